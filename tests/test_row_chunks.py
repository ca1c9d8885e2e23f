"""The dense unfused SwiGLU MLP in row chunks (``ops.row_chunks``, peak memory): the same bytes as one chunk, for
row counts that are and are not multiples of 128, both block sizes, with and without ``wgrad_with_hp``; on the
reference backend here and on the H200's kernels (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from cute_mxfp8 import MXFP8Config, ops
from cute_mxfp8.ops import row_chunks as RC


def test_row_chunks_cover_the_rows_in_128_row_multiples():
    for m, cols in [(1, 8), (300, 4 * 2**20), (16384, 28672), (16384, 14336), (128, 2**40)]:
        chunks = RC.row_chunks(m, cols)
        assert chunks[0][0] == 0 and chunks[-1][1] == m
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert all(r0 % 128 == 0 and r1 > r0 for r0, r1 in chunks)
        assert all((r1 - r0) * cols * 4 <= RC.CHUNK_ACC_BYTES for r0, r1 in chunks) or chunks[0][1] <= 128
    assert len(RC.row_chunks(16384, 28672)) == 4 and len(RC.row_chunks(16384, 14336)) == 2


def _step(device, backend, cfg_kw, m, d, i, rng):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    x = torch.randn(m, d, generator=gen)
    ws = [torch.randn(i, d, generator=gen) / d ** 0.5, torch.randn(d, i, generator=gen) / i ** 0.5,
          torch.randn(i, d, generator=gen) / d ** 0.5]
    dy = torch.randn(m, d, generator=gen)
    leaves = [t.to(device).to(torch.bfloat16).requires_grad_() for t in (x, *ws)]
    cfg = MXFP8Config(backend=backend, fused_epilogues=False, **cfg_kw)
    y = ops.mxfp8_swiglu_mlp(*leaves, config=cfg)
    y.backward(dy.to(device).to(torch.bfloat16))
    return [y.detach()] + [t.grad for t in leaves]


def _chunked_equals_whole(monkeypatch, device, backend, cfg_kw, m, d, i, seed):
    monkeypatch.setattr(RC, "CHUNK_ACC_BYTES", 2**60)
    whole = _step(device, backend, cfg_kw, m, d, i, torch.Generator().manual_seed(seed))
    monkeypatch.setattr(RC, "CHUNK_ACC_BYTES", 128 * 4 * 2 * i)  # 128-row chunks: several, a partial last one
    assert len(RC.row_chunks(m, 2 * i)) > 1 and len(RC.row_chunks(m, i)) > 1
    calls = []
    real = RC.DualOutputs.put
    monkeypatch.setattr(RC.DualOutputs, "put", lambda self, *a: calls.append(a[:2]) or real(self, *a))
    chunked = _step(device, backend, cfg_kw, m, d, i, torch.Generator().manual_seed(seed))
    assert len(calls) == len(RC.row_chunks(m, 2 * i)) + len(RC.row_chunks(m, i))  # forward, backward chunks
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b), f"{(a != b).sum().item()} elements differ"


@pytest.mark.parametrize("m", [300, 512])
@pytest.mark.parametrize("cfg_kw", [{}, {"hopper_block_k": 128}, {"hopper_block_k": 128, "wgrad_with_hp": True},
                                    {"hopper_block_k": 128, "hopper_weight_blocks": "128x128"}], ids=str)
def test_chunked_mlp_gives_the_same_bytes_on_the_reference(monkeypatch, cfg_kw, m):
    _chunked_equals_whole(monkeypatch, "cpu", "reference", cfg_kw, m, 128, 256, 7)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs an SM90 GPU (run on the H200 with -m gpu)")
@pytest.mark.parametrize("cfg_kw", [{}, {"hopper_block_k": 128}, {"hopper_block_k": 128, "wgrad_with_hp": True},
                                    {"hopper_block_k": 128, "hopper_weight_blocks": "128x128"}], ids=str)
def test_chunked_mlp_gives_the_same_bytes_on_sm90(monkeypatch, cfg_kw):
    _chunked_equals_whole(monkeypatch, "cuda", "sm90", cfg_kw, 1000, 256, 512, 11)

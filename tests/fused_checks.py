"""Helpers the fused-epilogue tests share (``test_gemm_checks``: the SM100 epilogue code through its H200 check
kernel; ``test_gemm_sm90`` / ``test_gemm_sm100``: the GEMMs' fused epilogues).  Not a test module."""

from __future__ import annotations

import torch

from cute_mxfp8 import formats as F
from cute_mxfp8 import ops
from cute_mxfp8.swiglu import GATE_UP_TILE, pack_gate_up, split_gate_up


def concat_gate_up(t: torch.Tensor, dim: int, tile: int = GATE_UP_TILE) -> torch.Tensor:
    """Interleaved gate/up layout (runs of ``tile``) -> concatenated, along ``dim``."""
    return pack_gate_up(*split_gate_up(t, dim=dim, tile=tile), dim=dim)


def assert_dh13_equal(data: tuple, plain_scales: tuple, ref: tuple, emit_hp: bool) -> None:
    """A fused dSwiGLU epilogue's outputs (dh13 interleaved: ``data = (q, qt, hp)``, ``plain_scales = (qs, qts)``
    in the plain layouts) equal the standalone dSwiGLU kernel's (gate | up concatenated, ``blocked=False``) bit for
    bit; scales move in runs of 2 columns (rowwise) / 64 rows (colwise)."""
    (q, qt, hp), (qs, qts), (rq, rqs, rqt, rqts, rhp) = data, plain_scales, ref
    assert torch.equal(concat_gate_up(qs.view(torch.uint8), -1, GATE_UP_TILE // 32), rqs.view(torch.uint8))
    assert torch.equal(concat_gate_up(qts.view(torch.uint8), 0), rqts.view(torch.uint8))
    assert torch.equal(concat_gate_up(q.view(torch.uint8), -1), rq.view(torch.uint8))
    assert torch.equal(concat_gate_up(qt.view(torch.uint8), 0), rqt.view(torch.uint8))
    if emit_hp:
        torch.testing.assert_close(concat_gate_up(hp, -1), rhp, rtol=0, atol=0, equal_nan=True)


def grouped_fused_check(backend: str, sizes: list, elem: torch.dtype, scale_mode: str, emit_hp: bool, rng) -> None:
    """2d-3d GEMM1 / GEMM3 with the fused epilogues on ``backend`` vs that backend's grouped GEMM (its own fp32
    accumulator) through the standalone grouped SwiGLU / dSwiGLU casts: bytes and scales bit-exact, grouped
    layouts (colwise blocks never crossing a group end), rows past offs[-1] (40 of them) zero."""
    d, i, e = 160, 128, len(sizes)
    t = sum(sizes) + 40
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    x, x_s = ops.quantize_rowwise(torch.randn(t, d, generator=rng).cuda(), offs=offs)
    w13, w13_s, _, _ = ops.quantize_gate_up(torch.randn(e, i, d, generator=rng).cuda() / 4,
                                            torch.randn(e, i, d, generator=rng).cuda() / 4, gate_up_tile=64)
    h13, q, qs, qt, qts, hp = ops.mm_swiglu_quant(x, x_s, w13, w13_s, gate_up_tile=GATE_UP_TILE,
                                                  scale_mode=scale_mode, elem_dtype=elem, emit_hp=emit_hp,
                                                  out_dtype=torch.float32, offs=offs, backend=backend)
    assert torch.equal(h13, ops.grouped_mm(x, x_s, w13, w13_s, offs, out_dtype=torch.float32, backend=backend))
    assert torch.all(h13[sum(sizes):] == 0) and torch.all(q[sum(sizes):].view(torch.uint8) == 0)
    ref = ops.swiglu_quant(concat_gate_up(h13, -1), scale_mode=scale_mode, elem_dtype=elem, emit_hp=emit_hp,
                           offs=offs, backend=backend)
    for got, want in zip((q, qs, qt, qts), ref[:4]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if emit_hp:
        torch.testing.assert_close(hp, ref[4], rtol=0, atol=0, equal_nan=True)
    dy, dy_s = ops.quantize_rowwise(torch.randn(t, d, generator=rng).cuda(), offs=offs)
    w2c, w2c_s = ops.quantize_rowwise(torch.randn(e, i, d, generator=rng).cuda() / 4)
    h13b = (torch.randn(t, 2 * i, generator=rng) * 3).to(torch.bfloat16).cuda()
    dq, dqs, dqt, dqts, dhp = ops.mm_dswiglu_quant(dy, dy_s, w2c, w2c_s, h13b, gate_up_tile=GATE_UP_TILE,
                                                   scale_mode=scale_mode, elem_dtype=elem, emit_hp=emit_hp,
                                                   offs=offs, backend=backend)
    dh = ops.grouped_mm(dy, dy_s, w2c, w2c_s, offs, out_dtype=torch.float32, backend=backend)
    rq, rqs, rqt, rqts, rhp = ops.dswiglu_quant(dh, concat_gate_up(h13b, -1).float(), scale_mode=scale_mode,
                                                elem_dtype=elem, blocked=False, emit_hp=emit_hp, offs=offs,
                                                backend=backend)
    plain = (F.from_blocked_scales_grouped_m(dqs, offs, t, 2 * i // 32),
             F.from_blocked_scales_grouped_k(dqts, offs, 2 * i, 4 * F.grouped_scale_tiles(t, e)))
    assert_dh13_equal((dq, dqt, dhp), plain, (rq, rqs, rqt, rqts, rhp), emit_hp)

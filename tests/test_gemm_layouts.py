"""The SM100 GEMM's view of the blocked E8M0 scales (``kernels/blockscaled.py``), evaluated element by element on
the CPU (static shapes are evaluated while the DSL traces, no GPU needed) against ``formats.to_blocked_scales``:
every element's scale byte is the one the cast kernels and the reference wrote for its 32-element block."""

from __future__ import annotations

import pytest
import torch

from cute_mxfp8 import formats as F

cute = pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is a dependency; install the package")


def _offsets(mn: int, k: int, batches: int, coords) -> list[int]:
    """Byte offsets the GEMM's scale layout gives the element coordinates ``coords`` = [(mn, k, l), ...]."""
    from cute_mxfp8.kernels.blockscaled import scale_layout

    out = []

    @cute.jit
    def probe():
        layout = scale_layout(mn, k, batches)
        out.extend(int(cute.crd2idx(c, layout)) for c in coords)

    cute.compile(probe)
    return out


@pytest.mark.parametrize("mn,k,batches", [(128, 128, 1), (300, 96, 1), (33, 32, 2), (256, 7168, 3)])
def test_scale_layout_equals_to_blocked_scales(mn, k, batches, rng):
    plain = torch.randint(0, 255, (batches, mn, k // 32), generator=rng, dtype=torch.uint8)
    blocked = F.to_blocked_scales(plain.view(torch.float8_e8m0fnu)).view(torch.uint8).reshape(-1)
    # every block at both of its ends (the layout has stride 0 inside a block); a sample of the big shape
    blocks = [(m, b, l) for l in range(batches) for m in range(mn) for b in range(k // 32)]
    if len(blocks) > 4000:
        pick = torch.randperm(len(blocks), generator=rng)[:4000].tolist()
        blocks = [blocks[i] for i in pick]
    coords = [(m, 32 * b + j, l) for m, b, l in blocks for j in (0, 31)]
    got = blocked[torch.tensor(_offsets(mn, k, batches, coords))]
    want = torch.stack([plain[l, m, b] for m, b, l in blocks]).repeat_interleave(2)
    assert torch.equal(got, want)
    per_batch = F.blocked_scales_numel(mn, k // 32)
    assert max(_offsets(mn, k, batches, [(mn - 1, k - 1, batches - 1)])) < batches * per_batch


@pytest.mark.parametrize("rows", [96, 300])
def test_wgrad_scale_tiles_read_the_grouped_k_layout(rows, rng):
    """The 2d-2d GEMM (``MXGemmSm100.call_wgrad``) reads a stage's scales as 512-byte tile ``chunk + kt`` of the
    buffer viewed as (128, 128, tiles) (``_wgrad_tile``: ``chunk = ceil(rows / 128) * tile_start + row_tile *
    k_tiles``).  Evaluated element by element against formats.to_blocked_scales_grouped_k of real groups."""
    offs = torch.tensor([0, 40, 300, 301, 700], dtype=torch.int32)
    t = 760
    x = torch.randn(t, rows, generator=rng)
    _, plain = F.quantize_mxfp8_grouped_k(x, offs)  # (4 * tiles, rows): block rows of the groups
    st = plain.t().contiguous()
    blocked = F.to_blocked_scales_grouped_k(st, offs).view(torch.uint8)
    tiles_total = blocked.numel() // 512
    coords, want = [], []
    prev = 0
    for o, t0 in zip(offs.tolist(), F.group_tile_starts(offs).tolist()):
        size = o - prev
        kt_n = -(-size // 128)
        for lmt in range(-(-rows // 128)):
            for kt in range(kt_n):
                chunk = -(-rows // 128) * t0 + lmt * kt_n + kt
                for r in (0, 5, 31, 32, 127):
                    row = lmt * 128 + r
                    for kk in (0, 31, 32, 127):
                        b = (kt * 128 + kk) // 32
                        if row < rows and kt * 128 + kk < -(-size // 32) * 32:
                            coords.append((r, kk, chunk))
                            want.append(int(st.view(torch.uint8)[row, 4 * t0 + b]))
        prev = o
    got = blocked[torch.tensor(_offsets(128, 128, tiles_total, coords))]
    assert got.tolist() == want

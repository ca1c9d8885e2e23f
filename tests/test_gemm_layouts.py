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

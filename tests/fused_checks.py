"""Helpers the fused-epilogue tests share (``test_gemm_checks``: the SM100 epilogue code through its H200 check
kernel; ``test_gemm_sm90``: the SM90 GEMM's fused epilogues).  Not a test module."""

from __future__ import annotations

import torch

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

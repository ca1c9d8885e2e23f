"""Row chunks of the unfused dense SwiGLU MLP (peak memory).

Unfused, GEMM1 writes h13 as an fp32 (M, 2I) accumulator and the w2 dgrad dh as fp32 (M, I), and the SwiGLU casts
read them: at M=16384, I=14336 the GEMM1 accumulator alone is 1.9 GB, more than the rest of the step's tensors.
Run over chunks of rows instead (a multiple of 128 rows each, :data:`CHUNK_ACC_BYTES` of accumulator), each chunk's
GEMM, cast and high-precision copy in turn, with the dual-quantized outputs written into full-size tensors
(:class:`DualOutputs`).  The bytes equal the unchunked ops' exactly: the GEMM and the rowwise casts treat rows
independently, a colwise block (32 or 128 rows) never crosses a 128-row chunk boundary, and the blocked scale
layouts tile rows (rowwise) and scale columns (colwise) in 128s, so a chunk's blocked scales are whole tiles of
the full buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import BLOCK_SIZE
from .shapes import ceil_div, colwise_shapes, rowwise_shapes

# fp32 accumulator bytes per chunk (rounded down to whole 128-row tiles, at least one): small enough that the
# chunk's accumulator is a fraction of the MLP's other tensors at the sizes where memory matters, large enough
# that each chunk's GEMM still fills the GPU (at M=16384, 2I=28672: 4 chunks of up to 4608 rows)
CHUNK_ACC_BYTES = 512 * 2**20
_TILE = 128


def row_chunks(m: int, acc_cols: int) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` covering ``m`` rows, each start a multiple of 128 and each chunk's fp32
    accumulator (``acc_cols`` wide) at most :data:`CHUNK_ACC_BYTES` (one chunk of 128 rows at least)."""
    rows = max(_TILE, CHUNK_ACC_BYTES // (4 * max(acc_cols, 1)) // _TILE * _TILE)
    return [(r0, min(m, r0 + rows)) for r0 in range(0, max(m, 1), rows)]


def blocked_rows(scales: Tensor, r0: int, r1: int, k: int) -> Tensor:
    """Rows ``[r0, r1)`` (``r0 % 128 == 0``) of a 1-D blocked rowwise scale buffer of a width-``k`` operand: its
    128-row tiles, a contiguous slice (what the GEMM ops take for the rows ``[r0, r1)`` of the data)."""
    per_tile = _TILE * ceil_div(k // BLOCK_SIZE, 4) * 4
    return scales[r0 // _TILE * per_tile:ceil_div(r1, _TILE) * per_tile]


class DualOutputs:
    """The full-size outputs of a dual cast with blocked scales (``api.swiglu_quant`` / ``dswiglu_quant``'s
    ``(q, q_scales, qt, qt_scales, hp)``) of an (M, N) result, filled chunk by chunk with :meth:`put`."""

    def __init__(self, m: int, n: int, elem_dtype: torch.dtype, device, hp_dtype: torch.dtype, emit_hp: bool):
        (rd, rs), (cd, cs) = rowwise_shapes((m, n), True, None), colwise_shapes((m, n), True, None)
        u8 = dict(dtype=torch.uint8, device=device)
        self.q, self.qs, self.qt, self.qts = (torch.empty(s, **u8) for s in (rd, rs, cd, cs))
        self.col_tiles = (ceil_div(n, _TILE), ceil_div(cd[1], _TILE))  # the colwise scales' 128 x 4 tiles
        self.hp = torch.empty((m, n) if emit_hp else (0,), dtype=hp_dtype, device=device)
        self.elem_dtype, self.emit_hp, self.n = elem_dtype, emit_hp, n

    def put(self, r0: int, r1: int, q: Tensor, qs: Tensor, qt: Tensor, qts: Tensor, hp: Tensor) -> None:
        """One chunk's outputs (rows ``[r0, r1)``, ``r0 % 128 == 0``) into their places."""
        u8 = torch.uint8
        self.q[r0:r1].copy_(q.view(u8))
        start = r0 // _TILE * _TILE * ceil_div(self.n // BLOCK_SIZE, 4) * 4
        self.qs[start:start + qs.numel()].copy_(qs.view(u8))
        self.qt[:, r0:r0 + qt.shape[1]].copy_(qt.view(u8))
        c0 = r0 // _TILE
        self.qts.view(*self.col_tiles, -1)[:, c0:c0 + ceil_div(qt.shape[1], _TILE)].copy_(
            qts.view(u8).view(self.col_tiles[0], -1, _TILE * 4))
        if self.emit_hp:
            self.hp[r0:r1].copy_(hp)

    def result(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        e8m0 = torch.float8_e8m0fnu
        return (self.q.view(self.elem_dtype), self.qs.view(e8m0), self.qt.view(self.elem_dtype), self.qts.view(e8m0),
                self.hp)

"""Packing the casts of w1 (gate) and w3 (up) into W13's: the reference backend's ``quantize_gate_up``, which casts
each projection on its own (no high-precision W13 is ever made), and the kernel backends' for a W13 past their 32-bit
indexing.  Otherwise the kernel backends cast W13 once (with 128-blocks straight from w1 and w3, else a packed
copy); the paragraph below is why both give the same bytes.

Rowwise blocks run along D and colwise blocks along I (I % 32 == 0), so no block straddles w1 and w3, and the
interleaved layout (runs of ``tile`` features, a multiple of 32) moves whole blocks: the packed casts are exactly
the casts of the packed W13 (:mod:`cute_mxfp8.swiglu`).
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..swiglu import pack_gate_up

_U8 = torch.uint8
# ``quantize_gate_up(..., direction=)``: which of the four outputs (row, row_scales, col, col_scales) it returns
GATE_UP_DIRECTIONS = {"dual": slice(0, 4), "rowwise": slice(0, 2), "colwise": slice(2, 4)}


def pack_gate_up_casts(w1_casts, w3_casts, blocked: bool, tile: int | None):
    """``(row, row_scales, col, col_scales)`` of w1 and of w3 -> W13's (a pair may be ``None, None`` in both: it
    stays None).  Inputs: rowwise data (..., I, D) with plain scales (..., I, D/32); colwise data stored transposed
    (..., D, I) with plain scales (..., D, I/32).  Output: (..., 2I, D) / (..., D, 2I) data, scales blocked
    (``formats.to_blocked_scales``) when ``blocked``."""
    stile = tile and tile // F.BLOCK_SIZE

    def pack(a, b, dim, t):  # bytewise: torch.cat of fp8 tensors fails under torch.autocast
        return None if a is None else pack_gate_up(a.view(_U8), b.view(_U8), dim=dim, tile=t).contiguous().view(
            a.dtype)

    (r1, rs1, c1, cs1), (r3, rs3, c3, cs3) = w1_casts, w3_casts
    row, row_s = pack(r1, r3, -2, tile), pack(rs1, rs3, -2, tile)
    col, col_s = pack(c1, c3, -1, tile), pack(cs1, cs3, -1, stile)
    if blocked:
        row_s, col_s = (None if t is None else F.to_blocked_scales(t) for t in (row_s, col_s))
    return row, row_s, col, col_s

"""Packing the casts of w1 (gate) and w3 (up) into W13's: what every backend's ``quantize_gate_up`` does after
casting each projection on its own (no high-precision W13 is ever made).

Rowwise blocks run along D and colwise blocks along I (I % 32 == 0), so no block straddles w1 and w3, and the
interleaved layout (runs of ``tile`` features, a multiple of 32) moves whole blocks: the packed casts are exactly
the casts of the packed W13 (:mod:`cute_mxfp8.swiglu`).
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..swiglu import pack_gate_up

_U8 = torch.uint8


def pack_gate_up_casts(w1_casts, w3_casts, blocked: bool, tile: int | None):
    """``(row, row_scales, col, col_scales)`` of w1 and of w3 -> W13's.  Inputs: rowwise data (..., I, D) with plain
    scales (..., I, D/32); colwise data stored transposed (..., D, I) with plain scales (..., D, I/32).  Output:
    (..., 2I, D) / (..., D, 2I) data, scales blocked (``formats.to_blocked_scales``) when ``blocked``."""
    (r1, rs1, c1, cs1), (r3, rs3, c3, cs3) = w1_casts, w3_casts
    stile = tile and tile // F.BLOCK_SIZE
    row = pack_gate_up(r1, r3, dim=-2, tile=tile)
    row_s = pack_gate_up(rs1.view(_U8), rs3.view(_U8), dim=-2, tile=tile).view(torch.float8_e8m0fnu)
    col = pack_gate_up(c1, c3, dim=-1, tile=tile).contiguous()
    col_s = pack_gate_up(cs1.view(_U8), cs3.view(_U8), dim=-1, tile=stile).contiguous().view(torch.float8_e8m0fnu)
    if blocked:
        row_s, col_s = F.to_blocked_scales(row_s), F.to_blocked_scales(col_s)
    return row, row_s, col, col_s

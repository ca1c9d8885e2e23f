"""The ``reference`` backend: every op in plain torch on top of :mod:`cute_mxfp8.formats`.

Runs on any device.  GEMMs dequantize both operands to fp32 and multiply in fp32, which is what a block-scaled
MMA with an fp32 accumulator computes up to summation order.  Shapes, dtypes and layouts are exactly those of
:mod:`cute_mxfp8.ops.shapes`; inputs arrive already checked by :mod:`cute_mxfp8.ops.library`.
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..swiglu import GATE_UP_TILE, dswiglu, pack_gate_up, split_gate_up, swiglu
from .backends import Backend, register_backend
from .gate_up import GATE_UP_DIRECTIONS, pack_gate_up_casts
from .shapes import ceil_div

_B = F.BLOCK_SIZE


# ---- quantize -------------------------------------------------------------------------------------------

def _block(scales: torch.Tensor, blocked: bool) -> torch.Tensor:
    return F.to_blocked_scales(scales) if blocked else scales


def quantize_rowwise(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, blocks_2d=False):
    if offs is not None:  # checked even where plain scales do not depend on the groups
        F.validate_offsets(offs, x.shape[0])
    data, scales = F.quantize_mxfp8(x, dim=-1, scale_mode=scale_mode, elem_dtype=elem_dtype, scale_block=scale_block,
                                    blocks_2d=blocks_2d)
    if blocked and offs is not None:
        return data, F.to_blocked_scales_grouped_m(scales, offs)
    return data, _block(scales, blocked)


def quantize_colwise(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, token_align=0, blocks_2d=False):
    kw = {"scale_mode": scale_mode, "elem_dtype": elem_dtype, "scale_block": scale_block}
    if blocks_2d:  # weights (no groups): the 128 x 128 tiles of the last two dims (a 2-D x's Mp rows padded)
        kw["blocks_2d"] = True
    if token_align:  # the cast of the groups padded with zero tokens (the op's definition)
        x, offs = F.pad_token_groups(x, offs, token_align)
    if x.dim() == 3:
        data, scales = F.quantize_mxfp8(x, dim=1, **kw)
        return data.transpose(1, 2).contiguous(), _block(scales.transpose(1, 2).contiguous(), blocked)
    m, k = x.shape
    if offs is None:
        mp = ceil_div(m, _B) * _B
        xp = x if mp == m else torch.cat([x, x.new_zeros(mp - m, k)])
        data, scales = F.quantize_mxfp8(xp, dim=0, **kw)
    else:
        F.validate_offsets(offs, m)
        data, scales = F.quantize_mxfp8_grouped_k(x, offs, **kw)
    if blocked and offs is not None:
        return data.t().contiguous(), F.to_blocked_scales_grouped_k(scales.t().contiguous(), offs)
    return data.t().contiguous(), _block(scales.t().contiguous(), blocked)


def quantize_dual(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, token_align=0, blocks_2d=False):
    return (*quantize_rowwise(x, scale_mode, elem_dtype, blocked, offs, scale_block, blocks_2d),
            *quantize_colwise(x, scale_mode, elem_dtype, blocked, offs, scale_block, token_align, blocks_2d))


def quantize_gate_up(w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile=0, scale_block=32, blocks_2d=False,
                     direction="dual"):
    """Each projection cast on its own, then packed: with scale_block=128 the op requires I % 128 == 0 and a
    gate_up_tile of 0 or a multiple of 128, so W13's 128-blocks along 2I are those of one projection.
    ``direction``: the four outputs, or the rowwise or colwise pair of them."""
    def casts(w):  # only the pairs ``direction`` asks for (None for the other)
        kw = {"scale_mode": scale_mode, "elem_dtype": elem_dtype, "scale_block": scale_block, "blocks_2d": blocks_2d}
        r = rs = c = cs = None
        if direction != "colwise":
            r, rs = F.quantize_mxfp8(w, dim=-1, **kw)
        if direction != "rowwise":
            c, cs = (t.transpose(-1, -2) for t in F.quantize_mxfp8(w, dim=-2, **kw))
        return r, rs, c, cs

    packed = pack_gate_up_casts(casts(w1), casts(w3), blocked, gate_up_tile or None)
    return packed[GATE_UP_DIRECTIONS[direction]]


# ---- GEMMs ----------------------------------------------------------------------------------------------

def _deq_rowwise(data: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    r, k = data.shape
    return F.dequantize_mxfp8(data, F.from_blocked_scales(blocked, r, k // _B))


def _check_runs(name: str, plain: torch.Tensor) -> None:
    """``scale_block=128``'s promise on a GEMM operand: its plain (rows, blocks) scales, the blocks along K from
    the start of K (or of a token group), are equal in every run of 4."""
    s = plain.view(torch.uint8)
    first = s[:, (torch.arange(s.shape[1], device=s.device) // 4) * 4]
    if not torch.equal(s, first):
        raise ValueError(f"{name}'s scales are not equal in runs of 4 along K, as scale_block=128 states (the sm90 "
                         f"kernel would read only the first of each run): quantize it with scale_block=128, or pass "
                         f"scale_block=32")


def _check_shared_runs(name: str, data: torch.Tensor, blocked: torch.Tensor, blocks_2d: bool = False) -> None:
    plain = F.from_blocked_scales(blocked, data.shape[0], data.shape[1] // _B)
    _check_runs(name, plain)
    if blocks_2d:  # b_blocks_2d's promise: also equal along each 128 rows (the kernel reads the first row's)
        s = plain.view(torch.uint8)
        if not torch.equal(s, s[(torch.arange(s.shape[0], device=s.device) // 128) * 128]):
            raise ValueError(f"{name}'s scales are not equal along each 128 rows, as b_blocks_2d=True states (the "
                             f"sm90 kernel would read only the first row's): quantize it with blocks_2d=True, or "
                             f"pass b_blocks_2d=False (in the autograd functions: hopper_weight_blocks='128x128' "
                             f"needs weight_operands cast with blocks_2d=True)")


def mm(a, a_scales, b, b_scales, out_dtype, bias=None, scale_block=32, b_blocks_2d=False):
    """The exact product of any MXFP8 operands; with ``scale_block=128`` the operands' promise (scales equal in
    runs of 4 along K; with ``b_blocks_2d`` b's also along 128 rows) is checked first, so code that breaks it fails
    here rather than only on SM90."""
    if scale_block == 128:
        _check_shared_runs("a", a, a_scales)
        _check_shared_runs("b", b, b_scales, b_blocks_2d)
    acc = _deq_rowwise(a, a_scales) @ _deq_rowwise(b, b_scales).t()
    if bias is not None:  # added to the fp32 accumulator: one rounding to out_dtype, as cuBLAS's bias epilogue
        acc = acc + bias.float()
    return acc.to(out_dtype)


def grouped_mm(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, b_blocks_2d=False):
    m, k = a.shape
    end = F.validate_offsets(offs, m)
    a_plain = F.from_blocked_scales_grouped_m(a_scales, offs, m, k // _B)
    if scale_block == 128:  # the promise, on the rows in groups and on every expert
        _check_runs("a", a_plain[:end])
        for g in range(b.shape[0]):
            _check_shared_runs("b", b[g], b_scales[g], b_blocks_2d)
    out = torch.zeros(m, b.shape[1], dtype=torch.float32, device=a.device)
    for g, (s, e) in enumerate(F.group_bounds(offs)):
        if e > s:
            a_g = F.dequantize_mxfp8(a[s:e], a_plain[s:e])
            out[s:e] = a_g @ _deq_rowwise(b[g], b_scales[g]).t()
    return out.to(out_dtype)


def grouped_mm_wgrad(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, split_halves=False):
    (n, m), k = a.shape, b.shape[0]
    F.validate_offsets(offs, m)
    cols = 4 * F.grouped_scale_tiles(m, offs.numel())
    a_plain = F.from_blocked_scales_grouped_k(a_scales, offs, n, cols)
    b_plain = F.from_blocked_scales_grouped_k(b_scales, offs, k, cols)
    bounds = F.group_bounds(offs)
    if scale_block == 128:  # the promise: runs of 4 from each group's first block (its first tile's column)
        for (s, e), t in zip(bounds, F.group_tile_starts(offs).tolist()):
            for name, plain in (("a", a_plain), ("b", b_plain)):
                _check_runs(name, plain[:, 4 * t:4 * t + (e - s + _B - 1) // _B])
    a_deq = F.dequantize_mxfp8_grouped_k(a.t(), a_plain.t(), offs)
    b_deq = F.dequantize_mxfp8_grouped_k(b.t(), b_plain.t(), offs)
    out = torch.zeros(offs.numel(), n, k, dtype=torch.float32, device=a.device)
    for g, (s, e) in enumerate(bounds):
        if e > s:
            out[g] = a_deq[s:e].t() @ b_deq[s:e]
    if split_halves:  # (2, G, N / 2, K): every group's first N / 2 rows, then the others
        out = out.view(out.shape[0], 2, n // 2, k).transpose(0, 1)
    return out.to(out_dtype)


# ---- SwiGLU + dual quantization -------------------------------------------------------------------------

def _hp_out(t: torch.Tensor, dtype: torch.dtype, emit_hp: bool) -> torch.Tensor:
    return t.to(dtype) if emit_hp else t.new_empty(0, dtype=dtype)


def swiglu_quant(h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
    g, u = split_gate_up(h13)
    h = swiglu(g, u)  # fp32, never rounded to bf16 before quantization
    if offs is not None:
        h = _zero_rows_past_end(h, offs)
    return (*quantize_dual(h, scale_mode, elem_dtype, blocked, offs, scale_block, token_align),
            _hp_out(h, h13.dtype, emit_hp))


def dswiglu_quant(dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
    g, u = split_gate_up(h13)
    dg, du = dswiglu(dh, g, u)
    dh13 = pack_gate_up(dg, du)
    if offs is not None:
        dh13 = _zero_rows_past_end(dh13, offs)
    return (*quantize_dual(dh13, scale_mode, elem_dtype, blocked, offs, scale_block, token_align),
            _hp_out(dh13, dh.dtype, emit_hp))


# ---- GEMM + fused SwiGLU epilogues (what the SM100 GEMM's epilogues compute) ----------------------------------

def _gemm_f32(a, a_scales, b, b_scales, offs):
    if offs is None:
        return mm(a, a_scales, b, b_scales, torch.float32)
    return grouped_mm(a, a_scales, b, b_scales, offs, torch.float32)  # rows at or past offs[-1] are zero


def mm_swiglu_quant(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, offs=None):
    acc = _gemm_f32(a, a_scales, b13, b13_scales, offs)  # (M, 2I), gate/up interleaved like b13
    g, u = split_gate_up(acc, tile=GATE_UP_TILE)
    h = swiglu(g, u)  # from the fp32 accumulator, as the epilogue does
    return (acc.to(out_dtype), *quantize_dual(h, scale_mode, elem_dtype, True, offs),
            _hp_out(h, torch.float32, emit_hp))


def mm_dswiglu_quant(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, offs=None):
    dh = _gemm_f32(a, a_scales, b, b_scales, offs)  # (M, I)
    dg, du = dswiglu(dh, *split_gate_up(h13, tile=GATE_UP_TILE))
    dh13 = pack_gate_up(dg, du, tile=GATE_UP_TILE)
    if offs is not None:  # h13 rows past offs[-1] (NaN / Inf there included) reach no output
        dh13 = _zero_rows_past_end(dh13, offs)
    return (*quantize_dual(dh13, scale_mode, elem_dtype, True, offs), _hp_out(dh13, torch.float32, emit_hp))


def _zero_rows_past_end(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    end = int(offs[-1]) if offs.numel() else 0
    if end < t.shape[0]:
        t = t.clone()
        t[end:] = 0
    return t


register_backend(Backend(
    name="reference",
    priority=0,
    unavailable_reason=lambda device: None,
    ops={
        "quantize_rowwise": quantize_rowwise,
        "quantize_colwise": quantize_colwise,
        "quantize_dual": quantize_dual,
        "quantize_gate_up": quantize_gate_up,
        "mm": mm,
        "grouped_mm": grouped_mm,
        "grouped_mm_wgrad": grouped_mm_wgrad,
        "swiglu_quant": swiglu_quant,
        "dswiglu_quant": dswiglu_quant,
        "mm_swiglu_quant": mm_swiglu_quant,
        "mm_dswiglu_quant": mm_dswiglu_quant,
    },
))

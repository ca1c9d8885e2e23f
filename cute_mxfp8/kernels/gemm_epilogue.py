"""The fused GEMM epilogues' math on one thread's fragment: SwiGLU or dSwiGLU, then dual MXFP8 quantization.

An SM100 epilogue warp reads its accumulator sub-tile with ``tcgen05.ld`` (32 data paths x 32 bits, 32 columns):
thread ``lane`` of warp ``w`` holds row ``32 w + lane`` of the tile, 32 consecutive columns, in fp32.  So one
thread holds a whole rowwise MX block (no shuffles) and the 32 lanes of a warp hold a whole colwise block of each
of the 32 columns (:func:`~.mx_math.reduce_scatter_max` over the lanes).  The functions here take such a fragment
(a 32-element fp32 ``TensorSSA``) with its coordinates and write every output of the block; they do not care how
the fragment got into registers, so :class:`.gemm_checks.EpilogueCheckKernel` runs the very same code on any GPU
from a global fp32 "accumulator" (the H200 check of the SM100 epilogue, ``docs/sm100_gemm.md``).

The SwiGLU and cast math are :mod:`.mx_math`'s device functions, the ones the standalone fused kernels use.

Gate/up layout: the interleaved one of :mod:`cute_mxfp8.swiglu` with runs of ``GATE_UP_TILE`` = 64 features:
h column ``c`` has its gate at h13 column ``128 (c // 64) + c % 64`` and its up 64 columns later.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .mx_math import (BLOCK, MXCastParams, block_scale, blocked_scale_offset, grouped_k_scale_offset,
                      quantize_block, reduce_scatter_max, swiglu_bwd, swiglu_fwd)

GATE_UP_TILE = 64  # equals cute_mxfp8.swiglu.GATE_UP_TILE (a test checks)
MODES = ("swiglu", "dswiglu")
EPILOGUES = ("plain", *MODES)  # a GEMM's epilogue: D only, or one of the fused modes


TRANSPOSE_BYTES = BLOCK * BLOCK  # per epilogue warp: one fp8 colwise block, transposed through shared memory


def transpose_tiles(smem, elem_dtype, warps: int) -> cute.Tensor:
    """Allocate the epilogue warps' (32, 32, warps) fp8 transpose tiles from ``smem`` (a ``SmemAllocator``)."""
    return smem.allocate_tensor(elem_dtype, cute.make_layout((BLOCK, BLOCK, warps), stride=(BLOCK, 1, BLOCK * BLOCK)),
                                byte_alignment=16)


def gate_column(c):
    """h13 column of the gate of h column ``c`` (its up is ``GATE_UP_TILE`` columns later)."""
    return (c // GATE_UP_TILE) * (2 * GATE_UP_TILE) + c % GATE_UP_TILE


@cute.jit
def _row_slice(t: cute.Tensor, m, c0):
    """The 32 elements ``t[m, c0:c0 + 32]`` of a row-major 2-D tensor (c0 a multiple of 32)."""
    return cute.zipped_divide(t, (1, BLOCK))[(0, None), (m, c0 // BLOCK)]


@cute.jit
def load_row_block(t: cute.Tensor, m, c0, valid):
    """The 32 values ``t[m, c0:c0 + 32]`` in fp32 (one 16- or 8-byte vector load per 4 or 8 elements), or zeros
    where ``valid`` is false (rows past M read as the zeros a TMA tile would hold)."""
    frag = cute.make_rmem_tensor((BLOCK,), cutlass.Float32)
    frag.fill(0.0)
    if valid:
        frag.store(_row_slice(t, m, c0).load().to(cutlass.Float32))
    return frag.load()


@cute.jit
def dual_quantize_block(v: cute.TensorSSA, out: tuple, tr: cute.Tensor, m, c0, lane, valid, rows, cols,
                        cast: MXCastParams, emit_hp: cutlass.Constexpr[bool], grp=None):
    """Rowwise and colwise MXFP8 quantization of one 32 x 32 block held by a warp, row ``m`` in this thread.

    ``v``: this thread's 32 fp32 values, columns ``[c0, c0 + 32)`` of row ``m``; lane ``l`` of the warp holds row
    ``m - lane + l``, and ``m - lane`` is a multiple of 32.  ``valid``: the block lies inside the ``cols``
    columns (warp-uniform; an invalid block writes nothing).  Rows ``>= rows`` must hold zeros (they pad the last
    colwise block, as the reference's zero padding does) and get no rowwise output.

    ``out = (q, qs, qt, qts, hp)``: ``q`` (rows, cols) fp8 rowwise data, ``qs`` its 1-D blocked scales
    ((rows, cols / 32) blocked), ``qt`` (cols, rows_p) fp8 colwise data stored transposed (rows_p = rows rounded
    up to 32; pad rows get the zeros they quantize to), ``qts`` its 1-D blocked scales ((cols, rows_p / 32)
    blocked), ``hp`` (rows, cols) the values themselves in its dtype when ``emit_hp``.  Scale pads outside the
    written blocks must be zero-filled by the caller.  ``tr``: this warp's (32, 32) fp8 shared-memory tile, where
    the colwise block is transposed so each lane stores one 32-byte row of ``qt``.

    ``grp`` (token groups, 2d-3d GEMM epilogues): ``(start, scale_row0)`` of the block's group: its first row and
    its first row in the grouped-M blocked rowwise scales (``128 * group_tile_starts[g]``); ``rows`` is then the
    group's end and ``m - lane - start`` a multiple of 32.  ``qt`` is (cols, M) (no padding: the bytes past the
    group's end belong to the next group and are not written, byte stores), rowwise scales go to row
    ``scale_row0 + m - start``, colwise ones to the group's block ``(m - lane - start) / 32`` of the grouped-K
    layout (:func:`~.mx_math.grouped_k_scale_offset`)."""
    q, qs, qt, qts, hp = out
    rows_p = (rows + BLOCK - 1) // BLOCK * BLOCK
    row0 = m - lane
    # rowwise: the thread's 32 values are one block
    qv, byte = quantize_block(v, cast.emax, cast.rceil)
    if valid and m < rows:
        _row_slice(q, m, c0).store(qv.to(cast.elem_dtype))
        if cutlass.const_expr(grp is None):
            qs[blocked_scale_offset(m, c0 // BLOCK, cols // BLOCK)] = cutlass.Uint8(byte)
        else:
            qs[blocked_scale_offset(grp[1] + m - grp[0], c0 // BLOCK, cols // BLOCK)] = cutlass.Uint8(byte)
        if cutlass.const_expr(emit_hp):
            _row_slice(hp, m, c0).store(v.to(hp.element_type))
    # colwise: column c0 + j's block is element j of the 32 lanes; lane j ends up with its amax
    mag = cute.make_rmem_tensor((BLOCK,), cutlass.Int32)
    mag.store(v.bitcast(cutlass.Int32) & 0x7FFFFFFF)
    reduce_scatter_max(mag, BLOCK, 0, lane)
    cbyte, cfactor = block_scale(mag[0], cast.emax, cast.rceil)
    if valid and row0 < rows:
        if cutlass.const_expr(grp is None):
            qts[blocked_scale_offset(c0 + lane, row0 // BLOCK, rows_p // BLOCK)] = cutlass.Uint8(cbyte)
        else:
            tiles = (rows - grp[0] + 127) // 128
            qts[grouped_k_scale_offset(c0 + lane, (row0 - grp[0]) // BLOCK, grp[1] // 128, tiles, cols)] = \
                cutlass.Uint8(cbyte)
    vals = cute.make_rmem_tensor((BLOCK,), cutlass.Float32)
    vals.store(v)
    for j in cutlass.range_constexpr(BLOCK):
        vals[j] = vals[j] * cute.arch.shuffle_sync(cfactor, offset=j)  # column j's factor, from lane j
    q8 = cute.make_rmem_tensor((BLOCK,), cast.elem_dtype)
    q8.store(vals.load().to(cast.elem_dtype))
    cute.arch.sync_warp()  # the previous block's reads of tr are done
    for j in cutlass.range_constexpr(BLOCK):
        tr[j, lane] = q8[j]
    cute.arch.sync_warp()
    if valid and row0 < rows:  # lane l: the 32 rows of column c0 + l (rows past M are zeros, the padding)
        if cutlass.const_expr(grp is None):
            _row_slice(qt, c0 + lane, row0).store(_row_slice(tr, lane, 0).load())
        else:  # the group's rows only, byte by byte (row0 need not be a multiple of 32 in qt)
            for j in cutlass.range_constexpr(BLOCK):
                if row0 + j < rows:
                    qt[c0 + lane, row0 + j] = tr[lane, j]


@cute.jit
def swiglu_block(g: cute.TensorSSA, u: cute.TensorSSA, out: tuple, tr: cute.Tensor, m, c0, lane, rows, cols,
                 cast: MXCastParams, emit_hp: cutlass.Constexpr[bool], grp=None):
    """GEMM1's epilogue for h columns ``[c0, c0 + 32)`` of row ``m``: ``h = silu(g) * u`` from the fp32 gate and
    up values, then :func:`dual_quantize_block` of h into ``out`` ((M, I) outputs; ``cols`` = I; ``grp`` as
    there)."""
    dual_quantize_block(swiglu_fwd(g, u), out, tr, m, c0, lane, c0 < cols, rows, cols, cast, emit_hp, grp)


@cute.jit
def dswiglu_block(dh: cute.TensorSSA, h13: cute.Tensor, out: tuple, tr: cute.Tensor, m, c0, lane, rows, cols,
                  cast: MXCastParams, emit_hp: cutlass.Constexpr[bool], grp=None):
    """GEMM3's epilogue for dh columns ``[c0, c0 + 32)`` of row ``m`` (``cols`` = I): read g and u from the saved
    ``h13`` (M, 2I) in the interleaved layout (zeros past ``rows``), ``(dg, du) = dswiglu(dh, g, u)``, and
    :func:`dual_quantize_block` of dg and du into the dh13 outputs ``out`` ((M, 2I), same layout as h13)."""
    pg = gate_column(c0)
    valid = c0 < cols
    g = load_row_block(h13, m, pg, valid and m < rows)
    u = load_row_block(h13, m, pg + GATE_UP_TILE, valid and m < rows)
    dg, du = swiglu_bwd(dh, g, u)
    dual_quantize_block(dg, out, tr, m, pg, lane, valid, rows, 2 * cols, cast, emit_hp, grp)
    dual_quantize_block(du, out, tr, m, pg + GATE_UP_TILE, lane, valid, rows, 2 * cols, cast, emit_hp, grp)

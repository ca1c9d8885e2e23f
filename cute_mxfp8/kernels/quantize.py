"""CuTe DSL kernels: rowwise (1x32) and colwise (32x1) MXFP8 quantization of a 2-D bf16/fp32 tensor, plain or
blocked scales.

Arch-generic (SM90 and SM100): plain vectorized global loads and stores, no TMA, no tensor cores.  The numerics
are those of ``cute_mxfp8.formats`` (``design.md`` section 1), computed with integer operations on fp32 bits so
they are exact and NaN-safe:

* ``amax_bits = max(bits(x) & 0x7FFFFFFF)`` over the block: for non-negative floats the integer order is the float
  order, and any NaN payload compares above +Inf, so a block with a NaN or an Inf has exponent field 255.
* With ``E`` the exponent field and ``Mt`` the mantissa field of ``amax_bits`` and ``emax`` = 8 (e4m3) / 15
  (e5m2), both element maxima being ``1.75 * 2**emax``:
  ``floor``: ``byte = E - emax``;  ``rceil``: ``byte = E - emax + (Mt > 0x600000)`` (the smallest power of two
  >= amax / max); both clamped below at 0 (so 0 when ``E == 0``: zero or subnormal amax), 255 when ``E == 255``.
  A finite block's byte is at most 247, so ``2**(127 - byte)`` is a normal fp32 number.
* Elements ``x * 2**(127 - byte)`` (one exact multiply), converted with ``cvt.rn.satfinite`` (round to nearest
  even, saturating to +-max, which is the clamp); a 255 block multiplies by NaN, so every element is NaN (0x7F).

:func:`quantize_block` is the per-block math as a device function, shared by every kernel that quantizes.
This module imports the DSL at module scope; the ops layer imports it lazily (through :mod:`cute_mxfp8.jit`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory

BLOCK = 32
THREADS = 256
_ELEM_DTYPES = {"e4m3": (cutlass.Float8E4M3FN, 8, 448.0), "e5m2": (cutlass.Float8E5M2, 15, 57344.0)}


def blocked_scale_offset(r, c, cols):
    """Byte offset of scale (r, c) of an (R, cols) scale matrix in the blocked tcgen05/cuBLAS layout."""
    return ((r // 128) * ((cols + 3) // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@cute.jit
def block_scale(amax_bits: cutlass.Int32, emax: cutlass.Constexpr[int], rceil: cutlass.Constexpr[bool]):
    """E8M0 scale of a block from ``amax_bits`` (the largest ``bits(x) & 0x7FFFFFFF`` of the block) ->
    (scale byte as Int32, fp32 factor ``2**(127 - byte)``, or NaN for byte 255).

    For a finite block the byte is at most 254 - emax + 1 (<= 247), so the factor is a normal fp32 number and one
    multiply scales an element exactly (up to results below 2**-126, which round to zero in fp8 either way)."""
    e = amax_bits >> 23
    byte = e - emax
    if cutlass.const_expr(rceil):
        byte = byte + cutlass.Int32((amax_bits & 0x7FFFFF) > 0x600000)
    byte = cutlass.max(byte, cutlass.Int32(0))  # zero / subnormal amax (e == 0) lands here too
    factor_bits = (254 - byte) << 23
    if e == 255:
        byte = cutlass.Int32(255)
        factor_bits = cutlass.Int32(0x7FC00000)  # NaN: every element of a poisoned block becomes NaN
    return byte, factor_bits.bitcast(cutlass.Float32)


@cute.jit
def apply_scale(xv: cute.TensorSSA, factor: cutlass.Float32):
    """Scaled fp32 elements of a block, ready for the fp8 conversion.  No clamp is needed: the conversion is
    ``cvt.rn.satfinite`` (round to nearest even, finite overflow saturates to +-max, NaN stays NaN)."""
    return xv * factor


@cute.jit
def abs_bits_max(xv: cute.TensorSSA, n: cutlass.Constexpr[int]):
    """``max(bits(x) & 0x7FFFFFFF)`` over the ``n`` fp32 elements of ``xv`` (integer order == float order for
    magnitudes; NaN payloads compare above +Inf)."""
    mag = xv.bitcast(cutlass.Int32) & 0x7FFFFFFF
    amax_bits = cutlass.Int32(0)
    for i in cutlass.range_constexpr(n):
        amax_bits = cutlass.max(amax_bits, cutlass.Int32(mag[i]))
    return amax_bits


@cute.jit
def quantize_block(xv: cute.TensorSSA, emax: cutlass.Constexpr[int], fmax: cutlass.Constexpr[float],
                   rceil: cutlass.Constexpr[bool]):
    """MXFP8-quantize one block: ``xv`` a 32-element fp32 TensorSSA -> (fp32 TensorSSA of the scaled, clamped
    elements (NaN for a poisoned block), E8M0 scale byte as Int32).  Device code, inlined where it is called; the
    rules are in this module's docstring."""
    byte, factor = block_scale(abs_bits_max(xv, BLOCK), emax, rceil)
    return apply_scale(xv, factor), byte


class _QuantKernelBase:
    def __init__(self, elem: str, scale_mode: str, blocked: bool):
        if elem not in _ELEM_DTYPES or scale_mode not in ("floor", "rceil"):
            raise ValueError(f"unsupported elem {elem!r} / scale_mode {scale_mode!r}")
        self.elem_dtype, self.emax, self.fmax = _ELEM_DTYPES[elem]
        self.rceil = scale_mode == "rceil"
        self.blocked = blocked


class RowwiseQuantKernel(_QuantKernelBase):
    """Rowwise MXFP8 cast ``x (M, K) -> data (M, K), scales`` (blocks of 32 along K).

    Compile-time parameters (the compile key): element dtype (``"e4m3"``/``"e5m2"``), ``scale_mode``
    (``"floor"``/``"rceil"``), ``blocked`` (scales in the tcgen05/cuBLAS blocked layout, 1-D buffer, which the caller
    zero-fills so that padding reads as 0; else plain (M, K/32) uint8).  The input dtype and the shapes are taken
    from the tensors; M and K are symbolic (no recompile per shape).

    Work split: one thread per 32-element block, consecutive threads on consecutive blocks of a row (a warp reads
    2 KiB of bf16 contiguously, with 16-byte vector loads).
    Constraints (checked by the ops layer before launch): K % 32 == 0; x row-major with 16-byte aligned rows;
    outputs contiguous.
    """

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, stream: cuda.CUstream):
        m, k = x.shape
        nblocks = m * (k // BLOCK)
        self.kernel(cute.zipped_divide(x, (1, BLOCK)), cute.zipped_divide(q, (1, BLOCK)), s, k // BLOCK).launch(
            grid=(cute.ceil_div(nblocks, THREADS), 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, cols: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * THREADS + tidx
        m = cute.size(gx, mode=[1, 0])
        if t < m * cols:
            r = t // cols
            c = t - r * cols
            qv, byte = quantize_block(gx[(None, (r, c))].load().to(cutlass.Float32), self.emax, self.fmax,
                                      self.rceil)
            gq[(None, (r, c))].store(qv.to(self.elem_dtype))
            if cutlass.const_expr(self.blocked):
                s[blocked_scale_offset(r, c, cols)] = cutlass.Uint8(byte)
            else:
                s[r, c] = cutlass.Uint8(byte)


DUAL_TILE_M = 32  # rows of a dual-cast tile: one colwise block
DUAL_TILE_K = 128  # columns of a dual-cast tile: four rowwise blocks
DUAL_THREADS = 128


class _TileQuantKernel(_QuantKernelBase):
    """32 x 128 tiles of ``x (M, K)`` through shared memory: the colwise cast (data_t (K, Mp), scales) and, when
    ``emit_rowwise``, the rowwise cast from the same read.

    Work split: a CTA of 128 threads owns a 32 x 128 tile.  Phase 1: thread t quantizes rowwise block
    (row t // 4, block t % 4) straight from 16-byte vector loads and parks the fp32 values in shared memory
    (row pitch 129 words).  Phase 2, after a barrier: thread t quantizes column t of the tile (one colwise block),
    reading shared memory without bank conflicts, and stores its 32 fp8 bytes as vectors into data_t.
    Rows >= M read as zero, so data_t's padding columns (Mp = ceil(M/32)*32) are written as zeros.
    Constraints: K % 32 == 0, x row-major with 16-byte aligned rows.
    """

    emit_rowwise = True

    @cute.jit
    def _launch(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
                stream: cuda.CUstream):
        m, k = x.shape
        mb = qt.shape[1] // BLOCK
        smem_bytes = DUAL_TILE_M * (DUAL_TILE_K + 1) * 4 + 64
        self.kernel(cute.zipped_divide(x, (1, BLOCK)), cute.zipped_divide(q, (1, BLOCK)), s,
                    cute.zipped_divide(qt, (1, BLOCK)), st, k // BLOCK, mb).launch(
            grid=(cute.ceil_div(k, DUAL_TILE_K), mb, 1), block=(DUAL_THREADS, 1, 1), smem=smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor, st: cute.Tensor,
               cols: cutlass.Int32, mb: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        kt, mt, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        tile = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((DUAL_TILE_M, DUAL_TILE_K), stride=(DUAL_TILE_K + 1, 1)), 16)
        m = cute.size(gx, mode=[1, 0])
        blocks_per_row = DUAL_TILE_K // BLOCK
        tr = tidx // blocks_per_row
        tb = tidx - tr * blocks_per_row
        r = mt * DUAL_TILE_M + tr
        c = kt * blocks_per_row + tb
        if r < m and c < cols:
            xv = gx[(None, (r, c))].load().to(cutlass.Float32)
            if cutlass.const_expr(self.emit_rowwise):
                qv, byte = quantize_block(xv, self.emax, self.fmax, self.rceil)
                gq[(None, (r, c))].store(qv.to(self.elem_dtype))
                if cutlass.const_expr(self.blocked):
                    s[blocked_scale_offset(r, c, cols)] = cutlass.Uint8(byte)
                else:
                    s[r, c] = cutlass.Uint8(byte)
            for i in cutlass.range_constexpr(BLOCK):
                tile[tr, tb * BLOCK + i] = xv[i]
        else:
            for i in cutlass.range_constexpr(BLOCK):
                tile[tr, tb * BLOCK + i] = cutlass.Float32(0.0)
        cute.arch.barrier()
        col = kt * DUAL_TILE_K + tidx
        if col < cols * BLOCK:
            frag = cute.make_rmem_tensor((BLOCK,), cutlass.Float32)
            for i in cutlass.range_constexpr(BLOCK):
                frag[i] = tile[i, tidx]
            qv, byte = quantize_block(frag.load(), self.emax, self.fmax, self.rceil)
            gqt[(None, (col, mt))].store(qv.to(self.elem_dtype))
            if cutlass.const_expr(self.blocked):
                st[blocked_scale_offset(col, mt, mb)] = cutlass.Uint8(byte)
            else:
                st[col, mt] = cutlass.Uint8(byte)


class DualQuantKernel(_TileQuantKernel):
    """Rowwise and colwise MXFP8 casts from ONE read of ``x (M, K)``: data (M, K) + scales as
    :class:`RowwiseQuantKernel`, data_t (K, Mp) + scales as :class:`ColwiseQuantKernel`.  See
    :class:`_TileQuantKernel` for the work split."""

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
                 stream: cuda.CUstream):
        self._launch(x, q, s, qt, st, stream)


class ColwiseQuantKernel(_TileQuantKernel):
    """Colwise MXFP8 cast ``x (M, K) -> data_t (K, Mp), scales (K, Mp/32)``: blocks of 32 along M, data stored
    transposed (the K-major operand of the transposed product), Mp = ceil(M/32)*32 with zero padding.  The
    shared-memory tile of :class:`_TileQuantKernel` without the rowwise outputs."""

    emit_rowwise = False

    @cute.jit
    def __call__(self, x: cute.Tensor, qt: cute.Tensor, st: cute.Tensor, stream: cuda.CUstream):
        self._launch(x, qt, st, qt, st, stream)  # the rowwise slots are unused (emit_rowwise is False)


@cute.jit
def group_of_row(r: cutlass.Int32, offs: cute.Tensor, num_groups: cutlass.Int32):
    """Index of the token group holding row ``r`` (``num_groups`` if ``r >= offs[-1]``): a binary search over the
    cumulative end offsets, 16 fixed steps (up to 65536 groups)."""
    lo = cutlass.Int32(0)
    hi = num_groups
    for _ in cutlass.range_constexpr(16):
        if lo < hi:
            mid = (lo + hi) // 2
            if offs[mid] <= r:
                lo = mid + 1
            else:
                hi = mid
    return lo


class GroupedRowwiseQuantKernel(RowwiseQuantKernel):
    """Rowwise MXFP8 cast of a 2d-3d GEMM operand grouped along M: data as :class:`RowwiseQuantKernel`, scales in
    the grouped-M blocked layout (``cute_mxfp8.formats.to_blocked_scales_grouped_m``): group g's scales start at
    128-row tile ``tile_starts[g]``.  Rows at or past ``offs[-1]`` get no scales (the caller zero-fills the buffer).

    Extra inputs: ``offs`` (G,) int32 cumulative end offsets and ``tile_starts`` (G,) int32
    (``cute_mxfp8.formats.group_tile_starts``), both on the device.  Always blocked.
    """

    def __init__(self, elem: str, scale_mode: str):
        super().__init__(elem, scale_mode, True)

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor,
                 stream: cuda.CUstream):
        m, k = x.shape
        nblocks = m * (k // BLOCK)
        self.grouped_kernel(cute.zipped_divide(x, (1, BLOCK)), cute.zipped_divide(q, (1, BLOCK)), s, k // BLOCK,
                            offs, tile_starts, cute.size(offs)).launch(
            grid=(cute.ceil_div(nblocks, THREADS), 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def grouped_kernel(self, gx: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, cols: cutlass.Int32,
                       offs: cute.Tensor, tile_starts: cute.Tensor, num_groups: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * THREADS + tidx
        m = cute.size(gx, mode=[1, 0])
        if t < m * cols:
            r = t // cols
            c = t - r * cols
            qv, byte = quantize_block(gx[(None, (r, c))].load().to(cutlass.Float32), self.emax, self.fmax,
                                      self.rceil)
            gq[(None, (r, c))].store(qv.to(self.elem_dtype))
            g = group_of_row(r, offs, num_groups)
            if g < num_groups:
                start = cutlass.Int32(0)
                if g > 0:
                    start = offs[g - 1]
                local = r - start
                # the group's own blocked matrix, placed at its first tile: tile rows advance by 128 local rows
                s[blocked_scale_offset(tile_starts[g] * 128 + local, c, cols)] = cutlass.Uint8(byte)

"""CuTe DSL MXFP8 block math and the rowwise (1x32) cast of a 2-D bf16/fp32 tensor (plain, blocked or grouped-M
blocked scales).  The colwise and dual casts are in :mod:`cute_mxfp8.kernels.quantize_tile`.

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
THREADS = 256  # rowwise kernel: threads per CTA
_ELEM_DTYPES = {"e4m3": (cutlass.Float8E4M3FN, 8), "e5m2": (cutlass.Float8E5M2, 15)}  # dtype, emax


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
def quantize_block(xv: cute.TensorSSA, emax: cutlass.Constexpr[int], rceil: cutlass.Constexpr[bool]):
    """MXFP8-quantize one block: ``xv`` a 32-element fp32 TensorSSA -> (fp32 TensorSSA of the scaled elements, NaN
    for a poisoned block, for the saturating fp8 conversion; E8M0 scale byte as Int32).  Device code, inlined where it is called; the
    rules are in this module's docstring."""
    byte, factor = block_scale(abs_bits_max(xv, BLOCK), emax, rceil)
    return apply_scale(xv, factor), byte


class _QuantKernelBase:
    def __init__(self, elem: str, scale_mode: str, blocked: bool = False):
        if elem not in _ELEM_DTYPES or scale_mode not in ("floor", "rceil"):
            raise ValueError(f"unsupported elem {elem!r} / scale_mode {scale_mode!r}")
        self.elem_dtype, self.emax = _ELEM_DTYPES[elem]
        self.rceil = scale_mode == "rceil"
        self.blocked = blocked


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


class RowwiseQuantKernel(_QuantKernelBase):
    """Rowwise MXFP8 cast ``x (M, K) -> data (M, K), scales`` (blocks of 32 along K).

    Compile-time parameters (the compile key): element dtype (``"e4m3"``/``"e5m2"``), ``scale_mode``
    (``"floor"``/``"rceil"``), ``blocked`` (scales in the tcgen05/cuBLAS blocked layout, 1-D buffer, which the caller
    zero-fills so that padding reads as 0; else plain (M, K/32) uint8).  The input dtype and the shapes are taken
    from the tensors; M and K are symbolic (no recompile per shape).

    Work split: one thread per 32-element block, consecutive threads on consecutive blocks of a row (a warp reads
    2 KiB of bf16 contiguously, with 16-byte vector loads).
    Constraints (checked by the ops layer before launch): K % 32 == 0; x row-major with 16-byte aligned rows;
    outputs contiguous; M * K / 32 < 2**31.
    """

    grouped = False

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, stream: cuda.CUstream):
        self._launch(x, q, s, s, s, stream)  # no groups: the group slots are unused

    @cute.jit
    def _launch(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor,
                stream: cuda.CUstream):
        m, k = x.shape
        nblocks = m * (k // BLOCK)
        self.kernel(cute.zipped_divide(x, (1, BLOCK)), cute.zipped_divide(q, (1, BLOCK)), s, k // BLOCK, offs,
                    tile_starts, cute.size(offs)).launch(
            grid=(cute.ceil_div(nblocks, THREADS), 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, cols: cutlass.Int32, offs: cute.Tensor,
               tile_starts: cute.Tensor, num_groups: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * THREADS + tidx
        m = cute.size(gx, mode=[1, 0])
        if t < m * cols:
            r = t // cols
            c = t - r * cols
            qv, byte = quantize_block(gx[(None, (r, c))].load().to(cutlass.Float32), self.emax, self.rceil)
            gq[(None, (r, c))].store(qv.to(self.elem_dtype))
            if cutlass.const_expr(self.grouped):
                g = group_of_row(r, offs, num_groups)
                if g < num_groups:  # rows at or past offs[-1] have no scales
                    start = cutlass.Int32(0)
                    if g > 0:
                        start = offs[g - 1]
                    # the group's own blocked matrix, placed at its first tile: tile rows advance by 128 rows
                    s[blocked_scale_offset(tile_starts[g] * 128 + r - start, c, cols)] = cutlass.Uint8(byte)
            elif cutlass.const_expr(self.blocked):
                s[blocked_scale_offset(r, c, cols)] = cutlass.Uint8(byte)
            else:
                s[r, c] = cutlass.Uint8(byte)


class GroupedRowwiseQuantKernel(RowwiseQuantKernel):
    """Rowwise MXFP8 cast of a 2d-3d GEMM operand grouped along M: data as :class:`RowwiseQuantKernel`, scales in
    the grouped-M blocked layout (``cute_mxfp8.formats.to_blocked_scales_grouped_m``): group g's scales start at
    128-row tile ``tile_starts[g]``.  Rows at or past ``offs[-1]`` get no scales (the caller zero-fills the buffer).

    Extra inputs: ``offs`` (G,) int32 cumulative end offsets and ``tile_starts`` (G,) int32
    (``cute_mxfp8.formats.group_tile_starts``), both on the device.  Always blocked.
    """

    grouped = True

    def __init__(self, elem: str, scale_mode: str):
        super().__init__(elem, scale_mode, True)

    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor,
                 stream: cuda.CUstream):
        self._launch(x, q, s, offs, tile_starts, stream)

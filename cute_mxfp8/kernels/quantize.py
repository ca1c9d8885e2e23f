"""CuTe DSL rowwise (1x32) MXFP8 cast of a 2-D bf16/fp32 tensor: plain, blocked or grouped-M blocked scales.
The colwise, dual and 3-D casts are in :mod:`cute_mxfp8.kernels.quantize_tile`; the block math in
:mod:`cute_mxfp8.kernels.mx_math`.

Arch-generic (SM90 and SM100): plain vectorized global loads and stores, no TMA, no tensor cores.  This module
imports the DSL at module scope; the ops layer imports it lazily (through :mod:`cute_mxfp8.jit`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .mx_math import BLOCK, MXCastParams, blocked_scale_offset, group_of_row, group_start, quantize_block

THREADS = 256  # threads per CTA


class RowwiseQuantKernel(MXCastParams):
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
                    start = group_start(offs, g)
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

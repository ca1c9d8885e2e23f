"""CuTe DSL gather of a token-major 2d-2d GEMM operand into the group-aligned layout the SM90 wgrad kernel reads.

A 2d-2d operand (R, T) holds each row's tokens contiguously, token groups back to back (``offs``).  TMA takes
only 16-byte aligned inner coordinates, so the grouped wgrad GEMM reads the operand from an (R, T') copy in which
group g starts at column ``starts[g]``, a multiple of 16 (``starts`` the exclusive prefix sum of the groups' sizes
rounded up to 16; ``ops.gemm_sm90.aligned_token_layout`` is the same map in torch).  The columns after a group's
last token, up to the next start, are written as zeros.

Arch-generic (SM90 and SM100): byte loads, 16-byte rows of output per thread; no TMA, no tensor cores.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .mx_math import group_of_row

THREADS = 128  # threads per CTA
CHUNK = 16  # output bytes per thread: one 16-byte-aligned piece of a row, inside one group's aligned range


class TokenAlignKernel:
    """``dst (R, T') <- src (R, T)`` with every token group moved to a 16-aligned first column.

    Inputs: ``src`` (R, T) uint8 row-major (any T; the fp8 data viewed as bytes), ``offs`` (G,) int32 cumulative
    group ends (non-decreasing, ``offs[-1] <= T``: the ops layer sanitizes them on the device), ``ends16`` (G,)
    int32 the cumulative sizes rounded up to 16 (group g occupies columns ``[ends16[g - 1], ends16[g])`` of dst).
    Output ``dst`` (R, T') uint8 with T' % 16 == 0 and T' >= ends16[-1]; columns past ``ends16[-1]`` are zero.

    Work split: grid (R, T' / 16 / 128); thread j of a row writes dst columns ``[16 j, 16 j + 16)`` as four 32-bit
    stores.  A 16-column piece never straddles two groups (both bounds are multiples of 16), so one binary search
    (:func:`~.mx_math.group_of_row` over ``ends16``) finds its group.
    """

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, offs: cute.Tensor, ends16: cute.Tensor,
                 stream: cuda.CUstream):
        rows, tp = dst.shape
        dst32 = cute.make_tensor(cute.recast_ptr(dst.iterator, dtype=cutlass.Uint32),
                                 cute.make_layout((rows, tp // 4), stride=(tp // 4, 1)))
        pieces = tp // CHUNK
        self.kernel(src, dst32, offs, ends16, pieces, cute.size(offs)).launch(  # rows on x: no 65535 limit
            grid=(rows, (pieces + THREADS - 1) // THREADS, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst32: cute.Tensor, offs: cute.Tensor, ends16: cute.Tensor,
               pieces: cutlass.Int32, groups: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, bx, _ = cute.arch.block_idx()
        j = bx * THREADS + tidx
        if j < pieces:
            p0 = j * CHUNK
            g = group_of_row(p0, ends16, groups)
            shift = cutlass.Int32(0)  # source column = destination column + shift
            valid = cutlass.Int32(0)  # bytes of this piece that are tokens of group g
            if g < groups:
                start = cutlass.Int32(0)
                start16 = cutlass.Int32(0)
                if g > 0:
                    start = offs[g - 1]
                    start16 = ends16[g - 1]
                shift = start - start16
                valid = cutlass.max(cutlass.min(offs[g] - start - (p0 - start16), cutlass.Int32(CHUNK)),
                                    cutlass.Int32(0))
            for w in cutlass.range_constexpr(CHUNK // 4):
                word = cutlass.Uint32(0)
                for b in cutlass.range_constexpr(4):
                    i = 4 * w + b
                    if i < valid:
                        word = word | (cutlass.Uint32(src[row, p0 + i + shift]) << (8 * b))
                dst32[row, j * (CHUNK // 4) + w] = word

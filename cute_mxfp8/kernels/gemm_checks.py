"""The SM100 GEMM's architecture-independent parts as small kernels that run on any GPU (``docs/sm100_gemm.md``:
there is no SM100 here, so the H200 runs these and the tests compare them with the reference):

* :class:`EpilogueCheckKernel`: the fused SwiGLU / dSwiGLU + dual-quant epilogue code of
  :mod:`.gemm_epilogue`, fed from a global fp32 accumulator instead of tensor memory.
* :class:`ScaleLayoutProbe`: the blocked scale layout the GEMM's TMA reads through (:func:`.blockscaled.scale_layout`
  with run-time shapes, as the GEMM builds it), evaluated for every scale of an operand.
* :class:`TileScheduleProbe`: the GEMM's persistent tile order (:mod:`.tile_scheduler`), every CTA
  counting the output tiles it is given.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .blockscaled import SF_VEC, scale_layout
from .gemm_epilogue import (BLOCK, GATE_UP_TILE, MODES, TRANSPOSE_BYTES, dswiglu_block, gate_column,
                            load_row_block, swiglu_block, transpose_tiles)
from .mx_math import MXCastParams
from .tile_scheduler import PersistentTiles


class EpilogueCheckKernel:
    """The fused epilogues' code path on any GPU, fed from a global fp32 "accumulator" instead of TMEM.

    Each CTA is 4 warps x 32 lanes = 128 rows (like the SM100 epilogue warps over a 128-row tile) and walks the
    32-column blocks of one column tile; thread ``t`` holds row ``128 * blockIdx.x + t``.  Rows past M read
    zeros, as a TMA zero-filled tile would give.  ``mode``:

    * ``"swiglu"``: ``acc`` (M, 2I) fp32 = GEMM1's accumulator (interleaved gate/up); outputs (M, I).
    * ``"dswiglu"``: ``acc`` (M, I) fp32 = GEMM3's accumulator dh, plus the saved ``h13`` (M, 2I); outputs
      (M, 2I).

    Launch: ``(acc, h13, q, qs, qt, qts, hp, stream)`` (``h13`` and ``hp`` placeholders where unused), the
    outputs as :func:`dual_quantize_block` describes, scale buffers zero-filled.
    """

    THREADS = 128

    def __init__(self, mode: str, elem: str, scale_mode: str, emit_hp: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.emit_hp = mode, emit_hp
        self.cast = MXCastParams(elem, scale_mode, blocked=True)
        self.elem_dtype = self.cast.elem_dtype

    @cute.jit
    def __call__(self, acc: cute.Tensor, h13: cute.Tensor, q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor,
                 qts: cute.Tensor, hp: cute.Tensor, stream: cuda.CUstream):
        m, n = acc.shape
        h_cols = n // 2 if cutlass.const_expr(self.mode == "swiglu") else n
        grid = [(m + self.THREADS - 1) // self.THREADS, (h_cols + BLOCK - 1) // BLOCK, 1]
        self.kernel(acc, h13, (q, qs, qt, qts, hp), m, h_cols).launch(
            grid=grid, block=[self.THREADS, 1, 1], smem=TRANSPOSE_BYTES * (self.THREADS // 32), stream=stream)

    @cute.kernel
    def kernel(self, acc: cute.Tensor, h13: cute.Tensor, out: tuple, rows: cutlass.Int32, cols: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tr = transpose_tiles(cutlass.memory.SmemAllocator(), self.elem_dtype, self.THREADS // 32)[(None, None, warp)]
        m = bx * self.THREADS + tidx
        c0 = by * BLOCK
        if cutlass.const_expr(self.mode == "swiglu"):
            pg = gate_column(c0)
            g, u = load_row_block(acc, m, pg, m < rows), load_row_block(acc, m, pg + GATE_UP_TILE, m < rows)
            swiglu_block(g, u, out, tr, m, c0, lane, rows, cols, self.cast, self.emit_hp)
        else:
            dswiglu_block(load_row_block(acc, m, c0, m < rows), h13, out, tr, m, c0, lane, rows, cols, self.cast,
                          self.emit_hp)


class ScaleLayoutProbe:
    """Gathers an operand's scales through the GEMM's blocked layout: ``(buf, plain, k)`` with ``buf`` the 1-D
    blocked uint8 buffer of a (rows, K) operand and ``plain`` (rows, K / 32) uint8; thread (r, b) writes
    ``plain[r, b] = buf[scale_layout(rows, K)(r, 32 b + 31, 0)]`` (the last element of the block, with the
    layout's run-time shape).  Equal to the scales that were blocked <=> the layout is ``to_blocked_scales``."""

    THREADS = 128

    @cute.jit
    def __call__(self, buf: cute.Tensor, plain: cute.Tensor, stream: cuda.CUstream):
        rows, blocks = plain.shape
        n = rows * blocks
        self.kernel(buf, plain, scale_layout(rows, blocks * SF_VEC)).launch(
            grid=[(n + self.THREADS - 1) // self.THREADS, 1, 1], block=[self.THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, buf: cute.Tensor, plain: cute.Tensor, layout: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        rows, blocks = plain.shape
        i = bx * self.THREADS + tidx
        if i < rows * blocks:
            r, b = i // blocks, i % blocks
            plain[r, b] = buf[cute.crd2idx((r, b * SF_VEC + SF_VEC - 1, 0), layout)]


class TileScheduleProbe:
    """Runs the GEMM's persistent tile order (:mod:`.tile_scheduler`) for an (M, N) output:
    ``(count, order, m, n)`` with ``count`` and ``order`` (M tiles, N tiles) int32, ``count`` zero-filled; every
    CTA's thread 0 walks the tiles it is given (as all roles of the GEMM do), adds 1 to ``count`` at each tile
    inside the output and writes there the cluster-tile index it visited it at (``tile_order``'s position).
    Compile-time: ``n_tile``, ``max_ctas`` and ``cluster_mn`` as the GEMM's (launched in clusters of that shape,
    as the GEMM is)."""

    def __init__(self, n_tile: int, max_ctas: int, cluster_mn: tuple = (1, 1)):
        self.n_tile, self.max_ctas, self.cluster_mn = n_tile, max_ctas, tuple(cluster_mn)

    @cute.jit
    def __call__(self, count: cute.Tensor, order: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32,
                 stream: cuda.CUstream):
        from .gemm_sm100 import tile_grid

        grid = tile_grid(m, n, self.n_tile, self.max_ctas, self.cluster_mn)
        self.kernel(count, order).launch(grid=grid, block=[32, 1, 1], cluster=(*self.cluster_mn, 1), stream=stream)

    @cute.kernel
    def kernel(self, count: cute.Tensor, order: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tiles = PersistentTiles(count.shape[0], count.shape[1], self.cluster_mn)
        linear = tiles.first()
        while tiles.valid(linear):
            mt, nt = tiles.tile(linear)
            # a cluster's CTAs take neighbouring tiles, so past the last tile row/column some get tiles outside
            # the output (the GEMM's TMA clips them, its epilogue predicates them): not counted here
            if tidx == 0 and mt < count.shape[0] and nt < count.shape[1]:
                cute.arch.atomic_add(count.iterator + cute.crd2idx((mt, nt), count.layout), cutlass.Int32(1))
                order[mt, nt] = linear
            linear = tiles.next(linear)

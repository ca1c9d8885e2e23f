"""SM90 (Hopper) MXFP8 GEMMs ``D = A · Bᵀ`` with E8M0 scales per 32 elements along K (issue 12), two mainloops:

* :class:`MXGemmSm90Dequant` (*dequantize*, the default): fp8 -> bf16 with the block scale folded in (exact), then
  bf16 WGMMA with one long fp32 accumulation; A from registers, B from shared memory.
* :class:`MXGemmSm90` (*promotion*): one fp8 WGMMA per MX block into a partial accumulator, scaled into the fp32
  accumulator on the CUDA cores.  Kept for comparison (``docs/sm90_gemm.md`` has both measured).
"""

from __future__ import annotations

from collections import namedtuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup

from .gemm_epilogue import EPILOGUES, GATE_UP_TILE, dswiglu_block, swiglu_block
from .tile_scheduler import PersistentTiles, SplitTailTiles, grid_clusters, part_k_range
from .mx_math import (BLOCK, MXCastParams, dequant_pair_bf16, e8m0_bf16x2, e8m0_to_f32, gemm_dtypes,
                      group_of_tile, group_start, pack_bf16x2)

_K_MAJOR = utils.LayoutEnum.ROW_MAJOR  # A (M, K) and B (N, K) with K contiguous
_ROW_MAJOR = utils.LayoutEnum.ROW_MAJOR  # D (M, N) with N contiguous

# MXGemmSm90.tile_work's result: TMA coordinates (A row, B row, first K column), the stage count, the output rows
# (first, limit), the A scale word of K tile 0 of the tile's rows (and whether they have scale rows), the B scale
# words' base and K tiles per 128-row scale tile
_Work = namedtuple("_Work", "a_row0 b_row0 k0 k_tiles d_row0 rows a_word0 a_ok b_word0 b_ktiles")


def _tma_atoms(a: cute.Tensor, b: cute.Tensor, a_smem, b_smem, tile_m: int, tile_n: int, k_stage: int,
               mcast: tuple = (1, 1)):
    """TMA load atoms (and the coordinate tensors) of the A (``tile_m`` x ``k_stage``) and B (``tile_n`` x
    ``k_stage``) stage tiles, for the stage layouts ``a_smem`` / ``b_smem``; ``mcast`` = the CTAs each A / B tile
    is multicast to (a cluster's N and M extents)."""
    def atom(x, smem, tile, count):
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if count > 1 else cpasync.CopyBulkTensorTileG2SOp()
        return cpasync.make_tiled_tma_atom(op, x, cute.slice_(smem, (None, None, 0)), (tile, k_stage),
                                           num_multicast=count)

    return (*atom(a, a_smem, tile_m, mcast[0]), *atom(b, b_smem, tile_n, mcast[1]))


def _check_split_halves(split_halves, grouping: str) -> bool:
    if type(split_halves) is not bool or (split_halves and grouping != "k"):
        raise ValueError(f"split_halves (a bool) is an output layout of the 2d-2d grouping 'k', got "
                         f"split_halves={split_halves!r} with grouping={grouping!r}")
    return split_halves


@cute.jit
def split_half_rows(g: cutlass.Int32, groups: cutlass.Int32, m: cutlass.Int32, a_row0: cutlass.Int32):
    """A 2d-2d tile's output rows with ``split_halves``: group g's (m, K) product goes to ``d`` viewed as
    (2, G, m / 2, K), its first m / 2 rows to half 0, the others to half 1 (the packed W13 = [w1; w3] wgrad lands
    as dW1 = d[0], dW3 = d[1], each in the parameters' (G, I, K) layout).  Needs m % 256 == 0, so that a 128-row
    tile lies in one half.  Returns (the tile's first output row, the end of its half's rows)."""
    half = m // 2
    part = a_row0 // half
    base = part * groups * half + g * half
    return base + (a_row0 - part * half), base + half


class MXGemmSm90:
    """MXFP8 GEMM for SM90: ``D (M, N) = Σ_b sa[m, b] · sb[n, b] · Σ_{k in block b} A[m, k] · B[n, k]`` in fp32,
    the reference's block-scaled product (OCP MX v1.0 blocks of 32 along K), rounded once to ``out_dtype``.

    Operands: A (M, K) and B (N, K) fp8, e4m3 or e5m2 each, K-major; their scales the blocked E8M0 buffers of
    ``quantize_rowwise(..., blocked=True)`` (cuBLAS block-scaling layout): the scales of a 128-row x 128-deep tile
    are one 512-byte chunk, and the 4 scales of one row in it are 4 consecutive bytes, read as one 32-bit load.

    Mainloop (*promotion*): one ``wgmma.mma_async ... .e4m3/.e5m2`` of K = 32 is exactly one MX block; it writes a
    zero-initialised partial accumulator, which is then added to the fp32 accumulator times ``sa[m] · sb[n]`` (exact:
    a product of powers of two).  Warp roles (384 threads): warpgroup 0 loads A and B by TMA into ``stages``
    shared-memory stages of 128 x 128 / ``n_tile`` x 128 bytes (``PipelineTmaAsync``; one warp issues); warpgroups 1
    and 2 (the consumers) each own all 128 rows of the output tile and half of its columns (two m64 WGMMAs per K
    step), so one promotes while the other's WGMMAs run; the scales are decoded into shared memory once per stage and
    each thread reads its column scales with 16-byte loads.  Epilogue: each thread stores its accumulator elements,
    converted to ``out_dtype``, predicated on M and N (partial tiles).  Persistent CTAs (``max_ctas``, one per SM)
    walk the shared tile order (:class:`.tile_scheduler.PersistentTiles`), the pipeline running on across tiles.

    ``block_k=128`` (the Hopper fast mode, issue 16): the operands' four MX scales of every 128-deep K block are
    equal (``quantize_mxfp8(..., scale_block=128)``), so the stage's 4 WGMMAs accumulate into one partial and it is
    promoted once per stage with the block's scale (the first of the four; the others are not read).  A warpgroup
    promotes while the other warpgroup's WGMMAs run.  The result is the reference's product of those operands.
    ``b_block_n=128`` (fast mode, dense and ``grouping="m"``): B's scales are also shared along N, one per
    128 x 128 block of B (``quantize_mxfp8(..., scale_block=128, blocks_2d=True)``: the weight blocks of DeepSeek-V3's
    recipe and cuBLAS's 1x128 x 128x128 blockwise fp8), so the stage's scale of an output column is one of two
    scalars per warpgroup (a warpgroup's columns span at most two 128-blocks, split on a 32-column boundary) and the
    promotion is one FFMA per element (``acc += part * (sa[row] * sb)``) instead of an FMUL and an FFMA.  The
    kernel reads the scale of each block's first row (the ops layer guarantees B's scales are equal along the
    block); the result is the reference's product of those operands.  ``consumer_split="m"`` (with
    ``b_block_n=128``; what the ops run): the consumer warpgroups split the tile's M instead, each 64 rows x all
    ``n_tile`` columns with one ``m64 x n_tile`` WGMMA per K step (the 192 columns span at most two 128-blocks
    too); with per-column scales this cost twice the column-scale reads, with two scalars it is 4-5 % faster.
    ``tma_store`` (split M, dense or ``grouping="m"``, bf16 D with N % 8 == 0; what the ops run there): the
    epilogue stages the tile in shared memory (``stmatrix``) and TMA-stores it, each warpgroup its own 64 rows; the
    stores drain while the next tile's mainloop runs (:meth:`_store_tma`).  It costs the pipeline one stage (4
    instead of 5: the staged tile takes 48 KB) and measured +14-20 % TFLOP/s at K = 2048, +3-4 % at K = 7168, 0-6 %
    at 8192³ (a tile's store is a larger share of a short K loop; ``docs/sm90_gemm.md``).  2d-3d: a warpgroup's
    64 rows whose group ends inside them are copied from the staged tile element by element instead (the rows
    past the end are the next group's); +19 % at 32768 x 3072 x 2048 in 8 groups.  That build's setmaxnreg
    budgets are 24 / 240 (:meth:`_regs`: at 40 / 232 ptxas spilled 4 words).  2d-2d (split N, the wgrads):
    each warpgroup stages its own columns, whole 128 x 32 boxes, with 32-bit shared stores and TMA-stores them
    (:meth:`_store_tma_n`); a tile whose 128 rows are not all its group's (N % 128 != 0) stores per thread.
    ``pingpong`` (block_k=128, default on): the consumer warpgroups pass a WGMMA issue token round a ring (named
    barriers, :meth:`_token`): each issues a stage's WGMMAs only after the previous one issued its own, so the
    tensor core runs one warpgroup's MMAs while the others promote.  ``cluster_mn`` (:attr:`CLUSTERS`): CTAs per
    cluster along (M, N); the A tile is TMA-multicast across the cluster's N CTAs and the B tile across its M CTAs
    (each CTA loads a slice; a CTA past the output's edge still loads and releases its slices).  ``grouping``
    (fast mode, no cluster): ``"m"`` 2d-3d or ``"k"`` 2d-2d token groups (:meth:`call_grouped`,
    :meth:`tile_work`).  ``split_tail`` (fast mode, dense, no cluster; :meth:`call_split`): the last ``tiles %
    ctas`` tiles of the order split along K (:class:`.tile_scheduler.SplitTailTiles`): a part writes its fp32
    accumulator to a workspace in the consumer threads' fragment order, then (a GPU-scope fence, a CTA barrier of
    the consumers) one thread adds 1 to the tile's counter; the part that takes it to ``parts`` adds the parts'
    accumulators in part order (deterministic: the same sum whichever part arrives last), resets the counter to 0
    and stores the tile with the build's epilogue.  The sum regroups the fp32 K reduction (exact for integer-valued
    products, otherwise within fp32 rounding of the unsplit kernel's).

    Constraints (:meth:`can_implement`): K % 32 == 0 (TMA zero-fills a partial 128-deep K tile; its padded scales
    are zero), 16-byte aligned contiguous operands; any M, N >= 1.

    Arguments: ``a_elem`` / ``b_elem`` ``"e4m3"`` or ``"e5m2"``; ``out_dtype`` ``"bfloat16"`` or ``"float32"``;
    ``n_tile`` the output tile's N, 128, or 192 with ``block_k=128``; ``block_k`` 32 or 128; ``max_ctas`` the
    persistent grid's CTAs (one per SM); ``cluster_mn`` one of :attr:`CLUSTERS` (dense only); ``pingpong`` the
    issue token (``block_k=128`` only; ignored with 32); ``grouping`` ``"none"``, or ``"m"`` / ``"k"`` with
    ``block_k=128`` and no cluster; ``b_block_n`` 1 or (fast mode, not ``"k"``) 128; ``consumer_split`` ``"n"``
    or (``b_block_n=128``) ``"m"``; ``tma_store`` (bool) with ``consumer_split="m"``, ``grouping`` ``"none"`` or
    ``"m"``, or with ``consumer_split="n"`` and ``grouping="k"``, no cluster and ``out_dtype="bfloat16"`` (D's
    rows then need a 16-byte pitch: N % 8 == 0);
    ``split_tail`` (bool) with ``block_k=128``, ``grouping="none"`` and no cluster.  Raises ValueError naming the
    argument for anything else.
    """

    TILE_M = 128
    K_STAGE = 128  # K elements per pipeline stage: 4 MX blocks, 4 x 2 WGMMAs per consumer warpgroup
    BLOCKS = 4
    EPI_COLS = 32  # tma_store: columns of one staged sub-tile (128 rows, both consumer warpgroups' 64)

    CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))

    consumers = 2  # consumer warpgroups (3, each on 64 columns of n_tile 192, measured 5-7 % slower)
    THREADS = 128 * (1 + consumers)
    # setmaxnreg budgets (producer warpgroup, each consumer warpgroup): 128 x 40 + 256 x 232 of the SM's 65536
    # registers (a consumer holds its accumulator and the partial)
    REGS = (40, 232)
    REGS_GROUPED_STAGED = (24, 240)  # tma_store 2d-3d: the staging and the partial-rows copy need 8 more per thread

    def __init__(self, a_elem: str, b_elem: str, out_dtype: str = "bfloat16", n_tile: int = 128,
                 block_k: int = 32, max_ctas: int = 132, cluster_mn: tuple = (1, 1), pingpong: bool = True,
                 grouping: str = "none", split_halves: bool = False, b_block_n: int = 1,
                 consumer_split: str = "n", tma_store: bool = False, split_tail: bool = False):
        self.a_dtype, self.b_dtype, self.d_dtype = gemm_dtypes(a_elem, b_elem, out_dtype)
        self.split_halves = _check_split_halves(split_halves, grouping)
        cluster_mn = tuple(cluster_mn) if isinstance(cluster_mn, (tuple, list)) else cluster_mn
        if cluster_mn not in self.CLUSTERS:
            raise ValueError(f"cluster_mn must be one of {self.CLUSTERS}, got {cluster_mn}")
        self.cluster_mn = cluster_mn
        self.pingpong = bool(pingpong) and block_k == 128
        if type(block_k) is not int or block_k not in (32, 128):
            raise ValueError(f"block_k must be 32 (MX blocks) or 128 (the Hopper fast mode's shared scales), got "
                             f"{block_k!r}")
        if type(n_tile) is not int or n_tile not in ((128, 192) if block_k == 128 else (128,)):
            raise ValueError(f"n_tile must be 128, or 192 with block_k=128 (the fast mode's one partial per stage "
                             f"leaves the registers), got {n_tile}")
        if type(max_ctas) is not int or max_ctas < 1:
            raise ValueError(f"max_ctas must be an int >= 1, got {max_ctas!r}")
        if grouping not in ("none", "m", "k"):
            raise ValueError(f"grouping must be 'none' (dense), 'm' (2d-3d) or 'k' (2d-2d), got {grouping!r}")
        if grouping != "none" and (block_k != 128 or cluster_mn != (1, 1)):
            raise ValueError(f"grouping={grouping!r} (token groups) needs the fast mode's block_k=128 and "
                             f"cluster_mn=(1, 1) (a cluster's tiles can be different groups'), got block_k={block_k}, "
                             f"cluster_mn={cluster_mn}")
        if type(b_block_n) is not int or b_block_n not in (1, 128) or (
                b_block_n == 128 and (block_k != 128 or grouping == "k")):
            raise ValueError(f"b_block_n must be 1 (1x128 B scales), or 128 (128x128 B blocks) with block_k=128 and "
                             f"grouping 'none' or 'm' (the 2d-2d B is an activation), got {b_block_n!r} with "
                             f"block_k={block_k}, grouping={grouping!r}")
        self.n_tile, self.block_k, self.max_ctas, self.grouping = n_tile, block_k, max_ctas, grouping
        self.b_block_n = b_block_n
        if consumer_split not in ("n", "m") or (consumer_split == "m" and b_block_n != 128):
            raise ValueError(f"consumer_split must be 'n', or 'm' with b_block_n=128 (split M needs every column's "
                             f"scale per thread: affordable with one scalar per B block only), got "
                             f"{consumer_split!r} with b_block_n={b_block_n}")
        self.split_m = consumer_split == "m"
        if type(tma_store) is not bool:
            raise ValueError(f"tma_store must be a bool, got {tma_store!r}")
        staged_ok = grouping == "k" if consumer_split == "n" else grouping in ("none", "m")
        unmet = [why for bad, why in (
            (not staged_ok, f"consumer_split='m' with grouping 'none' or 'm', or consumer_split='n' with grouping "
                            f"'k' (got {consumer_split!r} with {grouping!r})"),
            (out_dtype != "bfloat16", f"a bfloat16 output (got {out_dtype!r})"),
            (cluster_mn != (1, 1), f"no cluster (got cluster_mn={cluster_mn})")) if bad]
        if tma_store and unmet:  # (the whole tile is staged in shared memory; TMA clips only at the output's edges)
            raise ValueError(f"tma_store=True needs {'; and '.join(unmet)}")
        self.tma_store = tma_store
        if type(split_tail) is not bool or (split_tail and (block_k != 128 or grouping != "none"
                                                             or cluster_mn != (1, 1))):
            raise ValueError(f"split_tail (a bool) needs block_k=128, grouping 'none' and no cluster (the split "
                             f"tiles' parts meet in a per-tile counter), got split_tail={split_tail!r} with "
                             f"block_k={block_k}, grouping={grouping!r}, cluster_mn={cluster_mn}")
        self.split_tail = split_tail
        # split N: each consumer warpgroup all 128 rows (two m64 WGMMAs per K step) x n_tile / 2 columns;
        # split M: 64 rows x all n_tile columns (one m64 WGMMA per K step)
        self.wg_cols = n_tile if self.split_m else n_tile // self.consumers  # output columns per warpgroup
        self.row_frags = 1 if self.split_m else 2  # m64 fragments per warpgroup
        self.thr_cols = self.wg_cols // 4  # accumulator columns per thread (and row)

    @staticmethod
    def can_implement(m: int, n: int, k: int) -> str | None:
        """None if the kernel takes an (M, K) x (N, K) problem, else the reason."""
        if k % 32 or k <= 0:
            return f"K = {k} must be a positive multiple of 32"
        if m <= 0 or n <= 0:
            return "empty output: nothing to launch"
        return None

    def _configure(self):
        self.tiler = (self.TILE_M, self.n_tile, self.K_STAGE)
        # the consumer warpgroups split the tile's N (each all 128 rows: two m64 WGMMAs per K step), or its M
        self.tiled_mma = sm90.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (self.consumers, 1, 1) if self.split_m else (1, self.consumers, 1),
            tiler_mn=(64, self.wg_cols))
        self.stage_bytes = (self.TILE_M + self.n_tile) * self.K_STAGE  # fp8: one byte per element
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        # decoded scales: per buffer (2) and consumer warpgroup, the tile's 128 rows and its half's columns (padded
        # slots, _col_slot) x the scales decoded per stage (4 MX blocks, or the fast mode's one shared one) of fp32
        self.DEC_WORDS = (self.TILE_M + 4 * self._col_pitch()) * (self.BLOCKS if self.block_k == 32 else 1)
        dec_bytes = 2 * self.consumers * self.DEC_WORDS * 4
        epi_bytes = 0
        if self.tma_store:
            # the whole output tile, staged as n_tile / 32 sub-tiles of 128 x 32 (what stmatrix over the MMA's C
            # layout writes); each is two 64 x 32 boxes of the same swizzled layout, one per consumer warpgroup,
            # which TMA-stores its own (d_box: the same memory as 2 n_tile / 32 boxes)
            subtiles = self.n_tile // self.EPI_COLS
            self.d_smem = sm90.make_smem_layout_epi(self.d_dtype, _ROW_MAJOR, (self.TILE_M, self.EPI_COLS),
                                                    subtiles)
            if self.split_m:
                self.epi_box = (self.TILE_M // self.consumers, self.EPI_COLS)
                self.d_box = sm90.make_smem_layout_epi(self.d_dtype, _ROW_MAJOR, self.epi_box,
                                                       self.consumers * subtiles)
            else:  # split N (2d-2d): a warpgroup's columns are whole sub-tiles, each one 128 x 32 box
                self.epi_box = (self.TILE_M, self.EPI_COLS)
                self.d_box = self.d_smem
            epi_bytes = cute.size_in_bytes(self.d_dtype, self.d_smem) + 1024  # + its 1 KB alignment
        self.stages = min(8, (capacity - 4096 - dec_bytes - epi_bytes) // self.stage_bytes)
        self.a_smem = sm90.make_smem_layout_a(_K_MAJOR, self.tiler, self.a_dtype, self.stages)
        self.b_smem = sm90.make_smem_layout_b(_K_MAJOR, self.tiler, self.b_dtype, self.stages)
        self.cluster = cute.make_layout((*self.cluster_mn, 1))
        self.mcast_a, self.mcast_b = self.cluster_mn[1], self.cluster_mn[0]  # CTAs sharing an A / a B tile

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                 stream: cuda.CUstream):
        """Dense: ``a`` (M, K), ``b`` (N, K) fp8 K-major; ``sfa``/``sfb`` the 1-D blocked E8M0 buffers (bytes,
        16-byte aligned); ``d`` (M, N) row-major."""
        self._launch(a, b, sfa, sfb, d, None, None, stream)

    @cute.jit
    def call_split(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                   ws: cute.Tensor, flags: cute.Tensor, tail: cutlass.Int32, parts: cutlass.Int32,
                   stream: cuda.CUstream):
        """``split_tail``: dense as :meth:`__call__`, the last ``tail`` tiles of the order in ``parts`` K parts
        (:func:`.tile_scheduler.tail_split`); ``ws`` fp32 workspace of at least ``tail * parts * 128 * n_tile``
        elements, ``flags`` int32 (>= ``tail``) all 0 (the kernel leaves them 0), one launch at a time per
        buffer.  Unchecked here (``0 <= tail < tiles``, ``parts >= 1``, the buffer sizes): ``ops.gemm_sm90.mm``
        derives them."""
        self._launch(a, b, sfa, sfb, d, None, None, stream, (ws, flags, tail, parts))

    @cute.jit
    def call_grouped(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                     offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """Token groups ``offs`` (G,) int32 cumulative ends, ``sched`` (2, G) int32:

        * ``grouping="m"`` (2d-3d): ``a`` (T, K); ``b`` (G * N, K), the experts' (N, K) weights back to back;
          ``sfa`` grouped-M blocked (each group's rows from its own 128-row scale tile), ``sfb`` the G blocked
          buffers back to back; ``d`` (T, N), rows at or past ``offs[-1]`` written as zeros; ``sched`` row 0 the
          groups' cumulative 128-row tile counts, row 1 their first scale tiles
          (``ops.gemm_common.group_schedule``).
        * ``grouping="k"`` (2d-2d): ``a`` (N, T'), ``b`` (K', T') token-major with every group starting on a
          128-aligned column and zeros after its last token (``ops.token_layout`` with align 128); grouped-K
          blocked scales of the T-token operands (``formats.to_blocked_scales_grouped_k``); ``d`` (G * N, K'),
          an empty group's slice zeros; ``sched`` row 0 the groups' first columns, row 1 their first grouped-K
          scale tiles (``ops.token_layout.schedule_k``)."""
        self._launch(a, b, sfa, sfb, d, offs, sched, stream)

    @cute.jit
    def _launch(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor, offs,
                sched, stream: cuda.CUstream, split=None):
        self._configure()
        m, k = a.shape
        n = d.shape[1]  # columns of the output (per expert when grouped)
        tma_a, ga, tma_b, gb = _tma_atoms(a, b, self.a_smem, self.b_smem, self.TILE_M, self.n_tile, self.K_STAGE,
                                          (self.mcast_a, self.mcast_b))
        # the blocked scales as 32-bit words: word (tile * 128 + (r % 32) * 4 + (r % 128) // 32) holds the 4 block
        # scales of row r in 128-deep K tile ``tile % k_tiles``
        sfa_w = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=cutlass.Uint32),
                                 cute.make_layout(cute.size(sfa) // 4))
        sfb_w = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=cutlass.Uint32),
                                 cute.make_layout(cute.size(sfb) // 4))
        k_tiles = (k + self.K_STAGE - 1) // self.K_STAGE
        tma_d, gd = None, None
        if cutlass.const_expr(self.tma_store):
            tma_d, gd = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), d,
                                                    cute.slice_(self.d_box, (None, None, 0)), self.epi_box)

        @cute.struct
        class Shared:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem.outer)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem.outer)], 1024]
            sdec: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.consumers * self.DEC_WORDS], 16]
            if cutlass.const_expr(self.tma_store):  # the staged output tile (other builds have no such field)
                sd: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem.outer)], 1024]
            if cutlass.const_expr(self.split_tail):  # a split part's counter value, for the consumer threads
                arrived: cute.struct.MemRange[cutlass.Int32, 4]

        self.shared = Shared
        m_tiles = (m + self.TILE_M - 1) // self.TILE_M
        if cutlass.const_expr(self.grouping == "m"):  # a bound on the groups' tiles plus the tail's (rows >= offs[-1])
            m_tiles = m // self.TILE_M + cute.size(offs) + 1
        if cutlass.const_expr(self.grouping == "k"):  # (group, row tile) pairs
            m_tiles = cute.size(offs) * m_tiles
        n_tiles = (n + self.n_tile - 1) // self.n_tile
        grid = (*self.cluster_mn, grid_clusters(m_tiles, n_tiles, self.cluster_mn, self.max_ctas))
        if cutlass.const_expr(self.split_tail):  # units: the whole tiles, then the tail tiles' parts
            _, _, tail, parts = split
            units = m_tiles * n_tiles - tail + tail * parts
            grid = (1, 1, cutlass.max(cutlass.min(cutlass.Int32(self.max_ctas), units), cutlass.Int32(1)))
        self.kernel(self.tiled_mma, tma_a, ga, tma_b, gb, sfa_w, sfb_w, d, offs, sched, m, n, k_tiles, m_tiles,
                    n_tiles, self.a_smem, self.b_smem, self.cluster, tma_d, gd,
                    (self.d_smem, self.d_box) if self.tma_store else None, split).launch(
            grid=grid, block=[self.THREADS, 1, 1], cluster=(*self.cluster_mn, 1), smem=Shared.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1)  # a known entry register count: ptxas honours setmaxnreg (C7508)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, ga: cute.Tensor, tma_b: cute.CopyAtom,
               gb: cute.Tensor, sfa_w: cute.Tensor, sfb_w: cute.Tensor, d: cute.Tensor, offs, sched,
               rows: cutlass.Int32, cols: cutlass.Int32, k_tiles: cutlass.Int32, m_tiles: cutlass.Int32,
               n_tiles: cutlass.Int32, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               cluster: cute.Layout, tma_d, gd, d_layouts, split):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.tma_store):
                cpasync.prefetch_descriptor(tma_d)
        crd = cluster.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))

        st = cutlass.memory.SmemAllocator().allocate(self.shared)
        # a stage is free once every consumer warp of every CTA that multicasts into it has released it
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     (self.mcast_a + self.mcast_b - 1) * self.consumers * 4),
            tx_count=self.stage_bytes, cta_layout_vmnk=cute.make_layout((1, *cluster.shape)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)
        sa = st.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sb = st.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        # persistent CTAs walk the shared tile order (kernels/tile_scheduler.py); every role the same tiles, the
        # pipeline state running on across them so a tile's first loads overlap the previous tile's epilogue
        if cutlass.const_expr(self.split_tail):  # walking units (a whole tile, or one K part of a tail tile)
            tiles = SplitTailTiles(m_tiles, n_tiles, split[2], split[3])
        else:
            tiles = PersistentTiles(m_tiles, n_tiles, self.cluster_mn)
        linear = tiles.first()
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        if wg == 0:
            cute.arch.warpgroup_reg_dealloc(self._regs()[0])
            if warp == 0:  # TMA producer
                # A tiles go to the cluster's CTAs of this M row (mode 1), B tiles to those of this N column;
                # each CTA loads its slice of the shared tile and multicasts it.  A CTA past the output's last
                # row or column still loads (TMA zero-fills) and releases: the others wait on its slices.
                mask_a = cute.make_layout_image_mask(cluster, crd, mode=1) if self.mcast_a > 1 else 0
                mask_b = cute.make_layout_image_mask(cluster, crd, mode=0) if self.mcast_b > 1 else 0
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                while tiles.valid(linear):
                    bm, bn, k_range, _ = self._unit(tiles, linear, k_tiles)
                    work = self.tile_work(offs, sched, rows, cols, k_tiles, bm, bn, k_range)
                    gak = cute.local_tile(cute.domain_offset((work.a_row0, work.k0), ga),
                                          (self.TILE_M, self.K_STAGE), (0, None))
                    gbk = cute.local_tile(cute.domain_offset((work.b_row0, work.k0), gb),
                                          (self.n_tile, self.K_STAGE), (0, None))
                    tas, tag = cpasync.tma_partition(tma_a, crd[1], cute.make_layout(self.mcast_a),
                                                     cute.group_modes(sa, 0, 2), cute.group_modes(gak, 0, 2))
                    tbs, tbg = cpasync.tma_partition(tma_b, crd[0], cute.make_layout(self.mcast_b),
                                                     cute.group_modes(sb, 0, 2), cute.group_modes(gbk, 0, 2))
                    for kt in cutlass.range(work.k_tiles, unroll=1):
                        pipe.producer_acquire(state)
                        bar = pipe.producer_get_barrier(state)
                        cute.copy(tma_a, tag[(None, kt)], tas[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=mask_a)
                        cute.copy(tma_b, tbg[(None, kt)], tbs[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=mask_b)
                        pipe.producer_commit(state)
                        state.advance()
                    linear = tiles.next(linear)
                pipe.producer_tail(state)
        else:
            cute.arch.warpgroup_reg_alloc(self._regs()[1])
            sdec = st.sdec.get_tensor(cute.make_layout(2 * self.consumers * self.DEC_WORDS))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            epi = None
            if cutlass.const_expr(self.tma_store):
                d_smem, d_box = d_layouts
                epi = self._epilogue_setup(mma, st.sd.get_tensor(d_smem.outer, swizzle=d_smem.inner),
                                           st.sd.get_tensor(d_box.outer, swizzle=d_box.inner), tma_d, gd, tidx - 128,
                                           st.sd.data_ptr())
            if cutlass.const_expr(self.pingpong):
                if wg == self.consumers:  # the issue token starts with warpgroup 1 (see consume)
                    cute.arch.barrier_arrive(barrier_id=self._token(0), number_of_threads=256)
            while tiles.valid(linear):
                bm, bn, k_range, part = self._unit(tiles, linear, k_tiles)
                unit = None
                if cutlass.const_expr(self.split_tail):
                    unit = (*part, split[0], split[1], st.arrived.get_tensor(cute.make_layout(4)))
                state = self.consume(mma, pipe, state, sa, sb, sdec, sfa_w, sfb_w, d, cols, tidx - 128,
                                     self.tile_work(offs, sched, rows, cols, k_tiles, bm, bn, k_range), bn, epi,
                                     unit)
                linear = tiles.next(linear)
            if cutlass.const_expr(self.pingpong):
                if wg == 1:  # the token the last warpgroup passed after its last stage
                    cute.arch.barrier(barrier_id=self._token(0), number_of_threads=256)
            if cutlass.const_expr(self.tma_store):
                if warp % 4 == 0:  # each warpgroup's issuing warp: no store still reads the staged tile at exit
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _unit(self, tiles, linear: cutlass.Int32, k_tiles: cutlass.Int32):
        """(M tile, N tile, K tile range or None, (part, parts, slot) or None) of the walk's step ``linear``: a
        tile, or with ``split_tail`` a unit (a whole tile, or one K part of a tail tile)."""
        if cutlass.const_expr(self.split_tail):
            t, part, parts, slot = tiles.unit(linear)
            bm, bn = tiles.tile(t)
            return bm, bn, part_k_range(part, parts, k_tiles), (part, parts, slot)
        bm, bn = tiles.tile(linear)
        return bm, bn, None, None

    @cute.jit
    def consume(self, mma: cute.TiledMma, pipe, state, sa: cute.Tensor, sb: cute.Tensor, sdec: cute.Tensor,
                sfa_w: cute.Tensor, sfb_w: cute.Tensor, d: cute.Tensor, cols: cutlass.Int32, ct: cutlass.Int32,
                work: tuple, bn: cutlass.Int32, epi, unit=None):
        """A consumer warpgroup on N tile ``bn`` and the rows of :meth:`tile_work`'s ``work``: all 128 rows x its
        half of the ``n_tile`` columns (two 64-row WGMMAs per K step); returns the pipeline state.  Thread ``t`` of
        warp ``w`` holds the accumulator rows ``64 mi + 16 w + t // 4 (+ 8)`` and the half's columns
        ``8 j + 2 (t % 4) (+ 1)``: fragment element
        ``e + 2 rs + 4 j + (n_tile / 4) mi`` is (row + 8 rs, column 8 j + 2 (t % 4) + e).  Splitting N rather than
        M halves the column scales each thread applies (the promotion's shared-memory reads) and the B tile each
        warpgroup's WGMMAs read.  With ``consumer_split="m"`` the warpgroup holds rows ``64 wgi + 16 w + t // 4
        (+ 8)`` of all ``n_tile`` columns (no ``mi``: element ``e + 2 rs + 4 j``).

        Per 128-deep K stage the warpgroup decodes the stage's scales into shared memory (thread t: tile row t and
        half column t (t < n_tile / 2), one 32-bit word each, loaded a stage ahead; double-buffered, one named
        barrier per stage).  ``block_k=32``: the stage's 4 WGMMAs run one ahead of the promotion (WGMMA b + 1 on
        the tensor cores while the CUDA cores add partial b, times ``sa[row] * sb[col]``, to the accumulator).
        ``block_k=128``: the 4 WGMMAs accumulate into one partial, promoted once with the shared scale while the
        other warpgroup's WGMMAs run; the scales are decoded while the warpgroup's own WGMMAs run.  ``unit``
        (``split_tail``): (part, parts, slot, workspace, counters, shared slot) of the walk's unit: a K part of a
        tail tile stores only when it is the last of its tile to finish (:meth:`_join_parts`)."""
        wgi = ct // 128
        t = ct % 128
        lane = ct % 32
        w = t // 32
        thr = mma.get_slice(wgi * 128)
        fa = mma.make_fragment_A(thr.partition_A(sa))
        fb = mma.make_fragment_B(thr.partition_B(sb))
        acc_shape = thr.partition_C(cute.make_identity_tensor((self.TILE_M, self.n_tile))).shape
        acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        parts = (cute.make_rmem_tensor(acc_shape, cutlass.Float32), cute.make_rmem_tensor(acc_shape, cutlass.Float32))
        acc.fill(0.0)
        k_tiles = work.k_tiles
        rl = w * 16 + lane // 4  # tile row of fragment elements with mi = rs = 0
        c0 = bn * self.n_tile + wgi * self.wg_cols  # the warpgroup's first output column
        if cutlass.const_expr(self.split_m):
            rl = rl + wgi * 64
            c0 = bn * self.n_tile
        col_b = c0 + t  # the column whose scales this thread decodes (t < wg_cols; 1x128 B scales)
        lo_chunks = cutlass.Int32(0)
        if cutlass.const_expr(self.b_block_n == 128):
            # 128 x 128 B blocks: threads 0 and 1 decode the scales of the (at most) two blocks the warpgroup's
            # columns touch; the first lo_chunks 32-column chunks are in the first block
            col_b = (c0 // 128 + t) * 128
            lo_chunks = cutlass.min((c0 // 128 * 128 + 128 - c0) // 32, self.wg_cols // 32)
        # this thread's scale words (row t, column col_b) of stage kt, loaded one stage ahead: the global load's
        # latency hides behind the previous stage's WGMMAs and promotion.  A cluster's CTA past the output's last
        # row / column tile has no blocked scale rows: it reads none (nor does a column past N)
        a_at = work.a_word0 + (t % 32) * 4 + t // 32
        b_at = work.b_word0 + self._scale_word(col_b, work.b_ktiles)
        a_ok = work.a_ok
        b_ok = t < self._b_slots() and col_b < cols
        bw = cutlass.Int32(0)
        aw = cutlass.Int32(0)
        if k_tiles > 0:
            if b_ok:
                bw = cutlass.Int32(sfb_w[b_at])
            if a_ok:
                aw = cutlass.Int32(sfa_w[a_at])
        # the previous tile's last decode buffer may still be read by a slower warp of this warpgroup
        cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)
        words = (bw, aw)
        scale_src = ((sfb_w, sfa_w), (b_ok, a_ok), (b_at, a_at))
        blocks = self.BLOCKS if self.block_k == 32 else 1  # scales decoded per row / column and stage
        for kt in cutlass.range(k_tiles, unroll=1):
            base = ((kt % 2) * self.consumers + wgi) * self.DEC_WORDS
            b_base = base + self.TILE_M * blocks
            if cutlass.const_expr(self.block_k == 32):  # decode first: block 0's promotion follows its WGMMA
                words = self._decode(sdec, base, words, scale_src, t, kt, k_tiles, wgi)
            pipe.consumer_wait(state)
            if cutlass.const_expr(self.block_k == 128):
                if cutlass.const_expr(self.pingpong):  # wait for the token: the other warpgroup's WGMMAs are queued
                    cute.arch.barrier(barrier_id=self._token(wgi), number_of_threads=256)
                warpgroup.fence()
                for blk in cutlass.range_constexpr(self.BLOCKS):
                    mma.set(warpgroup.Field.ACCUMULATE, blk != 0)
                    cute.gemm(mma, parts[0], fa[(None, None, blk, state.index)], fb[(None, None, blk, state.index)],
                              parts[0])
                warpgroup.commit_group()
                if cutlass.const_expr(self.pingpong):  # pass it on
                    cute.arch.barrier_arrive(barrier_id=self._token((wgi + 1) % self.consumers),
                                             number_of_threads=256)
                # the stage's scales are decoded while its WGMMAs run (off the promote -> next issue path)
                words = self._decode(sdec, base, words, scale_src, t, kt, k_tiles, wgi)
                warpgroup.wait_group(0)
                pipe.consumer_release(state)
                if cutlass.const_expr(self.b_block_n == 128):
                    self._promote_blocks(acc, parts[0], self._load_row_scales(sdec, base, rl),
                                         (sdec[b_base], sdec[b_base + 1]), lo_chunks)
                else:
                    self._promote(acc, parts[0], (self._load_row_scales(sdec, base, rl),
                                                  self._load_col_scales(sdec, b_base, lane)))
            else:
                mma.set(warpgroup.Field.ACCUMULATE, False)  # every WGMMA is one MX block: its partial starts at 0
                warpgroup.fence()
                cute.gemm(mma, parts[0], fa[(None, None, 0, state.index)], fb[(None, None, 0, state.index)],
                          parts[0])
                warpgroup.commit_group()
                for blk in cutlass.range_constexpr(self.BLOCKS):
                    if cutlass.const_expr(blk + 1 < self.BLOCKS):
                        nxt = parts[(blk + 1) % 2]
                        warpgroup.fence()
                        cute.gemm(mma, nxt, fa[(None, None, blk + 1, state.index)],
                                  fb[(None, None, blk + 1, state.index)], nxt)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)
                    else:
                        warpgroup.wait_group(0)
                    self._promote(acc, parts[blk % 2], (
                        self._load_row_scales(sdec, base + blk * self.TILE_M, rl),
                        self._load_col_scales(sdec, b_base + blk * 4 * self._col_pitch(), lane)))
                pipe.consumer_release(state)
            state.advance()
        if cutlass.const_expr(self.split_tail):
            if self._join_parts(acc, ct, unit):
                self._epilogue(acc, d, work, bn, ct, epi, rl, c0, lane, cols)
        else:
            self._epilogue(acc, d, work, bn, ct, epi, rl, c0, lane, cols)
        return state

    @cute.jit
    def _epilogue(self, acc: cute.Tensor, d: cute.Tensor, work: tuple, bn: cutlass.Int32, ct: cutlass.Int32, epi,
                  rl: cutlass.Int32, c0: cutlass.Int32, lane: cutlass.Int32, cols: cutlass.Int32):
        """The tile's store (TMA-staged or per thread) of the consumer thread's accumulator ``acc``."""
        wgi = ct // 128
        if cutlass.const_expr(self.tma_store and self.grouping == "m"):
            # 2d-3d: the warpgroup's 64 rows start at a group's first row plus a multiple of 64 (any row of D); a
            # warpgroup past D's last row stores nothing
            r0 = work.d_row0 + wgi * 64
            if r0 < cute.size(d, mode=[0]):
                self._store_tma(acc, epi, r0, bn, ct, (d, work.rows, cols))
        elif cutlass.const_expr(self.tma_store and not self.split_m):
            # 2d-2d: TMA boxes where the tile's 128 rows start on a box row and all are its group's (N % 128 == 0);
            # otherwise the rows past the group's end are the next group's: per-thread stores
            if work.d_row0 % self.TILE_M == 0 and work.d_row0 + self.TILE_M <= work.rows:
                self._store_tma_n(acc, epi, work.d_row0 // self.TILE_M, bn, ct, rl, cols)
            else:
                self._store(acc, d, work.rows, cols, work.d_row0 + rl, c0 + 2 * (lane % 4))
        elif cutlass.const_expr(self.tma_store):
            self._store_tma(acc, epi, work.d_row0 // self.TILE_M, bn, ct)
        else:
            self._store(acc, d, work.rows, cols, work.d_row0 + rl, c0 + 2 * (lane % 4))

    SPLIT_BARRIER = 5  # named barrier of the consumer warpgroups' split join (ids 1-4: decode and issue token)

    @cute.jit
    def _join_parts(self, acc: cute.Tensor, ct: cutlass.Int32, unit) -> cutlass.Boolean:
        """``split_tail``: whether this unit stores its tile, with the tile's accumulator in ``acc`` then.  A whole
        tile (parts 1) stores ``acc`` as it is.  A K part: ``acc`` goes to workspace slot ``slot`` (element ``i`` of
        consumer thread ``ct`` at ``i * 256 + ct``: coalesced), a GPU-scope fence makes it visible, the consumers
        meet, one thread adds 1 to the tile's counter (acq_rel); the part that takes it to ``parts`` resets it and
        sums the tile's parts from the workspace in part order (its own too, read back: one 32-bit register array,
        and the same fp32 sum whichever part arrives last) with L1-bypassing loads."""
        part, parts, slot, ws, flags, arrived = unit
        elems = 2 * self.thr_cols * self.row_frags
        threads = 128 * self.consumers
        last = cutlass.Boolean(True)
        if parts > 1:
            for i in cutlass.range_constexpr(elems):
                ws[(slot * elems + i) * threads + ct] = acc[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=self.SPLIT_BARRIER, number_of_threads=threads)
            tile = slot // parts
            if ct == 0:
                arrived[0] = cute.arch.atomic_add((flags.iterator + tile).llvm_ptr, cutlass.Int32(1), sem="acq_rel",
                                                  scope="gpu")
            cute.arch.barrier(barrier_id=self.SPLIT_BARRIER, number_of_threads=threads)
            last = arrived[0] == parts - 1
            if last:
                if ct == 0:
                    flags[tile] = 0  # for the next launch (stream-ordered after this one)
                cute.arch.fence_acq_rel_gpu()
                for i in cutlass.range_constexpr(elems):
                    acc[i] = cutlass.Float32(0.0)
                first = slot - part
                for p in cutlass.range(parts, unroll=1):
                    for i in cutlass.range_constexpr(elems):
                        at = ws.iterator + ((first + p) * elems + i) * threads + ct
                        acc[i] = acc[i] + cute.arch.load(at.llvm_ptr, cutlass.Float32, sem="relaxed", scope="gpu")
        return last

    @cute.jit
    def _epilogue_setup(self, mma: cute.TiledMma, sd: cute.Tensor, sd_box: cute.Tensor, tma_d: cute.CopyAtom,
                        gd: cute.Tensor, ct: cutlass.Int32, raw):
        """``tma_store``: consumer thread ``ct``'s view of the staged output tile: ``sd`` as ``n_tile / 32``
        sub-tiles of 128 x 32 (``hopper_helpers.make_smem_layout_epi``) that an ``stmatrix`` copy from its
        accumulator fragment writes (``get_smem_store_op``, tiled over the MMA's C layout), and the same memory
        ``sd_box`` as 64 x 32 boxes (sub-tile s, warpgroup w: box 2 s + w) with D's boxes (``gd``, D's TMA
        coordinate tensor) partitioned for the TMA store.  Split N (2d-2d): the staging as 32-bit words from its
        unswizzled pointer ``raw`` (:meth:`_store_tma_n` applies the swizzle itself), its 128 x 32 boxes and D's."""
        if cutlass.const_expr(not self.split_m):  # split N (2d-2d): 32-bit stores into the staging, D's boxes
            s_box, g_box = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sd_box, 0, 2),
                                                 cute.group_modes(cute.local_tile(gd, self.epi_box, (None, None)), 0,
                                                                  2))
            words = cute.make_tensor(cute.recast_ptr(raw, dtype=cutlass.Uint32),  # (raw: the unswizzled pointer)
                                     cute.make_layout(self.TILE_M * self.n_tile // 2))
            return words, s_box, g_box, tma_d
        stsm = sm90.get_smem_store_op(_ROW_MAJOR, self.d_dtype, cutlass.Float32)  # stmatrix 8x8 x4 (bf16)
        r2s = cute.make_tiled_copy_S(stsm, cute.make_tiled_copy_C_atom(stsm, mma))
        thr = r2s.get_slice(ct)
        if cutlass.const_expr(self.grouping == "m"):  # the boxes start on a group's row: D's boxes partitioned per
            # tile (:meth:`_store_tma`), the staging's here
            s_box, _ = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sd_box, 0, 2),
                                             cute.group_modes(cute.local_tile(gd, self.epi_box, (0, None)), 0, 2))
            g_box = (sd_box, gd)
        else:
            s_box, g_box = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sd_box, 0, 2),
                                                 cute.group_modes(cute.local_tile(gd, self.epi_box, (None, None)), 0,
                                                                  2))
        return r2s, thr.partition_D(sd), cute.shape(thr.partition_S(sd))[:3], s_box, g_box, tma_d

    @cute.jit
    def _store_tma(self, acc: cute.Tensor, epi, bm: cutlass.Int32, bn: cutlass.Int32, ct: cutlass.Int32,
                   group=None):
        """``tma_store`` epilogue of output tile (bm, bn), each consumer warpgroup on its own 64 rows (no wait for
        the other, which may still promote its last stage): the previous tile's stores have read its boxes (its
        first warp waits), it writes its rows, converted to bf16, into shared memory (``stmatrix``, all
        ``n_tile / 32`` boxes at once), then its first warp issues their TMA stores and goes on without waiting:
        they drain while the next tile's mainloop runs.  TMA clips rows past M and columns past N.  ``grouping="m"``:
        ``bm`` is the warpgroup's first output row instead (any row: its boxes are partitioned here) and ``group``
        (D, the group's row end, D's columns): boxes whose rows in D are all the group's are TMA-stored; when the
        group ends inside them (rows past its end are the next group's, which a box store would overwrite) the
        warpgroup's threads copy its rows from the staged tile to D instead, predicated on the group's end."""
        r2s, s_d, rd_shape, s_box, g_box, tma_d = epi
        subtiles = self.n_tile // self.EPI_COLS
        wgi = ct // 128
        first = ct % 128 < 32  # the warpgroup's issuing warp
        if first:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)  # (the warpgroup's decode barrier id)
        r_acc = r2s.retile(acc)
        per = cute.size(cute.make_layout(rd_shape))
        for s in cutlass.range_constexpr(subtiles):
            r32 = cute.make_rmem_tensor(rd_shape, cutlass.Float32)
            for v in cutlass.range_constexpr(per):
                r32[v] = r_acc[s * per + v]
            r16 = cute.make_rmem_tensor(rd_shape, self.d_dtype)
            r16.store(r32.load().to(self.d_dtype))
            cute.copy(r2s, r16, s_d[(None, None, None, s)])
        cute.arch.fence_proxy("async.shared", space="cta")  # the generic-proxy writes, seen by the TMA unit
        cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)
        if cutlass.const_expr(self.grouping == "m"):
            d, rows, cols = group
            sd_box, gd = g_box
            if cutlass.min(bm + self.epi_box[0], cute.size(d, mode=[0])) <= rows:  # (TMA clips at D's end)
                if first:
                    _, g_rows = cpasync.tma_partition(
                        tma_d, 0, cute.make_layout(1), cute.group_modes(sd_box, 0, 2),
                        cute.group_modes(cute.local_tile(cute.domain_offset((bm, 0), gd), self.epi_box, (0, None)),
                                         0, 2))
                    for s in cutlass.range_constexpr(subtiles):
                        cute.copy(tma_d, s_box[(None, self.consumers * s + wgi)], g_rows[(None, subtiles * bn + s)])
                    cute.arch.cp_async_bulk_commit_group()
            else:  # the group's last rows: element by element, a warp per 32-column row of a box
                t = ct % 128
                per_thread = self.epi_box[0] * self.epi_box[1] // 128
                for s in cutlass.range_constexpr(subtiles):
                    col0 = (subtiles * bn + s) * self.epi_box[1]
                    for i in cutlass.range_constexpr(per_thread):
                        r = (t + 128 * i) // self.epi_box[1]
                        c = (t + 128 * i) % self.epi_box[1]
                        if bm + r < rows and col0 + c < cols:
                            d[bm + r, col0 + c] = sd_box[r, c, self.consumers * s + wgi]
        elif first:
            for s in cutlass.range_constexpr(subtiles):
                cute.copy(tma_d, s_box[(None, self.consumers * s + wgi)],
                          g_box[(None, self.consumers * bm + wgi, subtiles * bn + s)])
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store_tma_n(self, acc: cute.Tensor, epi, bm: cutlass.Int32, bn: cutlass.Int32, ct: cutlass.Int32,
                     rl: cutlass.Int32, cols: cutlass.Int32):
        """``tma_store`` epilogue of the split-N build (2d-2d) for output tile (bm, bn) (``bm`` in 128-row boxes):
        each consumer warpgroup owns the ``wg_cols / 32`` sub-tiles of its columns.  Its first warp waits until the
        previous tile's stores have read them, the warpgroup writes its accumulator, converted to bf16, a column
        pair per 32-bit store into them (the swizzled layout of :meth:`_configure`), then the first warp TMA-stores
        each 128 x 32 box with columns inside D and goes on: the stores drain while the next tile's mainloop runs.
        Thread
        element ``i`` is at (``rl`` + row offset, the warpgroup's first column + ``2 (lane % 4)`` + column offset)
        (:meth:`_frag_offset`); ``rl`` the tile row of its element 0."""
        words, s_box, g_box, tma_d = epi
        wgi = ct // 128
        lane = ct % 32
        first = ct % 128 < 32  # the warpgroup's issuing warp
        per_wg = self.wg_cols // self.EPI_COLS  # sub-tiles per warpgroup (wg_cols is a multiple of 32)
        sub = self.TILE_M * self.EPI_COLS  # elements per sub-tile
        # the staging's swizzle (make_smem_layout_epi, bf16 128 x 32: TMA's 64-byte swizzle, Swizzle<2,4,3> on
        # byte addresses) XORs byte bits 7-8 into bits 4-5: the 8-column run ``c // 8`` of row ``r`` is stored at
        # run ``(c // 8) ^ ((r >> 1) & 3)``.  All of a thread's rows (``rl`` + 8 rs + 64 mi) share ``(r >> 1) & 3``,
        # so its bf16 pairs lie at one base plus one of 4 run offsets plus compile-time offsets
        x = (rl >> 1) & 3
        base = rl * self.EPI_COLS + 2 * (lane % 4) + per_wg * sub * wgi
        runs = [((r ^ x) << 3) for r in range(4)]
        if first:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)  # (the warpgroup's decode barrier id)
        for mi in cutlass.range_constexpr(self.row_frags):
            for rs in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(self.thr_cols // 2):  # the thread's 8-column runs
                    at = (base + runs[j % 4] + (8 * j) // self.EPI_COLS * sub + (64 * mi + 8 * rs) * self.EPI_COLS)
                    words[at // 2] = pack_bf16x2(acc[self._frag_index(2 * j, mi, rs)],
                                                 acc[self._frag_index(2 * j + 1, mi, rs)])
        cute.arch.fence_proxy("async.shared", space="cta")  # the generic-proxy writes, seen by the TMA unit
        cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)
        if first:
            for s in cutlass.range_constexpr(per_wg):
                box = bn * (self.n_tile // self.EPI_COLS) + per_wg * wgi + s
                if box * self.EPI_COLS < cols:  # (boxes past D's last column hold nothing of D)
                    cute.copy(tma_d, s_box[(None, per_wg * wgi + s)], g_box[(None, bm, box)])
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store(self, acc: cute.Tensor, d: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32,
               row0: cutlass.Int32, col0: cutlass.Int32):
        """Epilogue: the thread's accumulator elements (:meth:`consume`'s layout; element (mi = rs = j = e = 0) at
        (``row0``, ``col0``)) converted to ``d``'s dtype and stored, predicated on the output's edges; bf16 pairs of
        adjacent columns as one 32-bit store when ``cols`` is even."""
        elems = 2 * self.thr_cols * self.row_frags
        paired = cutlass.const_expr(self.d_dtype == cutlass.BFloat16)
        if paired and cols % 2 == 0:
            d2 = cute.make_tensor(cute.recast_ptr(d.iterator, dtype=cutlass.Uint32),
                                  cute.make_layout((rows, cols // 2), stride=(cols // 2, 1)))
            for i0 in cutlass.range_constexpr(0, elems, 2):  # element pairs (e = 0, 1)
                dr, dc = self._frag_offset(i0)
                row, col = row0 + dr, col0 + dc
                if row < rows and col < cols:
                    d2[row, col // 2] = pack_bf16x2(acc[i0], acc[i0 + 1])
        else:
            for i in cutlass.range_constexpr(elems):
                dr, dc = self._frag_offset(i)
                row, col = row0 + dr, col0 + dc
                if row < rows and col < cols:
                    d[row, col] = acc[i].to(self.d_dtype)

    def _frag_offset(self, i: int) -> tuple:
        """(row, column) of accumulator fragment element ``i = e + 2 rs + 4 j + 2 thr_cols mi`` relative to
        element 0 (:meth:`consume`'s layout)."""
        ncol = self.thr_cols
        return 64 * (i // (2 * ncol)) + 8 * ((i // 2) % 2), 8 * ((i % (2 * ncol)) // 4) + i % 2

    def _frag_index(self, q: int, mi: int, rs: int) -> int:
        """Fragment element of the thread's column ``q`` (``8 (q // 2) + 2 (t % 4) + q % 2``), m64 fragment ``mi``
        and row half ``rs`` (the inverse of :meth:`_frag_offset`'s layout)."""
        return q % 2 + 2 * rs + 4 * (q // 2) + 2 * self.thr_cols * mi

    @cute.jit
    def tile_work(self, offs, sched, m: cutlass.Int32, n: cutlass.Int32, k_total: cutlass.Int32,
                  bm: cutlass.Int32, bn: cutlass.Int32, k_range=None):
        """Scheduled M tile ``bm``'s work (every thread computes the same), a :class:`_Work`.  ``m`` / ``n``: the
        A rows and the output columns (per expert / group); ``k_total``: 128-deep K tiles of the operands.

        * dense: row tile bm; ``k_range`` (``split_tail``): its K tiles ``[kb, ke)`` only.
        * ``"m"`` (2d-3d): the groups' tiles then the tail's (:func:`~.mx_math.group_of_tile`); a group's tiles
          start at its first row (the rows past its end are another group's, computed and not stored) and read
          expert g's B rows and scales; a tail tile (rows past ``offs[-1]``) has no K tiles and stores zeros.
        * ``"k"`` (2d-2d): M tiles are (group, row tile) pairs; K is the group's tokens from its 128-aligned first
          column ``sched[0, g]`` (the columns past its end are zeros), its scales the grouped-K blocked layout
          (the group's tiles from ``ceil(rows / 128) * sched[1, g]``, ``ceil(size / 128)`` per row tile); the
          output rows are group g's (G N, K) slice; an empty group has no K tiles and stores zeros."""
        zero = cutlass.Int32(0)
        a_row0 = bm * self.TILE_M
        b_row0 = bn * self.n_tile
        k0 = zero
        k_tiles = k_total
        d_row0 = a_row0
        rows = m
        a_word0 = bm * k_total * 128
        a_ok = a_row0 < m  # whether the tile's rows have blocked scale rows
        b_word0 = zero
        b_ktiles = k_total
        if cutlass.const_expr(self.grouping == "m"):
            g, start, before = group_of_tile(bm, offs, sched)  # the tail: g = groups, start = offs[-1]
            t = bm - before
            a_row0 = start + t * self.TILE_M
            d_row0 = a_row0
            a_word0 = zero
            a_ok = g < cute.size(offs)
            if a_ok:
                rows = cutlass.min(offs[g], m)
                a_word0 = (sched[1, g] + t) * k_total * 128
                b_row0 = g * n + bn * self.n_tile
                b_word0 = g * ((n + 127) // 128) * k_total * 128  # words of one expert's blocked B scales
            else:
                k_tiles = zero
                b_row0 = zero
        if cutlass.const_expr(self.grouping == "k"):
            per_g = (m + self.TILE_M - 1) // self.TILE_M
            g = bm // per_g
            t = bm - g * per_g
            start = group_start(offs, g)
            k_tiles = (offs[g] - start + self.K_STAGE - 1) // self.K_STAGE
            a_row0 = t * self.TILE_M
            k0 = sched[0, g]
            d_row0 = g * m + a_row0
            rows = g * m + m
            if cutlass.const_expr(self.split_halves):
                d_row0, rows = split_half_rows(g, cute.size(offs), m, a_row0)
            a_ok = True
            a_word0 = (per_g * sched[1, g] + t * k_tiles) * 128
            b_word0 = (n + 127) // 128 * sched[1, g] * 128
            b_ktiles = k_tiles
        if cutlass.const_expr(k_range is not None):  # split_tail (dense): K tiles [kb, ke) of the tile
            kb, ke = k_range
            k0 = kb * self.K_STAGE
            k_tiles = ke - kb
            a_word0 = a_word0 + kb * 128  # (the scale word of a row in K tile kt: + 128 kt)
            b_word0 = b_word0 + kb * 128
        return _Work(a_row0, b_row0, k0, k_tiles, d_row0, rows, a_word0, a_ok, b_word0, b_ktiles)

    def _regs(self):
        """setmaxnreg budgets (producer warpgroup, each consumer warpgroup) of this build."""
        return self.REGS_GROUPED_STAGED if self.tma_store and self.grouping == "m" else self.REGS

    def _token(self, wgi):
        """Named barrier passing the WGMMA issue token to consumer warpgroup ``wgi`` (ids 1 .. consumers are the
        warpgroups' scale-decode barriers)."""
        return 1 + self.consumers + wgi

    @cute.jit
    def _scale_word(self, col: cutlass.Int32, k_tiles: cutlass.Int32):
        """Index of the 32-bit blocked-scale word holding the 4 scales of B row (output column) ``col`` in 128-deep
        K tile 0 (tile kt: + 128 kt): its 128-row scale tile, then ``(r % 32) * 4 + r // 32``."""
        r = col % 128
        return (col // 128) * k_tiles * 128 + (r % 32) * 4 + r // 32

    @cute.jit
    def _decode(self, sdec: cute.Tensor, base: cutlass.Int32, words: tuple, scale_src: tuple, t: cutlass.Int32,
                kt: cutlass.Int32, k_tiles: cutlass.Int32, wgi: cutlass.Int32):
        """Decode stage ``kt``'s scale ``words`` (B: the half's column t, A: tile row t) into the warpgroup's
        ``sdec`` buffer at ``base`` (the 128 rows' scales, then the columns' in :meth:`_col_slot` order; per MX
        block with ``block_k=32``), load the words of stage kt + 1 (``scale_src``: the B and A scale word
        tensors, whether this thread reads each word, their stage-0 indices; returned) and wait for the
        warpgroup's other threads (every thread's promotion reads the buffer)."""
        bw, aw = words
        (sfb_w, sfa_w), (b_ok, a_ok), (b_at, a_at) = scale_src
        blocks = self.BLOCKS if self.block_k == 32 else 1
        if t < self._b_slots():  # columns past N decode byte 0 (2^-127): their partials are 0, never NaN
            for blk in cutlass.range_constexpr(blocks):
                sdec[base + self.TILE_M * blocks + blk * 4 * self._col_pitch() + self._col_slot(t)] = \
                    e8m0_to_f32(cutlass.Int32((bw >> (8 * blk)) & 0xFF))
        if a_ok:
            for blk in cutlass.range_constexpr(blocks):
                sdec[base + blk * self.TILE_M + t] = e8m0_to_f32(cutlass.Int32((aw >> (8 * blk)) & 0xFF))
        if kt + 1 < k_tiles:
            if b_ok:
                bw = cutlass.Int32(sfb_w[b_at + (kt + 1) * 128])
            if a_ok:
                aw = cutlass.Int32(sfa_w[a_at + (kt + 1) * 128])
        cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)
        return bw, aw

    def _b_slots(self):
        """Decoded B scales per warpgroup and stage: one per column, or with ``b_block_n=128`` the two blocks'."""
        return 2 if self.b_block_n == 128 else self.wg_cols

    def _col_pitch(self):
        """Words between the column-slot runs of the 4 thread quads (:meth:`_col_slot`): the ``n_tile / 8`` columns
        a thread reads plus 4, so the 4 addresses of a quarter warp's 16-byte loads fall in 4 different bank quads
        (with no padding quads 0 and 2 can share banks, doubling the shared-memory wavefronts)."""
        return self.thr_cols + 4

    def _col_slot(self, col):
        """Slot of the half's column ``col`` among the decoded column scales: the columns a thread reads
        (``8 j + 2 q + e`` for ``q = lane % 4``, ``j < n_tile / 16``, ``e < 2``) are the ``n_tile / 8`` consecutive
        slots from ``q * _col_pitch()`` in the order its fragment holds them, read with 16-byte loads."""
        return ((col % 8) // 2) * self._col_pitch() + (col // 8) * 2 + col % 2

    @cute.jit
    def _load_row_scales(self, sdec: cute.Tensor, a_base: cutlass.Int32, rl: cutlass.Int32):
        """The decoded scales of the thread's 4 accumulator rows (``sdec[a_base:]``), in registers."""
        scale_a = cute.make_rmem_tensor((4,), cutlass.Float32)
        for mi in cutlass.range_constexpr(self.row_frags):
            for rs in cutlass.range_constexpr(2):
                scale_a[2 * mi + rs] = sdec[a_base + 64 * mi + rl + 8 * rs]
        return scale_a

    @cute.jit
    def _load_col_scales(self, sdec: cute.Tensor, b_base: cutlass.Int32, lane: cutlass.Int32):
        """The decoded scales of the thread's ``n_tile / 8`` accumulator columns (from ``sdec[b_base:]`` in
        :meth:`_col_slot` order; ``b_base`` a multiple of 4: 16-byte loads), in registers."""
        ncol = self.thr_cols
        scale_b = cute.make_rmem_tensor((ncol,), cutlass.Float32)
        cute.autovec_copy(cute.make_tensor(sdec.iterator + cute.assume(b_base + (lane % 4) * self._col_pitch(),
                                                                       divby=4), cute.make_layout(ncol)), scale_b)
        return scale_b

    @cute.jit
    def _promote(self, acc: cute.Tensor, part: cute.Tensor, scales: tuple):
        """``acc += part * sa[row] * sb[col]`` with the thread's ``scales``: (row scales, column scales)."""
        scale_a, scale_b = scales
        for q in cutlass.range_constexpr(self.thr_cols):
            for mi in cutlass.range_constexpr(2):
                for rs in cutlass.range_constexpr(2):
                    i = self._frag_index(q, mi, rs)
                    acc[i] = acc[i] + part[i] * (scale_a[2 * mi + rs] * scale_b[q])

    @cute.jit
    def _promote_blocks(self, acc: cute.Tensor, part: cute.Tensor, scale_a: cute.Tensor, scale_b: tuple,
                        lo_chunks: cutlass.Int32):
        """``b_block_n=128``: ``acc += part * (sa[row] * sb)``, sb the first of ``scale_b`` for the warpgroup's
        first ``lo_chunks`` 32-column chunks (the thread's columns ``8 j + ...`` with ``j // 4`` the chunk), the
        second after them: 4 x chunks FMUL per stage, then one FFMA per element."""
        chunks = self.wg_cols // 32
        for c in cutlass.range_constexpr(chunks):
            sb = cutlass.select_(lo_chunks > c, scale_b[0], scale_b[1])
            rs_c = [scale_a[r] * sb for r in range(2 * self.row_frags)]
            for q in cutlass.range_constexpr(8 * c, 8 * c + 8):  # columns 8 (q // 2) + ... of chunk q // 8
                for mi in cutlass.range_constexpr(self.row_frags):
                    for rs in cutlass.range_constexpr(2):
                        i = self._frag_index(q, mi, rs)
                        acc[i] = acc[i] + part[i] * rs_c[2 * mi + rs]


class MXGemmSm90Dequant:
    """MXFP8 GEMM for SM90, *dequantize* mainloop: ``D (M, N) = Σ_k (A[m, k] · sa[m, k // 32]) ·
    (B[n, k] · sb[n, k // 32])`` in fp32, rounded once to ``out_dtype``: the reference's product (OCP MX v1.0
    blocks of 32 along K), with every scaled operand element exact in bf16 (an fp8 value has at most 4 significant
    bits and bf16 has fp32's exponent range; see :func:`~.mx_math.dequant_pair_bf16` for the subnormal corner).

    Operands: A (M, K) and B (N, K) fp8, e4m3 or e5m2 each, K-major; scales the blocked E8M0 buffers of
    ``quantize_rowwise(..., blocked=True)`` (cuBLAS block-scaling layout), read a byte at a time from global memory
    (:func:`~.mx_math.blocked_scale_offset`).

    CTA tile 256 x 128, 64-deep K stages (2 MX blocks).  Warp roles (512 threads with the default
    ``transform_warps=8``, 384 with 4):

    * warpgroup 0 and warpgroup 3 (*transform*, 8 warps; warpgroup 0 only with ``transform_warps=4``): B fp8 ->
      scaled bf16, one MX block of one row per thread and stage, written into a 3-stage ring of 128 x 64 bf16
      tiles in the 128-byte-swizzled layout bf16 WGMMA reads (``PipelineAsync`` to the consumers); their scale
      bytes are prefetched two stages ahead.  Warp 0 also issues the TMA loads of the fp8 A (256 x 64) and B
      (128 x 64) stage tiles (``PipelineTmaAsync``, up to 8 stages, 64-byte swizzle), :attr:`tma_ahead` stages
      ahead of its conversion, where the slot is known to be free (no warp idles as a TMA-only producer and the
      work divides evenly: 256 row blocks per stage);
    * warpgroups 1, 2 (*consumers*, 128 rows each as two 64-row WGMMA tiles): per 32-deep chunk they load their A
      rows from shared memory, scale and convert them into the WGMMA A-operand registers (two register buffers:
      chunk c + 1 is converted while the WGMMAs of chunk c run), and issue ``wgmma.m64n128k16.bf16`` with A from
      registers and B from the bf16 ring, accumulating in fp32 over the whole K.

    The K order inside a stage is permuted the same way for A and B (a GEMM's sum does not depend on the order):
    thread ``t % 4`` of a quad takes the 16 contiguous bytes ``[16 (t % 4), 16 (t % 4) + 16)`` of a row, one MX
    block, so each A load is 8 contiguous bytes and each thread needs one scale per row and stage; logical k
    ``16 j + 2 c + e % 2 + 8 (e // 2)`` of the WGMMA holds physical k ``16 c + 4 j + e`` (``c`` < 4, ``e`` < 4).

    Epilogue: per-thread predicated stores of the fp32 accumulator converted to ``out_dtype``.

    Tiles: persistent CTAs (``max_ctas``, one per SM) walk :class:`.tile_scheduler.PersistentTiles` (the SM100
    kernels' order: bands of 8 M tiles), every role the same sequence; the pipeline states run on across tiles, so
    a tile's first TMA loads and conversions overlap the previous tile's epilogue stores.  The fused epilogues
    stage their tile in the mainloop's shared memory, so those builds run one tile per CTA (the same code, no
    loop).  Token groups map onto the same walk: ``"m"`` M tiles are the groups' tiles plus the tail's
    (:func:`~.mx_math.group_of_tile`), ``"k"`` M tiles are (group, row tile) pairs.

    Constraints (:meth:`can_implement`): K % 32 == 0 (TMA zero-fills past K; the blocked scales' padding is zero),
    16-byte aligned contiguous operands; any M, N >= 1.
    """

    TILE_M = 256
    TILE_N = 128
    K_STAGE = 64
    B_STAGES = 3  # bf16 B ring (2 and 4 measured the same: docs/sm90_gemm.md)
    CONSUMER_WARPS = 8

    STAGE_PITCH = TILE_N + 4  # fp32 words per row of the fused epilogues' accumulator staging tile (16-byte
    #                           row reads by 8 lanes hit 8 different bank quads)

    def __init__(self, a_elem: str, b_elem: str, out_dtype: str = "bfloat16", transform_warps: int = 8,
                 grouping: str = "none", epilogue: str = "plain", cast_elem: str = "e4m3",
                 scale_mode: str = "rceil", emit_hp: bool = False, max_ctas: int = 132):
        if grouping not in ("none", "m", "k"):
            raise ValueError(f"grouping must be 'none' (dense), 'm' (2d-3d) or 'k' (2d-2d), got {grouping!r}")
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if epilogue != "plain" and grouping == "k":
            raise ValueError(f"the fused {epilogue!r} epilogue is for dense or 2d-3d GEMMs, got grouping='k'")
        self.grouping, self.epilogue, self.emit_hp = grouping, epilogue, emit_hp
        if max_ctas < 1:
            raise ValueError(f"max_ctas must be >= 1, got {max_ctas}")
        # persistent CTAs for the plain epilogue; the fused ones stage their tile in the mainloop's shared memory,
        # which the next tile's loads would overwrite, so they run one tile per CTA (no tile loop)
        self.max_ctas, self.persistent = max_ctas, epilogue == "plain"
        self.cast = MXCastParams(cast_elem, scale_mode, blocked=True)  # the fused epilogues' output cast
        self.a_dtype, self.b_dtype, self.d_dtype = gemm_dtypes(a_elem, b_elem, out_dtype)
        if transform_warps not in (4, 8):
            raise ValueError(f"transform_warps must be 4 (warpgroup 0) or 8 (plus warpgroup 3), got "
                             f"{transform_warps}")
        self.a_elem, self.b_elem = a_elem, b_elem
        self.TRANSFORM_THREADS = 32 * transform_warps
        self.THREADS = 384 if transform_warps == 4 else 512
        # setmaxnreg budgets (multiples of 8; 65536 registers per SM shared by the CTA's threads)
        self.regs_consumer = 224 if transform_warps == 4 else 208
        self.regs_other = (65536 - 256 * self.regs_consumer) // (self.THREADS - 256) // 8 * 8

    can_implement = MXGemmSm90.can_implement

    def _configure(self):
        self.tiler = (self.TILE_M, self.TILE_N, self.K_STAGE)
        self.tiled_mma = sm90.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), tiler_mn=(64, self.TILE_N), a_source=warpgroup.OperandSource.RMEM)
        self.a_bytes = self.TILE_M * self.K_STAGE  # fp8: one byte per element
        self.b_bytes = self.TILE_N * self.K_STAGE
        self.bh_bytes = 2 * self.TILE_N * self.K_STAGE
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.stages = min(8, (capacity - 2048 - self.B_STAGES * self.bh_bytes) // (self.a_bytes + self.b_bytes))
        # warp 0 loads stage kt + tma_ahead while it converts stage kt: once every transform warp holds bf16 slot
        # kt, the consumers have released fp8 stage kt - B_STAGES and every transform warp stage kt - B_STAGES
        # (the consumers waited for its bf16 tile), so that stage's slot is free without waiting
        self.tma_ahead = self.stages - self.B_STAGES
        self.a_smem = sm90.make_smem_layout_a(_K_MAJOR, self.tiler, self.a_dtype, self.stages)
        self.b_smem = sm90.make_smem_layout_b(_K_MAJOR, self.tiler, self.b_dtype, self.stages)
        self.bh_smem = sm90.make_smem_layout_b(_K_MAJOR, self.tiler, cutlass.BFloat16, self.B_STAGES)
        # the fused epilogues stage the fp32 tile and the warps' transpose tiles in the fp8 stages (sa, sb)
        staged = self.TILE_M * self.STAGE_PITCH * 4 + self.CONSUMER_WARPS * BLOCK * BLOCK
        if self.epilogue != "plain" and staged > self.stages * (self.a_bytes + self.b_bytes):
            raise ValueError(f"the fused epilogue's {staged}-byte staging needs more fp8 stages than {self.stages}")

    @cute.jit
    def call_swiglu(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, h13: cute.Tensor,
                    q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor, qts: cute.Tensor, hp: cute.Tensor,
                    offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """SwiGLU epilogue (GEMM1, dense): ``b`` = W13 (2I, K) in the interleaved gate/up layout (runs of 64, so
        an N tile is 64 gate + 64 up columns); writes ``h13`` (M, 2I) and h's dual MXFP8 cast: ``q`` (M, I), ``qt``
        (I, Mp), blocked scales ``qs`` / ``qts`` (zero-filled by the caller), ``hp`` (M, I) fp32 when
        ``emit_hp`` (:func:`.gemm_epilogue.swiglu_block`, the SM100 epilogue's code).  ``grouping="m"``: ``a``,
        ``b``, ``offs``, ``sched`` as :meth:`__call__` takes them, ``b`` the experts' W13 back to back; h's
        outputs in the grouped layouts (``q`` and ``qt`` (I, T) zero-filled by the caller, colwise blocks within
        a group); else ``offs`` / ``sched`` are placeholders."""
        self._launch(a, b, sfa, sfb, h13, None, (q, qs, qt, qts, hp), offs, sched, stream)

    @cute.jit
    def call_dswiglu(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, h13: cute.Tensor,
                     q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor, qts: cute.Tensor, hp: cute.Tensor,
                     offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """dSwiGLU epilogue (GEMM3, dense): the accumulator is dh (M, I); reads the saved ``h13`` (M, 2I) and
        writes dh13's dual MXFP8 cast: ``q`` (M, 2I), ``qt`` (2I, Mp), blocked scales (zero-filled), ``hp``
        (M, 2I) when ``emit_hp`` (:func:`.gemm_epilogue.dswiglu_block`).  No D is stored.  Token groups as for
        :meth:`call_swiglu`."""
        self._launch(a, b, sfa, sfb, None, h13, (q, qs, qt, qts, hp), offs, sched, stream)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                 offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """Plain epilogue.  Operands by ``grouping`` (all fp8 K-major, scales 1-D blocked E8M0 bytes, ``d`` row-major):

        * ``"none"``: ``a`` (M, K), ``b`` (N, K), ``d`` (M, N); ``offs`` / ``sched`` unused placeholders.
        * ``"m"`` (2d-3d): ``a`` (T, K) with token groups ``offs`` (E,) int32 cumulative ends; ``b`` (E * N, K), the
          experts' (N, K) weights back to back; ``sfa`` grouped-M blocked, ``sfb`` the E blocked buffers back to
          back; ``d`` (T, N); ``sched`` (2, E) int32: row 0 the cumulative 256-row tile counts of the groups,
          row 1 their first 128-row scale tiles (``formats.group_tile_starts``).
        * ``"k"`` (2d-2d): ``a`` (N, T'), ``b`` (K', T') token-major, every group starting on a 16-aligned token
          (TMA takes 16-byte aligned inner coordinates; the ops layer lays the groups out so); grouped-K blocked
          scales of the T-token operands (``formats.to_blocked_scales_grouped_k``: each group's tiles blocked on
          their own); ``d`` (E * N, K'); ``sched`` (2, E): row 0 the groups' first tokens in ``a`` / ``b``, row 1
          as for ``"m"``.  The group sizes come from ``offs``."""
        self._launch(a, b, sfa, sfb, d, None, (), offs, sched, stream)

    @cute.jit
    def _launch(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d, h13, fused: tuple,
                offs, sched, stream: cuda.CUstream):
        self._configure()
        m, k = a.shape
        n = b.shape[0]
        tma_a, ga, tma_b, gb = _tma_atoms(a, b, self.a_smem, self.b_smem, self.TILE_M, self.TILE_N, self.K_STAGE)

        @cute.struct
        class Shared:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            bbars: cute.struct.MemRange[cutlass.Int64, self.B_STAGES * 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem.outer)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem.outer)], 1024]
            sbh: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self.bh_smem.outer)], 1024]

        self.shared = Shared
        n_e = n  # columns of the output per expert
        m_tiles = (m + self.TILE_M - 1) // self.TILE_M
        if cutlass.const_expr(self.grouping == "m"):  # a bound on the groups' tiles plus the tail's (rows >= offs[-1])
            if cutlass.const_expr(d is None):
                n_e = h13.shape[1] // 2  # dSwiGLU: dh has I columns
            else:
                n_e = d.shape[1]
            m_tiles = m // self.TILE_M + cute.size(offs) + 1
        if cutlass.const_expr(self.grouping == "k"):  # (group, row tile) pairs
            m_tiles = cute.size(offs) * m_tiles
        n_tiles = (n_e + self.TILE_N - 1) // self.TILE_N
        clusters = m_tiles * n_tiles  # one tile per CTA
        if cutlass.const_expr(self.persistent):
            clusters = grid_clusters(m_tiles, n_tiles, (1, 1), self.max_ctas)
        grid = (1, 1, clusters)
        self.kernel(self.tiled_mma, tma_a, ga, tma_b, gb, sfa, sfb, d, h13, fused, offs, sched, m, n, k, n_e,
                    m_tiles, n_tiles, self.a_smem, self.b_smem, self.bh_smem).launch(
            grid=grid, block=[self.THREADS, 1, 1], smem=Shared.size_in_bytes(), stream=stream)

    @cute.jit
    def tile_work(self, offs: cute.Tensor, sched: cute.Tensor, n_e: cutlass.Int32, m: cutlass.Int32,
                  n: cutlass.Int32, k: cutlass.Int32, bm: cutlass.Int32, bn: cutlass.Int32, bz: cutlass.Int32):
        """This CTA's work (every thread computes the same): TMA rows of A and B and first k, stage count, the
        output rows (``d_row0`` .. limit ``rows``, columns < ``cols``), the A scale rows (``sa_base`` + local row,
        clamped below ``sa_rows``; ``tiles_ka`` 128-deep tiles per 128-row scale tile, plus column tile ``ct0``),
        the B scale byte offset of the tile, and the valid k of the last stage (``"k"`` grouping).  A CTA with
        ``k_tiles == 0`` stores zeros: the rows past ``offs[-1]`` (``"m"``) or an empty group's dW (``"k"``)."""
        zero = cutlass.Int32(0)
        a_row0 = bm * self.TILE_M
        b_row0 = bn * self.TILE_N
        k0 = zero
        k_tiles = (k + self.K_STAGE - 1) // self.K_STAGE
        k_last = cutlass.Int32(self.K_STAGE)
        d_row0 = a_row0
        rows = m
        cols = n
        tiles_ka = (k // 32 + 3) // 4
        sa_rows = (m + 127) // 128 * 128
        ct0 = zero
        sb_off = bn * tiles_ka * 512
        sa_base = a_row0
        if cutlass.const_expr(self.grouping == "m"):
            groups = cute.size(offs)
            cols = n_e
            per_expert = (cols + 127) // 128 * tiles_ka * 512  # bytes of one expert's blocked B scales
            sa_rows = (m // 128 + groups) * 128  # formats.grouped_scale_tiles
            g, start, before = group_of_tile(bm, offs, sched)  # the tail: g = groups, start = offs[-1]
            t = bm - before
            a_row0 = start + t * self.TILE_M
            if g < groups:
                rows = cutlass.min(offs[g], m)
                sa_base = sched[1, g] * 128 + t * self.TILE_M
                b_row0 = g * cols + bn * self.TILE_N
                sb_off = g * per_expert + bn * tiles_ka * 512
            else:  # the tail: rows past the last group's end are zero
                k_tiles = zero
                sa_base = zero
            d_row0 = a_row0
        if cutlass.const_expr(self.grouping == "k"):
            start = zero
            if bz > 0:
                start = offs[bz - 1]
            size = offs[bz] - start
            k0 = sched[0, bz]  # the group's first token in the operands (16-aligned: TMA's inner coordinate)
            k_tiles = (size + self.K_STAGE - 1) // self.K_STAGE
            k_last = size - (k_tiles - 1) * self.K_STAGE
            # grouped-K scales (mx_math.grouped_k_scale_offset): the group's (rows, 4 tiles_ka) matrix blocked on
            # its own from tile ceil(rows / 128) * group_tile_starts[g], for A (m rows) and B (n rows)
            tiles_ka = (size + 127) // 128
            ct0 = (m + 127) // 128 * sched[1, bz]
            sb_off = (bn * tiles_ka + (n + 127) // 128 * sched[1, bz]) * 512
            d_row0 = bz * m + a_row0
            rows = bz * m + m
        return a_row0, b_row0, k0, k_tiles, k_last, d_row0, rows, cols, sa_base, sa_rows, tiles_ka, ct0, sb_off

    @cute.jit
    def k_masks(self, kt: cutlass.Int32, k_tiles: cutlass.Int32, k_last: cutlass.Int32, c: cutlass.Int32):
        """``"k"`` grouping: byte masks for a thread's 16 bytes ``[16 c, 16 c + 16)`` of a stage's row (low 8,
        high 8): the bytes at k past the group's end (the next group's tokens, which TMA loaded) become 0."""
        valid = cutlass.Int32(self.K_STAGE)
        if kt == k_tiles - 1:
            valid = k_last
        v = cutlass.max(cutlass.min(valid - 16 * c, cutlass.Int32(16)), cutlass.Int32(0))
        vh = cutlass.max(v - 8, cutlass.Int32(0))
        ones = cutlass.Uint64(0xFFFFFFFFFFFFFFFF)
        one = cutlass.Uint64(1)
        lo = cutlass.select_(v >= 8, ones, (one << cutlass.Uint64(8 * cutlass.min(v, cutlass.Int32(7)))) - one)
        hi = cutlass.select_(vh >= 8, ones, (one << cutlass.Uint64(8 * cutlass.min(vh, cutlass.Int32(7)))) - one)
        return lo, hi

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, ga: cute.Tensor, tma_b: cute.CopyAtom,
               gb: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d, h13, fused: tuple, offs, sched,
               m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, n_e: cutlass.Int32, m_tiles: cutlass.Int32,
               n_tiles: cutlass.Int32, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               bh_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        st = cutlass.memory.SmemAllocator().allocate(self.shared)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,  # one arrival per warp
                                                     self.CONSUMER_WARPS + self.TRANSFORM_THREADS // 32),
            tx_count=self.a_bytes + self.b_bytes)
        pipe_b = pipeline.PipelineAsync.create(
            barrier_storage=st.bbars.data_ptr(), num_stages=self.B_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.TRANSFORM_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.CONSUMER_WARPS))
        # raw views for the hand-addressed loads and stores (byte offsets computed with the swizzles spelled out)
        sa8 = cute.make_tensor(cute.recast_ptr(st.sa.data_ptr(), dtype=cutlass.Uint64),
                               cute.make_layout(self.stages * self.a_bytes // 8))
        sb8 = cute.make_tensor(cute.recast_ptr(st.sb.data_ptr(), dtype=cutlass.Uint64),
                               cute.make_layout(self.stages * self.b_bytes // 8))
        sbh64 = cute.make_tensor(cute.recast_ptr(st.sbh.data_ptr(), dtype=cutlass.Uint64),
                                 cute.make_layout(self.B_STAGES * self.bh_bytes // 8))
        # every role walks the same tiles (kernels/tile_scheduler.py); the pipeline states run on across tiles, so
        # the TMA loads and conversions of a tile's first stages overlap the previous tile's epilogue
        tiles = PersistentTiles(m_tiles, n_tiles, (1, 1))
        per_e = (m + self.TILE_M - 1) // self.TILE_M  # "k": row tiles per group
        linear = tiles.first()
        work = (offs, sched, n_e, m, n, k, per_e)
        if wg == 0 or wg == 3:
            cute.arch.warpgroup_reg_dealloc(self.regs_other)
            sa = st.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            sb = st.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            bstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.B_STAGES)
            smem = (sa, sb, sb8, sbh64)
            tt = tidx if wg == 0 else tidx - 256  # transform thread: warps 0-3 are 0-127, warpgroup 3 128-255
            if cutlass.const_expr(self.persistent):
                while tiles.valid(linear):
                    state, bstate = self.transform_tile(tiles, linear, work, pipe, pipe_b, state, bstate, smem,
                                                        (tma_a, ga, tma_b, gb), sfb, tt)
                    linear = tiles.next(linear)
            else:  # one tile per CTA (the fused epilogues): no loop, no registers held across tiles
                self.transform_tile(tiles, linear, work, pipe, pipe_b, state, bstate, smem, (tma_a, ga, tma_b, gb),
                                    sfb, tt)
        else:
            cute.arch.warpgroup_reg_alloc(self.regs_consumer)
            sbh = st.sbh.get_tensor(bh_smem.outer, swizzle=bh_smem.inner)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            bstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.B_STAGES)
            brel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.B_STAGES)
            epi = (st.sa.data_ptr(), h13, fused)
            if cutlass.const_expr(self.persistent):
                while tiles.valid(linear):
                    state, bstate, brel = self.consume_tile(tiles, linear, work, mma, pipe, pipe_b, state, bstate,
                                                            brel, sa8, sbh, sfa, d, tidx - 128, epi)
                    linear = tiles.next(linear)
            else:
                self.consume_tile(tiles, linear, work, mma, pipe, pipe_b, state, bstate, brel, sa8, sbh, sfa, d,
                                  tidx - 128, epi)

    @cute.jit
    def transform_tile(self, tiles: PersistentTiles, linear: cutlass.Int32, work: tuple, pipe, pipe_b, state, bstate,
                       smem: tuple, tma: tuple, sfb: cute.Tensor, tt: cutlass.Int32):
        """The transform warps' work on scheduled tile ``linear`` (none for a tile without K tiles)."""
        offs, sched, n_e, m, n, k, per_e = work
        sa, sb, sb8, sbh64 = smem
        tma_a, ga, tma_b, gb = tma
        bm, bn, bz = self.tile_coords(tiles, linear, per_e)
        a_row0, b_row0, k0, k_tiles, k_last, _, _, _, _, _, tiles_ka, _, sb_off = \
            self.tile_work(offs, sched, n_e, m, n, k, bm, bn, bz)
        if k_tiles > 0:
            gak = cute.local_tile(cute.domain_offset((a_row0, k0), ga), (self.TILE_M, self.K_STAGE), (0, None))
            gbk = cute.local_tile(cute.domain_offset((b_row0, k0), gb), (self.TILE_N, self.K_STAGE), (0, None))
            tas, tag = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sa, 0, 2),
                                             cute.group_modes(gak, 0, 2))
            tbs, tbg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sb, 0, 2),
                                             cute.group_modes(gbk, 0, 2))
            state, bstate = self.transform(pipe, pipe_b, state, bstate, sb8, sbh64, sfb, k_tiles, k_last, sb_off,
                                           tiles_ka, tt, (tma_a, tag, tas, tma_b, tbg, tbs))
        return state, bstate

    @cute.jit
    def consume_tile(self, tiles: PersistentTiles, linear: cutlass.Int32, work: tuple, mma: cute.TiledMma, pipe,
                     pipe_b, state, bstate, brel, sa8: cute.Tensor, sbh: cute.Tensor, sfa: cute.Tensor, d,
                     ct: cutlass.Int32, epi: tuple):
        """The consumer warpgroups' work on scheduled tile ``linear``: mainloop and epilogue."""
        offs, sched, n_e, m, n, k, per_e = work
        base, h13, fused = epi
        bm, bn, bz = self.tile_coords(tiles, linear, per_e)
        _, _, _, k_tiles, k_last, d_row0, rows, cols, sa_base, sa_rows, tiles_ka, ct0, _ = \
            self.tile_work(offs, sched, n_e, m, n, k, bm, bn, bz)
        return self.consume(mma, pipe, pipe_b, state, bstate, brel, sa8, sbh, sfa, d, k_tiles, k_last, ct, sa_base,
                            sa_rows, tiles_ka, ct0, d_row0, rows, cols, bn, (base, h13, fused, offs, sched, bm, m))

    @cute.jit
    def tile_coords(self, tiles: PersistentTiles, linear: cutlass.Int32, per_e: cutlass.Int32):
        """Scheduled tile ``linear`` -> (M tile, N tile, group) as :meth:`tile_work` takes them: for ``"k"`` the
        scheduler's M tiles are (group, row tile) pairs, ``per_e`` row tiles per group."""
        mt, nt = tiles.tile(linear)
        bz = cutlass.Int32(0)
        if cutlass.const_expr(self.grouping == "k"):
            bz = mt // per_e
            mt = mt - bz * per_e
        return mt, nt, bz

    @cute.jit
    def transform(self, pipe, pipe_b, state, bstate, sb8: cute.Tensor, sbh64: cute.Tensor, sfb: cute.Tensor,
                  k_tiles: cutlass.Int32, k_last: cutlass.Int32, sb_off: cutlass.Int32, tiles_k: cutlass.Int32,
                  tt: cutlass.Int32, tma: tuple):
        """The transform warps (warp 0, which also issues the TMA loads, warps 1-3, and warpgroup 3 when there
        are 8): per stage, B's 128 rows x 2 MX blocks (item ``it``: row ``it // 2``, block ``p = it % 2``, the 32
        bytes ``[32 p, 32 p + 32)`` of the row) -> scaled bf16 at the permuted logical k of the class docstring.
        An item's two 16-byte pieces ``c = 2 p, 2 p + 1`` fill 4 consecutive bf16 of each of the 8 sixteen-byte
        chunks of the row's bf16 tile: one 64-bit store per chunk; the 128-byte swizzle puts the 8 rows of a warp
        store in 8 different chunks (2 wavefronts for 256 bytes, the minimum).  ``sb_off``: the byte offset of
        the tile's first scale (row 0, block 0) in ``sfb``."""
        reps = 2 * self.TILE_N // self.TRANSFORM_THREADS
        row_step = self.TRANSFORM_THREADS // 2  # rows between a thread's items; a multiple of 8, so the swizzle
        p = tt % 2                               # phases (row % 8, (row >> 1) % 4) are per thread
        n0 = tt // 2
        src0 = [(n0 * 64 + (((2 * p + i) ^ ((n0 >> 1) & 3)) << 4)) >> 3 for i in range(2)]  # u64, 64B swizzle
        dst0 = [(n0 * 128 + ((ch ^ (n0 % 8)) << 4) + 8 * p) >> 3 for ch in range(8)]  # u64 index, 128B swizzle
        srow = [(sb_off + ((n0 + row_step * r) % 32) * 16 + ((n0 + row_step * r) // 32) * 4)
                for r in range(reps)]  # blocked_scale_offset's row part (rows < 128 of this N tile)

        def block_part(kb):  # kb >= 0: shifts, not signed division
            return (kb >> 2) * 512 + (kb & 3)

        if tt < 32:  # warp 0: the first stages' TMA loads; each later one is issued self.tma_ahead stages ahead
            for s in cutlass.range(cutlass.min(k_tiles, cutlass.Int32(self.tma_ahead)), unroll=1):
                self.tma_load(pipe, state.count + s, s, tma)
        # scale bytes two stages ahead, issued after the stage's proxy fence (which waits for this thread's
        # outstanding loads): stage kt's bytes, loaded during stage kt - 2, are long there.  The loop is unrolled
        # by two so the two register sets alternate without moves (a move would wait for its load).
        ra = self.scale_loads(sfb, srow, block_part(p))
        rb = self.scale_loads(sfb, srow, block_part(cutlass.min(2, 2 * k_tiles - 2) + p))
        for kt2 in cutlass.range(k_tiles // 2, unroll=1):
            kt = 2 * kt2
            self.transform_stage(pipe, pipe_b, state, bstate, sb8, sbh64, src0, dst0, ra, row_step, kt, k_tiles,
                                 k_last, p, tt, tma)
            ra = self.scale_loads(sfb, srow, block_part(cutlass.min(kt + 2, k_tiles - 1) * 2 + p))
            state.advance()
            bstate.advance()
            self.transform_stage(pipe, pipe_b, state, bstate, sb8, sbh64, src0, dst0, rb, row_step, kt + 1,
                                 k_tiles, k_last, p, tt, tma)
            rb = self.scale_loads(sfb, srow, block_part(cutlass.min(kt + 3, k_tiles - 1) * 2 + p))
            state.advance()
            bstate.advance()
        if k_tiles % 2 == 1:
            self.transform_stage(pipe, pipe_b, state, bstate, sb8, sbh64, src0, dst0, ra, row_step, k_tiles - 1,
                                 k_tiles, k_last, p, tt, tma)
            state.advance()
            bstate.advance()
        return state, bstate

    @cute.jit
    def tma_load(self, pipe, s: cutlass.Int32, kt: cutlass.Int32, tma: tuple):
        """Warp 0: K tile ``kt`` of the tile's A and B into the CTA's ``s``-th fp8 stage (counted over all its
        tiles: slot ``s % stages``, the producer state built from ``s``)."""
        tma_a, tag, tas, tma_b, tbg, tbs = tma
        q = s // self.stages
        state = pipeline.PipelineState(self.stages, s, s - q * self.stages, (q % 2) ^ 1)
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(tma_a, tag[(None, kt)], tas[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tbg[(None, kt)], tbs[(None, state.index)], tma_bar_ptr=bar)
        pipe.producer_commit(state)

    @cute.jit
    def scale_loads(self, sf: cute.Tensor, srow: list, kb_part: cutlass.Int32):
        """The scale bytes ``sf[srow[r] + kb_part]`` as Int32."""
        return [cutlass.Int32(sf[srow[r] + kb_part]) for r in range(len(srow))]

    @cute.jit
    def transform_stage(self, pipe, pipe_b, state, bstate, sb8: cute.Tensor, sbh64: cute.Tensor, src0: list,
                        dst0: list, scales: list, row_step: cutlass.Constexpr[int], kt: cutlass.Int32,
                        k_tiles: cutlass.Int32, k_last: cutlass.Int32, p: cutlass.Int32, tt: cutlass.Int32,
                        tma: tuple):
        """One stage of the transform warps: wait for the fp8 stage and a free bf16 slot (warp 0 then issues the
        TMA loads of stage ``kt + tma_ahead``: every warp has released stage ``kt - 3`` by now, see
        :attr:`tma_ahead`), convert, fence, hand over."""
        if cutlass.const_expr(self.grouping == "k"):
            masks = [self.k_masks(kt, k_tiles, k_last, 2 * p + i) for i in range(2)]
        pipe.consumer_wait(state)
        pipe_b.producer_acquire(bstate)
        if tt < 32:
            if kt + self.tma_ahead < k_tiles:
                self.tma_load(pipe, state.count + self.tma_ahead, kt + self.tma_ahead, tma)
        src = [x + state.index * (self.b_bytes >> 3) for x in src0]
        dst = [x + bstate.index * (self.bh_bytes >> 3) for x in dst0]
        for r in cutlass.range_constexpr(len(scales)):
            factor = e8m0_bf16x2(scales[r])
            words = []
            for i in cutlass.range_constexpr(2):  # piece c = 2 p + i: physical k 16 c + 4 j + e
                w01 = sb8[src[i] + r * row_step * 8]
                w23 = sb8[src[i] + r * row_step * 8 + 1]
                if cutlass.const_expr(self.grouping == "k"):
                    w01 = w01 & masks[i][0]
                    w23 = w23 & masks[i][1]
                words.append((cutlass.Uint32(w01 & 0xFFFFFFFF), cutlass.Uint32(w01 >> 32),
                              cutlass.Uint32(w23 & 0xFFFFFFFF), cutlass.Uint32(w23 >> 32)))
            for j in cutlass.range_constexpr(4):  # bytes 4j..4j+3 -> logical k 16j + 2c (+1), +8 (+1): chunk 2j + half
                for half in cutlass.range_constexpr(2):
                    lo = dequant_pair_bf16(words[0][j], factor, self.b_elem, half == 1)
                    hi = dequant_pair_bf16(words[1][j], factor, self.b_elem, half == 1)
                    sbh64[dst[2 * j + half] + r * row_step * 16] = (cutlass.Uint64(hi) << 32) | cutlass.Uint64(lo)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy stores -> WGMMA (async proxy)
        pipe_b.producer_commit(bstate)
        pipe.consumer_release(state)

    @cute.jit
    def consume(self, mma: cute.TiledMma, pipe, pipe_b, state, bstate, brel, sa8: cute.Tensor, sbh: cute.Tensor,
                sfa: cute.Tensor,
                d: cute.Tensor, k_tiles: cutlass.Int32, k_last: cutlass.Int32, ct: cutlass.Int32,
                sa_base: cutlass.Int32, sa_rows: cutlass.Int32, tiles_k: cutlass.Int32, ct0: cutlass.Int32,
                d_row0: cutlass.Int32, rows: cutlass.Int32, cols: cutlass.Int32, bn: cutlass.Int32, epi: tuple):
        """A consumer warpgroup: rows ``128 wg + 64 h + 16 w + t // 4 (+ 8)`` (h = 0, 1) of the tile, all 128
        columns.  WGMMA A-fragment register ``v1 + 2 v2 + 4 kk`` (as bf16 pairs) is row ``+ 8 v1``, logical k
        ``16 kk + 2 (t % 4) + 8 v2`` of the chunk's two k16 steps; accumulator element ``e + 2 rs + 4 q`` is
        (row + 8 rs, column 8 q + 2 (t % 4) + e)."""
        wgi = ct // 128
        t = ct % 128
        lane = ct % 32
        w = t // 32
        c = lane % 4
        thr = mma.get_slice(t)
        fb = mma.make_fragment_B(thr.partition_B(sbh))
        acc_shape = thr.partition_shape_C((64, self.TILE_N))
        accs = [cute.make_rmem_tensor(acc_shape, cutlass.Float32) for _ in range(2)]
        for h in cutlass.range_constexpr(2):
            accs[h].fill(0.0)
        fas = [[mma.make_fragment_A(thr.partition_shape_A((64, 32))) for _ in range(2)] for _ in range(2)]
        fa32 = [[cute.recast_tensor(x, cutlass.Uint32) for x in bufs] for bufs in fas]
        local = [[128 * wgi + 64 * h + 16 * w + lane // 4 + 8 * v1 for v1 in range(2)] for h in range(2)]
        mma.set(warpgroup.Field.ACCUMULATE, True)
        # scale bytes one stage ahead (the global loads of stage kt + 1 fly while stage kt runs); branch-free: rows
        # past the scale buffer read its last row (their A rows are TMA zero fill or another group's and are never
        # stored), the last stage reloads its own bytes
        lrows = [local[q // 2][q % 2] for q in range(4)]
        grows = [cutlass.min(sa_base + lr, sa_rows - 1) for lr in lrows]
        srow = [((r // 128) * tiles_k + ct0) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 for r in grows]
        src_row = [(lr * 64 + ((c ^ ((lr >> 1) & 3)) << 4)) >> 3 for lr in lrows]  # u64 index, stage 0 (64B swizzle)

        def block_part(kb):  # kb >= 0: shifts, not signed division
            return (kb >> 2) * 512 + (kb & 3)

        nxt = [cutlass.Int32(sfa[srow[q] + block_part(c // 2)]) for q in range(4)]
        for kt in cutlass.range(k_tiles, unroll=1):
            factors = [[e8m0_bf16x2(nxt[2 * h + v1]) for v1 in range(2)] for h in range(2)]
            kb_next = block_part(cutlass.min(2 * kt + 2, 2 * k_tiles - 2) + c // 2)
            for q in cutlass.range_constexpr(4):
                nxt[q] = cutlass.Int32(sfa[srow[q] + kb_next])
            if cutlass.const_expr(self.grouping == "k"):
                masks = self.k_masks(kt, k_tiles, k_last, c)
            pipe.consumer_wait(state)
            base = state.index * (self.a_bytes >> 3)
            for i in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    for v1 in cutlass.range_constexpr(2):
                        w64 = sa8[base + src_row[2 * h + v1] + i]
                        if cutlass.const_expr(self.grouping == "k"):
                            w64 = w64 & masks[i]
                        lo = cutlass.Uint32(w64 & 0xFFFFFFFF)
                        hi = cutlass.Uint32(w64 >> 32)
                        f = factors[h][v1]
                        fa32[i][h][v1] = dequant_pair_bf16(lo, f, self.a_elem, False)
                        fa32[i][h][v1 + 2] = dequant_pair_bf16(lo, f, self.a_elem, True)
                        fa32[i][h][v1 + 4] = dequant_pair_bf16(hi, f, self.a_elem, False)
                        fa32[i][h][v1 + 6] = dequant_pair_bf16(hi, f, self.a_elem, True)
                if cutlass.const_expr(i == 1):
                    pipe.consumer_release(state)  # this warpgroup's A reads of the stage are done
                else:
                    pipe_b.consumer_wait(bstate)  # B is needed from here on: A's first chunk converts meanwhile
                warpgroup.fence()
                for h in cutlass.range_constexpr(2):
                    for kk in cutlass.range_constexpr(2):
                        cute.gemm(mma, accs[h], fas[i][h][(None, None, kk)],
                                  fb[(None, None, 2 * i + kk, bstate.index)], accs[h])
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # the previous chunk's WGMMAs are done: its A registers are free
                if cutlass.const_expr(i == 0):
                    if kt > 0:
                        pipe_b.consumer_release(brel)  # ... and so is the previous stage's bf16 B tile
                        brel.advance()
            state.advance()
            bstate.advance()
        warpgroup.wait_group(0)
        if k_tiles > 0:  # the tile's last bf16 B slot (the loop released the others one stage late)
            pipe_b.consumer_release(brel)
            brel.advance()

        if cutlass.const_expr(self.epilogue != "dswiglu"):
            self.store(accs, d, rows, cols, d_row0 + local[0][0], bn * self.TILE_N + 2 * c)
        if cutlass.const_expr(self.epilogue != "plain"):
            base, h13, fused, offs, sched, bm, m = epi
            lrow = [local[h][0] for h in range(2)]
            if cutlass.const_expr(self.grouping == "none"):
                self.fused_epilogue(accs, base, h13, fused, ct, lane, lrow, c, d_row0, bn, rows, cols, None)
            else:  # the group found again (not kept live through the mainloop: it would spill)
                g, start, _ = group_of_tile(bm, offs, sched)
                if g < cute.size(offs):  # the tail tiles past offs[-1] have no h rows (q, qt zero-filled)
                    grp = (start, sched[1, g] * 128)
                    self.fused_epilogue(accs, base, h13, fused, ct, lane, lrow, c, d_row0, bn, rows, cols, grp)
        return state, bstate, brel

    @cute.jit
    def fused_epilogue(self, accs, base, h13, fused: tuple, ct: cutlass.Int32, lane: cutlass.Int32, lrow: list,
                       c: cutlass.Int32, row_base: cutlass.Int32, bn: cutlass.Int32, rows: cutlass.Int32,
                       cols: cutlass.Int32, grp):
        """SwiGLU / dSwiGLU + dual MXFP8 cast of the accumulator tile, by the 8 consumer warps.

        The mainloop's shared memory is free once both consumer warpgroups are past it (every TMA stage and bf16
        B slot consumed): the fp32 tile (256 x 128, rows of :attr:`STAGE_PITCH` words) is staged there, then warp
        ``cw`` takes tile rows ``[32 cw, 32 cw + 32)`` one 32 x 32 block at a time with lane ``l`` holding row
        ``32 cw + l``: the fragment :mod:`.gemm_epilogue` works on (so the very code of the SM100 epilogue and of
        its H200 check runs here), with a 1 KB fp8 transpose tile per warp after the staging tile.  Rows past M
        are zero in the accumulator (TMA zero-fills A), the padding the colwise blocks need; with token groups
        (``grp``, see :func:`.gemm_epilogue.dual_quantize_block`) tile row 0 is global row ``row_base``, a group
        start plus a multiple of 256, and the rows from the group's end (``rows``; the next group's tokens times
        this expert's weights) are read as zeros."""
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * self.CONSUMER_WARPS)  # mainloop smem reads done
        stg = cute.make_tensor(cute.recast_ptr(base, dtype=cutlass.Float32),
                               cute.make_layout((self.TILE_M, self.TILE_N), stride=(self.STAGE_PITCH, 1)))
        for h in cutlass.range_constexpr(2):
            for q in cutlass.range_constexpr(self.TILE_N // 8):
                for rs in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        stg[lrow[h] + 8 * rs, 8 * q + 2 * c + e] = accs[h][e + 2 * rs + 4 * q]
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * self.CONSUMER_WARPS)
        cw = ct // 32
        tr_ptr = cute.recast_ptr(base + self.TILE_M * self.STAGE_PITCH * 4 + cw * BLOCK * BLOCK,
                                 dtype=self.cast.elem_dtype)
        tr = cute.make_tensor(tr_ptr, cute.make_layout((BLOCK, BLOCK), stride=(BLOCK, 1)))
        row = BLOCK * cw + lane
        m = row_base + row
        live = m < rows  # grouped: the rows of this tile's group
        if cutlass.const_expr(self.epilogue == "swiglu"):
            for cb in cutlass.range_constexpr(GATE_UP_TILE // BLOCK):  # h columns 64 bn + 32 cb, gate | up
                g = self.staged_block(stg, row, BLOCK * cb, live)
                u = self.staged_block(stg, row, GATE_UP_TILE + BLOCK * cb, live)
                swiglu_block(g, u, fused, tr, m, bn * GATE_UP_TILE + BLOCK * cb, lane, rows, cols // 2, self.cast,
                             self.emit_hp, grp)
        else:
            for cb in cutlass.range_constexpr(self.TILE_N // BLOCK):  # dh columns 128 bn + 32 cb
                dh = self.staged_block(stg, row, BLOCK * cb, live)
                dswiglu_block(dh, h13, fused, tr, m, bn * self.TILE_N + BLOCK * cb, lane, rows, cols, self.cast,
                              self.emit_hp, grp)

    @cute.jit
    def staged_block(self, stg: cute.Tensor, row: cutlass.Int32, c0: cutlass.Int32, live):
        """The 32 fp32 values ``stg[row, c0:c0 + 32]`` as a TensorSSA (grouped: zeros unless ``live``)."""
        frag = cute.make_rmem_tensor((BLOCK,), cutlass.Float32)
        for j in cutlass.range_constexpr(BLOCK):
            frag[j] = stg[row, c0 + j]
        if cutlass.const_expr(self.grouping == "m"):
            if not live:
                frag.fill(0.0)
        return frag.load()

    @cute.jit
    def store(self, accs, d: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32, row0: cutlass.Int32,
              col0: cutlass.Int32):
        """Epilogue: accumulator element pairs (columns ``col0 + 8 q``, ``+ 1``) stored as one 32-bit (bf16) or
        64-bit (fp32) word where N is even (row starts stay aligned), element by element otherwise; predicated on
        M and N.  The SwiGLU epilogue's h13 always has an even N (2I, I % 64 == 0): the element path is not built
        there (it would only add register pressure)."""
        if cutlass.const_expr(self.epilogue == "swiglu"):
            self.store_pairs(accs, d, rows, cols, row0, col0)
        elif cols % 2 == 0:
            self.store_pairs(accs, d, rows, cols, row0, col0)
        else:
            for h in cutlass.range_constexpr(2):
                for q in cutlass.range_constexpr(self.TILE_N // 4):
                    col = col0 + 8 * (q // 2) + q % 2
                    for rs in cutlass.range_constexpr(2):
                        row = row0 + 64 * h + 8 * rs
                        if row < rows and col < cols:
                            d[row, col] = accs[h][q % 2 + 2 * rs + 4 * (q // 2)].to(self.d_dtype)

    @cute.jit
    def store_pairs(self, accs, d: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32, row0: cutlass.Int32,
                    col0: cutlass.Int32):
        """:meth:`store` for an even N: one 32-bit (bf16) or 64-bit (fp32) store per element pair."""
        wide = cutlass.Uint32 if cutlass.const_expr(self.d_dtype is cutlass.BFloat16) else cutlass.Uint64
        dw = cute.make_tensor(cute.recast_ptr(d.iterator, dtype=wide),
                              cute.make_layout((rows, cols // 2), stride=(cols // 2, 1)))
        for h in cutlass.range_constexpr(2):
            for q in cutlass.range_constexpr(self.TILE_N // 8):
                col = col0 + 8 * q
                for rs in cutlass.range_constexpr(2):
                    row = row0 + 64 * h + 8 * rs
                    lo = accs[h][2 * rs + 4 * q]
                    hi = accs[h][1 + 2 * rs + 4 * q]
                    if row < rows and col < cols:
                        if cutlass.const_expr(self.d_dtype is cutlass.BFloat16):
                            dw[row, col // 2] = pack_bf16x2(lo, hi)
                        else:
                            dw[row, col // 2] = (cutlass.Uint64(hi.bitcast(cutlass.Uint32)) << 32) | \
                                cutlass.Uint64(lo.bitcast(cutlass.Uint32))

"""SM100 (Blackwell) MXFP8 GEMM on tcgen05 block-scaled MMA: ``D = A · Bᵀ`` with per-32 E8M0 scales along K, and
the SwiGLU MLP's fused epilogues (``docs/sm100_gemm.md``).  Compiled and SASS-checked on CPU machines, its
architecture-independent parts run on the H200 (:mod:`.gemm_checks`); no SM100 GPU has run it yet.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100
import cutlass.utils.blockscaled_layout as bsl
from cutlass.cute.nvgpu import cpasync, tcgen05

from .blockscaled import SF_VEC, scale_layout
from .gemm_epilogue import EPILOGUES, GATE_UP_TILE, TRANSPOSE_BYTES, dswiglu_block, swiglu_block
from .mx_math import group_of_tile, group_origin, group_start
from .tile_scheduler import PersistentTiles, grid_clusters

_K_MAJOR = cute.nvgpu.OperandMajorMode.K
_SF_DTYPE = cutlass.Float8E8M0FNU
_ROW_MAJOR = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
# cluster shapes (CTAs along M, N) by MMA kind: a 2-CTA MMA (M = 256) needs an even cluster M.  A cluster larger
# than the MMA multicasts: A across its N CTAs, B across its M MMA-pairs (or CTAs).
CLUSTERS = {False: ((1, 1), (2, 1), (1, 2)), True: ((2, 1), (4, 1), (2, 2))}


def tile_counts(m, n, n_tile: int):
    """(M tiles, N tiles) of an (M, N) output in per-CTA (128, ``n_tile``) tiles."""
    return (m + MXGemmSm100.TILE_M - 1) // MXGemmSm100.TILE_M, (n + n_tile - 1) // n_tile


def tile_grid(m, n, n_tile: int, max_ctas: int, cluster_mn: tuple = (1, 1)):
    """The GEMM's persistent launch grid ``(cm, cn, clusters)`` for an (M, N) output: at most ``max_ctas`` CTAs
    in clusters of ``cluster_mn``, each walking the tile order of :mod:`.tile_scheduler` (every role of every CTA
    walks the same sequence; :class:`.gemm_checks.TileScheduleProbe` runs it on any GPU)."""
    return (*cluster_mn, grid_clusters(*tile_counts(m, n, n_tile), cluster_mn, max_ctas))


@cute.jit
def _peek(probe, state, k_tiles, enabled):
    """Look-ahead on a pipeline stage: ``probe(state)`` (a non-blocking try-acquire / try-wait) while K tiles
    remain for this tile, else True; the following blocking acquire / wait then skips the wait if it succeeded."""
    ready = cutlass.Boolean(1)
    if state.count < k_tiles and enabled:
        ready = probe(state)
    return ready


class MXGemmSm100:
    """Persistent, warp-specialized MXFP8 GEMM for SM100: ``acc (M, N) = A (M, K) · B (N, K)ᵀ`` in fp32 in tensor
    memory (TMEM), then one of three epilogues.

    Operands: A and B K-major fp8, e4m3 or e5m2 each (every product of the SwiGLU MLP is of this form: colwise
    casts store their data transposed, ``docs/sm100_gemm.md``); their scales the blocked E8M0 buffers of
    ``quantize_rowwise(..., blocked=True)`` (:func:`.blockscaled.scale_layout`; the cuBLAS block-scaling layout,
    OCP MX v1.0 block of 32).  Dtype matrix: A x B in {e4m3, e5m2}², D / h13 in {bf16, fp32}, fused casts to
    {e4m3, e5m2} x {floor, rceil}.

    Epilogues (``epilogue``, compile time): ``"plain"`` D (M, N) row-major by TMA store; ``"swiglu"`` (GEMM1, B = W13
    interleaved in runs of 64 gate / 64 up rows) TMA-stores h13 and writes h's rowwise + colwise MXFP8 (h itself
    only with ``emit_hp``); ``"dswiglu"`` (GEMM3, acc = dh) reads the saved h13 and writes dh13's rowwise + colwise
    MXFP8 (:mod:`.gemm_epilogue`, the math of :mod:`.mx_math`).

    Warp roles (192 threads): warps 0-3 epilogue (``tcgen05.ld`` of 128 x 32 sub-tiles, thread = row); warp 4 MMA
    (``tcgen05.cp`` of the stage's scales into TMEM, then 4 ``tcgen05.mma ... kind::mxf8f6f4.block_scale`` per
    128-deep K stage; of a CTA pair only the leader issues); warp 5 TMA loads of A, B, SFA, SFB (multicast within
    the cluster).  Pipelines: ``PipelineTmaUmma`` over ``ab_stages`` shared-memory stages (as many as fit: 1-CTA
    bf16 6 at N-tile 128 and 4 at 256, 2-CTA N-tile 128 8), producer and consumer probing one stage ahead; ``PipelineUmmaAsync`` over ``acc_stages`` TMEM
    accumulators (2 at N-tile 128: a tile's epilogue overlaps the next tile's mainloop; 1 at 256);
    ``PipelineTmaStore`` for D.  Tiles: :class:`.tile_scheduler.PersistentTiles` over at most ``max_ctas`` CTAs
    (bands of 8 cluster rows, so a wave's A and B tiles stay in L2).

    Compile-time parameters: the A/B element types, ``out_dtype``, ``n_tile`` (128 or 256), ``max_ctas``,
    ``epilogue`` with ``cast_elem`` / ``scale_mode`` / ``emit_hp``, ``cta_pair`` (2-CTA MMA, M = 256) and
    ``cluster_mn`` (:data:`CLUSTERS`).  Constraints: :meth:`can_implement`; M, N, K of any size otherwise (TMA
    zero-fills partial tiles and clips stores, the blocked scales are zero-padded to whole 128 x 4 tiles, the
    fused epilogues predicate rows past M).

    Performance model (B200, 4.5 PFLOP/s dense MXFP8 = 30.4 TFLOP/s per SM; unmeasured, no SM100 here), for the
    ops' configuration (2-CTA, N-tile 128, cluster (2, 2)) at 8192³: a 256 x 128 pair tile does 8.4 MFLOP per
    128-deep K step (138 ns at peak) from 48 KB of operands (A 32 KB + B 16 KB; the cluster shares A between two
    pairs: 262 FLOP/B, 17 TB/s of L2 traffic at peak); 64 K steps = 8.8 µs of MMA per tile against a ~1 µs
    epilogue hidden by the second accumulator; 2048 tiles over 74 pairs = 27.7 waves.  Expected 75-85 % of peak if
    L2 keeps up.  The SwiGLU epilogue (~0.75 µs per tile) and the dSwiGLU one (~2.9 µs) stay under GEMM1's / GEMM3's
    4.4 µs of MMA per tile at D = 4096.
    """

    EPI_WARPS = (0, 1, 2, 3)
    MMA_WARP = 4
    TMA_WARP = 5
    THREADS = 32 * 6
    TILE_M = 128
    K_STAGE_BLOCKS = 4  # MMA instructions (K = 32 each) per pipeline stage: a 128-deep K tile

    def __init__(self, a_elem: str, b_elem: str, out_dtype: str = "bfloat16", n_tile: int = 128,
                 max_ctas: int = 148, epilogue: str = "plain", cast_elem: str = "e4m3", scale_mode: str = "rceil",
                 emit_hp: bool = False, cta_pair: bool = False, cluster_mn: tuple = (1, 1), grouping: str = "none"):
        from .mx_math import MXCastParams, gemm_dtypes

        if grouping not in ("none", "m", "k"):
            raise ValueError(f"grouping must be 'none' (dense), 'm' (2d-3d token groups) or 'k' (2d-2d wgrad), got "
                             f"{grouping!r}")
        if grouping == "k" and (cta_pair or n_tile != 128 or tuple(cluster_mn) not in ((1, 1), (1, 2))
                                or epilogue != "plain"):
            raise ValueError(f"the 2d-2d grouped GEMM runs 1-CTA MMAs, n_tile 128, clusters (1, 1) or (1, 2) and the "
                             f"plain epilogue (each stage's scales are one 512-byte tile of a group: "
                             f"call_wgrad), got cta_pair={cta_pair}, n_tile={n_tile}, cluster_mn={cluster_mn}, "
                             f"epilogue={epilogue!r}")
        self.grouping = grouping
        self.mma_m = self.TILE_M * (2 if cta_pair else 1)  # rows of one MMA tile (a group starts on a fresh one)

        self.a_dtype, self.b_dtype, self.d_dtype = gemm_dtypes(a_elem, b_elem, out_dtype)
        if n_tile not in (128, 256):
            raise ValueError(f"n_tile must be 128 or 256, got {n_tile}")
        self.n_tile, self.max_ctas = n_tile, max_ctas
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        self.epilogue, self.emit_hp = epilogue, emit_hp
        self.cast = MXCastParams(cast_elem, scale_mode, blocked=True)  # the fused epilogues' output cast
        cluster_mn = tuple(cluster_mn)
        if cluster_mn not in CLUSTERS[cta_pair]:
            raise ValueError(f"cluster_mn must be one of {CLUSTERS[cta_pair]} with cta_pair={cta_pair}, "
                             f"got {cluster_mn}")
        self.cta_pair, self.cluster_mn = cta_pair, cluster_mn
        if grouping == "m" and cluster_mn[0] != (2 if cta_pair else 1):
            raise ValueError(f"the 2d-3d grouped GEMM needs a cluster one MMA tile tall (M extent "
                             f"{2 if cta_pair else 1} with cta_pair={cta_pair}), got {cluster_mn}: M-neighbouring "
                             f"tiles may belong to different experts, so B cannot be multicast across them")
        self.acc_stages = 2 if n_tile == 128 else 1  # 2 x 256 accumulator columns would leave none for scales
        self.epi_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(self.EPI_WARPS))
        self.tmem_sync = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (len(self.EPI_WARPS) + 1))

    @staticmethod
    def can_implement(m: int, n: int, k: int, out_dtype: str = "bfloat16", epilogue: str = "plain") -> str | None:
        """None if the kernel takes this problem, else the reason (the ops layer refuses the call with it):
        M, N, K > 0; K % 32 == 0 (the MX block; also 16-byte aligned fp8 rows for TMA); N % 8 (bf16) or N % 4
        (fp32) for 16-byte aligned rows of D / h13; ``"swiglu"``: N = 2I with I % 64 == 0 (the interleaved
        gate/up runs); ``"dswiglu"``: N = I % 64 == 0.  Pointers must be 16-byte aligned (the ops layer checks)."""
        if min(m, n, k) <= 0:
            return "M, N and K must be positive"
        if k % SF_VEC:
            return f"K = {k} must be a multiple of {SF_VEC} (the MX block)"
        if n % (16 // (2 if out_dtype == "bfloat16" else 4)):
            return f"N = {n} must give 16-byte aligned rows of D ({out_dtype})"
        run = 2 * GATE_UP_TILE if epilogue == "swiglu" else GATE_UP_TILE
        if epilogue != "plain" and n % run:
            return (f"N = {n} must be a multiple of {run} for the {epilogue} epilogue (I % {GATE_UP_TILE} == 0: the "
                    f"interleaved gate/up runs); pad w1 and w3 each")
        return None

    # ---- host side ---------------------------------------------------------------------------------------------

    def _configure(self):
        """Tiled MMAs, cluster layouts, shared-memory layouts and stage counts (static: they depend only on the
        compile key)."""
        group = tcgen05.CtaGroup.TWO if self.cta_pair else tcgen05.CtaGroup.ONE
        mma_m = self.TILE_M * (2 if self.cta_pair else 1)
        mma = functools.partial(sm100.make_blockscaled_trivial_tiled_mma, self.a_dtype, self.b_dtype, _K_MAJOR,
                                _K_MAJOR, _SF_DTYPE, SF_VEC)
        self.tiled_mma = mma(group, (mma_m, self.n_tile))
        # SFB is loaded (and multicast) per CTA, whole N tile, rounded up to the 128-row scale atom
        self.tiled_mma_sfb = mma(tcgen05.CtaGroup.ONE, (self.TILE_M, cute.round_up(self.n_tile, 128)))
        k_tile = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * self.K_STAGE_BLOCKS
        self.mma_tiler = (mma_m, self.n_tile, k_tile)
        self.mma_tiler_sfb = (self.TILE_M, cute.round_up(self.n_tile, 128), k_tile)
        self.cta_tile = (self.TILE_M, self.n_tile, k_tile)
        cluster = cute.make_layout((*self.cluster_mn, 1))
        self.cluster_vmnk = cute.tiled_divide(cluster, (self.tiled_mma.thr_id.shape,))
        self.cluster_sfb_vmnk = cute.tiled_divide(cluster, (self.tiled_mma_sfb.thr_id.shape,))
        self.mcast_a = cute.size(self.cluster_vmnk.shape[2])  # CTAs sharing an A tile (the cluster's N extent)
        self.mcast_b = cute.size(self.cluster_vmnk.shape[1])  # MMA groups sharing a B tile (its M extent)
        self.epi_tile = sm100.compute_epilogue_tile_shape(self.cta_tile, self.cta_pair, _ROW_MAJOR, self.d_dtype)
        one = self._smem_layouts(1)
        stage_bytes = (cute.size_in_bytes(self.a_dtype, one[0]) + cute.size_in_bytes(self.b_dtype, one[1])
                       + cute.size_in_bytes(_SF_DTYPE, one[2]) + cute.size_in_bytes(_SF_DTYPE, one[3]))
        self.d_stages = 2
        # fused epilogues: each epilogue warp transposes its colwise blocks through a 32 x 32 fp8 tile
        self.tr_bytes = TRANSPOSE_BYTES * len(self.EPI_WARPS) if self.epilogue != "plain" else 16
        # the dSwiGLU epilogue stores no D: its shared memory goes to the pipeline (one more stage with fp32 h13)
        self.stores_d = self.epilogue != "dswiglu" and self.grouping == "none"  # grouped: masked row stores
        d_bytes = cute.size_in_bytes(self.d_dtype, sm100.make_smem_layout_epi(
            self.d_dtype, _ROW_MAJOR, self.epi_tile, 1)) * self.d_stages if self.stores_d else 1024  # placeholder
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_100")
        # 1 KB: barriers and the TMEM address
        self.ab_stages = (capacity - 1024 - d_bytes - self.tr_bytes) // stage_bytes
        # what one stage's TMA loads deliver to the barrier the MMA waits on (a 2-CTA MMA waits for both halves)
        self.tma_bytes = stage_bytes * cute.size(self.tiled_mma.thr_id.shape)
        self.a_smem, self.b_smem, self.sfa_smem, self.sfb_smem = self._smem_layouts(self.ab_stages)
        self.d_smem = sm100.make_smem_layout_epi(self.d_dtype, _ROW_MAJOR, self.epi_tile,
                                                 self.d_stages)
        self.sfa_tmem_cols = (self.TILE_M // 32) * self.K_STAGE_BLOCKS
        self.sfb_tmem_cols = (self.mma_tiler_sfb[1] // 32) * self.K_STAGE_BLOCKS
        self.acc_tmem_cols = self.n_tile * self.acc_stages

    def _smem_layouts(self, stages: int):
        return (sm100.make_smem_layout_a(self.tiled_mma, self.mma_tiler, self.a_dtype, stages),
                sm100.make_smem_layout_b(self.tiled_mma, self.mma_tiler, self.b_dtype, stages),
                bsl.make_smem_layout_sfa(self.tiled_mma, self.mma_tiler, SF_VEC, stages),
                bsl.make_smem_layout_sfb(self.tiled_mma, self.mma_tiler, SF_VEC, stages))

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                 stream: cuda.CUstream):
        """Plain epilogue: ``a`` (M, K), ``b`` (N, K) fp8 K-major; ``sfa``/``sfb`` the 1-D blocked E8M0 scale
        buffers (bytes); ``d`` (M, N) row-major."""
        self._launch(a, b, sfa, sfb, d, None, (), stream)

    @cute.jit
    def call_swiglu(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, h13: cute.Tensor,
                    q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor, qts: cute.Tensor, hp: cute.Tensor,
                    stream: cuda.CUstream):
        """SwiGLU epilogue (GEMM1): ``b`` = W13 in the interleaved gate/up layout (N = 2I); writes ``h13``
        (M, 2I) and h's dual MXFP8 cast: ``q`` (M, I), ``qt`` (I, Mp), blocked scales ``qs``/``qts``
        (zero-filled), ``hp`` (M, I) h itself when ``emit_hp`` (:func:`.gemm_epilogue.dual_quantize_block`)."""
        self._launch(a, b, sfa, sfb, h13, None, (q, qs, qt, qts, hp), stream)

    @cute.jit
    def call_dswiglu(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor,
                     h13: cute.Tensor, q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor, qts: cute.Tensor,
                     hp: cute.Tensor, stream: cuda.CUstream):
        """dSwiGLU epilogue (GEMM3): the accumulator is dh (M, I); reads the saved ``h13`` (M, 2I) and writes
        dh13's dual MXFP8 cast: ``q`` (M, 2I), ``qt`` (2I, Mp), blocked scales (zero-filled), ``hp`` (M, 2I)
        dh13 itself when ``emit_hp``.  No D is stored."""
        self._launch(a, b, sfa, sfb, None, h13, (q, qs, qt, qts, hp), stream)

    @cute.jit
    def call_grouped(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                     offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """2d-3d (``grouping="m"``), the plain epilogue (the fused ones: :meth:`call_swiglu_grouped`,
        :meth:`call_dswiglu_grouped`): ``a`` (T, K) with token groups ``offs`` (E,) int32 (cumulative
        ends, valid: the ops layer makes them so on the device), ``b`` (E * N, K) the experts' weights back to back, ``sfa`` the
        grouped-M blocked scales (every group on a fresh 128-row tile), ``sfb`` the E blocked buffers back to back,
        ``d`` (T, N) row-major; ``sched`` (2, E) int32: row 0 the cumulative MMA-tile counts of the groups
        (``ceil(size / mma_m)``, ``mma_m`` = 256 with ``cta_pair`` else 128), row 1 their first 128-row scale
        tiles (``formats.group_tile_starts``).  Rows from ``offs[-1]`` on are written as zeros.

        Design: a group's last MMA tile would write the next group's rows, so D is not TMA-stored: each epilogue
        thread owns one row and stores it (16-byte vectors) only inside its group (chosen over per-group tensor maps, which need a device-side descriptor update per group switch and
        still a zero tail).  A and SFA are loaded by element row offset (group start + ``mma_m`` t), B and SFB by
        the expert batch coordinate."""
        self._launch(a, b, sfa, sfb, d, None, (), stream, (d, offs, sched))

    @cute.jit
    def call_swiglu_grouped(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor,
                            h13: cute.Tensor, q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor, qts: cute.Tensor,
                            hp: cute.Tensor, offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """:meth:`call_swiglu` over token groups (``grouping="m"``): operands as :meth:`call_grouped` takes them,
        ``b`` the experts' W13 back to back; h13 rows masked at group ends (zeros past ``offs[-1]``), h's outputs
        in the grouped layouts (q, qt (I, T) zero-filled by the caller; colwise blocks never cross a group end:
        :func:`.gemm_epilogue.dual_quantize_block` with ``grp``)."""
        self._launch(a, b, sfa, sfb, h13, None, (q, qs, qt, qts, hp), stream, (h13, offs, sched))

    @cute.jit
    def call_dswiglu_grouped(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor,
                             h13: cute.Tensor, q: cute.Tensor, qs: cute.Tensor, qt: cute.Tensor, qts: cute.Tensor,
                             hp: cute.Tensor, offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """:meth:`call_dswiglu` over token groups, as :meth:`call_swiglu_grouped`."""
        self._launch(a, b, sfa, sfb, None, h13, (q, qs, qt, qts, hp), stream, (None, offs, sched))

    @cute.jit
    def call_wgrad(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                   offs: cute.Tensor, sched: cute.Tensor, stream: cuda.CUstream):
        """2d-2d (``grouping="k"``, MoE wgrad): ``d[e] (N, K') = a[:, tokens of e] · b[:, tokens of e]ᵀ`` for every
        token group e, K = the group's tokens.

        ``a`` (N, T') and ``b`` (K', T') fp8, token-major, in the 32-aligned group layout: group e's tokens are
        columns ``[sched[0, e], sched[0, e] + size_e)``, ``sched[0, e]`` a multiple of 32 and the columns up to the
        next multiple of 32 zero (the ops layer's gather, :mod:`.token_align`), so every MX block of a group holds
        only its tokens.  ``sfa`` / ``sfb``: the grouped-K blocked scales (``formats.to_blocked_scales_grouped_k``:
        group e's tiles blocked on their own, from tile ``ceil(rows / 128) * sched[1, e]``, ``sched[1]`` =
        ``group_tile_starts``).  ``d`` (E * N, K') row-major; ``offs`` (E,) int32 cumulative ends (valid: the ops
        layer sanitizes them on the device); an empty group's d[e] is zero.

        Design: output tiles (expert, 128-row tile, 128-column tile) on the persistent scheduler; a tile's K loop
        covers its group's ceil(size / 128) K tiles and the last one issues only the group's remaining MX blocks.
        A stage's scales are one 512-byte tile of the group (128 rows x 4 blocks), contiguous in the per-group
        layout, so SFA / SFB are loaded by TMA from a view of the buffer as 512-byte tiles (batch coordinate = tile
        index) and no descriptor changes per group.  D rows are stored by each thread inside its expert's N rows
        (masked 16-byte stores, N need not be a multiple of 128)."""
        self._launch(a, b, sfa, sfb, d, None, (), stream, (d, offs, sched))

    @cute.jit
    def _launch(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d, h13, fused: tuple,
                stream: cuda.CUstream, groups=None):
        self._configure()
        m, k = a.shape
        # (rows, K, batch) views, K-major; the scales as their blocked layout over element coordinates
        a3 = cute.make_tensor(a.iterator, cute.make_ordered_layout((m, k, 1), order=(1, 0, 2)))
        if cutlass.const_expr(groups is None):
            n = b.shape[0]
            b3 = cute.make_tensor(b.iterator, cute.make_ordered_layout((n, k, 1), order=(1, 0, 2)))
            sfa3 = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=_SF_DTYPE), scale_layout(m, k))
            sfb3 = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=_SF_DTYPE), scale_layout(n, k))
            m_rows = m
        elif cutlass.const_expr(self.grouping == "k"):  # token-major operands; scales as 512-byte tiles
            e = cute.size(groups[1])
            n = b.shape[0]
            b3 = cute.make_tensor(b.iterator, cute.make_ordered_layout((n, k, 1), order=(1, 0, 2)))
            sfa3 = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=_SF_DTYPE),
                                    scale_layout(128, 128, cute.size(sfa) // 512))
            sfb3 = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=_SF_DTYPE),
                                    scale_layout(128, 128, cute.size(sfb) // 512))
            m_rows = e * ((m + self.TILE_M - 1) // self.TILE_M) * self.TILE_M  # (expert, row tile) pairs
            d = None  # masked row stores, no TMA store
        else:
            e = cute.size(groups[1])
            n = b.shape[0] // e
            b3 = cute.make_tensor(b.iterator, cute.make_ordered_layout((n, k, e), order=(1, 0, 2)))
            sa_rows = (m // 128 + e) * 128  # formats.grouped_scale_tiles
            sfa3 = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=_SF_DTYPE), scale_layout(sa_rows, k))
            sfb3 = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=_SF_DTYPE), scale_layout(n, k, e))
            m_rows = (m // self.mma_m + e + 1) * self.mma_m  # a bound on the groups' tiles plus the tail's
            d = None  # masked row stores, no TMA store

        mma, cl = self.tiled_mma, self.cluster_mn
        load_a = sm100.cluster_shape_to_tma_atom_A(cl, mma.thr_id)
        load_b = sm100.cluster_shape_to_tma_atom_B(cl, mma.thr_id)
        load_sfb = sm100.cluster_shape_to_tma_atom_SFB(cl, mma.thr_id)
        stage = (None, None, None, 0)
        vmnk = self.cluster_vmnk.shape
        tma_a, ga = cute.nvgpu.make_tiled_tma_atom_A(load_a, a3, cute.slice_(self.a_smem, stage), self.mma_tiler,
                                                     mma, vmnk)
        tma_b, gb = cute.nvgpu.make_tiled_tma_atom_B(load_b, b3, cute.slice_(self.b_smem, stage), self.mma_tiler,
                                                     mma, vmnk)
        tma_sfa, gsfa = cute.nvgpu.make_tiled_tma_atom_A(load_a, sfa3, cute.slice_(self.sfa_smem, stage),
                                                         self.mma_tiler, mma, vmnk, internal_type=cutlass.Int16)
        tma_sfb, gsfb = cute.nvgpu.make_tiled_tma_atom_B(load_sfb, sfb3, cute.slice_(self.sfb_smem, stage),
                                                         self.mma_tiler_sfb, self.tiled_mma_sfb,
                                                         self.cluster_sfb_vmnk.shape, internal_type=cutlass.Int16)
        tma_d, gd = None, None
        if cutlass.const_expr(d is not None):
            d3 = cute.make_tensor(d.iterator, cute.make_ordered_layout((m, n, 1), order=(1, 0, 2)))
            tma_d, gd = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), d3,
                                                    cute.slice_(self.d_smem, (None, None, 0)), self.epi_tile)

        grid = tile_grid(m_rows, n, self.n_tile, self.max_ctas, cl)

        @cute.struct
        class Shared:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.ab_stages]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            tmem_dealloc: cutlass.Int64  # a CTA pair frees its TMEM together
            tmem_addr: cutlass.Int32
            sd: cute.struct.Align[cute.struct.MemRange[
                self.d_dtype, cute.cosize(self.d_smem.outer) if self.stores_d else 16], 1024]  # unused if no D
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem.outer)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem.outer)], 1024]
            ssfa: cute.struct.Align[cute.struct.MemRange[_SF_DTYPE, cute.cosize(self.sfa_smem)], 1024]
            ssfb: cute.struct.Align[cute.struct.MemRange[_SF_DTYPE, cute.cosize(self.sfb_smem)], 1024]
            tr: cute.struct.Align[cute.struct.MemRange[self.cast.elem_dtype, self.tr_bytes], 16]

        self.shared = Shared
        self.kernel(mma, self.tiled_mma_sfb, tma_a, ga, tma_b, gb, tma_sfa, gsfa, tma_sfb, gsfb, tma_d, gd, h13,
                    fused, groups, m, n, self.cluster_vmnk, self.cluster_sfb_vmnk, self.a_smem, self.b_smem,
                    self.sfa_smem, self.sfb_smem, self.d_smem, self.epi_tile).launch(
            grid=grid, block=[self.THREADS, 1, 1], cluster=(*cl, 1), smem=Shared.size_in_bytes(), stream=stream)

    # ---- device side -------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, mma_sfb: cute.TiledMma, tma_a: cute.CopyAtom, ga: cute.Tensor,
               tma_b: cute.CopyAtom, gb: cute.Tensor, tma_sfa: cute.CopyAtom, gsfa: cute.Tensor,
               tma_sfb: cute.CopyAtom, gsfb: cute.Tensor, tma_d, gd, h13, fused: tuple, groups,
               rows: cutlass.Int32,
               cols: cutlass.Int32, cluster: cute.Layout, cluster_sfb: cute.Layout,
               a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, sfa_smem: cute.Layout, sfb_smem: cute.Layout,
               d_smem: cute.ComposedLayout, epi_tile: cute.Tile):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == self.TMA_WARP:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(tma_d is not None):
                cpasync.prefetch_descriptor(tma_d)
        pair = cute.size(mma.thr_id.shape)  # CTAs per MMA: 1, or 2 for the 2-CTA (M = 256) MMA
        bidx, _, _ = cute.arch.block_idx()
        peer = bidx % pair  # this CTA's half of a 2-CTA MMA; the leader (0) issues the MMAs
        leader = peer == 0
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        crd = cluster.get_flat_coord(rank)
        crd_sfb = cluster_sfb.get_flat_coord(rank)

        st = cutlass.memory.SmemAllocator().allocate(self.shared)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.ab_full.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mcast_a + self.mcast_b - 1),
            tx_count=self.tma_bytes, cta_layout_vmnk=cluster, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=st.acc_full.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.EPI_WARPS) * pair),
            cta_layout_vmnk=cluster, defer_sync=True)
        tmem = cutlass.memory.TmemAllocator(st.tmem_addr.ptr, barrier_for_retrieve=self.tmem_sync,
                                            allocator_warp_id=self.EPI_WARPS[0], is_two_cta=self.cta_pair,
                                            two_cta_tmem_dealloc_mbar_ptr=st.tmem_dealloc.ptr)
        # one fence + cluster arrive for both pipelines' barrier initialisation; the wait comes before any role
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sa = st.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sb = st.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        ssfa = st.ssfa.get_tensor(sfa_smem)
        ssfb = st.ssfb.get_tensor(sfb_smem)
        sd = st.sd.get_tensor(d_smem.outer, swizzle=d_smem.inner)
        tr = st.tr.get_tensor(cute.make_layout((32, 32, len(self.EPI_WARPS)), stride=(32, 1, 1024)))

        # TMA multicast masks: the CTAs that share each tile (a 2-CTA MMA signals its peer's barrier too)
        masks = (None, None, None, None)
        if cutlass.const_expr(self.mcast_a > 1 or self.mcast_b > 1 or self.cta_pair):
            masks = (cpasync.create_tma_multicast_mask(cluster, crd, mcast_mode=2),
                     cpasync.create_tma_multicast_mask(cluster, crd, mcast_mode=1),
                     cpasync.create_tma_multicast_mask(cluster, crd, mcast_mode=2),
                     cpasync.create_tma_multicast_mask(cluster_sfb, crd_sfb, mcast_mode=1))

        # global tiles: (bM, bK, RestM, RestK, RestL) etc., partitioned for the MMA and for TMA
        tile_mk = cute.slice_(self.mma_tiler, (None, 0, None))
        tile_nk = cute.slice_(self.mma_tiler, (0, None, None))
        thr = mma.get_slice(peer)
        tcga = thr.partition_A(cute.local_tile(ga, tile_mk, (None, None, None)))
        tcgb = thr.partition_B(cute.local_tile(gb, tile_nk, (None, None, None)))
        tcgsfa = thr.partition_A(cute.local_tile(gsfa, tile_mk, (None, None, None)))
        tcgsfb = mma_sfb.get_slice(peer).partition_B(
            cute.local_tile(gsfb, cute.slice_(self.mma_tiler_sfb, (0, None, None)), (None, None, None)))
        tcgd = None
        if cutlass.const_expr(gd is not None):
            tcgd = thr.partition_C(cute.local_tile(gd, cute.slice_(self.mma_tiler, (None, None, 0)),
                                                   (None, None, None)))
        k_tiles = cute.size(tcga, mode=[4])
        counts = tile_counts(rows, cols, self.n_tile)
        if cutlass.const_expr(self.grouping == "m"):  # the groups' tiles and the tail's, read on the device
            counts = (pair * self._group_tiles(groups, rows), counts[1])
        if cutlass.const_expr(self.grouping == "k"):  # every expert's row tiles
            counts = (cute.size(groups[1]) * counts[0], counts[1])
        # MX blocks of the last 128-deep K tile (K % 32 == 0): only those MMAs are issued, so the scale buffer's
        # padding past K (any bytes: a caller's 0xFF, E8M0 NaN, included) never meets the TMA zero fill
        last_blocks = (cute.size(ga, mode=[1]) // 32) % self.K_STAGE_BLOCKS
        if last_blocks == 0:
            last_blocks = self.K_STAGE_BLOCKS
        a_ctas = cute.make_layout(cute.slice_(cluster, (0, 0, None, 0)).shape)
        b_ctas = cute.make_layout(cute.slice_(cluster, (0, None, 0, 0)).shape)
        sfb_ctas = cute.make_layout(cute.slice_(cluster_sfb, (0, None, 0, 0)).shape)
        tas, tag = cpasync.tma_partition(tma_a, crd[2], a_ctas, cute.group_modes(sa, 0, 3),
                                         cute.group_modes(tcga, 0, 3))
        tbs, tbg = cpasync.tma_partition(tma_b, crd[1], b_ctas, cute.group_modes(sb, 0, 3),
                                         cute.group_modes(tcgb, 0, 3))
        tsfas, tsfag = cpasync.tma_partition(tma_sfa, crd[2], a_ctas, cute.group_modes(ssfa, 0, 3),
                                             cute.group_modes(tcgsfa, 0, 3))
        tsfbs, tsfbg = cpasync.tma_partition(tma_sfb, crd_sfb[1], sfb_ctas, cute.group_modes(ssfb, 0, 3),
                                             cute.group_modes(tcgsfb, 0, 3))
        tsfas, tsfag = cute.filter_zeros(tsfas), cute.filter_zeros(tsfag)
        tsfbs, tsfbg = cute.filter_zeros(tsfbs), cute.filter_zeros(tsfbg)

        acc_layout = mma.make_fragment_C(cute.append(mma.partition_shape_C(self.mma_tiler[:2]),
                                                     self.acc_stages)).layout
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        # the grouped A / SFA (and, 2d-2d, B) partitions per tile
        regroup = (ga, gsfa, thr, tile_mk, crd, a_ctas, sa, ssfa, gb, tile_nk, b_ctas, sb)
        if warp == self.TMA_WARP:
            self._load_role(ab_pipe, counts, k_tiles, pair, masks, (tma_a, tas, tag), (tma_b, tbs, tbg),
                            (tma_sfa, tsfas, tsfag), (tma_sfb, tsfbs, tsfbg), groups, regroup, rows, cols)
        if warp == self.MMA_WARP:
            self._mma_role(mma, ab_pipe, acc_pipe, tmem, counts, sa, sb, ssfa, ssfb, sfa_smem, sfb_smem, acc_layout,
                           k_tiles, last_blocks, pair, leader, groups, rows, cols)
        if warp < self.MMA_WARP:
            self._epilogue_role(acc_pipe, tmem, counts, tma_d, tcgd, sd, acc_layout, epi_tile, tidx, warp, h13,
                                fused, tr[(None, None, warp)], rows, cols, pair, groups, k_tiles)

    @cute.jit
    def _group_tiles(self, groups, m: cutlass.Int32):
        """2d-3d: the MMA tiles of all groups (``sched[0, E - 1]``) plus those of the rows past ``offs[-1]``."""
        _, offs, sched = groups
        end, total = group_origin(cute.size(offs), offs, sched)
        return total + (cutlass.max(m - end, 0) + self.mma_m - 1) // self.mma_m

    @cute.jit
    def _tile_of(self, groups, m: cutlass.Int32, mt: cutlass.Int32, pair, k_tiles: cutlass.Int32):
        """2d-3d: CTA tile ``mt``'s MMA tile -> (its first row, the row its group ends at, its first row in the
        grouped-M scale layout, the expert, its K tiles, the group's first row, the group's first scale row); a
        tail tile (rows past ``offs[-1]``) has 0 K tiles and ends at M (its rows are written as zeros)."""
        _, offs, sched = groups
        u = mt // pair
        g, start, before = group_of_tile(u, offs, sched)  # the tail: g = E, start = offs[-1]
        row0 = start + (u - before) * self.mma_m
        zero = cutlass.Int32(0)
        rows_end = m
        scale_row0 = zero
        expert = zero
        kt = zero
        if g < cute.size(offs):
            rows_end = cutlass.min(offs[g], m)
            scale_row0 = sched[1, g] * 128
            expert = g
            kt = k_tiles
        return row0, rows_end, scale_row0 + (u - before) * self.mma_m, expert, kt, start, scale_row0

    @cute.jit
    def _wgrad_tile(self, groups, m: cutlass.Int32, n: cutlass.Int32, mt: cutlass.Int32, nt: cutlass.Int32):
        """2d-2d: CTA tile (``mt``, ``nt``) -> (expert, its row tile, the group's first column in the aligned
        token layout, its K tiles, the MX blocks of its last K tile, the first 512-byte scale tile of A and of B
        for this tile).  Group e's grouped-K scales start at tile ``ceil(rows / 128) * sched[1, e]`` and hold
        ``ceil(size / 128)`` tiles per 128-row tile (:func:`.mx_math.grouped_k_scale_offset`)."""
        _, offs, sched = groups
        per_e = (m + self.TILE_M - 1) // self.TILE_M
        e = mt // per_e
        lmt = mt - e * per_e
        start = group_start(offs, e)
        size = offs[e] - start
        kt = (size + 127) // 128  # K tiles, and the group's scale tiles per 128-row tile
        blocks = ((size + SF_VEC - 1) // SF_VEC) % self.K_STAGE_BLOCKS
        if blocks == 0:
            blocks = self.K_STAGE_BLOCKS
        chunk_a = (m + 127) // 128 * sched[1, e] + lmt * kt
        chunk_b = (n + 127) // 128 * sched[1, e] + nt * kt
        return e, lmt, sched[0, e], kt, blocks, chunk_a, chunk_b

    @cute.jit
    def _wgrad_ab(self, regroup, tma_a, tma_b, row_a: cutlass.Int32, row_b: cutlass.Int32, k0: cutlass.Int32):
        """2d-2d: the TMA source partitions of A and B for a tile whose rows start at ``row_a`` / ``row_b`` and
        whose K (token) range starts at column ``k0`` (a multiple of 32: 16-byte aligned TMA coordinates)."""
        ga, _, thr, tile_mk, crd, a_ctas, sa, _, gb, tile_nk, b_ctas, sb = regroup
        tcga = thr.partition_A(cute.local_tile(cute.domain_offset((row_a, k0, 0), ga), tile_mk, (None, None, None)))
        tcgb = thr.partition_B(cute.local_tile(cute.domain_offset((row_b, k0, 0), gb), tile_nk, (None, None, None)))
        _, tag = cpasync.tma_partition(tma_a, crd[2], a_ctas, cute.group_modes(sa, 0, 3), cute.group_modes(tcga, 0, 3))
        _, tbg = cpasync.tma_partition(tma_b, crd[1], b_ctas, cute.group_modes(sb, 0, 3), cute.group_modes(tcgb, 0, 3))
        return tag, tbg

    @cute.jit
    def _grouped_a(self, regroup, tma_a, tma_sfa, row0: cutlass.Int32, sa_row0: cutlass.Int32):
        """The TMA source partitions of A and SFA for an MMA tile starting at element row ``row0`` / scale row
        ``sa_row0`` (tile 0 of the offset coordinate tensors; TMA zero-fills past M)."""
        ga, gsfa, thr, tile_mk, crd, a_ctas, sa, ssfa = regroup[:8]
        tcga = thr.partition_A(cute.local_tile(cute.domain_offset((row0, 0, 0), ga), tile_mk, (None, None, None)))
        tcgsfa = thr.partition_A(cute.local_tile(cute.domain_offset((sa_row0, 0, 0), gsfa), tile_mk,
                                                 (None, None, None)))
        _, tag = cpasync.tma_partition(tma_a, crd[2], a_ctas, cute.group_modes(sa, 0, 3), cute.group_modes(tcga, 0, 3))
        _, tsfag = cpasync.tma_partition(tma_sfa, crd[2], a_ctas, cute.group_modes(ssfa, 0, 3),
                                         cute.group_modes(tcgsfa, 0, 3))
        return tag, cute.filter_zeros(tsfag)

    @cute.jit
    def _load_role(self, ab_pipe, counts, k_tiles, pair, masks, a, b, sfa, sfb, groups, regroup, m, n):
        """TMA warp: for each scheduled tile, stream its K tiles of A, B and both scales into the stages
        (multicast to the cluster CTAs sharing them).  Each stage's slot is probed one step ahead
        (``producer_try_acquire``), so the wait itself rarely blocks."""
        tiles = PersistentTiles(*counts, self.cluster_mn)
        linear = tiles.first()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        while tiles.valid(linear):
            mt, nt = tiles.tile(linear)
            # per operand: the source partition and (rest, batch, K step, batch step): K tile kt is read at
            # (None, rest, K step * kt, batch + batch step * kt)
            if cutlass.const_expr(self.grouping == "k"):  # the group's token columns; scales: its 512-byte tiles
                _, lmt, k0, kt_tile, _, chunk_a, chunk_b = self._wgrad_tile(groups, m, n, mt, nt)
                a_src, b_src = self._wgrad_ab(regroup, a[0], b[0], lmt * self.TILE_M, nt * self.n_tile, k0)
                srcs = (a_src, b_src, sfa[2], sfb[2])
                coords = ((0, 0, 1, 0), (0, 0, 1, 0), (0, chunk_a, 0, 1), (0, chunk_b, 0, 1))
            elif cutlass.const_expr(groups is None):
                kt_tile = k_tiles
                srcs = (a[2], b[2], sfa[2], sfb[2])
                coords = ((mt // pair, 0, 1, 0), (nt, 0, 1, 0), (mt // pair, 0, 1, 0), (nt, 0, 1, 0))  # MMA tiles
            else:  # A / SFA from the group's row offset, B / SFB of the group's expert
                row0, _, sa_row0, expert, kt_tile, _, _ = self._tile_of(groups, m, mt, pair, k_tiles)
                a_src, sfa_src = self._grouped_a(regroup, a[0], sfa[0], row0, sa_row0)
                srcs = (a_src, b[2], sfa_src, sfb[2])
                coords = ((0, 0, 1, 0), (nt, expert, 1, 0), (0, 0, 1, 0), (nt, expert, 1, 0))
            state.reset_count()
            ready = _peek(ab_pipe.producer_try_acquire, state, kt_tile, True)
            for kt in cutlass.range(0, kt_tile, 1, unroll=1):
                ab_pipe.producer_acquire(state, ready)
                bar = ab_pipe.producer_get_barrier(state)
                for (atom, smem, _), gmem, (rest, l, ks, ls), mask in zip((a, b, sfa, sfb), srcs, coords, masks):
                    cute.copy(atom, gmem[(None, rest, kt * ks, l + kt * ls)], smem[(None, state.index)],
                              tma_bar_ptr=bar, mcast_mask=mask)
                state.advance()
                ready = _peek(ab_pipe.producer_try_acquire, state, kt_tile, True)
            linear = tiles.next(linear)
        ab_pipe.producer_tail(state)

    @cute.jit
    def _mma_role(self, mma, ab_pipe, acc_pipe, tmem, counts, sa, sb, ssfa, ssfb, sfa_smem, sfb_smem, acc_layout,
                  k_tiles, last_blocks, pair, leader, groups, m, n):
        """MMA warp: per K tile, copy the scales into TMEM (``tcgen05.cp``) and issue the block-scaled MMAs
        into the tile's accumulator stage; hand the stage to the epilogue when the tile is done.  Of a CTA pair
        only the leader issues (its MMAs read both CTAs' shared memory and write both TMEMs).  The last K tile
        issues ``last_blocks`` MMAs (the MX blocks left of K).  The next stage's data is probed one step ahead
        (``consumer_try_wait``)."""
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
        acc = cute.make_tensor(acc_ptr, acc_layout)
        sfa_ptr = cute.recast_ptr(acc_ptr + self.acc_tmem_cols, dtype=_SF_DTYPE)
        sfb_ptr = cute.recast_ptr(acc_ptr + self.acc_tmem_cols + self.sfa_tmem_cols, dtype=_SF_DTYPE)
        tsfa = cute.make_tensor(sfa_ptr, bsl.make_tmem_layout_sfa(
            mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem, (None, None, None, 0))))
        tsfb = cute.make_tensor(sfb_ptr, bsl.make_tmem_layout_sfb(
            mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem, (None, None, None, 0))))
        cp_sfa, src_sfa, dst_sfa = self._scale_copy(ssfa, tsfa)
        cp_sfb, src_sfb, dst_sfb = self._scale_copy(ssfb, tsfb)
        fa, fb = mma.make_fragment_A(sa), mma.make_fragment_B(sb)

        tiles = PersistentTiles(*counts, self.cluster_mn)
        linear = tiles.first()
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
        while tiles.valid(linear):
            kt_tile = k_tiles
            tile_blocks = last_blocks
            if cutlass.const_expr(self.grouping == "m"):  # a tail tile has none: its rows are written as zeros
                mt, _ = tiles.tile(linear)
                kt_tile = self._tile_of(groups, m, mt, pair, k_tiles)[4]
            if cutlass.const_expr(self.grouping == "k"):  # the group's K tiles (none if empty: d[e] is zero)
                mt, nt = tiles.tile(linear)
                _, _, _, kt_tile, tile_blocks, _, _ = self._wgrad_tile(groups, m, n, mt, nt)
            ab_state.reset_count()
            ready = _peek(ab_pipe.consumer_try_wait, ab_state, kt_tile, leader)
            if leader:
                acc_pipe.producer_acquire(acc_state)
            tile_acc = acc[(None, None, None, acc_state.index)]
            mma.set(tcgen05.Field.ACCUMULATE, False)
            for kt in cutlass.range(0, kt_tile, 1, unroll=1):
                if leader:
                    ab_pipe.consumer_wait(ab_state, ready)
                    cute.copy(cp_sfa, src_sfa[(None, None, None, None, ab_state.index)], dst_sfa)
                    cute.copy(cp_sfb, src_sfb[(None, None, None, None, ab_state.index)], dst_sfb)
                    blocks = cutlass.Int32(self.K_STAGE_BLOCKS)
                    if kt == kt_tile - 1:
                        blocks = tile_blocks
                    for kb in cutlass.range_constexpr(self.K_STAGE_BLOCKS):
                        mma.set(tcgen05.Field.SFA, tsfa[(None, None, kb)].iterator)
                        mma.set(tcgen05.Field.SFB, tsfb[(None, None, kb)].iterator)
                        if cutlass.const_expr(kb == 0):  # K >= 32: every K tile has its first block
                            cute.gemm(mma, tile_acc, fa[(None, None, kb, ab_state.index)],
                                      fb[(None, None, kb, ab_state.index)], tile_acc)
                        elif kb < blocks:
                            cute.gemm(mma, tile_acc, fa[(None, None, kb, ab_state.index)],
                                      fb[(None, None, kb, ab_state.index)], tile_acc)
                        mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_pipe.consumer_release(ab_state)
                ab_state.advance()
                ready = _peek(ab_pipe.consumer_try_wait, ab_state, kt_tile, leader)
            if leader:
                acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            linear = tiles.next(linear)
        acc_pipe.producer_tail(acc_state)

    def _scale_copy(self, sf_smem: cute.Tensor, sf_tmem: cute.Tensor):
        """``tcgen05.cp`` (4 x 32 x 128-bit) of one stage's scale tile from shared memory into TMEM."""
        group = tcgen05.CtaGroup.TWO if self.cta_pair else tcgen05.CtaGroup.ONE
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(group), _SF_DTYPE)
        dst = cute.filter_zeros(sf_tmem)
        tiled = tcgen05.make_s2t_copy(atom, dst)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(sf_smem)))
        return tiled, src, thr.partition_D(dst)

    @cute.jit
    def _epilogue_role(self, acc_pipe, tmem, counts, tma_d, tcgd, sd, acc_layout, epi_tile, tidx, warp, h13, fused,
                       tr, rows, cols, pair, groups, k_tiles):
        """Epilogue warps: allocate TMEM, then per tile walk the 128 x 32 accumulator sub-tiles (``tcgen05.ld``:
        thread ``tidx`` gets row ``tidx`` of the tile, 32 columns, in fp32) and, by ``self.epilogue``:

        * plain: convert, stage in shared memory, TMA-store D (token groups: each thread stores its row's columns
          in 16-byte vectors, only inside the row's group; zeros for the rows past ``offs[-1]``);
        * swiglu: per 32 h columns, the gate and up sub-tiles (64 columns apart, the interleaved layout) are
          stored as h13 (TMA; token groups: masked row stores) and fed to :func:`.gemm_epilogue.swiglu_block`;
        * dswiglu: each dh sub-tile goes to :func:`.gemm_epilogue.dswiglu_block` (which reads h13).

        Then release the accumulator stage to the MMA warp."""
        tmem.allocate(cute.arch.get_max_tmem_alloc_cols("sm_100"))
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
        acc = cute.make_tensor(acc_ptr, acc_layout)

        # TMEM -> registers
        acc_epi = cute.flat_divide(acc[((None, None), 0, 0, None)], epi_tile)
        t2r = tcgen05.make_tmem_copy(sm100.get_tmem_load_op(self.cta_tile, _ROW_MAJOR, self.d_dtype,
                                                            cutlass.Float32, epi_tile, self.cta_pair),
                                     acc_epi[(None, None, 0, 0, 0)])
        t2r_thr = t2r.get_slice(tidx)
        t_acc = t2r_thr.partition_S(acc_epi)
        id_epi = cute.flat_divide(cute.make_identity_tensor(self.cta_tile[:2]), epi_tile)
        r_acc = cute.make_rmem_tensor(t2r_thr.partition_D(id_epi)[(None, None, None, 0, 0)].shape, cutlass.Float32)
        frag = cute.make_tensor(r_acc.iterator, cute.make_layout(cute.size(r_acc)))  # the row's 32 values
        r_up = cute.make_rmem_tensor(r_acc.shape, cutlass.Float32)
        r_d = cute.make_rmem_tensor(r_acc.shape, self.d_dtype)
        store = None
        if cutlass.const_expr(tma_d is not None):
            # registers -> shared memory -> global (TMA)
            r2s = cute.make_tiled_copy_D(sm100.get_smem_store_op(_ROW_MAJOR, self.d_dtype,
                                                                 cutlass.Float32, t2r), t2r)
            r2s_thr = r2s.get_slice(tidx)
            gd_epi = cute.flat_divide(tcgd[((None, None), 0, 0, None, None, None)], epi_tile)
            sdt, gdt = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sd, 0, 2),
                                             cute.group_modes(gd_epi, 0, 2))
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.d_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.EPI_WARPS)))
            store = (r2s, r2s_thr.partition_D(sd), r2s.retile(r_d), sdt, gdt, store_pipe, tma_d)
        lane = tidx % 32

        tiles = PersistentTiles(*counts, self.cluster_mn)
        linear = tiles.first()
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        stored = cutlass.Int32(0)
        while tiles.valid(linear):
            mt, nt = tiles.tile(linear)  # this CTA's 128-row tile (of a 2-CTA MMA tile: half mt % 2)
            lt = 0
            row = mt * self.TILE_M + tidx
            mma_tile = (mt // pair, nt, lt)
            acc_pipe.consumer_wait(acc_state)
            tile_acc = cute.group_modes(t_acc[(None, None, None, None, None, acc_state.index)], 3, 5)
            if cutlass.const_expr(self.epilogue == "plain" and groups is None):
                for sub in cutlass.range(cute.size(tile_acc, mode=[3])):
                    cute.copy(t2r, tile_acc[(None, None, None, sub)], r_acc)
                    stored = self._store_d(store, r_acc, mma_tile, sub, stored, warp)
            grp = None
            if cutlass.const_expr(self.grouping == "m"):
                row0, rows_end, _, _, kt_tile, start, scale_row0 = self._tile_of(groups, rows, mt, pair, k_tiles)
                row = row0 + (mt % pair) * self.TILE_M + tidx  # this thread's row of D / h13
                # the fused casts: colwise blocks from the group's first row, grouped scale layouts
                grp = (start, scale_row0)
            if cutlass.const_expr(self.grouping == "k"):  # d[e]'s rows e N .. e N + N (an empty group: zeros)
                e, lmt, _, kt_tile, _, _, _ = self._wgrad_tile(groups, rows, cols, mt, nt)
                row = e * rows + lmt * self.TILE_M + tidx
                rows_end = e * rows + rows
            if cutlass.const_expr(self.epilogue == "plain" and groups is not None):
                for sub in cutlass.range(cute.size(tile_acc, mode=[3])):
                    cute.copy(t2r, tile_acc[(None, None, None, sub)], r_acc)
                    if kt_tile == 0:
                        r_acc.fill(0.0)
                    self._store_row(groups[0], frag, row, rows_end, nt * self.n_tile + sub * 32, cols)
            if cutlass.const_expr(self.epilogue == "swiglu"):
                for hb in cutlass.range(self.n_tile // 64, unroll=1):  # 32 h columns: gate and up sub-tiles
                    sub = 4 * (hb // 2) + hb % 2
                    cute.copy(t2r, tile_acc[(None, None, None, sub)], r_acc)
                    cute.copy(t2r, tile_acc[(None, None, None, sub + 2)], r_up)
                    up = cute.make_tensor(r_up.iterator, frag.layout)
                    h_col = nt * (self.n_tile // 2) + hb * 32
                    if cutlass.const_expr(groups is None):
                        stored = self._store_d(store, r_acc, mma_tile, sub, stored, warp)
                        stored = self._store_d(store, r_up, mma_tile, sub + 2, stored, warp)
                        swiglu_block(frag.load(), up.load(), fused, tr, row, h_col, lane, rows, cols // 2,
                                     self.cast, self.emit_hp)
                    else:  # rows past the group's end: zeros (they pad the colwise blocks; not stored)
                        if kt_tile == 0 or row >= rows_end:
                            r_acc.fill(0.0)
                            r_up.fill(0.0)
                        self._store_row(groups[0], frag, row, rows_end, nt * self.n_tile + sub * 32, cols)
                        self._store_row(groups[0], up, row, rows_end, nt * self.n_tile + (sub + 2) * 32, cols)
                        if kt_tile > 0:  # the tail tiles past offs[-1] have no h rows (q, qt zero-filled)
                            swiglu_block(frag.load(), up.load(), fused, tr, row, h_col, lane, rows_end, cols // 2,
                                         self.cast, self.emit_hp, grp)
            if cutlass.const_expr(self.epilogue == "dswiglu"):
                for sub in cutlass.range(self.n_tile // 32, unroll=1):
                    cute.copy(t2r, tile_acc[(None, None, None, sub)], r_acc)
                    if cutlass.const_expr(groups is None):
                        dswiglu_block(frag.load(), h13, fused, tr, row, nt * self.n_tile + sub * 32, lane, rows,
                                      cols, self.cast, self.emit_hp)
                    else:
                        if kt_tile > 0:
                            if row >= rows_end:  # the next group's rows: zeros (a NaN there stays there)
                                r_acc.fill(0.0)
                            dswiglu_block(frag.load(), h13, fused, tr, row, nt * self.n_tile + sub * 32, lane,
                                          rows_end, cols, self.cast, self.emit_hp, grp)
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            linear = tiles.next(linear)
        tmem.relinquish_alloc_permit()
        self.epi_sync.arrive_and_wait()
        tmem.free(acc_ptr)
        if cutlass.const_expr(store is not None):
            store[5].producer_tail()

    @cute.jit
    def _store_row(self, d: cute.Tensor, frag: cute.Tensor, row: cutlass.Int32, rows_end: cutlass.Int32,
                   col0: cutlass.Int32, cols: cutlass.Int32):
        """Token groups: the row's 32 values ``frag`` at columns ``col0 ..`` of D in 16-byte vectors (8 bf16 or 4
        fp32 each; N is a multiple of that, so a vector lies wholly inside or outside N, and rows start 16-byte
        aligned), only for a row inside its group."""
        vec = 16 // (self.d_dtype.width // 8)
        if row < rows_end:
            for v in cutlass.range_constexpr(32 // vec):
                col = col0 + vec * v
                if col < cols:
                    r = cute.make_rmem_tensor((vec,), self.d_dtype)
                    for j in cutlass.range_constexpr(vec):
                        r[j] = frag[vec * v + j].to(self.d_dtype)
                    dst = cute.make_tensor(d.iterator + cute.assume(row * cols + col, divby=vec),
                                           cute.make_layout(vec))
                    cute.autovec_copy(r, dst)

    @cute.jit
    def _store_d(self, store, r_acc, tile, sub, stored, warp):
        """Convert one accumulator sub-tile to D's dtype, stage it in shared memory and TMA-store it (warp 0
        issues; ``d_stages`` buffers rotate).  Returns the updated count of stored sub-tiles."""
        r2s, s_d, r_d_view, sdt, gdt, store_pipe, tma_d = store
        mt, nt, lt = tile
        tile_gd = cute.group_modes(gdt[(None, None, None, mt, nt, lt)], 1, 3)
        r_d_view.store(r2s.retile(r_acc).load().to(self.d_dtype))
        buf = stored % self.d_stages
        cute.copy(r2s, r_d_view, s_d[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_sync.arrive_and_wait()
        if warp == self.EPI_WARPS[0]:
            cute.copy(tma_d, sdt[(None, buf)], tile_gd[(None, sub)])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        self.epi_sync.arrive_and_wait()
        return stored + 1

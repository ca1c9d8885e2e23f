"""SM90 (Hopper) MXFP8 GEMM on fp8 WGMMA with per-block scale promotion: ``D = A · Bᵀ`` with E8M0 scales per 32
elements along K (issue 12, the *promotion* mainloop; first cut, correctness before speed).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup

from .mx_math import ELEM_DTYPES, e8m0_to_f32

_OUT_DTYPES = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}
_K_MAJOR = utils.LayoutEnum.ROW_MAJOR  # A (M, K) and B (N, K) with K contiguous


class MXGemmSm90:
    """MXFP8 GEMM for SM90: ``D (M, N) = Σ_b sa[m, b] · sb[n, b] · Σ_{k in block b} A[m, k] · B[n, k]`` in fp32,
    the reference's block-scaled product (OCP MX v1.0 blocks of 32 along K), rounded once to ``out_dtype``.

    Operands: A (M, K) and B (N, K) fp8, e4m3 or e5m2 each, K-major; their scales the blocked E8M0 buffers of
    ``quantize_rowwise(..., blocked=True)`` (cuBLAS block-scaling layout): the scales of a 128-row x 128-deep tile
    are one 512-byte chunk, and the 4 scales of one row in it are 4 consecutive bytes, read as one 32-bit load.

    Mainloop (*promotion*): one ``wgmma.mma_async ... .e4m3/.e5m2`` of K = 32 is exactly one MX block; it writes a
    zero-initialised partial accumulator, which is then added to the fp32 accumulator times ``sa[m] · sb[n]``
    (exact: a product of powers of two).  Warp roles (384 threads): warpgroup 0 loads A and B by TMA into
    ``stages`` shared-memory stages of 128 x 128 / ``n_tile`` x 128 bytes (``PipelineTmaAsync``; one warp issues);
    warpgroups 1 and 2 each own 64 rows of the 128 x ``n_tile`` output tile, so one promotes while the other's
    WGMMA runs.  Epilogue: each thread stores its accumulator elements, converted to ``out_dtype``, predicated on
    M and N (partial tiles).  One CTA per output tile (not persistent yet).

    Constraints (:meth:`can_implement`): K % 32 == 0 (TMA zero-fills a partial 128-deep K tile; its padded scales
    are zero), 16-byte aligned contiguous operands; any M, N >= 1.
    """

    TILE_M = 128
    K_STAGE = 128  # K elements per pipeline stage: 4 MX blocks, 4 WGMMAs per consumer warpgroup
    BLOCKS = 4
    CONSUMERS = 2
    THREADS = 128 * (1 + CONSUMERS)

    def __init__(self, a_elem: str, b_elem: str, out_dtype: str = "bfloat16", n_tile: int = 128):
        if a_elem not in ELEM_DTYPES or b_elem not in ELEM_DTYPES:
            raise ValueError(f"A/B element types must be in {sorted(ELEM_DTYPES)}, got {a_elem!r}, {b_elem!r}")
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {sorted(_OUT_DTYPES)}, got {out_dtype!r}")
        if n_tile != 128:
            raise ValueError(f"n_tile must be 128 (one blocked scale tile per N tile), got {n_tile}")
        self.a_dtype, self.b_dtype = ELEM_DTYPES[a_elem][0], ELEM_DTYPES[b_elem][0]
        self.d_dtype = _OUT_DTYPES[out_dtype]
        self.n_tile = n_tile

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
        self.tiled_mma = sm90.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (self.CONSUMERS, 1, 1), tiler_mn=(64, self.n_tile))
        self.stage_bytes = (self.TILE_M + self.n_tile) * self.K_STAGE  # fp8: one byte per element
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        # decoded scales: per buffer (2) and consumer warpgroup, 64 rows and n_tile columns x 4 blocks of fp32
        self.DEC_WORDS = (64 + self.n_tile) * self.BLOCKS
        dec_bytes = 2 * self.CONSUMERS * self.DEC_WORDS * 4
        self.stages = min(8, (capacity - 4096 - dec_bytes) // self.stage_bytes)
        self.a_smem = sm90.make_smem_layout_a(_K_MAJOR, self.tiler, self.a_dtype, self.stages)
        self.b_smem = sm90.make_smem_layout_b(_K_MAJOR, self.tiler, self.b_dtype, self.stages)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor, sfb: cute.Tensor, d: cute.Tensor,
                 stream: cuda.CUstream):
        """``a`` (M, K), ``b`` (N, K) fp8 K-major; ``sfa``/``sfb`` the 1-D blocked E8M0 buffers (bytes, 16-byte
        aligned); ``d`` (M, N) row-major."""
        self._configure()
        m, k = a.shape
        n = b.shape[0]
        tma_a, ga = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a,
                                                cute.slice_(self.a_smem, (None, None, 0)), (self.TILE_M, self.K_STAGE))
        tma_b, gb = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b,
                                                cute.slice_(self.b_smem, (None, None, 0)), (self.n_tile, self.K_STAGE))
        # the blocked scales as 32-bit words: word (tile * 128 + (r % 32) * 4 + (r % 128) // 32) holds the 4 block
        # scales of row r in 128-deep K tile ``tile % k_tiles``
        sfa_w = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=cutlass.Uint32),
                                 cute.make_layout(cute.size(sfa) // 4))
        sfb_w = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=cutlass.Uint32),
                                 cute.make_layout(cute.size(sfb) // 4))
        k_tiles = (k + self.K_STAGE - 1) // self.K_STAGE

        @cute.struct
        class Shared:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem.outer)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem.outer)], 1024]
            sdec: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * self.CONSUMERS * self.DEC_WORDS], 16]

        self.shared = Shared
        grid = ((m + self.TILE_M - 1) // self.TILE_M, (n + self.n_tile - 1) // self.n_tile, 1)
        self.kernel(self.tiled_mma, tma_a, ga, tma_b, gb, sfa_w, sfb_w, d, m, n, k_tiles, self.a_smem,
                    self.b_smem).launch(grid=grid, block=[self.THREADS, 1, 1], smem=Shared.size_in_bytes(),
                                        stream=stream)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, ga: cute.Tensor, tma_b: cute.CopyAtom,
               gb: cute.Tensor, sfa_w: cute.Tensor, sfb_w: cute.Tensor, d: cute.Tensor, rows: cutlass.Int32,
               cols: cutlass.Int32, k_tiles: cutlass.Int32, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        bm, bn, _ = cute.arch.block_idx()
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        st = cutlass.memory.SmemAllocator().allocate(self.shared)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.CONSUMERS * 4),  # one per warp
            tx_count=self.stage_bytes)
        sa = st.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sb = st.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)

        if wg == 0:
            cute.arch.warpgroup_reg_dealloc(40)
            if warp == 0:  # TMA producer
                gak = cute.local_tile(ga, (self.TILE_M, self.K_STAGE), (bm, None))
                gbk = cute.local_tile(gb, (self.n_tile, self.K_STAGE), (bn, None))
                tas, tag = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sa, 0, 2),
                                                 cute.group_modes(gak, 0, 2))
                tbs, tbg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sb, 0, 2),
                                                 cute.group_modes(gbk, 0, 2))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for kt in cutlass.range(k_tiles, unroll=1):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    cute.copy(tma_a, tag[(None, kt)], tas[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tbg[(None, kt)], tbs[(None, state.index)], tma_bar_ptr=bar)
                    pipe.producer_commit(state)
                    state.advance()
                pipe.producer_tail(state)
        else:
            cute.arch.warpgroup_reg_alloc(232)
            sdec = st.sdec.get_tensor(cute.make_layout(2 * self.CONSUMERS * self.DEC_WORDS))
            self.consume(mma, pipe, sa, sb, sdec, sfa_w, sfb_w, d, rows, cols, k_tiles, tidx - 128, bm, bn)

    @cute.jit
    def consume(self, mma: cute.TiledMma, pipe, sa: cute.Tensor, sb: cute.Tensor, sdec: cute.Tensor,
                sfa_w: cute.Tensor, sfb_w: cute.Tensor, d: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32,
                k_tiles: cutlass.Int32, ct: cutlass.Int32, bm: cutlass.Int32, bn: cutlass.Int32):
        """A consumer warpgroup: 64 rows x ``n_tile`` of the tile.  Thread ``t`` of warp ``w`` holds the WGMMA
        accumulator rows ``16 w + t // 4 (+ 8)`` and columns ``8 j + 2 (t % 4) (+ 1)``: fragment element
        ``e + 2 rs + 4 j`` is (row + 8 rs, column 8 j + 2 (t % 4) + e).

        Per 128-deep K stage the warpgroup first decodes the stage's scales once into shared memory (thread t: the
        4 block scales of row t (t < 64) and of column t, one 32-bit load each; double-buffered, one named barrier
        per stage), then runs the stage's 4 WGMMAs one ahead of the promotion: WGMMA b + 1 runs on the tensor cores
        while the CUDA cores add partial b, times ``sa[row] * sb[col]``, to the accumulator."""
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
        ncol = self.n_tile // 4  # accumulator columns per thread
        rl = w * 16 + lane // 4  # warpgroup-local row of fragment elements with rs = 0
        ra = wgi * 64 + t  # the tile row whose scales this thread decodes (t < 64)
        mma.set(warpgroup.Field.ACCUMULATE, False)  # every WGMMA is one MX block: it starts its partial at zero
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for kt in cutlass.range(k_tiles, unroll=1):
            # decode this stage's scales into this warpgroup's half of buffer kt % 2
            base = ((kt % 2) * self.CONSUMERS + wgi) * self.DEC_WORDS
            bw = sfb_w[(bn * k_tiles + kt) * 128 + (t % 32) * 4 + t // 32]
            for blk in cutlass.range_constexpr(self.BLOCKS):
                sdec[base + 64 * self.BLOCKS + blk * self.n_tile + t] = \
                    e8m0_to_f32(cutlass.Int32((bw >> (8 * blk)) & 0xFF))
            if t < 64:
                aw = sfa_w[(bm * k_tiles + kt) * 128 + (ra % 32) * 4 + ra // 32]
                for blk in cutlass.range_constexpr(self.BLOCKS):
                    sdec[base + blk * 64 + t] = e8m0_to_f32(cutlass.Int32((aw >> (8 * blk)) & 0xFF))
            cute.arch.barrier(barrier_id=1 + wgi, number_of_threads=128)
            pipe.consumer_wait(state)
            warpgroup.fence()
            cute.gemm(mma, parts[0], fa[(None, None, 0, state.index)], fb[(None, None, 0, state.index)], parts[0])
            warpgroup.commit_group()
            for blk in cutlass.range_constexpr(self.BLOCKS):
                if cutlass.const_expr(blk + 1 < self.BLOCKS):
                    nxt = parts[(blk + 1) % 2]
                    warpgroup.fence()
                    cute.gemm(mma, nxt, fa[(None, None, blk + 1, state.index)], fb[(None, None, blk + 1, state.index)],
                              nxt)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                part = parts[blk % 2]
                scale_a = (sdec[base + blk * 64 + rl], sdec[base + blk * 64 + rl + 8])
                for q in cutlass.range_constexpr(ncol):
                    c = 8 * (q // 2) + 2 * (lane % 4) + q % 2
                    scale_b = sdec[base + 64 * self.BLOCKS + blk * self.n_tile + c]
                    for rs in cutlass.range_constexpr(2):
                        i = q % 2 + 2 * rs + 4 * (q // 2)
                        acc[i] = acc[i] + part[i] * (scale_a[rs] * scale_b)
            pipe.consumer_release(state)
            state.advance()

        row0 = bm * self.TILE_M + wgi * 64 + rl
        for q in cutlass.range_constexpr(ncol):
            col = bn * self.n_tile + 8 * (q // 2) + 2 * (lane % 4) + q % 2
            for rs in cutlass.range_constexpr(2):
                row = row0 + 8 * rs
                if row < rows and col < cols:
                    d[row, col] = acc[q % 2 + 2 * rs + 4 * (q // 2)].to(self.d_dtype)

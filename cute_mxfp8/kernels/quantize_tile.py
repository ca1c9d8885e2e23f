"""CuTe DSL register-tile MXFP8 casts: colwise (32x1 blocks), dual (rowwise + colwise from ONE read of the input)
and rowwise, for 2-D activations (as a batch of one), 3-D expert weights (E, N, K) and, for the 2d-2d wgrad
operands, token groups along M (``offs``); and the same tiles behind a SwiGLU forward / backward prologue
(:class:`SwiGLUQuantKernel`).

Arch-generic (SM90 and SM100): vectorized global loads and stores and warp shuffles; shared memory as the staged
loop's lane-private cp.async buffers (no barriers) and, in the one-launch 128-block casts (the Hopper fast mode),
for the 128-block amaxes the CTA's warps exchange across one barrier.  The block math, amax reductions and SwiGLU
are the device functions of :mod:`cute_mxfp8.kernels.mx_math` (bit-exact with ``cute_mxfp8.formats`` for the
casts).  Work split, tails and groups: :class:`TileQuantKernel`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .mx_math import (BLOCK, MXCastParams, apply_scale, block_scale, blocked_scale_offset, group_start,
                      grouped_k_scale_offset, last_group_at_or_below, pack_fp8x4, pack_fp8x8, reduce_scatter_max,
                      swiglu_bwd, swiglu_fwd)

VEC = 4  # columns per lane
LANE_ROWS = 8  # rows per lane
COL_LANES = BLOCK // VEC  # 8 lanes along K cover one rowwise block (32 columns)
ROW_LANES = BLOCK // LANE_ROWS  # 4 lanes along M cover one colwise block (32 rows)
WARPS = 4  # warps per CTA, side by side along K: a CTA tile is 32 rows x 128 columns
CTA_COLS = WARPS * BLOCK
RUN = 4  # 32-row blocks per 128-block along M: the one-pass 128-block cast's CTA covers one run
TAIL_ROWS = 256  # with token groups, each tail CTA covers this many rows past offs[-1] (TileQuantKernel._tail)
assert TAIL_ROWS % (RUN * BLOCK) == 0, "the tail CTAs unroll whole runs of the one-pass cast"


PROLOGUES = ("cast", "swiglu", "dswiglu")


class TileQuantKernel(MXCastParams):
    """Register-tile MXFP8 cast of ``x (E, M, K)`` (a 2-D input is passed as E = 1), optionally behind a SwiGLU
    prologue (:class:`SwiGLUQuantKernel`).

    Compile-time parameters (the compile key): element dtype, ``scale_mode``, ``blocked`` scales, ``rowwise`` and
    ``colwise`` outputs (at least one), ``grouped`` (token groups along M; needs ``colwise``, E == 1), the
    ``prologue`` (``"cast"`` here), ``emit_hp`` (also store the high-precision tile, in the dtype of ``hp``) and
    ``row_tiles`` (1: one row block per CTA; more: the staged loop below; ignored with token groups),
    ``keep_run`` and ``gate_up`` (the one-launch 128-block cast below), ``packed_stores`` (below).

    Outputs (contiguous), for a cast of width K:

    * rowwise: data (E, M, K); scales plain (E, M, K/32) or blocked (E, blocked_scales_numel(M, K/32)); with
      groups, blocked scales use the grouped-M layout (group g from tile ``tile_starts[g]``).
    * colwise: data (E, K, Mp), Mp = ceil(M/32)*32 (zero padded); scales plain (E, K, Mp/32) or blocked
      (E, blocked_scales_numel(K, Mp/32)).  With groups: data (1, K, M); scales aligned grouped-K
      (1, K, 4 * tiles) plain or blocked (1, blocked_scales_numel(K, 4 * tiles)), zero-filled by the caller.

    Work split: a warp owns one 32 x 32 block tile (one rowwise block wide, one colwise block tall); lane
    ``(rg, cg) = (lane // 8, lane % 8)`` holds rows ``[8 rg, 8 rg + 8)`` x columns ``[4 cg, 4 cg + 4)`` in 32 fp32
    registers, loaded as 8 vectors (8 bytes bf16, 16 bytes fp32), all issued before any is used.  Amax: each lane
    reduces its 4-element rows and 8-element columns, then a reduce-scatter over the 8 ``cg`` lanes (7 shuffles)
    leaves lane ``cg`` with the amax of row ``cg`` of its row group, and one over the 4 ``rg`` lanes (3 shuffles)
    leaves lane ``rg`` with the amax of column ``rg``; each lane computes that one scale, writes its byte and
    broadcasts the factor (8 + 4 shuffles).  Each lane stores 4 bytes per row (8 lanes: 32 contiguous bytes) and
    8 bytes per column of the transposed output (4 lanes: the 32-byte block).  4 warps side by side along K
    form a CTA; grid (32-row blocks, K / 128, E).

    Staged loop (``row_tiles > 1``, no token groups): grid (ceil(row blocks / row_tiles), K / 128, E); a CTA walks
    row blocks ``blockIdx.x + i * gridDim.x``, and while one block is computed the next block's input tiles are
    already on their way: each lane cp.asyncs its 8 x 4 tiles (8 bytes bf16, 16 bytes fp32 per row) into a
    lane-private double buffer in shared memory (4 warps x 2 buffers x operands x 2 KB bf16), so the prefetch
    holds no registers.  No barriers: each lane reads back only what it copied, after ``cp.async.wait_group``.

    Rows past the end (M tail, or a token group's end) read as zero: the colwise block is quantized as if
    zero-padded, exactly as ``cute_mxfp8.formats`` specifies.  With token groups, CTAs walk *virtual* 32-row
    blocks: the aligned grouped-K scale columns ``[4 * tile_starts[g], 4 * tile_starts[g] + ceil(size_g / 32))``
    of each group g; a virtual block past its group's blocks does nothing (its scales stay zero, from the
    caller's zero-filled buffer).  Blocked colwise scales go to the grouped-K layout (each group's tiles blocked
    on their own, ``formats.to_blocked_scales_grouped_k``).  Rows at or past ``offs[-1]`` (found on the device, so
    the host never needs ``offs[-1]``) belong to tail CTAs appended to the grid, ``ceil(M / TAIL_ROWS)`` per column
    tile, each owning ``TAIL_ROWS`` rows from ``offs[-1]`` (those past M exit at once): the cast quantizes them
    rowwise as any row (plain scales; there is no grouped blocked scale for them), the SwiGLU kernels store zeros
    (data, plain scales, ``hp``), and both store zeros in the unpadded colwise data (:meth:`_tail`).
    ``pad_groups`` (the ops' ``token_align=128``): the colwise data is (1, K, 32 * virtual blocks), virtual block
    vb at columns ``[32 vb, 32 vb + 32)``, i.e. every group from column ``128 * tile_starts[g]``
    (``formats.pad_token_groups``).  The blocks then store 8-byte vectors like the dense layout, and a virtual
    block past its group's tokens stores zeros (plus, inside the group's last 128-run, the run's scale), so the
    kernel writes every column and the caller needs no fill.

    ``scale_block=128`` (the Hopper fast mode's shared scales, ``formats.quantize_mxfp8(..., scale_block=128)``):
    every run of 4 blocks along the scaled dim, counted from its start (a token group's start with groups),
    takes the scale of the run's amax, so the 4 stored scales are equal.  ``phase="cast"`` (one launch, what the
    ops run): a CTA owns one run of 4 (virtual) row blocks, so both 128-blocks of every element are inside it
    (rows: the 4 warps' 32 columns; columns: the 4 row blocks).  It walks the run twice: the first walk only
    reduces (column amaxes in a register per lane, row amaxes per warp in 2 KB of shared memory), one CTA
    barrier, the second walk reloads the tiles (from L2: the CTA read them moments before) and casts with the
    128-block amaxes.  ``blocks_2d`` (weights; ``formats.quantize_mxfp8(..., blocks_2d=True)``): the CTA's
    128 x 128 tile shares one scale, so the first walk keeps one running amax per lane, each warp reduces it with 5
    shuffles into one shared-memory word, and both casts take the tile's amax after the barrier.
    ``keep_run`` (the plain cast only): the first walk keeps each of the run's 4 tiles in registers as loaded (64
    registers of bf16), and the second casts from them instead of reloading (one set of global loads; 128 registers
    instead of 56-64, so fewer CTAs per SM: on the H200 17-34 % less kernel time without token groups, 13 % with
    them, ``tools/fast_mode_casts.py``; the run's group is looked up once for both walks, :meth:`_blocks`).
    ``gate_up`` (any direction, no groups; :meth:`launch_gate_up`): the input is W13 = [w1; w3] read from its two
    halves, w1 ``(E, I, K)`` as x and w3 as the second operand, I % 128 == 0 so that each CTA's run lies in one of
    them (the ops' packed weight cast without a packed copy).
    So DRAM sees one read of the input, with no amax buffers and no atomics (the casts;
    :class:`SwiGLUQuantKernel` holds the run in registers instead, see there).  The two-launch form of the same math:
    ``phase="amax"`` reduces each lane's row and column amaxes as above and ``atomicMax``-es the fp32 bit patterns
    (non-negative, so integer order; NaN above Inf) into ``amax_rows`` (E, M, ceil(K/128)) and ``amax_cols``
    (E, ceil(blocks/4), K) int32, zero-filled by the caller, and stores nothing else; ``phase="apply"`` reads them
    back in place of its own amaxes and casts.  The input is read twice (the pre-pass computes the prologue too).

    Constraints (checked by the ops layer): K % 32 == 0; x contiguous, 16-byte aligned; fewer than 2**31
    elements; K / 128 and E at most 65535 (grid y and z).
    """

    prologue = "cast"
    resident = False  # SwiGLUQuantKernel's one-launch 128-block form (RUN x WARPS warps, tiles kept in registers)
    persistent_ctas = 0  # SwiGLUQuantKernel's resident form as a persistent loop over the runs (0: one run per CTA)

    def __init__(self, elem: str, scale_mode: str, blocked: bool, rowwise: bool, colwise: bool,
                 grouped: bool = False, emit_hp: bool = False, row_tiles: int = 1, scale_block: int = 32,
                 phase: str = "cast", pad_groups: bool = False, blocks_2d: bool = False, keep_run: bool = False,
                 gate_up: bool = False, packed_stores: bool = False):
        super().__init__(elem, scale_mode, blocked)
        if type(packed_stores) is not bool:
            raise TypeError(f"packed_stores must be a bool, got {type(packed_stores).__name__}")
        # the fp8 stores as packed words (pack_fp8x4 / pack_fp8x8) and, for full 32-row blocks, rowwise without
        # per-row checks from one base: 7-22 % fewer instructions on the sm_90a fall-through path (2026-12-05,
        # CPU); the default stores' bytes on the H200 (2026-12-06, tests/test_packed_stores.py), what the ops build
        # (ops.cute_kernels.PACKED_STORES)
        self.packed_stores = packed_stores
        if type(gate_up) is not bool or (gate_up and (scale_block != 128 or phase != "cast" or grouped
                                                      or self.prologue != "cast")):
            raise ValueError(f"gate_up (a bool: the cast of W13 = [w1; w3] read from w1 and w3) needs the "
                             f"one-launch 128-block cast without token groups, got gate_up={gate_up!r} with "
                             f"scale_block={scale_block!r}, phase={phase!r}, grouped={grouped!r}, "
                             f"prologue={self.prologue!r}")
        self.gate_up = gate_up
        if type(keep_run) is not bool or (keep_run and (scale_block != 128 or phase != "cast"
                                                        or self.prologue != "cast")):
            raise ValueError(f"keep_run (a bool: the one-pass 128-block cast keeps its run's tiles in registers) "
                             f"needs scale_block=128, phase='cast' and the plain cast, got keep_run={keep_run!r} "
                             f"with scale_block={scale_block!r}, phase={phase!r}, prologue={self.prologue!r}")
        self.keep_run = keep_run
        if type(blocks_2d) is not bool or (blocks_2d and (scale_block != 128 or phase != "cast" or grouped
                                                          or self.prologue != "cast")):
            raise ValueError(f"blocks_2d (a bool: 128 x 128 tiles share a scale, for weights) needs the one-pass "
                             f"128-block cast without token groups, got blocks_2d={blocks_2d!r} with scale_block="
                             f"{scale_block!r}, phase={phase!r}, grouped={grouped!r}, prologue={self.prologue!r}")
        self.blocks_2d = blocks_2d
        if pad_groups and not (grouped and colwise):
            raise ValueError("pad_groups is a layout of the colwise output of token groups: it needs grouped=True "
                             "and colwise=True")
        if not (rowwise or colwise) or (grouped and not colwise and scale_block == 32):
            raise ValueError("TileQuantKernel needs colwise output, or rowwise without groups (with groups: "
                             "scale_block=128 only)")
        if not isinstance(row_tiles, int) or row_tiles < 1:
            raise ValueError(f"row_tiles must be a positive int, got {row_tiles!r}")
        if scale_block not in (32, 128) or type(scale_block) is not int:
            raise ValueError(f"scale_block must be 32 (MX blocks) or 128 (the Hopper fast mode), got {scale_block!r}")
        if phase not in ("cast", "amax", "apply") or (scale_block == 32 and phase != "cast"):
            raise ValueError(f"phase is 'cast' (one launch), or for scale_block 128 also the two-launch 'amax' then "
                             f"'apply'; got phase={phase!r} with scale_block={scale_block}")
        self.rowwise, self.colwise, self.grouped, self.emit_hp = rowwise, colwise, grouped, emit_hp
        self.pad_groups = pad_groups
        self.scale_block, self.phase = scale_block, phase
        self.one_pass = scale_block == 128 and phase == "cast"  # one CTA per run of 4 row blocks (above)
        # token groups and the one-pass 128-block cast: one (virtual) row block (run) per CTA
        self.row_tiles = 1 if grouped or self.one_pass else row_tiles

    @cute.jit
    def launch(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
               offs: cute.Tensor, tile_starts: cute.Tensor, amax_rows: cute.Tensor, amax_cols: cute.Tensor,
               stream: cuda.CUstream):
        """The cast: ``x (E, M, K)`` -> the outputs above (unused ones take placeholders); ``amax_rows`` /
        ``amax_cols`` the 128-block amaxes of ``scale_block=128`` (placeholders otherwise)."""
        self._launch(x, x, q, s, qt, st, q, offs, tile_starts, amax_rows, amax_cols, x.shape[2], stream)

    @cute.jit
    def launch_gate_up(self, w1: cute.Tensor, w3: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor,
                       st: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor, amax_rows: cute.Tensor,
                       amax_cols: cute.Tensor, stream: cuda.CUstream):
        """``gate_up``: the cast of W13 = [w1; w3] ``(E, 2I, K)`` from ``w1`` and ``w3`` ``(E, I, K)``
        (I % 128 == 0, so no run holds rows of both), outputs as :meth:`launch` for 2I rows."""
        self._launch(w1, w3, q, s, qt, st, q, offs, tile_starts, amax_rows, amax_cols, w1.shape[2], stream)

    @cute.jit
    def _launch(self, x: cute.Tensor, y: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor,
                st: cute.Tensor, hp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor,
                amax_rows: cute.Tensor, amax_cols: cute.Tensor, k: cutlass.Int32, stream: cuda.CUstream):
        """``k``: the input columns each lane walks (the cast width; I for the SwiGLU prologues)."""
        e, m = x.shape[0], x.shape[1]
        if cutlass.const_expr(self.grouped):  # the aligned grouped-K scale columns: 4 * (M // 128 + G)
            vblocks = 4 * (m // 128 + cute.size(offs))
            gqt = qt  # (1, K, M), any M: stored bytewise
            if cutlass.const_expr(self.pad_groups):  # (1, K, 32 * vblocks): virtual block vb at column 32 vb
                gqt = cute.zipped_divide(qt, (1, 1, LANE_ROWS))
        elif cutlass.const_expr(self.colwise):
            vblocks = qt.shape[2] // BLOCK
            gqt = cute.zipped_divide(qt, (1, 1, LANE_ROWS))
        else:  # rowwise only: the cast's rows
            vblocks = cute.ceil_div(self._cast_rows(m), BLOCK)
            gqt = cute.zipped_divide(qt, (1, 1, LANE_ROWS))  # unused
        grid_x = cute.ceil_div(vblocks, RUN if self.one_pass else self.row_tiles)
        if cutlass.const_expr(self.grouped):  # the tail CTAs: rows at or past offs[-1] (see the class docstring)
            grid_x = grid_x + cute.ceil_div(m, TAIL_ROWS)
        grid = (grid_x, cute.ceil_div(k, CTA_COLS), e)
        if cutlass.const_expr(self.persistent_ctas > 0):  # the same (run, column tile) items, walked by at most
            # persistent_ctas CTAs per expert (_resident_loop)
            grid = (cutlass.min(cutlass.Int32(self.persistent_ctas), grid_x * cute.ceil_div(k, CTA_COLS)), 1, e)
        self.kernel(cute.zipped_divide(x, (1, 1, VEC)), cute.zipped_divide(y, (1, 1, VEC)),
                    cute.zipped_divide(q, (1, 1, VEC)), s, gqt, st, cute.zipped_divide(hp, (1, 1, VEC)), offs,
                    tile_starts, amax_rows, amax_cols, vblocks, k // VEC).launch(
            grid=grid,
            block=(self._threads(), 1, 1), stream=stream, smem=self._smem_bytes(x.element_type),
            **self._launch_bounds())

    def _cast_rows(self, m):
        """The cast's rows for an input of ``m`` rows: ``m``, or with ``gate_up`` W13's 2I (rows [0, I) of w1,
        then [I, 2I) of w3)."""
        return 2 * m if self.gate_up else m

    def _threads(self) -> int:
        """Threads per CTA: 4 warps side by side along K, or (``resident``) 4 rows of them, one per block of the
        run."""
        return 32 * WARPS * (RUN if self.resident else 1)

    def _outputs(self) -> int:
        """Cast outputs per input tile: 2 for the dSwiGLU (dg at column vector ``cv``, du at ``cv + kv``), else
        1."""
        return 2 if self.prologue == "dswiglu" else 1

    def _run(self) -> int:
        """(Virtual) 32-row blocks per CTA: a run of 4 in the one-pass 128-block cast, else 1 (token groups)."""
        return RUN if self.one_pass else 1

    def _smem_bytes(self, dtype) -> int:
        """Dynamic shared memory per CTA: the one-pass 128-block cast's row amaxes (4 x 32 rows x 4 warps, int32;
        the resident form also the column amaxes, per output; persistent: two sets and two prefetch buffers), or
        the staged loop's cp.async buffers (``row_tiles > 1``: two tiles per operand per warp), else none."""
        if self.resident:  # per output: the row amaxes as above, and the column amaxes (32 x 4 warps x 4 blocks)
            if self.persistent_ctas:  # two sets (by the parity of the CTA's item) and the lanes' two buffers
                return (4 * RUN * BLOCK * WARPS * 4 * self._outputs()
                        + 2 * RUN * WARPS * 32 * LANE_ROWS * VEC * len(self._operand_names()) * dtype.width // 8)
            return 2 * RUN * BLOCK * WARPS * 4 * self._outputs()
        if self.one_pass:
            return RUN * BLOCK * WARPS * 4
        if self.row_tiles == 1:
            return 0
        return WARPS * 2 * len(self._operand_names()) * 32 * LANE_ROWS * VEC * dtype.width // 8

    def _launch_bounds(self) -> dict:
        """Resident CTAs per SM (``__launch_bounds__``) of the one-tile-per-CTA SwiGLU kernels: the register cap
        ptxas gets.  Such a warp loads, computes and stores one tile with no overlap of its own, so resident warps
        are what hides memory latency: 6 CTAs forward (80 registers) and 4 backward (128) fit without spills; the
        forward keeps 5 with the high-precision store or token groups, the backward 3 with token groups (checked
        for every variant by ``inspect``).  With :class:`SwiGLUQuantKernel`'s defaults the one-tile paths are the
        token-group ones and the backward with ``emit_hp``.  The staged loop is told one CTA per SM is enough
        (160-220 registers; without the bound, ptxas for sm_100a stopped the bf16 forward at 128 and spilled)."""
        if self.prologue == "cast":
            return {}
        if self.resident:
            return {"min_blocks_per_mp": 1, "max_number_threads": [self._threads(), 1, 1],
                    "preferred_smem_carveout": 0}
        if self.row_tiles > 1:
            return {"min_blocks_per_mp": 1, "max_number_threads": [32 * WARPS, 1, 1], "preferred_smem_carveout": 0}
        if self.prologue == "swiglu":
            n = 5 if self.emit_hp or self.grouped else 6
        else:
            n = 3 if self.grouped else 4
        # the carveout is given so that the DSL does not query a GPU for it (kernels compile on CPU-only machines)
        return {"min_blocks_per_mp": n, "max_number_threads": [32 * WARPS, 1, 1], "preferred_smem_carveout": 0}

    def _operand_names(self):
        return {"cast": ("x",), "swiglu": ("gate", "up"), "dswiglu": ("dh", "gate", "up")}[self.prologue]

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gy: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor,
               st: cute.Tensor, ghp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor, ra: cute.Tensor,
               ca: cute.Tensor, vblocks: cutlass.Int32, kv: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        vb, bk, e = cute.arch.block_idx()  # vb: this CTA's (virtual) 32-row block
        warp = tidx // 32
        lane = tidx - warp * 32
        rg = lane // COL_LANES
        cg = lane - rg * COL_LANES
        cb = bk * WARPS + warp  # this warp's 32-column block (warp-uniform)
        if cutlass.const_expr(self.row_tiles > 1):
            nops = len(self._operand_names())
            staging = cutlass.memory.SmemAllocator().allocate_tensor(
                gx.element_type, cute.make_layout((VEC, 32, LANE_ROWS, nops, 2, WARPS)), 16)
            if cb * COL_LANES < kv:
                self._staged(gx, gy, gq, s, gqt, st, ghp, staging, vblocks, kv, cb * COL_LANES + cg,
                             e, warp, lane, rg, cg, vb, ra, ca)
        elif cutlass.const_expr(self.persistent_ctas > 0):
            self._resident_loop(gx, gy, gq, s, gqt, st, ghp, offs, tile_starts, ra, ca, vblocks, kv, e, vb, warp,
                                lane, rg, cg)
        elif cutlass.const_expr(self.resident):
            self._resident(gx, gy, gq, s, gqt, st, ghp, offs, tile_starts, ra, ca, vblocks, kv, e, vb, bk, warp, lane,
                           rg, cg)
        else:
            amaxes = None
            if cutlass.const_expr(self.one_pass):
                rows_s = cutlass.memory.SmemAllocator().allocate_tensor(
                    cutlass.Int32, cute.make_layout((RUN * BLOCK, WARPS)), 16)
                cacc = cute.make_rmem_tensor((1,), cutlass.Int32)
                amaxes = (rows_s, cacc, warp)
            args = (gx, gy, gq, s, gqt, st, ghp, offs, tile_starts, ra, ca, vblocks, kv, e, lane, rg, cg,
                    cb * COL_LANES + cg, amaxes)
            if cutlass.const_expr(self.grouped):
                main = (vblocks + self._run() - 1) // self._run()  # CTAs of the groups' virtual blocks
                if vb < main:
                    self._blocks(args, vb, cb * COL_LANES < kv)
                else:
                    self._tail(args, vb - main, cb * COL_LANES < kv)
            else:
                self._blocks(args, vb, cb * COL_LANES < kv)

    @cute.jit
    def _resident(self, gx: cute.Tensor, gy: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor,
                  st: cute.Tensor, ghp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor, ra: cute.Tensor,
                  ca: cute.Tensor, vblocks, kv, e, vb, bk, warp, lane, rg, cg):
        """``resident`` CTA ``vb``: warp ``(wr, wk)`` = ``(warp // 4, warp % 4)`` owns row block ``wr`` of the run
        and 32-column block ``wk`` of the CTA's 128 columns; with token groups, CTAs past the groups' runs are the
        tail's (:meth:`_tail`)."""
        alloc = cutlass.memory.SmemAllocator()
        nout = self._outputs()
        rows_s = alloc.allocate_tensor(cutlass.Int32, cute.make_layout((RUN * BLOCK, WARPS, nout)), 16)
        cols_s = alloc.allocate_tensor(cutlass.Int32, cute.make_layout((BLOCK, WARPS, RUN, nout)), 16)
        wk = warp % WARPS
        wr = warp // WARPS
        cb = bk * WARPS + wk
        args = (gx, gy, gq, s, gqt, st, ghp, offs, tile_starts, ra, ca, vblocks, kv, e, lane, rg, cg,
                cb * COL_LANES + cg, (rows_s, cols_s, wk, wr))
        if cutlass.const_expr(self.grouped):
            if vb < (vblocks + RUN - 1) // RUN:
                self._resident_run(args, vb, cb * COL_LANES < kv)
            else:
                self._tail(args, vb - (vblocks + RUN - 1) // RUN, cb * COL_LANES < kv)
        else:
            self._resident_run(args, vb, cb * COL_LANES < kv)

    @cute.jit
    def _resident_loop(self, gx: cute.Tensor, gy: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor,
                       st: cute.Tensor, ghp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor,
                       ra: cute.Tensor, ca: cute.Tensor, vblocks, kv, e, cta, warp, lane, rg, cg):
        """``persistent_ctas``: the resident form's items (run, 128-column tile), column tile fastest, runs past the
        groups' last (the tail's, with token groups) last, walked by CTA ``cta`` with a stride of the grid.  While
        an item is reduced and cast, each lane's input tiles of the CTA's next item are already on their way:
        cp.async into the lane's slots of the other of two shared-memory buffers (8 x 4 elements per operand and
        lane; no barrier: each lane reads back only what it copied), issued at the start of the item, so the buffer
        it fills was read in the previous item.  The amax slots alternate between two sets by the item's parity, so
        a warp that runs ahead writes the next item's slots while a slower one still reads this item's: the one
        barrier per item is all the loop needs."""
        alloc = cutlass.memory.SmemAllocator()
        nout = self._outputs()
        rows_l = cute.make_layout((RUN * BLOCK, WARPS, nout))
        cols_l = cute.make_layout((BLOCK, WARPS, RUN, nout))
        rows_s = alloc.allocate_tensor(cutlass.Int32, cute.make_layout(2 * cute.size(rows_l)), 16)
        cols_s = alloc.allocate_tensor(cutlass.Int32, cute.make_layout(2 * cute.size(cols_l)), 16)
        nops = len(self._operand_names())
        staging = alloc.allocate_tensor(gx.element_type,
                                        cute.make_layout((VEC, 32, LANE_ROWS, nops, RUN * WARPS, 2)), 16)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), gx.element_type,
                                   num_bits_per_copy=VEC * gx.element_type.width)
        wk = warp % WARPS
        wr = warp // WARPS
        ctiles = (kv + WARPS * COL_LANES - 1) // (WARPS * COL_LANES)  # 128-column tiles
        main = (vblocks + RUN - 1) // RUN  # runs of the (virtual) row blocks; then the tail's, with groups
        runs = main
        if cutlass.const_expr(self.grouped):
            runs = main + (cute.size(gx, mode=[1, 1]) + TAIL_ROWS - 1) // TAIL_ROWS
        items = runs * ctiles
        stride = cute.arch.grid_dim()[0]
        fetch = (gx, gy, offs, tile_starts, staging, atom, kv, e, main, wk, wr, warp, lane, rg, cg)
        # item w is (run, column tile) = divmod(w, ctiles), stepped by the stride without dividing per item
        step_run = stride // ctiles
        step_bk = stride - step_run * ctiles
        run = cta // ctiles
        bk = cta - run * ctiles
        self._prefetch(fetch, run, bk, 0)
        parity = cutlass.Int32(0)
        for w in cutlass.range(cta, items, stride):
            nrun = run + step_run
            nbk = bk + step_bk
            if nbk >= ctiles:
                nbk = nbk - ctiles
                nrun = nrun + 1
            self._prefetch(fetch, nrun, nbk, 1 - parity)  # (that buffer was read in the previous item)
            cute.arch.cp_async_wait_group(1)  # this lane's tiles of item w are in buffer parity
            cb = bk * WARPS + wk
            amaxes = (cute.make_tensor(rows_s.iterator + parity * cute.size(rows_l), rows_l),
                      cute.make_tensor(cols_s.iterator + parity * cute.size(cols_l), cols_l), wk, wr)
            args = (gx, gy, gq, s, gqt, st, ghp, offs, tile_starts, ra, ca, vblocks, kv, e, lane, rg, cg,
                    cb * COL_LANES + cg, amaxes)
            if cutlass.const_expr(self.grouped):
                if run < main:  # CTA-uniform, as the barrier inside needs
                    self._resident_run(args, run, cb * COL_LANES < kv, (staging, warp, parity))
                else:  # the tail's items come last: nothing more to prefetch
                    self._tail(args, run - main, cb * COL_LANES < kv)
            else:
                self._resident_run(args, run, cb * COL_LANES < kv, (staging, warp, parity))
            parity = 1 - parity
            run = nrun
            bk = nbk

    @cute.jit
    def _prefetch(self, fetch, run, bk, buf):
        """cp.async the lane's input tiles of item (``run``, column tile ``bk``), when it is one of the groups' runs
        (not the tail's, nor past the items) with data for this warp, into its buffer ``buf``, as one commit group
        (possibly empty)."""
        gx, gy, offs, tile_starts, staging, atom, kv, e, main, wk, wr, warp, lane, rg, cg = fetch
        cb = bk * WARPS + wk
        if run < main and cb * COL_LANES < kv:
            r0, end, _ = self._locate(gx, offs, tile_starts, run * RUN + wr)
            if r0 < end:
                rl = r0 + rg * LANE_ROWS
                ops = self._operands(gx, gy, cb * COL_LANES + cg, kv)
                for k in cutlass.range_constexpr(len(ops)):
                    for i in cutlass.range_constexpr(LANE_ROWS):  # rows past the end: row end - 1 (zeroed later)
                        src = ops[k][0][(None, (e, cutlass.min(rl + i, end - 1), ops[k][1]))]
                        cute.copy(atom, cute.make_tensor(src.iterator, cute.make_layout(VEC)),
                                  staging[(None, lane, i, k, warp, buf)])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _resident_run(self, args, run, active, staged=None):
        """The ``resident`` form of the one-pass cast: the warp loads row block ``4 run + wr`` once and keeps its
        tiles (h, or dg and du) in registers; it stores its 128-block amax parts (rows: one slot per row and
        column warp; columns: one per column and row warp, per output; zeros where it has no data), the CTA meets
        once, and it casts the kept tiles with the amaxes of the 4 slots of each row and of each column.
        ``staged`` (:meth:`_resident_loop`): (buffers, warp, buffer index): the tiles come from the lane's slots of
        that buffer; the backward then parks du there (:meth:`_staged_dg_du`) and reloads it for its amax and its
        casts, so only dg stays in registers across the barrier."""
        gx, gy, gq, s, gqt, st, ghp, offs, tile_starts, ra, ca, vblocks, kv, e, lane, rg, cg, cv, amaxes = args
        rows_s, cols_s, wk, wr = amaxes
        vb = run * RUN + wr
        r0, end, tile0 = self._locate(gx, offs, tile_starts, vb)
        nout = self._outputs()
        parts = [(rows_s[(None, None, o)], cols_s[(None, wk, None, o)], wk, wr) for o in range(nout)]
        for o in cutlass.range_constexpr(nout):  # the warp's own slots; a warp without data leaves zeros
            rows_s[wr * BLOCK + lane, wk, o] = cutlass.Int32(0)
            cols_s[lane, wk, wr, o] = cutlass.Int32(0)
        rl = r0 + rg * LANE_ROWS
        tiles = [cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32) for _ in range(nout)]
        # the staged backward parks du in the lane's buffer (its inputs are read by then) and holds only dg in
        # registers, reloading du for each of its two steps: 32 registers fewer across the barrier
        park = (staged[0], lane, staged[1], staged[2]) if staged is not None and nout == 2 else None
        if active:
            if r0 < end:
                if cutlass.const_expr(park is not None):
                    self._staged_dg_du(tiles[0], park)
                elif cutlass.const_expr(staged is None):
                    got = self._input_tiles(gx, gy, e, rl, end, r0 + BLOCK <= end, cv, kv)
                else:
                    got = self._staged_tiles(staged[0], lane, staged[1], staged[2])
                for o in cutlass.range_constexpr(nout):
                    if cutlass.const_expr(park is None):
                        tiles[o].store(got[o].load())
                    elif cutlass.const_expr(o == 1):  # (dg is in tiles[0] already)
                        self._unpark(tiles[1], park)
                    pos = _Pos(e, r0, rl, lane, rg, cg, end, tile0, vb, vblocks, ra, ca, parts[o])
                    self._emit(tiles[o], pos, cv + o * kv, gq, s, gqt, st, ghp, "amax")
        cute.arch.barrier()  # every warp's amax parts are in shared memory
        if active:
            if r0 < end:
                for o in cutlass.range_constexpr(nout):
                    t = tiles[o]
                    if cutlass.const_expr(park is not None and o == 1):  # into dg's registers, cast by now
                        t = tiles[0]
                        self._unpark(t, park)
                    pos = _Pos(e, r0, rl, lane, rg, cg, end, tile0, vb, vblocks, ra, ca, parts[o])
                    self._emit(t, pos, cv + o * kv, gq, s, gqt, st, ghp, "apply")
            elif cutlass.const_expr(self.pad_groups):  # past its group's tokens: as _block
                self._pad_block(gqt, st, e, r0, lane, rg, cg, end, tile0, vb, vblocks, cv, kv, ca, "apply", parts)

    @cute.jit
    def _blocks(self, args, vb, active):
        """CTA ``vb``'s (virtual) row block, or with the one-pass cast its run of 4 (reduce, barrier, cast)."""
        amaxes = args[-1]
        if cutlass.const_expr(self.one_pass):
            # the run's 4 blocks are one 128-row tile, so one group: located once for both walks (with token groups
            # a lookup per block and walk held the kept tiles' registers over 8 searches of tile_starts)
            r0, end, tile0 = self._locate(args[0], args[7], args[8], vb * RUN)
            self._reset_run(amaxes, args[14])
            kept = [None] * RUN
            if cutlass.const_expr(self.keep_run):  # the run's 4 input tiles, as loaded, for the casting walk
                kept = [cute.make_rmem_tensor((LANE_ROWS, VEC), args[0].element_type) for _ in range(RUN)]
            if active:
                for i in cutlass.range_constexpr(RUN):
                    self._block(*args[:17], vb * RUN + i, args[17], "amax", amaxes, kept[i],
                                (r0 + i * BLOCK, end, tile0))
                if cutlass.const_expr(self.blocks_2d):  # the warp's amax into its word (row 0's slot)
                    v = amaxes[1][0]
                    for b in cutlass.range_constexpr(5):
                        v = cutlass.max(v, cute.arch.shuffle_sync_bfly(v, offset=1 << b))
                    if args[14] == 0:
                        amaxes[0][0, amaxes[2]] = v
            cute.arch.barrier()  # every warp's row amaxes are in shared memory
            if cutlass.const_expr(self.blocks_2d):  # the tile's amax, for both casts
                v = amaxes[0][0, 0]
                for w in cutlass.range_constexpr(1, WARPS):
                    v = cutlass.max(v, amaxes[0][0, w])
                amaxes[1][0] = v
            if active:
                for i in cutlass.range_constexpr(RUN):
                    self._block(*args[:17], vb * RUN + i, args[17], "apply", amaxes, kept[i],
                                (r0 + i * BLOCK, end, tile0))
        elif active:
            self._block(*args[:17], vb, args[17], self.phase, None)

    @cute.jit
    def _reset_run(self, amaxes, lane):
        """The one-pass cast's amaxes before a run: a block or warp with no data leaves zeros."""
        amaxes[1][0] = cutlass.Int32(0)
        for i in cutlass.range_constexpr(RUN):
            amaxes[0][i * BLOCK + lane, amaxes[2]] = cutlass.Int32(0)

    @cute.jit
    def _tail(self, args, j, active):
        """Tail CTA ``j`` (token groups): rows ``[offs[-1] + TAIL_ROWS * j, offs[-1] + TAIL_ROWS * (j + 1))`` of the
        rows at or past ``offs[-1]`` (the launch has ``ceil(M / TAIL_ROWS)`` tail CTAs per column tile, enough for
        any ``offs[-1]``; the blocks are unrolled, since a loop with a run-time trip count made ptxas spill in the
        SwiGLU kernels).  Those rows belong to no group: the cast's rowwise data and plain rowwise scales quantize
        them (no grouped blocked scale exists for them), the SwiGLU kernels write zeros (data, plain scales,
        ``hp``), and the unpadded colwise data (K, M) is zero there; the padded layout has no columns for them."""
        gx, offs, lane, amaxes = args[0], args[7], args[14], args[-1]
        m = cute.size(gx, mode=[1, 1])
        r = offs[cute.size(offs) - 1] + TAIL_ROWS * j
        if cutlass.const_expr(self.resident):  # (the SwiGLU kernels: zeros, no amaxes) row warp wr of each run
            if active:
                for u in cutlass.range_constexpr(TAIL_ROWS // (RUN * BLOCK)):
                    self._tail_block(args, r + u * RUN * BLOCK + amaxes[3] * BLOCK, amaxes[3], m, "apply")
        elif cutlass.const_expr(self.one_pass):
            for u in cutlass.range_constexpr(TAIL_ROWS // (RUN * BLOCK)):
                r1 = r + u * RUN * BLOCK
                if r1 < m:  # CTA-uniform: the barriers below are reached by every thread or none
                    self._reset_run(amaxes, lane)
                    if active:
                        for i in cutlass.range_constexpr(RUN):
                            self._tail_block(args, r1 + i * BLOCK, i, m, "amax")
                    cute.arch.barrier()  # every warp's row amaxes are in shared memory
                    if active:
                        for i in cutlass.range_constexpr(RUN):
                            self._tail_block(args, r1 + i * BLOCK, i, m, "apply")
                    cute.arch.barrier()  # read by every warp before the next run resets them
        elif active:
            for u in cutlass.range_constexpr(TAIL_ROWS // BLOCK):
                self._tail_block(args, r + u * BLOCK, 0, m, self.phase)

    @cute.jit
    def _tail_block(self, args, r0, i, m, step: cutlass.Constexpr):
        """The tail's 32-row block from row ``r0`` (``i``: its index in the one-pass run)."""
        gx, gy, gq, s, gqt, st, ghp = args[:7]
        ra, ca, vblocks, kv, e, lane, rg, cg, cv, amaxes = args[9:13] + args[13:]
        if r0 < m:
            rl = r0 + rg * LANE_ROWS
            if cutlass.const_expr(self.prologue == "cast"):
                t = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
                _load_tile(t, gx, e, rl, m, r0 + BLOCK <= m, cv)
                pos = _Pos(e, r0, rl, lane, rg, cg, m, cutlass.Int32(0), i, vblocks, ra, ca, amaxes)
                self._emit(t, pos, cv, gq, s, gqt, st, ghp, step, True)
            elif cutlass.const_expr(step != "amax"):  # the SwiGLU kernels: zeros, stored without the cast's math
                for c in cutlass.range_constexpr(2 if self.prologue == "dswiglu" else 1):
                    self._zero_rows(gq, s, gqt, ghp, e, rl, cg, m, cv + c * kv)

    @cute.jit
    def _zero_rows(self, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor, ghp: cute.Tensor, e, rl, cg, m, cv):
        """Zeros in every output of the lane's 8 x 4 piece at rows ``[rl, rl + 8)`` before ``m``, column vector
        ``cv``: rowwise data, the plain rowwise scale of row ``rl + cg`` (byte 0, the scale of an all-zero block),
        ``hp`` and the unpadded colwise data (what the cast of a zero tile stores there)."""
        z = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        z.fill(0.0)
        for i in cutlass.range_constexpr(LANE_ROWS):
            if rl + i < m:
                gq[(None, (e, rl + i, cv))].store(z.load().to(self.elem_dtype))
                if cutlass.const_expr(self.emit_hp):
                    ghp[(None, (e, rl + i, cv))].store(z.load().to(ghp.element_type))
        if cutlass.const_expr(not self.blocked):
            if rl + cg < m:
                s[e, rl + cg, cv // COL_LANES] = cutlass.Uint8(0)
        if cutlass.const_expr(not self.pad_groups):
            _zero_columns(gqt, e, rl, m, cv, self.elem_dtype)

    @cute.jit
    def _block(self, gx: cute.Tensor, gy: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor,
               st: cute.Tensor, ghp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor, ra: cute.Tensor,
               ca: cute.Tensor, vblocks, kv, e, lane, rg, cg, vb, cv, step: cutlass.Constexpr, amaxes, kept=None,
               loc=None):
        """(Virtual) row block ``vb`` of the lane's column vector ``cv``: load, prologue, then ``step``: ``"cast"``
        (32-blocks), ``"amax"`` (reduce only) or ``"apply"`` (cast with the 128-block amaxes); ``amaxes`` is the
        one-pass kernel's (row amaxes in shared memory, column amaxes in registers, warp), else None (the
        two-launch form's global buffers ``ra`` / ``ca``); ``loc``: the block's :meth:`_locate`, when the caller
        has it."""
        if cutlass.const_expr(loc is None):
            loc = self._locate(gx, offs, tile_starts, vb)
        r0, end, tile0 = loc
        if r0 < end:  # (a block past the run's last, in the one-pass kernel, starts at or past the end too)
            rl = r0 + rg * LANE_ROWS  # this lane's first row
            pos = _Pos(e, r0, rl, lane, rg, cg, end, tile0, vb, vblocks, ra, ca, amaxes)
            if cutlass.const_expr(kept is None):
                tiles = self._input_tiles(gx, gy, e, rl, end, r0 + BLOCK <= end, cv, kv)
            else:  # keep_run: the "amax" walk loads and keeps the raw tile, the "apply" walk reads it back
                t = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
                if cutlass.const_expr(step == "amax"):
                    self._load_cast_tile(t, gx, gy, e, r0, rl, end, r0 + BLOCK <= end, cv, kept)
                else:
                    t.store(kept.load().to(cutlass.Float32))
                tiles = [t]
            for o in cutlass.range_constexpr(len(tiles)):
                self._emit(tiles[o], pos, cv + o * kv, gq, s, gqt, st, ghp, step)
        elif cutlass.const_expr(self.pad_groups and step != "amax"):
            self._pad_block(gqt, st, e, r0, lane, rg, cg, end, tile0, vb, vblocks, cv, kv, ca, step,
                            [amaxes] * self._outputs())

    @cute.jit
    def _pad_block(self, gqt: cute.Tensor, st: cute.Tensor, e, r0, lane, rg, cg, end, tile0, vb, vblocks, cv, kv,
                   ca: cute.Tensor, step: cutlass.Constexpr, amaxes: list):
        """A virtual block past its group's tokens (``pad_groups``): zero colwise data (the group's padding up to
        its 128-aligned end, or columns past the last group) and, inside the padded run, the run's scale (output
        ``c`` with ``amaxes[c]``)."""
        t = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
        t.fill(0.0)
        mag = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Int32)
        mag.fill(0)
        for c in cutlass.range_constexpr(self._outputs()):
            self._colwise(t, mag, gqt, st, e, r0, r0 + rg * LANE_ROWS, lane, rg, cg, end, tile0, vb, vblocks,
                          cv + c * kv, ca, step, amaxes[c])

    @cute.jit
    def _locate(self, gx: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor, vb):
        """(first row, end of its rows, the group's first 128-row tile) of (virtual) row block ``vb``: rows
        ``[32 vb, M)``, or with token groups the block's group from its start (tile 0 without groups)."""
        m = self._cast_rows(cute.size(gx, mode=[1, 1]))
        r0 = vb * BLOCK
        end = m
        tile0 = cutlass.Int32(0)
        if cutlass.const_expr(self.grouped):
            g = last_group_at_or_below(vb, tile_starts, cute.size(offs))
            start = group_start(offs, g)
            end = offs[g]
            tile0 = tile_starts[g]
            r0 = start + (vb - tile0 * 4) * BLOCK
        return r0, end, tile0

    @cute.jit
    def _input_tiles(self, gx: cute.Tensor, gy: cute.Tensor, e, rl, end, full, cv, kv) -> list:
        """The lane's 8 x 4 tiles to cast (fp32) at rows ``[rl, rl + 8)``, loaded and through the prologue: x;
        h = silu(g) u from h13 = ``gx`` (gate at column vector ``cv``, up at ``cv + kv``); or dg, du from dh =
        ``gx`` and h13 = ``gy`` (cast at ``cv`` and ``cv + kv`` of dh13)."""
        t = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
        if cutlass.const_expr(self.prologue == "cast"):
            if cutlass.const_expr(self.gate_up):  # (no token groups: the block starts on a multiple of 32)
                self._load_cast_tile(t, gx, gy, e, rl - rl % BLOCK, rl, end, full, cv)
            else:
                _load_tile(t, gx, e, rl, end, full, cv)
            return [t]
        elif cutlass.const_expr(self.prologue == "swiglu"):
            u = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
            _load_tile(t, gx, e, rl, end, full, cv)
            _load_tile(u, gx, e, rl, end, full, cv + kv)
            return self._prologue([t, u])
        gate = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
        u = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
        _load_tile(t, gx, e, rl, end, full, cv)
        _load_tile(gate, gy, e, rl, end, full, cv)
        _load_tile(u, gy, e, rl, end, full, cv + kv)
        return self._prologue([t, gate, u])

    @cute.jit
    def _staged_tiles(self, staging: cute.Tensor, lane, warp, buf) -> list:
        """:meth:`_input_tiles` from the lane's prefetch buffer (:meth:`_resident_loop`)."""
        loaded = [cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32) for _ in self._operand_names()]
        for k in cutlass.range_constexpr(len(loaded)):
            for i in cutlass.range_constexpr(LANE_ROWS):
                loaded[k][(i, None)].store(staging[(None, lane, i, k, warp, buf)].load().to(cutlass.Float32))
        return self._prologue(loaded)

    @cute.jit
    def _staged_dg_du(self, dg: cute.Tensor, park):
        """The backward's prologue from the lane's buffer, a row at a time: dg into ``dg``, du (fp32) parked over
        the row's dh and gate slots (4 + 4 bf16: the 16 bytes of its 4 values), which it has just read."""
        staging, lane, warp, buf = park
        for i in cutlass.range_constexpr(LANE_ROWS):
            row = [staging[(None, lane, i, k, warp, buf)].load().to(cutlass.Float32) for k in range(3)]
            g, u = swiglu_bwd(row[0], row[1], row[2])
            dg[(i, None)].store(g)
            du = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            du.store(u)
            for h in cutlass.range_constexpr(2):
                slot = self._park_slot(park, i, h)
                slot[0] = du[2 * h]
                slot[1] = du[2 * h + 1]

    @cute.jit
    def _unpark(self, du: cute.Tensor, park):
        """du's tile, parked by :meth:`_staged_dg_du`, back into registers."""
        for i in cutlass.range_constexpr(LANE_ROWS):
            for h in cutlass.range_constexpr(2):
                slot = self._park_slot(park, i, h)
                du[i, 2 * h] = slot[0]
                du[i, 2 * h + 1] = slot[1]

    @cute.jit
    def _park_slot(self, park, i: cutlass.Constexpr[int], h: cutlass.Constexpr[int]) -> cute.Tensor:
        """Two fp32 words over the lane's 4 bf16 of operand ``h`` (dh, gate) at row ``i`` (8-byte aligned)."""
        staging, lane, warp, buf = park
        return cute.make_tensor(cute.recast_ptr(staging[(None, lane, i, h, warp, buf)].iterator,
                                                dtype=cutlass.Float32), cute.make_layout(2))

    @cute.jit
    def _prologue(self, loaded: list) -> list:
        """The SwiGLU prologue on the loaded fp32 tiles (gate, up; or dh, gate, up), in place: [h] or [dg, du]."""
        t, u = loaded[0], loaded[-1]
        if cutlass.const_expr(self.prologue == "swiglu"):
            t.store(swiglu_fwd(t.load(), u.load()))
            return [t]
        dg, du = swiglu_bwd(t.load(), loaded[1].load(), u.load())
        t.store(dg)
        u.store(du)
        return [t, u]

    @cute.jit
    def _load_cast_tile(self, t: cute.Tensor, gx: cute.Tensor, gy: cute.Tensor, e, r0, rl, end, full, cv, raw=None):
        """:func:`_load_tile` of the cast's input at rows ``[rl, rl + 8)`` of block ``r0``: of ``gx``, or with
        ``gate_up`` of w1 (``gx``) below I and of w3 (``gy``, rows shifted by I) from I on."""
        if cutlass.const_expr(self.gate_up):
            half = cute.size(gx, mode=[1, 1])
            if r0 < half:
                _load_tile(t, gx, e, rl, half, full, cv, raw)
            else:
                _load_tile(t, gy, e, rl - half, end - half, full, cv, raw)
        else:
            _load_tile(t, gx, e, rl, end, full, cv, raw)

    @cute.jit
    def _operands(self, gx: cute.Tensor, gy: cute.Tensor, cv, kv):
        """(tensor, column vector) of each input tile of the prologue: x; gate and up of h13; dh, gate, up."""
        if cutlass.const_expr(self.prologue == "cast"):
            return [(gx, cv)]
        elif cutlass.const_expr(self.prologue == "swiglu"):
            return [(gx, cv), (gx, cv + kv)]
        else:
            return [(gx, cv), (gy, cv), (gy, cv + kv)]

    @cute.jit
    def _stage(self, ops, staging: cute.Tensor, atom, e, vb, m, lane, rg, buf, warp):
        """cp.async the lane's 8 x 4 tile of every operand at row block ``vb`` into staging buffer ``buf``
        (rows at or past ``m`` read row ``m - 1``; the emitter zeroes them), as one commit group."""
        rl = vb * BLOCK + rg * LANE_ROWS
        for k in cutlass.range_constexpr(len(ops)):
            for i in cutlass.range_constexpr(LANE_ROWS):
                src = ops[k][0][(None, (e, cutlass.min(rl + i, m - 1), ops[k][1]))]
                cute.copy(atom, cute.make_tensor(src.iterator, cute.make_layout(VEC)),
                          staging[(None, lane, i, k, buf, warp)])

    @cute.jit
    def _staged(self, gx: cute.Tensor, gy: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor,
                st: cute.Tensor, ghp: cute.Tensor, staging: cute.Tensor, vblocks, kv, cv,
                e, warp, lane, rg, cg, vb0, ra: cute.Tensor, ca: cute.Tensor):
        """Row blocks ``vb0, vb0 + gridDim.x, ...`` of this warp's column block with the next block's loads in
        flight while the current one is computed: cp.async into a lane-private double buffer in shared memory
        (no registers held by the prefetch; the loop itself needs 160-220 registers, so 2-3 CTAs per SM where the
        one-tile kernel has 4-6).  ``gridDim.x`` is ``ceil(row blocks / row_tiles)`` whatever the GPU: a call with
        few row blocks and few column tiles launches few CTAs (not tuned for moderate M yet)."""
        m = cute.size(gx, mode=[1, 1])
        stride = cute.arch.grid_dim()[0]
        ops = self._operands(gx, gy, cv, kv)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), gx.element_type,
                                   num_bits_per_copy=VEC * gx.element_type.width)
        self._stage(ops, staging, atom, e, vb0, m, lane, rg, 0, warp)
        cute.arch.cp_async_commit_group()
        buf = cutlass.Int32(0)
        for vb in cutlass.range(vb0, vblocks, stride):
            nxt = vb + stride
            if nxt < vblocks:
                self._stage(ops, staging, atom, e, nxt, m, lane, rg, 1 - buf, warp)
            cute.arch.cp_async_commit_group()  # possibly empty: the wait below always means "this block's"
            cute.arch.cp_async_wait_group(1)
            tiles = [cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32) for _ in ops]
            for k in cutlass.range_constexpr(len(ops)):
                for i in cutlass.range_constexpr(LANE_ROWS):
                    tiles[k][(i, None)].store(staging[(None, lane, i, k, buf, warp)].load().to(cutlass.Float32))
            r0 = vb * BLOCK
            pos = _Pos(e, r0, r0 + rg * LANE_ROWS, lane, rg, cg, m, cutlass.Int32(0), vb,
                       vblocks, ra, ca, None)
            self._prologue_and_emit(tiles, pos, cv, kv, gq, s, gqt, st, ghp)
            buf = 1 - buf

    @cute.jit
    def _prologue_and_emit(self, tiles, pos, cv, kv, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor,
                           st: cute.Tensor, ghp: cute.Tensor):
        """The prologue's math on the fp32 input tiles, then the casts of its output tile(s)."""
        if cutlass.const_expr(self.prologue == "cast"):
            self._emit(tiles[0], pos, cv, gq, s, gqt, st, ghp, self.phase)
        elif cutlass.const_expr(self.prologue == "swiglu"):
            tiles[0].store(swiglu_fwd(tiles[0].load(), tiles[1].load()))
            self._emit(tiles[0], pos, cv, gq, s, gqt, st, ghp, self.phase)
        else:
            dg, du = swiglu_bwd(tiles[0].load(), tiles[1].load(), tiles[2].load())
            tiles[0].store(dg)
            tiles[2].store(du)
            self._emit(tiles[0], pos, cv, gq, s, gqt, st, ghp, self.phase)
            self._emit(tiles[2], pos, cv + kv, gq, s, gqt, st, ghp, self.phase)

    @cute.jit
    def _emit(self, t: cute.Tensor, pos, cv, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor, st: cute.Tensor,
              ghp: cute.Tensor, step: cutlass.Constexpr, tail: cutlass.Constexpr = False):
        """Quantize the lane's tile ``t`` (rows past the end zeroed first) at output column vector ``cv``, or with
        ``step="amax"`` only reduce its 128-block amaxes; ``tail``: rows past the last group (:meth:`_tail`)."""
        if pos.r0 + BLOCK > pos.end:
            for i in cutlass.range_constexpr(LANE_ROWS):
                if pos.rl + i >= pos.end:
                    t[(i, None)].store(cute.full_like(t[(i, None)].load(), 0.0))
        if cutlass.const_expr(self.emit_hp and step != "amax"):
            for i in cutlass.range_constexpr(LANE_ROWS):
                if pos.rl + i < pos.end:
                    ghp[(None, (pos.e, pos.rl + i, cv))].store(t[(i, None)].load().to(ghp.element_type))
        mag = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Int32)  # |x| bits, shared by both casts
        mag.store(t.load().bitcast(cutlass.Int32) & 0x7FFFFFFF)
        if cutlass.const_expr(self.blocks_2d and step == "amax"):  # the lane's running amax of the 128 x 128 tile
            v = pos.amaxes[1][0]
            for i in cutlass.range_constexpr(LANE_ROWS):
                v = cutlass.max(v, _row_max(mag, i))
            pos.amaxes[1][0] = v
        else:
            if cutlass.const_expr(self.rowwise):
                kb = cute.size(gq, mode=[1, 2]) // COL_LANES  # rowwise blocks per output row
                self._rowwise(t, mag, gq, s, pos.e, pos.r0, pos.rl, pos.lane, pos.cg, pos.end, pos.vb, cv, kb,
                              pos.ra, step, pos.amaxes, tail)
            if cutlass.const_expr(tail):
                if cutlass.const_expr(self.colwise and not self.pad_groups and step != "amax"):
                    _zero_columns(gqt, pos.e, pos.rl, pos.end, cv, self.elem_dtype)
            elif cutlass.const_expr(self.colwise):
                self._colwise(t, mag, gqt, st, pos.e, pos.r0, pos.rl, pos.lane, pos.rg, pos.cg, pos.end, pos.tile0,
                              pos.vb, pos.vblocks, cv, pos.ca, step, pos.amaxes)

    @cute.jit
    def _rowwise(self, t: cute.Tensor, mag: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, e, r0, rl, lane, cg, end,
                 vb, cv, kb, ra: cute.Tensor, step: cutlass.Constexpr, amaxes, tail: cutlass.Constexpr = False):
        a = cute.make_rmem_tensor((LANE_ROWS,), cutlass.Int32)
        if cutlass.const_expr(step != "apply"):  # ("apply" reads the 128-block amax instead)
            for i in cutlass.range_constexpr(LANE_ROWS):
                a[i] = _row_max(mag, i)
            reduce_scatter_max(a, LANE_ROWS, 0, lane)  # lane cg: amax of its row group's row cg
        cb = cv // COL_LANES
        r = rl + cg
        if cutlass.const_expr(step == "amax"):  # the 128-block amax: 4 warps' 32-blocks of the row meet
            if cutlass.const_expr(amaxes is not None):  # one pass: row r0 + lane of the run, this warp's slot
                amaxes[0][(vb % RUN) * BLOCK + lane, amaxes[2]] = a[0]
            elif r < end:
                cute.arch.atomic_max(ra.iterator + cute.crd2idx((e, r, cb // 4), ra.layout), a[0])
        else:  # "cast" (32-blocks): the lane's own amax; "apply": a 128-block amax below (no own reduction above)
            amax = a[0] if cutlass.const_expr(step != "apply") else None
            if cutlass.const_expr(self.blocks_2d):  # the 128 x 128 tile's amax (_blocks)
                amax = amaxes[1][0]
            elif cutlass.const_expr(amaxes is not None):  # the 4 warps' slots of the row
                row = (vb % RUN) * BLOCK + lane
                amax = amaxes[0][row, 0]
                for w in cutlass.range_constexpr(1, WARPS):
                    amax = cutlass.max(amax, amaxes[0][row, w])
            elif cutlass.const_expr(step == "apply"):  # the row's 128-block amax from the amax pass (a row past
                # the end reads a clamped row: its data is not stored; a branch here made ptxas spill a predicate)
                amax = cutlass.Int32(ra[e, cutlass.min(r, ra.shape[1] - 1), cb // 4])
            self._rowwise_cast(t, amax, gq, s, e, r0, rl, lane, cg, end, vb, cv, kb, cb, r, tail)

    @cute.jit
    def _rowwise_cast(self, t: cute.Tensor, amax: cutlass.Int32, gq: cute.Tensor, s: cute.Tensor, e, r0, rl, lane,
                      cg, end, vb, cv, kb, cb, r, tail: cutlass.Constexpr = False):
        byte, factor = block_scale(amax, self.emax, self.rceil)
        if cutlass.const_expr(tail and self.blocked):
            pass  # rows past the last group have no blocked (grouped-M) scale
        elif r < end:
            if cutlass.const_expr(self.blocked):
                srow = r
                if cutlass.const_expr(self.grouped):  # grouped-M layout: the group from tile tile_starts[g], so
                    srow = vb * BLOCK + (r - r0)  # row r - start of the group is virtual row 32 vb + (r - r0)
                s[e, blocked_scale_offset(srow, cb, kb)] = cutlass.Uint8(byte)
            else:
                s[e, r, cb] = cutlass.Uint8(byte)
        if cutlass.const_expr(not self.packed_stores):
            base = lane - cg
            for i in cutlass.range_constexpr(LANE_ROWS):
                f = cute.arch.shuffle_sync(factor, offset=base + i)  # row i's factor, from lane cg == i
                if rl + i < end:
                    gq[(None, (e, rl + i, cv))].store(apply_scale(t[(i, None)].load(), f).to(self.elem_dtype))
        elif cutlass.const_expr(self._outputs() == 2 and (self.emit_hp or (self.grouped and not self.pad_groups))):
            # the dSwiGLU with its high-precision store or bytewise colwise groups: checked stores, each row
            # addressed on its own (a full-block path, or the lane's rows as one strided view, made ptxas spill
            # 3-37 words there, sm_90a)
            self._store_rows(gq, e, cv, t, factor, lane - cg, rl, end, True, False)
        elif r0 + BLOCK <= end:  # a full block (warp-uniform) stores every row without a check
            self._store_rows(gq, e, cv, t, factor, lane - cg, rl, end, False, True)
        else:
            self._store_rows(gq, e, cv, t, factor, lane - cg, rl, end, True, True)

    @cute.jit
    def _store_rows(self, gq: cute.Tensor, e, cv, t: cute.Tensor, factor, base, rl, end,
                    checked: cutlass.Constexpr, strided: cutlass.Constexpr):
        """``packed_stores``: scale, convert and store the lane's 8 rows of 4 elements (one packed word each) at
        column vector ``cv`` of rows ``[rl, rl + 8)``, row i's factor from lane ``base + i``.  ``checked``: rows at
        or past ``end`` are not stored; ``strided``: the rows addressed as one view from row ``rl`` (row i at a
        constant multiple of the row stride: fewer address instructions), else each from its coordinates."""
        rows = None
        if cutlass.const_expr(strided):
            rows = cute.domain_offset((0, rl), cute.recast_tensor(gq[(None, (e, None, cv))], cutlass.Uint32))
        for i in cutlass.range_constexpr(LANE_ROWS):
            f = cute.arch.shuffle_sync(factor, offset=base + i)  # row i's factor, from lane cg == i
            if cutlass.const_expr(checked):
                if rl + i < end:
                    self._store_row(gq, e, cv, rows, t, f, rl, i)
            else:
                self._store_row(gq, e, cv, rows, t, f, rl, i)

    @cute.jit
    def _store_row(self, gq: cute.Tensor, e, cv, rows, t: cute.Tensor, f, rl, i: cutlass.Constexpr):
        v = apply_scale(t[(i, None)].load(), f)
        w = pack_fp8x4(v[0], v[1], v[2], v[3], self.elem)
        if cutlass.const_expr(rows is not None):
            rows[0, i] = w
        else:
            cute.recast_tensor(gq[(None, (e, rl + i, cv))], cutlass.Uint32)[0] = w

    @cute.jit
    def _colwise(self, t: cute.Tensor, mag: cute.Tensor, gqt: cute.Tensor, st: cute.Tensor, e, r0, rl, lane, rg,
                 cg, end, tile0, vb, vblocks, cv, ca: cute.Tensor, step: cutlass.Constexpr, amaxes):
        a = cute.make_rmem_tensor((VEC,), cutlass.Int32)
        if cutlass.const_expr(step != "apply"):  # ("apply" reads the 128-block amax instead)
            for j in cutlass.range_constexpr(VEC):
                a[j] = _col_max(mag, j)
            reduce_scatter_max(a, VEC, 3, lane)  # lane rg: amax of its column rg
        # 128-block amaxes: (virtual) row blocks 4 b .. 4 b + 3 of the column (a group's blocks start on a multiple
        # of 4, so they never reach into the next group)
        if cutlass.const_expr(step == "amax"):
            if cutlass.const_expr(self.resident):  # the lane's column in this row block: its slot
                amaxes[1][lane, amaxes[3]] = a[0]
            elif cutlass.const_expr(amaxes is not None):  # one pass: the lane's column over the run's 4 blocks
                amaxes[1][0] = cutlass.max(amaxes[1][0], a[0])
            else:
                cute.arch.atomic_max(ca.iterator + cute.crd2idx((e, vb // 4, cv * VEC + rg), ca.layout), a[0])
        else:
            amax = a[0] if cutlass.const_expr(step != "apply") else None
            if cutlass.const_expr(self.resident):  # the 4 row blocks' slots of the lane's column
                amax = amaxes[1][lane, 0]
                for r in cutlass.range_constexpr(1, RUN):
                    amax = cutlass.max(amax, amaxes[1][lane, r])
            elif cutlass.const_expr(amaxes is not None):
                amax = amaxes[1][0]
            elif cutlass.const_expr(step == "apply"):  # the column's 128-block amax from the amax pass
                amax = cutlass.Int32(ca[e, vb // 4, cv * VEC + rg])
            self._colwise_cast(t, amax, gqt, st, e, r0, rl, lane, rg, cg, end, tile0, vb, vblocks, cv)

    @cute.jit
    def _group_scale(self, st: cute.Tensor, byte, e, r0, rg, end, tile0, vb, cv, kdim):
        """Store a grouped colwise block's scale: plain (E, K, 4 * tiles) or grouped-K blocked (each group's tiles
        blocked on their own)."""
        if cutlass.const_expr(self.blocked):
            start = r0 - (vb - 4 * tile0) * BLOCK  # recomputed here: ptxas spilled it when it stayed live
            st[e, grouped_k_scale_offset(cv * VEC + rg, vb - 4 * tile0, tile0, (end - start + 127) // 128,
                                         kdim)] = cutlass.Uint8(byte)
        else:
            st[e, cv * VEC + rg, vb] = cutlass.Uint8(byte)

    @cute.jit
    def _colwise_cast(self, t: cute.Tensor, amax: cutlass.Int32, gqt: cute.Tensor, st: cute.Tensor, e, r0, rl,
                      lane, rg, cg, end, tile0, vb, vblocks, cv):
        byte, factor = block_scale(amax, self.emax, self.rceil)
        if cutlass.const_expr(self.grouped and self.pad_groups):
            # a padding block past the group's 128-aligned end (or past the last group) stores no scale
            if vb - 4 * tile0 < 4 * ((end - (r0 - (vb - 4 * tile0) * BLOCK) + 127) // 128):
                self._group_scale(st, byte, e, r0, rg, end, tile0, vb, cv, cute.size(gqt, mode=[1, 1]))
        elif cutlass.const_expr(self.grouped):
            self._group_scale(st, byte, e, r0, rg, end, tile0, vb, cv, gqt.shape[1])
        elif cutlass.const_expr(self.blocked):
            st[e, blocked_scale_offset(cv * VEC + rg, vb, vblocks)] = cutlass.Uint8(byte)
        else:
            st[e, cv * VEC + rg, vb] = cutlass.Uint8(byte)
        for j in cutlass.range_constexpr(VEC):
            f = cute.arch.shuffle_sync(factor, offset=j * COL_LANES + cg)  # column j's factor, from lane rg == j
            if cutlass.const_expr(self.packed_stores and not (self.grouped and not self.pad_groups)):
                v = apply_scale(t[(None, j)].load(), f)  # the column's 8 bytes as one word
                w = cute.recast_tensor(gqt[(None, (e, cv * VEC + j, vb * ROW_LANES + rg))], cutlass.Uint64)
                w[0] = pack_fp8x8([v[k] for k in range(LANE_ROWS)], self.elem)
                continue
            qv = apply_scale(t[(None, j)].load(), f).to(self.elem_dtype)
            c = cv * VEC + j
            if cutlass.const_expr(self.grouped and not self.pad_groups):
                # data (K, M): the block starts at any row, so bytewise
                q8 = cute.make_rmem_tensor((LANE_ROWS,), self.elem_dtype)
                q8.store(qv)
                for i in cutlass.range_constexpr(LANE_ROWS):
                    if rl + i < end:
                        gqt[e, c, rl + i] = q8[i]
            else:
                gqt[(None, (e, c, vb * ROW_LANES + rg))].store(qv)


@cute.jit
def _zero_columns(gqt: cute.Tensor, e, rl, end, cv, elem_dtype):
    """Zero bytes in the lane's 8 x 4 piece of the unpadded grouped colwise data (1, K, M): columns
    ``[4 cv, 4 cv + 4)`` of K at rows (tokens) ``[rl, rl + 8)`` before ``end``."""
    z = cute.make_rmem_tensor((LANE_ROWS,), cutlass.Float32)
    z.fill(0.0)
    q8 = cute.make_rmem_tensor((LANE_ROWS,), elem_dtype)
    q8.store(z.load().to(elem_dtype))
    for j in cutlass.range_constexpr(VEC):
        for i in cutlass.range_constexpr(LANE_ROWS):
            if rl + i < end:
                gqt[e, cv * VEC + j, rl + i] = q8[i]


@cute.jit
def _row_max(mag: cute.Tensor, i: cutlass.Constexpr[int]):
    v = mag[i, 0]
    for j in cutlass.range_constexpr(1, VEC):
        v = cutlass.max(v, mag[i, j])
    return v


@cute.jit
def _col_max(mag: cute.Tensor, j: cutlass.Constexpr[int]):
    v = mag[0, j]
    for i in cutlass.range_constexpr(1, LANE_ROWS):
        v = cutlass.max(v, mag[i, j])
    return v


class _Pos:
    """Where a lane's tile sits (plain Python holder of DSL values, passed to the emit helpers)."""

    def __init__(self, e, r0, rl, lane, rg, cg, end, tile0, vb, vblocks, ra, ca, amaxes):
        self.e, self.r0, self.rl, self.lane, self.rg, self.cg = e, r0, rl, lane, rg, cg
        self.end, self.vb, self.vblocks = end, vb, vblocks
        self.tile0 = tile0  # token groups: the group's first 128-row tile (``tile_starts[g]``); 0 otherwise
        self.ra, self.ca = ra, ca  # the two-launch 128-block amaxes: (E, M, K/128), (E, blocks/4, K)
        self.amaxes = amaxes  # the one-pass kernel's (row amaxes (4 x 32, warps) in shared memory, the lane's
        # column amax (a register), warp), or None


@cute.jit
def _load_tile(t: cute.Tensor, gx: cute.Tensor, e, rl, end, full, cv, raw=None):
    """The lane's 8 x 4 tile of ``gx`` at rows ``[rl, rl + 8)``, column vector ``cv``, as fp32 (and as loaded into
    ``raw``, when given); rows at or past ``end`` are clamped loads of row ``end - 1`` (zeroed later by the
    emitter)."""
    if full:  # plain loads at constant row offsets
        for i in cutlass.range_constexpr(LANE_ROWS):
            _keep_row(t, raw, i, gx[(None, (e, rl + i, cv))].load())
    else:
        for i in cutlass.range_constexpr(LANE_ROWS):
            _keep_row(t, raw, i, gx[(None, (e, cutlass.min(rl + i, end - 1), cv))].load())


@cute.jit
def _keep_row(t: cute.Tensor, raw, i: cutlass.Constexpr[int], v):
    """Row ``i`` of the loaded tile: ``v`` as fp32 into ``t``, and as loaded into ``raw`` when given."""
    if cutlass.const_expr(raw is not None):
        raw[(i, None)].store(v)
    t[(i, None)].store(v.to(cutlass.Float32))


class SwiGLUQuantKernel(TileQuantKernel):
    """Fused SwiGLU + dual MXFP8 quantization, forward (``prologue="swiglu"``) or backward (``"dswiglu"``): the
    tile kernel of :class:`TileQuantKernel` with the SwiGLU math of :mod:`.mx_math` between the loads and the
    casts, so the activation and its gradient never round-trip through memory in high precision.

    Forward, :meth:`launch_fwd`: h13 (1, M, 2I) bf16/fp32 in the fused layout of ``cute_mxfp8.swiglu`` (gate
    columns ``[0, I)``, up ``[I, 2I)``), I % 32 == 0 -> ``h = silu(g) * u`` in fp32, cast rowwise (blocks along I)
    into q (1, M, I) + s and colwise (blocks along M) into qt (1, I, Mp or M) + st, and optionally h rounded to
    the input dtype into hp (1, M, I).  Backward, :meth:`launch_bwd`: dh (1, M, I) and the saved h13 -> ``dh13 = [dg | du]``
    (1, M, 2I) cast rowwise (blocks along 2I; no block straddles dg and du since I % 32 == 0) and colwise, and
    optionally dh13 in the input dtype.  Scale layouts, groups and tails as :class:`TileQuantKernel` with K = I
    (forward) or 2I (backward).

    ``scale_block=128`` in one launch (``phase="cast"``, *resident*): a CTA owns one run of 4 (virtual) row blocks
    x 128 columns with 16 warps, warp ``(wr, wk)`` on row block ``wr`` and 32-column block ``wk``.  Each warp loads
    its tiles once and keeps the prologue's output (h, or dg and du) in registers, stores its parts of the
    128-block amaxes in shared memory (per row: one slot per column warp; per column: one per row warp; zeros
    where it has no data), the CTA meets once, and each warp casts its kept tiles with the maxima of the 4 slots:
    the input is read once and no global amax buffer exists.  The plain casts' one-pass walk (4 warps walking the
    run twice, reloading it from L2) measured 1.6-2.4x slower than two launches here (a SwiGLU run is 64-192 KB of
    input); the resident form took 15-23 % less time than two launches on the H200 dense and 20-39 % for the
    grouped forward, whose two-launch time varied between runs (2026-12-02, ``tools/fast_mode_swiglu.py``).  512
    threads per CTA leave 128 registers per thread; the bf16 builds the ops run fit without spills (``inspect``,
    the tests) since the casting pass skips the lane's own amax reductions (the padded grouped backward spilled 3
    words for sm_90a before; in one launch it took 0.233 ms against 0.373 for two, H200, 2026-12-02).  The
    backward's CTA holds dg's and du's 128 columns, so it needs I % 128 == 0 (no 128-block along 2I holding both;
    the ops check).  A form that stashes the run's inputs in shared memory instead (2 CTAs per SM, the prologue
    recomputed for the cast) measured 0-7 % faster forward but 1.4-3.4x slower backward (dense and padded
    grouped), and the plain casts in that form no faster than their walk (``docs/sm90_gemm.md``).

    ``persistent_ctas`` (> 0, the resident form; :meth:`_resident_loop`): that many CTAs (one per SM) walk the
    (run, 128-column tile) items, and while one item is reduced and cast each lane's tiles of the CTA's next item
    are already in flight: cp.async into a lane-private buffer in shared memory (two buffers, 8 x 4 elements per
    operand and lane; no barrier: a lane reads back only what it copied), the amax slots in two sets by the item's
    parity (one barrier per item).  The backward parks du in the lane's buffer over its dh and gate slots (read by
    then) and holds only dg across the barrier.  Shared memory for bf16 inputs: two buffers of 64 KB forward, of
    96 KB backward, plus twice the amax slots (136 / 208 KB; fp32 inputs would need twice the buffers, more than an
    SM has: ``jit.compile_swiglu_quant`` refuses them).  sm_90a: the dense builds fit in 128 registers without
    local memory; the grouped ones spill (the group lookup per item).  On the H200 the dense forward took 7-21 % less kernel time than one CTA per
    run; the dense backward 1.16x more (it is compute-bound: the prefetch hides no load time, the park costs
    shared-memory traffic), the grouped builds 1.04-1.30x more, so the ops run only the dense forward this way
    (``ops.cute_kernels.SWIGLU_PERSISTENT``).

    Dense calls run the staged loop (:attr:`ROW_TILES` row blocks per CTA, 160-220 registers; on the H200 it was
    4-6 points of copy bandwidth faster forward and 1-2 backward than one block per CTA, bf16, 2026-11-30).
    Token groups and the backward with ``emit_hp`` (which would spill in the loop) take one block per CTA with
    launch bounds (:meth:`_launch_bounds`).
    """

    ROW_TILES = 8  # row blocks per CTA of the staged (cp.async double-buffered) loop

    def __init__(self, prologue: str, elem: str, scale_mode: str, blocked: bool, grouped: bool = False,
                 emit_hp: bool = False, row_tiles: int | None = None, scale_block: int = 32, phase: str = "cast",
                 pad_groups: bool = False, persistent_ctas: int = 0, packed_stores: bool = False):
        if prologue not in ("swiglu", "dswiglu"):
            raise ValueError(f"prologue must be 'swiglu' or 'dswiglu', got {prologue!r}")
        if row_tiles is None:  # the backward with its high-precision store, or reading the 128-block amaxes back,
            # would spill in the staged loop (255 registers + 8 bytes of local memory, measured for sm_90a)
            row_tiles = 1 if prologue == "dswiglu" and (emit_hp or phase == "apply") else self.ROW_TILES
        super().__init__(elem, scale_mode, blocked, True, True, grouped, emit_hp, row_tiles, scale_block, phase,
                         pad_groups, packed_stores=packed_stores)
        self.prologue = prologue
        # scale_block=128 in one launch: the run's 4 row blocks side by side in 16 warps, kept in registers (the
        # plain casts' one-pass walk reloads the run from L2, which measured 1.6-2.4x slower than two launches
        # here: a SwiGLU CTA's run is 64-192 KB of input)
        self.resident = self.one_pass
        if type(persistent_ctas) is not int:
            raise TypeError(f"persistent_ctas must be an int (the resident form's CTAs per expert, one per SM; 0 = "
                            f"one CTA per run), got {type(persistent_ctas).__name__}")
        if persistent_ctas < 0:
            raise ValueError(f"persistent_ctas must be >= 0 (0 = one CTA per run), got {persistent_ctas}")
        if persistent_ctas and not self.resident:
            raise ValueError(f"persistent_ctas > 0 is the resident one-launch form's: it needs scale_block=128 with "
                             f"phase='cast', got scale_block={scale_block!r}, phase={phase!r}")
        self.persistent_ctas = persistent_ctas

    @cute.jit
    def launch_fwd(self, h13: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
                   hp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor, amax_rows: cute.Tensor,
                   amax_cols: cute.Tensor, stream: cuda.CUstream):
        self._launch(h13, h13, q, s, qt, st, hp, offs, tile_starts, amax_rows, amax_cols, h13.shape[2] // 2, stream)

    @cute.jit
    def launch_bwd(self, dh: cute.Tensor, h13: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor,
                   st: cute.Tensor, hp: cute.Tensor, offs: cute.Tensor, tile_starts: cute.Tensor,
                   amax_rows: cute.Tensor, amax_cols: cute.Tensor, stream: cuda.CUstream):
        self._launch(dh, h13, q, s, qt, st, hp, offs, tile_starts, amax_rows, amax_cols, dh.shape[2], stream)

"""CuTe DSL register-tile MXFP8 casts: colwise (32x1 blocks), dual (rowwise + colwise from ONE read of the input)
and rowwise, for 2-D activations (as a batch of one), 3-D expert weights (E, N, K) and, for the 2d-2d wgrad
operands, token groups along M (``offs``).

Arch-generic (SM90 and SM100): vectorized global loads and stores, warp shuffles, no shared memory.  The per-block
math is that of :mod:`cute_mxfp8.kernels.quantize` (bit-exact with ``cute_mxfp8.formats``).

Work split: see :class:`TileQuantKernel`.
columns ``[4l, 4l + 4)`` of all 32 rows, loaded as 32 vectors of 4 elements (8 bytes for bf16, 16 for fp32), all
issued before any is used.  A CTA is 4 warps stacked along M (128 x 128).

* colwise: each lane holds 4 whole 32-row blocks (its 4 columns); it quantizes them in registers and stores each
  as 32 contiguous fp8 bytes of the transposed output (two 16-byte stores).
* rowwise: a 32-column block spans 8 lanes; the block amax is reduced with 3 butterfly shuffles, then every lane
  scales its 4 elements (a warp stores 128 contiguous bytes per row) and one lane of the 8 writes the scale byte.

Rows past the end (M tail, or a token group's end) read as zero: the colwise block is quantized as if zero-padded,
exactly as ``cute_mxfp8.formats`` specifies.  With token groups, warps walk *virtual* 32-row blocks: the aligned
grouped-K scale columns ``[4 * tile_starts[g], 4 * tile_starts[g] + ceil(size_g / 32))`` of each group g; a
virtual block past its group's blocks does nothing (its scales stay zero, from the caller's zero-filled buffer).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .quantize import BLOCK, _QuantKernelBase, apply_scale, block_scale, blocked_scale_offset

VEC = 4  # columns per lane
LANE_ROWS = 8  # rows per lane
COL_LANES = BLOCK // VEC  # 8 lanes along K cover one rowwise block (32 columns)
ROW_LANES = BLOCK // LANE_ROWS  # 4 lanes along M cover one colwise block (32 rows)
WARPS = 4  # warps per CTA, side by side along K: a CTA tile is 32 rows x 128 columns
CTA_COLS = WARPS * BLOCK


@cute.jit
def _last_group_at_or_below(vb: cutlass.Int32, tile_starts: cute.Tensor, num_groups: cutlass.Int32):
    """Largest g with ``4 * tile_starts[g] <= vb`` (tile_starts non-decreasing, tile_starts[0] == 0): 16 fixed
    binary-search steps (up to 65536 groups)."""
    lo = cutlass.Int32(0)
    hi = num_groups - 1
    for _ in cutlass.range_constexpr(16):
        if lo < hi:
            mid = (lo + hi + 1) // 2
            if tile_starts[mid] * 4 <= vb:
                lo = mid
            else:
                hi = mid - 1
    return lo


@cute.jit
def _reduce_scatter_max(a: cute.Tensor, n: cutlass.Constexpr[int], low_bit: cutlass.Constexpr[int], lane):
    """Max-reduce the ``n`` Int32 values ``a[0..n)`` of every lane over the ``log2(n)`` lanes that differ in lane
    bits ``[low_bit, low_bit + log2(n))``, leaving in ``a[0]`` of each lane the total of value index
    ``(lane >> low_bit) % n``.  Each step halves the values: a lane keeps the half its bit selects and sends the
    other half to its partner (``n - 1`` shuffles in all, instead of ``n * log2(n)`` for a butterfly of each)."""
    cnt = n
    bit = n.bit_length() - 2 + low_bit  # highest lane bit first
    for _ in cutlass.range_constexpr(n.bit_length() - 1):
        half = cnt // 2
        upper = (lane >> bit) & 1
        for j in cutlass.range_constexpr(half):
            lo, hi = a[j], a[j + half]
            send = hi
            keep = lo
            if upper == 1:
                send = lo
                keep = hi
            a[j] = cutlass.max(keep, cute.arch.shuffle_sync_bfly(send, offset=1 << bit))
        cnt = half
        bit -= 1


class TileQuantKernel(_QuantKernelBase):
    """Register-tile MXFP8 cast of ``x (E, M, K)`` (a 2-D input is passed as E = 1).

    Compile-time parameters (the compile key): element dtype, ``scale_mode``, ``blocked`` scales, ``rowwise`` and
    ``colwise`` outputs (at least one), ``grouped`` (token groups along M; needs ``colwise``, E == 1).

    Outputs (contiguous):

    * rowwise: data (E, M, K); scales plain (E, M, K/32) or blocked (E, blocked_scales_numel(M, K/32)); with
      groups, blocked scales use the grouped-M layout (group g from tile ``tile_starts[g]``).
    * colwise: data (E, K, Mp), Mp = ceil(M/32)*32 (zero padded); scales plain (E, K, Mp/32) or blocked
      (E, blocked_scales_numel(K, Mp/32)).  With groups: data (1, K, M); scales aligned grouped-K
      (1, K, 4 * tiles) plain or blocked (1, blocked_scales_numel(K, 4 * tiles)), zero-filled by the caller.

    Work split: a warp owns one 32 x 32 block tile (one rowwise block wide, one colwise block tall); lane
    ``(rg, cg) = (lane // 8, lane % 8)`` holds rows ``[8 rg, 8 rg + 8)`` x columns ``[4 cg, 4 cg + 4)`` in 32 fp32
    registers, loaded as 8 vectors (8 bytes bf16, 16 bytes fp32), all issued before any is used.  Row amax:
    3 butterfly shuffles over the 8 ``cg`` lanes; column amax: 2 over the 4 ``rg`` lanes.  Each lane then
    stores 4 bytes per row (8 lanes: 32 contiguous bytes) and 8 bytes per column of the transposed output
    (4 lanes: the 32-byte block), and writes exactly one rowwise and one colwise scale byte.  4 warps side by
    side along K form a CTA; grid (32-row blocks, K / 128, E).

    Constraints (checked by the ops layer): K % 32 == 0; x contiguous, 16-byte aligned; K / 128 and E at most
    65535 (grid y and z).
    """

    def __init__(self, elem: str, scale_mode: str, blocked: bool, rowwise: bool, colwise: bool,
                 grouped: bool = False):
        super().__init__(elem, scale_mode, blocked)
        if not (rowwise or colwise) or (grouped and not colwise):
            raise ValueError("TileQuantKernel needs colwise output, or rowwise without groups")
        self.rowwise, self.colwise, self.grouped = rowwise, colwise, grouped

    @cute.jit
    def launch(self, x: cute.Tensor, q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
               offs: cute.Tensor, tile_starts: cute.Tensor, stream: cuda.CUstream):
        e, m, k = x.shape
        if cutlass.const_expr(self.grouped):  # the aligned grouped-K scale columns: 4 * (M // 128 + G)
            vblocks = 4 * (m // 128 + cute.size(offs))
            gqt = qt  # (1, K, M), any M: stored bytewise
        elif cutlass.const_expr(self.colwise):
            vblocks = qt.shape[2] // BLOCK
            gqt = cute.zipped_divide(qt, (1, 1, LANE_ROWS))
        else:
            vblocks = cute.ceil_div(m, BLOCK)
            gqt = cute.zipped_divide(qt, (1, 1, LANE_ROWS))  # unused
        self.kernel(cute.zipped_divide(x, (1, 1, VEC)), cute.zipped_divide(q, (1, 1, VEC)), s, gqt, st, offs,
                    tile_starts, vblocks).launch(
            grid=(vblocks, cute.ceil_div(k, CTA_COLS), e), block=(32 * WARPS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, gx: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, gqt: cute.Tensor, st: cute.Tensor,
               offs: cute.Tensor, tile_starts: cute.Tensor, vblocks: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        vb, bk, e = cute.arch.block_idx()  # vb: this CTA's (virtual) 32-row block
        warp = tidx // 32
        lane = tidx - warp * 32
        rg = lane // COL_LANES
        cg = lane - rg * COL_LANES
        m = cute.size(gx, mode=[1, 1])
        kv = cute.size(gx, mode=[1, 2])  # 4-column vectors per row
        cb = bk * WARPS + warp  # this warp's 32-column block (warp-uniform)
        if cb * COL_LANES < kv:
            cv = cb * COL_LANES + cg
            r0 = vb * BLOCK
            end = m
            g = cutlass.Int32(0)
            start = cutlass.Int32(0)
            if cutlass.const_expr(self.grouped):
                g = _last_group_at_or_below(vb, tile_starts, cute.size(offs))
                if g > 0:
                    start = offs[g - 1]
                end = offs[g]
                r0 = start + (vb - tile_starts[g] * 4) * BLOCK
            if r0 < end:
                rl = r0 + rg * LANE_ROWS  # this lane's first row
                t = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Float32)
                if r0 + BLOCK <= end:  # full block: plain loads at constant row offsets
                    for i in cutlass.range_constexpr(LANE_ROWS):
                        t[(i, None)].store(gx[(None, (e, rl + i, cv))].load().to(cutlass.Float32))
                else:  # rows past the end: clamped loads, then zeroed
                    for i in cutlass.range_constexpr(LANE_ROWS):
                        t[(i, None)].store(gx[(None, (e, cutlass.min(rl + i, end - 1), cv))].load().to(
                            cutlass.Float32))
                    for i in cutlass.range_constexpr(LANE_ROWS):
                        if rl + i >= end:
                            t[(i, None)].store(cute.full_like(t[(i, None)].load(), 0.0))
                mag = cute.make_rmem_tensor((LANE_ROWS, VEC), cutlass.Int32)  # |x| bits, shared by both casts
                mag.store(t.load().bitcast(cutlass.Int32) & 0x7FFFFFFF)
                if cutlass.const_expr(self.rowwise):
                    self._rowwise(t, mag, gq, s, e, rl, lane, cg, end, start, g, tile_starts, cv, kv // COL_LANES)
                if cutlass.const_expr(self.colwise):
                    self._colwise(t, mag, gqt, st, e, r0, rl, lane, rg, cg, end, vb, vblocks, cv)

    @cute.jit
    def _rowwise(self, t: cute.Tensor, mag: cute.Tensor, gq: cute.Tensor, s: cute.Tensor, e, rl, lane, cg, end,
                 start, g, tile_starts: cute.Tensor, cv, kb):
        a = cute.make_rmem_tensor((LANE_ROWS,), cutlass.Int32)
        for i in cutlass.range_constexpr(LANE_ROWS):
            a[i] = _row_max(mag, i)
        _reduce_scatter_max(a, LANE_ROWS, 0, lane)  # lane cg: amax of its row group's row cg
        byte, factor = block_scale(a[0], self.emax, self.rceil)
        cb = cv // COL_LANES
        r = rl + cg
        if r < end:
            if cutlass.const_expr(self.blocked):
                srow = r
                if cutlass.const_expr(self.grouped):  # grouped-M layout: group g from tile tile_starts[g]
                    srow = tile_starts[g] * 128 + (r - start)
                s[e, blocked_scale_offset(srow, cb, kb)] = cutlass.Uint8(byte)
            else:
                s[e, r, cb] = cutlass.Uint8(byte)
        base = lane - cg
        for i in cutlass.range_constexpr(LANE_ROWS):
            f = cute.arch.shuffle_sync(factor, offset=base + i)  # row i's factor, from lane cg == i
            if rl + i < end:
                gq[(None, (e, rl + i, cv))].store(apply_scale(t[(i, None)].load(), f).to(self.elem_dtype))

    @cute.jit
    def _colwise(self, t: cute.Tensor, mag: cute.Tensor, gqt: cute.Tensor, st: cute.Tensor, e, r0, rl, lane, rg,
                 cg, end, vb, vblocks, cv):
        a = cute.make_rmem_tensor((VEC,), cutlass.Int32)
        for j in cutlass.range_constexpr(VEC):
            a[j] = _col_max(mag, j)
        _reduce_scatter_max(a, VEC, 3, lane)  # lane rg: amax of its column rg
        byte, factor = block_scale(a[0], self.emax, self.rceil)
        if cutlass.const_expr(self.blocked):
            st[e, blocked_scale_offset(cv * VEC + rg, vb, vblocks)] = cutlass.Uint8(byte)
        else:
            st[e, cv * VEC + rg, vb] = cutlass.Uint8(byte)
        for j in cutlass.range_constexpr(VEC):
            f = cute.arch.shuffle_sync(factor, offset=j * COL_LANES + cg)  # column j's factor, from lane rg == j
            qv = apply_scale(t[(None, j)].load(), f).to(self.elem_dtype)
            c = cv * VEC + j
            if cutlass.const_expr(self.grouped):  # data (K, M): the block starts at any row; bytewise
                q8 = cute.make_rmem_tensor((LANE_ROWS,), self.elem_dtype)
                q8.store(qv)
                for i in cutlass.range_constexpr(LANE_ROWS):
                    if rl + i < end:
                        gqt[e, c, rl + i] = q8[i]
            else:
                gqt[(None, (e, c, vb * ROW_LANES + rg))].store(qv)


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

"""CuTe DSL kernel: the per-offsets schedules of the Hopper fast mode's grouped step, from the offsets, in one launch.

A grouped SwiGLU MLP step in the fast mode (128-blocks, ``token_align=128``) reads four small int32 tensors made
from its token-group offsets: the casts' group tile starts, the 2d-3d GEMM's schedule in 128-row tiles, the padded
offsets of the ``token_align`` operands and the 2d-2d GEMM's schedule on those (``ops.token_layout``,
``prime_fast_schedules``).  In torch they take about fifteen tiny launches and their host time; this kernel
writes all four with one warp.

Arch-generic (SM90 and SM100): scalar loads and stores and warp shuffles, no shared memory.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

TILE = 128  # rows of a group's tiles: the fast mode's scale block and 2d-3d tile, and the token alignment
LANES = 32  # one warp


class FastScheduleKernel:
    """Four int32 outputs from ``offs (G,) int32``, G >= 1.

    ``offs``: cumulative group END offsets, non-decreasing and >= 0 (the ops layer's device-safe offsets).  With
    ``units[g] = ceil((offs[g] - offs[g - 1]) / 128)`` (``offs[-1]`` read as 0), ``incl[g] = units[0] + ... +
    units[g]`` and ``starts[g] = incl[g] - units[g]``:

    * ``tile_starts`` (G,): ``starts`` (``formats.group_tile_starts``: each group's first 128-row scale tile);
    * ``sched_m`` (2, G): ``incl``, ``starts`` (``ops.gemm_common.group_schedule`` in 128-row tiles);
    * ``ends`` (G,): ``128 * incl``, the padded offsets (``formats.padded_group_offsets(offs, 128)``);
    * ``sched_k`` (2, G), the 2d-2d schedule on the padded offsets: ``128 * starts`` (each group's first column),
      ``starts``.

    Each output may be a view anywhere in a larger buffer (``ops.token_layout.prime_fast_schedules`` packs them
    into one).  Values are int32 like the torch path's (the ops bound the padded width below 2**31).  Work split:
    one warp; lane ``l`` owns groups ``[l * c, l * c + c)`` with ``c = ceil(G / 32)``: it sums its units, an
    exclusive scan over the lanes (5 shuffles) gives its first tile, and it walks its groups again writing every
    output.
    """

    @cute.jit
    def __call__(self, offs: cute.Tensor, tile_starts: cute.Tensor, sched_m: cute.Tensor, ends: cute.Tensor,
                 sched_k: cute.Tensor, stream: cuda.CUstream):
        self.kernel(offs, tile_starts, sched_m, ends, sched_k, cute.size(offs)).launch(
            grid=(1, 1, 1), block=(LANES, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, offs: cute.Tensor, tile_starts: cute.Tensor, sched_m: cute.Tensor, ends: cute.Tensor,
               sched_k: cute.Tensor, groups: cutlass.Int32):
        lane, _, _ = cute.arch.thread_idx()
        chunk = (groups + LANES - 1) // LANES
        lo = cutlass.min(lane * chunk, groups)
        hi = cutlass.min(lo + chunk, groups)
        first = cutlass.Int32(0)  # the end of the group before this lane's first
        if lo > 0:
            first = offs[lo - 1]
        prev = first
        mine = cutlass.Int32(0)
        for g in cutlass.range(lo, hi, 1):
            o = offs[g]
            mine = mine + (o - prev + (TILE - 1)) // TILE
            prev = o
        incl = mine  # inclusive scan of the lanes' unit counts
        for d in cutlass.range_constexpr(5):
            v = cute.arch.shuffle_sync_up(incl, 1 << d)
            if lane >= (1 << d):
                incl = incl + v
        tile = incl - mine  # this lane's first group's first tile
        prev = first
        for g in cutlass.range(lo, hi, 1):
            o = offs[g]
            start = tile
            tile = tile + (o - prev + (TILE - 1)) // TILE
            prev = o
            tile_starts[g] = start
            sched_m[0, g] = tile
            sched_m[1, g] = start
            ends[g] = tile * TILE
            sched_k[0, g] = start * TILE
            sched_k[1, g] = start

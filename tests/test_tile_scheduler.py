"""The GEMMs' persistent tile order (kernels/tile_scheduler.py) in its plain-Python statement: every tile once,
clusters balanced, a wave's tiles packed into bands of ``swizzle`` rows.  The device function runs the same order
on the H200 (tests/test_gemm_checks.py, the probe kernel compared with :func:`tile_order`)."""

from __future__ import annotations

import itertools
import math

import pytest

pytest.importorskip("cutlass")
from cute_mxfp8.kernels.tile_scheduler import SWIZZLE, part_k_range, tail_split, tile_order  # noqa: E402

SHAPES = [(1, 1), (1, 9), (7, 3), (64, 56), (129, 17), (128, 16)]  # (M tiles, N tiles): skewed, odd, one tile
CLUSTERS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


@pytest.mark.parametrize("m_tiles,n_tiles", SHAPES)
@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("swizzle", [1, SWIZZLE])
@pytest.mark.parametrize("clusters", [1, 37, 148])
def test_every_tile_once_and_clusters_balanced(m_tiles, n_tiles, cluster, swizzle, clusters):
    order = tile_order(m_tiles, n_tiles, cluster, swizzle, clusters)
    cm, cn = cluster
    seen = []
    for walk in order:
        for mt, nt in walk:
            assert mt % cm == 0 and nt % cn == 0  # a cluster's CTA (0, 0) sits on the cluster grid
            seen += [(mt + i, nt + j) for i in range(cm) for j in range(cn) if mt + i < m_tiles and nt + j < n_tiles]
    assert sorted(seen) == sorted(itertools.product(range(m_tiles), range(n_tiles)))
    sizes = [len(walk) for walk in order]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == math.ceil(m_tiles / cm) * math.ceil(n_tiles / cn)


@pytest.mark.parametrize("m_tiles,n_tiles,swizzle,wave", [(64, 56, 8, 37), (64, 56, 4, 74), (130, 9, 8, 16)])
def test_a_wave_stays_in_one_band_of_rows(m_tiles, n_tiles, swizzle, wave):
    """``wave`` consecutive cluster tiles (one wave of persistent clusters) span at most two bands of
    ``swizzle`` rows, and their columns number about wave / band height (the last band may be shorter): the L2
    reuse the order is for."""
    flat = tile_order(m_tiles, n_tiles, (1, 1), swizzle, 1)[0]
    assert flat[:swizzle] == [(r, 0) for r in range(swizzle)]  # down the band first
    for start in range(0, len(flat) - wave + 1, wave):
        tiles = flat[start:start + wave]
        bands = {mt // swizzle for mt, _ in tiles}
        cols = {nt for _, nt in tiles}
        height = min(min(swizzle, m_tiles - b * swizzle) for b in bands)
        assert len(bands) <= 2 and len(cols) <= math.ceil(wave / height) + 1
    # swizzle 1 is plain row-major order: a wave is one row's run of columns
    assert tile_order(m_tiles, n_tiles, (1, 1), 1, 1)[0][:n_tiles] == [(0, c) for c in range(n_tiles)]


@pytest.mark.parametrize("args", [(4, 4, (1, 1), 0, 1), (4, 4, (0, 1), 8, 1), (4, 4, (1, 1), 8, 0)])
def test_tile_order_rejects_empty_arguments(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        tile_order(*args)


def test_empty_output_has_no_tiles():
    assert tile_order(0, 5, (2, 2), SWIZZLE, 3) == [[], [], []]


def _longest_rounds(tail, parts, ctas, k_tiles):
    """Tile time of the split units, simulated: CTA c runs units c, c + ctas, ... one after another, each as long
    as its K range; the slowest CTA sets the time (what split_units_time states)."""
    busy = {}
    for t in range(tail):
        for p in range(parts):
            u = t * parts + p
            b, e = part_k_range(p, parts, k_tiles)
            busy[u % ctas] = busy.get(u % ctas, 0) + (e - b)
    return max(busy.values()) / k_tiles


@pytest.mark.parametrize("tiles,ctas,k_tiles", [(704, 132, 64), (688, 132, 64), (1408, 132, 64), (4, 132, 32),
                                                (32, 132, 16), (6, 132, 4), (132, 132, 64), (2816, 132, 112),
                                                (5504, 132, 16), (133, 132, 7), (1, 1, 9), (238, 132, 31)])
def test_the_split_tail_covers_every_tile_and_k_tile_once_and_saves_time(tiles, ctas, k_tiles):
    """:func:`tail_split`: the whole tiles fill their rounds exactly; the last ``tail`` tiles' ``parts`` K parts
    (contiguous, disjoint, the whole K, each >= 4 K tiles) take fewer rounds of tile time than one unsplit round,
    and at least 2 % less time overall; (0, 1) where no split would."""
    tail, parts = tail_split(tiles, ctas, k_tiles)
    rounds = -(-tiles // ctas)
    if (tail, parts) == (0, 1):
        r = tiles % ctas
        assert r == 0 or all((1 - _longest_rounds(r, s, ctas, k_tiles)) / rounds < 0.02
                             for s in range(2, min(8, k_tiles // 4) + 1))
        return
    assert tail == tiles % ctas and 2 <= parts <= 8 and (tiles - tail) % ctas == 0
    split_rounds = (tiles - tail) // ctas + _longest_rounds(tail, parts, ctas, k_tiles)
    assert split_rounds <= 0.98 * rounds
    ranges = [part_k_range(p, parts, k_tiles) for p in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == k_tiles
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(e - b >= 4 for b, e in ranges)


def test_the_split_tail_of_the_bench_steps():
    """The M=8192 D=2048 I=8192 step's GEMMs (tiles of 128 x 192) on an H200's 132 SMs: N = 2048 (64 x 11 = 704
    tiles: the last 44 in 3 parts, one round of a third), the dW2 wgrad (16 x 43 = 688: 28 in 4), the dW13 wgrad
    (128 x 11 = 1408: 88 in 3, two rounds of a third: 10.67 rounds for 11); GEMM1 (64 x 86 = 5504) is not split
    (0.6 % at best)."""
    assert tail_split(704, 132, 64) == (44, 3) and tail_split(688, 132, 64) == (28, 4)
    assert tail_split(1408, 132, 64) == (88, 3) and tail_split(5504, 132, 16) == (0, 1)
    assert tail_split(0, 132, 8) == (0, 1) and tail_split(5, 132, 0) == (0, 1) and tail_split(4, 132, 2048) == (4, 8)


def test_tail_split_takes_two_parts_where_two_are_fastest():
    """198 tiles on 132 CTAs with 8 K tiles each: the 66-tile tail in 2 parts of 4 K tiles (3 or more parts would
    each fall under the 4-K-tile minimum)."""
    assert tail_split(198, 132, 8) == (66, 2)

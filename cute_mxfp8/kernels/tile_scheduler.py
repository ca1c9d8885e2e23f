"""The persistent tile order of the GEMMs: which output tiles each cluster of CTAs computes, and in what order.

Output tiles are counted in *cluster tiles*: a cluster of ``cluster_mn = (cm, cn)`` CTAs takes ``cm`` x ``cn``
neighbouring tiles at once (CTA ``(x % cm, y % cn)`` of the cluster the one at that offset), so a tile count of
``m_tiles`` x ``n_tiles`` CTA tiles is ``ceil(m_tiles / cm)`` x ``ceil(n_tiles / cn)`` cluster tiles.  Cluster
tiles are numbered in *bands* of ``swizzle`` cluster rows: inside a band the index walks down the band's rows
first, then across N, band after band.  Persistent cluster ``c`` of ``P`` takes indices ``c, c + P, c + 2P, ...``,
so a wave of ``P`` clusters covers about ``P / swizzle`` N columns of ``swizzle`` M rows: every A row block is read
by ``P / swizzle`` clusters and every B column block by ``swizzle`` of them, out of L2, instead of a wave spanning
all of M for one or two N columns (``swizzle = 1``).  The last band may have fewer rows.

``m_tiles`` is a runtime value: for token groups it is the sum of the groups' tile counts, each group starting on
a fresh tile (the grouped scale layouts' rule), and the kernel maps a global M tile to its group on the device
(:func:`.mx_math.group_of_row`) without a host sync, so consecutive M tiles of a band mostly share one expert's
weight.

:func:`tile_order` is the same order in plain Python (the tests' reference, and the model of the L2 traffic in
``docs/sm100_gemm.md``); :func:`cluster_tile` is the device function; :class:`.gemm_checks.TileScheduleProbe`
runs it on a GPU and counts every tile.

*Split tail* (:func:`tail_split`, :class:`SplitTailTiles`; the SM90 fast-mode dense GEMM): when the tile count is
not a multiple of the persistent CTAs, the last round runs on ``R = tiles % ctas`` of them while the others idle
(704 tiles on 132 SMs: 6 rounds for 5.33 rounds of work).  The last ``R`` tiles of the order are then split along
K into ``S`` parts each, so those rounds take about ``ceil(R * S / ctas) / S`` of a tile's time (44 tiles in 3
parts: one round of a third; :func:`split_units_time` counts each CTA's units' K tiles); each part writes its fp32
partial tile to a workspace and the last part to arrive (an atomic counter per tile) adds them, in part order, and
stores the tile.
"""

from __future__ import annotations

import copy
import functools

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

SWIZZLE = 8  # cluster rows per band (the GEMMs' default)


def tile_order(m_tiles: int, n_tiles: int, cluster_mn: tuple = (1, 1), swizzle: int = SWIZZLE,
               clusters: int = 1) -> list[list[tuple[int, int]]]:
    """Plain-Python statement of the order: for each of ``clusters`` persistent clusters, the CTA tiles
    ``(mt, nt)`` its CTA ``(0, 0)`` computes, in order (the cluster's other CTAs take ``(mt + i, nt + j)``,
    ``i < cm``, ``j < cn``; past the last tile row or column those fall outside the output).  Raises ValueError
    for a non-positive swizzle, cluster extent or cluster count."""
    cm, cn = cluster_mn
    if swizzle < 1 or cm < 1 or cn < 1 or clusters < 1:
        raise ValueError(f"swizzle, cluster extents and clusters must be >= 1, got {swizzle}, {cluster_mn}, "
                         f"{clusters}")
    rows, cols = -(-m_tiles // cm), -(-n_tiles // cn)
    order: list[list[tuple[int, int]]] = [[] for _ in range(clusters)]
    for linear in range(rows * cols):
        band, r = divmod(linear, swizzle * cols)
        height = min(swizzle, rows - band * swizzle)
        order[linear % clusters].append(((band * swizzle + r % height) * cm, (r // height) * cn))
    return order


@cute.jit
def cluster_tile(linear: cutlass.Int32, rows: cutlass.Int32, cols: cutlass.Int32,
                 swizzle: cutlass.Constexpr[int]):
    """Device side of :func:`tile_order`: cluster tile ``linear`` of a ``rows`` x ``cols`` grid of cluster tiles
    -> (cluster row, cluster column); ``linear < rows * cols`` (the caller's loop condition)."""
    band_size = swizzle * cols
    band = linear // band_size
    r = linear - band * band_size
    height = cutlass.min(cutlass.Int32(swizzle), rows - band * swizzle)
    return band * swizzle + r % height, r // height


def grid_clusters(m_tiles, n_tiles, cluster_mn: tuple, max_ctas: int):
    """Persistent clusters to launch: as many as fit in ``max_ctas`` CTAs, at most one per cluster tile, and at
    least one (host side, on DSL integers or Python ints)."""
    cm, cn = cluster_mn
    tiles = ((m_tiles + cm - 1) // cm) * ((n_tiles + cn - 1) // cn)
    return cutlass.max(cutlass.min(cutlass.Int32(max(max_ctas // (cm * cn), 1)), tiles), cutlass.Int32(1))


@functools.lru_cache(maxsize=4096)
def tail_split(tiles: int, ctas: int, k_tiles: int, min_part_k_tiles: int = 4, max_parts: int = 8,
               min_gain: float = 0.02) -> tuple[int, int]:
    """(tail tiles R, parts S) of :class:`SplitTailTiles` for ``tiles`` output tiles on ``ctas`` persistent CTAs
    with ``k_tiles`` K tiles each, or (0, 1) where nothing is split.  The last ``R = tiles % ctas`` tiles (one
    round of tile time on R CTAs, unsplit) become ``R * S`` units (:func:`part_k_range`), which CTA c takes as
    units c, c + ctas, ... after its whole tiles: those take :func:`split_units_time` (the most K tiles one CTA
    gets, in tile times).  S (2 .. ``max_parts``, each part at least ``min_part_k_tiles`` K tiles: a part pays a
    pipeline fill and its partial tile's write and read) is the smallest of the fastest, kept when it saves at
    least ``min_gain`` of the unsplit time.  Plain Python (the ops size the workspace with it; cached)."""
    tail = tiles % ctas if tiles > 0 and ctas > 0 else 0
    if not tail:
        return 0, 1
    best, parts = 1.0, 1
    for s in range(2, min(max_parts, k_tiles // max(min_part_k_tiles, 1)) + 1):
        t = split_units_time(tail, s, ctas, k_tiles)
        if t < best - 1e-9:
            best, parts = t, s
    if parts == 1 or (1.0 - best) / -(-tiles // ctas) < min_gain:
        return 0, 1
    return tail, parts


def split_units_time(tail: int, parts: int, ctas: int, k_tiles: int) -> float:
    """Tile times the split units of ``tail`` tiles in ``parts`` take on ``ctas`` CTAs: the most K tiles of the
    units one CTA walks (units c, c + ctas, ...; unit u is part ``u % parts``), over ``k_tiles``."""
    per_cta = [0] * ctas
    for u in range(tail * parts):
        b, e = part_k_range(u % parts, parts, k_tiles)
        per_cta[u % ctas] += e - b
    return max(per_cta) / k_tiles


def part_k_range(part, parts, k_tiles):
    """K tiles ``[begin, end)`` of part ``part`` of ``parts`` (balanced: each has ``k_tiles // parts`` or one more;
    plain Python and device integers alike)."""
    return part * k_tiles // parts, (part + 1) * k_tiles // parts


class PersistentTiles:
    """One CTA's walk over the tile order (every role of a CTA makes the same walk): ``m_tiles`` x ``n_tiles``
    CTA tiles, the launch grid ``(cm, cn, clusters)`` with clusters of ``(cm, cn, 1)``.  Use::

        tiles = PersistentTiles(m_tiles, n_tiles, cluster_mn)
        linear = tiles.first()
        while tiles.valid(linear):
            mt, nt = tiles.tile(linear)
            ...
            linear = tiles.next(linear)
    """

    def __init__(self, m_tiles, n_tiles, cluster_mn: tuple, swizzle: int = SWIZZLE):
        self.cm, self.cn = cluster_mn
        self.swizzle = swizzle
        self.rows = cutlass.Int32((m_tiles + self.cm - 1) // self.cm)  # cluster tiles
        self.cols = cutlass.Int32((n_tiles + self.cn - 1) // self.cn)

    # a runtime value for the DSL (carried through the roles' while loops): the two counts
    def __extract_mlir_values__(self):
        return extract_mlir_values(self.rows) + extract_mlir_values(self.cols)

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        new.rows = new_from_mlir_values(self.rows, values[:1])
        new.cols = new_from_mlir_values(self.cols, values[1:])
        return new

    def first(self):
        return cute.arch.block_idx()[2]

    def valid(self, linear):
        return linear < self.rows * self.cols

    def next(self, linear):
        return linear + cute.arch.grid_dim()[2]

    def tile(self, linear):
        """This CTA's (M tile, N tile) of cluster tile ``linear`` (outside the output past its last row or
        column when the cluster does not divide the tile counts: the GEMM clips and predicates those)."""
        bx, by, _ = cute.arch.block_idx()
        r, c = cluster_tile(linear, self.rows, self.cols, self.swizzle)
        return r * self.cm + bx % self.cm, c * self.cn + by % self.cn


class SplitTailTiles(PersistentTiles):
    """:class:`PersistentTiles` (no cluster) over *units*: the first ``tiles - tail`` tiles of the order whole,
    then each of the last ``tail`` tiles as ``parts`` units along K (:func:`tail_split`).  Use::

        tiles = SplitTailTiles(m_tiles, n_tiles, tail, parts)
        u = tiles.first()
        while tiles.valid(u):
            linear, part, parts, slot = tiles.unit(u)   # parts 1 (slot -1) for a whole tile
            mt, nt = tiles.tile(linear)
            ...
            u = tiles.next(u)

    ``slot``: the unit's index among the split units (its partial tile's place in the workspace); the tile's index
    among the tail tiles is ``slot // parts``."""

    def __init__(self, m_tiles, n_tiles, tail, parts, swizzle: int = SWIZZLE):
        super().__init__(m_tiles, n_tiles, (1, 1), swizzle)
        self.tail = cutlass.Int32(tail)
        self.parts = cutlass.Int32(parts)

    def __extract_mlir_values__(self):
        return super().__extract_mlir_values__() + extract_mlir_values(self.tail) + extract_mlir_values(self.parts)

    def __new_from_mlir_values__(self, values):
        new = super().__new_from_mlir_values__(values[:2])
        new.tail = new_from_mlir_values(self.tail, values[2:3])
        new.parts = new_from_mlir_values(self.parts, values[3:4])
        return new

    def _whole(self):
        return self.rows * self.cols - self.tail

    def valid(self, u):
        return u < self._whole() + self.tail * self.parts

    def unit(self, u):
        """(tile linear index, part, parts, slot) of unit ``u``."""
        whole = self._whole()
        split = u >= whole
        v = cutlass.max(u - whole, cutlass.Int32(0))
        linear = cutlass.select_(split, whole + v // self.parts, u)
        part = cutlass.select_(split, v % self.parts, cutlass.Int32(0))
        parts = cutlass.select_(split, self.parts, cutlass.Int32(1))
        return linear, part, parts, cutlass.select_(split, v, cutlass.Int32(-1))

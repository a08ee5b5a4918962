"""The FlashMask column-bound rule (``startend_row_indices``), one definition for every kernel.

Key column ``j`` carries up to four int32 bounds; query row ``i`` (sequence-relative) is masked in it
when ``LTS <= i < LTE`` or ``UTS <= i < UTE``. ``layout`` (a compile-time string, as
``paddle_fa4._spec.STARTEND_LAYOUTS``) says which bounds the tensor holds (its columns in order):

    "lts"              [LTS]                  LTE = +inf, no upper interval    (causal)
    "lts_lte"          [LTS, LTE]             no upper interval                (causal)
    "lts_ute"          [LTS, UTE]             LTE = +inf, UTS = 0              (non-causal)
    "lts_lte_uts_ute"  [LTS, LTE, UTS, UTE]                                    (non-causal)

Bounds are only compared with row indices, never used as addresses: any int32 value is memory safe
(values below 0 act as 0, above Sq as Sq, an interval whose start is not below its end masks nothing).

Three uses share :func:`row_masked`: the per-element masks of the forward and backward S tiles
(``apply_startend_mask`` / ``apply_startend_mask_kv_major``, before block_logit, so block_logit's
-inf pattern follows the same rule) and the tile classification (:func:`classify_tile`) from the
per-key-tile minima / maxima of each bound (``attention/fm_meta.py``): a (query tile, key tile) pair
is *skipped* (every row masked in every column), *full* (no row masked in any column: no element
mask) or partial.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr

#: layout -> number of int32 columns
COLS = {"lts": 1, "lts_lte": 2, "lts_ute": 2, "lts_lte_uts_ute": 4}
#: int32 extremes used as neutral elements of the per-tile min / max
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def num_cols(layout: str) -> int:
    return COLS[layout]


@cute.jit
def row_masked(i: Int32, b: list, layout: cutlass.Constexpr) -> Boolean:
    """Row ``i`` is masked in a column whose bounds are ``b`` (a list of ``num_cols(layout)`` Int32)."""
    masked = i >= b[0]
    if const_expr(layout == "lts_lte"):
        masked = masked and i < b[1]
    elif const_expr(layout == "lts_ute"):
        masked = masked or i < b[1]
    elif const_expr(layout == "lts_lte_uts_ute"):
        masked = (masked and i < b[1]) or (i >= b[2] and i < b[3])
    return masked


@cute.jit
def classify_tile(m_start: Int32, m_end: Int32, lo: list, hi: list, layout: cutlass.Constexpr):
    """``(skip, full)`` for query rows ``[m_start, m_end)`` against a key tile whose bound ``c`` has
    minimum ``lo[c]`` and maximum ``hi[c]`` over the tile's columns (``m_end > m_start``).

    ``skip``: every row is inside the same interval in every column (one interval covers the rows:
    its largest start <= m_start and its smallest end >= m_end). ``full``: every interval of every
    column misses the rows (smallest start >= m_end or largest end <= m_start). Both are sufficient
    conditions (a pair covered only by the union of the two intervals counts as partial)."""
    big = Int32(INT32_MAX)
    lts_lo, lts_hi = lo[0], hi[0]
    lte_lo, lte_hi = big, big
    if const_expr(layout == "lts_lte" or layout == "lts_lte_uts_ute"):
        lte_lo, lte_hi = lo[1], hi[1]
    skip = lts_hi <= m_start and lte_lo >= m_end
    full = lts_lo >= m_end or lte_hi <= m_start
    if const_expr(layout == "lts_ute"):
        # upper interval [0, UTE)
        skip = skip or lo[1] >= m_end
        full = full and hi[1] <= m_start
    if const_expr(layout == "lts_lte_uts_ute"):
        skip = skip or (hi[2] <= m_start and lo[3] >= m_end)
        full = full and (lo[2] >= m_end or hi[3] <= m_start)
    return skip, full


@cute.jit
def narrow_tile_range(tiles, first: Int32, end: Int32):
    """``tile_range.TileRange`` ``tiles`` intersected with the key tiles ``[first, end)`` the column
    bounds do not skip (``attention/fm_meta.py``); the mask split points are clamped into the result
    (an empty intersection has ``n_min >= n_max``)."""
    from cute_kernels.common.tile_range import TileRange

    n_min = cutlass.max(tiles.n_min, first)
    n_max = cutlass.min(tiles.n_max, end)
    n_right = cutlass.max(cutlass.min(tiles.n_right_mask, n_max), n_min)
    n_left = cutlass.min(cutlass.max(tiles.n_left_mask, n_min), n_right)
    return TileRange(n_min, n_max, n_right, n_left)


@cute.jit
def load_bounds(mBounds: cute.Tensor, j: Int32, layout: cutlass.Constexpr) -> list:
    """The bounds of key column ``j`` from an ``(Sk, n)`` view (``j`` must be a valid column)."""
    return [mBounds[j, c] for c in range(num_cols(layout))]


@cute.jit
def load_tile_minmax(mMinMax: cute.Tensor, n_tile: Int32, layout: cutlass.Constexpr):
    """``(lo, hi)`` lists of key tile ``n_tile`` from an ``(n_tiles, 2 * n)`` view laid out as
    ``[min_0, max_0, min_1, max_1, ...]`` (``attention/fm_meta.py``)."""
    n = num_cols(layout)
    return ([mMinMax[n_tile, 2 * c] for c in range(n)], [mMinMax[n_tile, 2 * c + 1] for c in range(n)])


@cute.jit
def apply_startend_mask(acc_mn: cute.Tensor, cols: cutlass.Constexpr, rows: list, col_offset: Int32,
                        mBounds: cute.Tensor, seqlen_k: Int32, layout: cutlass.Constexpr):
    """Set entries of ``acc_mn`` (register row r = sequence row ``rows[r]``, register column c = key
    ``cols[c] + col_offset``, as ``mask.apply_mask``) that the column bounds mask to -inf. Columns at or
    past ``seqlen_k`` are left to the seqlen mask (their bounds are not read)."""
    for c in cutlass.range_constexpr(len(cols)):
        j = cols[c] + col_offset
        jj = cutlass.min(j, seqlen_k - 1)  # a valid address; the tail's values are masked elsewhere
        b = load_bounds(mBounds, jj, layout)
        for r in cutlass.range_constexpr(len(rows)):
            acc_mn[r, c] = -Float32.inf if row_masked(rows[r], b, layout) else acc_mn[r, c]


@cute.jit
def apply_startend_mask_kv_major(acc_mn: cute.Tensor, cols: cutlass.Constexpr, keys: list, col_offset: Int32,
                                 mBounds: cute.Tensor, seqlen_k: Int32, layout: cutlass.Constexpr,
                                 fill: Float32 = -Float32.inf):
    """The same rule on a transposed tile (the backward's S^T): register row r holds key ``keys[r]``,
    register column c query row ``cols[c] + col_offset``. Each key's bounds are shifted by
    ``col_offset`` once, so every element costs compares of a compile-time column against them (the
    form ``mask.apply_mask_kv_major`` uses; adding the offset per element spilled at 240 registers).
    ``fill``: the value of masked entries (-inf on scores; 0 on probabilities, the backward's P^T)."""
    for r in cutlass.range_constexpr(len(keys)):
        jj = cutlass.min(keys[r], seqlen_k - 1)
        b = [x - col_offset for x in load_bounds(mBounds, jj, layout)]
        for c in cutlass.range_constexpr(len(cols)):
            acc_mn[r, c] = fill if row_masked(cols[c], b, layout) else acc_mn[r, c]


@cute.jit
def mask_kv_major_with_bounds(acc_mn: cute.Tensor, cols: cutlass.Constexpr, key_bounds: list, col_offset: Int32,
                              layout: cutlass.Constexpr, fill: Float32):
    """``apply_startend_mask_kv_major`` with the bounds of register row r's key already loaded
    (``key_bounds[r]``, a list of n Int32)."""
    for r in cutlass.range_constexpr(len(key_bounds)):
        b = [x - col_offset for x in key_bounds[r]]
        for c in cutlass.range_constexpr(len(cols)):
            acc_mn[r, c] = fill if row_masked(cols[c], b, layout) else acc_mn[r, c]


@cute.jit
def apply_startend_mask_row_warp(acc_mn: cute.Tensor, ncols: cutlass.Constexpr, row: Int32, col_offset: Int32,
                                 mBounds: cute.Tensor, seqlen_k: Int32, layout: cutlass.Constexpr, lane: Int32):
    """``apply_startend_mask`` for a layout with one row per thread and the same ``ncols`` columns
    (keys ``col_offset + c``) in every lane of the warp (SM100's TMEM rows): lane l loads the bounds
    of columns l, l + 32, ...; column c's come from lane c % 32 by shuffle, so a thread holds 4n
    loaded values instead of 128n."""
    n = num_cols(layout)
    mine = [load_bounds(mBounds, cutlass.min(col_offset + s * 32 + lane, seqlen_k - 1), layout)
            for s in range(ncols // 32)]
    for c in cutlass.range_constexpr(ncols):
        b = [cute.arch.shuffle_sync(mine[c // 32][k], c % 32) for k in range(n)]
        acc_mn[0, c] = -Float32.inf if row_masked(row, b, layout) else acc_mn[0, c]


@cute.jit
def skipped_query_tiles(lo: list, hi: list, layout: cutlass.Constexpr, tile_m: cutlass.Constexpr, seqlen_q: Int32):
    """The query tiles (of ``tile_m`` rows) that a key tile with per-bound minima ``lo`` / maxima ``hi``
    skips, as two tile-index ranges ``(a1, b1, a2, b2)``: [a1, b1) inside every column's lower interval,
    [a2, b2) inside every upper one (either may be empty, b <= a). Tile m is in one of them exactly when
    :func:`classify_tile` calls it skipped: m * tile_m >= max(start) and min((m + 1) * tile_m, Sq) <=
    min(end). The backward's steps use this closed form (no per-tile loop to count them)."""
    lte_lo = Int32(INT32_MAX)
    if const_expr(layout == "lts_lte" or layout == "lts_lte_uts_ute"):
        lte_lo = lo[1]
    a1, b1 = _tiles_within(hi[0], lte_lo, tile_m, seqlen_q)
    a2, b2 = Int32(0), Int32(0)
    if const_expr(layout == "lts_ute"):
        a2, b2 = _tiles_within(Int32(0), lo[1], tile_m, seqlen_q)
    elif const_expr(layout == "lts_lte_uts_ute"):
        a2, b2 = _tiles_within(hi[2], lo[3], tile_m, seqlen_q)
    return a1, b1, a2, b2


@cute.jit
def _tiles_within(start: Int32, end: Int32, tile_m: cutlass.Constexpr, seqlen_q: Int32):
    """Tile-index range [a, b) of the query tiles whose rows all lie in [start, end) (the last, short
    tile ends at Sq)."""
    a = (cutlass.max(start, 0) + tile_m - 1) // tile_m
    b = cutlass.max(end, 0) // tile_m
    if end >= seqlen_q:
        b = (seqlen_q + tile_m - 1) // tile_m
    return a, b


@cute.jit
def in_skipped(m: Int32, ranges) -> Boolean:
    """Query tile ``m`` lies in one of :func:`skipped_query_tiles`' ranges."""
    a1, b1, a2, b2 = ranges
    return (m >= a1 and m < b1) or (m >= a2 and m < b2)


@cute.jit
def count_skipped(m_lo: Int32, m_hi: Int32, ranges) -> Int32:
    """How many query tiles of ``[m_lo, m_hi)`` lie in :func:`skipped_query_tiles`' ranges."""
    a1, b1, a2, b2 = ranges
    l1, h1 = cutlass.max(a1, m_lo), cutlass.min(b1, m_hi)
    l2, h2 = cutlass.max(a2, m_lo), cutlass.min(b2, m_hi)
    n1 = cutlass.max(h1 - l1, 0)
    n2 = cutlass.max(h2 - l2, 0)
    both = cutlass.max(cutlass.min(h1, h2) - cutlass.max(l1, l2), 0)
    return n1 + n2 - both


@cute.jit
def merged_skips(m_lo: Int32, m_hi: Int32, ranges):
    """:func:`skipped_query_tiles`' two ranges clipped to ``[m_lo, m_hi)``, ordered and made disjoint:
    ``(first start, first length, second start, second length)`` with the second after the first."""
    a1, b1, a2, b2 = ranges
    l1 = cutlass.max(a1, m_lo)
    h1 = cutlass.max(cutlass.min(b1, m_hi), l1)
    l2 = cutlass.max(a2, m_lo)
    h2 = cutlass.max(cutlass.min(b2, m_hi), l2)
    swap = l2 < l1
    fa = l2 if swap else l1
    fb = h2 if swap else h1
    sa = l1 if swap else l2
    sb = h1 if swap else h2
    sa = cutlass.max(sa, fb)
    sb = cutlass.max(sb, sa)
    return fa, fb - fa, sa, sb - sa


@cute.jit
def live_tile(idx: Int32, m_lo: Int32, skips) -> Int32:
    """The ``idx``-th query tile of ``[m_lo, ...)`` outside the skipped ranges ``skips`` (:func:`merged_skips`):
    a step loop over the tiles that compute, with no branch around its body."""
    fa, fl, sa, sl = skips
    m = m_lo + idx
    m = m + fl if m >= fa else m
    m = m + sl if m >= sa else m
    return m


@cute.jit
def live_count(m_lo: Int32, m_hi: Int32, skips) -> Int32:
    """How many query tiles of ``[m_lo, m_hi)`` lie outside ``skips`` (:func:`merged_skips`)."""
    return cutlass.max(m_hi - m_lo, 0) - skips[1] - skips[3]

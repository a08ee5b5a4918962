"""Key-tile range of a query tile under bottom-right causal / sliding-window masks.

Row i of a sequence with lengths (Sq, Sk) sees keys t with
    i + Sk - Sq - window_left <= t <= i + Sk - Sq + window_right
where causal means window_right = 0, and an unbounded side is represented here by a window
large enough to cover the whole sequence (``normalize_window``). Tiles are [n*tile_n, (n+1)*tile_n).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@cute.jit
def normalize_window(window_left: Int32, window_right: Int32, seqlen_q: Int32, seqlen_k: Int32,
                     causal: cutlass.Constexpr, has_window: cutlass.Constexpr):
    """(left, right) reach in keys, with -1 (unbounded) replaced by Sq + Sk; causal forces right = 0."""
    big = seqlen_q + seqlen_k
    left = big
    right = big
    if const_expr(has_window):
        left = window_left if window_left >= 0 else big
        right = window_right if window_right >= 0 else big
    if const_expr(causal):
        if const_expr(has_window):
            right = cutlass.min(right, 0)
        else:
            right = Int32(0)
    return left, right


@dataclass(frozen=True)
class TileRange:
    """Key tiles [n_min, n_max) a query tile visits, and where masking is needed.

    Tiles n >= n_right_mask need the right (causal/window) mask, tiles n < n_left_mask the left
    window mask; tiles in between are fully visible (except the seqlen tail, masked on tile n_max-1).
    """

    n_min: Int32
    n_max: Int32
    n_right_mask: Int32
    n_left_mask: Int32

    @staticmethod
    @cute.jit
    def create(m_start: Int32, seqlen_q: Int32, seqlen_k: Int32, left: Int32, right: Int32,
               tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
               mask_right: cutlass.Constexpr, mask_left: cutlass.Constexpr):
        shift = seqlen_k - seqlen_q
        m_end = cutlass.min(m_start + tile_m, seqlen_q)  # exclusive; m_end > m_start for a live tile
        n_max = (seqlen_k + tile_n - 1) // tile_n
        n_min = Int32(0)
        n_right_mask = n_max
        n_left_mask = Int32(0)
        if const_expr(mask_right):
            # Last row's exclusive key limit; first row's limit decides which tiles need a mask.
            end_last = m_end - 1 + shift + right + 1
            n_max = cutlass.min(n_max, cutlass.max(end_last + tile_n - 1, 0) // tile_n)
            end_first = m_start + shift + right + 1
            n_right_mask = cutlass.max(end_first, 0) // tile_n
        if const_expr(mask_left):
            start_first = m_start + shift - left
            n_min = cutlass.max(start_first, 0) // tile_n
            start_last = m_end - 1 + shift - left
            n_left_mask = (cutlass.max(start_last, 0) + tile_n - 1) // tile_n
        n_right_mask = cutlass.max(cutlass.min(n_right_mask, n_max), n_min)
        n_left_mask = cutlass.min(cutlass.max(n_left_mask, n_min), n_right_mask)
        return TileRange(n_min, n_max, n_right_mask, n_left_mask)


@dataclass(frozen=True)
class QueryTileRange:
    """Query tiles [m_min, m_max) that see at least one key of key tile [n_start, n_start + tile_n).

    The backward's inverse of ``TileRange``, exact: m is in range iff some (row i of tile m, key t of
    the tile) pair is visible. Key t is seen by rows i with t - shift - right <= i <= t - shift + left
    (0 <= i < Sq), an interval of length >= 1 that moves by one row per key (left + right >= 0 after
    ``normalize_window``), so the rows seeing the tile form the single interval
    [t_first - shift - right, t_last - shift + left] clipped to [0, Sq); empty when the clip is empty.
    ``first_key_tile`` is the matching exact rule in the other direction (deterministic dQ order).

    Masking (the backward skips the mask on the other steps): query tiles m < m_right_mask need the
    right (causal / window) mask, tiles m >= m_left_mask the left window mask; the tiles in between are
    fully visible to every key of the tile. A tile that reaches past seqlen_k needs the key mask on
    every step (the caller's test; not part of this range).
    """

    m_min: Int32
    m_max: Int32
    m_right_mask: Int32
    m_left_mask: Int32

    @staticmethod
    @cute.jit
    def create(n_start: Int32, seqlen_q: Int32, seqlen_k: Int32, left: Int32, right: Int32,
               tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
               mask_right: cutlass.Constexpr, mask_left: cutlass.Constexpr):
        shift = seqlen_k - seqlen_q
        n_last = cutlass.min(n_start + tile_n, seqlen_k) - 1  # last key of the tile (n_start < Sk)
        row_lo = Int32(0)
        row_hi = seqlen_q - 1
        if const_expr(mask_right):
            row_lo = cutlass.max(n_start - shift - right, 0)
        if const_expr(mask_left):
            row_hi = cutlass.min(n_last - shift + left, seqlen_q - 1)
        m_min = row_lo // tile_m
        m_max = m_min
        if row_lo <= row_hi:
            m_max = row_hi // tile_m + 1
        m_right_mask = m_min
        m_left_mask = m_max
        if const_expr(mask_right):
            # Row i sees every key of the tile on the right side iff i >= n_last - shift - right.
            m_right_mask = (cutlass.max(n_last - shift - right, 0) + tile_m - 1) // tile_m
        if const_expr(mask_left):
            # ... and on the left side iff i <= n_start - shift + left (last row of tile m: (m + 1) tile_m - 1).
            m_left_mask = cutlass.max(n_start - shift + left + 1, 0) // tile_m
        m_right_mask = cutlass.min(cutlass.max(m_right_mask, m_min), m_max)
        m_left_mask = cutlass.min(cutlass.max(m_left_mask, m_right_mask), m_max)
        return QueryTileRange(m_min, m_max, m_right_mask, m_left_mask)


@cute.jit
def first_key_tile(m_start: Int32, seqlen_q: Int32, seqlen_k: Int32, left: Int32,
                   tile_n: cutlass.Constexpr, mask_left: cutlass.Constexpr) -> Int32:
    """First key tile that query tile ``m_start`` sees (exact; the query tile is assumed to see one):
    its first row's first visible key max(m_start + shift - left, 0), in tiles. Key tiles n with
    ``QueryTileRange(n)`` containing the query tile are exactly [first_key_tile, ...) contiguous."""
    first = Int32(0)
    if const_expr(mask_left):
        first = cutlass.max(m_start + seqlen_k - seqlen_q - left, 0) // tile_n
    return first


@cute.jit
def last_key_tile(m_start: Int32, seqlen_q: Int32, seqlen_k: Int32, right: Int32,
                  tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, mask_right: cutlass.Constexpr) -> Int32:
    """Last key tile that query tile ``m_start`` sees (exact; the tile is assumed to see one): its last
    row's last visible key min(m_end - 1 + shift + right, Sk - 1), in tiles. With ``first_key_tile``
    the visitors of the query tile are [first_key_tile, last_key_tile]."""
    last_key = seqlen_k - 1
    if const_expr(mask_right):
        m_end = cutlass.min(m_start + tile_m, seqlen_q)
        last_key = cutlass.min(m_end - 1 + seqlen_k - seqlen_q + right, seqlen_k - 1)
    return last_key // tile_n


#: L2 bytes the deterministic backward's head swizzle plans for (H100 / H200: 50 MiB).
L2_BYTES = 50 * 1024 * 1024
MAX_SWIZZLE_HEADS = 16
_SWIZZLE_POWERS = tuple(1 << i for i in range(1, MAX_SWIZZLE_HEADS.bit_length()))  # 2, 4, 8, 16


@cute.jit
def swizzle_heads(seqlen_q: Int32, head_dim: cutlass.Constexpr, head_dim_v: cutlass.Constexpr,
                  elem_bytes: cutlass.Constexpr) -> Int32:
    """How many (batch, head) pairs ``head_swizzled_tile`` interleaves: the largest power of two (at most
    MAX_SWIZZLE_HEADS, at least 1) whose Q, dO and fp32 dQ accumulator rows (``seqlen_q`` each) fit in
    L2_BYTES together -- the CTAs running at once stream those."""
    rows_fit = L2_BYTES // ((head_dim + head_dim_v) * elem_bytes + head_dim * 4)  # compile-time
    fit = Int32(rows_fit) // cutlass.max(seqlen_q, 1)
    heads = Int32(1)
    for p in _SWIZZLE_POWERS:  # a Python tuple: unrolled at trace time
        heads = Int32(p) if fit >= p else heads
    return heads


@cute.jit
def head_swizzled_tile(x: Int32, y: Int32, z: Int32, nx: Int32, ny: Int32, nz: Int32, heads: Int32):
    """Block (x, y, z) of an (nx key tiles, ny heads, nz batches) grid -> (key tile, head, batch) with
    ``heads`` (batch, head) pairs interleaved: consecutive blocks of the linear launch order
    x + nx (y + ny z) walk key tile 0 of heads h0 .. h0 + heads - 1, then key tile 1 of the same heads,
    ... (the last group may be narrower). A bijection; a block's key tile n - 1 and (same key tile) its
    previous head keep a smaller linear index, so turn counters that wait on those still wait only on
    blocks launched earlier. Note [head swizzle] in attention/bwd_sm90.py says why."""
    linear = x + nx * (y + ny * z)
    group_blocks = heads * nx
    group = linear // group_blocks
    rem = linear - group * group_blocks
    width = cutlass.min(heads, ny * nz - group * heads)
    n = rem // width
    hb = group * heads + (rem - n * width)
    b = hb // ny
    return n, hb - b * ny, b

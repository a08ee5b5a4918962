"""The one-row-per-thread document-relative block_logit plan (common/block_logit.py, used by the SM100 forward)
against the block_bos rule, on the CPU.

The kernel's per-key-tile step (``row_relative_maxima`` on the S row, ``store_relative_row`` once the row max
is handed over) and its unvisited-block fill (``fill_unvisited_relative``) are device code; this file replays
their logic in Python around the real integer plan of a tile (``relative_tile_plan``, plain operators, so it runs on Python ints too) over random rows,
origins, block sizes and visited key-tile ranges, and checks the two things the kernel relies on: every entry
``[0, nb)`` of a row is written exactly once, and each written value is the rule's block max (keys
``[bos + j * bs, bos + (j + 1) * bs)``, keys before ``bos`` in no block, keys of unvisited tiles masked).
It checks the plan, not the compiled kernel (tests/sm100/test_block_bos_sm100.py does that on a Blackwell GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels.common.block_logit import RowRelativeShape, relative_tile_plan

NEG = -np.inf


def _split(seg_vals: np.ndarray, u: int):
    """split_segment: (max over columns < u, max over columns >= u)."""
    lower = seg_vals[:u].max(initial=NEG)
    upper = seg_vals[u:].max(initial=NEG)
    return lower, upper


def _maxima(shape, row: np.ndarray, n0: int, bos: int, carry: list):
    """row_relative_maxima: (finished blocks top down, tile max); ``carry[0]`` becomes the part below the
    lowest start."""
    u_abs, _k_top = relative_tile_plan(shape, n0, bos)
    wide = shape.block_size > shape.tile_n
    u = min(u_abs, shape.tile_n) if wide else u_abs
    finished = []
    cur = carry[0]
    tile_max = NEG
    for i in range(shape.segments):
        m = shape.segments - 1 - i
        lower, upper = _split(row[m * shape.seg:(m + 1) * shape.seg], u)
        tile_max = max(tile_max, lower, upper)
        val = max(upper, cur)
        finished.append(val)
        cur = (lower if u_abs < shape.tile_n else max(val, lower)) if wide else lower
    carry[0] = cur
    return finished, tile_max


def _store(shape, finished, n0: int, bos: int, carry: list, limit: int, last: bool, writes):
    """store_relative_row: stores go to ``writes`` as (k, value)."""
    u_abs, k_top = relative_tile_plan(shape, n0, bos)

    def store(k, v):
        if 0 <= k < limit:
            writes.append((k, v))

    if shape.block_size > shape.tile_n:
        if u_abs < shape.tile_n:
            store(k_top, finished[0])
    else:
        for i in range(shape.segments):
            store(k_top - i, finished[i])
    if last:
        if u_abs != 0:
            store(k_top - shape.segments, carry[0])
        carry[0] = NEG


def _fill_unvisited(bos: int, nb: int, key_lo: int, key_hi: int, bs: int) -> list:
    """fill_unvisited_relative for one row: the block ids it writes -inf to."""
    lo = min(max((key_lo - bos) // bs, 0), nb)
    hi = min(max((key_hi + bs - 1 - bos) // bs, lo), nb)
    if key_lo >= key_hi:
        lo = hi = nb
    return list(range(0, lo)) + list(range(hi, nb))


def _rule(s_row: np.ndarray, bos: int, bs: int, nb: int) -> np.ndarray:
    """The block_bos rule (the reference backend's _block_max_relative) for one row."""
    out = np.full(nb, NEG)
    for j in range(nb):
        a, e = bos + j * bs, min(bos + (j + 1) * bs, len(s_row))
        if a < e:
            out[j] = s_row[a:e].max()
    return out


def _run_row(s_row, bos, bs, tile_n, n_min, n_max, sk, valid=True):
    """The kernel's whole row: key tiles n_max - 1 down to n_min, then the fill. -> (block_logit row, counts)."""
    shape = RowRelativeShape(tile_n, bs)
    nb = -(-sk // bs)
    limit = nb if valid else 0
    writes = []
    carry = [NEG]
    padded = np.full(max(n_max, -(-sk // tile_n)) * tile_n, NEG)
    padded[:sk] = s_row
    row_max = NEG
    for n_tile in range(n_max - 1, n_min - 1, -1):
        n0 = n_tile * tile_n
        finished, tmax = _maxima(shape, padded[n0:n0 + tile_n], n0, bos, carry)
        _store(shape, finished, n0, bos, carry, limit, n_tile == n_min, writes)
        row_max = max(row_max, tmax)
        assert tmax == padded[n0:n0 + tile_n].max(), "tile max must be the plain row max of the tile"
    assert carry[0] == NEG, "the carry is left -inf after a work tile"
    if valid:
        key_lo, key_hi = n_min * tile_n, n_max * tile_n
        writes += [(k, NEG) for k in _fill_unvisited(bos, nb, key_lo, key_hi if n_max > n_min else key_lo, bs)]
    out = np.full(nb, np.nan)
    count = np.zeros(nb, int)
    for k, v in writes:
        out[k] = v
        count[k] += 1
    return out, count


@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("tile_n", [128, 64])
def test_every_entry_once_and_the_rule(bs, tile_n):
    rng = np.random.default_rng(bs * 1000 + tile_n)
    for trial in range(300):
        sk = int(rng.integers(1, 5 * tile_n + 40))
        nt = -(-sk // tile_n)
        n_min = int(rng.integers(0, nt))
        n_max = int(rng.integers(n_min + 1, nt + 1))
        bos = int(rng.choice([0, sk, int(rng.integers(0, sk + 1)), (int(rng.integers(0, sk + 1)) // bs) * bs]))
        s_row = rng.standard_normal(sk)
        s_row[rng.random(sk) < 0.2] = NEG  # masked keys
        vis = s_row.copy()  # keys of tiles the kernel does not visit are masked for every row of the tile
        vis[:n_min * tile_n] = NEG
        vis[n_max * tile_n:] = NEG
        out, count = _run_row(vis, bos, bs, tile_n, n_min, n_max, sk)
        nb = -(-sk // bs)
        assert (count == 1).all(), (trial, sk, bos, n_min, n_max, count)
        np.testing.assert_array_equal(out, _rule(vis, bos, bs, nb), err_msg=f"{trial}: sk {sk} bos {bos}")


def test_no_visited_tile_and_rows_past_the_sequence():
    """A tile with no key tile fills the whole row; a row past seqlen_q stores nothing (limit 0)."""
    sk, bs, tile_n = 300, 32, 128
    nb = -(-sk // bs)
    assert _fill_unvisited(17, nb, 256, 256, bs) == list(range(nb))
    out, count = _run_row(np.zeros(sk), 17, bs, tile_n, 0, 3, sk, valid=False)
    assert (count == 0).all()


def test_plan_matches_floor_division():
    """relative_tile_plan: u_abs is (bos - n0) mod bs and k_top the block starting in the top segment, for
    negative offsets too (origins above the tile)."""
    for bs in (16, 32, 64, 128, 256):
        shape = RowRelativeShape(128, bs)
        for n0 in (0, 128, 256, 1024):
            for bos in (0, 1, 5, 127, 128, 129, 300, 1500, 4000):
                u_abs, k_top = relative_tile_plan(shape, n0, bos)
                assert u_abs == (bos - n0) % bs
                start = n0 + 128 - shape.seg + u_abs
                assert (start - bos) % bs == 0 and k_top == (start - bos) // bs

"""The SM100 kernels' plain-PTX / integer device helpers, run on the GPU at hand (the H200: sm_90a).

    python -m pytest tests/gpu/test_sm100_helpers.py -q

Tiny kernels (``cute_kernels.helper_probes``) call the helpers one value / case per thread; numpy is
the reference:

* ``math_sm100.exp2_poly`` (the FMA-pipe exp2 of the SM100 softmax) over a dense sweep of
  [-150, 128), 4096 points in every unit interval [n, n + 1), tiny and denormal inputs and the
  specials. Tolerance: relative error <= 1e-4 where 2^x is a normal float (x >= -126). That is the
  fitted polynomial's own error (8.6e-5 in exact arithmetic, ``_EXP2_POLY``) plus a few fp32 ulps of
  evaluation; the result feeds P, rounded to bf16 (relative spacing 7.8e-3) or fp16 (9.8e-4), so
  1e-4 is under a fifth of an fp16 half-ulp. Exact: integers in [-126, 127], 0 -> 1, and 0 for
  x < -127, -inf and NaN (a fully masked row keeps a zero sum). For x in [-127, -126) the result is a
  denormal within 2^-126 of 2^x (MUFU's ex2.approx.ftz gives 0 there; either is < 1e-38 of a row sum
  >= 1).
* ``math_sm100.max_tree`` over k = 1 ... 128 values (128 = one SM100 S row per thread): exactly
  numpy's fmax (NaN-quiet) incl. -inf entries and all -inf rows. On sm_90a ``fmax3`` is two
  ``max.f32``; the three-input form runs on Blackwell (``python -m cute_kernels.selftest``).
* The index math both arches share (``common/tile_range``, ``common/mask``: the SM100 backward's, and
  the forward's once it reads them) against brute-force visibility from the API's mask rule.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels.arch import TARGETS
from tests.conftest import torch_cuda_arch

ARCH = torch_cuda_arch()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ARCH not in TARGETS, reason=f"needs a CUDA GPU we build for {sorted(TARGETS)}")]

REL_TOL = 1e-4
TILES = [(128, 128), (64, 128), (128, 64)]
MASKS = [(False, False), (True, False), (False, True), (True, True)]  # (causal, has_window)


@pytest.fixture(scope="module")
def torch():
    t = pytest.importorskip("torch")
    pytest.importorskip("cutlass")
    return t


@pytest.fixture(scope="module")
def probes(torch):
    from cute_kernels import helper_probes

    return helper_probes


def _exp2(torch, probes, x: np.ndarray):
    fn = probes.compile_exp2(ARCH)
    tx = torch.from_numpy(x.astype(np.float32)).cuda()
    poly, mufu = torch.empty_like(tx), torch.empty_like(tx)
    fn(tx, poly, mufu)
    torch.cuda.synchronize()
    return poly.cpu().numpy(), mufu.cpu().numpy()


def _sweep() -> np.ndarray:
    rng = np.random.default_rng(0)
    parts = [np.linspace(-150.0, 128.0, 1 << 24, endpoint=False),
             (np.arange(-127, 128)[:, None] + np.linspace(0.0, 1.0, 4096, endpoint=False)[None, :]).ravel(),
             np.nextafter(np.arange(-126, 128, dtype=np.float32), np.float32(-np.inf)),  # just below integers
             rng.uniform(-130.0, 10.0, 1 << 20)]
    tiny = np.logspace(-45, -3, 1 << 14)
    parts += [tiny, -tiny, np.float32([1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38])]
    return np.concatenate([p.astype(np.float32) for p in parts])


def test_exp2_poly_relative_error_over_the_normal_range(torch, probes):
    x = _sweep()
    poly, _ = _exp2(torch, probes, x)
    normal = (x >= -126.0) & (x < 128.0)
    ref = np.exp2(x[normal].astype(np.float64))
    rel = np.abs(poly[normal].astype(np.float64) / ref - 1.0)
    worst = int(np.argmax(rel))
    assert rel.max() <= REL_TOL, f"max rel err {rel.max():.3e} at x = {x[normal][worst]!r}"
    assert (poly[normal] > 0).all() and np.isfinite(poly[normal]).all()


def test_exp2_poly_exact_values_and_specials(torch, probes):
    ints = np.arange(-126, 128, dtype=np.float32)
    specials = np.float32([0.0, -0.0, -np.inf, np.nan, -127.5, -128.0, -149.0, -150.0, -1000.0, -3.0e38])
    poly, _ = _exp2(torch, probes, np.concatenate([ints, specials]))
    np.testing.assert_array_equal(poly[:len(ints)], np.exp2(ints.astype(np.float64)).astype(np.float32))
    assert poly[len(ints)] == 1.0 and poly[len(ints) + 1] == 1.0
    assert (poly[len(ints) + 2:] == 0.0).all(), poly[len(ints) + 2:]  # -inf, NaN, x < -127


def test_exp2_poly_denormal_band(torch, probes):
    """x in [-127, -126): 2^x is a denormal; the result stays in [0, 2^-126] within 2^-126 of it."""
    x = np.linspace(-127.0, -126.0, 1 << 16, endpoint=False).astype(np.float32)
    poly, _ = _exp2(torch, probes, x)
    ref = np.exp2(x.astype(np.float64))
    assert (poly >= 0).all() and (poly <= 2.0 ** -126).all()
    assert np.abs(poly - ref).max() <= 2.0 ** -126


def test_exp2_poly_close_to_mufu(torch, probes):
    """The emulated and the MUFU exp2 of the same inputs agree to the polynomial's tolerance (they
    are mixed column by column in one row of the SM100 softmax)."""
    x = np.linspace(-100.0, 8.0, 1 << 20).astype(np.float32)
    poly, mufu = _exp2(torch, probes, x)
    rel = np.abs(poly.astype(np.float64) / mufu - 1.0)
    assert rel.max() <= REL_TOL + 1e-6, rel.max()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 9, 27, 32, 128])
def test_max_tree(torch, probes, k):
    rng = np.random.default_rng(k)
    n = 4096
    x = rng.standard_normal((n, k)).astype(np.float32) * 100
    x[rng.random((n, k)) < 0.2] = -np.inf
    x[: n // 16] = -np.inf  # rows with every entry masked
    x[n // 16: n // 8, rng.integers(0, k)] = np.nan  # one NaN operand is ignored, as max.f32 does
    x[n // 8: n // 8 + 64] = rng.standard_normal((64, 1)).astype(np.float32)  # all equal
    fn = probes.compile_max_tree(ARCH, k)
    tx = torch.from_numpy(x).cuda()
    y = torch.empty(n, device="cuda", dtype=torch.float32)
    fn(tx, y)
    torch.cuda.synchronize()
    ref = np.fmax.reduce(x, axis=1)
    got = y.cpu().numpy()
    bad = ~((got == ref) | (np.isnan(got) & np.isnan(ref)))
    assert not bad.any(), f"{int(bad.sum())} rows differ, first {int(np.argmax(bad))}: {got[bad][0]} vs {ref[bad][0]}"


# --------------------------------------------------------------------------- index math
def _bounds(sq, sk, causal, has_window, wl, wr):
    """(left, right) reach of the API rule, None = unbounded: row i sees t iff t < sk,
    t >= i + sk - sq - left and t <= i + sk - sq + right."""
    left = wl if has_window and wl >= 0 else None
    right = wr if has_window and wr >= 0 else None
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _visible(rows, keys, sq, sk, left, right):
    i, t = np.asarray(rows)[:, None], np.asarray(keys)[None, :]
    ok = np.broadcast_to((t < sk) & (t >= 0), (i.shape[0], t.shape[1])).copy()
    if left is not None:
        ok &= t >= i + sk - sq - left
    if right is not None:
        ok &= t <= i + sk - sq + right
    return ok


def _cases(rng, n, tile_m, tile_n):
    sq = rng.integers(1, 700, n)
    sk = rng.integers(1, 700, n)
    sq[:8], sk[:8] = [1, 1, 128, 128, 700, 100, 256, 129], [1, 300, 128, 700, 100, 700, 128, 257]
    wl = np.where(rng.random(n) < 0.25, -1, rng.integers(0, 300, n))
    wr = np.where(rng.random(n) < 0.25, -1, rng.integers(0, 300, n))
    wl[8:16], wr[8:16] = 0, 0
    m_start = rng.integers(0, (sq + tile_m - 1) // tile_m) * tile_m
    n_start = rng.integers(0, (sk + tile_n - 1) // tile_n) * tile_n
    return np.stack([m_start, n_start, sq, sk, wl, wr], axis=1).astype(np.int32)


@pytest.mark.parametrize("causal,has_window", MASKS, ids=["none", "causal", "window", "causal-window"])
@pytest.mark.parametrize("tile_m,tile_n", TILES, ids=lambda v: str(v))
def test_tile_ranges(torch, probes, tile_m, tile_n, causal, has_window):
    """TileRange / QueryTileRange / first_key_tile / last_key_tile are exact, and the tiles they call
    mask-free ([n_left_mask, n_right_mask) key tiles, [m_right_mask, m_left_mask) query tiles) are fully
    visible to every (row, key) pair of the two tiles."""
    cases = _cases(np.random.default_rng(tile_m + tile_n + 2 * causal + has_window), 600, tile_m, tile_n)
    fn = probes.compile_tiles(ARCH, tile_m, tile_n, causal, has_window)
    out = torch.empty(len(cases), len(probes.TILE_FIELDS), device="cuda", dtype=torch.int32)
    fn(torch.from_numpy(cases).cuda(), out)
    torch.cuda.synchronize()
    out = out.cpu().numpy()
    f = {name: out[:, j] for j, name in enumerate(probes.TILE_FIELDS)}
    for c, (m_start, n_start, sq, sk, wl, wr) in enumerate(cases.tolist()):
        left, right = _bounds(sq, sk, causal, has_window, wl, wr)
        rows = np.arange(m_start, min(m_start + tile_m, sq))
        vis = _visible(rows, np.arange(sk), sq, sk, left, right)
        tiles = np.unique(np.nonzero(vis)[1] // tile_n)
        got = {k: int(v[c]) for k, v in f.items()}
        where = f"case {c} {cases[c].tolist()}: {got}"
        if len(tiles):
            assert (got["n_min"], got["n_max"]) == (tiles[0], tiles[-1] + 1), where
            assert (got["first_key_tile"], got["last_key_tile"]) == (tiles[0], tiles[-1]), where
            assert got["n_min"] <= got["n_left_mask"] <= got["n_right_mask"] <= got["n_max"], where
            for n in range(got["n_left_mask"], got["n_right_mask"]):
                keys = np.arange(n * tile_n, min((n + 1) * tile_n, sk))
                assert _visible(rows, keys, sq, sk, left, right).all(), f"tile {n} needs a mask; {where}"
        else:
            assert got["n_max"] <= got["n_min"], where
        keys = np.arange(n_start, min(n_start + tile_n, sk))
        qvis = _visible(np.arange(sq), keys, sq, sk, left, right)
        qtiles = np.unique(np.nonzero(qvis)[0] // tile_m)
        if len(qtiles):
            assert (got["m_min"], got["m_max"]) == (qtiles[0], qtiles[-1] + 1), where
            assert len(qtiles) == qtiles[-1] - qtiles[0] + 1, where  # contiguous, as the kernels assume
            assert got["m_min"] <= got["m_right_mask"] <= got["m_left_mask"] <= got["m_max"], where
            for m in range(got["m_right_mask"], got["m_left_mask"]):  # the backward skips the mask there
                qrows = np.arange(m * tile_m, min((m + 1) * tile_m, sq))
                assert _visible(qrows, keys, sq, sk, left, right).all(), f"query tile {m} needs a mask; {where}"
        else:
            assert got["m_max"] <= got["m_min"], where


@pytest.mark.parametrize("causal,has_window", MASKS, ids=["none", "causal", "window", "causal-window"])
@pytest.mark.parametrize("tile_m,tile_n", [(128, 128), (64, 128)], ids=lambda v: str(v))
def test_masks(torch, probes, tile_m, tile_n, causal, has_window):
    """apply_mask (query-major, the forward's) and apply_mask_kv_major (the backward's S^T) keep exactly
    the visible (row, key) pairs of real rows (rows >= Sq are padding the kernels drop)."""
    rng = np.random.default_rng(7 + tile_m + 2 * causal + has_window)
    cases = _cases(rng, 800, tile_m, tile_n)
    cases[:, 0] = rng.integers(0, cases[:, 2])  # a real row
    cases[:, 1] = cases[:, 1] + rng.integers(0, tile_n, len(cases))  # any key of its tile, padding too
    fn = probes.compile_mask(ARCH, tile_m, tile_n, causal, has_window)
    q_major = torch.empty(len(cases), tile_n, device="cuda", dtype=torch.float32)
    kv_major = torch.empty(len(cases), tile_m, device="cuda", dtype=torch.float32)
    fn(torch.from_numpy(cases).cuda(), q_major, kv_major)
    torch.cuda.synchronize()
    q_major, kv_major = q_major.cpu().numpy(), kv_major.cpu().numpy()
    assert set(np.unique(q_major)) <= {0.0, -np.inf} and set(np.unique(kv_major)) <= {0.0, -np.inf}
    for c, (row, key, sq, sk, wl, wr) in enumerate(cases.tolist()):
        left, right = _bounds(sq, sk, causal, has_window, wl, wr)
        keys = (key // tile_n) * tile_n + np.arange(tile_n)
        ref = _visible([row], keys, sq, sk, left, right)[0]
        np.testing.assert_array_equal(q_major[c] == 0.0, ref, err_msg=f"query-major case {c} {cases[c].tolist()}")
        rows = (row // tile_m) * tile_m + np.arange(tile_m)
        real = rows < sq
        ref_t = _visible(rows[real], [key], sq, sk, left, right)[:, 0]
        np.testing.assert_array_equal(kv_major[c][real] == 0.0, ref_t, err_msg=f"kv-major case {c} {cases[c].tolist()}")

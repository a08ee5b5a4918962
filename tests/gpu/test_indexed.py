"""Windowed indexed attention on the H200 through the compiled launchers (torch tensors).

Plan (built on the GPU) vs a numpy expansion of the index rows; forward and backward vs an fp32
dense-mask reference (rel. L2 <= 1e-2); determinism, row-order invariance, padding never read,
empty rows. ``-k memcheck`` selects the small cases run under compute-sanitizer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import torch_cuda_arch  # noqa: E402
from tests.oracles import index_sources as src  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch_cuda_arch() is None or torch_cuda_arch() < 90,
                       reason="needs a CUDA GPU with compute capability >= 9.0"),
]

REL_TOL = 1e-2


# ---------------------------------------------------------------------------------------------
# driving the launchers
# ---------------------------------------------------------------------------------------------
def build_plan(idx: "torch.Tensor", kv_len: int, wq: int) -> dict:
    from cute_kernels.indexed.launch import plan_shapes, run_plan

    idx3 = idx.reshape(-1, idx.shape[-2], idx.shape[-1]).contiguous()
    shapes = plan_shapes(idx3.shape[0], idx3.shape[1], idx3.shape[2], kv_len, wq)
    dev = idx.device
    plan = {name: torch.empty(shape, dtype=torch.int32, device=dev) for name, shape in shapes._asdict().items()}
    plan["tile_bits"].zero_()
    run_plan(idx3, kv_len, plan["win_key"], plan["win_mask"], plan["win_count"], plan["tile_bits"],
             plan["tile_ptr"], plan["tile_win"], plan["tile_start"], window_queries=wq)
    return plan


def run_indexed(q, k, v, idx, dout, scale=None, stages=None, meta_ahead=None, skip_empty=None,
                dkdv_impl="auto"):
    from cute_kernels.indexed.launch import attn_config, run_bwd, run_fwd

    per_kv_head = idx.dim() == 4
    cfg = attn_config(q, k, per_kv_head, stages=stages, meta_ahead=meta_ahead, skip_empty=skip_empty,
                      dkdv_impl=dkdv_impl)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = build_plan(idx, k.shape[1], cfg.window_queries)
    B, Lq, Hq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    run_fwd(cfg, q, k, v, plan["win_key"], plan["win_mask"], plan["win_count"], out, lse, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    run_bwd(cfg, q, k, v, out, dout, lse, plan["win_key"], plan["win_mask"], plan["win_count"],
            plan["tile_ptr"], plan["tile_win"], plan["tile_start"], dq, dk, dv, delta, scale)
    torch.cuda.synchronize()
    return out, lse, dq, dk, dv


def reference(q, k, v, idx, dout, scale=None):
    """fp32 dense-mask attention over the distinct valid indices of every row (autograd grads)."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    idx4 = idx[:, None] if idx.dim() == 3 else idx  # [B, Hs, Lq, W]
    valid = (idx4 >= 0) & (idx4 < Lkv)
    mask = torch.zeros(idx4.shape[:3] + (Lkv + 1,), dtype=torch.bool, device=q.device)
    mask.scatter_(3, torch.where(valid, idx4, Lkv).long(), True)
    mask = mask[..., :Lkv]
    mask = mask.expand(B, Hkv, Lq, Lkv) if mask.shape[1] == 1 else mask
    mask = mask.repeat_interleave(G, dim=1)  # [B, Hq, Lq, Lkv]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    kx, vx = kf.repeat_interleave(G, dim=2), vf.repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kx) * scale
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(mask, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vx)
    out.backward(dout.float())
    return out.detach(), lse.detach(), qf.grad, kf.grad, vf.grad


def rel_l2(a, e):
    a, e = a.double(), e.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    return mk(B, Lq, Hq, D), mk(B, Lkv, Hkv, D), mk(B, Lkv, Hkv, D), mk(B, Lq, Hq, D)


# ---------------------------------------------------------------------------------------------
# cases: (id, B, Lq, Lkv, Hq, Hkv, D, index builder(rows, kv_len, wq, seed) -> [Lq, W])
# ---------------------------------------------------------------------------------------------
def _prime(rho):
    return lambda lq, lkv, wq, seed: src.prime_rl_indices(lq, lkv, rho, budget_blocks=24, seed=seed)


def _uniform_padded(lq, lkv, wq, seed):
    idx = src.uniform_indices(lq, lkv, 96, seed=seed)
    return src.with_duplicates(src.with_padding(idx, lkv, 0.3, seed=seed), lkv, 0.1, seed=seed)


CASES = [
    ("prod-rho0.9", 1, 400, 400, 24, 2, 256, _prime(0.9)),
    ("prod-rho0.5-cp", 1, 203, 900, 24, 2, 256, _prime(0.5)),
    ("prod-uniform-pad-dup-b2", 2, 161, 300, 24, 2, 256, _uniform_padded),
    ("prod-identical", 1, 130, 700, 24, 2, 256,
     lambda lq, lkv, wq, seed: src.identical_windows(lq, lkv, 200, wq, seed=seed)),
    ("prod-disjoint", 1, 123, 1200, 24, 2, 256,
     lambda lq, lkv, wq, seed: src.disjoint_windows(lq, lkv, 200, wq, seed=seed)),
    ("prod-doc-starts", 1, 97, 300, 24, 2, 256,
     lambda lq, lkv, wq, seed: src.document_starts(lq, lkv, 8, seed=seed)),
    ("memcheck-g1-d64", 1, 77, 150, 2, 2, 64, _uniform_padded),
    ("g4-d128-lq3", 1, 3, 100, 8, 2, 128, _uniform_padded),
]
PER_HEAD_CASES = [
    ("perhead-g4-d128", 2, 150, 333, 8, 2, 128),
    ("memcheck-perhead-g4-d128", 1, 40, 70, 8, 2, 128),
]


def _idx_tensor(builder, B, Lq, Lkv, wq, heads=None):
    rows = [builder(Lq, Lkv, wq, seed) for seed in range(B * (heads or 1))]
    arr = np.stack(rows).reshape((B, heads, Lq, -1) if heads else (B, Lq, -1))
    return torch.from_numpy(arr.astype(np.int32)).cuda()


def _check(q, k, v, idx, dout):
    got = run_indexed(q, k, v, idx, dout)
    ref = reference(q, k, v, idx, dout)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, e in zip(names, got, ref):
        assert torch.isfinite(a).all() or name == "lse", f"{name} has non-finite values"
        if name == "lse":
            assert torch.equal(torch.isinf(a), torch.isinf(e)), "lse -inf pattern differs"
            a, e = torch.where(torch.isinf(e), 0.0, a), torch.where(torch.isinf(e), 0.0, e)
        err = rel_l2(a.float(), e)
        assert err <= REL_TOL, f"{name}: rel L2 {err:.2e} > {REL_TOL}"
    return got


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_indexed_matches_reference(case):
    from cute_kernels.indexed.config import window_queries

    _, B, Lq, Lkv, Hq, Hkv, D, builder = case
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D)
    idx = _idx_tensor(builder, B, Lq, Lkv, window_queries(Hq // Hkv))
    _check(q, k, v, idx, dout)


@pytest.mark.parametrize("case", PER_HEAD_CASES, ids=[c[0] for c in PER_HEAD_CASES])
def test_indexed_per_kv_head_matches_reference(case):
    _, B, Lq, Lkv, Hq, Hkv, D = case
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=1)
    idx = _idx_tensor(_uniform_padded, B, Lq, Lkv, 0, heads=Hkv)
    _check(q, k, v, idx, dout)


def test_plan_round_trip():
    """Expanding the GPU plan's windows gives back every row's set; the transpose lists exactly the
    windows touching each tile, ascending, with the right start offsets."""
    from cute_kernels.indexed.config import KEY_TILE

    lq, lkv, wq = 211, 500, 5
    idx_np = np.stack([_uniform_padded(lq, lkv, wq, s) for s in range(2)])
    plan = {k: v.cpu().numpy() for k, v in build_plan(torch.from_numpy(idx_np).cuda(), lkv, wq).items()}
    sets = src.row_sets(idx_np, lkv)
    nw = -(-lq // wq)
    nt = -(-lkv // KEY_TILE)
    for s in range(2):
        touching = [[] for _ in range(nt)]
        for w in range(nw):
            n = plan["win_count"][s, w]
            keys, masks = plan["win_key"][s, w, :n], plan["win_mask"][s, w, :n]
            assert np.all(np.diff(keys) > 0), "window keys not strictly ascending"
            for i in range(wq):
                q = w * wq + i
                got = frozenset(int(k) for k, m in zip(keys, masks) if (m >> i) & 1)
                want = sets[s * lq + q] if q < lq else frozenset()
                assert got == want, f"set {s} query {q}"
            for t in sorted({int(k) // KEY_TILE for k in keys}):
                touching[t].append((w, int(np.searchsorted(keys, t * KEY_TILE))))
        for t in range(nt):
            p0, p1 = plan["tile_ptr"][s * nt + t], plan["tile_ptr"][s * nt + t + 1]
            got = list(zip(plan["tile_win"][p0:p1].tolist(), plan["tile_start"][p0:p1].tolist()))
            assert got == touching[t], f"set {s} tile {t}"


def test_deterministic_and_row_order_invariant():
    """Two runs are bitwise equal, and so is a run with every index row shuffled."""
    B, Lq, Lkv, Hq, Hkv, D = 1, 230, 600, 24, 2, 256
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=3)
    idx_np = _uniform_padded(Lq, Lkv, 5, 7)[None]
    idx = torch.from_numpy(idx_np).cuda()
    shuffled = torch.from_numpy(src.shuffle_rows(idx_np, seed=9)).cuda()
    a = run_indexed(q, k, v, idx, dout)
    b = run_indexed(q, k, v, idx, dout)
    c = run_indexed(q, k, v, shuffled, dout)
    for name, x, y, z in zip(("out", "lse", "dq", "dk", "dv"), a, b, c):
        assert torch.equal(x, y), f"{name} differs between two runs"
        assert torch.equal(x, z), f"{name} depends on the order of the index rows"


@pytest.mark.parametrize("D,Hq", [(256, 24), (64, 2)], ids=["memcheck-d256", "memcheck-d64"])
def test_padding_never_read_and_untouched_keys_zero(D, Hq):
    """K/V rows no query selects are NaN-poisoned: outputs stay finite and their dK/dV are 0."""
    B, Lq, Lkv, Hkv = 1, 60, 256, 2
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=5)
    idx_np = src.with_padding(src.uniform_indices(Lq, Lkv, 20, seed=2), Lkv, 0.3, seed=4)[None]
    used = np.zeros(Lkv, bool)
    for key in idx_np.reshape(-1):
        if 0 <= key < Lkv:
            used[key] = True
    unused = torch.from_numpy(~used).cuda()
    k[:, unused] = float("nan")
    v[:, unused] = float("nan")
    out, lse, dq, dk, dv = run_indexed(q, k, v, torch.from_numpy(idx_np).cuda(), dout)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name} read a padding / unselected row"
    assert (dk[:, unused] == 0).all() and (dv[:, unused] == 0).all()


def test_empty_rows_are_finite():
    """Rows with only padding: out 0, lse -inf, zero dq, finite everything."""
    B, Lq, Lkv, Hq, Hkv, D = 1, 50, 128, 24, 2, 256
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=6)
    idx_np = src.uniform_indices(Lq, Lkv, 16, seed=3)
    idx_np[::3] = -1
    idx_np[1::7] = Lkv
    empty = torch.from_numpy(np.all((idx_np < 0) | (idx_np >= Lkv), axis=1)).cuda()
    out, lse, dq, dk, dv = _check(q, k, v, torch.from_numpy(idx_np[None]).cuda(), dout)
    assert (out[0, empty] == 0).all() and (dq[0, empty] == 0).all()
    assert torch.isneginf(lse[0][:, empty]).all()


@pytest.mark.parametrize("group,D", [(12, 256), (1, 64)], ids=["g12-d256", "g1-d64"])
def test_prefetch_stages_match_reference_and_each_other(group, D):
    """dQ / dK-dV with and without one-ahead prefetch: both match the reference, bitwise equal."""
    Hkv = 2
    B, Lq, Lkv, Hq = 1, 190, 500, group * Hkv
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=8)
    idx = torch.from_numpy(src.prime_rl_indices(Lq, Lkv, 0.9, budget_blocks=24, seed=3)[None]).cuda()
    ref = reference(q, k, v, idx, dout)
    a = run_indexed(q, k, v, idx, dout, stages=2, dkdv_impl="mma")
    b = run_indexed(q, k, v, idx, dout, stages=1, dkdv_impl="mma")
    for name, x, y, e in zip(("out", "lse", "dq", "dk", "dv"), a, b, ref):
        assert torch.equal(x, y), f"{name}: 2-stage result differs from 1-stage"
        if name != "lse":
            assert rel_l2(y.float(), e) <= REL_TOL, f"{name} (1 stage) vs reference"


@pytest.mark.parametrize("group,D,per_head", [(12, 256, False), (1, 64, False), (4, 128, True)],
                         ids=["g12-d256", "g1-d64", "perhead-g4-d128"])
@pytest.mark.parametrize("meta,skip", [(False, False), (True, False), (False, True)],
                         ids=["plain", "meta", "skip"])
def test_optional_variants_match_reference_and_default(group, D, per_head, meta, skip):
    """The default kernels read the plan one chunk / pair ahead (meta_ahead) and the portable dK/dV
    kernel skips unselected key halves (skip_empty); without either or both: the same bits, and the reference,
    including padding, an Lq that is not a multiple of the window and few-key tiles."""
    Hkv = 2
    B, Lq, Lkv, Hq = 1, 173, 450, group * Hkv
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=11)
    if per_head:
        idx = _idx_tensor(_uniform_padded, B, Lq, Lkv, 0, heads=Hkv)
    else:
        idx = torch.from_numpy(src.prime_rl_indices(Lq, Lkv, 0.9, budget_blocks=24, seed=5)[None]).cuda()
    ref = reference(q, k, v, idx, dout)
    a = run_indexed(q, k, v, idx, dout, meta_ahead=meta, skip_empty=skip, dkdv_impl="mma")
    b = run_indexed(q, k, v, idx, dout, dkdv_impl="mma")
    for name, x, y, e in zip(("out", "lse", "dq", "dk", "dv"), a, b, ref):
        assert torch.equal(x, y), f"{name}: meta={meta} skip={skip} differs from the default kernels"
        if name != "lse":
            assert rel_l2(x.float(), e) <= REL_TOL, f"{name} (meta={meta} skip={skip}) vs reference"


@pytest.mark.parametrize("group,D,per_head,Lkv", [(12, 256, False, 450), (1, 64, False, 450),
                                                  (4, 128, True, 450), (16, 256, False, 97),
                                                  (12, 256, False, 33), (12, 256, False, 200),
                                                  (2, 128, False, 300), (8, 256, True, 200)],
                         ids=["g12-d256", "g1-d64", "perhead-g4-d128", "g16-d256-partial-tile",
                              "g12-d256-one-key-past-a-tile", "g12-d256-odd-tiles", "g2-d128",
                              "perhead-g8-d256"])
def test_dkdv_wgmma_matches_mma_kernel_and_reference(group, D, per_head, Lkv):
    """SM90's warp-specialised wgmma dK/dV kernel (64 keys per CTA, merged window lists) against the
    portable mma.sync kernel and the reference: other summation order inside a pair, so close rather
    than bitwise; run-to-run bitwise; keys past Lkv and an odd tile count (a CTA with one tile)."""
    if torch_cuda_arch() != 90:
        pytest.skip("the wgmma dK/dV kernel is SM90 only")
    Hkv = 2
    B, Lq, Hq = 1, 173, group * Hkv
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=13)
    if per_head:
        idx = _idx_tensor(_uniform_padded, B, Lq, Lkv, 0, heads=Hkv)
    elif Lkv < Lq:
        idx = _idx_tensor(lambda lq, lkv, wq, seed: src.uniform_indices(lq, lkv, 24, causal=False, seed=seed),
                          B, Lq, Lkv, 0)
    else:
        idx = torch.from_numpy(src.prime_rl_indices(Lq, Lkv, 0.9, budget_blocks=24, seed=7)[None]).cuda()
    ref = reference(q, k, v, idx, dout)
    a = run_indexed(q, k, v, idx, dout, dkdv_impl="wgmma")
    a2 = run_indexed(q, k, v, idx, dout, dkdv_impl="wgmma")
    b = run_indexed(q, k, v, idx, dout, dkdv_impl="mma")
    for name, x, x2, y, e in zip(("out", "lse", "dq", "dk", "dv"), a, a2, b, ref):
        assert torch.equal(x, x2), f"{name}: wgmma dK/dV run-to-run differs"
        if name in ("dk", "dv"):
            assert rel_l2(x.float(), y.float()) <= 5e-3, f"{name}: wgmma vs mma kernel"
            assert rel_l2(x.float(), e) <= REL_TOL, f"{name} (wgmma) vs reference"
            untouched = (e.abs().amax(dim=-1) == 0)
            assert (x[untouched] == 0).all(), f"{name}: keys no query selects must be exact zeros"
        else:
            assert torch.equal(x, y), f"{name}: forward / dQ must not depend on the dK/dV kernel"


@pytest.mark.parametrize("D,Hq", [(256, 24), (128, 8), (64, 2)], ids=["d256-g12", "d128-g4", "d64-g1"])
@pytest.mark.parametrize("poisoned", ["k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_selected_keys_a_row_did_not_select_never_reach_it(D, Hq, poisoned, value):
    """A few *selected* key rows poisoned (issue 43, section 4): each sits in the window's key union, so the
    chunks that hold it multiply P = 0 / dS = 0 of the window's other rows by it unless the kernels scrub
    (Note [scrubbed value chunks] in fwd.py, Note [scrubbed key chunks] in bwd_dq.py). A row that selected none
    of them gets the out, lse and dq of a run with finite rows there (bitwise: deterministic kernels), a key
    selected only by such rows the same dk / dv; a row that selected one gets a non-finite out (a value) or dq
    (either)."""
    B, Lq, Lkv, Hkv = 1, 96, 384, 2
    q, k, v, dout = make_qkv(B, Lq, Lkv, Hq, Hkv, D, seed=11)
    idx_np = src.uniform_indices(Lq, Lkv, 24, seed=12)
    sel = np.zeros((Lq, Lkv), bool)
    for r in range(Lq):
        sel[r, idx_np[r][(idx_np[r] >= 0) & (idx_np[r] < Lkv)]] = True
    # keys selected by exactly one or two rows: the window's other rows did not select them
    counts = sel.sum(axis=0)
    keys = [int(k_) for k_ in np.nonzero((counts >= 1) & (counts <= 2))[0][:4]]
    assert len(keys) == 4, "the case needs keys only one or two rows selected"
    seeing = sel[:, keys].any(axis=1)
    clean_rows = torch.from_numpy(np.nonzero(~seeing)[0]).cuda()
    clean_keys = torch.from_numpy(np.nonzero(sel.any(axis=0) & ~sel[seeing].any(axis=0))[0]).cuda()
    assert len(clean_rows) > Lq // 2 and len(clean_keys) > 100
    idx = torch.from_numpy(idx_np[None]).cuda()
    clean = run_indexed(q, k, v, idx, dout)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if poisoned == "k" else bad_v)[:, keys] = value
    dirty = run_indexed(q, bad_k, bad_v, idx, dout)
    for name, a, b, sl in zip(("out", "lse", "dq", "dk", "dv"), dirty, clean,
                              ("rows", "lse", "rows", "keys", "keys")):
        if sl == "lse":
            a, b = a[:, :, clean_rows], b[:, :, clean_rows]
        else:
            pick = clean_rows if sl == "rows" else clean_keys
            a, b = a[:, pick], b[:, pick]
        assert torch.isfinite(a).all(), f"{name}: entries no poison-selecting row reaches are not finite"
        assert torch.equal(a, b), f"{name}: entries no poison-selecting row reaches changed"
    seen = torch.from_numpy(np.nonzero(seeing)[0]).cuda()
    if poisoned == "v":
        assert not torch.isfinite(dirty[0][:, seen]).all(dim=-1).any(), "out: a row that selected a poisoned value is finite"
    assert not torch.isfinite(dirty[2][:, seen]).all(dim=-1).any(), "dq: a row that selected a poisoned key is finite"

"""NaN / Inf in keys and values a row cannot see (issue 43, section 4) on the SM90 dense kernels, forward
(run_fwd) and deterministic backward (run_bwd), through torch tensors.

The rule (docs/api.md, "NaN and Inf in keys a row cannot see"): a poisoned key or value row a query row does
not see never reaches that row's out / lse / dq, nor the dk / dv of keys no row sees. Each case compares a run
with poisoned k / v rows against the same run with finite rows there: the rows that cannot see them must be
bitwise equal (deterministic kernels) and finite.

Two geometries per mask, with tiles of at most 128 x 128:
- ``far``: the poisoned keys sit in key tiles that no query tile of the checked rows visits; the kernels never
  load them. Expected to hold.
- ``near``: the poisoned keys sit in a key tile the checked rows' query tile visits, masked for those rows.
  The kernels set masked scores to -inf (a NaN / Inf key is harmless in S) but then multiply P = 0 by the
  value rows (forward O += P V, backward dP = dO V^T and dS = P (dP - D)) and dS = 0 by the key rows
  (dQ += dS K): IEEE 0 * NaN = NaN, 0 * Inf = NaN. Without the kernels' scrub (common/nonfinite.py: the
  forward's masked V tiles, the backward's K / V tiles) poisoned values reach every row of the tile and
  poisoned keys reach dq; these cases failed on the H100 before it (12 strict xfails until 2026-12-07).
  The rows that do see a poisoned key must still come out non-finite (the scrub re-injects the NaN).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.gpu._fwd_launch import make_qkv, run_ours  # noqa: E402
from tests.gpu.test_bwd_sm90 import run_bwd_ours  # noqa: E402

pytestmark = sm90_gpu_marks()

# (sq, sk, causal, window, poisoned keys, checked rows, keys no row sees)
GEOMETRY = {
    # causal 512 x 512: key 440 seen by rows >= 440. Rows < 256 never visit its key tile (far); rows 256..439
    # include the diagonal query tile that does visit it, masked (near).
    ("causal", "far"): (512, 512, True, (-1, -1), [440, 441], range(0, 256), None),
    ("causal", "near"): (512, 512, True, (-1, -1), [440, 441], range(256, 440), None),
    # Sq 128, Sk 640, causal, window (128, 0): row i sees keys 384 + i .. 512 + i; keys < 384 no row sees.
    # Keys 10 / 11 are in a key tile no query tile visits (far: out, lse, dq, and dk / dv of keys 0..383);
    # keys 392 / 393 are seen by rows 0..8 / 0..9 and masked for rows 10..127 in the visited tile [384, ...) (near).
    # (Rows from 9 were checked until 2026-12-07: row 9 sees key 393, so its NaN out was right, not a leak.)
    ("window", "far"): (128, 640, True, (128, 0), [10, 11], range(0, 128), range(0, 384)),
    ("window", "near"): (128, 640, True, (128, 0), [392, 393], range(10, 128), None),
}

# Keys that only rows without a poisoned key see: their dk / dv must not change. Window near: rows 0..9 see a
# poisoned key (and so get a NaN out and D = rowsum(dO * O), or a NaN lse); keys 522.. are seen by rows 10.. only
# (row i sees keys up to 512 + i), but sit in a key tile rows 0..9 visit, masked for them: P there must be 0 and
# dS = P (dP - D) = 0, not 0 * NaN. (Run once with 521: row 9 sees key 521, so its dk changed rightly, H100.)
CLEAN_KEYS = {("window", "near"): range(522, 640)}

# Rows that do see a poisoned key: (sq, sk, causal, window) geometry -> rows seeing keys [440, 441] / [392, 393].
SEEING = {"causal": range(441, 512), "window": range(0, 9)}


def _case(mask, where, poisoned, direction):
    return pytest.param(mask, where, poisoned, direction, id=f"{mask}-{where}-{poisoned}-{direction}")


CASES = [_case(m, w, p, d) for m in ("causal", "window") for w in ("far", "near") for p in ("k", "v")
         for d in ("fwd", "bwd")]


def _run(q, k, v, do, causal, window, direction, arch):
    out, lse, _ = run_ours(q, k, v, causal=causal, window=window, arch=arch)
    if direction == "fwd":
        return {"out": out, "lse": lse}
    dq, dk, dv = run_bwd_ours(q, k, v, out, lse, do, causal=causal, window=window, deterministic=True, arch=arch)
    return {"dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("mask,where,poisoned,direction", CASES)
def test_invisible_keys_never_reach_a_row(mask, where, poisoned, direction, value):
    check_invisible(mask, where, poisoned, direction, value, 90)


def check_invisible(mask, where, poisoned, direction, value, arch):
    """The case on the kernels of compute capability ``arch`` (tests/sm100/test_invisible_nan_sm100.py: 100 / 103)."""
    sq, sk, causal, window, keys, rows, unseen = GEOMETRY[(mask, where)]
    q, k, v = make_qkv(1, sq, sk, 4, 2, 128, seed=7)
    g = torch.Generator(device="cuda").manual_seed(8)
    do = torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    clean = _run(q, k, v, do, causal, window, direction, arch)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if poisoned == "k" else bad_v)[:, keys] = value
    dirty = _run(q, bad_k, bad_v, do, causal, window, direction, arch)
    rows = list(rows)
    for name, want in clean.items():
        got = dirty[name]
        if name in ("out", "dq"):  # [B, S, H, D]
            a, b = got[:, rows], want[:, rows]
        elif name == "lse":  # [B, H, S]
            a, b = got[:, :, rows], want[:, :, rows]
        else:  # dk / dv: only the keys no row sees are free of the rows that see the poison
            if unseen is None:
                continue
            a, b = got[:, list(unseen)], want[:, list(unseen)]
            assert torch.count_nonzero(a) == 0, f"{name}: keys no row sees got a gradient"
        assert torch.isfinite(a).all(), f"{name}: rows that cannot see the poisoned keys are not finite"
        assert torch.equal(a, b), f"{name}: rows that cannot see the poisoned keys changed"
    keys_clean = CLEAN_KEYS.get((mask, where))
    if keys_clean is not None and direction == "bwd":
        for name in ("dk", "dv"):
            a, b = dirty[name][:, list(keys_clean)], clean[name][:, list(keys_clean)]
            assert torch.isfinite(a).all() and torch.equal(a, b), f"{name}: keys only clean rows see changed"
    if where == "near" and not (poisoned == "k" and direction == "fwd" and value == math.inf):
        # The rows that see a poisoned key still show it (the scrub must not hide a visible NaN / Inf):
        # out (a poisoned value), dq (either). A +Inf key gives +Inf scores, which the kernels' softmax turns
        # into NaN as IEEE does; we only ask for non-finite.
        seeing = list(SEEING[mask])
        name = "out" if direction == "fwd" else "dq"
        got = dirty[name][:, seeing]
        assert not torch.isfinite(got).all(dim=-1).any(), f"{name}: a row that sees a poisoned key is finite"


# An Inf value in a key tile nobody masks (issue 43, section 4; docs/attention_bwd.md): Sq = Sk = 1024, causal,
# window (300, 0): row i sees keys i - 300 .. i. One element of value row 600 (head dim 5) is +Inf. Rows whose query
# tile meets key 600's key tile unmasked (about rows 640..767 for 64- or 128-wide tiles) get out[..., 5] = +-Inf,
# not NaN (no scrub there), so D = rowsum(dO * O) = +-Inf; their query tiles visit keys below 340 masked (the
# window's left edge). Keys below 300 are seen only by rows below 600, none of which sees key 600: their dk / dv
# (and those rows' dq) must equal a run with a finite value there. A guard that zeroes dS^T = P (dP - D) at P = 0
# only when D is NaN gives 0 * Inf = NaN in those keys' dk.
INF_D = dict(sq=1024, causal=True, window=(300, 0), key=600, dim=5, clean_keys=range(0, 300), clean_rows=range(0, 600))


def test_inf_out_rows_keep_masked_gradients_clean():
    check_inf_d(90)


def check_inf_d(arch):
    """The Inf-D case on the kernels of compute capability ``arch`` (tests/sm100 reuses it)."""
    c = INF_D
    q, k, v = make_qkv(1, c["sq"], c["sq"], 4, 2, 128, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    do = torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    bad_v = v.clone()
    bad_v[:, c["key"], :, c["dim"]] = math.inf
    runs = {}
    for name, vv in (("clean", v), ("dirty", bad_v)):
        out, lse, _ = run_ours(q, k, vv, causal=c["causal"], window=c["window"], arch=arch)
        dq, dk, dv = run_bwd_ours(q, k, vv, out, lse, do, causal=c["causal"], window=c["window"],
                                  deterministic=True, arch=arch)
        runs[name] = dict(out=out, dq=dq, dk=dk, dv=dv)
    out = runs["dirty"]["out"][..., c["dim"]].float()
    # The case must exercise what it is about: some rows carry an infinite (not NaN) out, hence D = +-Inf.
    assert torch.isinf(out).any(), "no row got an infinite out: the case does not test an Inf D"
    keys, rows = list(c["clean_keys"]), list(c["clean_rows"])
    for name, sel in (("dk", keys), ("dv", keys), ("dq", rows)):
        a, b = runs["dirty"][name][:, sel], runs["clean"][name][:, sel]
        assert torch.isfinite(a).all(), f"{name}: gradients that no Inf-seeing row reaches are not finite"
        assert torch.equal(a, b), f"{name}: gradients that no Inf-seeing row reaches changed"

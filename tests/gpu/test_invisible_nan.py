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
  (dQ += dS K): IEEE 0 * NaN = NaN, 0 * Inf = NaN. So poisoned values reach every row of the tile, poisoned
  keys reach dq. These cases are marked xfail(strict=True) from reading the kernels (not yet observed):
  a strict xfail fails the run if the kernels turn out to keep those rows clean, so the marks get revisited.
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

# (mask, where, poisoned tensor, direction) predicted to fail: see the module docstring
PREDICTED = {
    ("near", "v", "fwd"): "O += P V multiplies P = 0 by the poisoned value row (0 * NaN) for every row of the tile",
    ("near", "v", "bwd"): "dP = dO V^T carries the poisoned value row to every row of the tile, dS = 0 * NaN",
    ("near", "k", "bwd"): "dQ += dS K multiplies dS = 0 by the poisoned key row (0 * NaN)",
}
# (mask, where, poisoned, direction) seen failing on the GPU though the reading above predicted it clean. Empty: the
# one entry it held (window / near / k / fwd, H100, 2026-12-07) came from this file's geometry, which checked row 9
# although row 9 sees poisoned key 393 (fixed above, not yet re-run on a GPU).
OBSERVED: dict = {}


def _case(mask, where, poisoned, direction):
    reason = PREDICTED.get((where, poisoned, direction)) or OBSERVED.get((mask, where, poisoned, direction))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(mask, where, poisoned, direction, marks=marks, id=f"{mask}-{where}-{poisoned}-{direction}")


CASES = [_case(m, w, p, d) for m in ("causal", "window") for w in ("far", "near") for p in ("k", "v")
         for d in ("fwd", "bwd")]


def _run(q, k, v, do, causal, window, direction):
    out, lse, _ = run_ours(q, k, v, causal=causal, window=window)
    if direction == "fwd":
        return {"out": out, "lse": lse}
    dq, dk, dv = run_bwd_ours(q, k, v, out, lse, do, causal=causal, window=window, deterministic=True)
    return {"dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("mask,where,poisoned,direction", CASES)
def test_invisible_keys_never_reach_a_row(mask, where, poisoned, direction, value):
    sq, sk, causal, window, keys, rows, unseen = GEOMETRY[(mask, where)]
    q, k, v = make_qkv(1, sq, sk, 4, 2, 128, seed=7)
    g = torch.Generator(device="cuda").manual_seed(8)
    do = torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    clean = _run(q, k, v, do, causal, window, direction)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if poisoned == "k" else bad_v)[:, keys] = value
    dirty = _run(q, bad_k, bad_v, do, causal, window, direction)
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

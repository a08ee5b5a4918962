"""The softcap tanh policy of common/softmax.py (``softcap_logit``, every arch, forward and backward):
tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1) through ex2.approx and rcp.approx has an absolute error below
5e-7 for every x. numpy replica of the device sequence in fp32, with ex2 and rcp perturbed by their
PTX ISA error bounds (2 ulp = 2^-22 relative and 1 ulp = 2^-23; not measured on a GPU here)."""

from __future__ import annotations

import numpy as np

from cute_kernels.common import softmax

BOUND = 5e-7
TANH_APPROX_ERROR = 2.0**-11  # tanh.approx.f32, the rejected alternative (for the comparison below)


def _replica(x: np.ndarray, ex2_rel: float, rcp_rel: float) -> np.ndarray:
    f32 = np.float32
    with np.errstate(over="ignore", invalid="ignore"):  # ex2 overflows to inf, as on the GPU
        y = (x * f32(softmax._TWO_LOG2_E)).astype(f32)  # s * (softcap_in * 2 log2 e), softcap_in = 1
        e = (np.exp2(y.astype(np.float64)) * (1.0 + ex2_rel)).astype(f32)
        r = ((1.0 / (e + f32(1.0)).astype(np.float64)) * (1.0 + rcp_rel)).astype(f32)
    return (f32(1.0) - (f32(2.0) * r).astype(f32)).astype(f32)


def test_softcap_tanh_absolute_error_bound():
    x = np.concatenate([np.linspace(-60.0, 60.0, 1_200_001), np.geomspace(1e-9, 1e-2, 20001),
                        -np.geomspace(1e-9, 1e-2, 20001), [0.0, 89.0, -89.0, 1e30, -1e30]]).astype(np.float32)
    ref = np.tanh(x.astype(np.float64))
    worst = 0.0
    for ex2_rel in (-(2.0**-22), 0.0, 2.0**-22):
        for rcp_rel in (-(2.0**-23), 0.0, 2.0**-23):
            t = _replica(x, ex2_rel, rcp_rel)
            assert np.all(np.isfinite(t))
            worst = max(worst, float(np.abs(t.astype(np.float64) - ref).max()))
    assert worst < BOUND, worst
    assert worst < TANH_APPROX_ERROR / 1000  # three orders of magnitude inside tanh.approx's error


def test_softcap_tanh_limits():
    """+-inf saturate to +-1 (ex2 overflows to inf, rcp(inf) = 0), NaN stays NaN (no select hides it)."""
    t = _replica(np.array([np.inf, -np.inf, np.nan], np.float32), 0.0, 0.0)
    assert t[0] == 1.0 and t[1] == -1.0 and np.isnan(t[2])

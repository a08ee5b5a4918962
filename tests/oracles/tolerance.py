"""Comparison helpers shared by the CPU and GPU tests.

Exact where the contract is exact (the positions of ``-inf``/``+inf``/NaN), tolerances elsewhere.
"""

from __future__ import annotations

import numpy as np


def to_numpy64(x) -> np.ndarray:
    """A paddle/torch tensor or array as float64 numpy (bf16/fp16 are upcast exactly)."""
    if isinstance(x, (np.ndarray, float, int, list, tuple)):
        return np.asarray(x, dtype=np.float64)
    name = str(x.dtype)
    if name.startswith("torch."):
        x = x.detach().cpu()
        if "float16" in name:  # bfloat16 and float16: numpy lacks bf16
            x = x.float()
        return x.numpy().astype(np.float64)
    if "float16" in name:  # paddle
        x = x.astype("float32")
    return np.asarray(x.numpy(), dtype=np.float64)


def assert_same_nonfinite(name: str, actual, expected) -> None:
    """``-inf``, ``+inf`` and NaN must sit at exactly the same positions."""
    a, e = to_numpy64(actual), to_numpy64(expected)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    for label, fn in (("-inf", np.isneginf), ("+inf", np.isposinf), ("nan", np.isnan)):
        bad = fn(a) != fn(e)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AssertionError(f"{name}: {label} pattern differs at {int(bad.sum())} entries, first at "
                                 f"{idx}: actual {a[idx]!r} vs expected {e[idx]!r}")


def assert_close(name: str, actual, expected, atol: float, rtol: float) -> None:
    """Same non-finite pattern, and ``|a - e| <= atol + rtol * |e|`` on the finite entries."""
    a, e = to_numpy64(actual), to_numpy64(expected)
    assert_same_nonfinite(name, a, e)
    finite = np.isfinite(e)
    err = np.abs(a[finite] - e[finite])
    bound = atol + rtol * np.abs(e[finite])
    if err.size and (err > bound).any():
        worst = int(np.argmax(err - bound))
        idx = tuple(int(i) for i in np.argwhere(finite)[worst])
        raise AssertionError(f"{name}: {int((err > bound).sum())} of {err.size} entries out of tolerance "
                             f"(atol={atol}, rtol={rtol}); worst at {idx}: actual {a[idx]!r} vs expected "
                             f"{e[idx]!r}")


def rel_l2(actual, expected) -> float:
    """``||a - e|| / ||e||`` over the finite entries of ``expected`` (0 when both are zero)."""
    a, e = to_numpy64(actual), to_numpy64(expected)
    finite = np.isfinite(e)
    num = float(np.linalg.norm(a[finite] - e[finite]))
    den = float(np.linalg.norm(e[finite]))
    if den == 0.0:
        return num
    return num / den


def assert_rel_l2(name: str, actual, expected, tol: float) -> None:
    """Same non-finite pattern and relative L2 error at most ``tol``."""
    assert_same_nonfinite(name, actual, expected)
    err = rel_l2(actual, expected)
    assert err <= tol, f"{name}: relative L2 error {err:.3e} > {tol:.1e}"

"""Opt-in debugging checks (off by default: each costs a device-to-host sync).

``PADDLE_FA4_CHECK_NAN=1`` makes the selection ops (``select_topk_blocks``, ``h2o.select_pages``)
raise ``FloatingPointError`` naming the op and the input when a score tensor holds NaN, instead of
applying the NaN rule of docs/api.md ("NaN in selection inputs") silently.
"""

from __future__ import annotations

import os

ENV = "PADDLE_FA4_CHECK_NAN"


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def check_no_nan(op: str, **tensors) -> None:
    """Raise FloatingPointError when ``PADDLE_FA4_CHECK_NAN`` is set and a tensor holds NaN."""
    if not enabled():
        return
    import paddle

    for name, t in tensors.items():
        if t is not None and t.size > 0 and bool(paddle.isnan(t).any()):
            count = int(paddle.isnan(t).astype("int64").sum())
            raise FloatingPointError(f"{op}: {name} holds {count} NaN value(s) ({ENV}=1 is set; unset it to "
                                     f"apply the NaN rule: NaN is never selected over a number)")

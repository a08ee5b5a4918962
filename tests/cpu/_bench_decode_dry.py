"""bench/bench_decode.py's main() without a GPU (``python tests/cpu/_bench_decode_dry.py ARGS...``).

Reuses tests/cpu/_bench_dry.py's stand-ins (MagicMock torch and FA4, a timer with fixed samples); the
decode launchers are a mock with concrete host answers (split count, partial shapes, Sk_max). The sparse
rows' byte counts come from tensor shapes, so the dry run keeps to dense and block_logit rows.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_dry  # noqa: E402


def main(argv: list) -> int:
    torch = _bench_dry._install_fakes()
    import _timing

    _timing.timer_from_args = lambda args, torch_mod=None: _bench_dry.FakeTimer()
    _timing.host_us_per_call = lambda fn, n=100, **kw: (fn(), 9.5)[1]
    import bench_decode as mod

    for attr in ("timer_from_args", "host_us_per_call"):
        setattr(mod, attr, getattr(_timing, attr))
    fake_l = mock.MagicMock(name="decode_launch")
    fake_l.choose_num_splits.return_value = 4
    fake_l.sk_max.return_value = 4096
    fake_l.partial_shapes.return_value = ((4, 1, 1, 32, 128), (4, 1, 1, 32))
    mod._imports = lambda: None
    mod.torch, mod.L = torch, fake_l
    full_plan = mod.plan
    mod.plan = lambda quick, heads=mod.HEADS, kinds=(), layouts=(): [
        r for r in full_plan(quick, heads, ("dense", "blk"), layouts) if r[0] != "sparse"][:3] + [
        r for r in full_plan(quick, heads, ("blk",), layouts) if r[0] == "blk"][:1]
    rc = mod.main(argv)
    print("WINDOWS", ",".join(f"{n}:{i}" for n, i in _bench_dry.CALLS))
    print("RUN_DECODE_CALLS", fake_l.run_decode.call_count)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

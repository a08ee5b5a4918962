"""bench/host_decode.py on the CPU: every row runs the real decode path (launcher; glue and public op on Paddle
CPU tensors) up to the compiled kernel, which is a stub confined to the ``with`` block (launch memos included)."""

from __future__ import annotations

import json
import os
import sys

import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("cutlass")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))

import host_decode as H  # noqa: E402


def test_rows_reach_the_stubbed_kernel(tmp_path, monkeypatch):
    from cute_kernels.decode import launch

    seen = []
    real = launch.decode_launcher

    def spy_launcher(*a, **kw):  # every row builds its launch function here (the memos start empty)
        fn = real(*a, **kw)

        def launch_fn(*args):
            seen.append((type(args[0]).__module__.split(".")[0], args[3].ndim, args[4] is None or args[4].ndim,
                         args[8] is not None))
            return fn(*args)
        return launch_fn

    monkeypatch.setattr(launch, "decode_launcher", spy_launcher)
    out = tmp_path / "host.json"
    assert H.main(["--n", "2", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["us_per_call"]
    assert set(rows) == {"launcher", "launcher_split", "launcher_sparse", "splits", "glue", "glue_auto", "op"}
    assert all(0 < v["min"] <= v["median"] for v in rows.values())
    # the launcher rows (numpy: dense, split, per kv head) and the glue / op rows (Paddle, dense) reached the kernel
    assert {("numpy", 1, 2, False), ("numpy", 1, 2, True), ("numpy", 2, 3, False)} <= set(seen)
    assert ("paddle", 1, 2, False) in seen


def test_stubs_and_memos_are_restored():
    from cute_kernels import jit_cache
    from cute_kernels.decode import launch
    from paddle_fa4._cute import decode as glue

    before = (launch.compile_decode, launch.compile_combine, glue.device_of, dict(jit_cache._FAST), dict(glue._PLANS))
    with H.stubbed():
        assert launch.compile_decode is not before[0] and glue.device_of(paddle.zeros([1]))[:2] == (90, 0)
        H.launcher_calls()["launcher"]()
        assert jit_cache._FAST
    assert (launch.compile_decode, launch.compile_combine, glue.device_of) == before[:3]
    assert jit_cache._FAST == before[3] and glue._PLANS == before[4]

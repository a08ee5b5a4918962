"""bench/bench_host_paddle.py on the CPU: every row runs through the real Paddle path (the ops take the
CuTe backend, the compiled kernel call is a stub), the stubs are confined to the ``with`` block, and
the memoised dtype names agree with the uncached rule."""

from __future__ import annotations

import json
import os
import sys

import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("cutlass")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))

import bench_host_paddle as B  # noqa: E402


def test_rows_run_the_cute_path_and_report_every_case(tmp_path, monkeypatch):
    from cute_kernels.attention import launch
    from cute_kernels.block_sparse import launch as bs_launch

    seen = []
    bs_seen = []

    def spy(mod, name, into):
        real = getattr(mod, name)

        def wrapped(*args, **kwargs):  # the glue reached the launcher: the call took the CuTe backend
            into.append((name, args[0]))
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, name, wrapped)

    spy(launch, "run_fwd", seen)
    for name in ("run_fwd", "run_bwd_dq", "run_bwd_dkdv"):
        spy(bs_launch, name, bs_seen)
    out = tmp_path / "host.json"
    assert B.main(["--n", "2", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["us_per_call"]
    assert set(rows) == {"fwd", "fwd_bl", "fwd_grad", "bwd_op", "step", "dlpack", "bs_plan", "bs_fwd", "bs_step",
                         "bs_latent_fwd", "bs_latent_step"}
    assert all(0 < v["min"] <= v["median"] for v in rows.values())
    cfgs = [cfg for _, cfg in seen]
    assert cfgs and all(cfg.arch == 90 for cfg in cfgs)
    assert any(cfg.block_size == 64 for cfg in cfgs) and any(cfg.block_size == 0 for cfg in cfgs)
    # block_sparse rows: every kernel of the GQA and of the latent path was launched (stubbed) on SM90
    reached = {(name, cfg.latent) for name, cfg in bs_seen}
    assert reached == {(n, lat) for n in ("run_fwd", "run_bwd_dq", "run_bwd_dkdv") for lat in (False, True)}
    assert all(cfg.arch == 90 for _, cfg in bs_seen)


def test_stubs_are_restored_after_the_block():
    import paddle_fa4._bridge as bridge
    import paddle_fa4.backend as backend
    from cute_kernels import arch as _arch
    from cute_kernels.attention import bwd_launch, launch

    from cute_kernels.block_sparse import launch as bs_launch

    def current():
        return (bridge.tensor_arch, backend.tensor_arch, _arch.device_sm_count, launch.compile_fwd,
                bwd_launch.compile_bwd_main, bwd_launch.compile_bwd_pre, bwd_launch.compile_bwd_post,
                bs_launch.compile_fwd, bs_launch.compile_bwd_dq, bs_launch.compile_bwd_dkdv)

    before = current()
    with B.stubbed_launch():
        assert all(a is not b for a, b in zip(current()[2:], before[2:]))
        assert bridge.tensor_arch(paddle.zeros([1])) == 90
        assert _arch.tensor_sm_count(paddle.zeros([1])) == 132  # the persistent grids' SM count
    after = current()
    assert after == before
    assert bridge.tensor_arch(paddle.zeros([1])) is None  # a CPU tensor again has no CUDA arch


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32", "bool"])
def test_memoised_dtype_names_match_the_rule(dtype):
    from cute_kernels import dtypes

    t = paddle.zeros([1], dtype=dtype)
    first = dtypes.dtype_name(t.dtype)
    assert first == dtype
    assert dtypes.dtype_name(t.dtype) == first  # from the cache
    assert dtypes.dtype_name(str(t.dtype)) == dtype
    assert dtypes.dtype_name(["not", "hashable"]) == "['not', 'hashable']"  # unhashable: computed, not cached

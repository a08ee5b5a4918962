"""The windowed indexed-attention kernels compile for sm_90a and sm_100a without a GPU (no spills,
shared memory within the arch limit), and the launch module's host helpers behave as documented."""

from __future__ import annotations

import pytest

from cute_kernels.indexed.config import AttnConfig, unsupported_reason, window_queries
from cute_kernels.indexed.launch import CHECKS, attn_matrix, plan_shapes
from tests.cpu._check_cli import run_check

KERNELS = ("indexed_plan", "indexed_fwd", "indexed_bwd_dq", "indexed_bwd_dkdv")


def _check(arch, kernel, tmp_path, full=False):
    rows = run_check(tmp_path, arch, kernel, *(["--full"] if full else []), timeout=3000)
    assert all(0 < r["registers"] <= 255 for r in rows)
    return rows


@pytest.mark.compile
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_check_cli_compiles_indexed_kernels(arch, kernel, tmp_path):
    rows = _check(arch, kernel, tmp_path)
    assert all(r["smem_bytes"] <= 232_448 for r in rows)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS[1:])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_check_cli_full_matrix(arch, kernel, tmp_path):
    rows = _check(arch, kernel, tmp_path, full=True)
    assert len(rows) == 3 * 6 * 2  # D x G x layout


def test_checks_registered_and_matrices_cover_production():
    from cute_kernels.registry import LAUNCH_MODULES

    assert "cute_kernels.indexed.launch" in LAUNCH_MODULES
    assert set(CHECKS) == set(KERNELS)
    prod = [c for c in attn_matrix(90) if (c.head_dim, c.group, c.num_kv_heads) == (256, 12, 2)]
    assert {c.dkdv_stages for c in prod} == {1, 2} and {c.dq_stages for c in prod} == {1, 2}


@pytest.mark.parametrize("group,wq", [(1, 32), (2, 32), (4, 16), (8, 8), (12, 5), (16, 4)])
def test_window_fills_64_rows(group, wq):
    assert window_queries(group) == wq
    assert AttnConfig(arch=90, head_dim=256, group=group, num_kv_heads=2, per_kv_head=False).rows <= 64


def test_window_queries_rejects_bad_groups():
    with pytest.raises(ValueError, match="heads per kv head"):
        window_queries(0)
    with pytest.raises(ValueError, match="heads per kv head"):
        window_queries(65)


def test_unsupported_reason_names_the_case():
    assert unsupported_reason(256, 12, "bfloat16") is None
    assert "float16" in unsupported_reason(256, 12, "float16")
    assert "head_dim 96" in unsupported_reason(96, 12, "bfloat16")
    assert "3 query heads" in unsupported_reason(128, 3, "bfloat16")


def test_plan_shapes_bound_the_transpose():
    s = plan_shapes(num_sets=2, num_queries=11, width=7, kv_len=100, wq=5)
    assert s.win_key == (2, 3, 35) and s.win_count == (2, 3)
    assert s.tile_bits == (2, 4, 1) and s.tile_ptr == (9,)
    assert s.tile_win == (2 * 3 * 4,)  # every window touches at most min(CAP, NT) tiles
    empty = plan_shapes(num_sets=1, num_queries=0, width=0, kv_len=0, wq=5)
    assert min(min(v) for v in empty) >= 0 and empty.tile_win == (1,)


def test_paddle_plan_shapes_agree_with_launcher():
    from paddle_fa4._plan.indexed import plan_shapes as paddle_shapes

    for args in [(1, 400, 2051, 400, 5), (3, 7, 3, 33, 32), (2, 0, 5, 9, 4)]:
        a = plan_shapes(*args)._asdict()
        b = paddle_shapes(*args)
        assert {k: tuple(v) for k, v in b.items()} == a


def _spec(**kw):
    from paddle_fa4.indexed import IndexedSpec

    base = dict(B=1, Lq=20, Lkv=50, Hq=24, Hkv=2, D=256, W=7, per_kv_head=False, scale=0.0625, dtype="bfloat16")
    base.update(kw)
    return IndexedSpec(**base)


def test_glue_unsupported_reason_names_the_case():
    from paddle_fa4._cute import indexed as glue

    assert glue.unsupported_reason(90, _spec()) is None
    assert glue.unsupported_reason(100, _spec(D=64, Hq=2, Hkv=2)) is None
    assert "float16" in glue.unsupported_reason(90, _spec(dtype="float16"))
    assert "head_dim 96" in glue.unsupported_reason(90, _spec(D=96))
    assert "3 query heads" in glue.unsupported_reason(90, _spec(Hq=6, Hkv=2))


def test_glue_rejects_a_plan_built_for_other_indices():
    import paddle

    import paddle_fa4
    from paddle_fa4._cute import indexed as glue

    idx = paddle.zeros([1, 20, 7], dtype="int32")
    plan = paddle_fa4.indexed_attention_plan(idx, kv_len=50, heads_per_kv=12, backend="reference")
    assert glue._plan_for(_spec(), idx, plan) is plan
    with pytest.raises(ValueError, match="indexed_attention: plan was built for other indices"):
        glue._plan_for(_spec(Lkv=60), idx, plan)
    with pytest.raises(ValueError, match="plan was built"):
        glue._plan_for(_spec(Hq=16), idx, plan)  # G = 8: another window size

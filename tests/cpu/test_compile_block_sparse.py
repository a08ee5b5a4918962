"""The block-sparse forward, dQ and dK/dV kernels compile for sm_90a without a GPU (no spills, shared memory within the
arch limit), the SM100 forward, dQ and dK/dV for sm_100a and sm_103a, are registered for ``python -m cute_kernels.check``, and their
host-side rules agree with the Paddle planner's."""

from __future__ import annotations

import dataclasses

import pytest

from cute_kernels.block_sparse.config import FwdConfig, head_chunk, tile_queries, unsupported_reason
from cute_kernels.block_sparse.launch import CHECKS, bwd_matrix, dq_matrix, fwd_matrix
from tests.cpu._check_cli import run_check


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["block_sparse_fwd", "block_sparse_bwd_dq", "block_sparse_bwd_dkdv"])
def test_check_cli_compiles_block_sparse_kernels(kernel, tmp_path):
    rows = run_check(tmp_path, "sm_90a", kernel, timeout=3000)
    matrix = {"block_sparse_fwd": fwd_matrix, "block_sparse_bwd_dq": dq_matrix, "block_sparse_bwd_dkdv": bwd_matrix}[kernel](90)
    assert len(rows) == len(matrix) and all(0 < r["registers"] <= 255 for r in rows)
    assert all(r["smem_bytes"] <= 232_448 for r in rows)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_check_cli_compiles_sm100_forward(arch, tmp_path):
    rows = run_check(tmp_path, arch, "block_sparse_fwd", timeout=3000)
    assert len(rows) == len(fwd_matrix(100)) == 12 and all(0 < r["registers"] <= 255 for r in rows)
    assert all(r["smem_bytes"] <= 232_448 for r in rows)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("kernel", ["block_sparse_bwd_dq", "block_sparse_bwd_dkdv"])
def test_check_cli_compiles_sm100_backward(kernel, arch, tmp_path):
    rows = run_check(tmp_path, arch, kernel, timeout=3000)
    matrix = {"block_sparse_bwd_dq": dq_matrix, "block_sparse_bwd_dkdv": bwd_matrix}[kernel](100)
    # dQ: four configs and the exact-delta variant of its G 8 d 128 one (Note [SM100 exact delta])
    assert len(rows) == len(matrix) == {"block_sparse_bwd_dq": 5, "block_sparse_bwd_dkdv": 4}[kernel]
    assert all(0 < r["registers"] <= 255 for r in rows)
    assert all(r["smem_bytes"] <= 232_448 for r in rows)


def test_registered_sm90_and_sm100_forward():
    from cute_kernels.registry import LAUNCH_MODULES

    assert "cute_kernels.block_sparse.launch" in LAUNCH_MODULES
    assert set(CHECKS) == {"block_sparse_fwd", "block_sparse_bwd_dq", "block_sparse_bwd_dkdv"}
    assert not any(c.latent for c in fwd_matrix(100, full=True))
    # SM100 dQ (bwd_dq_sm100.py): dtypes x head dims x groups x id layouts x exact delta; no latent.
    # SM100 dK/dV (bwd_dkdv_sm100.py): head dim 128 only, dtypes x groups x id layouts.
    assert len(dq_matrix(100, full=True)) == 2 * 2 * 6 * 2 * 2
    assert sum(c.exact_delta for c in dq_matrix(100, full=True)) == 2 * 2 * 6 * 2
    assert sum(c.exact_delta for c in dq_matrix(100)) == 1
    assert len(bwd_matrix(100, full=True)) == 2 * 7 * 2
    assert not any(c.latent for c in dq_matrix(100, full=True) + bwd_matrix(100, full=True))
    assert not any(c.exact_delta for c in bwd_matrix(100, full=True))
    assert all(c.head_dim == c.head_dim_v == 128 for c in bwd_matrix(100, full=True))
    assert len(fwd_matrix(100, full=True)) == 2 * 3 * 8 * 2 * 2
    # dtypes x head dims x groups x id layouts x sink, plus the latent: dtypes x (Dk, Dv) x groups x sink
    assert len(fwd_matrix(90, full=True)) == 2 * 3 * 6 * 2 * 2 + 2 * 2 * 3 * 2
    assert len(bwd_matrix(90, full=True)) == 2 * 2 * 6 * 2 + 2 * 2 * 3 * 2
    assert sum(c.latent for c in bwd_matrix(90)) == 2
    # the dQ kernels also compile their exact-delta variant (Note [exact delta]); the dK/dV kernels have none
    assert not any(c.exact_delta for c in bwd_matrix(90, full=True))
    assert sum(c.exact_delta for c in dq_matrix(90)) == 3
    assert sorted(map(repr, dq_matrix(90, full=True))) == sorted(
        [repr(c) for c in bwd_matrix(90, full=True)] + [repr(dataclasses.replace(c, exact_delta=True))
                                                        for c in bwd_matrix(90, full=True)])
    assert sum(c.latent for c in fwd_matrix(90)) == 2


@pytest.mark.parametrize("group", [1, 2, 4, 8, 12, 16, 64, 128])
def test_row_tile_matches_planner(group):
    from cute_kernels.block_sparse.config import q_stages_sm100, stage_queries_sm100
    from paddle_fa4._plan.block_sparse import tile_queries as planner_tile_queries

    assert tile_queries(group) == planner_tile_queries(group)
    for arch in (100, 103):
        for dv in (64, 128, 256):
            wq = tile_queries(group, arch, dv)
            assert wq == planner_tile_queries(group, arch, dv) <= 32
            # the window's queries fill the kernel's Q stages in order: QS per stage, GC rows each
            assert wq <= q_stages_sm100(group, dv) * stage_queries_sm100(group)
            assert stage_queries_sm100(group) * head_chunk(group) <= 128
            assert FwdConfig(arch=arch, dtype="bfloat16", head_dim=dv, head_dim_v=dv, group=group, per_kv_head=False,
                             has_sink=False).window_queries == wq
        assert q_stages_sm100(group, 256) == 1
    assert tile_queries(group) * head_chunk(group) <= 64 and group % head_chunk(group) == 0
    assert FwdConfig(arch=90, dtype="bfloat16", head_dim=128, head_dim_v=128, group=group, per_kv_head=False,
                     has_sink=False).window_queries == tile_queries(group)


@pytest.mark.parametrize("kw, fragment", [
    (dict(latent=True), "absorbed-MLA latent with Dk 128 / Dv 128"),
    (dict(latent=True, head_dim=576, head_dim_v=512, group=96), "multiple of 64"),
    (dict(block_size=32), "block_size 32"),
    (dict(head_dim=96, head_dim_v=96), "head dims"),
    (dict(head_dim_v=64), "head dims"),
    (dict(group=96), "multiple of 64"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(head_dim=256, head_dim_v=256, backward=True), "backward at head dim 256"),
])
def test_unsupported_reason_names_the_case(kw, fragment):
    args = dict(head_dim=128, head_dim_v=128, group=8, dtype="bfloat16", block_size=64)
    args.update(kw)
    assert fragment in unsupported_reason(**args)
    assert unsupported_reason(head_dim=128, head_dim_v=128, group=8, dtype="bfloat16", block_size=64) is None
    for dk, dv in ((576, 512), (512, 448)):
        for backward in (False, True):
            assert unsupported_reason(head_dim=dk, head_dim_v=dv, group=64, dtype="bfloat16", block_size=64,
                                      latent=True, backward=backward) is None


@pytest.mark.parametrize("bad", [0, -3])
def test_dkdv_min_segment_pairs_checked_before_launch(bad, monkeypatch):
    """A shortest segment below 1 is a ValueError from the launcher, before any compile or launch."""
    from types import SimpleNamespace

    import cute_kernels.block_sparse.launch as L

    monkeypatch.setattr(L, "compile_bwd_dkdv", lambda cfg, *a: pytest.fail("compiled despite a bad min_segment_pairs"))
    t = SimpleNamespace(shape=(1, 128, 2, 64))
    ks = SimpleNamespace(shape=(1, 2))
    with pytest.raises(ValueError, match="min_segment_pairs"):
        L.run_bwd_dkdv(None, t, t, t, t, t, t, t, t, ks, ks, ks, ks, ks, ks, t, t, t, t, t, 0.125,
                       min_segment_pairs=bad)
    assert L.default_min_segment_pairs(1, 2, 2) == L.MIN_SEGMENT_PAIRS >= 1
    assert L.default_min_segment_pairs(1, 2, 2, ordered=True) == L.ORDERED_MIN_SEGMENT_PAIRS >= 1


@pytest.mark.parametrize("shape,dtype", [((1, 15), "int32"), ((1, 16), "int64"), ((2, 16), "int32")])
def test_dkdv_key_order_checked_before_launch(shape, dtype, monkeypatch):
    """A key_order that is not the plan's shape ([NS, KCAP * SEGMENTS]) or not int32 is a ValueError from the
    launcher, before any compile or launch (Note [tile-ordered segments]: the kernels trust it)."""
    from types import SimpleNamespace

    import cute_kernels.block_sparse.launch as L

    monkeypatch.setattr(L, "compile_bwd_dkdv", lambda cfg, *a: pytest.fail("compiled despite a bad key_order"))
    t = SimpleNamespace(shape=(1, 128, 2, 64))
    ks = SimpleNamespace(shape=(1, 2))
    order = SimpleNamespace(shape=shape, dtype=dtype)
    with pytest.raises(ValueError, match="key_order must be int32"):
        L.run_bwd_dkdv(SimpleNamespace(latent=False, arch=90), t, t, t, t, t, t, t, t, ks, ks, ks, ks, ks, ks, t, t, t,
                       t, t, 0.125, key_order=order)


def test_dkdv_segment_split_covers_every_pair_once():
    """Note [key block segments]: the split the dK/dV kernel computes (the same function, on Python ints):
    at most SEGMENTS non-empty segments of L pairs (the last one shorter), L no longer than
    max(ceil(n / SEGMENTS), min_seg), together exactly the block's n pairs; no segment for n = 0."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse.config import SEGMENTS, segment_split

    assert segment_split(83, 64) == (42, 2)  # the balanced split the Note quotes (not 64 + 19)
    for min_seg in (1, 7, 64, 256, 1 << 20):
        assert segment_split(0, min_seg)[1] == 0
        for n in range(1, 2500):
            seg_len, nseg = segment_split(n, min_seg)
            assert 1 <= nseg <= SEGMENTS, (n, min_seg, seg_len, nseg)
            assert (nseg - 1) * seg_len < n <= nseg * seg_len, (n, min_seg, seg_len, nseg)  # each one non-empty
            assert seg_len <= max(-(-n // SEGMENTS), min_seg), (n, min_seg, seg_len)
            assert nseg == -(-n // max(-(-n // SEGMENTS), min_seg)), (n, min_seg)  # as many as before balancing


def test_latent_register_splits_fit_the_launch():
    """setmaxnreg splits of the three latent kernels (384 threads, one CTA per SM) stay within the 168 registers per
    thread the launch holds: 48 / 232 did not (producer + 2 x consumer = 512 > 504) and hung on the H200 (Run AG3,
    docs/benchmarks.md), which ``check_setmaxnreg`` now refuses at trace time."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse import bwd_dkv_latent_sm90, bwd_dq_latent_sm90, fwd_latent_sm90
    from cute_kernels.block_sparse.common import check_setmaxnreg

    for mod in (fwd_latent_sm90, bwd_dq_latent_sm90, bwd_dkv_latent_sm90):
        check_setmaxnreg(mod.PRODUCER_REGS, mod.CONSUMER_REGS, 2)
        assert mod.PRODUCER_REGS + 2 * mod.CONSUMER_REGS <= 3 * 168
    with pytest.raises(AssertionError, match="exceeds the 168 registers"):
        check_setmaxnreg(48, 232, 2)
    check_setmaxnreg(24, 240, 2)


def test_sm100_backward_register_and_tmem_plans():
    """The SM100 dQ kernel's setmaxnreg split sums to the 4 x 128 registers its 512 threads launch with (an
    increase past what the CTA holds never returns) and its TMEM plan (two S buffers, dP, dQ) fits 512
    columns at both head dims; the dK/dV kernel's 384 threads need no split (<= 168 registers each)."""
    from cute_kernels.block_sparse import bwd_dkdv_sm100 as kv
    from cute_kernels.block_sparse import bwd_dq_sm100 as dq

    assert sum(dq.DQ_REGS) == 4 * 128 and all(r % 8 == 0 and 24 <= r <= 256 for r in dq.DQ_REGS)
    for d in (64, 128):
        assert 2 * 128 + d <= dq.S1_OFFSET and dq.S1_OFFSET + 128 <= 512
    # the exact delta's exchange barrier is not one the dense forward's roles use, and the 2 x TILE_M threads it
    # counts are the two softmax warpgroups' (Note [SM100 exact delta])
    from cute_kernels.attention.fwd_sm100 import ROLE_THREADS, TILE_M, FwdBarrier

    assert dq.DELTA_BARRIER not in (0, *map(int, FwdBarrier))
    assert 2 * TILE_M == 2 * ROLE_THREADS["softmax"] and dq.DQ_REGS[0] == dq.DQ_REGS[1] > 128
    assert kv.NUM_THREADS == 384 and kv.TMEM_DK + 64 <= kv.TMEM_COLS
    assert kv.TMEM_S[1] + 2 * 64 <= kv.TMEM_DV


@pytest.mark.parametrize("group,S", [(8, 100), (12, 37), (1, 33), (64, 5)])
def test_launchers_refuse_a_plan_of_another_query_tile(group, S):
    """The launchers check the plan's row tiles against their kernels' (check_plan_tiles, before any launch): a
    plan tiled for SM90 handed to SM100 kernels (and back) is refused by name where the tiles differ, accepted
    for its own arch; a plan without ids (CAP 1) passes."""
    import numpy as np

    from cute_kernels.block_sparse.config import BwdConfig
    from cute_kernels.block_sparse.launch import check_plan_tiles

    def plan(wq, topk=3):
        return np.zeros((1, -(-S // wq), max(wq * topk, 1)), np.int32)

    for arch in (90, 100):
        cfg = BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=group, per_kv_head=False)
        other = tile_queries(group, 190 - arch, 128)
        check_plan_tiles(cfg, S, plan(cfg.window_queries))
        check_plan_tiles(cfg, S, plan(cfg.window_queries, topk=0))
        if other != cfg.window_queries and -(-S // other) != -(-S // cfg.window_queries):
            with pytest.raises(ValueError, match=f"tile {cfg.window_queries} queries"):
                check_plan_tiles(cfg, S, plan(other))

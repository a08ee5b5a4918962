"""select_topk_blocks / blocks_to_indices / block_log_weight on the reference backend vs the fp64
numpy oracle (tests/oracles/selection.py), plus the API contracts and error cases."""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_fa4  # noqa: E402
from tests.oracles import selection as oracle  # noqa: E402

REF = {"backend": "reference"}


def _t(a):
    return paddle.to_tensor(a)


# (b, hq, sq, sk, block_size, num_kv_heads, topk, sink, local, window, ties)
CASES = [
    pytest.param(2, 4, 37, 300, 16, None, 5, 1, 2, None, False, id="all-heads-sink-local"),
    pytest.param(1, 8, 50, 50, 16, 2, 4, 0, 1, None, True, id="gqa-8to2-ties"),
    pytest.param(1, 8, 33, 64, 16, 1, 3, 0, 0, None, False, id="gqa-8to1-explicit"),
    pytest.param(1, 4, 29, 90, 16, 4, 3, 1, 1, None, False, id="per-head"),
    pytest.param(1, 4, 20, 100, 16, 2, 3, 1, 1, 40, False, id="window"),
    pytest.param(2, 2, 70, 40, 16, None, 8, 0, 0, None, True, id="sq-gt-sk-empty-rows"),
    pytest.param(1, 2, 5, 250, 32, None, 20, 2, 2, None, False, id="topk-gt-nb"),
    pytest.param(1, 3, 1, 1, 64, None, 2, 1, 1, None, False, id="one-token"),
    pytest.param(1, 2, 40, 63, 64, None, 1, 0, 1, None, False, id="one-block-local-only"),
    pytest.param(1, 2, 96, 96, 16, None, 16, 0, 0, None, True, id="all-ties-lower-id"),
]


@pytest.mark.parametrize("b,hq,sq,sk,bs,hs,topk,sink,local,window,ties", CASES)
def test_select_matches_oracle(b, hq, sq, sk, bs, hs, topk, sink, local, window, ties):
    rng = np.random.default_rng(7)
    bl, lse = oracle.causal_block_logit(rng, b, hq, sq, sk, bs, window=window, ties=ties)
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=topk, num_kv_heads=hs, sink_blocks=sink,
                                        local_blocks=local, **REF)
    want = oracle.select_topk_blocks(bl, lse, topk, hs, sink, local)
    assert got.dtype == paddle.int32 and list(got.shape) == [b, hs or 1, sq, topk]
    np.testing.assert_array_equal(got.numpy(), want)


def test_selection_contract_properties():
    """Ascending ids then -1; every chosen block visible; sinks and the diagonal block kept."""
    rng = np.random.default_rng(3)
    b, hq, sq, sk, bs, topk = 2, 4, 80, 160, 16, 4
    bl, lse = oracle.causal_block_logit(rng, b, hq, sq, sk, bs)
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=topk, sink_blocks=1, local_blocks=1, **REF).numpy()
    visible = np.isfinite(bl).any(axis=1)  # [B, Sq, nb]
    for bi in range(b):
        for i in range(sq):
            row = got[bi, 0, i]
            ids = row[row >= 0]
            assert (row[len(ids):] == -1).all()
            assert (np.diff(ids) > 0).all()
            assert visible[bi, i, ids].all()
            diag = (i + sk - sq) // bs
            if diag >= 0:
                assert diag in ids and 0 in ids
                assert len(ids) == min(topk, diag + 1)
            else:
                assert len(ids) == 0


def _nan_case():
    """block_logit [1, 2, 4, 8] / lse [1, 2, 4] exercising every branch of the NaN rule."""
    rng = np.random.default_rng(3)
    bl = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    lse = np.full((1, 2, 4), 3.0, np.float32)
    bl[0, :, 0, 0:2] = np.nan  # row 0: NaN block_logit in both heads = unseen blocks
    lse[0, :, 1] = np.nan  # row 1: NaN lse in every head: visible, nothing ranked
    lse[0, 0, 2] = np.nan  # row 2: one head's lse NaN: the other head ranks
    bl[0, 1, 3, 4] = np.nan  # row 3: NaN in one head only, the other head's value counts
    bl[0, :, 3, 6:] = -np.inf
    return bl, lse


def test_nan_rule_matches_oracle():
    bl, lse = _nan_case()
    for hs, sink, local, topk in ((None, 1, 1, 4), (2, 0, 2, 3), (None, 0, 0, 8), (1, 2, 0, 2)):
        got = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=topk, num_kv_heads=hs, sink_blocks=sink,
                                            local_blocks=local, **REF)
        np.testing.assert_array_equal(got.numpy(), oracle.select_topk_blocks(bl, lse, topk, hs, sink, local))


def test_nan_never_takes_a_finite_blocks_slot():
    """The issue's rows: NaN scores must not push finite blocks out, nor drop sink / local blocks."""
    bl = np.array([[[[np.nan, np.nan, 0.5, 0.4, 0.3, 0.2]]]], np.float32)
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(np.zeros((1, 1, 1), np.float32)), topk=4, **REF)
    assert got.numpy().tolist() == [[[[2, 3, 4, 5]]]]
    bl = np.array([[[[0.1, 0.9, 0.8, 0.2, 0.3, -np.inf]]]], np.float32)
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(np.full((1, 1, 1), np.nan, np.float32)), topk=4, sink_blocks=1,
                                        local_blocks=1, **REF)
    assert got.numpy().tolist() == [[[[0, 4, -1, -1]]]]  # sink 0 and diagonal 4 kept, nothing ranked


def test_nan_check_opt_in(monkeypatch):
    bl, lse = _nan_case()
    paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=4, **REF)
    monkeypatch.setenv("PADDLE_FA4_CHECK_NAN", "1")
    with pytest.raises(FloatingPointError, match="select_topk_blocks: block_logit holds 5 NaN"):
        paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=4, **REF)


def test_ties_go_to_lower_block():
    """Equal log-weights: the lower block id wins (regression guard for unstable top-k)."""
    bl = np.zeros((1, 1, 1, 6), np.float32)
    bl[..., 4] = -1.0
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(np.ones((1, 1, 1), np.float32)), topk=3, **REF)
    assert got.numpy().tolist() == [[[[0, 1, 2]]]]


def test_max_over_heads_not_sum():
    bl = np.array([[[[5.0, 0.0, 0.0]], [[0.0, 4.0, 4.0]]]], np.float32)  # [1, 2, 1, 3]
    lse = np.array([[[6.0], [5.0]]], np.float32)  # log-weights: head0 [-1,-6,-6], head1 [-5,-1,-1]
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=2, **REF)
    assert got.numpy().tolist() == [[[[0, 1]]]]  # max: [-1, -1, -1] -> ties -> 0, 1
    per_head = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=1, num_kv_heads=2, **REF)
    assert per_head.numpy().tolist() == [[[[0]], [[1]]]]


def test_varlen_matches_oracle_per_sequence():
    """Varlen [Hq, total_q, nb]: each sequence's rows select on their own (document-relative) blocks."""
    rng = np.random.default_rng(11)
    hq, bs, topk, nb_max = 4, 16, 3, 7
    parts_bl, parts_lse, wants = [], [], []
    for sq, sk in [(30, 30), (5, 100), (17, 17)]:
        bl, lse = oracle.causal_block_logit(rng, 1, hq, sq, sk, bs)
        pad = np.full((1, hq, sq, nb_max - bl.shape[-1]), -np.inf, np.float32)
        bl = np.concatenate([bl, pad], axis=-1)
        parts_bl.append(bl[0])
        parts_lse.append(lse[0])
        wants.append(oracle.select_topk_blocks(bl, lse, topk, 2, 1, 1)[0])
    bl = np.concatenate(parts_bl, axis=1)
    lse = np.concatenate(parts_lse, axis=1)
    got = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=topk, num_kv_heads=2, sink_blocks=1,
                                        local_blocks=1, **REF)
    assert list(got.shape) == [2, bl.shape[1], topk]
    np.testing.assert_array_equal(got.numpy(), np.concatenate(wants, axis=1))
    np.testing.assert_array_equal(got.numpy(), oracle.select_topk_blocks(bl, lse, topk, 2, 1, 1))


def test_block_log_weight_matches_oracle():
    rng = np.random.default_rng(5)
    bl, lse = oracle.causal_block_logit(rng, 1, 2, 40, 30, 16)  # rows 0..9 see no key: lse -inf
    got = paddle_fa4.block_log_weight(_t(bl), _t(lse)).numpy()
    want = oracle.block_log_weight(bl, lse)
    assert np.isneginf(lse).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hs", [1, 2])
@pytest.mark.parametrize("sq,sk,bs", [(37, 300, 16), (64, 40, 32), (10, 10, 64)], ids=["sq<sk", "sq>sk", "sk<block"])
def test_blocks_to_indices_matches_oracle(causal, hs, sq, sk, bs):
    rng = np.random.default_rng(2)
    nb = -(-sk // bs)
    blk = rng.integers(-1, nb + 2, size=(2, hs, sq, 4)).astype(np.int32)  # ids past nb must pad too
    got = paddle_fa4.blocks_to_indices(_t(blk), block_size=bs, seqlen_k=sk, causal=causal, **REF)
    want = oracle.blocks_to_indices(blk, bs, sk, causal=causal)
    assert got.dtype == paddle.int32 and list(got.shape) == list(want.shape)
    np.testing.assert_array_equal(got.numpy(), want)


def test_blocks_to_indices_round_trip():
    """Selected blocks -> token ids -> blocks: same set, and exactly the visible keys of those blocks."""
    rng = np.random.default_rng(9)
    b, hq, sq, sk, bs, topk = 1, 4, 48, 120, 16, 3
    bl, lse = oracle.causal_block_logit(rng, b, hq, sq, sk, bs)
    blk = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=topk, num_kv_heads=2, local_blocks=1, **REF)
    idx = paddle_fa4.blocks_to_indices(blk, block_size=bs, seqlen_k=sk, **REF).numpy()  # [B, 2, Sq, topk * bs]
    blk = blk.numpy()
    for g in range(2):
        for i in range(sq):
            ids = idx[0, g, i]
            chosen = set(blk[0, g, i][blk[0, g, i] >= 0].tolist())
            assert set((ids[ids >= 0] // bs).tolist()) == chosen
            last = i + sk - sq
            expect = sorted(t for j in chosen for t in range(j * bs, min((j + 1) * bs, sk)) if t <= last)
            assert sorted(ids[ids >= 0].tolist()) == expect


def test_zero_size_and_no_blocks():
    empty = paddle_fa4.select_topk_blocks(paddle.zeros([1, 2, 0, 4]), paddle.zeros([1, 2, 0]), topk=3, **REF)
    assert list(empty.shape) == [1, 1, 0, 3]
    none = paddle_fa4.select_topk_blocks(paddle.zeros([1, 2, 3, 0]), paddle.zeros([1, 2, 3]), topk=2, **REF)
    assert none.numpy().tolist() == [[[[-1, -1]] * 3]]


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"bl_dtype": "float16"}, TypeError, "block_logit must be float32"),
    ({"lse_shape": [1, 2, 5]}, ValueError, "lse must have shape"),
    ({"topk": 0}, ValueError, "topk must be >= 1"),
    ({"topk": 2.0}, TypeError, "topk must be an int"),
    ({"num_kv_heads": 3}, ValueError, "num_kv_heads .3. must divide"),
    ({"sink_blocks": 2, "local_blocks": 2, "topk": 3}, ValueError, "sink_blocks \\+ local_blocks"),
    ({"sink_blocks": -1}, ValueError, "sink_blocks must be >= 0"),
    ({"backend": "triton"}, ValueError, "backend must be one of"),
])
def test_select_errors(kwargs, exc, match):
    bl = paddle.zeros([1, 4, 6, 5], dtype=kwargs.pop("bl_dtype", "float32"))
    lse = paddle.zeros(kwargs.pop("lse_shape", [1, 4, 6]))
    args = {"topk": 3, **kwargs}
    with pytest.raises(exc, match=f"select_topk_blocks: {match}"):
        paddle_fa4.select_topk_blocks(bl, lse, **args)


@pytest.mark.parametrize("blk,kwargs,exc,match", [
    ("float32", {}, TypeError, "block_idx must be int32 \\(int64 is accepted"),
    ("3d", {}, ValueError, "block_idx must be \\[B, Hs, Sq, topk\\]"),
    ("int32", {"block_size": 48}, ValueError, "block_size must be one of"),
    ("int32", {"seqlen_k": -1}, ValueError, "seqlen_k must be >= 0"),
    ("int32", {"causal": 1}, TypeError, "causal must be a bool"),
])
def test_blocks_to_indices_errors(blk, kwargs, exc, match):
    t = paddle.zeros([1, 2, 3] if blk == "3d" else [1, 1, 2, 3], dtype="float32" if blk == "float32" else "int32")
    args = {"block_size": 16, "seqlen_k": 32, **kwargs}
    with pytest.raises(exc, match=f"blocks_to_indices: {match}"):
        paddle_fa4.blocks_to_indices(t, **args)


def test_cute_backend_on_cpu_says_why():
    with pytest.raises(NotImplementedError, match="select_topk_blocks: backend='cute'.*CUDA place"):
        paddle_fa4.select_topk_blocks(paddle.zeros([1, 1, 2, 4]), paddle.zeros([1, 1, 2]), topk=1, backend="cute")


@pytest.mark.parametrize("sq,sk,bs", [(40, 100, 16), (70, 40, 16), (33, 33, 32)], ids=["sq<sk", "sq>sk", "square"])
def test_causal_read_limit(sq, sk, bs):
    """block_size/seqlen_k: blocks past the causal limit are ignored (poisoned there), and on a causal
    block_logit the result is the same as without the limit."""
    rng = np.random.default_rng(4)
    bl, lse = oracle.causal_block_logit(rng, 1, 4, sq, sk, bs)
    plain = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=4, sink_blocks=1, local_blocks=1, **REF).numpy()
    limited = paddle_fa4.select_topk_blocks(_t(bl), _t(lse), topk=4, sink_blocks=1, local_blocks=1,
                                            block_size=bs, seqlen_k=sk, **REF).numpy()
    np.testing.assert_array_equal(limited, plain)
    poisoned = np.where(np.isneginf(bl), np.float32(50.0), bl)  # huge weights on invisible blocks
    got = paddle_fa4.select_topk_blocks(_t(poisoned), _t(lse), topk=4, sink_blocks=1, local_blocks=1,
                                        block_size=bs, seqlen_k=sk, **REF).numpy()
    want = oracle.select_topk_blocks(poisoned, lse, 4, None, 1, 1, causal_limit=(bs, sk))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, plain)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 16}, "block_size and seqlen_k go together"),
    ({"block_size": 16, "seqlen_k": 100}, "block_logit has 5 blocks but seqlen_k=100"),
    ({"block_size": 24, "seqlen_k": 80}, "block_size must be one of"),
])
def test_causal_read_limit_errors(kwargs, match):
    with pytest.raises(ValueError, match=f"select_topk_blocks: {match}"):
        paddle_fa4.select_topk_blocks(paddle.zeros([1, 2, 3, 5]), paddle.zeros([1, 2, 3]), topk=2, **kwargs)


def test_docstring_examples_run():
    import doctest

    import paddle_fa4.selection as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0

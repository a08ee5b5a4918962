"""indexed_attention (forward and backward, through its PyLayer) on the reference backend vs the oracle."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4.reference import indexed as ref_indexed
from tests.oracles import indexed as oracle
from tests.oracles.tolerance import assert_rel_l2, to_numpy64

REL_L2 = 1e-4


def make_case(seed, b, lq, lkv, hq, hkv, d, w, per_kv_head=False, pad_frac=0.2, dtype="float32"):
    """Inputs with grads enabled, random indices (~pad_frac padding of both kinds) and an upstream grad."""
    rng = np.random.default_rng(seed)

    def leaf(shape):
        t = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        t.stop_gradient = False
        return t

    q, k, v = leaf([b, lq, hq, d]), leaf([b, lkv, hkv, d]), leaf([b, lkv, hkv, d])
    shape = (b, hkv, lq, w) if per_kv_head else (b, lq, w)
    idx = rng.integers(0, max(lkv, 1), size=shape)
    pad = rng.random(shape) < pad_frac
    idx = np.where(pad, rng.choice([-1, -7, lkv, lkv + 5], size=shape), idx).astype(np.int32)
    dout = paddle.to_tensor(rng.standard_normal([b, lq, hq, d]).astype(np.float32)).astype(dtype)
    return q, k, v, paddle.to_tensor(idx), dout


def run(q, k, v, idx, dout, **kw):
    """Forward + backward; returns numpy (out, lse, dq, dk, dv)."""
    for t in (q, k, v):
        t.clear_gradient() if t.grad is not None else None
    out, lse = paddle_fa4.indexed_attention(q, k, v, idx, return_lse=True, backend="reference", **kw)
    paddle.autograd.backward([out], [dout])
    return out, lse, q.grad, k.grad, v.grad


def check_against_oracle(q, k, v, idx, dout, tol=REL_L2, **kw):
    got = run(q, k, v, idx, dout, **kw)
    args = [to_numpy64(t) for t in (q, k, v)] + [idx.numpy()]
    out, lse = oracle.forward(*args, scale=kw.get("softmax_scale"))
    dq, dk, dv = oracle.backward(*args, to_numpy64(dout), scale=kw.get("softmax_scale"))
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, (out, lse, dq, dk, dv)):
        assert_rel_l2(name, a, e, tol)
    return got


CASES = [  # (b, lq, lkv, hq, hkv, d, w)
    pytest.param((2, 9, 13, 4, 2, 16, 6), id="gqa-2"),
    pytest.param((1, 12, 12, 2, 2, 32, 5), id="mha"),
    pytest.param((1, 7, 30, 8, 1, 16, 9), id="mqa-8"),
    pytest.param((2, 20, 6, 4, 1, 16, 4), id="lq-gt-lkv"),
    pytest.param((1, 5, 64, 4, 2, 16, 20), id="lq-lt-lkv"),
    pytest.param((1, 6, 10, 2, 1, 8, 1), id="w-1"),
]


@pytest.mark.parametrize("per_kv_head", [False, True], ids=["shared", "per-kv-head"])
@pytest.mark.parametrize("case", CASES)
def test_forward_backward(case, per_kv_head):
    check_against_oracle(*make_case(1, *case, per_kv_head=per_kv_head))


def test_custom_scale():
    check_against_oracle(*make_case(2, 1, 8, 10, 4, 2, 16, 5), softmax_scale=0.21)


def test_duplicates_count_once():
    """A row with repeats equals the same row with the repeats replaced by padding."""
    q, k, v, _, dout = make_case(3, 1, 4, 10, 2, 1, 16, 6)
    dup = paddle.to_tensor([[[3, 3, 1, 3, 1, 9], [0, 0, 0, 0, 0, 0], [2, 5, 2, -1, 5, 10], [7, 8, 9, 7, 8, 9]]],
                           dtype="int32")
    uniq = paddle.to_tensor([[[3, 1, 9, -1, -1, -1], [0, -1, -1, -1, -1, -1], [2, 5, -1, -1, -1, -1],
                              [7, 8, 9, -1, -1, -1]]], dtype="int32")
    got = check_against_oracle(q, k, v, dup, dout)
    got = [t.numpy().copy() for t in got]
    again = [t.numpy() for t in run(q, k, v, uniq, dout)]
    for a, b in zip(got, again):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_kv_head", [False, True], ids=["shared", "per-kv-head"])
def test_padding_rows_are_never_read(per_kv_head):
    """Key/value rows no index selects are poisoned with NaN and huge values: nothing changes."""
    q, k, v, idx, dout = make_case(4, 2, 8, 20, 4, 2, 16, 5, per_kv_head=per_kv_head, pad_frac=0.3)
    ids = np.where(idx.numpy() == 0, -1, idx.numpy()).astype(np.int32)  # key 0 is never selected
    idx = paddle.to_tensor(ids)
    clean = [t.numpy().copy() for t in run(q, k, v, idx, dout)]
    used = np.zeros((2, 20, 2), dtype=bool)  # [b, t, kv head]
    for b in range(2):
        for kh in range(2):
            rows = ids[b, kh] if per_kv_head else ids[b]
            valid = rows[(rows >= 0) & (rows < 20)]
            used[b, valid, kh] = True
    assert (~used).any()
    poison_k = np.where(used[..., None], k.numpy(), np.nan).astype(np.float32)
    poison_v = np.where(used[..., None], v.numpy(), 3e38).astype(np.float32)
    k2, v2 = paddle.to_tensor(poison_k, stop_gradient=False), paddle.to_tensor(poison_v, stop_gradient=False)
    q2 = paddle.to_tensor(q.numpy(), stop_gradient=False)
    poisoned = [t.numpy() for t in run(q2, k2, v2, idx, dout)]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), clean, poisoned):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_empty_rows_give_zero_out_neg_inf_lse_and_finite_zero_grads():
    q, k, v, _, dout = make_case(5, 1, 3, 8, 2, 1, 16, 4)
    idx = paddle.to_tensor([[[-1, -1, 8, 100], [1, 2, -1, -1], [-5, 8, 8, -1]]], dtype="int32")
    out, lse, dq, dk, dv = run(q, k, v, idx, dout)
    assert np.all(out.numpy()[0, [0, 2]] == 0)
    assert np.all(np.isneginf(lse.numpy()[0][:, [0, 2]])) and np.all(np.isfinite(lse.numpy()[0][:, 1]))
    assert np.all(dq.numpy()[0, [0, 2]] == 0)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g.numpy()))
    untouched = [t for t in range(8) if t not in (1, 2)]
    assert np.all(dk.numpy()[0, untouched] == 0) and np.all(dv.numpy()[0, untouched] == 0)


def test_all_rows_empty_and_zero_width():
    """W = 0 and all-padding indices: out 0, lse -inf, zero grads."""
    for w, fill in ((0, 0), (3, -1)):
        q, k, v, _, dout = make_case(6, 1, 4, 5, 2, 2, 8, max(w, 1))
        idx = paddle.full([1, 4, w], fill, dtype="int32")
        out, lse, dq, dk, dv = run(q, k, v, idx, dout)
        assert np.all(out.numpy() == 0) and np.all(np.isneginf(lse.numpy()))
        for g in (dq, dk, dv):
            assert np.all(g.numpy() == 0)


def test_shuffled_rows_are_bitwise_equal():
    """The order of a row's indices does not matter, bit for bit."""
    q, k, v, idx, dout = make_case(7, 2, 10, 16, 4, 2, 16, 7)
    first = [t.numpy().copy() for t in run(q, k, v, idx, dout)]
    rng = np.random.default_rng(0)
    shuffled = rng.permuted(idx.numpy(), axis=-1)
    assert not np.array_equal(shuffled, idx.numpy())
    second = [t.numpy() for t in run(q, k, v, paddle.to_tensor(shuffled), dout)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs(dtype):
    q, k, v, idx, dout = make_case(8, 1, 9, 14, 4, 2, 32, 6, dtype=dtype)
    got = check_against_oracle(q, k, v, idx, dout, tol=1e-2)
    assert [t.dtype for t in got] == [q.dtype, paddle.float32, q.dtype, k.dtype, v.dtype]


def test_chunked_queries(monkeypatch):
    """Tiny tiles force one query per chunk; forward and backward still match the oracle."""
    monkeypatch.setattr(ref_indexed, "TILE_BYTES", 1)
    check_against_oracle(*make_case(9, 2, 6, 11, 4, 2, 8, 5, per_kv_head=True))


# ---------------------------------------------------------------------------------------------
# PyLayer rules


def test_stop_gradient_inputs_get_no_grad():
    q, k, v, idx, dout = make_case(10, 1, 5, 7, 2, 1, 8, 3)
    k.stop_gradient = True
    out = paddle_fa4.indexed_attention(q, k, v, idx, backend="reference")
    paddle.autograd.backward([out], [dout])
    assert k.grad is None and q.grad is not None and v.grad is not None
    _, _, dq, _, dv = check_against_oracle(*make_case(10, 1, 5, 7, 2, 1, 8, 3))
    np.testing.assert_allclose(q.grad.numpy(), dq.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v.grad.numpy(), dv.numpy(), rtol=1e-6, atol=1e-6)


def test_only_key_needs_grad():
    q, k, v, idx, dout = make_case(11, 1, 5, 7, 2, 1, 8, 3)
    q.stop_gradient = True
    v.stop_gradient = True
    out = paddle_fa4.indexed_attention(q, k, v, idx, backend="reference")
    assert not out.stop_gradient
    paddle.autograd.backward([out], [dout])
    assert q.grad is None and v.grad is None and k.grad is not None


def test_no_input_needs_grad():
    q, k, v, idx, _ = make_case(12, 1, 5, 7, 2, 1, 8, 3)
    for t in (q, k, v):
        t.stop_gradient = True
    out, lse = paddle_fa4.indexed_attention(q, k, v, idx, return_lse=True, backend="reference")
    assert out.stop_gradient and lse.stop_gradient


def test_no_grad_context():
    q, k, v, idx, _ = make_case(13, 1, 5, 7, 2, 1, 8, 3)
    with paddle.no_grad():
        out, lse = paddle_fa4.indexed_attention(q, k, v, idx, return_lse=True, backend="reference")
    assert out.stop_gradient and lse.stop_gradient
    expected, _ = oracle.forward(q.numpy(), k.numpy(), v.numpy(), idx.numpy())
    assert_rel_l2("out", out, expected, REL_L2)


def test_lse_is_not_differentiable():
    q, k, v, idx, _ = make_case(14, 1, 5, 7, 2, 1, 8, 3)
    out, lse = paddle_fa4.indexed_attention(q, k, v, idx, return_lse=True, backend="reference")
    assert lse.stop_gradient and not out.stop_gradient


def test_plan_is_accepted_and_ignored_by_reference():
    """A plan from indexed_attention_plan passes validation; the reference result does not change."""
    q, k, v, idx, dout = make_case(15, 1, 6, 9, 4, 2, 8, 4)
    plan = paddle_fa4.indexed_attention_plan(idx, kv_len=9, heads_per_kv=2, backend="reference")
    base = [t.numpy().copy() for t in run(q, k, v, idx, dout)]
    with_plan = [t.numpy() for t in run(q, k, v, idx, dout, plan=plan)]
    for a, b in zip(base, with_plan):
        np.testing.assert_array_equal(a, b)


def test_peaked_rows_bf16():
    """Every row indexes key 0, an attention sink (~0.99 of its weight), bf16 inputs: the reference's
    D = rowsum(P dP) keeps dq / dk within 1e-2 of the fp64 gradients, where D from the bf16-rounded out
    (rowsum(dO * O)) is off by ~1 relative (tests/cpu/test_attention_bwd.py::test_peaked_rows_bf16)."""
    rng = np.random.default_rng(8)
    lq = lkv = 128
    d, w = 64, 24
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    q = rng.standard_normal((1, lq, 2, d))
    q = q - (q @ u)[..., None] * u + u
    k = rng.standard_normal((1, lkv, 1, d))
    k[0, 0, 0] = 12.0 * 8.0 * u  # logit q . k_0 / sqrt(64) = 12 on every row and head
    v = rng.standard_normal((1, lkv, 1, d))
    dout = rng.standard_normal((1, lq, 2, d))
    idx = rng.integers(1, lkv, size=(1, lq, w))
    idx[..., 0] = 0
    leaves = []
    for a in (q, k, v):
        t = paddle.to_tensor(a.astype(np.float32)).astype("bfloat16")
        t.stop_gradient = False
        leaves.append(t)
    dout_t = paddle.to_tensor(dout.astype(np.float32)).astype("bfloat16")
    idx_t = paddle.to_tensor(idx.astype(np.int32))
    out, lse, dq, dk, dv = run(*leaves, idx_t, dout_t)
    args = [to_numpy64(t) for t in leaves] + [idx]
    _, lse64 = oracle.forward(*args)
    assert np.exp(to_numpy64(leaves[0])[0] @ to_numpy64(leaves[1])[0, 0, 0] / 8.0
                  - to_numpy64(lse64)[0].T).min() > 0.98  # the sink's weight on every row
    want = oracle.backward(*args, to_numpy64(dout_t))
    for name, a, e in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_rel_l2(name, a, e, 1e-2)

"""block_sparse_attention (reference backend) and block_sparse_plan on the CPU.

The fp32 reference vs the fp64 oracle over the expanded token mask (tests/oracles/block_sparse.py):
documents packed with bos % block_size != 0, -1 padding and repeated ids, rows with fewer visible
blocks (first rows of a document), S not a multiple of the block size, GQA / MQA / per-kv-head ids,
the absorbed-MLA latent (v=None), learnable sinks (forward, gradient vs the oracle and by finite
differences), empty rows; equality with indexed_attention over blocks_to_indices of the same
selection; the plan vs a numpy plan; validation errors before any work.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_fa4  # noqa: E402
from tests.oracles import block_sparse as orc  # noqa: E402

paddle.set_device("cpu")


def _t(x, dtype="float32", grad=False):
    t = paddle.to_tensor(np.asarray(x), dtype=dtype)
    t.stop_gradient = not grad
    return t


def _case(seed, B, S, Hq, Hkv, Dk, Dv, topk, bs, causal=True, cu=None, per_kv=False, sink=False, latent=False,
          pad=0.2, dup=0.1):
    rng = np.random.default_rng(seed)
    ids = orc.random_ids(rng, B, S, topk, bs, causal, cu, heads=Hkv if per_kv else None, pad=pad, dup=dup)
    q = rng.standard_normal((B, S, Hq, Dk)).astype(np.float32)
    k = rng.standard_normal((B, S, Hkv, Dk)).astype(np.float32)
    v = None if latent else rng.standard_normal((B, S, Hkv, Dv)).astype(np.float32)
    s = rng.standard_normal(Hq).astype(np.float32) if sink else None
    dout = rng.standard_normal((B, S, Hq, Dv)).astype(np.float32)
    return dict(ids=ids, q=q, k=k, v=v, sink=s, dout=dout, bs=bs, causal=causal, cu=cu, Dv=Dv)


def _run(c, plan=None, **kw):
    """(out, lse, dq, dk, dv, dsink) numpy from the Paddle op (reference backend)."""
    q, k = _t(c["q"], grad=True), _t(c["k"], grad=True)
    v = None if c["v"] is None else _t(c["v"], grad=True)
    sink = None if c["sink"] is None else _t(c["sink"], grad=True)
    cu = None if c["cu"] is None else _t(c["cu"], "int32")
    out, lse = paddle_fa4.block_sparse_attention(
        q, k, v, _t(c["ids"], "int32"), block_size=c["bs"], causal=c["causal"], cu_seqlens=cu, sink=sink,
        dv=c["Dv"] if v is None else None, return_lse=True, plan=plan, backend="reference", **kw)
    (out * _t(c["dout"])).sum().backward()
    grad = lambda t: None if t is None or t.grad is None else t.grad.numpy()  # noqa: E731
    return out.numpy(), lse.numpy(), grad(q), grad(k), grad(v), grad(sink)


def _oracle(c):
    mask = orc.token_mask(c["ids"], c["bs"], c["causal"], c["cu"])
    v = c["k"][..., :c["Dv"]] if c["v"] is None else c["v"]
    out, lse, _ = orc.attention(c["q"], c["k"], v, mask, sink=c["sink"])
    dq, dk, dv, dsink = orc.gradients(c["q"], c["k"], c["v"], mask, c["dout"], sink=c["sink"],
                                      latent_dv=c["Dv"] if c["v"] is None else None)
    return out, lse, dq, dk, dv, dsink


def _close(name, got, want, atol=2e-5, rtol=2e-4):
    if want is None:
        assert got is None, name
        return
    want = np.asarray(want)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), f"{name}: -inf pattern differs"
    np.testing.assert_allclose(got[fin], want[fin], atol=atol, rtol=rtol, err_msg=name)
    assert np.array_equal(got[~fin], want[~fin]), f"{name}: non-finite values differ"


CASES = [
    pytest.param(dict(B=1, S=70, Hq=4, Hkv=1, Dk=16, Dv=16, topk=3, bs=16), id="mqa-s70-bs16"),
    pytest.param(dict(B=2, S=53, Hq=4, Hkv=2, Dk=8, Dv=12, topk=4, bs=16, cu=[0, 7, 30, 30, 53]),
                 id="gqa-docs-empty-doc-dv!=dk"),
    pytest.param(dict(B=1, S=150, Hq=2, Hkv=1, Dk=8, Dv=8, topk=2, bs=64, cu=[0, 37, 150]),
                 id="bs64-bos37-s150"),
    pytest.param(dict(B=2, S=40, Hq=6, Hkv=3, Dk=8, Dv=8, topk=3, bs=16, per_kv=True,
                      cu=[[0, 19, 40], [0, 1, 40]]), id="per-kv-head-ids-2d-cu"),
    pytest.param(dict(B=1, S=48, Hq=4, Hkv=2, Dk=8, Dv=8, topk=2, bs=16, causal=False, cu=[0, 21, 48]),
                 id="non-causal-doc-tail"),
    pytest.param(dict(B=1, S=45, Hq=4, Hkv=1, Dk=8, Dv=8, topk=3, bs=16, sink=True, cu=[0, 5, 45]),
                 id="sink"),
    pytest.param(dict(B=1, S=40, Hq=8, Hkv=1, Dk=40, Dv=32, topk=3, bs=16, latent=True, sink=True),
                 id="mla-latent-sink"),
    pytest.param(dict(B=1, S=33, Hq=2, Hkv=1, Dk=8, Dv=8, topk=2, bs=16, pad=0.6, dup=0.5), id="mostly-padding"),
]


@pytest.mark.parametrize("kw", CASES)
def test_matches_fp64_oracle(kw):
    c = _case(0, **kw)
    got, want = _run(c), _oracle(c)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsink"), got, want):
        _close(name, g, w)


def test_first_rows_see_fewer_blocks():
    """Rows at the start of a document have fewer live blocks than topk: ids past the query select nothing."""
    c = _case(1, B=1, S=64, Hq=2, Hkv=1, Dk=8, Dv=8, topk=4, bs=16, cu=[0, 10, 64], pad=0.0, dup=0.0)
    c["ids"][0, 10:26, 1:] = np.array([1, 2, 3])[None]  # rows 10..25 (doc rows 0..15): blocks 1..3 not live
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), _run(c), _oracle(c)):
        _close(name, g, w)


def test_empty_rows():
    """All-padding rows: out 0, lse -inf (the sink logit with a sink), zero gradients, no NaN."""
    for sink in (False, True):
        c = _case(2, B=1, S=40, Hq=4, Hkv=2, Dk=8, Dv=8, topk=2, bs=16, sink=sink)
        c["ids"][0, 5:9] = -1
        out, lse, dq, dk, dv, dsink = _run(c)
        assert not np.abs(out[0, 5:9]).any() and not np.abs(dq[0, 5:9]).any()
        want = np.broadcast_to(c["sink"][:, None], (4, 4)) if sink else np.full((4, 4), -np.inf)
        assert np.array_equal(lse[0, :, 5:9], want)
        assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))
        if sink:
            assert np.isfinite(dsink).all()


def test_sink_gradient_finite_differences():
    c = _case(3, B=1, S=30, Hq=2, Hkv=1, Dk=8, Dv=8, topk=2, bs=16, sink=True)
    dsink = _run(c)[5]
    eps = 1e-2
    for h in range(2):
        vals = []
        for sgn in (1, -1):
            c2 = dict(c, sink=c["sink"] + sgn * eps * np.eye(2, dtype=np.float32)[h])
            out = paddle_fa4.block_sparse_attention(_t(c2["q"]), _t(c2["k"]), _t(c2["v"]), _t(c2["ids"], "int32"),
                                                    block_size=16, sink=_t(c2["sink"]), backend="reference")
            vals.append(float((out.numpy().astype(np.float64) * c2["dout"]).sum()))
        np.testing.assert_allclose(dsink[h], (vals[0] - vals[1]) / (2 * eps), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
def test_equals_indexed_attention_over_blocks_to_indices(causal):
    """One document (bos = 0): block ids are global, so blocks_to_indices + indexed_attention see the same keys."""
    c = _case(4, B=2, S=70, Hq=4, Hkv=2, Dk=16, Dv=16, topk=3, bs=16, causal=causal)
    out, lse, dq, dk, dv, _ = _run(c)
    ids = _t(c["ids"], "int32")
    tokens = paddle_fa4.blocks_to_indices(ids.unsqueeze(1), block_size=16, seqlen_k=70, causal=causal,
                                          backend="reference")
    q, k, v = (_t(c[n], grad=True) for n in ("q", "k", "v"))
    o2, l2 = paddle_fa4.indexed_attention(q, k, v, tokens, return_lse=True, backend="reference")
    (o2 * _t(c["dout"])).sum().backward()
    for name, a, b in (("out", out, o2.numpy()), ("lse", lse, l2.numpy()), ("dq", dq, q.grad.numpy()),
                       ("dk", dk, k.grad.numpy()), ("dv", dv, v.grad.numpy())):
        _close(name, a, b, atol=1e-5, rtol=1e-5)


def test_slot_order_and_determinism():
    """Shuffling the slots of every row, or running twice, gives bitwise the same results."""
    c = _case(5, B=1, S=50, Hq=4, Hkv=1, Dk=8, Dv=8, topk=4, bs=16, sink=True, cu=[0, 13, 50])
    a, b = _run(c), _run(c)
    perm = np.random.default_rng(0).permuted(c["ids"], axis=-1)
    s = _run(dict(c, ids=perm))
    for x, y, z in zip(a, b, s):
        assert np.array_equal(x, y) and np.array_equal(x, z)


def test_stop_gradient_inputs_get_none():
    c = _case(6, B=1, S=20, Hq=2, Hkv=1, Dk=8, Dv=8, topk=2, bs=16)
    q, k, v = _t(c["q"], grad=True), _t(c["k"]), _t(c["v"])
    out = paddle_fa4.block_sparse_attention(q, k, v, _t(c["ids"], "int32"), block_size=16,
                                            backend="reference")
    out.sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None


# ---------------------------------------------------------------------------------------------
# plan


PLAN_CASES = [
    pytest.param(dict(B=1, S=70, G=4, topk=3, bs=16), id="gqa-wq16"),
    pytest.param(dict(B=2, S=53, G=8, topk=4, bs=16, cu=[0, 7, 30, 30, 53]), id="docs-wq8"),
    pytest.param(dict(B=2, S=40, G=2, topk=3, bs=16, per_kv=3, cu=[[0, 19, 40], [0, 1, 40]]), id="per-kv-wq32"),
    pytest.param(dict(B=1, S=150, G=128, topk=2, bs=64, cu=[0, 37, 150], causal=False), id="mqa128-wq1-noncausal"),
    pytest.param(dict(B=1, S=40, G=1, topk=2, bs=16), id="mha-wq32"),
]


@pytest.mark.parametrize("kw", PLAN_CASES)
def test_plan_matches_numpy_plan(kw):
    rng = np.random.default_rng(7)
    causal, cu = kw.get("causal", True), kw.get("cu")
    ids = orc.random_ids(rng, kw["B"], kw["S"], kw["topk"], kw["bs"], causal, cu, heads=kw.get("per_kv"))
    plan = paddle_fa4.block_sparse_plan(_t(ids, "int32"), heads_per_kv=kw["G"], block_size=kw["bs"], causal=causal,
                                        cu_seqlens=None if cu is None else _t(cu, "int32"))
    want = orc.plan_arrays(ids, kw["bs"], kw["G"], causal, cu)
    assert plan.window_queries == orc.tile_queries(kw["G"])
    for name, w in want.items():
        got = getattr(plan, name).numpy()
        assert got.shape == w.shape, name
        assert np.array_equal(got, w), name
    # round trip: every (tile, slot) pair appears once in the key-major transpose
    n = int(plan.key_ptr.numpy()[-1])
    assert n == int(plan.tile_count.numpy().sum())


@pytest.mark.parametrize("kw", PLAN_CASES)
def test_sm100_plan_matches_numpy_plan(kw, monkeypatch):
    """A plan built "on an SM100 GPU" (its query tile, tile_queries(G, 100, Dv)) equals the numpy builder's at that
    window -- the plan bench/bench_block_sparse.py hands the SM100 kernels (orc.plan_arrays(window=...))."""
    from cute_kernels.block_sparse.config import tile_queries
    from paddle_fa4 import backend as backend_mod

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda t: 100)
    rng = np.random.default_rng(7)
    causal, cu = kw.get("causal", True), kw.get("cu")
    ids = orc.random_ids(rng, kw["B"], kw["S"], kw["topk"], kw["bs"], causal, cu, heads=kw.get("per_kv"))
    plan = paddle_fa4.block_sparse_plan(_t(ids, "int32"), heads_per_kv=kw["G"], block_size=kw["bs"], causal=causal,
                                        cu_seqlens=None if cu is None else _t(cu, "int32"), head_dim_v=128)
    wq = tile_queries(kw["G"], 100, 128)
    assert plan.window_queries == wq
    for name, w in orc.plan_arrays(ids, kw["bs"], kw["G"], causal, cu, window=wq).items():
        got = getattr(plan, name).numpy()
        assert got.shape == w.shape and np.array_equal(got, w), name


@pytest.mark.parametrize("kw", [dict(B=2, S=2048, G=8, topk=3), dict(B=1, S=700, G=64, topk=3, cu=[0, 300, 700])],
                         ids=["gqa8-b2", "mqa64-docs"])
def test_key_order_is_a_safe_tile_order(kw):
    """Note [tile-ordered segments] (cute_kernels/block_sparse/bwd_dkdv_sm90.py): the plan's key_order equals the
    numpy one; per set it is a permutation of the CTA ids; each key block's segments come in k order (for all k,
    so a segment waits only on a CTA launched before it whatever min_seg a launch uses); the live segments are
    sorted by their first query tile, the others last; and it is not the key-block-major order (every query also
    selects block 0, split into several segments that interleave with the other blocks')."""
    from cute_kernels.block_sparse.config import ORDERED_MIN_SEGMENT_PAIRS, SEGMENTS, segment_split

    rng = np.random.default_rng(3)
    cu = kw.get("cu")
    ids = orc.random_ids(rng, kw["B"], kw["S"], kw["topk"], 64, True, cu, pad=0.0, dup=0.0)
    ids[..., -1] = 0
    plan = paddle_fa4.block_sparse_plan(_t(ids, "int32"), heads_per_kv=kw["G"], block_size=64,
                                        cu_seqlens=None if cu is None else _t(cu, "int32"))
    want = orc.plan_arrays(ids, 64, kw["G"], True, cu)
    order, ptr, tile = plan.key_order.numpy(), plan.key_ptr.numpy(), plan.key_tile.numpy()
    assert np.array_equal(order, want["key_order"])
    ns, kcap = plan.key_start.shape
    assert order.shape == (ns, kcap * SEGMENTS)
    for s in range(ns):
        assert np.array_equal(np.sort(order[s]), np.arange(kcap * SEGMENTS))
        pos = np.argsort(order[s]).reshape(kcap, SEGMENTS)  # pos[r, k]: where segment k of block r runs
        assert (np.diff(pos, axis=1) > 0).all()
        firsts, live = [], []
        for x in order[s]:
            r, k = divmod(int(x), SEGMENTS)
            p0, p1 = int(ptr[s * kcap + r]), int(ptr[s * kcap + r + 1])
            seg_len, nseg = segment_split(p1 - p0, ORDERED_MIN_SEGMENT_PAIRS)
            live.append(k < nseg)
            firsts.append(int(tile[p0 + k * seg_len]) if k < nseg else -1)
        n_live = sum(live)
        assert all(live[:n_live]) and not any(live[n_live:])
        assert all(a <= b for a, b in zip(firsts[:n_live], firsts[1:n_live]))
        assert max(divmod(int(x), SEGMENTS)[1] for x in order[s][:n_live]) >= 2  # block 0 is split
        assert not np.array_equal(order[s][:n_live], np.sort(order[s][:n_live]))


def test_plan_reuse_and_mismatch():
    c = _case(8, B=1, S=40, Hq=4, Hkv=1, Dk=8, Dv=8, topk=2, bs=16)
    ids = _t(c["ids"], "int32")
    plan = paddle_fa4.block_sparse_plan(ids, heads_per_kv=4, block_size=16)
    for x, y in zip(_run(c), _run(c, plan=plan)):
        assert np.array_equal(x, y)
    other = paddle_fa4.block_sparse_plan(ids, heads_per_kv=2, block_size=16)
    with pytest.raises(ValueError, match="plan was built for another selection"):
        _run(c, plan=other)
    with pytest.raises(TypeError, match="plan must be a BlockSparsePlan"):
        _run(c, plan=object())


# ---------------------------------------------------------------------------------------------
# validation


def _args(**over):
    rng = np.random.default_rng(9)
    a = dict(q=_t(rng.standard_normal((1, 20, 4, 8))), k=_t(rng.standard_normal((1, 20, 2, 8))),
             v=_t(rng.standard_normal((1, 20, 2, 8))), block_ids=_t(np.zeros((1, 20, 2)), "int32"), block_size=16)
    a.update(over)
    return a


@pytest.mark.parametrize("over, exc, match", [
    (dict(block_ids=_t(np.zeros((1, 20, 2)), "float32")), TypeError, "block_ids must be int32 \\(int64 is accepted"),
    (dict(block_ids=_t(np.full((1, 20, 2), 2), "int32")), ValueError, "block of the query's document"),
    (dict(block_ids=_t(np.full((1, 20, 2), -2), "int32")), ValueError, "block of the query's document"),
    (dict(block_ids=_t(np.zeros((1, 19, 2)), "int32")), ValueError, "block_ids must have shape"),
    (dict(block_size=48), ValueError, "block_size must be one of"),
    (dict(k=_t(np.zeros((1, 20, 3, 8)))), ValueError, "multiple of k's head count"),
    (dict(v=None), ValueError, "dv must be given"),
    (dict(v=None, dv=9), ValueError, "dv must be <= 8"),
    (dict(dv=4), ValueError, "disagrees with v's head dim"),
    (dict(v=_t(np.zeros((1, 20, 2, 8)), "float16")), TypeError, "v must have q's dtype"),
    (dict(sink=_t(np.zeros(2))), ValueError, "sink must have shape"),
    (dict(sink=_t(np.zeros(4), "float64")), TypeError, "sink must be float32"),
    (dict(cu_seqlens=_t([0, 5, 19], "int32")), ValueError, "end at S = 20"),
    (dict(cu_seqlens=_t([[0, 5, 20]] * 2, "int32")), ValueError, "cu_seqlens must be"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_validation(over, exc, match):
    with pytest.raises(exc, match=match):
        paddle_fa4.block_sparse_attention(**_args(**over), backend="reference")


def test_cute_backend_on_cpu_raises():
    with pytest.raises(NotImplementedError, match="backend='cute'"):
        paddle_fa4.block_sparse_attention(**_args(), backend="cute")


def test_ids_of_a_short_document_checked_per_document():
    """Ids are checked against the query's own document: 15 tokens at block_size 16 have block 0 only."""
    ids = np.zeros((1, 20, 1), np.int32)
    ids[0, 15:] = 1  # rows of doc [5, 20): 15 tokens -> blocks 0 only
    with pytest.raises(ValueError, match="block of the query's document"):
        paddle_fa4.block_sparse_attention(**_args(block_ids=_t(ids, "int32"), cu_seqlens=_t([0, 5, 20], "int32")),
                                          backend="reference")


def test_zero_size_and_topk_zero():
    out, lse = paddle_fa4.block_sparse_attention(**_args(block_ids=_t(np.zeros((1, 20, 0)), "int32")),
                                                 return_lse=True, backend="reference")
    assert out.shape == [1, 20, 4, 8] and not out.numpy().any() and np.isneginf(lse.numpy()).all()
    rng = np.random.default_rng(0)
    out = paddle_fa4.block_sparse_attention(_t(rng.standard_normal((0, 5, 4, 8))), _t(np.zeros((0, 5, 2, 8))),
                                            _t(np.zeros((0, 5, 2, 8))), _t(np.zeros((0, 5, 2)), "int32"), block_size=16,
                                            backend="reference")
    assert out.shape == [0, 5, 4, 8]


@pytest.mark.parametrize("module", ["paddle_fa4.block_sparse"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_cute_glue_refuses_what_it_does_not_cover():
    """The reasons auto falls back on (and backend='cute' raises with)."""
    from paddle_fa4._cute import block_sparse as glue
    from paddle_fa4.block_sparse import BlockSparseSpec

    base = dict(B=1, S=128, Hq=32, Hkv=4, Dk=128, Dv=128, topk=16, block_size=64, per_kv_head=False, latent=False,
                causal=True, has_sink=False, num_docs=1, scale=0.1, dtype="bfloat16", deterministic=True)
    assert glue.unsupported_reason(90, BlockSparseSpec(**base), needs_grad=False) is None
    assert glue.unsupported_reason(90, BlockSparseSpec(**base), needs_grad=True) is None
    assert "backward at head dim 256" in glue.unsupported_reason(
        90, BlockSparseSpec(**dict(base, Dk=256, Dv=256)), needs_grad=True)
    assert glue.unsupported_reason(90, BlockSparseSpec(**dict(base, Dk=256, Dv=256)), needs_grad=False) is None
    # SM100: the token path (Note [SM100 token path]), sinks folded in around it; no kernel at all for 12.0
    assert glue.unsupported_reason(100, BlockSparseSpec(**base), needs_grad=True) is None
    assert glue.unsupported_reason(100, BlockSparseSpec(**dict(base, has_sink=True)), needs_grad=True) is None
    assert "compute capability 100" in glue.unsupported_reason(100, BlockSparseSpec(**dict(mla_base(base))),
                                                               needs_grad=False)
    assert "compute capability 120" in glue.unsupported_reason(120, BlockSparseSpec(**base), needs_grad=False)
    # exact_delta: the SM90 dQ kernels take it, and SM100's at head dim 128; SM100's token-path backward
    # (other head dims) does not (its forward does)
    exact = BlockSparseSpec(**dict(base, exact_delta=True))  # head dim 128
    assert glue.unsupported_reason(90, exact, needs_grad=True) is None
    assert glue.unsupported_reason(100, exact, needs_grad=False) is None
    assert glue.unsupported_reason(100, exact, needs_grad=True) is None
    exact64 = BlockSparseSpec(**dict(base, Dk=64, Dv=64, exact_delta=True))
    assert glue.unsupported_reason(90, exact64, needs_grad=True) is None
    assert "exact_delta=True at head dim 64" in glue.unsupported_reason(100, exact64, needs_grad=True)
    assert glue.unsupported_reason(100, dataclasses.replace(exact64, exact_delta=False), needs_grad=True) is None
    # the absorbed-MLA latent: the two production (Dk, Dv), forward and backward
    mla = dict(base, Hq=64, Hkv=1, Dk=576, Dv=512, latent=True, has_sink=True)
    for grad in (False, True):
        assert glue.unsupported_reason(90, BlockSparseSpec(**mla), needs_grad=grad) is None
        assert glue.unsupported_reason(90, BlockSparseSpec(**dict(mla, Dk=512, Dv=448)), needs_grad=grad) is None
    assert "Dk 576 / Dv 448" in glue.unsupported_reason(90, BlockSparseSpec(**dict(mla, Dv=448)), needs_grad=False)
    for over, fragment in ((dict(latent=True, Dv=64), "absorbed-MLA"), (dict(block_size=16), "block_size 16"),
                           (dict(Dv=64), "head dims"), (dict(dtype="float32"), "dtype"),
                           (dict(has_sink=True, scale=0.0), "softmax_scale 0")):
        assert fragment in glue.unsupported_reason(90, BlockSparseSpec(**dict(base, **over)), needs_grad=False)


def test_peaked_rows_bf16():
    """Key 0 as an attention sink (every row selects block 0 and puts ~0.995 of its weight on key 0), bf16
    inputs: the reference's D = rowsum(P dP) keeps dq / dk within 1e-2 of the fp64 gradients, where D from
    the bf16-rounded out (rowsum(dO * O)) is off by ~1 relative (tests/cpu/test_attention_bwd.py has the
    dense version with both numbers)."""
    c = _case(3, B=1, S=192, Hq=4, Hkv=1, Dk=64, Dv=64, topk=3, bs=16, pad=0.0, dup=0.0)
    c["ids"][..., 0] = 0
    rng = np.random.default_rng(4)
    u = rng.standard_normal(64)
    u /= np.linalg.norm(u)
    c["q"] = c["q"] - (c["q"] @ u)[..., None] * u + u
    c["k"][:, 0] = 12.0 * 8.0 * u  # logit q . k_0 / sqrt(64) = 12
    bf = lambda a: paddle.to_tensor(a).astype("bfloat16")  # noqa: E731
    for name in ("q", "k", "v", "dout"):
        c[name] = bf(c[name]).astype("float32").numpy()
    q, k, v = (bf(c[n]) for n in ("q", "k", "v"))
    for t in (q, k, v):
        t.stop_gradient = False
    out, lse = paddle_fa4.block_sparse_attention(q, k, v, _t(c["ids"], "int32"), block_size=16, return_lse=True,
                                                 backend="reference")
    (out.astype("float32") * _t(c["dout"])).sum().backward()
    want = _oracle(c)
    mask = orc.token_mask(c["ids"], 16, True, None)
    assert mask[0, 0, 1:, 0].all()  # every row after the first sees key 0
    p0 = np.exp(np.einsum("ihd,d->hi", c["q"][0], c["k"][0, 0, 0]) / 8.0 - lse.numpy()[0])[:, 1:]
    assert p0.min() > 0.98, p0.min()
    for name, t, w in zip(("dq", "dk", "dv"), (q, k, v), want[2:5]):
        g = t.grad.astype("float32").numpy()
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel <= 1e-2, (name, rel)


# ---------------------------------------------------------------------------------------------
# SM100: the CuTe backend's token path (Note [SM100 token path] in paddle_fa4/_cute/block_sparse.py)


def mla_base(base):
    """The latent (v=None) variant of a spec dict: the SM100 token path refuses it by name."""
    return dict(base, Hq=64, Hkv=1, Dk=576, Dv=512, latent=True)


def _spec(c, dtype="float32"):
    from paddle_fa4 import block_sparse as bs_mod

    v = None if c["v"] is None else _t(c["v"], dtype)
    cu = None if c["cu"] is None else _t(c["cu"], "int32")
    sink = None if c["sink"] is None else _t(c["sink"])
    return bs_mod._validate(_t(c["q"], dtype), _t(c["k"], dtype), v, _t(c["ids"], "int32"), c["bs"], None,
                            c["causal"], cu, sink, c["Dv"] if v is None else None, True, True, None)


@pytest.mark.parametrize("case,fragment", [
    (dict(latent=True, Dv=8), "latent"),
    (dict(Dv=8), "Dk 16 != Dv 8"), (dict(Hq=8, Hkv=1, Dk=20, Dv=20), "SM100 token path"),
])
def test_sm100_token_path_names_what_it_does_not_cover(case, fragment):
    pytest.importorskip("cutlass")
    from paddle_fa4._cute import block_sparse as glue

    kw = dict(B=1, S=48, Hq=4, Hkv=2, Dk=16, Dv=16, topk=3, bs=16)
    kw.update(case)
    c = _case(0, **kw)
    reason = glue.unsupported_reason(100, _spec(c, "bfloat16"), True)
    assert reason is not None and fragment in reason, reason
    ok = _case(0, B=1, S=48, Hq=4, Hkv=2, Dk=64, Dv=64, topk=3, bs=16)
    assert glue.unsupported_reason(100, _spec(ok, "bfloat16"), True) is None
    assert glue.unsupported_reason(103, _spec(ok, "bfloat16"), True) is None
    sunk = _case(0, B=1, S=48, Hq=4, Hkv=2, Dk=64, Dv=64, topk=3, bs=16, sink=True)  # folded in around it
    assert glue.unsupported_reason(100, _spec(sunk, "bfloat16"), True) is None
    docs = _case(0, B=1, S=48, Hq=4, Hkv=2, Dk=64, Dv=64, topk=3, bs=16, cu=[0, 20, 48])
    assert glue.unsupported_reason(100, _spec(docs, "bfloat16"), True) is None
    assert "bf16" in glue.unsupported_reason(100, _spec(ok), True)  # float32: the indexed kernels' dtype
    assert "compute capability 120" in glue.unsupported_reason(120, _spec(ok, "bfloat16"), True)


@pytest.mark.parametrize("per_kv,causal,cu,sink", [(False, True, None, False), (True, True, None, False),
                                                   (False, False, None, False), (False, True, [0, 37, 70], False),
                                                   (True, False, [[0, 19, 70], [0, 1, 70]], False),
                                                   (False, True, [0, 37, 70], True), (True, False, None, True)],
                         ids=["shared-causal", "per-kv-causal", "shared-noncausal", "docs-bos37",
                              "per-kv-noncausal-2d-docs", "docs-bos37-sink", "per-kv-noncausal-sink"])
def test_sm100_token_path_matches_the_reference(per_kv, causal, cu, sink, monkeypatch):
    """The SM100 forward / backward glue with the indexed kernels replaced by the indexed reference: ids ->
    token rows (the glue's own Paddle ops) -> indexed attention gives the block-sparse reference's out,
    lse and gradients (the token rule with documents at bos % 16 != 0, layouts, per-kv-head ids, the plan);
    with a sink folded in around it (Note [sink on the token path]: out, lse, dq / dk / dv and dsink, also
    for the rows padding leaves without keys)."""
    from paddle_fa4._cute import block_sparse as glue
    from paddle_fa4.reference import block_sparse as block_sparse_ref
    from paddle_fa4._cute import indexed as indexed_glue
    from paddle_fa4.reference import indexed as ref_indexed

    monkeypatch.setattr(glue, "arch_of", lambda t: 100)
    monkeypatch.setattr(indexed_glue, "forward", lambda sp, q, k, v, idx, plan: ref_indexed.forward(sp, q, k, v, idx)[:2]
                        + (("indexed plan", idx),))
    def fake_backward(sp, q, k, v, out, lse, dout, plan, return_delta=False):  # delta: what the dQ kernel writes
        grads = tuple(ref_indexed.backward(sp, q, k, v, out, lse, dout, plan[1]))
        delta = (dout.astype("float32") * out.astype("float32")).sum(axis=-1).transpose([0, 2, 1])
        return grads + (delta,) if return_delta else grads

    monkeypatch.setattr(indexed_glue, "backward", fake_backward)
    c = _case(7, B=2, S=70, Hq=4, Hkv=2, Dk=16, Dv=16, topk=3, bs=16, causal=causal, per_kv=per_kv, pad=0.3, dup=0.3,
              cu=cu, sink=sink)
    if sink:
        c["ids"][0, ..., 5:9, :] = -1  # rows without keys: lse = sink, out 0
    spec = _spec(c)
    q, k, v, ids, dout = _t(c["q"]), _t(c["k"]), _t(c["v"]), _t(c["ids"], "int32"), _t(c["dout"])
    cu_t = None if cu is None else _t(cu, "int32")
    s_t = _t(c["sink"]) if sink else None
    out, lse, plan = glue.forward(spec, q, k, v, ids, cu_t, s_t, None)
    assert isinstance(plan, glue._TokenPlan)
    assert plan.tokens.shape == ([2, 2, 70, 48] if per_kv else [2, 70, 48])
    want_out, want_lse, _ = block_sparse_ref.forward(spec, q, k, v, ids, cu_t, s_t)
    grads = glue.backward(spec, q, k, v, ids, cu_t, s_t, out, lse, dout, plan)
    want = block_sparse_ref.backward(spec, q, k, v, ids, cu_t, s_t, want_out, want_lse, dout)
    assert (grads[3] is None and want[3] is None) if not sink else (grads[3] is not None and want[3] is not None)
    if sink:  # exactly the sink, and out 0, on the rows without keys
        assert np.array_equal(lse.numpy()[0][:, 5:9], np.broadcast_to(c["sink"][:, None], (4, 4)))
        assert not out.numpy()[0, 5:9].any()
    named = [("out", out, want_out), ("lse", lse, want_lse), ("dq", grads[0], want[0]), ("dk", grads[1], want[1]),
             ("dv", grads[2], want[2])] + ([("dsink", grads[3], want[3])] if sink else [])
    for name, a, b in named:
        _close(name, a.numpy(), b.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("S,topk", [(0, 2), (20, 0)], ids=["S0", "topk0"])
def test_sm100_token_path_without_work(S, topk, monkeypatch):
    """Zero-size or topk-0 calls on the SM100 path launch nothing: out 0, lse -inf, zero gradients."""
    from paddle_fa4._cute import block_sparse as glue
    from paddle_fa4._cute import indexed as indexed_glue

    monkeypatch.setattr(glue, "arch_of", lambda t: 100)
    monkeypatch.setattr(indexed_glue, "forward", lambda *a: pytest.fail("launched"))
    c = _case(2, B=1, S=S, Hq=2, Hkv=1, Dk=8, Dv=8, topk=1, bs=16)
    c["ids"] = np.ascontiguousarray(c["ids"][..., :topk])
    spec = _spec(c)
    q, k, v, ids, dout = _t(c["q"]), _t(c["k"]), _t(c["v"]), _t(c["ids"], "int32"), _t(c["dout"])
    out, lse, plan = glue.forward(spec, q, k, v, ids, None, None, None)
    dq, dk, dv, dsink = glue.backward(spec, q, k, v, ids, None, None, out, lse, dout, plan)
    assert out.shape == [1, S, 2, 8] and not out.numpy().any() and np.isneginf(lse.numpy()).all()
    assert dsink is None and not any(g.numpy().any() for g in (dq, dk, dv))


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_sm100_kernel_forward_then_token_backward(sink, monkeypatch):
    """SM100 with a case the block-sparse tcgen05 forward takes (bf16, Dk = Dv = 64, block 64): the glue
    builds the plan with SM100's query tile (G 8: 32 queries, two Q stages), hands the kernel (stubbed with
    the reference here) an SM100 config, and the backward runs the token path from that forward's out / lse
    (indexed kernels stubbed with the indexed reference): gradients as the block-sparse reference's. A plan
    with another query tile (built on the CPU: the SM90 tile) is refused by name before any launch."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse import launch
    from paddle_fa4 import backend as backend_mod
    from paddle_fa4._cute import block_sparse as glue
    from paddle_fa4.reference import block_sparse as block_sparse_ref
    from paddle_fa4._cute import indexed as indexed_glue
    from paddle_fa4._plan.block_sparse import build_plan
    from paddle_fa4.reference import indexed as ref_indexed

    c = _case(5, B=1, S=150, Hq=8, Hkv=1, Dk=64, Dv=64, topk=3, bs=64, cu=[0, 37, 150], sink=sink)
    spec = _spec(c, "bfloat16")
    assert glue.unsupported_reason(100, spec, needs_grad=False) is None
    assert glue.unsupported_reason(103, spec, needs_grad=True) is None  # backward: the token path
    q, k, v, ids = tuple(_t(c[n], "bfloat16") for n in ("q", "k", "v")) + (_t(c["ids"], "int32"),)
    cu_t, s_t, dout = _t(c["cu"], "int32"), _t(c["sink"]) if sink else None, _t(c["dout"], "bfloat16")
    seen = {}

    def fake_run_fwd(cfg, q_, k_, v_, tile_start, tile_mask, tile_count, q_limit, sink_, out, lse, scale):
        seen.update(cfg=cfg, tiles=tile_count.shape)
        o, l, _ = block_sparse_ref.forward(spec, q, k, v, ids, cu_t, s_t)
        paddle.assign(o.astype(out.dtype), out)
        paddle.assign(l, lse)

    monkeypatch.setattr(glue, "arch_of", lambda t: 100)
    monkeypatch.setattr(launch, "run_fwd", fake_run_fwd)
    with pytest.raises(ValueError, match="head_dim_v=64"):  # a CPU-built plan tiles 8 queries
        glue.forward(spec, q, k, v, ids, cu_t, s_t, build_plan(ids, heads_per_kv=8, block_size=64, causal=True,
                                                               cu_seqlens=cu_t))
    assert not seen
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda t: 100)  # the plan is built "on the GPU"
    out, lse, plan = glue.forward(spec, q, k, v, ids, cu_t, s_t, None)
    assert seen["cfg"].arch == 100 and seen["cfg"].window_queries == plan.window_queries == 32
    assert seen["tiles"] == [1, 5] and seen["cfg"].has_sink == sink
    monkeypatch.setattr(indexed_glue, "backward", lambda sp, q_, k_, v_, o, l, do, pl, return_delta=False: (
        tuple(ref_indexed.backward(sp, q_, k_, v_, o, l, do, pl)) + (
            (do.astype("float32") * o.astype("float32")).sum(axis=-1).transpose([0, 2, 1]),) if return_delta else
        tuple(ref_indexed.backward(sp, q_, k_, v_, o, l, do, pl))))
    monkeypatch.setattr(indexed_glue, "_plan_for", lambda sp, idx, pl: idx)  # the reference takes the rows
    grads = glue.backward(spec, q, k, v, ids, cu_t, s_t, out, lse, dout, plan)
    want = block_sparse_ref.backward(spec, q, k, v, ids, cu_t, s_t, out, lse, dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, want):
        assert (a is None) == (b is None) == (name == "dsink" and not sink), name
        if a is not None:
            _close(name, a.astype("float32").numpy(), b.astype("float32").numpy(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("exact", [False, True], ids=["delta-from-out", "exact-delta"])
@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_sm100_kernel_forward_and_backward(sink, exact, monkeypatch):
    """SM100 at head dim 128 (bf16, block 64): the forward and both backward kernels are the block-sparse tcgen05
    ones (bwd_dq_sm100.py, bwd_dkdv_sm100.py; stubbed here with the block-sparse reference): the glue hands each an
    SM100 config whose query tile is the plan's (the forward's, G 8: 32 queries), delta from the dQ kernel to the
    dK/dV kernel and the sink gradient, and zero-filled dk / dv; exact_delta reaches the dQ kernel's config
    (Note [SM100 exact delta]); head dim 64 takes the token path by name."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse import launch
    from paddle_fa4 import backend as backend_mod
    from paddle_fa4._cute import block_sparse as glue
    from paddle_fa4.reference import block_sparse as block_sparse_ref

    c = _case(7, B=1, S=150, Hq=8, Hkv=1, Dk=128, Dv=128, topk=3, bs=64, cu=[0, 37, 150], sink=sink)
    spec = dataclasses.replace(_spec(c, "bfloat16"), exact_delta=exact)
    assert glue.unsupported_reason(100, spec, needs_grad=True) is None
    assert glue._sm100_backward_reason(spec) is None
    assert "head dim 64" in glue._sm100_backward_reason(_spec(dict(c, q=c["q"][..., :64], k=c["k"][..., :64],
                                                                   v=c["v"][..., :64]), "bfloat16"))
    assert glue._sm100_backward_reason(dataclasses.replace(spec, exact_delta=True)) is None  # bwd_dq_sm100.py's
    q, k, v, ids = tuple(_t(c[n], "bfloat16") for n in ("q", "k", "v")) + (_t(c["ids"], "int32"),)
    cu_t, s_t, dout = _t(c["cu"], "int32"), _t(c["sink"]) if sink else None, _t(c["dout"], "bfloat16")
    want = None
    seen = {}

    def fake_run_fwd(cfg, q_, k_, v_, tile_start, tile_mask, tile_count, q_limit, sink_, out, lse, scale):
        seen.update(fwd=cfg)
        o, l, _ = block_sparse_ref.forward(spec, q, k, v, ids, cu_t, s_t)
        paddle.assign(o.astype(out.dtype), out)
        paddle.assign(l, lse)

    def fake_dq(cfg, q_, k_, v_, out, dout_, lse, delta, tile_start, tile_mask, tile_count, q_limit, dq, scale):
        seen.update(dq=cfg, dq_tiles=list(tile_count.shape))
        paddle.assign(want[0].astype(dq.dtype), dq)
        d = (dout_.astype("float32") * out.astype("float32")).sum(axis=-1).transpose([0, 2, 1])
        paddle.assign(d, delta)

    def fake_dkdv(cfg, q_, k_, v_, dout_, lse, delta, *rest, key_order=None):
        dk, dv = rest[8], rest[9]
        zero = not any(t.astype("float32").abs().sum().item() for t in (dk, dv))
        seen.update(kv=cfg, kv_zero=zero)
        paddle.assign(want[1].astype(dk.dtype), dk)
        paddle.assign(want[2].astype(dv.dtype), dv)

    monkeypatch.setattr(glue, "arch_of", lambda t: 100)
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda t: 100)  # the plan is built "on the GPU"
    monkeypatch.setattr(launch, "run_fwd", fake_run_fwd)
    monkeypatch.setattr(launch, "run_bwd_dq", fake_dq)
    monkeypatch.setattr(launch, "run_bwd_dkdv", fake_dkdv)
    out, lse, plan = glue.forward(spec, q, k, v, ids, cu_t, s_t, None)
    want = block_sparse_ref.backward(spec, q, k, v, ids, cu_t, s_t, out, lse, dout)
    grads = glue.backward(spec, q, k, v, ids, cu_t, s_t, out, lse, dout, plan)
    for key in ("fwd", "dq", "kv"):
        cfg = seen[key]
        assert cfg.arch == 100 and (cfg.head_dim, cfg.group) == (128, 8) and cfg.window_queries == plan.window_queries
    assert plan.window_queries == 32 and seen["dq_tiles"] == [1, 5] and seen["kv_zero"]
    assert seen["dq"].exact_delta == exact  # (run_bwd_dkdv builds its one dK/dV kernel whatever the flag)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, want):
        assert (a is None) == (b is None) == (name == "dsink" and not sink), name
        if a is not None:
            _close(name, a.astype("float32").numpy(), b.astype("float32").numpy(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dk,dv", [(576, 512), (512, 448)])
def test_sm90_latent_forward_glue(dk, dv, monkeypatch):
    """The SM90 glue of the latent (v=None) forward hands the kernel k alone (v None), a latent config with
    Dv = dv, an out of Dv columns and the plan it built; the kernel (stubbed here) is what the H200 tests
    check against the oracle (tests/gpu/test_block_sparse.py, test_latent_forward_matches_oracle)."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse import launch
    from paddle_fa4._cute import block_sparse as glue

    seen = {}

    def fake_run_fwd(cfg, q, k, v, tile_start, tile_mask, tile_count, q_limit, sink, out, lse, scale):
        seen.update(cfg=cfg, v=v, k=list(k.shape), out=list(out.shape), lse=list(lse.shape), sink=sink is not None,
                    count=tile_count.numpy().copy(), scale=scale)

    monkeypatch.setattr(glue, "arch_of", lambda t: 90)
    monkeypatch.setattr(launch, "run_fwd", fake_run_fwd)
    c = _case(4, B=1, S=130, Hq=16, Hkv=1, Dk=dk, Dv=dv, topk=3, bs=64, latent=True, sink=True)
    spec = _spec(c, "bfloat16")
    assert spec.latent and glue.unsupported_reason(90, spec, needs_grad=False) is None
    q, k = _t(c["q"], "bfloat16"), _t(c["k"], "bfloat16")
    out, lse, plan = glue.forward(spec, q, k, None, _t(c["ids"], "int32"), None, _t(c["sink"]), None)
    cfg = seen["cfg"]
    assert cfg.latent and (cfg.head_dim, cfg.head_dim_v, cfg.group, cfg.has_sink) == (dk, dv, 16, True)
    assert seen["v"] is None and seen["k"] == [1, 130, 1, dk] and seen["sink"]
    assert seen["out"] == [1, 130, 16, dv] and out.shape == [1, 130, 16, dv] and seen["lse"] == [1, 16, 130]
    assert seen["scale"] == pytest.approx(dk ** -0.5)
    want = orc.plan_arrays(c["ids"], 64, 16, keys=False)["tile_count"]
    assert np.array_equal(seen["count"], want)


@pytest.mark.parametrize("dk,dv", [(576, 512), (512, 448)])
def test_sm90_latent_backward_glue(dk, dv, monkeypatch):
    """The SM90 glue of the latent backward hands both kernels k alone (v, dv and the dv partial None), a
    latent config with Dv = dv, and returns the combined gradient in dk's place (dv None) with the sink
    gradient; the kernels (stubbed here) are checked against the oracle on the H200
    (tests/gpu/test_block_sparse.py, test_latent_backward_matches_oracle)."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse import launch
    from paddle_fa4._cute import block_sparse as glue

    seen = {}

    def fake_dq(cfg, q, k, v, out, dout, lse, delta, tile_start, tile_mask, tile_count, q_limit, dq, scale):
        seen.update(dq_cfg=cfg, dq_v=v, dout=list(dout.shape), dq=list(dq.shape))
        delta.fill_(0.5)

    def fake_dkdv(cfg, q, k, v, dout, lse, delta, *plan_and_outs, key_order=None):
        dkv, dvv, dk_part, dv_part, seg_sem, scale = plan_and_outs[8:]
        seen.update(kv_cfg=cfg, kv_v=v, dkv=list(dkv.shape), dvv=dvv, dk_part=list(dk_part.shape), dv_part=dv_part,
                    order=None if key_order is None else [list(key_order.shape), list(plan_and_outs[2].shape)])

    monkeypatch.setattr(glue, "arch_of", lambda t: 90)
    monkeypatch.setattr(launch, "run_bwd_dq", fake_dq)
    monkeypatch.setattr(launch, "run_bwd_dkdv", fake_dkdv)
    c = _case(5, B=1, S=130, Hq=16, Hkv=1, Dk=dk, Dv=dv, topk=3, bs=64, latent=True, sink=True)
    spec = _spec(c, "bfloat16")
    assert glue.unsupported_reason(90, spec, needs_grad=True) is None
    q, k = _t(c["q"], "bfloat16"), _t(c["k"], "bfloat16")
    from paddle_fa4._plan.block_sparse import build_plan

    plan = build_plan(_t(c["ids"], "int32"), heads_per_kv=16, block_size=64, causal=True, cu_seqlens=None)
    out = paddle.zeros([1, 130, 16, dv], dtype="bfloat16")
    lse = paddle.zeros([1, 16, 130], dtype="float32")
    dout = _t(c["dout"], "bfloat16")
    dq, dkv, dvv, dsink = glue.backward(spec, q, k, None, _t(c["ids"], "int32"), None, _t(c["sink"]), out, lse, dout,
                                        plan)
    for key in ("dq_cfg", "kv_cfg"):
        cfg = seen[key]
        assert cfg.latent and (cfg.head_dim, cfg.head_dim_v, cfg.group) == (dk, dv, 16) and not cfg.exact_delta
    assert seen["dq_v"] is None and seen["kv_v"] is None and seen["dvv"] is None and seen["dv_part"] is None
    assert seen["dout"] == [1, 130, 16, dv] and seen["dq"] == [1, 130, 16, dk]
    assert seen["dkv"] == [1, 130, 1, dk] and seen["dk_part"] == [1, 130, 1, dk]
    ks = seen["order"][1]  # the plan's key_order reaches the launcher: [NS, KCAP * SEGMENTS]
    assert seen["order"][0] == [ks[0], ks[1] * 8]
    assert dvv is None and list(dkv.shape) == [1, 130, 1, dk] and list(dq.shape) == [1, 130, 16, dk]
    # dsink = -sum exp(sink - lse) * delta, with lse 0 and delta 0.5 from the stubbed dQ kernel
    want = -0.5 * 130 * np.exp(c["sink"])
    np.testing.assert_allclose(dsink.numpy(), want, rtol=1e-5)


def test_exact_delta_reaches_the_dq_kernel(monkeypatch):
    """``exact_delta=True`` is validated (a bool), kept in the spec and handed to the SM90 dQ kernel's config
    (the dK / dV launcher gets the same config; its compile key drops the flag, launch.run_bwd_dkdv). The
    kernel's numerics on peaked rows: tests/gpu/test_block_sparse.py, test_exact_delta_on_peaked_rows."""
    pytest.importorskip("cutlass")
    from cute_kernels.block_sparse import launch
    from paddle_fa4 import block_sparse as bs_mod
    from paddle_fa4._cute import block_sparse as glue
    from paddle_fa4._plan.block_sparse import build_plan

    c = _case(6, B=1, S=100, Hq=8, Hkv=2, Dk=64, Dv=64, topk=2, bs=64)
    args = (_t(c["q"], "bfloat16"), _t(c["k"], "bfloat16"), _t(c["v"], "bfloat16"), _t(c["ids"], "int32"), 64, None,
            True, None, None, None, True, True, None)
    with pytest.raises(TypeError, match="exact_delta"):
        bs_mod._validate(*args, exact_delta="yes")
    seen = []
    monkeypatch.setattr(glue, "arch_of", lambda t: 90)
    monkeypatch.setattr(launch, "run_bwd_dq", lambda cfg, *a: (seen.append(cfg), a[6].fill_(0.0)))
    monkeypatch.setattr(launch, "run_bwd_dkdv", lambda cfg, *a, **kw: None)
    plan = build_plan(_t(c["ids"], "int32"), heads_per_kv=4, block_size=64, causal=True, cu_seqlens=None)
    out = paddle.zeros([1, 100, 8, 64], dtype="bfloat16")
    lse = paddle.zeros([1, 8, 100], dtype="float32")
    for flag in (False, True):
        spec = bs_mod._validate(*args, exact_delta=flag)
        assert spec.exact_delta is flag
        glue.backward(spec, args[0], args[1], args[2], args[3], None, None, out, lse, _t(c["dout"], "bfloat16"), plan)
        assert seen[-1].exact_delta is flag

"""Every public op under paddle.jit.to_static (docs/api.md, "Static graph"): SOT mode (the default)
runs the op eagerly between graph breaks with results bitwise equal to eager mode, and
full_graph=True raises NotImplementedError naming the op and the way out."""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_fa4  # noqa: E402
from paddle_fa4 import h2o  # noqa: E402
from tests.cpu.test_h2o import make_paged  # noqa: E402

REF = {"backend": "reference"}


def _qkv(seed=0, s=48, hq=4, hkv=2, d=16):
    rng = np.random.default_rng(seed)
    return [paddle.to_tensor(rng.standard_normal((1, s, h, d)).astype("float32")) for h in (hq, hkv, hkv)]


def _flat(x):
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    if hasattr(x, "numpy"):
        return [x.numpy()]
    return [x]


def _fa_fwd(q, k, v):
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=16, return_block_logit=True, **REF)
    return out * 2.0, lse, bl


def _fa_bwd(q, k, v):
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, **REF)
    return paddle_fa4.flash_attn_bwd(out * 0.5, q, k, v, out, lse, causal=True, **REF)


def _selection(q, k, v):
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=16, return_block_logit=True, **REF)
    w = paddle_fa4.block_log_weight(bl, lse)
    blk = paddle_fa4.select_topk_blocks(bl, lse, topk=2, num_kv_heads=2, sink_blocks=1, **REF)
    idx = paddle_fa4.blocks_to_indices(blk, block_size=16, seqlen_k=48, **REF)
    return w, blk, idx


def _chunked(q, k, v):
    return paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=2, block_size=16, num_kv_heads=2, chunk_q=16, **REF)


_IDX = paddle.to_tensor(np.random.default_rng(1).integers(-1, 48, size=(1, 48, 8)).astype("int32"))


def _indexed(q, k, v):
    idx = _IDX
    plan = paddle_fa4.indexed_attention_plan(idx, kv_len=48, heads_per_kv=2, **REF)
    return paddle_fa4.indexed_attention(q, k, v, idx, plan=plan, **REF), paddle_fa4.indexed_attention(q, k, v, idx, **REF)


def _flashmask(q, k, v):
    se = paddle_fa4.startend_row_indices_from_cu_seqlens(paddle.to_tensor(np.array([0, 20, 48], "int32")))
    return paddle_fa4.flashmask_attention(q, k, v, se, causal=True, return_softmax_lse=True, **REF)


OPS = [pytest.param(_fa_fwd, id="flash_attn_fwd"),
       pytest.param(_flashmask, id="flashmask_attention"), pytest.param(_fa_bwd, id="flash_attn_bwd"),
       pytest.param(_selection, id="selection"), pytest.param(_chunked, id="select_topk_blocks_chunked"),
       pytest.param(_indexed, id="indexed_attention")]


@pytest.mark.parametrize("fn", OPS)
def test_sot_mode_equals_eager(fn):
    q, k, v = _qkv()
    want = _flat(fn(q, k, v))
    got = _flat(paddle.jit.to_static(fn)(q, k, v))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_sot_mode_trains_like_eager():
    """Gradients through a to_static (SOT) function holding flash_attn_fwd equal eager ones."""
    grads = []
    for static in (False, True):
        q, k, v = _qkv(3)
        for t in (q, k, v):
            t.stop_gradient = False

        def loss_fn(q, k, v):
            out, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, **REF)
            return (out * out).sum()

        (paddle.jit.to_static(loss_fn) if static else loss_fn)(q, k, v).backward()
        grads.append([t.grad.numpy() for t in (q, k, v)])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def _h2o_ops(q, key, state, summary, tables, seq_lens):
    slots = paddle.to_tensor([0, 5], dtype="int32")
    h2o.reset_scores(state, slots, **REF)
    h2o.update_page_summary(key, slots, summary, **REF)
    ps = h2o.page_scores(q, key, summary, tables, seq_lens, **REF)
    state, tps = h2o.token_accumulate(q, key, state, tables, seq_lens, return_page_scores=True, **REF)
    tps2 = h2o.token_page_scores(state, tables, seq_lens, **REF)
    sel = h2o.select_pages(ps, tables, seq_lens, page_size=4, topk=1, **REF)
    return ps, tps, tps2, sel


def test_sot_mode_h2o_equals_eager():
    rng = np.random.default_rng(2)
    outs = []
    for static in (False, True):
        key, tables, seq_lens = make_paged(np.random.default_rng(2), [13, 20], 2, 4, 16)
        q = paddle.to_tensor(rng.standard_normal((2, 4, 16)).astype("float32")) if not outs else outs[0][0]
        state = paddle.zeros([key.shape[0], 2, 4], dtype="float32")
        summary = paddle.zeros([key.shape[0], 2, 3, 16], dtype="float32")
        fn = paddle.jit.to_static(_h2o_ops) if static else _h2o_ops
        outs.append((q, _flat(fn(q, key, state, summary, tables, seq_lens))))
    for a, b in zip(outs[0][1], outs[1][1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fn,op", [(_fa_fwd, "flash_attn_fwd"), (_fa_bwd, "flash_attn_fwd"),
                                   (_selection, "flash_attn_fwd"), (_chunked, "select_topk_blocks_chunked"),
                                   (_indexed, "indexed_attention_plan")])
def test_full_graph_raises_not_implemented(fn, op):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=rf"{op}: paddle.jit.to_static\(full_graph=True\) is not supported"):
        paddle.jit.to_static(fn, full_graph=True)(q, k, v)


def test_full_graph_h2o_raises_not_implemented():
    key, tables, seq_lens = make_paged(np.random.default_rng(2), [13], 2, 4, 16)
    state = paddle.zeros([key.shape[0], 2, 4], dtype="float32")

    def fn(state):
        return h2o.reset_scores(state, paddle.to_tensor([1], dtype="int32"), **REF)

    with pytest.raises(NotImplementedError, match=r"h2o.reset_scores: paddle.jit.to_static\(full_graph=True\)"):
        paddle.jit.to_static(fn, full_graph=True)(state)

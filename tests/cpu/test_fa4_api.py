"""FA4-compatible entry points (flash_attn_func / flash_attn_varlen_func), the keyword-only rule of
every public op, the one vocabulary (q/k/v, softmax_scale, return_lse) and head_agg="sum".

Reference backend on the CPU; see docs/api.md ("Calling convention", "Migrating").
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import h2o
from tests.oracles import selection as sel_oracle

REF = dict(backend="reference")


def _t(shape, dtype="float32", seed=0, grad=False):
    x = paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)
    x.stop_gradient = not grad
    return x


# ---------------------------------------------------------------------------------------------
# flash_attn_func


def test_func_matches_flash_attn_fwd_and_returns_fa4_pair():
    q, k, v = _t([2, 9, 4, 32]), _t([2, 11, 2, 32], seed=1), _t([2, 11, 2, 32], seed=2)
    got = paddle_fa4.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True, window_size=(4, None), **REF)
    assert isinstance(got, tuple) and len(got) == 2  # FA4 b36 returns (out, lse) either way
    want = paddle_fa4.flash_attn_fwd(q, k, v, softmax_scale=0.2, causal=True, window_size=(4, None), **REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    out, lse, bl = paddle_fa4.flash_attn_func(q, k, v, causal=True, block_size=16, return_block_logit=True, **REF)
    _, _, want_bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=16, return_block_logit=True, **REF)
    np.testing.assert_array_equal(bl.numpy(), want_bl.numpy())


def test_func_gradients_equal_flash_attn_fwd():
    grads = []
    for fn in (paddle_fa4.flash_attn_func, paddle_fa4.flash_attn_fwd):
        q, k, v = (_t([1, 7, 2, 16], seed=s, grad=True) for s in range(3))
        out, lse = fn(q, k, v, causal=True, **REF)[:2]
        assert lse.stop_gradient  # return_lse=False: lse carries no gradient
        (out * out).sum().backward()
        grads.append([x.grad.numpy() for x in (q, k, v)])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def _naive_lse_out(q, k, v, scale, causal):
    """Pure-Paddle fp32 attention (autograd by Paddle) for [B, S, H, D] with Hq == Hkv."""
    s = paddle.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = paddle.arange(sk).reshape([1, sk]) <= paddle.arange(sq).reshape([sq, 1]) + (sk - sq)
        s = paddle.where(mask, s, paddle.full_like(s, float("-inf")))
    lse = paddle.logsumexp(s, axis=-1)
    p = paddle.exp(s - lse.unsqueeze(-1))
    return paddle.einsum("bhqk,bkhd->bqhd", p, v), lse


def test_return_lse_makes_lse_differentiable():
    q, k, v = (_t([1, 6, 2, 8], seed=s, grad=True) for s in range(3))
    out, lse = paddle_fa4.flash_attn_func(q, k, v, causal=True, return_lse=True, **REF)
    assert not lse.stop_gradient
    (out.sum() + (lse * lse).sum()).backward()
    rq, rk, rv = (_t([1, 6, 2, 8], seed=s, grad=True) for s in range(3))
    rout, rlse = _naive_lse_out(rq, rk, rv, 8 ** -0.5, True)
    (rout.sum() + (rlse * rlse).sum()).backward()
    np.testing.assert_allclose(lse.numpy(), rlse.numpy(), rtol=1e-5, atol=1e-5)
    for a, b in ((q, rq), (k, rk), (v, rv)):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-4, atol=1e-5)
    # without return_lse the lse term would contribute nothing: the dq must differ
    q2, k2, v2 = (_t([1, 6, 2, 8], seed=s, grad=True) for s in range(3))
    out2, _ = paddle_fa4.flash_attn_func(q2, k2, v2, causal=True, **REF)
    out2.sum().backward()
    assert not np.allclose(q2.grad.numpy(), q.grad.numpy())


def test_flash_attn_fwd_return_lse():
    """flash_attn_fwd(..., return_lse=True): docs/api.md's vocabulary -- the same (out, lse) as without it, lse
    differentiable with the gradients of flash_attn_func(return_lse=True); block_logit still comes third."""
    q, k, v = (_t([1, 6, 2, 8], seed=s, grad=True) for s in range(3))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, return_lse=True, **REF)
    assert not lse.stop_gradient
    (out.sum() + (lse * lse).sum()).backward()
    rq, rk, rv = (_t([1, 6, 2, 8], seed=s, grad=True) for s in range(3))
    rout, rlse = paddle_fa4.flash_attn_func(rq, rk, rv, causal=True, return_lse=True, **REF)
    (rout.sum() + (rlse * rlse).sum()).backward()
    np.testing.assert_array_equal(lse.numpy(), rlse.numpy())
    for a, b in ((q, rq), (k, rk), (v, rv)):
        np.testing.assert_array_equal(a.grad.numpy(), b.grad.numpy())
    res = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, return_lse=True, return_block_logit=True, block_size=16,
                                    **REF)
    assert len(res) == 3 and not res[1].stop_gradient and res[2].stop_gradient
    out0, lse0 = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, **REF)
    assert lse0.stop_gradient
    np.testing.assert_array_equal(out0.numpy(), out.numpy())
    with pytest.raises(TypeError, match="flash_attn_fwd: return_lse must be a bool"):
        paddle_fa4.flash_attn_fwd(q, k, v, return_lse=1, **REF)


def test_fa4_only_keywords():
    q = _t([1, 4, 2, 16])
    with pytest.raises(NotImplementedError, match="flash_attn_func: qv is an FA4 option"):
        paddle_fa4.flash_attn_func(q, q, q, qv=q, **REF)
    with pytest.raises(NotImplementedError, match="flash_attn_func: learnable_sink"):
        paddle_fa4.flash_attn_func(q, q, q, learnable_sink=q, **REF)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropout'"):
        paddle_fa4.flash_attn_func(q, q, q, dropout=0.1, **REF)
    out, _ = paddle_fa4.flash_attn_func(q, q, q, num_splits=3, qv=None, mask_mod=None, **REF)  # hints / defaults
    want, _ = paddle_fa4.flash_attn_fwd(q, q, q, **REF)
    np.testing.assert_array_equal(out.numpy(), want.numpy())
    with pytest.raises(TypeError):
        paddle_fa4.flash_attn_func(q, q, q, 0.5, **REF)  # FA4's 4th positional is qv, Paddle's dropout
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func: page_table"):
        cu = paddle.to_tensor([0, 4], dtype="int32")
        paddle_fa4.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, page_table=cu, **REF)


# ---------------------------------------------------------------------------------------------
# flash_attn_varlen_func


def _varlen_inputs():
    cu_q = paddle.to_tensor([0, 3, 3, 10], dtype="int32")
    cu_k = paddle.to_tensor([0, 5, 6, 12], dtype="int32")
    return _t([10, 4, 16]), _t([12, 2, 16], seed=1), _t([12, 2, 16], seed=2), cu_q, cu_k


def test_varlen_func_computes_max_seqlen_when_not_given():
    q, k, v, cu_q, cu_k = _varlen_inputs()
    out, lse, bl = paddle_fa4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, block_size=16,
                                                     return_block_logit=True, **REF)
    want = paddle_fa4.flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                     max_seqlen_k=6, causal=True, block_size=16, return_block_logit=True, **REF)
    assert bl.shape == [4, 10, 1]  # ceil(max_seqlen_k 6 / 16): the computed max, not total_k
    for a, b in zip((out, lse, bl), want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    given = paddle_fa4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=7, max_seqlen_k=6, causal=True,
                                              **REF)
    np.testing.assert_array_equal(given[0].numpy(), out.numpy())
    with pytest.raises(ValueError, match="max_seqlen_k 5 is below the longest sequence"):
        paddle_fa4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_k=5, **REF)


def test_varlen_func_gradients_and_keyword_only():
    q, k, v, cu_q, cu_k = _varlen_inputs()
    for x in (q, k, v):
        x.stop_gradient = False
    out, lse = paddle_fa4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, return_lse=True, **REF)
    assert lse.shape == [4, 10] and not lse.stop_gradient
    out.sum().backward()
    q2, k2, v2 = (paddle.to_tensor(x.numpy()) for x in (q, k, v))
    for x in (q2, k2, v2):
        x.stop_gradient = False
    out2, _ = paddle_fa4.flash_attn_fwd(q2, k2, v2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                        max_seqlen_k=6, causal=True, **REF)
    out2.sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        np.testing.assert_array_equal(a.grad.numpy(), b.grad.numpy())
    with pytest.raises(TypeError):
        paddle_fa4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, **REF)


# ---------------------------------------------------------------------------------------------
# calling convention of every public op

#: Public ops and their positional (tensor) parameters; everything else must be keyword-only.
POSITIONAL = {
    paddle_fa4.flash_attn_func: ["q", "k", "v"],
    paddle_fa4.flash_attn_varlen_func: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"],
    paddle_fa4.flash_attn_fwd: ["q", "k", "v"],
    paddle_fa4.flash_attn_bwd: ["dout", "q", "k", "v", "out", "lse"],
    paddle_fa4.flashmask_attention: ["query", "key", "value", "startend_row_indices"],
    paddle_fa4.startend_row_indices_from_cu_seqlens: ["cu_seqlens"],
    paddle_fa4.cu_seqlens_from_startend_row_indices: ["startend_row_indices"],
    paddle_fa4.indexed_attention: ["q", "k", "v", "indices"],
    paddle_fa4.indexed_attention_plan: ["indices"],
    paddle_fa4.select_topk_blocks: ["block_logit", "lse"],
    paddle_fa4.blocks_to_indices: ["block_idx"],
    paddle_fa4.select_topk_blocks_chunked: ["q", "k", "v"],
    paddle_fa4.block_log_weight: ["block_logit", "lse"],
    paddle_fa4.block_sparse_attention: ["q", "k", "v", "block_ids"],
    paddle_fa4.block_sparse_plan: ["block_ids"],
    paddle_fa4.flash_attn_with_kvcache: ["q", "k_cache", "v_cache", "cache_seqlens"],
    paddle_fa4.sparse_decode_attention: ["q", "k_cache", "v_cache", "sparse_block_tables", "sparse_seq_lens"],
    paddle_fa4.block_selection_to_page_table: ["block_idx", "block_table", "cache_seqlens"],
    h2o.reset_scores: ["state", "slot_mapping"],
    h2o.update_page_summary: ["key_cache", "slot_mapping", "summary"],
    h2o.page_scores: ["q", "key_cache", "summary", "block_tables", "seq_lens"],
    h2o.token_accumulate: ["q", "key_cache", "state", "block_tables", "seq_lens"],
    h2o.token_page_scores: ["state", "block_tables", "seq_lens"],
    h2o.select_pages: ["scores", "block_tables", "seq_lens"],
}
OLD_SPELLINGS = {"query", "key", "value", "scale"}
#: Drop-in replacements of a Paddle op keep Paddle's parameter names (replacing the import is the migration).
PADDLE_NAMES = {paddle_fa4.flashmask_attention}


@pytest.mark.parametrize("op", list(POSITIONAL), ids=lambda op: op.__name__)
def test_options_are_keyword_only(op):
    params = inspect.signature(op).parameters
    positional = [n for n, p in params.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == POSITIONAL[op]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for n, p in params.items() if n not in positional)
    assert op in PADDLE_NAMES or not OLD_SPELLINGS & set(params)  # one vocabulary: q/k/v, softmax_scale


def test_public_ops_are_all_covered():
    public = {getattr(paddle_fa4, n) for n in paddle_fa4.__all__ if callable(getattr(paddle_fa4, n))
              and not isinstance(getattr(paddle_fa4, n), type) and n not in ("h2o", "backend", "library")}
    public |= {getattr(h2o, n) for n in ("reset_scores", "update_page_summary", "page_scores", "token_accumulate",
                                         "token_page_scores", "select_pages")}
    assert public == set(POSITIONAL)


def test_old_spellings_are_removed():
    q, idx = _t([1, 3, 2, 8]), paddle.zeros([1, 3, 2], dtype="int32")
    with pytest.raises(TypeError):
        paddle_fa4.indexed_attention(query=q, key=q, value=q, indices=idx, **REF)
    with pytest.raises(TypeError):
        paddle_fa4.indexed_attention(q, q, q, idx, scale=0.5, **REF)
    with pytest.raises(TypeError):
        paddle_fa4.indexed_attention(q, q, q, idx, 0.5, **REF)
    out = paddle_fa4.indexed_attention(q, q, q, idx, softmax_scale=0.5, **REF)
    assert out.shape == [1, 3, 2, 8]
    with pytest.raises(TypeError):
        paddle_fa4.select_topk_blocks(_t([1, 1, 1, 4]), _t([1, 1, 1]), 2, **REF)


# ---------------------------------------------------------------------------------------------
# head_agg="sum" (PaddleFleet): sum over the heads of the weights exp(block_logit - lse)


def test_head_agg_sum_matches_the_oracle():
    rng = np.random.default_rng(5)
    bl, lse = sel_oracle.causal_block_logit(rng, 2, 4, 24, 40, 8)
    for hs in (None, 2):
        got = paddle_fa4.select_topk_blocks(paddle.to_tensor(bl), paddle.to_tensor(lse), topk=3, num_kv_heads=hs,
                                            sink_blocks=1, head_agg="sum", **REF)
        want = sel_oracle.select_topk_blocks(bl, lse, 3, num_kv_heads=hs, sink_blocks=1, head_agg="sum")
        np.testing.assert_array_equal(got.numpy(), want)


def test_head_agg_sum_differs_from_max():
    # head 0 puts all its weight on block 0; heads 1 and 2 spread theirs over block 1: max picks 0,
    # the sum of weights picks 1 (0.9 + 0.1 + 0.1 = 1.1 vs 0.05 + 0.6 + 0.6 = 1.25).
    w = np.array([[0.9, 0.05], [0.1, 0.6], [0.1, 0.6]], np.float32)
    bl = paddle.to_tensor(np.log(w)[None, :, None, :])  # lse = 0
    lse = paddle.zeros([1, 3, 1])
    assert paddle_fa4.select_topk_blocks(bl, lse, topk=1, **REF).numpy().ravel().tolist() == [0]
    assert paddle_fa4.select_topk_blocks(bl, lse, topk=1, head_agg="sum", **REF).numpy().ravel().tolist() == [1]


def test_head_agg_sum_nan_rule():
    # a NaN lse head sees its blocks but ranks none (adds weight 0); NaN block_logit = unseen
    nan = float("nan")
    bl = np.array([[[[0.0, -1.0, -2.0, nan]], [[-5.0, -1.0, -0.5, nan]]]], np.float32)
    lse = np.array([[[0.0], [nan]]], np.float32)
    got = paddle_fa4.select_topk_blocks(paddle.to_tensor(bl), paddle.to_tensor(lse), topk=2, head_agg="sum", **REF)
    want = sel_oracle.select_topk_blocks(bl, lse, 2, head_agg="sum")
    np.testing.assert_array_equal(got.numpy(), want)
    assert got.numpy().ravel().tolist() == [0, 1]


def test_head_agg_sum_plus_inf_stays_plus_inf():
    # two heads at +inf: the sum of weights is +inf (inf - inf must not make it NaN and lose the block)
    inf = float("inf")
    bl = np.array([[[[inf, 0.0, -1.0]], [[inf, 0.0, -3.0]]]], np.float32)
    lse = np.zeros((1, 2, 1), np.float32)
    got = paddle_fa4.select_topk_blocks(paddle.to_tensor(bl), paddle.to_tensor(lse), topk=2, head_agg="sum", **REF)
    assert got.numpy().ravel().tolist() == [0, 1] == sel_oracle.select_topk_blocks(bl, lse, 2, head_agg="sum").ravel().tolist()


def test_head_agg_sum_runs_on_the_cute_backend(monkeypatch):
    """head_agg reaches the CuTe glue and its compile config (the kernel itself: tests/gpu/test_select.py)."""
    from cute_kernels.select.launch import topk_config, topk_unsupported_reason
    from paddle_fa4 import backend as backend_mod
    from paddle_fa4._cute import selection as glue

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    calls = []
    monkeypatch.setattr(glue, "select_topk_blocks", lambda *args: calls.append(args))
    bl, lse = paddle.zeros([1, 4, 3, 8]), paddle.zeros([1, 4, 3])
    paddle_fa4.select_topk_blocks(bl, lse, topk=2, num_kv_heads=2, head_agg="sum", backend="cute")
    assert calls and calls[0][-1] == "sum"
    assert glue.topk_unsupported_reason(90, nb=8, topk=2, head_agg="sum") is None
    assert "head_agg = 'mean'" in topk_unsupported_reason(8, 2, "mean")
    # every nb up to NB_MAX, 16-byte rows or not (scalar-load rows above 1024 blocks since 2026-12-04)
    for nb in (2048, 2047, 1025, 1023):
        assert topk_unsupported_reason(nb, 2, "sum") is None
    assert "nb = 2049 key blocks > 2048" in topk_unsupported_reason(2049, 2, "sum")
    assert topk_config(90, 4, 2, 8, 2, head_agg="sum").head_agg == "sum"
    assert topk_config(90, 4, 4, 8, 2, head_agg="sum").head_agg == "max"  # one head per group: the same
    with pytest.raises(ValueError, match="head_agg must be one of"):
        paddle_fa4.select_topk_blocks(bl, lse, topk=2, head_agg="mean", **REF)


def test_readme_using_it_blocks_run():
    """README's "Using it" code (the FA4-compatible call and the training step) runs as written."""
    import pathlib
    import re

    src = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = src[src.index("## Using it"):src.index("## Checking the kernels")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2 and "flash_attn_func" in blocks[0] and ".backward()" in "".join(blocks)
    scope = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "using the reference backend" on the CPU
        for block in blocks:
            exec(block, scope)
    assert scope["proj"].weight.grad is not None and float(scope["proj"].weight.grad.abs().sum()) > 0
    assert scope["out"].shape == [2, 512, 8, 128] and scope["out_v"].shape == [512, 8, 128]

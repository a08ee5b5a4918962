"""select_topk_blocks_chunked on the reference backend: the same ids as one forward + one selection,
bit for bit, for any chunking; out/lse to rounding; the plan and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_fa4  # noqa: E402
from paddle_fa4.selection import chunk_plan  # noqa: E402

REF = {"backend": "reference"}


@pytest.mark.parametrize("b,sq,sk,hq,hkv,causal,window,hs", [
    pytest.param(2, 70, 90, 4, 2, True, (None, None), 2, id="causal-sq<sk-gqa-groups"),
    pytest.param(1, 90, 50, 2, 1, True, (20, None), None, id="causal-window-sq>sk"),
    pytest.param(1, 40, 60, 2, 2, False, (None, None), 2, id="no-mask"),
])
@pytest.mark.parametrize("chunk_q", [7, 33, 512])
def test_chunked_equals_one_shot(b, sq, sk, hq, hkv, causal, window, hs, chunk_q):
    paddle.seed(0)
    q = paddle.randn([b, sq, hq, 32])
    k = paddle.randn([b, sk, hkv, 32])
    v = paddle.randn([b, sk, hkv, 32])
    o1, l1, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=causal, window_size=window, block_size=16,
                                           return_block_logit=True, **REF)
    s1 = paddle_fa4.select_topk_blocks(bl, l1, topk=3, num_kv_heads=hs, sink_blocks=1, local_blocks=1, **REF)
    o2, l2, s2 = paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=3, causal=causal, window_size=window,
                                                       block_size=16, num_kv_heads=hs, sink_blocks=1,
                                                       local_blocks=1, chunk_q=chunk_q, **REF)
    np.testing.assert_array_equal(s2.numpy(), s1.numpy())
    l1, l2 = l1.numpy(), l2.numpy()
    np.testing.assert_array_equal(np.isneginf(l2), np.isneginf(l1))
    fin = np.isfinite(l1)
    np.testing.assert_allclose(l2[fin], l1[fin], rtol=0, atol=2e-6)
    np.testing.assert_allclose(o2.numpy(), o1.numpy(), rtol=0, atol=2e-6)
    if chunk_q >= sq:
        assert (l1[fin] == l2[fin]).all() and (o1.numpy() == o2.numpy()).all()


def test_chunk_plan_keeps_alignment():
    # causal Sq=10 > Sk=6: rows 0..3 see nothing; chunk [4, 8) needs keys [0, 4)
    assert chunk_plan(10, 6, 4, True) == [(0, 4, 0, True), (4, 8, 4, True), (8, 10, 6, True)]
    assert chunk_plan(5, 9, 2, False) == [(0, 2, 9, False), (2, 4, 9, False), (4, 5, 9, False)]
    assert chunk_plan(4, 4, 4, True, (3, None)) == [(0, 4, 4, True)]


@pytest.mark.parametrize("causal,window", [(False, (4, None)), (False, (None, 3)), (False, (2, 2))])
def test_chunk_plan_refuses_masks_it_cannot_align(causal, window):
    with pytest.raises(NotImplementedError, match="select_topk_blocks_chunked: window_size"):
        chunk_plan(8, 8, 4, causal, window)


def test_chunked_errors():
    q = paddle.zeros([4, 2, 16])
    with pytest.raises(ValueError, match="select_topk_blocks_chunked: q must be 4-D"):
        paddle_fa4.select_topk_blocks_chunked(q, q, q, topk=2)
    q = paddle.zeros([1, 4, 2, 16])
    with pytest.raises(ValueError, match="select_topk_blocks_chunked: chunk_q must be >= 1"):
        paddle_fa4.select_topk_blocks_chunked(q, q, q, topk=2, chunk_q=0)
    with pytest.raises(ValueError, match="select_topk_blocks_chunked: block_size must be one of"):
        paddle_fa4.select_topk_blocks_chunked(q, q, q, topk=2, block_size=8)


def test_chunked_head_agg_sum_equals_one_shot():
    paddle.seed(1)
    q, k, v = paddle.randn([1, 40, 4, 32]), paddle.randn([1, 40, 2, 32]), paddle.randn([1, 40, 2, 32])
    o1, l1, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=16, return_block_logit=True, **REF)
    s1 = paddle_fa4.select_topk_blocks(bl, l1, topk=2, head_agg="sum", **REF)
    _, _, s2 = paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=2, block_size=16, head_agg="sum", chunk_q=7,
                                                     **REF)
    np.testing.assert_array_equal(s2.numpy(), s1.numpy())
    with pytest.raises(ValueError, match="select_topk_blocks_chunked: head_agg must be one of"):
        paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=2, head_agg="avg", **REF)

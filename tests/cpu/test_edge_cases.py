"""Edge cases that gave silent wrong results (issue 43, section 4), on the reference backend:
window bounds near the 64-bit limit, NaN / Inf in keys and values a row cannot see, ``h2o.select_pages``'s
``sparse_seq_lens`` with ``eos=0``, ``blocks_to_indices`` past int32, huge selection sizes, a numpy ``lse``."""

from __future__ import annotations

import math
import sys

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import h2o

REF = "reference"


def _t(x, dtype="float32"):
    return paddle.to_tensor(np.asarray(x)).astype(dtype)


def _qkv(seed, sq, sk, hq=4, hkv=2, d=16, b=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, sq, hq, d)).astype(np.float32), rng.standard_normal((b, sk, hkv, d)).astype(np.float32),
            rng.standard_normal((b, sk, hkv, d)).astype(np.float32))


# ------------------------------------------------------------------------------------------ window_size
HUGE = [sys.maxsize, 2 ** 63, 2 ** 70]


@pytest.mark.parametrize("huge", HUGE)
@pytest.mark.parametrize("causal", [False, True])
def test_huge_window_is_unbounded(huge, causal):
    q, k, v = (_t(x) for x in _qkv(0, 7, 11))
    want = paddle_fa4.flash_attn_fwd(q, k, v, causal=causal, return_block_logit=True, block_size=16, backend=REF)
    for window in ((huge, None), (None, huge), (huge, huge), (huge, -1)):
        got = paddle_fa4.flash_attn_fwd(q, k, v, causal=causal, window_size=window, return_block_logit=True,
                                        block_size=16, backend=REF)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    # a huge left bound with causal is plain causal; next to a finite right bound it keeps that bound
    got = paddle_fa4.flash_attn_fwd(q, k, v, window_size=(huge, 0), backend=REF)
    np.testing.assert_array_equal(got[0].numpy(), paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend=REF)[0].numpy())
    got = paddle_fa4.flash_attn_fwd(q, k, v, window_size=(huge, 2), backend=REF)
    np.testing.assert_array_equal(got[0].numpy(), paddle_fa4.flash_attn_fwd(q, k, v, window_size=(None, 2),
                                                                            backend=REF)[0].numpy())


def test_huge_window_backward_varlen_and_chunked():
    q, k, v = (_t(x) for x in _qkv(1, 6, 6))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend=REF)
    dout = paddle.ones_like(out)
    want = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend=REF)
    got = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, window_size=(sys.maxsize, 2 ** 70),
                                    backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # varlen: the bound is compared with max_seqlen_q + max_seqlen_k
    cu = _t([0, 2, 6], "int32")
    qv, kv, vv = q[0], k[0], v[0]
    want = paddle_fa4.flash_attn_varlen_func(qv, kv, vv, cu, cu, backend=REF)
    got = paddle_fa4.flash_attn_varlen_func(qv, kv, vv, cu, cu, window_size=(2 ** 70, sys.maxsize), backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # the chunked driver: a huge right bound without causal is no mask (was NotImplementedError)
    want = paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=1, causal=False, block_size=16, chunk_q=2,
                                                 backend=REF)
    got = paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=1, causal=False, block_size=16, chunk_q=2,
                                                window_size=(None, sys.maxsize), backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_window_bound_within_reach_is_kept():
    """Only bounds that hide no key become unbounded: one key short of it still masks."""
    q, k, v = (_t(x) for x in _qkv(2, 5, 5))
    from paddle_fa4.attention import _check_window

    assert _check_window((9, 9), False, reach=10) == (9, 9, False)
    assert _check_window((10, sys.maxsize), False, reach=10) == (None, None, False)
    assert _check_window((2 ** 70, 3), True, reach=10) == (None, 0, True)
    with pytest.raises(ValueError, match="window_size\\[0\\] must be None, -1"):
        paddle_fa4.flash_attn_fwd(q, k, v, window_size=(-2 ** 70, None), backend=REF)

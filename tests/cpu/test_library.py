"""paddle.library name registration (``paddle.ops.paddle_fa4.<name>``)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from paddle._ops import PYTHON_OP_REGISTRY

import paddle_fa4
import paddle_fa4.library as library

EXPECTED = {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_fwd", "flash_attn_bwd", "indexed_attention", "block_log_weight", "select_topk_blocks", "blocks_to_indices",
            "h2o_update_page_summary", "h2o_page_scores", "h2o_reset_scores", "h2o_token_accumulate",
            "h2o_select_pages", "h2o_token_page_scores", "flash_attn_with_kvcache", "sparse_decode_attention",
            "block_selection_to_page_table"}


def test_every_op_is_registered_on_import():
    assert set(library.OPS) == EXPECTED
    for name in EXPECTED:
        assert PYTHON_OP_REGISTRY.has_operator(f"paddle_fa4::{name}")


def test_register_is_idempotent():
    first = library.register_ops()
    again = library.register_ops()
    assert first == again and len(first) == len(EXPECTED)


def test_foreign_registration_is_refused(monkeypatch):
    qualname = "paddle_fa4::flash_attn_fwd"
    mine = PYTHON_OP_REGISTRY.get_operator(qualname)
    monkeypatch.setitem(PYTHON_OP_REGISTRY._registry, qualname, lambda *a: None)  # Paddle 3.3 internals
    assert PYTHON_OP_REGISTRY.get_operator(qualname) is not mine
    with pytest.raises(RuntimeError, match="paddle_fa4::flash_attn_fwd is already registered"):
        library.register_ops()


def test_flash_attn_fwd_through_paddle_ops():
    q = paddle.to_tensor(np.random.default_rng(0).standard_normal([1, 6, 2, 16]).astype(np.float32))
    direct = paddle_fa4.flash_attn_fwd(q, q, q, causal=True, return_block_logit=True, block_size=16,
                                       backend="reference")
    for fn in (paddle.ops.paddle_fa4.flash_attn_fwd, paddle.ops.paddle_fa4.flash_attn_fwd.default):
        via = fn(q, q, q, causal=True, return_block_logit=True, block_size=16, backend="reference")
        for a, b in zip(direct, via):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_indexed_attention_through_paddle_ops_keeps_autograd():
    q = paddle.to_tensor(np.random.default_rng(1).standard_normal([1, 4, 2, 8]).astype(np.float32))
    q.stop_gradient = False
    idx = paddle.to_tensor([[[0, 1], [1, 2], [3, -1], [-1, -1]]], dtype="int32")
    out = paddle.ops.paddle_fa4.indexed_attention(q, q, q, idx, backend="reference")
    out.sum().backward()
    assert q.grad is not None and np.all(np.isfinite(q.grad.numpy()))


def test_wrappers_resolve_lazily_to_the_public_ops():
    assert library.resolve("flash_attn_fwd") is paddle_fa4.flash_attn_fwd
    assert library.resolve("indexed_attention") is paddle_fa4.indexed_attention
    assert library.resolve("h2o_reset_scores") is paddle_fa4.h2o.reset_scores
    for name, (module, attr) in library.OPS.items():  # every registered name reaches a public op
        target = getattr(paddle_fa4, module) if module else paddle_fa4
        assert library.resolve(name) is getattr(target, attr), name
    with pytest.raises(KeyError):
        library.resolve("nope")


def test_in_place_h2o_op_through_paddle_ops():
    """h2o_reset_scores mutates its state argument when called through the registry too."""
    state = paddle.ones([2, 1, 4], dtype="float32")
    paddle.ops.paddle_fa4.h2o_reset_scores(state, paddle.to_tensor([1, 6, -1], dtype="int32"), backend="reference")
    expected = np.ones([2, 1, 4], np.float32)
    expected[0, 0, 1] = expected[1, 0, 2] = 0
    np.testing.assert_array_equal(state.numpy(), expected)

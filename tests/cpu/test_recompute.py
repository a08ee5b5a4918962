"""Activation recompute (``paddle.distributed.fleet.utils.recompute``) of a whole HySparse layer pair
(flash_attn_fwd with block_logit -> selection -> indexed_attention, q/k/v sliced from one fused
projection per layer): the gradients equal those of the plain graph bitwise, reentrant or not."""

from __future__ import annotations

import warnings

import numpy as np
import paddle
import pytest

import paddle_fa4


class FusedPair(paddle.nn.Layer):
    """Full layer and sparse layer, each with one fused qkv projection (q/k/v are strided views)."""

    def __init__(self, d_model=16, heads=2, head_dim=8, block_size=16):
        super().__init__()
        self.heads, self.head_dim, self.block_size = heads, head_dim, block_size
        self.qkv1 = paddle.nn.Linear(d_model, 3 * heads * head_dim)
        self.qkv2 = paddle.nn.Linear(d_model, 3 * heads * head_dim)
        self.o1 = paddle.nn.Linear(heads * head_dim, d_model)
        self.o2 = paddle.nn.Linear(heads * head_dim, d_model)

    def _split(self, proj, x):
        b, s = x.shape[0], x.shape[1]
        qkv = proj(x).reshape([b, s, 3, self.heads, self.head_dim])
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = self._split(self.qkv1, x)
        out, lse, block_logit = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=self.block_size,
                                                          return_block_logit=True, backend="reference")
        h = x + self.o1(out.reshape([b, s, -1]))
        with paddle.no_grad():
            blocks = paddle_fa4.select_topk_blocks(block_logit, lse, topk=2, num_kv_heads=self.heads, sink_blocks=1,
                                                   backend="reference")
            indices = paddle_fa4.blocks_to_indices(blocks, block_size=self.block_size, seqlen_k=s, backend="reference")
        q2, k2, v2 = self._split(self.qkv2, h)
        sparse = paddle_fa4.indexed_attention(q2, k2, v2, indices, backend="reference")
        return h + self.o2(sparse.reshape([b, s, -1]))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_recompute_of_a_layer_pair_gives_the_same_gradients(use_reentrant):
    from paddle.distributed.fleet.utils import recompute

    paddle.seed(7)
    pair = FusedPair()
    x_np = np.random.default_rng(8).standard_normal((2, 40, 16)).astype(np.float32)
    grads = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*using the reference backend.*")
        for use_recompute in (False, True):
            pair.clear_gradients()
            x = paddle.to_tensor(x_np)
            x.stop_gradient = False
            y = recompute(pair, x, use_reentrant=use_reentrant) if use_recompute else pair(x)
            (y ** 2).mean().backward()
            grads.append({n: p.grad.numpy() for n, p in pair.named_parameters()} | {"x": x.grad.numpy()})
    assert float(np.abs(grads[0]["qkv1.weight"]).max()) > 0 and float(np.abs(grads[0]["qkv2.weight"]).max()) > 0
    for name in grads[0]:
        np.testing.assert_array_equal(grads[0][name], grads[1][name], err_msg=name)

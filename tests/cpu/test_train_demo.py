"""``python -m paddle_fa4 train-demo``: a tiny HySparse layer pair trains on the reference backend
(the full layer's projections get gradients through flash_attn_fwd's backward) and its loss falls."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("paddle")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_loss_decreases_and_the_full_layer_learns():
    from paddle_fa4.train_demo import TrainConfig, run

    r = run(TrainConfig(steps=30, seed=1), verbose=False)
    assert len(r["losses"]) == 30 and all(np.isfinite(r["losses"]))
    assert r["eval_after"] < 0.7 * r["eval_before"]
    assert r["last_mean"] < r["first_mean"]
    assert r["full_layer_q_grad_norm_min"] > 0  # every step's full-attention q projection got a gradient


def test_full_layer_gradients_match_flash_attn_bwd():
    """The q/k/v projection gradients of the full layer are those of flash_attn_bwd chained by hand."""
    import paddle

    import paddle_fa4
    from paddle_fa4.train_demo import TrainConfig, _make_pair

    cfg = TrainConfig(seq=32, heads=2, kv_heads=1, head_dim=8, d_model=16, block_size=16, topk=2)
    pair = _make_pair(cfg, 3)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 32, 16)).astype(np.float32))
    q = pair.q1(x).reshape([2, 32, 2, 8])
    q.retain_grads()
    k, v = (p(x).reshape([2, 32, 1, 8]) for p in (pair.k1, pair.v1))
    out, lse, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, return_block_logit=True, block_size=16,
                                            backend="reference")
    out.retain_grads()
    (pair.o1(out.reshape([2, 32, 16])) ** 2).sum().backward()
    dq, _, _ = paddle_fa4.flash_attn_bwd(out.grad, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                         causal=True, backend="reference")
    np.testing.assert_array_equal(q.grad.numpy(), dq.numpy())
    assert float(pair.q1.weight.grad.abs().max()) > 0 and float(pair.k1.weight.grad.abs().max()) > 0


def test_cli():
    proc = subprocess.run([sys.executable, "-m", "paddle_fa4", "train-demo", "--steps", "4", "--log-every", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train loss: first" in proc.stdout and "held-out loss" in proc.stdout
    assert "step    2" in proc.stdout and "4 steps in" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "paddle_fa4", "train-demo", "--heads", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "multiple of --kv-heads" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "paddle_fa4", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert usage.returncode == 0 and "train-demo" in usage.stdout

"""``python -m paddle_fa4 train-demo``: train a tiny HySparse layer pair end to end (``docs/hysparse.md``).

The pair, as in HySparse training:

1. **full layer**: learnable q/k/v projections -> :func:`flash_attn_fwd` (causal, with
   ``block_logit``) -> output projection, residual. Its backward is the attention backward
   (:func:`flash_attn_bwd` through autograd); ``block_logit`` and ``lse`` carry no gradient.
2. **selection** (not differentiable): :func:`select_topk_blocks` on the full layer's
   ``block_logit`` / ``lse`` per kv head, then :func:`blocks_to_indices`.
3. **sparse layer**: its own q/k/v projections -> :func:`indexed_attention` over the selected
   tokens -> output projection, residual.

Task (embedded, synthetic): teacher-student regression. A teacher pair with fixed random weights
maps random Gaussian token sequences to targets; the student, a pair of the same shape from
another seed, is trained with Adam on fresh batches to match it (mean squared error). The loss on
a fixed held-out batch is printed before and after. The defaults (300 steps) take about 20 s on
the CPU reference backend (2 cores).
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 300
    batch: int = 2
    seq: int = 64
    d_model: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    block_size: int = 16
    topk: int = 3
    sink_blocks: int = 1
    local_blocks: int = 1
    lr: float = 1e-2
    seed: int = 0
    backend: str = "reference"
    deterministic: bool = False
    log_every: int = 50


def _layer_pair_class():
    import paddle

    import paddle_fa4

    class HySparsePair(paddle.nn.Layer):
        """A full-attention layer with block_logit followed by a sparse (indexed) layer."""

        def __init__(self, cfg: TrainConfig):
            super().__init__()
            self.cfg = cfg
            hq, hkv, d = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.d_model
            lin = paddle.nn.Linear
            self.q1, self.k1, self.v1, self.o1 = lin(d, hq), lin(d, hkv), lin(d, hkv), lin(hq, d)
            self.q2, self.k2, self.v2, self.o2 = lin(d, hq), lin(d, hkv), lin(d, hkv), lin(hq, d)

        def _heads(self, x, heads):
            b, s = x.shape[0], x.shape[1]
            return x.reshape([b, s, heads, self.cfg.head_dim])

        def forward(self, x):
            cfg = self.cfg
            b, s = x.shape[0], x.shape[1]
            be = dict(backend=cfg.backend)
            q, k, v = (self._heads(p(x), h) for p, h in ((self.q1, cfg.heads), (self.k1, cfg.kv_heads),
                                                         (self.v1, cfg.kv_heads)))
            out, lse, block_logit = paddle_fa4.flash_attn_fwd(
                q, k, v, causal=True, block_size=cfg.block_size, return_block_logit=True,
                deterministic=cfg.deterministic, **be)
            h = x + self.o1(out.reshape([b, s, cfg.heads * cfg.head_dim]))
            with paddle.no_grad():  # the selection is discrete: no gradient flows through it
                blocks = paddle_fa4.select_topk_blocks(
                    block_logit, lse, topk=cfg.topk, num_kv_heads=cfg.kv_heads, sink_blocks=cfg.sink_blocks,
                    local_blocks=cfg.local_blocks, block_size=cfg.block_size, seqlen_k=s, **be)
                indices = paddle_fa4.blocks_to_indices(blocks, block_size=cfg.block_size, seqlen_k=s, **be)
            q2, k2, v2 = (self._heads(p(h), n) for p, n in ((self.q2, cfg.heads), (self.k2, cfg.kv_heads),
                                                            (self.v2, cfg.kv_heads)))
            sparse = paddle_fa4.indexed_attention(q2, k2, v2, indices, **be)
            return h + self.o2(sparse.reshape([b, s, cfg.heads * cfg.head_dim]))

    return HySparsePair


def _make_pair(cfg: TrainConfig, seed: int):
    import paddle

    paddle.seed(seed)
    return _layer_pair_class()(cfg)


def run(cfg: TrainConfig, verbose: bool = True) -> dict:
    """Train the student for ``cfg.steps`` steps; return losses, timings and gradient norms."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*using the reference backend.*")
        return _train(cfg, verbose)


def _train(cfg: TrainConfig, verbose: bool) -> dict:
    import numpy as np
    import paddle

    teacher = _make_pair(cfg, cfg.seed + 1000)
    for p in teacher.parameters():
        p.stop_gradient = True
    student = _make_pair(cfg, cfg.seed)
    opt = paddle.optimizer.Adam(learning_rate=cfg.lr, parameters=student.parameters())
    rng = np.random.default_rng(cfg.seed)

    def batch():
        x = paddle.to_tensor(rng.standard_normal((cfg.batch, cfg.seq, cfg.d_model)).astype(np.float32))
        with paddle.no_grad():
            y = teacher(x)
        return x, y

    def mse(a, b):
        return ((a - b) ** 2).mean()

    x_eval, y_eval = batch()

    def eval_loss():
        with paddle.no_grad():
            return float(mse(student(x_eval), y_eval))

    eval_before = eval_loss()
    losses, full_grad_norms = [], []
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = batch()
        loss = mse(student(x), y)
        loss.backward()
        full_grad_norms.append(float(paddle.linalg.norm(student.q1.weight.grad)))  # via the attention backward
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        if verbose and (step == 1 or step % cfg.log_every == 0 or step == cfg.steps):
            print(f"  step {step:4d}  train loss {losses[-1]:.5f}")
    seconds = time.perf_counter() - start
    eval_after = eval_loss()
    window = max(1, min(10, cfg.steps // 4))
    report = {
        "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
        "first_mean": float(np.mean(losses[:window])), "last_mean": float(np.mean(losses[-window:])),
        "eval_before": eval_before, "eval_after": eval_after, "seconds": seconds,
        "full_layer_q_grad_norm_min": float(min(full_grad_norms)),
    }
    if verbose:
        print(f"HySparse layer pair (full attention + block_logit -> top-{cfg.topk} blocks of "
              f"{cfg.block_size} -> indexed attention), B={cfg.batch}, S={cfg.seq}, Hq={cfg.heads}, "
              f"Hkv={cfg.kv_heads}, D={cfg.head_dim}, backend {cfg.backend}")
        print(f"  train loss: first {report['first_loss']:.5f} -> last {report['last_loss']:.5f} "
              f"(mean of {window}: {report['first_mean']:.5f} -> {report['last_mean']:.5f})")
        print(f"  held-out loss: {eval_before:.5f} -> {eval_after:.5f} "
              f"({eval_before / max(eval_after, 1e-30):.1f}x lower)")
        print(f"  full-layer q projection gradient norm (through flash_attn's backward): min "
              f"{report['full_layer_q_grad_norm_min']:.3e} over the steps")
        print(f"  {cfg.steps} steps in {seconds:.1f} s ({1e3 * seconds / cfg.steps:.1f} ms/step)")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_fa4 train-demo", description=__doc__.splitlines()[0])
    d = TrainConfig()
    ap.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence (default %(default)s)")
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--head-dim", type=int, default=d.head_dim)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--topk", type=int, default=d.topk)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--backend", default=d.backend, choices=("auto", "cute", "reference"))
    ap.add_argument("--deterministic", action="store_true", help="deterministic attention backward")
    ap.add_argument("--log-every", type=int, default=d.log_every)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    if d.sink_blocks + d.local_blocks > args.topk:
        ap.error(f"--topk must be at least {d.sink_blocks + d.local_blocks} (sink + local blocks)")
    run(TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, block_size=args.block_size, topk=args.topk, lr=args.lr, seed=args.seed,
                    backend=args.backend, deterministic=args.deterministic, log_every=args.log_every))
    return 0

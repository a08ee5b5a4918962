"""The HySparse walk-through behind ``python -m paddle_fa4 demo`` (see ``docs/hysparse.md``).

A small HySparse layer pair on an embedded default problem:

1. **full layer**: :func:`flash_attn_fwd` with ``block_logit`` (the per-(query, key block) max
   logit) and ``lse``;
2. **selection**: :func:`select_topk_blocks` picks per query token and kv group the ``topk`` key
   blocks with the largest attention weight across heads, plus sink and local blocks;
   :func:`select_topk_blocks_chunked` must give the same ids chunk by chunk;
3. **sparse layer**: the next layer's queries attend only to the selected blocks of the full
   layer's keys/values through :func:`blocks_to_indices` + :func:`indexed_attention`.

It prints selection statistics, the recall of the selection against the exact top-k attention
mass, the sparse-vs-dense output error and timings, and saves a heatmap of the selected blocks.
Runs on the reference backend on CPU (well under a minute on 2 cores) and on the CuTe kernels on
a GPU place.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np

#: Logit (``q . k / sqrt(D)``) of each head's anchor token and of its recent token.
ANCHOR_LOGIT = 10.0
LOCAL_LOGIT = 6.0

@dataclass
class DemoConfig:
    seq: int = 2048
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 32
    topk: int = 8
    sink_blocks: int = 1
    local_blocks: int = 2
    next_layer_noise: float = 0.35  # how far the sparse layer's queries drift from the full layer's
    seed: int = 0
    backend: str = "auto"
    out: str = "hysparse_selection.png"


def make_layer_inputs(cfg: DemoConfig):
    """q, q_next, k, v ``[1, S, H, D]`` (numpy fp32) with the structure HySparse relies on.

    Keys and values are Gaussian. Each query head looks for one earlier "anchor" token of its own
    (logit about ``ANCHOR_LOGIT``) and, more weakly, a recent token (``LOCAL_LOGIT``), over a noise
    floor: as in trained models a few tokens carry most of the weight, and the heads of one kv
    group want different blocks, which the max over heads has to keep. ``q_next`` (the sparse
    layer's queries) drifts from ``q`` by ``next_layer_noise``.
    """
    rng = np.random.default_rng(cfg.seed)
    s, hq, hkv, d = cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim
    k = rng.standard_normal((1, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((1, s, hkv, d)).astype(np.float32)
    group = hq // hkv
    rows = np.arange(s)

    def unit(x):
        return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)

    # logit = q . k / sqrt(d) and |k_t| ~ sqrt(d): c * unit(k_t) gives k_t a logit of ~c and any
    # other key a logit of ~N(0, (c / sqrt(d))^2): the noise floor the anchors stand out from
    q = 0.3 * rng.standard_normal((1, s, hq, d)).astype(np.float32)
    for h in range(hq):
        anchor = (rng.random(s) * (rows + 1)).astype(np.int64)  # uniform over keys <= i
        recent = np.maximum(rows - rng.integers(0, 16, s), 0)
        kv = k[0, :, h // group]
        q[0, :, h] += ANCHOR_LOGIT * unit(kv[anchor]) + LOCAL_LOGIT * unit(kv[recent])
    q_next = q + cfg.next_layer_noise * rng.standard_normal(q.shape).astype(np.float32)
    return q, q_next, k, v


def attention_probs(q, k, scale):
    """Exact causal softmax ``[H, S, S]`` fp32 (numpy) for one batch, GQA by head // group."""
    s, hq = q.shape[1], q.shape[2]
    group = hq // k.shape[2]
    kk = np.repeat(k[0], group, axis=1).transpose(1, 2, 0)  # [H, D, S]
    logits = np.einsum("shd,hdt->hst", q[0], kk) * scale
    logits[:, np.triu(np.ones((s, s), bool), 1)] = -np.inf
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


def selection_recall(probs, block_idx, block_size, topk):
    """Per (head, row): attention mass in the selected blocks, and that mass over the best
    possible mass of ``topk`` blocks of that head (the exact top-k by block mass)."""
    hq, s, _ = probs.shape
    nb = -(-s // block_size)
    pad = nb * block_size - s
    mass = np.pad(probs, ((0, 0), (0, 0), (0, pad))).reshape(hq, s, nb, block_size).sum(-1)  # [H, S, nb]
    hs = block_idx.shape[1]
    group = hq // hs
    sel = block_idx[0]  # [Hs, S, topk]
    onehot = np.zeros((hs, s, nb + 1), bool)
    np.put_along_axis(onehot, np.where(sel >= 0, sel, nb), True, axis=-1)
    chosen = np.repeat(onehot[..., :nb], group, axis=0)  # [H, S, nb]
    captured = (mass * chosen).sum(-1)
    best = -np.sort(-mass, axis=-1)[..., :topk].sum(-1)
    return captured, captured / np.maximum(best, 1e-30)


def heatmap(path, block_idx, logw_max, cfg: DemoConfig) -> None:
    """Two panels over (query row, key block) for kv group 0: the selection, and the log-weight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    s, nb = logw_max.shape
    visible = np.isfinite(logw_max)
    diag = np.where(visible, np.arange(nb), -1).max(-1)
    kind = np.where(visible, 1, 0)  # 0 invisible, 1 visible
    sel = block_idx[0, 0]
    for i in range(s):
        for j in sel[i][sel[i] >= 0]:
            forced_sink = j < cfg.sink_blocks
            forced_local = j > diag[i] - cfg.local_blocks
            kind[i, j] = 3 if forced_sink else 4 if forced_local else 2
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), dpi=90, sharey=True)
    cmap = ListedColormap(["#ffffff", "#e6e6e6", "#1f5fbf", "#e07b00", "#2ca02c"])
    axes[0].imshow(kind, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=4.5)
    axes[0].set_title(f"selected blocks (kv group 0): top-{cfg.topk}\n"
                      f"blue = by weight, orange = sink, green = local,\n"
                      f"grey = visible, not chosen, white = not visible (causal)", fontsize=9)
    shown = np.where(visible, logw_max, np.nan)
    im = axes[1].imshow(shown, aspect="auto", interpolation="nearest", cmap="magma", vmin=-12, vmax=0)
    axes[1].set_title("block log-weight max over group heads\n(block_logit - lse; white = no visible key)")
    for ax in axes:
        ax.set_xlabel(f"key block ({cfg.block_size} tokens)")
    axes[0].set_ylabel("query token")
    fig.colorbar(im, ax=axes[1], fraction=0.046, pad=0.02)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _mean(x) -> float:
    """Mean of a possibly empty selection: NaN (shown as n/a) instead of numpy's empty-slice warning."""
    x = np.asarray(x)
    return float(x.mean()) if x.size else float("nan")


def _sync(t) -> None:
    if t.place.is_gpu_place():
        import paddle

        paddle.device.synchronize()


def run(cfg: DemoConfig) -> dict:
    """Run the walk-through, print the report, save the heatmap; return the numbers."""
    import paddle

    import paddle_fa4

    warnings.filterwarnings("ignore", message=".*using the reference backend.*")
    on_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    dtype = "bfloat16" if on_gpu else "float32"  # the CuTe kernels take bf16/fp16
    place = "gpu" if on_gpu else "cpu"
    q_np, q2_np, k_np, v_np = make_layer_inputs(cfg)
    q, q2, k, v = (paddle.to_tensor(a, place=place).astype(dtype) for a in (q_np, q2_np, k_np, v_np))
    scale = cfg.head_dim ** -0.5
    be = {"backend": cfg.backend}
    times = {}

    def timed(name, fn):
        start = time.perf_counter()
        result = fn()
        _sync(q)
        times[name] = time.perf_counter() - start
        return result

    out_full, lse, block_logit = timed("full forward + block_logit", lambda: paddle_fa4.flash_attn_fwd(
        q, k, v, causal=True, block_size=cfg.block_size, return_block_logit=True, **be))
    blk = timed("select_topk_blocks", lambda: paddle_fa4.select_topk_blocks(
        block_logit, lse, topk=cfg.topk, num_kv_heads=cfg.kv_heads, sink_blocks=cfg.sink_blocks,
        local_blocks=cfg.local_blocks, block_size=cfg.block_size, seqlen_k=cfg.seq, **be))
    chunk_q = max(1, cfg.seq // 4)
    _, _, blk_chunked = timed("chunked forward + selection (4 chunks)", lambda: paddle_fa4.select_topk_blocks_chunked(
        q, k, v, topk=cfg.topk, block_size=cfg.block_size, num_kv_heads=cfg.kv_heads, sink_blocks=cfg.sink_blocks,
        local_blocks=cfg.local_blocks, chunk_q=chunk_q, **be))
    idx = timed("blocks_to_indices", lambda: paddle_fa4.blocks_to_indices(blk, block_size=cfg.block_size, seqlen_k=cfg.seq, **be))
    sparse_next = timed("sparse layer (indexed_attention)", lambda: paddle_fa4.indexed_attention(
        q2, k, v, idx, softmax_scale=scale, **be))
    dense_next = timed("dense layer (flash_attn_fwd, for comparison)", lambda: paddle_fa4.flash_attn_fwd(
        q2, k, v, causal=True, **be)[0])
    sparse_same = paddle_fa4.indexed_attention(q, k, v, idx, softmax_scale=scale, **be)

    blk_np = blk.numpy()
    nb = block_logit.shape[-1]
    counts = (blk_np >= 0).sum(-1)  # [1, Hs, S]
    idx_np = idx.numpy()
    keys_attended = (idx_np >= 0).sum(-1)  # [1, Hs, S]
    rows = np.arange(cfg.seq)
    probs = attention_probs(q_np, k_np, scale)
    captured, recall = selection_recall(probs, blk_np, cfg.block_size, cfg.topk)
    long_rows = rows >= cfg.topk * cfg.block_size  # rows that see more than topk blocks

    def rel_err(a, b):
        a, b = a.astype("float32").numpy(), b.astype("float32").numpy()
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    logw = paddle_fa4.block_log_weight(block_logit, lse).numpy()[0]  # [Hq, S, nb]
    group = cfg.heads // cfg.kv_heads
    heatmap(cfg.out, blk_np, logw[:group].max(0), cfg)
    report = {
        "backend": "reference" if not on_gpu or cfg.backend == "reference" else cfg.backend,
        "rows": cfg.seq, "key_blocks": nb,
        "blocks_per_row_mean": float(counts.mean()),
        "keys_attended_long_rows_fraction": _mean(keys_attended[..., long_rows] / (rows[long_rows] + 1)),
        "chunked_ids_identical": bool((blk_chunked.numpy() == blk_np).all()),
        "mass_captured_mean": float(captured.mean()),
        "mass_captured_long_rows_mean": _mean(captured[:, long_rows]),
        "recall_vs_exact_topk_mean": float(recall.mean()),
        "recall_vs_exact_topk_p10": float(np.quantile(recall, 0.1)),
        "sparse_vs_dense_rel_err_next_layer": rel_err(sparse_next, dense_next),
        "sparse_vs_dense_rel_err_same_layer": rel_err(sparse_same, out_full),
        "times_s": times, "png": os.path.abspath(cfg.out),
    }
    _print_report(cfg, report)
    return report


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


def _print_report(cfg: DemoConfig, r: dict) -> None:
    print(f"HySparse demo: S={cfg.seq}, Hq={cfg.heads}, Hkv={cfg.kv_heads}, D={cfg.head_dim}, "
          f"block {cfg.block_size}, top-{cfg.topk} (+{cfg.sink_blocks} sink, {cfg.local_blocks} local), "
          f"backend {r['backend']}")
    print(f"  key blocks per row: {r['key_blocks']} in all, {r['blocks_per_row_mean']:.2f} selected on average; "
          f"rows past the first {cfg.topk * cfg.block_size} tokens attend to "
          f"{_pct(r['keys_attended_long_rows_fraction'])} of their keys")
    print(f"  chunked driver (4 query chunks): ids identical to the one-shot selection: {r['chunked_ids_identical']}")
    print(f"  attention mass inside the selection: {100 * r['mass_captured_mean']:.1f}% of each row on average "
          f"({_pct(r['mass_captured_long_rows_mean'])} on rows longer than the budget)")
    print(f"  recall vs the exact top-{cfg.topk} blocks by attention mass: mean "
          f"{100 * r['recall_vs_exact_topk_mean']:.1f}%, 10th percentile {100 * r['recall_vs_exact_topk_p10']:.1f}%")
    print(f"  sparse vs dense output, relative L2 error: next layer {r['sparse_vs_dense_rel_err_next_layer']:.4f}, "
          f"same layer {r['sparse_vs_dense_rel_err_same_layer']:.4f}")
    print("  timings:")
    for name, sec in r["times_s"].items():
        print(f"    {name:<45} {1e3 * sec:9.1f} ms")
    print(f"  heatmap of the selected blocks: {r['png']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_fa4 demo", description=__doc__.splitlines()[0])
    d = DemoConfig()
    ap.add_argument("--seq", type=int, default=d.seq, help="tokens (default %(default)s)")
    ap.add_argument("--heads", type=int, default=d.heads, help="query heads (default %(default)s)")
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads, help="kv heads = selection groups (default %(default)s)")
    ap.add_argument("--head-dim", type=int, default=d.head_dim)
    ap.add_argument("--block-size", type=int, default=d.block_size)
    ap.add_argument("--topk", type=int, default=d.topk)
    ap.add_argument("--sink-blocks", type=int, default=d.sink_blocks)
    ap.add_argument("--local-blocks", type=int, default=d.local_blocks)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--backend", default=d.backend, choices=("auto", "cute", "reference"))
    ap.add_argument("--out", default=d.out, help="heatmap PNG path (default %(default)s)")
    args = ap.parse_args(argv)
    for flag, value, low in (("--seq", args.seq, 1), ("--heads", args.heads, 1), ("--kv-heads", args.kv_heads, 1),
                             ("--head-dim", args.head_dim, 1), ("--topk", args.topk, 1),
                             ("--sink-blocks", args.sink_blocks, 0), ("--local-blocks", args.local_blocks, 0)):
        if value < low:
            ap.error(f"{flag} must be >= {low}, got {value}")
    from .attention import BLOCK_SIZES

    if args.block_size not in BLOCK_SIZES:
        ap.error(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {args.block_size}")
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    if args.sink_blocks + args.local_blocks > args.topk:
        ap.error("--sink-blocks + --local-blocks must not exceed --topk")
    run(DemoConfig(seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   block_size=args.block_size, topk=args.topk, sink_blocks=args.sink_blocks,
                   local_blocks=args.local_blocks, seed=args.seed, backend=args.backend, out=args.out))
    return 0

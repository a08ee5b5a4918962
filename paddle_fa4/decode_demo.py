"""The paged-cache decode loop behind ``python -m paddle_fa4 decode-demo`` (docs/api.md, Decode).

A small serving loop: a prompt is prefilled into a paged KV cache (pages taken from a shuffled
free list, every unused byte NaN, as recycled ``paddle.empty`` pages may be), then each decode step
writes the new token's K/V into its page and runs

1. **dense decode** with ``block_logit``: :func:`flash_attn_with_kvcache` (the HySparse full layer);
2. **HySparse sparse decode**: :func:`select_topk_blocks` on that ``block_logit`` ->
   :func:`block_selection_to_page_table` -> :func:`sparse_decode_attention` for the next layer's
   query (which drifts from the full layer's);
3. **H2O token flow**: :func:`h2o.reset_scores` (the new slot) -> :func:`h2o.token_accumulate` ->
   :func:`h2o.select_pages` -> :func:`sparse_decode_attention`, fed straight in;

and reports each sparse output's error against dense decode of the same query, and the fraction of
the KV bytes attention reads (selected tokens over all tokens, per kv head). Queries look for a few
"anchor" tokens per head over a noise floor, the structure both methods rely on. Runs on the
reference backend on the CPU in seconds, on the CuTe kernels on a GPU place.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass

import numpy as np

ANCHOR_LOGIT = 14.0  # logit of an anchor: well above the log(#keys) ~ 8 noise floor at 4K tokens


@dataclass
class DecodeDemoConfig:
    batch: int = 2
    prompt: int = 4000
    steps: int = 6
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    topk_blocks: int = 8      # HySparse: 64-token blocks per kv head (1 sink included)
    window: int = 64          # HySparse: trailing tokens always attended
    h2o_topk: int = 16        # H2O: pages per kv head beside bos / eos
    anchors: int = 2          # tokens each head looks for
    next_layer_noise: float = 0.3
    seed: int = 0
    backend: str = "auto"


def make_problem(cfg: DecodeDemoConfig, rng):
    """K, V ``[B, T, Hkv, D]`` and the per-step queries ``q, q_next [steps, B, Hq, D]`` (fp32 numpy)."""
    b, total, hkv, d, hq = cfg.batch, cfg.prompt + cfg.steps, cfg.kv_heads, cfg.head_dim, cfg.heads
    k = rng.standard_normal((b, total, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, total, hkv, d)).astype(np.float32)
    group = hq // hkv
    q = 0.3 * rng.standard_normal((cfg.steps, b, hq, d)).astype(np.float32)
    for bi in range(b):
        for h in range(hq):
            for a in rng.integers(0, cfg.prompt, cfg.anchors):
                key = k[bi, a, h // group]
                q[:, bi, h] += ANCHOR_LOGIT * key / np.linalg.norm(key) * (0.75 + 0.5 * rng.random())
    q_next = q + cfg.next_layer_noise * rng.standard_normal(q.shape).astype(np.float32)
    return k, v, q, q_next


def run(cfg: DecodeDemoConfig) -> dict:
    """Run the loop, print the report; return the numbers."""
    import paddle

    import paddle_fa4
    from paddle_fa4 import h2o

    warnings.filterwarnings("ignore", message=".*using the reference backend.*")
    on_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    dtype = "bfloat16" if on_gpu else "float32"
    place = "gpu" if on_gpu else "cpu"
    rng = np.random.default_rng(cfg.seed)
    k_np, v_np, q_np, qn_np = make_problem(cfg, rng)
    b, hkv, d, p = cfg.batch, cfg.kv_heads, cfg.head_dim, cfg.page_size
    total = cfg.prompt + cfg.steps
    max_pages = -(-total // p)
    num_pages = b * max_pages + 4
    free = rng.permutation(num_pages).tolist()  # a shuffled free list: pages are not in order
    table_np = np.full((b, max_pages), -1, dtype=np.int32)
    k_cache = paddle.full([num_pages, hkv, p, d], float("nan"), dtype=dtype).to(place)  # stale pages
    v_cache = paddle.full([num_pages, hkv, p, d], float("nan"), dtype=dtype).to(place)
    state = paddle.full([num_pages, hkv, p], 3.0, dtype="float32").to(place)  # stale H2O scores
    be = {"backend": cfg.backend}

    def write(tokens):
        """Write K/V of token positions ``tokens`` of every sequence; return their flat slots."""
        slots = []
        for bi in range(b):
            for t in tokens:
                if table_np[bi, t // p] < 0:
                    table_np[bi, t // p] = free.pop()
                slots.append(int(table_np[bi, t // p]) * p + t % p)
        slot_t = np.array(slots, dtype=np.int64)
        kk = paddle.to_tensor(k_np[:, tokens].reshape(-1, hkv, d)).astype(dtype).to(place)
        vv = paddle.to_tensor(v_np[:, tokens].reshape(-1, hkv, d)).astype(dtype).to(place)
        flat_k = k_cache.transpose([0, 2, 1, 3]).reshape([-1, hkv, d])
        flat_v = v_cache.transpose([0, 2, 1, 3]).reshape([-1, hkv, d])
        idx = paddle.to_tensor(slot_t).to(place)
        flat_k = paddle.scatter(flat_k, idx, kk, overwrite=True)
        flat_v = paddle.scatter(flat_v, idx, vv, overwrite=True)
        paddle.assign(flat_k.reshape([num_pages, p, hkv, d]).transpose([0, 2, 1, 3]), k_cache)
        paddle.assign(flat_v.reshape([num_pages, p, hkv, d]).transpose([0, 2, 1, 3]), v_cache)
        return paddle.to_tensor(slot_t.astype(np.int32)).to(place)

    h2o.reset_scores(state, write(list(range(cfg.prompt))), **be)  # prefill (its attention is not shown)
    errs = {"hysparse": [], "h2o": []}
    read = {"hysparse": [], "h2o": []}
    times = {"dense decode + block_logit": 0.0, "hysparse select + tables + sparse decode": 0.0,
             "h2o reset + accumulate + select + sparse decode": 0.0}

    def rel(a, ref):
        a, ref = a.astype("float32").numpy(), ref.astype("float32").numpy()
        return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))

    for step in range(cfg.steps):
        pos = cfg.prompt + step
        new_slots = write([pos])
        lens = paddle.to_tensor(np.full(b, pos + 1, dtype=np.int32)).to(place)
        table = paddle.to_tensor(table_np).to(place)
        q = paddle.to_tensor(q_np[step][:, None]).astype(dtype).to(place)  # [B, 1, Hq, D]
        q_next = paddle.to_tensor(qn_np[step][:, None]).astype(dtype).to(place)

        t0 = time.perf_counter()
        dense, lse, bl = paddle_fa4.flash_attn_with_kvcache(q, k_cache, v_cache, lens, block_table=table,
                                                            return_block_logit=True, block_size=64, **be)
        t1 = time.perf_counter()
        blk = paddle_fa4.select_topk_blocks(bl, lse, topk=cfg.topk_blocks, num_kv_heads=hkv, sink_blocks=1, **be)
        tables, seq = paddle_fa4.block_selection_to_page_table(blk, table, lens, page_size=p, num_kv_heads=hkv,
                                                               window=cfg.window)
        sparse_next = paddle_fa4.sparse_decode_attention(q_next, k_cache, v_cache, tables, seq, **be)
        t2 = time.perf_counter()
        dense_next = paddle_fa4.flash_attn_with_kvcache(q_next, k_cache, v_cache, lens, block_table=table, **be)
        t3 = time.perf_counter()
        h2o.reset_scores(state, new_slots, **be)
        _, scores = h2o.token_accumulate(q[:, 0], k_cache, state, table, lens, return_page_scores=True,
                                          gqa_reduce="max", **be)
        st, sl = h2o.select_pages(scores, table, lens, page_size=p, topk=cfg.h2o_topk, bos=1, eos=1, **be)
        sparse_h2o = paddle_fa4.sparse_decode_attention(q, k_cache, v_cache, st, sl, **be)
        t4 = time.perf_counter()
        times["dense decode + block_logit"] += t1 - t0
        times["hysparse select + tables + sparse decode"] += t2 - t1
        times["h2o reset + accumulate + select + sparse decode"] += t4 - t3
        errs["hysparse"].append(rel(sparse_next, dense_next))
        errs["h2o"].append(rel(sparse_h2o, dense))
        denom = float(hkv * b * (pos + 1))
        read["hysparse"].append(float(seq.numpy().sum()) / denom)
        read["h2o"].append(float(sl.numpy().sum()) / denom)
        finite = bool(np.isfinite(dense.astype("float32").numpy()).all()
                      and np.isfinite(sparse_next.astype("float32").numpy()).all()
                      and np.isfinite(sparse_h2o.astype("float32").numpy()).all())
        if not finite:
            raise RuntimeError("decode-demo: a NaN from the stale pages reached an output")
    report = {
        "backend": "reference" if not on_gpu or cfg.backend == "reference" else cfg.backend,
        "hysparse_rel_err_mean": float(np.mean(errs["hysparse"])),
        "h2o_rel_err_mean": float(np.mean(errs["h2o"])),
        "hysparse_kv_read_fraction": float(np.mean(read["hysparse"])),
        "h2o_kv_read_fraction": float(np.mean(read["h2o"])),
        "outputs_finite": True, "times_s": times,
    }
    _print_report(cfg, report)
    return report


def _print_report(cfg: DecodeDemoConfig, r: dict) -> None:
    print(f"decode demo: B={cfg.batch}, Hq/Hkv={cfg.heads}/{cfg.kv_heads}, D={cfg.head_dim}, page {cfg.page_size}, "
          f"prompt {cfg.prompt} tokens, {cfg.steps} decode steps, backend {r['backend']} "
          f"(stale pages hold NaN: every output stayed finite)")
    print(f"  {'method':<66} {'rel. L2 err vs dense':>20} {'KV read':>8}")
    hysparse = "HySparse: top-%d blocks of 64 (1 sink) + %d-token window, next layer" % (cfg.topk_blocks, cfg.window)
    print(f"  {hysparse:<66}"
          f" {r['hysparse_rel_err_mean']:>20.4f} {100 * r['hysparse_kv_read_fraction']:>7.1f}%")
    print(f"  {'H2O token flow (gqa max): top-%d pages + 1 bos + 1 eos' % cfg.h2o_topk:<66}"
          f" {r['h2o_rel_err_mean']:>20.4f} {100 * r['h2o_kv_read_fraction']:>7.1f}%")
    print("  (KV read = tokens the sparse attention reads over the dense cache's, per kv head; H2O's scoring pass "
          "reads every key once more)")
    print(f"  time per step (all {cfg.steps} steps averaged):")
    for name, sec in r["times_s"].items():
        print(f"    {name:<50} {1e3 * sec / cfg.steps:9.1f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_fa4 decode-demo", description=__doc__.splitlines()[0])
    d = DecodeDemoConfig()
    for flag, default, low in (("--batch", d.batch, 1), ("--prompt", d.prompt, 1), ("--steps", d.steps, 1),
                               ("--heads", d.heads, 1), ("--kv-heads", d.kv_heads, 1), ("--head-dim", d.head_dim, 1),
                               ("--page-size", d.page_size, 1), ("--topk-blocks", d.topk_blocks, 1),
                               ("--window", d.window, 0), ("--h2o-topk", d.h2o_topk, 1), ("--seed", d.seed, 0)):
        ap.add_argument(flag, type=int, default=default, help=f"default %(default)s, >= {low}")
    ap.add_argument("--backend", default=d.backend, choices=("auto", "cute", "reference"))
    args = ap.parse_args(argv)
    for flag, low in (("batch", 1), ("prompt", 1), ("steps", 1), ("heads", 1), ("kv_heads", 1), ("head_dim", 1),
                      ("page_size", 1), ("topk_blocks", 1), ("window", 0), ("h2o_topk", 1), ("seed", 0)):
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    run(DecodeDemoConfig(batch=args.batch, prompt=args.prompt, steps=args.steps, heads=args.heads,
                         kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                         topk_blocks=args.topk_blocks, window=args.window, h2o_topk=args.h2o_topk, seed=args.seed,
                         backend=args.backend))
    return 0

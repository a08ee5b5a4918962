"""Benchmark: cross-head top-k block selection kernel vs the composite torch path, on one GPU.

    python bench/bench_select.py [--seqlens 8192,16384,32768,65536,131072] [--heads 32]
                                 [--block-size 64] [--topk 16] [--json FILE] [--no-forward]

Per sequence length S (B = 1, Hq = 32, causal, block 64, topk 16, 1 sink + 2 local blocks):

- ``kernel``        our ``select_topk_blocks`` kernel on a causal ``block_logit [1, H, S, S/64]``
- ``kernel_limit``  the same with the causal read limit (``block_size``/``seqlen_k`` given)
- ``composite``     torch: subtract lse, max over heads, top-k, sort (the same semantics incl.
                    sink/local blocks; ``[B, H, S, nb]`` log-weights materialised)
- ``composite_min`` torch: subtract, max over heads, ``torch.topk`` only (the cheapest path)
- ``indices``       our ``blocks_to_indices`` kernel on the selection
- ``fa4_fwd``       FA4 (flash_attn.cute) causal bf16 forward, head_dim 128, as the forward anchor;
                    ``ours_fwd`` / ``ours_fwd_blk``: our forward without/with block_logit, when it runs

Times are CUDA-event medians after warm-up. The selection is checked against the composite path
(random logits: ties have probability ~0, so the ids must agree exactly).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import median_ms  # noqa: E402 (bench/ is on sys.path when run as a script)


def cuda_time(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs (CUDA events)."""
    return median_ms(fn, iters, warmup)


def causal_inputs(s: int, h: int, bs: int, gen: torch.Generator):
    nb = -(-s // bs)
    bl = torch.empty((1, h, s, nb), device="cuda").normal_(0.0, 2.0, generator=gen)
    visible = torch.arange(nb, device="cuda")[None, :] * bs <= torch.arange(s, device="cuda")[:, None]
    bl.masked_fill_(~visible, float("-inf"))
    lse = bl.amax(dim=-1) + 3.0
    return bl, lse


def composite(bl, lse, topk, sink, local):
    """The same semantics in plain torch (ties not pinned: torch.topk does not promise an order)."""
    nb = bl.shape[-1]
    w = (bl - lse.unsqueeze(-1)).amax(dim=1)  # [B, S, nb], after a [B, H, S, nb] temporary
    visible = w > float("-inf")
    col = torch.arange(nb, device=bl.device)
    diag = torch.where(visible, col, -1).amax(dim=-1, keepdim=True)
    forced = visible & ((col < sink) | (col > diag - local))
    w = torch.where(forced, float("inf"), w)
    vals, idx = torch.topk(w, min(topk, nb), dim=-1)
    idx = torch.where(vals > float("-inf"), idx, nb).sort(dim=-1).values
    return torch.where(idx == nb, -1, idx).to(torch.int32)


def composite_min(bl, lse, topk):
    w = (bl - lse.unsqueeze(-1)).amax(dim=1)
    return torch.topk(w, topk, dim=-1).indices


def forward_times(s: int, h: int, d: int, bs: int, bl_buf, row: dict) -> None:
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    try:
        from flash_attn.cute.interface import flash_attn_func

        row["fa4_fwd_ms"] = cuda_time(lambda: flash_attn_func(q, k, v, causal=True), warmup=1, iters=3)
    except Exception as exc:  # the anchor missing must not hide our numbers
        row["fa4_fwd_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        from cute_kernels.attention.launch import fwd_config, run_fwd

        out = torch.empty_like(q)
        lse = torch.empty((1, h, s), device="cuda")
        scale = 1.0 / math.sqrt(d)
        for key, size, blk in (("ours_fwd_ms", 0, None), ("ours_fwd_blk_ms", bs, bl_buf)):
            cfg = fwd_config(90, "bfloat16", d, d, 1, True, False, False, size, False)
            run = (lambda cfg=cfg, blk=blk: run_fwd(cfg, q, k, v, out, lse, blk, None, None, softmax_scale=scale,
                                                     softcap=0.0, window_left=-1, window_right=-1, max_seqlen_q=s))
            row[key] = cuda_time(run, warmup=1, iters=3)
    except Exception as exc:
        row["ours_fwd_error"] = f"{type(exc).__name__}: {exc}"[:300]


def bench_one(s: int, h: int, bs: int, topk: int, with_forward: bool, gen) -> dict:
    from cute_kernels.select.launch import run_blocks_to_indices, run_select_topk_blocks

    sink, local = 1, 2
    bl, lse = causal_inputs(s, h, bs, gen)
    nb = bl.shape[-1]
    out = torch.empty((1, 1, s, topk), dtype=torch.int32, device="cuda")
    row = {"S": s, "H": h, "block_size": bs, "topk": topk, "nb": nb,
           "block_logit_GiB": bl.numel() * 4 / 2**30}
    sel = lambda: run_select_topk_blocks(bl, lse, out, sink_blocks=sink, local_blocks=local)  # noqa: E731
    sel_lim = lambda: run_select_topk_blocks(bl, lse, out, sink_blocks=sink, local_blocks=local,  # noqa: E731
                                             causal_limit=(bs, s))
    row["kernel_ms"] = cuda_time(sel)
    row["kernel_limit_ms"] = cuda_time(sel_lim)
    row["kernel_GBps"] = bl.numel() * 4 / row["kernel_ms"] / 1e6
    sel_lim()
    want = composite(bl, lse, topk, sink, local)
    row["mismatched_rows_vs_composite"] = int((out[0, 0] != want[0]).any(dim=-1).sum())
    row["composite_ms"] = cuda_time(lambda: composite(bl, lse, topk, sink, local), warmup=1, iters=3)
    row["composite_min_ms"] = cuda_time(lambda: composite_min(bl, lse, topk), warmup=1, iters=3)
    idx = torch.empty((1, 1, s, topk * bs), dtype=torch.int32, device="cuda")
    row["indices_ms"] = cuda_time(lambda: run_blocks_to_indices(out, idx, block_size=bs, seqlen_k=s))
    best = min(row["kernel_ms"], row["kernel_limit_ms"])
    row["speedup_vs_composite"] = row["composite_ms"] / best
    row["speedup_vs_composite_min"] = row["composite_min_ms"] / best
    del want
    if with_forward:
        forward_times(s, h, 128, bs, bl, row)
        fwd = row.get("ours_fwd_ms") or row.get("fa4_fwd_ms")
        if fwd:
            blk_extra = max(0.0, row.get("ours_fwd_blk_ms", 0.0) - row.get("ours_fwd_ms", 0.0))
            row["selection_over_forward"] = (best + row["indices_ms"]) / fwd
            if "ours_fwd_blk_ms" in row:
                row["block_logit_overhead_ms"] = blk_extra
                row["selection_plus_block_logit_over_forward"] = (best + row["indices_ms"] + blk_extra) / row["ours_fwd_ms"]
            if "fa4_fwd_ms" in row:
                row["selection_over_fa4_forward"] = (best + row["indices_ms"]) / row["fa4_fwd_ms"]
    del bl, lse
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192,16384,32768,65536,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-forward", action="store_true", help="skip the forward-time anchors")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    for s in (int(x) for x in args.seqlens.split(",")):
        try:
            row = bench_one(s, args.heads, args.block_size, args.topk, not args.no_forward, gen)
        except Exception as exc:
            row = {"S": s, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "traceback"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

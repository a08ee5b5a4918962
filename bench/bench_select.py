"""Benchmark: cross-head top-k block selection kernel vs the composite torch path, on one GPU.

    python bench/bench_select.py [--seqlens 8192,16384,32768,65536,131072] [--heads 32]
                                 [--block-size 64] [--topk 16] [--no-forward] [--forward-seqlens LIST]
                                 [--window 0.5] [--rounds 3] [--no-flush] [--graph]
                                 [--json FILE] [--markdown [FILE]]

Per sequence length S (B = 1, Hq = 32, causal, block 64, topk 16, 1 sink + 2 local blocks):

- ``kernel``        our ``select_topk_blocks`` kernel on a causal ``block_logit [1, H, S, S/64]``
- ``kernel_limit``  the same with the causal read limit (``block_size``/``seqlen_k`` given)
- ``composite``     torch: subtract lse, max over heads, top-k, sort (the same semantics incl.
                    sink/local blocks; ``[B, H, S, nb]`` log-weights materialised)
- ``composite_min`` torch: subtract, max over heads, ``torch.topk`` only (the cheapest path)
- ``indices``       our ``blocks_to_indices`` kernel on the selection
- ``fa4_fwd``       FA4 (flash_attn.cute) causal bf16 forward, head_dim 128, as the forward anchor;
                    ``ours_fwd`` / ``ours_fwd_blk``: our forward without/with block_logit, when it runs

Kernel time: bench/_timing.py (each variant in its own >= 0.5 s window, launches queued back to back,
L2 flushed between repetitions, alternating windows for --rounds rounds; median and min-max of the
window medians); the selection variants share one set of rounds (speed-ups per round), the
forward anchors a second one after it (block_logit overhead per round; fractions of the forward from
the two sets' medians). Host cost per call (µs): 100 calls on a tiny input
(S 1024) with the GPU kept busy, our launchers and FA4's interface. The selection is checked against
the composite path (random logits: ties have probability ~0, so the ids must agree exactly).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import (RunInfo, add_method_args, bench_windows, host_us_per_call, method_from_args,  # noqa: E402
                     timer_from_args, write_markdown)

SEL_VARIANTS = ("kernel", "kernel_limit", "composite", "composite_min", "indices")
FWD_VARIANTS = ("fa4_fwd", "ours_fwd", "ours_fwd_blk")


def causal_inputs(s: int, h: int, bs: int, gen):
    import torch

    nb = -(-s // bs)
    bl = torch.empty((1, h, s, nb), device="cuda").normal_(0.0, 2.0, generator=gen)
    visible = torch.arange(nb, device="cuda")[None, :] * bs <= torch.arange(s, device="cuda")[:, None]
    bl.masked_fill_(~visible, float("-inf"))
    lse = bl.amax(dim=-1) + 3.0
    return bl, lse


def composite(bl, lse, topk, sink, local):
    """The same semantics in plain torch (ties not pinned: torch.topk does not promise an order)."""
    import torch

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
    import torch

    w = (bl - lse.unsqueeze(-1)).amax(dim=1)
    return torch.topk(w, topk, dim=-1).indices


def forward_fns(s: int, h: int, d: int, bs: int, bl_buf, errors: dict) -> dict:
    """The forward anchors: FA4 (interface), ours without / with block_logit (launcher), causal bf16."""
    import torch

    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {}
    try:
        from flash_attn.cute.interface import flash_attn_func

        fns["fa4_fwd"] = lambda: flash_attn_func(q, k, v, causal=True)
    except Exception as exc:  # the anchor missing must not hide our numbers
        errors["fa4_fwd_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        from cute_kernels.attention.launch import fwd_config, run_fwd

        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor  # the exact CC (its own build)
        out = torch.empty_like(q)
        lse = torch.empty((1, h, s), device="cuda")
        blk = bl_buf  # [1, h, s, s / bs]: the forward's block_logit shape
        scale = 1.0 / math.sqrt(d)
        for key, size, b_ in (("ours_fwd", 0, None), ("ours_fwd_blk", bs, blk)):
            cfg = fwd_config(arch, "bfloat16", d, d, 1, True, False, False, size, False)
            fns[key] = (lambda cfg=cfg, b_=b_: run_fwd(cfg, q, k, v, out, lse, b_, None, None, softmax_scale=scale,
                                                       softcap=0.0, window_left=-1, window_right=-1,
                                                       max_seqlen_q=s))
    except Exception as exc:
        errors["ours_fwd_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return fns


def selection_fns(s: int, h: int, bs: int, topk: int, gen):
    import torch

    from cute_kernels.select.launch import run_blocks_to_indices, run_select_topk_blocks

    sink, local = 1, 2
    bl, lse = causal_inputs(s, h, bs, gen)
    out = torch.empty((1, 1, s, topk), dtype=torch.int32, device="cuda")
    idx = torch.empty((1, 1, s, topk * bs), dtype=torch.int32, device="cuda")
    fns = {"kernel": lambda: run_select_topk_blocks(bl, lse, out, sink_blocks=sink, local_blocks=local),
           "kernel_limit": lambda: run_select_topk_blocks(bl, lse, out, sink_blocks=sink, local_blocks=local,
                                                          causal_limit=(bs, s)),
           "composite": lambda: composite(bl, lse, topk, sink, local),
           "composite_min": lambda: composite_min(bl, lse, topk),
           "indices": lambda: run_blocks_to_indices(out, idx, block_size=bs, seqlen_k=s)}
    return fns, bl, lse, out


def ratio_dict(res, num, den) -> dict:
    return res.ratio(num, den).as_dict()


def bench_one(s: int, h: int, bs: int, topk: int, with_forward: bool, gen, timer, rounds: int) -> dict:
    import torch

    fns, bl, lse, out = selection_fns(s, h, bs, topk, gen)
    nb = bl.shape[-1]
    row = {"S": s, "H": h, "block_size": bs, "topk": topk, "nb": nb,
           "block_logit_GiB": bl.numel() * 4 / 2**30}
    fns["kernel_limit"]()
    want = composite(bl, lse, topk, 1, 2)
    row["mismatched_rows_vs_composite"] = int((out[0, 0] != want[0]).any(dim=-1).sum())
    del want
    res = bench_windows(fns, rounds=rounds, timer=timer)
    row["stats"] = {n: st.as_dict() for n, st in res.items()}
    row["rounds"] = res.rounds
    for n, st in res.items():
        row[f"{n}_ms"] = st.median_ms
    row["kernel_GBps"] = bl.numel() * 4 / row["kernel_ms"] / 1e6
    row["speedup_vs_composite"] = ratio_dict(res, "composite", "kernel_limit")
    row["speedup_vs_composite_min"] = ratio_dict(res, "composite_min", "kernel_limit")
    row["speedup_full_read_vs_composite"] = ratio_dict(res, "composite", "kernel")
    ffns = {}
    if with_forward:
        # A second set of rounds after the selection's: ours_fwd_blk overwrites the random block_logit,
        # which the selection variants must not read. Fractions of the forward use both sets' medians.
        errors = {}
        ffns = forward_fns(s, h, 128, bs, bl, errors)
        row.update(errors)
    if ffns:
        fres = bench_windows(ffns, rounds=rounds, timer=timer)
        row["forward_stats"] = {n: st.as_dict() for n, st in fres.items()}
        row["forward_rounds"] = fres.rounds
        for n, st in fres.items():
            row[f"{n}_ms"] = st.median_ms
        sel = res["kernel_limit"].median_ms + res["indices"].median_ms  # selection (+limit) + indices
        if "ours_fwd" in fres:
            row["selection_over_forward"] = sel / fres["ours_fwd"].median_ms
        if "ours_fwd_blk" in fres and "ours_fwd" in fres:
            row["block_logit_overhead"] = fres.ratio("ours_fwd_blk", "ours_fwd").as_dict()  # per round
            row["selection_plus_block_logit_over_forward"] = (
                (sel + fres["ours_fwd_blk"].median_ms - fres["ours_fwd"].median_ms) / fres["ours_fwd"].median_ms)
        if "fa4_fwd" in fres:
            row["selection_over_fa4_forward"] = sel / fres["fa4_fwd"].median_ms
    del ffns
    del bl, lse, fns
    torch.cuda.empty_cache()
    return row


def fmt_ms(st) -> str:
    return f"{st['median_ms']:.3f} ({st['lo_ms']:.3f}-{st['hi_ms']:.3f})"


def fmt_ratio(x, digits=2) -> str:
    return f"{x['median']:.{digits}f} ({x['lo']:.{digits}f}-{x['hi']:.{digits}f})"


def markdown(info: RunInfo, rows: list, host: dict) -> str:
    lines = ["# Selection", "", info.markdown(), "",
             "ms: median window (min-max of the window medians); speed-ups per round, median (min-max).", "",
             "| S | block_logit GiB | kernel | kernel+limit | composite | composite_min | speed-up vs composite "
             "| vs composite_min | blocks_to_indices | mismatched rows |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['S']} | error: {r['error'][:80]} |" + " |" * 8)
            continue
        st = r["stats"]
        lines.append(f"| {r['S']} | {r['block_logit_GiB']:.3f} | {fmt_ms(st['kernel'])} | {fmt_ms(st['kernel_limit'])} | "
                     f"{fmt_ms(st['composite'])} | {fmt_ms(st['composite_min'])} | "
                     f"{fmt_ratio(r['speedup_vs_composite'])} | {fmt_ratio(r['speedup_vs_composite_min'])} | "
                     f"{fmt_ms(st['indices'])} | {r['mismatched_rows_vs_composite']} |")
    fwd_rows = [r for r in rows if "forward_stats" in r]
    if fwd_rows:
        lines += ["", "| S | FA4 fwd | ours fwd | ours fwd + block_logit | ours+bl time / ours time | selection / ours fwd "
                  "| (selection + block_logit overhead) / ours fwd | selection / FA4 fwd |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in fwd_rows:
            fs = r["forward_stats"]

            def g(key, src=fs):
                return fmt_ms(src[key]) if key in src else "-"

            def q(key, digits=3):
                if key not in r:
                    return "-"
                return fmt_ratio(r[key], digits) if isinstance(r[key], dict) else f"{r[key]:.{digits}f}"

            lines.append(f"| {r['S']} | {g('fa4_fwd')} | {g('ours_fwd')} | {g('ours_fwd_blk')} | "
                         f"{q('block_logit_overhead')} | {q('selection_over_forward')} | "
                         f"{q('selection_plus_block_logit_over_forward')} | {q('selection_over_fa4_forward')} |")
    if host:
        lines += ["", "Host cost per call (µs, S 1024, GPU kept busy): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192,16384,32768,65536,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--no-forward", action="store_true", help="skip the forward-time anchors")
    ap.add_argument("--forward-seqlens", default="8192,32768,131072",
                    help="lengths at which the forward anchors run (a subset of --seqlens)")
    ap.add_argument("--host-n", type=int, default=100, help="calls per host-cost measurement (0: skip)")
    add_method_args(ap)
    args = ap.parse_args(argv)
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.forward_seqlens = {int(x) for x in args.forward_seqlens.split(",") if x}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = timer_from_args(args)
    print(f"GPU: {info.gpu}  commit {info.commit}", flush=True)
    host = {}
    if args.host_n > 0:
        fns, bl, _, _ = selection_fns(1024, args.heads, args.block_size, args.topk, gen)
        host = {n: host_us_per_call(fns[n], n=args.host_n) for n in ("kernel", "kernel_limit", "indices")}
        if not args.no_forward:
            errors = {}
            ffns = forward_fns(1024, args.heads, 128, args.block_size, bl, errors)
            host.update({n: host_us_per_call(f, n=args.host_n) for n, f in ffns.items()})
            del ffns
        del fns, bl
        print(json.dumps({"host_us_per_call": {k: round(v, 1) for k, v in host.items()}}), flush=True)
    rows = []
    for s in args.seqlens:
        try:
            row = bench_one(s, args.heads, args.block_size, args.topk,
                            not args.no_forward and s in args.forward_seqlens, gen, timer, args.rounds)
        except Exception as exc:
            row = {"S": s, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k not in ("traceback", "stats", "rounds", "forward_stats", "forward_rounds")}),
              flush=True)
    info.finish()
    if timer.capture_errors:
        info.method["graph_capture_failed"] = timer.capture_errors
    info.method["host_calls"] = args.host_n
    write_markdown(args.markdown, markdown(info, rows, host))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": info.as_dict(), "host_us_per_call": host, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""One training step of a HySparse full-attention layer: forward with block_logit + backward, ours vs FA4 b36.

    python bench/bench_layer.py [--hdims 128] [--seqlens 8192,16384] [--tokens 32768] [--heads 16,32/8]
                                [--modes full,causal] [--block-size 64] [--host-n 100]
                                [--window 0.5] [--rounds 3] [--no-flush] [--graph] [--json FILE] [--markdown [FILE]]

What PaddleFleet's HySparse layer runs per step is "FA4 forward with block_logit + FA4 backward"; FA4 b36
has no block_logit, so its row is the plain fwd + bwd the layer would need besides a separate block-max
pass. Variants (bf16, B = tokens / S; TFLOPs/s = 3.5 x the forward's 4*B*Hq*Sq*Sk*d, halved for causal):
  ours_layer  ``run_fwd`` with fused block_logit (block_size) then ``run_bwd`` (pre + main + post)
  ours_plain  the same forward without block_logit, then ``run_bwd``
  fa4_layer   FA4 b36 ``_flash_attn_fwd`` (return lse) then ``_flash_attn_bwd``
Kernel time: bench/_timing.py (each variant in its own window, launches queued back to back, L2 flushed
between repetitions, alternating order for --rounds rounds). Ratio per round: ours / FA4 = t(fa4_layer) /
t(ours_layer) (> 1: ours faster). Host cost per call (µs, own columns, tiny input B 1 S 128 with the GPU
kept busy): the step (fwd + bwd) and the backward alone, ours through the launchers, FA4 through its
interface functions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import (add_method_args, add_shape_args, bench_windows, fmt_spread, host_us_per_call,  # noqa: E402
                     method_from_args, parse_shape_args, RunInfo, timer_from_args, write_markdown)

VARIANTS = ("ours_layer", "ours_plain", "fa4_layer")
HOST = ("ours_step", "fa4_step", "ours_bwd", "fa4_bwd")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap, hdims="128", seqlens="8192,16384")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--host-n", type=int, default=100, help="calls per host-cost measurement (0: skip)")
    add_method_args(ap)
    args = ap.parse_args(argv)
    parse_shape_args(args)
    return args


def make_step_fns(torch, b, s, hq, hkv, d, causal, bs):
    """Callables of one step per variant (and the two backwards alone), on fresh random inputs."""
    from cute_kernels.attention.bwd_launch import bwd_config, run_bwd, workspace_shapes
    from cute_kernels.attention.launch import fwd_config, run_fwd
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(b, s, h, d, device="cuda", generator=g).to(dt) for h in (hq, hkv, hkv)]
    do = torch.randn(b, s, hq, d, device="cuda", generator=g).to(dt)
    scale = 1.0 / math.sqrt(d)
    out, lse = torch.empty_like(q), torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
    blk = torch.empty(b, hq, s, -(-s // bs), device="cuda", dtype=torch.float32)
    cfg_bl = fwd_config(90, dt, d, d, hq // hkv, causal, False, False, bs, False)
    cfg_plain = fwd_config(90, dt, d, d, hq // hkv, causal, False, False, 0, False)
    bcfg = bwd_config(90, dt, d, d, hq // hkv, causal, False, False, False, False)
    ws = {n: torch.empty(sh, device="cuda", dtype=getattr(torch, t_))
          for n, (sh, t_) in workspace_shapes(bcfg, batch=b, seqlen_q=s, num_heads=hq, seqlen_k=s,
                                                             num_kv_heads=hkv).items()}
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def fwd(cfg, bl):
        run_fwd(cfg, q, k, v, out, lse, bl, None, None, softmax_scale=scale, softcap=0.0, window_left=-1,
                window_right=-1, max_seqlen_q=s)

    def bwd():
        run_bwd(bcfg, do, q, k, v, out, lse, None, dq, dk, dv, None, None, ws, softmax_scale=scale, softcap=0.0,
                window_left=-1, window_right=-1, max_seqlen_q=s, max_seqlen_k=s)

    def fa4_fwd():
        return _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)[:2]

    fa4_out = fa4_fwd()

    def fa4_bwd():
        _flash_attn_bwd(q, k, v, fa4_out[0], do, fa4_out[1], scale, causal)

    def fa4_step():
        o, l_ = fa4_fwd()
        _flash_attn_bwd(q, k, v, o, do, l_, scale, causal)

    step = {"ours_layer": lambda: (fwd(cfg_bl, blk), bwd()), "ours_plain": lambda: (fwd(cfg_plain, None), bwd()),
            "fa4_layer": fa4_step}
    return step, {"ours_step": step["ours_layer"], "fa4_step": fa4_step, "ours_bwd": bwd, "fa4_bwd": fa4_bwd}


def markdown(info, rows, host):
    head = ["d", "S", "B", "Hq/Hkv", "mode"] + [f"{v} TFLOPs/s" for v in VARIANTS] + ["ours / FA4 (step)"]
    lines = ["# Training step of the full layer (fwd with block_logit + bwd)", "", info.markdown(), "",
             "TFLOPs/s (3.5 x fwd FLOPs) from the median window (min-max of window medians); ratio per round, "
             "median (min-max).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["head_dim"]), str(r["seqlen"]), str(r["batch"]), f"{r['heads']}/{r['heads_kv']}",
                 "causal" if r["causal"] else "full"]
        cells += [fmt_spread(r["tflops"][v], 0) for v in VARIANTS]
        cells.append(fmt_spread(r["ratio"]))
        lines.append("| " + " | ".join(cells) + " |")
    if host:
        lines += ["", "Host cost per call (µs, B 1 S 128, GPU kept busy):", "",
                  "| d | mode | " + " | ".join(HOST) + " |", "|" + "---|" * (len(HOST) + 2)]
        for (d, mode), h in host.items():
            lines.append(f"| {d} | {mode} | " + " | ".join(f"{h[n]:.1f}" for n in HOST) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    timer = timer_from_args(args, torch)
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    host = {}
    if args.host_n > 0:
        for d in args.hdims:
            for mode in args.modes:
                _, fns = make_step_fns(torch, 1, 128, 2, 2, d, mode == "causal", args.block_size)
                host[(d, mode)] = {n: host_us_per_call(fns[n], n=args.host_n) for n in HOST}
                print(f"host d {d} {mode}: " + ", ".join(f"{n} {x:.1f} us" for n, x in host[(d, mode)].items()),
                      flush=True)
    rows = []
    for d in args.hdims:
        for hq, hkv in args.heads:
            for s in args.seqlens:
                b = max(1, args.tokens // s)
                for mode in args.modes:
                    causal = mode == "causal"
                    step, _ = make_step_fns(torch, b, s, hq, hkv, d, causal, args.block_size)
                    res = bench_windows(step, rounds=args.rounds, timer=timer)
                    flops = 3.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
                    ratio = res.ratio("fa4_layer", "ours_layer").as_dict()
                    tflops = {n: {"median": flops / (st.median_ms * 1e9), "lo": flops / (st.hi_ms * 1e9),
                                  "hi": flops / (st.lo_ms * 1e9)} for n, st in res.items()}
                    rows.append({"head_dim": d, "seqlen": s, "batch": b, "heads": hq, "heads_kv": hkv,
                                 "causal": causal, "stats": {n: st.as_dict() for n, st in res.items()},
                                 "tflops": tflops, "ratio": ratio})
                    print(f"d {d} S {s} B {b} H {hq}/{hkv} {mode}: "
                          + "; ".join(f"{n} {tflops[n]['median']:.0f} TF" for n in VARIANTS)
                          + f"; ours / FA4 {fmt_spread(ratio)}", flush=True)
                    del step
                    torch.cuda.empty_cache()
    info.finish()
    write_markdown(args.markdown, markdown(info, rows, host))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"run": info.as_dict(), "rows": rows,
                       "host_us": {f"{d}/{m}": h for (d, m), h in host.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention backward speed on one GPU: ours (pre + main + post) vs FA4 b36's backward, same inputs.

    python bench/bench_bwd.py [--hdims 64,128,256] [--seqlens 2048,4096,8192,16384] [--tokens 32768]
                              [--heads 16,32/8] [--modes full,causal] [--variants ours,fa4,ours_det,fa4_det]
                              [--host-n 100] [--window 0.5] [--rounds 3] [--no-flush] [--graph] [--json FILE]
                              [--markdown [FILE]]

Rows: bf16, B = tokens / S, heads "Hq" (MHA) or "Hq/Hkv" (GQA). TFLOPs/s = 2.5 x the forward's
4*B*Hq*Sq*Sk*d (halved for causal). Variants:
  ours       ``bwd_launch.run_bwd`` (preprocess, main kernel, postprocess; workspace allocated once)
  ours_det   the same with deterministic=True (causal: the descending dQ order, bwd_sm90's
             Note [deterministic dQ, descending order])
  fa4        FA4 b36 ``flash_attn.cute.interface._flash_attn_bwd`` (its own pre/post, tiles, dq/dk/dv allocs)
  fa4_det    the same with deterministic=True
out / lse come from FA4's forward (both backwards read the same tensors). Kernel time: bench/_timing.py
(each variant in its own window, launches queued back to back, L2 flushed between repetitions, windows
in alternating order for --rounds rounds; median and min-max of the window medians). Ratios per
round: ours / FA4 = t(fa4) / t(ours) (> 1: ours faster), det likewise. Host cost per call, its own
table (``_timing.host_us_per_call``: --host-n back-to-back calls on B 1, S 128, H 2, the GPU kept
busy so no call waits for it): ours through the launcher (``run_bwd``), FA4 through its interface.
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

VARIANTS = ("ours", "fa4", "ours_det", "fa4_det")
RATIOS = (("ours_over_fa4", "fa4", "ours", "ours / FA4"),
          ("det_over_fa4_det", "fa4_det", "ours_det", "ours det / FA4 det"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap, hdims="64,128", seqlens="2048,4096,8192,16384")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--host-n", type=int, default=100, help="calls per host-cost measurement (0: skip)")
    add_method_args(ap)
    args = ap.parse_args(argv)
    parse_shape_args(args)
    args.variants = args.variants.split(",")
    return args


def markdown(info, rows, variants, host=None):
    ratios = [(k, lab) for k, num, den, lab in RATIOS if num in variants and den in variants]
    head = ["d", "S", "B", "Hq/Hkv", "mode"] + [f"{v} TFLOPs/s" for v in variants] + [lab for _, lab in ratios]
    lines = ["# Attention backward", "", info.markdown(), "",
             "TFLOPs/s (2.5 x fwd FLOPs) from the median window (min-max of window medians); ratios per round, "
             "median (min-max).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["head_dim"]), str(r["seqlen"]), str(r["batch"]), f"{r['heads']}/{r['heads_kv']}",
                 "causal" if r["causal"] else "full"]
        for v in variants:
            t = r["tflops"].get(v)
            cells.append(fmt_spread(t, 0))
        for k, _ in ratios:
            x = r["ratios"].get(k)
            cells.append(fmt_spread(x))
        lines.append("| " + " | ".join(cells) + " |")
    if host:
        names = list(next(iter(host.values())))
        lines += ["", "Host cost per call (µs, B 1 S 128 H 2, GPU kept busy):", "",
                  "| d | mode | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
        for (d, mode), h in host.items():
            lines.append(f"| {d} | {mode} | " + " | ".join(f"{h[n]:.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def make_fns(torch, b: int, s: int, hq: int, hkv: int, d: int, causal: bool, variants):
    """{variant: callable} of one shape (inputs, FA4's forward out / lse, our workspace) and its FLOPs."""
    from cute_kernels.attention.bwd_launch import bwd_config, run_bwd, unsupported_reason, workspace_shapes
    from flash_attn.cute.interface import _flash_attn_bwd, flash_attn_func

    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(b, s, h, d, device="cuda", generator=g).to(dt) for h in (hq, hkv, hkv)]
    do = torch.randn(b, s, hq, d, device="cuda", generator=g).to(dt)
    scale = 1.0 / math.sqrt(d)
    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    fns = {}
    for det, name in ((False, "ours"), (True, "ours_det")):
        if name not in variants:
            continue
        cfg = bwd_config(90, dt, d, d, hq // hkv, causal, False, False, False, det)
        if unsupported_reason(cfg) is not None:
            continue
        ws = {n: torch.empty(sh, device="cuda", dtype=getattr(torch, t_))
              for n, (sh, t_) in workspace_shapes(cfg, batch=b, seqlen_q=s, num_heads=hq, seqlen_k=s,
                                                 num_kv_heads=hkv).items()}
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def ours(cfg=cfg, ws=ws, dq=dq, dk=dk, dv=dv):
            run_bwd(cfg, do, q, k, v, out, lse, None, dq, dk, dv, None, None, ws, softmax_scale=scale, softcap=0.0,
                    window_left=-1, window_right=-1, max_seqlen_q=s, max_seqlen_k=s)
        fns[name] = ours
    for det in (False, True):
        name = "fa4_det" if det else "fa4"
        if name in variants:
            fns[name] = (lambda det=det: _flash_attn_bwd(q, k, v, out, do, lse, scale, causal, deterministic=det))
    return fns, 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    timer = timer_from_args(args, torch)
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    host = {}
    if args.host_n > 0:
        for d in args.hdims:
            for mode in args.modes:
                fns, _ = make_fns(torch, 1, 128, 2, 2, d, mode == "causal", args.variants)
                host[(d, mode)] = {n: host_us_per_call(fn, n=args.host_n) for n, fn in fns.items()}
                print(f"host d {d} {mode}: " + ", ".join(f"{n} {x:.1f} us" for n, x in host[(d, mode)].items()),
                      flush=True)
                del fns
    rows = []
    for d in args.hdims:
        for hq, hkv in args.heads:
            for s in args.seqlens:
                b = max(1, args.tokens // s)
                for mode in args.modes:
                    causal = mode == "causal"
                    fns, flops = make_fns(torch, b, s, hq, hkv, d, causal, args.variants)
                    order = [n for n in args.variants if n in fns]
                    res = bench_windows({n: fns[n] for n in order}, rounds=args.rounds, timer=timer)
                    ratios = {key: res.ratio(num, den).as_dict() for key, num, den, _ in RATIOS
                              if num in fns and den in fns}
                    row = {"head_dim": d, "seqlen": s, "batch": b, "heads": hq, "heads_kv": hkv,
                           "causal": causal, "stats": {n: st.as_dict() for n, st in res.items()},
                           "ratios": ratios,
                           "tflops": {n: {"median": flops / (st.median_ms * 1e9), "lo": flops / (st.hi_ms * 1e9),
                                          "hi": flops / (st.lo_ms * 1e9)} for n, st in res.items()}}
                    rows.append(row)
                    parts = [f"{n} {flops / (res[n].median_ms * 1e9):.0f} TF" for n in order]
                    parts += [f"{k_} {fmt_spread(x)}" for k_, x in ratios.items()]
                    print(f"d {d} S {s} B {b} H {hq}/{hkv} {mode}: " + "; ".join(parts), flush=True)
                    del fns
                    torch.cuda.empty_cache()
    info.finish()
    write_markdown(args.markdown, markdown(info, rows, args.variants, host))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"run": info.as_dict(), "rows": rows,
                       "host_us": {f"{d}/{m}": h for (d, m), h in host.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

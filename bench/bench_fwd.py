"""Attention forward speed on one GPU: ours with/without block_logit vs FA4 b36 (and the unfused path).

    python bench/bench_fwd.py [--hdims 64,128,256] [--seqlens 2048,4096,8192,16384] [--tokens 32768]
                              [--heads 16] [--heads-kv N] [--block-size 64] [--modes full,causal]
                              [--variants ours,ours_bl,fa4[,unfused,bl_fill]]
                              [--window 0.5] [--rounds 3] [--no-flush] [--graph]
                              [--json FILE] [--markdown [FILE]]

Rows: bf16, B = tokens / S, Hq = heads, Hkv = heads-kv (default heads). Variants (TFLOPs/s,
4*B*Hq*Sq*Sk*d, halved for causal):
  ours      cute_kernels forward through its launcher (``run_fwd``), lse, no block_logit
  ours_bl   the same with fused block_logit (block_size)
  fa4       FA4 b36 ``flash_attn.cute.interface.flash_attn_func(..., return_lse=True)``
  unfused   FA4 + a separate block-max pass (chunked torch bf16 S = QK^T, masked, amax per block)
  bl_fill   one ``fill_`` of the block_logit buffer (a floor for block_logit's store cost)
Kernel time: bench/_timing.py (each variant in its own >= 0.5 s window, launches queued back to back,
L2 flushed between repetitions, windows in alternating order for --rounds rounds; median and the
min-max of the window medians). Ratios are taken per round: ours+bl / FA4 = t(fa4) / t(ours_bl)
(> 1: ours+bl faster), ours+bl / ours = t(ours) / t(ours_bl) (1 - x: block_logit's overhead),
ours / FA4, ours+bl / unfused. Host cost per call (µs, its own columns): 100 back-to-back calls on a
tiny input (B 1, S 128) with the GPU kept busy, ours through the launcher, FA4 through its interface.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import (fmt_spread, RunInfo, add_method_args, bench_windows, host_us_per_call, method_from_args,  # noqa: E402
                     timer_from_args, write_markdown)

VARIANTS = ("ours", "ours_bl", "fa4", "unfused", "bl_fill")
LABELS = {"ours": "ours", "ours_bl": "ours+bl", "fa4": "FA4 b36", "unfused": "unfused", "bl_fill": "bl fill"}
# (key, numerator variant, denominator variant, label): time ratios taken per round
RATIOS = (("bl_over_fa4", "fa4", "ours_bl", "ours+bl / FA4"),
          ("bl_over_ours", "ours", "ours_bl", "ours+bl / ours"),
          ("ours_over_fa4", "fa4", "ours", "ours / FA4"),
          ("bl_over_unfused", "unfused", "ours_bl", "ours+bl / unfused"),
          ("bl_fill_over_ours", "bl_fill", "ours", "bl fill / ours"))


def block_max_torch(q, k, block_size, causal, scale, out, chunk_rows=1024):
    """The unfused alternative's second pass: block_logit from a chunked bf16 S = QK^T."""
    import torch

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    nb = out.shape[-1]
    qt = q.permute(0, 2, 1, 3)
    kt = k.permute(0, 2, 3, 1).repeat_interleave(h // hkv, dim=1)
    cols = torch.arange(nb * block_size, device=q.device)
    for r0 in range(0, sq, chunk_rows):
        r1 = min(sq, r0 + chunk_rows)
        s = torch.matmul(qt[:, :, r0:r1], kt).float() * scale  # (b, h, rows, sk)
        s = torch.nn.functional.pad(s, (0, nb * block_size - sk), value=float("-inf"))
        if causal:
            rows = torch.arange(r0, r1, device=q.device)[:, None] + (sk - sq)
            s.masked_fill_(cols[None, :] > rows, float("-inf"))
        else:
            s[..., sk:] = float("-inf")
        out[:, :, r0:r1] = s.view(b, h, r1 - r0, nb, block_size).amax(-1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=None, help="kv heads (GQA); default --heads")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--modes", default="full,causal")
    ap.add_argument("--variants", default="ours,ours_bl,fa4",
                    help=f"comma list of {','.join(VARIANTS)}")
    ap.add_argument("--host-n", type=int, default=100, help="calls per host-cost measurement (0: skip)")
    add_method_args(ap)
    args = ap.parse_args(argv)
    args.heads_kv = args.heads_kv or args.heads
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad} (known: {', '.join(VARIANTS)})")
    if args.heads % args.heads_kv:
        ap.error(f"--heads {args.heads} is not a multiple of --heads-kv {args.heads_kv}")
    args.hdims = [int(x) for x in args.hdims.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.modes = args.modes.split(",")
    return args


def row_ratios(res, variants) -> dict:
    out = {}
    for key, num, den, _ in RATIOS:
        if num in variants and den in variants:
            out[key] = res.ratio(num, den).as_dict()
    return out


def markdown(info: RunInfo, rows: list, variants: list) -> str:
    ratios = [(k, lab) for k, num, den, lab in RATIOS if num in variants and den in variants]
    tflops = [v for v in variants if v != "bl_fill"]
    hosts = [v for v in ("ours", "ours_bl", "fa4") if v in variants]
    head = (["d", "S", "B", "Hq/Hkv", "mode"] + [f"{LABELS[v]} TFLOPs/s" for v in tflops]
            + [lab for _, lab in ratios] + [f"host µs {LABELS[v]}" for v in hosts])
    lines = ["# Attention forward", "", info.markdown(), "",
             "TFLOPs/s from the median window (min-max of the window medians in brackets); ratios per round, "
             "median (min-max).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["head_dim"]), str(r["seqlen"]), str(r["batch"]), f"{r['heads']}/{r['heads_kv']}",
                 "causal" if r["causal"] else "full"]
        for v in tflops:
            t = r["tflops"].get(v)
            cells.append(fmt_spread(t, 0))
        for k, _ in ratios:
            x = r["ratios"].get(k)
            cells.append(fmt_spread(x))
        for v in hosts:
            h = r.get("host_us", {}).get(v)
            cells.append("-" if h is None else f"{h:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from cute_kernels.attention.launch import compile_fwd, fwd_config, run_fwd

    variants = list(args.variants)
    fa4 = None
    if "fa4" in variants or "unfused" in variants:
        try:
            from flash_attn.cute.interface import flash_attn_func as fa4
        except Exception as exc:  # noqa: BLE001 - report and go on without the anchor
            print(f"FA4 not available: {exc}", file=sys.stderr)
            variants = [v for v in variants if v not in ("fa4", "unfused")]
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor  # the exact CC: the build this GPU runs (cute_kernels.arch.TARGETS)
    bs, hq, hkv = args.block_size, args.heads, args.heads_kv
    ratio_qk = hq // hkv
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    info.method.update({"host_calls": args.host_n, "host_input": "B 1, S 128"})
    # Compile every config up front (CPU only).
    for d in args.hdims:
        for mode in args.modes:
            for b_sz in (0, bs):
                compile_fwd(fwd_config(arch, "bfloat16", d, d, ratio_qk, mode == "causal", False, False, b_sz, False))
    timer = timer_from_args(args)
    print(f"# {info.gpu}  bf16  tokens={args.tokens} heads={hq}/{hkv} block_size={bs}  commit {info.commit}",
          flush=True)

    def make_fns(q, k, v, out, lse, blk, s, causal, d):
        scale = 1.0 / math.sqrt(d)
        cfg0 = fwd_config(arch, "bfloat16", d, d, ratio_qk, causal, False, False, 0, False)
        cfg1 = fwd_config(arch, "bfloat16", d, d, ratio_qk, causal, False, False, bs, False)

        def ours(cfg, bl):
            run_fwd(cfg, q, k, v, out, lse, bl, None, None, softmax_scale=scale, softcap=0.0,
                    window_left=-1, window_right=-1, max_seqlen_q=s)

        def fa4_fn():
            return fa4(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)

        def unfused():
            fa4_fn()
            block_max_torch(q, k, bs, causal, scale, blk)

        table = {"ours": lambda: ours(cfg0, None), "ours_bl": lambda: ours(cfg1, blk), "fa4": fa4_fn,
                 "unfused": unfused, "bl_fill": lambda: blk.fill_(float("-inf"))}
        return {name: table[name] for name in variants}

    def tensors(b, s, d):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
        blk = torch.empty(b, hq, s, -(-s // bs), device="cuda", dtype=torch.float32)
        return q, k, v, out, lse, blk

    host = {}
    if args.host_n > 0:  # host cost per call: tiny input, GPU kept busy
        for d in args.hdims:
            for mode in args.modes:
                small = tensors(1, 128, d)
                fns = make_fns(*small, 128, mode == "causal", d)
                host[(d, mode)] = {name: host_us_per_call(fns[name], n=args.host_n)
                                   for name in ("ours", "ours_bl", "fa4") if name in fns}
                del small, fns
    rows = []
    for d in args.hdims:
        for s in args.seqlens:
            b = max(1, args.tokens // s)
            q, k, v, out, lse, blk = tensors(b, s, d)
            for mode in args.modes:
                causal = mode == "causal"
                flops = 4 * b * hq * s * s * d / (2 if causal else 1)
                fns = make_fns(q, k, v, out, lse, blk, s, causal, d)
                res = bench_windows(fns, rounds=args.rounds, timer=timer)
                row = {"head_dim": d, "seqlen": s, "batch": b, "heads": hq, "heads_kv": hkv, "causal": causal,
                       "block_size": bs, "stats": {n: st.as_dict() for n, st in res.items()},
                       "rounds": res.rounds, "ratios": row_ratios(res, fns),
                       "host_us": host.get((d, mode), {}),
                       "tflops": {n: {"median": flops / (st.median_ms * 1e9), "lo": flops / (st.hi_ms * 1e9),
                                      "hi": flops / (st.lo_ms * 1e9)}
                                  for n, st in res.items() if n != "bl_fill"}}
                rows.append(row)
                parts = [f"{n} {res[n].median_ms:.3f} ms ({res[n].lo_ms:.3f}-{res[n].hi_ms:.3f})" for n in fns]
                parts += [f"{k_} {fmt_spread(x)}" for k_, x in row["ratios"].items()]
                print(f"d {d} S {s} B {b} {mode}: " + "; ".join(parts), flush=True)
            del q, k, v, out, lse, blk
            torch.cuda.empty_cache()
    info.finish()
    if timer.capture_errors:
        info.method["graph_capture_failed"] = timer.capture_errors
    write_markdown(args.markdown, markdown(info, rows, variants))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"run": info.as_dict(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

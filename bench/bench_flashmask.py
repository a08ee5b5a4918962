"""FlashMask forward speed on one GPU: ``startend_row_indices`` masks vs our causal / varlen kernels.

    python bench/bench_flashmask.py [--seqlens 8192,16384,32768] [--tokens 32768] [--heads 32,32/8]
                                    [--hdim 128] [--masks causal,docs,share_question,sliding_window,prefix_lm]
                                    [--window 0.5] [--rounds 3] [--no-flush] [--graph]
                                    [--json FILE] [--markdown [FILE]]

Rows: bf16, B = tokens / S, heads "Hq" or "Hq/Hkv". Per (S, heads) every variant is timed in the same
alternating windows (bench/_timing.py: >= 0.5 s windows, L2 flushed between repetitions, --rounds
rounds; median and min-max of the window medians), so ratios are per round:

  causal          our causal kernel (no mask), the rate anchor
  fm_causal       the causal mask given as startend ([LTS] = Sq in every column)
  varlen_docs     our varlen kernel over the documents of ``docs`` (causal)
  fm_docs         causal document packing (documents of 0.5-4K tokens, seeded), [LTS] = document end
  fm_share_question  DPO / RM packing: questions 0.5-1K, 2 answers of 0.25-1K each, [LTS, LTE]
  fm_sliding_window  causal sliding window of 1K keys, [LTS]
  fm_prefix_lm    prefix-LM documents (0.5-4K, prefix half the document), 4 columns

Every FlashMask timing includes its metadata kernels (fm_meta: per-key-tile bounds and query-tile
ranges), which run once per call. TFLOPs/s count the **visible** pairs only: 4 * B * Hq * pairs * d
forward, 2.5x that backward (pairs from tests/oracles/flashmask.visible_pairs). "rate / causal" is the
mask's visible-pair rate
over the causal kernel's (per round: t_causal / t_mask * pairs_mask / pairs_causal; the issue's
targets: fm_causal >= 0.95, every other mask >= 0.85); "/ varlen" for fm_docs is t_varlen / t_fm_docs
(same visible pairs; target >= 0.95). ``--directions fwd,bwd`` (default both): the backward rows time
``run_bwd`` (preprocess, main kernel with its bounds kernel, postprocess; not deterministic) on the
forward's out / lse, against our causal / varlen backward the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import RunInfo, add_method_args, bench_windows, fmt_spread, method_from_args, timer_from_args, \
    write_markdown  # noqa: E402

from tests.oracles import flashmask as F  # noqa: E402

MASKS = ("causal", "docs", "share_question", "sliding_window", "prefix_lm")
LAYOUT = {(True, 1): "lts", (True, 2): "lts_lte", (False, 2): "lts_ute", (False, 4): "lts_lte_uts_ute"}


def doc_lengths(s: int, lo: int, hi: int, rng) -> list:
    """Lengths in [lo, hi] filling ``s`` exactly (the last one cut to fit)."""
    out, total = [], 0
    while total < s:
        n = min(int(rng.integers(lo, hi + 1)), s - total)
        out.append(n)
        total += n
    return out


def make_mask(kind: str, s: int, seed: int = 0):
    """``(startend [1, 1, S, n] int32, causal, docs or None)`` of one mask kind at length ``s``."""
    rng = np.random.default_rng(seed)
    if kind == "causal":
        return np.full((1, 1, s, 1), s, np.int32), True, None
    if kind == "docs":
        docs = doc_lengths(s, 512, 4096, rng)
        return F.causal_document(docs, dense=False)[0], True, docs
    if kind == "share_question":
        groups, total = [], 0
        while total < s:
            qlen = int(rng.integers(512, 1025))
            answers = [int(rng.integers(256, 1025)) for _ in range(2)]
            need = qlen + sum(answers)
            if total + need > s:  # the last group: one answer filling the rest
                qlen = min(qlen, s - total)
                answers = [s - total - qlen] if s - total - qlen > 0 else []
                need = s - total
            groups.append((qlen, answers))
            total += need
        return F.share_question(groups, dense=False)[0], True, None
    if kind == "sliding_window":
        return F.sliding_window(s, 1024, dense=False)[0], True, None
    if kind == "prefix_lm":
        docs = doc_lengths(s, 512, 4096, rng)
        return F.prefix_lm_documents([(n, n // 2) for n in docs], dense=False)[0], False, None
    raise ValueError(f"unknown mask {kind!r}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default="8192,16384,32768")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="32,32/8")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--directions", default="fwd,bwd")
    add_method_args(ap)
    args = ap.parse_args(argv)
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.heads = [tuple(int(y) for y in (x.split("/") * 2)[:2]) for x in args.heads.split(",")]
    args.masks = args.masks.split(",")
    args.directions = args.directions.split(",")
    unknown = set(args.masks) - set(MASKS)
    if unknown:
        ap.error(f"unknown masks {sorted(unknown)} (choose from {MASKS})")
    return args


def measure(direction, fns, pairs, s, b, hq, hkv, d, args, timer) -> list:
    """Time ``fns`` in alternating windows; one row per variant (visible-pair TFLOPs/s, rates per round)."""
    res = bench_windows(fns, rounds=args.rounds, timer=timer)
    factor = 4.0 if direction == "fwd" else 10.0  # backward: 2.5x the forward's FLOPs
    rows = []
    for name in fns:
        st = res[name]
        tflops = factor * hq * pairs[name] * d / (st.median_ms * 1e-3) / 1e12
        row = {"direction": direction, "variant": name, "seqlen": s, "batch": b, "heads": hq, "heads_kv": hkv,
               "head_dim": d, "pairs": pairs[name], "density": pairs[name] / (b * s * s), "stats": st.as_dict(),
               "tflops_visible": tflops, "rounds": [r[name] for r in res.rounds]}
        if name != "causal":
            r = res.ratio("causal", name)  # t_causal / t_mask, per round
            f = pairs[name] / pairs["causal"]
            row["rate_over_causal"] = {"median": r.median * f, "lo": r.lo * f, "hi": r.hi * f,
                                       "rounds": [x * f for x in r.samples]}
        if name == "fm_docs" and "varlen_docs" in fns:
            r = res.ratio("varlen_docs", name)
            row["over_varlen"] = r.as_dict()
        rows.append(row)
        print(f"{direction} S {s:6d} {hq}/{hkv} {name:18s} {st.median_ms:8.3f} ms  {tflops:7.1f} TFLOPs/s visible  "
              f"density {row['density']:.3f}  rate/causal {fmt_spread(row.get('rate_over_causal'))}  "
              f"/varlen {fmt_spread(row.get('over_varlen'))}", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from cute_kernels.attention import bwd_launch as BL
    from cute_kernels.attention import fm_meta
    from cute_kernels.attention.launch import compile_fwd, fm_meta_config, fwd_config, run_fwd

    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    d = args.hdim
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    timer = timer_from_args(args)
    print(f"# {info.gpu}  bf16 d {d}  tokens={args.tokens}  commit {info.commit}", flush=True)
    rows = []
    for s in args.seqlens:
        b = max(1, args.tokens // s)
        for hq, hkv in args.heads:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, s, hq, d, device="cuda", generator=g).to(torch.bfloat16)
            k, v = (torch.randn(b, s, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
            out = torch.empty_like(q)
            lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
            scale = 1.0 / math.sqrt(d)
            cfg_causal = fwd_config(arch, "bfloat16", d, d, hq // hkv, True, False, False, 0, False)
            compile_fwd(cfg_causal)
            fns, pairs = {}, {}
            pairs["causal"] = b * s * (s + 1) // 2

            def plain(cfg=cfg_causal):
                run_fwd(cfg, q, k, v, out, lse, None, None, None, softmax_scale=scale, softcap=0.0,
                        window_left=-1, window_right=-1, max_seqlen_q=s)

            fns["causal"] = plain
            bwd = "bwd" in args.directions
            bfns = {}
            if bwd:
                do = torch.randn(b, s, hq, d, device="cuda", generator=g).to(torch.bfloat16)
                grads = [torch.empty_like(x) for x in (q, k, v)]

                def make_bwd(cfg_f, cfg_b, fwd_kw, q_, k_, v_, out_, lse_, do_, grads_, mx, cu=None, **bkw):
                    """A backward callable on this forward's out / lse (computed once here)."""
                    run_fwd(cfg_f, q_, k_, v_, out_, lse_, None, cu, cu, softmax_scale=scale, softcap=0.0,
                            window_left=-1, window_right=-1, max_seqlen_q=mx, **fwd_kw)
                    if cu is None:
                        shapes = BL.workspace_shapes(cfg_b, batch=b, seqlen_q=s, num_heads=hq, seqlen_k=s,
                                                     num_kv_heads=hkv)
                    else:
                        shapes = BL.workspace_shapes(cfg_b, batch=int(cu.shape[0]) - 1, seqlen_q=0, num_heads=hq,
                                                     total_q=b * s, seqlen_k=mx, num_kv_heads=hkv, total_k=b * s)
                    ws = {n: torch.empty(shape, device="cuda", dtype=getattr(torch, dt))
                          for n, (shape, dt) in shapes.items()}
                    BL.compile_bwd(cfg_b)

                    def run(ws=ws):
                        BL.run_bwd(cfg_b, do_, q_, k_, v_, out_, lse_, None, *grads_, cu, cu, ws,
                                   softmax_scale=scale, softcap=0.0, window_left=-1, window_right=-1,
                                   max_seqlen_q=mx, max_seqlen_k=mx, **bkw)
                    return run

                out_c = torch.empty_like(q)
                lse_c = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
                bfns["causal"] = make_bwd(cfg_causal, BL.bwd_config(arch, "bfloat16", d, d, hq // hkv, True, False,
                                                                    False, False, False), {}, q, k, v, out_c,
                                          lse_c, do, grads, s)
            for kind in args.masks:
                se_np, causal, docs = make_mask(kind, s)
                se_np = np.repeat(se_np, b, axis=0)
                layout = LAYOUT[(causal, se_np.shape[-1])]
                cfg = fwd_config(arch, "bfloat16", d, d, hq // hkv, causal, False, False, 0, False, startend=layout)
                compile_fwd(cfg)
                se = torch.as_tensor(se_np, device="cuda")
                shapes = fm_meta.workspace_shapes(fm_meta_config(cfg), b, 1, s, s)
                ws = {n: torch.empty(shape, device="cuda", dtype=torch.int32) for n, (shape, _) in shapes.items()}
                name = "fm_" + kind

                def masked(cfg=cfg, se=se, ws=ws):
                    run_fwd(cfg, q, k, v, out, lse, None, None, None, softmax_scale=scale, softcap=0.0,
                            window_left=-1, window_right=-1, max_seqlen_q=s, startend=se, **ws)

                fns[name] = masked
                pairs[name] = F.visible_pairs(se_np, causal, s)
                if bwd:
                    cfg_b = BL.bwd_config(arch, "bfloat16", d, d, hq // hkv, causal, False, False, False, False,
                                          startend=layout)
                    bshape, _ = fm_meta.workspace_shapes(BL.fm_meta_config(cfg_b), b, 1, s, s)["fm_minmax"]
                    bmm = torch.empty(bshape, device="cuda", dtype=torch.int32)
                    fwd_kw = dict(startend=se, **{n: torch.empty(shape, device="cuda", dtype=torch.int32)
                                                  for n, (shape, _) in shapes.items()})
                    bfns[name] = make_bwd(cfg, cfg_b, fwd_kw, q, k, v, torch.empty_like(q),
                                          torch.empty(b, hq, s, device="cuda", dtype=torch.float32), do, grads, s,
                                          startend=se, fm_minmax=bmm)
                if docs is not None:  # the same documents through the varlen kernel
                    cfg_vl = fwd_config(arch, "bfloat16", d, d, hq // hkv, True, False, False, 0, True)
                    compile_fwd(cfg_vl)
                    cu_np = np.concatenate([[0], np.cumsum(np.tile(docs, b))]).astype(np.int32)
                    cu = torch.as_tensor(cu_np, device="cuda")
                    qv, kv_, vv = (x.reshape(b * s, x.shape[2], d) for x in (q, k, v))
                    ov = out.view(b * s, hq, d)
                    lsev = torch.empty(hq, b * s, device="cuda", dtype=torch.float32)

                    def varlen(cfg=cfg_vl, cu=cu, qv=qv, kv_=kv_, vv=vv, ov=ov, lsev=lsev, mx=max(docs)):
                        run_fwd(cfg, qv, kv_, vv, ov, lsev, None, cu, cu, softmax_scale=scale, softcap=0.0,
                                window_left=-1, window_right=-1, max_seqlen_q=mx)

                    fns["varlen_docs"] = varlen
                    pairs["varlen_docs"] = pairs[name]
                    if bwd:
                        cfg_vb = BL.bwd_config(arch, "bfloat16", d, d, hq // hkv, True, False, False, True, False)
                        dov = do.reshape(b * s, hq, d)
                        gv = [x.reshape(b * s, x.shape[2], d) for x in grads]
                        bfns["varlen_docs"] = make_bwd(cfg_vl, cfg_vb, {}, qv, kv_, vv, torch.empty_like(ov),
                                                       torch.empty(hq, b * s, device="cuda", dtype=torch.float32),
                                                       dov, gv, max(docs), cu=cu)
            for direction, dfns in (("fwd", fns), ("bwd", bfns)):
                if direction not in args.directions or not dfns:
                    continue
                rows += measure(direction, dfns, pairs, s, b, hq, hkv, d, args, timer)
            del q, k, v, out, lse, fns, bfns
    info.finish()

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"run": info.as_dict(), "rows": rows}, fh, indent=1)
    lines = [info.markdown(), "",
             "| dir | S | B | heads | variant | density | ms (lo-hi) | TFLOPs/s visible | rate / causal | / varlen |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stats"]
        lines.append(f"| {r['direction']} | {r['seqlen']} | {r['batch']} | {r['heads']}/{r['heads_kv']} | "
                     f"{r['variant']} | "
                     f"{r['density']:.3f} | {st['median_ms']:.3f} ({st['lo_ms']:.3f}-{st['hi_ms']:.3f}) | "
                     f"{r['tflops_visible']:.1f} | {fmt_spread(r.get('rate_over_causal'))} | "
                     f"{fmt_spread(r.get('over_varlen'))} |")
    write_markdown(args.markdown, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention forward speed on one GPU: ours with/without block_logit vs FA4 b36 and the unfused path.

    python bench/bench_fwd.py [--hdims 64,128,256] [--seqlens 2048,4096,8192,16384] [--tokens 32768]
                              [--heads 16] [--block-size 64] [--modes causal,full] [--json FILE]
                              [--bl-store producer]

Rows: bf16, B = tokens / S, Hq = Hkv = heads. Columns (TFLOPs/s, 4*B*H*Sq*Sk*d, halved for causal):
  ours        cute_kernels SM90 forward, lse, no block_logit
  ours+bl     the same with fused block_logit (block_size)
  fa4         FA4 b36 ``flash_attn.cute.interface.flash_attn_func(..., return_lse=True)``
  unfused     FA4 + a separate block-max pass (chunked torch bf16 S = QK^T, masked, amax per block)
  ours+bl(producer)  with ``--bl-store producer`` (SM90 only): the opt-in variant in which warps 1-3
              store block_logit from a shared-memory staging buffer (``CUTE_KERNELS_SM90_BL_STORE``)
Ratios: ours+bl / fa4 (target >= 0.90 at d=128), ours+bl / ours (overhead), ours+bl / unfused.
CUDA events, warm-up then median of ``--iters`` rounds, all in one process; ours, ours+bl, ours+bl(producer)
and FA4 are timed round-robin within each round (the unfused path separately, after them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from _timing import interleaved_median_ms, median_ms


def block_max_torch(q, k, block_size, causal, scale, out, chunk_rows=1024):
    """The unfused alternative's second pass: block_logit from a chunked bf16 S = QK^T."""
    import torch

    b, sq, h, d = q.shape
    sk = k.shape[1]
    nb = out.shape[-1]
    qt = q.permute(0, 2, 1, 3)
    kt = k.permute(0, 2, 3, 1)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--modes", default="full,causal")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--no-unfused", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--bl-store", default="consumer", choices=("consumer", "producer"),
                    help="producer: also time the SM90 bl_store='producer' variant (ours+bl(producer))")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table (docs/benchmarks.md)")
    ap.add_argument("--start-after", default=None,
                    help="compile everything first, then wait for this file to exist before timing")
    args = ap.parse_args(argv)

    import torch

    from cute_kernels.attention.launch import fwd_config, run_fwd

    fa4 = None
    if not args.no_fa4:
        try:
            from flash_attn.cute.interface import flash_attn_func as fa4
        except Exception as exc:  # noqa: BLE001 - report and go on without the anchor
            print(f"FA4 not available: {exc}", file=sys.stderr)
    dev = torch.cuda.get_device_name()
    from cute_kernels.arch import family

    major, minor = torch.cuda.get_device_capability()
    arch = family(major * 10 + minor)  # 90 on Hopper, 100 on Blackwell: time the kernel this GPU runs
    bs = args.block_size
    bl_producer = args.bl_store == "producer" and arch == 90
    hdims = [int(x) for x in args.hdims.split(",")]
    modes = args.modes.split(",")
    # Compile every config up front (CPU only), and warm FA4's compile cache on a small input.
    from cute_kernels.attention.launch import compile_fwd

    for d in hdims:
        for mode in modes:
            for b_sz in (0, bs):
                compile_fwd(fwd_config(arch, "bfloat16", d, d, 1, mode == "causal", False, False, b_sz, False))
            if bl_producer:
                compile_fwd(fwd_config(arch, "bfloat16", d, d, 1, mode == "causal", False, False, bs, False),
                            "producer")
            if fa4 is not None:
                t = torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16)
                fa4(t, t, t, causal=mode == "causal", return_lse=True)
    if args.start_after:
        import os
        import time

        while not os.path.exists(args.start_after):
            time.sleep(0.5)
    rows = []
    print(f"# {dev}  bf16  tokens={args.tokens} heads={args.heads} block_size={bs}")
    print(f"{'d':>4} {'S':>6} {'mode':>6} | {'ours':>7} {'ours+bl':>7} {'fa4':>7} {'unfused':>7} | "
          f"{'bl/fa4':>6} {'bl/ours':>7} {'bl/unf':>6}"
          + (f" | {'bl(p)':>7} {'p/fa4':>6} {'p/ours':>7}" if bl_producer else ""))
    for d in hdims:
        for s in [int(x) for x in args.seqlens.split(",")]:
            b = max(1, args.tokens // s)
            h = args.heads
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
            scale = 1.0 / math.sqrt(d)
            out = torch.empty_like(q)
            lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
            nb = -(-s // bs)
            blk = torch.empty(b, h, s, nb, device="cuda", dtype=torch.float32)
            for mode in modes:
                causal = mode == "causal"
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                cfg0 = fwd_config(arch, "bfloat16", d, d, 1, causal, False, False, 0, False)
                cfg1 = fwd_config(arch, "bfloat16", d, d, 1, causal, False, False, bs, False)

                def ours(cfg=cfg0, bl=None, bl_store="consumer"):
                    run_fwd(cfg, q, k, v, out, lse, bl, None, None, softmax_scale=scale, softcap=0.0,
                            window_left=-1, window_right=-1, max_seqlen_q=s, bl_store=bl_store)

                row = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal, "block_size": bs}
                fns = {"ours": lambda: ours(cfg0, None), "ours_bl": lambda: ours(cfg1, blk)}
                if bl_producer:
                    fns["ours_blp"] = lambda: ours(cfg1, blk, "producer")
                if fa4 is not None:
                    def fa4_fn():
                        return fa4(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)

                    fns["fa4"] = fa4_fn
                # Lower bound on block_logit's cost if its stores overlapped nothing: one fill of the buffer.
                fns["bl_fill"] = lambda: blk.fill_(float("-inf"))
                for key, ms in interleaved_median_ms(fns, args.iters).items():
                    row[f"{key}_ms"] = ms
                if fa4 is not None:
                    if not args.no_unfused:
                        def unfused():
                            fa4_fn()
                            block_max_torch(q, k, bs, causal, scale, blk)

                        row["unfused_ms"] = median_ms(unfused, max(3, args.iters // 3), warmup=1)
                row["bl_fill_over_ours"] = row["bl_fill_ms"] / row["ours_ms"]
                for key in ("ours", "ours_bl", "ours_blp", "fa4", "unfused"):
                    if f"{key}_ms" in row:
                        row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
                if "fa4_ms" in row:
                    row["bl_over_fa4"] = row["fa4_ms"] / row["ours_bl_ms"]
                if "unfused_ms" in row:
                    row["bl_over_unfused"] = row["unfused_ms"] / row["ours_bl_ms"]
                row["bl_over_ours"] = row["ours_ms"] / row["ours_bl_ms"]
                if "ours_blp_ms" in row:
                    row["blp_over_ours"] = row["ours_ms"] / row["ours_blp_ms"]
                    if "fa4_ms" in row:
                        row["blp_over_fa4"] = row["fa4_ms"] / row["ours_blp_ms"]
                rows.append(row)

                def f(key):
                    return f"{row[key]:7.1f}" if key in row else f"{'-':>7}"

                def r(key, w=6):
                    return f"{row[key]:{w}.3f}" if key in row else f"{'-':>{w}}"

                print(f"{d:>4} {s:>6} {mode:>6} | {f('ours_tflops')} {f('ours_bl_tflops')} {f('fa4_tflops')} "
                      f"{f('unfused_tflops')} | {r('bl_over_fa4')} {r('bl_over_ours', 7)} {r('bl_over_unfused')}"
                      + (f" | {f('ours_blp_tflops')} {r('blp_over_fa4')} {r('blp_over_ours', 7)}" if bl_producer
                         else ""), flush=True)
            del q, k, v, out, lse, blk
            torch.cuda.empty_cache()
    if args.markdown:
        print()
        extra_h = " ours+bl(producer) | ours+bl(producer) / FA4 | ours+bl(producer) / ours |" if bl_producer else ""
        print("| d | S | B | mode | ours | ours+bl | FA4 b36 | unfused | ours+bl / FA4 | ours+bl / ours | ours+bl / unfused "
              "| bl fill / ours |" + extra_h)
        print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if bl_producer else ""))
        for row in rows:
            def g(key, fmt):
                return format(row[key], fmt) if key in row else "-"
            print(f"| {row['head_dim']} | {row['seqlen']} | {row['batch']} | {'causal' if row['causal'] else 'full'} | "
                  f"{g('ours_tflops', '.0f')} | {g('ours_bl_tflops', '.0f')} | {g('fa4_tflops', '.0f')} | "
                  f"{g('unfused_tflops', '.0f')} | {g('bl_over_fa4', '.3f')} | {g('bl_over_ours', '.3f')} | "
                  f"{g('bl_over_unfused', '.2f')} | {g('bl_fill_over_ours', '.3f')} |"
                  + (f" {g('ours_blp_tflops', '.0f')} | {g('blp_over_fa4', '.3f')} | {g('blp_over_ours', '.3f')} |"
                     if bl_producer else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": dev, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of our dense forward / backward kernels from two source trees, side by side in one process.

Used to measure what a kernel change costs (or saves): ``--base DIR`` names another checkout of this
repository (e.g. ``git worktree add /tmp/base HEAD~1``); its ``cute_kernels`` is copied to a temporary
directory as the package ``cute_kernels_base`` (imports rewritten) so both builds load in the same process
and are timed with the same method (bench/_timing.py: L2 flushed, own steady-state window per variant,
alternating rounds, ratios per round). ``new`` is this tree.

    python bench/ab_trees.py --base /tmp/base --shapes causal:8192:128,window:8192:128 --dirs fwd,bwd

Shapes: ``mask:S:d`` with mask ``full`` | ``causal`` | ``window`` (window (1024, 0)); bf16, B = tokens / S,
--heads Hq/Hkv.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import RunInfo, add_method_args, bench_windows, fmt_spread, method_from_args, timer_from_args  # noqa: E402


def load_base(base_dir: str):
    """The base tree's ``cute_kernels`` as the package ``cute_kernels_base``."""
    tmp = tempfile.mkdtemp(prefix="ab_base_")
    dst = os.path.join(tmp, "cute_kernels_base")
    shutil.copytree(os.path.join(base_dir, "cute_kernels"), dst,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for root, _dirs, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(root, f)
                with open(p) as fh:
                    text = fh.read()
                text = re.sub(r"\bcute_kernels\b", "cute_kernels_base", text)
                with open(p, "w") as fh:
                    fh.write(text)
    sys.path.insert(0, tmp)
    return importlib.import_module("cute_kernels_base")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="root of the other checkout")
    ap.add_argument("--shapes", default="causal:8192:128")
    ap.add_argument("--dirs", default="fwd,bwd")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", default="32/8")
    add_method_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    load_base(args.base)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    timer = timer_from_args(args)
    print(f"# {info.gpu}  bf16  heads {hq}/{hkv}  commit {info.commit}  base {args.base}", flush=True)
    trees = {}
    for name, pkg in (("new", "cute_kernels"), ("base", "cute_kernels_base")):
        trees[name] = (importlib.import_module(f"{pkg}.attention.launch"),
                       importlib.import_module(f"{pkg}.attention.bwd_launch"))
    for spec in args.shapes.split(","):
        mask, s, d = spec.split(":")
        s, d = int(s), int(d)
        b = max(1, args.tokens // s)
        causal = mask in ("causal", "window")
        wl, wr = (1024, 0) if mask == "window" else (-1, -1)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
        scale = 1.0 / math.sqrt(d)
        fwd_fns, bwd_fns = {}, {}
        for name, (fl, bl) in trees.items():
            cfg = fl.fwd_config(arch, "bfloat16", d, d, hq // hkv, causal, mask == "window", False, 0, False)
            fl.compile_fwd(cfg)
            o_t, l_t = torch.empty_like(out), torch.empty_like(lse)

            def fwd(fl=fl, cfg=cfg, o_t=o_t, l_t=l_t):
                fl.run_fwd(cfg, q, k, v, o_t, l_t, None, None, None, softmax_scale=scale, softcap=0.0,
                           window_left=wl, window_right=wr, max_seqlen_q=s)
            fwd_fns[name] = fwd
            fwd()
            out.copy_(o_t)
            lse.copy_(l_t)
            bcfg = bl.bwd_config(arch, torch.bfloat16, d, d, hq // hkv, causal, mask == "window", False, False, True)
            ws = {n: torch.empty(sh, device="cuda", dtype=getattr(torch, t_))
                  for n, (sh, t_) in bl.workspace_shapes(bcfg, batch=b, seqlen_q=s, num_heads=hq, seqlen_k=s,
                                                         num_kv_heads=hkv).items()}
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

            def bwd(bl=bl, bcfg=bcfg, ws=ws, dq=dq, dk=dk, dv=dv, o_t=o_t, l_t=l_t):
                bl.run_bwd(bcfg, do, q, k, v, o_t, l_t, None, dq, dk, dv, None, None, ws, softmax_scale=scale,
                           softcap=0.0, window_left=wl, window_right=wr, max_seqlen_q=s, max_seqlen_k=s)
            bwd_fns[name] = bwd
        torch.cuda.synchronize()
        for direction, fns in (("fwd", fwd_fns), ("bwd", bwd_fns)):
            if direction not in args.dirs.split(","):
                continue
            res = bench_windows(fns, rounds=args.rounds, timer=timer)
            r = res.ratio("base", "new").as_dict()
            print(f"{direction} {mask} S {s} d {d} B {b}: new {res['new'].median_ms:.4f} ms "
                  f"({res['new'].lo_ms:.4f}-{res['new'].hi_ms:.4f}), base {res['base'].median_ms:.4f} ms "
                  f"({res['base'].lo_ms:.4f}-{res['base'].hi_ms:.4f}); new speed / base "
                  f"{fmt_spread(r)}", flush=True)
        del q, k, v, do, out, lse, fwd_fns, bwd_fns
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

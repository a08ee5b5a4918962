"""A/B of our block-sparse and indexed kernels from two source trees, side by side in one process.

What a change to those kernels costs (or saves): ``--base DIR`` names another checkout of this repository; its
``cute_kernels`` is loaded as ``cute_kernels_base`` (bench/ab_trees.py's ``load_base``) and both trees' variants
of bench/bench_block_sparse.py (same shapes, selections, inputs) are timed pairwise by the bench/_timing.py
method (L2 flushed, own steady-state window per variant, alternating rounds, ratios per round).

    python bench/ab_sparse.py --base /tmp/base --shapes gqa,mla64 --selections local,random --seqlens 16K \\
        --variants bs_fwd,bs_dq,bs_dkdv,idx_fwd,idx_fwd_bwd
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import RunInfo, add_method_args, bench_windows, fmt_spread, method_from_args, timer_from_args  # noqa: E402
from ab_trees import load_base  # noqa: E402
from bench_block_sparse import SHAPES, make_fns, parse_len  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="root of the other checkout")
    ap.add_argument("--shapes", default="gqa,mla64")
    ap.add_argument("--selections", default="local,random")
    ap.add_argument("--seqlens", default="16K")
    ap.add_argument("--variants", default="bs_fwd,bs_dq,bs_dkdv,idx_fwd,idx_fwd_bwd")
    add_method_args(ap)
    args = ap.parse_args(argv)
    import torch

    load_base(args.base)
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    timer = timer_from_args(args)
    print(f"# {info.gpu}  commit {info.commit}  base {args.base}", flush=True)
    for shape in args.shapes.split(","):
        for kind in args.selections.split(","):
            for s in (parse_len(x) for x in args.seqlens.split(",")):
                new, _ = make_fns(torch, s, SHAPES[shape], kind)
                base, _ = make_fns(torch, s, SHAPES[shape], kind, pkg="cute_kernels_base")
                torch.cuda.synchronize()
                for v in args.variants.split(","):
                    if v not in new:
                        continue
                    res = bench_windows({"new": new[v], "base": base[v]}, rounds=args.rounds, timer=timer)
                    r = res.ratio("base", "new").as_dict()
                    print(f"{v:12s} {shape} {kind} S {s}: new {res['new'].median_ms:.4f} ms, base "
                          f"{res['base'].median_ms:.4f} ms; new speed / base {fmt_spread(r)}", flush=True)
                del new, base
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

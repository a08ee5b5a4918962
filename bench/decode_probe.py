"""Where the time of a small-batch decode step goes (issue 41 diagnostics; not a published benchmark).

    python bench/decode_probe.py [--shapes b1_32k,b8_8k] [--rounds 3] [--window 0.3]
    python bench/decode_probe.py --ncu-once b1_32k       # one launch each, for ``ncu -k regex:Decode``

Per shape (bf16, d 128, Hq/Hkv 32/8 paged P 64 or 8/1 contiguous (m*), one query token, causal), every variant in its own
window of bench/_timing.py (L2 flushed, alternating rounds, one process):

  step        the decode step as served: split kernel + combine (the split count the host picks)
  split_only  the split kernel alone (writes the fp32 partials; no combine)
  combine     the combine kernel alone (on the partials of the step above)
  step_nopdl  the step with the combine launched without programmatic dependent launch
  s<N>        the step with N splits
  ring<KB>    the step with a per-warp load ring of KB (``--rings``)
  read_same   ``x.sum()`` over a buffer of the step's K + V bytes: the small-read floor of the same size

It prints microseconds and the KV rate of each against the 2 GiB streaming read of the same process,
once per L2 flush mode (``--flush-modes zero,read``: zero_() leaves dirty lines the timed kernel writes
back; a read-only flush leaves clean ones).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_decode as BD  # noqa: E402
from _timing import add_method_args, bench_windows, timer_from_args  # noqa: E402

SHAPES = {
    "b1_32k": dict(b=1, sk=32768, hq=32, hkv=8, layout="hnd", page=64),
    "b1_8k": dict(b=1, sk=8192, hq=32, hkv=8, layout="hnd", page=64),
    "b8_8k": dict(b=8, sk=8192, hq=32, hkv=8, layout="hnd", page=64),
    "b1_32k_c": dict(b=1, sk=32768, hq=32, hkv=8, layout="contiguous", page=0),
    "c8_8k": dict(b=8, sk=8192, hq=32, hkv=8, layout="contiguous", page=0),
    # one kv head (Hq / Hkv 8 / 1), contiguous: the shapes that miss the bars
    "m1_32k": dict(b=1, sk=32768, hq=8, hkv=1, layout="contiguous", page=0),
    "m1_128k": dict(b=1, sk=131072, hq=8, hkv=1, layout="contiguous", page=0),
    "m8_32k": dict(b=8, sk=32768, hq=8, hkv=1, layout="contiguous", page=0),
    "m64_4k": dict(b=64, sk=4096, hq=8, hkv=1, layout="contiguous", page=0),
    "m256_2k": dict(b=256, sk=2048, hq=8, hkv=1, layout="contiguous", page=0),
    # sparse decode (bench_decode.py's rows): 16 blocks of 64 + the last 128 tokens of a 32K pool, 32/8, P 64
    "sp1_32k": dict(b=1, sk=32768, hq=32, hkv=8, layout="hnd", page=64, sparse=True, pool=32768),
    "sp8_32k": dict(b=8, sk=32768, hq=32, hkv=8, layout="hnd", page=64, sparse=True, pool=32768),
}


def variants(name: str, extra_splits, rings=()):
    torch, L = BD.torch, BD.L
    shp = BD.Shape(**SHAPES[name])
    fns = {"step": shp.ours}
    if shp.splits > 1:
        from cute_kernels import arch as _arch
        from cute_kernels.decode.combine import CombineConfig
        from cute_kernels.decode.launch import compile_combine, compile_decode, decode_launcher

        a = _arch.kernel_arch(None)
        cfg = decode_launcher(shp.q, shp.k, shp.seq, shp.table, layout=shp.layout, split=True,
                              window_right=0).config  # the config the step runs (index form included)
        fwd = compile_decode(cfg)
        comb = compile_combine(CombineConfig(arch=a, dtype="bfloat16", head_dim=BD.D))
        fns["split_only"] = lambda: fwd(shp.q, shp.k, shp.v, shp.seq, shp.table, shp.o_part, shp.lse_part, None,
                                        float(shp.scale), 0.0, -1, 0)
        fns["combine"] = lambda: comb(shp.o_part, shp.lse_part, shp.out, shp.lse)
        comb0 = compile_combine(CombineConfig(arch=a, dtype="bfloat16", head_dim=BD.D, pdl=False))

        def step_nopdl():
            fns["split_only"]()
            comb0(shp.o_part, shp.lse_part, shp.out, shp.lse)

        fns["step_nopdl"] = step_nopdl
    keep = [shp]
    for s in extra_splits:
        if s != shp.splits:
            o = BD.Shape(**SHAPES[name], splits=s)
            keep.append(o)
            fns[f"s{s}"] = o.ours
    for kb in rings:  # the per-warp load ring (KB of K + V in flight per warp; 24 by default)
        fns[f"ring{kb}"] = (lambda kb=kb: shp.ours(kb))
    x = torch.empty(shp.keys * BD.D * 2 * 2 // 4, dtype=torch.float32, device="cuda").normal_()
    keep.append(x)
    fns["read_same"] = lambda: x.sum()
    return shp, fns, keep


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="b1_32k,b8_8k")
    ap.add_argument("--splits", default="16,33,48,66,99,128")
    ap.add_argument("--rings", default="", help="ring_kb variants of the step, e.g. 32,48")
    ap.add_argument("--ncu-once", default=None)
    ap.add_argument("--flush-modes", default="zero,read", help="L2 flush modes to compare (bench/_timing.py)")
    add_method_args(ap)
    args = ap.parse_args(argv)
    BD._imports()
    torch = BD.torch
    if args.ncu_once:
        shp, fns, keep = variants(args.ncu_once, ())
        for name in ("step",):
            fns[name]()
        torch.cuda.synchronize()
        print("auto splits", shp.splits)
        return
    for mode in args.flush_modes.split(","):
        args.flush_mode = mode
        timer = timer_from_args(args)
        read_bw, _ = BD.ceilings(timer, args.rounds)
        print(f"{torch.cuda.get_device_name()}: flush {mode}: streaming read {read_bw / 1e9:.0f} GB/s", flush=True)
        for name in args.shapes.split(","):
            shp, fns, keep = variants(name, [int(s) for s in args.splits.split(",") if s],
                                        [int(r) for r in args.rings.split(",") if r])
            res = bench_windows(fns, rounds=args.rounds, timer=timer)
            kv = shp.keys * BD.D * 2 * 2
            print(f"{name} (flush {mode}): auto splits {shp.splits}, KV {kv / 1e6:.1f} MB, "
                  f"ideal {kv / read_bw * 1e6:.1f} us")
            for n, st in res.items():
                print(f"   {n:11s} {st.median_ms * 1e3:8.1f} us  [{st.lo_ms * 1e3:.1f}-{st.hi_ms * 1e3:.1f}]  "
                      f"{kv / (st.median_ms * 1e-3) / read_bw * 100:5.1f} % of read", flush=True)
            del keep, fns
            torch.cuda.empty_cache()
        del timer

if __name__ == "__main__":
    main()

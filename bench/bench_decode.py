"""Benchmark of the decode kernels (issue 41) against FA4 b36 and torch SDPA, in KV bytes per second.

    python bench/bench_decode.py [--quick] [--window 0.5] [--rounds 3] [--no-flush] [--graph]
                                 [--json FILE] [--markdown [FILE]] [--host-n 100]

Timing by bench/_timing.py for every variant alike (own window per variant, L2 flushed between
repetitions, launches queued back to back, alternating windows for --rounds rounds in ONE process;
median and min-max of the window medians; per-round ratios). Bytes: K + V of every key each (sequence,
kv head) holds, plus q and out. Ceilings measured in the same process: a streaming read of 2 GiB
(``x.sum()`` over fp32, bytes read / time) and a device copy of 2 GiB (``y.copy_(x)``, read + write).

Shapes (bf16, d 128, one query token, causal, lengths = Sk for every sequence): Hq/Hkv 32/8, 64/8, 8/1;
contiguous cache (FA4 and SDPA beside ours), paged P 16 and P 64 (ours in FastDeploy's [pages, Hkv, P, D];
FA4 paged in its own [pages, P, Hkv, D] where it runs); (B, Sk) in (1, 8K/32K/128K), (8, 8K/32K),
(64, 4K/16K), (256, 2K). Also: block_logit (block 64) overhead, sparse decode (16 blocks of 64 + a
128-token window per (sequence, kv head), pool of Sk 32K / 128K: bytes over the selected pages), and
the launcher's host time per call (tiny shape, GPU kept busy), reported apart. ``--kinds h2o_step``: the
whole H2O token decode step (reset_scores -> token_accumulate + page scores -> select_pages -> sparse
decode over a 2048-token page budget, P 16) captured in one CUDA graph against dense decode of the same
32K cache in its own graph, B 1 / 8 / 32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import (RunInfo, add_method_args, bench_windows, host_us_per_call, method_from_args,  # noqa: E402
                     timer_from_args, write_markdown)

torch = None
L = None
DEV = "cuda"
D = 128
HEADS = ((32, 8), (64, 8), (8, 1))
SHAPES = ((1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (64, 4096), (64, 16384), (256, 2048))


def _imports() -> None:
    global torch, L
    import torch as torch_

    from cute_kernels.decode import launch as launch_

    torch, L = torch_, launch_


def ceilings(timer, rounds: int) -> tuple[float, float]:
    """(streaming read bytes/s, device copy bytes/s) of 2 GiB buffers."""
    n = 2 << 30
    x = torch.randn(n // 4, dtype=torch.float32, device=DEV)
    y = torch.empty_like(x)
    res = bench_windows({"read": lambda: x.sum(), "copy": lambda: y.copy_(x)}, rounds=rounds, timer=timer)
    read = n / (res["read"].median_ms * 1e-3)
    copy = 2 * n / (res["copy"].median_ms * 1e-3)
    del x, y
    torch.cuda.empty_cache()
    return read, copy


class Shape:
    """Inputs of one decode shape: ours (launcher, preallocated outputs), FA4 and SDPA where they apply."""

    def __init__(self, b, sk, hq, hkv, layout, page, bs=0, sparse=False, pool=0, splits=None):
        self.b, self.sk, self.hq, self.hkv, self.layout, self.page, self.bs = b, sk, hq, hkv, layout, page, bs
        dt = torch.bfloat16
        self.q = torch.randn(b, 1, hq, D, device=DEV, dtype=dt)
        self.scale = 1.0 / math.sqrt(D)
        # dense shapes: FA's cache_seqlens [B] / block_table [B, n], read in place by every kv head (what
        # flash_attn_with_kvcache hands the launcher); sparse: per-(sequence, kv head) [B, Hkv] / [B, Hkv, n]
        if layout == "contiguous":
            self.k = torch.randn(b, sk, hkv, D, device=DEV, dtype=dt)
            self.v = torch.randn(b, sk, hkv, D, device=DEV, dtype=dt)
            self.table = None
            self.seq = torch.full((b,), sk, dtype=torch.int32, device=DEV)
            self.keys = b * hkv * sk
        elif not sparse:
            pages = sk // page
            n_pages = b * pages
            self.k = torch.randn(n_pages, hkv, page, D, device=DEV, dtype=dt)
            self.v = torch.randn(n_pages, hkv, page, D, device=DEV, dtype=dt)
            self.table = torch.randperm(n_pages, device=DEV).to(torch.int32).view(b, pages).contiguous()
            self.seq = torch.full((b,), sk, dtype=torch.int32, device=DEV)
            self.keys = b * hkv * sk
        else:  # 16 random 64-token blocks + the last 128 tokens of a pool of `pool` tokens, P = page
            pages = pool // page
            n_pages = b * pages
            self.k = torch.randn(n_pages, hkv, page, D, device=DEV, dtype=dt)
            self.v = torch.randn(n_pages, hkv, page, D, device=DEV, dtype=dt)
            per_block = 64 // page
            sel = []
            for _ in range(b * hkv):
                blocks = torch.randperm(pool // 64 - 2)[:16].sort().values
                ids = (blocks[:, None] * per_block + torch.arange(per_block)).flatten()
                win = torch.arange(pages - 128 // page, pages)
                sel.append(torch.cat([ids, win]))
            sel = torch.stack(sel).view(b, hkv, -1)
            base = (torch.arange(b) * pages).view(b, 1, 1)
            self.table = (sel + base).to(torch.int32).to(DEV).contiguous()
            n_tok = self.table.shape[2] * page
            self.seq = torch.full((b, hkv), n_tok, dtype=torch.int32, device=DEV)
            self.keys = b * hkv * n_tok
        self.nbytes = self.keys * D * 2 * 2 + 2 * b * hq * D * 2  # K + V, q and out
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(b, hq, 1, dtype=torch.float32, device=DEV)
        sk_max = L.sk_max(self.k, self.table, layout)
        self.blk = torch.empty(b, hq, 1, -(-sk_max // bs), dtype=torch.float32, device=DEV) if bs else None
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        self.splits = splits or L.choose_num_splits(self.q, self.k, self.table, layout=layout, sm_count=sm,
                                                    block_size=bs)
        self.o_part = self.lse_part = None
        if self.splits > 1:
            o_shape, l_shape = L.partial_shapes(self.q, self.splits)
            self.o_part = torch.empty(o_shape, dtype=torch.float32, device=DEV)
            self.lse_part = torch.empty(l_shape, dtype=torch.float32, device=DEV)

    def ours(self, ring_kb=None):
        L.run_decode(self.q, self.k, self.v, self.seq, self.table, self.out, self.lse, self.blk, self.o_part,
                     self.lse_part, layout=self.layout, softmax_scale=self.scale, window_left=-1, window_right=0,
                     block_size=self.bs, ring_kb=ring_kb)

    def fa4(self):
        """FA4 b36 (pack_gqa, causal; its paged mode on [pages, P, Hkv, D] copies), or None where it fails."""
        try:
            from flash_attn.cute.interface import _flash_attn_fwd
        except Exception:
            return None
        if self.layout == "contiguous":
            seqused = torch.full((self.b,), self.sk, dtype=torch.int32, device=DEV)

            def fn():
                _flash_attn_fwd(self.q, self.k, self.v, seqused_k=seqused, causal=True, pack_gqa=True,
                                softmax_scale=self.scale)
        else:
            k_fa = self.k.transpose(1, 2).contiguous()
            v_fa = self.v.transpose(1, 2).contiguous()
            seqused = torch.full((self.b,), self.sk, dtype=torch.int32, device=DEV)
            table = self.table

            def fn():
                _flash_attn_fwd(self.q, k_fa, v_fa, seqused_k=seqused, page_table=table, causal=True,
                                pack_gqa=True, softmax_scale=self.scale)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - recorded as "does not run"
            print(f"   FA4 does not run here: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return None
        return fn

    def sdpa(self):
        if self.layout != "contiguous":
            return None
        q = self.q.transpose(1, 2)  # [B, Hq, 1, D]
        k = self.k.permute(0, 2, 1, 3).contiguous()  # [B, Hkv, Sk, D]
        v = self.v.permute(0, 2, 1, 3).contiguous()
        f = torch.nn.functional.scaled_dot_product_attention

        def fn():
            f(q, k, v, enable_gqa=True, scale=self.scale)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"   SDPA does not run here: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return None
        return fn


def _row(kind, shp, res, read_bw, copy_bw, extra=None):
    t = res["ours"].median_ms * 1e-3
    row = {"kind": kind, "B": shp.b, "Sk": shp.sk, "Hq": shp.hq, "Hkv": shp.hkv, "layout": shp.layout, "P": shp.page,
           "splits": shp.splits, "us": t * 1e6, "us_lo": res["ours"].lo_ms * 1e3, "us_hi": res["ours"].hi_ms * 1e3,
           "bytes": shp.nbytes, "GBps": shp.nbytes / t / 1e9, "frac_read": shp.nbytes / t / read_bw,
           "frac_copy": shp.nbytes / t / copy_bw, "tokens": shp.keys,
           "stats": {n: st.as_dict() for n, st in res.items()}, "rounds": res.rounds}
    for other in ("fa4", "sdpa", "nobl"):
        if other in res:
            row[f"{other}_us"] = res[other].median_ms * 1e3
            row[f"vs_{other}"] = res.ratio(other, "ours").as_dict()
    row.update(extra or {})
    return row


def _fmt(row):
    s = (f"{row['kind']:<8} {row['Hq']:>2}/{row['Hkv']:<1} {row['layout']:<10} P={row['P']:<3} B={row['B']:<3} "
         f"Sk={row['Sk']:<6} S={row['splits']:<3} {row['us']:8.1f} us {row['GBps']:6.0f} GB/s "
         f"{100 * row['frac_read']:5.1f}% read")
    for other in ("fa4", "sdpa", "nobl"):
        if f"vs_{other}" in row:
            r = row[f"vs_{other}"]
            s += f"  {other} {row[other + '_us']:8.1f} us x{r['median']:.2f} ({r['lo']:.2f}-{r['hi']:.2f})"
    return s


def plan(quick: bool, heads=HEADS, kinds=("dense", "blk", "sparse"), layouts=("contiguous", "hnd16", "hnd64")):
    out = []
    for hq, hkv in heads if "dense" in kinds else ():
        for layout, page in (("contiguous", 0), ("hnd", 16), ("hnd", 64)):
            if (layout if layout == "contiguous" else f"{layout}{page}") not in layouts:
                continue
            for b, sk in SHAPES:
                out.append(("dense", dict(b=b, sk=sk, hq=hq, hkv=hkv, layout=layout, page=page)))
    if quick:
        out = [x for i, x in enumerate(out) if x[1]["hq"] == 32 and x[1]["b"] in (1, 8, 64, 256)][::2]
    for b, sk in ((1, 131072), (8, 32768), (64, 16384)) if "blk" in kinds else ():
        out.append(("blk", dict(b=b, sk=sk, hq=32, hkv=8, layout="hnd", page=64, bs=64)))
    for b, pool in ((1, 32768), (1, 131072), (8, 32768), (8, 131072), (64, 32768)) if "sparse" in kinds else ():
        out.append(("sparse", dict(b=b, sk=pool, hq=32, hkv=8, layout="hnd", page=64, sparse=True, pool=pool)))
    return out


def run_ab(args, timer) -> list:
    """The per-warp ring size (KB of K + V in flight per warp) A/B on a few shapes, one process."""
    rows = []
    for kw in (dict(b=64, sk=16384, hq=32, hkv=8, layout="contiguous", page=0),
               dict(b=64, sk=16384, hq=32, hkv=8, layout="hnd", page=64),
               dict(b=8, sk=32768, hq=32, hkv=8, layout="hnd", page=16),
               dict(b=1, sk=131072, hq=32, hkv=8, layout="hnd", page=64)):
        if args.ab_splits_only:
            break
        shp = Shape(**kw)
        fns = {f"ring{kb}": (lambda kb=kb: shp.ours(kb)) for kb in (16, 24, 32, 48)}
        res = bench_windows(fns, rounds=args.rounds, timer=timer)
        line = {"shape": kw, "us": {n: st.median_ms * 1e3 for n, st in res.items()},
                "vs_ring24": {n: res.ratio("ring24", n).as_dict() for n in res}}
        rows.append(line)
        print("A/B", kw, " ".join(f"{n} {v:.1f}us" for n, v in line["us"].items()), flush=True)
        del shp
        torch.cuda.empty_cache()
    for kw in (dict(b=1, sk=8192, hq=32, hkv=8, layout="hnd", page=64),
               dict(b=1, sk=32768, hq=32, hkv=8, layout="hnd", page=64),
               dict(b=8, sk=8192, hq=32, hkv=8, layout="hnd", page=64)):
        shapes = {"auto": Shape(**kw)}
        for s in (2, 4, 8, 16, 32):
            shapes[f"s{s}"] = Shape(**kw, splits=s)
        res = bench_windows({n: sh.ours for n, sh in shapes.items()}, rounds=args.rounds, timer=timer)
        line = {"shape": kw, "auto_splits": shapes["auto"].splits,
                "us": {n: st.median_ms * 1e3 for n, st in res.items()}}
        rows.append(line)
        times = " ".join(f"{n} {v:.1f}us" for n, v in line["us"].items())
        print("A/B splits", kw, f"auto={shapes['auto'].splits}", times, flush=True)
        del shapes
        torch.cuda.empty_cache()
    return rows


class H2OStep:
    """The H2O token decode step of one layer on a paged cache ([pages, Hkv, P, D], P 16):
    reset_scores (the new token's slot) -> token_accumulate (+ its page scores) -> select_pages ->
    sparse decode over the selected pages; and dense decode of the same cache, for the same q."""

    def __init__(self, b, sk, hq=32, hkv=8, page=16, budget=2048):
        from cute_kernels.h2o import launch as H

        self.b, self.sk, self.hq, self.hkv, self.page, self.budget = b, sk, hq, hkv, page, budget
        dt = torch.bfloat16
        pages = sk // page
        n_pages = b * pages
        self.k = torch.randn(n_pages, hkv, page, D, device=DEV, dtype=dt)
        self.v = torch.randn(n_pages, hkv, page, D, device=DEV, dtype=dt)
        self.q = torch.randn(b, 1, hq, D, device=DEV, dtype=dt)
        self.scale = 1.0 / math.sqrt(D)
        self.table2d = torch.randperm(n_pages, device=DEV).to(torch.int32).view(b, pages).contiguous()
        self.seq1d = torch.full((b,), sk, dtype=torch.int32, device=DEV)
        self.slots = (self.table2d[:, -1] * page + (sk - 1) % page).contiguous()
        self.state = torch.rand(n_pages, hkv, page, device=DEV)
        lg_shape, st_shape = H.token_workspace_shapes(self.q[:, 0], self.k, self.table2d, "mean_q")
        self.lg = torch.empty(lg_shape, device=DEV)
        self.sts = torch.empty(st_shape, device=DEV)
        self.scores = torch.empty(b, hkv, pages, device=DEV)
        self.bos_p, self.eos_p = 1, 4
        self.topk = budget // page - self.bos_p - self.eos_p
        self.sel = torch.empty(b, hkv, self.bos_p + self.topk + self.eos_p, dtype=torch.int32, device=DEV)
        self.sel_lens = torch.empty(b, hkv, dtype=torch.int32, device=DEV)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(b, hq, 1, dtype=torch.float32, device=DEV)
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        self.sp_splits = L.choose_num_splits(self.q, self.k, self.sel, layout="hnd", sm_count=sm)
        self.sp_parts = self._parts(self.sp_splits)
        self.table3d = self.table2d[:, None, :].expand(b, hkv, pages).contiguous()
        self.seq2d = torch.full((b, hkv), sk, dtype=torch.int32, device=DEV)
        self.d_splits = L.choose_num_splits(self.q, self.k, self.table3d, layout="hnd", sm_count=sm)
        self.d_parts = self._parts(self.d_splits)
        self.H = H

    def _parts(self, s):
        if s <= 1:
            return None, None
        o_shape, l_shape = L.partial_shapes(self.q, s)
        return (torch.empty(o_shape, dtype=torch.float32, device=DEV),
                torch.empty(l_shape, dtype=torch.float32, device=DEV))

    def h2o(self):
        H = self.H
        H.run_reset_scores(self.state, self.slots)
        H.run_token_accumulate(self.q[:, 0], self.k, self.state, self.table2d, self.seq1d, self.lg, self.sts,
                               scale=self.scale, decay=0.984375, bos=4, eos=64, gqa_reduce="mean_q")
        H.run_token_page_scores(self.state, self.table2d, self.seq1d, self.scores)
        H.run_select_pages(self.scores, self.table2d, self.seq1d, self.sel, self.sel_lens, page_size=self.page,
                           topk=self.topk, bos=self.bos_p, eos=self.eos_p)
        self.sparse()

    def sparse(self):
        L.run_decode(self.q, self.k, self.v, self.sel_lens, self.sel, self.out, self.lse, None, *self.sp_parts,
                     layout="hnd", softmax_scale=self.scale, window_left=-1, window_right=0)

    def dense(self):
        L.run_decode(self.q, self.k, self.v, self.seq2d, self.table3d, self.out, self.lse, None, *self.d_parts,
                     layout="hnd", softmax_scale=self.scale, window_left=-1, window_right=0)


def run_h2o_step(args, read_bw) -> list:
    """H2O token decode step vs dense decode at Sk 32K, each captured in one CUDA graph and replayed."""
    gtimer = timer_from_args(argparse.Namespace(**{**vars(args), "graph": True}))
    rows = []
    for b in (1, 8, 32):
        st = H2OStep(b, 32768)
        st.h2o()
        torch.cuda.synchronize()
        res = bench_windows({"h2o_step": st.h2o, "sparse_only": st.sparse, "dense": st.dense}, rounds=args.rounds,
                            timer=gtimer)
        dense_bytes = b * st.hkv * st.sk * D * 2 * 2
        row = {"kind": "h2o_step", "B": b, "Sk": st.sk, "Hq": st.hq, "Hkv": st.hkv, "P": st.page,
               "budget_tokens": st.budget, "modes": {n: s.mode for n, s in res.items()},
               "us": {n: s.median_ms * 1e3 for n, s in res.items()},
               "h2o_over_dense_time": res.ratio("h2o_step", "dense").as_dict(),  # t_h2o / t_dense
               "dense_frac_read": dense_bytes / (res["dense"].median_ms * 1e-3) / read_bw,
               "stats": {n: s.as_dict() for n, s in res.items()}}
        rows.append(row)
        r = row["h2o_over_dense_time"]
        print(f"h2o_step B={b} Sk=32768 budget {st.budget}: " + " ".join(f"{n} {v:.1f}us" for n, v in row["us"].items())
              + f"  time h2o / dense x{r['median']:.2f} ({r['lo']:.2f}-{r['hi']:.2f})  modes {row['modes']}", flush=True)
        del st
        torch.cuda.empty_cache()
    return rows


def run(args) -> dict:
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    timer = timer_from_args(args)
    read_bw, copy_bw = ceilings(timer, args.rounds)
    print(f"streaming read {read_bw / 1e9:.0f} GB/s, device copy {copy_bw / 1e9:.0f} GB/s "
          f"({torch.cuda.get_device_name()})", flush=True)
    ab = run_ab(args, timer) if args.ab else None
    h2o = run_h2o_step(args, read_bw) if "h2o_step" in args.kinds.split(",") else None
    rows = []
    heads = tuple(tuple(int(x) for x in h.split("/")) for h in args.heads.split(","))
    kinds = tuple(k for k in args.kinds.split(",") if k != "h2o_step")
    for kind, kw in ([] if args.ab_only else plan(args.quick, heads, kinds, tuple(args.layouts.split(",")))):
        shp = Shape(**kw)
        fns = {"ours": shp.ours}
        if kind == "dense":
            for name, fn in (("fa4", shp.fa4()), ("sdpa", shp.sdpa())):
                if fn is not None:
                    fns[name] = fn
        elif kind == "blk":
            base = Shape(**{k: v for k, v in kw.items() if k != "bs"})
            fns["nobl"] = base.ours
        res = bench_windows(fns, rounds=args.rounds, timer=timer)
        row = _row(kind, shp, res, read_bw, copy_bw)
        rows.append(row)
        print(_fmt(row), flush=True)
        if args.json:  # after every row: a run cut short by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"read_GBps": read_bw / 1e9, "copy_GBps": copy_bw / 1e9, "rows": rows, "ring_ab": ab,
                           "partial": True}, f, indent=1)
        del shp, fns
        torch.cuda.empty_cache()
    host = None
    host_extra = {}
    if args.host_n > 0:
        # flash_attn_with_kvcache's launch: dense [B] lengths / [B, n] table as they are, unsplit
        shp = Shape(b=1, sk=256, hq=32, hkv=8, layout="hnd", page=16)
        host = host_us_per_call(shp.ours, n=args.host_n)
        print(f"host time per run_decode call (launcher, unsplit, dense [B] / [B, n] index): {host:.1f} us",
              flush=True)
        split = Shape(b=1, sk=256, hq=32, hkv=8, layout="hnd", page=16, splits=4)
        host_extra["split4"] = host_us_per_call(split.ours, n=args.host_n)
        per_head = Shape(b=1, sk=256, hq=32, hkv=8, layout="hnd", page=16)
        per_head.seq = per_head.seq[:, None].expand(1, 8).contiguous()
        per_head.table = per_head.table[:, None].expand(1, 8, per_head.table.shape[1]).contiguous()
        host_extra["per_head"] = host_us_per_call(per_head.ours, n=args.host_n)
        print(f"  split in 4 (+ combine launch): {host_extra['split4']:.1f} us; per-kv-head [B, Hkv] / [B, Hkv, n] "
              f"index (sparse decode's form): {host_extra['per_head']:.1f} us", flush=True)
    info.finish()
    return {"run": info.as_dict(), "read_GBps": read_bw / 1e9, "copy_GBps": copy_bw / 1e9, "host_us": host,
            "host_us_extra": host_extra, "rows": rows, "h2o_step": h2o, "ring_ab": ab, "_info": info}


def markdown(info, res) -> str:
    lines = ["# Decode", "", info.markdown(),
             f"- streaming read {res['read_GBps']:.0f} GB/s, device copy {res['copy_GBps']:.0f} GB/s; "
             f"launcher host time {res['host_us'] or float('nan'):.1f} us per call", "",
             "| kind | Hq/Hkv | layout | P | B | Sk | splits | us | GB/s | % read | vs FA4 | vs SDPA | vs no-blk |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        def ratio(k):
            x = r.get(f"vs_{k}")
            return "-" if x is None else f"{x['median']:.2f}x ({x['lo']:.2f}-{x['hi']:.2f})"
        lines.append(f"| {r['kind']} | {r['Hq']}/{r['Hkv']} | {r['layout']} | {r['P']} | {r['B']} | {r['Sk']} | "
                     f"{r['splits']} | {r['us']:.1f} | {r['GBps']:.0f} | {100 * r['frac_read']:.0f}% | "
                     f"{ratio('fa4')} | "
                     f"{ratio('sdpa')} | {ratio('nobl')} |")
    for r in res.get("h2o_step") or ():
        x = r["h2o_over_dense_time"]
        lines.append(f"| h2o_step (graph) | {r['Hq']}/{r['Hkv']} | hnd | {r['P']} | {r['B']} | {r['Sk']} | - | "
                     + " / ".join(f"{n} {v:.1f}" for n, v in r["us"].items())
                     + f" | - | dense {100 * r['dense_frac_read']:.0f}% | time h2o step / dense {x['median']:.2f}x "
                       f"({x['lo']:.2f}-{x['hi']:.2f}) | - | - |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset of the dense shapes")
    ap.add_argument("--host-n", type=int, default=100, help="calls per host-cost measurement (0: skip)")
    ap.add_argument("--ab", action="store_true", help="also the per-warp ring size A/B (ring_kb 16/24/32/48)")
    ap.add_argument("--ab-only", action="store_true", help="only the A/B")
    ap.add_argument("--ab-splits-only", action="store_true", help="the A/B of split counts only (with --ab)")
    ap.add_argument("--layouts", default="contiguous,hnd16,hnd64", help="dense cache layouts to time")
    ap.add_argument("--kinds", default="dense,blk,sparse", help="row kinds to time (dense, blk, sparse, h2o_step)")
    ap.add_argument("--heads", default=",".join(f"{a}/{b}" for a, b in HEADS), help="Hq/Hkv list, e.g. 32/8,8/1")
    add_method_args(ap)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    _imports()
    res = run(args)
    info = res.pop("_info")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    write_markdown(args.markdown, markdown(info, res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark of windowed indexed attention (plan + forward + backward) on one GPU, torch tensors.

    python bench/bench_indexed.py [--shapes 16Kx16K,64Kx64K,...] [--rhos 0.9,0.5]
                                  [--baseline-max 16384] [--window 0.5] [--rounds 3] [--no-flush] [--graph]
                                  [--json FILE] [--markdown [FILE]]

Production QSA layer: Hq 24, Hkv 2, D 256, bf16, rows of 2,051 token indices (512 blocks of 4 plus
the query's 0-3 tail tokens), one selection shared by the heads. Indices come from a GPU port of
``tests/oracles/index_sources.prime_rl_indices`` (AR(1) hidden states, rho = 0.9 "local",
0.5 "less local"); CP shapes are the last rank's queries of a 131K document. Reported: ms of plan,
forward, dQ, dK/dV and of all four in one call ("total"), each a variant of bench/_timing.py
(its own >= 0.5 s window, launches queued back to back, L2 flushed between repetitions, alternating
windows for --rounds rounds; median and min-max of the window medians), the union ratio (mean window
union / mean row size), the host cost per call of each part (µs, 20 calls on a 1K x 1K problem, GPU kept
busy) and an in-process baseline: per-query gather + dense attention in torch (chunked, autograd;
dK/dV by index_add), fwd + bwd, when Lq <= --baseline-max (one window, one round: it takes seconds).
Published H200 numbers of the windowed Triton kernel (prime-kernels) for the same shapes:
31 / 191 / 448 / 134 / 65 ms (old TileLang kernel 116 / 352 / 669 / 163 / 84 ms).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import (fmt_spread, CudaTimer, RunInfo, add_method_args, bench_windows, host_us_per_call,  # noqa: E402
                     method_from_args, timer_from_args, write_markdown)

PUBLISHED = {"16Kx16K": (31, 116), "64Kx64K": (191, 352), "131Kx131K": (448, 669),
             "32Kx131K": (134, 163), "16Kx131K": (65, 84)}
HQ, HKV, D = 24, 2, 256
BUDGET, RATIO = 512, 4
WIDTH = BUDGET * RATIO + RATIO - 1


def parse_len(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def prime_rl_indices_gpu(num_q: int, kv_len: int, rho: float, seed: int = 0, heads: int = 4,
                         head_dim: int = 32, hidden: int = 64, chunk: int = 2048):
    """GPU twin of index_sources.prime_rl_indices: [num_q, 2051] int32, sentinel kv_len."""
    import torch

    with torch.no_grad():
        return _prime_rl_indices_gpu(torch, num_q, kv_len, rho, seed, heads, head_dim, hidden, chunk)


def _prime_rl_indices_gpu(torch, num_q, kv_len, rho, seed, heads, head_dim, hidden, chunk):
    g = torch.Generator(device="cuda").manual_seed(seed)
    eps = torch.randn(kv_len, hidden, device="cuda", generator=g)
    # AR(1) by a blocked scan: h_t = rho h_{t-1} + c eps_t
    c = math.sqrt(1 - rho * rho)
    h = torch.empty_like(eps)
    blk = 256
    powers = rho ** torch.arange(blk, device="cuda", dtype=torch.float32)
    lag = torch.arange(blk, device="cuda")[:, None] - torch.arange(blk, device="cuda")[None, :]
    lower = torch.where(lag >= 0, rho ** lag.clamp_min(0).float(), torch.zeros((), device="cuda"))  # rho^(i-j)
    carry = torch.zeros(hidden, device="cuda")
    for t0 in range(0, kv_len, blk):
        e = eps[t0: t0 + blk] * c
        n = e.shape[0]
        if t0 == 0:
            e = e.clone()
            e[0] = eps[0]
        hb = lower[:n, :n] @ e + powers[:n, None] * rho * carry[None, :]
        h[t0: t0 + n] = hb
        carry = hb[-1]
    wq = (torch.rand(hidden, heads * head_dim, device="cuda", generator=g) * 2 - 1) / math.sqrt(hidden)
    wk = (torch.rand(hidden, head_dim, device="cuda", generator=g) * 2 - 1) / math.sqrt(hidden)
    n_blocks = kv_len // RATIO
    kb = (h[: n_blocks * RATIO] @ wk).view(n_blocks, RATIO, head_dim).mean(1)
    out = torch.full((num_q, WIDTH), kv_len, dtype=torch.int32, device="cuda")
    offset = kv_len - num_q
    ar = torch.arange(RATIO, device="cuda")
    for c0 in range(0, num_q, chunk):
        pos = torch.arange(offset + c0, offset + min(c0 + chunk, num_q), device="cuda")
        q = (h[pos] @ wq).view(len(pos), heads, head_dim)
        vis = (pos + 1) // RATIO
        nb = int(vis.max().item())
        k = min(BUDGET, nb)
        rows = out[c0: c0 + len(pos)]
        if k > 0:
            scores = torch.zeros(len(pos), nb, device="cuda")
            for hh in range(heads):
                scores += torch.relu(q[:, hh] @ kb[:nb].T)
            scores.masked_fill_(torch.arange(nb, device="cuda")[None, :] >= vis[:, None], -math.inf)
            top = torch.topk(scores, k, dim=1).indices  # score order, as a top-k would emit
            tok = (top[:, :, None] * RATIO + ar).reshape(len(pos), k * RATIO)
            nsel = torch.clamp(vis, max=BUDGET)
            keep = torch.arange(k * RATIO, device="cuda")[None, :] < (nsel * RATIO)[:, None]
            rows[:, : k * RATIO] = torch.where(keep, tok, kv_len).int()
        else:
            nsel = torch.zeros_like(vis)
        tail = (pos + 1) % RATIO
        col = nsel * RATIO
        for j in range(RATIO - 1):
            sel = j < tail
            r = torch.nonzero(sel).squeeze(1)
            rows[r, col[r] + j] = (pos[r] - tail[r] + 1 + j).int()
    return out


def union_ratio_gpu(idx, kv_len: int, wq: int, samples: int = 512) -> float:
    import torch

    with torch.no_grad():
        return _union_ratio_gpu(torch, idx, kv_len, wq, samples)


def _union_ratio_gpu(torch, idx, kv_len, wq, samples):
    nw = idx.shape[0] // wq
    ws = torch.linspace(0, nw - 1, min(samples, nw), device="cuda").long()
    unions, rows = [], []
    for w in ws.tolist():
        blk = idx[w * wq:(w + 1) * wq]
        valid = blk[(blk >= 0) & (blk < kv_len)]
        unions.append(torch.unique(valid).numel())
        rows.append(sum(torch.unique(r[(r >= 0) & (r < kv_len)]).numel() for r in blk) / wq)
    return sum(unions) / max(sum(rows), 1)


def windowed_fns(q, k, v, idx, dout, stages=None) -> tuple:
    """The parts of one windowed layer as callables ({plan, fwd, dq, dkdv, total}) and a function that
    reads the plan's statistics after they ran."""
    import torch

    from cute_kernels.indexed.config import window_queries
    from cute_kernels.indexed.launch import (attn_config, plan_shapes, run_bwd_dkdv, run_bwd_dq, run_fwd,
                                             run_plan)

    named = isinstance(stages, str)
    # "default": AttnConfig's defaults (wgmma dK/dV on SM90); "mma": the portable mma.sync dK/dV
    # kernel with its defaults; other names pick its optional steps ("plain" = neither).
    custom = named and stages not in ("default", "mma")
    cfg = attn_config(q, k, per_kv_head=False, stages=None if named else stages,
                      meta_ahead=("meta" in stages) if custom else None,
                      skip_empty=("skip" in stages) if custom else None,
                      dkdv_impl="auto" if stages in (None, "default") else "mma")
    wq = window_queries(cfg.group)
    kv_len = k.shape[1]
    hq = q.shape[2]
    scale = D ** -0.5
    shapes = plan_shapes(1, q.shape[1], WIDTH, kv_len, wq)
    plan = {n: torch.empty(s, dtype=torch.int32, device="cuda") for n, s in shapes._asdict().items()}
    out = torch.empty_like(q)
    lse = torch.empty((1, hq, q.shape[1]), dtype=torch.float32, device="cuda")
    dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)

    def plan_fn():
        plan["tile_bits"].zero_()
        run_plan(idx, kv_len, plan["win_key"], plan["win_mask"], plan["win_count"], plan["tile_bits"],
                 plan["tile_ptr"], plan["tile_win"], plan["tile_start"], window_queries=wq)

    def fwd_fn():
        run_fwd(cfg, q, k, v, plan["win_key"], plan["win_mask"], plan["win_count"], out, lse, scale)

    def dq_fn():
        run_bwd_dq(cfg, q, k, v, out, dout, lse, plan["win_key"], plan["win_mask"], plan["win_count"], dq,
                   delta, scale)

    def dkdv_fn():
        run_bwd_dkdv(cfg, q, k, v, dout, lse, delta, plan["win_key"], plan["win_mask"], plan["win_count"],
                     plan["tile_ptr"], plan["tile_win"], plan["tile_start"], dk, dv, scale)

    def all_fn():
        plan_fn()
        fwd_fn()
        dq_fn()
        dkdv_fn()

    def plan_stats():
        return {"mean_window_keys": float(plan["win_count"].float().mean()), "pairs": int(plan["tile_ptr"][-1])}

    all_fn()  # every part's inputs exist before any part is timed alone
    return {"plan": plan_fn, "fwd": fwd_fn, "dq": dq_fn, "dkdv": dkdv_fn, "total": all_fn}, plan_stats


PARTS = ("plan", "fwd", "dq", "dkdv", "total")


def layer_inputs(lq: int, lkv: int, rho: float, hq: int = HQ, hkv: int = HKV):
    import torch

    torch.manual_seed(0)
    q = torch.randn(1, lq, hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, lkv, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, lkv, hkv, D, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    idx = prime_rl_indices_gpu(lq, lkv, rho, seed=1)
    return q, k, v, dout, idx


def parse_stages(text: str) -> list:
    return [None if x == "default" else int(x) if x.isdigit() else x for x in text.split(",") if x]


def prefix(st) -> str:
    return "" if st is None else f"{st}_"


def baseline_fwd_bwd(q, k, v, idx, dout, chunk: int = 256):
    """Gather + dense attention per query in torch (fp32 softmax), chunked; grads by autograd."""
    import torch

    kv_len = k.shape[1]
    G = HQ // HKV
    kp = torch.cat([k, torch.zeros_like(k[:, :1])], 1).requires_grad_()
    vp = torch.cat([v, torch.zeros_like(v[:, :1])], 1).requires_grad_()
    qg = q.detach().requires_grad_()
    for c0 in range(0, q.shape[1], chunk):
        ic = idx[c0: c0 + chunk].long().clamp(0, kv_len)
        kg = kp[0][ic]  # [n, W, Hkv, D]
        vg = vp[0][ic]
        qc = qg[0, c0: c0 + chunk].view(-1, HKV, G, D)
        s = torch.einsum("nhgd,nwhd->nhgw", qc, kg).float() * D ** -0.5
        s = s.masked_fill((ic == kv_len)[:, None, None, :], -math.inf)
        p = torch.softmax(s, -1).to(q.dtype)
        o = torch.einsum("nhgw,nwhd->nhgd", p, vg).reshape(-1, HQ, D)
        o.backward(dout[0, c0: c0 + chunk])
    return qg.grad, kp.grad, vp.grad


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16Kx16K,64Kx64K,131Kx131K,32Kx131K,16Kx131K")
    ap.add_argument("--rhos", default="0.9,0.5")
    ap.add_argument("--baseline-max", type=int, default=16384)
    ap.add_argument("--host-n", type=int, default=20, help="calls per host-cost measurement (0: skip)")
    ap.add_argument("--stages", default="default",
                    help="comma list of 'default' (AttnConfig defaults: meta+skip, wgmma dK/dV on SM90), "
                         "'mma' (the portable mma.sync dK/dV kernel, its defaults), and for that kernel: "
                         "1 or 2 (both passes forced), 'plain' (neither optional step), 'meta' (one-ahead "
                         "plan reads only), 'skip' (dK/dV skips unselected halves only), 'meta+skip'")
    add_method_args(ap)
    args = ap.parse_args(argv)
    args.shapes = [(sh, parse_len(sh.split("x")[0]), parse_len(sh.split("x")[1])) for sh in args.shapes.split(",")]
    args.rhos = [float(r) for r in args.rhos.split(",")]
    args.stage_list = parse_stages(args.stages)
    return args


def markdown(info: RunInfo, rows: list, host: dict) -> str:
    head = ["Lq x Lkv", "rho", "union"] + [f"{p} ms" for p in PARTS] + [
        "published windowed ms", "total / published", "gather+dense ms", "speed-up vs gather+dense"]
    lines = ["# Indexed attention (plan + fwd + bwd)", "", info.markdown(), "",
             "ms: median window (min-max of the window medians); default stages only.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], f"{r['rho']}", f"{r['union_ratio']:.2f}"]
        for p in PARTS:
            st = r["stats"].get(p)
            cells.append("-" if st is None else f"{st['median_ms']:.2f} ({st['lo_ms']:.2f}-{st['hi_ms']:.2f})")
        cells.append(str(r.get("published_windowed_ms", "-")))
        x = r.get("ratio_vs_published_windowed")
        cells.append(fmt_spread(x))
        cells.append(f"{r['baseline_gather_dense_ms']:.0f}" if "baseline_gather_dense_ms" in r else "-")
        cells.append(f"{r['speedup_vs_baseline']:.1f}" if "speedup_vs_baseline" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if host:
        lines += ["", "Host cost per call (µs, 1K x 1K, GPU kept busy): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    import torch

    from cute_kernels.indexed.config import window_queries

    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    timer = timer_from_args(args)
    host = {}
    if args.host_n > 0:
        q, k, v, dout, idx = layer_inputs(1024, 1024, args.rhos[0])
        fns, _ = windowed_fns(q, k, v, idx[None], dout)
        host = {p: host_us_per_call(fns[p], n=args.host_n) for p in PARTS}
        del fns, q, k, v, dout, idx
        print(json.dumps({"host_us_per_call": {k: round(v, 1) for k, v in host.items()}}), flush=True)
    rows = []
    for shape, lq, lkv in args.shapes:
        for rho in args.rhos:
            q, k, v, dout, idx = layer_inputs(lq, lkv, rho)
            ratio = union_ratio_gpu(idx, lkv, window_queries(HQ // HKV))
            row = {"shape": shape, "rho": rho, "union_ratio": round(ratio, 3), "stages": args.stages}
            fns, stats_fns = {}, []
            for st in args.stage_list:
                parts, plan_stats = windowed_fns(q, k, v, idx[None], dout, st)
                fns.update({prefix(st) + p: f for p, f in parts.items()})
                stats_fns.append((st, plan_stats))
            res = bench_windows(fns, rounds=args.rounds, timer=timer)
            row["stats"] = {n: s_.as_dict() for n, s_ in res.items()}
            row["rounds"] = res.rounds
            for n, s_ in res.items():
                row[f"{n}_ms"] = round(s_.median_ms, 3)
            for st, plan_stats in stats_fns:
                if st is None:
                    row.update(plan_stats())
            pub = PUBLISHED.get(shape)
            if pub and "total" in res:
                row["published_windowed_ms"], row["published_tilelang_ms"] = pub
                vals = tuple(r_["total"] / pub[0] for r_ in res.rounds)
                row["ratio_vs_published_windowed"] = {"median": statistics.median(vals), "lo": min(vals),
                                                      "hi": max(vals), "rounds": list(vals)}
            if lq <= args.baseline_max and "total" in res:
                # seconds per call: one round, one timed repetition (after the first call and one warm-up call)
                slow = CudaTimer(window_s=args.window, warmup_s=0.0, flush=not args.no_flush, min_reps=1)
                base = bench_windows({"baseline": lambda q=q, k=k, v=v, idx=idx, dout=dout:
                                      baseline_fwd_bwd(q, k, v, idx, dout)}, rounds=1,
                                     timer=slow)["baseline"]
                row["baseline_gather_dense_ms"] = round(base.median_ms, 2)
                row["speedup_vs_baseline"] = round(base.median_ms / res["total"].median_ms, 3)
                del slow
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ not in ("stats", "rounds")}), flush=True)
            rows.append(row)
            del q, k, v, dout, idx, fns, stats_fns
            torch.cuda.empty_cache()
    info.finish()
    if timer.capture_errors:
        info.method["graph_capture_failed"] = timer.capture_errors
    info.method["host_calls"] = args.host_n
    write_markdown(args.markdown, markdown(info, rows, host))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": info.as_dict(), "host_us_per_call": host, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

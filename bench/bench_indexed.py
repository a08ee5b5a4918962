"""Benchmark of windowed indexed attention (plan + forward + backward) on one GPU, torch tensors.

    python bench/bench_indexed.py [--shapes 16Kx16K,64Kx64K,...] [--rhos 0.9,0.5] [--iters 5]
                                  [--baseline-max 16384] [--json FILE]

Production QSA layer: Hq 24, Hkv 2, D 256, bf16, rows of 2,051 token indices (512 blocks of 4 plus
the query's 0-3 tail tokens), one selection shared by the heads. Indices come from a GPU port of
``tests/oracles/index_sources.prime_rl_indices`` (AR(1) hidden states, rho = 0.9 "local",
0.5 "less local"); CP shapes are the last rank's queries of a 131K document. Reported: median ms
of plan, forward, backward and their sum (CUDA events, after one warm-up), the union ratio
(mean window union / mean row size), and an in-process baseline: per-query gather + dense
attention in torch (chunked, autograd; dK/dV by index_add), fwd + bwd, when Lq <= --baseline-max.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import samples_ms  # noqa: E402 (bench/ is on sys.path when run as a script)

PUBLISHED = {"16Kx16K": (31, 116), "64Kx64K": (191, 352), "131Kx131K": (448, 669),
             "32Kx131K": (134, 163), "16Kx131K": (65, 84)}
HQ, HKV, D = 24, 2, 256
BUDGET, RATIO = 512, 4
WIDTH = BUDGET * RATIO + RATIO - 1


def parse_len(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


@torch.no_grad()
def prime_rl_indices_gpu(num_q: int, kv_len: int, rho: float, seed: int = 0, heads: int = 4,
                         head_dim: int = 32, hidden: int = 64, chunk: int = 2048) -> torch.Tensor:
    """GPU twin of index_sources.prime_rl_indices: [num_q, 2051] int32, sentinel kv_len."""
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


@torch.no_grad()
def union_ratio_gpu(idx: torch.Tensor, kv_len: int, wq: int, samples: int = 512) -> float:
    nw = idx.shape[0] // wq
    ws = torch.linspace(0, nw - 1, min(samples, nw), device="cuda").long()
    unions, rows = [], []
    for w in ws.tolist():
        blk = idx[w * wq:(w + 1) * wq]
        valid = blk[(blk >= 0) & (blk < kv_len)]
        unions.append(torch.unique(valid).numel())
        rows.append(sum(torch.unique(r[(r >= 0) & (r < kv_len)]).numel() for r in blk) / wq)
    return sum(unions) / max(sum(rows), 1)


def time_ms(fn, iters: int) -> list:
    return samples_ms(fn, iters, warmup=1)


def bench_windowed(q, k, v, idx, dout, iters: int, stages=None) -> dict:
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
    scale = D ** -0.5
    shapes = plan_shapes(1, q.shape[1], WIDTH, kv_len, wq)
    plan = {n: torch.empty(s, dtype=torch.int32, device="cuda") for n, s in shapes._asdict().items()}
    out = torch.empty_like(q)
    lse = torch.empty((1, HQ, q.shape[1]), dtype=torch.float32, device="cuda")
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

    res = {f"{name}_ms": statistics.median(time_ms(fn, iters))
           for name, fn in (("plan", plan_fn), ("fwd", fwd_fn), ("dq", dq_fn), ("dkdv", dkdv_fn))}
    res["total_ms"] = statistics.median(time_ms(all_fn, iters))
    res["mean_window_keys"] = float(plan["win_count"].float().mean())
    res["pairs"] = int(plan["tile_ptr"][-1])
    return res


def baseline_fwd_bwd(q, k, v, idx, dout, chunk: int = 256):
    """Gather + dense attention per query in torch (fp32 softmax), chunked; grads by autograd."""
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16Kx16K,64Kx64K,131Kx131K,32Kx131K,16Kx131K")
    ap.add_argument("--rhos", default="0.9,0.5")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--baseline-max", type=int, default=16384)
    ap.add_argument("--json", default=None)
    ap.add_argument("--stages", default="default",
                    help="comma list of 'default' (AttnConfig defaults: meta+skip, wgmma dK/dV on SM90), "
                         "'mma' (the portable mma.sync dK/dV kernel, its defaults), and for that kernel: "
                         "1 or 2 (both passes forced), 'plain' (neither optional step), 'meta' (one-ahead "
                         "plan reads only), 'skip' (dK/dV skips unselected halves only), 'meta+skip'")
    args = ap.parse_args(argv)
    from cute_kernels.indexed.config import window_queries

    rows = []
    for shape in args.shapes.split(","):
        lq, lkv = (parse_len(x) for x in shape.split("x"))
        for rho in (float(r) for r in args.rhos.split(",")):
            torch.manual_seed(0)
            q = torch.randn(1, lq, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, lkv, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, lkv, HKV, D, device="cuda", dtype=torch.bfloat16)
            dout = torch.randn_like(q)
            idx = prime_rl_indices_gpu(lq, lkv, rho, seed=1)
            ratio = union_ratio_gpu(idx, lkv, window_queries(HQ // HKV))
            row = {"shape": shape, "rho": rho, "union_ratio": round(ratio, 3)}
            for i, st in enumerate(None if x == "default" else int(x) if x.isdigit() else x
                                   for x in args.stages.split(",")):
                res = bench_windowed(q, k, v, idx[None], dout, args.iters, st)
                row.update({(k_ if i == 0 else f"{st}_{k_}"): round(v_, 3) if isinstance(v_, float) else v_
                            for k_, v_ in res.items() if i == 0 or k_.endswith("_ms")})
            row["stages"] = args.stages
            pub = PUBLISHED.get(shape)
            if pub:
                row["published_windowed_ms"], row["published_tilelang_ms"] = pub
                row["ratio_vs_published_windowed"] = round(row["total_ms"] / pub[0], 3)
            if lq <= args.baseline_max:
                base = statistics.median(time_ms(lambda: baseline_fwd_bwd(q, k, v, idx, dout), 1))
                row["baseline_gather_dense_ms"] = round(base, 2)
                row["speedup_vs_baseline"] = round(base / row["total_ms"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del q, k, v, dout, idx
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

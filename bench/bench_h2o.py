"""Benchmark of the H2O CuTe kernels on decode shapes, against the same math composed from torch ops.

    python bench/bench_h2o.py [--quick] [--json FILE]

For every op and shape: device time of our launch(es) (CUDA-graph replay of 20 launches, so host
overhead is excluded), the bytes the op must move (keys / summaries / state / scores read, state
and outputs written) divided by that time, as a fraction of the measured device-copy bandwidth
(``y.copy_(x)`` of 2 GiB: 2 x bytes / time), the host time per launch (Python launcher + TVM-FFI
call, no sync, tiny shape) and the eager torch composition of the same math in this process.
Shapes follow issue 6: Hq 32, Hkv 8, D 128, batch 1/16/64, context 4K..128K, bf16 keys.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cute_kernels.h2o import launch as L  # noqa: E402

DEV = "cuda"
HQ, HKV, D = 32, 8, 128
G = HQ // HKV


def copy_bandwidth() -> float:
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * n / device_time(lambda: y.copy_(x), reps=10)


GRAPH_OK = {"ok": True}


def device_time(fn, reps=20) -> float:
    """Seconds per call: ``reps`` calls captured in one CUDA graph, replayed and timed by events.

    Falls back to back-to-back eager launches (recorded in the output) if capture fails.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as exc:  # noqa: BLE001 - report and time eagerly instead
        if GRAPH_OK["ok"]:
            print(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eager launches", flush=True)
        GRAPH_OK["ok"] = False
        torch.cuda.synchronize()
        return eager_time(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def eager_time(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def host_time(fn, reps=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    return host


def paged(batch, ctx, page):
    pages = ctx // page
    num_pages = batch * pages
    tables = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return num_pages, tables, seq_lens


# ------------------------------------------------------------------------------------ ops
def bench_page_scores(batch, ctx, summary_dtype=torch.float32):
    page = 16
    num_pages, tables, seq_lens = paged(batch, ctx, page)
    summary = torch.randn(num_pages, HKV, 3, D, device=DEV).to(summary_dtype)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(batch, HKV, tables.shape[1], device=DEV)
    ours = lambda: L.run_page_scores(q, summary, tables, seq_lens, out, page_size=page)  # noqa: E731

    def composed():
        s = summary[tables.long()].float()  # [B, MP, Hkv, 3, D]
        qb = q.float().view(batch, HKV, G, D).mean(2)[:, None]  # [B, 1, Hkv, D]
        avg = (s[:, :, :, 0] * qb).sum(-1)
        peak = torch.maximum(s[:, :, :, 1] * qb, s[:, :, :, 2] * qb).sum(-1)
        res = (avg + peak).transpose(1, 2)
        n_pages = (seq_lens + page - 1) // page
        valid = torch.arange(tables.shape[1], device=DEV)[None, None] < n_pages[:, None, None]
        return torch.where(valid, res, torch.full_like(res, -math.inf))

    check = composed()
    ours()
    torch.testing.assert_close(out, check, rtol=1e-4, atol=1e-3)
    nbytes = summary.numel() * summary.element_size() + out.numel() * 4 + tables.numel() * 4
    return ours, composed, nbytes


def bench_token_accumulate(batch, ctx, page):
    num_pages, tables, seq_lens = paged(batch, ctx, page)
    key = torch.randn(num_pages, HKV, page, D, device=DEV, dtype=torch.bfloat16)
    state = torch.zeros(num_pages, HKV, page, device=DEV)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    lg_shape, st_shape = L.token_workspace_shapes(q, key, tables, "mean_q")
    lg = torch.empty(lg_shape, device=DEV)
    sts = torch.empty(st_shape, device=DEV)
    bos, eos, scale, decay = 4, 64, D ** -0.5, 0.984375
    ours = lambda: L.run_token_accumulate(q, key, state, tables, seq_lens, lg, sts, scale=scale, decay=decay,  # noqa: E731
                                          bos=bos, eos=eos, gqa_reduce="mean_q")
    t_idx = torch.arange(ctx, device=DEV)
    win = (t_idx >= bos) & (t_idx < ctx - eos)

    def composed():
        k = key[tables.long()]  # [B, MP, Hkv, P, D]
        k = k.permute(0, 2, 1, 3, 4).reshape(batch, HKV, ctx, D)
        qb = q.float().view(batch, HKV, G, D).mean(2)
        logit = torch.einsum("bhd,bhtd->bht", qb, k.float()) * scale
        logit = logit.masked_fill(~win, -math.inf)
        p = torch.softmax(logit, dim=-1)
        hh = state[tables.long()].permute(0, 2, 1, 3).reshape(batch, HKV, ctx)
        new = torch.where(win, p + decay * hh, hh)
        state[tables.long()] = new.view(batch, HKV, -1, page).permute(0, 2, 1, 3)

    nbytes = key.numel() * 2 + state.numel() * 4 * 2 + tables.numel() * 4
    return ours, composed, nbytes


def bench_select(batch, ctx, page=16, topk=None):
    num_pages, tables, seq_lens = paged(batch, ctx, page)
    mp = tables.shape[1]
    topk = topk or max(1, mp // 8)
    bos, eos = 1, 2
    scores = torch.randn(batch, HKV, mp, device=DEV)
    out = torch.empty(batch, HKV, bos + topk + eos, dtype=torch.int32, device=DEV)
    lens = torch.empty(batch, HKV, dtype=torch.int32, device=DEV)
    ours = lambda: L.run_select_pages(scores, tables, seq_lens, out, lens, page_size=page, topk=topk, bos=bos,  # noqa: E731
                                      eos=eos)

    def composed():
        mid = scores[:, :, bos:mp - eos]
        idx = torch.topk(mid, topk, dim=-1, sorted=False).indices.sort(-1).values + bos
        head = torch.arange(bos, device=DEV).expand(batch, HKV, bos)
        tail = torch.arange(mp - eos, mp, device=DEV).expand(batch, HKV, eos)
        logical = torch.cat([head, idx, tail], -1)
        return torch.gather(tables.long()[:, None].expand(batch, HKV, mp), 2, logical)

    ours()
    torch.testing.assert_close(out.long(), composed())
    nbytes = scores.numel() * 4 + out.numel() * 4
    return ours, composed, nbytes


def bench_summary(batch, ctx, page=16):
    num_pages, tables, seq_lens = paged(batch, ctx, page)
    key = torch.randn(num_pages, HKV, page, D, device=DEV, dtype=torch.bfloat16)
    summary = torch.zeros(num_pages, HKV, 3, D, device=DEV)
    last = tables[:, -1].long()
    slots = (last * page + page - 1).int()  # decode: each request just filled its last page
    ours = lambda: L.run_update_page_summary(key, slots, summary)  # noqa: E731

    def composed():
        k = key[last].float()  # [B, Hkv, P, D]
        summary[last] = torch.stack([k.mean(2), k.amax(2), k.amin(2)], 2)

    nbytes = batch * HKV * page * D * 2 + batch * HKV * 3 * D * 4
    return ours, composed, nbytes


def run(quick: bool):
    copy_bw = copy_bandwidth()
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    plan = [("page_scores", bench_page_scores, (b, c)) for b, c in
            [(1, 4096), (1, 131072), (16, 32768), (64, 32768), (64, 131072)]]
    plan += [(f"token_accumulate P{p}", bench_token_accumulate, (b, c, p)) for p in (1, 16) for b, c in
             [(1, 4096), (1, 131072), (16, 32768), (64, 32768)]]
    plan += [("select_pages", bench_select, (b, c)) for b, c in [(1, 4096), (1, 131072), (16, 32768), (64, 131072)]]
    plan += [("update_page_summary", bench_summary, (b, c)) for b, c in [(1, 4096), (64, 32768)]]
    if quick:
        plan = plan[::3]
    for name, fn, args in plan:
        ours, composed, nbytes = fn(*args)
        t = device_time(ours)
        tb = eager_time(composed)
        host = host_time(ours) if t < 1e-4 else None  # big shapes: the GPU, not the host, is the limit
        row = {"op": name, "batch": args[0], "context": args[1], "us": t * 1e6, "GBps": nbytes / t / 1e9,
               "frac_copy": nbytes / t / copy_bw, "composed_us": tb * 1e6, "speedup": tb / t,
               "host_us": None if host is None else host * 1e6, "bytes": nbytes}
        rows.append(row)
        print(f"{name:<22} B={args[0]:<3} ctx={args[1]:<7} {row['us']:9.1f} us {row['GBps']:7.0f} GB/s "
              f"({100 * row['frac_copy']:5.1f}% of copy)  composed {row['composed_us']:9.1f} us "
              f"x{row['speedup']:6.1f}  host {row['host_us'] or float('nan'):5.1f} us", flush=True)
        del ours, composed
        torch.cuda.empty_cache()
    return {"copy_GBps": copy_bw / 1e9, "device": torch.cuda.get_device_name(), "graph_timing": GRAPH_OK["ok"],
            "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark of the H2O CuTe kernels on decode shapes, against the same math composed from torch ops.

    python bench/bench_h2o.py [--quick] [--window 0.5] [--rounds 3] [--no-flush] [--graph]
                              [--json FILE] [--markdown [FILE]]

For every op and shape: device time of our launch(es) and of the eager torch composition of the same
math, both timed by bench/_timing.py (each in its own >= 0.5 s window, launches queued back to back,
L2 flushed between repetitions, alternating windows for --rounds rounds; median and min-max of the
window medians; with --graph each repetition replays a CUDA graph of one call), the speed-up per
round, the bytes the op must move (keys / summaries / state / scores read, state and outputs written)
divided by that time, as a fraction of the measured device-copy bandwidth (``y.copy_(x)`` of 2 GiB:
2 x bytes / time), and the host time per call of our launcher (Python + TVM-FFI call(s), 100 calls
with the GPU kept busy; measured where the device time is under 100 µs, i.e. where the host limits).
Shapes follow issue 6: Hq 32, Hkv 8, D 128, batch 1/16/64, context 4K..128K, bf16 keys.
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

torch = None  # imported by main() (so --help runs without torch)
L = None  # cute_kernels.h2o.launch, likewise

DEV = "cuda"
HQ, HKV, D = 32, 8, 128
G = HQ // HKV


def _imports() -> None:
    global torch, L
    import torch as torch_
    from cute_kernels.h2o import launch as launch_

    torch, L = torch_, launch_


def copy_bandwidth(timer, rounds: int) -> float:
    """Bytes/s of ``y.copy_(x)`` of 2 GiB (read + write counted)."""
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    st = bench_windows({"copy": lambda x=x, y=y: y.copy_(x)}, rounds=rounds, timer=timer)["copy"]
    del x, y
    torch.cuda.empty_cache()
    return 2 * n / (st.median_ms * 1e-3)


def paged(batch, ctx, page):
    pages = ctx // page
    num_pages = batch * pages
    tables = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return num_pages, tables, seq_lens


# ------------------------------------------------------------------------------------ ops
def bench_page_scores(batch, ctx, summary_dtype=None):
    summary_dtype = summary_dtype or torch.float32
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


def plan(quick: bool) -> list:
    ops = {"page_scores": bench_page_scores, "token_accumulate": bench_token_accumulate,
           "select_pages": bench_select, "update_page_summary": bench_summary}
    out = [("page_scores", ops["page_scores"], (b, c)) for b, c in
           [(1, 4096), (1, 131072), (16, 32768), (64, 32768), (64, 131072)]]
    out += [(f"token_accumulate P{p}", ops["token_accumulate"], (b, c, p)) for p in (1, 16) for b, c in
            [(1, 4096), (1, 131072), (16, 32768), (64, 32768)]]
    out += [("select_pages", ops["select_pages"], (b, c)) for b, c in [(1, 4096), (1, 131072), (16, 32768), (64, 131072)]]
    out += [("update_page_summary", ops["update_page_summary"], (b, c)) for b, c in [(1, 4096), (64, 32768)]]
    return out[::3] if quick else out


def run(args) -> dict:
    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    info.method["host_calls"] = args.host_n
    timer = timer_from_args(args)
    copy_bw = copy_bandwidth(timer, args.rounds)
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name, fn, fargs in plan(args.quick):
        ours, composed, nbytes = fn(*fargs)
        res = bench_windows({"ours": ours, "composed": composed}, rounds=args.rounds, timer=timer)
        t = res["ours"].median_ms * 1e-3
        host = host_us_per_call(ours, n=args.host_n) if t < 1e-4 and args.host_n > 0 else None
        speed = res.ratio("composed", "ours")
        row = {"op": name, "batch": fargs[0], "context": fargs[1], "us": t * 1e6,
               "us_lo": res["ours"].lo_ms * 1e3, "us_hi": res["ours"].hi_ms * 1e3,
               "GBps": nbytes / t / 1e9, "frac_copy": nbytes / t / copy_bw,
               "composed_us": res["composed"].median_ms * 1e3, "speedup": speed.as_dict(),
               "host_us": host, "bytes": nbytes, "stats": {n: st.as_dict() for n, st in res.items()},
               "rounds": res.rounds}
        rows.append(row)
        print(f"{name:<22} B={fargs[0]:<3} ctx={fargs[1]:<7} {row['us']:9.1f} us ({row['us_lo']:.1f}-{row['us_hi']:.1f}) "
              f"{row['GBps']:7.0f} GB/s ({100 * row['frac_copy']:5.1f}% of copy)  composed {row['composed_us']:9.1f} us "
              f"x{speed.median:6.1f} ({speed.lo:.1f}-{speed.hi:.1f})  host {host or float('nan'):5.1f} us", flush=True)
        del ours, composed
        torch.cuda.empty_cache()
    info.finish()
    if timer.capture_errors:
        info.method["graph_capture_failed"] = timer.capture_errors
    return {"run": info.as_dict(), "copy_GBps": copy_bw / 1e9, "rows": rows, "_info": info}


def markdown(info: RunInfo, res: dict) -> str:
    lines = ["# H2O", "", info.markdown(), f"- device copy bandwidth {res['copy_GBps']:.0f} GB/s", "",
             "| op | B | context | us (min-max) | GB/s | % copy | composed us | speed-up (min-max) | host us |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        sp = r["speedup"]
        host = "-" if r["host_us"] is None else f"{r['host_us']:.1f}"
        lines.append(f"| {r['op']} | {r['batch']} | {r['context']} | {r['us']:.1f} ({r['us_lo']:.1f}-{r['us_hi']:.1f}) | "
                     f"{r['GBps']:.0f} | {100 * r['frac_copy']:.0f}% | {r['composed_us']:.1f} | "
                     f"{sp['median']:.1f}x ({sp['lo']:.1f}-{sp['hi']:.1f}) | {host} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every third op/shape only")
    ap.add_argument("--host-n", type=int, default=100, help="calls per host-cost measurement (0: skip)")
    add_method_args(ap)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    _imports()
    res = run(args)
    info = res.pop("_info")
    write_markdown(args.markdown, markdown(info, res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

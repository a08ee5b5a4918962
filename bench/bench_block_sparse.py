"""Benchmark of block-sparse attention forward and backward (HySparse sparse layer) on one GPU, torch tensors.

    python bench/bench_block_sparse.py [--seqlens 16K,32K] [--selections local,random] [--shapes gqa,mqa64]
                                       [--window 0.5] [--rounds 3] [--no-flush] [--graph] [--json FILE]
                                       [--markdown [FILE]] [--exact-delta]

Shapes: ``gqa`` = Hq 32 / Hkv 4, d 128 (issue 20's GQA shape), ``mqa64`` = Hq 64 / Hkv 1, d 128 (one
query per row tile), ``mla64`` / ``mla64_448`` = the absorbed-MLA latent (v=None), Hq 64 over one latent
row per key, Dk 576 / Dv 512 and Dk 512 / Dv 448 (its backward writes one combined latent gradient; no
token path at these head dims); bf16, one document, causal, 16 blocks of 64 per query shared by the heads.
Selections (torch, on the GPU): ``local`` = the diagonal block plus 15 earlier blocks shared by the
64 queries of a block (neighbouring rows pick the same blocks, as trained selections do), ``random``
= the diagonal block plus 15 earlier blocks drawn per query (the union stress case).

Timed with bench/_timing.py (own >= 0.5 s window per variant, L2 flushed between repetitions,
alternating windows for --rounds rounds; median and min-max of the window medians):

    bs_fwd            block_sparse forward kernel (plan prebuilt)
    bs_fwd_bwd        forward + dQ kernel (also writes delta = rowsum(dout * out)) + dK/dV kernel (dk/dv
                      zero-filled)
    bs_dq, bs_dkdv    the dQ kernel, the dK/dV kernel alone (the breakdown of the backward; ms only)
    bs_dkdv_L<n>      the dK/dV kernel alone with shortest segment n (``--dkdv-min-seg n,...``; Note [key block
                      segments] in cute_kernels/block_sparse/bwd_dkdv_sm90.py), to size the default (in the
                      plan's key_order, which is sorted for the default: Note [tile-ordered segments])
    bs_exact_dq, bs_exact_fwd_bwd  (``--exact-delta``) the dQ kernel, forward + backward with delta = rowsum(P dP)
                      (Note [exact delta] in cute_kernels/block_sparse/bwd_dq_sm90.py)
    idx_fwd           indexed_attention forward over blocks_to_indices of the same selection (plan prebuilt)
    idx_b2i_plan_fwd  blocks_to_indices + indexed plan + indexed forward (what the token path costs per layer)
    idx_fwd_bwd       blocks_to_indices + indexed plan + forward + dQ + dK/dV (issue 20's baseline)

TFLOPs/s count the selected pairs only: 2 * S * Hq * keys * (Dk + Dv) forward (QK^T and PV; 4 * S * Hq *
keys * D at Dk = Dv = D), x 3.5 for forward + backward,
keys = the distinct visible keys of each row (16 x 64 less the diagonal block's cut). The
block-sparse plan is built on the host by the numpy planner of tests/oracles/block_sparse.py (not
timed; production builds it with Paddle ops once per selection and reuses it across layers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import RunInfo, add_method_args, bench_windows, fmt_spread, method_from_args, timer_from_args, write_markdown  # noqa: E402

BS, TOPK = 64, 16
#: name: (Hq, Hkv, Dk, Dv, latent)
SHAPES = {"gqa": (32, 4, 128, 128, False), "mqa64": (64, 1, 128, 128, False), "mla64": (64, 1, 576, 512, True),
          "mla64_448": (64, 1, 512, 448, True)}


def parse_len(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def selection(torch, seqlen: int, kind: str, seed: int = 0):
    """int32 [1, S, 16] ids (diagonal first, then distinct earlier blocks, -1 where fewer exist) and the
    number of visible keys of each row (float64 [S])."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = -(-seqlen // BS)
    t = torch.arange(seqlen, device="cuda")
    diag = t // BS
    rows = nb if kind == "local" else seqlen
    owner = torch.arange(rows, device="cuda") if kind == "local" else diag  # block of each score row
    scores = torch.rand(rows, nb, device="cuda", generator=g)
    scores.masked_fill_(torch.arange(nb, device="cuda")[None, :] >= owner[:, None], -1.0)
    top = torch.topk(scores, TOPK - 1, dim=1)
    picks = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, -1))
    picks = picks[diag] if kind == "local" else picks
    ids = torch.cat([diag[:, None], picks], 1).int()[None].contiguous()
    keys = (picks >= 0).sum(1).double() * BS + (t % BS + 1).double()
    return ids, keys


def make_fns(torch, seqlen: int, shape: tuple, kind: str, min_segs=(), exact_delta=False, pkg="cute_kernels"):
    """The timed variants on one shape and selection; ``pkg``: the kernels' package (bench/ab_sparse.py passes
    another tree's copy)."""
    import importlib

    bl = importlib.import_module(f"{pkg}.block_sparse.launch")
    bwd_config, dkdv_workspace_shapes, fwd_config = bl.bwd_config, bl.dkdv_workspace_shapes, bl.fwd_config
    run_bwd_dkdv, run_bwd_dq, run_fwd = bl.run_bwd_dkdv, bl.run_bwd_dq, bl.run_fwd
    from tests.oracles import block_sparse as orc

    hq, hkv, dk_, dv_, latent = shape
    torch.manual_seed(0)
    q = torch.randn(1, seqlen, hq, dk_, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seqlen, hkv, dk_, device="cuda", dtype=torch.bfloat16)
    v = None if latent else torch.randn(1, seqlen, hkv, dv_, device="cuda", dtype=torch.bfloat16)
    ids, keys = selection(torch, seqlen, kind)
    cfg = fwd_config(q, k, v, per_kv_head=False, has_sink=False, latent_dv=dv_ if latent else None)
    plan = {n: torch.from_numpy(a).cuda()  # row tiles of this GPU's kernels (SM90 and SM100 differ)
            for n, a in orc.plan_arrays(ids.cpu().numpy(), BS, hq // hkv, window=cfg.window_queries).items()}
    out = torch.empty(1, seqlen, hq, dv_, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, hq, seqlen, device="cuda")
    scale = dk_ ** -0.5

    def bs_fwd():
        run_fwd(cfg, q, k, v, plan["tile_start"], plan["tile_mask"], plan["tile_count"], plan["q_limit"], None,
                out, lse, scale)

    stats = {"keys_per_row": float(keys.mean()), "tile_blocks": float(plan["tile_count"].float().mean()),
             "flops": 2.0 * seqlen * hq * float(keys.mean()) * (dk_ + dv_)}
    dout = torch.randn_like(out)
    # the latent: dk is the combined latent gradient, no v / dv (and no token path at these head dims)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), None if latent else torch.empty_like(v)
    bcfg = bwd_config(q, k, v, per_kv_head=False, latent_dv=dv_ if latent else None)

    delta = torch.empty(1, hq, seqlen, device="cuda")  # written by the dQ kernel
    shapes = dkdv_workspace_shapes(k, v, plan["key_start"])
    ws = {n: torch.empty(shape, dtype=getattr(torch, dt), device="cuda") for n, (shape, dt, _) in shapes.items()}

    def zero_and_dkdv():  # the glue's zero-filled dk / dv, then the dK/dV kernel
        dk.zero_()
        if dv is not None:
            dv.zero_()
        ws["seg_sem"].zero_()
        run_bwd_dkdv(bcfg, q, k, v, dout, lse, delta, plan["tile_mask"], plan["q_limit"], plan["key_start"],
                     plan["key_end"], plan["key_count"], plan["key_ptr"], plan["key_tile"], plan["key_slot"], dk, dv,
                     ws["dk_part"], ws.get("dv_part"), ws["seg_sem"], scale, key_order=plan["key_order"])

    def bs_fwd_bwd():
        bs_fwd()
        run_bwd_dq(bcfg, q, k, v, out, dout, lse, delta, plan["tile_start"], plan["tile_mask"], plan["tile_count"],
                   plan["q_limit"], dq, scale)
        zero_and_dkdv()

    def bs_dq():  # the two backward kernels alone (out / lse / delta of the bs_fwd_bwd run below)
        run_bwd_dq(bcfg, q, k, v, out, dout, lse, delta, plan["tile_start"], plan["tile_mask"], plan["tile_count"],
                   plan["q_limit"], dq, scale)

    def dkdv_with(min_seg):  # the dK/dV kernel alone (None: the launcher's default shortest segment)
        def fn():
            ws["seg_sem"].zero_()
            run_bwd_dkdv(bcfg, q, k, v, dout, lse, delta, plan["tile_mask"], plan["q_limit"], plan["key_start"],
                         plan["key_end"], plan["key_count"], plan["key_ptr"], plan["key_tile"], plan["key_slot"], dk,
                         dv, ws["dk_part"], ws.get("dv_part"), ws["seg_sem"], scale, min_segment_pairs=min_seg,
                         key_order=plan["key_order"])
        return fn

    fns = {"bs_fwd": bs_fwd, "bs_fwd_bwd": bs_fwd_bwd, "bs_dq": bs_dq, "bs_dkdv": dkdv_with(None)}
    if exact_delta:
        ecfg = bwd_config(q, k, v, per_kv_head=False, latent_dv=dv_ if latent else None, exact_delta=True)

        def bs_exact_dq():
            run_bwd_dq(ecfg, q, k, v, out, dout, lse, delta, plan["tile_start"], plan["tile_mask"],
                       plan["tile_count"], plan["q_limit"], dq, scale)

        def bs_exact_fwd_bwd():
            bs_fwd()
            bs_exact_dq()
            zero_and_dkdv()

        fns.update(bs_exact_dq=bs_exact_dq, bs_exact_fwd_bwd=bs_exact_fwd_bwd)
    for n in min_segs:
        fns[f"bs_dkdv_L{n}"] = dkdv_with(n)
    ic = importlib.import_module(f"{pkg}.indexed.config")
    GROUP_SIZES, window_queries = ic.GROUP_SIZES, ic.window_queries

    if hq // hkv in GROUP_SIZES:
        il = importlib.import_module(f"{pkg}.indexed.launch")
        attn_config, plan_shapes, idx_run_bwd, run_plan, idx_run_fwd = (il.attn_config, il.plan_shapes, il.run_bwd,
                                                                        il.run_plan, il.run_fwd)
        run_blocks_to_indices = importlib.import_module(f"{pkg}.select.launch").run_blocks_to_indices

        tokens = torch.empty(1, 1, seqlen, TOPK * BS, dtype=torch.int32, device="cuda")
        icfg = attn_config(q, k, per_kv_head=False)
        wq = window_queries(icfg.group)
        ip = {n: torch.empty(s, dtype=torch.int32, device="cuda")
              for n, s in plan_shapes(1, seqlen, TOPK * BS, seqlen, wq)._asdict().items()}
        out2 = torch.empty_like(q)

        def b2i_plan():
            run_blocks_to_indices(ids[:, None], tokens, block_size=BS, seqlen_k=seqlen, causal=True)
            ip["tile_bits"].zero_()
            run_plan(tokens[:, 0], seqlen, ip["win_key"], ip["win_mask"], ip["win_count"], ip["tile_bits"],
                     ip["tile_ptr"], ip["tile_win"], ip["tile_start"], window_queries=wq)

        def idx_fwd():
            idx_run_fwd(icfg, q, k, v, ip["win_key"], ip["win_mask"], ip["win_count"], out2, lse, scale)

        def idx_all():
            b2i_plan()
            idx_fwd()

        lse2 = torch.empty_like(lse)
        dq2, dk2, dv2, delta2 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)

        def idx_fwd_bwd():
            b2i_plan()
            idx_run_fwd(icfg, q, k, v, ip["win_key"], ip["win_mask"], ip["win_count"], out2, lse2, scale)
            idx_run_bwd(icfg, q, k, v, out2, dout, lse2, ip["win_key"], ip["win_mask"], ip["win_count"],
                        ip["tile_ptr"], ip["tile_win"], ip["tile_start"], dq2, dk2, dv2, delta2, scale)

        b2i_plan()
        fns.update(idx_fwd=idx_fwd, idx_b2i_plan_fwd=idx_all, idx_fwd_bwd=idx_fwd_bwd)
    return _warmed(fns, torch), stats


def _warmed(fns: dict, torch) -> dict:
    """``fns`` after one call each (compiles, and the backward variants get the forward's out / lse)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="16K,32K")
    ap.add_argument("--selections", default="local,random")
    ap.add_argument("--shapes", default="gqa,mqa64")
    ap.add_argument("--dkdv-min-seg", default="", help="also time the dK/dV kernel with these shortest segments")
    ap.add_argument("--exact-delta", action="store_true", help="also time the backward with exact_delta")
    add_method_args(ap)
    args = ap.parse_args(argv)
    import torch

    info = RunInfo(gpu=torch.cuda.get_device_name(), method=method_from_args(args))
    timer = timer_from_args(args)
    rows = []
    min_segs = [int(x) for x in args.dkdv_min_seg.split(",") if x]
    for shape in args.shapes.split(","):
        for seqlen in (parse_len(x) for x in args.seqlens.split(",")):
            for kind in args.selections.split(","):
                fns, st = make_fns(torch, seqlen, SHAPES[shape], kind, min_segs, args.exact_delta)
                res = bench_windows(fns, rounds=args.rounds, timer=timer)
                row = {"shape": shape, "S": seqlen, "selection": kind, **{k: round(v, 2) for k, v in st.items()}}
                for name, s in res.items():
                    flops = st["flops"] * (3.5 if name.endswith("bwd") else 1.0)
                    row[f"{name}_ms"] = round(s.median_ms, 4)
                    row[f"{name}_spread_ms"] = [round(s.lo_ms, 4), round(s.hi_ms, 4)]
                    row[f"{name}_tflops"] = round(flops / (s.median_ms * 1e-3) / 1e12, 1)
                for other, ours in (("idx_fwd", "bs_fwd"), ("idx_b2i_plan_fwd", "bs_fwd"), ("idx_fwd_bwd", "bs_fwd_bwd"),
                                    ("bs_exact_fwd_bwd", "bs_fwd_bwd"), ("bs_exact_dq", "bs_dq"),
                                    ("idx_fwd_bwd", "bs_exact_fwd_bwd")):
                    if other in res and ours in res:
                        r = res.ratio(other, ours)
                        row[f"speedup_{ours}_vs_{other}" if ours.startswith("bs_exact") or other.startswith("bs_exact")
                            else f"speedup_vs_{other}"] = {"median": round(r.median, 3), "lo": round(r.lo, 3),
                                                      "hi": round(r.hi, 3)}
                print(json.dumps(row), flush=True)
                rows.append(row)
                del fns
                torch.cuda.empty_cache()
    info.finish()
    head = ["shape", "S", "selection", "keys/row", "blocks/tile", "bs_fwd ms (TF/s)", "idx_fwd ms (TF/s)",
            "b2i+plan+idx_fwd ms", "speed-up vs idx_fwd", "vs b2i+plan+idx_fwd", "bs_fwd_bwd ms (TF/s)",
            "idx_fwd_bwd ms (TF/s)", "fwd+bwd speed-up", "bwd dq / dkdv kernels ms"]
    if min_segs:
        head.append("dkdv ms by shortest segment")
    lines = ["# Block-sparse attention", "", info.markdown(), "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        cell = lambda n: (f"{r[n + '_ms']:.3f} ({r[n + '_tflops']})" if n + "_ms" in r else "-")  # noqa: E731
        ratio = lambda n: (fmt_spread(r["speedup_vs_" + n]) if "speedup_vs_" + n in r else "-")  # noqa: E731
        lines.append("| " + " | ".join([r["shape"], str(r["S"]), r["selection"], f"{r['keys_per_row']:.0f}",
                                        f"{r['tile_blocks']:.1f}", cell("bs_fwd"), cell("idx_fwd"),
                                        cell("idx_b2i_plan_fwd").split(" ")[0], ratio("idx_fwd"),
                                        ratio("idx_b2i_plan_fwd"), cell("bs_fwd_bwd"), cell("idx_fwd_bwd"),
                                        ratio("idx_fwd_bwd"),
                                        f"{r.get('bs_dq_ms', '-')} / {r.get('bs_dkdv_ms', '-')}"]
                                       + ([", ".join(f"{n}: {r.get(f'bs_dkdv_L{n}_ms', '-')}" for n in min_segs)]
                                          if min_segs else [])) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": info.as_dict(), "rows": rows}, f, indent=1)
    write_markdown(args.markdown, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""How much of each visited 128 x 128 tile a FlashMask mask leaves visible (CPU, no GPU; issue 42's "why").

    python bench/flashmask_tiles.py [--seqlens 8192,32768] [--masks causal,docs,share_question,sliding_window,prefix_lm]

For the masks of bench/bench_flashmask.py (same generators, same seed) it counts, over the (query tile, key tile)
grid the kernels walk, the tiles with any visible pair (visited: the kernels compute them whole), the partial ones
among them (an element mask runs), the visited key tiles per query tile (a work tile's fixed cost -- Q load,
prologue, epilogue -- is spread over that many) and the visible pairs per visited tile. A kernel that spends a full tile's time on
every visited tile runs at (visible pairs per visited tile) / (causal's) of the causal rate on visible pairs, before
the partial tiles' mask cost: the ceiling the rate / causal column of docs/benchmarks.md is measured against.
For ``docs`` it also counts what our varlen kernel visits on the same documents (tiles start at each document).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_flashmask as BF  # noqa: E402

T = 128


def visible_rows(se: np.ndarray, causal: bool, rows: np.ndarray) -> np.ndarray:
    """[len(rows), S] bool: which keys each row sees under ``se`` ([S, n] int32 bounds, Paddle's rule)."""
    s, n = se.shape
    i = rows[:, None]
    j = np.arange(s)[None, :]
    lts = se[:, 0][None, :]
    if n == 1:
        masked = i >= lts
    elif n == 2 and causal:
        masked = (i >= lts) & (i < se[:, 1][None, :])
    elif n == 2:
        masked = (i >= lts) | (i < se[:, 1][None, :])
    else:
        masked = ((i >= lts) & (i < se[:, 1][None, :])) | ((i >= se[:, 2][None, :]) & (i < se[:, 3][None, :]))
    if causal:
        masked |= j > i
    return ~masked


def tile_stats(se: np.ndarray, causal: bool) -> dict:
    s = se.shape[0]
    nt = -(-s // T)
    visited = partial = pairs = 0
    for m in range(nt):
        rows = np.arange(m * T, min((m + 1) * T, s))
        vis = visible_rows(se, causal, rows)
        pad = np.zeros((T, nt * T), bool)
        pad[: len(rows), :s] = vis
        per = pad.reshape(T, nt, T).sum(axis=(0, 2))
        full = len(rows) * np.minimum(T, s - np.arange(nt) * T)
        visited += int((per > 0).sum())
        partial += int(((per > 0) & (per < full)).sum())
        pairs += int(per.sum())
    return dict(visited=visited, partial=partial, pairs=pairs, density=pairs / s / s,
                per_tile=pairs / max(visited, 1) / T / T, per_row=visited / nt)


def varlen_stats(docs) -> dict:
    visited = partial = pairs = 0
    for length in docs:
        t = -(-length // T)
        for m in range(t):
            r0, r1 = m * T, min((m + 1) * T, length)
            for n in range(m + 1):
                c0, c1 = n * T, min((n + 1) * T, length)
                vis = sum(max(0, min(c1, r + 1) - c0) for r in range(r0, r1))
                visited += 1
                partial += vis < (r1 - r0) * (c1 - c0)
                pairs += vis
    return dict(visited=visited, partial=partial, pairs=pairs, per_tile=pairs / visited / T / T,
                per_row=visited / sum(-(-n // T) for n in docs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="8192,32768")
    ap.add_argument("--masks", default=",".join(BF.MASKS))
    args = ap.parse_args(argv)
    print("| mask | S | density | visited tiles | partial | key tiles per query tile | visible pairs per visited tile "
          "| ceiling vs causal |")
    print("|---|---|---|---|---|---|---|---|")
    for s in (int(x) for x in args.seqlens.split(",")):
        base = None
        for kind in args.masks.split(","):
            se, causal, docs = BF.make_mask(kind, s)
            st = tile_stats(np.asarray(se)[0, 0], causal)
            if kind == "causal":
                base = st["per_tile"]
            ceil = f"{st['per_tile'] / base:.3f}" if base else "-"
            print(f"| {kind} | {s} | {st['density']:.3f} | {st['visited']} | {st['partial']} | {st['per_row']:.1f} | "
                  f"{st['per_tile']:.3f} | {ceil} |", flush=True)
            if docs is not None:
                vl = varlen_stats(docs)
                print(f"| varlen over the same documents | {s} | | {vl['visited']} | {vl['partial']} | {vl['per_row']:.1f} | "
                      f"{vl['per_tile']:.3f} | {vl['per_tile'] / base:.3f} (FlashMask visits "
                      f"{st['visited'] / vl['visited']:.3f}x its tiles) |" if base else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

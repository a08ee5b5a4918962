"""fp64 numpy oracle of paged decode attention over the gathered cache (the decode contract's semantics).

Used by tests/gpu/test_decode.py and the SM10 suite. Independent of the kernels: keys are gathered
per (sequence, kv head) by the page table (only slots below the length are read, so padding ids and
stale pages never enter), logits and masks are written out element by element in float64.
"""

from __future__ import annotations

import numpy as np


def gather(cache: np.ndarray, table, seqlens: np.ndarray, layout: str, b: int, h: int) -> np.ndarray:
    """Keys ``[L, D]`` of sequence ``b``, kv head ``h`` (``seqlens [B, Hkv]``, ``table [B, Hkv, n]``)."""
    n = int(seqlens[b, h])
    if layout == "contiguous":
        return cache[b, :n, h, :]
    p = cache.shape[2] if layout == "hnd" else cache.shape[1]
    rows = []
    for t in range(n):
        page = int(table[b, h, t // p])
        rows.append(cache[page, h, t % p] if layout == "hnd" else cache[page, t % p, h])
    return np.stack(rows) if rows else np.zeros((0, cache.shape[-1]), cache.dtype)


def decode_reference(q, k_cache, v_cache, seqlens, table, *, layout: str, scale: float, window_left: int = -1,
                     window_right: int = -1, softcap: float = 0.0, block_size: int = 0, nb: int = 0):
    """(out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]``, block_logit ``[B, Hq, Sq, nb]`` or None), float64.

    ``window_*`` -1 = unbounded (causal: right 0). Rows with no visible key: out 0, lse -inf."""
    q = np.asarray(q, np.float64)
    bsz, sq, hq, d = q.shape
    hkv = seqlens.shape[1]
    g = hq // hkv
    out = np.zeros((bsz, sq, hq, d))
    lse = np.full((bsz, hq, sq), -np.inf)
    blk = np.full((bsz, hq, sq, nb), -np.inf) if block_size else None
    for b in range(bsz):
        for h in range(hkv):
            k = gather(k_cache, table, seqlens, layout, b, h).astype(np.float64)
            v = gather(v_cache, table, seqlens, layout, b, h).astype(np.float64)
            n = k.shape[0]
            t = np.arange(n)
            for s in range(sq):
                pos = n - sq + s
                vis = np.ones(n, bool)
                if window_right >= 0:
                    vis &= t <= pos + window_right
                if window_left >= 0:
                    vis &= t >= pos - window_left
                for gi in range(g):
                    hh = h * g + gi
                    logit = scale * (k @ q[b, s, hh])
                    if softcap > 0:
                        logit = softcap * np.tanh(logit / softcap)
                    logit = np.where(vis, logit, -np.inf)
                    if block_size:
                        for j in range(min(nb, -(-n // block_size))):
                            seg = logit[j * block_size:(j + 1) * block_size]
                            blk[b, hh, s, j] = seg.max() if seg.size else -np.inf
                    if not vis.any():
                        continue
                    m = logit.max()
                    p = np.exp(logit[vis] - m)
                    tot = p.sum()
                    out[b, s, hh] = (p @ v[vis]) / tot  # invisible keys' rows never enter (NaN in them neither)
                    lse[b, hh, s] = m + np.log(tot)
    return out, lse, blk

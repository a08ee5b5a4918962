"""float64 numpy oracle of decode attention (``flash_attn_with_kvcache`` / ``sparse_decode_attention``).

Written from the contract in ``docs/api.md`` (Decode), independently of the implementation: the
cache is gathered token by token into a per-(sequence, kv head) key list, and each query row is a
plain softmax over the keys it sees, with the conditions (length, causal, window left, window
right) spelled out separately.
"""

from __future__ import annotations

import numpy as np


def gather(cache: np.ndarray, table, lens, layout: str, b: int, h: int) -> np.ndarray:
    """Keys ``0 .. L-1`` of sequence ``b``, kv head ``h``: ``[L, D]`` float64.

    ``table`` ``[B, Hkv, n]`` (None for a contiguous ``[B, Sk, Hkv, D]`` cache), ``lens [B, Hkv]``."""
    n = int(lens[b, h])
    rows = []
    for t in range(n):
        if layout == "contiguous":
            rows.append(cache[b, t, h])
            continue
        page = cache.shape[2] if layout == "hnd" else cache.shape[1]
        pid = int(table[b, h, t // page])
        rows.append(cache[pid, h, t % page] if layout == "hnd" else cache[pid, t % page, h])
    d = cache.shape[-1]
    return np.array(rows, dtype=np.float64).reshape(n, d)


def attend(q, keys, values, key_pos, q_pos, *, scale, causal, window, softcap, block_size=0, num_blocks=0):
    """One (sequence, kv head): ``q [Sq, G, D]``, ``keys [L, D]``, ``values [L, Dv]``, the position of
    each key ``key_pos [L]`` and of each query row ``q_pos [Sq]``.

    Returns ``out [Sq, G, Dv]``, ``lse [G, Sq]`` and ``block_logit [G, Sq, num_blocks]`` (block of a
    key = ``key_pos // block_size``)."""
    left, right = window
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    sq, g, _ = q.shape
    dv = values.shape[1]
    out = np.zeros((sq, g, dv))
    lse = np.full((g, sq), -np.inf)
    blk = np.full((g, sq, num_blocks), -np.inf)
    for s in range(sq):
        ok = np.ones(len(key_pos), dtype=bool)
        if causal:
            ok &= key_pos <= q_pos[s]
        if left is not None:
            ok &= key_pos >= q_pos[s] - left
        if right is not None:
            ok &= key_pos <= q_pos[s] + right
        idx = np.nonzero(ok)[0]
        if idx.size == 0:
            continue
        for j in range(g):
            logit = scale * (keys[idx] @ q[s, j])
            if softcap > 0:
                logit = softcap * np.tanh(logit / softcap)
            m = logit.max()
            w = np.exp(logit - m)
            lse[j, s] = m + np.log(w.sum())
            out[s, j] = (w / w.sum()) @ values[idx]
            if block_size:
                for t, x in zip(key_pos[idx], logit):
                    blk[j, s, t // block_size] = max(blk[j, s, t // block_size], x)
    return out, lse, blk


def decode(q, k_cache, v_cache, lens, table, layout, *, softmax_scale=None, causal=True, window=(None, None),
           softcap=0.0, block_size=0):
    """The decode contract over numpy inputs (any float dtype; computed in float64).

    ``q [B, Sq, Hq, D]``; ``lens [B, Hkv]``; ``table [B, Hkv, n]`` or None (contiguous). Returns
    ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq], block_logit [B, Hq, Sq, nb] | None)``."""
    q = np.asarray(q, dtype=np.float64)
    k_cache = np.asarray(k_cache, dtype=np.float64)
    v_cache = np.asarray(v_cache, dtype=np.float64)
    batch, sq, hq, d = q.shape
    hkv = lens.shape[1]
    g = hq // hkv
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    if layout == "contiguous":
        sk_max = k_cache.shape[1]
    else:
        sk_max = table.shape[2] * (k_cache.shape[2] if layout == "hnd" else k_cache.shape[1])
    nb = -(-sk_max // block_size) if block_size else 0
    out = np.zeros((batch, sq, hq, v_cache.shape[-1]))
    lse = np.full((batch, hq, sq), -np.inf)
    blk = np.full((batch, hq, sq, nb), -np.inf)
    for b in range(batch):
        for h in range(hkv):
            n = int(lens[b, h])
            keys = gather(k_cache, table, lens, layout, b, h)
            vals = gather(v_cache, table, lens, layout, b, h)
            o, l, bl = attend(q[b, :, h * g:(h + 1) * g], keys, vals, np.arange(n), n - sq + np.arange(sq),
                              scale=scale, causal=causal, window=window, softcap=softcap, block_size=block_size,
                              num_blocks=nb)
            out[b, :, h * g:(h + 1) * g] = o
            lse[b, h * g:(h + 1) * g] = l
            blk[b, h * g:(h + 1) * g] = bl
    return out, lse, (blk if block_size else None)

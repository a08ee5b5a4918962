"""float64 numpy oracle of ``indexed_attention`` forward and backward.

Per (batch, query, kv head): the row's key set is ``sorted(set(valid indices))`` (padding ``< 0``
or ``>= Lkv`` dropped, duplicates once); every query head of the kv group attends to that set.
The backward is the textbook softmax-attention gradient written out per row.
"""

from __future__ import annotations

import numpy as np


def key_set(row, lkv: int) -> np.ndarray:
    """Sorted distinct valid indices of one index row."""
    row = np.asarray(row).astype(np.int64)
    return np.unique(row[(row >= 0) & (row < lkv)])


def _row_indices(indices, b: int, i: int, kh: int):
    indices = np.asarray(indices)
    return indices[b, i] if indices.ndim == 3 else indices[b, kh, i]


def forward(q, k, v, indices, scale=None):
    """``(out [B, Lq, Hq, D], lse [B, Hq, Lq])`` in float64; empty rows give 0 and -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    bsz, lq, hq, _ = q.shape
    lkv, hkv, dv = v.shape[1:]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = hq // hkv
    out = np.zeros((bsz, lq, hq, dv))
    lse = np.full((bsz, hq, lq), -np.inf)
    for b in range(bsz):
        for i in range(lq):
            for kh in range(hkv):
                keys = key_set(_row_indices(indices, b, i, kh), lkv)
                if keys.size == 0:
                    continue
                heads = slice(kh * group, (kh + 1) * group)
                s = scale * q[b, i, heads] @ k[b, keys, kh].T  # [G, n]
                m = s.max(axis=1, keepdims=True)
                w = np.exp(s - m)
                lse[b, heads, i] = (m + np.log(w.sum(axis=1, keepdims=True)))[:, 0]
                out[b, i, heads] = (w / w.sum(axis=1, keepdims=True)) @ v[b, keys, kh]
    return out, lse


def backward(q, k, v, indices, dout, scale=None):
    """``(dq, dk, dv)`` in float64 for the loss ``sum(out * dout)``."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    bsz, lq, hq, _ = q.shape
    lkv, hkv, _ = k.shape[1:]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = hq // hkv
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(bsz):
        for i in range(lq):
            for kh in range(hkv):
                keys = key_set(_row_indices(indices, b, i, kh), lkv)
                if keys.size == 0:
                    continue
                heads = slice(kh * group, (kh + 1) * group)
                kk, vv, qq, do = k[b, keys, kh], v[b, keys, kh], q[b, i, heads], dout[b, i, heads]
                s = scale * qq @ kk.T
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)  # [G, n]
                o = p @ vv  # [G, Dv]
                dp = do @ vv.T  # [G, n]
                ds = p * (dp - (do * o).sum(axis=1, keepdims=True))
                dq[b, i, heads] = scale * ds @ kk
                dk[b, keys, kh] += scale * ds.T @ qq
                dv[b, keys, kh] += p.T @ do
    return dq, dk, dv

"""float64 numpy oracle of ``flash_attn_fwd`` (out, lse, block_logit).

Written from the semantics in ``docs/api.md``, per sequence and per head, with the masks spelled
out as the three separate conditions (causal, window left, window right) rather than the
"causal = right window 0" normalisation the implementation uses.
"""

from __future__ import annotations

import numpy as np


def visible(sq: int, sk: int, causal: bool = False, window=(None, None)) -> np.ndarray:
    """``[Sq, Sk]`` bool: query row ``i`` sees key ``t`` (bottom-right aligned)."""
    left, right = window
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    i = np.arange(sq)[:, None]
    t = np.arange(sk)[None, :]
    diag = i + sk - sq
    ok = np.ones((sq, sk), dtype=bool)
    if causal:
        ok &= t <= diag
    if left is not None:
        ok &= t >= diag - left
    if right is not None:
        ok &= t <= diag + right
    return ok


def _one_sequence(q, k, v, scale, causal, window, softcap, block_size, num_blocks):
    """``q [Sq, Hq, D]``, ``k [Sk, Hkv, D]``, ``v [Sk, Hkv, Dv]`` (float64)."""
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    mask = visible(sq, sk, causal, window)
    out = np.zeros((sq, hq, dv))
    lse = np.full((hq, sq), -np.inf)
    blk = np.full((hq, sq, num_blocks), -np.inf) if block_size else None
    for h in range(hq):
        kh = h // group
        s = scale * (q[:, h, :] @ k[:, kh, :].T)  # [Sq, Sk]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        for i in range(sq):
            keys = np.nonzero(mask[i])[0]
            if keys.size == 0:
                continue
            row = s[i, keys]
            m = row.max()
            w = np.exp(row - m)
            lse[h, i] = m + np.log(w.sum())
            out[i, h] = (w / w.sum()) @ v[keys, kh, :]
            if block_size:
                for t, logit in zip(keys, row):
                    j = t // block_size
                    blk[h, i, j] = max(blk[h, i, j], logit)
    return out, lse, blk


def attention(q, k, v, softmax_scale=None, causal=False, window=(None, None), softcap=0.0,
              block_size=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_k=None):
    """Oracle of ``flash_attn_fwd``; arrays of any float dtype, computed in float64.

    Returns ``(out, lse, block_logit)`` with the layouts of ``flash_attn_fwd`` (padded
    ``[B, Sq, Hq, Dv]`` / ``[B, Hq, Sq]`` / ``[B, Hq, Sq, nb]`` or varlen ``[total_q, Hq, Dv]`` /
    ``[Hq, total_q]`` / ``[Hq, total_q, nb]``); ``block_logit`` is None when ``block_size`` is 0.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    args = (scale, causal, window, softcap, block_size)
    if cu_seqlens_q is None:
        b, sq = q.shape[:2]
        sk = k.shape[1]
        nb = -(-sk // block_size) if block_size else 0
        parts = [_one_sequence(q[i], k[i], v[i], *args, nb) for i in range(b)]
        out = np.stack([p[0] for p in parts]).reshape(b, sq, q.shape[2], v.shape[-1])
        lse = np.stack([p[1] for p in parts]).reshape(b, q.shape[2], sq)
        blk = np.stack([p[2] for p in parts]).reshape(b, q.shape[2], sq, nb) if block_size else None
        return out, lse, blk
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    total_q, hq = q.shape[:2]
    nb = -(-max_seqlen_k // block_size) if block_size else 0
    out = np.zeros((total_q, hq, v.shape[-1]))
    lse = np.full((hq, total_q), -np.inf)
    blk = np.full((hq, total_q, nb), -np.inf) if block_size else None
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        o, l, bl = _one_sequence(q[q0:q1], k[k0:k1], v[k0:k1], *args, nb)
        out[q0:q1], lse[:, q0:q1] = o, l
        if block_size:
            blk[:, q0:q1] = bl
    return out, lse, blk

"""float64 numpy oracle of FlashMask attention over the expanded dense mask, and mask generators.

:func:`expand` turns ``startend_row_indices`` into a dense ``[B, Hm, Sq, Sk]`` visibility from
Paddle's definition (written per column as the four row intervals, independently of the
implementation's layout names); :func:`attention` / :func:`grads` are plain per-row softmax
attention over any dense visibility ``[B, Hq, Sq, Sk]``. The generators build the masks users
build (each returns ``(startend int32 [B, 1, Sk, n], causal, intended)`` where ``intended`` is
the dense mask written directly from the mask's description, so a test can check the encoding).
Shared by the CPU and GPU tests.
"""

from __future__ import annotations

import numpy as np

from .attention import visible as window_visible

# ----------------------------------------------------------------------------------------------
# dense expansion


def expand(startend, causal: bool, sq: int, window=(None, None)) -> np.ndarray:
    """``[B, Hm, Sq, Sk]`` bool: row ``i`` sees key ``j`` (column mask, bottom-right causal, window)."""
    se = np.asarray(startend, dtype=np.int64)
    b, hm, sk, n = se.shape
    inf = np.iinfo(np.int64).max
    if causal and n == 1:
        intervals = [(se[..., 0], np.full_like(se[..., 0], inf))]
    elif causal and n == 2:
        intervals = [(se[..., 0], se[..., 1])]
    elif not causal and n == 2:
        intervals = [(se[..., 0], np.full_like(se[..., 0], inf)), (np.zeros_like(se[..., 0]), se[..., 1])]
    elif not causal and n == 4:
        intervals = [(se[..., 0], se[..., 1]), (se[..., 2], se[..., 3])]
    else:
        raise ValueError(f"no FlashMask layout has {n} columns with causal={causal}")
    rows = np.arange(sq)[:, None]  # [Sq, 1]
    vis = np.ones((b, hm, sq, sk), dtype=bool)
    for start, end in intervals:  # [B, Hm, Sk] each
        vis &= ~((rows >= start[:, :, None, :]) & (rows < end[:, :, None, :]))
    return vis & window_visible(sq, sk, causal, window)[None, None]


def per_query_head(vis: np.ndarray, hq: int) -> np.ndarray:
    """``[B, Hm, Sq, Sk]`` -> ``[B, Hq, Sq, Sk]``: query head ``h`` reads mask head ``h // (Hq // Hm)``."""
    return np.repeat(vis, hq // vis.shape[1], axis=1)


# ----------------------------------------------------------------------------------------------
# attention over a dense visibility


def attention(q, k, v, vis, scale=None, block_size=0, bos=None):
    """``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``, ``vis [B, Hq, Sq, Sk]``.

    Returns float64 ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq], block_logit [B, Hq, Sq, nb] | None)``;
    with ``bos [B, Sq]`` key ``t`` of row ``i`` lies in block ``(t - bos_i) // block_size`` (none
    when ``t < bos_i``). Keys a row does not see are never read for it (NaN there is harmless).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv, dv = v.shape[1:]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    nb = -(-sk // block_size) if block_size else 0
    out = np.zeros((b, sq, hq, dv))
    lse = np.full((b, hq, sq), -np.inf)
    blk = np.full((b, hq, sq, nb), -np.inf) if block_size else None
    for bi in range(b):
        for h in range(hq):
            g = h // group
            for i in range(sq):
                keys = np.nonzero(vis[bi, h, i])[0]
                if keys.size == 0:
                    continue
                s = scale * (k[bi, keys, g, :] @ q[bi, i, h, :])
                m = s.max()
                w = np.exp(s - m)
                lse[bi, h, i] = m + np.log(w.sum())
                out[bi, i, h] = (w / w.sum()) @ v[bi, keys, g, :]
                if block_size:
                    origin = 0 if bos is None else int(bos[bi, i])
                    for t, logit in zip(keys, s):
                        if t >= origin:
                            j = (t - origin) // block_size
                            blk[bi, h, i, j] = max(blk[bi, h, i, j], logit)
    return out, lse, blk


def grads(q, k, v, dout, vis, scale=None):
    """Exact float64 ``(dq, dk, dv)`` of ``<dout, out>`` for :func:`attention` (per row, from the
    softmax Jacobian); rows without keys contribute nothing."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for h in range(hq):
            g = h // group
            for i in range(sq):
                keys = np.nonzero(vis[bi, h, i])[0]
                if keys.size == 0:
                    continue
                s = scale * (k[bi, keys, g, :] @ q[bi, i, h, :])
                p = np.exp(s - s.max())
                p /= p.sum()
                dp = v[bi, keys, g, :] @ dout[bi, i, h, :]
                ds = p * (dp - p @ dp)
                dq[bi, i, h] += scale * ds @ k[bi, keys, g, :]
                dk[bi, keys, g, :] += scale * np.outer(ds, q[bi, i, h, :])
                dv[bi, keys, g, :] += np.outer(p, dout[bi, i, h, :])
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# mask generators (each: startend [1, 1, S, n] int32, causal flag, intended dense [S, S] or None
# with dense=False, for lengths where an S x S matrix does not fit)


def _doc_bounds(doc_lens):
    ends = np.cumsum(doc_lens)
    return ends - np.asarray(doc_lens), ends


def causal_document(doc_lens, dense=True):
    """Packed documents, causal inside each: column j's ``LTS`` is its document's end."""
    starts, ends = _doc_bounds(doc_lens)
    s = int(ends[-1])
    doc = np.repeat(np.arange(len(doc_lens)), doc_lens)
    se = np.repeat(ends, doc_lens).reshape(1, 1, s, 1)
    if not dense:
        return se.astype(np.int32), True, None
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    return se.astype(np.int32), True, (doc[:, None] == doc[None, :]) & (j <= i)


def bidirectional_document(doc_lens, dense=True):
    """Packed documents, full attention inside each: ``[LTS, UTE] = [end, start]``."""
    starts, ends = _doc_bounds(doc_lens)
    s = int(ends[-1])
    doc = np.repeat(np.arange(len(doc_lens)), doc_lens)
    se = np.stack([np.repeat(ends, doc_lens), np.repeat(starts, doc_lens)], axis=-1).reshape(1, 1, s, 2)
    if not dense:
        return se.astype(np.int32), False, None
    return se.astype(np.int32), False, doc[:, None] == doc[None, :]


def share_question(groups, dense=True):
    """DPO / reward-model packing: ``groups = [(question_len, [answer_len, ...]), ...]``; each
    answer sees its group's question and itself (causally), never the other answers or groups.
    Causal, ``[LTS, LTE]``: question columns hidden from rows past the group, answer columns hidden
    from rows past the answer."""
    pos = 0
    spans = []  # (question span, [answer spans])
    for qlen, answers in groups:
        qs = (pos, pos + qlen)
        pos += qlen
        ans = []
        for a in answers:
            ans.append((pos, pos + a))
            pos += a
        spans.append((qs, ans))
    s = pos
    lts = np.zeros(s, dtype=np.int64)
    intended = np.zeros((s, s) if dense else (0, 0), dtype=bool)
    for (q0, q1), ans in spans:
        group_end = ans[-1][1] if ans else q1
        lts[q0:q1] = group_end
        intended[q0:group_end, q0:q1] = True
        for a0, a1 in ans:
            lts[a0:a1] = a1
            intended[a0:a1, a0:a1] = True
    se = np.stack([lts, np.full(s, s)], axis=-1).reshape(1, 1, s, 2).astype(np.int32)
    if not dense:
        return se, True, None
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    return se, True, intended & (j <= i)


def sliding_window(s, w, dense=True):
    """Causal sliding window of ``w`` past keys: ``LTS = min(j + w + 1, S)``."""
    j = np.arange(s)
    se = np.minimum(j + w + 1, s).reshape(1, 1, s, 1)
    if not dense:
        return se.astype(np.int32), True, None
    i, jj = np.arange(s)[:, None], j[None, :]
    return se.astype(np.int32), True, (jj <= i) & (i - jj <= w)


def global_sliding_window(s, g, w, dense=True):
    """Bidirectional: the first ``g`` tokens see and are seen by all; the others see keys within
    ``w`` on each side. Four columns: rows ``[j + w + 1, S)`` and ``[g, j - w)`` are masked."""
    j = np.arange(s)
    lts = np.where(j < g, s, np.minimum(j + w + 1, s))
    lte = np.full(s, s)
    uts = np.where(j < g, 0, g)
    ute = np.where(j < g, 0, np.maximum(g, j - w))
    se = np.stack([lts, lte, uts, ute], axis=-1).reshape(1, 1, s, 4)
    if not dense:
        return se.astype(np.int32), False, None
    i, jj = np.arange(s)[:, None], j[None, :]
    intended = (i < g) | (jj < g) | (np.abs(i - jj) <= w)
    return se.astype(np.int32), False, intended


def causal_blockwise(block_lens, dense=True):
    """Causal blocks that see only themselves, except the last block, which sees every block:
    ``[LTS, LTE] = [block end, last block start]``."""
    starts, ends = _doc_bounds(block_lens)
    s = int(ends[-1])
    last = int(starts[-1])
    blk = np.repeat(np.arange(len(block_lens)), block_lens)
    lts = np.repeat(ends, block_lens)
    lte = np.where(blk == len(block_lens) - 1, s, last)
    lts = np.where(blk == len(block_lens) - 1, s, lts)
    se = np.stack([lts, lte], axis=-1).reshape(1, 1, s, 2)
    if not dense:
        return se.astype(np.int32), True, None
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    intended = ((blk[:, None] == blk[None, :]) | (i >= last)) & (j <= i)
    return se.astype(np.int32), True, intended


def prefix_lm(s, prefix, dense=True):
    """One document: the first ``prefix`` tokens attend bidirectionally, the rest causally.
    ``[LTS, UTE] = [S, 0]`` on the prefix, ``[S, j]`` after it."""
    j = np.arange(s)
    se = np.stack([np.full(s, s), np.where(j < prefix, 0, j)], axis=-1).reshape(1, 1, s, 2)
    if not dense:
        return se.astype(np.int32), False, None
    i, jj = np.arange(s)[:, None], j[None, :]
    return se.astype(np.int32), False, (jj <= i) | (jj < prefix)


def prefix_lm_documents(docs, dense=True):
    """Packed prefix-LM documents ``[(length, prefix), ...]`` (four columns): column j of document
    ``[a, e)`` is hidden from rows ``[e, S)`` and from rows ``[0, a)`` (prefix) or ``[0, j)``."""
    lens = [n for n, _ in docs]
    starts, ends = _doc_bounds(lens)
    s = int(ends[-1])
    se = np.zeros((s, 4), dtype=np.int64)
    intended = np.zeros((s, s) if dense else (0, 0), dtype=bool)
    for (n, p), a, e in zip(docs, starts, ends):
        j = np.arange(a, e)
        lo = np.where(j < a + p, a, j)  # first row seeing column j
        se[a:e] = np.stack([np.full(n, e), np.full(n, s), np.zeros(n, np.int64), lo], axis=-1)
        if dense:
            for jj, first in zip(j, lo):
                intended[first:e, jj] = True
    return se.reshape(1, 1, s, 4).astype(np.int32), False, intended if dense else None


def random_eviction(s, seed=0, dense=True):
    """QK-sparse eviction: key j is seen causally until a random row ``LTS in [j + 1, S]``."""
    rng = np.random.default_rng(seed)
    j = np.arange(s)
    lts = np.array([rng.integers(x + 1, s + 1) for x in j])
    if not dense:
        return lts.reshape(1, 1, s, 1).astype(np.int32), True, None
    i, jj = np.arange(s)[:, None], j[None, :]
    return lts.reshape(1, 1, s, 1).astype(np.int32), True, (jj <= i) & (i < lts[None, :])


def random_mask(rng, b, hm, sq, sk, causal: bool, cols: int):
    """Any valid mask of the layout: bounds in ``[0, Sq]``, each interval's start <= its end."""
    lo = rng.integers(0, sq + 1, size=(b, hm, sk, 2))
    hi = rng.integers(0, sq + 1, size=(b, hm, sk, 2))
    a, z = np.minimum(lo, hi), np.maximum(lo, hi)
    if causal and cols == 1:
        se = a[..., :1]
    elif causal:  # [LTS, LTE]
        se = np.stack([a[..., 0], z[..., 0]], axis=-1)
    elif cols == 2:  # [LTS, UTE]: unordered
        se = np.stack([lo[..., 0], hi[..., 0]], axis=-1)
    else:
        se = np.stack([a[..., 0], z[..., 0], a[..., 1], z[..., 1]], axis=-1)
    return se.astype(np.int32)


def visible_pairs(startend, causal: bool, sq: int) -> int:
    """Number of visible (row, key) pairs of ``startend [B, Hm, Sk, n]`` summed over batch and mask
    heads, without building the dense mask (per column: the rows the causal cut leaves, minus those
    inside the union of the column's two masked intervals)."""
    se = np.asarray(startend, dtype=np.int64)
    b, hm, sk, n = se.shape
    j = np.arange(sk)
    lo = np.maximum(j + sq - sk, 0) if causal else np.zeros(sk, dtype=np.int64)  # first row seeing key j
    lo = np.broadcast_to(lo, se.shape[:3])

    def clip(a, z):  # the part of [a, z) inside [lo, sq)
        a2, z2 = np.clip(a, lo, sq), np.clip(z, lo, sq)
        return a2, np.maximum(z2, a2)

    big = np.full(se.shape[:3], sq, dtype=np.int64)
    zero = np.zeros(se.shape[:3], dtype=np.int64)
    if causal and n == 1:
        intervals = [(se[..., 0], big), (zero, zero)]
    elif causal:
        intervals = [(se[..., 0], se[..., 1]), (zero, zero)]
    elif n == 2:
        intervals = [(se[..., 0], big), (zero, se[..., 1])]
    else:
        intervals = [(se[..., 0], se[..., 1]), (se[..., 2], se[..., 3])]
    (a1, z1), (a2, z2) = (clip(a, z) for a, z in intervals)
    overlap = np.maximum(np.minimum(z1, z2) - np.maximum(a1, a2), 0)
    masked = (z1 - a1) + (z2 - a2) - overlap
    return int(((sq - lo) - masked).sum())

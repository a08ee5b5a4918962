"""numpy fp64 oracle of block_sparse_attention over the expanded token mask, and a numpy plan builder.

Independent of ``paddle_fa4`` (no Paddle import), so ``tests/gpu`` can use it on the H200. The rule,
written here once more on purpose (an oracle): query ``t`` of document ``[bos, eos)`` sees key ``c``
iff some id ``j >= 0`` of its row has ``bos + bs*j <= c < bos + bs*(j+1)`` and ``c < limit(t)``,
``limit = t + 1`` (causal) or ``eos``.
"""

from __future__ import annotations

import numpy as np


def doc_bounds(batch: int, seqlen: int, cu_seqlens=None):
    """int64 ``(bos, eos)`` ``[B, S]`` from ``cu_seqlens`` ``[n + 1]`` / ``[B, n + 1]`` (None: one doc)."""
    if cu_seqlens is None:
        return np.zeros((batch, seqlen), np.int64), np.full((batch, seqlen), seqlen, np.int64)
    cu = np.broadcast_to(np.asarray(cu_seqlens, np.int64).reshape(-1, np.shape(cu_seqlens)[-1]), (batch, np.shape(cu_seqlens)[-1]))
    bos = np.empty((batch, seqlen), np.int64)
    eos = np.empty((batch, seqlen), np.int64)
    for b in range(batch):
        doc = np.searchsorted(cu[b], np.arange(seqlen), side="right") - 1
        bos[b], eos[b] = cu[b][doc], cu[b][doc + 1]
    return bos, eos


def limits(batch: int, seqlen: int, causal: bool, cu_seqlens=None):
    bos, eos = doc_bounds(batch, seqlen, cu_seqlens)
    return np.broadcast_to(np.arange(seqlen) + 1, (batch, seqlen)).copy() if causal else eos


def token_mask(block_ids, block_size: int, causal: bool = True, cu_seqlens=None) -> np.ndarray:
    """bool ``[B, Hs, S, S]`` (Hs = 1 for shared ids): row t, key c visible."""
    ids = np.asarray(block_ids)
    ids4 = ids[:, None] if ids.ndim == 3 else ids
    b_, hs, s, _ = ids4.shape
    bos, _ = doc_bounds(b_, s, cu_seqlens)
    lim = limits(b_, s, causal, cu_seqlens)
    mask = np.zeros((b_, hs, s, s), bool)
    for b in range(b_):
        for h in range(hs):
            for t in range(s):
                for j in ids4[b, h, t]:
                    if j < 0:
                        continue
                    lo = bos[b, t] + block_size * j
                    hi = min(lo + block_size, lim[b, t])
                    if lo < hi:
                        mask[b, h, t, lo:hi] = True
    return mask


def _expand(mask, hq: int):
    """[B, Hs, S, S] -> [B, Hq, S, S] (shared: all heads; per kv head: its G query heads)."""
    b, hs, s, _ = mask.shape
    return np.repeat(mask, hq // hs, axis=1) if hs > 1 else np.broadcast_to(mask, (b, hq, s, s))


def attention(q, k, v, mask, scale=None, sink=None):
    """fp64 ``(out [B, S, Hq, Dv], lse [B, Hq, S], p [B, Hq, S, S])``; ``v`` None: V = k[..., :dv]
    must then be passed as ``v`` by the caller (the oracle is explicit)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, hq, dk = q.shape
    g = hq // k.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    kx, vx = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    m = _expand(mask, hq)
    logits = np.matmul(q.transpose(0, 2, 1, 3), kx.transpose(0, 2, 3, 1)) * scale  # bhij (BLAS, not einsum)
    logits = np.where(m, logits, -np.inf)
    cols = [logits]
    if sink is not None:
        cols.append(np.broadcast_to(np.asarray(sink, np.float64).reshape(1, hq, 1, 1), (b, hq, s, 1)))
    full = np.concatenate(cols, axis=-1)
    mx = full.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(np.isfinite(full), np.exp(full - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (mx + np.log(tot))[..., 0]
    p = e[..., :s] / np.where(tot > 0, tot, 1.0)
    out = np.matmul(p, vx.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # bihd
    return out, lse, p


def gradients(q, k, v, mask, dout, scale=None, sink=None, latent_dv=None):
    """fp64 ``(dq, dk, dv, dsink)``; with ``latent_dv`` (V = k[..., :latent_dv]) dk is the combined
    latent gradient and dv None."""
    q, k, dout = (np.asarray(x, np.float64) for x in (q, k, dout))
    v = k[..., :latent_dv] if latent_dv is not None else np.asarray(v, np.float64)
    b, s, hq, dk = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = dk ** -0.5 if scale is None else scale
    out, lse, p = attention(q, k, v, mask, scale, sink)
    kx, vx = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    dp = np.einsum("bihd,bjhd->bhij", dout, vx)
    delta = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
    ds = p * (dp - delta)
    dq = np.einsum("bhij,bjhd->bihd", ds, kx) * scale
    dkx = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    dvx = np.einsum("bhij,bihd->bjhd", p, dout)
    dk_ = dkx.reshape(b, s, hkv, g, dk).sum(3)
    dv_ = dvx.reshape(b, s, hkv, g, -1).sum(3)
    dsink = None
    if sink is not None:
        p_sink = np.where(np.isfinite(lse), np.exp(np.asarray(sink, np.float64).reshape(1, hq, 1) - lse), 0.0)
        dsink = -(p_sink * delta[..., 0]).sum(axis=(0, 2))
    if latent_dv is not None:
        dk_[..., :latent_dv] += dv_
        return dq, dk_, None, dsink
    return dq, dk_, dv_, dsink


# ---------------------------------------------------------------------------------------------
# plan (same layout as paddle_fa4._plan.block_sparse.BlockSparsePlan)


def tile_queries(group: int) -> int:
    return min(64 // min(group, 64), 32)


def plan_arrays(block_ids, block_size: int, group: int, causal: bool = True, cu_seqlens=None,
                keys: bool = True, window: int | None = None) -> dict:
    """int32 numpy plan tensors: tile_start / tile_mask / tile_count / q_limit / key_start / key_end /
    key_count / key_ptr / key_tile / key_slot (entries past counts: -1 or 0), for row tiles of ``window``
    queries (default the SM90 kernels', ``tile_queries``; the SM100 kernels': their config's
    ``window_queries``). ``keys=False`` leaves
    the key-major transpose (the backward's) unfilled: the forward needs the first four only."""
    ids = np.asarray(block_ids, np.int64)
    b_, s, topk = ids.shape[0], ids.shape[-2], ids.shape[-1]
    per_kv = ids.ndim == 4
    hs = ids.shape[1] if per_kv else 1
    ns = b_ * hs
    wq = tile_queries(group) if window is None else int(window)
    nqt = -(-s // wq)
    cap = max(wq * topk, 1)
    ndoc = 1 if cu_seqlens is None else np.shape(cu_seqlens)[-1] - 1
    kcap = -(-s // block_size) + ndoc
    bos, eos = doc_bounds(b_, s, cu_seqlens)
    lim = limits(b_, s, causal, cu_seqlens)
    ids4 = (ids if per_kv else ids[:, None]).reshape(ns, s, topk)
    set_b = np.repeat(np.arange(b_), hs)
    start = bos[set_b][:, :, None] + ids4 * block_size
    live = (ids4 >= 0) & (start < lim[set_b][:, :, None])
    out = dict(tile_start=np.zeros((ns, nqt, cap), np.int32), tile_mask=np.zeros((ns, nqt, cap), np.int32),
               tile_count=np.zeros((ns, nqt), np.int32), q_limit=lim.astype(np.int32),
               key_start=np.full((ns, kcap), -1, np.int32), key_end=np.full((ns, kcap), -1, np.int32),
               key_count=np.zeros((ns,), np.int32), key_ptr=np.zeros((ns * kcap + 1,), np.int32),
               key_tile=np.full((max(ns * nqt * cap, 1),), -1, np.int32),
               key_slot=np.full((max(ns * nqt * cap, 1),), -1, np.int32))
    sidx, t, _ = np.nonzero(live)
    st = start[live]
    w, bit = t // wq, t % wq
    key = (sidx * nqt + w) * s + st
    order = np.lexsort((bit, key))
    key, bit, sidx, w, st = key[order], bit[order], sidx[order], w[order], st[order]
    uniq, first = np.unique(key, return_index=True)
    masks = np.bitwise_or.reduceat(np.left_shift(np.int64(1), bit), first) if len(first) else np.zeros(0, np.int64)
    us, uw, ust = sidx[first], w[first], st[first]
    tile = us * nqt + uw
    pos = np.arange(len(uniq)) - np.searchsorted(tile, tile, side="left")
    out["tile_start"][us, uw, pos] = ust
    out["tile_mask"][us, uw, pos] = (masks & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    np.add.at(out["tile_count"], (us, uw), 1)
    if not keys:
        return out
    rows = []
    for si in range(ns):
        sel = us == si
        kst = np.unique(ust[sel])
        out["key_count"][si] = len(kst)
        out["key_start"][si, :len(kst)] = kst
        out["key_end"][si, :len(kst)] = np.minimum(kst + block_size, eos[set_b[si], kst])
        for r, k0 in enumerate(kst):
            m = sel & (ust == k0)
            rows.append((si * kcap + r, uw[m], pos[m]))  # uw ascending already (sorted keys)
    counts = np.zeros(ns * kcap, np.int64)
    n = 0
    for row, ws, ps in sorted(rows, key=lambda x: x[0]):
        order = np.argsort(ws, kind="stable")
        out["key_tile"][n:n + len(ws)] = ws[order]
        out["key_slot"][n:n + len(ws)] = ps[order]
        counts[row] = len(ws)
        n += len(ws)
    out["key_ptr"][1:] = np.cumsum(counts)
    out["key_order"] = key_order(out["key_ptr"], out["key_tile"], ns, kcap)
    return out


def key_order(key_ptr, key_tile, ns: int, kcap: int, min_seg: int | None = None):
    """The dK/dV CTA order (Note [tile-ordered segments] in cute_kernels/block_sparse/bwd_dkdv_sm90.py), written
    out segment by segment: per set, the ids ``r * SEGMENTS + k`` of the live segments by (first query tile,
    id), then the other ids ascending. ``min_seg``: the segmentation (default the planner's)."""
    from cute_kernels.block_sparse.config import ORDERED_MIN_SEGMENT_PAIRS, SEGMENTS, segment_split

    min_seg = ORDERED_MIN_SEGMENT_PAIRS if min_seg is None else min_seg
    order = np.zeros((ns, kcap * SEGMENTS), np.int32)
    for si in range(ns):
        live, dead = [], []
        for r in range(kcap):
            p0, p1 = int(key_ptr[si * kcap + r]), int(key_ptr[si * kcap + r + 1])
            seg_len, nseg = segment_split(p1 - p0, min_seg)
            for k in range(SEGMENTS):
                x = r * SEGMENTS + k
                (live.append((int(key_tile[p0 + k * seg_len]), x)) if k < nseg else dead.append(x))
        order[si] = [x for _, x in sorted(live)] + dead
    return order


def random_ids(rng, batch: int, seqlen: int, topk: int, block_size: int, causal: bool = True, cu_seqlens=None,
               heads: int | None = None, pad: float = 0.2, dup: float = 0.1, diagonal: bool = True):
    """int32 document-relative ids (``[B, S, topk]``, or ``[B, heads, S, topk]``): random live blocks
    (the diagonal one first when ``diagonal``), ``pad`` of the slots -1, ``dup`` of them repeats."""
    bos, eos = doc_bounds(batch, seqlen, cu_seqlens)
    lead = (batch,) if heads is None else (batch, heads)
    ids = np.full(lead + (seqlen, topk), -1, np.int64)
    for idx in np.ndindex(*lead):
        b = idx[0]
        for t in range(seqlen):
            last = (t - bos[b, t]) // block_size if causal else (eos[b, t] - 1 - bos[b, t]) // block_size
            row = rng.integers(0, last + 1, size=topk)
            if diagonal:
                row[0] = (t - bos[b, t]) // block_size
            row = np.where(rng.random(topk) < pad, -1, row)
            rep = rng.random(topk) < dup
            row[1:] = np.where(rep[1:], row[:-1], row[1:])
            ids[idx + (t,)] = row
    return ids.astype(np.int32)

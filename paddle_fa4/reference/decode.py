"""Reference (pure Paddle, float32) paged / split-KV decode attention. Semantics: ``docs/api.md`` (Decode).

The same call as the CuTe glue (``paddle_fa4._cute.decode.decode_fwd``), on validated inputs in the
forms the public ops hand both backends: ``seqlens`` int32 ``[B]`` with ``table`` int32 ``[B, n]``
(dense: shared by every kv head of the sequence) or ``[B, Hkv]`` with ``[B, Hkv, n]`` (a sparse
per-kv-head table); ``table`` is None for a contiguous cache.

Works on any place without a device sync: every mask is a tensor op. Keys are processed in chunks
of at most :data:`TILE_BYTES` of float32 scores with an online softmax (the split over keys has
no meaning here; ``num_splits`` is validated by the public op and ignored). Only the listed pages
are gathered, and the K and V rows of every key that no query row of its (sequence, kv head) can
see -- past the length, on a padding / out-of-range page id, outside every row's causal or window
range -- are replaced by zeros before any arithmetic, so NaN or Inf left in recycled pages never
reaches an output (a masked score alone would not do: ``0 * NaN = NaN`` in ``P @ V``).
"""

from __future__ import annotations

import math

import paddle

#: Upper bound on one float32 score chunk ``[B, Hkv, G * Sq, T]`` (a few live at once).
TILE_BYTES = 32 << 20
_NEG_INF = -math.inf


def decode_fwd(q, k_cache, v_cache, seqlens, table, *, layout, softmax_scale, causal, window_left,
               window_right, softcap, num_splits, return_lse, block_logit_size):
    """``(out, lse | None, block_logit | None)`` of a validated decode call.

    Args:
        q (Tensor): ``[B, Sq, Hq, D]``.
        k_cache, v_cache (Tensor): ``layout`` ``"hnd"`` ``[pages, Hkv, P, D]``, ``"nhd"``
            ``[pages, P, Hkv, D]`` or ``"contiguous"`` ``[B, Sk, Hkv, D]`` (v: ``Dv`` last).
        seqlens (Tensor): int32 ``[B, Hkv]`` keys per (sequence, kv head), or ``[B]`` per sequence.
        table (Tensor | None): int32 ``[B, Hkv, n]`` page ids, or ``[B, n]`` with ``[B]`` lengths
            (None for ``"contiguous"``).
        window_left, window_right (int): ``-1`` = unbounded; causal calls have ``window_right == 0``.
        block_logit_size (int | None): key-block size of ``block_logit``; None = not computed.

    Returns:
        tuple: ``out [B, Sq, Hq, Dv]`` (q's dtype), ``lse`` float32 ``[B, Hq, Sq]`` when
        ``return_lse`` (else None), ``block_logit`` float32 ``[B, Hq, Sq, ceil(Sk_max / bs)]``
        when ``block_logit_size`` (else None).
    """
    del num_splits, causal  # causal is window_right == 0 here; the reference never splits
    with paddle.no_grad():
        return _decode(q, k_cache, v_cache, seqlens, table, layout, float(softmax_scale), int(window_left),
                       int(window_right), float(softcap), bool(return_lse), block_logit_size)


def _geometry(layout, k_cache, table):
    """``(num_rows_of_cache, P, Sk_max)``; P is 0 for a contiguous cache."""
    if layout == "contiguous":
        return k_cache.shape[1], 0, k_cache.shape[1]
    page = k_cache.shape[2] if layout == "hnd" else k_cache.shape[1]
    return k_cache.shape[0], page, table.shape[2] * page


def _row_index(layout, t, ids, batch, hkv, rows_per_seq, page):
    """Flat row of key ``t`` in ``cache.reshape([-1, D])`` per (b, h): ``[B, Hkv, T]`` int64."""
    h = paddle.arange(hkv, dtype="int64", device=t.place).reshape([1, hkv, 1])
    if layout == "contiguous":
        b = paddle.arange(batch, dtype="int64", device=t.place).reshape([batch, 1, 1])
        return (b * rows_per_seq + t.reshape([1, 1, -1])) * hkv + h
    off = (t % page).reshape([1, 1, -1])
    if layout == "hnd":  # [pages, Hkv, P, D]
        return (ids * hkv + h) * page + off
    return (ids * page + off) * hkv + h  # "nhd": [pages, P, Hkv, D]


def _decode(q, k_cache, v_cache, seqlens, table, layout, scale, left, right, softcap, return_lse, bl_size):
    batch, sq, hq, d = q.shape
    hkv = k_cache.shape[1] if layout == "hnd" else k_cache.shape[2]
    if seqlens.ndim == 1:  # dense: every kv head of a sequence reads its length (and page list)
        seqlens = seqlens.reshape([batch, 1]).expand([batch, hkv])
        if table is not None:
            table = table.reshape([batch, 1, table.shape[1]]).expand([batch, hkv, table.shape[1]])
    group = hq // hkv
    dv = v_cache.shape[-1]
    place = q.place
    cache_units, page, sk_max = _geometry(layout, k_cache, table)
    nb = -(-sk_max // bl_size) if bl_size else 0

    rows = group * sq
    qf = (q.astype("float32").reshape([batch, sq, hkv, group, d]).transpose([0, 2, 3, 1, 4])
          .reshape([batch, hkv, rows, d]))  # row r = g * Sq + s
    lens = seqlens.astype("int64").reshape([batch, hkv, 1, 1])
    qpos = lens - sq + paddle.arange(sq, dtype="int64", device=place).reshape([1, 1, sq, 1])  # [B, Hkv, Sq, 1]

    m = paddle.full([batch, hkv, rows], _NEG_INF, dtype="float32", device=place)
    lsum = paddle.zeros([batch, hkv, rows], dtype="float32", device=place)
    acc = paddle.zeros([batch, hkv, rows, dv], dtype="float32", device=place)
    blocks = []

    if batch > 0 and sk_max > 0 and cache_units > 0:
        k_rows = k_cache.reshape([-1, d])
        v_rows = v_cache.reshape([-1, dv])
        align = bl_size or 1
        per_key = 4 * max(batch * hkv, 1) * (rows + d + dv + 2 * sq)
        chunk = max(align, (TILE_BYTES // per_key) // align * align)
        for t0 in range(0, sk_max, chunk):
            t1 = min(sk_max, t0 + chunk)
            t = paddle.arange(t0, t1, dtype="int64", device=place)
            exists = t.reshape([1, 1, -1]) < lens.reshape([batch, hkv, 1])  # [B, Hkv, T]
            ids = None
            if layout != "contiguous":
                slot = (t // page).reshape([1, 1, -1]).expand([batch, hkv, t1 - t0])
                ids = paddle.take_along_axis(table.astype("int64"), slot, axis=2)
                exists = exists & (ids >= 0) & (ids < cache_units)
                ids = paddle.where(exists, ids, paddle.zeros_like(ids))
            tt = t.reshape([1, 1, 1, -1])
            visible = exists.unsqueeze(2)  # [B, Hkv, Sq, T]
            if left >= 0:
                visible = visible & (tt >= qpos - left)
            if right >= 0:
                visible = visible & (tt <= qpos + right)
            seen = visible.any(axis=2)  # [B, Hkv, T]: some row of the kv head sees the key
            idx = _row_index(layout, t, ids, batch, hkv, k_cache.shape[1], page)
            idx = paddle.where(seen, idx, paddle.zeros_like(idx)).reshape([-1])
            kk = _gather_rows(k_rows, idx).astype("float32").reshape([batch, hkv, t1 - t0, d])
            vv = _gather_rows(v_rows, idx).astype("float32").reshape([batch, hkv, t1 - t0, dv])
            keep = seen.unsqueeze(-1)
            kk = paddle.where(keep, kk, paddle.zeros_like(kk))  # garbage never enters the arithmetic
            vv = paddle.where(keep, vv, paddle.zeros_like(vv))
            s = paddle.matmul(qf, kk, transpose_y=True) * scale  # [B, Hkv, rows, T]
            if softcap > 0:
                s = paddle.tanh(s / softcap) * softcap
            vis = visible.unsqueeze(2).expand([batch, hkv, group, sq, t1 - t0]).reshape([batch, hkv, rows, -1])
            s = paddle.where(vis, s, paddle.full_like(s, _NEG_INF))
            if bl_size:
                blocks.append(_block_max(s, bl_size))
            m_new = paddle.maximum(m, s.max(axis=-1))
            base = paddle.where(paddle.isinf(m_new), paddle.zeros_like(m_new), m_new)
            # exp(-inf) is not exactly 0 in Paddle's CPU exp (about 1e-38): zero masked entries explicitly
            p = paddle.where(vis, paddle.exp(s - base.unsqueeze(-1)), paddle.zeros_like(s))
            alpha = paddle.where(paddle.isinf(m), paddle.zeros_like(m), paddle.exp(m - base))
            lsum = lsum * alpha + p.sum(axis=-1)
            acc = acc * alpha.unsqueeze(-1) + paddle.matmul(p, vv)
            m = m_new

    live = lsum > 0
    safe = paddle.where(live, lsum, paddle.ones_like(lsum))
    o = paddle.where(live.unsqueeze(-1), acc / safe.unsqueeze(-1), paddle.zeros_like(acc))
    out = (o.reshape([batch, hkv, group, sq, dv]).transpose([0, 3, 1, 2, 4]).reshape([batch, sq, hq, dv])
           .astype(q.dtype))
    lse = None
    if return_lse:
        lse = paddle.where(live, m + paddle.log(safe), paddle.full_like(m, _NEG_INF)).reshape([batch, hq, sq])
    block_logit = None
    if bl_size:
        if blocks:
            bl = paddle.concat(blocks, axis=-1)
        else:
            bl = paddle.full([batch, hkv, rows, nb], _NEG_INF, dtype="float32", device=place)
        block_logit = bl.reshape([batch, hq, sq, nb])
    return out, lse, block_logit


def _gather_rows(rows, idx):
    """``rows[idx]``; float16 through its bits (CPU Paddle has no float16 gather kernel)."""
    if rows.dtype == paddle.float16:
        return paddle.view(paddle.gather(paddle.view(rows, "int16"), idx), "float16")
    return paddle.gather(rows, idx)


def _block_max(s, bs):
    """Max over each ``bs`` keys of a chunk that starts on a block boundary (padded with -inf)."""
    width = s.shape[-1]
    nblk = -(-width // bs)
    if nblk * bs != width:
        pad = paddle.full(list(s.shape[:-1]) + [nblk * bs - width], _NEG_INF, dtype="float32", device=s.place)
        s = paddle.concat([s, pad], axis=-1)
    return s.reshape(list(s.shape[:-1]) + [nblk, bs]).max(axis=-1)

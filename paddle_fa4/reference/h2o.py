"""Reference (pure Paddle, fp32) H2O ops, CPU or GPU place. Semantics: ``paddle_fa4.h2o`` docstrings.

Memory stays bounded for long contexts: page scores and token logits are computed in chunks of
``PAGE_CHUNK`` logical pages / ``TOKEN_CHUNK`` tokens per request; state updates are flat
gathers/scatters.
"""

from __future__ import annotations

import paddle

PAGE_CHUNK = 1024
TOKEN_CHUNK = 16384


def reset_scores(state, slot_mapping) -> None:
    num_pages, hkv, page_size = state.shape
    slots = slot_mapping.astype("int64")
    valid = (slots >= 0) & (slots < num_pages * page_size)
    slots = paddle.masked_select(slots, valid)
    if slots.shape[0] == 0:
        return
    # scatter in fp32 (Paddle's CPU scatter has no bf16 kernel); zero and fp32 values round-trip exactly
    flat = state.astype("float32").transpose([0, 2, 1]).reshape([num_pages * page_size, hkv])
    zeros = paddle.zeros([slots.shape[0], hkv], dtype="float32")
    flat = paddle.scatter(flat, slots, zeros, overwrite=True)
    paddle.assign(flat.reshape([num_pages, page_size, hkv]).transpose([0, 2, 1]).astype(state.dtype), state)


def update_page_summary(key_cache, slot_mapping, summary) -> None:
    num_pages, hkv, page_size, d = key_cache.shape
    slots = slot_mapping.astype("int64")
    n = slots.shape[0]
    nxt = paddle.concat([slots[1:], paddle.full([1], -2, dtype="int64")]) if n > 1 else paddle.full([1], -2, "int64")
    page = paddle.floor_divide(slots, paddle.full_like(slots, page_size))
    off = slots - page * page_size
    valid = (slots >= 0) & (slots < num_pages * page_size)
    continues = (nxt == slots + 1) & (off + 1 < page_size)
    ends = valid & ~continues
    page = paddle.masked_select(page, ends)
    off = paddle.masked_select(off, ends)
    if page.shape[0] == 0:
        return
    keys = paddle.gather(key_cache, page, axis=0).astype("float32")  # [M, Hkv, P, D]
    present = paddle.arange(page_size, dtype="int64").reshape([1, 1, page_size, 1]) <= off.reshape([-1, 1, 1, 1])
    count = (off + 1).astype("float32").reshape([-1, 1, 1])
    zero = paddle.zeros_like(keys)
    mean = paddle.where(present, keys, zero).sum(axis=2) / count
    big = paddle.full_like(keys, float("inf"))
    kmax = paddle.where(present, keys, -big).max(axis=2)
    kmin = paddle.where(present, keys, big).min(axis=2)
    vals = paddle.stack([mean, kmax, kmin], axis=2).astype(summary.dtype).astype("float32")  # [M, Hkv, 3, D]
    merged = paddle.scatter(summary.astype("float32"), page, vals, overwrite=True)
    paddle.assign(merged.astype(summary.dtype), summary)


def _group_queries(q, hkv: int):
    """q [B, Hq, D] -> fp32 [B, Hkv, G, D]."""
    b, hq, d = q.shape
    return q.astype("float32").reshape([b, hkv, hq // hkv, d])


def _safe_pages(tables, num_pages: int):
    """(clamped int64 ids for gathers, validity mask) of a block-table slice."""
    ids = tables.astype("int64")
    ok = (ids >= 0) & (ids < num_pages)
    return paddle.where(ok, ids, paddle.zeros_like(ids)), ok


def page_scores(q, summary, block_tables, seq_lens, page_size, w_avg, w_peak, gqa_reduce):
    num_pages, hkv, _, d = summary.shape
    batch, max_pages = block_tables.shape
    qg = _group_queries(q, hkv)  # [B, Hkv, G, D]
    if gqa_reduce == "mean_q":
        qg = qg.mean(axis=2, keepdim=True)  # [B, Hkv, 1, D]
    n_pages = (seq_lens.astype("int64") + page_size - 1) // page_size  # [B]
    parts = []
    for j0 in range(0, max_pages, PAGE_CHUNK):
        j1 = min(j0 + PAGE_CHUNK, max_pages)
        ids, ok = _safe_pages(block_tables[:, j0:j1], num_pages)  # [B, C]
        s = paddle.gather(summary, ids.reshape([-1]), axis=0).astype("float32")
        s = s.reshape([batch, j1 - j0, hkv, 3, d]).transpose([0, 2, 1, 3, 4])  # [B, Hkv, C, 3, D]
        qx = qg.unsqueeze(3)  # [B, Hkv, R, 1, D]
        mu, mx, mn = (s[:, :, :, i].unsqueeze(2) for i in range(3))  # [B, Hkv, 1, C, D]
        avg = (qx * mu).sum(-1).max(axis=2)  # [B, Hkv, C]; max over R (R = 1 for mean_q)
        peak = paddle.maximum(qx * mx, qx * mn).sum(-1).max(axis=2)
        score = w_avg * avg + w_peak * peak
        j = paddle.arange(j0, j1, dtype="int64").reshape([1, -1])
        valid = (ok & (j < n_pages.reshape([-1, 1]))).unsqueeze(1)  # [B, 1, C]
        parts.append(paddle.where(valid, score, paddle.full_like(score, float("-inf"))))
    return paddle.concat(parts, axis=2)


def token_accumulate(q, key_cache, state, block_tables, seq_lens, scale, decay, gqa_reduce, bos, eos) -> None:
    num_pages, hkv, page_size, d = key_cache.shape
    batch, max_pages = block_tables.shape
    qg = _group_queries(q, hkv)  # [B, Hkv, G, D]
    group = qg.shape[2]
    if gqa_reduce == "mean_q":
        qg = qg.mean(axis=2, keepdim=True)
    qg = qg * scale
    lens = seq_lens.numpy().tolist()  # host values: the reference may sync
    flat = state.reshape([-1]).astype("float32")
    key_rows = key_cache.reshape([num_pages * hkv * page_size, d])  # row (page * Hkv + g) * P + off
    heads = paddle.arange(hkv, dtype="int64").reshape([hkv, 1])
    for b in range(batch):
        t_start, t_end = bos, min(int(lens[b]) - eos, max_pages * page_size)
        if t_end <= t_start:
            continue
        logits, index, okays = [], [], []
        for c0 in range(t_start, t_end, TOKEN_CHUNK):
            c1 = min(c0 + TOKEN_CHUNK, t_end)
            tok = paddle.arange(c0, c1, dtype="int64")
            lp = tok // page_size
            ids, ok = _safe_pages(paddle.gather(block_tables[b], lp), num_pages)  # [T]
            rows = (ids.reshape([1, -1]) * hkv + heads) * page_size + (tok - lp * page_size).reshape([1, -1])
            keys = paddle.gather(key_rows, rows.reshape([-1])).reshape([hkv, c1 - c0, d]).astype("float32")
            logits.append(paddle.einsum("hrd,htd->hrt", qg[b], keys))  # [Hkv, R, T]
            index.append(rows)  # the state [num_pages, Hkv, P] has the same flat index
            okays.append(ok)
        logit = paddle.concat(logits, axis=2)
        ok = paddle.concat(okays)
        logit = paddle.where(ok.reshape([1, 1, -1]), logit, paddle.full_like(logit, float("-inf")))
        if not bool(ok.any()):
            continue
        probs = paddle.nn.functional.softmax(logit, axis=-1)  # [Hkv, R, W], one softmax per row
        if gqa_reduce == "max":
            p = probs.max(axis=1)
        elif gqa_reduce == "sum":
            p = probs.sum(axis=1)
        elif gqa_reduce == "mean_p":
            p = probs.sum(axis=1) / group
        else:
            p = probs[:, 0]
        idx = paddle.concat(index, axis=1)  # [Hkv, W]
        idx = paddle.masked_select(idx, ok.reshape([1, -1]).expand([hkv, ok.shape[0]]))
        p = paddle.masked_select(p, ok.reshape([1, -1]).expand([hkv, ok.shape[0]]))
        new = p + decay * paddle.gather(flat, idx)
        if state.dtype != paddle.float32:
            new = new.astype(state.dtype).astype("float32")  # round on store, as the kernel
        flat = paddle.scatter(flat, idx, new, overwrite=True)
    paddle.assign(flat.reshape(state.shape).astype(state.dtype), state)


def token_page_scores(state, block_tables, seq_lens):
    num_pages, hkv, page_size = state.shape
    batch, max_pages = block_tables.shape
    n = seq_lens.astype("int64").reshape([-1, 1, 1])
    parts = []
    for j0 in range(0, max_pages, PAGE_CHUNK):
        j1 = min(j0 + PAGE_CHUNK, max_pages)
        ids, ok = _safe_pages(block_tables[:, j0:j1], num_pages)
        st = paddle.gather(state, ids.reshape([-1]), axis=0).astype("float32")
        st = st.reshape([batch, j1 - j0, hkv, page_size]).transpose([0, 2, 1, 3])  # [B, Hkv, C, P]
        tok = (paddle.arange(j0, j1, dtype="int64").reshape([1, -1, 1]) * page_size
               + paddle.arange(page_size, dtype="int64").reshape([1, 1, -1]))  # [1, C, P]
        present = (tok < n).unsqueeze(1)  # [B, 1, C, P]
        s = paddle.where(present, st, paddle.zeros_like(st)).sum(-1)  # [B, Hkv, C]
        j = paddle.arange(j0, j1, dtype="int64").reshape([1, -1])
        valid = (ok & (j * page_size < n.reshape([-1, 1]))).unsqueeze(1)
        parts.append(paddle.where(valid, s, paddle.full_like(s, float("-inf"))))
    return paddle.concat(parts, axis=2)


def select_pages(scores, block_tables, seq_lens, page_size, topk, bos, eos):
    batch, hkv, max_pages = scores.shape
    budget = bos + topk + eos
    lens = seq_lens.numpy().tolist()
    rows, out_lens = [], []
    for b in range(batch):
        n = int(lens[b])
        n_pages = -(-n // page_size)
        if n_pages <= budget:
            logical = paddle.arange(n_pages, dtype="int64").reshape([1, -1]).expand([hkv, n_pages])
        else:
            mid = scores[b, :, bos:n_pages - eos]  # [Hkv, W]
            mid = paddle.where(mid == 0, paddle.zeros_like(mid), mid)  # -0.0 ties +0.0
            # NaN rule: a NaN page ranks below every number (-inf included), ties in page order.
            # Stable sorts: by score (NaN as -inf), then NaN last keeping that order.
            nan = paddle.isnan(mid)
            order = paddle.argsort(paddle.where(nan, paddle.full_like(mid, float("-inf")), mid), axis=-1,
                                   descending=True, stable=True)
            nan_last = paddle.argsort(paddle.take_along_axis(nan.astype("int32"), order, axis=-1), axis=-1,
                                      stable=True)
            order = paddle.take_along_axis(order, nan_last, axis=-1)[:, :topk]
            picked = paddle.sort(order, axis=-1) + bos
            head = paddle.arange(bos, dtype="int64").reshape([1, -1]).expand([hkv, bos])
            tail = paddle.arange(n_pages - eos, n_pages, dtype="int64").reshape([1, -1]).expand([hkv, eos])
            logical = paddle.concat([head, picked, tail], axis=1)
        count = logical.shape[1]
        phys = paddle.gather(block_tables[b].astype("int64"), logical.reshape([-1])).reshape([hkv, count])
        if count < budget:
            phys = paddle.concat([phys, paddle.full([hkv, budget - count], -1, dtype="int64")], axis=1)
        rows.append(phys)
        # tokens of the selected pages: all full but the request's real last page, when selected (always
        # when n_pages <= budget or eos >= 1; with eos = 0 only if the top-k picks it)
        empty_slots = n_pages * page_size - n
        has_last = (logical == n_pages - 1).any(axis=1) if count > 0 else paddle.zeros([hkv], dtype="bool")
        covered = count * page_size - paddle.where(has_last, paddle.full([hkv], empty_slots, dtype="int64"),
                                                   paddle.zeros([hkv], dtype="int64"))
        out_lens.append(covered.astype("int64"))
    return (paddle.stack(rows).astype("int32"), paddle.stack(out_lens).astype("int32"))

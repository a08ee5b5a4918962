"""fp64 numpy oracles of the H2O ops (independent of paddle_fa4.reference; plain loops over rows).

Layouts as ``paddle_fa4.h2o``: key_cache [num_pages, Hkv, P, D], block_tables [B, max_pages],
seq_lens [B] (tokens), q [B, Hq, D], token state [num_pages, Hkv, P], summary [num_pages, Hkv, 3, D].
Every function takes numpy arrays (any float dtype) and returns new fp64 arrays (ids as int64).
"""

from __future__ import annotations

import numpy as np


def bf16_round(x) -> np.ndarray:
    """Round fp32/fp64 values to the nearest bfloat16 (ties to even), returned as fp64."""
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isfinite(f), out, f.astype(np.float64))


def softmax(x, axis=0):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def reset_scores(state, slot_mapping):
    out = np.array(state, dtype=np.float64)
    num_pages, _, page_size = out.shape
    for s in np.asarray(slot_mapping).tolist():
        if 0 <= s < num_pages * page_size:
            out[s // page_size, :, s % page_size] = 0.0
    return out


def update_page_summary(key_cache, slot_mapping, summary):
    """Recompute (mean, max, min) over offsets 0..off of each page whose write run ends at ``off``."""
    key = np.asarray(key_cache, dtype=np.float64)
    out = np.array(summary, dtype=np.float64)
    num_pages, _, page_size, _ = key.shape
    slots = np.asarray(slot_mapping).tolist()
    for i, s in enumerate(slots):
        if not 0 <= s < num_pages * page_size:
            continue
        page, off = divmod(s, page_size)
        if i + 1 < len(slots) and slots[i + 1] == s + 1 and off + 1 < page_size:
            continue  # not the end of this page's run of writes
        k = key[page, :, : off + 1, :]  # [Hkv, c, D]
        out[page, :, 0] = k.mean(axis=1)
        out[page, :, 1] = k.max(axis=1)
        out[page, :, 2] = k.min(axis=1)
    return out


def page_scores(q, summary, block_tables, seq_lens, page_size, w_avg=1.0, w_peak=1.0, gqa_reduce="mean_q"):
    q = np.asarray(q, dtype=np.float64)
    summ = np.asarray(summary, dtype=np.float64)
    bt = np.asarray(block_tables)
    B, hq, _ = q.shape
    num_pages, hkv = summ.shape[:2]
    G = hq // hkv
    max_pages = bt.shape[1]
    out = np.full((B, hkv, max_pages), -np.inf)
    for b in range(B):
        n_pages = -(-int(seq_lens[b]) // page_size)
        for g in range(hkv):
            qg = q[b, g * G:(g + 1) * G]  # [G, D]
            for j in range(min(n_pages, max_pages)):
                p = int(bt[b, j])
                if not 0 <= p < num_pages:
                    continue
                mu, mx, mn = summ[p, g]
                if gqa_reduce == "mean_q":
                    qb = qg.mean(0)
                    avg = qb @ mu
                    peak = np.maximum(qb * mx, qb * mn).sum()
                else:  # "max": max over heads of each term separately
                    avg = (qg @ mu).max()
                    peak = np.maximum(qg * mx, qg * mn).sum(-1).max()
                out[b, g, j] = w_avg * avg + w_peak * peak
    return out


def window_probs(q_group, keys, scale, gqa_reduce):
    """p over the window's keys [W, D] for the group's queries [G, D]."""
    if gqa_reduce == "mean_q":
        return softmax(scale * keys @ q_group.mean(0))
    probs = softmax(scale * keys @ q_group.T, axis=0)  # [W, G], one softmax per head
    return {"max": probs.max(1), "sum": probs.sum(1), "mean_p": probs.mean(1)}[gqa_reduce]


def token_accumulate(q, key_cache, state, block_tables, seq_lens, scale=None, decay=0.984375,
                     gqa_reduce="mean_q", bos=0, eos=0, state_dtype="float32"):
    """One step: state[t] <- p_t + decay * state[t] on the token window [bos, n - eos).

    ``state_dtype="bfloat16"`` rounds every stored value to bf16 (fp64 math, round on store).
    """
    q = np.asarray(q, dtype=np.float64)
    key = np.asarray(key_cache, dtype=np.float64)
    out = np.array(state, dtype=np.float64)
    bt = np.asarray(block_tables)
    B, hq, D = q.shape
    num_pages, hkv, P, _ = key.shape
    G = hq // hkv
    scale = D ** -0.5 if scale is None else scale
    for b in range(B):
        n = int(seq_lens[b])
        toks = np.arange(bos, n - eos)
        if toks.size == 0:
            continue
        pages = bt[b, toks // P]
        offs = toks % P
        ok = (pages >= 0) & (pages < num_pages)
        pages, offs = pages[ok], offs[ok]
        if pages.size == 0:
            continue
        for g in range(hkv):
            p = window_probs(q[b, g * G:(g + 1) * G], key[pages, g, offs], scale, gqa_reduce)
            new = p + decay * out[pages, g, offs]
            out[pages, g, offs] = bf16_round(new) if state_dtype == "bfloat16" else new
    return out


def token_page_scores(state, block_tables, seq_lens):
    st = np.asarray(state, dtype=np.float64)
    bt = np.asarray(block_tables)
    num_pages, hkv, P = st.shape
    B, max_pages = bt.shape
    out = np.full((B, hkv, max_pages), -np.inf)
    for b in range(B):
        n = int(seq_lens[b])
        for j in range(min(-(-n // P), max_pages)):
            p = int(bt[b, j])
            if 0 <= p < num_pages:
                out[b, :, j] = st[p, :, : min(P, n - j * P)].sum(-1)
    return out


def select_pages(scores, block_tables, seq_lens, page_size, topk, bos=0, eos=0):
    """(sparse tables [B, Hkv, bos+topk+eos] int64 with -1 padding, token lengths [B, Hkv])."""
    sc = np.asarray(scores, dtype=np.float64)
    bt = np.asarray(block_tables)
    B, hkv, _ = sc.shape
    budget = bos + topk + eos
    tables = np.full((B, hkv, budget), -1, dtype=np.int64)
    lens = np.zeros((B, hkv), dtype=np.int64)
    for b in range(B):
        n = int(seq_lens[b])
        n_pages = -(-n // page_size)
        for g in range(hkv):
            if n_pages <= budget:
                logical = list(range(n_pages))
            else:
                mid = sc[b, g, bos:n_pages - eos]
                # NaN rule: NaN ranks below every number (-inf included); ties -> lower page
                order = sorted(range(mid.size), key=lambda i: (bool(np.isnan(mid[i])),
                                                               0.0 if np.isnan(mid[i]) else -mid[i], i))[:topk]
                logical = list(range(bos)) + sorted(bos + i for i in order) + list(range(n_pages - eos, n_pages))
            tables[b, g, :len(logical)] = bt[b, logical]
            # tokens of the selected pages: each full, but the real last page holds n - (n_pages - 1) * P
            lens[b, g] = len(logical) * page_size - (n_pages * page_size - n if n_pages - 1 in logical else 0)
    return tables, lens


# ---------------------------------------------------------------------------- the seed harness
def affinity_problem(rng, n_tokens=128, G=4, D=128, spread=2.0):
    """Keys with a stable per-token affinity along a shared direction u (the seed's harness).

    k_t = randn + a_t * u with a_t ~ N(0, spread^2): the per-token affinity makes the top-k
    boundary gap large compared with rounding, so selections can be compared exactly.
    Returns (keys [n, D], u [D]); queries per step come from ``affinity_query``.
    """
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    a = rng.normal(0.0, spread, size=n_tokens)
    keys = rng.standard_normal((n_tokens, D)) + a[:, None] * u[None, :] * np.sqrt(D)
    return keys, u


def affinity_query(rng, u, G=4, D=128):
    return 0.3 * rng.standard_normal((G, D)) + u[None, :]

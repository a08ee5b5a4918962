"""fp64 numpy oracles of the block-selection ops (independent of ``paddle_fa4.reference``).

Written as plain per-row loops straight from the semantics in ``docs/api.md`` so that a bug in the
vectorised reference or in the kernel cannot be mirrored here.
"""

from __future__ import annotations

import numpy as np

NEG_INF = -np.inf


def block_log_weight(block_logit, lse):
    """``block_logit - lse[..., None]`` in fp64; ``-inf`` where ``block_logit`` is ``-inf``."""
    bl = np.asarray(block_logit, np.float64)
    ls = np.asarray(lse, np.float64)[..., None]
    with np.errstate(invalid="ignore"):
        out = bl - ls
    return np.where(np.isneginf(bl), NEG_INF, out)


def _select_row(scores, visible, topk, sink_blocks, local_blocks):
    """One row: ``scores[nb]`` (fp64 ranked log-weights, NaN = not ranked) and ``visible[nb]`` ->
    ascending block ids, -1 padded. NaN rule: an unranked block is kept only when forced."""
    nb = scores.shape[0]
    vis = [j for j in range(nb) if visible[j]]
    picked = []
    if vis:
        diag = max(vis)  # last block holding a visible key
        forced = [j for j in vis if j < sink_blocks or j > diag - local_blocks]
        assert len(forced) <= topk, "sink_blocks + local_blocks > topk"
        rest = [j for j in vis if j not in forced and not np.isnan(scores[j])]
        # Largest score first; equal scores -> lower block index first.
        rest.sort(key=lambda j: (-scores[j], j))
        picked = sorted(forced + rest[: topk - len(forced)])
    row = np.full(topk, -1, np.int32)
    row[: len(picked)] = picked
    return row


def _group_row(bl_heads, lse_heads, head_agg="max"):
    """The NaN rule for one (group, row): ``bl_heads [group, nb]``, ``lse_heads [group]`` ->
    ``(scores, visible)``. A head sees block j when its block_logit is a number above -inf; it ranks
    it when also ``block_logit - lse`` (fp32) is a number above -inf. The group's score is the max
    over ranking heads (``head_agg="sum"``: the log of the sum of their weights exp(d), in fp64;
    NaN when none ranks it); visible = some head sees it."""
    group, nb = bl_heads.shape
    scores = np.full(nb, np.nan)
    visible = np.zeros(nb, bool)
    for h in range(group):
        for j in range(nb):
            x = bl_heads[h, j]
            if np.isnan(x) or x == NEG_INF:
                continue
            visible[j] = True
            with np.errstate(invalid="ignore"):
                d = float(np.float32(x - np.float64(lse_heads[h])))
            if np.isnan(d) or d == NEG_INF:
                continue
            if head_agg == "sum":
                w = np.exp(d)
                scores[j] = np.log(w if np.isnan(scores[j]) else np.exp(scores[j]) + w)
            else:
                scores[j] = d if np.isnan(scores[j]) else max(scores[j], d)
    return scores, visible


def select_topk_blocks(block_logit, lse, topk, num_kv_heads=None, sink_blocks=0, local_blocks=0,
                       causal_limit=None, head_agg="max"):
    """Oracle of ``paddle_fa4.select_topk_blocks`` (dense 4-D or varlen 3-D inputs).

    ``causal_limit = (block_size, seqlen_k)``: blocks past row i's (i + Sk - Sq) // block_size are
    invisible (the op's read limit).
    """
    bl = np.asarray(block_logit, np.float64)
    ls = np.asarray(lse, np.float64)
    varlen = bl.ndim == 3
    if varlen:
        bl = bl[None]
        ls = ls[None]
    b, hq, sq, nb = bl.shape
    hs = 1 if num_kv_heads is None else num_kv_heads
    group = hq // hs
    out = np.full((b, hs, sq, topk), -1, np.int32)
    for bi in range(b):
        for g in range(hs):
            for i in range(sq):
                # The op's log-weight is an fp32 number (fp32 inputs, one fp32 subtraction): each
                # head's exact difference is rounded once so that ties are the ties the op sees.
                scores, visible = _group_row(bl[bi, g * group:(g + 1) * group, i, :],
                                             ls[bi, g * group:(g + 1) * group, i], head_agg)
                if causal_limit is not None:
                    block_size, seqlen_k = causal_limit
                    last_key = i + seqlen_k - sq
                    for j in range(nb):
                        if last_key < 0 or j > last_key // block_size:
                            visible[j] = False
                out[bi, g, i] = _select_row(scores, visible, topk, sink_blocks, local_blocks)
    return out[0] if varlen else out


def blocks_to_indices(block_idx, block_size, seqlen_k, causal=True):
    """Oracle of ``paddle_fa4.blocks_to_indices``: block ids -> token ids, -1 beyond the row's limit."""
    blk = np.asarray(block_idx)
    b, hs, sq, topk = blk.shape
    out = np.full((b, hs, sq, topk * block_size), -1, np.int32)
    for bi in range(b):
        for g in range(hs):
            for i in range(sq):
                last = seqlen_k - 1
                if causal:
                    last = min(last, i + seqlen_k - sq)
                for s in range(topk):
                    j = int(blk[bi, g, i, s])
                    if j < 0:
                        continue
                    for t in range(block_size):
                        key = j * block_size + t
                        if key <= last:
                            out[bi, g, i, s * block_size + t] = key
    return out[:, 0] if hs == 1 else out


def causal_block_logit(rng, b, hq, sq, sk, block_size, *, window=None, ties=False):
    """Random ``(block_logit, lse)`` with the exact -inf pattern of bottom-right causal attention.

    ``lse`` is a plausible logsumexp (>= every finite block_logit of the row). ``ties=True`` draws
    values from a small set so that equal log-weights are common.
    """
    nb = -(-sk // block_size)
    if ties:
        bl = rng.integers(0, 4, size=(b, hq, sq, nb)).astype(np.float64) * 0.5
    else:
        bl = rng.standard_normal((b, hq, sq, nb)) * 2.0
    rows = np.arange(sq)[:, None]
    first_key = np.arange(nb)[None, :] * block_size
    last_visible = rows + sk - sq  # [Sq, 1]
    visible = first_key <= last_visible
    if window is not None:
        last_key = np.minimum(first_key + block_size - 1, sk - 1)
        visible &= last_key >= last_visible - window
    bl = np.where(visible[None, None], bl, NEG_INF)
    finite = np.where(np.isfinite(bl), bl, -1e30)
    lse = finite.max(axis=-1) + np.log1p(rng.random((b, hq, sq)) * 4.0) + 1.0
    lse = np.where(visible.any(-1)[None, None], lse, NEG_INF)
    return bl.astype(np.float32), lse.astype(np.float32)

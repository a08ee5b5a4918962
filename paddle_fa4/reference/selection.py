"""Reference (pure Paddle, fp32) block selection: log-weights, cross-head top-k, token indices.

Row-chunked so that the temporaries stay bounded (``_ROW_ELEMS`` fp32 elements per chunk) for long
sequences; each function writes into an output allocated by the caller, as the CuTe glue does.
"""

from __future__ import annotations

import paddle

#: Elements of the [B, Hq, rows, nb] slab processed at once (64 MiB of fp32).
_ROW_ELEMS = 1 << 24
_NEG_INF = float("-inf")


def block_log_weight(block_logit, lse):
    """``block_logit - lse[..., None]`` in fp32; ``-inf`` stays ``-inf`` (also when ``lse`` is -inf)."""
    bl = block_logit.astype("float32")
    diff = bl - lse.astype("float32").unsqueeze(-1)
    return paddle.where(bl == _NEG_INF, paddle.full_like(bl, _NEG_INF), diff)


def _group_scores(block_logit, lse, num_groups, head_agg="max"):
    """``(score, visible)`` of each (group, row, block) under the NaN rule (docs/api.md, "NaN").

    A head sees block j when its block_logit is a number above -inf (NaN = unseen); its score is
    ``block_logit - lse`` unless that is NaN or -inf (NaN or +inf lse): then the head sees the block
    but ranks nothing. ``visible`` = some head of the group sees it; ``score`` = the max over the
    heads that rank it (``head_agg="sum"``: the log of the sum of their weights, ``logsumexp``;
    an unranked head adds weight 0), -inf when none does (visible-but-unranked blocks are kept
    only when forced).
    """
    b, hq, c, nb = block_logit.shape
    group = hq // num_groups
    bl = block_logit.astype("float32")
    seen = bl > _NEG_INF  # False for NaN
    diff = bl - lse.astype("float32").unsqueeze(-1)
    ranked = seen & (diff > _NEG_INF)  # False for NaN differences
    score = paddle.where(ranked, diff, paddle.full_like(diff, _NEG_INF))
    score = score.reshape([b, num_groups, group, c, nb])
    best = score.max(axis=2)  # [B, Hs, c, nb]
    if head_agg == "sum":
        # log(sum_h exp(score_h)) around the max (no overflow/underflow of the weights); the heads
        # that rank nothing hold -inf and add exp(-inf) = 0; all -inf stays -inf.
        # A +inf max stays +inf (inf - inf would make the sum NaN), as in the kernel and the oracle.
        keep = (best == _NEG_INF) | (best == float("inf"))
        shift = paddle.where(keep, paddle.zeros_like(best), best)
        total = paddle.exp(score - shift.unsqueeze(2)).sum(axis=2)
        best = paddle.where(keep, best, shift + paddle.log(total))
    score = best
    visible = seen.reshape([b, num_groups, group, c, nb]).any(axis=2)
    return score, visible


def _select_rows(block_logit, lse, topk, num_groups, sink_blocks, local_blocks, last_blocks, head_agg="max"):
    """``block_logit [B, Hq, c, nb]``, ``lse [B, Hq, c]`` -> int32 ``[B, Hs, c, topk]``.

    ``last_blocks [c]`` int64 (or None): the causal read limit, blocks past it count as invisible.
    """
    b, hq, c, nb = block_logit.shape
    logw, visible = _group_scores(block_logit, lse, num_groups, head_agg)
    col = paddle.arange(nb, dtype="int64", device=block_logit.place).reshape([1, 1, 1, nb])
    if last_blocks is not None:
        visible = visible & (col <= last_blocks.reshape([1, 1, c, 1]))
        logw = paddle.where(visible, logw, paddle.full_like(logw, _NEG_INF))
    # Diagonal block = last block with a visible key (see docs/api.md, "local blocks").
    last = paddle.where(visible, col.expand_as(logw), paddle.full_like(col, -1).expand_as(logw))
    last = last.max(axis=-1, keepdim=True)
    forced = visible & ((col < sink_blocks) | (col > last - local_blocks))
    score = paddle.where(forced, paddle.full_like(logw, float("inf")), logw)
    # Stable descending sort: equal scores keep ascending block order, so ties go to the lower id.
    kept = min(topk, nb)
    order = paddle.argsort(score, axis=-1, descending=True, stable=True)[..., :kept]
    chosen = paddle.take_along_axis(score, order, axis=-1) > _NEG_INF
    sentinel = paddle.full_like(order, nb)
    ids = paddle.sort(paddle.where(chosen, order, sentinel), axis=-1)
    ids = paddle.where(ids == nb, paddle.full_like(ids, -1), ids).astype("int32")
    if kept < topk:
        pad = paddle.full([b, num_groups, c, topk - kept], -1, dtype="int32", device=block_logit.place)
        ids = paddle.concat([ids, pad], axis=-1)
    return ids


def select_topk_blocks(block_logit, lse, out, topk, num_groups, sink_blocks, local_blocks,
                       causal_limit=None, head_agg="max") -> None:
    """Dense 4-D inputs, ``out [B, Hs, Sq, topk]`` int32 (varlen callers add a batch axis of 1).

    ``causal_limit = (block_size, seqlen_k)``: row i sees only blocks <= (i + Sk - Sq) // block_size.
    """
    b, hq, sq, nb = block_logit.shape
    rows = max(1, _ROW_ELEMS // max(1, b * hq * nb))
    for s0 in range(0, sq, rows):
        s1 = min(sq, s0 + rows)
        last_blocks = None
        if causal_limit is not None:
            block_size, seqlen_k = causal_limit
            # floor division: a row that sees no key gets -1 (nothing visible)
            rows_k = paddle.arange(s0, s1, dtype="int64", device=block_logit.place) + (seqlen_k - sq)
            last_blocks = paddle.floor_divide(rows_k, paddle.full([], block_size, dtype="int64",
                                                                  device=block_logit.place))
        out[:, :, s0:s1] = _select_rows(block_logit[:, :, s0:s1], lse[:, :, s0:s1], topk, num_groups,
                                        sink_blocks, local_blocks, last_blocks, head_agg)


def blocks_to_indices(block_idx, out, block_size, seqlen_k, causal) -> None:
    """``block_idx [B, Hs, Sq, topk]`` -> ``out [B, Hs, Sq, topk * block_size]`` int32 token ids."""
    b, hs, sq, topk = block_idx.shape
    nb_k = -(-seqlen_k // block_size)
    rows = max(1, _ROW_ELEMS // max(1, b * hs * topk * block_size))
    offs = paddle.arange(block_size, dtype="int64", device=block_idx.place).reshape([1, 1, 1, 1, block_size])
    for s0 in range(0, sq, rows):
        s1 = min(sq, s0 + rows)
        blk = block_idx[:, :, s0:s1].astype("int64").unsqueeze(-1)  # [B, Hs, c, topk, 1]
        keys = blk * block_size + offs
        valid = (blk >= 0) & (blk < nb_k) & (keys < seqlen_k)
        if causal:
            row = paddle.arange(s0, s1, dtype="int64", device=block_idx.place).reshape([1, 1, s1 - s0, 1, 1])
            valid = valid & (keys <= row + (seqlen_k - sq))
        keys = paddle.where(valid, keys, paddle.full_like(keys, -1)).astype("int32")
        out[:, :, s0:s1] = keys.reshape([b, hs, s1 - s0, topk * block_size])

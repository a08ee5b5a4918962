"""Reference (pure Paddle, float32) block-sparse attention forward and analytic backward.

Per batch, query rows are processed in chunks: each row's live blocks (the block rule of
``paddle_fa4._plan.block_sparse.block_starts``), deduplicated, expand to their visible keys (``< q_limit``),
which are gathered as float32 ``[rows, Hkv, topk * block_size, D]`` tiles under :data:`TILE_BYTES`.
Unused slots are zeroed before use (never read values). The plan is not needed and is passed
through. Semantics: ``docs/api.md`` (block_sparse_attention).
"""

from __future__ import annotations

import math

import paddle

from .._plan.block_sparse import block_starts, block_tokens, doc_bounds, query_limits

#: Upper bound on the float32 bytes of one chunk's gathered keys, values and scores.
TILE_BYTES = 64 << 20


def forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan=None):
    """``(out [B, S, Hq, Dv] q dtype, lse [B, Hq, S] float32, plan)``."""
    place = q.place
    with paddle.no_grad():
        out = paddle.zeros([spec.B, spec.S, spec.Hq, spec.Dv], dtype=q.dtype, device=place)
        lse = _empty_lse(spec, sink, place)
        if _has_work(spec):
            rule = _Rule(spec, block_ids, cu_seqlens)
            for b in range(spec.B):
                kv = _KeyValues(spec, k[b], None if v is None else v[b])
                for i0, i1 in _chunks(spec):
                    rows = _Rows(spec, kv, rule.tokens(b, i0, i1), sink)
                    o, row_lse = rows.forward(q[b, i0:i1])
                    out[b, i0:i1] = o.astype(q.dtype)
                    lse[b, :, i0:i1] = row_lse
    return out, lse, plan


def backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse, dout, plan=None):
    """``(dq, dk, dv, dsink)``; ``dk`` is the combined latent gradient and ``dv`` None when
    ``spec.latent``; ``dsink`` float32 ``[Hq]`` (None without a sink).

    ``P = exp(s - lse)``, ``D = rowsum(P dO V^T)`` (= rowsum(dO * O), free of O's rounding),
    ``dS = P (dO V^T - D)``; ``dq = scale dS K``,
    ``dk = scale dS^T q`` and ``dv = P^T dO`` added into the selected key rows;
    ``dsink[h] = -sum_rows exp(sink[h] - lse) D``.
    """
    place = q.place
    with paddle.no_grad():
        dq = paddle.zeros(q.shape, dtype=q.dtype, device=place)
        dk = paddle.zeros(k.shape, dtype=k.dtype, device=place)
        dv = None if v is None else paddle.zeros(v.shape, dtype=v.dtype, device=place)
        dsink = None if sink is None else paddle.zeros([spec.Hq], dtype="float32", device=place)
        if _has_work(spec):
            rule = _Rule(spec, block_ids, cu_seqlens)
            for b in range(spec.B):
                kv = _KeyValues(spec, k[b], None if v is None else v[b])
                grads = _KeyGrads(spec, place)
                for i0, i1 in _chunks(spec):
                    rows = _Rows(spec, kv, rule.tokens(b, i0, i1), sink)
                    dq_rows, ds_rows = rows.backward(q[b, i0:i1], out[b, i0:i1], lse[b, :, i0:i1],
                                                     dout[b, i0:i1], grads)
                    dq[b, i0:i1] = dq_rows.astype(q.dtype)
                    if dsink is not None:
                        dsink = dsink + ds_rows
                dk[b] = grads.dk().astype(k.dtype)
                if dv is not None:
                    dv[b] = grads.dv().astype(v.dtype)
    return dq, dk, dv, dsink


def _empty_lse(spec, sink, place):
    """lse of rows without keys: -inf, or the sink logit (the sink is then the row's only column)."""
    if sink is None:
        return paddle.full([spec.B, spec.Hq, spec.S], -math.inf, dtype="float32", device=place)
    return sink.astype("float32").reshape([1, spec.Hq, 1]).expand([spec.B, spec.Hq, spec.S]).clone()


def _has_work(spec) -> bool:
    return spec.B * spec.S * spec.Hq > 0 and spec.topk > 0


def _chunks(spec):
    """``(i0, i1)`` query-row ranges whose gathered tiles fit in :data:`TILE_BYTES`."""
    width = spec.topk * spec.block_size
    per_row = 4 * spec.Hkv * width * (spec.Dk + spec.Dv + 4 * spec.group)
    step = max(1, min(spec.S, TILE_BYTES // per_row))
    return [(i0, min(spec.S, i0 + step)) for i0 in range(0, spec.S, step)]


class _Rule:
    """The block rule of this call: per query, its distinct live blocks as visible key tokens."""

    def __init__(self, spec, block_ids, cu_seqlens):
        self.spec = spec
        bos, eos = doc_bounds(spec.B, spec.S, cu_seqlens, block_ids.place)
        self.limit = query_limits(bos, eos, spec.causal)  # [B, S] int64
        self.starts = block_starts(block_ids, bos, self.limit, spec.block_size)  # ids' shape, int64

    def tokens(self, b: int, i0: int, i1: int):
        """``(token [rows, Hkv, W] int64, keep [rows, Hkv, W] bool)``, ``W = topk * block_size``:
        the keys of each distinct live block that the row sees (``keep``), 0 elsewhere."""
        spec = self.spec
        rows = i1 - i0
        if spec.per_kv_head:
            st = self.starts[b, :, i0:i1].transpose([1, 0, 2])
        else:
            st = self.starts[b, i0:i1].unsqueeze(1).expand([rows, spec.Hkv, spec.topk])
        st = paddle.sort(st, axis=-1)  # repeats become neighbours; -1 first
        repeat = paddle.concat([paddle.zeros([rows, spec.Hkv, 1], dtype="bool", device=st.place),
                                st[..., 1:] == st[..., :-1]], axis=-1)
        st = paddle.where(repeat, paddle.full_like(st, -1), st)
        token, keep = block_tokens(st, self.limit[b, i0:i1].reshape([rows, 1, 1]), spec.block_size)
        return paddle.where(keep, token, paddle.zeros_like(token)), keep


class _KeyValues:
    """One batch's keys and values as float32 ``[Hkv * S, D]`` (row ``kv_head * S + t``); the
    latent's V is the leading Dv columns of K. Upcast once per batch: CPU Paddle has no fp16 gather."""

    def __init__(self, spec, key, value):
        self.key = key.astype("float32").transpose([1, 0, 2]).reshape([spec.Hkv * spec.S, spec.Dk])
        self.value = None if value is None else (
            value.astype("float32").transpose([1, 0, 2]).reshape([spec.Hkv * spec.S, spec.Dv]))


class _KeyGrads:
    """fp32 ``[Hkv * S, D]`` key / value gradient sums of one batch (the latent: one sum)."""

    def __init__(self, spec, place):
        self.spec = spec
        self.k = paddle.zeros([spec.Hkv * spec.S, spec.Dk], dtype="float32", device=place)
        self.v = None if spec.latent else paddle.zeros([spec.Hkv * spec.S, spec.Dv], dtype="float32", device=place)

    def add(self, flat_index, dk_rows, dv_rows):
        spec = self.spec
        dv_rows = dv_rows.reshape([-1, spec.Dv])
        if spec.latent:  # dV lands on the leading Dv columns of the same rows
            dv_rows = paddle.concat([dv_rows, paddle.zeros([dv_rows.shape[0], spec.Dk - spec.Dv],
                                                           dtype="float32", device=dv_rows.place)], axis=-1)
            self.k = paddle.index_add(self.k, flat_index, 0, dk_rows.reshape([-1, spec.Dk]) + dv_rows)
        else:
            self.k = paddle.index_add(self.k, flat_index, 0, dk_rows.reshape([-1, spec.Dk]))
            self.v = paddle.index_add(self.v, flat_index, 0, dv_rows)

    def _unflatten(self, flat, d):
        return flat.reshape([self.spec.Hkv, self.spec.S, d]).transpose([1, 0, 2])

    def dk(self):
        return self._unflatten(self.k, self.spec.Dk)

    def dv(self):
        return self._unflatten(self.v, self.spec.Dv)


class _Rows:
    """A chunk of query rows: their visible keys, gathered and zeroed where unused."""

    def __init__(self, spec, kv: _KeyValues, tokens, sink):
        self.spec = spec
        token, self.keep = tokens  # [rows, Hkv, W]
        self.rows, _, self.width = token.shape
        head_base = paddle.arange(spec.Hkv, dtype="int64", device=token.place).reshape([1, spec.Hkv, 1])
        self.flat_index = (token + head_base * spec.S).reshape([-1])
        self.k = self._gather(kv.key, spec.Dk)
        self.v = self.k[..., :spec.Dv] if kv.value is None else self._gather(kv.value, spec.Dv)
        # [1, Hkv, G, 1] sink logits (natural log), or None
        self.sink = None if sink is None else sink.astype("float32").reshape([1, spec.Hkv, spec.group, 1])

    def _gather(self, table, d):
        g = paddle.gather(table, self.flat_index).reshape([self.rows, self.spec.Hkv, self.width, d])
        return paddle.where(self.keep.unsqueeze(-1), g, paddle.zeros_like(g))

    def _heads(self, x, d):
        """``[rows, Hq, d]`` -> float32 ``[rows, Hkv, G, d]`` (query head h = kv * G + g)."""
        return x.astype("float32").reshape([self.rows, self.spec.Hkv, self.spec.group, d])

    def _scores(self, q):
        s = paddle.matmul(q, self.k, transpose_y=True) * self.spec.scale  # [rows, Hkv, G, W]
        return paddle.where(self.keep.unsqueeze(2), s, paddle.full([], -math.inf, dtype="float32", device=s.place))

    def forward(self, q_rows):
        """``(out [rows, Hq, Dv] float32, lse [Hq, rows] float32)``."""
        spec = self.spec
        s = self._scores(self._heads(q_rows, spec.Dk))
        row_max = paddle.max(s, axis=-1, keepdim=True)
        if self.sink is not None:
            row_max = paddle.maximum(row_max, self.sink.expand(row_max.shape))
        safe_max = paddle.where(paddle.isinf(row_max), paddle.zeros_like(row_max), row_max)
        zero = paddle.zeros([], dtype="float32", device=s.place)
        # CPU Paddle's vectorised exp returns ~3e-39 for -inf, hence the explicit mask.
        p = paddle.where(self.keep.unsqueeze(2), paddle.exp(s - safe_max), zero)
        row_sum = paddle.sum(p, axis=-1, keepdim=True)
        if self.sink is not None:
            row_sum = row_sum + paddle.exp(self.sink - safe_max)
        o = paddle.matmul(p, self.v) / paddle.where(row_sum > 0, row_sum, paddle.ones_like(row_sum))
        row_lse = (safe_max + paddle.log(row_sum)).reshape([self.rows, spec.Hq])
        return o.reshape([self.rows, spec.Hq, spec.Dv]), row_lse.transpose([1, 0])

    def backward(self, q_rows, out_rows, lse_rows, dout_rows, grads: _KeyGrads):
        """``(dq [rows, Hq, Dk] float32, dsink [Hq] float32 or None)``; key gradients go into ``grads``."""
        spec = self.spec
        q = self._heads(q_rows, spec.Dk)
        do = self._heads(dout_rows, spec.Dv)  # out_rows is not read: D comes from P and dP
        row_lse = lse_rows.transpose([1, 0]).reshape([self.rows, spec.Hkv, spec.group, 1])
        live = self.keep.unsqueeze(2) & paddle.isfinite(row_lse)
        zero = paddle.zeros([], dtype="float32", device=q.place)
        p = paddle.where(live, paddle.exp(self._scores(q) - row_lse), zero)  # [rows, Hkv, G, W]
        dp = paddle.matmul(do, self.v, transpose_y=True)
        delta = paddle.sum(p * dp, axis=-1, keepdim=True)  # [rows, Hkv, G, 1]; see reference/attention.py
        # dS = 0 where P = 0 (live only): a row whose delta is NaN (it sees a NaN / Inf value) must not reach, as
        # 0 * NaN through an unused slot (gathered as token 0), the dK of a key it does not see
        ds = paddle.where(live, p * (dp - delta), zero)
        dq = paddle.matmul(ds, self.k) * spec.scale
        grads.add(self.flat_index, paddle.matmul(ds, q, transpose_x=True) * spec.scale,
                  paddle.matmul(p, do, transpose_x=True))
        dsink = None
        if self.sink is not None:
            p_sink = paddle.where(paddle.isfinite(row_lse), paddle.exp(self.sink - row_lse), zero)
            dsink = -(p_sink * delta).sum(axis=[0, 3]).reshape([spec.Hq])
        return dq.reshape([self.rows, spec.Hq, spec.Dk]), dsink

"""Reference (pure Paddle, float32) indexed attention forward and analytic backward.

Per batch, query rows are processed in chunks so the gathered ``[rows, Hkv, W, D]`` float32 key
and value tiles stay under :data:`TILE_BYTES`. Each index row is sorted and repeats and padding
(``< 0`` or ``>= Lkv``) are masked out, so duplicates count once and padded slots are never read
(their gathered rows are zeroed before use). Semantics: ``docs/api.md`` (indexed_attention).
"""

from __future__ import annotations

import math

import paddle

#: Upper bound on the float32 bytes of one chunk's gathered keys, values and scores.
TILE_BYTES = 64 << 20


def forward(spec, query, key, value, indices, plan=None):
    """``(out [B, Lq, Hq, D] query dtype, lse [B, Hq, Lq] float32, plan)``; ``plan`` is passed through."""
    place = query.place
    with paddle.no_grad():
        out = paddle.zeros([spec.B, spec.Lq, spec.Hq, spec.D], dtype=query.dtype, device=place)
        lse = paddle.full([spec.B, spec.Hq, spec.Lq], -math.inf, dtype="float32", device=place)
        if _has_keys(spec):
            for b in range(spec.B):
                kv = _KeyValues(spec, key[b], value[b])
                for i0, i1 in _chunks(spec):
                    rows = _Rows(spec, kv, _index_rows(spec, indices, b, i0, i1))
                    o, row_lse = rows.forward(query[b, i0:i1])
                    out[b, i0:i1] = o.astype(query.dtype)
                    lse[b, :, i0:i1] = row_lse
    return out, lse, plan


def backward(spec, query, key, value, out, lse, dout, indices):
    """``(dq, dk, dv)`` in the inputs' dtypes for upstream gradient ``dout [B, Lq, Hq, D]``.

    ``dP = dO V^T``, ``dS = P * (dP - rowsum(P dP))`` (rowsum(P dP) = rowsum(dO * O), free of O's rounding),
    ``dq = scale dS K``; ``dk = scale dS^T q``
    and ``dv = P^T dO`` are added into the selected (valid, distinct) key rows.
    """
    place = query.place
    with paddle.no_grad():
        dq = paddle.zeros(query.shape, dtype=query.dtype, device=place)
        dk = paddle.zeros(key.shape, dtype=key.dtype, device=place)
        dv = paddle.zeros(value.shape, dtype=value.dtype, device=place)
        if _has_keys(spec):
            for b in range(spec.B):
                kv = _KeyValues(spec, key[b], value[b])
                dk_flat = paddle.zeros([spec.Hkv * spec.Lkv, spec.D], dtype="float32", device=place)
                dv_flat = paddle.zeros([spec.Hkv * spec.Lkv, spec.D], dtype="float32", device=place)
                for i0, i1 in _chunks(spec):
                    rows = _Rows(spec, kv, _index_rows(spec, indices, b, i0, i1))
                    dq_rows, dk_flat, dv_flat = rows.backward(
                        query[b, i0:i1], out[b, i0:i1], lse[b, :, i0:i1], dout[b, i0:i1], dk_flat, dv_flat)
                    dq[b, i0:i1] = dq_rows.astype(query.dtype)
                dk[b] = _unflatten(spec, dk_flat).astype(key.dtype)
                dv[b] = _unflatten(spec, dv_flat).astype(value.dtype)
    return dq, dk, dv


def _has_keys(spec) -> bool:
    return spec.B * spec.Lq * spec.Hq > 0 and spec.Lkv > 0 and spec.W > 0


def _chunks(spec):
    """``(i0, i1)`` query-row ranges whose gathered tiles fit in :data:`TILE_BYTES`."""
    group = spec.Hq // spec.Hkv
    per_row = 4 * spec.Hkv * spec.W * (4 * spec.D + 4 * group)
    step = max(1, min(spec.Lq, TILE_BYTES // per_row))
    return [(i0, min(spec.Lq, i0 + step)) for i0 in range(0, spec.Lq, step)]


def _index_rows(spec, indices, b: int, i0: int, i1: int):
    """Index rows of queries ``i0..i1`` as ``[rows, Hkv, W]`` (shared rows repeated per kv head)."""
    if spec.per_kv_head:
        return indices[b, :, i0:i1].transpose([1, 0, 2])
    return indices[b, i0:i1].unsqueeze(1).expand([i1 - i0, spec.Hkv, spec.W])


def _unflatten(spec, flat):
    """``[Hkv * Lkv, D]`` -> ``[Lkv, Hkv, D]``."""
    return flat.reshape([spec.Hkv, spec.Lkv, spec.D]).transpose([1, 0, 2])


class _KeyValues:
    """One batch's keys and values as float32 ``[Hkv * Lkv, D]`` (row ``kv_head * Lkv + t``).

    Upcast once per batch: CPU Paddle has no float16 gather.
    """

    def __init__(self, spec, key, value):
        self.key = key.astype("float32").transpose([1, 0, 2]).reshape([spec.Hkv * spec.Lkv, spec.D])
        self.value = value.astype("float32").transpose([1, 0, 2]).reshape([spec.Hkv * spec.Lkv, spec.D])


class _Rows:
    """A chunk of query rows: their distinct valid keys, gathered and zeroed where unused."""

    def __init__(self, spec, kv: _KeyValues, index_rows):
        self.spec = spec
        rows = index_rows.shape[0]
        self.rows = rows
        ordered = paddle.sort(index_rows, axis=-1)  # [rows, Hkv, W]
        valid = (ordered >= 0) & (ordered < spec.Lkv)
        repeat = paddle.concat([paddle.zeros([rows, spec.Hkv, 1], dtype="bool", device=ordered.place),
                                ordered[..., 1:] == ordered[..., :-1]], axis=-1)
        self.keep = valid & ~repeat  # [rows, Hkv, W]: slot holds a distinct valid key
        head_base = paddle.arange(spec.Hkv, dtype="int64", device=ordered.place).reshape([1, spec.Hkv, 1])
        safe = paddle.where(self.keep, ordered, paddle.zeros_like(ordered)).astype("int64")
        self.flat_index = (safe + head_base * spec.Lkv).reshape([-1])
        self.k = self._gather(kv.key)
        self.v = self._gather(kv.value)

    def _gather(self, table):
        """``[rows, Hkv, W, D]`` float32 rows of ``table``; 0 in unused slots (never read values)."""
        g = paddle.gather(table, self.flat_index)
        g = g.reshape([self.rows, self.spec.Hkv, self.spec.W, self.spec.D])
        return paddle.where(self.keep.unsqueeze(-1), g, paddle.zeros_like(g))

    def _queries(self, x):
        """``[rows, Hq, D]`` -> float32 ``[rows, Hkv, G, D]`` (query head h = kv * G + g)."""
        return x.astype("float32").reshape([self.rows, self.spec.Hkv, -1, self.spec.D])

    def _scores(self, q):
        s = paddle.matmul(q, self.k, transpose_y=True) * self.spec.scale  # [rows, Hkv, G, W]
        return paddle.where(self.keep.unsqueeze(2), s, paddle.full([], -math.inf, dtype="float32", device=s.place))

    def forward(self, query_rows):
        """``(out [rows, Hq, D] float32, lse [Hq, rows] float32)``."""
        s = self._scores(self._queries(query_rows))
        row_max = paddle.max(s, axis=-1, keepdim=True)
        safe_max = paddle.where(paddle.isinf(row_max), paddle.zeros_like(row_max), row_max)
        # CPU Paddle's vectorised exp returns ~3e-39 for -inf, hence the explicit mask.
        zero = paddle.zeros([], dtype="float32", device=s.place)
        p = paddle.where(self.keep.unsqueeze(2), paddle.exp(s - safe_max), zero)
        row_sum = paddle.sum(p, axis=-1, keepdim=True)
        o = paddle.matmul(p, self.v) / paddle.where(row_sum > 0, row_sum, paddle.ones_like(row_sum))
        row_lse = (safe_max + paddle.log(row_sum)).reshape([self.rows, self.spec.Hq])
        return o.reshape([self.rows, self.spec.Hq, self.spec.D]), row_lse.transpose([1, 0])

    def backward(self, query_rows, out_rows, lse_rows, dout_rows, dk_flat, dv_flat):
        """``(dq [rows, Hq, D] float32, dk_flat, dv_flat)`` with this chunk's key gradients added."""
        q = self._queries(query_rows)
        do = self._queries(dout_rows)  # out_rows is not read: D comes from P and dP
        row_lse = lse_rows.transpose([1, 0]).reshape([self.rows, self.spec.Hkv, -1, 1])
        live = self.keep.unsqueeze(2) & paddle.isfinite(row_lse)
        zero = paddle.zeros([], dtype="float32", device=q.place)
        p = paddle.where(live, paddle.exp(self._scores(q) - row_lse), zero)  # [rows, Hkv, G, W]
        dp = paddle.matmul(do, self.v, transpose_y=True)  # [rows, Hkv, G, W]
        # D = rowsum(P dP), as reference/attention.py; dS = 0 where P = 0 (live only): a row whose D is NaN (it
        # selected a NaN / Inf value) must not reach, as 0 * NaN through an unused slot (gathered as token 0),
        # the dK of a key it did not select
        ds = paddle.where(live, p * (dp - paddle.sum(p * dp, axis=-1, keepdim=True)), zero)
        dq = paddle.matmul(ds, self.k) * self.spec.scale
        dk_rows = paddle.matmul(ds, q, transpose_x=True) * self.spec.scale  # [rows, Hkv, W, D]
        dv_rows = paddle.matmul(p, do, transpose_x=True)
        dk_flat = paddle.index_add(dk_flat, self.flat_index, 0, dk_rows.reshape([-1, self.spec.D]))
        dv_flat = paddle.index_add(dv_flat, self.flat_index, 0, dv_rows.reshape([-1, self.spec.D]))
        return dq.reshape([self.rows, self.spec.Hq, self.spec.D]), dk_flat, dv_flat

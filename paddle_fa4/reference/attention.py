"""Reference (pure Paddle, float32) attention forward with ``block_logit``.

Works on any place. Inputs are upcast to float32 (CPU Paddle has no bf16/fp16 matmul or exp);
``out`` is cast back to q's dtype. Query rows are processed in chunks so the ``[Hq, rows, Sk]``
float32 score tile stays under :data:`TILE_BYTES`, which bounds memory for long sequences.
Semantics: ``docs/api.md`` (flash_attn_fwd; "FlashMask" for ``startend_row_indices`` and
``block_bos``, which this module takes as the mask arguments of the same dense reference).

Keys a row cannot see never reach its results, NaN or inf included: scores are replaced before
the softmax, and products with V (forward) or K (dq) that involve a non-finite key row are added
per row only where that row sees the key (:func:`key_matmul`).
"""

from __future__ import annotations

import math

import paddle

#: Upper bound on one float32 score tile ``[Hq, rows, nb * block_size]`` (a few live at once).
TILE_BYTES = 64 << 20


def flash_attn_fwd(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k, startend_row_indices=None,
                   block_bos=None) -> None:
    """Fill ``out``, ``lse`` and (when not None) ``block_logit`` for a validated call.

    Args:
        spec (AttnFwdSpec): the validated call (``paddle_fa4.attention``).
        q, k, v (Tensor): inputs as described by ``spec``.
        out (Tensor): ``spec.out_shape()`` in q's dtype, written.
        lse (Tensor): float32 ``spec.lse_shape()``, written.
        block_logit (Tensor | None): float32 ``spec.block_logit_shape()``, every entry written.
        cu_seqlens_q, cu_seqlens_k (Tensor | None): int32 ``[B + 1]`` for varlen calls. Their values
            are read on the host (a device sync on GPU places, acceptable for a reference).
        startend_row_indices (Tensor | None): int32 ``[B, Hm, Sk, n]`` FlashMask bounds (dense only).
        block_bos (Tensor | None): int32 ``[B, Sq]`` block origins of ``block_logit`` (dense only).
    """
    with paddle.no_grad():
        if spec.varlen:
            _varlen(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k)
        else:
            for b in range(spec.batch):
                _sequence(spec, q[b], k[b], v[b], _Writer(out, lse, block_logit, b, 0),
                          None if startend_row_indices is None else startend_row_indices[b],
                          None if block_bos is None else block_bos[b])


def _varlen(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k) -> None:
    cu_q = cu_seqlens_q.numpy().tolist()
    cu_k = cu_seqlens_k.numpy().tolist()
    # Tokens covered by no sequence (possible only when cu_seqlens[-1] < total) still get defined values.
    paddle.assign(paddle.zeros(out.shape, dtype=out.dtype, device=out.place), out)
    paddle.assign(paddle.full(lse.shape, -math.inf, dtype="float32", device=lse.place), lse)
    if block_logit is not None:
        paddle.assign(paddle.full(block_logit.shape, -math.inf, dtype="float32", device=block_logit.place),
                      block_logit)
    for b in range(spec.batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 > q0 and k1 > k0:  # a document without keys keeps the fill (out 0, lse -inf)
            _sequence(spec, q[q0:q1], k[k0:k1], v[k0:k1], _Writer(out, lse, block_logit, None, q0))


class _Writer:
    """Writes the results of a chunk of query rows of one sequence into the output buffers."""

    def __init__(self, out, lse, block_logit, batch_idx, row_offset: int):
        self.out, self.lse, self.block_logit = out, lse, block_logit
        self.b, self.offset = batch_idx, row_offset

    def __call__(self, row0: int, o, row_lse, row_block_logit) -> None:
        """``o [rows, Hq, Dv]`` float32, ``row_lse [Hq, rows]``, ``row_block_logit [Hq, rows, nb]``."""
        r0 = self.offset + row0
        r1 = r0 + o.shape[0]
        o = o.astype(self.out.dtype)
        if self.b is None:  # varlen: out [total_q, Hq, Dv], lse [Hq, total_q], bl [Hq, total_q, nb]
            self.out[r0:r1] = o
            self.lse[:, r0:r1] = row_lse
            if self.block_logit is not None:
                self.block_logit[:, r0:r1] = row_block_logit
        else:
            self.out[self.b, r0:r1] = o
            self.lse[self.b, :, r0:r1] = row_lse
            if self.block_logit is not None:
                self.block_logit[self.b, :, r0:r1] = row_block_logit


def _sequence(spec, q, k, v, write, startend=None, bos=None) -> None:
    """One sequence: ``q [Sq, Hq, D]``, ``k [Sk, Hkv, D]``, ``v [Sk, Hkv, Dv]``; ``startend [Hm, Sk, n]``
    and ``bos [Sq]`` this sequence's FlashMask bounds and block origins (or None)."""
    sq, sk = q.shape[0], k.shape[0]
    if spec.block_size and sk > spec.num_blocks * spec.block_size:
        raise ValueError(f"flash_attn_fwd: a key sequence of length {sk} exceeds max_seqlen_k {spec.seqlen_k}")
    kf = k.astype("float32").transpose([1, 0, 2])  # [Hkv, Sk, D]
    vf = v.astype("float32").transpose([1, 0, 2])  # [Hkv, Sk, Dv]
    width = max(spec.num_blocks * spec.block_size, sk)
    rows = max(1, min(sq, TILE_BYTES // (4 * spec.num_heads * max(width, 1))))
    for row0 in range(0, sq, rows):
        row1 = min(sq, row0 + rows)
        o, row_lse, row_bl = _chunk(spec, q[row0:row1], kf, vf, row0, sq, sk, startend,
                                    None if bos is None else bos[row0:row1])
        write(row0, o, row_lse, row_bl)


def visible_mask(spec, row0: int, rows: int, sq: int, sk: int, place):
    """``[rows, Sk]`` bool: key ``t`` visible to query row ``row0 + r`` (bottom-right aligned)."""
    i = paddle.arange(row0, row0 + rows, dtype="int64", device=place).unsqueeze(1)
    t = paddle.arange(0, sk, dtype="int64", device=place).unsqueeze(0)
    diag = i + (sk - sq)  # the key aligned with row i
    mask = paddle.ones([rows, sk], dtype="bool", device=place)
    if spec.window_left is not None:
        mask = mask & (t >= diag - spec.window_left)
    if spec.window_right is not None:
        mask = mask & (t <= diag + spec.window_right)
    return mask


def _all_finite(x) -> bool:
    """Whether ``x`` holds no NaN / Inf (read on the host: a device sync on GPU places, acceptable for a
    reference; it keeps the common case at one matmul, see :func:`key_matmul`)."""
    return bool(paddle.isfinite(x).all())


def key_matmul(a, b, live, b_finite: bool):
    """``a @ b`` over the key axis (``a [H, R, Sk]``, ``b [H, Sk, X]``), where ``a`` is 0 on the keys a row does
    not see (``live [H, R, Sk]`` False), such that a NaN / Inf of ``b`` reaches only the rows that see its key.

    A plain matmul multiplies those zeros by every key row: ``0 * NaN = NaN`` (also ``0 * Inf``) would turn
    every row of the tile non-finite. With ``b_finite`` there is nothing to guard. Otherwise the finite part
    is one matmul with the non-finite entries zeroed, and each ``(row, column)`` that sees a non-finite entry
    gets the IEEE value of its visible products (counted with 0/1 matmuls): NaN for a NaN, for ``0 * Inf``
    or for infinities of both signs, else the sign of its infinities.
    """
    if b_finite:
        return paddle.matmul(a, b)
    zero = paddle.zeros([], dtype="float32", device=a.place)
    finite = paddle.isfinite(b)
    out = paddle.matmul(a, paddle.where(finite, b, zero))

    def count(rows_mask, entries_mask):
        return paddle.matmul(rows_mask.astype("float32"), entries_mask.astype("float32"))

    pos_inf, neg_inf = b == math.inf, b == -math.inf
    a_pos, a_neg = live & (a > 0), live & (a < 0)
    plus = (count(a_pos, pos_inf) + count(a_neg, neg_inf)) > 0
    minus = (count(a_pos, neg_inf) + count(a_neg, pos_inf)) > 0
    nan = (paddle.isnan(out) | (plus & minus) | (count(live, paddle.isnan(b)) > 0)
           | (count(live & ~((a > 0) | (a < 0)), ~finite) > 0))  # 0 * Inf, NaN * Inf
    out = paddle.where(plus, paddle.full_like(out, math.inf), out)
    out = paddle.where(minus, paddle.full_like(out, -math.inf), out)
    return paddle.where(nan, paddle.full_like(out, math.nan), out)


def startend_visible(spec, startend, row0: int, rows: int):
    """``[Hm, rows, Sk]`` bool: the FlashMask mask of ``startend [Hm, Sk, n]`` (one sequence) lets
    query row ``row0 + r`` see key ``t``; row ``i`` is masked in column ``t`` when
    ``LTS <= i < LTE`` or ``UTS <= i < UTE`` (the layout ``spec.startend`` says which bounds exist)."""
    place = startend.place
    bounds = startend.astype("int64").unsqueeze(1)  # [Hm, 1, Sk, n]
    i = paddle.arange(row0, row0 + rows, dtype="int64", device=place).reshape([1, rows, 1])
    lts = bounds[..., 0]
    if spec.startend == "lts":
        return i < lts
    if spec.startend == "lts_lte":
        return (i < lts) | (i >= bounds[..., 1])
    if spec.startend == "lts_ute":
        return (i < lts) & (i >= bounds[..., 1])
    lower = (i >= lts) & (i < bounds[..., 1])
    upper = (i >= bounds[..., 2]) & (i < bounds[..., 3])
    return ~(lower | upper)


def _full_mask(spec, row0: int, rows: int, sq: int, sk: int, hq: int, place, startend):
    """``[1 or Hq, rows, Sk]`` bool visibility: window / causal, and the FlashMask mask when given
    (query head ``h`` reads mask head ``h // (Hq // Hm)``)."""
    mask = visible_mask(spec, row0, rows, sq, sk, place).unsqueeze(0)
    if startend is None:
        return mask
    fm = startend_visible(spec, startend, row0, rows)
    if 1 < fm.shape[0] < hq:  # kv-head masks: repeat each for its query heads (bool has no repeat kernel)
        fm = paddle.repeat_interleave(fm.astype("int32"), hq // fm.shape[0], axis=0).astype("bool")
    return mask & fm


def _chunk(spec, q, kf, vf, row0: int, sq: int, sk: int, startend=None, bos=None):
    """Rows ``row0 .. row0 + q.shape[0]`` of one sequence (``startend``/``bos``: see :func:`_sequence`).

    Returns ``(o [rows, Hq, Dv] fp32, lse [Hq, rows] fp32, block_logit [Hq, rows, nb] fp32 | None)``.
    """
    rows, hq = q.shape[0], q.shape[1]
    hkv, group = kf.shape[0], hq // kf.shape[0]
    qf = q.astype("float32").transpose([1, 0, 2]).reshape([hkv, group * rows, -1])  # head h = kv * G + g
    s = paddle.matmul(qf, kf, transpose_y=True).reshape([hq, rows, sk]) * spec.softmax_scale
    if spec.softcap > 0:
        s = paddle.tanh(s / spec.softcap) * spec.softcap
    mask = _full_mask(spec, row0, rows, sq, sk, hq, q.place, startend)
    s = paddle.where(mask, s, paddle.full([], -math.inf, dtype="float32", device=q.place))
    row_max = paddle.max(s, axis=-1)  # [Hq, rows], -inf on rows with no visible key
    safe_max = paddle.where(paddle.isinf(row_max), paddle.zeros_like(row_max), row_max)
    # CPU Paddle's vectorised exp returns ~3e-39 for -inf, hence the explicit mask.
    p = paddle.where(mask, paddle.exp(s - safe_max.unsqueeze(-1)), paddle.zeros([], dtype="float32", device=q.place))
    row_sum = paddle.sum(p, axis=-1)
    row_lse = safe_max + paddle.log(row_sum)  # log(0) = -inf for empty rows
    live = mask.expand([hq, rows, sk]).reshape([hkv, group * rows, sk])
    o = key_matmul(p.reshape([hkv, group * rows, sk]), vf, live, _all_finite(vf)).reshape([hq, rows, -1])
    o = o / paddle.where(row_sum > 0, row_sum, paddle.ones_like(row_sum)).unsqueeze(-1)
    row_bl = None
    if spec.block_size:
        row_bl = (_block_max(s, spec.block_size, spec.num_blocks) if bos is None
                  else _block_max_relative(s, bos, spec.block_size, spec.num_blocks))
    return o.transpose([1, 0, 2]), row_lse, row_bl


def _block_max(s, block_size: int, num_blocks: int):
    """``s [Hq, rows, Sk]`` (-inf where masked) -> ``[Hq, rows, num_blocks]`` block maxima."""
    hq, rows, sk = s.shape
    pad = num_blocks * block_size - sk
    if pad > 0:
        s = paddle.concat([s, paddle.full([hq, rows, pad], -math.inf, dtype="float32", device=s.place)], axis=-1)
    return paddle.max(s.reshape([hq, rows, num_blocks, block_size]), axis=-1)


def _block_max_relative(s, bos, block_size: int, num_blocks: int):
    """``s [Hq, rows, Sk]`` (-inf where masked), ``bos [rows]`` -> ``[Hq, rows, num_blocks]``: block
    ``j`` of row ``r`` is the max over keys ``[bos_r + j * block_size, bos_r + (j + 1) * block_size)``;
    keys before ``bos_r`` belong to no block."""
    hq, rows, sk = s.shape
    width = num_blocks * block_size
    u = paddle.arange(width, dtype="int64", device=s.place).unsqueeze(0) + bos.astype("int64").unsqueeze(1)
    valid = u < sk  # [rows, width]
    idx = paddle.where(valid, u, paddle.zeros_like(u)).unsqueeze(0).expand([hq, rows, width])
    g = paddle.take_along_axis(s, idx, axis=2)
    g = paddle.where(valid.unsqueeze(0), g, paddle.full([], -math.inf, dtype="float32", device=s.place))
    return paddle.max(g.reshape([hq, rows, num_blocks, block_size]), axis=-1)


# ----------------------------------------------------------------------------------------------
# backward


def flash_attn_bwd(spec, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *,
                   deterministic=False, startend_row_indices=None):
    """``(dq, dk, dv)`` of a validated call, exact float32 closed form (deterministic by construction).

    Per sequence and chunk of query rows (each ``[Hq, rows, Sk]`` float32 tile stays under
    :data:`TILE_BYTES` / 4): recompute ``P = exp(s - lse)`` on the visible keys (0 on rows whose
    lse is -inf), ``dP = dout V^T``, ``D = rowsum(P dP) - dlse`` (rowsum(dout * out) in exact arithmetic,
    here free of out's rounding), ``dS = P (dP - D)``
    (times ``1 - tanh^2`` under softcap), then ``dq = scale dS K`` per chunk and
    ``dk += scale dS^T Q``, ``dv += P^T dout`` over the chunks (and the query heads of each kv head)
    in float32, cast once per sequence.

    Args:
        spec (AttnFwdSpec): the validated call.
        dout, q, k, v, out, lse, dlse: as in :func:`paddle_fa4.flash_attn_bwd` (``dlse`` may be None).
        dq, dk, dv (Tensor | None): out-parameters in q's / k's / v's shape and dtype, every element
            written; allocated when None.
        cu_seqlens_q, cu_seqlens_k (Tensor | None): int32 ``[B + 1]`` for varlen calls (read on the host).
        deterministic (bool): accepted for the shared contract; this backend always is.
        startend_row_indices (Tensor | None): the forward's FlashMask bounds (dense only).
    """
    del deterministic  # a fixed sequence of dense Paddle ops: bitwise reproducible anyway
    with paddle.no_grad():
        dq = _output(dq, q)
        dk = _output(dk, k)
        dv = _output(dv, v)
        if spec.varlen:
            _varlen_bwd(spec, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k)
        else:
            for b in range(spec.batch):
                dq_b, dk_b, dv_b = _sequence_bwd(spec, dout[b], q[b], k[b], v[b], out[b], lse[b],
                                                 None if dlse is None else dlse[b],
                                                 None if startend_row_indices is None else startend_row_indices[b])
                dq[b] = dq_b.astype(dq.dtype)
                dk[b] = dk_b.astype(dk.dtype)
                dv[b] = dv_b.astype(dv.dtype)
    return dq, dk, dv


def _output(buf, like):
    return paddle.empty(like.shape, dtype=like.dtype, device=like.place) if buf is None else buf


def _varlen_bwd(spec, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k) -> None:
    cu_q = cu_seqlens_q.numpy().tolist()
    cu_k = cu_seqlens_k.numpy().tolist()
    # Tokens of empty documents (and any past cu_seqlens[-1]) get zero gradients.
    for buf in (dq, dk, dv):
        paddle.assign(paddle.zeros(buf.shape, dtype=buf.dtype, device=buf.place), buf)
    for b in range(spec.batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0 or k1 == k0:  # no query or no key in this document: its gradients stay 0
            continue
        dq_b, dk_b, dv_b = _sequence_bwd(spec, dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1],
                                         lse[:, q0:q1], None if dlse is None else dlse[:, q0:q1])
        dq[q0:q1] = dq_b.astype(dq.dtype)
        dk[k0:k1] = dk_b.astype(dk.dtype)
        dv[k0:k1] = dv_b.astype(dv.dtype)


def _sequence_bwd(spec, dout, q, k, v, out, lse, dlse, startend=None):
    """One sequence: ``dout/out [Sq, Hq, Dv]``, ``q [Sq, Hq, D]``, ``k [Sk, Hkv, D]``, ``v [Sk, Hkv, Dv]``,
    ``lse/dlse [Hq, Sq]``. Returns float32 ``(dq [Sq, Hq, D], dk [Sk, Hkv, D], dv [Sk, Hkv, Dv])``."""
    sq, sk = q.shape[0], k.shape[0]
    hkv = k.shape[1]
    kf = k.astype("float32").transpose([1, 0, 2])  # [Hkv, Sk, D]
    vf = v.astype("float32").transpose([1, 0, 2])  # [Hkv, Sk, Dv]
    dk = paddle.zeros([hkv, sk, spec.head_dim], dtype="float32", device=q.place)
    dv = paddle.zeros([hkv, sk, spec.head_dim_v], dtype="float32", device=q.place)
    # s, tanh, p, dP and dS tiles [Hq, rows, Sk] live at once: each is kept to TILE_BYTES / 4
    rows = max(1, min(sq, TILE_BYTES // (4 * 4 * spec.num_heads * max(sk, 1))))
    dq_chunks = []
    for row0 in range(0, sq, rows):
        row1 = min(sq, row0 + rows)
        d_lse = None if dlse is None else dlse[:, row0:row1]
        dq_c, dk, dv = _chunk_bwd(spec, dout[row0:row1], q[row0:row1], kf, vf, out[row0:row1],
                                  lse[:, row0:row1], d_lse, dk, dv, row0, sq, sk, startend)
        dq_chunks.append(dq_c)
    dq = paddle.concat(dq_chunks, axis=0) if len(dq_chunks) > 1 else dq_chunks[0]
    return dq, dk.transpose([1, 0, 2]), dv.transpose([1, 0, 2])


def _chunk_bwd(spec, dout, q, kf, vf, out, lse, dlse, dk, dv, row0: int, sq: int, sk: int, startend=None):
    """Rows ``row0 .. row0 + q.shape[0]``: ``(dq [rows, Hq, D], dk, dv)`` with this chunk's key-side
    gradients (``[Hkv, Sk, D]`` / ``[Hkv, Sk, Dv]`` float32) added."""
    rows, hq = q.shape[0], q.shape[1]
    hkv, group = kf.shape[0], hq // kf.shape[0]

    def by_kv_head(x):  # [rows, Hq, X] -> float32 [Hkv, G * rows, X]; head h = kv * G + g
        return x.astype("float32").transpose([1, 0, 2]).reshape([hkv, group * rows, -1])

    qf, dof = by_kv_head(q), by_kv_head(dout)
    s = paddle.matmul(qf, kf, transpose_y=True).reshape([hq, rows, sk]) * spec.softmax_scale
    if spec.softcap > 0:
        tanh = paddle.tanh(s / spec.softcap)
        s = tanh * spec.softcap
    row_lse = lse.unsqueeze(-1)  # [Hq, rows, 1]
    live = _full_mask(spec, row0, rows, sq, sk, hq, q.place, startend) & paddle.isfinite(row_lse)
    zero = paddle.zeros([], dtype="float32", device=q.place)
    safe_lse = paddle.where(paddle.isfinite(row_lse), row_lse, paddle.zeros_like(row_lse))
    p = paddle.where(live, paddle.exp(s - safe_lse), zero)  # [Hq, rows, Sk]
    # dP on the visible keys only: a NaN / Inf value row a query does not see must not reach its D or dS
    dp = paddle.where(live, paddle.matmul(dof, vf, transpose_y=True).reshape([hq, rows, sk]), zero)
    # D = rowsum(P dP), equal to rowsum(dout * out) in exact arithmetic but taken from the float32 P and dP:
    # on peaked rows dS = P (dP - D) is far smaller than dP, and the bf16 rounding of out (2^-9 |out|)
    # would exceed it (docs/api.md, "Gradients of peaked rows"). out is then not read.
    delta = paddle.sum(p * dp, axis=-1)  # [Hq, rows]
    if dlse is not None:
        delta = delta - dlse
    # dS = 0 where P = 0 (masked): a row whose D is NaN (it sees a NaN / Inf value) must not reach, through
    # 0 * NaN, the dK of keys it cannot see (the kernels do the same: bwd_sm90's grad_score)
    ds = paddle.where(live, p * (dp - delta.unsqueeze(-1)), zero)
    if spec.softcap > 0:  # tanh only where visible: a NaN / Inf key's tanh must not reach dS through a 0 * NaN
        ds = ds * paddle.where(live, 1.0 - tanh * tanh, zero)
    ds = ds.reshape([hkv, group * rows, sk])
    live = live.expand([hq, rows, sk]).reshape([hkv, group * rows, sk])
    dq = key_matmul(ds, kf, live, _all_finite(kf)) * spec.softmax_scale  # [Hkv, G * rows, D]
    dk = dk + paddle.matmul(ds, qf, transpose_x=True) * spec.softmax_scale
    dv = dv + paddle.matmul(p.reshape([hkv, group * rows, sk]), dof, transpose_x=True)
    return dq.reshape([hq, rows, -1]).transpose([1, 0, 2]), dk, dv

"""FlashMask: attention under a column-wise ``startend_row_indices`` mask, with Paddle's interface.

:func:`flashmask_attention` takes ``paddle.nn.functional.flashmask_attention``'s arguments, defaults
and returns, so replacing the import is the whole migration. It is the attention of
:func:`paddle_fa4.flash_attn_fwd` with the mask as an argument (validation, backend dispatch and the
autograd PyLayer are the attention module's), and :func:`startend_row_indices_from_cu_seqlens` /
:func:`cu_seqlens_from_startend_row_indices` convert between packed-document masks and varlen
``cu_seqlens``. Semantics and pictures: docs/api.md "FlashMask".
"""

from __future__ import annotations

import numpy as np

from . import _validate as V
from ._static import dynamic_only

OP = "flashmask_attention"


@dynamic_only(OP)
def flashmask_attention(query, key, value, startend_row_indices=None, *, dropout=0.0, causal=False,
                        window_size=None, return_softmax_lse=False, return_seed_offset=False,
                        fixed_seed_offset=None, rng_name="", training=True, name=None, softmax_scale=None,
                        block_mask=None, backend="auto", deterministic=False):
    r"""Attention with a FlashMask column mask (``paddle.nn.functional.flashmask_attention``).

    ``startend_row_indices`` holds, per key column ``j``, the query rows masked in that column:
    row ``i`` does not see key ``j`` when ``LTS <= i < LTE`` or ``UTS <= i < UTE``.

    ============  =======  ===========================  ==========================================
    ``causal``    columns  layout                       masked rows of column ``j``
    ============  =======  ===========================  ==========================================
    True          1        ``[LTS]``                    ``i >= LTS`` (and the causal cut ``i < j``)
    True          2        ``[LTS, LTE]``               ``LTS <= i < LTE`` (and ``i < j``)
    False         2        ``[LTS, UTE]``               ``i >= LTS`` or ``i < UTE``
    False         4        ``[LTS, LTE, UTS, UTE]``     ``LTS <= i < LTE`` or ``UTS <= i < UTE``
    ============  =======  ===========================  ==========================================

    The causal cut is bottom-right aligned when ``Sq != Sk`` (row ``i`` sees keys
    ``j <= i + Sk - Sq``). Rows that see no key get ``out`` 0, ``lse`` -inf and zero gradients.

    Args:
        query (Tensor): ``[B, Sq, Hq, D]``, bfloat16 or float16 (float32 on the reference backend).
        key (Tensor): ``[B, Sk, Hkv, D]``, query's dtype, ``Hq % Hkv == 0``.
        value (Tensor): ``[B, Sk, Hkv, Dv]``, query's dtype.
        startend_row_indices (Tensor, optional): int32 ``[B, Hm, Sk, n]`` with ``Hm`` 1 (broadcast),
            ``Hkv`` (query head ``h`` uses its kv head's mask) or ``Hq``; ``n`` as in the table,
            values in ``[0, Sq]``, ``LTS <= LTE`` and ``UTS <= UTE``. None: no column mask (plain
            attention with ``causal`` / ``window_size``).
        dropout (float): must be 0.0 (dropout is not implemented).
        causal (bool): the causal cut; also selects what a 2-column mask means.
        window_size (int | tuple, optional): sliding window ``(left, right)`` (an int ``w`` is
            ``(w, w)``): row ``i`` sees keys ``i' - left <= j <= i' + right`` with
            ``i' = i + Sk - Sq`` (``right`` is 0 under ``causal``). Unlike Paddle's op, it may be
            combined with ``startend_row_indices`` (both masks apply); alone it equals Paddle's
            window when ``Sq == Sk``.
        return_softmax_lse (bool): also return ``lse``.
        return_seed_offset, fixed_seed_offset, rng_name, training: dropout arguments; with
            ``dropout=0.0`` ``rng_name`` and ``training`` change nothing and are accepted;
            ``return_seed_offset=True`` or a ``fixed_seed_offset`` raise NotImplementedError.
        name (str, optional): ignored (Paddle's op name).
        softmax_scale (float, optional): default ``D ** -0.5``.
        block_mask (Tensor, optional): must be None (FlashMask's extra block mask is not implemented).
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"`` (not a Paddle argument).
        deterministic (bool): bitwise reproducible backward (not a Paddle argument).

    Returns:
        Tensor | tuple: ``out`` ``[B, Sq, Hq, Dv]`` in query's dtype, or ``(out, lse)`` with
        ``return_softmax_lse`` (``lse`` float32 ``[B, Hq, Sq]``, natural log, -inf on rows that see
        no key, not differentiable). ``out`` is differentiable w.r.t. query, key and value.

    Raises:
        TypeError / ValueError: bad tensors, dtypes, shapes, a column count that does not match
            ``causal``, values outside ``[0, Sq]`` or an interval start above its end (value checks
            only for CPU tensors; on the GPU out-of-range values act as if clamped to ``[0, Sq]``
            and an interval whose start is not below its end masks nothing; memory stays safe, the
            bounds are only compared with row indices).
        NotImplementedError: ``dropout != 0``, ``block_mask``, seed/offset arguments, or
            ``backend="cute"`` for a case no kernel covers.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 6, 2, 16])
            >>> mask = paddle_fa4.startend_row_indices_from_cu_seqlens(
            ...     paddle.to_tensor([0, 2, 6], dtype="int32"), causal=True)
            >>> mask.numpy().ravel().tolist()
            [2, 2, 6, 6, 6, 6]
            >>> out = paddle_fa4.flashmask_attention(q, q, q, mask, causal=True, backend="reference")
            >>> out.shape
            paddle.Size([1, 6, 2, 16])
    """
    from .attention import _attention

    dropout = V.check_float(OP, "dropout", dropout)
    if dropout != 0.0:
        raise NotImplementedError(f"{OP}: dropout={dropout} is not implemented (dropout must be 0.0)")
    if block_mask is not None:
        raise NotImplementedError(f"{OP}: block_mask (FlashMask's block-level mask) is not implemented; "
                                  f"leave it None")
    if return_seed_offset:
        raise NotImplementedError(f"{OP}: return_seed_offset=True is a dropout option; dropout is not "
                                  f"implemented")
    if fixed_seed_offset is not None:
        raise NotImplementedError(f"{OP}: fixed_seed_offset is a dropout option; dropout is not implemented")
    V.check_bool(OP, "training", training)
    V.check_bool(OP, "return_softmax_lse", return_softmax_lse)
    if not isinstance(rng_name, str):
        raise TypeError(f"{OP}: rng_name must be a str, got {type(rng_name).__name__}")
    window = _window(window_size)
    out, lse, _ = _attention(
        OP, query, key, value, softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=0.0,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_logit=None,
        block_size=64, return_block_logit=False, pack_gqa=None, backend=backend, deterministic=deterministic,
        lse_grad=False, startend_row_indices=startend_row_indices, stacklevel=6)
    return (out, lse) if return_softmax_lse else out


def _window(window_size):
    """Paddle's ``window_size`` (None, an int, or a pair) as ``flash_attn_fwd``'s ``(left, right)``."""
    if window_size is None:
        return (None, None)
    if isinstance(window_size, bool):
        raise TypeError(f"{OP}: window_size must be an int or a (left, right) pair, got a bool")
    if isinstance(window_size, (int, np.integer)):
        return (int(window_size), int(window_size))
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        return tuple(window_size)
    raise ValueError(f"{OP}: window_size must be None, an int or a (left, right) pair, got {window_size!r}")


# ----------------------------------------------------------------------------------------------
# packed documents <-> varlen


def startend_row_indices_from_cu_seqlens(cu_seqlens, *, causal=True, seqlen=None):
    """The FlashMask mask of documents packed into one row (or one per batch row).

    Document ``d`` covers tokens ``[cu_seqlens[d], cu_seqlens[d + 1])``; each token sees the tokens
    of its own document only: with ``causal=True`` the earlier ones and itself
    (``[LTS] = [document end]``, used with ``causal=True``), else all of them
    (``[LTS, UTE] = [document end, document start]``, used with ``causal=False``). Tokens from
    ``cu_seqlens[-1]`` up to ``seqlen`` are padding: no token sees them (``LTS = 0``) and they see
    nothing (out 0, lse -inf, zero gradients).

    Args:
        cu_seqlens (Tensor | list): int32 ``[N + 1]`` (starts at 0, non-decreasing), or a list of
            such tensors, one per batch row. Values are read on the host (a device sync for GPU
            tensors).
        causal (bool): causal (``[B, 1, S, 1]``) or bidirectional (``[B, 1, S, 2]``) documents.
        seqlen (int, optional): the row length ``S``, at least every ``cu_seqlens[-1]``; default
            the largest ``cu_seqlens[-1]``.

    Returns:
        Tensor: int32 ``[B, 1, S, 1]`` (causal) or ``[B, 1, S, 2]``, on ``cu_seqlens``' place.
    """
    import paddle

    op = "startend_row_indices_from_cu_seqlens"
    V.check_bool(op, "causal", causal)
    rows = list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else [cu_seqlens]
    if not rows:
        raise ValueError(f"{op}: cu_seqlens must hold at least one tensor")
    host = []
    for i, t in enumerate(rows):
        label = "cu_seqlens" if len(rows) == 1 and not isinstance(cu_seqlens, (list, tuple)) else f"cu_seqlens[{i}]"
        V.check_tensor(op, label, t)
        V.check_dtype(op, label, t, ("int32",))
        V.check_rank(op, label, t, (1,), "1-D [N + 1]")
        values = t.numpy().astype(np.int64)
        if values.size == 0 or values[0] != 0 or (np.diff(values) < 0).any():
            raise ValueError(f"{op}: {label} must start at 0 and be non-decreasing, got {values.tolist()}")
        host.append(values)
    total = max(int(v[-1]) for v in host)
    seqlen = total if seqlen is None else V.check_int(op, "seqlen", seqlen, low=total)
    out = np.empty((len(host), 1, seqlen, 1 if causal else 2), dtype=np.int32)
    for b, cu in enumerate(host):
        lts = np.zeros(seqlen, dtype=np.int64)  # padding: LTS 0 hides the column from every row
        ute = np.zeros(seqlen, dtype=np.int64)
        for start, end in zip(cu[:-1], cu[1:]):
            lts[start:end] = end
            ute[start:end] = start
        out[b, 0, :, 0] = lts
        if not causal:
            out[b, 0, :, 1] = ute
    return paddle.to_tensor(out, dtype="int32", place=rows[0].place)


def cu_seqlens_from_startend_row_indices(startend_row_indices, *, causal=True):
    """The varlen form of a packed-document FlashMask mask: ``(cu_seqlens, max_seqlen)``.

    The inverse of :func:`startend_row_indices_from_cu_seqlens`: the mask must be a document mask
    (``causal=True``: ``[B, Hm, S, 1]`` with ``LTS`` = the end of the column's document;
    ``causal=False``: ``[B, Hm, S, 2]`` with ``[LTS, UTE]`` = its end and start), the same for
    every head. Batch rows are laid end to end (row ``b``'s tokens start at ``b * S``, as
    ``q.reshape([B * S, H, D])``); padding columns (``LTS = 0``, seen by no row) may only form the
    tail of the last row, which the returned ``cu_seqlens`` then leaves out.

    Args:
        startend_row_indices (Tensor): int32, as above. Values are read on the host (a device
            sync for GPU tensors).
        causal (bool): how the mask is used (as for :func:`flashmask_attention`).

    Returns:
        tuple: ``(cu_seqlens int32 [N + 1] on the mask's place, max_seqlen int)``.

    Raises:
        ValueError: the mask is not a document mask (no varlen form exists), its heads differ,
            or padding sits anywhere but the very end.
    """
    import paddle

    op = "cu_seqlens_from_startend_row_indices"
    name = "startend_row_indices"
    V.check_bool(op, "causal", causal)
    V.check_tensor(op, name, startend_row_indices)
    V.check_dtype(op, name, startend_row_indices, ("int32",))
    V.check_rank(op, name, startend_row_indices, (4,), "[B, H, S, n]")
    cols = 1 if causal else 2
    if startend_row_indices.shape[-1] != cols:
        raise ValueError(f"{op}: a {'causal' if causal else 'bidirectional'} document mask has {cols} "
                         f"column(s), got {startend_row_indices.shape[-1]}")
    values = startend_row_indices.numpy().astype(np.int64)
    if (values != values[:, :1]).any():
        raise ValueError(f"{op}: the mask differs between heads; a varlen call has one document layout")
    batch, seqlen = values.shape[0], values.shape[2]
    bounds = [0]
    for b in range(batch):
        lts = values[b, 0, :, 0]
        ute = values[b, 0, :, 1] if not causal else None
        j = 0
        while j < seqlen:
            end = int(lts[j])
            if end == 0:  # padding: must run to the end of the last row
                if b != batch - 1 or (lts[j:] != 0).any() or (ute is not None and (ute[j:] != 0).any()):
                    raise ValueError(f"{op}: padding column (LTS 0) at [b={b}, key={j}] is not part of the "
                                     f"trailing padding of the last row; no cu_seqlens describes it")
                break
            if end <= j or end > seqlen or (lts[j:end] != end).any() or (ute is not None and (ute[j:end] != j).any()):
                raise ValueError(f"{op}: not a document mask at [b={b}, key={j}]: the columns of a document "
                                 f"[start, end) must hold LTS = end" + ("" if causal else " and UTE = start"))
            bounds.append(b * seqlen + end)
            j = end
    cu = np.asarray(bounds, dtype=np.int32)
    max_seqlen = int(np.diff(cu).max(initial=0))
    return paddle.to_tensor(cu, dtype="int32", place=startend_row_indices.place), max_seqlen

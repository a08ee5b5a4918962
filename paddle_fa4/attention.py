"""Attention forward with fused ``block_logit`` and natural-log LSE, its backward and autograd.
See ``docs/api.md``.

:func:`flash_attn_fwd` validates its arguments into a frozen :class:`AttnFwdSpec`, resolves the
backend, allocates the outputs with ``paddle.empty`` on ``q.place`` (a caller's ``block_logit``
buffer is used as is). :func:`flash_attn_func` / :func:`flash_attn_varlen_func` are FA4-compatible
faces of the same call (``_attention``) and calls an out-parameter implementation: the pure-Paddle reference
(``paddle_fa4.reference.attention``) or the CuTe glue (``paddle_fa4._cute.attention``), both with
the call ``impl.flash_attn_fwd(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k)``.

When an input needs gradients (and grad mode is on) the forward runs inside the private PyLayer
``_FlashAttnFn``, whose backward calls ``impl.flash_attn_bwd(spec, dout, q, k, v, out, lse, dlse,
dq, dk, dv, cu_seqlens_q, cu_seqlens_k, deterministic=...) -> (dq, dk, dv)`` on the backward's own
backend (``_bwd_backend``: ``auto`` may run the CuTe forward and the reference backward).
:func:`flash_attn_bwd` is the same backward as a public op, validated with the forward's rules.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

from paddle.autograd import PyLayer

from . import _validate as V
from ._bridge import as_contiguous
from .backend import resolve_backend
from ._spec import AttnFwdSpec
from ._static import dynamic_only

OP = "flash_attn_fwd"
BWD_OP = "flash_attn_bwd"

#: block_logit key-block sizes.
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: Largest head dim the reference backend takes (the kernels take 64, 96, 128, 192, 256).
MAX_HEAD_DIM = 256


@dynamic_only("flash_attn_fwd")
def flash_attn_fwd(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   block_logit=None, block_size=64, return_block_logit=False, pack_gqa=None,
                   backend="auto", deterministic=False, return_lse=False, startend_row_indices=None,
                   block_bos=None):
    r"""Attention forward; optionally the per-(row, key block) max logit ``block_logit``.

    Row ``i`` of a sequence with lengths ``(Sq, Sk)`` sees key ``t`` when
    ``i + Sk - Sq - left <= t <= i + Sk - Sq + right`` (bottom-right aligned, as FA4), where
    ``(left, right) = window_size`` (None = unbounded) and ``causal`` means ``right = 0``.
    The logit fed to softmax is ``s = softmax_scale * q_i . k_t``, or
    ``softcap * tanh(s / softcap)`` when ``softcap > 0``.

    Args:
        q (Tensor): ``[B, Sq, Hq, D]`` (varlen: ``[total_q, Hq, D]``), bfloat16 or float16
            (float32 on the reference backend only). Strided views (e.g. slices of a fused qkv
            projection) are accepted for q, k, v: the CuTe backend reads contiguous copies.
        k (Tensor): ``[B, Sk, Hkv, D]`` (varlen: ``[total_k, Hkv, D]``), q's dtype; ``Hq % Hkv == 0``
            and query head ``h`` uses kv head ``h // (Hq // Hkv)``.
        v (Tensor): ``[B, Sk, Hkv, Dv]`` (varlen: ``[total_k, Hkv, Dv]``), q's dtype.
        softmax_scale (float, optional): default ``D ** -0.5``.
        causal (bool): bottom-right causal mask.
        window_size (tuple): ``(left, right)``; each None (or -1) = unbounded, else an int >= 0.
            With ``causal`` the right bound is ``min(right, 0)``.
        softcap (float): ``>= 0``; 0 disables the cap.
        cu_seqlens_q (Tensor, optional): int32 (or int64, converted) ``[B + 1]``, starts at 0, non-decreasing; enables
            varlen together with ``cu_seqlens_k``.
        cu_seqlens_k (Tensor, optional): int32 ``[B + 1]``, as ``cu_seqlens_q``.
        max_seqlen_q (int, optional): longest query sequence; required with varlen.
        max_seqlen_k (int, optional): longest key sequence; required with varlen.
        block_logit (Tensor, optional): float32 ``[B, Hq, Sq, ceil(Sk / block_size)]`` (varlen:
            ``[Hq, total_q, ceil(max_seqlen_k / block_size)]``) to fill; every entry is written
            (a strided view through a contiguous temporary on the CuTe backend, copied back).
        block_size (int): key-block size of ``block_logit``: 16, 32, 64, 128 or 256.
        return_block_logit (bool): allocate and return ``block_logit``.
        pack_gqa (bool, optional): GQA packing hint for the kernels; results do not depend on it.
            True cannot be combined with ``block_logit``; None resolves to no packing then.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.
        deterministic (bool): the backward of this call (autograd) is bitwise
            reproducible (see :func:`flash_attn_bwd`). The forward is deterministic either way.
        return_lse (bool): ``lse`` is differentiable, as in :func:`flash_attn_func` (its gradient
            reaches q and k through the backward's ``dlse``); the return value is the same either way.
        startend_row_indices (Tensor, optional): a FlashMask column mask, int32
            ``[B, 1 | Hkv | Hq, Sk, n]`` (dense layout only), combined with ``causal`` and
            ``window_size``: ``n`` is 1 (``[LTS]``) or 2 (``[LTS, LTE]``) with ``causal=True``,
            2 (``[LTS, UTE]``) or 4 (``[LTS, LTE, UTS, UTE]``) with ``causal=False``; see
            :func:`paddle_fa4.flashmask_attention` and docs/api.md "FlashMask".
        block_bos (Tensor, optional): int32 ``[B, Sq]``, with ``block_logit`` only: block ``j`` of
            query ``i`` covers keys ``[bos_i + j * block_size, bos_i + (j + 1) * block_size)``
            (document-relative blocks, as PaddleFleet's HySparse layer passes them); keys before
            ``bos_i`` belong to no block. The shape of ``block_logit`` does not change.

    Returns:
        tuple: ``(out, lse)``, or ``(out, lse, block_logit)`` when ``block_logit`` is given or
        ``return_block_logit`` is True. ``out`` ``[B, Sq, Hq, Dv]`` (varlen ``[total_q, Hq, Dv]``)
        in q's dtype, 0 on rows with no visible key; ``lse`` float32 ``[B, Hq, Sq]`` (varlen
        ``[Hq, total_q]``), natural log of the softmax normaliser, -inf on rows with no visible
        key; ``block_logit`` float32, the max visible logit of each key block (block indices
        relative to each sequence's start), -inf where the block has no visible key.
        ``out`` is differentiable w.r.t. ``q``, ``k`` and ``v`` (those with
        ``stop_gradient=False``) when gradients are enabled, and so is ``lse`` with ``return_lse``;
        otherwise ``lse`` has ``stop_gradient=True``, and ``block_logit`` always has.

    Raises:
        TypeError: a tensor argument of the wrong type or dtype, or a non-int/float option.
        ValueError: inconsistent shapes or places, bad ``cu_seqlens``/``block_size``/``window_size``/
            ``softcap``, ``pack_gqa=True`` with ``block_logit``, or an unknown ``backend``.
        NotImplementedError: a head dim above 256, or ``backend="cute"`` when no kernel applies
            (for inputs that need gradients: when no backward kernel applies either).

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 8, 2, 64]).astype("bfloat16")
            >>> k = paddle.randn([1, 12, 2, 64]).astype("bfloat16")
            >>> out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, k, causal=True, block_size=16,
            ...                                          return_block_logit=True, backend="reference")
            >>> bl.shape
            paddle.Size([1, 2, 8, 1])
    """
    out, lse, block_logit = _attention(
        OP, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, block_logit=block_logit, block_size=block_size,
        return_block_logit=return_block_logit, pack_gqa=pack_gqa, backend=backend,
        deterministic=deterministic, lse_grad=V.check_bool(OP, "return_lse", return_lse),
        startend_row_indices=startend_row_indices, block_bos=block_bos)
    if block_logit is not None:
        return out, lse, block_logit
    return out, lse


def _attention(op, q, k, v, *, softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
               max_seqlen_q, max_seqlen_k, block_logit, block_size, return_block_logit, pack_gqa, backend,
               deterministic, lse_grad, startend_row_indices=None, block_bos=None, stacklevel=5):
    """``(out, lse, block_logit or None)`` of every forward entry point (validated with ``op``'s name).

    ``lse_grad``: ``lse`` is differentiable (``flash_attn_func(..., return_lse=True)``, as FA4);
    the backward then reads its gradient as ``dlse``. ``startend_row_indices``/``block_bos``: the
    FlashMask mask and block origins (``flash_attn_fwd``, ``flashmask_attention``).
    """
    import paddle

    cu_seqlens_q, cu_seqlens_k = _cu_seqlens_int32(op, cu_seqlens_q, cu_seqlens_k)
    startend_row_indices, block_bos = _mask_int32(op, startend_row_indices, block_bos)
    spec = _validate(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, block_logit, block_size, return_block_logit, pack_gqa, op=op,
                     startend_row_indices=startend_row_indices, block_bos=block_bos)
    mask = _Mask(startend_row_indices, block_bos)
    V.check_bool(op, "deterministic", deterministic)
    fwd_backend = resolve_backend(op, backend, q, functools.partial(_unsupported_reason, spec=spec),
                                  auto_reason=functools.partial(_unverified_reason, spec=spec),
                                  stacklevel=stacklevel)
    if spec.has_block_logit and block_logit is None:
        sizes = (f"max_seqlen_q={spec.seqlen_q}, max_seqlen_k={spec.seqlen_k}" if spec.varlen else
                 f"Sq={spec.seqlen_q}, Sk={spec.seqlen_k}") + f" and block_size={spec.block_size}"
        with V.sized_by(op, f"block_logit {spec.block_logit_shape()} float32", sizes):
            block_logit = paddle.empty(spec.block_logit_shape(), dtype="float32", device=q.place)
    if not spec.has_block_logit:
        block_logit = None
    if _needs_grad(q, k, v):
        bwd_backend = _bwd_backend(backend, q, spec, deterministic, has_dlse=lse_grad, stacklevel=stacklevel + 1)
        out, lse = _FlashAttnFn.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, block_logit, startend_row_indices,
                                      block_bos, spec, fwd_backend, bwd_backend, deterministic, lse_grad)
    else:
        out, lse = _forward(spec, fwd_backend, q, k, v, block_logit, cu_seqlens_q, cu_seqlens_k, mask)
    return out, lse, block_logit


class _Mask:
    """The FlashMask tensors of a call (either may be None), passed to the backends as keywords."""

    def __init__(self, startend_row_indices=None, block_bos=None):
        self.startend_row_indices, self.block_bos = startend_row_indices, block_bos

    def fwd_kwargs(self) -> dict:
        """Keywords of ``impl.flash_attn_fwd`` (empty without a mask: the dense contract)."""
        kw = {}
        if self.startend_row_indices is not None:
            kw["startend_row_indices"] = self.startend_row_indices
        if self.block_bos is not None:
            kw["block_bos"] = self.block_bos
        return kw

    def bwd_kwargs(self) -> dict:
        """Keywords of ``impl.flash_attn_bwd`` (block_bos only shapes block_logit: not read)."""
        if self.startend_row_indices is None:
            return {}
        return {"startend_row_indices": self.startend_row_indices}


#: FA4 b36 keywords of ``flash_attn_func`` / ``flash_attn_varlen_func`` with no counterpart here:
#: accepted only at their FA4 defaults (None / False), else NotImplementedError naming them.
FA4_UNSUPPORTED = {
    "qv": "MLA weight absorption (qv)",
    "gather_kv_indices": "gathered-KV sparse MLA (use indexed_attention)",
    "learnable_sink": "learnable attention sinks",
    "score_mod": "score_mod callbacks",
    "score_mod_bwd": "score_mod callbacks",
    "mask_mod": "mask_mod callbacks",
    "aux_tensors": "score_mod/mask_mod aux tensors",
    "aux_scalars": "score_mod/mask_mod aux scalars",
    "block_sparse_tensors": "FA4 block sparsity (use select_topk_blocks + indexed_attention)",
    "block_sparse_tensors_bwd": "FA4 block sparsity",
    "gather_bwd_recompute_p": "gathered-KV sparse MLA backward options",
    "gather_bwd_token_chunk": "gathered-KV sparse MLA backward options",
}
#: Additional FA4 b36 keywords of ``flash_attn_varlen_func`` only.
FA4_VARLEN_UNSUPPORTED = {
    "seqused_q": "seqused_q (per-sequence used lengths)",
    "seqused_k": "seqused_k (per-sequence used lengths)",
    "page_table": "paged KV (page_table)",
    "scheduler_metadata": "scheduler metadata",
    "seqlen_k_per_split": "split-KV options",
}
#: FA4 performance hints accepted and ignored (results do not depend on them here).
FA4_HINTS = ("num_splits", "min_seqlen_k", "disable_scheduler_metadata")


def _check_fa4_extras(op: str, extras: dict, varlen: bool) -> None:
    """Reject FA4-only keywords that would change the result; unknown keywords are a TypeError."""
    table = dict(FA4_UNSUPPORTED, **(FA4_VARLEN_UNSUPPORTED if varlen else {}))
    hints = FA4_HINTS if varlen else ("num_splits",)
    for name, value in extras.items():
        if name in hints:
            continue
        if name not in table:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
        if value is not None and value is not False:
            raise NotImplementedError(
                f"{op}: {name} is an FA4 option paddle_fa4 does not implement ({table[name]}); leave it "
                f"at its default (None)")


@dynamic_only("flash_attn_func")
def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                    pack_gqa=None, deterministic=False, return_lse=False, block_logit=None, block_size=64,
                    return_block_logit=False, backend="auto", **fa4_options):
    r"""FA4-compatible attention forward (``flash_attn.cute.flash_attn_func``, b36), with autograd.

    The same attention as :func:`flash_attn_fwd` (dense layout ``[B, S, H, D]``; mask, scale,
    softcap and GQA semantics identical) under FA4's names and return convention. Every option is
    keyword-only.

    Args:
        q, k, v (Tensor): as :func:`flash_attn_fwd` (dense layout). Strided views are accepted.
        softmax_scale, causal, window_size, softcap, pack_gqa, deterministic: as
            :func:`flash_attn_fwd` (and as FA4).
        return_lse (bool): as FA4: ``lse`` is differentiable (its gradient reaches q and k through
            the backward's ``dlse``). Default False: ``lse`` is returned anyway but does not carry
            gradients.
        block_logit, block_size, return_block_logit: the fused per-(row, key block) max logit, as
            :func:`flash_attn_fwd` (not an FA4 option).
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.
        **fa4_options: FA4 b36 keywords. ``num_splits`` is a performance hint and ignored; the others
            (``qv``, ``gather_kv_indices``, ``learnable_sink``, ``score_mod``, ``score_mod_bwd``,
            ``mask_mod``, ``aux_tensors``, ``aux_scalars``, ``block_sparse_tensors``,
            ``block_sparse_tensors_bwd``, ``gather_bwd_recompute_p``, ``gather_bwd_token_chunk``)
            raise NotImplementedError unless left at their defaults. Any other name is a TypeError.

    Returns:
        tuple: ``(out, lse)`` as FA4 b36 (which returns the pair whether or not ``return_lse`` is
        set; ``lse`` float32 ``[B, Hq, Sq]``, natural log), or ``(out, lse, block_logit)`` when a
        ``block_logit`` is given or ``return_block_logit`` is True.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 8, 2, 64]).astype("bfloat16")
            >>> out, lse = paddle_fa4.flash_attn_func(q, q, q, causal=True, backend="reference")
            >>> out.shape, lse.shape
            (paddle.Size([1, 8, 2, 64]), paddle.Size([1, 2, 8]))
    """
    op = "flash_attn_func"
    _check_fa4_extras(op, fa4_options, varlen=False)
    V.check_bool(op, "return_lse", return_lse)
    out, lse, block_logit = _attention(
        op, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_logit=block_logit,
        block_size=block_size, return_block_logit=return_block_logit, pack_gqa=pack_gqa, backend=backend,
        deterministic=deterministic, lse_grad=return_lse)
    return (out, lse) if block_logit is None else (out, lse, block_logit)


@dynamic_only("flash_attn_varlen_func")
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                           pack_gqa=None, deterministic=False, return_lse=False, block_logit=None,
                           block_size=64, return_block_logit=False, backend="auto", **fa4_options):
    r"""FA4-compatible varlen attention forward (``flash_attn.cute.flash_attn_varlen_func``, b36).

    The packed layout of :func:`flash_attn_fwd`: ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``,
    ``v [total_k, Hkv, Dv]``, int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``[B + 1]``. Unlike FA4,
    ``cu_seqlens_q``/``cu_seqlens_k`` are required (FA4's ``seqused_*`` alternative is not
    implemented) and may be passed positionally after ``v``; everything after them is keyword-only.

    Args:
        max_seqlen_q, max_seqlen_k (int, optional): longest query / key sequence. When None it is
            computed from the cu_seqlens on the host: for GPU tensors that copies them to the CPU
            and **synchronises with the device** (pass the ints to avoid it, e.g. under CUDA graphs).
        return_lse (bool): ``lse`` ``[Hq, total_q]`` is differentiable, as FA4.
        other options: as :func:`flash_attn_func`; FA4's ``min_seqlen_k``, ``num_splits`` and
            ``disable_scheduler_metadata`` are hints and ignored; ``seqused_q``, ``seqused_k``,
            ``page_table``, ``scheduler_metadata``, ``seqlen_k_per_split`` and the keywords
            :func:`flash_attn_func` rejects raise NotImplementedError unless left at None.

    Returns:
        tuple: ``(out, lse)`` (``out [total_q, Hq, Dv]``, ``lse [Hq, total_q]``), or
        ``(out, lse, block_logit)`` (``block_logit [Hq, total_q, ceil(max_seqlen_k / block_size)]``).

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([12, 2, 64]).astype("bfloat16")
            >>> cu = paddle.to_tensor([0, 5, 12], dtype="int32")
            >>> out, lse = paddle_fa4.flash_attn_varlen_func(q, q, q, cu, cu, causal=True, backend="reference")
            >>> out.shape, lse.shape
            (paddle.Size([12, 2, 64]), paddle.Size([2, 12]))
    """
    op = "flash_attn_varlen_func"
    _check_fa4_extras(op, fa4_options, varlen=True)
    V.check_bool(op, "return_lse", return_lse)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is None:
            raise ValueError(f"{op}: {name} is required (FA4's seqused_q/seqused_k are not supported)")
    cu_seqlens_q, cu_seqlens_k = _cu_seqlens_int32(op, cu_seqlens_q, cu_seqlens_k)
    max_seqlen_q = _max_seqlen(op, "cu_seqlens_q", cu_seqlens_q, max_seqlen_q)
    max_seqlen_k = _max_seqlen(op, "cu_seqlens_k", cu_seqlens_k, max_seqlen_k)
    out, lse, block_logit = _attention(
        op, q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, block_logit=block_logit, block_size=block_size,
        return_block_logit=return_block_logit, pack_gqa=pack_gqa, backend=backend,
        deterministic=deterministic, lse_grad=return_lse)
    return (out, lse) if block_logit is None else (out, lse, block_logit)


def _cu_seqlens_int32(op: str, cu_seqlens_q, cu_seqlens_k):
    """The cu_seqlens as int32 (int64 converted once, ``_validate.index_tensor``); None stays None."""
    return tuple(None if t is None else V.index_tensor(op, name, t, padding=False)
                 for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))


def _mask_int32(op: str, startend_row_indices, block_bos):
    """The FlashMask index tensors as int32 (int64 converted once, value-checked on the host as any
    row index: ``_validate.index_tensor``); None stays None."""
    return tuple(None if t is None else V.index_tensor(op, name, t, padding=False)
                 for name, t in (("startend_row_indices", startend_row_indices), ("block_bos", block_bos)))


def _max_seqlen(op: str, name: str, cu_seqlens, given):
    """``given``, or the longest sequence of ``cu_seqlens`` read on the host (a device sync on GPU)."""
    if given is not None:
        return given
    V.check_tensor(op, name, cu_seqlens)
    V.check_dtype(op, name, cu_seqlens, ("int32",))
    V.check_rank(op, name, cu_seqlens, (1,), "1-D [B + 1]")
    if cu_seqlens.shape[0] < 2:
        return 0
    values = cu_seqlens.numpy()  # copies to the host: synchronises with the GPU
    return int((values[1:] - values[:-1]).max(initial=0))


def _needs_grad(*tensors) -> bool:
    """Whether autograd must record the call: grad mode on and some input not frozen."""
    import paddle

    return paddle.is_grad_enabled() and any(not t.stop_gradient for t in tensors)


def _forward(spec: AttnFwdSpec, backend: str, q, k, v, block_logit, cu_seqlens_q, cu_seqlens_k, mask=None):
    """``(out, lse)`` of a validated call on the resolved backend; ``block_logit`` (or None) is filled."""
    import paddle

    out = paddle.empty(spec.out_shape(), dtype=q.dtype, device=q.place)
    lse = paddle.empty(spec.lse_shape(), dtype="float32", device=q.place)
    if _is_empty(spec):
        _fill_no_keys(out, lse, block_logit)
    else:
        _impl(backend).flash_attn_fwd(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k,
                                      **(mask or _Mask()).fwd_kwargs())
    return out, lse


class _FlashAttnFn(PyLayer):
    """Autograd of :func:`flash_attn_fwd`, shared by both backends.

    Tensor inputs (Paddle counts them strictly, one backward slot each): q, k, v, then each of
    cu_seqlens_q, cu_seqlens_k, block_logit, startend_row_indices and block_bos that is not None.
    ``block_logit`` is an in-place output (filled by the forward, never differentiated). Saved: q,
    k, v, out, lse (and the cu_seqlens of a varlen call and a FlashMask ``startend_row_indices``,
    which its backward reads); never block_logit or block_bos. A strided q/k/v
    view (e.g. a slice of a fused qkv projection) is saved as a contiguous copy.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, block_logit, startend_row_indices, block_bos, spec,
                fwd_backend, bwd_backend, deterministic, lse_grad=False):
        out, lse = _forward(spec, fwd_backend, q, k, v, block_logit, cu_seqlens_q, cu_seqlens_k,
                            _Mask(startend_row_indices, block_bos))
        ctx.state = (spec, bwd_backend, deterministic, lse_grad)
        ctx.needs_grad = tuple(not t.stop_gradient for t in (q, k, v))
        ctx.extra_slots = sum(t is not None for t in (cu_seqlens_q, cu_seqlens_k, block_logit,
                                                      startend_row_indices, block_bos))
        # Strided views are saved as contiguous copies: Paddle 3.3's non-reentrant recompute
        # restores a saved view from its base buffer without the strides (wrong values).
        saved = tuple(as_contiguous(t) for t in (q, k, v)) + (out, lse)
        if spec.varlen:
            saved += (as_contiguous(cu_seqlens_q), as_contiguous(cu_seqlens_k))
        if spec.startend:
            saved += (as_contiguous(startend_row_indices),)
        ctx.save_for_backward(*saved)
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        import paddle

        if paddle.is_grad_enabled():
            raise NotImplementedError(
                f"{OP}: double backward (create_graph=True) is not supported; its backward is not "
                f"differentiable")
        spec, bwd_backend, deterministic, lse_grad = ctx.state
        saved = ctx.saved_tensor()
        q, k, v, out, lse = saved[:5]
        cu_seqlens_q, cu_seqlens_k = saved[5:7] if spec.varlen else (None, None)
        mask = _Mask(saved[-1] if spec.startend else None)
        # Unless lse_grad, lse is not differentiable (dlse is Paddle's materialised zeros): the
        # backward reads dout only. With lse_grad (flash_attn_func(return_lse=True)) dlse is passed on.
        if not any(ctx.needs_grad):
            grads = (None, None, None)
        else:
            if dout is None:
                dout = paddle.zeros_like(out)
            if not lse_grad:
                dlse = None
            elif dlse is None:
                dlse = paddle.zeros_like(lse)
            grads = _backward(spec, bwd_backend, as_contiguous(dout), q, k, v, out, lse, as_contiguous(dlse),
                              None, None, None, cu_seqlens_q, cu_seqlens_k, deterministic, mask)
        return tuple(g if need else None for need, g in zip(ctx.needs_grad, grads)) + (None,) * ctx.extra_slots


def _backward(spec: AttnFwdSpec, backend: str, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q,
              cu_seqlens_k, deterministic: bool, mask=None):
    """``(dq, dk, dv)`` of a validated call on the resolved backward backend (out-params or None)."""
    if _is_empty(spec):  # no row sees a key: every gradient is zero, nothing to launch
        return tuple(_zeros_into(g, t) for g, t in ((dq, q), (dk, k), (dv, v)))
    return _impl(backend).flash_attn_bwd(spec, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q,
                                         cu_seqlens_k, deterministic=deterministic,
                                         **(mask or _Mask()).bwd_kwargs())


def _zeros_into(buf, like):
    """A zero gradient shaped like ``like``: written into ``buf`` when given."""
    import paddle

    with paddle.no_grad():
        zeros = paddle.zeros(like.shape, dtype=like.dtype, device=like.place)
        if buf is None:
            return zeros
        if not V.is_empty(buf):
            paddle.assign(zeros, buf)
        return buf


@dynamic_only("flash_attn_bwd")
def flash_attn_bwd(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(None, None),
                   softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   dlse=None, deterministic=False, dq=None, dk=None, dv=None, backend="auto",
                   startend_row_indices=None):
    r"""Attention backward: ``(dq, dk, dv)`` of a :func:`flash_attn_fwd` call, for callers that run
    their own autograd or recompute (e.g. a PaddleFleet PyLayer).

    Same mask, scale, softcap, GQA and varlen semantics (and the same argument checks) as
    :func:`flash_attn_fwd`. With ``P = exp(s - lse)`` over the visible keys,
    ``D = rowsum(dout * out) - dlse``, ``dP = dout V^T`` and ``dS = P * (dP - D)`` (times
    ``1 - tanh^2(s / softcap)`` with softcap), the results are ``dq = softmax_scale dS K``,
    ``dk = softmax_scale dS^T Q`` (summed over the query heads of each kv head) and ``dv = P^T dout``.
    Rows without a visible key (``lse = -inf``) contribute nothing; key rows no query sees get 0.
    The reference backend takes ``D = rowsum(P * dP) - dlse`` (equal in exact arithmetic, free of
    ``out``'s rounding, which matters on rows peaked on one key; docs/api.md, "Gradients of peaked
    rows"); the CuTe kernels compute it from ``out``, as FA4 does.

    Args:
        dout (Tensor): gradient of ``out``, ``out``'s shape and q's dtype. A non-contiguous
            tensor is copied.
        q, k, v (Tensor): the forward's inputs.
        out (Tensor): the forward's ``out`` (``[B, Sq, Hq, Dv]``, varlen ``[total_q, Hq, Dv]``).
        lse (Tensor): the forward's float32 ``lse`` (``[B, Hq, Sq]``, varlen ``[Hq, total_q]``).
        softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k: exactly as passed to the forward.
        dlse (Tensor, optional): float32 gradient of ``lse`` (``lse``'s shape), for callers whose
            loss reads ``lse``; None = 0.
        deterministic (bool): bitwise reproducible results (the CuTe kernels then sum dq in a fixed
            order; the reference is deterministic anyway).
        dq, dk, dv (Tensor, optional): out-parameters (shape and dtype of q, k, v), every element
            written; allocated with ``paddle.empty`` when None.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.
        startend_row_indices (Tensor, optional): the forward's FlashMask mask, exactly as passed
            to it (with the same ``causal``).

    Returns:
        tuple: ``(dq, dk, dv)`` in the dtypes of q, k, v, ``stop_gradient=True``.

    Raises:
        TypeError: a non-tensor argument; ``dout``/``out`` not q's dtype, ``lse``/``dlse`` not
            float32, an out-parameter of the wrong dtype; the forward's type errors.
        ValueError: ``dout``/``out``/``lse``/``dlse``/an out-parameter of the wrong shape or place;
            the forward's value errors; an unknown ``backend``.
        NotImplementedError: a head dim above 256, or ``backend="cute"`` when no backward kernel
            applies.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 8, 2, 16])
            >>> out, lse = paddle_fa4.flash_attn_fwd(q, q, q, causal=True, backend="reference")
            >>> dq, dk, dv = paddle_fa4.flash_attn_bwd(paddle.ones_like(out), q, q, q, out, lse, causal=True,
            ...                                        backend="reference")
            >>> dq.shape, dv.shape
            (paddle.Size([1, 8, 2, 16]), paddle.Size([1, 8, 2, 16]))
    """
    cu_seqlens_q, cu_seqlens_k = _cu_seqlens_int32(BWD_OP, cu_seqlens_q, cu_seqlens_k)
    startend_row_indices, _ = _mask_int32(BWD_OP, startend_row_indices, None)
    spec = _validate(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, None, 64, False, None, op=BWD_OP,
                     startend_row_indices=startend_row_indices)
    _check_bwd_tensors(spec, dout, q, k, v, out, lse, dlse, dq, dk, dv)
    V.check_bool(BWD_OP, "deterministic", deterministic)
    name = _bwd_backend(backend, q, spec, deterministic, has_dlse=dlse is not None)
    return _backward(spec, name, as_contiguous(dout), q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q,
                     cu_seqlens_k, deterministic, _Mask(startend_row_indices))


def _bwd_backend(backend: str, q, spec: AttnFwdSpec, deterministic: bool, has_dlse: bool,
                 stacklevel: int = 5) -> str:
    """The backend of a backward call: ``auto`` takes the CuTe backward only when its launcher imports
    and supports this case on the GPU's arch (independently of the forward's choice)."""
    return resolve_backend(BWD_OP, backend, q, functools.partial(
        _bwd_unsupported_reason, spec=spec, deterministic=deterministic, has_dlse=has_dlse),
        stacklevel=stacklevel, auto_reason=functools.partial(_unverified_reason, spec=spec))


def _bwd_unsupported_reason(arch: int, spec: AttnFwdSpec, deterministic: bool, has_dlse: bool) -> Optional[str]:
    from ._cute import attention as glue

    return glue.bwd_unsupported_reason(arch, spec, deterministic, has_dlse)


def _check_bwd_tensors(spec: AttnFwdSpec, dout, q, k, v, out, lse, dlse, dq, dk, dv) -> None:
    """Types, dtypes, shapes and places of :func:`flash_attn_bwd`'s own tensors."""
    op = BWD_OP
    optional = {"dlse": dlse, "dq": dq, "dk": dk, "dv": dv}
    for name, t in {"dout": dout, "out": out, "lse": lse, **optional}.items():
        if t is not None or name not in optional:
            V.check_tensor(op, name, t)
    out_layout = "[total_q, Hq, Dv]" if spec.varlen else "[B, Sq, Hq, Dv]"
    lse_layout = "[Hq, total_q]" if spec.varlen else "[B, Hq, Sq]"
    for name, t in (("dout", dout), ("out", out)):
        if V.dtype_name(t) != spec.dtype:
            raise TypeError(f"{op}: {name} must have q's dtype {spec.dtype}, got {V.dtype_name(t)}")
        V.check_shape(op, name, t, spec.out_shape(), out_layout + " matching q and v")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None:
            V.check_dtype(op, name, t, ("float32",))
            V.check_shape(op, name, t, spec.lse_shape(), lse_layout)
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is not None:
            if V.dtype_name(t) != V.dtype_name(like):
                raise TypeError(f"{op}: {name} must have {name[1]}'s dtype {V.dtype_name(like)}, got "
                                f"{V.dtype_name(t)}")
            V.check_shape(op, name, t, list(like.shape), f"{name[1]}'s shape")
    V.check_same_place(op, {"q": q, "dout": dout, "out": out, "lse": lse, **optional})


def _unverified_reason(arch: int, spec: AttnFwdSpec) -> Optional[str]:
    from ._cute import attention as glue

    return glue.unverified_reason(arch, spec)


def _unsupported_reason(arch: int, spec: AttnFwdSpec) -> Optional[str]:
    from ._cute import attention as glue

    return glue.unsupported_reason(arch, spec)


def _impl(backend: str):
    """The module implementing a call on the resolved backend (same out-parameter contract)."""
    if backend == "cute":
        from ._cute import attention as impl
    else:
        from .reference import attention as impl
    return impl


def _is_empty(spec: AttnFwdSpec) -> bool:
    return spec.total_q == 0 or spec.total_k == 0 or spec.num_heads == 0


def _fill_no_keys(out, lse, block_logit) -> None:
    """Outputs of a call where no row sees any key: out 0, lse and block_logit -inf."""
    import paddle

    with paddle.no_grad():
        if not V.is_empty(out):
            paddle.assign(paddle.zeros(out.shape, dtype=out.dtype, device=out.place), out)
        if not V.is_empty(lse):
            paddle.assign(paddle.full(lse.shape, -math.inf, dtype="float32", device=lse.place), lse)
        if block_logit is not None and not V.is_empty(block_logit):
            paddle.assign(paddle.full(block_logit.shape, -math.inf, dtype="float32",
                                      device=block_logit.place), block_logit)


# ----------------------------------------------------------------------------------------------
# validation


def _validate(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, block_logit, block_size, return_block_logit,
              pack_gqa, op: str = OP, startend_row_indices=None, block_bos=None) -> AttnFwdSpec:
    """Check every argument of :func:`flash_attn_fwd` and return the call's spec.

    ``op`` names the op in error messages (:func:`flash_attn_bwd` validates with the same rules)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("block_logit", block_logit),
                    ("startend_row_indices", startend_row_indices), ("block_bos", block_bos)):
        if t is not None or name in ("q", "k", "v"):
            V.check_tensor(op, name, t)
    user_causal = causal
    dtype = V.check_dtype(op, "q", q, V.REFERENCE_FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if V.dtype_name(t) != dtype:
            raise TypeError(f"{op}: {name} must have q's dtype {dtype}, got {V.dtype_name(t)}")
    varlen = _check_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, op)
    dims = _check_shapes(q, k, v, varlen, cu_seqlens_q, op)
    V.check_same_place(op, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                            "cu_seqlens_k": cu_seqlens_k, "block_logit": block_logit,
                            "startend_row_indices": startend_row_indices, "block_bos": block_bos})
    if varlen:
        # lengths are int32 in the kernels (and no sequence of an int32-indexed tensor is longer)
        seqlen_q = V.check_int(op, "max_seqlen_q", max_seqlen_q, low=0, high=V.INT32_MAX)
        seqlen_k = V.check_int(op, "max_seqlen_k", max_seqlen_k, low=0, high=V.INT32_MAX)
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, dims["total_q"], seqlen_q, "max_seqlen_q", op)
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, dims["total_k"], seqlen_k, "max_seqlen_k", op)
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    causal = V.check_bool(op, "causal", causal)
    window_left, window_right, causal = _check_window(window_size, causal, op, reach=seqlen_q + seqlen_k)
    softcap = V.check_float(op, "softcap", softcap, low=0.0)
    # >= 0: the kernels take the running max of the raw logits q.k and scale it afterwards, which
    # for a negative scale would be the minimum of the scaled logits (and block_logit its minimum).
    scale = (dims["head_dim"] ** -0.5 if softmax_scale is None
             else V.check_float(op, "softmax_scale", softmax_scale, low=0.0))
    V.check_int(op, "block_size", block_size)
    V.check_choice(op, "block_size", block_size, BLOCK_SIZES)
    V.check_bool(op, "return_block_logit", return_block_logit)
    wants_block_logit = block_logit is not None or return_block_logit
    packed = _check_pack_gqa(pack_gqa, wants_block_logit, op)
    num_blocks = -(-seqlen_k // block_size) if wants_block_logit else 0
    startend, startend_heads = "", 0
    if startend_row_indices is not None:
        startend, startend_heads = _check_startend(startend_row_indices, V.check_bool(op, "causal", user_causal),
                                                   varlen, dims, seqlen_q, seqlen_k, op)
    if block_bos is not None:
        _check_block_bos(block_bos, wants_block_logit, varlen, dims["batch"], seqlen_q, seqlen_k, op)
    spec = AttnFwdSpec(
        batch=dims["batch"], seqlen_q=seqlen_q, seqlen_k=seqlen_k, total_q=dims["total_q"],
        total_k=dims["total_k"], num_heads=dims["num_heads"], num_heads_k=dims["num_heads_k"],
        head_dim=dims["head_dim"], head_dim_v=dims["head_dim_v"], dtype=dtype, varlen=varlen,
        softmax_scale=float(scale), softcap=softcap, causal=causal, window_left=window_left,
        window_right=window_right, block_size=block_size if wants_block_logit else 0,
        num_blocks=num_blocks, pack_gqa=packed, startend=startend, startend_heads=startend_heads,
        has_block_bos=block_bos is not None)
    if block_logit is not None:
        _check_block_logit_buffer(block_logit, spec, op)
    return spec


def _check_startend(t, causal: bool, varlen: bool, dims: dict, seqlen_q: int, seqlen_k: int,
                    op: str = OP) -> Tuple[str, int]:
    """``(layout, mask heads)`` of a FlashMask ``startend_row_indices`` (docs/api.md "FlashMask").

    ``causal`` is the caller's flag (it selects what a 2-column mask means). Values are checked
    only when the tensor is on the CPU (reading a GPU tensor would synchronise): every bound in
    ``[0, Sq]`` and each interval's start at most its end."""
    name = "startend_row_indices"
    if varlen:
        raise NotImplementedError(f"{op}: {name} with cu_seqlens (varlen) is not supported; pack the "
                                  f"documents into [B, S] and mask them with {name} instead")
    V.check_dtype(op, name, t, ("int32",))
    V.check_rank(op, name, t, (4,), "[B, Hkv or 1, Sk, 1|2|4]")
    b, hm, sk, cols = t.shape
    allowed = (1, 2) if causal else (2, 4)
    if cols not in allowed:
        raise ValueError(f"{op}: {name} must have {' or '.join(map(str, allowed))} columns with "
                         f"causal={causal} ([LTS]/[LTS, LTE] when causal, [LTS, UTE]/[LTS, LTE, UTS, UTE] "
                         f"otherwise), got {cols}")
    heads = sorted({1, dims["num_heads_k"], dims["num_heads"]})
    if b != dims["batch"] or sk != seqlen_k or hm not in heads:
        raise ValueError(f"{op}: {name} must be [B, H, Sk, {cols}] with B = {dims['batch']}, H one of "
                         f"{heads} (1, Hkv or Hq) and Sk = {seqlen_k}, got {list(t.shape)}")
    layout = {(True, 1): "lts", (True, 2): "lts_lte", (False, 2): "lts_ute", (False, 4): "lts_lte_uts_ute"}
    values = V.host_values(t)
    if values is not None and values.size:
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > seqlen_q:
            raise ValueError(f"{op}: {name} values must lie in [0, Sq] = [0, {seqlen_q}], got values in "
                             f"[{low}, {high}]")
        pairs = {2: ((0, 1, "LTS", "LTE"),), 4: ((0, 1, "LTS", "LTE"), (2, 3, "UTS", "UTE"))}
        for lo, hi, lo_name, hi_name in pairs.get(cols, ()) if (causal or cols == 4) else ():
            bad = values[..., lo] > values[..., hi]
            if bad.any():
                where = tuple(int(x) for x in next(zip(*bad.nonzero())))
                raise ValueError(f"{op}: {name} has {lo_name} > {hi_name} at [b, h, key] = {list(where)} "
                                 f"({int(values[where + (lo,)])} > {int(values[where + (hi,)])})")
    return layout[(causal, cols)], hm


def _check_block_bos(t, wants_block_logit: bool, varlen: bool, batch: int, seqlen_q: int, seqlen_k: int,
                     op: str = OP) -> None:
    """``block_bos``: int32 ``[B, Sq]``, each query's block origin in ``[0, Sk]`` (values checked on the CPU)."""
    name = "block_bos"
    if not wants_block_logit:
        raise ValueError(f"{op}: {name} only shifts block_logit's key blocks; pass block_logit (or "
                         f"return_block_logit=True) with it")
    if varlen:
        raise NotImplementedError(f"{op}: {name} with cu_seqlens (varlen) is not supported: varlen block ids "
                                  f"are already relative to each sequence's start")
    V.check_dtype(op, name, t, ("int32",))
    V.check_shape(op, name, t, [batch, seqlen_q], "[B, Sq]")
    values = V.host_values(t)
    if values is not None and values.size and (values.min() < 0 or values.max() > seqlen_k):
        raise ValueError(f"{op}: {name} values must lie in [0, Sk] = [0, {seqlen_k}], got values in "
                         f"[{int(values.min())}, {int(values.max())}]")


def _check_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, op: str = OP) -> bool:
    """True for a varlen call; both cu_seqlens and both max_seqlen must come together."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{op}: {name} is only used with cu_seqlens_q/cu_seqlens_k (varlen)")
        return False
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is None:
            raise ValueError(f"{op}: {name} is required when the other cu_seqlens is given (varlen)")
        V.check_tensor(op, name, t)
        V.check_dtype(op, name, t, ("int32",))
        V.check_rank(op, name, t, (1,), "1-D [B + 1]")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length [B + 1], got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens_q must have at least one entry (B + 1), got 0")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            raise ValueError(f"{op}: {name} is required with cu_seqlens (varlen)")
    return True


def _check_shapes(q, k, v, varlen: bool, cu_seqlens_q, op: str = OP) -> dict:
    """Ranks, shape agreement and head counts; returns the call's dimensions."""
    if varlen:
        V.check_rank(op, "q", q, (3,), "[total_q, Hq, D] with cu_seqlens")
        V.check_rank(op, "k", k, (3,), "[total_k, Hkv, D] with cu_seqlens")
        V.check_rank(op, "v", v, (3,), "[total_k, Hkv, Dv] with cu_seqlens")
        total_q, hq, d = q.shape
        total_k, hkv, dk = k.shape
        batch = cu_seqlens_q.shape[0] - 1
        if list(v.shape[:2]) != [total_k, hkv]:
            raise ValueError(f"{op}: v must be [total_k, Hkv, Dv] = [{total_k}, {hkv}, Dv] like k, "
                             f"got {list(v.shape)}")
    else:
        V.check_rank(op, "q", q, (4,), "[B, Sq, Hq, D] (or [total_q, Hq, D] with cu_seqlens)")
        V.check_rank(op, "k", k, (4,), "[B, Sk, Hkv, D]")
        V.check_rank(op, "v", v, (4,), "[B, Sk, Hkv, Dv]")
        batch, sq, hq, d = q.shape
        bk, sk, hkv, dk = k.shape
        if bk != batch:
            raise ValueError(f"{op}: k must have q's batch size {batch}, got {bk}")
        if list(v.shape[:3]) != [batch, sk, hkv]:
            raise ValueError(f"{op}: v must be [B, Sk, Hkv, Dv] = [{batch}, {sk}, {hkv}, Dv] like k, "
                             f"got {list(v.shape)}")
        total_q, total_k = batch * sq, batch * sk
    dv = v.shape[-1]
    if dk != d:
        raise ValueError(f"{op}: k must have q's head_dim {d}, got {dk}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{op}: q's head count {hq} must be a multiple of k's head count {hkv}")
    for name, dim in (("head_dim", d), ("head_dim_v", dv)):
        if dim < 1:
            raise ValueError(f"{op}: {name} must be >= 1, got {dim}")
        if dim > MAX_HEAD_DIM:
            raise NotImplementedError(f"{op}: {name} {dim} is not supported (at most {MAX_HEAD_DIM})")
    return {"batch": batch, "total_q": total_q, "total_k": total_k, "num_heads": hq,
            "num_heads_k": hkv, "head_dim": d, "head_dim_v": dv}


def _check_cu_seqlens(name: str, t, total: int, max_seqlen: int, max_name: str, op: str = OP) -> None:
    """Value checks of a cu_seqlens tensor; run only when its values are on the host (no sync)."""
    values = V.host_values(t)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {int(values[0])}")
    lengths = values[1:] - values[:-1]
    if (lengths < 0).any():
        raise ValueError(f"{op}: {name} must be non-decreasing, got {values.tolist()}")
    if int(values[-1]) != total:
        raise ValueError(f"{op}: {name}[-1] must equal the packed token count {total}, got {int(values[-1])}")
    if lengths.size and int(lengths.max()) > max_seqlen:
        raise ValueError(f"{op}: {max_name} {max_seqlen} is below the longest sequence in {name} "
                         f"({int(lengths.max())})")


def _window_bound(name: str, value, op: str = OP, reach: Optional[int] = None) -> Optional[int]:
    """A window bound as None (unbounded) or an int in ``[0, reach)``: a bound of ``reach = Sq + Sk``
    keys or more (varlen: ``max_seqlen_q + max_seqlen_k``) lets every row see every key on its side,
    so it is unbounded -- also past the 64-bit range (``sys.maxsize``, ``2**70``), which the masks'
    integer arithmetic would otherwise overflow, and the kernels' int32 bounds."""
    if value is None:
        return None
    value = V.check_int(op, name, value)
    if value == -1:
        return None
    if value < 0:
        raise ValueError(f"{op}: {name} must be None, -1 (unbounded) or >= 0, got {value}")
    if reach is not None and value >= reach:
        return None
    return value


def _check_window(window_size, causal: bool, op: str = OP,
                  reach: Optional[int] = None) -> Tuple[Optional[int], Optional[int], bool]:
    """``(left, right, causal)`` with None for unbounded (and for a bound ``>= reach``, see
    :func:`_window_bound`); causal forces ``right <= 0``."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"{op}: window_size must be a (left, right) pair, got {window_size!r}")
    left = _window_bound("window_size[0]", window_size[0], op, reach)
    right = _window_bound("window_size[1]", window_size[1], op, reach)
    if causal:
        right = 0 if right is None else min(right, 0)
    causal = causal or (left is None and right == 0)
    return left, right, causal


def _check_pack_gqa(pack_gqa, wants_block_logit: bool, op: str = OP) -> bool:
    if pack_gqa is None:
        return False
    V.check_bool(op, "pack_gqa", pack_gqa)
    if pack_gqa and wants_block_logit:
        raise ValueError(f"{op}: pack_gqa=True cannot be combined with block_logit (block_logit is per "
                         f"query head); pass pack_gqa=None or False")
    return pack_gqa


def _check_block_logit_buffer(block_logit, spec: AttnFwdSpec, op: str = OP) -> None:
    V.check_dtype(op, "block_logit", block_logit, ("float32",))
    layout = "[Hq, total_q, ceil(max_seqlen_k / block_size)]" if spec.varlen else \
        "[B, Hq, Sq, ceil(Sk / block_size)]"
    V.check_shape(op, "block_logit", block_logit, spec.block_logit_shape(), layout)

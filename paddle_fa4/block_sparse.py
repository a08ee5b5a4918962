"""Block-sparse attention over per-query selected key blocks (HySparse sparse layers), with autograd.

See ``docs/api.md`` (block_sparse_attention) and ``docs/hysparse.md``. :func:`block_sparse_attention`
validates into a frozen :class:`BlockSparseSpec`, resolves the backend and runs a private
``paddle.autograd.PyLayer`` whose forward and backward call the chosen implementation: the
pure-Paddle fp32 reference (``paddle_fa4.block_sparse_ref``) or the CuTe glue
(``paddle_fa4.block_sparse_cute``). The block rule and the plan live in
``paddle_fa4.block_sparse_planner``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from paddle.autograd import PyLayer

from . import _validate as V
from ._bridge import as_contiguous
from ._static import dynamic_only
from .backend import resolve_backend
from .block_sparse_planner import (BlockSparsePlan, build_plan, check_block_size, check_cu_seqlens, check_ids,
                                num_docs)
from .indexed import import_optional

OP = "block_sparse_attention"
_GLUE_MODULE = "paddle_fa4.block_sparse_cute"


@dataclass(frozen=True)
class BlockSparseSpec:
    """A validated call. ``latent``: ``v`` is None and V is the leading ``Dv`` columns of ``k``
    (absorbed MLA); ``per_kv_head``: ids ``[B, Hkv, S, topk]``; ``scale`` resolved (``Dk ** -0.5``)."""

    B: int
    S: int
    Hq: int
    Hkv: int
    Dk: int
    Dv: int
    topk: int
    block_size: int
    per_kv_head: bool
    latent: bool
    causal: bool
    has_sink: bool
    num_docs: int
    scale: float
    dtype: str
    deterministic: bool
    exact_delta: bool = False

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv

    def plan_geometry(self) -> tuple:
        sets = self.B * (self.Hkv if self.per_kv_head else 1)
        return (self.B, sets, self.S, self.topk, self.block_size, self.group, self.per_kv_head, self.causal,
                self.num_docs)


@dynamic_only("block_sparse_attention")
def block_sparse_attention(q, k, v, block_ids, *, block_size=64, softmax_scale=None, causal=True,
                           cu_seqlens=None, sink=None, dv=None, return_lse=False, deterministic=True,
                           exact_delta=False, plan=None, backend="auto"):
    r"""Attention of each query token over the key blocks selected for it, with autograd.

    Query ``t`` (document ``[bos, eos)``, from ``cu_seqlens``) attends, in query head ``h``, to the
    keys of its distinct live blocks ``j`` of ``block_ids[b, t]`` (or ``block_ids[b, h // G, t]``):
    block ``j`` covers ``[bos + block_size * j, bos + block_size * (j + 1))``, and only keys
    ``< limit(t)`` are visible, ``limit(t) = t + 1`` when ``causal`` (the diagonal block is cut at
    the query) else ``eos`` (the document's tail block is cut at its end)::

        block_size 4, one document, causal, row t = 9, block_ids[t] = [2, 0, -1, 0]
        keys:   0 1 2 3 | 4 5 6 7 | 8 9 10 11
        seen:   1 1 1 1   0 0 0 0   1 1 0  0      (duplicate 0 once, -1 padding)

    ``out = softmax(softmax_scale * q . K^T  [+ sink column]) V`` over those keys. With ``sink`` a
    virtual column of logit ``sink[h]`` (natural-log units, not scaled) joins each row's softmax: it
    enlarges the normaliser and ``lse`` but adds nothing to ``out``. A row with no visible key gives
    ``out`` 0, ``lse`` -inf (``sink[h]`` with a sink) and zero gradients.

    Args:
        q (Tensor): ``[B, S, Hq, Dk]``, bfloat16 or float16 (float32 on the reference backend).
        k (Tensor): ``[B, S, Hkv, Dk]``, q's dtype, ``Hq % Hkv == 0`` (GQA / MQA).
        v (Tensor|None): ``[B, S, Hkv, Dv]``, q's dtype; None for the absorbed-MLA latent: V is the
            leading ``dv`` columns of ``k`` (read once; ``k`` gets one combined gradient).
        block_ids (Tensor): int32 ``[B, S, topk]`` shared by all heads, or ``[B, Hkv, S, topk]`` per
            kv head; document-relative ids, ``-1`` = padding, repeats count once. Ids must be -1 or
            ``< ceil(doc_len / block_size)`` (checked for CPU tensors; on the GPU others select nothing).
        block_size (int): 16, 32, 64, 128 or 256 (the CuTe kernels: 64). Default 64.
        softmax_scale (float, optional): default ``Dk ** -0.5``.
        causal (bool): see above. Default True.
        cu_seqlens (Tensor, optional): int32 document boundaries along S, ``[n + 1]`` for every batch
            row or ``[B, n + 1]``; starts at 0, non-decreasing, ends at S. None: one document.
        sink (Tensor, optional): float32 ``[Hq]`` learnable sink logits (gets a gradient).
        dv (int, optional): V's head dim when ``v`` is None (``1 <= dv <= Dk``).
        return_lse (bool): also return ``lse``.
        deterministic (bool): every path is deterministic (no float atomics); kept for the FA4-style
            signature. Default True.
        exact_delta (bool): the backward's ``delta`` (``dS = P (dP - delta)``) as ``rowsum(P dP)`` from the
            recomputed fp32 ``P`` and ``dP`` instead of ``rowsum(dout * out)`` from the 16-bit ``out``:
            accurate gradients on rows whose weight sits on one key (sinks; docs/api.md, "Gradients of
            peaked rows") for two more GEMMs per block in the dQ kernel. The reference backend always
            computes it so; on SM100 the head dim 128 kernels take it (compile-verified only), the
            token-path backward of other head dims does not. Default False.
        plan (BlockSparsePlan, optional): from :func:`paddle_fa4.block_sparse_plan` for these
            ``block_ids`` / ``cu_seqlens`` / ``causal`` / ``block_size`` and ``Hq // Hkv``; built
            when None (the reference backend does not need one).
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        Tensor | tuple: ``out [B, S, Hq, Dv]`` in q's dtype, or ``(out, lse)`` with ``lse [B, Hq, S]``
        float32 natural log including the sink (not differentiable).

    Raises:
        TypeError: a non-tensor input, a wrong dtype, a bad ``plan``.
        ValueError: shapes, places, head counts, ``cu_seqlens`` or ids that disagree; a plan built
            for another geometry.
        NotImplementedError: ``backend="cute"`` for a case the kernels do not cover (the message
            names it); ``"auto"`` then runs the reference.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 80, 4, 32])
            >>> kv = paddle.randn([1, 80, 1, 32])
            >>> ids = paddle.full([1, 80, 2], -1, dtype="int32")
            >>> ids[:, :, 0] = paddle.arange(80, dtype="int32") // 16     # the diagonal block
            >>> out, lse = paddle_fa4.block_sparse_attention(q, kv, kv, ids, block_size=16, return_lse=True,
            ...                                              backend="reference")
            >>> out.shape, lse.shape
            (paddle.Size([1, 80, 4, 32]), paddle.Size([1, 4, 80]))
    """
    spec = _validate(q, k, v, block_ids, block_size, softmax_scale, causal, cu_seqlens, sink, dv, return_lse,
                     deterministic, plan, exact_delta)
    import paddle

    needs_grad = paddle.is_grad_enabled() and any(t is not None and not t.stop_gradient for t in (q, k, v, sink))
    name = resolve_backend(OP, backend, q, functools.partial(_unsupported_reason, spec=spec, needs_grad=needs_grad))
    out, lse = _BlockSparseFn.apply(q, k, v, block_ids, sink, cu_seqlens, spec, name, plan)
    return (out, lse) if return_lse else out


def _glue():
    """The CuTe glue module, or None when it is not part of this install."""
    return import_optional(_GLUE_MODULE)


def _unsupported_reason(arch: int, spec: BlockSparseSpec, needs_grad: bool) -> Optional[str]:
    glue = _glue()
    if glue is None:
        return f"the CuTe block-sparse attention is not available ({_GLUE_MODULE} is missing)"
    return glue.unsupported_reason(arch, spec, needs_grad)


def _impl(backend: str):
    if backend == "cute":
        return _glue()
    from . import block_sparse_ref

    return block_sparse_ref


def plan_for(spec: BlockSparseSpec, block_ids, cu_seqlens, plan) -> BlockSparsePlan:
    """``plan`` (checked to fit) or a new one for this call."""
    if plan is None:
        return build_plan(block_ids, heads_per_kv=spec.group, block_size=spec.block_size, causal=spec.causal,
                          cu_seqlens=cu_seqlens, head_dim_v=spec.Dv)
    return plan


class _BlockSparseFn(PyLayer):
    """Autograd of :func:`block_sparse_attention`. Tensor inputs (Paddle counts them strictly, one
    backward slot each): q, k, then each of v, block_ids, sink, cu_seqlens that is not None."""

    @staticmethod
    def forward(ctx, q, k, v, block_ids, sink, cu_seqlens, spec, backend, plan):
        out, lse, plan = _impl(backend).forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan)
        ctx.state = (spec, backend, plan)
        ctx.has = tuple(t is not None for t in (v, block_ids, sink, cu_seqlens))
        ctx.needs_grad = tuple(t is not None and not t.stop_gradient for t in (q, k, v, sink))
        # Strided views are saved as contiguous copies: Paddle 3.3's non-reentrant recompute
        # restores a saved view from its base buffer without the strides (wrong gradients).
        saved = [as_contiguous(t) for t in (q, k, v, block_ids, sink, cu_seqlens) if t is not None]
        ctx.save_for_backward(*saved, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        import paddle

        if paddle.is_grad_enabled():
            raise NotImplementedError(f"{OP}: double backward (create_graph=True) is not supported")
        spec, backend, plan = ctx.state
        saved = list(ctx.saved_tensor())
        out, lse = saved[-2:]
        it = iter(saved[:-2])
        q, k = next(it), next(it)
        v, block_ids, sink, cu_seqlens = (next(it) if has else None for has in ctx.has)
        if any(ctx.needs_grad):
            if dout is None:
                dout = paddle.zeros_like(out)
            grads = _impl(backend).backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse,
                                            as_contiguous(dout), plan)
        else:
            grads = (None, None, None, None)
        dq, dk, dv, dsink = (g if need else None for need, g in zip(ctx.needs_grad, grads))
        slots = [dq, dk]
        for has, g in zip(ctx.has, (dv, None, dsink, None)):
            if has:
                slots.append(g)
        return tuple(slots)


# ----------------------------------------------------------------------------------------------
# validation


def _validate(q, k, v, block_ids, block_size, softmax_scale, causal, cu_seqlens, sink, dv, return_lse,
              deterministic, plan, exact_delta=False) -> BlockSparseSpec:
    """Check every argument of :func:`block_sparse_attention` and return the call's spec."""
    for name, t in (("q", q), ("k", k), ("block_ids", block_ids)):
        V.check_tensor(OP, name, t)
    if v is not None:
        V.check_tensor(OP, "v", v)
    dtype = V.check_dtype(OP, "q", q, V.REFERENCE_FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if t is not None and V.dtype_name(t) != dtype:
            raise TypeError(f"{OP}: {name} must have q's dtype {dtype}, got {V.dtype_name(t)}")
    V.check_dtype(OP, "block_ids", block_ids, ("int32",))
    V.check_rank(OP, "q", q, (4,), "[B, S, Hq, Dk]")
    V.check_rank(OP, "k", k, (4,), "[B, S, Hkv, Dk]")
    b, s, hq, dk = q.shape
    hkv = k.shape[2]
    V.check_shape(OP, "k", k, [b, s, hkv, dk], "[B, S, Hkv, Dk] with q's B, S and Dk")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{OP}: q's head count {hq} must be a multiple of k's head count {hkv}")
    if dk < 1:
        raise ValueError(f"{OP}: head dim Dk must be >= 1, got {dk}")
    if v is None:
        if dv is None:
            raise ValueError(f"{OP}: dv must be given when v is None (V = the leading dv columns of k)")
        dv = V.check_int(OP, "dv", dv, low=1, high=dk)
    else:
        V.check_rank(OP, "v", v, (4,), "[B, S, Hkv, Dv]")
        if dv is not None and (isinstance(dv, bool) or dv != v.shape[3]):
            raise ValueError(f"{OP}: dv={dv!r} disagrees with v's head dim {v.shape[3]} (pass dv only with v=None)")
        dv = v.shape[3]
        V.check_shape(OP, "v", v, [b, s, hkv, dv], "[B, S, Hkv, Dv] with k's B, S and Hkv")
        if dv < 1:
            raise ValueError(f"{OP}: head dim Dv must be >= 1, got {dv}")
    V.check_rank(OP, "block_ids", block_ids, (3, 4), "[B, S, topk] or [B, Hkv, S, topk]")
    per_kv_head = block_ids.ndim == 4
    topk = block_ids.shape[-1]
    expected = [b, hkv, s, topk] if per_kv_head else [b, s, topk]
    V.check_shape(OP, "block_ids", block_ids, expected, "[B, Hkv, S, topk]" if per_kv_head else "[B, S, topk]")
    check_block_size(OP, block_size)
    if sink is not None:
        V.check_tensor(OP, "sink", sink)
        V.check_dtype(OP, "sink", sink, ("float32",))
        V.check_shape(OP, "sink", sink, [hq], "[Hq]")
    V.check_same_place(OP, {"q": q, "k": k, "v": v, "block_ids": block_ids, "sink": sink, "cu_seqlens": cu_seqlens})
    scale = dk ** -0.5 if softmax_scale is None else V.check_float(OP, "softmax_scale", softmax_scale, low=0.0)
    V.check_bool(OP, "causal", causal)
    V.check_bool(OP, "return_lse", return_lse)
    V.check_bool(OP, "deterministic", deterministic)
    V.check_bool(OP, "exact_delta", exact_delta)
    check_cu_seqlens(OP, cu_seqlens, b, s, block_ids)
    check_ids(OP, block_ids, cu_seqlens, block_size)
    spec = BlockSparseSpec(B=b, S=s, Hq=hq, Hkv=hkv, Dk=dk, Dv=dv, topk=topk, block_size=block_size,
                           per_kv_head=per_kv_head, latent=v is None, causal=causal, has_sink=sink is not None,
                           num_docs=num_docs(cu_seqlens), scale=float(scale), dtype=dtype,
                           deterministic=deterministic, exact_delta=exact_delta)
    if plan is not None:
        if not isinstance(plan, BlockSparsePlan):
            raise TypeError(f"{OP}: plan must be a BlockSparsePlan from block_sparse_plan, got {type(plan).__name__}")
        if plan.geometry() != spec.plan_geometry():
            names = "batch/sets/S/topk/block_size/heads_per_kv/per_kv_head/causal/num_docs"
            raise ValueError(f"{OP}: plan was built for another selection ({names} "
                             f"{'/'.join(map(str, plan.geometry()))}, call needs "
                             f"{'/'.join(map(str, spec.plan_geometry()))})")
    return spec

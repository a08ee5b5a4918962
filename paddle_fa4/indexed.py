"""Indexed (token-sparse) attention with autograd. See ``docs/api.md`` (indexed_attention).

:func:`indexed_attention` validates into a frozen :class:`IndexedSpec`, resolves the backend and
runs a private ``paddle.autograd.PyLayer`` whose forward and backward call the chosen
implementation: the pure-Paddle reference (``paddle_fa4.reference.indexed``) or the CuTe glue
(``paddle_fa4._cute.indexed``). The reference goes through the same PyLayer, so the CPU tests
exercise the autograd contract the kernels use. :func:`indexed_attention_plan` builds the windowed
plan (types and the Paddle-op builder: ``paddle_fa4._plan.indexed``) with the kernels or Paddle ops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from paddle.autograd import PyLayer

from . import _validate as V
from ._bridge import as_contiguous
from ._plan import indexed as P
from ._plan.indexed import IndexedAttentionPlan
from .backend import resolve_backend
from ._static import dynamic_only

OP = "indexed_attention"
PLAN_OP = "indexed_attention_plan"
_GLUE_MODULE = "paddle_fa4._cute.indexed"


@dataclass(frozen=True)
class IndexedSpec:
    """A validated :func:`indexed_attention` call.

    ``W`` is the index-row width; ``per_kv_head`` is True for ``indices [B, Hkv, Lq, W]`` and False
    for ``[B, Lq, W]``; ``scale`` is resolved (``D ** -0.5`` by default); ``dtype`` is the query's.
    """

    B: int
    Lq: int
    Lkv: int
    Hq: int
    Hkv: int
    D: int
    W: int
    per_kv_head: bool
    scale: float
    dtype: str


@dynamic_only("indexed_attention")
def indexed_attention(q, k, v, indices, *, softmax_scale=None, return_lse=False, backend="auto", plan=None):
    r"""Attention of each query token over its own set of key tokens, with autograd.

    Query token ``i`` of batch ``b`` attends, in every query head ``h``, to the distinct valid
    indices of its row (``indices[b, i]``, or ``indices[b, h // (Hq // Hkv), i]`` per kv head):
    ``out = softmax(softmax_scale * q . K[S]^T) V[S]`` with ``S`` that set. Indices ``< 0`` or ``>= Lkv``
    are padding and never read; duplicates count once. A row with no valid index gives ``out`` 0,
    ``lse`` -inf and zero gradients.

    Args:
        q (Tensor): ``[B, Lq, Hq, D]``, bfloat16 or float16 (float32 on the reference backend).
        k (Tensor): ``[B, Lkv, Hkv, D]``, q's dtype; ``Hq % Hkv == 0``.
        v (Tensor): ``[B, Lkv, Hkv, D]``, q's dtype.
        indices (Tensor): int32 (or int64, converted) token indices into the key axis (global coordinates, so
            ``Lq != Lkv`` is allowed): ``[B, Lq, W]`` shared by all heads of a token, or
            ``[B, Hkv, Lq, W]`` one row per kv head.
        softmax_scale (float, optional): default ``D ** -0.5``.
        return_lse (bool): also return ``lse``.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.
        plan (IndexedAttentionPlan, optional): a plan from :func:`paddle_fa4.indexed_attention_plan`
            for these ``indices`` (the CuTe backend builds one when None; the reference ignores it).

    Returns:
        Tensor | tuple: ``out [B, Lq, Hq, D]`` in q's dtype, or ``(out, lse)`` with
        ``lse [B, Hq, Lq]`` float32 natural log (-inf on empty rows, not differentiable).

    Raises:
        TypeError: a non-tensor input, a wrong dtype (``indices`` must be int32 or int64), a bad ``plan``.
        ValueError: shapes, places or head counts that disagree, a non-finite ``softmax_scale``, an
            unknown ``backend``.
        NotImplementedError: ``backend="cute"`` when no kernel applies.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 4, 2, 32])
            >>> kv = paddle.randn([1, 6, 1, 32])
            >>> idx = paddle.to_tensor([[[0, 1], [2, -1], [5, 5], [-1, -1]]], dtype="int32")
            >>> out, lse = paddle_fa4.indexed_attention(q, kv, kv, idx, return_lse=True, backend="reference")
            >>> lse.shape
            paddle.Size([1, 2, 4])
    """
    indices = V.index_tensor(OP, "indices", indices, padding=True)
    spec = _validate(q, k, v, indices, softmax_scale, return_lse, plan)
    name = resolve_backend(OP, backend, q, functools.partial(_unsupported_reason, spec=spec))
    if _no_work(spec):  # zero-size or W == 0: zeros / -inf and zero gradients, no launch
        name = "reference"
    out, lse = _IndexedAttentionFn.apply(q, k, v, indices, spec, name, plan)
    return (out, lse) if return_lse else out


@dynamic_only("indexed_attention_plan")
def indexed_attention_plan(indices, *, kv_len: int, heads_per_kv: int, backend: str = "auto",
                           name: Optional[str] = None) -> IndexedAttentionPlan:
    r"""Build the windowed plan :func:`indexed_attention` uses for ``indices``.

    The plan can be built once and passed to several calls with the same indices (``plan=``);
    ``indexed_attention`` builds it itself when none is given and keeps it for the backward.

    Args:
        indices (Tensor): int32 (or int64, converted) ``[B, Lq, W]`` (shared by all heads) or ``[B, Hkv, Lq, W]`` (one
            selection per kv head) token indices; any index ``< 0`` or ``>= kv_len`` is padding,
            duplicates in a row count once.
        kv_len (int): length ``Lkv`` of the key axis, ``>= 0``.
        heads_per_kv (int): query heads per kv head ``G = Hq // Hkv`` (sets the window size
            ``min(64 // G, 32)``), ``1 <= G <= 64``.
        backend (str): ``"auto"`` (CuTe kernels on a supported GPU, else the reference),
            ``"cute"`` or ``"reference"``.
        name (str|None, optional): Name for the operation. Default: None.

    Returns:
        IndexedAttentionPlan: see the class docstring for the tensors and their meaning.

    Raises:
        TypeError: ``indices`` is not an int32 or int64 tensor.
        ValueError: bad rank, ``kv_len`` or ``heads_per_kv`` out of range.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> idx = paddle.to_tensor([[[3, 1, -1], [1, 2, 2]]], dtype="int32")
            >>> plan = paddle_fa4.indexed_attention_plan(idx, kv_len=4, heads_per_kv=12, backend="reference")
            >>> plan.window_queries, plan.win_count.tolist()
            (5, [[3]])
            >>> plan.win_key[0, 0, :3].tolist(), plan.win_mask[0, 0, :3].tolist()
            ([1, 2, 3], [3, 2, 1])
    """
    indices = V.index_tensor(PLAN_OP, "indices", indices, padding=True)
    V.check_rank(PLAN_OP, "indices", indices, (3, 4), "[B, Lq, W] or [B, Hkv, Lq, W]")
    kv_len = V.check_int(PLAN_OP, "kv_len", kv_len, low=0, high=V.INT32_MAX)  # int32 indices name no key past it
    heads_per_kv = V.check_int(PLAN_OP, "heads_per_kv", heads_per_kv, low=1, high=P.TILE_M)
    per_kv_head = indices.ndim == 4
    shape = list(indices.shape)
    num_sets = shape[0] * (shape[1] if per_kv_head else 1)
    geometry = dict(num_sets=num_sets, num_queries=shape[-2], width=shape[-1], kv_len=kv_len,
                    heads_per_kv=heads_per_kv, per_kv_head=per_kv_head)

    chosen = resolve_backend(PLAN_OP, backend, indices, _plan_unsupported_reason)
    flat = indices.reshape([num_sets, shape[-2], shape[-1]])
    with V.sized_by(PLAN_OP, "the plan", f"kv_len={kv_len} and indices {shape} (docs/api.md: the plan's memory)"):
        if chosen == "cute":
            return _glue().build_plan(flat, **geometry)
        return P.build_plan(flat, **geometry)


def _plan_unsupported_reason(arch: int) -> Optional[str]:
    glue = _glue()
    if glue is None:
        return f"the CuTe indexed plan kernels are not available ({_GLUE_MODULE} is missing)"
    return glue.plan_unsupported_reason(arch)


def _no_work(spec: IndexedSpec) -> bool:
    return spec.B * spec.Lq * spec.Hq == 0 or spec.Lkv == 0 or spec.W == 0


def import_optional(name: str):
    """Module ``name``, or None when it is not part of this install (errors inside it still raise)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == name:
            return None
        raise


def _glue():
    """The CuTe glue module, or None when it is not part of this install yet."""
    return import_optional(_GLUE_MODULE)


def _unsupported_reason(arch: int, spec: IndexedSpec) -> Optional[str]:
    glue = _glue()
    if glue is None:
        return f"the CuTe indexed attention is not available ({_GLUE_MODULE} is missing)"
    return glue.unsupported_reason(arch, spec)


def _impl(backend: str):
    if backend == "cute":
        return _glue()
    from .reference import indexed

    return indexed


class _IndexedAttentionFn(PyLayer):
    """Autograd of :func:`indexed_attention`; positional tensor inputs: q, k, v, indices."""

    @staticmethod
    def forward(ctx, q, k, v, indices, spec, backend, plan):
        out, lse, plan = _impl(backend).forward(spec, q, k, v, indices, plan)
        ctx.state = (spec, backend, plan)
        ctx.needs_grad = tuple(not t.stop_gradient for t in (q, k, v))
        # Strided views are saved as contiguous copies: Paddle 3.3's non-reentrant recompute
        # restores a saved view from its base buffer without the strides (wrong gradients).
        ctx.save_for_backward(*(as_contiguous(t) for t in (q, k, v, indices)), out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        import paddle

        spec, backend, plan = ctx.state
        q, k, v, indices, out, lse = ctx.saved_tensor()
        if not any(ctx.needs_grad):
            return None, None, None, None
        if dout is None:
            dout = paddle.zeros_like(out)
        if backend == "cute":
            grads = _glue().backward(spec, q, k, v, out, lse, dout, plan)
        else:
            grads = _impl(backend).backward(spec, q, k, v, out, lse, dout, indices)
        return _grad_slots(ctx.needs_grad, grads)


def _grad_slots(needs_grad, grads) -> tuple:
    """One slot per tensor input (q, k, v, indices); None where no gradient is wanted."""
    return tuple(g if need else None for need, g in zip(needs_grad, grads)) + (None,)


# ----------------------------------------------------------------------------------------------
# validation


def _validate(q, k, v, indices, softmax_scale, return_lse, plan) -> IndexedSpec:
    """Check every argument of :func:`indexed_attention` and return the call's spec."""
    for name, t in (("q", q), ("k", k), ("v", v), ("indices", indices)):
        V.check_tensor(OP, name, t)
    dtype = V.check_dtype(OP, "q", q, V.REFERENCE_FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if V.dtype_name(t) != dtype:
            raise TypeError(f"{OP}: {name} must have q's dtype {dtype}, got {V.dtype_name(t)}")
    V.check_dtype(OP, "indices", indices, ("int32",))
    V.check_rank(OP, "q", q, (4,), "[B, Lq, Hq, D]")
    V.check_rank(OP, "k", k, (4,), "[B, Lkv, Hkv, D]")
    V.check_rank(OP, "indices", indices, (3, 4), "[B, Lq, W] or [B, Hkv, Lq, W]")
    b, lq, hq, d = q.shape
    _, lkv, hkv, _ = k.shape
    V.check_shape(OP, "k", k, [b, lkv, hkv, d], "[B, Lkv, Hkv, D] with q's B and D")
    V.check_shape(OP, "v", v, [b, lkv, hkv, d], "[B, Lkv, Hkv, D] like k")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{OP}: q's head count {hq} must be a multiple of k's head count {hkv}")
    if d < 1:
        raise ValueError(f"{OP}: head dim D must be >= 1, got {d}")
    per_kv_head = indices.ndim == 4
    w = indices.shape[-1]
    expected = [b, hkv, lq, w] if per_kv_head else [b, lq, w]
    V.check_shape(OP, "indices", indices, expected, "[B, Hkv, Lq, W]" if per_kv_head else "[B, Lq, W]")
    V.check_same_place(OP, {"q": q, "k": k, "v": v, "indices": indices})
    scale = d ** -0.5 if softmax_scale is None else V.check_float(OP, "softmax_scale", softmax_scale, low=0.0)  # raw-max softmax: >= 0
    V.check_bool(OP, "return_lse", return_lse)
    _check_plan(plan)
    return IndexedSpec(B=b, Lq=lq, Lkv=lkv, Hq=hq, Hkv=hkv, D=d, W=w, per_kv_head=per_kv_head,
                       scale=float(scale), dtype=dtype)


def _check_plan(plan) -> None:
    if plan is None:
        return
    if not isinstance(plan, IndexedAttentionPlan):
        raise TypeError(f"{OP}: plan must be an IndexedAttentionPlan from indexed_attention_plan, "
                        f"got {type(plan).__name__}")

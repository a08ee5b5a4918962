"""Block-sparse attention over per-query selected key blocks (HySparse sparse layers), with autograd.

See ``docs/api.md`` (block_sparse_attention) and ``docs/hysparse.md``. :func:`block_sparse_attention`
validates into a frozen :class:`BlockSparseSpec`, resolves the backend and runs a private
``paddle.autograd.PyLayer`` whose forward and backward call the chosen implementation: the
pure-Paddle fp32 reference (``paddle_fa4.reference.block_sparse``) or the CuTe glue
(``paddle_fa4._cute.block_sparse``). :func:`block_sparse_plan` builds the reusable plan; the block rule,
the plan type and its builder live in ``paddle_fa4._plan.block_sparse``.
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
from ._plan.block_sparse import BLOCK_SIZES, BlockSparsePlan, build_plan, num_docs
from .indexed import import_optional

OP = "block_sparse_attention"
PLAN_OP = "block_sparse_plan"
_GLUE_MODULE = "paddle_fa4._cute.block_sparse"


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
        block_ids (Tensor): int32 (or int64, converted) ``[B, S, topk]`` shared by all heads, or
            ``[B, Hkv, S, topk]`` per kv head; document-relative ids, ``-1`` = padding, repeats count once. Ids must be -1 or
            ``< ceil(doc_len / block_size)`` (checked for CPU tensors; on the GPU others select nothing).
        block_size (int): 16, 32, 64, 128 or 256 (the CuTe kernels: 64). Default 64.
        softmax_scale (float, optional): default ``Dk ** -0.5``.
        causal (bool): see above. Default True.
        cu_seqlens (Tensor, optional): int32 (or int64) document boundaries along S, ``[n + 1]`` for every batch
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
    block_ids, cu_seqlens = _index_int32(OP, block_ids, cu_seqlens)
    spec = _validate(q, k, v, block_ids, block_size, softmax_scale, causal, cu_seqlens, sink, dv, return_lse,
                     deterministic, plan, exact_delta)
    import paddle

    needs_grad = paddle.is_grad_enabled() and any(t is not None and not t.stop_gradient for t in (q, k, v, sink))
    name = resolve_backend(OP, backend, q, functools.partial(_unsupported_reason, spec=spec, needs_grad=needs_grad))
    out, lse = _BlockSparseFn.apply(q, k, v, block_ids, sink, cu_seqlens, spec, name, plan)
    return (out, lse) if return_lse else out


@dynamic_only("block_sparse_plan")
def block_sparse_plan(block_ids, *, heads_per_kv: int, block_size: int = 64, causal: bool = True,
                      cu_seqlens=None, head_dim_v: int = 128, name: Optional[str] = None) -> BlockSparsePlan:
    r"""Build the plan :func:`block_sparse_attention` uses for ``block_ids`` (reusable via ``plan=``).

    Built with Paddle tensor ops on the ids' place (it reads a few sizes back to the host); a
    pure function of ``(block_ids, cu_seqlens, block_size, causal, heads_per_kv)`` and, for the query
    tile, of the ids' GPU (and ``head_dim_v`` on SM100), so the N sparse
    layers sharing one selection can share one plan, and a recompute may rebuild it.

    Args:
        block_ids (Tensor): int32 (or int64, converted) ``[B, S, topk]`` (shared by all heads) or ``[B, Hkv, S, topk]``,
            document-relative block ids, ``-1`` = padding.
        heads_per_kv (int): ``G = Hq // Hkv >= 1``; sets the query tile, ``tile_queries(G)``.
        block_size (int): keys per block (16, 32, 64, 128 or 256). Default 64.
        causal (bool): query ``t`` sees keys ``<= t`` only. Default True.
        cu_seqlens (Tensor, optional): int32 (or int64) document boundaries along S, ``[n + 1]`` (the same for
            every batch row) or ``[B, n + 1]``: starts at 0, non-decreasing, ends at S. None: one
            document per row.
        head_dim_v (int): the value head dim of the calls the plan serves. Only an SM100 GPU reads
            it (its forward tiles queries by it: one Q stage above 128); default 128.
        name (str|None, optional): Name for the operation. Default: None.

    Returns:
        BlockSparsePlan: see the docstring of ``paddle_fa4._plan.block_sparse``.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> ids = paddle.to_tensor([[[1, 0]] * 20], dtype="int32")        # S = 20, topk = 2
            >>> plan = paddle_fa4.block_sparse_plan(ids, heads_per_kv=64, block_size=16)
            >>> plan.tile_count[0, 14:18].tolist()      # one query per tile; block 1 live from row 16
            [1, 1, 2, 2]
            >>> plan.tile_start[0, 17, :2].tolist(), plan.key_start.tolist(), plan.key_end.tolist()
            ([0, 16], [[0, 16, -1]], [[16, 20, -1]])
    """
    block_ids, cu_seqlens = _index_int32(PLAN_OP, block_ids, cu_seqlens)
    V.check_rank(PLAN_OP, "block_ids", block_ids, (3, 4), "[B, S, topk] or [B, Hkv, S, topk]")
    heads_per_kv = V.check_int(PLAN_OP, "heads_per_kv", heads_per_kv, low=1)
    check_block_size(PLAN_OP, block_size)
    V.check_bool(PLAN_OP, "causal", causal)
    b, s = block_ids.shape[0], block_ids.shape[-2]
    check_cu_seqlens(PLAN_OP, cu_seqlens, b, s, block_ids)
    check_ids(PLAN_OP, block_ids, cu_seqlens, block_size)
    head_dim_v = V.check_int(PLAN_OP, "head_dim_v", head_dim_v, low=1)
    return build_plan(block_ids, heads_per_kv=heads_per_kv, block_size=block_size, causal=causal,
                      cu_seqlens=cu_seqlens, head_dim_v=head_dim_v)


def _index_int32(op: str, block_ids, cu_seqlens):
    """``block_ids`` and ``cu_seqlens`` (None stays None) as int32: int64 converted once; values outside
    int32 are an error on the host (``_validate.index_tensor``)."""
    block_ids = V.index_tensor(op, "block_ids", block_ids, padding=False)
    return block_ids, None if cu_seqlens is None else V.index_tensor(op, "cu_seqlens", cu_seqlens, padding=False)


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
    from .reference import block_sparse

    return block_sparse


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


# ----------------------------------------------------------------------------------------------
# checks shared with block_sparse_attention


def check_block_size(op: str, block_size) -> int:
    V.check_int(op, "block_size", block_size)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{op}: block_size must be one of {BLOCK_SIZES}, got {block_size}")
    return block_size


def check_cu_seqlens(op: str, cu_seqlens, batch: int, seqlen: int, like) -> None:
    """int32 ``[n + 1]`` or ``[B, n + 1]``, n >= 1; values (0 first, non-decreasing, S last) are
    checked when they are on the host."""
    if cu_seqlens is None:
        return
    V.check_tensor(op, "cu_seqlens", cu_seqlens)
    V.check_dtype(op, "cu_seqlens", cu_seqlens, ("int32",))
    V.check_rank(op, "cu_seqlens", cu_seqlens, (1, 2), "[n + 1] or [B, n + 1]")
    if cu_seqlens.shape[-1] < 2 or (cu_seqlens.ndim == 2 and cu_seqlens.shape[0] != batch):
        raise ValueError(f"{op}: cu_seqlens must be [n + 1] or [B, n + 1] with n >= 1 and B = {batch}, "
                         f"got shape {list(cu_seqlens.shape)}")
    V.check_same_place(op, {"block_ids": like, "cu_seqlens": cu_seqlens})
    values = V.host_values(cu_seqlens)
    if values is not None:
        import numpy as np

        rows = values.reshape(-1, values.shape[-1])
        if (rows[:, 0] != 0).any() or (rows[:, -1] != seqlen).any() or (np.diff(rows, axis=1) < 0).any():
            raise ValueError(f"{op}: cu_seqlens must start at 0, be non-decreasing and end at S = {seqlen}, "
                             f"got {values.tolist()}")


def check_ids(op: str, block_ids, cu_seqlens, block_size: int) -> None:
    """Ids must be -1 or name a block of the query's document (checked when on the host)."""
    ids = V.host_values(block_ids)
    if ids is None or ids.size == 0:
        return
    import numpy as np

    b, s = ids.shape[0], ids.shape[-2]
    if cu_seqlens is None:
        doc_len = np.full((b, s), s, dtype=np.int64)
    else:
        cu = V.host_values(cu_seqlens)
        cu = np.broadcast_to(cu.reshape(-1, cu.shape[-1]), (b, cu.shape[-1]))
        doc_len = np.stack([np.diff(row)[np.searchsorted(row, np.arange(s), side="right") - 1] for row in cu])
    nb = -(-doc_len // block_size)  # [B, S]
    nb = nb[:, None, :, None] if ids.ndim == 4 else nb[:, :, None]
    bad = (ids < -1) | (ids >= nb)
    if bad.any():
        where = tuple(int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"{op}: block_ids must be -1 or a block of the query's document (0 <= id < "
                         f"ceil(doc_len / block_size)); block_ids{list(where)} = {int(ids[where])}, "
                         f"doc_len {int(doc_len[where[0], where[-2]])}, block_size {block_size}")

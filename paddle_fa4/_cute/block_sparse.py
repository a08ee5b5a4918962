"""CuTe backend of :func:`paddle_fa4.block_sparse_attention` (see ``docs/hysparse.md``).

SM90 runs the block-sparse kernels of ``cute_kernels.block_sparse`` (also the absorbed-MLA latent, v=None,
Dk 576 / Dv 512 and Dk 512 / Dv 448, forward and backward: one combined latent gradient). SM100 (10.0 /
10.3) runs the block-sparse tcgen05 forward (``fwd_sm100.py``) and, at head dim 128, the tcgen05 backward
(``bwd_dq_sm100.py``, exact_delta included, and ``bwd_dkdv_sm100.py``; all compile-verified, never run here: no
Blackwell GPU), and takes the token path for the rest of Dk == Dv with v given (Note [SM100 token path] below);
the latent has no SM100 path (the reference under "auto").

Contract used by the PyLayer in ``paddle_fa4/block_sparse.py``:

    unsupported_reason(arch, spec, needs_grad) -> str | None
    forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan) -> (out, lse, plan)
    backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse, dout, plan) -> (dq, dk, dv, dsink)

The backward: ``delta = rowsum(dout * out)`` and the sink gradient ``-sum exp(sink - lse) delta``
with Paddle ops, dQ (query-major) and dK / dV (key-major, into zero-filled buffers) by the kernels;
no float atomics anywhere, so gradients are bitwise reproducible.

The plan is built with Paddle ops (``paddle_fa4._plan.block_sparse.build_plan``) when none is given; the
launchers in ``cute_kernels.block_sparse.launch`` are imported lazily.
"""

from __future__ import annotations

from .._bridge import arch_of, kernel_arg, kernel_input

OP = "block_sparse_attention"


def unsupported_reason(arch: int, spec, needs_grad: bool) -> str | None:
    """None when the CuTe kernels handle ``spec`` on compute capability ``arch``."""
    try:
        from cute_kernels.block_sparse.config import unsupported_reason as kernel_reason
    except ImportError as err:  # cutlass-dsl missing from this install
        return f"the CuTe block-sparse kernels cannot be imported ({err})"
    from cute_kernels.arch import family

    if family(arch) == 100:
        if _sm100_kernel_reason(spec) is None and not needs_grad:
            return None
        if needs_grad and _sm100_backward_reason(spec) is None:
            return None
        if needs_grad and spec.exact_delta and _sm100_kernel_reason(spec) is None:
            return (f"exact_delta=True at head dim {spec.Dk} on compute capability {arch} (the SM100 backward "
                    "kernels take head dim 128; the token path takes delta from out)")
        return _token_path_reason(arch, spec)  # the backward (and a forward the kernel does not take)
    if family(arch) != 90:
        return f"no CuTe block-sparse kernel for compute capability {arch}"
    if spec.has_sink and spec.scale == 0.0:
        return "softmax_scale 0 with a sink (the kernel folds the sink in units of the scale)"
    return kernel_reason(head_dim=spec.Dk, head_dim_v=spec.Dv, group=spec.group, dtype=spec.dtype,
                         block_size=spec.block_size, latent=spec.latent, backward=needs_grad)


# Note [SM100 token path]: where the block-sparse tcgen05 kernels do not take a case (the forward: the latent; the
# backward: head dims other than 128 -- without exact_delta, which the token path cannot do -- and what the
# forward does not take), an SM100 call expands the
# blocks to token index rows with Paddle ops -- the rule of the planner and the reference
# (paddle_fa4._plan.block_sparse.block_starts / query_limits: absolute block starts from document-relative ids,
# each row's causal or document-end limit; -1 for what the row does not see) -- and runs the
# indexed-attention kernels over them (forward, deterministic key-major backward; they compile for
# sm_100a / sm_103a; repeated blocks are repeated tokens, which indexed attention counts once). As slow
# as the token path the SM90 kernels replace, and the rows take B * S * topk * block_size int32
# (Hkv times that for per-kv-head ids), but on the GPU's kernels instead of the reference backend.
# Covered: Dk == Dv, v given, and what the indexed kernels take; the rest runs the reference under "auto".
# A sink is folded in around the indexed kernels (Note [sink on the token path]).
#
# Note [sink on the token path]: the sink is one more column of each row's softmax with logit sink[h] and
# no value, so with the indexed forward's (out, lse) over the keys alone, lse' = logaddexp(lse, sink[h])
# and out' = out * exp(lse - lse') (a row without keys: lse' = sink exactly, out' = 0). The indexed backward
# recomputes P from the lse it is given and takes delta = rowsum(dout * out) from the out it is given, so
# handed (out', lse') it differentiates the softmax with the sink, as the SM90 kernels do ("lse includes
# the sink"); dsink = -sum exp(sink - lse') delta, with the indexed dQ kernel's delta. out' is rounded twice to
# 16 bits (the kernel's out, then the rescale): at most one more rounding step than the SM90 kernel.


def _sm100_kernel_reason(spec) -> str | None:
    """Why the SM100 block-sparse forward kernel does not take ``spec`` (then the token path does), or None."""
    from cute_kernels.block_sparse.config import unsupported_reason as kernel_reason

    if spec.latent:
        return "the absorbed-MLA latent (v=None) has no SM100 kernel"
    if spec.has_sink and spec.scale == 0.0:
        return "softmax_scale 0 with a sink (the kernel folds the sink in units of the scale)"
    return kernel_reason(head_dim=spec.Dk, head_dim_v=spec.Dv, group=spec.group, dtype=spec.dtype,
                         block_size=spec.block_size)


def _sm100_backward_reason(spec) -> str | None:
    """Why the SM100 block-sparse backward kernels (``bwd_dq_sm100.py``, ``bwd_dkdv_sm100.py``) do not take ``spec``
    (then the token path runs the backward), or None."""
    reason = _sm100_kernel_reason(spec)
    if reason is not None:
        return reason
    if spec.Dk != 128:
        return f"head dim {spec.Dk} (the SM100 dK/dV kernel takes 128)"
    return None


class _TokenPlan:
    """What an SM100 forward hands its backward: the token rows, the indexed spec and plan (all None for
    a call with no work)."""

    def __init__(self, tokens, ispec, iplan):
        self.tokens, self.ispec, self.iplan = tokens, ispec, iplan


def _token_path_reason(arch: int, spec) -> str | None:
    if spec.latent:
        return f"the absorbed-MLA latent (v=None) on compute capability {arch} (SM100: token path only)"
    if spec.Dk != spec.Dv:
        return f"Dk {spec.Dk} != Dv {spec.Dv} on compute capability {arch} (SM100: token path only)"
    from . import indexed as indexed_glue

    reason = indexed_glue.unsupported_reason(arch, _indexed_spec(spec))
    return None if reason is None else f"SM100 token path: {reason}"


def _indexed_spec(spec):
    from ..indexed import IndexedSpec

    return IndexedSpec(B=spec.B, Lq=spec.S, Lkv=spec.S, Hq=spec.Hq, Hkv=spec.Hkv, D=spec.Dk,
                       W=spec.topk * spec.block_size, per_kv_head=spec.per_kv_head, scale=spec.scale,
                       dtype=spec.dtype)


def token_rows(spec, block_ids, cu_seqlens):
    """int32 ``[B, S, topk * block_size]`` (per-kv-head ids: ``[B, Hkv, S, ...]``): the key tokens of each
    row's blocks, -1 where the row does not see them (Note [SM100 token path])."""
    import paddle

    from .._plan.block_sparse import block_starts, block_tokens, doc_bounds, query_limits

    bos, eos = doc_bounds(spec.B, spec.S, cu_seqlens, block_ids.place)
    limit = query_limits(bos, eos, spec.causal)
    start = block_starts(block_ids, bos, limit, spec.block_size)  # int64, ids' shape, -1: nothing live
    token, keep = block_tokens(start, (limit.unsqueeze(1) if spec.per_kv_head else limit).unsqueeze(-1),
                               spec.block_size)
    return paddle.where(keep, token, paddle.full_like(token, -1)).astype("int32")


def _token_forward(spec, q, k, v, block_ids, cu_seqlens, sink):
    from . import indexed as indexed_glue

    if spec.B * spec.S * spec.Hq == 0 or spec.topk == 0:  # no work: zeros / -inf or the sink (the reference's rule)
        from ..reference import block_sparse as block_sparse_ref

        out, lse, _ = block_sparse_ref.forward(spec, q, k, v, block_ids, cu_seqlens, sink)
        return out, lse, _TokenPlan(None, None, None)
    tokens = token_rows(spec, block_ids, cu_seqlens)
    ispec = _indexed_spec(spec)
    out, lse, iplan = indexed_glue.forward(ispec, q, k, v, tokens, None)
    if sink is not None:
        out, lse = _fold_sink(out, lse, sink)
    return out, lse, _TokenPlan(tokens, ispec, iplan)


def _token_plan(spec, block_ids, cu_seqlens):
    """The token rows and indexed plan of the SM100 backward (Note [SM100 token path]) after the block-sparse
    forward kernel; None members for a call with no work."""
    from . import indexed as indexed_glue

    if spec.B * spec.S * spec.Hq == 0 or spec.topk == 0:
        return _TokenPlan(None, None, None)
    tokens = token_rows(spec, block_ids, cu_seqlens)
    ispec = _indexed_spec(spec)
    return _TokenPlan(tokens, ispec, indexed_glue._plan_for(ispec, kernel_input(tokens, 4), None))


def _fold_sink(out, lse, sink):
    """Note [sink on the token path]: (out', lse') of the softmax with the sink column from the keys' (out, lse);
    out [B, S, Hq, Dv], lse [B, Hq, S] fp32, sink [Hq]."""
    import paddle

    s = sink.astype("float32").reshape([1, -1, 1])
    m = paddle.maximum(lse, s)  # finite: the sink is
    lse2 = m + paddle.log(paddle.exp(lse - m) + paddle.exp(s - m))
    keep = paddle.exp(lse - lse2).transpose([0, 2, 1]).unsqueeze(-1)  # [B, S, Hq, 1]; 0 for a row without keys
    return (out.astype("float32") * keep).astype(out.dtype), lse2


def _sink_grad(sink, lse, delta):
    """dsink[h] = -sum_{b, s} exp(sink[h] - lse) delta, lse [B, Hq, S] with the sink in it (finite on every row),
    delta = rowsum(dout * out) [B, Hq, S]."""
    import paddle

    p_sink = paddle.exp(sink.astype("float32").reshape([1, -1, 1]) - lse)
    return -(p_sink * delta).sum(axis=[0, 2])


def forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan):
    import paddle

    from cute_kernels.arch import family

    arch = arch_of(q)
    if family(arch) == 100 and _sm100_kernel_reason(spec) is not None:
        # Note [SM100 token path]; a given block-sparse plan is not needed there
        return _token_forward(spec, q, k, v, block_ids, cu_seqlens, sink)

    from cute_kernels.block_sparse.config import tile_queries
    from cute_kernels.block_sparse.launch import fwd_config, run_fwd

    from .._plan.block_sparse import plan_for

    plan = plan_for(spec, block_ids, cu_seqlens, plan)
    want = tile_queries(spec.group, arch, spec.Dv)
    if plan.window_queries != want:
        raise ValueError(f"{OP}: plan tiles {plan.window_queries} queries, the kernel of this GPU (compute "
                         f"capability {arch}, Dv {spec.Dv}) takes {want}: build it on this GPU with "
                         f"block_sparse_plan(..., head_dim_v={spec.Dv})")
    q, k = kernel_input(q), kernel_input(k)  # strided views: contiguous copies
    v = None if spec.latent else kernel_input(v)  # the latent: V is k's leading Dv columns
    sink = None if sink is None else kernel_input(sink, 4)
    out = paddle.empty([spec.B, spec.S, spec.Hq, spec.Dv], dtype=q.dtype, device=q.place)
    lse = paddle.empty([spec.B, spec.Hq, spec.S], dtype="float32", device=q.place)
    cfg = fwd_config(q, k, v, per_kv_head=spec.per_kv_head, has_sink=sink is not None, arch=arch,
                     latent_dv=spec.Dv if spec.latent else None)
    a = kernel_arg
    run_fwd(cfg, a(q), a(k), a(v), a(plan.tile_start), a(plan.tile_mask), a(plan.tile_count), a(plan.q_limit),
            a(sink), a(out), a(lse), spec.scale)
    return out, lse, plan


def backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse, dout, plan):
    import paddle

    from cute_kernels.arch import family

    if not isinstance(plan, _TokenPlan) and family(arch_of(q)) == 100 and _sm100_backward_reason(spec) is not None:
        # the SM100 forward kernel ran (its out / lse include the sink); the backward kernels do not take this
        # case, so the backward takes the token path
        plan = _token_plan(spec, block_ids, cu_seqlens)
    if isinstance(plan, _TokenPlan):  # Note [SM100 token path]
        if plan.ispec is None:  # no work: zero gradients (and the sink's, from its rows)
            from ..reference import block_sparse as block_sparse_ref

            return block_sparse_ref.backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse, dout)
        from . import indexed as indexed_glue

        if sink is None:
            return indexed_glue.backward(plan.ispec, q, k, v, out, lse, dout, plan.iplan) + (None,)
        # out / lse have the sink folded in (Note [sink on the token path]); delta from the dQ kernel
        dq, dk, dv, delta = indexed_glue.backward(plan.ispec, q, k, v, out, lse, dout, plan.iplan, return_delta=True)
        return dq, dk, dv, _sink_grad(sink, lse, delta)

    from cute_kernels.block_sparse.launch import bwd_config, dkdv_workspace_shapes, run_bwd_dkdv, run_bwd_dq

    q, k, out, dout = (kernel_input(t) for t in (q, k, out, dout))
    v = None if spec.latent else kernel_input(v)  # the latent: V is k's leading Dv columns, one gradient in dk
    # rowsum(dout * out), or rowsum(P dP) with exact_delta (the dQ kernel writes every element)
    delta = paddle.empty([q.shape[0], q.shape[2], q.shape[1]], dtype="float32", device=q.place)
    dq = paddle.empty(q.shape, dtype=q.dtype, device=q.place)
    dk = paddle.zeros(k.shape, dtype=k.dtype, device=k.place)  # keys no query selects stay 0
    dv = None if v is None else paddle.zeros(v.shape, dtype=v.dtype, device=v.place)
    cfg = bwd_config(q, k, v, per_kv_head=spec.per_kv_head, arch=arch_of(q),
                     latent_dv=spec.Dv if spec.latent else None, exact_delta=spec.exact_delta)
    ws = {name: (paddle.zeros if zero else paddle.empty)(shape, dtype=dtype, device=q.place)
          for name, (shape, dtype, zero) in dkdv_workspace_shapes(k, v, plan.key_start).items()}
    a = kernel_arg
    run_bwd_dq(cfg, a(q), a(k), a(v), a(out), a(dout), a(lse), a(delta), a(plan.tile_start), a(plan.tile_mask),
               a(plan.tile_count), a(plan.q_limit), a(dq), spec.scale)
    run_bwd_dkdv(cfg, a(q), a(k), a(v), a(dout), a(lse), a(delta), a(plan.tile_mask), a(plan.q_limit),
                 a(plan.key_start), a(plan.key_end), a(plan.key_count), a(plan.key_ptr), a(plan.key_tile),
                 a(plan.key_slot), a(dk), a(dv), a(ws["dk_part"]), a(ws.get("dv_part")), a(ws["seg_sem"]), spec.scale,
                 key_order=a(plan.key_order))
    return dq, dk, dv, None if sink is None else _sink_grad(sink, lse, delta)

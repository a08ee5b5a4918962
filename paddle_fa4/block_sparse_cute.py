"""CuTe backend of :func:`paddle_fa4.block_sparse_attention` (SM90; see ``docs/hysparse.md``).

Contract used by the PyLayer in ``paddle_fa4/block_sparse.py``:

    unsupported_reason(arch, spec, needs_grad) -> str | None
    forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan) -> (out, lse, plan)
    backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse, dout, plan) -> (dq, dk, dv, dsink)

The backward: ``delta = rowsum(dout * out)`` and the sink gradient ``-sum exp(sink - lse) delta``
with Paddle ops, dQ (query-major) and dK / dV (key-major, into zero-filled buffers) by the kernels;
no float atomics anywhere, so gradients are bitwise reproducible.

The plan is built with Paddle ops (``block_sparse_planner.build_plan``) when none is given; the
launchers in ``cute_kernels.block_sparse.launch`` are imported lazily.
"""

from __future__ import annotations

from ._bridge import arch_of, kernel_arg, kernel_input

OP = "block_sparse_attention"


def unsupported_reason(arch: int, spec, needs_grad: bool) -> str | None:
    """None when the CuTe kernels handle ``spec`` on compute capability ``arch``."""
    try:
        from cute_kernels.block_sparse.config import unsupported_reason as kernel_reason
    except ImportError as err:  # cutlass-dsl missing from this install
        return f"the CuTe block-sparse kernels cannot be imported ({err})"
    from cute_kernels.arch import family

    if family(arch) != 90:
        return f"no CuTe block-sparse kernel for compute capability {arch} yet (SM90 only)"
    if spec.has_sink and spec.scale == 0.0:
        return "softmax_scale 0 with a sink (the kernel folds the sink in units of the scale)"
    return kernel_reason(head_dim=spec.Dk, head_dim_v=spec.Dv, group=spec.group, dtype=spec.dtype,
                         block_size=spec.block_size, latent=spec.latent, backward=needs_grad)


def forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan):
    import paddle

    from cute_kernels.block_sparse.config import tile_queries
    from cute_kernels.block_sparse.launch import fwd_config, run_fwd

    from .block_sparse import plan_for

    plan = plan_for(spec, block_ids, cu_seqlens, plan)
    assert plan.window_queries == tile_queries(spec.group), "planner and kernel disagree on the row tile"
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)  # strided views: contiguous copies
    sink = None if sink is None else kernel_input(sink, 4)
    out = paddle.empty([spec.B, spec.S, spec.Hq, spec.Dv], dtype=q.dtype, device=q.place)
    lse = paddle.empty([spec.B, spec.Hq, spec.S], dtype="float32", device=q.place)
    cfg = fwd_config(q, k, v, per_kv_head=spec.per_kv_head, has_sink=sink is not None, arch=arch_of(q))
    a = kernel_arg
    run_fwd(cfg, a(q), a(k), a(v), a(plan.tile_start), a(plan.tile_mask), a(plan.tile_count), a(plan.q_limit),
            a(sink), a(out), a(lse), spec.scale)
    return out, lse, plan


def backward(spec, q, k, v, block_ids, cu_seqlens, sink, out, lse, dout, plan):
    import paddle

    from cute_kernels.block_sparse.launch import bwd_config, dkdv_workspace_shapes, run_bwd_dkdv, run_bwd_dq

    q, k, v, out, dout = (kernel_input(t) for t in (q, k, v, out, dout))
    delta = paddle.empty([q.shape[0], q.shape[2], q.shape[1]], dtype="float32", device=q.place)  # rowsum(dout*out)
    dq = paddle.empty(q.shape, dtype=q.dtype, device=q.place)
    dk = paddle.zeros(k.shape, dtype=k.dtype, device=k.place)  # keys no query selects stay 0
    dv = paddle.zeros(v.shape, dtype=v.dtype, device=v.place)
    cfg = bwd_config(q, k, v, per_kv_head=spec.per_kv_head, arch=arch_of(q))
    ws = {name: (paddle.zeros if zero else paddle.empty)(shape, dtype=dtype, device=q.place)
          for name, (shape, dtype, zero) in dkdv_workspace_shapes(k, v, plan.key_start).items()}
    a = kernel_arg
    run_bwd_dq(cfg, a(q), a(k), a(v), a(out), a(dout), a(lse), a(delta), a(plan.tile_start), a(plan.tile_mask),
               a(plan.tile_count), a(plan.q_limit), a(dq), spec.scale)
    run_bwd_dkdv(cfg, a(q), a(k), a(v), a(dout), a(lse), a(delta), a(plan.tile_mask), a(plan.q_limit),
                 a(plan.key_start), a(plan.key_end), a(plan.key_count), a(plan.key_ptr), a(plan.key_tile),
                 a(plan.key_slot), a(dk), a(dv), a(ws["dk_part"]), a(ws["dv_part"]), a(ws["seg_sem"]), spec.scale)
    dsink = None
    if sink is not None:  # lse includes the sink, so it is finite on every row
        p_sink = paddle.exp(sink.astype("float32").reshape([1, -1, 1]) - lse)
        dsink = -(p_sink * delta).sum(axis=[0, 2])
    return dq, dk, dv, dsink

"""CuTe backend of :func:`paddle_fa4.block_sparse_attention` (SM90 forward; see ``docs/hysparse.md``).

Contract used by the PyLayer in ``paddle_fa4/block_sparse.py``:

    unsupported_reason(arch, spec, needs_grad) -> str | None
    forward(spec, q, k, v, block_ids, cu_seqlens, sink, plan) -> (out, lse, plan)
    backward(...)  -> raises NotImplementedError (no CuTe backward yet; unsupported_reason refuses
                      calls that need gradients, so ``auto`` runs them on the reference)

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

    if needs_grad:
        return "the CuTe block-sparse backward is not implemented yet (SM90 forward only)"
    if family(arch) != 90:
        return f"no CuTe block-sparse kernel for compute capability {arch} yet (SM90 forward only)"
    if spec.has_sink and spec.scale == 0.0:
        return "softmax_scale 0 with a sink (the kernel folds the sink in units of the scale)"
    return kernel_reason(head_dim=spec.Dk, head_dim_v=spec.Dv, group=spec.group, dtype=spec.dtype,
                         block_size=spec.block_size, latent=spec.latent)


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


def backward(*args, **kwargs):
    raise NotImplementedError(f"{OP}: the CuTe backward is not implemented yet (SM90 forward only)")

"""CuTe backend of :func:`paddle_fa4.indexed_attention` and :func:`paddle_fa4.indexed_attention_plan`.

Contract used by the PyLayer in ``paddle_fa4/indexed.py``:

    unsupported_reason(arch, spec) -> str | None
    forward(spec, q, k, v, indices, plan) -> (out, lse, plan)     # plan None: built on the GPU
    backward(spec, q, k, v, out, lse, dout, plan) -> (dq, dk, dv)

Outputs are allocated with ``paddle.empty`` on the inputs' place (the kernels write every element)
and the launchers in ``cute_kernels.indexed.launch`` are imported lazily.
"""

from __future__ import annotations

import functools

from .._bridge import arch_of, kernel_arg, kernel_input

OP = "indexed_attention"
_LAUNCH_MODULE = "cute_kernels.indexed.launch"


def _launch():
    import importlib

    return importlib.import_module(_LAUNCH_MODULE)


def plan_unsupported_reason(arch: int) -> str | None:
    try:
        _launch()
    except ImportError as err:  # cutlass-dsl missing from this install
        return f"the CuTe indexed kernels cannot be imported ({err})"
    return None


def unsupported_reason(arch: int, spec) -> str | None:
    """None when the CuTe kernels handle ``spec`` on compute capability ``arch`` (90, 100 or 103)."""
    from cute_kernels.indexed.config import unsupported_reason as kernel_reason

    reason = kernel_reason(spec.D, spec.Hq // spec.Hkv, spec.dtype)
    return reason if reason is not None else plan_unsupported_reason(arch)


def build_plan(flat_indices, *, num_sets: int, num_queries: int, width: int, kv_len: int,
               heads_per_kv: int, per_kv_head: bool):
    """The windowed plan of ``flat_indices [S, Lq, W]`` built by the plan kernels (no host sync)."""
    import paddle

    from .._plan.indexed import IndexedAttentionPlan, plan_shapes, window_queries

    wq = window_queries(heads_per_kv)
    shapes = plan_shapes(num_sets, num_queries, width, kv_len, wq)
    place = flat_indices.place
    t = {n: paddle.empty(s, dtype="int32", device=place) for n, s in shapes.items() if n != "tile_bits"}
    t["tile_bits"] = paddle.zeros(shapes["tile_bits"], dtype="int32", device=place)
    if num_sets * num_queries * width > 0 and kv_len > 0:
        _launch().run_plan(kernel_arg(kernel_input(flat_indices, 4)), kv_len, *(kernel_arg(t[n]) for n in (
            "win_key", "win_mask", "win_count", "tile_bits", "tile_ptr", "tile_win", "tile_start")),
            window_queries=wq, arch=arch_of(flat_indices))
    else:
        t["win_count"] = paddle.zeros(shapes["win_count"], dtype="int32", device=place)
        t["tile_ptr"] = paddle.zeros(shapes["tile_ptr"], dtype="int32", device=place)
    return IndexedAttentionPlan(backend="cute", window_queries=wq, num_sets=num_sets, num_queries=num_queries,
                                width=width, kv_len=kv_len, heads_per_kv=heads_per_kv,
                                per_kv_head=per_kv_head, **t)


def _plan_for(spec, indices, plan):
    num_sets = spec.B * (spec.Hkv if spec.per_kv_head else 1)
    geometry = dict(num_sets=num_sets, num_queries=spec.Lq, width=spec.W, kv_len=spec.Lkv,
                    heads_per_kv=spec.Hq // spec.Hkv, per_kv_head=spec.per_kv_head)
    if plan is None:
        return build_plan(indices.reshape([num_sets, spec.Lq, spec.W]), **geometry)
    if not plan.matches(**geometry):
        raise ValueError(f"{OP}: plan was built for other indices (sets/queries/width/kv_len/"
                         f"heads_per_kv/layout {plan.num_sets}/{plan.num_queries}/{plan.width}/"
                         f"{plan.kv_len}/{plan.heads_per_kv}/{plan.per_kv_head}, call needs "
                         f"{'/'.join(str(v) for v in geometry.values())})")
    return plan


def _config(spec, q):
    return _attn_config(arch_of(q), spec.D, spec.Hq // spec.Hkv, spec.Hkv, spec.per_kv_head)


@functools.lru_cache(maxsize=None)
def _attn_config(arch: int, head_dim: int, group: int, num_kv_heads: int, per_kv_head: bool):
    """The kernels' compile key, built once per shape class (forward and backward of every call)."""
    from cute_kernels.indexed.config import AttnConfig

    return AttnConfig(arch=arch, head_dim=head_dim, group=group, num_kv_heads=num_kv_heads,
                      per_kv_head=per_kv_head)


def forward(spec, q, k, v, indices, plan):
    import paddle

    indices = kernel_input(indices, 4)
    plan = _plan_for(spec, indices, plan)
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)  # strided views: contiguous copies
    out = paddle.empty([spec.B, spec.Lq, spec.Hq, spec.D], dtype=q.dtype, device=q.place)
    lse = paddle.empty([spec.B, spec.Hq, spec.Lq], dtype="float32", device=q.place)
    _launch().run_fwd(_config(spec, q), kernel_arg(q), kernel_arg(k), kernel_arg(v), kernel_arg(plan.win_key),
                      kernel_arg(plan.win_mask), kernel_arg(plan.win_count), kernel_arg(out), kernel_arg(lse),
                      spec.scale)
    return out, lse, plan


def backward(spec, q, k, v, out, lse, dout, plan, return_delta: bool = False):
    """(dq, dk, dv), and with ``return_delta`` also the dQ kernel's ``delta = rowsum(dout * out)`` [B, Hq, Lq]
    fp32 (every row written; the block-sparse token path's sink gradient reads it)."""
    import paddle

    q, k, v, out, dout = (kernel_input(t) for t in (q, k, v, out, dout))
    dq = paddle.empty(q.shape, dtype=q.dtype, device=q.place)
    dk = paddle.empty(k.shape, dtype=k.dtype, device=k.place)
    dv = paddle.empty(v.shape, dtype=v.dtype, device=v.place)
    delta = paddle.empty([spec.B, spec.Hq, spec.Lq], dtype="float32", device=q.place)
    a = kernel_arg
    _launch().run_bwd(_config(spec, q), a(q), a(k), a(v), a(out), a(dout), a(lse), a(plan.win_key),
                      a(plan.win_mask), a(plan.win_count), a(plan.tile_ptr), a(plan.tile_win),
                      a(plan.tile_start), a(dq), a(dk), a(dv), a(delta), spec.scale)
    return (dq, dk, dv, delta) if return_delta else (dq, dk, dv)

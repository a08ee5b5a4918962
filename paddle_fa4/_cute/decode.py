"""CuTe backend of ``paddle_fa4.decode``: allocate with ``_bridge.empty``, call the decode launchers.

Interface fixed by the decode contract (decode.py validates shapes, dtypes and index ranges before
calling here): ``seqlens`` int32 ``[B]`` with ``table`` int32 ``[B, n]`` (the dense form, one page list
per sequence: passed to the kernel as the caller's tensors, never expanded over kv heads), or
``[B, Hkv]`` with ``[B, Hkv, n]`` (per kv head); ``table`` is None for the contiguous layout. Window
sizes are ints, -1 = unbounded, already normalised (causal -> right 0). A strided or misaligned
tensor is read through a compact copy (``kernel_input``); a compact one is passed as it is.
The split partials (fp32) are allocated here when the split count is above 1; the split count
comes from shapes only (``num_splits=None``), so a decode step stays CUDA-graph capturable.

Per call: one dict lookup for what the shapes decide (``_plan``: block_logit's extent, the split count,
the partial shapes), the output allocations, and the launcher's own lookup.
"""

from __future__ import annotations

from cute_kernels.dtypes import dtype_name

from .. import _bridge
from .._bridge import device_of, kernel_arg, kernel_input

_REASONS: dict = {}
_MISS = object()


#: (compute-capability family, case) of decode kernel paths changed since their last GPU run: ``auto`` takes the
#: reference for them (``backend="cute"`` runs them); an entry goes once tests/gpu/test_decode.py passes with it.
#: Empty: the d 256 warp-pair path (``config.d_split``) passed on an H100 on 2026-12-07 (38 of 38).
NOT_YET_RUN: set = set()


def unverified_reason(arch: int, q) -> str | None:
    """Why ``auto`` should not yet pick the decode kernel for ``q`` on ``arch`` (None: nothing keeps it)."""
    case = f"head_dim {int(q.shape[-1])}"
    if (arch // 10 * 10, case) in NOT_YET_RUN:
        return (f"the SM{arch // 10 * 10} decode kernel's {case} path has not run on a GPU yet; backend='cute' runs it "
                f"(docs/decode.md)")
    return None


def unsupported_reason(arch: int, q, k_cache, v_cache, *, layout: str, paged: bool, sparse: bool,
                       block_logit_size) -> str | None:
    """None when the CuTe decode kernel handles these tensors on ``arch``, else why not."""
    key = (arch, dtype_name(q.dtype), dtype_name(k_cache.dtype), dtype_name(v_cache.dtype), tuple(q.shape)[1:],
           tuple(k_cache.shape)[1:], tuple(v_cache.shape)[1:], layout, paged, sparse, block_logit_size)
    hit = _REASONS.get(key, _MISS)
    if hit is _MISS:
        hit = _REASONS[key] = _kernel_reason(arch, q, k_cache, v_cache, layout, paged, block_logit_size)
    return hit


def _kernel_reason(arch, q, k_cache, v_cache, layout, paged, block_logit_size) -> str | None:
    from cute_kernels.decode.config import unsupported_reason as why
    from cute_kernels.decode.launch import decode_config

    if layout not in ("hnd", "nhd", "contiguous"):
        return f"cache layout {layout!r}"
    if paged == (layout == "contiguous"):
        return "a page table goes with the paged layouts only"
    if dtype_name(k_cache.dtype) != dtype_name(q.dtype) or dtype_name(v_cache.dtype) != dtype_name(q.dtype):
        return f"q / k / v dtypes differ ({q.dtype}, {k_cache.dtype}, {v_cache.dtype})"
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        return "head_dim_v != head_dim (the decode kernel reads K and V with one layout)"
    hkv = int(k_cache.shape[1] if layout == "hnd" else k_cache.shape[2])
    if hkv <= 0 or int(q.shape[2]) % hkv:
        return f"Hq = {q.shape[2]} is not a multiple of Hkv = {hkv}"
    cfg = decode_config(q, k_cache, layout=layout, causal_or_right=True, has_left=True, softcap=False,
                        block_size=int(block_logit_size or 0), split=False, arch=arch)
    return why(cfg)


def decode_fwd(q, k_cache, v_cache, seqlens, table, *, layout: str, softmax_scale: float, causal: bool,
               window_left: int, window_right: int, softcap: float, num_splits, return_lse: bool,
               block_logit_size):
    """(out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]`` fp32 or None, block_logit ``[B, Hq, Sq, nb]`` fp32 or None)."""
    q, k_cache, v_cache = kernel_input(q), kernel_input(k_cache), kernel_input(v_cache)
    seqlens, table = kernel_input(seqlens, 4), kernel_input(table, 4)
    arch, device, place = device_of(q)
    bs = int(block_logit_size or 0)
    right = 0 if causal else window_right
    dt = q.dtype
    q_shape = tuple(q.shape)
    # everything the launcher's key holds (the dtype by identity: the plan's launch function keeps it alive)
    key = (arch, device, id(dt), q_shape, tuple(k_cache.shape), seqlens.ndim,
           None if table is None else table.shape[-1], layout, bs, num_splits, window_left >= 0, right >= 0,
           softcap > 0.0)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(q, k_cache, seqlens, table, layout, bs, num_splits, device, arch, window_left,
                                   right, softcap)
    launch, bl_shape, o_shape, l_shape = plan
    b, sq, hq, _ = q_shape
    out = _bridge.empty(q_shape, dt, q, place)
    lse = _bridge.empty((b, hq, sq), "float32", q, place)
    block_logit = _bridge.empty(bl_shape, "float32", q, place) if bs else None
    o_part = lse_part = None
    if o_shape is not None:
        o_part = _bridge.empty(o_shape, "float32", q, place)
        lse_part = _bridge.empty(l_shape, "float32", q, place)
    if b:
        launch(kernel_arg(q), kernel_arg(k_cache), kernel_arg(v_cache), kernel_arg(seqlens), kernel_arg(table), out,
               lse, block_logit, o_part, lse_part, softmax_scale, softcap if softcap > 0.0 else 0.0, window_left,
               right)
    return out, (lse if return_lse else None), block_logit


_PLANS: dict = {}  # glue key -> (launch function, block_logit shape, partial shapes): what the shapes decide


def _plan(q, k_cache, seqlens, table, layout, bs, num_splits, device, arch, window_left, window_right, softcap):
    """``(launch, block_logit shape | None, o_part shape | None, lse_part shape | None)`` from shapes only."""
    from cute_kernels.arch import device_sm_count
    from cute_kernels.decode import launch as L
    from cute_kernels.decode.config import MAX_SPLITS

    b, sq, hq, _ = (int(x) for x in q.shape)
    bl_shape = (b, hq, sq, -(-L.sk_max(k_cache, table, layout) // bs)) if bs else None
    if num_splits is None or int(num_splits) <= 0:
        sm_count = device_sm_count(device)
        if sm_count is None:
            raise RuntimeError("cannot read the SM count of the tensors' CUDA device")
        num_splits = L.choose_num_splits(q, k_cache, table, layout=layout, sm_count=sm_count, block_size=bs)
    splits = min(int(num_splits), MAX_SPLITS)
    o_shape, l_shape = L.partial_shapes(q, splits) if splits > 1 else (None, None)
    launch = L.decode_launcher(q, k_cache, seqlens, table, layout=layout, split=splits > 1,
                               window_left=window_left, window_right=window_right, softcap=softcap, block_size=bs,
                               arch=arch)
    return launch, bl_shape, o_shape, l_shape

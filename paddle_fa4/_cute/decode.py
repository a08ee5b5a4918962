"""CuTe backend of ``paddle_fa4.decode``: allocate with ``_bridge.empty``, call the decode launchers.

Interface fixed by the decode contract (decode.py validates shapes, dtypes and index ranges before
calling here): ``seqlens`` int32 ``[B, Hkv]`` and ``table`` int32 ``[B, Hkv, n]`` (None for the
contiguous layout); window sizes are ints, -1 = unbounded, already normalised (causal -> right 0).
A stride-0 (broadcast) or strided index tensor is read through a compact copy (``kernel_input``).
The split partials (fp32) are allocated here when the split count is above 1; the split count
comes from shapes only (``num_splits=None``), so a decode step stays CUDA-graph capturable.
"""

from __future__ import annotations

from .. import _bridge
from .._bridge import arch_of, kernel_arg, kernel_input

_REASONS: dict = {}


def unsupported_reason(arch: int, q, k_cache, v_cache, *, layout: str, paged: bool, sparse: bool,
                       block_logit_size) -> str | None:
    """None when the CuTe decode kernel handles these tensors on ``arch``, else why not."""
    key = (arch, str(q.dtype), str(k_cache.dtype), str(v_cache.dtype), tuple(q.shape[1:]), tuple(k_cache.shape[1:]),
           tuple(v_cache.shape[1:]), layout, bool(paged), bool(sparse), block_logit_size)
    if key not in _REASONS:
        _REASONS[key] = _kernel_reason(arch, q, k_cache, v_cache, layout, paged, block_logit_size)
    return _REASONS[key]


def _kernel_reason(arch, q, k_cache, v_cache, layout, paged, block_logit_size) -> str | None:
    from cute_kernels.decode.config import unsupported_reason as why
    from cute_kernels.decode.launch import decode_config
    from cute_kernels.dtypes import dtype_name

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
    from cute_kernels.arch import tensor_sm_count
    from cute_kernels.decode.config import MAX_SPLITS
    from cute_kernels.decode.launch import choose_num_splits, partial_shapes, run_decode, sk_max

    q, k_cache, v_cache = kernel_input(q), kernel_input(k_cache), kernel_input(v_cache)
    seqlens, table = kernel_input(seqlens, 4), kernel_input(table, 4)
    b, sq, hq, d = (int(x) for x in q.shape)
    bs = int(block_logit_size or 0)
    out = _bridge.empty((b, sq, hq, d), q.dtype, q)
    lse = _bridge.empty((b, hq, sq), "float32", q)
    block_logit = None
    if bs:
        nb = -(-sk_max(k_cache, table, layout) // bs)
        block_logit = _bridge.empty((b, hq, sq, nb), "float32", q)
    if num_splits is None or int(num_splits) <= 0:
        num_splits = choose_num_splits(q, k_cache, table, layout=layout, sm_count=tensor_sm_count(q), block_size=bs)
    num_splits = min(int(num_splits), MAX_SPLITS)
    o_part = lse_part = None
    if num_splits > 1:
        o_shape, l_shape = partial_shapes(q, num_splits)
        o_part = _bridge.empty(o_shape, "float32", q)
        lse_part = _bridge.empty(l_shape, "float32", q)
    right = 0 if causal else int(window_right)
    run_decode(kernel_arg(q), kernel_arg(k_cache), kernel_arg(v_cache), kernel_arg(seqlens), kernel_arg(table), out,
               lse, block_logit, o_part, lse_part, layout=layout, softmax_scale=float(softmax_scale),
               window_left=int(window_left), window_right=right, softcap=float(softcap or 0.0), block_size=bs,
               arch=arch_of(q))
    return out, (lse if return_lse else None), block_logit

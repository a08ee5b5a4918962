"""CuTe backend of :func:`paddle_fa4.flash_attn_fwd`: spec -> ``FwdConfig`` -> ``run_fwd``.

The launcher (``cute_kernels.attention.launch``) is imported lazily, only when a call may go to the
kernels, so ``import paddle_fa4`` never loads cutlass.
"""

from __future__ import annotations

from .._bridge import arch_of, kernel_arg, require_aligned, require_contiguous

OP = "flash_attn_fwd"
_LAUNCH_MODULE = "cute_kernels.attention.launch"

#: (head_dim, head_dim_v) pairs the kernels are built for.
KERNEL_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
KERNEL_DTYPES = ("bfloat16", "float16")


def _launch():
    """The launcher module, or None when it is not part of this install yet."""
    import importlib

    try:
        return importlib.import_module(_LAUNCH_MODULE)
    except ModuleNotFoundError as err:
        if err.name in (_LAUNCH_MODULE, "cute_kernels.attention"):
            return None
        raise


def fwd_config(arch: int, spec):
    """The launcher's compile key for ``spec`` on kernel family ``arch`` (90 or 100)."""
    return _launch().fwd_config(
        arch=arch, dtype=spec.dtype, head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
        qhead_per_kvhead=spec.qhead_per_kvhead, causal=spec.causal, has_window=spec.has_window,
        has_softcap=spec.softcap > 0, block_size=spec.block_size, varlen=spec.varlen)


def unsupported_reason(arch: int, spec) -> str | None:
    """None when the CuTe forward handles ``spec`` on kernel family ``arch``, else why not."""
    if spec.dtype not in KERNEL_DTYPES:
        return f"the CuTe kernels take bfloat16 or float16 inputs, got {spec.dtype}"
    if (spec.head_dim, spec.head_dim_v) not in KERNEL_HEAD_DIMS:
        return (f"no CuTe kernel for head_dim {spec.head_dim} / head_dim_v {spec.head_dim_v} "
                f"(supported: {', '.join(f'{d}/{dv}' for d, dv in KERNEL_HEAD_DIMS)})")
    launch = _launch()
    if launch is None:
        return f"the CuTe attention forward is not available ({_LAUNCH_MODULE} is missing)"
    return launch.unsupported_reason(fwd_config(arch, spec))


def flash_attn_fwd(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k) -> None:
    """Launch the CuTe forward; same out-parameter contract as the reference.

    Raises:
        ValueError: an input or output is not contiguous or not 16-byte aligned.
    """
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "block_logit": block_logit,
             "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    for name, t in named.items():
        require_contiguous(OP, name, t)
    for name in ("q", "k", "v", "out"):
        require_aligned(OP, name, named[name])
    for name in ("lse", "block_logit", "cu_seqlens_q", "cu_seqlens_k"):
        require_aligned(OP, name, named[name], nbytes=4)
    launch = _launch()
    cfg = fwd_config(arch_of(q), spec)
    launch.run_fwd(
        cfg, kernel_arg(q), kernel_arg(k), kernel_arg(v), kernel_arg(out), kernel_arg(lse),
        kernel_arg(block_logit), kernel_arg(cu_seqlens_q), kernel_arg(cu_seqlens_k),
        softmax_scale=spec.softmax_scale, softcap=spec.softcap,
        window_left=-1 if spec.window_left is None else spec.window_left,
        window_right=-1 if spec.window_right is None else spec.window_right,
        max_seqlen_q=spec.seqlen_q)

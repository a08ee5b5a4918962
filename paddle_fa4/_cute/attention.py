"""CuTe backend of :func:`paddle_fa4.flash_attn_fwd` (spec -> ``FwdConfig`` -> ``run_fwd``) and of
its backward :func:`paddle_fa4.flash_attn_bwd` (spec -> ``BwdConfig`` -> workspace -> ``run_bwd``).

The launchers (``cute_kernels.attention.launch``, ``cute_kernels.attention.bwd_launch``) are
imported lazily, only when a call may go to the kernels, so ``import paddle_fa4`` never loads
cutlass.
"""

from __future__ import annotations

import sys

from .. import _bridge
from .._bridge import (arch_of, commit_output, kernel_arg, kernel_input, require_aligned, require_contiguous,
                       stage_output)

OP = "flash_attn_fwd"
BWD_OP = "flash_attn_bwd"
_LAUNCH_MODULE = "cute_kernels.attention.launch"
_BWD_LAUNCH_MODULE = "cute_kernels.attention.bwd_launch"

#: (head_dim, head_dim_v) pairs the kernels are built for.
KERNEL_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
KERNEL_DTYPES = ("bfloat16", "float16")


def _import_launcher(module: str):
    """The launcher module, or None when it is not part of this install yet (looked up on every call:
    an imported module comes straight from ``sys.modules``)."""
    found = sys.modules.get(module)
    if found is not None:
        return found
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name in (module, "cute_kernels.attention"):
            return None
        raise


def _launch():
    """The forward launcher module, or None when it is not part of this install yet."""
    return _import_launcher(_LAUNCH_MODULE)


def _bwd_launch():
    """The backward launcher module, or None when it is not part of this install yet."""
    return _import_launcher(_BWD_LAUNCH_MODULE)


def fwd_config(arch: int, spec):
    """The launcher's compile key for ``spec`` on compute capability ``arch`` (90, 100 or 103)."""
    return _launch().fwd_config(
        arch=arch, dtype=spec.dtype, head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
        qhead_per_kvhead=spec.qhead_per_kvhead, causal=spec.causal, has_window=spec.has_window,
        has_softcap=spec.softcap > 0, block_size=spec.block_size, varlen=spec.varlen, startend=spec.startend,
        block_bos=spec.has_block_bos)


def _kernel_case_reason(spec) -> str | None:
    """Why no CuTe attention kernel (forward or backward) takes ``spec``'s dtype / head dims."""
    if spec.dtype not in KERNEL_DTYPES:
        return f"the CuTe kernels take bfloat16 or float16 inputs, got {spec.dtype}"
    if (spec.head_dim, spec.head_dim_v) not in KERNEL_HEAD_DIMS:
        return (f"no CuTe kernel for head_dim {spec.head_dim} / head_dim_v {spec.head_dim_v} "
                f"(supported: {', '.join(f'{d}/{dv}' for d, dv in KERNEL_HEAD_DIMS)})")
    return None


def unsupported_reason(arch: int, spec) -> str | None:
    """None when the CuTe forward handles ``spec`` on compute capability ``arch``, else why not."""
    reason = _kernel_case_reason(spec)
    if reason is not None:
        return reason
    launch = _launch()
    if launch is None:
        return f"the CuTe attention forward is not available ({_LAUNCH_MODULE} is missing)"
    return launch.unsupported_reason(fwd_config(arch, spec))


#: (compute-capability family, case) of kernel paths that compile and have GPU tests but have not run on a
#: GPU yet: ``auto`` takes the reference for them (``backend="cute"`` runs them). An entry goes once its GPU
#: tests pass (tests/gpu/test_flashmask.py, tests/gpu/test_block_bos.py). SM100 is compile-only as a whole
#: (README), so its entries would say nothing new.
# (empty since 2026-12-07: the SM90 FlashMask forward / backward and block_bos paths passed their GPU tests on an
# H100, tests/gpu/test_flashmask.py 80 passed, tests/gpu/test_block_bos.py 31 passed)
NOT_YET_RUN: set = set()


def unverified_reason(arch: int, spec) -> str | None:
    """Why ``auto`` should not yet pick the CuTe kernels for ``spec`` on ``arch`` (None: nothing keeps it)."""
    family = arch // 10 * 10
    for case, present in (("startend_row_indices", bool(spec.startend)), ("block_bos", spec.has_block_bos)):
        if present and (family, case) in NOT_YET_RUN:
            return (f"the SM{family} kernels' {case} path has not run on a GPU yet; backend='cute' runs it "
                    f"(docs/api.md, FlashMask)")
    return None


def flash_attn_fwd(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k, startend_row_indices=None,
                   block_bos=None) -> None:
    """Launch the CuTe forward; same out-parameter contract as the reference.

    Strided (or misaligned) q / k / v / cu_seqlens are read through contiguous copies; a strided
    caller ``block_logit`` buffer is written through a contiguous temporary and copied back (the
    kernels are compiled for compact row-major layouts). ``out``/``lse`` are the op's own
    ``paddle.empty`` allocations.

    ``block_bos`` (int32 ``[B, Sq]``, with ``spec.has_block_bos``): document-relative block_logit; the
    launcher says where a kernel takes it (SM90; SM100 names the case).

    Raises:
        ValueError: ``out`` or ``lse`` is not contiguous or not aligned (never for the op's own).
    """
    assert (block_bos is None) == (not spec.has_block_bos), "block_bos must match spec.has_block_bos"
    q, k, v = (kernel_input(t) for t in (q, k, v))
    startend_row_indices = kernel_input(startend_row_indices, 4)
    block_bos = kernel_input(block_bos, 4)
    cu_seqlens_q, cu_seqlens_k = kernel_input(cu_seqlens_q, 4), kernel_input(cu_seqlens_k, 4)
    caller_block_logit, block_logit = block_logit, stage_output(block_logit, 4)
    for name, t in (("out", out), ("lse", lse)):
        require_contiguous(OP, name, t)
    require_aligned(OP, "out", out)
    require_aligned(OP, "lse", lse, nbytes=4)
    launch = _launch()
    cfg = fwd_config(arch_of(q), spec)
    fm_kw = {}
    if spec.startend:  # FlashMask: the tile metadata workspace (fm_meta), filled by run_fwd
        from cute_kernels.attention import fm_meta

        shapes = fm_meta.workspace_shapes(launch.fm_meta_config(cfg), spec.batch, spec.startend_heads,
                                          spec.seqlen_q, spec.seqlen_k)
        fm_kw = {name: kernel_arg(_bridge.empty(shape, dtype, q)) for name, (shape, dtype) in shapes.items()}
        fm_kw["startend"] = kernel_arg(startend_row_indices)
    if block_bos is not None:
        fm_kw["block_bos"] = kernel_arg(block_bos)
    launch.run_fwd(
        cfg, kernel_arg(q), kernel_arg(k), kernel_arg(v), kernel_arg(out), kernel_arg(lse),
        kernel_arg(block_logit), kernel_arg(cu_seqlens_q), kernel_arg(cu_seqlens_k),
        softmax_scale=spec.softmax_scale, softcap=spec.softcap,
        window_left=-1 if spec.window_left is None else spec.window_left,
        window_right=-1 if spec.window_right is None else spec.window_right,
        max_seqlen_q=spec.seqlen_q, **fm_kw)
    commit_output(caller_block_logit, block_logit)


# ----------------------------------------------------------------------------------------------
# backward


def bwd_config(arch: int, spec, deterministic: bool, has_dlse: bool):
    """The backward launcher's compile key for ``spec`` on compute capability ``arch`` (90, 100 or 103)."""
    return _bwd_launch().bwd_config(
        arch=arch, dtype=spec.dtype, head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
        qhead_per_kvhead=spec.qhead_per_kvhead, causal=spec.causal, has_window=spec.has_window,
        has_softcap=spec.softcap > 0, varlen=spec.varlen, deterministic=bool(deterministic),
        has_dlse=bool(has_dlse), startend=spec.startend)


def bwd_unsupported_reason(arch: int, spec, deterministic: bool, has_dlse: bool) -> str | None:
    """None when the CuTe backward handles ``spec`` on compute capability ``arch``, else why not."""
    reason = _kernel_case_reason(spec)
    if reason is not None:
        return reason
    launch = _bwd_launch()
    if launch is None:
        return f"the CuTe attention backward is not available ({_BWD_LAUNCH_MODULE} is missing)"
    return launch.unsupported_reason(bwd_config(arch, spec, deterministic, has_dlse))


def flash_attn_bwd(spec, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *,
                   deterministic=False, startend_row_indices=None):
    """Launch the CuTe backward: allocate the workspace (and dq/dk/dv when None) with ``paddle.empty``
    and call ``run_bwd``; same contract as the reference. Strided (or misaligned) inputs are read
    through contiguous copies; strided dq/dk/dv out-parameters are written through contiguous
    temporaries and copied back (the caller's tensors then hold the result, as for compact ones).
    """
    dout, q, k, v, out = (kernel_input(t) for t in (dout, q, k, v, out))
    startend_row_indices = kernel_input(startend_row_indices, 4)
    lse, dlse, cu_seqlens_q, cu_seqlens_k = (kernel_input(t, 4) for t in (lse, dlse, cu_seqlens_q, cu_seqlens_k))
    results, outputs = {}, {}
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buf is None:
            buf = _bridge.empty(like.shape, like.dtype, like)
        results[name] = buf
        outputs[name] = stage_output(buf)
    launch = _bwd_launch()
    cfg = bwd_config(arch_of(q), spec, deterministic, dlse is not None)
    shapes = launch.workspace_shapes(cfg, batch=spec.batch, seqlen_q=spec.seqlen_q, num_heads=spec.num_heads,
                                     total_q=spec.total_q, seqlen_k=spec.seqlen_k, num_kv_heads=spec.num_heads_k,
                                     total_k=spec.total_k)
    workspace = {name: _bridge.empty(shape, dtype, q) for name, (shape, dtype) in shapes.items()}
    a = kernel_arg
    fm_kw = {}
    if spec.startend:  # FlashMask: the per-key-tile bounds workspace (fm_meta), filled by run_bwd
        from cute_kernels.attention import fm_meta

        shape, dtype = fm_meta.workspace_shapes(launch.fm_meta_config(cfg), spec.batch, spec.startend_heads,
                                                spec.seqlen_q, spec.seqlen_k)["fm_minmax"]
        fm_kw = {"startend": a(startend_row_indices), "fm_minmax": a(_bridge.empty(shape, dtype, q))}
    launch.run_bwd(
        cfg, a(dout), a(q), a(k), a(v), a(out), a(lse), a(dlse), a(outputs["dq"]), a(outputs["dk"]),
        a(outputs["dv"]), a(cu_seqlens_q), a(cu_seqlens_k), {name: a(t) for name, t in workspace.items()},
        softmax_scale=spec.softmax_scale, softcap=spec.softcap,
        window_left=-1 if spec.window_left is None else spec.window_left,
        window_right=-1 if spec.window_right is None else spec.window_right,
        max_seqlen_q=spec.seqlen_q, max_seqlen_k=spec.seqlen_k, **fm_kw)
    for name in ("dq", "dk", "dv"):
        commit_output(results[name], outputs[name])
    return results["dq"], results["dk"], results["dv"]

"""CuTe backend of ``paddle_fa4.h2o``: allocate with ``paddle.empty``, call the cute_kernels launchers.

Strided (or misaligned) inputs are read through contiguous copies (:func:`kernel_input`); a
strided ``state``/``summary`` updated in place is staged through a contiguous copy of its values
and copied back after the launch. The kernels stay compiled for compact row-major layouts.
"""

from __future__ import annotations

from .._bridge import arch_of, commit_output, kernel_arg, kernel_input, stage_output


# (arch, op, the dtypes and static dims the op's kernel config is built from) -> reason. A decode
# step calls these ops every token; building a config to re-derive the same answer would cost more
# than the launch.
_REASONS: dict = {}


def _reason_key(arch: int, op: str, kw: dict):
    if op == "update_page_summary":
        kc, summary = kw["key_cache"], kw["summary"]
        return arch, op, str(kc.dtype), tuple(kc.shape[1:]), str(summary.dtype)
    if op == "page_scores":
        q, summary = kw["q"], kw["summary"]
        return arch, op, str(q.dtype), str(summary.dtype), tuple(summary.shape[1:]), kw["group"]
    if op == "token_accumulate":
        q, kc, state = kw["q"], kw["key_cache"], kw["state"]
        return (arch, op, str(q.dtype), str(kc.dtype), str(state.dtype), tuple(kc.shape[1:]), q.shape[1],
                kw["gqa_reduce"])
    return arch, op


def unsupported_reason(arch: int, op: str, **kw) -> str | None:
    """None when the CuTe kernel of ``h2o.<op>`` handles these tensors on ``arch``, else why not."""
    if op in ("reset_scores", "select_pages", "token_page_scores"):
        return None
    key = _reason_key(arch, op, kw)
    if key not in _REASONS:
        _REASONS[key] = _kernel_reason(arch, op, **kw)
    return _REASONS[key]


def _kernel_reason(arch: int, op: str, **kw) -> str | None:
    from cute_kernels.dtypes import dtype_name

    if op == "update_page_summary":
        from cute_kernels.h2o.launch import page_summary_config
        from cute_kernels.h2o.page_summary import unsupported_reason as why

        return why(page_summary_config(kw["key_cache"], kw["summary"], arch))
    if op == "page_scores":
        from cute_kernels.h2o.page_scores import PageScoresConfig
        from cute_kernels.h2o.page_scores import unsupported_reason as why

        q, summary = kw["q"], kw["summary"]
        return why(PageScoresConfig(arch=arch, q_dtype=dtype_name(q.dtype), summary_dtype=dtype_name(summary.dtype),
                                    num_kv_heads=int(summary.shape[1]), group=kw["group"],
                                    head_dim=int(summary.shape[3])))
    if op == "token_accumulate":
        from cute_kernels.h2o.launch import token_config
        from cute_kernels.h2o.token_accumulate import unsupported_reason as why

        return why(token_config(kw["q"], kw["key_cache"], kw["state"], kw["gqa_reduce"], arch))
    return f"no CuTe kernel for h2o.{op}"


def reset_scores(state, slot_mapping) -> None:
    from cute_kernels.h2o.launch import run_reset_scores

    buf = stage_output(state, 4, keep_values=True)
    run_reset_scores(kernel_arg(buf), kernel_arg(kernel_input(slot_mapping, 4)), arch=arch_of(state))
    commit_output(state, buf)


def update_page_summary(key_cache, slot_mapping, summary) -> None:
    from cute_kernels.h2o.launch import run_update_page_summary

    buf = stage_output(summary, keep_values=True)
    run_update_page_summary(kernel_arg(kernel_input(key_cache)), kernel_arg(kernel_input(slot_mapping, 4)),
                            kernel_arg(buf), arch=arch_of(key_cache))
    commit_output(summary, buf)


def page_scores(q, summary, block_tables, seq_lens, page_size, w_avg, w_peak, gqa_reduce):
    import paddle

    from cute_kernels.h2o.launch import run_page_scores

    q, summary = kernel_input(q), kernel_input(summary)
    block_tables, seq_lens = kernel_input(block_tables, 4), kernel_input(seq_lens, 4)
    out = paddle.empty([q.shape[0], summary.shape[1], block_tables.shape[1]], dtype="float32", device=q.place)
    run_page_scores(kernel_arg(q), kernel_arg(summary), kernel_arg(block_tables), kernel_arg(seq_lens), out,
                    page_size=page_size, w_avg=w_avg, w_peak=w_peak, gqa_reduce=gqa_reduce, arch=arch_of(q))
    return out


def token_accumulate(q, key_cache, state, block_tables, seq_lens, scale, decay, gqa_reduce, bos, eos) -> None:
    import paddle

    from cute_kernels.h2o.launch import run_token_accumulate, token_workspace_shapes

    caller_state, state = state, stage_output(state, 4, keep_values=True)
    q, key_cache = kernel_input(q), kernel_input(key_cache)
    block_tables, seq_lens = kernel_input(block_tables, 4), kernel_input(seq_lens, 4)
    lg_shape, st_shape = token_workspace_shapes(q, key_cache, block_tables, gqa_reduce)
    logits = paddle.empty(list(lg_shape), dtype="float32", device=q.place)
    stats = paddle.empty(list(st_shape), dtype="float32", device=q.place)
    run_token_accumulate(kernel_arg(q), kernel_arg(key_cache), kernel_arg(state), kernel_arg(block_tables),
                         kernel_arg(seq_lens), logits, stats, scale=scale, decay=decay, bos=bos, eos=eos,
                         gqa_reduce=gqa_reduce, arch=arch_of(q))
    commit_output(caller_state, state)


def token_page_scores(state, block_tables, seq_lens):
    import paddle

    from cute_kernels.h2o.launch import run_token_page_scores

    state = kernel_input(state, 4)
    block_tables, seq_lens = kernel_input(block_tables, 4), kernel_input(seq_lens, 4)
    out = paddle.empty([block_tables.shape[0], state.shape[1], block_tables.shape[1]], dtype="float32", device=state.place)
    run_token_page_scores(kernel_arg(state), kernel_arg(block_tables), kernel_arg(seq_lens), out, arch=arch_of(state))
    return out


def select_pages(scores, block_tables, seq_lens, page_size, topk, bos, eos):
    import paddle

    from cute_kernels.h2o.launch import run_select_pages

    scores = kernel_input(scores, 4)
    block_tables, seq_lens = kernel_input(block_tables, 4), kernel_input(seq_lens, 4)
    b, hkv = scores.shape[0], scores.shape[1]
    out = paddle.empty([b, hkv, bos + topk + eos], dtype="int32", device=scores.place)
    out_lens = paddle.empty([b, hkv], dtype="int32", device=scores.place)
    run_select_pages(kernel_arg(scores), kernel_arg(block_tables), kernel_arg(seq_lens), out, out_lens,
                     page_size=page_size, topk=topk, bos=bos, eos=eos, arch=arch_of(scores))
    return out, out_lens

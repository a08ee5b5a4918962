"""Heavy-hitter (H2O) decode ops on Paddle's paged KV layout. See ``docs/api.md`` (H2O).

Layout (as ``paddle.incubate.nn.functional.block_multihead_attention``):
``key_cache [num_pages, Hkv, page_size, D]``, ``block_tables [B, max_pages]`` int32,
``seq_lens [B]`` int32 (tokens, the current one included; int64 index tensors are converted), decode
``q [B, Hq, D]`` with query head ``h`` on kv head ``h // G`` (``G = Hq / Hkv``, any value). Flat slots are ``page * page_size + off``.
Token score state ``[num_pages, Hkv, page_size]`` (float32 by default, bfloat16 allowed), parallel
to the KV cache; page summaries one tensor ``[num_pages, Hkv, 3, D]`` (mean, max, min).

Units: ``bos``/``eos`` of :func:`token_accumulate` count **tokens** (the scored window is
``[bos, n - eos)``); ``bos``/``eos``/``topk`` of :func:`select_pages` count **pages**.

A decode step of the token-level flow: write K/V -> :func:`reset_scores` (new slots) ->
:func:`token_accumulate` (``return_page_scores=True``) -> :func:`select_pages` -> sparse attention.
The page-level flow: write K/V -> :func:`update_page_summary` -> :func:`page_scores` ->
:func:`select_pages`.

Page size: every op that takes a paged tensor reads it from that tensor (``key_cache.shape[2]``,
``state.shape[2]``), so it cannot disagree with the cache; only :func:`select_pages`, whose scores
have no page axis, takes ``page_size=`` (the same number).
"""

from __future__ import annotations

from typing import Literal

from . import _validate as V
from .backend import resolve_backend
from ._static import dynamic_only

_STATE_DTYPES = ("float32", "bfloat16")
_SUMMARY_DTYPES = ("float32", "bfloat16")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32")
PAGE_GQA = ("mean_q", "max")
TOKEN_GQA = ("mean_q", "max", "sum", "mean_p")
DEFAULT_DECAY = 0.984375  # 1 - 2^-6: exact in bf16, time constant 64 steps

__all__ = ["update_page_summary", "page_scores", "reset_scores", "token_accumulate", "token_page_scores",
           "select_pages"]


def _dtype_name(t) -> str:
    return V.dtype_name(t)


def _check_paged(op: str, block_tables, seq_lens, batch: int | None = None):
    """``(B, block_tables, seq_lens)``: the paged index arguments checked and as int32 (int64 converted
    once; table entries outside int32 saturate -- they name no page either way --, ``seq_lens`` outside
    int32 is an error on the host: ``_validate.index_tensor``)."""
    block_tables = V.index_tensor(op, "block_tables", block_tables, padding=True)
    seq_lens = V.index_tensor(op, "seq_lens", seq_lens, padding=False)
    V.check_rank(op, "block_tables", block_tables, (2,), "[B, max_pages]")
    V.check_rank(op, "seq_lens", seq_lens, (1,), "[B]")
    b = block_tables.shape[0] if batch is None else batch
    V.check_shape(op, "block_tables", block_tables, [b, block_tables.shape[1]], "[B, max_pages]")
    V.check_shape(op, "seq_lens", seq_lens, [b], "[B]")
    return b, block_tables, seq_lens


def _check_seq_values(op: str, seq_lens, block_tables, page_size: int, source: str) -> None:
    """Value checks that need no device sync: only when seq_lens lives on the CPU.

    ``source`` says where ``page_size`` came from (named in the message: a wrong page size shows
    up as too-long ``seq_lens``)."""
    vals = V.host_values(seq_lens)
    if vals is None or vals.size == 0:
        return
    max_pages = block_tables.shape[1]
    if vals.min() < 0:
        raise ValueError(f"{op}: seq_lens must be >= 0, got {int(vals.min())}")
    if vals.max() > max_pages * page_size:
        raise ValueError(f"{op}: seq_lens must be <= max_pages * page_size = {max_pages} * {page_size} = "
                         f"{max_pages * page_size} (page_size from {source}), got {int(vals.max())}")


def _check_slots(op: str, slot_mapping):
    """``slot_mapping`` checked and as int32 (int64 converted once; slots outside int32 saturate: they
    name no slot either way)."""
    slot_mapping = V.index_tensor(op, "slot_mapping", slot_mapping, padding=True)
    V.check_rank(op, "slot_mapping", slot_mapping, (1,), "1-D [N]")
    return slot_mapping


def _check_key_cache(op: str, key_cache) -> tuple[int, int, int, int]:
    V.check_tensor(op, "key_cache", key_cache)
    V.check_rank(op, "key_cache", key_cache, (4,), "[num_pages, Hkv, page_size, D]")
    V.check_dtype(op, "key_cache", key_cache, _FLOAT_DTYPES)
    num_pages, hkv, page_size, d = key_cache.shape
    if hkv < 1 or page_size < 1 or d < 1:
        raise ValueError(f"{op}: key_cache must have Hkv, page_size and D >= 1, got shape {list(key_cache.shape)}")
    return num_pages, hkv, page_size, d


def _check_q(op: str, q, hkv: int, d: int, batch: int) -> int:
    V.check_tensor(op, "q", q)
    V.check_rank(op, "q", q, (3,), "[B, Hq, D]")
    V.check_dtype(op, "q", q, _FLOAT_DTYPES)
    if q.shape[0] != batch:
        raise ValueError(f"{op}: q must have B = {batch} rows (block_tables), got shape {list(q.shape)}")
    if q.shape[2] != d:
        raise ValueError(f"{op}: q head_dim {q.shape[2]} must equal the cache's D = {d}")
    if q.shape[1] < 1 or q.shape[1] % hkv:
        raise ValueError(f"{op}: q heads Hq = {q.shape[1]} must be a positive multiple of Hkv = {hkv}")
    return q.shape[1] // hkv


# ------------------------------------------------------------------------------------ reset
@dynamic_only("h2o.reset_scores")
def reset_scores(state, slot_mapping, *, backend: Literal["auto", "cute", "reference"] = "auto"):
    """Zero the accumulated score of the token slots written this step (in place).

    Run it after the K/V write and before :func:`token_accumulate` of the same step, for prefill
    and decode writes alike, so a recycled page never inherits the previous request's scores.

    Args:
        state (Tensor): ``[num_pages, Hkv, page_size]`` float32 or bfloat16 score state.
        slot_mapping (Tensor): int32 (or int64) ``[N]`` flat slots ``page * page_size + offset`` written this
            step (Paddle's block-attention ``slot_mapping``). Slots ``< 0`` or
            ``>= num_pages * page_size`` are padding and touch nothing.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        Tensor: ``state`` (updated in place).
    """
    op = "h2o.reset_scores"
    V.check_tensor(op, "state", state)
    if state.ndim != 3:
        raise ValueError(f"{op}: state must be [num_pages, Hkv, page_size], got shape {list(state.shape)}")
    if _dtype_name(state) not in _STATE_DTYPES:
        raise TypeError(f"{op}: state must be float32 or bfloat16, got {_dtype_name(state)}")
    slot_mapping = _check_slots(op, slot_mapping)
    if state.place != slot_mapping.place:
        raise ValueError(f"{op}: state and slot_mapping must be on the same place "
                         f"({state.place} vs {slot_mapping.place})")
    if V.is_empty(state) or V.is_empty(slot_mapping):
        return state

    def reason(arch):
        from ._cute import h2o as glue

        return glue.unsupported_reason(arch, "reset_scores")

    if resolve_backend(op, backend, state, reason) == "cute":
        from ._cute import h2o as glue

        glue.reset_scores(state, slot_mapping)
    else:
        from .reference import h2o as ref

        ref.reset_scores(state, slot_mapping)
    return state


# ------------------------------------------------------------------------------ page summaries
@dynamic_only("h2o.update_page_summary")
def update_page_summary(key_cache, slot_mapping, summary, *, backend: Literal["auto", "cute", "reference"] = "auto"):
    """Refresh the per-page mean / max / min of the keys of the pages written this step (in place).

    For every slot ``s = page * page_size + off`` in ``slot_mapping`` that ends the step's run of
    writes into its page (the next entry is not ``s + 1`` on the same page), the summary of
    ``page`` becomes the mean, max and min over offsets ``0 .. off`` of ``key_cache[page]``, per kv
    head. Tokens of a page are written in offset order, so a partial last page is summarised **as
    it stands** (its ``off + 1`` tokens) and refreshed when its next token lands; there is no need
    to keep partial pages out of the ``eos`` window.

    Args:
        key_cache (Tensor): ``[num_pages, Hkv, page_size, D]`` bfloat16, float16 or float32, already
            holding this step's keys.
        slot_mapping (Tensor): int32 (or int64) ``[N]`` flat slots written this step; slots ``< 0`` or
            ``>= num_pages * page_size`` are padding.
        summary (Tensor): ``[num_pages, Hkv, 3, D]`` float32 or bfloat16; ``summary[:, :, 0]`` mean,
            ``[:, :, 1]`` max, ``[:, :, 2]`` min. Pages not written keep their values.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        Tensor: ``summary`` (updated in place).
    """
    op = "h2o.update_page_summary"
    num_pages, hkv, page_size, d = _check_key_cache(op, key_cache)
    slot_mapping = _check_slots(op, slot_mapping)
    V.check_tensor(op, "summary", summary)
    V.check_dtype(op, "summary", summary, _SUMMARY_DTYPES)
    V.check_shape(op, "summary", summary, [num_pages, hkv, 3, d], "[num_pages, Hkv, 3, D]")
    V.check_same_place(op, {"key_cache": key_cache, "slot_mapping": slot_mapping, "summary": summary})
    if V.is_empty(key_cache) or V.is_empty(slot_mapping):
        return summary

    def reason(arch):
        from ._cute import h2o as glue

        return glue.unsupported_reason(arch, "update_page_summary", key_cache=key_cache, summary=summary)

    if resolve_backend(op, backend, key_cache, reason) == "cute":
        from ._cute import h2o as glue

        glue.update_page_summary(key_cache, slot_mapping, summary)
    else:
        from .reference import h2o as ref

        ref.update_page_summary(key_cache, slot_mapping, summary)
    return summary


@dynamic_only("h2o.page_scores")
def page_scores(q, key_cache, summary, block_tables, seq_lens, *, w_avg: float = 1.0, w_peak: float = 1.0,
                gqa_reduce: Literal["mean_q", "max"] = "mean_q",
                backend: Literal["auto", "cute", "reference"] = "auto"):
    r"""Query-aware score of every page of every request and kv head (no softmax, no state).

    With the group's query heads :math:`q_h` (:math:`h < G`), :math:`\bar q = \mathrm{mean}_h q_h`
    and a page's summary :math:`(\mu, M, m)`:

    .. math::

        \text{mean\_q}:\ w_{avg}\,\bar q\cdot\mu + w_{peak}\sum_d \max(\bar q_d M_d, \bar q_d m_d)
        \qquad
        \text{max}:\ w_{avg}\max_h q_h\cdot\mu + w_{peak}\max_h \sum_d \max(q_{h,d} M_d, q_{h,d} m_d)

    (for ``"max"`` the maximum over heads is taken of each term separately, as upstream).

    The page size is the key cache's (``key_cache.shape[2]``), so it cannot disagree with the
    cache the summaries were taken from; ``key_cache`` is read for its shape only (no bytes).

    Args:
        q (Tensor): ``[B, Hq, D]`` decode queries, bfloat16 / float16 / float32.
        key_cache (Tensor): ``[num_pages, Hkv, page_size, D]``, the cache :func:`update_page_summary`
            summarised (shape only).
        summary (Tensor): ``[num_pages, Hkv, 3, D]`` from :func:`update_page_summary`.
        block_tables (Tensor): int32 (or int64) ``[B, max_pages]`` physical page of each logical page.
        seq_lens (Tensor): int32 (or int64) ``[B]`` tokens per request.
        w_avg, w_peak (float): weights of the mean and the peak (Quest bound) terms.
        gqa_reduce (str): ``"mean_q"`` or ``"max"``.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        Tensor: float32 ``[B, Hkv, max_pages]``; ``-inf`` for logical pages
        ``j >= ceil(seq_lens[b] / page_size)`` and for table entries outside ``[0, num_pages)``.
    """
    op = "h2o.page_scores"
    num_pages, hkv, page_size, d = _check_key_cache(op, key_cache)
    V.check_tensor(op, "summary", summary)
    V.check_dtype(op, "summary", summary, _SUMMARY_DTYPES)
    V.check_shape(op, "summary", summary, [num_pages, hkv, 3, d], "[num_pages, Hkv, 3, D] of key_cache")
    batch, block_tables, seq_lens = _check_paged(op, block_tables, seq_lens)
    group = _check_q(op, q, hkv, d, batch)
    w_avg = V.check_float(op, "w_avg", w_avg)
    w_peak = V.check_float(op, "w_peak", w_peak)
    V.check_choice(op, "gqa_reduce", gqa_reduce, PAGE_GQA)
    V.check_same_place(op, {"q": q, "key_cache": key_cache, "summary": summary, "block_tables": block_tables,
                            "seq_lens": seq_lens})
    _check_seq_values(op, seq_lens, block_tables, page_size, "key_cache.shape[2]")
    import paddle

    if batch == 0 or block_tables.shape[1] == 0:
        return paddle.empty([batch, hkv, block_tables.shape[1]], dtype="float32")

    def reason(arch):
        from ._cute import h2o as glue

        return glue.unsupported_reason(arch, "page_scores", q=q, summary=summary, group=group)

    if resolve_backend(op, backend, q, reason) == "cute":
        from ._cute import h2o as glue

        return glue.page_scores(q, summary, block_tables, seq_lens, page_size, w_avg, w_peak, gqa_reduce)
    from .reference import h2o as ref

    return ref.page_scores(q, summary, block_tables, seq_lens, page_size, w_avg, w_peak, gqa_reduce)


# --------------------------------------------------------------------------- token accumulate
@dynamic_only("h2o.token_accumulate")
def token_accumulate(q, key_cache, state, block_tables, seq_lens, *, softmax_scale: float | None = None,
                     decay: float = DEFAULT_DECAY, gqa_reduce: Literal["mean_q", "max", "sum", "mean_p"] = "mean_q",
                     bos: int = 0, eos: int = 0, return_page_scores: bool = False,
                     backend: Literal["auto", "cute", "reference"] = "auto"):
    r"""One decode step of the heavy-hitter recurrence (in place on ``state``).

    Per request ``b`` with ``n = seq_lens[b]`` tokens and kv head ``g``, on the scored window
    ``W = [bos, n - eos)`` (tokens):

    .. math::

        P_{h,t} = \mathrm{softmax}_{t \in W}(\text{softmax\_scale}\cdot q_h\cdot k_t),\qquad
        hh_t \leftarrow p_t + \text{decay}\cdot hh_t \quad (t \in W)

    with ``p = softmax of q-bar`` (``"mean_q"``, one softmax of the mean query), or the per-head
    probabilities reduced by ``"max"``, ``"sum"`` or ``"mean_p"`` (so the per-step mass over W is 1
    for ``mean_q``/``mean_p``, G for ``sum``, in [1, G] for ``max``). Slots outside W are not
    touched. The window is softmaxed whenever it is non-empty, so short rows hold probabilities,
    never raw logits. Example, n = 10, bos = 2, eos = 3 (1 = scored this step)::

        token  0 1 2 3 4 5 6 7 8 9
        W      0 0 1 1 1 1 1 0 0 0

    The update is computed in fp32 and rounded on store: a float32 state (default) keeps
    accumulating indefinitely; a bfloat16 state reproduces upstream vortex_torch, including its
    freeze once increments fall below half an ulp (about 25% of the mass lost after 600 steps at
    ``decay=1.0``).

    Args:
        q (Tensor): ``[B, Hq, D]`` decode queries, bfloat16 / float16 / float32.
        key_cache (Tensor): ``[num_pages, Hkv, page_size, D]`` holding this step's keys.
        state (Tensor): ``[num_pages, Hkv, page_size]`` float32 or bfloat16 score state.
        block_tables (Tensor): int32 (or int64) ``[B, max_pages]``; seq_lens (Tensor): int32 (or int64) ``[B]``.
        softmax_scale (float, optional): logit scale, default ``D ** -0.5``.
        decay (float): ``>= 0``; default ``0.984375`` (steady mass ``1 / (1 - decay) = 64``).
        gqa_reduce (str): ``"mean_q"``, ``"max"``, ``"sum"`` or ``"mean_p"``.
        bos, eos (int): tokens at the start / end never scored (their state keeps its value).
        return_page_scores (bool): also return :func:`token_page_scores` of the updated state.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        Tensor: ``state``; or ``(state, page_scores)`` when ``return_page_scores``.
    """
    op = "h2o.token_accumulate"
    num_pages, hkv, page_size, d = _check_key_cache(op, key_cache)
    batch, block_tables, seq_lens = _check_paged(op, block_tables, seq_lens)
    group = _check_q(op, q, hkv, d, batch)
    V.check_tensor(op, "state", state)
    V.check_dtype(op, "state", state, _STATE_DTYPES)
    V.check_shape(op, "state", state, [num_pages, hkv, page_size], "[num_pages, Hkv, page_size]")
    scale = d ** -0.5 if softmax_scale is None else V.check_float(op, "softmax_scale", softmax_scale, low=0.0)  # raw-max softmax: >= 0
    decay = V.check_float(op, "decay", decay, low=0.0)
    V.check_choice(op, "gqa_reduce", gqa_reduce, TOKEN_GQA)
    bos = V.check_int(op, "bos", bos, low=0)
    eos = V.check_int(op, "eos", eos, low=0)
    V.check_bool(op, "return_page_scores", return_page_scores)
    V.check_same_place(op, {"q": q, "key_cache": key_cache, "state": state, "block_tables": block_tables,
                            "seq_lens": seq_lens})
    _check_seq_values(op, seq_lens, block_tables, page_size, "key_cache.shape[2]")

    if batch > 0 and block_tables.shape[1] > 0 and num_pages > 0:
        def reason(arch):
            from ._cute import h2o as glue

            return glue.unsupported_reason(arch, "token_accumulate", q=q, key_cache=key_cache, state=state,
                                           group=group, gqa_reduce=gqa_reduce)

        if resolve_backend(op, backend, q, reason) == "cute":
            from ._cute import h2o as glue

            glue.token_accumulate(q, key_cache, state, block_tables, seq_lens, scale, decay, gqa_reduce, bos, eos)
        else:
            from .reference import h2o as ref

            ref.token_accumulate(q, key_cache, state, block_tables, seq_lens, scale, decay, gqa_reduce, bos, eos)
    if return_page_scores:
        # Inputs are validated above; token_page_scores would check them all again.
        return state, _token_page_scores("h2o.token_page_scores", state, block_tables, seq_lens, batch, backend)
    return state


@dynamic_only("h2o.token_page_scores")
def token_page_scores(state, block_tables, seq_lens, *, backend: Literal["auto", "cute", "reference"] = "auto"):
    """Per-page sums of the token state in request order: the scores :func:`select_pages` ranks.

    ``out[b, g, j] = sum of state[block_tables[b, j], g, o]`` over the page's valid offsets
    ``o < min(page_size, seq_lens[b] - j * page_size)``; ``-inf`` for ``j >= ceil(n / page_size)``
    and for table entries outside ``[0, num_pages)``. With ``page_size = 1`` it is the token
    state gathered into request order.

    Returns:
        Tensor: float32 ``[B, Hkv, max_pages]``.
    """
    op = "h2o.token_page_scores"
    V.check_tensor(op, "state", state)
    V.check_rank(op, "state", state, (3,), "[num_pages, Hkv, page_size]")
    V.check_dtype(op, "state", state, _STATE_DTYPES)
    batch, block_tables, seq_lens = _check_paged(op, block_tables, seq_lens)
    V.check_same_place(op, {"state": state, "block_tables": block_tables, "seq_lens": seq_lens})
    _check_seq_values(op, seq_lens, block_tables, state.shape[2], "state.shape[2]")
    return _token_page_scores(op, state, block_tables, seq_lens, batch, backend)


def _token_page_scores(op: str, state, block_tables, seq_lens, batch: int, backend):
    """token_page_scores on validated inputs (also the tail of token_accumulate)."""
    import paddle

    hkv = state.shape[1]
    if batch == 0 or block_tables.shape[1] == 0:
        return paddle.empty([batch, hkv, block_tables.shape[1]], dtype="float32")

    def reason(arch):
        from ._cute import h2o as glue

        return glue.unsupported_reason(arch, "token_page_scores", state=state)

    if resolve_backend(op, backend, state, reason) == "cute":
        from ._cute import h2o as glue

        return glue.token_page_scores(state, block_tables, seq_lens)
    from .reference import h2o as ref

    return ref.token_page_scores(state, block_tables, seq_lens)


# ------------------------------------------------------------------------------------ select
@dynamic_only("h2o.select_pages")
def select_pages(scores, block_tables, seq_lens, *, page_size: int, topk: int, bos: int = 1, eos: int = 1,
                 backend: Literal["auto", "cute", "reference"] = "auto"):
    """Top-k pages per request and kv head, with the first ``bos`` and last ``eos`` pages kept.

    With ``n_pages = ceil(seq_lens[b] / page_size)`` and the budget ``K = bos + topk + eos``::

        n_pages <= K:  [0, 1, ..., n_pages - 1, -1, ...]          (every page, in order)
        otherwise:     [0 .. bos-1 | topk pages of [bos, n_pages - eos) | n_pages-eos .. n_pages-1]

    The middle holds the ``topk`` largest scores in **ascending page order** (ties go to the lower
    page), so each row is in sequence order and, for ``eos >= 1``, the real (possibly partial)
    last page is last. Entries are physical page ids from ``block_tables``: the result is a sparse
    block table (one row per kv head) and ``sparse_seq_lens`` its token counts: the tokens of the
    selected pages, ``count * page_size`` less the empty slots of the request's real last page when
    that page is selected (always for ``eos >= 1``; with ``eos = 0`` only if the top-k picks it).

    Args:
        scores (Tensor): float32 ``[B, Hkv, max_pages]`` per logical page (:func:`page_scores` or
            :func:`token_page_scores`); larger is kept.
        block_tables (Tensor): int32 (or int64) ``[B, max_pages]``; seq_lens (Tensor): int32 (or int64) ``[B]`` tokens.
        page_size (int): tokens per page: the key cache's ``page_size`` (``scores`` has no page
            axis, so nothing here can check it). topk (int): ``>= 1`` pages picked from the window.
        bos, eos (int): pages always kept at the start / end (``>= 0``).
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        tuple: ``(sparse_block_tables int32 [B, Hkv, bos + topk + eos]`` (``-1`` in unused slots),
        ``sparse_seq_lens int32 [B, Hkv])``.
    """
    op = "h2o.select_pages"
    V.check_tensor(op, "scores", scores)
    V.check_rank(op, "scores", scores, (3,), "[B, Hkv, max_pages]")
    V.check_dtype(op, "scores", scores, ("float32",))
    batch, block_tables, seq_lens = _check_paged(op, block_tables, seq_lens, batch=scores.shape[0])
    if scores.shape[2] != block_tables.shape[1]:
        raise ValueError(f"{op}: scores must have max_pages = {block_tables.shape[1]} (block_tables) in its "
                         f"last dim, got shape {list(scores.shape)}")
    page_size = V.check_int(op, "page_size", page_size, low=1, high=V.INT32_MAX)
    topk = V.check_int(op, "topk", topk, low=1, high=V.INT32_MAX)
    bos = V.check_int(op, "bos", bos, low=0, high=V.INT32_MAX)
    eos = V.check_int(op, "eos", eos, low=0, high=V.INT32_MAX)
    if bos + topk + eos > V.INT32_MAX:
        raise ValueError(f"{op}: bos + topk + eos (the row width) must be <= {V.INT32_MAX} (int32 in the kernel), "
                         f"got {bos} + {topk} + {eos}")
    V.check_same_place(op, {"scores": scores, "block_tables": block_tables, "seq_lens": seq_lens})
    _check_seq_values(op, seq_lens, block_tables, page_size, "the page_size argument")
    hkv = scores.shape[1]
    import paddle

    from ._debug import check_no_nan

    check_no_nan(op, scores=scores)

    if batch == 0 or hkv == 0:
        return (paddle.empty([batch, hkv, bos + topk + eos], dtype="int32"),
                paddle.empty([batch, hkv], dtype="int32"))

    def reason(arch):
        from ._cute import h2o as glue

        return glue.unsupported_reason(arch, "select_pages")

    with V.sized_by(op, f"the output [B, Hkv, bos + topk + eos] = {[batch, hkv, bos + topk + eos]} int32",
                    f"topk={topk}, bos={bos}, eos={eos}"):
        if resolve_backend(op, backend, scores, reason) == "cute":
            from ._cute import h2o as glue

            return glue.select_pages(scores, block_tables, seq_lens, page_size, topk, bos, eos)
        from .reference import h2o as ref

        return ref.select_pages(scores, block_tables, seq_lens, page_size, topk, bos, eos)

"""Decode attention over a KV cache: paged (any page size), contiguous, sparse (compacted page tables).

:func:`flash_attn_with_kvcache` (FA's name and meaning) attends ``Sq`` (1..16) new query tokens per
sequence to its cached keys, bottom-right aligned against ``cache_seqlens``, and can emit the
per-query-head ``block_logit`` of a HySparse full layer. :func:`sparse_decode_attention` is the same
attention over a per-(sequence, kv head) compacted page table -- exactly what
:func:`paddle_fa4.h2o.select_pages` returns, or what :func:`block_selection_to_page_table` makes of a
HySparse block selection. Semantics, layouts and guarantees: ``docs/api.md`` (Decode).

Both ops validate everything here, then hand the index tensors to the backend in the caller's form
(int32; int64 is converted once): ``seqlens [B]`` with ``table [B, n]`` from
:func:`flash_attn_with_kvcache` (dense: every kv head of a sequence reads its length and pages; no
copy expands them over kv heads), ``seqlens [B, Hkv]`` with ``table [B, Hkv, n]`` from
:func:`sparse_decode_attention`; ``table`` is None for a contiguous cache. Also ``layout``
``"hnd"`` / ``"nhd"`` / ``"contiguous"`` and normalised window bounds (-1 = unbounded). The CuTe glue (``paddle_fa4._cute.decode``) and the reference
(``paddle_fa4.reference.decode``) take the same call and return ``(out, lse | None, block_logit | None)``.
"""

from __future__ import annotations

import math
from typing import Literal

from . import _cute
from . import _validate as V
from .backend import resolve_backend
from ._static import dynamic_only

Backend = Literal["auto", "cute", "reference"]

#: Largest number of query tokens per sequence (speculative / multi-token decode).
MAX_SEQLEN_Q = 16
#: Largest head dim (q/k and v) the decode ops take.
MAX_HEAD_DIM = 256
#: block_logit key-block sizes (as flash_attn_fwd).
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: Paged cache layouts: ``"hnd"`` = ``[num_pages, Hkv, P, D]`` (FastDeploy, paddle_fa4.h2o; default),
#: ``"nhd"`` = ``[num_pages, P, Hkv, D]`` (FlashAttention's paged layout).
KV_LAYOUTS = ("hnd", "nhd")

__all__ = ["flash_attn_with_kvcache", "sparse_decode_attention", "block_selection_to_page_table"]


# ----------------------------------------------------------------------------------------- ops
@dynamic_only("flash_attn_with_kvcache")
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None,
                            causal=True, window_size=(None, None), softcap=0.0, num_splits=None,
                            return_lse=False, block_logit=None, block_size=64, return_block_logit=False,
                            kv_layout: Literal["hnd", "nhd"] = "hnd", backend: Backend = "auto"):
    r"""Decode attention of ``Sq`` new query tokens per sequence over a paged or contiguous KV cache.

    Sequence ``b`` has ``L = cache_seqlens[b]`` keys (the new tokens' keys included: write them
    into the cache first); its query row ``s`` sits at key position ``L - Sq + s``. Key ``t < L``
    lives at page ``block_table[b, t // P]``, row ``t % P`` (contiguous cache: ``k_cache[b, t]``).
    Row ``s`` sees key ``t`` when ``t < L`` and ``L - Sq + s - left <= t <= L - Sq + s + right``
    (``(left, right) = window_size``, None = unbounded; ``causal`` means ``right = 0``). The logit
    is ``softmax_scale * q . k``, or ``softcap * tanh(softmax_scale * q . k / softcap)``.

    Args:
        q (Tensor): ``[B, Sq, Hq, D]``, ``1 <= Sq <= 16``, bfloat16 or float16 (float32 on the
            reference backend only). Query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        k_cache (Tensor): paged ``[num_pages, Hkv, P, D]`` (``kv_layout="hnd"``, default; also a
            ``[num_pages, P, Hkv, D]`` buffer viewed through ``transpose([0, 2, 1, 3])``) or
            ``[num_pages, P, Hkv, D]`` (``kv_layout="nhd"``) with ``block_table``; without
            ``block_table`` a contiguous ``[B, Sk_max, Hkv, D]``. q's dtype. Any page size.
        v_cache (Tensor): as ``k_cache`` with head dim ``Dv``.
        cache_seqlens (Tensor): int32 ``[B]``, ``0 <= L <= max_pages * P`` (``<= Sk_max``).
        block_table (Tensor, optional): int32 ``[B, max_pages]`` physical page of each logical
            page; entries past a sequence's ``ceil(L / P)`` pages, and with a left window those of
            pages wholly before it (slots below ``(L - Sq - left) // P``), are padding (``-1`` or any
            out-of-range id) and never read.
        softmax_scale (float, optional): ``>= 0``, default ``D ** -0.5``.
        causal (bool): bottom-right causal (default True, as FA's ``flash_attn_with_kvcache``).
        window_size (tuple): ``(left, right)``, each None / -1 (unbounded) or an int ``>= 0``.
        softcap (float): ``>= 0``; 0 disables the cap.
        num_splits (int, optional): split of the keys over CTAs on the CuTe backend: None or 0
            (FA's "heuristic") chooses from the shapes on the host (no device read); ``>= 1``
            fixes it. The result is bitwise reproducible for a given value (fixed-order combine).
        return_lse (bool): also return ``lse``.
        block_logit (Tensor, optional): float32 ``[B, Hq, Sq, ceil(Sk_max / block_size)]`` to
            fill (every entry written); ``Sk_max = max_pages * P`` (paged) or ``k_cache.shape[1]``.
        block_size (int): key-block size of ``block_logit``: 16, 32, 64, 128 or 256.
        return_block_logit (bool): allocate and return ``block_logit``.
        kv_layout (str): ``"hnd"`` or ``"nhd"`` (paged caches only).
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        ``out``; ``(out, lse)`` when ``return_lse``; ``(out, lse, block_logit)`` whenever a
        ``block_logit`` is given or ``return_block_logit`` (lse included, as
        :func:`flash_attn_fwd`). ``out`` ``[B, Sq, Hq, Dv]`` in q's dtype (0 on a row with no
        visible key); ``lse`` float32 ``[B, Hq, Sq]`` natural log (``-inf`` there);
        ``block_logit`` float32, per query head the max visible logit of each key block
        (``-inf`` where none). No autograd: every output has ``stop_gradient=True``.

    Raises:
        TypeError: a non-tensor, a dtype other than the ones above (index tensors: int32, or int64
            converted once; pass int32 to avoid the copy).
        ValueError: shapes, places, options; ``cache_seqlens`` above ``max_pages * P`` or a page id
            a sequence needs outside ``[0, num_pages)`` (checked when the index tensors are on the CPU).
        NotImplementedError: ``Sq > 16``, a head dim above 256, or ``backend="cute"`` when no
            kernel applies.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> kc = paddle.randn([4, 2, 16, 64])                       # 4 pages of 16 tokens, 2 kv heads
            >>> q = paddle.randn([2, 1, 8, 64])
            >>> table = paddle.to_tensor([[0, 2], [3, -1]], dtype="int32")
            >>> lens = paddle.to_tensor([20, 5], dtype="int32")
            >>> out = paddle_fa4.flash_attn_with_kvcache(q, kc, kc, lens, block_table=table, backend="reference")
            >>> out.shape
            paddle.Size([2, 1, 8, 64])
    """
    op = "flash_attn_with_kvcache"
    batch, sq, hq, d = _check_q(op, q)
    paged = block_table is not None
    layout, k_cache, v_cache, geo = _check_cache(op, k_cache, v_cache, q, kv_layout, paged, batch)
    hkv, page, num_units = geo["hkv"], geo["page"], geo["units"]
    _check_heads(op, hq, hkv)
    cache_seqlens = _check_index(op, "cache_seqlens", cache_seqlens, [batch], "[B]", padding=False)
    if paged:
        block_table = _check_index(op, "block_table", block_table, [batch, -1], "[B, max_pages]", padding=True)
        if batch * block_table.shape[1] > V.INT32_MAX:  # the kernel's row offset b * max_pages is 32-bit
            raise ValueError(f"{op}: block_table must hold fewer than 2^31 page ids, got shape "
                             f"{list(block_table.shape)}")
        sk_max = block_table.shape[1] * page
    else:
        sk_max = k_cache.shape[1]
    opts = _check_options(op, q, d, softmax_scale, causal, window_size, softcap, num_splits, return_lse)
    V.check_int(op, "block_size", block_size)
    V.check_choice(op, "block_size", block_size, BLOCK_SIZES)
    V.check_bool(op, "return_block_logit", return_block_logit)
    wants_bl = block_logit is not None or return_block_logit
    nb = -(-sk_max // block_size) if wants_bl else 0
    if block_logit is not None:
        V.check_tensor(op, "block_logit", block_logit)
        V.check_dtype(op, "block_logit", block_logit, ("float32",))
        V.check_shape(op, "block_logit", block_logit, [batch, hq, sq, nb], "[B, Hq, Sq, ceil(Sk_max / block_size)]")
    V.check_same_place(op, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
                            "block_table": block_table, "block_logit": block_logit})
    _check_lengths(op, "cache_seqlens", cache_seqlens, sk_max,
                   f"max_pages * page_size = {sk_max // max(page, 1)} * {page}" if paged else "k_cache.shape[1]")
    if paged:
        _check_pages(op, "block_table", block_table, cache_seqlens, page, num_units, sq, opts["window_left"])
    # the dense form goes to the backend as it is: every kv head reads its sequence's length and pages
    out, lse, bl = _run(op, backend, q, k_cache, v_cache, cache_seqlens, block_table, layout, paged, False, sk_max,
                        num_units, opts, return_lse or wants_bl, block_size if wants_bl else None)
    if not wants_bl:
        return (out, lse) if return_lse else out
    if block_logit is not None:
        if not V.is_empty(block_logit):
            block_logit.copy_(bl, False)
        bl = block_logit
    return out, lse, bl


@dynamic_only("sparse_decode_attention")
def sparse_decode_attention(q, k_cache, v_cache, sparse_block_tables, sparse_seq_lens, *, softmax_scale=None,
                            causal=True, window_size=(None, None), softcap=0.0, num_splits=None, return_lse=False,
                            kv_layout: Literal["hnd", "nhd"] = "hnd", backend: Backend = "auto"):
    r"""Decode attention over a compacted page table per (sequence, kv head).

    Kv head ``h`` of sequence ``b`` attends to the first ``L = sparse_seq_lens[b, h]`` tokens of the
    pages ``sparse_block_tables[b, h, 0], [b, h, 1], ...`` taken in order: compacted key ``c``
    (``0 <= c < L``) is row ``c % P`` of page ``sparse_block_tables[b, h, c // P]``. These are
    exactly the two tensors :func:`paddle_fa4.h2o.select_pages` returns (feed them straight in) and
    :func:`block_selection_to_page_table` makes of a HySparse selection. Everything else is
    :func:`flash_attn_with_kvcache` with ``L`` per kv head: in particular **causal and window act
    on compacted positions** (row ``s`` sits at ``L - Sq + s``), so with ``Sq = 1`` and causal every
    listed token is visible, and with ``Sq > 1`` compacted causal equals causal on the real
    positions when the last ``Sq`` tokens of the sequence are the last ``Sq`` listed ones (the
    step's own keys: :func:`block_selection_to_page_table` always lists them).

    Args:
        q (Tensor): ``[B, Sq, Hq, D]``, ``1 <= Sq <= 16``.
        k_cache, v_cache (Tensor): paged ``[num_pages, Hkv, P, D]`` (or ``"nhd"``, as
            :func:`flash_attn_with_kvcache`); no contiguous form.
        sparse_block_tables (Tensor): int32 ``[B, Hkv, n]`` physical page ids; entries past
            ``ceil(L / P)`` (or wholly before a left window) are padding (-1 or out of range), never read.
        sparse_seq_lens (Tensor): int32 ``[B, Hkv]`` tokens, ``0 <= L <= n * P``.
        softmax_scale, causal, window_size, softcap, num_splits, return_lse, kv_layout, backend:
            as :func:`flash_attn_with_kvcache`.

    Returns:
        ``out [B, Sq, Hq, Dv]``, or ``(out, lse [B, Hq, Sq])`` when ``return_lse``.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> kc = paddle.randn([6, 2, 16, 64])
            >>> q = paddle.randn([1, 1, 4, 64])
            >>> tables = paddle.to_tensor([[[0, 3, 5], [1, 4, -1]]], dtype="int32")   # per kv head
            >>> lens = paddle.to_tensor([[40, 20]], dtype="int32")
            >>> paddle_fa4.sparse_decode_attention(q, kc, kc, tables, lens, backend="reference").shape
            paddle.Size([1, 1, 4, 64])
    """
    op = "sparse_decode_attention"
    batch, sq, hq, d = _check_q(op, q)
    layout, k_cache, v_cache, geo = _check_cache(op, k_cache, v_cache, q, kv_layout, True, batch)
    hkv, page, num_units = geo["hkv"], geo["page"], geo["units"]
    _check_heads(op, hq, hkv)
    sparse_block_tables = _check_index(op, "sparse_block_tables", sparse_block_tables, [batch, hkv, -1], "[B, Hkv, n]",
                                       padding=True)
    n = sparse_block_tables.shape[2]
    sparse_seq_lens = _check_index(op, "sparse_seq_lens", sparse_seq_lens, [batch, hkv], "[B, Hkv]", padding=False)
    sk_max = n * page
    opts = _check_options(op, q, d, softmax_scale, causal, window_size, softcap, num_splits, return_lse)
    V.check_same_place(op, {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                            "sparse_block_tables": sparse_block_tables, "sparse_seq_lens": sparse_seq_lens})
    _check_lengths(op, "sparse_seq_lens", sparse_seq_lens, sk_max, f"n * page_size = {n} * {page}")
    _check_pages(op, "sparse_block_tables", sparse_block_tables, sparse_seq_lens, page, num_units, sq,
                 opts["window_left"])
    out, lse, _ = _run(op, backend, q, k_cache, v_cache, sparse_seq_lens, sparse_block_tables, layout, True, True,
                       sk_max, num_units, opts, return_lse, None)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------- dispatch
def _run(op, backend, q, k_cache, v_cache, seqlens, table, layout, paged, sparse, sk_max, num_units, opts,
         return_lse, bl_size):
    """``(out, lse | None, block_logit | None)`` on the resolved backend; no launch when nothing is visible."""
    batch = q.shape[0]

    def reason(arch):
        return _glue().unsupported_reason(arch, q, k_cache, v_cache, layout=layout, paged=paged, sparse=sparse,
                                          block_logit_size=bl_size)

    name = resolve_backend(op, backend, q, reason, stacklevel=5,
                           auto_reason=lambda arch: _glue().unverified_reason(arch, q))
    if batch == 0 or sk_max == 0 or num_units == 0:  # no key exists: out 0, lse / block_logit -inf
        import paddle

        _, sq, hq, _ = q.shape
        dv = v_cache.shape[-1]
        nb = -(-sk_max // bl_size) if bl_size else 0
        out = paddle.zeros([batch, sq, hq, dv], dtype=q.dtype, device=q.place)
        lse = paddle.full([batch, hq, sq], -math.inf, dtype="float32", device=q.place) if return_lse else None
        bl = paddle.full([batch, hq, sq, nb], -math.inf, dtype="float32", device=q.place) if bl_size else None
        return out, lse, bl
    if name == "cute":
        impl = _glue()
    else:
        from .reference import decode as impl
    out, lse, bl = impl.decode_fwd(q, k_cache, v_cache, seqlens, table, layout=layout, **opts, return_lse=return_lse,
                                   block_logit_size=bl_size)
    for t in (out, lse, bl):
        if t is not None and not t.stop_gradient:  # the glue's buffers already are (no setter call per call)
            t.stop_gradient = True
    return out, lse, bl


def _glue():
    """``paddle_fa4._cute.decode``: the package attribute ``from ._cute import decode`` reads, without the import
    statement's per-call machinery (imported on first use)."""
    mod = getattr(_cute, "decode", None)
    if mod is None:
        from ._cute import decode as mod
    return mod


# -------------------------------------------------------------------------------- validation
def _check_q(op, q):
    V.check_tensor(op, "q", q)
    V.check_rank(op, "q", q, (4,), "[B, Sq, Hq, D]")
    V.check_dtype(op, "q", q, V.REFERENCE_FLOAT_DTYPES)
    batch, sq, hq, d = q.shape
    if sq < 1:
        raise ValueError(f"{op}: q must have Sq >= 1 query tokens per sequence, got shape {list(q.shape)}")
    if sq > MAX_SEQLEN_Q:
        raise NotImplementedError(f"{op}: q has Sq = {sq} query tokens per sequence; decode takes at most "
                                  f"{MAX_SEQLEN_Q} (use flash_attn_fwd / flash_attn_varlen_func for prefill)")
    if d < 1:
        raise ValueError(f"{op}: q must have head_dim >= 1, got shape {list(q.shape)}")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"{op}: head_dim {d} is not supported (at most {MAX_HEAD_DIM})")
    return batch, sq, hq, d


def _is_nhd_view(t) -> bool:
    """A ``[pages, Hkv, P, D]``-shaped view of a contiguous ``[pages, P, Hkv, D]`` buffer."""
    return not t.is_contiguous() and t.transpose([0, 2, 1, 3]).is_contiguous()


def _check_cache(op, k_cache, v_cache, q, kv_layout, paged, batch):
    """``(layout, k, v, geometry)``: the backend layout and the tensors in that layout's shape."""
    V.check_tensor(op, "k_cache", k_cache)
    V.check_tensor(op, "v_cache", v_cache)
    dtype = V.dtype_name(q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if V.dtype_name(t) != dtype:
            raise TypeError(f"{op}: {name} must have q's dtype {dtype}, got {V.dtype_name(t)}")
    V.check_choice(op, "kv_layout", kv_layout, KV_LAYOUTS)
    d = q.shape[3]
    if paged:
        want = "[num_pages, Hkv, page_size, D]" if kv_layout == "hnd" else "[num_pages, page_size, Hkv, D]"
        V.check_rank(op, "k_cache", k_cache, (4,), f"{want} (kv_layout={kv_layout!r})")
        V.check_rank(op, "v_cache", v_cache, (4,), f"{want[:-2]}Dv] (kv_layout={kv_layout!r})")
        layout = kv_layout
        if layout == "hnd" and _is_nhd_view(k_cache) and _is_nhd_view(v_cache):
            layout = "nhd"  # FA's buffer passed through a transpose: read it in place
            k_cache, v_cache = k_cache.transpose([0, 2, 1, 3]), v_cache.transpose([0, 2, 1, 3])
        if layout == "hnd":
            num_pages, hkv, page, dk = k_cache.shape
        else:
            num_pages, page, hkv, dk = k_cache.shape
        if list(v_cache.shape[:3]) != list(k_cache.shape[:3]):
            raise ValueError(f"{op}: v_cache must match k_cache {list(k_cache.shape)} in all but the last dim "
                             f"({want}), got {list(v_cache.shape)}")
        if page < 1:
            raise ValueError(f"{op}: page_size must be >= 1, got k_cache shape {list(k_cache.shape)}")
        units = num_pages
    else:
        if kv_layout != "hnd":
            raise ValueError(f"{op}: kv_layout={kv_layout!r} applies to paged caches; without block_table the "
                             f"cache is contiguous [B, Sk_max, Hkv, D]")
        V.check_rank(op, "k_cache", k_cache, (4,), "[B, Sk_max, Hkv, D] (contiguous, no block_table)")
        V.check_rank(op, "v_cache", v_cache, (4,), "[B, Sk_max, Hkv, Dv] (contiguous, no block_table)")
        b, sk, hkv, dk = k_cache.shape
        if b != batch:
            raise ValueError(f"{op}: k_cache must have q's batch size {batch} (contiguous cache), got "
                             f"{list(k_cache.shape)}")
        if list(v_cache.shape[:3]) != list(k_cache.shape[:3]):
            raise ValueError(f"{op}: v_cache must be [B, Sk_max, Hkv, Dv] = {list(k_cache.shape[:3])} + [Dv] "
                             f"like k_cache, got {list(v_cache.shape)}")
        layout, page, units = "contiguous", 0, batch * sk
    if dk != d:
        raise ValueError(f"{op}: k_cache must have q's head_dim {d}, got {dk}")
    dv = v_cache.shape[-1]
    if dv < 1:
        raise ValueError(f"{op}: v_cache must have head_dim >= 1, got {list(v_cache.shape)}")
    if dv > MAX_HEAD_DIM:
        raise NotImplementedError(f"{op}: v head_dim {dv} is not supported (at most {MAX_HEAD_DIM})")
    if hkv < 1:
        raise ValueError(f"{op}: k_cache must have Hkv >= 1 kv heads, got shape {list(k_cache.shape)}")
    return layout, k_cache, v_cache, {"hkv": hkv, "page": page, "units": units}


def _check_heads(op, hq, hkv):
    if hq < 1 or hq % hkv:
        raise ValueError(f"{op}: q's head count {hq} must be a positive multiple of the cache's kv heads {hkv}")


def _check_index(op, name, t, shape, layout, *, padding):
    """``t`` as an int32 index tensor of ``shape`` (-1 = any extent): int64 is converted once
    (``_validate.index_tensor``: ``padding`` says whether an out-of-int32 value means padding)."""
    t = V.index_tensor(op, name, t, padding=padding)
    if t.ndim != len(shape) or any(s not in (-1, g) for s, g in zip(shape, t.shape)):
        raise ValueError(f"{op}: {name} must be {layout} = {[s if s >= 0 else '*' for s in shape]}, got "
                         f"{list(t.shape)}")
    return t


def _check_options(op, q, d, softmax_scale, causal, window_size, softcap, num_splits, return_lse) -> dict:
    from .attention import _check_window

    causal = V.check_bool(op, "causal", causal)
    left, right, causal = _check_window(window_size, causal, op)
    softcap = V.check_float(op, "softcap", softcap, low=0.0)
    # >= 0: the kernels keep the running max of the raw q.k and scale it afterwards (as flash_attn_fwd).
    scale = d ** -0.5 if softmax_scale is None else V.check_float(op, "softmax_scale", softmax_scale, low=0.0)
    if num_splits is not None:
        num_splits = V.check_int(op, "num_splits", num_splits, low=0) or None  # 0 = FA's "heuristic"
    V.check_bool(op, "return_lse", return_lse)
    return {"softmax_scale": float(scale), "causal": causal, "window_left": -1 if left is None else left,
            "window_right": -1 if right is None else right, "softcap": softcap, "num_splits": num_splits}


def _check_lengths(op, name, lens, limit, limit_text):
    """Host check (CPU tensors only; a GPU tensor is never read back): ``0 <= lens <= limit``."""
    vals = V.host_values(lens)
    if vals is None or vals.size == 0:
        return
    low = int(vals.min())
    if low < 0:
        where = tuple(int(i) for i in next(zip(*(vals < 0).nonzero())))
        raise ValueError(f"{op}: {name} must be >= 0, got {name}{list(where)} = {low}")
    high = int(vals.max())
    if high > limit:
        where = tuple(int(i) for i in next(zip(*(vals > limit).nonzero())))
        raise ValueError(f"{op}: {name} must be <= {limit_text} = {limit}, got {name}{list(where)} = "
                         f"{int(vals[where])}")


def _check_pages(op, name, table, lens, page, num_pages, sq, left):
    """Host check: every page holding a key some query row can see is an id in ``[0, num_pages)``.

    Those are the slots ``j`` with ``first // P <= j < ceil(L / P)``, ``first = L - Sq - left`` (the
    lowest key row 0 sees; 0 without a left window): entries past the sequence and, with a left
    window, wholly before it (a sliding-window engine may have recycled those pages) are padding."""
    import numpy as np

    ids = V.host_values(table)
    vals = V.host_values(lens)
    if ids is None or vals is None or ids.size == 0:
        return
    slot = np.arange(ids.shape[-1])
    need = slot * page < vals[..., None]  # [B, n] or [B, Hkv, n]
    if left >= 0:
        need &= (slot + 1) * page > (vals[..., None].astype(np.int64) - sq - left)
    bad = need & ((ids < 0) | (ids >= num_pages))
    if bad.any():
        where = tuple(int(i) for i in next(zip(*bad.nonzero())))
        lens_name = "cache_seqlens" if name == "block_table" else "sparse_seq_lens"
        raise ValueError(f"{op}: {name}{list(where)} = {int(ids[where])} is not a page id in [0, num_pages = "
                         f"{num_pages}), but the sequence needs that page ({lens_name}{list(where[:-1])} = "
                         f"{int(vals[where[:-1]])}, page size {page}); only entries past a sequence (or wholly "
                         f"before its window) may be padding (-1 or out of range)")


# ---------------------------------------------------------------------- HySparse page tables
@dynamic_only("block_selection_to_page_table")
def block_selection_to_page_table(block_idx, block_table, cache_seqlens, *, page_size: int, num_kv_heads: int,
                                  block_size: int = 64, window: int = 0):
    r"""A HySparse decode-time block selection as a compacted page table for :func:`sparse_decode_attention`.

    The selected token set of sequence ``b`` and kv head ``h`` is: the keys of every selected block
    ``j`` (``block_idx[b, h, s, :]`` over the ``Sq`` query rows -- their union -- each block the
    tokens ``[j * block_size, (j + 1) * block_size)``; ``-1`` and blocks at or past ``L`` are
    ignored), plus the last ``max(window, Sq)`` tokens (the sliding window, and always the step's
    own ``Sq`` tokens), all clipped at ``L = cache_seqlens[b]``. The table lists, in sequence
    order, **every logical page holding a selected token** and the length counts their tokens
    below ``L``: the keys :func:`sparse_decode_attention` reads are exactly the tokens ``< L`` of
    those pages. Guarantee:

    * it is a superset of the selected token set and a subset of ``[0, L)``, in sequence order;
      every listed page but the last is whole, and the last is the page of token ``L - 1`` (always
      selected), so the compacted positions keep the real order and the last ``Sq`` compacted
      keys are the step's own tokens: causal on compacted positions is causal on real positions;
    * it is **exactly** the selected blocks when ``page_size`` divides ``block_size`` (e.g. P 1, 8,
      16, 32, 64 for 64-token blocks) and the window start ``L - max(window, Sq)`` is a multiple
      of P (otherwise the window's first page is taken whole: up to P - 1 extra tokens);
    * with ``page_size > block_size`` a selected block brings in the whole page(s) it lies in.

    Pure Paddle tensor ops on the inputs' place: no host read, static output shapes.

    Args:
        block_idx (Tensor): int32 ``[B, Hs, Sq, topk]`` from :func:`paddle_fa4.select_topk_blocks`
            at decode (``Hs = num_kv_heads``, or 1 = one selection shared by every kv head).
        block_table (Tensor): int32 ``[B, max_pages]`` the dense page table of the cache.
        cache_seqlens (Tensor): int32 ``[B]`` keys per sequence (the step's tokens included).
        page_size (int): the cache's page size P (``>= 1``).
        num_kv_heads (int): Hkv of the cache (the output's second dim).
        block_size (int): tokens per selected block (default 64, HySparse's).
        window (int): trailing tokens always attended (``>= 0``).

    Returns:
        tuple: ``(sparse_block_tables int32 [B, Hkv, n], sparse_seq_lens int32 [B, Hkv])`` with
        ``n = min(max_pages, Sq * topk * pages_per_block + ceil(max(window, Sq) / P) + 1)``
        (``pages_per_block`` = 1 if ``block_size`` divides P, ``block_size / P`` if P divides
        ``block_size``, else ``ceil(block_size / P) + 1``); unused slots are ``-1``.
    """
    import paddle

    op = "block_selection_to_page_table"
    V.check_tensor(op, "block_idx", block_idx)
    V.check_rank(op, "block_idx", block_idx, (4,), "[B, Hs, Sq, topk]")
    block_idx = V.index_tensor(op, "block_idx", block_idx, padding=True)
    batch, hs, sq, topk = block_idx.shape
    block_table = _check_index(op, "block_table", block_table, [batch, -1], "[B, max_pages]", padding=True)
    cache_seqlens = _check_index(op, "cache_seqlens", cache_seqlens, [batch], "[B]", padding=False)
    page = V.check_int(op, "page_size", page_size, low=1)
    hkv = V.check_int(op, "num_kv_heads", num_kv_heads, low=1)
    bs = V.check_int(op, "block_size", block_size, low=1)
    window = V.check_int(op, "window", window, low=0)
    if hs not in (1, hkv):
        raise ValueError(f"{op}: block_idx must have Hs = 1 or num_kv_heads = {hkv} selection groups, got "
                         f"shape {list(block_idx.shape)}")
    V.check_same_place(op, {"block_idx": block_idx, "block_table": block_table, "cache_seqlens": cache_seqlens})
    max_pages = block_table.shape[1]
    _check_lengths(op, "cache_seqlens", cache_seqlens, max_pages * page,
                   f"max_pages * page_size = {max_pages} * {page}")
    if page % bs == 0:
        per_block = 1
    elif bs % page == 0:
        per_block = bs // page
    else:
        per_block = -(-bs // page) + 1
    tail = max(window, sq)
    n_out = min(max_pages, sq * topk * per_block + -(-tail // page) + 1)
    place = block_idx.place
    if batch == 0 or max_pages == 0:
        return (paddle.full([batch, hkv, n_out], -1, dtype="int32", device=place),
                paddle.zeros([batch, hkv], dtype="int32", device=place))

    lens = cache_seqlens.astype("int64").reshape([batch, 1, 1])
    ids = block_idx.astype("int64").reshape([batch, hs, sq * topk])
    start = ids * bs
    end = paddle.minimum(start + bs, lens)
    valid = (ids >= 0) & (start < lens)
    first = paddle.where(valid, start // page, paddle.zeros_like(start))
    row = paddle.arange(batch * hs, dtype="int64", device=place).reshape([batch, hs, 1]) * (max_pages + 1)
    hits = []
    for k in range(per_block):
        pg = first + k
        ok = valid & (pg * page < end)
        hits.append(row + paddle.where(ok, pg, paddle.full_like(pg, max_pages)))  # max_pages = discard column
    hits = paddle.concat(hits, axis=2).reshape([-1])
    flat = paddle.zeros([batch * hs * (max_pages + 1)], dtype="int32", device=place)
    flat = paddle.scatter(flat, hits, paddle.ones(hits.shape, dtype="int32", device=place), overwrite=False)  # counts
    chosen = flat.reshape([batch, hs, max_pages + 1])[:, :, :max_pages] > 0
    p = paddle.arange(max_pages, dtype="int64", device=place).reshape([1, 1, max_pages])
    wstart = paddle.maximum(lens - tail, paddle.zeros_like(lens))
    chosen = chosen | ((p >= wstart // page) & (p * page < lens))
    if hs != hkv:
        chosen = chosen.expand([batch, hkv, max_pages])
    order = paddle.argsort(paddle.where(chosen, p, p + max_pages), axis=-1)[:, :, :n_out]  # chosen pages first
    count = chosen.astype("int64").sum(axis=-1)  # [B, Hkv]
    slot = paddle.arange(n_out, dtype="int64", device=place).reshape([1, 1, n_out])
    dense = block_table.astype("int64").reshape([batch, 1, max_pages]).expand([batch, hkv, max_pages])
    phys = paddle.take_along_axis(dense, order, axis=2)
    tables = paddle.where(slot < count.unsqueeze(-1), phys, paddle.full_like(phys, -1)).astype("int32")
    last = paddle.where(chosen, p.expand([batch, hkv, max_pages]), paddle.full_like(p, -1).expand(
        [batch, hkv, max_pages])).max(axis=-1)
    lens2 = lens.reshape([batch, 1])
    covered = (count - 1) * page + paddle.minimum(lens2 - last * page, paddle.full_like(lens2, page))
    seq = paddle.where(count > 0, covered, paddle.zeros_like(covered)).astype("int32")
    return tables, seq

"""HySparse block selection: log-weights, cross-head top-k key blocks, token indices.

A full-attention layer (:func:`paddle_fa4.flash_attn_fwd` with ``block_logit``) says, per query row
and key block, the largest logit in the block; with the row's ``lse`` that is the log of the largest
softmax weight in the block. These ops turn it into the key blocks a sparse layer attends to and
the token index rows :func:`paddle_fa4.indexed_attention` takes. Exact semantics: ``docs/api.md``
(Selection); the walk-through: ``docs/hysparse.md``.
"""

from __future__ import annotations

from typing import Literal, Optional

from . import _validate as V
from .backend import resolve_backend
from ._static import dynamic_only

Backend = Literal["auto", "cute", "reference"]

#: Block sizes flash_attn_fwd emits block_logit for.
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: How select_topk_blocks merges the heads of a group: the max of their log-weights (default), or
#: the sum of their weights (PaddleFleet's ``head_agg="sum"``, ranked by its log: logsumexp).
HEAD_AGG = ("max", "sum")
_NEG_INF = float("-inf")


def _dtype_name(t) -> str:
    from cute_kernels.dtypes import dtype_name

    return dtype_name(t.dtype)


def _require_int(op: str, name: str, value, minimum: int, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{op}: {name} must be <= {maximum} (the kernels count in int32), got {value}")
    return value


def _check_backend(op: str, backend) -> None:
    from .backend import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")


def _check_logit_lse(op: str, block_logit, lse) -> bool:
    """Validate the (block_logit, lse) pair; True for the varlen (3-D) layout."""
    for name, t in (("block_logit", block_logit), ("lse", lse)):
        V.check_tensor(op, name, t)
        if _dtype_name(t) != "float32":
            raise TypeError(f"{op}: {name} must be float32, got {_dtype_name(t)}")
    if block_logit.ndim == 4:
        want = 3
    elif block_logit.ndim == 3:
        want = 2
    else:
        raise ValueError(f"{op}: block_logit must be [B, Hq, Sq, nb] (or varlen [Hq, total_q, nb]), "
                         f"got shape {list(block_logit.shape)}")
    if lse.ndim != want or list(lse.shape) != list(block_logit.shape[:-1]):
        raise ValueError(f"{op}: lse must have shape {list(block_logit.shape[:-1])} to match block_logit "
                         f"{list(block_logit.shape)}, got {list(lse.shape)}")
    if block_logit.place != lse.place:
        raise ValueError(f"{op}: block_logit and lse must be on the same place "
                         f"({block_logit.place} vs {lse.place})")
    return block_logit.ndim == 3


@dynamic_only("block_log_weight")
def block_log_weight(block_logit, lse, *, name: Optional[str] = None):
    r"""
    Log of the largest softmax weight in each key block: ``block_logit - lse[..., None]``.

    Args:
        block_logit (Tensor): float32 ``[B, Hq, Sq, nb]`` (varlen ``[Hq, total_q, nb]``) from
            :func:`flash_attn_fwd`; ``-inf`` = no visible key in the block.
        lse (Tensor): float32 ``[B, Hq, Sq]`` (varlen ``[Hq, total_q]``), natural log.
        name (str|None, optional): Name for the operation. Default: None.

    Returns:
        Tensor: float32, ``block_logit``'s shape; ``-inf`` wherever ``block_logit`` is ``-inf``
        (also on rows whose ``lse`` is ``-inf``), so ``exp`` of it is the block's weight in ``[0, 1]``.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> bl = paddle.to_tensor([[[[0.5, float("-inf")]]]])
            >>> lse = paddle.to_tensor([[[1.0]]])
            >>> paddle_fa4.block_log_weight(bl, lse).tolist()
            [[[[-0.5, -inf]]]]
    """
    _check_logit_lse("block_log_weight", block_logit, lse)
    from .reference.selection import block_log_weight as ref

    out = ref(block_logit, lse)
    out.stop_gradient = True
    return out


@dynamic_only("select_topk_blocks")
def select_topk_blocks(block_logit, lse, *, topk: int, num_kv_heads: Optional[int] = None,
                       sink_blocks: int = 0, local_blocks: int = 0, head_agg: str = "max",
                       backend: Backend = "auto", name: Optional[str] = None,
                       block_size: Optional[int] = None, seqlen_k: Optional[int] = None):
    r"""
    Pick, for every query row, the ``topk`` key blocks carrying the most attention.

    A block's log-weight ``block_logit - lse`` is the log of its largest softmax weight; it is
    maxed over the heads of each kv group (``num_kv_heads`` given: query head ``h`` belongs to
    group ``h // (Hq // num_kv_heads)``) or over all heads, and the ``topk`` largest win. Some
    blocks are always kept, when visible: the first ``sink_blocks`` blocks, and the
    ``local_blocks`` blocks ending at the row's **diagonal block** — the last block holding a key
    the row sees, which for causal attention is ``(i + Sk - Sq) // block_size``::

        row i, nb = 8, causal, sink_blocks=1, local_blocks=2, topk=4:
        block      0  1  2  3  4  5  6  7
        visible    1  1  1  1  1  1  0  0     diagonal block = 5
        forced     S  .  .  .  L  L  .  .     S = sink, L = local
        chosen     S  .  x  .  L  L  .  .     x = best remaining block by log-weight

    Because the diagonal block is read off the ``-inf`` pattern, no ``block_size``/``seqlen_k``
    is needed and varlen rows work as they are (blocks are relative to each sequence's start).
    Passing them anyway (dense causal attention) is a read limit: row ``i`` then looks only at
    blocks ``<= (i + Sk - Sq) // block_size`` and treats later ones as invisible, which halves the
    bytes the kernel reads for causal self-attention and changes nothing for a causal
    ``block_logit``.

    Args:
        block_logit (Tensor): float32 ``[B, Hq, Sq, nb]`` or varlen ``[Hq, total_q, nb]``;
            ``-inf`` = no visible key in the block. Strided views are accepted (the CuTe backend
            reads a contiguous copy).
        lse (Tensor): float32 ``[B, Hq, Sq]`` or varlen ``[Hq, total_q]``, natural log, as
            returned by :func:`flash_attn_fwd`.
        topk (int): blocks kept per row, ``>= 1``. May exceed ``nb``; slots that no visible block
            fills are ``-1``.
        num_kv_heads (int|None, optional): number of kv groups ``Hs`` (must divide ``Hq``); None
            selects one set per row shared by all heads (``Hs = 1``). Default: None.
        sink_blocks (int, optional): leading blocks always kept. Default: 0.
        local_blocks (int, optional): blocks ending at the diagonal block always kept. Default: 0.
            ``sink_blocks + local_blocks`` must not exceed ``topk``.
        head_agg (str, optional): how a group's heads are merged: ``"max"`` (default) ranks a block
            by its largest log-weight over the heads; ``"sum"`` by the sum over the heads of the
            weights ``exp(block_logit - lse)`` (PaddleFleet's ``head_agg="sum"``; computed as a
            logsumexp of the log-weights, heads that rank nothing add 0). Both backends take
            both; the CuTe kernel's fp32 logaddexp may order two blocks whose sums agree to a few
            ulp differently from the reference (``"max"`` is exact on both).
        backend (str, optional): ``"auto"``, ``"cute"`` or ``"reference"``. Default: ``"auto"``.
        name (str|None, optional): Name for the operation. Default: None.
        block_size (int|None, optional): with ``seqlen_k``, the causal read limit above (dense
            layout only; ``nb`` must be ``ceil(seqlen_k / block_size)``). Default: None.
        seqlen_k (int|None, optional): number of keys ``Sk`` for the read limit. Default: None.

    Returns:
        Tensor: int32 ``[B, Hs, Sq, topk]`` (varlen ``[Hs, total_q, topk]``): chosen block ids in
        ascending order, then ``-1`` in unused slots. Blocks with no visible key are never chosen;
        equal log-weights go to the lower block id, so the result is deterministic.

    Raises:
        TypeError: a non-float32 input or a non-int count.
        ValueError: shapes disagree, ``num_kv_heads`` does not divide ``Hq``, counts out of range.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> bl = paddle.to_tensor([[[[0.0, 3.0, 1.0, float("-inf")]]]])
            >>> lse = paddle.to_tensor([[[4.0]]])
            >>> paddle_fa4.select_topk_blocks(bl, lse, topk=2, backend="reference").tolist()
            [[[[1, 2]]]]
    """
    op = "select_topk_blocks"
    _check_backend(op, backend)
    varlen = _check_logit_lse(op, block_logit, lse)
    _require_int(op, "topk", topk, 1, V.INT32_MAX)
    sink_blocks = _require_int(op, "sink_blocks", sink_blocks, 0)
    local_blocks = _require_int(op, "local_blocks", local_blocks, 0)
    if not isinstance(head_agg, str) or head_agg not in HEAD_AGG:
        raise ValueError(f"{op}: head_agg must be one of {HEAD_AGG}, got {head_agg!r}")
    if sink_blocks + local_blocks > topk:
        raise ValueError(f"{op}: sink_blocks + local_blocks ({sink_blocks} + {local_blocks}) must not "
                         f"exceed topk ({topk})")
    dense_bl = block_logit.unsqueeze(0) if varlen else block_logit
    dense_lse = lse.unsqueeze(0) if varlen else lse
    b, hq, sq, nb = dense_bl.shape
    causal_limit = None
    if (block_size is None) != (seqlen_k is None):
        raise ValueError(f"{op}: block_size and seqlen_k go together (the causal read limit); got "
                         f"block_size={block_size!r}, seqlen_k={seqlen_k!r}")
    if block_size is not None:
        if varlen:
            raise ValueError(f"{op}: block_size/seqlen_k (causal read limit) need the dense layout; "
                             "varlen rows find their diagonal block from block_logit")
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"{op}: block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
        _require_int(op, "seqlen_k", seqlen_k, 0, V.INT32_MAX)
        if nb != -(-seqlen_k // block_size):
            raise ValueError(f"{op}: block_logit has {nb} blocks but seqlen_k={seqlen_k} at "
                             f"block_size={block_size} gives {-(-seqlen_k // block_size)}")
        causal_limit = (block_size, seqlen_k)
    if num_kv_heads is None:
        groups = 1
    else:
        groups = _require_int(op, "num_kv_heads", num_kv_heads, 1)
        if hq % groups:
            raise ValueError(f"{op}: num_kv_heads ({groups}) must divide the {hq} query heads")

    import paddle

    from ._debug import check_no_nan

    check_no_nan(op, block_logit=block_logit, lse=lse)
    with V.sized_by(op, f"the output [B, Hs, Sq, topk] = {[b, groups, sq, topk]} int32", f"topk={topk}"):
        if nb == 0:  # no key block: every slot -1
            out = paddle.full([b, groups, sq, topk], -1, dtype="int32", device=block_logit.place)
        else:
            out = paddle.empty([b, groups, sq, topk], dtype="int32", device=block_logit.place)
    if b * sq > 0 and nb > 0:
        def reason(arch):
            from ._cute import selection as glue

            return glue.topk_unsupported_reason(arch, nb=nb, topk=topk, head_agg=head_agg)

        if resolve_backend(op, backend, block_logit, reason) == "cute":
            from ._cute import selection as glue

            glue.select_topk_blocks(dense_bl, dense_lse, out, topk, groups, sink_blocks, local_blocks,
                                    causal_limit, head_agg)
        else:
            from .reference import selection as ref

            ref.select_topk_blocks(dense_bl, dense_lse, out, topk, groups, sink_blocks, local_blocks,
                                   causal_limit, head_agg)
    out.stop_gradient = True
    return out[0] if varlen else out


@dynamic_only("blocks_to_indices")
def blocks_to_indices(block_idx, *, block_size: int, seqlen_k: int, causal: bool = True,
                      backend: Backend = "auto", name: Optional[str] = None):
    r"""
    Expand selected key blocks into the token index rows :func:`indexed_attention` takes.

    Slot ``s`` of a row becomes the ``block_size`` keys ``block_idx[s] * block_size + t``; a key
    the row cannot see becomes ``-1`` (padding): beyond ``seqlen_k``, beyond the row's causal
    limit ``i + seqlen_k - Sq`` when ``causal``, or in a ``-1`` slot::

        block_size = 4, seqlen_k = 10, Sq = 10, row i = 5 (sees keys 0..5), block_idx = [0, 1, -1]
        -> [0, 1, 2, 3,  4, 5, -1, -1,  -1, -1, -1, -1]

    Args:
        block_idx (Tensor): int32 (or int64, converted) ``[B, Hs, Sq, topk]``, e.g. from :func:`select_topk_blocks`
            (dense layout; split a varlen selection per sequence).
        block_size (int): key block size the selection was made with (16, 32, 64, 128 or 256).
        seqlen_k (int): number of keys ``Sk``.
        causal (bool, optional): apply the bottom-right causal limit. Default: True.
        backend (str, optional): ``"auto"``, ``"cute"`` or ``"reference"``. Default: ``"auto"``.
        name (str|None, optional): Name for the operation. Default: None.

    Returns:
        Tensor: int32 ``[B, Sq, topk * block_size]`` when ``Hs == 1`` (one selection shared by all
        heads), else ``[B, Hs, Sq, topk * block_size]`` (one per kv head): exactly the two
        ``indices`` layouts of :func:`indexed_attention`.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> blk = paddle.to_tensor([[[[0, 1, -1]]]], dtype="int32")
            >>> idx = paddle_fa4.blocks_to_indices(blk, block_size=16, seqlen_k=20, backend="reference")
            >>> idx.shape, idx[0, 0, 14:22].tolist()
            (paddle.Size([1, 1, 48]), [14, 15, 16, 17, 18, 19, -1, -1])
    """
    op = "blocks_to_indices"
    _check_backend(op, backend)
    block_idx = V.index_tensor(op, "block_idx", block_idx, padding=True)
    if block_idx.ndim != 4:
        raise ValueError(f"{op}: block_idx must be [B, Hs, Sq, topk], got shape {list(block_idx.shape)} "
                         "(split a varlen selection per sequence)")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{op}: block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    # token ids are int32: keys past 2**31 - 1 cannot be named (they would wrap)
    _require_int(op, "seqlen_k", seqlen_k, 0, V.INT32_MAX)
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    b, hs, sq, topk = block_idx.shape
    width = topk * block_size

    import paddle

    with V.sized_by(op, f"the output [B, Hs, Sq, topk * block_size] = {[b, hs, sq, width]} int32",
                    f"block_idx's topk {topk} and block_size={block_size}"):
        out = paddle.empty([b, hs, sq, width], dtype="int32", device=block_idx.place)
    if not V.is_empty(out):
        def reason(arch):
            from ._cute import selection as glue

            return glue.indices_unsupported_reason(arch, topk=topk, block_size=block_size)

        if resolve_backend(op, backend, block_idx, reason) == "cute":
            from ._cute import selection as glue

            glue.blocks_to_indices(block_idx, out, block_size, seqlen_k, causal)
        else:
            from .reference import selection as ref

            ref.blocks_to_indices(block_idx, out, block_size, seqlen_k, causal)
    out.stop_gradient = True
    return out[:, 0] if hs == 1 else out


#: Bytes of one chunk's fp32 block_logit buffer when ``chunk_q`` is left to the driver.
CHUNK_BLOCK_LOGIT_BYTES = 1 << 30


@dynamic_only("select_topk_blocks_chunked")
def select_topk_blocks_chunked(q, k, v, *, topk: int, softmax_scale: Optional[float] = None,
                               causal: bool = True, window_size=(None, None), softcap: float = 0.0,
                               block_size: int = 64, num_kv_heads: Optional[int] = None,
                               sink_blocks: int = 0, local_blocks: int = 0, head_agg: str = "max",
                               chunk_q: Optional[int] = None, backend: Backend = "auto",
                               name: Optional[str] = None):
    r"""
    The full-attention layer of HySparse in query chunks: forward, block_logit and selection.

    Runs :func:`flash_attn_fwd` (with ``block_logit``) and :func:`select_topk_blocks` on ``chunk_q``
    query rows at a time, so the ``[B, Hq, Sq, nb]`` block_logit buffer never exists whole (at
    32 heads, 128K tokens and block 64 it would be 32 GiB); only a ``[B, Hq, chunk_q, nb]`` one
    does. Each chunk's keys are cut at its last row's causal limit, which keeps bottom-right
    alignment: row ``i`` sees exactly the keys it sees in one call over all rows (see
    :func:`chunk_plan`: a causal mask, with any left window, or no mask). The selection uses the
    causal read limit (``block_size``/``seqlen_k``) when causal.

    The ids equal those of one :func:`flash_attn_fwd` over all rows followed by
    :func:`select_topk_blocks`, bit for bit. ``out``/``lse`` agree to rounding: the reference
    backend sums each row over the chunk's key range, so the last bit may differ.

    Args:
        q (Tensor): ``[B, Sq, Hq, D]`` (dense layout; varlen is not supported here).
        k (Tensor): ``[B, Sk, Hkv, D]``.
        v (Tensor): ``[B, Sk, Hkv, Dv]``.
        topk (int): blocks per row, as :func:`select_topk_blocks`.
        softmax_scale, causal, window_size, softcap, block_size: as :func:`flash_attn_fwd`
            (``causal`` defaults to True here).
        num_kv_heads, sink_blocks, local_blocks, head_agg: as :func:`select_topk_blocks`.
        chunk_q (int|None, optional): query rows per chunk; None picks the largest multiple of 128
            whose block_logit fits in ``CHUNK_BLOCK_LOGIT_BYTES`` (1 GiB). Default: None.
        backend (str, optional): passed to both ops. Default: ``"auto"``.
        name (str|None, optional): Name for the operation. Default: None.

    Returns:
        tuple: ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32, block_idx [B, Hs, Sq, topk] int32)``,
        the same as one :func:`flash_attn_fwd` call followed by :func:`select_topk_blocks`.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 40, 2, 16])
            >>> out, lse, blk = paddle_fa4.select_topk_blocks_chunked(
            ...     q, q, q, topk=2, block_size=16, sink_blocks=1, local_blocks=1, chunk_q=16,
            ...     backend="reference")
            >>> blk[0, 0, 39].tolist()  # row 39 sees blocks 0..2: the sink and the diagonal block
            [0, 2]
    """
    op = "select_topk_blocks_chunked"
    _check_backend(op, backend)
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if getattr(t, "ndim", None) != 4:
            raise ValueError(f"{op}: {arg} must be 4-D [B, S, H, D] (varlen is not supported by the "
                             f"chunked driver), got shape {list(getattr(t, 'shape', []))}")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    _require_int(op, "topk", topk, 1, V.INT32_MAX)
    if not isinstance(head_agg, str) or head_agg not in HEAD_AGG:
        raise ValueError(f"{op}: head_agg must be one of {HEAD_AGG}, got {head_agg!r}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{op}: block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    b, sq, hq, _ = q.shape
    sk, dv = k.shape[1], v.shape[3]
    nb = -(-sk // block_size)
    if chunk_q is None:
        chunk_q = max(128, CHUNK_BLOCK_LOGIT_BYTES // max(1, 4 * b * hq * nb) // 128 * 128)
    _require_int(op, "chunk_q", chunk_q, 1)
    plan = chunk_plan(sq, sk, chunk_q, causal, window_size)

    import paddle

    from .attention import flash_attn_fwd

    groups = 1 if num_kv_heads is None else num_kv_heads
    out = paddle.zeros([b, sq, hq, dv], dtype=q.dtype, device=q.place)
    lse = paddle.full([b, hq, sq], _NEG_INF, dtype="float32", device=q.place)
    with V.sized_by(op, f"block_idx [B, Hs, Sq, topk] = {[b, groups, sq, topk]} int32", f"topk={topk}"):
        block_idx = paddle.full([b, groups, sq, topk], -1, dtype="int32", device=q.place)
    for c0, c1, keys, read_limit in plan:
        if keys == 0:
            continue  # these rows see no key: out 0, lse -inf, no block (already filled)
        o, row_lse, bl = flash_attn_fwd(q[:, c0:c1], k[:, :keys], v[:, :keys], softmax_scale=softmax_scale,
                                         causal=causal, window_size=window_size, softcap=softcap,
                                         block_size=block_size, return_block_logit=True, backend=backend)
        limit = {"block_size": block_size, "seqlen_k": keys} if read_limit else {}
        blk = select_topk_blocks(bl, row_lse, topk=topk, num_kv_heads=num_kv_heads, sink_blocks=sink_blocks,
                                 local_blocks=local_blocks, head_agg=head_agg, backend=backend, **limit)
        del bl
        out[:, c0:c1] = o
        lse[:, :, c0:c1] = row_lse
        block_idx[:, :, c0:c1] = blk
    for t in (out, lse, block_idx):
        t.stop_gradient = True
    return out, lse, block_idx


def chunk_plan(seqlen_q: int, seqlen_k: int, chunk_q: int, causal: bool, window_size=(None, None)):
    """``[(c0, c1, keys, read_limit)]``: query rows ``[c0, c1)`` attend to keys ``[0, keys)``.

    Bottom-right alignment fixes ``keys``: row ``i`` of the chunk (``i - c0`` in it) keeps its
    limits only when ``keys - (c1 - c0) = Sk - Sq + c0``, i.e. ``keys = c1 + Sk - Sq``. That cut
    drops only invisible keys when the right limit is the diagonal (causal), so chunking takes a
    causal mask (any left window) or no mask at all (every row sees every key, no cut); a right
    window above 0 or a left window without causal raises ``NotImplementedError``. ``read_limit``
    says the selection may skip blocks past each row's diagonal. Pure Python, so the GPU tests can
    drive the kernels with the same plan.
    """
    if window_size is None:
        window_size = (None, None)
    reach = seqlen_q + seqlen_k  # a bound this far or farther hides no key: unbounded (as flash_attn_fwd)
    left, right = (None if w is None or w == -1 or (isinstance(w, int) and w >= reach) else w for w in window_size)
    if causal:
        right = 0 if right is None else min(right, 0)
    if right != 0 and (left is not None or right is not None):
        raise NotImplementedError(f"select_topk_blocks_chunked: window_size={tuple(window_size)} with "
                                  f"causal={causal}: chunking keeps alignment only for a causal mask "
                                  "or no mask")
    plan = []
    for c0 in range(0, seqlen_q, chunk_q):
        c1 = min(seqlen_q, c0 + chunk_q)
        if right == 0:
            plan.append((c0, c1, max(0, c1 + seqlen_k - seqlen_q), True))
        else:
            plan.append((c0, c1, seqlen_k, False))
    return plan

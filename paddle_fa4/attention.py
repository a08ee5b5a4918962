"""Attention forward with fused ``block_logit`` and natural-log LSE. See ``docs/api.md``.

:func:`flash_attn_fwd` validates its arguments into a frozen :class:`AttnFwdSpec`, resolves the
backend, allocates the outputs with ``paddle.empty`` on ``q.place`` (a caller's ``block_logit``
buffer is used as is) and calls an out-parameter implementation: the pure-Paddle reference
(``paddle_fa4.reference.attention``) or the CuTe glue (``paddle_fa4._cute.attention``), both with
the call ``impl.flash_attn_fwd(spec, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from . import _validate as V
from .backend import resolve_backend

OP = "flash_attn_fwd"

#: block_logit key-block sizes.
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: Largest head dim the reference backend takes (the kernels take 64, 96, 128, 192, 256).
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttnFwdSpec:
    """A validated :func:`flash_attn_fwd` call; everything downstream reads only this.

    Shape letters as in ``docs/api.md``. For varlen calls ``batch`` is the number of sequences,
    ``seqlen_q``/``seqlen_k`` are ``max_seqlen_q``/``max_seqlen_k`` and ``total_q``/``total_k`` the
    packed token counts; otherwise ``total_q == batch * seqlen_q`` (likewise for k).

    ``window_left``/``window_right`` are None when unbounded; causal calls have
    ``window_right == 0``. ``causal`` is also True for a window ``(None, 0)`` (the same mask).
    ``block_size`` is 0 when no ``block_logit`` is produced; ``num_blocks`` is its last extent.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    total_q: int
    total_k: int
    num_heads: int
    num_heads_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    varlen: bool
    softmax_scale: float
    softcap: float
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    block_size: int
    num_blocks: int
    pack_gqa: bool

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_heads // self.num_heads_k

    @property
    def has_window(self) -> bool:
        """True when the mask needs a window beyond plain causal."""
        return self.window_left is not None or (self.window_right is not None and not self.causal)

    @property
    def has_block_logit(self) -> bool:
        return self.block_size > 0

    def out_shape(self) -> list:
        if self.varlen:
            return [self.total_q, self.num_heads, self.head_dim_v]
        return [self.batch, self.seqlen_q, self.num_heads, self.head_dim_v]

    def lse_shape(self) -> list:
        if self.varlen:
            return [self.num_heads, self.total_q]
        return [self.batch, self.num_heads, self.seqlen_q]

    def block_logit_shape(self) -> list:
        if self.varlen:
            return [self.num_heads, self.total_q, self.num_blocks]
        return [self.batch, self.num_heads, self.seqlen_q, self.num_blocks]


def flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   block_logit=None, block_size=64, return_block_logit=False, pack_gqa=None,
                   backend="auto"):
    r"""Attention forward; optionally the per-(row, key block) max logit ``block_logit``.

    Row ``i`` of a sequence with lengths ``(Sq, Sk)`` sees key ``t`` when
    ``i + Sk - Sq - left <= t <= i + Sk - Sq + right`` (bottom-right aligned, as FA4), where
    ``(left, right) = window_size`` (None = unbounded) and ``causal`` means ``right = 0``.
    The logit fed to softmax is ``s = softmax_scale * q_i . k_t``, or
    ``softcap * tanh(s / softcap)`` when ``softcap > 0``.

    Args:
        q (Tensor): ``[B, Sq, Hq, D]`` (varlen: ``[total_q, Hq, D]``), bfloat16 or float16
            (float32 on the reference backend only).
        k (Tensor): ``[B, Sk, Hkv, D]`` (varlen: ``[total_k, Hkv, D]``), q's dtype; ``Hq % Hkv == 0``
            and query head ``h`` uses kv head ``h // (Hq // Hkv)``.
        v (Tensor): ``[B, Sk, Hkv, Dv]`` (varlen: ``[total_k, Hkv, Dv]``), q's dtype.
        softmax_scale (float, optional): default ``D ** -0.5``.
        causal (bool): bottom-right causal mask.
        window_size (tuple): ``(left, right)``; each None (or -1) = unbounded, else an int >= 0.
            With ``causal`` the right bound is ``min(right, 0)``.
        softcap (float): ``>= 0``; 0 disables the cap.
        cu_seqlens_q (Tensor, optional): int32 ``[B + 1]``, starts at 0, non-decreasing; enables
            varlen together with ``cu_seqlens_k``.
        cu_seqlens_k (Tensor, optional): int32 ``[B + 1]``, as ``cu_seqlens_q``.
        max_seqlen_q (int, optional): longest query sequence; required with varlen.
        max_seqlen_k (int, optional): longest key sequence; required with varlen.
        block_logit (Tensor, optional): float32 ``[B, Hq, Sq, ceil(Sk / block_size)]`` (varlen:
            ``[Hq, total_q, ceil(max_seqlen_k / block_size)]``) to fill; every entry is written.
        block_size (int): key-block size of ``block_logit``: 16, 32, 64, 128 or 256.
        return_block_logit (bool): allocate and return ``block_logit``.
        pack_gqa (bool, optional): GQA packing hint for the kernels; results do not depend on it.
            True cannot be combined with ``block_logit``; None resolves to no packing then.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        tuple: ``(out, lse)``, or ``(out, lse, block_logit)`` when ``block_logit`` is given or
        ``return_block_logit`` is True. ``out`` ``[B, Sq, Hq, Dv]`` (varlen ``[total_q, Hq, Dv]``)
        in q's dtype, 0 on rows with no visible key; ``lse`` float32 ``[B, Hq, Sq]`` (varlen
        ``[Hq, total_q]``), natural log of the softmax normaliser, -inf on rows with no visible
        key; ``block_logit`` float32, the max visible logit of each key block (block indices
        relative to each sequence's start), -inf where the block has no visible key. All
        outputs have ``stop_gradient=True``.

    Raises:
        TypeError: a tensor argument of the wrong type or dtype, or a non-int/float option.
        ValueError: inconsistent shapes or places, bad ``cu_seqlens``/``block_size``/``window_size``/
            ``softcap``, ``pack_gqa=True`` with ``block_logit``, or an unknown ``backend``.
        NotImplementedError: a head dim above 256, or ``backend="cute"`` when no kernel applies.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> q = paddle.randn([1, 8, 2, 64]).astype("bfloat16")
            >>> k = paddle.randn([1, 12, 2, 64]).astype("bfloat16")
            >>> out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, k, causal=True, block_size=16,
            ...                                          return_block_logit=True, backend="reference")
            >>> bl.shape
            paddle.Size([1, 2, 8, 1])
    """
    import paddle

    spec = _validate(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, block_logit, block_size, return_block_logit, pack_gqa)
    impl = _impl(resolve_backend(OP, backend, q, functools.partial(_unsupported_reason, spec=spec)))
    out = paddle.empty(spec.out_shape(), dtype=q.dtype, device=q.place)
    lse = paddle.empty(spec.lse_shape(), dtype="float32", device=q.place)
    if spec.has_block_logit and block_logit is None:
        block_logit = paddle.empty(spec.block_logit_shape(), dtype="float32", device=q.place)
    if _is_empty(spec):
        _fill_no_keys(out, lse, block_logit)
    else:
        impl.flash_attn_fwd(spec, q, k, v, out, lse, block_logit if spec.has_block_logit else None,
                            cu_seqlens_q, cu_seqlens_k)
    if spec.has_block_logit:
        return out, lse, block_logit
    return out, lse


def _unsupported_reason(arch: int, spec: AttnFwdSpec) -> Optional[str]:
    from ._cute import attention as glue

    return glue.unsupported_reason(arch, spec)


def _impl(backend: str):
    """The module implementing a call on the resolved backend (same out-parameter contract)."""
    if backend == "cute":
        from ._cute import attention as impl
    else:
        from .reference import attention as impl
    return impl


def _is_empty(spec: AttnFwdSpec) -> bool:
    return spec.total_q == 0 or spec.total_k == 0 or spec.num_heads == 0


def _fill_no_keys(out, lse, block_logit) -> None:
    """Outputs of a call where no row sees any key: out 0, lse and block_logit -inf."""
    import paddle

    with paddle.no_grad():
        if not V.is_empty(out):
            paddle.assign(paddle.zeros(out.shape, dtype=out.dtype, device=out.place), out)
        if not V.is_empty(lse):
            paddle.assign(paddle.full(lse.shape, -math.inf, dtype="float32", device=lse.place), lse)
        if block_logit is not None and not V.is_empty(block_logit):
            paddle.assign(paddle.full(block_logit.shape, -math.inf, dtype="float32",
                                      device=block_logit.place), block_logit)


# ----------------------------------------------------------------------------------------------
# validation


def _validate(q, k, v, softmax_scale, causal, window_size, softcap, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, block_logit, block_size, return_block_logit,
              pack_gqa) -> AttnFwdSpec:
    """Check every argument of :func:`flash_attn_fwd` and return the call's spec."""
    for name, t in (("q", q), ("k", k), ("v", v), ("block_logit", block_logit)):
        if t is not None or name != "block_logit":
            V.check_tensor(OP, name, t)
    dtype = V.check_dtype(OP, "q", q, V.REFERENCE_FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if V.dtype_name(t) != dtype:
            raise TypeError(f"{OP}: {name} must have q's dtype {dtype}, got {V.dtype_name(t)}")
    varlen = _check_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dims = _check_shapes(q, k, v, varlen, cu_seqlens_q)
    V.check_same_place(OP, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                            "cu_seqlens_k": cu_seqlens_k, "block_logit": block_logit})
    if varlen:
        seqlen_q = V.check_int(OP, "max_seqlen_q", max_seqlen_q, low=0)
        seqlen_k = V.check_int(OP, "max_seqlen_k", max_seqlen_k, low=0)
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, dims["total_q"], seqlen_q, "max_seqlen_q")
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, dims["total_k"], seqlen_k, "max_seqlen_k")
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    causal = V.check_bool(OP, "causal", causal)
    window_left, window_right, causal = _check_window(window_size, causal)
    softcap = V.check_float(OP, "softcap", softcap, low=0.0)
    scale = dims["head_dim"] ** -0.5 if softmax_scale is None else V.check_float(OP, "softmax_scale", softmax_scale)
    V.check_int(OP, "block_size", block_size)
    V.check_choice(OP, "block_size", block_size, BLOCK_SIZES)
    V.check_bool(OP, "return_block_logit", return_block_logit)
    wants_block_logit = block_logit is not None or return_block_logit
    packed = _check_pack_gqa(pack_gqa, wants_block_logit)
    num_blocks = -(-seqlen_k // block_size) if wants_block_logit else 0
    spec = AttnFwdSpec(
        batch=dims["batch"], seqlen_q=seqlen_q, seqlen_k=seqlen_k, total_q=dims["total_q"],
        total_k=dims["total_k"], num_heads=dims["num_heads"], num_heads_k=dims["num_heads_k"],
        head_dim=dims["head_dim"], head_dim_v=dims["head_dim_v"], dtype=dtype, varlen=varlen,
        softmax_scale=float(scale), softcap=softcap, causal=causal, window_left=window_left,
        window_right=window_right, block_size=block_size if wants_block_logit else 0,
        num_blocks=num_blocks, pack_gqa=packed)
    if block_logit is not None:
        _check_block_logit_buffer(block_logit, spec)
    return spec


def _check_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """True for a varlen call; both cu_seqlens and both max_seqlen must come together."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{OP}: {name} is only used with cu_seqlens_q/cu_seqlens_k (varlen)")
        return False
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is None:
            raise ValueError(f"{OP}: {name} is required when the other cu_seqlens is given (varlen)")
        V.check_tensor(OP, name, t)
        V.check_dtype(OP, name, t, ("int32",))
        V.check_rank(OP, name, t, (1,), "1-D [B + 1]")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"{OP}: cu_seqlens_q and cu_seqlens_k must have the same length [B + 1], got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"{OP}: cu_seqlens_q must have at least one entry (B + 1), got 0")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            raise ValueError(f"{OP}: {name} is required with cu_seqlens (varlen)")
    return True


def _check_shapes(q, k, v, varlen: bool, cu_seqlens_q) -> dict:
    """Ranks, shape agreement and head counts; returns the call's dimensions."""
    if varlen:
        V.check_rank(OP, "q", q, (3,), "[total_q, Hq, D] with cu_seqlens")
        V.check_rank(OP, "k", k, (3,), "[total_k, Hkv, D] with cu_seqlens")
        V.check_rank(OP, "v", v, (3,), "[total_k, Hkv, Dv] with cu_seqlens")
        total_q, hq, d = q.shape
        total_k, hkv, dk = k.shape
        batch = cu_seqlens_q.shape[0] - 1
        if list(v.shape[:2]) != [total_k, hkv]:
            raise ValueError(f"{OP}: v must be [total_k, Hkv, Dv] = [{total_k}, {hkv}, Dv] like k, "
                             f"got {list(v.shape)}")
    else:
        V.check_rank(OP, "q", q, (4,), "[B, Sq, Hq, D] (or [total_q, Hq, D] with cu_seqlens)")
        V.check_rank(OP, "k", k, (4,), "[B, Sk, Hkv, D]")
        V.check_rank(OP, "v", v, (4,), "[B, Sk, Hkv, Dv]")
        batch, sq, hq, d = q.shape
        bk, sk, hkv, dk = k.shape
        if bk != batch:
            raise ValueError(f"{OP}: k must have q's batch size {batch}, got {bk}")
        if list(v.shape[:3]) != [batch, sk, hkv]:
            raise ValueError(f"{OP}: v must be [B, Sk, Hkv, Dv] = [{batch}, {sk}, {hkv}, Dv] like k, "
                             f"got {list(v.shape)}")
        total_q, total_k = batch * sq, batch * sk
    dv = v.shape[-1]
    if dk != d:
        raise ValueError(f"{OP}: k must have q's head_dim {d}, got {dk}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{OP}: q's head count {hq} must be a multiple of k's head count {hkv}")
    for name, dim in (("head_dim", d), ("head_dim_v", dv)):
        if dim < 1:
            raise ValueError(f"{OP}: {name} must be >= 1, got {dim}")
        if dim > MAX_HEAD_DIM:
            raise NotImplementedError(f"{OP}: {name} {dim} is not supported (at most {MAX_HEAD_DIM})")
    return {"batch": batch, "total_q": total_q, "total_k": total_k, "num_heads": hq,
            "num_heads_k": hkv, "head_dim": d, "head_dim_v": dv}


def _check_cu_seqlens(name: str, t, total: int, max_seqlen: int, max_name: str) -> None:
    """Value checks of a cu_seqlens tensor; run only when its values are on the host (no sync)."""
    values = V.host_values(t)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"{OP}: {name} must start at 0, got {int(values[0])}")
    lengths = values[1:] - values[:-1]
    if (lengths < 0).any():
        raise ValueError(f"{OP}: {name} must be non-decreasing, got {values.tolist()}")
    if int(values[-1]) != total:
        raise ValueError(f"{OP}: {name}[-1] must equal the packed token count {total}, got {int(values[-1])}")
    if lengths.size and int(lengths.max()) > max_seqlen:
        raise ValueError(f"{OP}: {max_name} {max_seqlen} is below the longest sequence in {name} "
                         f"({int(lengths.max())})")


def _window_bound(name: str, value) -> Optional[int]:
    if value is None:
        return None
    value = V.check_int(OP, name, value)
    if value == -1:
        return None
    if value < 0:
        raise ValueError(f"{OP}: {name} must be None, -1 (unbounded) or >= 0, got {value}")
    return value


def _check_window(window_size, causal: bool) -> Tuple[Optional[int], Optional[int], bool]:
    """``(left, right, causal)`` with None for unbounded; causal forces ``right <= 0``."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"{OP}: window_size must be a (left, right) pair, got {window_size!r}")
    left = _window_bound("window_size[0]", window_size[0])
    right = _window_bound("window_size[1]", window_size[1])
    if causal:
        right = 0 if right is None else min(right, 0)
    causal = causal or (left is None and right == 0)
    return left, right, causal


def _check_pack_gqa(pack_gqa, wants_block_logit: bool) -> bool:
    if pack_gqa is None:
        return False
    V.check_bool(OP, "pack_gqa", pack_gqa)
    if pack_gqa and wants_block_logit:
        raise ValueError(f"{OP}: pack_gqa=True cannot be combined with block_logit (block_logit is per "
                         f"query head); pass pack_gqa=None or False")
    return pack_gqa


def _check_block_logit_buffer(block_logit, spec: AttnFwdSpec) -> None:
    V.check_dtype(OP, "block_logit", block_logit, ("float32",))
    layout = "[Hq, total_q, ceil(max_seqlen_k / block_size)]" if spec.varlen else \
        "[B, Hq, Sq, ceil(Sk / block_size)]"
    V.check_shape(OP, "block_logit", block_logit, spec.block_logit_shape(), layout)

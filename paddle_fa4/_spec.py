"""The validated form of an attention call (``AttnFwdSpec``), free of Paddle imports.

Built by ``paddle_fa4.attention._validate``; read by both backends and the CuTe glue. It lives apart
from ``attention.py`` (whose PyLayer needs Paddle at import) so that the glue can be driven with
torch tensors on a machine without Paddle (tests/gpu/test_strided.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: FlashMask column layouts -> number of int32 columns per key. Rows ``i`` of key column ``j`` are
#: masked when ``LTS <= i < LTE`` or ``UTS <= i < UTE``; an absent bound is LTE = +inf (``lts``,
#: ``lts_ute``) or the empty upper interval (``lts``, ``lts_lte``). ``lts``/``lts_lte`` come with
#: ``causal=True``, ``lts_ute``/``lts_lte_uts_ute`` with ``causal=False`` (Paddle's convention).
STARTEND_LAYOUTS = {"": 0, "lts": 1, "lts_lte": 2, "lts_ute": 2, "lts_lte_uts_ute": 4}


@dataclass(frozen=True)
class AttnFwdSpec:
    """A validated :func:`flash_attn_fwd` call; everything downstream reads only this.

    Shape letters as in ``docs/api.md``. For varlen calls ``batch`` is the number of sequences,
    ``seqlen_q``/``seqlen_k`` are ``max_seqlen_q``/``max_seqlen_k`` and ``total_q``/``total_k`` the
    packed token counts; otherwise ``total_q == batch * seqlen_q`` (likewise for k).

    ``window_left``/``window_right`` are None when unbounded; causal calls have
    ``window_right == 0``. ``causal`` is also True for a window ``(None, 0)`` (the same mask).
    ``block_size`` is 0 when no ``block_logit`` is produced; ``num_blocks`` is its last extent.

    FlashMask (``startend_row_indices``, docs/api.md "FlashMask"): ``startend`` names the column
    layout, one of :data:`STARTEND_LAYOUTS` ("" = no mask); ``startend_heads`` is the mask's head
    extent (1, Hkv or Hq; query head ``h`` reads mask head ``h // (Hq // startend_heads)``).
    ``has_block_bos``: ``block_logit`` block ids are relative to each query's ``block_bos``.
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
    startend: str = ""
    startend_heads: int = 0
    has_block_bos: bool = False

    @property
    def startend_cols(self) -> int:
        """The last extent of ``startend_row_indices`` (0 without a FlashMask mask)."""
        return STARTEND_LAYOUTS[self.startend]

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

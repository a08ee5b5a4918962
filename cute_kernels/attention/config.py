"""Forward-attention config (the compile-cache key) and the one kernel-argument order.

``FwdConfig`` holds everything that changes generated code. Batch size, sequence lengths, the
softmax scale, softcap value and window sizes stay out of it: they are ``sym_int`` extents or
runtime ``Float32``/``Int32`` arguments, so one compile serves every length. Each arch's kernel
class derives its own tiles/stages from the config in ``__init__``.

Tensors as the kernels receive them (``FwdArgs``), shape letters as in docs/api.md:

    mQ           [B, Sq, Hq, D]       (varlen: [total_q, Hq, D])          bf16/fp16
    mK           [B, Sk, Hkv, D]      (varlen: [total_k, Hkv, D])
    mV           [B, Sk, Hkv, Dv]     (varlen: [total_k, Hkv, Dv])
    mO           [B, Sq, Hq, Dv]      (varlen: [total_q, Hq, Dv])         same dtype as Q
    mLSE         [B, Hq, Sq]          (varlen: [Hq, total_q])             fp32, natural log
    mBlockLogit  [B, Hq, Sq, nb]      (varlen: [Hq, total_q, nb]) fp32, or None when block_size == 0
    mCuSeqlensQ, mCuSeqlensK  [B + 1] int32, or None unless varlen
    softmax_scale (Float32), softcap (Float32, 0 when has_softcap is False),
    window_left, window_right (Int32, -1 = unbounded; read only when has_window),
    max_seqlen_q (Int32: grid extent for varlen, Sq otherwise), stream (TVM-FFI env stream)

With ``startend`` (FlashMask, dense only) three int32 tensors follow the stream argument:

    mStartend    [B, Hm, Sk, n]       the column bounds (query head h reads mask head h // (Hq // Hm))
    mFmMinMax    [B, Hm, NT, 2n]      per key tile min / max of each bound   (attention/fm_meta.py)
    mFmRanges    [B, Hm, MT, 2NT+3]   per query tile [first, last + 1) key tile not skipped, then the
                                      prefix counts and the list of those tiles (fm_meta.py)

with NT / MT the kernel's key / query tile counts (``launch.fm_tiles``).

With ``block_bos`` (SM90 and SM100) one more int32 tensor follows them (the three are None without
``startend``):

    mBlockBos    [B, Sq]              each query row's origin: block j of row i covers keys
                                      [bos_i + j * block_size, bos_i + (j + 1) * block_size); keys
                                      before bos_i lie in no block (common/block_logit.py)

nb = ceil(Sk / block_size) (varlen: ceil(max_seqlen_k / block_size), block index relative to each
sequence's own start). Causal and window masks are aligned bottom-right: row i of a sequence with
lengths (Sq, Sk) sees keys t with i + Sk - Sq - window_left <= t <= i + Sk - Sq + window_right
(causal == window_right 0, window_left unbounded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

HEAD_DIMS = (64, 96, 128, 192, 256)
BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class FwdConfig:
    arch: int  # exact compute capability (90, 100, 103): decides the target; kernels check arch.family
    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int  # Hq // Hkv (static; 1 = MHA)
    causal: bool
    has_window: bool
    has_softcap: bool
    block_size: int  # 0 = no block_logit output
    varlen: bool
    startend: str = ""  # FlashMask column layout (common/flashmask.COLS), "" = no startend_row_indices
    block_bos: bool = False  # block_logit block ids relative to each row's mBlockBos origin (dense only)

    @property
    def has_startend(self) -> bool:
        return bool(self.startend)

    @property
    def has_block_logit(self) -> bool:
        return self.block_size > 0


#: The FlashMask tensors a ``startend`` build takes after the stream argument (the module docstring).
FM_ARGS = ("mStartend", "mFmMinMax", "mFmRanges")
#: The tensor a ``block_bos`` build takes after them.
BOS_ARGS = ("mBlockBos",)


class FwdArgs(NamedTuple):
    """Kernel arguments in the one order used to compile (fake tensors) and to call (real ones)."""

    mQ: Any
    mK: Any
    mV: Any
    mO: Any
    mLSE: Any
    mBlockLogit: Any
    mCuSeqlensQ: Any
    mCuSeqlensK: Any
    softmax_scale: Any
    softcap: Any
    window_left: Any
    window_right: Any
    max_seqlen_q: Any

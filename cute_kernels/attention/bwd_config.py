"""Attention backward: the compile key, the workspace each call needs, and the accumulator layout.

One module both arches' backward kernels, the preprocess / postprocess kernels and the host
launcher (``bwd_launch``) read, so that tile padding, accumulator offsets and buffer shapes have a
single definition (most reported FA backward bugs are a mismatch between those three).

Math (natural-log LSE as the forward writes it; s = softmax_scale * q.k, softcapped when
``has_softcap``: s' = c * tanh(s / c)):

    P    = exp(s' - LSE)                       (rows with LSE = -inf: P = 0, zero gradients)
    D_i  = sum_d dO_id * O_id  (- dLSE_i when the caller passes dlse)
    dV   = P^T dO
    dP   = dO V^T
    dS'  = P * (dP - D)                        (gradient w.r.t. the softmax input s')
    dS   = dS' * (1 - tanh^2(s / c))           (softcap chain rule; dS = dS' without softcap)
    dQ   = softmax_scale * dS K,   dK = softmax_scale * dS^T Q

Tensors as the launcher receives them (shape letters as in docs/api.md; varlen in brackets):

    dO, O   [B, Sq, Hq, Dv]   ([total_q, Hq, Dv])   q's dtype
    Q       [B, Sq, Hq, D]    ([total_q, Hq, D])
    K       [B, Sk, Hkv, D]   ([total_k, Hkv, D])
    V       [B, Sk, Hkv, Dv]  ([total_k, Hkv, Dv])
    LSE     [B, Hq, Sq]       ([Hq, total_q])       fp32, natural log (forward's output)
    dLSE    like LSE, or None (``has_dlse``)
    dQ, dK, dV  like Q, K, V (outputs; every element written)

Workspace (``workspace_shapes``; fp32 unless noted). Allocated by the caller with its framework's
``empty`` -- the preprocess kernel initialises every entry the main kernel reads or accumulates
into (no memset launch):

    lse_log2  [B, Hq, Sq_pad]     ([Hq, total_q_pad])       LSE * log2(e); -inf rows -> +inf (P = 0)
    dpsum     [B, Hq, Sq_pad]     ([Hq, total_q_pad])       D (minus dLSE)
    dq_accum  [B, Hq, Sq_pad, D]  ([Hq, total_q_pad, D])    row-major; zeroed by the preprocess
    dq_sem    int32 [B, Hq, Sq_pad // DQ_SEM_ROWS]  ([Hq, total_q_pad // DQ_SEM_ROWS])
              only when ``deterministic``: one turn counter per DQ_SEM_ROWS (64) accumulator rows,
              zeroed by the preprocess. A kernel whose tile_m is a multiple of 64 uses the counter of
              its query tile's first 64-row block (``dq_sem_index``); the others stay 0.

Only when ``group_split(cfg)`` (deterministic GQA with causal / window on SM90; Note [group split] in
bwd_sm90.py):

    dk_accum  like K  [B, Sk, Hkv, D]   ([total_k, Hkv, D])    fp32 partial sums of the group's heads
    dv_accum  like V  [B, Sk, Hkv, Dv]  ([total_k, Hkv, Dv])   (never read before written: no init)
    dkv_sem   int32 [B, Hkv, ceil(Sk / KV_SEM_KEYS)]  (varlen: Sk = max_seqlen_k)
              one turn counter per KV_SEM_KEYS keys, zeroed by the preprocess

Sq_pad = round_up(Sq, ACCUM_ROW_PAD). For varlen, sequence b's rows start at
``accum_row_start(cu_seqlens_q[b], b)`` (a multiple of ACCUM_ROW_PAD) and
total_q_pad = ``varlen_accum_rows(total_q, B)``; every sequence owns round_up(len_b, ACCUM_ROW_PAD)
rows there, so any query tile of at most ACCUM_ROW_PAD rows reads and writes whole padded tiles
without touching its neighbour (proof in Note [varlen accumulator rows]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

#: Row padding of the fp32 accumulators and row statistics: a multiple of every backward tile_m.
ACCUM_ROW_PAD = 128
#: Accumulator rows per deterministic-dQ turn counter (the smallest backward tile_m; divides ACCUM_ROW_PAD).
DQ_SEM_ROWS = 64
#: Keys per dK/dV turn counter of ``group_split`` (the smallest backward tile_n).
KV_SEM_KEYS = 64

HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class BwdConfig:
    """Everything that changes generated code of the backward (pre, main and post kernels)."""

    arch: int  # exact compute capability (90, 100, 103): decides the target; kernels check arch.family
    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int  # Hq // Hkv (static; 1 = MHA)
    causal: bool
    has_window: bool
    has_softcap: bool
    varlen: bool
    deterministic: bool  # dQ (and any cross-CTA sum) in a fixed order: bitwise reproducible
    has_dlse: bool = False  # D' = D - dLSE in the preprocess; the main kernel is unchanged
    startend: str = ""  # FlashMask column layout (common/flashmask.COLS); "" = no startend_row_indices


def group_split(cfg: BwdConfig) -> bool:
    """Deterministic GQA with causal / window on SM90: one CTA per (key tile, query head) instead of one
    per (key tile, kv head), dK / dV summed over the group in head order through fp32 workspace (Note
    [group split] in bwd_sm90.py). The other configs sum the group in registers."""
    return (cfg.arch // 10 == 9 and cfg.deterministic and cfg.qhead_per_kvhead > 1
            and (cfg.causal or cfg.has_window))


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def accum_row_start(cu_q_b: int, b: int) -> int:
    """First accumulator row of varlen sequence ``b`` whose packed rows start at ``cu_q_b``.

    Note [varlen accumulator rows]: start_b = floor((cu_b + R b) / R) R with R = ACCUM_ROW_PAD.
    start_b <= cu_b + R b and start_{b+1} >= cu_{b+1} + R (b + 1) - (R - 1) >= start_b + len_b + 1;
    both are multiples of R, so start_{b+1} - start_b >= round_up(len_b + 1, R) >= round_up(len_b, R):
    the padded tiles of consecutive sequences never overlap. The last sequence ends at most at
    cu_{B-1} + R (B - 1) + round_up(len, R) <= total_q + R B, hence ``varlen_accum_rows``.
    Device code computes the same expression (``(cu_b + R * b) // R * R``).
    """
    r = ACCUM_ROW_PAD
    return (int(cu_q_b) + r * int(b)) // r * r


def varlen_accum_rows(total_q: int, batch: int) -> int:
    """Rows of the varlen accumulators for ``batch`` sequences of ``total_q`` packed rows."""
    return round_up(int(total_q) + ACCUM_ROW_PAD * int(batch), ACCUM_ROW_PAD)


def dq_sem_index(accum_row: int) -> int:
    """Turn counter of the query tile whose first accumulator row is ``accum_row`` (device code: the
    same expression, ``accum_row // DQ_SEM_ROWS``)."""
    return int(accum_row) // DQ_SEM_ROWS


def workspace_shapes(cfg: BwdConfig, *, batch: int, seqlen_q: int, num_heads: int, total_q: int = 0,
                     seqlen_k: int = 0, num_kv_heads: int = 0, total_k: int = 0) -> dict:
    """``{name: (shape, dtype)}`` of the workspace one call needs (see the module docstring).

    ``seqlen_q`` is Sq (varlen: ignored; ``total_q`` and ``batch`` = number of sequences are used).
    ``seqlen_k`` (Sk; varlen: max_seqlen_k), ``num_kv_heads`` and ``total_k`` (varlen) are read only
    when ``group_split(cfg)``.
    """
    if cfg.varlen:
        rows = varlen_accum_rows(total_q, batch)
        lead = [num_heads, rows]
    else:
        rows = round_up(seqlen_q, ACCUM_ROW_PAD)
        lead = [batch, num_heads, rows]
    out = {
        "lse_log2": (lead, "float32"),
        "dpsum": (lead, "float32"),
        "dq_accum": (lead + [cfg.head_dim], "float32"),
    }
    if cfg.deterministic:
        out["dq_sem"] = (lead[:-1] + [rows // DQ_SEM_ROWS], "int32")
    if group_split(cfg):
        assert num_kv_heads > 0, "group_split configs need num_kv_heads (and seqlen_k / total_k)"
        keys = [int(total_k)] if cfg.varlen else [batch, int(seqlen_k)]
        out["dk_accum"] = (keys + [num_kv_heads, cfg.head_dim], "float32")
        out["dv_accum"] = (keys + [num_kv_heads, cfg.head_dim_v], "float32")
        out["dkv_sem"] = ([batch, num_kv_heads, -(-int(seqlen_k) // KV_SEM_KEYS)], "int32")
    return out


class BwdArgs(NamedTuple):
    """Launcher-level tensors and scalars, in the one order ``bwd_launch.run_bwd`` documents."""

    dO: Any
    Q: Any
    K: Any
    V: Any
    O: Any
    LSE: Any
    dLSE: Any
    dQ: Any
    dK: Any
    dV: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any


#: The FlashMask tensors a ``startend`` build of the main kernel takes after the stream (BwdKernelArgs).
BWD_FM_ARGS = ("mStartend", "mFmMinMax")


class BwdKernelArgs(NamedTuple):
    """Arguments of each arch's **main** backward kernel (``FlashBwdSm90`` / ``FlashBwdSm100``
    ``__call__(*BwdKernelArgs, stream)``), in the one order used to compile (fake tensors) and to call.

        mQ, mK, mV, mdO    as in the module docstring (dense 4-D or varlen 3-D)
        mLSElog2, mdPsum   workspace rows written by the preprocess
        mdQaccum           fp32 workspace, accumulated (reduce-add) by the main kernel
        mdK, mdV           outputs in q's dtype, written once per element: for GQA the kernel sums the
                           Hq // Hkv query heads of a group itself (no fp32 dK/dV expansion over Hq)
        mCuSeqlensQ, mCuSeqlensK   int32 [B + 1], or None unless varlen
        mdQsem             int32 turn counters, or None unless deterministic
        mdKaccum, mdVaccum, mdKVsem   fp32 partial dK / dV and their int32 turn counters, or None
                           unless ``group_split`` (SM90 only)
        softmax_scale, softcap   Float32 (softcap 0 unless has_softcap)
        window_left, window_right  Int32, -1 = unbounded (read only when has_window)
        max_seqlen_q, max_seqlen_k Int32 (varlen: the longest sequence; else Sq, Sk)

    With ``startend`` (FlashMask, dense only) two int32 tensors follow the stream argument: mStartend
    [B, Hm, Sk, n] and mFmMinMax [B, Hm, ceil(Sk / tile_n), 2n] (attention/fm_meta.py, the main
    kernel's tile_n: ``bwd_launch.fm_meta_config``).
    """

    mQ: Any
    mK: Any
    mV: Any
    mdO: Any
    mLSElog2: Any
    mdPsum: Any
    mdQaccum: Any
    mdK: Any
    mdV: Any
    mCuSeqlensQ: Any
    mCuSeqlensK: Any
    mdQsem: Any
    mdKaccum: Any
    mdVaccum: Any
    mdKVsem: Any
    softmax_scale: Any
    softcap: Any
    window_left: Any
    window_right: Any
    max_seqlen_q: Any
    max_seqlen_k: Any

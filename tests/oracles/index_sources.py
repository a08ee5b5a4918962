"""Index sources for indexed_attention tests and benchmarks (numpy only).

Every generator returns int32 token indices ``[Lq, Wsel]`` into a key axis of length ``kv_len``
(batch / kv-head axes are stacked by the caller). Padding is ``kv_len`` (prime-rl's sentinel) unless
a generator says otherwise; ``with_padding`` mixes in ``-1`` and ``kv_len``.

``prime_rl_indices`` follows prime-rl's QSA indexer format: each query at position p (global key
coordinates, ``query_offset`` for context-parallel ranks) selects ``budget_blocks`` blocks of
``ratio`` tokens among the complete blocks at or before p (all of them when fewer are visible), in
score order, followed by the 0..ratio-1 tail tokens of its own incomplete block; row width
``budget_blocks * ratio + ratio - 1``. Scores are the indexer's ReLU-sum over heads of query . block
key with a random projection of AR(1) hidden states ``h_t = rho h_{t-1} + sqrt(1 - rho^2) eps_t``:
rho = 0.9 gives "local" selections (union of 5 neighbouring rows ~1.7-2.4x one row), rho = 0.5
"less local" ones (see /work/shared/notes/indexed_attention.md section 5). RMSNorm and RoPE of the
real indexer are left out: they change scores, not the locality knob.
"""

from __future__ import annotations

import numpy as np


def ar1_states(n: int, hidden: int, rho: float, rng: np.random.Generator) -> np.ndarray:
    eps = rng.standard_normal((n, hidden)).astype(np.float32)
    h = np.empty_like(eps)
    h[0] = eps[0]
    c = np.float32(np.sqrt(1.0 - rho * rho))
    for t in range(1, n):
        h[t] = rho * h[t - 1] + c * eps[t]
    return h


def prime_rl_indices(num_queries: int, kv_len: int, rho: float = 0.9, *, query_offset: int | None = None,
                     budget_blocks: int = 512, ratio: int = 4, heads: int = 4, head_dim: int = 32,
                     hidden: int = 64, seed: int = 0, chunk: int = 1024) -> np.ndarray:
    """prime-rl-format rows (see module docstring); queries are the last ``num_queries`` positions
    of the ``kv_len``-token document unless ``query_offset`` is given."""
    rng = np.random.default_rng(seed)
    if query_offset is None:
        query_offset = kv_len - num_queries
    h = ar1_states(kv_len, hidden, rho, rng)
    wq = rng.uniform(-1, 1, (hidden, heads * head_dim)).astype(np.float32) / np.sqrt(hidden)
    wk = rng.uniform(-1, 1, (hidden, head_dim)).astype(np.float32) / np.sqrt(hidden)
    n_blocks = kv_len // ratio
    kb = (h[: n_blocks * ratio] @ wk).reshape(n_blocks, ratio, head_dim).mean(axis=1)  # (n_blocks, hd)
    width = budget_blocks * ratio + ratio - 1
    out = np.full((num_queries, width), kv_len, dtype=np.int32)
    for c0 in range(0, num_queries, chunk):
        pos = np.arange(query_offset + c0, query_offset + min(c0 + chunk, num_queries))
        q = (h[pos] @ wq).reshape(len(pos), heads, head_dim)
        scores = np.maximum(np.einsum("qhd,bd->qhb", q, kb), 0).sum(axis=1)  # (n, n_blocks)
        visible = (pos + 1) // ratio
        scores[np.arange(n_blocks)[None, :] >= visible[:, None]] = -np.inf
        k = min(budget_blocks, n_blocks)
        if k > 0:
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            order = np.argsort(-np.take_along_axis(scores, top, 1), axis=1, kind="stable")
            top = np.take_along_axis(top, order, 1)
        for i, p in enumerate(pos):
            nsel = min(budget_blocks, int(visible[i]))
            if nsel:
                blocks = top[i, :nsel]
                out[c0 + i, : nsel * ratio] = (blocks[:, None] * ratio + np.arange(ratio)).reshape(-1)
            tail = (p + 1) % ratio
            out[c0 + i, nsel * ratio: nsel * ratio + tail] = np.arange(p - tail + 1, p + 1)
    return out


def uniform_indices(num_queries: int, kv_len: int, width: int, *, causal: bool = True,
                    query_offset: int | None = None, seed: int = 0) -> np.ndarray:
    """Each row: ``width`` distinct random keys (at or before its position when causal), padding -1."""
    rng = np.random.default_rng(seed)
    if query_offset is None:
        query_offset = kv_len - num_queries
    out = np.full((num_queries, width), -1, dtype=np.int32)
    for i in range(num_queries):
        limit = min(query_offset + i + 1, kv_len) if causal else kv_len
        n = min(width, limit)
        out[i, :n] = rng.choice(limit, size=n, replace=False)
    return out


def identical_windows(num_queries: int, kv_len: int, width: int, window_queries: int, *,
                      seed: int = 0) -> np.ndarray:
    """All queries of each window select the same row (window union = one row)."""
    rng = np.random.default_rng(seed)
    out = np.empty((num_queries, width), dtype=np.int32)
    for w0 in range(0, num_queries, window_queries):
        row = rng.choice(kv_len, size=min(width, kv_len), replace=False).astype(np.int32)
        out[w0: w0 + window_queries, : len(row)] = row
        out[w0: w0 + window_queries, len(row):] = kv_len
    return out


def disjoint_windows(num_queries: int, kv_len: int, width: int, window_queries: int, *,
                     seed: int = 0) -> np.ndarray:
    """Queries of a window select pairwise disjoint keys (union = window_queries x width)."""
    rng = np.random.default_rng(seed)
    if width * window_queries > kv_len:
        raise ValueError("disjoint_windows: width * window_queries must be <= kv_len")
    out = np.empty((num_queries, width), dtype=np.int32)
    for w0 in range(0, num_queries, window_queries):
        perm = rng.permutation(kv_len).astype(np.int32)
        for i in range(min(window_queries, num_queries - w0)):
            out[w0 + i] = perm[i * width: (i + 1) * width]
    return out


def document_starts(num_queries: int, kv_len: int, width: int, *, doc_len: int = 7, seed: int = 0) -> np.ndarray:
    """Packed documents of ``doc_len`` tokens; query i selects the 1-3 most recent tokens of its own
    document (the first positions of a document see only their tail), padding kv_len."""
    rng = np.random.default_rng(seed)
    offset = kv_len - num_queries
    out = np.full((num_queries, width), kv_len, dtype=np.int32)
    for i in range(num_queries):
        p = offset + i
        doc0 = p - p % doc_len
        n = min(p - doc0 + 1, int(rng.integers(1, 4)), width)
        out[i, :n] = np.arange(p - n + 1, p + 1)
    return out


def with_padding(idx: np.ndarray, kv_len: int, fraction: float = 0.3, *, seed: int = 0) -> np.ndarray:
    """Replace ``fraction`` of the entries by padding: -1, kv_len, or a large out-of-range value."""
    rng = np.random.default_rng(seed)
    out = idx.copy()
    hit = rng.random(idx.shape) < fraction
    kind = rng.integers(0, 3, idx.shape)
    pad = np.where(kind == 0, -1, np.where(kind == 1, kv_len, kv_len + 1000)).astype(np.int32)
    out[hit] = pad[hit]
    return out


def with_duplicates(idx: np.ndarray, kv_len: int, fraction: float = 0.2, *, seed: int = 0) -> np.ndarray:
    """Overwrite ``fraction`` of each row's entries with copies of valid entries of the same row."""
    rng = np.random.default_rng(seed)
    out = idx.copy()
    for row in out:
        valid = row[(row >= 0) & (row < kv_len)]
        if len(valid) == 0:
            continue
        hit = rng.random(len(row)) < fraction
        row[hit] = rng.choice(valid, size=int(hit.sum()))
    return out


def shuffle_rows(idx: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """Permute the entries of every row independently (the selected sets stay the same)."""
    rng = np.random.default_rng(seed)
    return rng.permuted(idx, axis=-1).astype(np.int32)


def row_sets(idx: np.ndarray, kv_len: int) -> list[frozenset]:
    """Distinct valid keys of every row of ``idx [..., Lq, Wsel]`` flattened over leading axes."""
    flat = idx.reshape(-1, idx.shape[-1])
    return [frozenset(int(k) for k in row if 0 <= k < kv_len) for row in flat]


def union_ratio(idx: np.ndarray, kv_len: int, window_queries: int) -> float:
    """Mean window union size / mean row set size (1 = identical rows, window_queries = disjoint)."""
    sets = row_sets(idx, kv_len)
    rows = np.mean([len(s) for s in sets]) if sets else 0.0
    unions = [len(frozenset().union(*sets[w: w + window_queries])) for w in range(0, len(sets), window_queries)]
    return float(np.mean(unions) / rows) if rows else 0.0

"""The SM100 block-sparse dQ kernel's softmax warpgroups find the ring buffer of a step's K tile by counting
(Note [non-finite keys, SM100 dQ] in cute_kernels/block_sparse/bwd_dq_sm100.py): checked against a model of the
load warp's fill order (``BlockSparseBwdDQSm100.load``: per row tile with keys, K(0), V(0), then K(j), V(j) for
j = 1 .. n * sweeps - 1; the second sweep walks the steps again). A wrong count would scrub a buffer that holds
another tile (or one the TMA is filling)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("cutlass")

from cute_kernels.block_sparse.bwd_dq_sm100 import k_ring_position, ring_tiles  # noqa: E402


def load_order(tiles, sweeps):
    """[(tile, 'K' | 'V', global step j)] in the order the load warp fills the ring (tiles: steps per row tile,
    0 for a tile without keys, which loads nothing)."""
    out = []
    for t, n in enumerate(tiles):
        if n == 0:
            continue
        for j in range(n * sweeps):
            out.append((t, "K", j))
            out.append((t, "V", j))
    return out


@pytest.mark.parametrize("sweeps", [1, 2], ids=["delta", "exact_delta"])
def test_k_ring_position_matches_the_load_order(sweeps):
    rng = random.Random(5)
    for _ in range(50):
        tiles = [rng.choice([0, 1, 2, 3, 7]) for _ in range(rng.randint(1, 6))]
        order = load_order(tiles, sweeps)
        kv_count = 0
        for t, n in enumerate(tiles):
            if n == 0:
                continue
            for step in range(n):  # the last sweep's steps (the one whose K the dQ GEMM reads)
                want = order.index((t, "K", (sweeps - 1) * n + step))
                assert k_ring_position(kv_count, sweeps, n, step) == want
            kv_count += ring_tiles(sweeps, n)
        assert kv_count == len(order)

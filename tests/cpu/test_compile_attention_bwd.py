"""The attention backward (pre, main, post) compiles for sm_90a without a GPU: 0 spills, shared memory
within the limit; plus the launcher's host-side contracts (argument order, workspace, tile ranges).

``python -m cute_kernels.check --arch sm_90a --kernel attention_bwd[_pre|_post]`` in a subprocess; the
whole matrix (``--full``) is under the slow marker.
"""

from __future__ import annotations

import inspect

import pytest

from tests.cpu._check_cli import run_check


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["attention_bwd", "attention_bwd_pre", "attention_bwd_post"])
def test_attention_bwd_compiles_for_sm90(tmp_path, kernel):
    rows = run_check(tmp_path, "sm_90a", kernel)
    from cute_kernels.attention import bwd_launch

    matrix = bwd_launch.CHECKS[kernel][0]
    assert len(rows) == len(matrix(90, False))


@pytest.mark.compile
@pytest.mark.slow
def test_attention_bwd_full_matrix_compiles_for_sm90(tmp_path):
    run_check(tmp_path, "sm_90a", "attention_bwd", "--full")


def test_bwd_kernel_args_order_matches_kernel_call():
    from cute_kernels.attention.bwd_config import BwdKernelArgs
    from cute_kernels.attention.bwd_sm90 import FlashBwdSm90

    params = list(inspect.signature(FlashBwdSm90.__call__).parameters)
    from cute_kernels.attention.bwd_config import BWD_FM_ARGS

    assert params == ["self", *BwdKernelArgs._fields, "stream", *BWD_FM_ARGS]  # then the FlashMask tensors


def test_unsupported_reasons_name_the_case():
    from cute_kernels.attention.bwd_launch import bwd_config, unsupported_reason

    assert unsupported_reason(bwd_config(90, "bfloat16", 128, 128, 4, True, False, False, True, True)) is None
    for d, dv in ((192, 192), (256, 256), (192, 128)):
        assert unsupported_reason(bwd_config(90, "float16", d, dv, 4, True, True, True, True, True)) is None
    r = unsupported_reason(bwd_config(90, "bfloat16", 80, 80, 1, False, False, False, False, False))
    assert r is not None and "head_dim 80" in r
    r = unsupported_reason(bwd_config(90, "bfloat16", 256, 128, 1, False, False, False, False, False))
    assert r is not None and "head_dim_v 128" in r
    assert "compute capability 8.0" in unsupported_reason(
        bwd_config(80, "bfloat16", 128, 128, 1, False, False, False, False, False))


def test_sm90_tiles_fit():
    """Every SM90 head-dim pair: the wide schedule (d > 128) takes 64-key tiles, both consumer WGs split
    d in halves that are whole swizzle atoms, the dQ staging rounds cover d, and the shared memory the
    kernel asks for stays under the limit (the compiled struct is asserted against this estimate)."""
    from cute_kernels.attention.bwd_config import ACCUM_ROW_PAD, DQ_SEM_ROWS, HEAD_DIMS
    from cute_kernels.attention.bwd_launch import bwd_config
    from cute_kernels.attention.bwd_sm90 import SMEM_BYTES_MAX, FlashBwdSm90, tile_config

    for d, dv in HEAD_DIMS:
        for det in (False, True):
            cfg = bwd_config(90, "bfloat16", d, dv, 4, True, False, False, True, det)
            t = tile_config(cfg)
            assert FlashBwdSm90.smem_bytes(cfg) <= SMEM_BYTES_MAX, (d, dv)
            assert ACCUM_ROW_PAD % t.tile_m == 0 and t.tile_m % DQ_SEM_ROWS == 0
            assert t.wide == (d > 128)
            k = FlashBwdSm90(cfg)
            if t.wide:
                assert t.tile_n == 64 and k.dq_wgs * k.dq_cols * k.dq_rounds == d
                assert (d // 2) % 32 == 0 and (dv // 2) % 32 == 0  # halves of whole SW64 / SW128 atoms


def test_workspace_shapes():
    from cute_kernels.attention.bwd_config import DQ_SEM_ROWS, accum_row_start, varlen_accum_rows
    from cute_kernels.attention.bwd_launch import bwd_config, workspace_shapes

    cfg = bwd_config(90, "bfloat16", 128, 128, 1, False, False, False, False, True)
    ws = workspace_shapes(cfg, batch=2, seqlen_q=300, num_heads=3)
    assert ws["dq_accum"] == ([2, 3, 384, 128], "float32")
    assert ws["dq_sem"] == ([2, 3, 384 // DQ_SEM_ROWS], "int32")
    cfg_v = bwd_config(90, "bfloat16", 64, 64, 1, False, False, False, True, False)
    lens = [130, 0, 257, 64, 1]
    ws = workspace_shapes(cfg_v, batch=len(lens), seqlen_q=0, num_heads=2, total_q=sum(lens))
    rows = ws["lse_log2"][0][1]
    assert rows == varlen_accum_rows(sum(lens), len(lens)) and "dq_sem" not in ws
    cu = 0
    prev_end = 0
    for b, n in enumerate(lens):  # padded tiles of consecutive sequences never overlap, all in range
        start = accum_row_start(cu, b)
        assert start % 128 == 0 and start >= prev_end
        prev_end = start + -(-n // 128) * 128
        assert prev_end <= rows
        cu += n


def test_group_split_workspace():
    """Deterministic GQA with causal / window on SM90 (Note [group split]): fp32 partials shaped like K / V and
    one turn counter per 64 keys; every other config allocates none of them."""
    from cute_kernels.attention.bwd_config import KV_SEM_KEYS, group_split
    from cute_kernels.attention.bwd_launch import _prepost_key, bwd_config, workspace_shapes

    cfg = bwd_config(90, "bfloat16", 128, 128, 4, True, False, False, False, True)
    assert group_split(cfg) and group_split(_prepost_key(cfg))  # the preprocess zeroes the counters
    ws = workspace_shapes(cfg, batch=2, seqlen_q=300, num_heads=8, seqlen_k=200, num_kv_heads=2)
    assert ws["dk_accum"] == ([2, 200, 2, 128], "float32") and ws["dv_accum"] == ([2, 200, 2, 128], "float32")
    assert ws["dkv_sem"] == ([2, 2, -(-200 // KV_SEM_KEYS)], "int32")
    cfg_v = bwd_config(90, "bfloat16", 192, 128, 2, False, True, False, True, True)
    ws = workspace_shapes(cfg_v, batch=3, seqlen_q=0, num_heads=4, total_q=50, seqlen_k=130, num_kv_heads=2,
                          total_k=70)
    assert ws["dk_accum"] == ([70, 2, 192], "float32") and ws["dv_accum"] == ([70, 2, 128], "float32")
    assert ws["dkv_sem"] == ([3, 2, 3], "int32")
    for args in ((90, "bfloat16", 128, 128, 4, True, False, False, False, False),  # not deterministic
                 (90, "bfloat16", 128, 128, 1, True, False, False, False, True),  # MHA
                 (90, "bfloat16", 128, 128, 4, False, False, False, False, True),  # no causal / window
                 (100, "bfloat16", 128, 128, 4, True, False, False, False, True)):  # SM100
        c = bwd_config(*args)
        assert not group_split(c) and not group_split(_prepost_key(c))
        assert "dkv_sem" not in workspace_shapes(c, batch=1, seqlen_q=64, num_heads=4)


def _visible(i, t, sq, sk, left, right):
    return t - (sk - sq) - right <= i <= t - (sk - sq) + left and 0 <= i < sq and 0 <= t < sk


@pytest.mark.parametrize("sq,sk", [(300, 300), (517, 300), (100, 700), (1, 129), (256, 1024)])
@pytest.mark.parametrize("window", [(None, None), (None, 0), (100, 30), (10, 0), (0, 0)])
def test_query_tile_range_is_exact(sq, sk, window):
    """Python replica of common/tile_range.QueryTileRange / first_key_tile / last_key_tile against brute
    force: key tile n visits query tile m iff a visible pair exists, and the visitors of m are exactly
    [first_key_tile(m), last_key_tile(m)] (so every deterministic turn counter sees 0 .. k-1)."""
    big = sq + sk
    left = big if window[0] is None else window[0]
    right = big if window[1] is None else window[1]
    mask_right, mask_left = window[1] is not None, window[0] is not None
    for tile_m, tile_n in ((64, 128), (128, 128), (64, 64)):  # 128-key and wide schedules
        shift = sk - sq
        for n in range(-(-sk // tile_n)):
            n0 = n * tile_n
            n_last = min(n0 + tile_n, sk) - 1
            lo = max(n0 - shift - right, 0) if mask_right else 0
            hi = min(n_last - shift + left, sq - 1) if mask_left else sq - 1
            mr = range(lo // tile_m, hi // tile_m + 1) if lo <= hi else range(0)
            # mask-free query tiles [m_right_mask, m_left_mask) (the backward skips the mask there)
            m_lo, m_hi = (mr.start, mr.stop) if len(mr) else (lo // tile_m, lo // tile_m)
            m_rm = -(-max(n_last - shift - right, 0) // tile_m) if mask_right else m_lo
            m_lm = max(n0 - shift + left + 1, 0) // tile_m if mask_left else m_hi
            m_rm = min(max(m_rm, m_lo), m_hi)
            m_lm = min(max(m_lm, m_rm), m_hi)
            for m in range(-(-sq // tile_m)):
                brute = any(_visible(i, t, sq, sk, left, right)
                            for i in range(m * tile_m, min(m * tile_m + tile_m, sq))
                            for t in range(n0, n_last + 1))
                assert (m in mr) == brute, (sq, sk, window, tile_m, n, m)
                if m_rm <= m < m_lm:
                    assert all(_visible(i, t, sq, sk, left, right)
                               for i in range(m * tile_m, min(m * tile_m + tile_m, sq))
                               for t in range(n0, n_last + 1)), ("mask-free", sq, sk, window, tile_m, n, m)
        for m in range(-(-sq // tile_m)):
            visitors = [n for n in range(-(-sk // tile_n))
                        if any(_visible(i, t, sq, sk, left, right)
                               for i in range(m * tile_m, min(m * tile_m + tile_m, sq))
                               for t in range(n * tile_n, min(n * tile_n + tile_n, sk)))]
            if visitors:
                first = max(m * tile_m + shift - left, 0) // tile_n if mask_left else 0
                m_end = min(m * tile_m + tile_m, sq)
                last = (min(m_end - 1 + shift + right, sk - 1) if mask_right else sk - 1) // tile_n
                # ascending lock n - first and descending (spt) lock last - n both give 0 .. k-1
                assert visitors == list(range(first, last + 1)), (sq, sk, window, m)

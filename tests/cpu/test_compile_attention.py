"""The attention forward compiles for sm_90a without a GPU: 0 spills, shared memory within the limit.

Runs ``python -m cute_kernels.check --arch sm_90a --kernel attention_fwd`` (a representative subset of
the config matrix) in a subprocess; the whole matrix (``--full``) is under the slow marker. Also checks
the host-side contracts of cute_kernels.attention.launch that need no compile.
"""

from __future__ import annotations

import inspect

import pytest

from tests.cpu._check_cli import run_check


def _run_check(tmp_path, *extra):
    return run_check(tmp_path, "sm_90a", "attention_fwd", *extra)


@pytest.mark.compile
def test_attention_fwd_compiles_for_sm90(tmp_path):
    rows = _run_check(tmp_path)
    from cute_kernels.attention.launch import config_matrix

    assert len(rows) == len(config_matrix(90, False))


@pytest.mark.compile
@pytest.mark.slow
def test_attention_fwd_full_matrix_compiles_for_sm90(tmp_path):
    _run_check(tmp_path, "--full")


def test_fwd_args_order_matches_kernel_call():
    """FwdArgs is the one argument order: the SM90 kernel's __call__ takes exactly it, then stream, then
    the FlashMask tensors (FM_ARGS, None unless a startend build), then block_bos's (BOS_ARGS)."""
    from cute_kernels.attention.config import BOS_ARGS, FM_ARGS, FwdArgs
    from cute_kernels.attention.fwd_sm90 import FlashFwdSm90

    params = list(inspect.signature(FlashFwdSm90.__call__).parameters)
    assert params == ["self", *FwdArgs._fields, "stream", *FM_ARGS, *BOS_ARGS]


def test_unsupported_reasons_name_the_case():
    from cute_kernels.attention.launch import fwd_config, unsupported_reason

    ok = fwd_config(90, "bfloat16", 128, 128, 1, True, False, False, 64, False)
    assert unsupported_reason(ok) is None
    assert "head_dim 80" in unsupported_reason(fwd_config(90, "bfloat16", 80, 80, 1, False, False, False, 0, False))
    assert unsupported_reason(fwd_config(90, "bfloat16", 192, 128, 1, False, False, False, 0, False)) is None
    assert "head_dim_v 64" in unsupported_reason(fwd_config(90, "bfloat16", 128, 64, 1, False, False, False, 0, False))
    assert "block_size 48" in unsupported_reason(fwd_config(90, "bfloat16", 128, 128, 1, False, False, False, 48, False))
    assert "compute capability 8.0" in unsupported_reason(fwd_config(80, "bfloat16", 128, 128, 1, False, False, False, 0, False))
    # block_bos: both kernels take it (dense, with block_logit); varlen or no block_logit is named
    for arch in (90, 100, 103):
        for se in ("", "lts"):
            assert unsupported_reason(fwd_config(arch, "bfloat16", 128, 128, 1, True, False, False, 64, False,
                                                 startend=se, block_bos=True)) is None
        assert "block_bos" in unsupported_reason(fwd_config(arch, "bfloat16", 128, 128, 1, True, False, False, 64,
                                                            True, block_bos=True))
        assert "block_bos" in unsupported_reason(fwd_config(arch, "bfloat16", 128, 128, 1, True, False, False, 0,
                                                            False, block_bos=True))


def test_config_matrix_covers_both_archs():
    from cute_kernels.attention.launch import config_matrix

    for arch in (90, 100):
        small = config_matrix(arch, False)
        bos = [c for c in small if c.block_bos]
        small = [c for c in small if not c.block_bos]
        # block_bos lines: block sizes below, at and above tile_n, with and without a mask (SM100: also d 192
        # and (192, 128))
        assert (len(bos) >= 5 and {c.block_size for c in bos} >= {16, 64, 256}
                and {c.startend for c in bos} >= {"", "lts"})
        assert arch == 90 or {(c.head_dim, c.head_dim_v) for c in bos} >= {(64, 64), (128, 128), (192, 192),
                                                                          (256, 256), (192, 128)}
        dense = [c for c in small if not c.startend]
        assert 6 <= len(dense) <= 10 and all(c.arch == arch for c in small)
        # FlashMask lines: every column layout, in the default matrix and the full one
        layouts = {"lts", "lts_lte", "lts_ute", "lts_lte_uts_ute"}
        assert {c.startend for c in small if c.startend} == layouts and len(small) - len(dense) <= 9
        assert any(c.startend and (c.head_dim, c.head_dim_v) == (192, 128) for c in small)
        full = config_matrix(arch, True)
        assert {c.startend for c in full if c.startend} == layouts
        assert {c.block_size for c in full} == {0, 16, 32, 64, 128, 256}
        assert {c.head_dim for c in full} >= {64, 128, 192, 256}
        assert any(c.varlen for c in full) and any(c.has_window for c in full)
        assert any(c.qhead_per_kvhead > 1 for c in full)
        if arch == 100:  # every head dim x block size x mask with block_bos, each FlashMask layout, softcap
            fb = [c for c in full if c.block_bos]
            assert {(c.head_dim, c.head_dim_v, c.block_size, c.causal, c.has_window) for c in fb} >= {
                (d, dv, bs, m == "causal", m == "window") for d, dv in ((64, 64), (128, 128), (192, 192),
                                                                        (256, 256), (192, 128))
                for bs in (16, 32, 64, 128, 256) for m in ("none", "causal", "window")}
            assert {c.startend for c in fb} == layouts | {""} and any(c.has_softcap for c in fb)
            assert len(fb) == len(set(fb)) and not any(c.varlen for c in fb)


def test_block_logit_shape_rejects_straddling_blocks():
    from cute_kernels.common.block_logit import BlockLogitShape

    s = BlockLogitShape(128, 64, rows_per_thread=2, threads_per_row=4)
    assert (s.blocks_per_tile, s.tiles_per_block, s.owned) == (2, 1, 1)
    s = BlockLogitShape(128, 16, rows_per_thread=2, threads_per_row=4)
    assert s.owned == 4
    s = BlockLogitShape(64, 256, rows_per_thread=2, threads_per_row=4)
    assert s.tiles_per_block == 4
    s = BlockLogitShape(128, 32, rows_per_thread=1, threads_per_row=1)
    assert s.owned == 4 and s.stages == ()
    with pytest.raises(ValueError, match="straddle"):
        BlockLogitShape(96, 64, rows_per_thread=2, threads_per_row=4)

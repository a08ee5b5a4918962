"""SM90 forward's opt-in block_logit store variant (bl_store="producer"): host contracts and compile.

The variant is selected by ``run_fwd(..., bl_store=)`` or ``$CUTE_KERNELS_SM90_BL_STORE``, read only in
cute_kernels/attention/launch.py and passed to ``compile_fwd`` as part of its cache key. The GPU tests
(bitwise equality with the default build) are in tests/gpu/test_fwd_sm90_bl_store.py.
"""

from __future__ import annotations

import inspect

import pytest

from tests.cpu._check_cli import run_check


def _cfg(arch=90, block_size=64):
    from cute_kernels.attention.launch import fwd_config

    return fwd_config(arch, "bfloat16", 128, 128, 1, True, False, False, block_size, False)


def test_mode_defaults_to_consumer(monkeypatch):
    from cute_kernels.attention import launch

    monkeypatch.delenv(launch.BL_STORE_ENV, raising=False)
    assert launch.bl_store_mode(_cfg()) == "consumer"
    monkeypatch.setenv(launch.BL_STORE_ENV, "")
    assert launch.bl_store_mode(_cfg()) == "consumer"


def test_env_and_argument_select_producer(monkeypatch):
    from cute_kernels.attention import launch

    monkeypatch.setenv(launch.BL_STORE_ENV, "producer")
    assert launch.bl_store_mode(_cfg()) == "producer"
    # An explicit argument wins over the environment.
    assert launch.bl_store_mode(_cfg(), "consumer") == "consumer"
    # Where the variant changes nothing it is not requested: no block_logit, or not SM90.
    assert launch.bl_store_mode(_cfg(block_size=0)) == "consumer"
    assert launch.bl_store_mode(_cfg(arch=100)) == "consumer"


def test_bad_mode_rejected(monkeypatch):
    from cute_kernels.attention import launch

    monkeypatch.setenv(launch.BL_STORE_ENV, "warp0")
    with pytest.raises(ValueError, match="CUTE_KERNELS_SM90_BL_STORE"):
        launch.bl_store_mode(_cfg())
    from cute_kernels.attention.fwd_sm90 import FlashFwdSm90

    with pytest.raises(ValueError, match="bl_store"):
        FlashFwdSm90(_cfg(), bl_store="warp0")


def test_bl_store_is_part_of_the_compile_key():
    from cute_kernels.attention.launch import compile_fwd

    params = inspect.signature(compile_fwd.fn).parameters
    assert list(params) == ["cfg", "bl_store"] and params["bl_store"].default == "consumer"


def test_producer_smem_within_limit_for_every_config():
    from cute_kernels.attention.fwd_sm90 import SMEM_BYTES_MAX, FlashFwdSm90
    from cute_kernels.attention.launch import config_matrix

    for cfg in config_matrix(90, True):
        base = FlashFwdSm90.smem_bytes(cfg)
        prod = FlashFwdSm90.smem_bytes(cfg, bl_store="producer")
        assert prod <= SMEM_BYTES_MAX, cfg
        assert (prod > base) == cfg.has_block_logit


@pytest.mark.compile
def test_producer_variant_compiles_for_sm90(tmp_path):
    rows = run_check(tmp_path, "sm_90a", "attention_fwd_bl_producer", timeout=3600)
    from cute_kernels.attention.launch import config_matrix_bl_producer

    assert len(rows) == len(config_matrix_bl_producer(90, False))
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in rows)

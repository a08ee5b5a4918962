"""The selection kernels compile for sm_90a and sm_100a without a GPU (no spills), and their host
side picks configs as documented."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cute_kernels.select.blocks_to_indices import BlocksToIndices, BlocksToIndicesConfig
from cute_kernels.select.launch import topk_config, topk_unsupported_reason
from cute_kernels.select.topk_blocks import TopkBlocks, TopkBlocksConfig, nb_cap_for
from tests.conftest import ROOT
from tests.cpu._check_cli import run_check


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["select_topk_blocks", "blocks_to_indices"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_check_cli_compiles_select_kernels(arch, kernel, tmp_path):
    rows = run_check(tmp_path, arch, kernel, timeout=600)
    assert len(rows) >= 3
    assert all(r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_check_cli_full_matrix(arch, tmp_path):
    for kernel in ("select_topk_blocks", "blocks_to_indices"):
        run_check(tmp_path, arch, kernel, "--full", timeout=1800)


@pytest.mark.compile
def test_compile_cache_one_entry_per_config():
    """Same config -> one compile; another topk -> a second entry (subprocess: own CUTE_DSL_ARCH)."""
    code = (
        "from cute_kernels.select.launch import compile_topk_blocks as c\n"
        "from cute_kernels.select.topk_blocks import TopkBlocksConfig as C\n"
        "a = C(arch=90, group_size=2, nb_cap=128, topk=4)\n"
        "f1 = c(a); f2 = c(C(arch=90, group_size=2, nb_cap=128, topk=4)); f3 = c(C(arch=90, group_size=2, nb_cap=128, topk=5))\n"
        "assert f1 is f2 and f1 is not f3, 'cache'\n"
        "print(c.cache_info()['entries'])\n"
    )
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("2")


@pytest.mark.parametrize("nb,vec,cap", [(1, 1, 32), (33, 1, 64), (128, 4, 128), (129, 1, 256), (2048, 4, 2048),
                                        (500, 4, 512)])
def test_nb_cap(nb, vec, cap):
    assert nb_cap_for(nb, vec) == cap


def test_topk_config_vectorises_only_aligned_rows():
    assert topk_config(90, 32, 1, 512, 16, ptr=256).vec == 4
    assert topk_config(90, 32, 1, 510, 16, ptr=256).vec == 1  # rows not 16-byte aligned
    assert topk_config(90, 32, 1, 512, 16, ptr=4).vec == 1  # base pointer not 16-byte aligned
    cfg = topk_config(100, 32, 8, 1000, 64, ptr=0)
    assert (cfg.group_size, cfg.nb_cap, cfg.topk, cfg.arch) == (4, 1024, 64, 100)


def test_unsupported_cases_are_named():
    assert "nb = 4096" in topk_unsupported_reason(4096, 16)
    assert "topk = 65" in topk_unsupported_reason(64, 65)
    assert topk_unsupported_reason(2048, 64) is None
    with pytest.raises(ValueError, match="nb_cap"):
        TopkBlocks(TopkBlocksConfig(arch=90, group_size=1, nb_cap=4096, topk=4))
    with pytest.raises(ValueError, match="topk"):
        TopkBlocks(TopkBlocksConfig(arch=90, group_size=1, nb_cap=128, topk=0))
    with pytest.raises(ValueError, match="block_size"):
        BlocksToIndices(BlocksToIndicesConfig(arch=90, block_size=48, topk=4))


def test_registry_lists_select_kernels():
    from cute_kernels.registry import LAUNCH_MODULES

    assert "cute_kernels.select.launch" in LAUNCH_MODULES

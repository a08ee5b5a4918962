"""Every H2O kernel compiles for sm_90a and sm_100a without a GPU: no spills, shared memory in budget.

Runs ``python -m cute_kernels.check --arch <arch> --kernel h2o_*`` over the representative config
matrix in a subprocess (the DSL target is fixed per process); ``--full`` (every G, page size,
reduction and dtype) is under the slow marker. Also checks the launchers' host-side contracts.
"""

from __future__ import annotations

import pytest

from tests.cpu._check_cli import run_check

KERNELS = ("h2o_reset_scores", "h2o_update_page_summary", "h2o_page_scores", "h2o_token_accumulate",
           "h2o_token_page_scores", "h2o_select_pages")


def _check(tmp_path, arch, kernel, *extra):
    return run_check(tmp_path, arch, kernel, *extra)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_h2o_kernels_compile(tmp_path, arch, kernel):
    from cute_kernels.arch import parse_arch
    from cute_kernels.h2o.launch import CHECKS

    rows = _check(tmp_path, arch, kernel)
    assert len(rows) == len(CHECKS[kernel][0](parse_arch(arch), False))


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_h2o_kernels_compile_full_matrix(tmp_path, arch, kernel):
    _check(tmp_path, arch, kernel, "--full")


def test_check_registry_lists_h2o():
    from cute_kernels.registry import all_checks

    assert set(KERNELS) <= set(all_checks())


def test_config_is_the_cache_key():
    """Equal configs hash equal (one compile); changing one field gives a different key."""
    from cute_kernels.h2o.token_accumulate import TokenConfig

    a, b = TokenConfig(arch=90), TokenConfig(arch=90)
    assert a == b and hash(a) == hash(b)
    assert TokenConfig(arch=90, page_size=1) != a and TokenConfig(arch=90, group=3) != a


def test_unsupported_configs_name_the_reason():
    from cute_kernels.h2o.page_scores import PageScoresConfig
    from cute_kernels.h2o.page_scores import unsupported_reason as page_reason
    from cute_kernels.h2o.token_accumulate import TokenConfig, unsupported_reason

    assert "head_dim 96" in unsupported_reason(TokenConfig(arch=90, head_dim=96))
    assert unsupported_reason(TokenConfig(arch=90, head_dim=64)) is None
    assert "state dtype" in unsupported_reason(TokenConfig(arch=90, state_dtype="float16"))
    assert page_reason(PageScoresConfig(arch=90, head_dim=256, summary_dtype="bfloat16")) is None
    assert "head_dim 256" in page_reason(PageScoresConfig(arch=90, head_dim=256, summary_dtype="float32"))


def test_token_workspace_shapes_cover_the_table():
    from cute_kernels.h2o.token_accumulate import CHUNK, GQA_MAX, TokenConfig, workspace_shapes

    lg, st = workspace_shapes(3, TokenConfig(arch=90, page_size=16, group=5, gqa=GQA_MAX), max_pages=100)
    assert lg[:3] == (3, 8, 5) and lg[3] >= 1600 and lg[3] % CHUNK == 0
    assert st == (3, 8, 5, lg[3] // CHUNK, 2)

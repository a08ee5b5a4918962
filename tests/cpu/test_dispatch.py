"""The dispatch table by exact compute capability, on a machine without a GPU.

9.0 -> sm_90a, 10.0 -> sm_100a, 10.3 -> sm_103a; every other part has no build (``arch_reason``). A
config's ``arch`` is the exact CC and names its target; kernels pick their class by family. The SM100
forward takes its grid's SM count from the launching device and its exp2 policy from the target.
(The Paddle side of the table, auto / cute on each part, is in test_backend.py.)
"""

from __future__ import annotations

import types

import pytest

from cute_kernels import arch as arch_mod


def test_targets_and_families():
    assert arch_mod.TARGETS == {90: "sm_90a", 100: "sm_100a", 103: "sm_103a"}
    assert {cc: arch_mod.family(cc) for cc in arch_mod.TARGETS} == {90: 90, 100: 100, 103: 100}
    for cc in (80, 89, 101, 110, 120, 121):
        assert arch_mod.arch_reason(cc) is not None
        with pytest.raises(ValueError, match=f"compute capability {cc}"):
            arch_mod.arch_name(cc)


@pytest.mark.parametrize("cc", [90, 100, 103])
def test_every_check_matrix_keys_on_the_exact_cc(cc):
    """What check.py compiles for --arch sm_<cc>a carries that CC, so the target is the CC's own."""
    from cute_kernels.fake import arch_options
    from cute_kernels.registry import all_checks

    built = 0
    for name, (matrix, _, _) in all_checks().items():
        cfgs = matrix(cc, False)  # empty for a kernel without a version for this family
        assert all(c.arch == cc for c in cfgs), name
        built += bool(cfgs)
        assert not cfgs or f"--gpu-arch {arch_mod.TARGETS[cc]}" in arch_options(cfgs[0].arch)
    assert built >= 10


def test_check_cli_rejects_a_part_without_a_build():
    from cute_kernels.check import main

    with pytest.raises(SystemExit, match="compute capability 12.0"):
        main(["--arch", "sm_120a", "--kernel", "attention_fwd"])


class _Tensor(types.SimpleNamespace):
    """Shape and DLPack device of a CUDA tensor, all run_fwd reads before the launch."""

    def __dlpack_device__(self):
        return (2, self.device)


@pytest.mark.parametrize("cc,expected", [(100, 160), (103, 160), (90, None)])
def test_sm100_forward_grid_uses_the_devices_sm_count(monkeypatch, cc, expected):
    from cute_kernels.attention import launch

    seen = []
    monkeypatch.setattr(arch_mod, "device_sm_count", lambda index: {0: 132, 1: 160}[index])
    monkeypatch.setattr(launch, "_compile_fwd",
                        lambda cfg, sm_count, trace=False: seen.append(sm_count) or (lambda *a: None))
    cfg = launch.fwd_config(cc, "bfloat16", 128, 128, 1, True, False, False, 0, False)
    q = _Tensor(shape=(1, 256, 2, 128), device=1)
    launch.run_fwd(cfg, q, q, q, q, q, None, None, None, softmax_scale=0.1, softcap=0.0, window_left=-1,
                   window_right=-1, max_seqlen_q=256)
    assert seen == [expected]
    seen.clear()
    launch.compile_fwd(cfg)  # compile-only: the target's default count
    assert seen == [arch_mod.SM_COUNT_DEFAULT[cc] if expected else None]


@pytest.mark.parametrize("cc,emulated", [(100, True), (103, False)])
def test_exp2_emulation_follows_the_target(cc, emulated):
    """FA4 b36's rule: the FMA-pipe exp2 on 10.0, none on 10.3 (faster MUFU.EX2)."""
    from cute_kernels.attention.config import FwdConfig
    from cute_kernels.attention.fwd_sm100 import FlashFwdSm100

    assert arch_mod.exp2_emulation(cc) is emulated
    k = FlashFwdSm100(FwdConfig(cc, "bfloat16", 128, 128, 1, True, False, False, 0, False), sm_count=148)
    assert k.exp2_emulation is emulated

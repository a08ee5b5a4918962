"""The cute_kernels binding layer on a machine without a GPU: arch parsing, dtype names, the compile
cache, compile-only builds for sm_90a and sm_100a, and the check CLI's report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cute_kernels import arch as arch_mod
from cute_kernels.dtypes import dtype_name
from cute_kernels.jit_cache import jit_cache
from tests.conftest import ROOT
from tests.cpu._check_cli import run_check


@pytest.mark.parametrize("text,expected", [("sm_90a", 90), ("sm_100a", 100), ("90", 90), (100, 100), ("sm_100f", 100),
                                           ("sm_103a", 103)])
def test_parse_arch(text, expected):
    assert arch_mod.parse_arch(text) == expected


def test_parse_arch_rejects_garbage():
    with pytest.raises(ValueError, match="unknown arch"):
        arch_mod.parse_arch("hopper")


@pytest.mark.parametrize("cc,fam", [(90, 90), (100, 100), (103, 100), (110, 110), (80, 80), (120, 120)])
def test_family(cc, fam):
    """10.0 and 10.3 run the SM100 kernels (each from its own build); no other part maps onto a family."""
    assert arch_mod.family(cc) == fam


@pytest.mark.parametrize("cc,needle", [(90, None), (100, None), (103, None), (110, "compute capability 11.0"),
                                       (120, "consumer Blackwell"), (89, "built for 9.0 (sm_90a)")])
def test_arch_reason(cc, needle):
    reason = arch_mod.arch_reason(cc)
    assert (reason is None) if needle is None else (needle in reason)


def test_dtype_name_accepts_framework_dtypes():
    import numpy as np
    import paddle

    assert dtype_name(paddle.bfloat16) == "bfloat16"
    assert dtype_name(paddle.float32) == "float32"
    assert dtype_name(np.dtype("int32")) == "int32"
    assert dtype_name("bf16") == "bfloat16"


def test_jit_cache_keys_on_arguments():
    calls = []

    @jit_cache
    def build(cfg):
        calls.append(cfg)
        return object()

    a1, a2, b = build(("x", 1)), build(("x", 1)), build(("x", 2))
    assert a1 is a2 and a1 is not b
    assert calls == [("x", 1), ("x", 2)]
    assert build.cache_info()["entries"] == 2
    build.clear()
    assert build.cache_info()["entries"] == 0


def test_no_gpu_query_at_import():
    """Importing the kernel package must not need a driver (CI has none)."""
    code = "import cute_kernels, cute_kernels.arch, cute_kernels.registry, paddle_fa4; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_check_cli_reset_scores(arch, tmp_path):
    """python -m cute_kernels.check compiles reset_scores without a GPU and reports resources."""
    rows = run_check(tmp_path, arch, "h2o_reset_scores", timeout=600)
    assert rows and all(r["ok"] for r in rows)
    for r in rows:
        assert r["registers"] > 0 and r["spill_bytes"] == 0


def test_check_cli_unknown_kernel():
    out = subprocess.run([sys.executable, "-m", "cute_kernels.check", "--arch", "sm_90a", "--kernel", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "unknown kernel" in (out.stdout + out.stderr)


def test_parse_remarks():
    from cute_kernels.check import parse_remarks

    text = ("ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'\n"
            "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 1 barriers\n")
    (row,) = parse_remarks(text)
    assert row == {"function": "kern_a", "registers": 168, "stack_bytes": 8,
                   "spill_store_bytes": 4, "spill_load_bytes": 4}


def test_parse_remarks_when_ptxas_spills():
    """With spills the DSL re-wraps ptxas' output in a remark: the entry name moves to its own line,
    without the quotes on the first one. Parsing must still find the spill bytes."""
    from cute_kernels.check import parse_remarks

    text = ("remark[ptxas]: ptxas detected register spills\n"
            "          ptxas info    : Compiling entry function\n"
            "          'kernel_cutlass_kernel_x_0'\n"
            "          for 'sm_90a'\n"
            "          ptxas         .     64 bytes stack frame, 104 bytes spill stores, 72 bytes spill loads\n"
            "          ptxas info    : Used 255 registers, used 1 barriers, 64 bytes cumulative stack size\n")
    (row,) = parse_remarks(text)
    assert row == {"function": "kernel_cutlass_kernel_x_0", "registers": 255, "stack_bytes": 64,
                   "spill_store_bytes": 104, "spill_load_bytes": 72}


def test_device_queries_return_none_without_a_driver():
    """On a CPU-only machine the driver probes answer None instead of raising."""
    code = "from cute_kernels import arch; print(arch.device_arch(), arch.device_sm_count())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if "NVIDIA" not in os.environ.get("NVIDIA_VISIBLE_DEVICES", "") and not os.path.exists("/dev/nvidia0"):
        assert out.stdout.split() == ["None", "None"]


def test_kernel_arch_uses_the_given_arch_and_refuses_without_a_device():
    assert arch_mod.kernel_arch(90) == 90 and arch_mod.kernel_arch(100) == 100 and arch_mod.kernel_arch(103) == 103
    if arch_mod.device_arch() is None:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            arch_mod.kernel_arch(None)

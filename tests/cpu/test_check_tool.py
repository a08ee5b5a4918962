"""``cute_kernels.check``'s reading of ptxas remarks: the wgmma-serialization note fails a config.

The sample lines are ptxas output seen on 2026-12-02 (cu12 ptxas through cutlass-dsl 4.8.1): the first
from a block-sparse dK/dV variant that deferred its last wgmma wait (rejected for this reason), the
second the form ptxas uses for another cause."""

from __future__ import annotations

import pytest

from cute_kernels import check as C

SERIALIZED = (
    "remark[ptxas info]: ptxas output: ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async "
    "instructions are serialized due to insufficient register resources for the function 'kernel_abc'\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
EXTERN = ("ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
          "to the presence of Extern calls in the function 'kernel_abc'\n")
CLEAN = ("ptxas info    : Compiling entry function 'kernel_abc' for 'sm_90a'\n"
         "ptxas info    : Function properties for kernel_abc\n"
         "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
         "ptxas info    : Used 168 registers\n")


def test_serialized_wgmma_reasons():
    assert C.serialized_wgmma(SERIALIZED) == ["insufficient register resources"]
    assert C.serialized_wgmma(EXTERN) == ["the presence of Extern calls"]
    assert C.serialized_wgmma(SERIALIZED + EXTERN + SERIALIZED) == ["insufficient register resources",
                                                                   "the presence of Extern calls"]


def test_clean_output_has_none_and_still_parses():
    assert C.serialized_wgmma(CLEAN) == []
    fns = C.parse_remarks(CLEAN)
    assert [(f["function"], f["registers"], f["spill_store_bytes"]) for f in fns] == [("kernel_abc", 168, 0)]


def test_dsl_cuda_names_the_loaded_build(monkeypatch):
    """``dsl_cuda``: the CUDA major of the DSL build in use, read from its loaded module's file name (the check's
    summary line names it: spills differ between the cu12 and cu13 ptxas). A module named otherwise gives None."""
    import sys
    from types import SimpleNamespace

    pytest = __import__("pytest")
    pytest.importorskip("cutlass")
    import cutlass  # noqa: F401  (loads the build)

    assert C.dsl_cuda() in (12, 13)
    name = "cutlass._mlir._mlir_libs._cutlass_ir"
    monkeypatch.setitem(sys.modules, name, SimpleNamespace(__file__="/x/_cutlass_ir.cu13.cpython-311-x86_64-linux-gnu.so"))
    assert C.dsl_cuda() == 13
    monkeypatch.setitem(sys.modules, name, SimpleNamespace(__file__="/x/_cutlass_ir.so"))
    assert C.dsl_cuda() is None


def test_expected_dsl_build_is_enforced(monkeypatch, capsys):
    """``CUTE_KERNELS_CHECK_DSL_CUDA`` (``make check-cu13`` sets 13): a run whose DSL build differs fails even when
    every config compiled, so a CUDA 12 driver cannot turn that check into a second CUDA 12 one unnoticed."""
    monkeypatch.setattr(C, "check", lambda *a, **k: [{"ok": True}])
    monkeypatch.setattr(C, "dsl_cuda", lambda: 12)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_KERNELS_CHECK_DSL_CUDA", "13")
    assert C.main(["--arch", "sm_90a"]) == 1
    assert "expected the DSL's CUDA 13 build" in capsys.readouterr().out
    monkeypatch.setattr(C, "dsl_cuda", lambda: 13)
    assert C.main(["--arch", "sm_90a"]) == 0
    monkeypatch.delenv("CUTE_KERNELS_CHECK_DSL_CUDA")
    monkeypatch.setattr(C, "dsl_cuda", lambda: 12)
    assert C.main(["--arch", "sm_90a"]) == 0


def test_match_compiles_only_the_configs_that_contain_every_text(monkeypatch):
    """``--match TEXT`` (repeatable): only the configs whose repr contains every TEXT are compiled, in matrix order,
    before ``--limit``; a kernel none of whose configs match compiles nothing."""
    from cute_kernels import registry

    compiled = []
    matrix = lambda arch, full: [f"Cfg(d={d}, causal={c})" for d in (64, 96, 128) for c in (False, True)]  # noqa: E731
    checks = {"k1": (matrix, compiled.append, lambda cfg: None),
              "k2": (lambda arch, full: ["Other(x=1)"], compiled.append, lambda cfg: None)}
    monkeypatch.setattr(registry, "all_checks", lambda: checks)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_KERNELS_EXTRA_OPTS", "")
    rows = C.check("sm_90a", match=["causal=True"])
    assert compiled == ["Cfg(d=64, causal=True)", "Cfg(d=96, causal=True)", "Cfg(d=128, causal=True)"]
    assert [r["config"] for r in rows] == [repr(c) for c in compiled]
    compiled.clear()
    C.check("sm_90a", match=["d=96,", "causal=True"])
    assert compiled == ["Cfg(d=96, causal=True)"]
    compiled.clear()
    C.check("sm_90a", match=["causal=True"], limit=1)
    assert compiled == ["Cfg(d=64, causal=True)"]
    compiled.clear()
    C.main(["--arch", "sm_90a", "--match", "d=128,", "--match", "causal=False"])
    assert compiled == ["Cfg(d=128, causal=False)"]


def test_shard_splits_each_kernels_selection_once(monkeypatch):
    """``--shard K/N``: the N shards of a kernel's selection (after ``--match``) are disjoint and cover it once, in
    matrix order; a malformed shard is a usage error before anything compiles."""
    from cute_kernels import registry

    compiled = []
    matrix = lambda arch, full: [f"Cfg(i={i}, causal={i % 2 == 0})" for i in range(7)]  # noqa: E731
    monkeypatch.setattr(registry, "all_checks", lambda: {"k1": (matrix, compiled.append, lambda cfg: None)})
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_KERNELS_EXTRA_OPTS", "")
    seen = []
    for k in range(3):
        compiled.clear()
        C.check("sm_90a", shard=(k, 3))
        seen.append(list(compiled))
    assert seen[1] == ["Cfg(i=1, causal=False)", "Cfg(i=4, causal=True)"]
    assert sorted(sum(seen, [])) == sorted(matrix("sm_90a", False))
    compiled.clear()
    C.main(["--arch", "sm_90a", "--match", "causal=True", "--shard", "1/2"])
    assert compiled == ["Cfg(i=2, causal=True)", "Cfg(i=6, causal=True)"]
    for bad in ("2/2", "x", "1/0"):
        compiled.clear()
        with pytest.raises(SystemExit):
            C.main(["--arch", "sm_90a", "--shard", bad])
        assert compiled == []

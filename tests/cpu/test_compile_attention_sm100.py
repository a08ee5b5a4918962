"""The SM100 attention forward compiles for sm_100a without a GPU: 0 spills, smem within the limit.

Runs ``python -m cute_kernels.check --arch sm_100a --kernel attention_fwd`` (the representative
subset of the config matrix) in a subprocess; the whole matrix (``--full``) and the softcap
configs are under the slow marker. Also checks host-side facts of FlashFwdSm100 that need no
compile (argument order, unsupported cases, shared-memory plan, the exp2 polynomial).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.cpu._check_cli import run_check

SMEM_LIMIT = 232_448


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run_check(tmp_path, *extra):
    rows = run_check(tmp_path, "sm_100a", "attention_fwd", *extra, timeout=14400)
    assert all(r["smem_bytes"] <= SMEM_LIMIT for r in rows)
    return rows


@pytest.mark.compile
def test_attention_fwd_compiles_for_sm100(tmp_path):
    from cute_kernels.attention.launch import config_matrix

    rows = _run_check(tmp_path)
    assert len(rows) == len(config_matrix(100, False))


@pytest.mark.compile
@pytest.mark.slow
def test_attention_fwd_full_matrix_compiles_for_sm100(tmp_path):
    _run_check(tmp_path, "--full")


_SOFTCAP_SCRIPT = r"""
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
os.environ["CUTE_KERNELS_EXTRA_OPTS"] = "remarks{ptx}"
from cute_kernels.check import _capture_fd2, parse_remarks
from cute_kernels.attention.launch import compile_fwd, fwd_config
rows = []
for d, causal, window, bs, varlen in [(128, True, False, 64, False), (64, False, True, 16, True),
                                      (256, False, False, 256, False), (192, True, False, 32, True)]:
    cfg = fwd_config(100, "bfloat16", d, d, 2, causal, window, True, bs, varlen)
    with _capture_fd2() as box:
        compile_fwd(cfg)
    fns = parse_remarks(box["text"])
    rows.append({"config": repr(cfg), "remarks": len(fns),
                 "spill": sum(f["spill_store_bytes"] + f["spill_load_bytes"] for f in fns)})
print(json.dumps(rows))
"""


@pytest.mark.compile
@pytest.mark.slow
def test_softcap_configs_compile_for_sm100():
    """Softcap is outside the check matrix for sm_100a; its configs must compile spill-free too."""
    proc = subprocess.run([sys.executable, "-c", _SOFTCAP_SCRIPT], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["remarks"] >= 1 and r["spill"] == 0 for r in rows), rows


def test_fwd_args_order_matches_kernel_call():
    """FwdArgs is the one argument order: the SM100 kernel's __call__ takes exactly it, then stream (and the
    edge-trace address of a traced build)."""
    from cute_kernels.attention.config import FwdArgs
    from cute_kernels.attention.fwd_sm100 import FlashFwdSm100

    params = list(inspect.signature(FlashFwdSm100.__call__).parameters)
    from cute_kernels.attention.config import BOS_ARGS, FM_ARGS

    # trace_addr: the edge-trace build; then the FlashMask tensors, then block_bos's
    assert params == ["self", *FwdArgs._fields, "stream", "trace_addr", *FM_ARGS, *BOS_ARGS]


def test_unsupported_reasons_name_the_case():
    from cute_kernels.attention.launch import fwd_config, unsupported_reason

    def cfg(d=128, dv=None, bs=64):
        return fwd_config(100, "bfloat16", d, dv or d, 1, True, False, False, bs, False)

    assert unsupported_reason(cfg()) is None
    assert unsupported_reason(cfg(192, 128)) is None  # MLA-style prefill: Q / K 192, V / O 128
    assert "head_dim 96" in unsupported_reason(cfg(96))
    assert "head_dim_v 64 with head_dim 128" in unsupported_reason(cfg(128, 64))
    assert "head_dim_v 128 with head_dim 256" in unsupported_reason(cfg(256, 128))
    assert "block_size 48" in unsupported_reason(cfg(bs=48))


def test_constructor_is_host_only_and_rejects_bad_configs():
    """Building the kernel object touches no driver (compile-only machines) and validates the config."""
    from cute_kernels.attention.config import FwdConfig
    from cute_kernels.attention.fwd_sm100 import FlashFwdSm100

    k = FlashFwdSm100(FwdConfig(100, "bfloat16", 256, 256, 4, True, False, False, 256, True), sm_count=132)
    assert k.sm_count == 132 and k.q_stage == 1 and k.kv_stage >= 2
    with pytest.raises(ValueError, match="head_dim 80"):
        FlashFwdSm100(FwdConfig(100, "bfloat16", 80, 80, 1, False, False, False, 0, False))


def test_smem_and_tmem_plan_fits_every_config():
    """Every config of the full matrix fits 232,448 B of smem and 512 TMEM columns, with >= 2 K/V buffers."""
    from cute_kernels.attention import fwd_sm100 as m
    from cute_kernels.attention.launch import config_matrix, fwd_config

    mla = [fwd_config(100, dt, 192, 128, r, c, w, False, bs, vl) for dt in ("bfloat16", "float16")
           for r in (1, 4) for c, w in ((False, False), (True, False), (False, True)) for vl in (False, True)
           for bs in (0, 16, 256)]
    for cfg in config_matrix(100, True) + mla:
        k = m.FlashFwdSm100(cfg)
        assert m.FlashFwdSm100.smem_bytes(cfg) <= SMEM_LIMIT, cfg
        assert k.kv_stage >= 2, cfg
        assert k.q_stage * (m.TILE_N + cfg.head_dim_v) <= 512, cfg
        assert k.tmem_o_offset[-1] + cfg.head_dim_v <= k.tmem_cols, cfg
        regs = k.role_regs()
        assert regs in (m.REGS[k.q_stage], m.REGS_BOS_FINE), cfg
        assert sum(regs) <= 4 * 128 and all(r % 8 == 0 and 24 <= r <= 256 for r in regs)


def test_arrival_table_matches_the_roles():
    """The counts FlashFwdSm100 initialises its barriers with (ARRIVALS, NAMED_THREADS) pass the shared
    check (common/barriers.py) against the role sizes, and the roles are the warps the kernel dispatches."""
    from cute_kernels.attention import fwd_sm100 as m
    from cute_kernels.common.barriers import ArrivalCountError, check_arrivals

    kw = dict(pipes=m.PIPES, barriers=m.BARRIERS, role_threads=m.ROLE_THREADS)
    check_arrivals(m.ARRIVALS, m.NAMED_THREADS, **kw)
    with pytest.raises(ArrivalCountError, match="pipeline s: .*256 softmax\\+correction"):
        check_arrivals(dict(m.ARRIVALS, s=(1, m.TILE_M)), m.NAMED_THREADS, **kw)
    with pytest.raises(ArrivalCountError, match="named barrier TmemFree"):
        check_arrivals(m.ARRIVALS, {m.FwdBarrier.TmemFree: 256}, **kw)
    assert m.ROLE_THREADS["softmax"] == 32 * len(m._WARPS_SOFTMAX[0]) == m.TILE_M
    assert m.ROLE_THREADS["correction"] == 32 * len(m._WARPS_CORRECTION) == 128
    assert set(m.ARRIVALS) == set(m.PIPES) and len(m._WARPS_SOFTMAX) * 4 + 4 + 4 == m.NUM_THREADS // 32
    # Note [scrubbed value tiles, SM100]: the vready / scrub edges a build adds, per Q-stage count
    for q_stage in (1, 2):
        pipes, arrivals = dict(m.PIPES, **m.scrub_pipes(q_stage)), dict(m.ARRIVALS, **m.scrub_arrivals(q_stage))
        kw = dict(pipes=pipes, barriers=m.BARRIERS, role_threads=m.ROLE_THREADS)
        check_arrivals(arrivals, m.NAMED_THREADS, **kw)
        assert arrivals["scrub"] == (64, 32 + q_stage * m.TILE_M) and arrivals["vready"] == (32, 64)
        with pytest.raises(ArrivalCountError, match="pipeline scrub"):
            check_arrivals(dict(arrivals, scrub=(64, 32 + (3 - q_stage) * m.TILE_M)), m.NAMED_THREADS, **kw)
    assert 32 * len(m._WARPS_SCRUB) == m.ROLE_THREADS["scrub"] and m._WARPS_SCRUB == (14, 15)


_WRONG_COUNT_SCRIPT = r"""
import os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
from cute_kernels.attention import fwd_sm100 as m
from cute_kernels.attention.launch import compile_fwd, fwd_config
from cute_kernels.common.barriers import ArrivalCountError
which = sys.argv[1]
# the kernel reads its counts from its class (FlashFwdSm100.ARRIVALS, the module's table unless a kernel built on
# it overrides them)
if which == "s":
    m.FlashFwdSm100.ARRIVALS = dict(m.ARRIVALS, s=(1, m.TILE_M))  # P ready / O rescaled without the correction WG
elif which == "stats":
    m.FlashFwdSm100.ARRIVALS = dict(m.ARRIVALS, stats=(2 * m.TILE_M, m.TILE_M))
else:
    m.NAMED_THREADS = {m.FwdBarrier.TmemFree: 2 * 128}
try:
    compile_fwd(fwd_config(100, "bfloat16", 128, 128, 1, True, False, False, 64, False))
except ArrivalCountError as exc:
    print("ArrivalCountError:", exc)
else:
    print("compiled")
"""


@pytest.mark.parametrize("which", ["s", "stats", "named"])
def test_wrong_arrival_count_fails_the_compile(which):
    """A deliberately wrong barrier count in the kernel stops the compile at trace time (before ptxas),
    naming the barrier, instead of hanging or racing on the GPU."""
    proc = subprocess.run([sys.executable, "-c", _WRONG_COUNT_SCRIPT, which], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    want = {"s": "pipeline s: arrival counts (1, 128)", "stats": "pipeline stats: arrival counts (256, 128)",
            "named": "named barrier TmemFree: 256 threads != 128"}[which]
    assert "ArrivalCountError: " + want in proc.stdout, proc.stdout[-2000:]


def test_exp2_polynomial_constants():
    """numpy replica of math_sm100.exp2_poly_x2: relative error < 1e-4 on [-126, 8], 0 below -127."""
    from cute_kernels.common.math_sm100 import _EXP2_POLY, _ROUND_MAGIC

    x = np.concatenate([np.linspace(-126.0, 8.0, 200001), [-0.0, 1e-7, 3.999999]]).astype(np.float32)
    xc = np.maximum(x, np.float32(-127.0))
    rounded = np.floor(xc.astype(np.float64)) + _ROUND_MAGIC  # the add.rm result
    frac = xc.astype(np.float64) - (rounded - _ROUND_MAGIC)
    c1, c2, c3 = _EXP2_POLY
    p = 1.0 + frac * (c1 + frac * (c2 + frac * c3))
    y = p * np.exp2(rounded - _ROUND_MAGIC)
    rel = np.abs(y / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 1e-4, rel.max()
    assert (frac >= 0).all() and (frac < 1).all()


def test_bos_fine_register_split_follows_target_and_build(monkeypatch):
    """d 256 softcap block_bos builds on 16-key blocks take REGS_BOS_FINE (the split their ptxas fits) on sm_100a
    under the DSL's CUDA 13 build and sm_103a under CUDA 12; every other config and pair keeps REGS[q_stage]."""
    from cute_kernels import arch as A
    from cute_kernels.attention import fwd_sm100 as m
    from cute_kernels.attention.launch import config_matrix

    for build in (12, 13):
        monkeypatch.setattr(A, "dsl_cuda", lambda build=build: build)
        for arch in (100, 103):
            cfgs = [c for c in config_matrix(arch, True) if c.block_bos]
            fine = [c for c in cfgs if c.head_dim == 256 and c.has_softcap and c.block_size == 16]
            assert len(fine) == 2, fine  # causal, and the 4-column FlashMask line
            for cfg in cfgs:
                k = m.FlashFwdSm100(cfg)
                want = m.REGS_BOS_FINE if cfg in fine and (arch, build) in ((100, 13), (103, 12)) else m.REGS[k.q_stage]
                assert k.role_regs() == want, (build, cfg)

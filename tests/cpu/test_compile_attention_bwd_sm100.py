"""The SM100 attention backward main kernel compiles for sm_100a without a GPU: 0 spills, smem and TMEM
within the limits; host-side facts of FlashBwdSm100 (argument order, unsupported cases, the pipeline
arrival-count check) need no compile.

``python -m cute_kernels.check --arch sm_100a --kernel attention_bwd`` compiles the representative subset
of ``bwd_launch.config_matrix(100)`` (the configs the SM100 kernel supports); ``_EXTRA`` adds the feature
combinations that subset lacks (softcap with GQA and masks, deterministic varlen window, fp16 d 96) and
the whole matrix (``--full``) is under the slow marker.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.cpu._check_cli import run_check

SMEM_LIMIT = 232_448


@pytest.mark.compile
def test_attention_bwd_compiles_for_sm100(tmp_path):
    from cute_kernels.attention.bwd_launch import config_matrix

    rows = run_check(tmp_path, "sm_100a", "attention_bwd", timeout=7200)
    assert len(rows) == len(config_matrix(100, False)) >= 4
    assert all(r["smem_bytes"] <= SMEM_LIMIT for r in rows)


@pytest.mark.compile
@pytest.mark.slow
def test_attention_bwd_full_matrix_compiles_for_sm100(tmp_path):
    rows = run_check(tmp_path, "sm_100a", "attention_bwd", "--full", timeout=14400)
    assert all(r["smem_bytes"] <= SMEM_LIMIT for r in rows)


# (dtype, d or [d, dv], qhead_per_kvhead, causal, window, softcap, varlen, deterministic, spt)
_EXTRA = [("bfloat16", 256, 8, True, False, True, True, True, False),
          ("float16", 192, 4, False, True, True, False, True, False),
          ("bfloat16", [192, 128], 8, True, False, True, True, True, False),
          ("bfloat16", 256, 4, True, False, False, False, True, True),
          ("bfloat16", 192, 1, True, False, False, True, True, True),
          ("bfloat16", 128, 8, True, True, True, False, False, False),
          ("bfloat16", 64, 8, True, True, True, True, True, False),
          ("float16", 96, 1, False, True, True, True, True, False),
          ("bfloat16", 128, 1, False, False, False, False, False, False),
          ("bfloat16", 128, 4, True, False, False, True, True, True)]

_EXTRA_SCRIPT = r"""
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
os.environ["CUTE_KERNELS_EXTRA_OPTS"] = "remarks{ptx}"
from cute_kernels.check import _capture_fd2, parse_remarks
import cutlass.cute as cute
from cute_kernels.fake import arch_options, fake_stream
from cute_kernels.attention.bwd_launch import bwd_config, compile_bwd_main, fake_bwd_args
from cute_kernels.attention.bwd_sm100 import FlashBwdSm100
rows = []
for dt, d, g, causal, window, softcap, varlen, det, spt in json.loads(sys.argv[1]):
    d, dv = d if isinstance(d, list) else (d, d)
    cfg = bwd_config(100, dt, d, dv, g, causal, window, softcap, varlen, det)
    with _capture_fd2() as box:
        if spt:  # opt-in descending deterministic order (not reachable through the launcher)
            kernel = FlashBwdSm100(cfg, spt=True)
            assert kernel.spt
            cute.compile(kernel, *fake_bwd_args(cfg), fake_stream(), options=arch_options(100))
        else:
            compile_bwd_main(cfg)
    fns = parse_remarks(box["text"])
    rows.append({"config": repr(cfg), "remarks": len(fns), "registers": [f["registers"] for f in fns],
                 "spill": sum(f["spill_store_bytes"] + f["spill_load_bytes"] for f in fns)})
print(json.dumps(rows))
"""


@pytest.mark.compile
def test_feature_combinations_compile_for_sm100():
    """softcap x GQA x masks, deterministic varlen window, the wide schedule with softcap / varlen /
    deterministic (d 192, 256, (192, 128)) and the opt-in descending deterministic order (outside the
    check subset) compile spill-free."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, "-c", _EXTRA_SCRIPT, json.dumps(_EXTRA)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == len(_EXTRA)
    assert all(r["remarks"] == 1 and r["spill"] == 0 for r in rows), rows


def test_kernel_call_takes_bwd_kernel_args():
    """BwdKernelArgs is the one argument order: __call__ takes exactly it, then stream."""
    from cute_kernels.attention.bwd_config import BwdKernelArgs
    from cute_kernels.attention.bwd_sm100 import FlashBwdSm100

    params = list(inspect.signature(FlashBwdSm100.__call__).parameters)
    from cute_kernels.attention.bwd_config import BWD_FM_ARGS

    # trace_addr: the edge-trace build; then the FlashMask tensors
    assert params == ["self", *BwdKernelArgs._fields, "stream", "trace_addr", *BWD_FM_ARGS]


def _cfg(d=128, dv=None, **kw):
    from cute_kernels.attention.bwd_config import BwdConfig

    args = dict(arch=100, dtype="bfloat16", head_dim=d, head_dim_v=dv or d, qhead_per_kvhead=1, causal=False,
                has_window=False, has_softcap=False, varlen=False, deterministic=False)
    args.update(kw)
    return BwdConfig(**args)


def test_unsupported_reasons_name_the_case():
    from cute_kernels.attention.bwd_launch import unsupported_reason
    from cute_kernels.attention.bwd_sm100 import FlashBwdSm100

    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)):
        assert unsupported_reason(_cfg(d, dv)) is None
        assert unsupported_reason(_cfg(d, dv, qhead_per_kvhead=8, causal=True, has_softcap=True, varlen=True,
                                       deterministic=True)) is None
    for d, dv in ((256, 128), (128, 64), (160, 160)):
        assert f"head_dim {d} / head_dim_v {dv}" in unsupported_reason(_cfg(d, dv))
    assert "float32" in unsupported_reason(_cfg(dtype="float32"))
    assert "arch 90" in FlashBwdSm100.unsupported_reason(_cfg(arch=90))
    with pytest.raises(ValueError, match="head_dim 256 / head_dim_v 128"):
        FlashBwdSm100(_cfg(256, 128))


def _spans_disjoint(spans):
    spans = sorted(spans)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_smem_and_tmem_plan_fits_every_config():
    """Every supported config of the full matrix: smem <= 232,448 B, TMEM map inside 512 columns
    (S^T, dP^T, dV, dK disjoint; the narrow dQ inside the dP^T columns it reuses), register split within
    64K registers; the wide schedule (Note [SM100 wide schedule]) below."""
    from cute_kernels.attention import bwd_sm100 as m
    from cute_kernels.attention.bwd_launch import config_matrix

    cfgs = config_matrix(100, True)
    assert {(c.head_dim, c.head_dim_v) for c in cfgs} == {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256),
                                                          (192, 128)}
    for cfg in cfgs:
        k = m.FlashBwdSm100(cfg)
        assert m.FlashBwdSm100.smem_bytes(cfg) <= SMEM_LIMIT, cfg
        t, tm = k.tmem, k.tile_m
        spans = [(t["S"], t["S"] + tm), (t["dP"], t["dP"] + tm), (t["dV"], t["dV"] + k.dv_cols),
                 (t["dK"], t["dK"] + k.dk_cols)]
        assert t["end"] <= m.TMEM_COLS and _spans_disjoint(spans), (cfg, t)
        if not k.wide:
            assert tm == m.TILE_M and k.n_split == 1 and t["dQ"] + cfg.head_dim <= t["dP"] + m.TILE_M, t
    r, c, o = m.REGS
    assert r + 2 * c + o <= 4 * 128 and all(x % 8 == 0 and 24 <= x <= 256 for x in m.REGS)
    # dO: two stages where they fit beside the dQ staging (d 64, 96), one at d 128 (231,424 B)
    assert [m.FlashBwdSm100(_cfg(d)).do_stage for d in (64, 96, 128)] == [2, 2, 1]


@pytest.mark.parametrize("d, dv", [(192, 192), (256, 256), (192, 128)])
def test_wide_schedule_plan(d, dv):
    """Wide schedule: the dQ^T chunks' new lanes cover each CTA's head-dim slice exactly once, a chunk
    lies in free columns or over dP^T / S^T only (never over dV / dK or another chunk), the serial order
    is chosen exactly when a chunk is over S^T or Q has one stage, and the K^T / Q^T / dO^T views start
    on whole swizzle repeats (checked again at trace time by check_operand_aliases)."""
    from cute_kernels.attention import bwd_sm100 as m

    k = m.FlashBwdSm100(_cfg(d, dv))
    t, tm = k.tmem, k.tile_m
    assert k.wide and tm == m.TILE_M_WIDE and k.n_split == (2 if d == 256 else 1)
    assert k.dk_cols * k.n_split == d and k.dv_cols * k.n_split == dv
    dims = []
    for first, lane_lo, col in k.dq_chunks:
        assert first + m.MMA_M <= k.dk_cols and lane_lo % m.DQT_BOX == 0 and col % tm == 0
        dims += [first + lane for lane in range(lane_lo, m.MMA_M)]
    assert sorted(dims) == list(range(k.dk_cols))  # every head dim of the slice reduced once
    accs = [(t["dV"], t["dV"] + k.dv_cols), (t["dK"], t["dK"] + k.dk_cols)]
    chunks = [(col, col + tm) for _, _, col in k.dq_chunks]
    assert _spans_disjoint(accs + chunks) and all(b <= m.TMEM_COLS for _, b in chunks)
    over_s = any(col == t["S"] for _, _, col in k.dq_chunks)
    assert k.serial == (over_s or k.q_stage == 1)
    expect = {(192, 192): (2, 2, True), (256, 256): (1, 1, True), (192, 128): (2, 2, False)}[(d, dv)]
    assert (k.q_stage, k.do_stage, k.serial) == expect
    assert m.FlashBwdSm100.smem_bytes(_cfg(d, dv)) <= SMEM_LIMIT
    assert m.DQ_SEM_ROWS == tm and (len(k.dq_chunks) * tm // m.DQT_ROWS) % m.DQ_STAGES == 0


def test_arrival_check_rejects_wrong_counts():
    """check_arrivals (run at trace time) accepts the kernel's own counts and fails on a wrong one."""
    from cute_kernels.attention import bwd_sm100 as m

    rt = m.ROLE_THREADS

    def threads(roles):
        return sum(rt[r] for r in ((roles,) if isinstance(roles, str) else roles))

    good = {name: (threads(p), threads(c)) for name, (p, c) in {**m.PIPES, **m.SCRUB_PIPES}.items()}
    bars = {b: sum(rt[r] for r in roles) for b, roles in m.BARRIERS.items()}
    m.check_arrivals(good, bars)
    bad = dict(good, dS=(128, 1))  # one compute warpgroup instead of two
    with pytest.raises(ValueError, match="pipeline dS"):
        m.check_arrivals(bad, bars)
    # Note [scrubbed K / V, SM100]: the scrub warps hand K / V to the MMA warp's 32 threads and the compute warps
    assert good["kvs"] == (64, 32 + 256)
    with pytest.raises(ValueError, match="pipeline kvs"):
        m.check_arrivals(dict(good, kvs=(64, 256)), bars)  # the MMA warp's arrivals forgotten
    with pytest.raises(ValueError, match="pipeline kvs"):
        m.check_arrivals({k: v for k, v in good.items() if k != "kvs"}, bars)  # an unchecked edge
    with pytest.raises(ValueError, match="TmemFree"):
        m.check_arrivals(good, {**bars, m.BwdBarrier.TmemFree: 256})
    assert rt["compute"] == 32 * len(m._WARPS_COMPUTE) == 256 and rt["reduce"] == 128
    assert m.NUM_THREADS == 32 * 16


def test_smem_plan_check_rejects_an_overflow():
    """check_smem_plan (run at trace time on the real SharedStorage size) passes the kernel's own plan
    and fails when the storage outgrows it or the plan outgrows the arch."""
    from cute_kernels.attention import bwd_sm100 as m

    plan = m.FlashBwdSm100.smem_bytes(_cfg(128))
    m.check_smem_plan(plan - 1024, plan)
    with pytest.raises(ValueError, match="exceeds the plan"):
        m.check_smem_plan(plan - 1023, plan)
    with pytest.raises(ValueError, match="limit"):
        m.check_smem_plan(1000, m.SMEM_BYTES_MAX_SM100 + 1)

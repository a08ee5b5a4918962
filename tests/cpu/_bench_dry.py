"""Run one bench script's main() without a GPU (``python tests/cpu/_bench_dry.py SCRIPT ARGS...``).

torch, FA4 and the GPU launchers are stand-ins (MagicMock) and the timer returns fixed per-repetition
samples, so what runs is the scripts' own plumbing: argument flow into the callables, row building,
per-round ratios, markdown and JSON. Used by tests/cpu/test_bench_scripts.py in a subprocess (the
fake ``torch`` module must never reach the pytest process).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

CALLS = []  # (variant name, window index) in the order the timer saw them


def _install_fakes():
    torch = mock.MagicMock(name="torch")
    torch.cuda.get_device_capability.return_value = (9, 0)
    torch.cuda.get_device_name.return_value = "FakeGPU"
    sys.modules["torch"] = torch
    fli = types.ModuleType("flash_attn.cute.interface")
    fli.flash_attn_func = mock.MagicMock(name="fa4")
    fli._flash_attn_fwd = mock.MagicMock(name="fa4_fwd", return_value=(mock.MagicMock(),) * 5)
    fli._flash_attn_bwd = mock.MagicMock(name="fa4_bwd")
    sys.modules.update({"flash_attn": types.ModuleType("flash_attn"),
                        "flash_attn.cute": types.ModuleType("flash_attn.cute"),
                        "flash_attn.cute.interface": fli})
    return torch


class FakeTimer:
    """Calls each variant once per window; its samples depend on the name and the round, so the
    per-round ratios differ from the ratio of medians."""

    capture_errors: dict = {}

    def __init__(self, **kw):
        self.count = {}

    def window(self, name, fn):
        fn()
        i = self.count.get(name, 0)
        self.count[name] = i + 1
        CALLS.append((name, i))
        base = 1.0 + 0.25 * (sum(map(ord, name)) % 4)
        return [base * (1.0 + 0.1 * i), base * (1.0 + 0.1 * i) + 0.01]


class Mat:
    """Stands in for a tensor where a script compares or indexes (composite vs kernel ids)."""

    def __getitem__(self, i):
        return self

    def __ne__(self, other):
        m = mock.MagicMock()
        m.any.return_value.sum.return_value = 0
        return m


def main(name: str, argv: list) -> int:
    torch = _install_fakes()
    import _timing

    _timing.timer_from_args = lambda args, torch_mod=None: FakeTimer()
    _timing.host_us_per_call = lambda fn, n=100, **kw: (fn(), 12.5)[1]
    _timing.CudaTimer = FakeTimer
    mod = importlib.import_module(name)
    for attr in ("timer_from_args", "host_us_per_call", "CudaTimer"):
        if hasattr(mod, attr):
            setattr(mod, attr, getattr(_timing, attr))
    if name == "bench_fwd":
        import cute_kernels.attention.launch as L

        L.compile_fwd = mock.MagicMock()
        L.run_fwd = mock.MagicMock()
        mod.block_max_torch = mock.MagicMock()
    elif name == "bench_flashmask":
        import cute_kernels.attention.bwd_launch as BL
        import cute_kernels.attention.launch as L

        L.compile_fwd = mock.MagicMock()
        L.run_fwd = mock.MagicMock()
        BL.compile_bwd = mock.MagicMock()
        BL.run_bwd = mock.MagicMock()
    elif name == "bench_bwd":
        import cute_kernels.attention.bwd_launch as BL

        BL.run_bwd = mock.MagicMock()
        BL.unsupported_reason = lambda cfg: None  # the stand-in torch dtype is no real dtype name
        sys.modules["flash_attn.cute.interface"].flash_attn_func.return_value = (mock.MagicMock(), mock.MagicMock())
    elif name == "bench_layer":
        import cute_kernels.attention.bwd_launch as BL
        import cute_kernels.attention.launch as L

        L.run_fwd = mock.MagicMock()
        BL.run_bwd = mock.MagicMock()
    elif name == "bench_indexed":
        import cute_kernels.indexed.launch as IL

        mod.prime_rl_indices_gpu = mock.MagicMock()
        mod.union_ratio_gpu = lambda *a: 2.0
        for f in ("run_plan", "run_fwd", "run_bwd_dq", "run_bwd_dkdv"):
            setattr(IL, f, mock.MagicMock())
        IL.attn_config = mock.MagicMock(return_value=types.SimpleNamespace(group=12))
        names = ("win_key", "win_mask", "win_count", "tile_bits", "tile_ptr", "tile_win", "tile_start")
        IL.plan_shapes = lambda *a: types.SimpleNamespace(_asdict=lambda: {n: 1 for n in names})
        mod.baseline_fwd_bwd = mock.MagicMock()
    elif name == "bench_select":
        import cute_kernels.attention.launch as L
        import cute_kernels.select.launch as SL

        SL.run_select_topk_blocks = mock.MagicMock()
        SL.run_blocks_to_indices = mock.MagicMock()
        L.run_fwd = mock.MagicMock()
        mod.causal_inputs = lambda s, h, bs, gen: (
            mock.MagicMock(numel=lambda: s * h * (s // bs), shape=(1, h, s, s // bs)), mock.MagicMock())
        mod.composite = lambda *a: Mat()
        orig = mod.selection_fns

        def selection_fns(*a):
            fns, bl, lse, _ = orig(*a)
            return fns, bl, lse, Mat()

        mod.selection_fns = selection_fns
    elif name == "bench_block_sparse":
        import cute_kernels.block_sparse.launch as BSL
        import cute_kernels.indexed.launch as IL
        import cute_kernels.select.launch as SL
        from tests.oracles import block_sparse as orc

        mod.selection = lambda torch_, seqlen, kind, seed=0: (mock.MagicMock(), mock.MagicMock())
        plan_names = ("tile_start", "tile_mask", "tile_count", "q_limit", "key_start", "key_end", "key_count",
                      "key_ptr", "key_tile", "key_slot", "key_order")
        orc.plan_arrays = lambda *a, **k: {n: mock.MagicMock() for n in plan_names}
        for f in ("run_fwd", "run_bwd_dq", "run_bwd_dkdv", "fwd_config", "bwd_config"):
            setattr(BSL, f, mock.MagicMock(name=f))
        BSL.dkdv_workspace_shapes = lambda *a: {"dk_part": ([1], "float32", False),
                                                "dv_part": ([1], "float32", False), "seg_sem": ([1], "int32", True)}
        for f in ("run_plan", "run_fwd", "run_bwd"):
            setattr(IL, f, mock.MagicMock(name=f))
        IL.attn_config = mock.MagicMock(return_value=types.SimpleNamespace(group=8))
        names = ("win_key", "win_mask", "win_count", "tile_bits", "tile_ptr", "tile_win", "tile_start")
        IL.plan_shapes = lambda *a: types.SimpleNamespace(_asdict=lambda: {n: 1 for n in names})
        SL.run_blocks_to_indices = mock.MagicMock()
    elif name == "bench_h2o":
        def fake_op(*a):
            return mock.MagicMock(), mock.MagicMock(), 1 << 20

        mod.plan = lambda quick: [("page_scores", fake_op, (1, 4096)), ("select_pages", fake_op, (16, 32768))]
        mod._imports = lambda: None
        mod.torch = torch
        mod.L = mock.MagicMock()
    rc = mod.main(argv)
    print("WINDOWS", ",".join(f"{n}:{i}" for n, i in CALLS))
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))

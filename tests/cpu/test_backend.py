"""Backend resolution of flash_attn_fwd / indexed_attention and their CuTe glue, driven on the CPU.

A GPU place is simulated by patching ``backend.tensor_arch``; the kernel launchers are replaced by
recording fakes, so the glue's translation of a spec into launcher arguments is checked here and
the real launchers are exercised by tests/gpu.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import backend as backend_mod
from paddle_fa4 import indexed as indexed_mod
from paddle_fa4._cute import attention as glue
from paddle_fa4.attention import _validate as validate_fwd


def t(shape, dtype="float32"):
    return paddle.to_tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(backend_mod, "_warned", set())


def test_auto_on_cpu_warns_once_and_runs_reference(fresh_warnings):
    q = t([1, 4, 2, 16])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_fa4.flash_attn_fwd(q, q, q)
        paddle_fa4.flash_attn_fwd(q, q, q)
    msgs = [str(w.message) for w in caught if "reference backend" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith("flash_attn_fwd: using the reference backend")
    assert caught[0].filename == __file__  # points at the caller


def test_auto_indexed_on_cpu_warns_once(fresh_warnings):
    q, idx = t([1, 3, 2, 8]), paddle.zeros([1, 3, 2], dtype="int32")
    with pytest.warns(UserWarning, match="indexed_attention: using the reference backend"):
        paddle_fa4.indexed_attention(q, q, q, idx)


def test_cute_on_cpu_raises():
    q = t([1, 4, 2, 16], "bfloat16")
    with pytest.raises(NotImplementedError, match="flash_attn_fwd: backend='cute' is not available: .*CUDA place"):
        paddle_fa4.flash_attn_fwd(q, q, q, backend="cute")
    with pytest.raises(NotImplementedError, match="indexed_attention: backend='cute' is not available"):
        paddle_fa4.indexed_attention(q, q, q, paddle.zeros([1, 4, 1], dtype="int32"), backend="cute")


@pytest.mark.parametrize("bad", ["Auto", "cuda", "", None])
def test_bad_backend_string(bad):
    q = t([1, 4, 2, 16])
    with pytest.raises(ValueError, match="flash_attn_fwd: backend must be one of"):
        paddle_fa4.flash_attn_fwd(q, q, q, backend=bad)


# ---------------------------------------------------------------------------------------------
# flash_attn_fwd CuTe glue


def spec_for(q, k, v, causal=False, window=(None, None), softcap=0.0, block_size=64, return_block_logit=False,
             **varlen):
    return validate_fwd(q, k, v, None, causal, window, softcap, varlen.get("cu_q"), varlen.get("cu_k"),
                        varlen.get("max_q"), varlen.get("max_k"), None, block_size, return_block_logit, None)


class FakeLaunch(types.SimpleNamespace):
    """Stands in for cute_kernels.attention.launch: records calls, fills outputs with markers."""

    def __init__(self, reason=None):
        super().__init__(configs=[], runs=[], reason=reason)

    def fwd_config(self, **kw):
        self.configs.append(kw)
        return ("cfg", tuple(sorted(kw.items())))

    def unsupported_reason(self, cfg):
        return self.reason

    def run_fwd(self, cfg, q, k, v, out, lse, block_logit, cu_q, cu_k, **kw):
        self.runs.append(dict(cfg=cfg, tensors=(q, k, v, out, lse, block_logit, cu_q, cu_k), **kw))
        paddle.assign(paddle.full(out.shape, 7.0).astype(out.dtype), out)
        paddle.assign(paddle.full(lse.shape, 3.0), lse)
        if block_logit is not None:
            paddle.assign(paddle.full(block_logit.shape, 5.0), block_logit)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend every tensor is on an SM90 GPU and the attention launcher is the fake."""
    fake = FakeLaunch()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(glue, "_launch", lambda: fake)
    return fake


def test_unsupported_reasons_without_launcher(monkeypatch):
    monkeypatch.setattr(glue, "_launch", lambda: None)
    q = t([1, 4, 2, 64], "bfloat16")
    assert "float32" in glue.unsupported_reason(90, spec_for(*(t([1, 4, 2, 64]),) * 3))
    assert "head_dim 80" in glue.unsupported_reason(90, spec_for(*(t([1, 4, 2, 80], "bfloat16"),) * 3))
    v = t([1, 4, 2, 64], "bfloat16")
    assert "head_dim 128 / head_dim_v 64" in glue.unsupported_reason(
        90, spec_for(t([1, 4, 2, 128], "bfloat16"), t([1, 4, 2, 128], "bfloat16"), v))
    assert "is missing" in glue.unsupported_reason(90, spec_for(q, q, q))


def test_launcher_reason_is_passed_on(fake_gpu):
    fake_gpu.reason = "no kernel for block_size 256 on sm_90a"
    q = t([1, 4, 2, 64], "bfloat16")
    with pytest.raises(NotImplementedError, match="no kernel for block_size 256 on sm_90a"):
        paddle_fa4.flash_attn_fwd(q, q, q, block_size=256, return_block_logit=True, backend="cute")


def test_cute_call_translates_spec(fake_gpu):
    q, k = t([2, 8, 4, 128], "bfloat16"), t([2, 12, 2, 128], "bfloat16")
    q.stop_gradient = False
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, k, causal=True, window_size=(5, None), softcap=3.0,
                                             softmax_scale=0.1, block_size=32, return_block_logit=True,
                                             backend="auto")
    cfg = fake_gpu.configs[-1]
    assert cfg == dict(arch=90, dtype="bfloat16", head_dim=128, head_dim_v=128, qhead_per_kvhead=2, causal=True,
                       has_window=True, has_softcap=True, block_size=32, varlen=False, startend="",
                       block_bos=False)
    run = fake_gpu.runs[-1]
    assert (run["softmax_scale"], run["softcap"]) == (pytest.approx(0.1), 3.0)
    assert (run["window_left"], run["window_right"], run["max_seqlen_q"]) == (5, 0, 8)
    tq, tk, tv, tout, tlse, tbl, cu_q, cu_k = run["tensors"]
    assert tq.stop_gradient and tq.data_ptr() == q.data_ptr()  # detached view, same storage
    assert tout.data_ptr() == out.data_ptr() and tlse.data_ptr() == lse.data_ptr()
    assert tbl.data_ptr() == bl.data_ptr() and cu_q is None and cu_k is None
    assert out.shape == [2, 8, 4, 128] and out.dtype == paddle.bfloat16 and float(out[0, 0, 0, 0]) == 7.0
    assert float(lse.max()) == 3.0 and float(bl.min()) == 5.0


def test_cute_call_without_block_logit_and_unbounded_window(fake_gpu):
    q = t([1, 8, 2, 64], "float16")
    out, lse = paddle_fa4.flash_attn_fwd(q, q, q, backend="cute")
    cfg, run = fake_gpu.configs[-1], fake_gpu.runs[-1]
    assert cfg["block_size"] == 0 and not cfg["causal"] and not cfg["has_window"] and not cfg["has_softcap"]
    assert (run["window_left"], run["window_right"]) == (-1, -1) and run["tensors"][5] is None
    assert run["softmax_scale"] == pytest.approx(64 ** -0.5)


def test_cute_varlen_call(fake_gpu):
    q, k = t([9, 4, 64], "bfloat16"), t([12, 2, 64], "bfloat16")
    cu_q, cu_k = paddle.to_tensor([0, 4, 9], dtype="int32"), paddle.to_tensor([0, 5, 12], dtype="int32")
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                             max_seqlen_k=7, block_size=16, return_block_logit=True,
                                             backend="cute")
    cfg, run = fake_gpu.configs[-1], fake_gpu.runs[-1]
    assert cfg["varlen"] and run["max_seqlen_q"] == 5
    assert run["tensors"][6].data_ptr() == cu_q.data_ptr() and run["tensors"][7].data_ptr() == cu_k.data_ptr()
    assert bl.shape == [4, 9, 1]


def test_float32_auto_falls_back_to_reference(fake_gpu, fresh_warnings):
    q = t([1, 4, 2, 64])
    with pytest.warns(UserWarning, match="float32"):
        out, _ = paddle_fa4.flash_attn_fwd(q, q, q)
    assert not fake_gpu.runs and float(out.abs().max()) != 7.0


def test_cute_takes_strided_inputs_as_contiguous_copies(fake_gpu):
    q = t([1, 2, 8, 64], "bfloat16").transpose([0, 2, 1, 3])  # [1, 8, 2, 64] strided view
    k = t([1, 8, 2, 64], "bfloat16")  # (Paddle's Tensor.contiguous() makes its tensor contiguous in place)
    before = q.astype("float32").numpy()
    assert not q.is_contiguous()
    out, _ = paddle_fa4.flash_attn_fwd(q, k, k, backend="cute")
    tq = fake_gpu.runs[-1]["tensors"][0]
    assert tq.is_contiguous() and tq.data_ptr() != q.data_ptr()
    np.testing.assert_array_equal(tq.astype("float32").numpy(), before)
    assert not q.is_contiguous()  # the caller's view is left as it was (see tests/cpu/test_strided.py)
    assert float(out.astype("float32").abs().max()) == 7.0


# ---------------------------------------------------------------------------------------------
# indexed_attention CuTe glue (the same PyLayer as the reference)


class FakeIndexedGlue(types.SimpleNamespace):
    """Stands in for paddle_fa4._cute.indexed: the reference math, with the calls recorded."""

    def __init__(self):
        super().__init__(calls=[])

    def unsupported_reason(self, arch, spec):
        return None

    def forward(self, spec, q, k, v, indices, plan):
        from paddle_fa4.reference import indexed as ref

        self.calls.append(("forward", spec, plan))
        out, lse, _ = ref.forward(spec, q, k, v, indices, None)
        self.indices = indices
        return out, lse, "built-plan" if plan is None else plan

    def backward(self, spec, q, k, v, out, lse, dout, plan):
        from paddle_fa4.reference import indexed as ref

        self.calls.append(("backward", spec, plan))
        return ref.backward(spec, q, k, v, out, lse, dout, self.indices)


def test_indexed_cute_path_goes_through_pylayer(monkeypatch):
    fake = FakeIndexedGlue()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(indexed_mod, "_glue", lambda: fake)
    q, k = t([1, 5, 4, 16], "bfloat16"), t([1, 7, 2, 16], "bfloat16")
    q.stop_gradient = False
    idx = paddle.to_tensor(np.array([[[0, 1], [2, -1], [6, 6], [-1, -1], [3, 4]]], dtype=np.int32))
    out = paddle_fa4.indexed_attention(q, k, k, idx, backend="cute")
    out.astype("float32").sum().backward()
    assert [c[0] for c in fake.calls] == ["forward", "backward"]
    assert fake.calls[0][2] is None and fake.calls[1][2] == "built-plan"  # the plan is kept for backward
    assert q.grad is not None and k.stop_gradient
    ref_out = paddle_fa4.indexed_attention(q, k, k, idx, backend="reference")
    np.testing.assert_array_equal(out.astype("float32").numpy(), ref_out.astype("float32").numpy())


def test_indexed_auto_without_glue_uses_reference(monkeypatch, fresh_warnings):
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(indexed_mod, "_glue", lambda: None)
    q = t([1, 3, 2, 64], "bfloat16")
    with pytest.warns(UserWarning, match="paddle_fa4._cute.indexed is missing"):
        paddle_fa4.indexed_attention(q, q, q, paddle.zeros([1, 3, 2], dtype="int32"))


def test_indexed_zero_width_never_launches(monkeypatch):
    """W = 0 (no index at all) returns zeros / -inf and zero grads without calling the kernels."""
    fake = FakeIndexedGlue()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(indexed_mod, "_glue", lambda: fake)
    q = t([1, 3, 2, 64], "bfloat16")
    q.stop_gradient = False
    out, lse = paddle_fa4.indexed_attention(q, q, q, paddle.zeros([1, 3, 0], dtype="int32"), return_lse=True,
                                            backend="cute")
    out.astype("float32").sum().backward()
    assert not fake.calls
    assert float(out.astype("float32").abs().max()) == 0.0 and np.all(np.isneginf(lse.numpy()))
    assert float(q.grad.astype("float32").abs().max()) == 0.0


def test_glue_matches_the_real_launcher_contract():
    """The glue's fwd_config keywords are the ones cute_kernels.attention.launch takes (no GPU needed)."""
    launch = pytest.importorskip("cute_kernels.attention.launch", reason="attention launcher not in this tree")
    q, k = t([1, 8, 4, 128], "bfloat16"), t([1, 8, 2, 128], "bfloat16")
    spec = spec_for(q, k, k, causal=True, window=(5, None), softcap=5.0, block_size=128, return_block_logit=True)
    cfg = glue.fwd_config(90, spec)
    assert isinstance(cfg, launch.FwdConfig)
    assert (cfg.arch, cfg.dtype, cfg.head_dim, cfg.head_dim_v, cfg.qhead_per_kvhead) == (90, "bfloat16", 128, 128, 2)
    assert (cfg.causal, cfg.has_window, cfg.has_softcap, cfg.block_size, cfg.varlen) == (True, True, True, 128, False)
    assert glue.unsupported_reason(90, spec) is None


def test_as_contiguous_never_relays_out_the_callers_tensor():
    """Paddle's Tensor.contiguous() works in place; the bridge must copy instead."""
    import paddle

    from paddle_fa4._bridge import as_contiguous

    x = paddle.randn([4, 6]).transpose([1, 0])
    strides = list(x.strides)
    y = as_contiguous(x)
    assert y.is_contiguous()
    assert list(x.strides) == strides and not x.is_contiguous()
    assert bool((y == x).all())
    z = paddle.randn([3, 5])
    assert as_contiguous(z) is z


def test_bridge_empty_and_kernel_arg_fast_paths():
    """The glue's allocator (the eager op behind paddle.empty) gives paddle.empty's tensor for a dtype name or a
    Paddle dtype; kernel_arg passes a tensor that records no autograd edge as it is (no new Tensor object per
    call) and detaches one that does (same storage, no edge)."""
    from cute_kernels.dtypes import dtype_name
    from paddle_fa4 import _bridge

    like = paddle.zeros([2], dtype="bfloat16")
    for dtype, name in (("float32", "float32"), (like.dtype, "bfloat16"), ("int32", "int32")):
        x = _bridge.empty((3, 4), dtype, like)
        assert list(x.shape) == [3, 4] and dtype_name(x.dtype) == name and x.place == like.place and x.stop_gradient
    assert list(_bridge.empty([0, 2], "float32", like).shape) == [0, 2]
    a = paddle.ones([3])
    assert _bridge.kernel_arg(a) is a and _bridge.kernel_arg(None) is None
    g = paddle.ones([3])
    g.stop_gradient = False
    d = _bridge.kernel_arg(g)
    assert d is not g and d.stop_gradient and d.data_ptr() == g.data_ptr()


@pytest.mark.parametrize("cc,target", [(90, "sm_90a"), (100, "sm_100a"), (103, "sm_103a")])
def test_dispatch_table_builds_for_the_exact_part(monkeypatch, cc, target):
    """9.0 -> sm_90a, 10.0 -> sm_100a, 10.3 -> sm_103a: the glue's compile key carries the tensor's exact
    compute capability, which alone names the target the launcher compiles for."""
    from cute_kernels import arch as arch_mod
    from cute_kernels.attention import launch
    from cute_kernels.fake import arch_options

    fake = FakeLaunch()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: cc)
    monkeypatch.setattr(glue, "arch_of", backend_mod.tensor_arch)
    monkeypatch.setattr(glue, "_launch", lambda: fake)
    q = t([1, 8, 2, 64], "bfloat16")
    paddle_fa4.flash_attn_fwd(q, q, q, backend="cute")
    kw = fake.configs[-1]
    assert kw["arch"] == cc
    cfg = launch.fwd_config(**kw)
    assert launch.unsupported_reason(cfg) is None and arch_mod.arch_name(cfg.arch) == target
    assert f"--gpu-arch {target}" in arch_options(cfg.arch)


@pytest.mark.parametrize("cc", [80, 89, 110, 120, 121])
def test_parts_without_a_build_fall_back(monkeypatch, fresh_warnings, cc):
    """No build loads on these parts: auto takes the reference with arch_reason's text, cute refuses
    before any launch, and the launcher is never asked."""
    from cute_kernels.arch import arch_reason

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: cc)
    monkeypatch.setattr(glue, "_launch", lambda: pytest.fail("launcher consulted on an unsupported part"))
    q = paddle.randn([1, 8, 2, 16])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_fa4.flash_attn_fwd(q, q, q)
    assert any(arch_reason(cc) in str(w.message) for w in caught)
    with pytest.raises(NotImplementedError, match=f"compute capability {cc // 10}\\.{cc % 10}"):
        paddle_fa4.flash_attn_fwd(q, q, q, backend="cute")


def test_auto_holds_back_paths_not_yet_run_on_a_gpu(fake_gpu, fresh_warnings, monkeypatch):
    """``NOT_YET_RUN`` (kernel paths compiled but never run on a GPU): ``auto`` takes the reference for them and
    says why, ``cute`` runs the kernel, dense calls and SM100 are not held back. Empty today (the SM90 FlashMask
    paths ran on an H100): auto takes the kernel for them; the mechanism is checked with an entry put back."""
    q = t([1, 32, 2, 64], "bfloat16")
    lts = paddle.full([1, 1, 32, 1], 32, dtype="int32")
    spec = validate_fwd(q, q, q, None, True, (None, None), 0.0, None, None, None, None, None, 64, True, None,
                        startend_row_indices=lts)
    assert not glue.NOT_YET_RUN and glue.unverified_reason(90, spec) is None  # auto: the GPU-run kernel
    monkeypatch.setattr(glue, "NOT_YET_RUN", {(90, "startend_row_indices")})
    with pytest.warns(UserWarning, match="startend_row_indices path has not run on a GPU yet"):
        out, _ = paddle_fa4.flash_attn_fwd(q, q, q, causal=True, startend_row_indices=lts)
    assert not fake_gpu.runs and float(out.astype("float32").abs().max()) != 7.0
    paddle_fa4.flash_attn_fwd(q, q, q, causal=True)  # dense: the GPU-verified kernel
    assert len(fake_gpu.runs) == 1
    held = lambda arch: "not run yet"  # noqa: E731
    assert backend_mod.resolve_backend("op", "cute", q, lambda arch: None, auto_reason=held) == "cute"
    with pytest.warns(UserWarning, match=r"op: using the reference backend \(not run yet\)"):
        assert backend_mod.resolve_backend("op", "auto", q, lambda arch: None, auto_reason=held) == "reference"
    assert "startend_row_indices" in glue.unverified_reason(90, spec)
    assert glue.unverified_reason(100, spec) is None and glue.unverified_reason(90, spec_for(q, q, q)) is None

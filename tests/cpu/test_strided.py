"""Strided (non-contiguous) tensors under backend="cute", driven on the CPU with fake launchers.

The rule (docs/api.md, "Strided inputs"): every op accepts strided inputs; the CuTe glue hands the
launcher a contiguous copy (the kernels are compiled for compact row-major layouts) and never
touches the caller's tensor; a strided out-parameter (flash_attn_fwd's block_logit, flash_attn_bwd's
dq/dk/dv, h2o's in-place state/summary) is written through a contiguous temporary that is copied
back. Each test checks what the launcher received (contiguous, the caller's values) and that the
caller's tensors are unchanged (values, strides, and the rest of a base buffer an out-view lives in).
tests/gpu/test_strided.py checks the same paths on the GPU (bitwise equal to contiguous inputs).
"""

from __future__ import annotations

import types

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import attention as attention_mod
from paddle_fa4 import backend as backend_mod
from paddle_fa4 import h2o
from paddle_fa4._cute import attention as glue
from paddle_fa4.reference import attention as ref_attention


def _t(shape, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _np(t):
    return t.astype("float32").numpy() if t.dtype in (paddle.bfloat16, paddle.float16) else t.numpy()


def _qkv_views(b=1, s=8, h=2, d=64, dtype="bfloat16"):
    """q, k, v as strided slices of one fused [B, S, 3, H, D] projection (the common case)."""
    fused = _t([b, s, 3, h, d], dtype)
    q, k, v = (fused[:, :, i] for i in range(3))
    assert not any(x.is_contiguous() for x in (q, k, v))
    return fused, q, k, v


class _Record:
    """The caller's tensor before a call: values and strides, to check it is left alone."""

    def __init__(self, t):
        self.t, self.values, self.strides, self.ptr = t, _np(t).copy(), list(t.strides), t.data_ptr()

    def unchanged(self) -> bool:
        t = self.t
        return (list(t.strides) == self.strides and t.data_ptr() == self.ptr and not t.is_contiguous()
                and np.array_equal(_np(t), self.values))


class FakeFwd(types.SimpleNamespace):
    """cute_kernels.attention.launch stand-in: records what it got, then runs the reference forward
    on it (so the result shows the launcher read the right values)."""

    def __init__(self):
        super().__init__(runs=[])

    def fwd_config(self, **kw):
        return ("fwd-cfg", tuple(sorted(kw.items())))

    def unsupported_reason(self, cfg):
        return None

    def run_fwd(self, cfg, q, k, v, out, lse, block_logit, cu_q, cu_k, **kw):
        self.runs.append(dict(tensors=(q, k, v, out, lse, block_logit, cu_q, cu_k),
                              contiguous=[t is None or t.is_contiguous() for t in (q, k, v, out, lse, block_logit)],
                              values=[None if t is None else _np(t).copy() for t in (q, k, v)]))
        ref_attention.flash_attn_fwd(self.spec, q, k, v, out, lse, block_logit, cu_q, cu_k)


class FakeBwd(types.SimpleNamespace):
    def __init__(self):
        super().__init__(runs=[])

    def bwd_config(self, **kw):
        from cute_kernels.attention.bwd_config import BwdConfig

        return BwdConfig(**kw)

    def unsupported_reason(self, cfg):
        return None

    def workspace_shapes(self, cfg, **kw):
        from cute_kernels.attention.bwd_config import workspace_shapes

        return workspace_shapes(cfg, **kw)

    def run_bwd(self, cfg, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, workspace, **kw):
        tensors = (dout, q, k, v, out, lse, dq, dk, dv)
        self.runs.append(dict(tensors=tensors, contiguous=[t.is_contiguous() for t in tensors],
                              values=[_np(t).copy() for t in (dout, q, k, v)]))
        grads = ref_attention.flash_attn_bwd(self.spec, dout, q, k, v, out, lse, dlse, None, None, None, cu_q, cu_k)
        for buf, g in zip((dq, dk, dv), grads):
            paddle.assign(g, buf)


@pytest.fixture
def fake_gpu(monkeypatch):
    fwd, bwd = FakeFwd(), FakeBwd()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(glue, "_launch", lambda: fwd)
    monkeypatch.setattr(glue, "_bwd_launch", lambda: bwd)
    original = attention_mod._validate

    def validate(*args, **kwargs):
        spec = original(*args, **kwargs)
        fwd.spec = bwd.spec = spec
        return spec

    monkeypatch.setattr(attention_mod, "_validate", validate)
    return types.SimpleNamespace(fwd=fwd, bwd=bwd)


def test_flash_attn_fwd_strided_qkv(fake_gpu):
    fused, q, k, v = _qkv_views()
    records = [_Record(x) for x in (q, k, v)]
    fused_before = _np(fused).copy()
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="cute")
    run = fake_gpu.fwd.runs[-1]
    assert run["contiguous"][:5] == [True] * 5
    for got, rec in zip(run["values"], records):
        np.testing.assert_array_equal(got, rec.values)  # the launcher read the caller's values
    assert all(rec.unchanged() for rec in records)
    np.testing.assert_array_equal(_np(fused), fused_before)
    want_out, want_lse = paddle_fa4.flash_attn_fwd(q.clone(), k.clone(), v.clone(), causal=True,
                                                   backend="reference")
    np.testing.assert_array_equal(_np(out), _np(want_out))
    np.testing.assert_array_equal(lse.numpy(), want_lse.numpy())


def test_flash_attn_fwd_strided_block_logit_buffer_is_written_back(fake_gpu):
    q = _t([1, 8, 2, 64], "bfloat16")
    base = paddle.full([1, 2, 8, 3], 123.0)  # block_logit [1, 2, 8, 1] = column 1 of a wider buffer
    view = base[:, :, :, 1:2]
    assert not view.is_contiguous()
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, q, q, block_logit=view, block_size=16, causal=True,
                                             backend="cute")
    run = fake_gpu.fwd.runs[-1]
    tbl = run["tensors"][5]
    assert run["contiguous"][5] and tbl.data_ptr() != view.data_ptr()  # a contiguous temporary
    assert bl is view and not view.is_contiguous()
    _, _, want = paddle_fa4.flash_attn_fwd(q, q, q, block_size=16, causal=True, return_block_logit=True,
                                           backend="reference")
    np.testing.assert_array_equal(base[:, :, :, 1:2].numpy(), want.numpy())  # copied back into the view
    np.testing.assert_array_equal(base[:, :, :, 0].numpy(), np.full([1, 2, 8], 123.0, np.float32))
    np.testing.assert_array_equal(base[:, :, :, 2].numpy(), np.full([1, 2, 8], 123.0, np.float32))


def test_flash_attn_varlen_strided_cu_seqlens(fake_gpu):
    q = _t([9, 2, 64], "bfloat16")
    cu_base = paddle.to_tensor([0, 99, 4, 99, 9, 99], dtype="int32")
    cu = cu_base[::2]  # [0, 4, 9], stride 2
    assert not cu.is_contiguous()
    paddle_fa4.flash_attn_varlen_func(q, q, q, cu, cu, max_seqlen_q=5, max_seqlen_k=5, backend="cute")
    tcu = fake_gpu.fwd.runs[-1]["tensors"][6]
    assert tcu.is_contiguous() and tcu.numpy().tolist() == [0, 4, 9]
    assert cu_base.numpy().tolist() == [0, 99, 4, 99, 9, 99] and not cu.is_contiguous()


def test_autograd_with_strided_qkv_under_cute(fake_gpu):
    fused, q, k, v = _qkv_views()
    fused.stop_gradient = False
    q, k, v = (fused[:, :, i] for i in range(3))
    out, _ = paddle_fa4.flash_attn_func(q, k, v, causal=True, backend="cute")
    out.astype("float32").sum().backward()
    run = fake_gpu.bwd.runs[-1]
    assert all(run["contiguous"])
    ref_fused = paddle.to_tensor(_np(fused)).astype("bfloat16")
    ref_fused.stop_gradient = False
    rq, rk, rv = (ref_fused[:, :, i].clone() for i in range(3))
    rout, _ = paddle_fa4.flash_attn_func(rq, rk, rv, causal=True, backend="reference")
    rout.astype("float32").sum().backward()
    np.testing.assert_array_equal(_np(out), _np(rout))
    np.testing.assert_array_equal(_np(fused.grad), _np(ref_fused.grad))


def test_flash_attn_bwd_strided_inputs_and_out_params(fake_gpu):
    fused, q, k, v = _qkv_views()
    out, lse = paddle_fa4.flash_attn_fwd(q.clone(), k.clone(), v.clone(), causal=True, backend="reference")
    dout = _t([1, 2, 8, 64], "bfloat16", seed=3).transpose([0, 2, 1, 3])  # strided [1, 8, 2, 64]
    records = [_Record(x) for x in (dout, q, k, v)]
    grads_base = paddle.full([1, 8, 3, 2, 64], 9.0).astype("bfloat16")  # dq/dk/dv views of one buffer
    dq, dk, dv = (grads_base[:, :, i] for i in range(3))
    got = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv, backend="cute")
    run = fake_gpu.bwd.runs[-1]
    assert all(run["contiguous"])
    for got_values, rec in zip(run["values"], records):
        np.testing.assert_array_equal(got_values, rec.values)
    assert all(rec.unchanged() for rec in records)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    assert run["tensors"][6].data_ptr() != dq.data_ptr()  # written through a temporary
    want = paddle_fa4.flash_attn_bwd(dout.clone(), q.clone(), k.clone(), v.clone(), out, lse, causal=True,
                                     backend="reference")
    for i, w in enumerate(want):
        np.testing.assert_array_equal(_np(grads_base[:, :, i]), _np(w))


# ---------------------------------------------------------------------------------------------
# selection


@pytest.fixture
def fake_select(monkeypatch):
    import cute_kernels.select.launch as launch

    from paddle_fa4._cute import selection as sel_glue
    from paddle_fa4.reference import selection as ref

    runs = []

    def run_topk(block_logit, lse, out, *, sink_blocks=0, local_blocks=0, causal_limit=None, head_agg="max",
                 arch=None):
        runs.append(dict(contiguous=(block_logit.is_contiguous(), lse.is_contiguous()),
                         values=(block_logit.numpy().copy(), lse.numpy().copy())))
        ref.select_topk_blocks(block_logit, lse, out, out.shape[3], out.shape[1], sink_blocks, local_blocks,
                               causal_limit, head_agg)

    def run_indices(block_idx, out, *, block_size, seqlen_k, causal=True, arch=None):
        runs.append(dict(contiguous=(block_idx.is_contiguous(),), values=(block_idx.numpy().copy(),)))
        ref.blocks_to_indices(block_idx, out, block_size, seqlen_k, causal)

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(sel_glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(launch, "run_select_topk_blocks", run_topk)
    monkeypatch.setattr(launch, "run_blocks_to_indices", run_indices)
    return runs


def test_select_topk_blocks_strided(fake_select):
    base = _t([1, 4, 6, 10])
    bl = base[:, :, :, 1:9]  # [1, 4, 6, 8], row stride 10
    lse_base = _t([1, 6, 4], seed=1)
    lse = lse_base.transpose([0, 2, 1])  # [1, 4, 6] strided
    rec_bl, rec_lse = _Record(bl), _Record(lse)
    got = paddle_fa4.select_topk_blocks(bl, lse, topk=3, num_kv_heads=2, sink_blocks=1, backend="cute")
    run = fake_select[-1]
    assert run["contiguous"] == (True, True)
    np.testing.assert_array_equal(run["values"][0], rec_bl.values)
    np.testing.assert_array_equal(run["values"][1], rec_lse.values)
    assert rec_bl.unchanged() and rec_lse.unchanged()
    want = paddle_fa4.select_topk_blocks(bl.clone(), lse.clone(), topk=3, num_kv_heads=2, sink_blocks=1,
                                         backend="reference")
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_blocks_to_indices_strided(fake_select):
    base = paddle.to_tensor(np.array([[[[0, 7, 1], [1, 7, -1]]]], np.int32))  # [1, 1, 2, 3]
    blk = base[:, :, :, ::2]  # [1, 1, 2, 2] strided
    rec = _Record(blk)
    got = paddle_fa4.blocks_to_indices(blk, block_size=16, seqlen_k=40, backend="cute")
    run = fake_select[-1]
    assert run["contiguous"] == (True,)
    np.testing.assert_array_equal(run["values"][0], rec.values)
    assert rec.unchanged()
    want = paddle_fa4.blocks_to_indices(blk.clone(), block_size=16, seqlen_k=40, backend="reference")
    np.testing.assert_array_equal(got.numpy(), want.numpy())


# ---------------------------------------------------------------------------------------------
# indexed attention: the real glue with a fake launcher module


def test_indexed_attention_strided(monkeypatch):
    from paddle_fa4._cute import indexed as idx_glue

    seen = []

    class FakeIndexedLaunch:
        def run_plan(self, flat_indices, kv_len, *tensors, window_queries, arch):
            seen.append(("plan", flat_indices.is_contiguous()))
            for t in tensors:
                paddle.assign(paddle.zeros(t.shape, dtype=t.dtype), t)

        def run_fwd(self, cfg, q, k, v, win_key, win_mask, win_count, out, lse, scale):
            seen.append(("fwd", q.is_contiguous() and k.is_contiguous() and v.is_contiguous(),
                         _np(q).copy(), _np(k).copy(), _np(v).copy()))
            paddle.assign(paddle.zeros(out.shape, dtype=out.dtype), out)
            paddle.assign(paddle.zeros(lse.shape, dtype=lse.dtype), lse)

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(idx_glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(idx_glue, "_launch", lambda: FakeIndexedLaunch())
    monkeypatch.setattr(idx_glue, "unsupported_reason", lambda arch, spec: None)
    fused, q, k, v = _qkv_views(s=6)
    idx_base = paddle.to_tensor(np.arange(36, dtype=np.int32).reshape([1, 6, 6]) % 6)
    idx = idx_base[:, :, ::2]  # [1, 6, 3] strided
    records = [_Record(x) for x in (q, k, v, idx)]
    paddle_fa4.indexed_attention(q, k, v, idx, backend="cute")
    kinds = {s[0]: s for s in seen}
    assert kinds["plan"][1] and kinds["fwd"][1]
    for got, rec in zip(kinds["fwd"][2:], records[:3]):
        np.testing.assert_array_equal(got, rec.values)
    assert all(rec.unchanged() for rec in records)


# ---------------------------------------------------------------------------------------------
# h2o: in-place state through a contiguous copy


def test_h2o_strided_state_and_inputs(monkeypatch):
    import cute_kernels.h2o.launch as launch

    from paddle_fa4._cute import h2o as h2o_glue

    got = {}

    def run_reset_scores(state, slot_mapping, arch=None):
        got["reset"] = (state.is_contiguous(), slot_mapping.is_contiguous(), state.numpy().copy())
        paddle.assign(state + 1.0, state)  # marks every element: the copy-back must land in the view

    def run_token_page_scores(state, block_tables, seq_lens, out, arch=None):
        got["tps"] = (state.is_contiguous(), block_tables.is_contiguous(), state.numpy().copy())
        paddle.assign(paddle.zeros(out.shape, dtype=out.dtype), out)

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(h2o_glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(launch, "run_reset_scores", run_reset_scores)
    monkeypatch.setattr(launch, "run_token_page_scores", run_token_page_scores)
    base = _t([3, 2, 4, 2])  # state [3, 2, 4] = [..., 0] of a wider buffer
    state = base[:, :, :, 0]
    before = state.numpy().copy()
    other = base[:, :, :, 1].numpy().copy()
    slots = paddle.to_tensor(np.array([0, 9, 5, 9], np.int32))[::2]  # [0, 5], strided
    h2o.reset_scores(state, slots, backend="cute")
    assert got["reset"][:2] == (True, True)
    np.testing.assert_array_equal(got["reset"][2], before)  # the staged copy holds the old values
    np.testing.assert_array_equal(base[:, :, :, 0].numpy(), before + 1.0)  # written back into the view
    np.testing.assert_array_equal(base[:, :, :, 1].numpy(), other)  # the rest of the buffer untouched
    assert not state.is_contiguous()
    tables_base = paddle.to_tensor(np.array([[0, 9, 1, 9, 2, 9]], np.int32))
    tables = tables_base[:, ::2]
    h2o.token_page_scores(state, tables, paddle.to_tensor(np.array([10], np.int32)), backend="cute")
    assert got["tps"][:2] == (True, True)
    np.testing.assert_array_equal(got["tps"][2], state.numpy())
    assert tables_base.numpy().tolist() == [[0, 9, 1, 9, 2, 9]]

"""Public contracts of flash_attn_fwd and indexed_attention: return arity, dtypes, flags, and every
validation error (raised before any work, naming the op and the argument)."""

from __future__ import annotations

import re

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4.attention import AttnFwdSpec
from paddle_fa4.indexed import IndexedSpec


def t(shape, dtype="float32", fill=None):
    if fill is not None:
        return paddle.full(shape, fill, dtype=dtype)
    return paddle.to_tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).astype(dtype)


Q, K, V = t([1, 8, 4, 32]), t([1, 10, 2, 32]), t([1, 10, 2, 32])


# ---------------------------------------------------------------------------------------------
# flash_attn_fwd contracts


def test_returns_out_lse_without_block_logit():
    res = paddle_fa4.flash_attn_fwd(Q, K, V, backend="reference")
    assert len(res) == 2
    out, lse = res
    assert out.shape == [1, 8, 4, 32] and out.dtype == Q.dtype
    assert lse.shape == [1, 4, 8] and lse.dtype == paddle.float32


def test_returns_block_logit_when_asked_or_given():
    res = paddle_fa4.flash_attn_fwd(Q, K, V, return_block_logit=True, block_size=16, backend="reference")
    assert len(res) == 3 and res[2].shape == [1, 4, 8, 1] and res[2].dtype == paddle.float32
    buf = paddle.empty([1, 4, 8, 1], dtype="float32")
    res = paddle_fa4.flash_attn_fwd(Q, K, V, block_logit=buf, block_size=16, backend="reference")
    assert len(res) == 3 and res[2] is buf


def test_outputs_stop_gradient():
    """out is differentiable when an input needs gradients; lse and block_logit never are."""
    q = t([1, 8, 4, 32])
    q.stop_gradient = False
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, K, V, return_block_logit=True, backend="reference")
    assert not out.stop_gradient and lse.stop_gradient and bl.stop_gradient
    for x in paddle_fa4.flash_attn_fwd(t([1, 8, 4, 32]), K, V, return_block_logit=True, backend="reference"):
        assert x.stop_gradient


def test_bf16_out_dtype_and_varlen_shapes():
    q, k = t([9, 4, 64], "bfloat16"), t([12, 2, 64], "bfloat16")
    cu_q, cu_k = paddle.to_tensor([0, 4, 9], dtype="int32"), paddle.to_tensor([0, 5, 12], dtype="int32")
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                             max_seqlen_k=7, block_size=32, return_block_logit=True,
                                             backend="reference")
    assert out.shape == [9, 4, 64] and out.dtype == paddle.bfloat16
    assert lse.shape == [4, 9] and bl.shape == [4, 9, 1]


def test_pack_gqa_without_block_logit_is_accepted():
    out, _ = paddle_fa4.flash_attn_fwd(Q, K, V, pack_gqa=True, backend="reference")
    ref, _ = paddle_fa4.flash_attn_fwd(Q, K, V, pack_gqa=False, backend="reference")
    np.testing.assert_array_equal(out.numpy(), ref.numpy())


def test_spec_fields():
    from paddle_fa4.attention import _validate

    spec = _validate(Q, K, V, None, True, (3, None), 0.0, None, None, None, None, None, 32, True, None)
    assert isinstance(spec, AttnFwdSpec)
    assert (spec.batch, spec.seqlen_q, spec.seqlen_k, spec.num_heads, spec.num_heads_k) == (1, 8, 10, 4, 2)
    assert spec.causal and spec.window_left == 3 and spec.window_right == 0 and spec.has_window
    assert spec.block_size == 32 and spec.num_blocks == 1 and spec.qhead_per_kvhead == 2
    assert spec.softmax_scale == pytest.approx(32 ** -0.5)
    plain = _validate(Q, K, V, None, False, (None, 0), 0.0, None, None, None, None, None, 64, False, None)
    assert plain.causal and not plain.has_window and plain.block_size == 0


def _cu(values):
    return paddle.to_tensor(values, dtype="int32")


VARLEN_Q, VARLEN_K = t([9, 4, 32]), t([12, 2, 32])

FWD_ERRORS = [  # (kwargs overriding a valid call, exception, message fragment)
    pytest.param(dict(q=np.zeros([1, 8, 4, 32], np.float32)), TypeError, "q must be a paddle.Tensor",
                 id="q-not-tensor"),
    pytest.param(dict(q=t([1, 8, 4, 32], "int32")), TypeError, "q must be", id="q-int"),
    pytest.param(dict(k=t([1, 10, 2, 32], "bfloat16")), TypeError, "k must have q's dtype", id="k-dtype"),
    pytest.param(dict(v=t([1, 10, 2, 32], "float16")), TypeError, "v must have q's dtype", id="v-dtype"),
    pytest.param(dict(q=t([8, 4, 32])), ValueError, "q must be [B, Sq, Hq, D]", id="q-rank"),
    pytest.param(dict(k=t([10, 2, 32])), ValueError, "k must be [B, Sk, Hkv, D]", id="k-rank"),
    pytest.param(dict(k=t([2, 10, 2, 32])), ValueError, "k must have q's batch size", id="batch-mismatch"),
    pytest.param(dict(v=t([1, 11, 2, 32])), ValueError, "v must be [B, Sk, Hkv, Dv]", id="v-seqlen"),
    pytest.param(dict(k=t([1, 10, 2, 16]), v=t([1, 10, 2, 16])), ValueError, "k must have q's head_dim",
                 id="head-dim-mismatch"),
    pytest.param(dict(k=t([1, 10, 3, 32]), v=t([1, 10, 3, 32])), ValueError, "multiple of k's head count",
                 id="heads-not-divisible"),
    pytest.param(dict(q=t([1, 8, 4, 288]), k=t([1, 10, 2, 288]), v=t([1, 10, 2, 288])), NotImplementedError,
                 "head_dim 288", id="head-dim-too-big"),
    pytest.param(dict(v=t([1, 10, 2, 300])), NotImplementedError, "head_dim_v 300", id="head-dim-v-too-big"),
    pytest.param(dict(causal=1), TypeError, "causal must be a bool", id="causal-int"),
    pytest.param(dict(window_size=(3,)), ValueError, "window_size must be a (left, right) pair", id="window-len"),
    pytest.param(dict(window_size=(-2, None)), ValueError, "window_size[0]", id="window-negative"),
    pytest.param(dict(window_size=(None, 1.5)), TypeError, "window_size[1] must be an int", id="window-float"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap must be >= 0", id="softcap-negative"),
    pytest.param(dict(softcap=float("nan")), ValueError, "softcap must be finite", id="softcap-nan"),
    pytest.param(dict(softmax_scale="x"), TypeError, "softmax_scale must be a float", id="scale-str"),
    pytest.param(dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite", id="scale-inf"),
    pytest.param(dict(softmax_scale=-0.125), ValueError, "softmax_scale must be >= 0", id="scale-negative"),
    pytest.param(dict(block_size=48, return_block_logit=True), ValueError, "block_size must be one of",
                 id="block-size"),
    pytest.param(dict(block_size=64.0), TypeError, "block_size must be an int", id="block-size-float"),
    pytest.param(dict(return_block_logit=1), TypeError, "return_block_logit must be a bool", id="return-flag"),
    pytest.param(dict(pack_gqa=True, return_block_logit=True), ValueError, "pack_gqa", id="pack-gqa-return"),
    pytest.param(dict(pack_gqa=True, block_logit=t([1, 4, 8, 1])), ValueError, "pack_gqa", id="pack-gqa-buffer"),
    pytest.param(dict(pack_gqa="yes"), TypeError, "pack_gqa must be a bool", id="pack-gqa-str"),
    pytest.param(dict(block_logit=t([1, 4, 8, 1], "bfloat16")), TypeError, "block_logit must be float32",
                 id="buffer-dtype"),
    pytest.param(dict(block_logit=t([1, 4, 8, 2])), ValueError, "block_logit must have shape [1, 4, 8, 1]",
                 id="buffer-shape"),
    pytest.param(dict(block_logit=np.zeros([1, 4, 8, 1])), TypeError, "block_logit must be a paddle.Tensor",
                 id="buffer-not-tensor"),
    pytest.param(dict(max_seqlen_q=8), ValueError, "max_seqlen_q is only used with cu_seqlens",
                 id="max-seqlen-without-varlen"),
    pytest.param(dict(backend="triton"), ValueError, "backend must be one of", id="backend"),
]


@pytest.mark.parametrize("override,exc,fragment", FWD_ERRORS)
def test_flash_attn_fwd_errors(override, exc, fragment):
    kw = dict(q=Q, k=K, v=V, block_size=16)
    kw.update(override)
    with pytest.raises(exc, match="^flash_attn_fwd: .*" + re.escape(fragment)):
        paddle_fa4.flash_attn_fwd(**kw)


VARLEN_OK = dict(q=VARLEN_Q, k=VARLEN_K, v=VARLEN_K, cu_seqlens_q=_cu([0, 4, 9]), cu_seqlens_k=_cu([0, 5, 12]),
                 max_seqlen_q=5, max_seqlen_k=7)

VARLEN_ERRORS = [
    pytest.param(dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k is required", id="missing-cu-k"),
    pytest.param(dict(cu_seqlens_q=paddle.to_tensor([0, 4, 9], dtype="int16")), TypeError,
                 "cu_seqlens_q must be int32 (int64 is accepted", id="cu-int16"),
    pytest.param(dict(cu_seqlens_q=_cu([[0, 4, 9]])), ValueError, "cu_seqlens_q must be 1-D", id="cu-rank"),
    pytest.param(dict(cu_seqlens_k=_cu([0, 12])), ValueError, "same length", id="cu-lengths-differ"),
    pytest.param(dict(max_seqlen_q=None), ValueError, "max_seqlen_q is required", id="missing-max-q"),
    pytest.param(dict(max_seqlen_k=7.0), TypeError, "max_seqlen_k must be an int", id="max-k-float"),
    pytest.param(dict(cu_seqlens_q=_cu([1, 4, 9])), ValueError, "cu_seqlens_q must start at 0", id="cu-start"),
    pytest.param(dict(cu_seqlens_k=_cu([0, 7, 5]), k=t([5, 2, 32]), v=t([5, 2, 32])), ValueError,
                 "cu_seqlens_k must be non-decreasing", id="cu-decreasing"),
    pytest.param(dict(cu_seqlens_q=_cu([0, 4, 8])), ValueError, "cu_seqlens_q[-1] must equal the packed token",
                 id="cu-total"),
    pytest.param(dict(max_seqlen_k=6), ValueError, "max_seqlen_k 6 is below the longest", id="max-too-small"),
    pytest.param(dict(q=t([1, 9, 4, 32])), ValueError, "q must be [total_q, Hq, D] with cu_seqlens", id="q-rank"),
    pytest.param(dict(v=t([11, 2, 32])), ValueError, "v must be [total_k, Hkv, Dv]", id="v-total"),
]


@pytest.mark.parametrize("override,exc,fragment", VARLEN_ERRORS)
def test_flash_attn_fwd_varlen_errors(override, exc, fragment):
    kw = dict(VARLEN_OK, backend="reference")
    kw.update(override)
    with pytest.raises(exc, match="^flash_attn_fwd: .*" + re.escape(fragment)):
        paddle_fa4.flash_attn_fwd(**kw)


def test_varlen_valid_call_passes():
    out, lse = paddle_fa4.flash_attn_fwd(**VARLEN_OK, backend="reference")
    assert out.shape == [9, 4, 32]


# ---------------------------------------------------------------------------------------------
# indexed_attention contracts

IQ, IK, IV = t([2, 5, 4, 16]), t([2, 7, 2, 16]), t([2, 7, 2, 16])
IDX = paddle.to_tensor(np.random.default_rng(1).integers(-1, 7, size=(2, 5, 3)).astype(np.int32))


def test_indexed_returns_out_or_out_lse():
    out = paddle_fa4.indexed_attention(IQ, IK, IV, IDX, backend="reference")
    assert isinstance(out, paddle.Tensor) and out.shape == [2, 5, 4, 16] and out.dtype == IQ.dtype
    out, lse = paddle_fa4.indexed_attention(IQ, IK, IV, IDX, return_lse=True, backend="reference")
    assert lse.shape == [2, 4, 5] and lse.dtype == paddle.float32


def test_indexed_spec_fields():
    from paddle_fa4.indexed import _validate

    import dataclasses

    assert [f.name for f in dataclasses.fields(IndexedSpec)] == [
        "B", "Lq", "Lkv", "Hq", "Hkv", "D", "W", "per_kv_head", "scale", "dtype"]
    spec = _validate(IQ, IK, IV, IDX, None, False, None)
    assert spec == IndexedSpec(B=2, Lq=5, Lkv=7, Hq=4, Hkv=2, D=16, W=3, per_kv_head=False, scale=0.25,
                               dtype="float32")
    per_head = _validate(IQ, IK, IV, paddle.zeros([2, 2, 5, 6], dtype="int32"), 0.5, True, None)
    assert per_head.per_kv_head and per_head.W == 6 and per_head.scale == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.W = 4


INDEXED_ERRORS = [
    pytest.param(dict(q=np.zeros([2, 5, 4, 16])), TypeError, "q must be a paddle.Tensor", id="q-numpy"),
    pytest.param(dict(q=t([2, 5, 4, 16], "int32")), TypeError, "q must be", id="q-int"),
    pytest.param(dict(k=t([2, 7, 2, 16], "bfloat16")), TypeError, "k must have q's dtype", id="k-dtype"),
    pytest.param(dict(v=t([2, 7, 2, 16], "float16")), TypeError, "v must have q's dtype",
                 id="v-dtype"),
    pytest.param(dict(indices=t([2, 5, 3])), TypeError, "indices must be int32 (int64 is accepted and converted to "
                 "int32), got float32; convert with indices.astype('int32')", id="idx-float"),
    pytest.param(dict(q=t([5, 4, 16])), ValueError, "q must be [B, Lq, Hq, D]", id="q-rank"),
    pytest.param(dict(k=t([7, 2, 16])), ValueError, "k must be [B, Lkv, Hkv, D]", id="k-rank"),
    pytest.param(dict(indices=paddle.zeros([10, 3], dtype="int32")), ValueError,
                 "indices must be [B, Lq, W] or [B, Hkv, Lq, W]", id="idx-rank"),
    pytest.param(dict(k=t([1, 7, 2, 16]), v=t([1, 7, 2, 16])), ValueError, "k must have shape",
                 id="batch-mismatch"),
    pytest.param(dict(k=t([2, 7, 2, 8]), v=t([2, 7, 2, 8])), ValueError, "k must have shape",
                 id="head-dim-mismatch"),
    pytest.param(dict(v=t([2, 6, 2, 16])), ValueError, "v must have shape", id="value-shape"),
    pytest.param(dict(k=t([2, 7, 3, 16]), v=t([2, 7, 3, 16])), ValueError, "multiple of k's head count",
                 id="heads-not-divisible"),
    pytest.param(dict(indices=paddle.zeros([2, 4, 3], dtype="int32")), ValueError,
                 "indices must have shape [2, 5, 3]", id="idx-lq"),
    pytest.param(dict(indices=paddle.zeros([2, 3, 5, 3], dtype="int32")), ValueError,
                 "indices must have shape [2, 2, 5, 3]", id="idx-per-head-hkv"),
    pytest.param(dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite", id="scale-nan"),
    pytest.param(dict(softmax_scale=-1.0), ValueError, "softmax_scale must be >= 0", id="scale-negative"),
    pytest.param(dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float", id="scale-str"),
    pytest.param(dict(return_lse=1), TypeError, "return_lse must be a bool", id="return-lse-int"),
    pytest.param(dict(plan=object()), TypeError, "plan must be an IndexedAttentionPlan", id="plan-type"),
    pytest.param(dict(backend="fast"), ValueError, "backend must be one of", id="backend"),
]


@pytest.mark.parametrize("override,exc,fragment", INDEXED_ERRORS)
def test_indexed_attention_errors(override, exc, fragment):
    kw = dict(q=IQ, k=IK, v=IV, indices=IDX)
    kw.update(override)
    with pytest.raises(exc, match="^indexed_attention: .*" + re.escape(fragment)):
        paddle_fa4.indexed_attention(**kw)


def test_zero_size_inputs():
    out, lse = paddle_fa4.indexed_attention(t([0, 5, 4, 16]), t([0, 7, 2, 16]), t([0, 7, 2, 16]),
                                            paddle.zeros([0, 5, 3], dtype="int32"), return_lse=True,
                                            backend="reference")
    assert out.shape == [0, 5, 4, 16] and lse.shape == [0, 4, 5]


@pytest.mark.parametrize("module", ["paddle_fa4.attention", "paddle_fa4.indexed", "paddle_fa4.flashmask"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------------
# GPU test files say what they need when they skip (issue 19 item 6)


def test_gpu_test_files_say_what_they_need():
    """A GPU file skipped on a machine without torch says why ("needs a CUDA GPU; torch is used to
    drive the launchers"), not pytest's bare "could not import 'torch'"."""
    import pathlib

    gpu = pathlib.Path(__file__).resolve().parents[1] / "gpu"
    files = sorted(gpu.glob("test_*.py"))
    assert files
    for path in files:
        for line in path.read_text().splitlines():
            if re.match(r"\w+ = pytest\.importorskip\(\"torch\"", line):
                assert "needs a CUDA GPU" in line, f"{path.name}: {line}"

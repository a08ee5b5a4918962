"""SM90 attention forward + fused block_logit on the H200, through cute_kernels.attention.launch.run_fwd.

Reference: tests/gpu/_attn_ref.py (fp32 on upcast bf16/fp16 inputs). block_logit: exact -inf
pattern and |err| <= 2e-3 + 1e-3 |ref| on finite entries; out: FA-style (at most 2x the error of a
same-precision eager computation + 2e-3); lse: 1e-3 + 1e-3 |ref|.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.gpu._fwd_launch import SENTINEL, make_qkv, run_ours  # noqa: E402, F401

pytestmark = sm90_gpu_marks()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _ref():
    from tests.gpu import _attn_ref

    return _attn_ref


def check_block_logit(bl, bl_ref):
    assert bl.shape == bl_ref.shape
    assert not torch.isnan(bl).any(), "NaN in block_logit"
    assert not (bl == SENTINEL).any(), "block_logit entries left unwritten"
    inf_ours = torch.isneginf(bl)
    inf_ref = torch.isneginf(bl_ref)
    assert torch.equal(inf_ours, inf_ref), (
        f"-inf pattern differs at {int((inf_ours != inf_ref).sum())} entries")
    fin = ~inf_ref
    err = (bl[fin] - bl_ref[fin]).abs()
    tol = 2e-3 + 1e-3 * bl_ref[fin].abs()
    assert bool((err <= tol).all()), f"block_logit max err {float(err.max()):.3e}"


def check_out_lse(q, k, v, out, lse, ref_kwargs):
    ref = _ref()
    out_ref, lse_ref, _ = ref.attention_ref(q, k, v, **ref_kwargs)
    out_lp, _, _ = ref.attention_ref(q, k, v, low_precision=True, **ref_kwargs)
    err = (out.float() - out_ref).abs().max().item()
    err_lp = (out_lp - out_ref).abs().max().item()
    assert err <= 2 * err_lp + 2e-3, f"out err {err:.3e} vs eager {err_lp:.3e}"
    assert not torch.isnan(out).any()
    inf_ref = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), inf_ref)
    fin = ~inf_ref
    lerr = (lse[fin] - lse_ref[fin]).abs()
    assert bool((lerr <= 1e-3 + 1e-3 * lse_ref[fin].abs()).all()), f"lse err {float(lerr.max()):.3e}"
    # Rows with no visible key: out is 0.
    if inf_ref.any():
        rows = inf_ref.permute(0, 2, 1)  # (B, Sq, Hq)
        assert float(out.float()[rows].abs().max()) == 0.0


def full_check(q, k, v, block_size, **kw):
    out, lse, bl = run_ours(q, k, v, block_size=block_size, **kw)
    ref_kw = {key: kw[key] for key in ("causal", "window", "softcap") if key in kw}
    check_out_lse(q, k, v, out, lse, ref_kw)
    if block_size:
        _, _, bl_ref = _ref().attention_ref(q, k, v, block_size=block_size, nb=bl.shape[-1], **ref_kw)
        check_block_logit(bl, bl_ref)
    return out, lse, bl


SHAPES = [(1, 256, 256, 8, 64), (2, 512, 512, 4, 128), (1, 512, 512, 8, 256), (1, 1024, 1024, 2, 256),
          (2, 640, 640, 6, 128)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_multi_shapes(shape, causal):
    b, s, sk, h, d = shape
    q, k, v = make_qkv(b, s, sk, h, h, d)
    full_check(q, k, v, 64, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_block_sizes(block_size, causal):
    q, k, v = make_qkv(1, 512, 700, 4, 4, 128, seed=1)
    full_check(q, k, v, block_size, causal=causal)


CORNERS = [
    pytest.param(1, 250, 250, 128, id="sk-not-multiple-of-block"),
    pytest.param(1, 130, 130, 128, id="sk-not-multiple-of-tile"),
    pytest.param(1, 63, 63, 128, id="63x63"),
    pytest.param(1, 1, 1, 128, id="1x1"),
    pytest.param(2, 300, 512, 128, id="sq-lt-sk"),
    pytest.param(2, 512, 300, 128, id="sq-gt-sk-rows-without-keys"),
    pytest.param(1, 511, 513, 256, id="ragged-d256"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b,sq,sk,d", CORNERS)
def test_corner_cases(b, sq, sk, d, causal):
    q, k, v = make_qkv(b, sq, sk, 2, 2, d, seed=2)
    full_check(q, k, v, 64, causal=causal)


@pytest.mark.parametrize("hq,hkv,causal", [(8, 2, True), (8, 2, False), (8, 1, True), (4, 2, False)],
                         ids=["8-2-causal", "8-2-full", "8-1-causal", "4-2-full"])
def test_gqa(hq, hkv, causal):
    q, k, v = make_qkv(1, 512, 512, hq, hkv, 128, seed=3)
    full_check(q, k, v, 64, causal=causal)


@pytest.mark.parametrize("window", [(64, 32), (100, 0), (-1, 40), (200, -1)],
                         ids=["64-32", "100-0", "inf-40", "200-inf"])
@pytest.mark.parametrize("sq,sk", [(512, 512), (300, 700)], ids=["square", "sq-lt-sk"])
def test_window(window, sq, sk):
    q, k, v = make_qkv(1, sq, sk, 4, 4, 128, seed=4)
    full_check(q, k, v, 64, window=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(softcap, causal):
    q, k, v = make_qkv(1, 384, 384, 4, 4, 128, seed=5)
    q = q * 3  # make the cap matter
    full_check(q, k, v, 64, causal=causal, softcap=softcap)


@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "gqa4"])
def test_window_softcap_d64(hkv):
    """head_dim 64 with window + softcap (3 WGs; at block_size 32 the block maxima are reduced in the softmax
    step, ``bl_early_reduce``): reference numerics, block_logit, and out / lse bitwise the same with and
    without block_logit."""
    q, k, v = make_qkv(1, 700, 700, 4, hkv, 64, seed=12)
    q = q * 3
    kw = dict(window=(100, 20), softcap=10.0)
    o0, l0, _ = full_check(q, k, v, 0, **kw)
    for bs in (32, 128):
        o1, l1, _ = full_check(q, k, v, bs, **kw)
        assert torch.equal(o0, o1) and torch.equal(l0, l1), f"out / lse changed by block_logit (block_size={bs})"


@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("case", ["causal", "window", "causal-varlen", "window-varlen"])
def test_d64_small_blocks(case, hkv):
    """head_dim 64 (3 WGs at 160 registers) with blocks of 16 (8 per key tile): the configs whose thread
    coordinates are read again at their use (Note [thread coordinates at use] in attention/fwd_sm90.py).
    Reference numerics and block_logit; out / lse bitwise the same without block_logit; with varlen, each
    packed document (unaligned starts) exactly what it gives alone."""
    kw = dict(causal=True) if case.startswith("causal") else dict(window=(150, 30))
    if not case.endswith("varlen"):
        q, k, v = make_qkv(1, 700, 700, 4, hkv, 64, seed=13)
        o0, l0, _ = full_check(q, k, v, 0, **kw)
        o1, l1, _ = full_check(q, k, v, 16, **kw)
        assert torch.equal(o0, o1) and torch.equal(l0, l1), "out / lse changed by block_logit"
        return
    lens = [300, 77, 451]
    q, k, v = make_qkv(1, sum(lens), sum(lens), 4, hkv, 64, seed=14)
    q, k, v = q[0], k[0], v[0]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    out, lse, bl = run_ours(q, k, v, block_size=16, cu_q=cu, cu_k=cu, max_sq=max(lens), max_sk=max(lens), **kw)
    assert not (bl == SENTINEL).any()
    for i, n in enumerate(lens):
        a, e = int(cu[i]), int(cu[i + 1])
        one = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        o1, l1, b1 = run_ours(q[a:e], k[a:e], v[a:e], block_size=16, cu_q=one, cu_k=one, max_sq=n, max_sk=n,
                              **kw)
        assert torch.equal(out[a:e], o1) and torch.equal(lse[:, a:e], l1), f"doc {i}: out / lse differ"
        assert torch.equal(bl[:, a:e, :b1.shape[-1]], b1), f"doc {i}: block_logit differs"
        check_out_lse(q[None, a:e], k[None, a:e], v[None, a:e], o1[None], l1[None], kw)
        _, _, bl_ref = _ref().attention_ref(q[None, a:e], k[None, a:e], v[None, a:e], block_size=16, **kw)
        check_block_logit(b1, bl_ref[0])


@pytest.mark.parametrize("dtype,d", [(torch.float16, 128), (torch.bfloat16, 96), (torch.bfloat16, 192)],
                         ids=["fp16-d128", "bf16-d96", "bf16-d192"])
def test_dtypes_and_head_dims(dtype, d):
    q, k, v = make_qkv(2, 333, 333, 4, 4, d, dtype=dtype, seed=6)
    full_check(q, k, v, 64, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims_192_128(causal):
    """head_dim 192 with head_dim_v 128 (Q/K 192 wide, V/O 128), GQA, Sq != Sk: reference, and out/lse
    bitwise the same without block_logit."""
    q, k, v = make_qkv(2, 333, 400, 8, 4, 192, seed=12)
    v = v[..., :128].contiguous()
    out, lse, _ = full_check(q, k, v, 64, causal=causal)
    out0, lse0, _ = run_ours(q, k, v, causal=causal)
    assert out.shape[-1] == 128
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_documents_bit_identical(causal):
    """Each packed document (unaligned starts) gives exactly what it gives alone; blocks past it are -inf."""
    lens = [40, 200, 72, 133, 1]
    hq, d, bs = 4, 128, 64
    q, k, v = make_qkv(1, sum(lens), sum(lens), hq, hq, d, seed=7)
    q, k, v = q[0], k[0], v[0]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    out, lse, bl = run_ours(q, k, v, causal=causal, block_size=bs, cu_q=cu, cu_k=cu, max_sq=max(lens),
                            max_sk=max(lens))
    assert not (bl == SENTINEL).any()
    for i, n in enumerate(lens):
        a, e = int(cu[i]), int(cu[i + 1])
        one = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        o1, l1, b1 = run_ours(q[a:e], k[a:e], v[a:e], causal=causal, block_size=bs, cu_q=one, cu_k=one,
                              max_sq=n, max_sk=n)
        assert torch.equal(out[a:e], o1), f"doc {i}: out differs"
        assert torch.equal(lse[:, a:e], l1), f"doc {i}: lse differs"
        nbd = b1.shape[-1]
        assert torch.equal(bl[:, a:e, :nbd], b1), f"doc {i}: block_logit differs"
        assert torch.isneginf(bl[:, a:e, nbd:]).all(), f"doc {i}: blocks past the document not -inf"
        _, _, bl_ref = _ref().attention_ref(q[None, a:e], k[None, a:e], v[None, a:e], causal=causal,
                                            block_size=bs)
        check_block_logit(b1, bl_ref[0])


@pytest.mark.parametrize("case", ["full", "causal", "window", "sq-gt-sk"])
def test_sentinel_buffer_fully_overwritten(case):
    """A poisoned buffer (sentinel / NaN) ends bitwise equal to a -inf-filled one: no pre-fill needed."""
    sq, sk = (512, 300) if case == "sq-gt-sk" else (640, 640)
    q, k, v = make_qkv(1, sq, sk, 2, 2, 128, seed=8)
    kw = dict(causal=case in ("causal", "sq-gt-sk"), window=(96, 0) if case == "window" else (-1, -1))
    _, _, a = run_ours(q, k, v, block_size=32, fill=SENTINEL, **kw)
    _, _, bnan = run_ours(q, k, v, block_size=32, fill=float("nan"), **kw)
    _, _, c = run_ours(q, k, v, block_size=32, fill=float("-inf"), **kw)
    assert not (a == SENTINEL).any() and not torch.isnan(bnan).any()
    assert torch.equal(a, c) and torch.equal(bnan, c)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_out_rows_past_the_sequence_untouched(d):
    """Note [staged O epilogue]: the last query tile's TMA box reaches past Sq (130 = 128 + 2 rows; 192-row
    tiles at d 64); it must be clipped at the tensor's extent. out is the head of a larger SENTINEL storage:
    what follows it stays untouched and out equals a plainly allocated one's."""
    q, k, v = make_qkv(1, 130, 130, 2, 2, d, seed=14)
    ref, lse_ref, _ = run_ours(q, k, v, causal=True)
    tail = 192 * 2 * d  # one tile of rows past the end
    got, lse, _ = run_ours(q, k, v, causal=True, out_tail=tail)
    assert torch.equal(got, ref) and torch.equal(lse, lse_ref)
    storage = torch.empty(0, device=got.device, dtype=got.dtype).set_(got.untyped_storage())
    assert bool((storage[got.numel():] == SENTINEL).all()), "the O store wrote past the sequence"


@pytest.mark.parametrize("offset", [1, 2, 3], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("case", ["causal", "window"])
def test_underaligned_block_logit_buffer(case, offset):
    """A block_logit buffer that is only 4-byte aligned (rows not 16-byte aligned) gets the same values
    as an aligned one, and nothing before it is written (the -inf fill falls back to scalar stores)."""
    q, k, v = make_qkv(1, 640, 640, 2, 2, 128, seed=12)
    kw = dict(causal=case == "causal", window=(96, 0) if case == "window" else (-1, -1))
    _, _, ref = run_ours(q, k, v, block_size=16, **kw)
    _, _, got = run_ours(q, k, v, block_size=16, bl_offset=offset, **kw)
    assert got.data_ptr() % 16 != 0
    assert torch.equal(got, ref)
    storage = torch.empty(0, device=got.device, dtype=got.dtype).set_(got.untyped_storage())
    assert bool((storage[:offset] == SENTINEL).all()), "block_logit wrote before its buffer"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 256])
def test_out_lse_bit_identical_with_without_block_logit(d, causal):
    q, k, v = make_qkv(1, 700, 700, 4, 4, d, seed=9)
    o0, l0, _ = run_ours(q, k, v, causal=causal, block_size=0)
    for bs in (64, 256):
        o1, l1, _ = run_ours(q, k, v, causal=causal, block_size=bs)
        assert torch.equal(o0, o1), f"out changed by block_logit (block_size={bs})"
        assert torch.equal(l0, l1), f"lse changed by block_logit (block_size={bs})"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_self_consistency(causal):
    """max of two 64-blocks == the 128-block (bit-exact); max_j block_logit <= lse; run-to-run bitwise."""
    q, k, v = make_qkv(2, 600, 777, 4, 4, 128, seed=10)
    _, lse, b64 = run_ours(q, k, v, causal=causal, block_size=64)
    _, _, b128 = run_ours(q, k, v, causal=causal, block_size=128)
    nb128 = b128.shape[-1]
    pad = 2 * nb128 - b64.shape[-1]
    b64p = torch.nn.functional.pad(b64, (0, pad), value=float("-inf"))
    paired = b64p.view(*b64.shape[:-1], nb128, 2).amax(-1)
    assert torch.equal(paired, b128)
    row_max = b64.amax(-1)
    fin = torch.isfinite(row_max)
    assert bool((row_max[fin] <= lse[fin] + 1e-5 * lse[fin].abs() + 1e-6).all())
    assert torch.equal(torch.isneginf(row_max), torch.isneginf(lse))
    o_a, l_a, b_a = run_ours(q, k, v, causal=causal, block_size=64)
    o_b, l_b, b_b = run_ours(q, k, v, causal=causal, block_size=64)
    assert torch.equal(o_a, o_b) and torch.equal(l_a, l_b) and torch.equal(b_a, b_b)


def test_nondefault_stream():
    """The launcher runs on torch's current stream (TVM-FFI env stream): inputs become valid and
    results are read only on a busy side stream (tests/gpu/_streams.py)."""
    from tests.gpu._streams import side_stream_run

    q, k, v = make_qkv(1, 256, 256, 2, 2, 128, seed=11)
    ref = run_ours(q, k, v, causal=True, block_size=64)
    got = side_stream_run((q, k, v), lambda *qkv: run_ours(*qkv, causal=True, block_size=64),
                          poison=(float("nan"),) * 3)
    for a, b in zip(ref, got):
        assert torch.equal(a.cpu(), b)


def test_stream_harness_catches_a_default_stream_launch():
    """The control of test_nondefault_stream: the same launch forced onto the default stream must
    give a different answer in that harness, or the harness could not catch a wrong stream."""
    from tests.gpu._streams import on_default_stream, side_stream_run

    q, k, v = make_qkv(1, 256, 256, 2, 2, 128, seed=11)
    ref = run_ours(q, k, v, causal=True, block_size=64)
    got = side_stream_run((q, k, v), on_default_stream(lambda *qkv: run_ours(*qkv, causal=True, block_size=64)),
                          poison=(float("nan"),) * 3)
    assert not all(torch.equal(a.cpu(), b) for a, b in zip(ref, got))

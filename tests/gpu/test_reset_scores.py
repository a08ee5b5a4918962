"""h2o.reset_scores on the H200 through the compiled launcher (torch tensors), vs a numpy oracle.

This file also proves the binding layer end to end: one compile per config, the TVM-FFI callable
taking torch tensors, launching on torch's current stream.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import torch_cuda_arch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch_cuda_arch() is None or torch_cuda_arch() < 90,
                       reason="needs a CUDA GPU with compute capability >= 9.0"),
]


def _oracle(state: np.ndarray, slots: np.ndarray) -> np.ndarray:
    out = state.copy()
    num_pages, _, page_size = state.shape
    for s in slots:
        if 0 <= s < num_pages * page_size:
            out[s // page_size, :, s % page_size] = 0
    return out


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hkv,page_size", [(8, 16), (1, 1), (3, 64)], ids=["h8p16", "h1p1", "h3p64"])
def test_reset_scores_matches_oracle(state_dtype, hkv, page_size):
    from cute_kernels.h2o.launch import run_reset_scores

    gen = np.random.default_rng(0)
    num_pages = 37
    n_slots = num_pages * page_size
    state_np = gen.uniform(1, 9, size=(num_pages, hkv, page_size)).astype(np.float32)
    # valid slots, padding (-1) and out-of-range slots that must touch nothing
    slots_np = np.concatenate([gen.choice(n_slots, size=min(11, n_slots), replace=False),
                               [-1, -7, n_slots, n_slots + 5]]).astype(np.int32)
    dt = getattr(torch, state_dtype)
    state = torch.from_numpy(state_np).to("cuda", dt)
    expected = _oracle(state.float().cpu().numpy(), slots_np)
    run_reset_scores(state, torch.from_numpy(slots_np).cuda())
    torch.cuda.synchronize()
    np.testing.assert_array_equal(state.float().cpu().numpy(), expected)


def test_reset_scores_runs_on_current_stream_and_caches_compile():
    """State and slots become valid, and the state is read back, only on a busy side stream
    (tests/gpu/_streams.py): a launch on another stream zeroes nothing of the real state."""
    from cute_kernels.h2o.launch import compile_reset_scores, run_reset_scores

    from tests.gpu._streams import side_stream_run

    state = torch.full((4, 2, 8), 7.5, device="cuda")
    slots = torch.tensor([3, 9], dtype=torch.int32, device="cuda")
    before = compile_reset_scores.cache_info()["entries"]

    def launch(st, sl):
        run_reset_scores(st, sl)
        return st

    (got,) = side_stream_run((state, slots), launch, poison=(1.0, -1))
    (again,) = side_stream_run((state, slots), launch, poison=(1.0, -1))
    assert compile_reset_scores.cache_info()["entries"] - before <= 1
    for out in (got.numpy(), again.numpy()):
        assert out[0, :, 3].tolist() == [0, 0] and out[1, :, 1].tolist() == [0, 0]
        assert (out == 0).sum() == 4 and (out == 7.5).sum() == out.size - 4


def test_wrong_dtype_rejected_by_tvm_ffi_before_launch():
    from cute_kernels.h2o.launch import compile_reset_scores
    from cute_kernels.h2o.reset_scores import ResetScoresConfig

    fn = compile_reset_scores(ResetScoresConfig(arch=90, state_dtype="float32", num_kv_heads=2))
    state = torch.zeros((4, 2, 8), device="cuda")
    with pytest.raises(Exception):
        fn(state, torch.zeros(3, dtype=torch.int64, device="cuda"))

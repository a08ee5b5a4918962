"""SM100 (Blackwell) FlashMask: the SM90 GPU file's tests (tests/gpu/test_flashmask.py) on an SM10x GPU.

    python -m pytest tests/sm100/test_flashmask_sm100.py -q     # skips, with the reason, elsewhere

The tests drive ``run_fwd`` / ``run_bwd`` with torch tensors and build their configs for the GPU's own
compute capability, so the same checks (every mask type and layout, 4-column masks included, Sq != Sk,
mask heads, empty rows, window, block_logit, causal-as-startend bitwise, document == varlen, hidden
NaN keys, the backward and its bitwise determinism) run against FlashFwdSm100 / FlashBwdSm100 here.
Nothing here has been run: no Blackwell GPU was available when it was written (docs/sm100.md).
"""

from __future__ import annotations

import pytest

from tests.conftest import torch_cuda_arch

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

_arch = torch_cuda_arch()
pytestmark = [pytest.mark.sm100, pytest.mark.skipif(_arch is None or _arch // 10 != 10,
                                                    reason="needs an SM10x (Blackwell) GPU")]

from tests.gpu.test_flashmask import (  # noqa: E402,F401  (collected here under this file's marks)
    _no_tf32, test_backward_deterministic_bitwise, test_backward_mask_heads,
    test_backward_random_masks_sq_ne_sk, test_backward_rows_and_keys_without_partner, test_backward_user_masks,
    test_block_logit, test_causal_mask_as_startend_equals_causal_kernel, test_document_mask_equals_varlen,
    test_empty_rows_and_query_tiles, test_mask_heads, test_nan_in_partial_tiles_does_not_leak,
    test_nan_in_skipped_key_tiles_does_not_leak,
    test_random_masks_sq_ne_sk, test_user_masks, test_window_and_mask)

"""NaN / Inf in keys and values a row cannot see on the SM100 kernels (Notes [scrubbed value tiles, SM100] in
fwd_sm100.py and [scrubbed K / V, SM100] in bwd_sm100.py): the cases and checks of
tests/gpu/test_invisible_nan.py (far and near geometries, causal and window, poisoned k or v, NaN and +Inf,
forward and deterministic backward; rows and keys that cannot see a poisoned key unchanged and finite, rows that
see one non-finite), driven through torch on a compute-capability 10.0 / 10.3 GPU.

    python -m pytest tests/sm100/test_invisible_nan_sm100.py -q   # skips without such a GPU and torch

Nothing here has been run: no Blackwell GPU was available when it was written (the SM90 cases pass on an H100).
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import torch_cuda_arch
from tests.sm100.conftest import SM100_BUILDS

pytestmark = [pytest.mark.sm100,
              pytest.mark.skipif(torch_cuda_arch() not in SM100_BUILDS,
                                 reason="needs a compute-capability-10.0 (B200) or 10.3 (B300) GPU through torch: "
                                        "the kernels are sm_100a / sm_103a builds, which load only there")]

pytest.importorskip("torch", reason="drives the SM100 launchers with torch tensors")
from tests.gpu.test_invisible_nan import CASES, check_inf_d, check_invisible  # noqa: E402


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("mask,where,poisoned,direction", CASES)
def test_invisible_keys_never_reach_a_row_sm100(mask, where, poisoned, direction, value):
    check_invisible(mask, where, poisoned, direction, value, torch_cuda_arch())


def test_inf_out_rows_keep_masked_gradients_clean_sm100():
    check_inf_d(torch_cuda_arch())

"""The scrub rule of the dense kernels (cute_kernels/common/nonfinite.py), checked on the CPU.

``scrub_rows`` tests a 32-bit word of two bf16 / fp16 halves with ``((w & e) + one) & 0x80008000`` and zeroes
the halves it flags. Every 16-bit pattern, in either half and next to every class of the other half, must be
flagged exactly when it is Inf or NaN, and the zeroing must leave the other half alone. The kernel-level
behaviour (rows that cannot see a poisoned key stay exact, rows that can see it stay non-finite) is
tests/gpu/test_invisible_nan.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cutlass = pytest.importorskip("cutlass")

from cute_kernels.common import nonfinite as nf  # noqa: E402


def _swar(words: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flag bits, scrubbed words) as the kernel computes them, on uint32 numpy words."""
    e, one = nf.pair_constants(dtype)
    h = ((words & np.uint32(e)) + np.uint32(one)) & np.uint32(0x80008000)
    keep = ~((h >> np.uint32(15)) * np.uint32(0xFFFF))
    return h, words & keep


@pytest.mark.parametrize("dtype,np_dtype", [(cutlass.BFloat16, "bfloat16"), (cutlass.Float16, np.float16)])
def test_swar_flags_exactly_inf_and_nan(dtype, np_dtype):
    patterns = np.arange(1 << 16, dtype=np.uint32)
    if np_dtype == "bfloat16":  # bf16 = the top half of an fp32
        values = (patterns << np.uint32(16)).view(np.float32)
    else:
        values = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
    nonfinite = ~np.isfinite(values)
    assert nonfinite.sum() == (2 * ((1 << (7 if np_dtype == "bfloat16" else 10)) - 1) + 2)  # +-Inf, NaNs
    # the other half: zero, a finite value, +Inf, a NaN (an exponent-all-ones neighbour must not carry over)
    e = nf.exponent_mask(dtype)
    for other in (0x0000, 0x3C00, e, e | 1, 0xFFFF):
        for shift, other_shift in ((0, 16), (16, 0)):
            words = (patterns << np.uint32(shift)) | np.uint32(other << other_shift)
            h, scrubbed = _swar(words, dtype)
            mine = (h >> np.uint32(shift + 15)) & np.uint32(1)
            assert np.array_equal(mine.astype(bool), nonfinite)
            theirs = (h >> np.uint32(other_shift + 15)) & np.uint32(1)
            other_bad = (other & e) == e
            assert np.all(theirs.astype(bool) == other_bad)
            kept_mine = (scrubbed >> np.uint32(shift)) & np.uint32(0xFFFF)
            assert np.array_equal(kept_mine, np.where(nonfinite, 0, patterns))
            kept_other = (scrubbed >> np.uint32(other_shift)) & np.uint32(0xFFFF)
            assert np.all(kept_other == (0 if other_bad else other))


def test_threads_per_row_layouts():
    bf16 = cutlass.BFloat16
    assert nf.threads_per_row(128, 128, 32, bf16) == 1  # forward scrub warp, 128-key tiles
    assert nf.threads_per_row(64, 256, 32, bf16) == 1
    assert nf.threads_per_row(128, 128, 256, bf16) == 2  # backward, both consumer WGs
    assert nf.threads_per_row(64, 256, 256, bf16) == 4
    assert nf.threads_per_row(128, 96, 256, bf16) == 2
    with pytest.raises(AssertionError):
        nf.threads_per_row(128, 8, 512, bf16)  # one 16-byte chunk cannot be shared by 4 threads


def test_nan_seen_halves_poisons_exactly_the_seen_flagged_keys():
    """The SM100 forward's P poison (nf.nan_seen_halves, Note [scrubbed value tiles, SM100]): a half becomes NaN
    exactly when its key's bit is set and the half is not +-0 (a NaN P stays NaN); the other half is untouched.
    Every 16-bit pattern in either half, next to a zero, a finite and a NaN neighbour, with every flag pair."""
    u32 = np.uint32
    patterns = np.arange(1 << 16, dtype=np.uint32)
    nonzero = (patterns & u32(0x7FFF)) != 0
    for other in (0x0000, 0x8000, 0x3C00, 0x7FC0):
        for shift, other_shift in ((0, 16), (16, 0)):
            words = (patterns << u32(shift)) | u32(other << other_shift)
            for bits in range(8):  # bit 2 must be ignored
                out = nf.nan_seen_halves(words, u32(bits), u32)
                mine_flag = (bits >> (shift // 16)) & 1
                other_flag = (bits >> (other_shift // 16)) & 1
                mine = (out >> u32(shift)) & u32(0xFFFF)
                want = np.where(nonzero & bool(mine_flag), 0x7FFF, patterns)
                assert np.array_equal(mine, want), (other, shift, bits)
                theirs = (out >> u32(other_shift)) & u32(0xFFFF)
                other_seen = (other & 0x7FFF) != 0 and other_flag
                assert np.all(theirs == (0x7FFF if other_seen else other)), (other, shift, bits)
    # 0x7FFF is a NaN in both 16-bit formats
    assert np.isnan(np.array([0x7FFF], np.uint16).view(np.float16)[0])
    assert np.isnan(np.array([0x7FFF0000], np.uint32).view(np.float32)[0])

"""Host launchers of the H2O kernels: compiled once per config, called with any DLPack tensor.

Each ``run_*`` takes out-parameters (in-place state) and launches on the caller's current stream.
Arguments were validated by the Paddle layer (or the test); only internal invariants are asserted.
"""

from __future__ import annotations

from cute_kernels import arch as _arch
from cute_kernels.dtypes import cutlass_dtype, dtype_name
from cute_kernels.jit_cache import jit_cache

from .reset_scores import ResetScores, ResetScoresConfig


@jit_cache
def compile_reset_scores(cfg: ResetScoresConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import compile_options, fake_stream, fake_tensor, sym

    state = fake_tensor(cutlass_dtype(cfg.state_dtype), (sym(), cfg.num_kv_heads, sym()), align_bytes=4)
    slots = fake_tensor(cutlass.Int32, (sym(),), align_bytes=4)
    return cute.compile(ResetScores(cfg), state, slots, fake_stream(),
                        options=compile_options(f"--gpu-arch {_arch.arch_name(cfg.arch)}"))


def run_reset_scores(state, slot_mapping, *, arch: int | None = None) -> None:
    """Zero ``state[page, :, off]`` for every valid flat slot in ``slot_mapping`` (in place)."""
    if slot_mapping.shape[0] == 0 or state.shape[0] == 0:
        return
    arch = _arch.family(arch if arch is not None else _arch.device_arch())
    cfg = ResetScoresConfig(arch=arch, state_dtype=dtype_name(state.dtype), num_kv_heads=int(state.shape[1]))
    compile_reset_scores(cfg)(state, slot_mapping)


# Configs compiled by ``python -m cute_kernels.check`` (and in CI for both archs).
def config_matrix(arch: int, full: bool = False):
    heads = (1, 2, 8) if full else (8,)
    return [ResetScoresConfig(arch=arch, state_dtype=dt, num_kv_heads=h)
            for dt in ("float32", "bfloat16") for h in heads]


CHECKS = {
    "h2o_reset_scores": (config_matrix, compile_reset_scores, lambda cfg: 0),
}

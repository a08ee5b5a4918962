"""CuTe backend of ``paddle_fa4.h2o``."""

from __future__ import annotations

from .._bridge import arch_of, kernel_arg


def unsupported_reason(arch: int, op: str, **_) -> str | None:
    return None if op == "reset_scores" else f"no CuTe kernel for h2o.{op} yet"


def reset_scores(state, slot_mapping) -> None:
    from cute_kernels.h2o.launch import run_reset_scores

    run_reset_scores(kernel_arg(state), kernel_arg(slot_mapping), arch=arch_of(state))

"""Every kernel family that ``python -m cute_kernels.check`` compiles.

Each entry names a launch module exposing, per kernel name in its ``CHECKS`` dict, a triple
``(config_matrix(arch, full) -> [cfg], compile(cfg) -> compiled, smem_bytes(cfg) -> int | None)``.
A kernel issue adds its module here the day its kernel lands, so CI compiles it for both archs.
"""

from __future__ import annotations

import importlib

LAUNCH_MODULES = (
    "cute_kernels.attention.launch",
    "cute_kernels.attention.bwd_launch",
    "cute_kernels.attention.fm_meta",
    "cute_kernels.block_sparse.launch",
    "cute_kernels.decode.launch",
    "cute_kernels.h2o.launch",
    "cute_kernels.indexed.launch",
    "cute_kernels.select.launch",
)


def all_checks() -> dict:
    """``{kernel_name: (config_matrix, compile, smem_bytes)}`` over every launch module."""
    checks: dict = {}
    for mod_name in LAUNCH_MODULES:
        mod = importlib.import_module(mod_name)
        for name, entry in mod.CHECKS.items():
            if name in checks:
                raise RuntimeError(f"kernel name {name!r} registered twice")
            checks[name] = entry
    return checks

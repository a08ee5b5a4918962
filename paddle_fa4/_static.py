"""Every public op under ``paddle.jit.to_static`` (docs/api.md, "Static graph").

The CuTe kernels are Python-JIT functions that need real device buffers, and the reference backend
is eager Paddle code with host-side decisions, so an op cannot become part of a static program:

* SOT mode (``to_static``'s default, ``full_graph=False``): SOT would translate every Python frame
  below the call, cutlass' included, and dies there. ``install_sot_graph_break`` (run when
  ``paddle_fa4`` is imported) adds this package's, ``cute_kernels``' and cutlass' directories to
  SOT's skip list, so SOT breaks the graph around each op and runs it eagerly: results are those of
  eager mode. The skip list is a Paddle-internal API (``paddle.jit.sot``); where it is missing the
  hook does nothing and SOT falls back as it would without it.
* ``full_graph=True`` (AST mode): ``dynamic_only`` marks each public op ``not_to_static`` and raises
  ``NotImplementedError`` naming the op and what to do instead when it is reached without dynamic
  mode (its inputs are then symbolic ``Value``s).
"""

from __future__ import annotations

import functools
import importlib.util
import os

_INSTALLED = False


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "")


def install_sot_graph_break() -> bool:
    """Make SOT run every op of this package eagerly between graph breaks; True when installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from paddle.jit.sot.opcode_translator import skip_files
    except Exception:  # no Paddle, or a Paddle without SOT's skip list
        return False
    dirs = [d for d in map(_package_dir, ("paddle_fa4", "cute_kernels", "cutlass")) if d]
    try:
        skip_files.skip_file_names.update(dirs)
        skip_files.setup_skip_files()
    except Exception:
        return False
    _INSTALLED = True
    return True


def dynamic_only(op: str):
    """Decorator of a public op: never converted by ``to_static``; a clear error in a static graph."""

    def wrap(fn):
        @functools.wraps(fn)
        def op_call(*args, **kwargs):
            import paddle

            if not paddle.in_dynamic_mode():
                raise NotImplementedError(
                    f"{op}: paddle.jit.to_static(full_graph=True) is not supported (the op runs eager "
                    f"kernels on real buffers, so it cannot be part of a static program); use "
                    f"to_static's default SOT mode (full_graph=False), which runs {op} eagerly between "
                    f"graph breaks, or call it outside to_static")
            return fn(*args, **kwargs)

        try:
            import paddle

            return paddle.jit.not_to_static(op_call)
        except (ImportError, AttributeError):
            return op_call

    return wrap

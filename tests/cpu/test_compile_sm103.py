"""Every kernel compiles for sm_103a (B300 / GB300, CC 10.3) without a GPU: the CI smoke of that target.

``python -m cute_kernels.check --arch sm_103a --kernel <name> --limit 2`` per registered kernel: the
first two configs of its default matrix (the sm_100a tests compile the rest of the SM100 code paths;
the 10.3 build differs in its target and, in the forward, in ``arch.exp2_emulation``). The whole
default matrix is ``python -m cute_kernels.check --arch sm_103a``.
"""

from __future__ import annotations

import pytest

from tests.cpu._check_cli import run_check

LIMIT = 2


def _kernels() -> list[str]:
    """Registered kernels with configs for 10.3 (a kernel without an SM100 version has none)."""
    from cute_kernels.registry import all_checks

    return sorted(name for name, (matrix, _, _) in all_checks().items() if matrix(103, False))


@pytest.mark.compile
@pytest.mark.parametrize("kernel", _kernels())
def test_kernel_compiles_for_sm103(tmp_path, kernel):
    from cute_kernels.registry import all_checks

    rows = run_check(tmp_path, "sm_103a", kernel, "--limit", str(LIMIT), timeout=3600)
    assert len(rows) == min(LIMIT, len(all_checks()[kernel][0](103, False)))
    assert all("arch=103" in r["config"] for r in rows)

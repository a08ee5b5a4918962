"""common/barriers.py: the trace-time arrival rule both SM100 attention kernels follow (no GPU, no compile)."""

from __future__ import annotations

from enum import IntEnum
from types import SimpleNamespace

import pytest
from cutlass.pipeline import PipelineOp

from cute_kernels.common.barriers import ArrivalCountError, check_arrivals, pipeline_counts


class _Bar(IntEnum):
    Both = 1


ROLES = {"a": 128, "b": 128, "mma": 1}
PIPES = {"x": ("mma", ("a", "b")), "y": ("a", "b")}
BARRIERS = {_Bar.Both: ("a", "b")}


def _check(counts, named):
    check_arrivals(counts, named, pipes=PIPES, barriers=BARRIERS, role_threads=ROLES)


def test_counts_equal_to_the_roles_pass_and_every_mismatch_is_named():
    good = {"x": (1, 256), "y": (128, 128)}
    _check(good, {_Bar.Both: 256})
    with pytest.raises(ArrivalCountError, match=r"pipeline x: arrival counts \(1, 128\) != role threads \(1 mma, 256 a\+b\)"):
        _check(dict(good, x=(1, 128)), {_Bar.Both: 256})
    with pytest.raises(ArrivalCountError, match="pipeline y"):
        _check(dict(good, y=(129, 128)), {_Bar.Both: 256})
    with pytest.raises(ArrivalCountError, match="named barrier Both: 128 threads != 256"):
        _check(good, {_Bar.Both: 128})


def test_an_unchecked_edge_is_an_error():
    with pytest.raises(ArrivalCountError, match="pipeline y: declared but"):
        _check({"x": (1, 256)}, {_Bar.Both: 256})
    with pytest.raises(ArrivalCountError, match="named barrier Both: declared but"):
        _check({"x": (1, 256), "y": (128, 128)}, {})


def _pipe(full, empty):
    return SimpleNamespace(sync_object_full=SimpleNamespace(op_type=full[0], arrive_count=full[1]),
                           sync_object_empty=SimpleNamespace(op_type=empty[0], arrive_count=empty[1]))


def test_pipeline_counts_reads_the_initialised_counts_and_rejects_multi_arrival_hardware_sides():
    assert pipeline_counts("s", _pipe((PipelineOp.TCGen05Mma, 1), (PipelineOp.AsyncThread, 256))) == (1, 256)
    assert pipeline_counts("q", _pipe((PipelineOp.TmaLoad, 1), (PipelineOp.TCGen05Mma, 1))) == (1, 1)
    with pytest.raises(ArrivalCountError, match="pipeline q: full barrier is signalled by TmaLoad"):
        pipeline_counts("q", _pipe((PipelineOp.TmaLoad, 32), (PipelineOp.TCGen05Mma, 1)))
    with pytest.raises(ArrivalCountError, match="pipeline o: empty barrier is signalled by TCGen05Mma"):
        pipeline_counts("o", _pipe((PipelineOp.AsyncThread, 128), (PipelineOp.TCGen05Mma, 128)))

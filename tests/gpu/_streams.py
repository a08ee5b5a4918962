"""A harness in which a launch on the wrong stream gives a wrong answer (not just a slow one).

``side_stream_run`` makes a fresh side stream busy (``torch.cuda._sleep``) before the host launches,
gives the inputs their values only after that sleep, on that stream (until then they hold a
poison), launches, and copies the results to the host on that stream too. A kernel launched on the
default (or any other) stream runs at once on the poisoned inputs, and its outputs may be copied
back before it finishes: either way the result differs from the oracle's.
``test_stream_harness_catches_a_default_stream_launch`` in test_fwd_sm90.py checks exactly that.
"""

from __future__ import annotations

import torch

#: ~0.1 s of GPU time at the H200's clocks: far longer than the host needs to launch everything.
SLEEP_CYCLES = 200_000_000


def side_stream_run(inputs, launch, poison, cycles: int = SLEEP_CYCLES):
    """``launch(*device_inputs) -> tensor | tuple`` on a busy side stream; returns host copies.

    ``inputs``: device tensors holding the real values (ready on the default stream);
    ``poison``: one fill value per input, what the kernel reads if it does not wait for the stream.
    """
    srcs = list(inputs)
    dev = [torch.full_like(t, p) for t, p in zip(srcs, poison)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        for d, src in zip(dev, srcs):
            d.copy_(src)
        outs = launch(*dev)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        host = [None if o is None else o.cpu() for o in outs]  # copied on the side stream
    torch.cuda.synchronize()
    return host


def on_default_stream(launch):
    """``launch`` forced onto the default stream: the wrong-stream launch the harness must catch."""
    def wrong(*args):
        with torch.cuda.stream(torch.cuda.default_stream()):
            return launch(*args)
    return wrong

"""Host cost per call of the Paddle ops' own path (validation, spec, ``paddle.empty`` outputs, PyLayer,
the CuTe glue and the launcher's Python), on a machine without a GPU.

    python bench/bench_host_paddle.py [--n 2000] [--repeats 5] [--json FILE]

Paddle with CUDA is not available where this project is developed, so the Paddle path cannot launch a
kernel here. This bench runs every line of it on CPU tensors up to the compiled kernel call, which it
replaces by a no-op: ``tensor_arch`` reports compute capability 90, so the ops take the CuTe backend,
the SM count query of the persistent kernels' grid reports that arch's default (132), and ``compile_fwd`` /
``compile_bwd_*`` return a stub instead of the compiled TVM-FFI function. What
the stub leaves out is the TVM-FFI call itself (DLPack of the arguments + the launch), which
bench_fwd.py / bench_bwd.py measure with torch tensors on a GPU (``host µs ours``); the ``dlpack``
row below times exporting the same Paddle tensors through ``__dlpack__``, the part of that call that
depends on the framework.

Shapes: B 1, S 128, 2 heads, head dim 128, bfloat16 (tiny, as in the GPU benches' host column).
Reported: microseconds per call, median and minimum of ``--repeats`` timings of ``--n`` back-to-back
calls.
Rows: ``fwd`` (no autograd), ``fwd_bl`` (with block_logit), ``fwd_grad`` (inputs need gradients: the
PyLayer records the call), ``bwd_op`` (the public ``flash_attn_bwd``), ``step`` (``fwd_grad`` + the
autograd backward of ``out.sum()``), ``dlpack`` (``__dlpack__`` of the 8 tensors a forward launch takes);
``block_sparse_attention`` (2 query heads over 1 kv head, 2 blocks of 64 per query): ``bs_plan``
(``block_sparse_plan``, once per selection), ``bs_fwd`` (d 128, ``plan=`` given), ``bs_step`` (inputs need
gradients + ``paddle.grad``), ``bs_latent_fwd`` / ``bs_latent_step`` (the absorbed-MLA latent, Dk 576 / Dv
512, ``v=None``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import cpu_us_per_call, write_host_rows  # noqa: E402


def _noop(*args, **kwargs):
    return None


@contextlib.contextmanager
def stubbed_launch(arch: int = 90):
    """Patch the arch query and the compiled kernels (see the module docstring); restored on exit."""
    import paddle_fa4._bridge as bridge
    import paddle_fa4.backend as backend
    from cute_kernels import arch as _arch
    from cute_kernels.attention import bwd_launch, launch

    from cute_kernels.block_sparse import launch as bs_launch

    saved = [(bridge, "tensor_arch"), (backend, "tensor_arch"), (_arch, "device_sm_count"), (launch, "compile_fwd"),
             (bwd_launch, "compile_bwd_main"), (bwd_launch, "compile_bwd_pre"), (bwd_launch, "compile_bwd_post"),
             (bs_launch, "compile_fwd"), (bs_launch, "compile_bwd_dq"), (bs_launch, "compile_bwd_dkdv")]
    old = [getattr(mod, name) for mod, name in saved]
    bridge.tensor_arch = backend.tensor_arch = lambda t: arch
    # the persistent kernels' grid (SM100, the SM90 latent forward) reads the device's SM count
    _arch.device_sm_count = lambda index: _arch.SM_COUNT_DEFAULT[_arch.family(arch)]
    launch.compile_fwd = lambda cfg, sm_count=None, trace=False: _noop
    bwd_launch.compile_bwd_main = bwd_launch.compile_bwd_pre = bwd_launch.compile_bwd_post = lambda cfg, *a, **k: _noop
    bs_launch.compile_fwd = bs_launch.compile_bwd_dq = bs_launch.compile_bwd_dkdv = lambda cfg, *a, **k: _noop
    try:
        yield
    finally:
        for (mod, name), value in zip(saved, old):
            setattr(mod, name, value)




def make_calls(paddle, pf):
    b, s, h, d = 1, 128, 2, 128

    def t(*shape, grad=False):
        x = paddle.randn(shape, dtype="float32").astype("bfloat16")
        x.stop_gradient = not grad
        return x

    q, k, v = t(b, s, h, d), t(b, s, h, d), t(b, s, h, d)
    qg, kg, vg = t(b, s, h, d, grad=True), t(b, s, h, d, grad=True), t(b, s, h, d, grad=True)
    out, lse = pf.flash_attn_fwd(q, k, v, causal=True, backend="cute")[:2]
    dout = t(b, s, h, d)
    args8 = [q, k, v, out, lse, paddle.empty([b, h, s, s // 64], dtype="float32"),
             paddle.zeros([2], dtype="int32"), paddle.zeros([2], dtype="int32")]

    def step():
        o = pf.flash_attn_fwd(qg, kg, vg, causal=True, backend="cute")[0]
        o.backward(dout)

    # block_sparse_attention, as tiny as the rows above (S 128, 2 query heads over 1 kv head, 2 blocks of 64
    # per query; ``plan=`` given, as the N sparse layers sharing a selection pass it): GQA d 128, and the
    # absorbed-MLA latent (v=None) at Dk 576 / Dv 512. Tiny, so that the CPU's own arithmetic in Paddle ops
    # (queued kernels on a GPU) stays small next to the Python.
    hq, hkv, topk = 2, 1, 2
    ids = paddle.randint(0, s // 64, [b, s, topk], dtype="int32")
    bq, bk, bv = t(b, s, hq, d), t(b, s, hkv, d), t(b, s, hkv, d)
    bqg, bkg, bvg = t(b, s, hq, d, grad=True), t(b, s, hkv, d, grad=True), t(b, s, hkv, d, grad=True)
    plan = pf.block_sparse_plan(ids, heads_per_kv=hq // hkv)
    lq, lk = t(b, s, hq, 576), t(b, s, hkv, 576)
    lqg, lkg = t(b, s, hq, 576, grad=True), t(b, s, hkv, 576, grad=True)
    bdout, ldout = t(b, s, hq, d), t(b, s, hq, 512)

    # paddle.grad, not .backward(): on CPU tensors the autograd engine's accumulation into .grad across the
    # timed calls is a real CPU add (ms at these sizes), which on a GPU would be one queued kernel
    def bs_step():
        o = pf.block_sparse_attention(bqg, bkg, bvg, ids, plan=plan, backend="cute")
        paddle.grad([o], [bqg, bkg, bvg], [bdout])

    def bs_latent_step():
        o = pf.block_sparse_attention(lqg, lkg, None, ids, dv=512, plan=plan, backend="cute")
        paddle.grad([o], [lqg, lkg], [ldout])

    return {
        "bs_plan": lambda: pf.block_sparse_plan(ids, heads_per_kv=hq // hkv),
        "bs_fwd": lambda: pf.block_sparse_attention(bq, bk, bv, ids, plan=plan, backend="cute"),
        "bs_step": bs_step,
        "bs_latent_fwd": lambda: pf.block_sparse_attention(lq, lk, None, ids, dv=512, plan=plan, backend="cute"),
        "bs_latent_step": bs_latent_step,
        "fwd": lambda: pf.flash_attn_fwd(q, k, v, causal=True, backend="cute"),
        "fwd_bl": lambda: pf.flash_attn_fwd(q, k, v, causal=True, block_size=64, return_block_logit=True,
                                            backend="cute"),
        "fwd_grad": lambda: pf.flash_attn_fwd(qg, kg, vg, causal=True, backend="cute"),
        "bwd_op": lambda: pf.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend="cute"),
        "step": step,
        "dlpack": lambda: [x.__dlpack__() for x in args8],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import paddle

    import paddle_fa4 as pf

    paddle.set_device("cpu")
    rows = {}
    with stubbed_launch():
        calls = make_calls(paddle, pf)
        for name, fn in calls.items():
            rows[name] = cpu_us_per_call(fn, args.n, args.repeats)
            print(f"{name:9s} {rows[name]['median']:8.1f} us per call (min {rows[name]['min']:.1f})", flush=True)
    write_host_rows(args.json, rows, argv, args.n, args.repeats, paddle=paddle.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host cost per call of the decode path's Python (launcher, CuTe glue, public op), on a machine without a GPU.

    python bench/host_decode.py [--n 2000] [--repeats 7] [--json FILE] [--rows launcher,glue,op]

Every line of the path runs up to the compiled TVM-FFI function, which is replaced by a no-op:
``compile_decode`` / ``compile_decode_step`` (the split kernel + combine entry) / ``compile_combine`` return a stub, the tensors' arch reads as 90 after one place
query (so the ops take the CuTe backend) and the SM count as the H100's 132. What the stub leaves out is the TVM-FFI call itself
(DLPack of the arguments, their checks, the launch): ``python bench/bench_decode.py --host-n 100`` measures
the launcher with it, on a GPU with torch tensors.

Rows (B 1, Sq 1, Hq/Hkv 32/8, d 128, hnd P 16, 16 pages; the dense form ``[B, n]`` table / ``[B]`` lengths):

* ``launcher`` / ``launcher_split`` / ``launcher_sparse``: ``run_decode`` unsplit, split in 4 (one entry launches the split kernel and the combine), and
  with a per-kv-head ``[B, Hkv, n]`` table; the tensors are numpy arrays (DLPack-capable, a tuple ``shape``
  as cheap as torch's), standing in for the torch tensors of the GPU measurement.
* ``splits``: ``choose_num_splits`` (what ``num_splits=None`` costs on top of the launcher).
* ``glue`` / ``glue_auto``: ``paddle_fa4._cute.decode.decode_fwd`` with Paddle CPU tensors (output and
  partial allocations included), ``num_splits=1`` and ``None``.
* ``op``: the public ``flash_attn_with_kvcache(..., backend="cute")``, validation included; the host-value
  checks that read a CPU tensor back (lengths, page ids) are skipped as on a GPU tensor.

Reported: microseconds per call, median and minimum of ``--repeats`` timings of ``--n`` back-to-back calls.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import cpu_us_per_call, write_host_rows  # noqa: E402

B, HQ, HKV, D, P, PAGES = 1, 32, 8, 128, 16, 16


def _noop(*args, **kwargs):
    return None


@contextlib.contextmanager
def stubbed(arch: int = 90):
    """Patch the compiled decode kernels, the arch and SM count queries and the host-value reads; restored on exit."""
    import paddle_fa4._bridge as bridge
    import paddle_fa4._validate as validate
    import paddle_fa4.backend as backend
    from cute_kernels import arch as _arch
    from cute_kernels.decode import launch

    from paddle_fa4._cute import decode as glue

    saved = [(bridge, "tensor_arch"), (backend, "tensor_arch"), (_arch, "device_sm_count"), (validate, "host_values"),
             (launch, "compile_decode"), (launch, "compile_combine"), (launch, "compile_decode_step")]
    if hasattr(glue, "device_of"):
        saved.append((glue, "device_of"))
    old = [getattr(mod, name) for mod, name in saved]
    # the arch queries keep their one place query (what they cost on a GPU tensor), then answer `arch`
    bridge.tensor_arch = backend.tensor_arch = lambda t: (t.place.is_gpu_place(), arch)[1]
    if hasattr(glue, "device_of"):
        def device_of(t):  # the real one's place query, then arch 90 on device 0
            place = t.place
            place.is_gpu_place()
            return arch, 0, place

        glue.device_of = device_of
    _arch.device_sm_count = lambda index: 132
    validate.host_values = lambda t: None  # as for a GPU tensor: never read back
    launch.compile_decode = launch.compile_combine = launch.compile_decode_step = lambda cfg: _noop
    from cute_kernels import jit_cache

    memos = [m for m in (jit_cache._FAST, getattr(glue, "_PLANS", None)) if m is not None]
    kept = [dict(m) for m in memos]  # the stubs must not outlive the block in the launch memos
    for m in memos:
        m.clear()
    try:
        yield
    finally:
        for (mod, name), value in zip(saved, old):
            setattr(mod, name, value)
        for m, k in zip(memos, kept):
            m.clear()
            m.update(k)




def launcher_calls():
    import numpy as np

    from cute_kernels.decode import launch as L

    f16, f32, i32 = np.float16, np.float32, np.int32
    q = np.zeros((B, 1, HQ, D), f16)
    k = np.zeros((B * PAGES, HKV, P, D), f16)
    v = np.zeros_like(k)
    seq = np.full((B,), P * PAGES, i32)
    table = np.arange(B * PAGES, dtype=i32).reshape(B, PAGES)
    seq_h = np.repeat(seq[:, None], HKV, 1)
    table_h = np.repeat(table[:, None], HKV, 1)
    out = np.zeros_like(q)
    lse = np.zeros((B, HQ, 1), f32)
    o_shape, l_shape = L.partial_shapes(q, 4)
    o_part, lse_part = np.zeros(o_shape, f32), np.zeros(l_shape, f32)
    scale = D ** -0.5

    def run(s, t, op=None, lp=None):
        L.run_decode(q, k, v, s, t, out, lse, None, op, lp, layout="hnd", softmax_scale=scale, window_left=-1,
                     window_right=0, arch=90)

    return {
        "launcher": lambda: run(seq, table),
        "launcher_split": lambda: run(seq, table, o_part, lse_part),
        "launcher_sparse": lambda: run(seq_h, table_h),
        "splits": lambda: L.choose_num_splits(q, k, table_h, layout="hnd", sm_count=132),
    }


def paddle_calls(glue_form: str = "dense"):
    import paddle

    import paddle_fa4 as pf
    from paddle_fa4._cute import decode as glue

    paddle.set_device("cpu")
    q = paddle.zeros([B, 1, HQ, D], dtype="bfloat16")
    k = paddle.zeros([B * PAGES, HKV, P, D], dtype="bfloat16")
    v = paddle.zeros([B * PAGES, HKV, P, D], dtype="bfloat16")
    seq = paddle.full([B], P * PAGES, dtype="int32")
    table = paddle.arange(B * PAGES, dtype="int32").reshape([B, PAGES])
    scale = D ** -0.5
    g_seq, g_table = seq, table
    if glue_form == "per_head":  # the glue's input before the dense form was passed through (compact copies)
        g_seq = seq.reshape([B, 1]).expand([B, HKV]).clone()
        g_table = table.reshape([B, 1, PAGES]).expand([B, HKV, PAGES]).clone()

    def g(splits):
        glue.decode_fwd(q, k, v, g_seq, g_table, layout="hnd", softmax_scale=scale, causal=True, window_left=-1,
                        window_right=0, softcap=0.0, num_splits=splits, return_lse=False, block_logit_size=None)

    return {
        "glue": lambda: g(1),
        "glue_auto": lambda: g(None),
        "op": lambda: pf.flash_attn_with_kvcache(q, k, v, seq, block_table=table, num_splits=1, backend="cute"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="launcher,glue,op", help="row groups: launcher (numpy), glue and op (paddle)")
    ap.add_argument("--glue-form", default="dense", choices=("dense", "per_head"),
                    help="index tensors handed to the glue rows (per_head: [B, Hkv] / [B, Hkv, n], the old contract)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    groups = set(args.rows.split(","))
    rows = {}
    with stubbed():
        calls = dict(launcher_calls()) if "launcher" in groups else {}
        if groups & {"glue", "op"}:
            calls.update({n: f for n, f in paddle_calls(args.glue_form).items() if n.split("_")[0] in groups})
        for name, fn in calls.items():
            rows[name] = cpu_us_per_call(fn, args.n, args.repeats)
            print(f"{name:16s} {rows[name]['median']:8.2f} us per call (min {rows[name]['min']:.2f})", flush=True)
    write_host_rows(args.json, rows, argv, args.n, args.repeats, python=platform.python_version())
    return 0


if __name__ == "__main__":
    sys.exit(main())

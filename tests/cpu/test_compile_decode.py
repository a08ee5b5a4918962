"""The decode kernels compile for sm_90a, sm_100a and sm_103a without a GPU: no spills, shared memory in budget.

Runs ``python -m cute_kernels.check --arch <arch> --kernel decode_*`` over the default config matrix in a
subprocess (the DSL target is fixed per process); ``--full`` (page sizes, head dims, G up to 128, dtypes,
softcap, block_logit, layouts) is under the slow marker. Also the host rules: the split count (shapes
only), the config as the compile key, and named refusals.
"""

from __future__ import annotations

import pytest

from tests.cpu._check_cli import run_check

KERNELS = ("decode_attention", "decode_combine", "decode_split_step")
ARCHS = ("sm_90a", "sm_100a", "sm_103a")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_kernels_compile(tmp_path, arch, kernel):
    from cute_kernels.arch import parse_arch
    from cute_kernels.decode.launch import CHECKS

    rows = run_check(tmp_path, arch, kernel)
    assert len(rows) == len(CHECKS[kernel][0](parse_arch(arch), False))


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_kernels_compile_full_matrix(tmp_path, arch, kernel):
    run_check(tmp_path, arch, kernel, "--full")


def test_check_registry_lists_decode():
    from cute_kernels.registry import all_checks

    assert set(KERNELS) <= set(all_checks())


def test_config_is_the_cache_key():
    from cute_kernels.decode.config import DecodeConfig

    a, b = DecodeConfig(arch=90), DecodeConfig(arch=90)
    assert a == b and hash(a) == hash(b)
    assert DecodeConfig(arch=90, page_size=64) != a and DecodeConfig(arch=90, split=True) != a


def test_unsupported_configs_name_the_case():
    from cute_kernels.decode.config import DecodeConfig, unsupported_reason

    assert unsupported_reason(DecodeConfig(arch=90)) is None
    assert "head_dim" in unsupported_reason(DecodeConfig(arch=90, head_dim=96))
    assert "page size" in unsupported_reason(DecodeConfig(arch=90, page_size=12))
    assert "seqlen_q" in unsupported_reason(DecodeConfig(arch=90, seqlen_q=17))
    assert "block_size" in unsupported_reason(DecodeConfig(arch=90, block_size=24))
    assert "G * Sq" in unsupported_reason(DecodeConfig(arch=90, group=32, seqlen_q=16))
    assert "float32" in unsupported_reason(DecodeConfig(arch=90, dtype="float32"))
    assert unsupported_reason(DecodeConfig(arch=120)) is not None
    with pytest.raises(NotImplementedError, match="head_dim"):
        from cute_kernels.decode.fwd import DecodeFwd

        DecodeFwd(DecodeConfig(arch=90, head_dim=96))


def test_tiling_rules():
    from cute_kernels.decode.config import DecodeConfig, ctas_per_sm

    c = DecodeConfig(arch=90, group=4, seqlen_q=1)
    assert (c.m_tiles, c.row_blocks, c.q_in_regs) == (1, 1, True)
    c = DecodeConfig(arch=90, group=8, seqlen_q=4)  # 32 rows: two m16 tiles per warp
    assert (c.m_tiles, c.row_blocks, c.q_in_regs) == (2, 1, False)
    c = DecodeConfig(arch=90, group=16, seqlen_q=16)  # 256 rows: 8 row blocks of 32
    assert (c.m_tiles, c.row_blocks) == (2, 8)
    c = DecodeConfig(arch=90, head_dim=256, group=64)  # d 256: one tile per warp
    assert (c.m_tiles, c.row_blocks) == (1, 4)
    for d in (64, 128, 256):
        cfg = DecodeConfig(arch=90, head_dim=d)
        assert cfg.stages >= 2 and cfg.merge_bytes <= max(cfg.ring_bytes, cfg.merge_bytes) <= 227 * 1024
        # d 256: warp pairs share a key range and split O's columns; d <= 128: every warp its own range
        assert (cfg.d_split, cfg.key_groups) == ((2, 2) if d == 256 else (1, 4))
    c = DecodeConfig(arch=90, head_dim=256)  # a pair's ring holds both warps' budgets: 3 steps of 16 KB
    assert (c.stages, c.ring_bytes) == (3, 2 * 3 * 16384) and ctas_per_sm(c) == 2


def test_choose_splits_from_shapes_only():
    from cute_kernels.decode.config import MAX_SPLITS, MIN_KEYS_PER_SPLIT, DecodeConfig, choose_splits

    cfg = DecodeConfig(arch=90, split=True)
    # many (sequence, kv head) pairs fill the machine: no split
    assert choose_splits(cfg, 64, 8, 16384, 132) == 1
    # one sequence, long context: enough CTAs for the 132 SMs, never fewer than MIN_KEYS_PER_SPLIT keys each
    s = choose_splits(cfg, 1, 8, 131072, 132)
    assert 16 <= s <= MAX_SPLITS
    assert choose_splits(cfg, 1, 8, 512, 132) <= 512 // MIN_KEYS_PER_SPLIT
    assert choose_splits(cfg, 1, 8, 100, 132) == 1
    # where 2 splits would fill the SMs: none on a contiguous cache or a short paged one (sparse decode's tables),
    # 2 on a long paged one (the measured points in config.PAGED_SPLIT_MIN_KEYS's comment)
    from cute_kernels.decode.config import PAGED_SPLIT_MIN_KEYS

    contiguous = DecodeConfig(arch=90, split=True, layout="contiguous", page_size=0, group=8)
    assert choose_splits(contiguous, 64, 1, 4096, 132) == 1
    assert choose_splits(contiguous, 8, 8, 8192, 132) == 1
    paged = DecodeConfig(arch=90, split=True, layout="hnd", page_size=64, group=4)
    assert choose_splits(paged, 8, 8, 1152, 132) == 1
    assert choose_splits(paged, 8, 8, PAGED_SPLIT_MIN_KEYS - 1, 132) == 1
    assert choose_splits(paged, 8, 8, 8192, 132) == 2
    assert choose_splits(paged, 1, 8, 1152, 132) == 4  # 8 CTAs unsplit: still split
    assert choose_splits(contiguous, 8, 1, 32768, 132) == 16
    # deterministic in its inputs
    assert all(choose_splits(cfg, 8, 8, 32768, 132) == choose_splits(cfg, 8, 8, 32768, 132) for _ in range(3))


def test_partial_shapes_and_sk_max():
    import numpy as np

    from cute_kernels.decode.launch import partial_shapes, sk_max

    q = np.zeros((3, 2, 32, 128), np.float32)
    assert partial_shapes(q, 5) == ((5, 3, 2, 32, 128), (5, 3, 2, 32))
    k_hnd = np.zeros((10, 8, 16, 128))
    k_nhd = np.zeros((10, 16, 8, 128))
    table = np.zeros((3, 8, 7), np.int32)
    assert sk_max(k_hnd, table, "hnd") == 7 * 16 == sk_max(k_nhd, table, "nhd")
    assert sk_max(np.zeros((3, 999, 8, 128)), None, "contiguous") == 999


def test_sk_max_of_a_dense_table():
    import numpy as np

    from cute_kernels.decode.launch import sk_max

    assert sk_max(np.zeros((10, 8, 16, 128)), np.zeros((3, 7), np.int32), "hnd") == 7 * 16


def test_dense_index_fakes_and_launch_key(monkeypatch):
    """The dense form compiles [B] lengths / [B, n] table fakes (32-bit table strides); the launcher picks the
    dense config from the lengths' rank, compiles once per key, and refuses mismatched ranks."""
    import numpy as np

    from cute_kernels import jit_cache
    from cute_kernels.decode import launch
    from cute_kernels.decode.config import DecodeConfig

    _, _, _, seq, table, *_ = launch._fakes(DecodeConfig(arch=90, dense_index=True))
    assert len(seq.shape) == 1 and len(table.shape) == 2
    _, _, _, seq, table, *_ = launch._fakes(DecodeConfig(arch=90))
    assert len(seq.shape) == 2 and len(table.shape) == 3
    _, _, _, seq, table, *_ = launch._fakes(DecodeConfig(arch=90, layout="contiguous", page_size=0, dense_index=True))
    assert len(seq.shape) == 1 and table is None

    cfgs, calls = [], []

    def compile_decode(cfg):
        cfgs.append(cfg)
        return lambda *args: calls.append(args)

    monkeypatch.setattr(launch, "compile_decode", compile_decode)
    saved = dict(jit_cache._FAST)
    jit_cache._FAST.clear()
    try:
        q = np.zeros((2, 1, 8, 128), np.float16)
        k = np.zeros((6, 2, 16, 128), np.float16)
        out, lse = np.zeros_like(q), np.zeros((2, 8, 1), np.float32)
        seq1, tab2 = np.zeros(2, np.int32), np.zeros((2, 3), np.int32)
        seq2, tab3 = np.zeros((2, 2), np.int32), np.zeros((2, 2, 3), np.int32)

        def run(s, t):
            launch.run_decode(q, k, k, s, t, out, lse, layout="hnd", softmax_scale=0.1, window_right=0, arch=90)

        run(seq1, tab2)
        run(seq1, tab2)
        run(seq2, tab3)
        assert [c.dense_index for c in cfgs] == [True, False] and len(calls) == 3
        assert calls[0][3] is seq1 and calls[0][4] is tab2 and calls[2][3] is seq2
        jit_cache._FAST.clear()  # checked where a key is built (on a hit TVM-FFI checks every tensor's rank)
        with pytest.raises(AssertionError, match="seqlens"):
            run(seq1, tab3)
    finally:
        jit_cache._FAST.clear()
        jit_cache._FAST.update(saved)


@pytest.mark.compile
def test_launches_take_the_compiled_functions_c_entry():
    """The launch function calls the TVM-FFI C entry of both kernels (jit_cache.direct_call: the DSL's Python
    __call__ only passes the arguments through for these signatures), in a subprocess (the DSL target)."""
    import subprocess
    import sys

    code = (
        "import os; os.environ['CUTE_DSL_ARCH'] = 'sm_90a'\n"
        "from cute_kernels.decode import launch as L\n"
        "from cute_kernels.decode.config import DecodeConfig\n"
        "from cute_kernels.decode.combine import CombineConfig\n"
        "from cute_kernels.jit_cache import direct_call\n"
        "f = L.compile_decode(DecodeConfig(arch=90, dtype='float16', head_dim=64, group=1, layout='nhd', page_size=1,"
        " mask_right=True, dense_index=True))\n"
        "c = L.compile_combine(CombineConfig(arch=90, head_dim=64))\n"
        "print(direct_call(f) is f._tvm_ffi_function, direct_call(c) is c._tvm_ffi_function)\n")
    root = __file__.rsplit("/tests/", 1)[0]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "True True"


def test_direct_call_keeps_anything_else():
    from types import SimpleNamespace

    from cute_kernels.jit_cache import direct_call

    plain = lambda *a: a  # noqa: E731
    assert direct_call(plain) is plain
    ptr = SimpleNamespace(execution_args=SimpleNamespace(has_pointer_address_arg_specs=True), _tvm_ffi_function=plain)
    assert direct_call(ptr) is ptr

    def wrapper(a, b=1):  # a wrapper with a default (or anything but a bare target call) is not bypassed
        return a
    odd = SimpleNamespace(execution_args=SimpleNamespace(has_pointer_address_arg_specs=False), _tvm_ffi_function=plain,
                          _kwargs_wrapper=wrapper)
    assert direct_call(odd) is odd


def test_combine_partition_covers_every_split_once():
    """The combine's split partition (combine.warps_per_row, the kernel's chunking): for every split count the
    launcher may pass, the row's warps fit one CTA, each takes at most one stage of splits per round trip
    (``stage_splits`` at d <= 128), the parts are contiguous, in order, and cover 0..S-1 exactly once."""
    from cute_kernels.decode.combine import MAX_SPLITS, UNROLL, WARPS, stage_splits, warps_per_row

    assert stage_splits(128) == UNROLL and stage_splits(256) == UNROLL // 2
    for n in range(1, MAX_SPLITS + 1):
        wpr = warps_per_row(n)
        assert 1 <= wpr <= WARPS and WARPS // wpr >= 1
        chunk = -(-n // wpr)
        assert chunk <= UNROLL, (n, wpr, chunk)
        covered = []
        for part in range(wpr):
            lo, hi = part * chunk, min(n, part * chunk + chunk)
            covered += list(range(lo, hi))
        assert covered == list(range(n)), n
    assert warps_per_row(16) == 1 and warps_per_row(17) == 2 and warps_per_row(128) == 8

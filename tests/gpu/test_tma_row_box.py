"""The hardware assumption behind Note [query rows by TMA] (cute_kernels/indexed/bwd_dkdv_sm90.py):
a 128B-swizzled TMA box of G rows (G not a multiple of 8) may start at any row of a wgmma shared-memory
tile, i.e. TMA swizzles by shared-memory address, as wgmma reads it. Loads Q[q, 0:G, :] (the G head
rows of one query, D 256) into rows [off, off + G) of a zeroed (64, 256) tile and reads the whole tile
back through its swizzled layout: the box's rows must match and every other row stay zero."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")
pytest.importorskip("cutlass")

from tests.conftest import torch_cuda_arch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch_cuda_arch() is None or torch_cuda_arch() < 90,
                       reason="needs a CUDA GPU with compute capability >= 9.0"),
]

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402

from cute_kernels.common.utils import wgmma_smem_layout  # noqa: E402
from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym  # noqa: E402
from cute_kernels.indexed.bwd_dkdv_sm90 import STAGES, IndexedBwdDKDVSm90  # noqa: E402
from cute_kernels.indexed.config import TILE_M, AttnConfig  # noqa: E402

G, D, ROWS = 12, 256, TILE_M
bf16 = cutlass.BFloat16
#: The production dK/dV kernel, whose stage layout and row box the probe uses as they are.
KERNEL = IndexedBwdDKDVSm90(AttnConfig(arch=90, head_dim=D, group=G, num_kv_heads=2, per_kv_head=False))


@cute.kernel
def _kernel(atom: cute.CopyAtom, tmaQ: cute.Tensor, mOut: cute.Tensor, q: Int32, off: Int32,
            s_layout: cute.ComposedLayout, box_layout: cute.ComposedLayout):
    tidx, _, _ = cute.arch.thread_idx()

    @cute.struct
    class S:
        bar: cute.struct.MemRange[Int64, 1]
        tile: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(s_layout)], 1024]

    st = cutlass.utils.SmemAllocator().allocate(S)
    sT = st.tile.get_tensor(s_layout.outer, swizzle=s_layout.inner)[None, None, 0]  # stage 0
    bar = st.bar.data_ptr()
    for i in cutlass.range(tidx, ROWS * D, 128):
        sT[i // D, i % D] = bf16(0.0)
    if tidx == 0:
        cute.arch.mbarrier_init(bar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.fence_view_async_shared()
    cute.arch.barrier()
    # destination: rows [off, off + G) of stage 0, as the kernel addresses a packed query's row slots
    dst = cute.make_tensor(cute.recast_ptr(st.tile.data_ptr() + off * 64, box_layout.inner), box_layout.outer)
    gQ = cute.local_tile(tmaQ[None, None, q], (G, D), (0, 0))
    tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                   cute.group_modes(gQ, 0, 2))
    if tidx < 32:  # a whole warp: cute.copy of a TMA atom elects one lane
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, G * D * 2)
        cute.copy(atom, tG, tS, tma_bar_ptr=bar)
    cute.arch.mbarrier_wait(bar, 0)
    for i in cutlass.range(tidx, ROWS * D, 128):
        mOut[i // D, i % D] = sT[i // D, i % D]


@cute.jit
def probe(mQ: cute.Tensor, mOut: cute.Tensor, q: Int32, off: Int32, stream):
    mQv = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))  # (H, D, L)
    s_layout = wgmma_smem_layout(bf16, (ROWS, D, STAGES))  # the kernel's Q / dO stages
    box_layout = KERNEL.row_box(s_layout)
    atom, tmaQ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQv, box_layout, (G, D))
    _kernel(atom, tmaQ, mOut, q, off, s_layout, box_layout).launch(
        grid=[1, 1, 1], block=[128, 1, 1], smem=cute.cosize(s_layout) * 2 + 2048, stream=stream)


def compile_probe():
    mQ = fake_tensor(bf16, (sym(), 24, D))
    mOut = fake_tensor(bf16, (ROWS, D))
    return cute.compile(probe, mQ, mOut, Int32(0), Int32(0), fake_stream(), options=arch_options(90))


@pytest.fixture(scope="module")
def probe_fn():
    return compile_probe()


@pytest.mark.parametrize("off", [0, 8, 12, 24, 36, 52])
def test_swizzled_box_lands_at_any_row(probe_fn, off):
    torch.manual_seed(off)
    Q = torch.randn(100, 24, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(ROWS, D, device="cuda", dtype=torch.bfloat16)
    probe_fn(Q, out, 7, off)
    torch.cuda.synchronize()
    assert torch.equal(out[off:off + G], Q[7, :G])
    assert not out[:off].any() and not out[off + G:].any()

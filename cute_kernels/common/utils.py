"""Small device helpers shared by the kernels: accumulator views, fp32 -> 16-bit packing, tensor views.

All functions are trace-time layout algebra or ``@cute.jit`` device code; no host logic.
"""

from __future__ import annotations

import math
import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def tree_reduce(vals: list, op):
    """``op`` over a Python list of values as a balanced tree (independent chains, short depth)."""
    vals = list(vals)
    while len(vals) > 1:
        nxt = [op(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def tree_max(vals: list):
    return tree_reduce(vals, cute.arch.fmax)


def tree_sum(vals: list):
    return tree_reduce(vals, operator.add)


def row_allreduce(v, threads_per_row: int, op):
    """Combine ``v`` across the ``threads_per_row`` adjacent lanes sharing a row (butterfly)."""
    dist = threads_per_row // 2
    while dist >= 1:
        v = op(v, cute.arch.shuffle_sync_bfly(v, offset=dist))
        dist //= 2
    return v


def wgmma_smem_layout(dtype, shape: tuple):
    """Shared-memory layout of a ``shape = (rows, cols[, stages...])`` tile of 16-bit ``dtype``, cols
    contiguous, in the canonical SM90 wgmma K-major swizzle (128 B when cols % 64 == 0); its
    transpose_view is the matching MN-major operand."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, shape[1]), dtype)
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))


@cute.jit
def wgmma_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
               zero_init: cutlass.Constexpr):
    """Issue acc (+)= A B over all k-blocks as one wgmma group; the caller waits (wait_group)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def wgmma_gemm_k(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, k0: int, k1: int,
                 zero_init: bool):
    """Issue acc (+)= A B over k-blocks [k0, k1) as one wgmma group (a GEMM issued in k-ranges as its operand
    arrives in parts); the caller waits (wait_group)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(k0, k1):  # trace-time unrolled (k0, k1: Python ints)
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """A view of ``t`` with its modes reordered (e.g. (B, S, H, D) -> (S, D, H, B))."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(modes)))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled) shared-memory tensor."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N/8, MMA_N)) = (rows, cols)."""
    col_major = cute.make_layout(acc_layout.shape)
    shape = ((col_major.shape[0][1], col_major.shape[1]),
             (col_major.shape[0][0], *col_major.shape[0][2:], col_major.shape[2]))
    stride = ((col_major.stride[0][1], col_major.stride[1]),
              (col_major.stride[0][0], *col_major.stride[0][2:], col_major.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) register view of a wgmma accumulator: row r, column c of this thread."""
    return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an fp32 S accumulator ((2, 2, N/8), M, N) as the 16-bit A operand ((2, 2, 2), M, (N/16, N))."""
    layout = acc.layout
    div = 2 if const_expr(layout.shape[0][2] % 2 == 0) else 1
    l = cute.logical_divide(layout, ((None, None, div), None, None))
    a_layout = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1],
                (l.stride[0][2][1], l.stride[2])),
    )
    return cute.make_tensor(acc.iterator, a_layout)


def sm90_thread0_cols(tile_n: int) -> list:
    """Compile-time column (within an n-tile) of each mn-view register column for lane 0 of a quad.

    A wgmma m64nN accumulator gives each thread columns 8*j + 2*(lane % 4) + {0, 1}; the mn view
    orders them (pair element, j). Other lanes add 2*(lane % 4) < 8.
    """
    return [8 * (c // 2) + c % 2 for c in range(tile_n // 4)]


@dsl_user_op
def _cvt_pack2(a, b, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{'bf16x2' if to_bf16 else 'f16x2'}.f32 $0, $2, $1;",
        "=r,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """fp32 ``src`` -> bf16/fp16 ``dst`` (same size), two elements per cvt instruction."""
    dst_i32 = cute.recast_tensor(dst, Int32)
    to_bf16 = const_expr(dst.element_type is cutlass.BFloat16)
    for i in cutlass.range_constexpr(cute.size(dst_i32)):
        dst_i32[i] = _cvt_pack2(src[2 * i], src[2 * i + 1], to_bf16)


@cute.jit
def stage_acc_16bit(r16: cute.Tensor, tiled_mma: cute.TiledMma, tidx: Int32, sX: cute.Tensor):
    """A wgmma accumulator of ``tiled_mma`` already converted to 16 bits (``convert_to_16bit``; this thread's
    ``tidx`` slice) into the shared-memory tile ``sX`` (stmatrix from the accumulator's layout, in ``sX``'s own
    swizzled layout): the staging step of the epilogues that then store the tile by TMA. The caller fences
    and synchronises."""
    st_copy = cute.make_tiled_copy_C(
        sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, r16.element_type, Float32), tiled_mma)
    thr_st = st_copy.get_slice(tidx)
    cute.copy(st_copy, thr_st.retile(r16), thr_st.partition_D(sX))


@dsl_user_op
def reread_tid_x(*, loc=None, ip=None) -> Int32:
    """``threadIdx.x`` read again where called, as a volatile read that LLVM neither merges with earlier reads
    nor hoists out of loops: values derived from it are computed at their use instead of being kept live
    (or spilled) through a main loop from the kernel's start. ptxas may still hoist what it sees is
    loop-invariant (it did so for the SM100 backward's dS store addresses: docs/benchmarks.md, Runs AQ)."""
    return Int32(llvm.inline_asm(
        T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def ld_acquire_gpu(addr, *, loc=None, ip=None) -> Int32:
    """``ld.acquire.gpu`` of the int32 at global address ``addr`` (an Int64): a turn counter's read."""
    return Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)], "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def red_release_add_gpu(addr, val, *, loc=None, ip=None) -> None:
    """``red.release.gpu.global.add.s32``: bump the turn counter at ``addr`` by ``val`` (release)."""
    llvm.inline_asm(
        None, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

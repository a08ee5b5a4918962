"""The few SM80-class instructions the decode kernel issues by hand (they run unchanged on SM90 and SM100).

* ``cp_async_16``: ``cp.async.cg.shared.global`` of 16 bytes with a source size: 0 zero-fills the
  destination and reads nothing, which is how a key past its sequence, a padding page id or an
  unused page tail becomes a zero row in shared memory (its stale bytes, NaN included, are never
  loaded, so P = 0 times V stays 0).
* ``cp_async_ca``: ``cp.async.ca.shared.global`` of 4, 8 or 16 bytes (the combine's staged partial loads).
* ``ldsm_x4``: ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``, four 8x8 16-bit matrices.
* ``mma_16816``: ``mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}``, fp32 accumulators.
* ``pack2``: two fp32 -> one 32-bit register of two 16-bit values (low half = first argument).

Addresses are raw: shared memory as a 32-bit shared-window address, global memory as a 64-bit
generic address. Every helper is an ``llvm.inline_asm``; the ones that touch memory are marked
with side effects so they are neither merged nor moved across the warp barriers around them.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_ATT = llvm.AsmDialect.AD_ATT


@dsl_user_op
def cp_async_16(smem_addr, gmem_addr, src_bytes, *, loc=None, ip=None) -> None:
    """Copy 16 bytes global -> shared asynchronously (``src_bytes`` of them read, the rest zero-filled)."""
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
         Int32(src_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=_ATT)


@dsl_user_op
def cp_async_ca(smem_addr, gmem_addr, nbytes: int, *, loc=None, ip=None) -> None:
    """Copy ``nbytes`` (4, 8 or 16, a compile-time size) global -> shared asynchronously (``cp.async.ca``)."""
    assert nbytes in (4, 8, 16)
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
        f"cp.async.ca.shared.global [$0], [$1], {int(nbytes)};", "r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=_ATT)


@dsl_user_op
def ldsm_x4(smem_addr, trans: bool = False, offset: int = 0, *, loc=None, ip=None):
    """Four 8x8 b16 matrices from shared memory (lane i gives the row address of matrix i // 8).

    ``offset``: a compile-time byte offset added in the instruction's address (``[reg+imm]``), so addresses that
    differ by a constant share one register."""
    addr = f"$4+{int(offset)}" if offset else "$4"
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [{addr}];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=_ATT)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def mma_16816(a, b0, b1, c, bf16: bool, *, loc=None, ip=None):
    """``c + A B`` for one m16n8k16 tile: ``a`` 4 regs, ``b0``/``b1`` the B regs, ``c`` 4 fp32."""
    ab = "bf16" if bf16 else "f16"
    ops = ([Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, b0, b1)]
           + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), ops,
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=_ATT)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def pack2(lo, hi, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Round two fp32 to bf16/fp16 (nearest even) and pack them: ``lo`` in bits 0-15, ``hi`` in 16-31."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{'bf16x2' if bf16 else 'f16x2'}.f32 $0, $2, $1;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=_ATT))

"""Small SM100 math helpers for the attention softmax warps (device code only).

``fmax3``      one ``max.f32`` with three inputs (sm_100+ PTX), so a max tree over n values costs
               about n/2 instructions instead of n.
``max_tree``   trace-time balanced tree of ``fmax3`` over a Python list of Float32 values: the
               depth is log3(n), which keeps the dependent chain short in the softmax critical path.
``exp2_poly``  2^x on the FMA pipe (Cody-Waite split + degree-3 polynomial), used for a fraction of
               the elements so the MUFU unit is not the only exp2 source (FA4's "exp2 emulation").

Nothing here reads or writes memory; every helper is a pure function of its register inputs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 2^f on f in [0, 1): iteratively reweighted least-squares fit (numpy, fp64, 4097 points) of
# 1 + c1 f + c2 f^2 + c3 f^3 on the relative error; max relative error 8.6e-5, below half an fp16
# ulp (4.9e-4) and far below a bf16 ulp of P. Coefficients c1, c2, c3.
_EXP2_POLY = (0.6951175613407709, 0.2276456107541215, 0.0770650606883423)
# 1.5 * 2^23: adding it (round-down) leaves floor(x) in the low mantissa bits for |x| < 2^22.
_ROUND_MAGIC = 12582912.0


@dsl_user_op
def fmax3(a, b, c, *, loc=None, ip=None) -> Float32:
    """max(a, b, c) in one instruction (NaN-quiet like ``max.f32``)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip),
             Float32(c).ir_value(loc=loc, ip=ip)],
            "max.f32 $0, $1, $2, $3;",
            "=f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def max_tree(values: list) -> Float32:
    """Balanced fmax3 tree over a trace-time list of Float32 values (len >= 1)."""
    vals = list(values)
    while len(vals) > 1:
        nxt = []
        i = 0
        while i < len(vals):
            rest = len(vals) - i
            if rest >= 3:
                nxt.append(fmax3(vals[i], vals[i + 1], vals[i + 2]))
                i += 3
            elif rest == 2:
                nxt.append(cute.arch.fmax(vals[i], vals[i + 1]))
                i += 2
            else:
                nxt.append(vals[i])
                i += 1
        vals = nxt
    return vals[0]


@dsl_user_op
def _shift_add_exponent(rounded: Float32, frac_pow: Float32, *, loc=None, ip=None) -> Float32:
    """bits(frac_pow) + (bits(rounded) << 23): adds floor(x) (low bits of ``rounded``) to the exponent."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(rounded).ir_value(loc=loc, ip=ip), Float32(frac_pow).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b32 r_i, p_i;\n\tmov.b32 r_i, $1;\n\tmov.b32 p_i, $2;\n\t"
            "shl.b32 r_i, r_i, 23;\n\tadd.s32 p_i, p_i, r_i;\n\tmov.b32 $0, p_i;\n\t}",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def exp2_poly_x2(x0: Float32, x1: Float32):
    """(2^x0, 2^x1) without MUFU, for x <= 127; exactly 0 for x < -127 (and -inf), like the
    flush-to-zero MUFU ex2, so a fully masked row keeps a zero row sum.

    x = n + f with n = floor(x), f in [0, 1); 2^f by the polynomial, n added to the exponent field.
    The packed f32x2 FMA/ADD instructions process both inputs at once.
    """
    xc = (cute.arch.fmax(x0, -127.0), cute.arch.fmax(x1, -127.0))
    rounded = cute.arch.add_packed_f32x2(xc, (_ROUND_MAGIC, _ROUND_MAGIC), rnd="rm")
    back = cute.arch.sub_packed_f32x2(rounded, (_ROUND_MAGIC, _ROUND_MAGIC))
    frac = cute.arch.sub_packed_f32x2(xc, back)
    c1, c2, c3 = _EXP2_POLY
    p = cute.arch.fma_packed_f32x2(frac, (c3, c3), (c2, c2))
    p = cute.arch.fma_packed_f32x2(frac, p, (c1, c1))
    p = cute.arch.fma_packed_f32x2(frac, p, (1.0, 1.0))
    y0 = _shift_add_exponent(rounded[0], p[0])
    y1 = _shift_add_exponent(rounded[1], p[1])
    y0 = Float32(cutlass.select_(x0 >= -127.0, y0, Float32(0.0)))
    y1 = Float32(cutlass.select_(x1 >= -127.0, y1, Float32(0.0)))
    return y0, y1


__all__ = ["fmax3", "max_tree", "exp2_poly_x2"]

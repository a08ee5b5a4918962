"""Small SM100 math helpers for the attention softmax warps (device code only).

``fmax3``      one ``max.f32`` with three inputs (sm_100+ PTX), so a max tree over n values costs
               about n/2 instructions instead of n. Compiled for an older target (sm_90a: the H200
               runs these helpers in tests/gpu/test_sm100_helpers.py) it is two two-input ``max.f32``
               with the same result, so the tree logic is tested there; the three-input instruction
               itself runs only on Blackwell (``python -m cute_kernels.selftest``).
``max_tree``   trace-time balanced tree of ``fmax3`` over a Python list of Float32 values: the
               depth is log3(n), which keeps the dependent chain short in the softmax critical path.
``exp2_poly``  2^x on the FMA pipe (floor/fraction split + degree-3 polynomial), used for a fraction
               of the elements so the MUFU unit is not the only exp2 source (FA4's "exp2 emulation").

Nothing here reads or writes memory; every helper is a pure function of its register inputs.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import BaseDSL, T, dsl_user_op

# 2^f on f in [0, 1): iteratively reweighted least-squares fit (numpy, fp64, 4097 points) of
# 1 + c1 f + c2 f^2 + c3 f^3 on the relative error; max relative error 8.6e-5, below half an fp16
# ulp (4.9e-4) and far below a bf16 ulp of P. Coefficients c1, c2, c3.
_EXP2_POLY = (0.6951175613407709, 0.2276456107541215, 0.0770650606883423)
# 1.5 * 2^23: adding it (round-down) leaves floor(x) in the low mantissa bits for |x| < 2^22.
_ROUND_MAGIC = 12582912.0


def _has_max3() -> bool:
    """Whether the target being compiled (the ``--gpu-arch`` of this compile) has three-input max.f32."""
    return BaseDSL._get_dsl().get_arch_enum().major >= 10


@dsl_user_op
def fmax3(a, b, c, *, loc=None, ip=None) -> Float32:
    """max(a, b, c) in one instruction on sm_100+ (NaN-quiet like ``max.f32``: a NaN operand is
    ignored unless all are NaN); two ``max.f32`` on older targets."""
    if not _has_max3():
        return cute.arch.fmax(cute.arch.fmax(Float32(a), Float32(b), loc=loc, ip=ip), Float32(c), loc=loc, ip=ip)
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


def _hex(v: float) -> str:
    """PTX literal of the float32 nearest to ``v``."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


# One inline-PTX block per value, every constant an immediate (no registers held for constants:
# the softmax warps run at the edge of their register budget).
_EXP2_POLY_PTX = (
    "{\n\t.reg .f32 xc, r, bk, f, p;\n\t.reg .b32 ri, pi;\n\t.reg .pred keep;\n\t"
    "max.f32 xc, $1, %(m127)s;\n\t"
    "add.rm.f32 r, xc, %(magic)s;\n\t"  # floor(x) in the low mantissa bits of r
    "sub.f32 bk, r, %(magic)s;\n\t"
    "sub.f32 f, xc, bk;\n\t"  # fractional part in [0, 1)
    "fma.rn.f32 p, f, %(c3)s, %(c2)s;\n\t"
    "fma.rn.f32 p, f, p, %(c1)s;\n\t"
    "fma.rn.f32 p, f, p, 0f3F800000;\n\t"
    "mov.b32 ri, r;\n\tshl.b32 ri, ri, 23;\n\tmov.b32 pi, p;\n\tadd.s32 pi, pi, ri;\n\t"
    "setp.ge.f32 keep, $1, %(m127)s;\n\t"
    "selp.b32 pi, pi, 0, keep;\n\t"
    "mov.b32 $0, pi;\n\t}"
) % {"m127": _hex(-127.0), "magic": _hex(_ROUND_MAGIC), "c1": _hex(_EXP2_POLY[0]),
     "c2": _hex(_EXP2_POLY[1]), "c3": _hex(_EXP2_POLY[2])}


@dsl_user_op
def exp2_poly(x, *, loc=None, ip=None) -> Float32:
    """2^x without MUFU, for x <= 127; exactly 0 for x < -127 (and -inf, and NaN), like the
    flush-to-zero MUFU ex2, so a fully masked row keeps a zero row sum. Relative error <= 1e-4 for
    x in [-126, 127], exact at integers; x in [-127, -126) gives a denormal within 2^-126 of 2^x.

    x = n + f with n = floor(x), f in [0, 1); 2^f by the polynomial, n added to the exponent field.
    """
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _EXP2_POLY_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


__all__ = ["fmax3", "max_tree", "exp2_poly"]

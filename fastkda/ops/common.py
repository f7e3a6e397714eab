"""Helpers shared by the Triton kernels: bf16 operands that behave the same natively and under the interpreter.

Triton's CPU interpreter computes ``tl.dot`` and arithmetic on bf16 values from their raw bit patterns, and
truncates when it casts fp32 to bf16. Kernels therefore take an ``EMULATE`` flag: natively they hand bf16
to the tensor cores; under the interpreter they round to bf16 (nearest-even, as the GPU does) and keep fp32,
so the same kernel source computes the same function on both.
"""

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 (bit arithmetic, exact on any backend)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_operand(x, EMULATE: tl.constexpr):
    """``x`` as a bf16 matrix operand: bf16 natively, its bf16 rounding in fp32 under the interpreter."""
    if EMULATE:
        return round_to_bf16(x.to(tl.float32))
    else:
        return x.to(tl.bfloat16)


@triton.jit
def store_as(ptr, x, mask, EMULATE: tl.constexpr):
    """Store ``x`` converted to the pointee type, rounding to nearest-even bf16 under the interpreter too."""
    if EMULATE:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16(x.to(tl.float32))
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_f32(ptr, mask):
    """Masked load (zeros outside ``mask``) converted to fp32."""
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def fast_exp2(x, EMULATE: tl.constexpr):
    """2^x with one MUFU instruction (flushes subnormal results to zero); ``tl.exp2`` under the interpreter."""
    if EMULATE:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def fast_reciprocal(x, EMULATE: tl.constexpr):
    """1/x with one MUFU instruction (relative error ~1 ulp); exact division under the interpreter."""
    if EMULATE:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

"""A one-program kernel around :func:`fastkda.ops.prefill.recurrence.split_bf16`, for its test on the interpreter
(imported by the test, after the interpreter is set up)."""

import triton
import triton.language as tl

from fastkda.ops.prefill.recurrence import split_bf16


@triton.jit
def split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    hi, lo = split_bf16(tl.load(x_ptr + offsets), True)
    tl.store(hi_ptr + offsets, hi)
    tl.store(lo_ptr + offsets, lo)

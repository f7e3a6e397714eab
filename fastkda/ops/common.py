"""Helpers shared by the Triton kernels: bf16 operands that behave the same natively and under the interpreter.

Triton's CPU interpreter computes ``tl.dot`` and arithmetic on bf16 values from their raw bit patterns, and
truncates when it casts fp32 to bf16. Kernels therefore take an ``EMULATE`` flag: natively they hand bf16
to the tensor cores; under the interpreter they round to bf16 (nearest-even, as the GPU does) and keep fp32,
so the same kernel source computes the same function on both.
"""

import os

import torch
import triton
import triton.language as tl


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as Triton reads it when it defines
# the kernels (an eager call's host time counts, and an environment lookup per call is part of it)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1`` when fastkda was imported)."""
    return _INTERPRETING


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


_COMPILED = {}  # (kernel, device, argument specialisation, constexprs and options) -> (compiled kernel, constexprs)
# the Triton whose launcher signature and specialisation rules ``launch`` mirrors (tests/test_launch.py checks the
# rules against the installed Triton); any other version launches through Triton's own path
_DIRECT_LAUNCH = triton.__version__.split(".")[:2] == ["3", "6"]


def _specialisation(args):
    """What Triton's launcher specialises each argument on (triton 3.6, ``native_specialize_impl``): a tensor's
    (subclasses too) dtype and 16-byte alignment; an integer's being 1, a multiple of 16, 32-bit, below 2^63;
    nothing for a float; anything else (None, bools) by value. Calls with equal keys run the same binary, and no key
    holds a tensor (the cache would keep its memory alive). One comprehension over the arguments (a function call
    per argument cost twice as much host time)."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor) else
                  (a == 1, not a & 15, -2147483648 <= a < 2147483648, a < 9223372036854775808) if type(a) is int else
                  float if type(a) is float else a for a in args])


def _launch_hooked():
    """Whether a launch hook is set (Triton 3.6 holds a chain of hooks, empty unless a profiler added one)."""
    hooks = triton.knobs.runtime.launch_enter_hook
    return bool(getattr(hooks, "calls", hooks))


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)`` for a 3-D ``grid``, keyword arguments being the parameters after ``args`` (in
    any order) and launch options. Triton binds and specialises every argument of every call in Python, tens of µs
    of host time per launch (docs/perf-notes.md, "Eager host path"); after the first call of a
    specialisation this launches its compiled kernel directly. Under the interpreter, with a Triton launch hook
    set (profilers) or another Triton than 3.6, it is Triton's own path.

    It launches on the GPU of the first argument (every kernel's first argument is a tensor of the call), on that
    GPU's current stream, as PyTorch runs an operator: Triton launches on the current device, and a model split
    over GPUs in one process (transformers' ``device_map="auto"``) calls layers whose tensors are on another."""
    if _INTERPRETING:
        kernel[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    if args[0].get_device() != device:  # the rare case: one level down, its GPU is the current one (no call more
        # on the common path, whose host time an eager call pays per launch)
        with torch.cuda.device(args[0].device):
            launch(kernel, grid, *args, **meta)
        return
    if not _DIRECT_LAUNCH or _launch_hooked():
        kernel[grid](*args, **meta)
        return
    key = (kernel, device, _specialisation(args), tuple(meta.items()))
    entry = _COMPILED.get(key)
    if entry is None:
        _COMPILED[key] = kernel[grid](*args, **meta), [meta[name] for name in kernel.arg_names[len(args):]]
        return
    compiled, constexprs = entry
    compiled.run(*grid, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *constexprs)

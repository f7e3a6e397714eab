"""Triton's CPU interpreter for the tests: whether it can run here, and products that do not depend on the CPU.

Without a GPU the tests run fastkda's Triton kernels on Triton's interpreter (``TRITON_INTERPRET=1``). Its
``tl.dot`` is numpy's ``matmul``, whose BLAS kernel, and with it the order of the sums, depends on the CPU
(OpenBLAS picks one per processor; ``OPENBLAS_CORETYPE`` changes it): the same kernel then gives bits that differ
from one machine to another and, worse, between two tile shapes on one machine, which the bitwise tests across
V-slices would take for a kernel bug. :func:`install_ordered_dot` makes the interpreter's products add their
terms onto the accumulator in one fixed order, k = 0, 1, ..., with plain fp32 multiplies and adds (exact IEEE
operations on any CPU), so the interpreter's results are the same everywhere and a product's element depends on
its row and column alone, as it does on the GPU. Adding onto the accumulator, as the tensor cores' k-steps do,
also makes one product over a concatenated K add what two chained products add (``recurrence.py``). The GPU tests
keep their own bitwise checks on the real tensor cores.

The interpreter also re-patches ``triton.language`` (a walk over every member of the module) at each call of a
``@triton.jit`` helper inside a kernel, although the kernel's launch has already patched it (its cost:
docs/perf-notes.md, "Session 28"). :func:`install_one_patch_per_launch` keeps the launch's patch for its helpers.
And with its default options it checks every 32-bit integer add, subtract and multiply for overflow (the sum again
in 64 bits, two comparisons), then drops the check's assert, since asserts are off unless ``debug`` is:
:func:`skip_dead_overflow_checks` stops the work that no test can see.
"""

import os

REQUIRED = "triton 3.6 and numpy < 2.4 (pip install -e '.[interpreter]')"


def unavailable_reason():
    """None if the interpreter can run fastkda's kernels here, else why not (triton 3.6's interpreter fails on
    loops with a runtime bound under numpy >= 2.4). Reads the installed versions without importing triton, which
    must first be imported after ``TRITON_INTERPRET`` is set."""
    from importlib import metadata

    try:
        versions = {name: metadata.version(name) for name in ("triton", "numpy")}
    except metadata.PackageNotFoundError as exc:
        return f"needs {REQUIRED}: {exc.name} is not installed"
    triton_ok = versions["triton"].split(".")[:2] == ["3", "6"]
    numpy_ok = tuple(int(x) for x in versions["numpy"].split(".")[:2]) < (2, 4)
    if not (triton_ok and numpy_ok):
        return f"needs {REQUIRED}, found triton {versions['triton']}, numpy {versions['numpy']}"
    return None


def add_products_in_order(total, lhs, rhs):
    """``total += lhs·rhs`` (batched over leading dimensions), the terms added onto ``total`` one k at a time, in
    order, in ``total``'s dtype (the module docstring); returns ``total``."""
    for i in range(lhs.shape[-1]):
        dtype = total.dtype
        total += lhs[..., i:i + 1].astype(dtype, copy=False) * rhs[..., i:i + 1, :].astype(dtype, copy=False)
    return total


def install_ordered_dot():
    """Replace the interpreter's fp32/fp64 ``tl.dot`` by a sum over k in order (see the module docstring)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "ordered", False):
        return
    matmul_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        lhs, rhs, acc = a.data, b.data, d.data
        if lhs.dtype not in (np.float32, np.float64) or rhs.dtype != lhs.dtype:
            return matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        total = np.array(np.broadcast_to(acc, lhs.shape[:-1] + rhs.shape[-1:]), dtype=acc.dtype)
        # the preparation's products overflow above their diagonal, which the kernel discards (prepare.py)
        with np.errstate(over="ignore", invalid="ignore"):
            return interpreter.TensorHandle(add_products_in_order(total, lhs, rhs), d.dtype.scalar)

    create_dot.ordered = True
    builder.create_dot = create_dot


def install_one_patch_per_launch():
    """Patch ``triton.language`` for the interpreter once per kernel launch, not again at every helper call inside
    it (see the module docstring). A call with no launch open is a launch: its scope's ``restore`` closes it. A
    helper that sees a language module the launch has not patched yet (Triton's own ``tl.sum`` sees
    ``triton.language.core``) patches it once, into the launch's scope, so the launch's end restores it too."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "once_per_launch", False):
        return
    patch_lang = interpreter._patch_lang
    launch = {}  # while a launch is open: its scope and the language modules patched in it

    def languages(fn):
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def patch_once(fn):
        seen = languages(fn)
        if launch and seen <= launch["languages"]:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's patch stays
        scope = patch_lang(fn)
        if launch:  # a helper's new module: restored with the launch, after the launch's own changes
            launch["scope"]._changes.extend(scope._changes)
            launch["languages"] |= seen
            return interpreter._LangPatchScope()
        launch.update(scope=scope, languages=seen)
        restore = scope.restore

        def close():
            launch.clear()
            restore()

        scope.restore = close
        return scope

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once


def skip_dead_overflow_checks():
    """Turn off the interpreter's overflow checks of 32-bit integer arithmetic while its ``debug`` option is off
    (Triton 3.6's default), under which their asserts are dropped (the module docstring)."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def active():
    """Whether this test run interprets the kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"

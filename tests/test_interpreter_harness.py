"""The tests' interpreter harness (``tests/interpreter.py``): one patch of ``triton.language`` per kernel launch,
whatever the number of helper calls inside it, and the language as it was once the launch ends; the integer
overflow checks skipped only where their asserts are dropped."""

import dataclasses
import inspect

import pytest
import torch

import interpreter

if not interpreter.active():
    pytest.skip("the harness patches Triton's CPU interpreter, which these tests do not run on",
                allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as triton_interpreter  # noqa: E402


@triton.jit
def _total(x):
    return tl.sum(x, axis=0)  # Triton's own helper, whose module sees triton.language.core


@triton.jit
def _sums_kernel(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    total = 0.0
    for _ in range(4):  # helper calls at run time, every program
        total += _total(x)
    tl.store(out_ptr + tl.program_id(0), total)


@triton.jit
def _int32_sum_kernel(x_ptr, out_ptr):
    tl.store(out_ptr, tl.load(x_ptr) + tl.load(x_ptr + 1))


@triton.jit
def _failing_kernel(x_ptr, N: tl.constexpr):
    tl.store(x_ptr, _total(tl.load(x_ptr + tl.arange(0, N))))
    tl.static_assert(N == 7, "fails after a helper call, inside the launch")


class _CountingInspect:
    """The interpreter's ``inspect`` with its walks over a module's members counted."""

    def __init__(self):
        self.walks = 0

    def getmembers(self, *args, **kwargs):
        self.walks += 1
        return inspect.getmembers(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(inspect, name)


def _launch_walks(monkeypatch, programs):
    counting = _CountingInspect()
    monkeypatch.setattr(triton_interpreter, "inspect", counting)
    out = torch.full((programs,), float("nan"))
    _sums_kernel[(programs,)](torch.arange(8, dtype=torch.float32), out, N=8)
    monkeypatch.undo()
    assert out.tolist() == [4 * 28.0] * programs
    return counting.walks


def test_one_patch_per_launch_whatever_the_helper_calls(monkeypatch):
    assert getattr(triton_interpreter._patch_lang, "once_per_launch", False)
    _launch_walks(monkeypatch, 1)  # the first launch patches fewer of Triton's own modules than later ones
    one = _launch_walks(monkeypatch, 1)
    assert one > 0 and _launch_walks(monkeypatch, 5) == one  # 8 and 40 helper calls: the same walks


def test_the_language_is_restored_after_a_launch_and_after_a_failing_one():
    before = {name: getattr(tl, name) for name in ("sum", "load", "store", "arange")}
    core_before = tl.core.reduce, tl.core.tensor.__add__
    out = torch.zeros(1)
    _sums_kernel[(1,)](torch.arange(8, dtype=torch.float32), out, N=8)
    with pytest.raises(Exception, match="inside the launch"):
        _failing_kernel[(1,)](torch.zeros(8), N=8)
    assert {name: getattr(tl, name) for name in before} == before
    assert (tl.core.reduce, tl.core.tensor.__add__) == core_before
    _sums_kernel[(1,)](torch.arange(8, dtype=torch.float32), out, N=8)  # and a launch after works as before
    assert out.item() == 4 * 28.0


def test_overflow_checks_skipped_only_where_their_asserts_are_dropped(monkeypatch):
    builder = triton_interpreter.interpreter_builder
    unchecked = builder.options
    assert not unchecked.debug and not unchecked.sanitize_overflow  # the harness's choice
    x = torch.tensor([2 ** 31 - 1, 1], dtype=torch.int32)

    def int32_sum(options):
        monkeypatch.setattr(builder, "options", options)
        out = torch.zeros(1, dtype=torch.int32)
        _int32_sum_kernel[(1,)](x, out)
        return out.item()

    checked = dataclasses.replace(unchecked, sanitize_overflow=True)
    assert int32_sum(checked) == int32_sum(unchecked) == -2 ** 31  # checked or not: wrapped, nothing raised
    debugging = dataclasses.replace(checked, debug=True)
    monkeypatch.setattr(builder, "options", debugging)
    interpreter.skip_dead_overflow_checks()
    assert builder.options is debugging  # under debug the checks stay, and they are live
    with pytest.raises(Exception, match="int32 overflow"):
        int32_sum(debugging)

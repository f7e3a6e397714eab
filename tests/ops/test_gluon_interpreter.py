"""The emulation of Gluon kernels on the interpreter (``tests/gluon_interpreter.py``) on a kernel of its own: a
ring of shared-memory slots that a producer partition fills with ``cp.async`` and a consumer drains, handed over
by mbarriers, as a warp-specialized kernel does. Its values flow as the kernel says; a consumer that never frees
its slots is reported as the deadlock it is, and copies signalled on the wrong barrier as read in flight."""

import sys

import pytest
import torch

from gluon_interpreter import interpreted_gluon
from helpers import needs_interpreter

pytestmark = needs_interpreter

try:  # Gluon (triton 3.6+); the interpreter tests need triton 3.6 anyway
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
except ImportError:  # pragma: no cover
    pytest.skip("needs triton's Gluon", allow_module_level=True)

ROW = 32  # elements a slot


@gluon.jit
def produce(src, ring, ready, empty, steps, STAGES: gl.constexpr, SIGNAL: gl.constexpr):
    rows = gl.arange(0, ROW, layout=gl.BlockedLayout([1], [32], [4], [0]))
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier counts as freed
        async_copy.async_copy_global_to_shared(ring.index(slot), src + i * ROW + rows)
        if SIGNAL:
            async_copy.mbarrier_arrive(ready.index(slot))
        else:  # the copies' arrival on the wrong barrier: nothing makes the consumer wait for them
            async_copy.mbarrier_arrive(empty.index(slot))
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def consume(dst, ring, ready, empty, steps, STAGES: gl.constexpr, FREE: gl.constexpr):
    rows = gl.arange(0, ROW, layout=gl.BlockedLayout([1], [32], [4], [0]))
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        x = ring.index(slot).load(gl.BlockedLayout([1], [32], [4], [0]))
        gl.store(dst + i * ROW + rows, x * 2.0)
        if FREE:
            mbarrier.arrive(empty.index(slot), count=1)
    return (steps,)


@gluon.jit
def ring_kernel(src, dst, steps, STAGES: gl.constexpr, FREE: gl.constexpr, SIGNAL: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.float32, [STAGES, ROW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([(consume, (dst, ring, ready, empty, steps, STAGES, FREE)),
                        (produce, (src, ring, ready, empty, steps, STAGES, SIGNAL))], [4], [40])


@pytest.fixture
def emulated(monkeypatch):
    with interpreted_gluon(sys.modules[__name__], monkeypatch) as emulation:
        yield emulation


def test_a_warp_specialized_ring_passes_every_row(emulated):
    src = torch.randn(10 * ROW)
    dst = torch.full_like(src, float("nan"))
    ring_kernel[(1,)](src, dst, 10, STAGES=3, FREE=True, SIGNAL=True)
    assert torch.equal(dst, src * 2) and emulated.launches == 1


def test_a_consumer_that_never_frees_its_slots_deadlocks(emulated):
    emulated.deadlock_s = 1
    src = torch.randn(10 * ROW)
    with pytest.raises(Exception) as caught:
        ring_kernel[(1,)](src, torch.empty_like(src), 10, STAGES=3, FREE=False, SIGNAL=True)
    assert "deadlock" in repr(caught.value)


def test_copies_signalled_on_the_wrong_barrier_are_read_in_flight(emulated):
    """The copies' ``cp.async`` arrival on another barrier than the one the consumer waits on: the consumer reads a
    slot whose copies may still be in flight."""
    src = torch.randn(10 * ROW)
    with pytest.raises(Exception) as caught:
        ring_kernel[(1,)](src, torch.empty_like(src), 10, STAGES=3, FREE=True, SIGNAL=False)
    assert "a shared-memory load reads shared memory that a cp.async group still in flight writes" in repr(
        caught.value)

"""The emulation of Gluon kernels on the interpreter (``tests/gluon_interpreter.py``) on a kernel of its own: a
ring of shared-memory slots that a producer partition fills with ``cp.async`` and a consumer drains, handed over
by mbarriers, as a warp-specialized kernel does. Its values flow as the kernel says; a consumer that never frees
its slots is reported as the deadlock it is, and copies signalled on the wrong barrier as read in flight. A
product's operand overwritten by a copy while the product runs, and a program ending with copies in flight, are
races too."""

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
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_wait)
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


@gluon.jit
def overwrite_kernel(src, dst, WAIT_PRODUCT: gl.constexpr, WAIT_COPY: gl.constexpr):
    """A product of a 64×16 bf16 operand from shared memory; then a new copy into that operand, after or before the
    product's wait; and, unless ``WAIT_COPY``, the program ends with that copy in flight."""
    TILE: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    b = gl.allocate_shared_memory(gl.bfloat16, [16, 16], gl.NVMMASharedLayout.get_default_for([16, 16], gl.bfloat16))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, TILE))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, TILE))
    at = rows[:, None] * 16 + cols[None, :]
    async_copy.async_copy_global_to_shared(b, src + at)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    a = gl.full([64, 16], 1.0, gl.float32, gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2))
    a = a.to(gl.bfloat16)
    product = warpgroup_mma(a, b, gl.zeros([64, 16], gl.float32, ACC), use_acc=False, is_async=True)
    if WAIT_PRODUCT:
        product = warpgroup_mma_wait(0, deps=[product])
    async_copy.async_copy_global_to_shared(b, src + 256 + at)
    async_copy.commit_group()
    product = warpgroup_mma_wait(0, deps=[product])
    if WAIT_COPY:
        async_copy.wait_group(0)
    gl.store(dst + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))[:, None] * 16
             + gl.arange(0, 16, layout=gl.SliceLayout(0, ACC))[None, :], product)


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


def test_a_copy_into_an_operand_of_a_product_in_flight_is_a_race(emulated):
    """The copy after the product's wait is fine (each output row sums the first copy's column); before it, the
    copy may overwrite what the tensor cores still read."""
    src = torch.arange(512, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.full((64, 16), float("nan"))
    overwrite_kernel[(1,)](src, dst, WAIT_PRODUCT=True, WAIT_COPY=True)
    assert torch.equal(dst, src[:256].float().view(16, 16).sum(0).expand(64, 16))
    with pytest.raises(Exception) as caught:
        overwrite_kernel[(1,)](src, dst, WAIT_PRODUCT=False, WAIT_COPY=True)
    assert "a cp.async into shared memory that a copy or a product still in flight uses" in repr(caught.value)


def test_a_program_that_ends_with_copies_in_flight_is_reported(emulated):
    src = torch.arange(512, dtype=torch.float32).to(torch.bfloat16)
    with pytest.raises(Exception) as caught:
        overwrite_kernel[(1,)](src, torch.empty(64, 16), WAIT_PRODUCT=True, WAIT_COPY=False)
    assert "the program ends with cp.async copies in flight" in repr(caught.value)

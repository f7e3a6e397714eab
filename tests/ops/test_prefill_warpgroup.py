"""The Gluon recurrence (``fastkda/ops/prefill/recurrence_warpgroup.py``, the plan's ``warpgroup_recurrence``) on
the CPU: its kernels on Triton's interpreter through ``tests/gluon_interpreter.py``, against the Triton kernels'
bits on the interpreter (whose accuracy against float64 ``test_prefill.py`` tests). What the emulation checks
besides the values (copies landed before they are read, no copy or store into memory a product in flight reads,
writes fenced before the tensor cores read them, products complete before their results are used) is tested to
fail where the kernel breaks those rules. The GPU's own checks are ``tests/test_gpu_warpgroup.py``."""

import pytest
import torch

from gluon_interpreter import interpreted_gluon
from helpers import make_inputs, needs_interpreter, plan_for
from prefill_kernels import nan_workspaces, run_open_entry, run_triton

pytestmark = needs_interpreter

CASES = [  # one head each, for the interpreter's time; V = 128 (slices of 64 and 128 columns) but in the last
    dict(lengths=[100], varlen=False, key_dim=64, value_dim=128, heads=1),
    dict(lengths=[0, 1, 31, 32, 33, 70, 0], key_dim=128, value_dim=128, heads=1),  # empty, 1-token, partial chunks
    dict(lengths=[66, 40], varlen=False, key_dim=64, value_dim=128, gate="precomputed", heads=1,
         with_initial=False),
    dict(lengths=[90], key_dim=128, value_dim=64, gate="weak", heads=1, state_dtype=torch.bfloat16),
]


@pytest.fixture
def gluon(monkeypatch):
    """The Gluon kernels on the interpreter, where the plan asks for them: :func:`fastkda.ops.prefill.recurrence.
    warpgroup_runs` as on a GPU (it refuses the interpreter, which runs no Gluon kernel of its own). Yields the
    emulation's state."""
    from fastkda.ops.prefill import recurrence, recurrence_warpgroup

    on_gpu = recurrence.warpgroup_runs
    monkeypatch.setattr(recurrence, "warpgroup_runs", lambda wanted, ws, emulate: on_gpu(wanted, ws, False))
    with interpreted_gluon(recurrence_warpgroup, monkeypatch) as emulation:
        yield emulation


def warpgroup(stages=4, segmented=False):
    """The plan's changes that run the Gluon recurrence at ``stages`` (and, ``segmented``, the transitions)."""
    transitions = dict(warpgroup_transition=True, transition_stages=stages) if segmented else {}
    return dict(warpgroup_recurrence=True, recurrence_stages=stages, **transitions)


def widths(case, stages=4):
    """The V-slice counts whose slices are 64 or 128 columns wide, and whose ring of ``stages`` chunks fits the
    shared memory (5 stages only at 64 columns)."""
    value_dim = case.get("value_dim", case.get("key_dim", 64))
    return [s for s in (1, 2) if value_dim // s in (64, 128) and (stages == 4 or value_dim // s == 64)]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("stages", [4, 5])
def test_serial_same_bits_as_the_triton_kernel(case, stages, request):
    inp = make_inputs(seed=21 + stages, **case)
    final_dtype = case.get("state_dtype", torch.float32)
    expected = {s: run_triton(inp, s, final_dtype=final_dtype) for s in widths(case, stages)}
    emulation = request.getfixturevalue("gluon")
    for v_slices, (out, final) in expected.items():
        got_o, got_s = run_triton(inp, v_slices, final_dtype=final_dtype, **warpgroup(stages))
        assert torch.equal(got_o, out) and torch.equal(got_s, final), v_slices
    assert emulation.launches == len(expected)  # the Gluon kernels ran, not the Triton ones they fall back to


SEGMENT_CASES = [CASES[0], dict(CASES[1], lengths=[0, 1, 33, 70]), CASES[3]]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=range(len(SEGMENT_CASES)))
def test_segments_same_bits_as_the_triton_kernels(case, request):
    """Sequence parallelism, segments of two chunks: the transitions (identity columns included) and the rerun."""
    inp = make_inputs(seed=31, **dict(case, gate="weak"))
    expected = {s: run_triton(inp, s, sequence_parallel=64) for s in widths(case)}
    emulation = request.getfixturevalue("gluon")
    for v_slices, (out, final) in expected.items():
        got_o, got_s = run_triton(inp, v_slices, sequence_parallel=64, **warpgroup(segmented=True))
        assert torch.equal(got_o, out) and torch.equal(got_s, final), v_slices
    assert emulation.launches == 2 * len(expected)  # the Gluon transitions and rerun


@pytest.mark.parametrize("sequence_parallel", [False, 64])
def test_longest_first_same_bits_as_the_triton_kernel(sequence_parallel, request):
    """The plan's ``longest_first``: the Gluon recurrence (serial, or the segments' rerun) reads its rows from the
    order the solve kernel wrote and gives the Triton kernel's bits in the grid's order."""
    inp = make_inputs([3, 90, 0, 40, 130], heads=2, key_dim=64, seed=41)
    out, final = run_triton(inp, 1, sequence_parallel=sequence_parallel)
    emulation = request.getfixturevalue("gluon")
    got_o, got_s = run_triton(inp, 1, sequence_parallel=sequence_parallel, longest_first=True, **warpgroup())
    assert torch.equal(got_o, out) and torch.equal(got_s, final)
    assert emulation.launches == 1


def test_transitions_in_order_same_bits_as_the_triton_kernels(request, monkeypatch):
    """The plan's ``transitions_in_order``: the Gluon transitions take the order's first rows (4 of 15 here) and,
    with the Gluon rerun, give the Triton kernels' bits in the grid's order, from NaN-poisoned workspaces."""
    nan_workspaces(monkeypatch)
    inp = make_inputs([3, 90, 0, 40, 130], heads=2, key_dim=64, seed=41)
    out, final = run_triton(inp, 1, sequence_parallel=64)
    ordered = dict(longest_first=True, transitions_in_order=True, **warpgroup(segmented=True))
    assert plan_for(inp, 1, sequence_parallel=64, **ordered).transition_grid[2] == 4
    emulation = request.getfixturevalue("gluon")
    got_o, got_s = run_triton(inp, 1, sequence_parallel=64, **ordered)
    assert torch.equal(got_o, out) and torch.equal(got_s, final)
    assert emulation.launches == 2  # the Gluon transitions and rerun


def test_open_entry_same_bits_as_the_triton_kernels(request):
    """Context parallelism's halves: every segment's transition from zero, then the rerun from an entry."""
    inp = make_inputs([150, 150], varlen=False, key_dim=64, value_dim=128, gate="weak", heads=1, seed=41)
    entry = inp.pop("initial_state")
    expected = run_open_entry(inp, entry, 2, segment_tokens=64)
    emulation = request.getfixturevalue("gluon")
    got = run_open_entry(inp, entry, 2, segment_tokens=64, **warpgroup(segmented=True))
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and emulation.launches == 2


def run_with_checkpoints(inp, plan):
    """:func:`fastkda.ops.prefill.chunk_kda_forward` with two checkpoints per sequence: ``(out, final, states)``."""
    from fastkda.ops.prefill import chunk_kda_forward

    num_seqs, heads, value_dim, key_dim = inp["initial_state"].shape
    offsets = torch.tensor([[32, 64], [0, 96]], dtype=torch.int32)
    states = torch.full((num_seqs, 2, heads, value_dim, key_dim), float("nan"))
    out = torch.full_like(inp["v"], float("nan"))
    final = torch.full_like(inp["initial_state"], float("nan"))
    chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=inp["A_log"],
                      dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=key_dim ** -0.5,
                      initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True,
                      use_beta_sigmoid=True, out=out, final_state=final, checkpoint_offsets=offsets,
                      checkpoint_states=states)
    return out, final, states


@pytest.mark.parametrize("sequence_parallel", [False, 64])
def test_checkpoints_and_fp32_v_as_the_triton_kernel(sequence_parallel, request):
    """Checkpoints at chunk multiples (the first at 0, one inside a segment), and fp32 q, k, v (the ring holds v
    as it comes)."""
    inp = make_inputs([100, 130], key_dim=64, value_dim=128, gate="weak", heads=1, seed=51)
    inp.update({name: inp[name].float() for name in ("q", "k", "v")})
    plan = plan_for(inp, 2, sequence_parallel=sequence_parallel)
    expected = run_with_checkpoints(inp, plan)
    emulation = request.getfixturevalue("gluon")
    got = run_with_checkpoints(inp, plan.replace(**warpgroup(segmented=bool(sequence_parallel))))
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and emulation.launches
    assert torch.isfinite(got[2]).all()


def test_malformed_cu_seqlens_counted_as_the_triton_kernels_count_them(request):
    """An offset past T and one out of order: the kernels clamp and count them (the GPU path takes such values
    unchecked), and the Gluon kernels count as many, with no race or stray read in the emulation. The outputs are
    unspecified then (they read workspace rows that no chunk wrote), so they are not compared."""
    from fastkda.ops.prefill import chunk_kda_forward

    inp = make_inputs([60, 40, 70], key_dim=64, value_dim=128, gate="weak", heads=1, seed=71)
    bad = inp["cu_seqlens"].clone()
    bad[1], bad[2] = 500, 30  # past T; then below its predecessor

    def run(**changes):
        plan = plan_for(inp, 2).replace(**changes)
        out = torch.full_like(inp["v"], float("nan"))
        final = torch.full_like(inp["initial_state"], float("nan"))
        errors = torch.zeros(3, dtype=torch.int32)
        chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=None, dt_bias=None,
                          lower_bound=None, scale=0.125, initial_state=inp["initial_state"], cu_seqlens=bad,
                          use_qk_l2norm=True, use_beta_sigmoid=True, out=out, final_state=final, errors=errors)
        return errors

    expected = run()
    assert expected.sum() > 0
    emulation = request.getfixturevalue("gluon")
    assert torch.equal(run(**warpgroup()), expected) and emulation.launches == 1


def test_the_emulation_catches_a_ring_slot_read_before_its_copies_land(gluon, monkeypatch):
    """A wait for one commit group fewer than the ring needs: the step reads a slot whose copies are in flight."""
    from fastkda.ops.prefill import recurrence_warpgroup

    monkeypatch.setattr(recurrence_warpgroup.async_copy, "wait_group",
                        lambda outstanding: gluon.wait(int(getattr(outstanding, "value", outstanding)) + 1))
    inp = make_inputs([100], varlen=False, key_dim=64, value_dim=128, heads=1, seed=61)
    with pytest.raises(Exception) as caught:
        run_triton(inp, 2, **warpgroup())
    assert "a shared-memory load reads shared memory that a cp.async group still in flight writes" in repr(
        caught.value)


def test_the_emulation_catches_a_product_used_before_it_completes(gluon, monkeypatch):
    """A wait for one product fewer than the step needs: its result is read while still in flight."""
    from fastkda.ops.prefill import recurrence_warpgroup

    waits = recurrence_warpgroup.warpgroup_mma_wait
    monkeypatch.setattr(recurrence_warpgroup, "warpgroup_mma_wait",
                        lambda num_outstanding=0, deps=None: waits(int(num_outstanding) + 1, deps))
    inp = make_inputs([40], varlen=False, key_dim=64, value_dim=128, heads=1, seed=64)
    with pytest.raises(Exception) as caught:
        run_triton(inp, 2, **warpgroup())
    assert "warpgroup_mma_wait returns a product still in flight" in repr(caught.value)


def test_the_emulation_catches_an_unfenced_store(gluon, monkeypatch):
    """T·β's halves written with no fence after: the tensor cores' next read of them is a race."""
    from fastkda.ops.prefill import recurrence_warpgroup

    monkeypatch.setattr(recurrence_warpgroup, "fence_async_shared", lambda: None)
    inp = make_inputs([40], varlen=False, key_dim=64, value_dim=128, heads=1, seed=62)
    with pytest.raises(Exception) as caught:
        run_triton(inp, 2, **warpgroup())
    assert "GluonRaceError" in repr(caught.value) and "fence_async_shared" in repr(caught.value)


def test_the_emulation_catches_a_write_to_memory_a_product_still_reads(gluon, monkeypatch):
    """Products never waited for: the refill of the previous chunk's ring slot (in the serial recurrence, issued
    first) or the next chunk's halves of T·β, written into memory the previous step's products read, is a race."""
    from fastkda.ops.prefill import recurrence_warpgroup

    monkeypatch.setattr(recurrence_warpgroup, "warpgroup_mma_wait",
                        lambda num_outstanding=0, deps=None: deps[0] if len(deps) == 1 else tuple(deps))
    inp = make_inputs([160], varlen=False, key_dim=64, value_dim=128, heads=1, seed=63)
    with pytest.raises(Exception) as caught:
        run_triton(inp, 2, **warpgroup())
    assert "GluonRaceError" in repr(caught.value) and "in flight uses" in repr(caught.value)


def test_the_emulation_rounds_bf16_to_nearest_even(gluon):
    """The emulated ``.to(bfloat16)`` rounds as the GPU does: halfway cases to the even neighbour."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x, y):
        offsets = tl.arange(0, 4)
        tl.store(y + offsets, tl.load(x + offsets).to(tl.bfloat16).to(tl.float32))

    x = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -7 - 2 ** -20, -3.14159])
    y = torch.empty(4)
    convert[(1,)](x, y)
    assert torch.equal(y, x.bfloat16().float())


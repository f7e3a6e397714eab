"""The Triton kernels themselves, on the CPU interpreter (``TRITON_INTERPRET=1``), against float64.

The kernels keep bf16 operands as their exact bf16 roundings in fp32 under the interpreter (see
``fastkda/ops/common.py``), so these errors are the GPU's, up to summation order."""

import pytest
import torch

from helpers import make_inputs, needs_interpreter, plan_for, rel_err, solve_lower
from prefill_kernels import nan_workspaces, reference, run_open_entry, run_triton

pytestmark = needs_interpreter

OUT_BOUND, STATE_BOUND = 4e-3, 3e-3  # issue 2's accuracy bar


CASES = [
    dict(lengths=[100], varlen=False),
    dict(lengths=[64, 64], varlen=False, with_initial=False),
    dict(lengths=[0, 70, 1, 130, 0], varlen=True),
    dict(lengths=[150, 20], varlen=True, gate="precomputed"),
    dict(lengths=[90], varlen=True, key_dim=128, state_dtype=torch.bfloat16),
    dict(lengths=[3, 65], varlen=True, cu_dtype=torch.int64),
    # a slot's sequence: 64 sequences (the most one load covers, layout.OWNER_LOOKUP_WIDTH) and 70 (a binary
    # search), empty ones among both; one head (the lookup does not depend on it), for the interpreter's time
    dict(lengths=[(5 * i) % 23 for i in range(64)], varlen=True, heads=1),
    dict(lengths=[(7 * i) % 41 for i in range(70)], varlen=True, cu_dtype=torch.int64, heads=1),
    dict(lengths=[70], varlen=True, key_dim=64, value_dim=128),  # K != V: the solve kernel's masked channel steps
    dict(lengths=[66], varlen=False, key_dim=128, value_dim=64, gate="precomputed"),
]


@pytest.mark.parametrize("case", CASES)
def test_kernels_match_float64(case):
    inp = make_inputs(seed=sum(case["lengths"]), **case)
    out, final = run_triton(inp)
    ref_o, ref_s = reference(inp)
    assert rel_err(out, ref_o) < OUT_BOUND
    assert rel_err(final, ref_s) < STATE_BOUND


@pytest.mark.parametrize("key_dim", [64, 128])
@pytest.mark.parametrize("lengths, varlen", [([100], False), ([0, 70, 1, 130], True)])
def test_saturated_lower_bound_gate(key_dim, lengths, varlen):
    """Every token decaying at the lower bound (-5 per token and channel): the preparation's factors reach their
    range's ends (2^±116 across 16 tokens), and must stay finite and accurate where they are kept, in whole
    chunks and in short tails, empty and 1-token sequences."""
    inp = make_inputs(lengths, varlen=varlen, key_dim=key_dim, seed=11)
    inp["g"] = torch.full_like(inp["g"], 40.0)  # σ(e^A_log·(40 + b)) = 1 in fp32
    out, final = run_triton(inp)
    ref_o, ref_s = reference(inp)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert rel_err(out, ref_o) < OUT_BOUND
    assert rel_err(final, ref_s) < STATE_BOUND


@pytest.mark.parametrize("value_dim, v_slices, state_rows_v", [
    (64, 1, False), (64, 2, True), (64, 2, False), (64, 4, False),
    (128, 2, True), (128, 2, False), (128, 4, False)])
def test_v_slices_and_state_forms_are_bitwise_identical(value_dim, v_slices, state_rows_v):
    """Against one whole slice in the transposed form (64 or 128 columns wide): every narrower slice, in either
    form (rows = V or rows = K), and the whole slice untransposed."""
    inp = make_inputs([0, 80, 1, 45], heads=2, key_dim=64, value_dim=value_dim, seed=3)
    base_o, base_s = run_triton(inp, 1)
    out, final = run_triton(inp, v_slices, state_rows_v=state_rows_v)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_equal_rows_same_bits_and_offsets_that_disagree_counted(cu_dtype):
    """A varlen batch whose ``max_seqlen`` hint gives every sequence one length (N·max_seqlen = T) runs as rows
    (the plan's ``equal_rows``): the varlen layout's bits, serial and in segments, nothing counted. Offsets that
    give other lengths are counted once per sequence whose entries disagree, and every output is still written."""
    inp = make_inputs([40, 40, 40], heads=2, key_dim=64, seed=5, cu_dtype=cu_dtype)
    assert plan_for(inp, 2, max_seqlen=40).equal_rows and not plan_for(inp, 2, max_seqlen=40).varlen
    for segments in (False, 32):
        errors = torch.zeros(3, dtype=torch.int32)
        base_o, base_s = run_triton(inp, 2, sequence_parallel=segments)
        out, final = run_triton(inp, 2, sequence_parallel=segments, max_seqlen=40, errors=errors)
        assert torch.equal(out, base_o) and torch.equal(final, base_s)
        assert errors.tolist() == [0, 0, 0]
    inp["cu_seqlens"] = torch.tensor([0, 30, 80, 120], dtype=cu_dtype)  # sequences 0 and 1 disagree, 2 agrees
    errors = torch.zeros(3, dtype=torch.int32)
    out, final = run_triton(inp, 2, max_seqlen=40, errors=errors)
    assert errors.tolist() == [0, 0, 2]
    assert torch.isfinite(out).all() and torch.isfinite(final).all()


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
def test_inverse_in_prepare_gives_the_solve_kernels_bits(gate):
    """The plan's ``inverse_in_prepare`` (the first kernel inverts its own chunk; no solve launch) gives the two
    kernels' outputs and final states bit for bit: varlen with empty and 1-token sequences (the longest first),
    segmented, and as rows under ``equal_rows``, whose malformed offsets it counts as the solve kernel does."""
    inp = make_inputs([0, 80, 1, 45, 33], heads=2, key_dim=64, gate=gate, seed=21)
    for changes in (dict(), dict(longest_first=True), dict(sequence_parallel=64, longest_first=True)):
        base_o, base_s = run_triton(inp, 2, inverse_in_prepare=False, **changes)
        out, final = run_triton(inp, 2, inverse_in_prepare=True, **changes)
        assert torch.equal(out, base_o) and torch.equal(final, base_s), changes
    rows = make_inputs([40, 40, 40], heads=2, key_dim=64, gate=gate, seed=22)
    rows["cu_seqlens"] = torch.tensor([0, 30, 80, 120], dtype=torch.int32)  # sequences 0 and 1 disagree
    counted = []
    for inverse_in_prepare in (False, True):
        errors = torch.zeros(3, dtype=torch.int32)
        counted.append((run_triton(rows, 2, max_seqlen=40, errors=errors, inverse_in_prepare=inverse_in_prepare),
                        errors.tolist()))
    (base, base_errors), (got, got_errors) = counted
    assert got_errors == base_errors == [0, 0, 2]
    assert all(torch.equal(x, y) for x, y in zip(got, base))


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
def test_early_chunks_last_writes_the_slot_orders_workspace(gate):
    """The plan's ``early_chunks_last`` (the preparation on one grid axis, heads innermost, from the last chunk
    slots back) writes every bit of the workspace that the two-axis slot order writes, over a NaN-poisoned one (a
    slot no program took would keep its NaN; one taken twice would leave another slot's NaN): rows with a partial
    last chunk and a varlen batch with empty and 1-token sequences and the longest first (its order section too:
    in segments it has more rows than there are chunk slots, so each program of head 0 writes several), with the
    solve kernel and with the inverse in the first kernel; and the whole call, serial and in segments, gives the
    slot order's outputs and final states, as does a varlen batch run as rows."""
    from fastkda.ops.prefill import prepare, solve
    from fastkda.ops.prefill.layout import Workspace

    # rows: 2 rows of 4 chunk slots, 3 heads (three different counts, so that no two can stand for each other)
    rows = make_inputs([100, 100], heads=3, key_dim=64, varlen=False, gate=gate, seed=31)
    batch = make_inputs([0, 70, 1, 45, 33], heads=3, key_dim=64, gate=gate, seed=32)
    # the batch in segments of two chunks: the longest-first order has more rows than there are chunk slots
    assert plan_for(batch, 2, sequence_parallel=64).recurrence_grid[2] > plan_for(batch, 2).chunk_slots
    for inp, segments, changes in ((rows, False, {}), (rows, 64, {}), (batch, False, dict(longest_first=True)),
                                   (batch, 64, dict(longest_first=True))):
        assert plan_for(inp, 2).early_chunks_last  # the automatic plan's choice
        gate_args = (inp["A_log"], inp["dt_bias"], inp["lower_bound"], 0.125, True, True)
        for folded in (False, True):
            written = []
            for early in (False, True):
                plan = plan_for(inp, 2, sequence_parallel=segments, early_chunks_last=early, inverse_in_prepare=folded,
                                **changes)
                slots = plan.chunk_slots
                assert plan.prepare_grid == ((slots * 3, 1, 1) if early else (slots, 3, 1))
                ws = Workspace.allocate(plan, inp["v"], inp["cu_seqlens"])
                ws.fp32.fill_(float("nan"))
                ws.bf16.fill_(float("nan"))
                prepare.launch_prepare(plan, ws, inp["q"], inp["k"], inp["g"], inp["beta"], *gate_args, None, True)
                if not folded:
                    solve.launch_solve(plan, ws, inp["beta"], True, None, True)
                written.append((ws.bf16.view(torch.int16), ws.fp32.view(torch.int32)))
            (base_bf16, base_fp32), (bf16, fp32) = written
            assert torch.equal(bf16, base_bf16) and torch.equal(fp32, base_fp32), (segments, changes, folded)
        base_o, base_s = run_triton(inp, 2, sequence_parallel=segments, early_chunks_last=False, **changes)
        out, final = run_triton(inp, 2, sequence_parallel=segments, early_chunks_last=True, **changes)
        assert torch.equal(out, base_o) and torch.equal(final, base_s), (segments, changes)
    serial_o, serial_s = run_triton(rows, 2, early_chunks_last=False)
    packed = make_inputs([100, 100], heads=3, key_dim=64, gate=gate, seed=31)
    out, final = run_triton(packed, 2, max_seqlen=100)
    assert torch.equal(out.view_as(serial_o), serial_o) and torch.equal(final, serial_s)


def test_longest_first_takes_the_sequences_longest_first_with_the_same_bits():
    """``longest_first``: the solve kernel writes the sequences sorted by length, longest first, ties in index
    order, and the recurrence's programs taking them in that order give the same outputs and final states (and
    count the same malformed offsets); on offsets past T the clamped lengths still give a permutation."""
    from fastkda.ops.prefill import prepare, solve
    from fastkda.ops.prefill.layout import Workspace

    lengths = [3, 70, 0, 33, 70, 1, 130]
    for cu_dtype in (torch.int32, torch.int64):
        inp = make_inputs(lengths, heads=2, key_dim=64, seed=9, cu_dtype=cu_dtype)
        base_o, base_s = run_triton(inp, 2)
        out, final = run_triton(inp, 2, longest_first=True)
        assert torch.equal(out, base_o) and torch.equal(final, base_s)
    gate = (inp["A_log"], inp["dt_bias"], inp["lower_bound"], 0.125, True, True)
    for folded, early in ((False, False), (True, False), (False, True), (True, True)):  # the order written by the
        # solve kernel or by the first kernel that inverts, on either grid
        plan = plan_for(inp, 2, longest_first=True, inverse_in_prepare=folded, early_chunks_last=early)
        for cu, want in ((inp["cu_seqlens"], [6, 1, 4, 3, 0, 5, 2]),
                         (torch.tensor([0, 3, 500, 0, 40, 307, 307, 307], dtype=torch.int32), [1, 4, 3, 0, 2, 5, 6])):
            ws = Workspace.allocate(plan, inp["v"], cu)
            ws.fp32.fill_(float("nan"))
            prepare.launch_prepare(plan, ws, inp["q"], inp["k"], inp["g"], inp["beta"], *gate, None, True)
            if not folded:
                solve.launch_solve(plan, ws, inp["beta"], True, None, True)
            assert_order_and_ranks(ws, want), (folded, early)
    bad = inp["cu_seqlens"].clone()
    bad[3] = 10_000  # past T: clamped and counted, the same count in either order
    counts = []
    for longest_first in (False, True):
        errors = torch.zeros(3, dtype=torch.int32)
        run_triton(dict(inp, cu_seqlens=bad), 2, errors=errors, longest_first=longest_first)
        counts.append(errors.tolist())
    assert counts[0] == counts[1] and counts[0][2] >= 1


def assert_order_and_ranks(ws, want):
    """The workspace's ``order`` section holds the rows ``want`` in order, then each row's place in it."""
    written = ws.fp32[ws.layout.order:].view(torch.int32).tolist()
    ranks = [want.index(z) for z in range(len(want))]
    assert written == want + ranks, (written, want + ranks)


def test_longest_first_orders_the_segment_programs_with_the_same_bits():
    """Under sequence parallelism the rerun's rows are each sequence's first segment, then one per segment slot
    (idle where the slot holds no later segment): the solve kernel sorts them by their chunks, the most first,
    among equal chunks the segments that are not their sequence's last first (those with a transition), ties in
    grid order (or the first kernel does, where it inverts), and the rerun taking them in that order gives the same
    bits."""
    from fastkda.ops.prefill import prepare, solve
    from fastkda.ops.prefill.layout import Workspace

    lengths, segment_chunks = [3, 70, 0, 33, 200, 1, 130], 2
    inp = make_inputs(lengths, heads=2, key_dim=64, seed=10)
    base_o, base_s = run_triton(inp, 2, sequence_parallel=32 * segment_chunks)
    out, final = run_triton(inp, 2, sequence_parallel=32 * segment_chunks, longest_first=True)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)
    plan = plan_for(inp, 2, sequence_parallel=32 * segment_chunks, longest_first=True)
    tokens, starts = 32 * segment_chunks, [sum(lengths[:n]) for n in range(len(lengths))]
    firsts = [start // tokens + n for n, start in enumerate(starts)]
    chunks = [-(-length // 32) for length in lengths]
    rows = [min(segment_chunks, c) for c in chunks]
    not_last = [c > segment_chunks for c in chunks]
    for slot in range(plan.segment_slots):
        n = max(i for i, first in enumerate(firsts) if first <= slot)
        j = slot - firsts[n]
        rows.append(min((j + 1) * segment_chunks, chunks[n]) - j * segment_chunks
                    if j > 0 and j * segment_chunks < chunks[n] else 0)
        not_last.append(j > 0 and (j + 1) * segment_chunks < chunks[n])
    assert len(rows) == plan.program_rows
    want = sorted(range(len(rows)), key=lambda z: (-rows[z], not not_last[z], z))
    assert rows[want[0]] == segment_chunks and rows[want[-1]] == 0
    # a last segment of full length (the 33-token sequence's first, of two chunks) ranks after every segment with a
    # transition, though earlier in the grid
    with_transition = [z for z in range(len(rows)) if not_last[z]]
    assert sorted(want[:len(with_transition)]) == with_transition
    assert any(rows[z] == segment_chunks and not not_last[z] and z < max(with_transition) for z in range(len(rows)))
    gate = (inp["A_log"], inp["dt_bias"], inp["lower_bound"], 0.125, True, True)
    for folded, early in ((False, False), (True, False), (False, True), (True, True)):  # the order written by the
        # solve kernel or by the first kernel that inverts, on either grid
        plan = plan.replace(inverse_in_prepare=folded, early_chunks_last=early)
        ws = Workspace.allocate(plan, inp["v"], inp["cu_seqlens"])
        ws.fp32.fill_(float("nan"))
        prepare.launch_prepare(plan, ws, inp["q"], inp["k"], inp["g"], inp["beta"], *gate, None, True)
        if not folded:
            solve.launch_solve(plan, ws, inp["beta"], True, None, True)
        assert_order_and_ranks(ws, want), (folded, early)


@pytest.mark.parametrize("lengths, rows, programs", [([3, 70, 0, 33, 200, 1, 130], 6, 21), ([100, 132], 3, 8)],
                         ids=["many idle", "every row needed"])
@pytest.mark.parametrize("rerun, scan", [(False, False), (True, False), (True, True)],
                         ids=["every rerun row", "rerun in order", "rerun and scan in order"])
def test_transitions_in_order_run_the_order_s_first_rows_with_the_same_bits(lengths, rows, programs, rerun, scan,
                                                                           monkeypatch):
    """The plan's ``transitions_in_order``: the transition kernel runs only the first ``T // segment_tokens`` rows
    of the recurrence's order (6 of 21 in a batch where most segment programs have no transition; 3 of 8 where all 3
    are needed beside a last segment of full work, the 100-token sequence's 36 tokens in two chunks), and the
    outputs and final states are the grid order's bits, from workspaces and outputs whose unwritten parts are NaN.
    With ``rerun_in_order`` the rerun runs only the first ``N + T // segment_tokens`` rows (13 of 21: every first
    segment, the empty sequence's too, and the six later ones; 5 of 8: every row with work). With
    ``scan_in_order`` the scan runs on the order's first ``min(N, T // segment_tokens)`` places (6 of 7 sequences,
    where the 70-, 200- and 130-token sequences have several segments; 2 of 2)."""
    nan_workspaces(monkeypatch)
    tokens = 64
    inp = make_inputs(lengths, heads=2, key_dim=64, seed=10)
    base_o, base_s = run_triton(inp, 2, sequence_parallel=tokens)
    assert torch.isfinite(base_o).all() and torch.isfinite(base_s).all()
    ordered = dict(longest_first=True, transitions_in_order=True, rerun_in_order=rerun, scan_in_order=scan)
    plan = plan_for(inp, 2, sequence_parallel=tokens, **ordered)
    assert plan.transition_grid[2] == sum(lengths) // tokens == rows < plan.segment_programs == programs
    assert plan.recurrence_grid[2] == (len(lengths) + rows if rerun else programs)
    assert plan.scan_grid[2] == (min(len(lengths), rows) if scan else len(lengths))
    for v_slices in (1, 2):
        out, final = run_triton(inp, v_slices, sequence_parallel=tokens, **ordered)
        assert torch.equal(out, base_o) and torch.equal(final, base_s), v_slices


@pytest.mark.parametrize("horner", [False, True])
@pytest.mark.parametrize("size, bound", [(0.3, 1e-3), (1.0, 3e-3), (4.0, 1e-4), ("ones", 1e-7)])
def test_solve_inverts_blocks_of_any_entry_size(size, bound, horner):
    """The solve kernel's T·diag(β) against float64, from a β·L scratch with entries up to ``size``. Under the
    plan's ``horner_inverse``: at most 1 (every block under the lower-bound or precomputed gate with normalised keys
    and β ≤ 1), fp16 operands, whose rounding is tf32's; at 4 the fp16 form's partial sums leave fp16's range, so
    the block must keep the series at the plan's precision (the interpreter's fp32 here) to stay finite and
    accurate. "ones": every entry below the diagonal 1, the edge of Horner's range, whose inverse (I minus the
    subdiagonal) every form gets exactly, and where a Horner step too few leaves an error of 1 in a corner."""
    inp = make_inputs([64], varlen=False, seed=5)
    plan = plan_for(inp, horner_inverse=horner)
    gen = torch.Generator().manual_seed(7)
    _, length, heads, _ = inp["q"].shape
    chunks, C = length // plan.chunk, plan.chunk
    entries = torch.ones(chunks, heads, C, C) if size == "ones" else size * (
        2 * torch.rand(chunks, heads, C, C, generator=gen) - 1)
    got, expected = solve_lower(plan, inp, entries, torch.rand(1, length, heads, generator=gen), True)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool))
    assert rel_err(got.double()[..., lower], expected[..., lower]) < bound


def test_horner_inverse_matches_float64():
    """The whole prefill under the plan's ``horner_inverse``, empty and 1-token sequences among others."""
    inp = make_inputs([0, 70, 1, 130, 0], varlen=True, seed=201)
    out, final = run_triton(inp, horner_inverse=True)
    ref_o, ref_s = reference(inp)
    assert rel_err(out, ref_o) < OUT_BOUND
    assert rel_err(final, ref_s) < STATE_BOUND


def test_fp32_inputs_are_bitwise_identical_across_slice_widths():
    """fp32 q, k, v (which the kernels take too): the 64-wide slices subtract the same v as the 128-wide one (the
    next chunk's v is carried as bf16 only when v is bf16)."""
    inp = make_inputs([80, 45], heads=1, key_dim=64, value_dim=128, seed=7)
    inp = dict(inp, **{name: inp[name].float() + 1e-3 * torch.randn(inp[name].shape) for name in ("q", "k", "v")})
    base_o, base_s = run_triton(inp, 1)
    out, final = run_triton(inp, 2)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)
    assert rel_err(out, reference(inp)[0]) < OUT_BOUND


def test_split_bf16_keeps_sixteen_bits():
    """T·β's two bf16 halves rebuild it to about 2^-16 (one bf16 tile keeps 2^-9, which costs the state its bar)."""
    from split_kernel import split_kernel

    x = torch.randn(1024, generator=torch.Generator().manual_seed(8)) * 10.0 ** torch.arange(-4, 4).repeat(128)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    split_kernel[(1,)](x, hi, lo, N=1024)
    assert torch.equal(hi, x.to(torch.bfloat16).float()) and torch.equal(lo, (x - hi).to(torch.bfloat16).float())
    assert ((hi + lo - x).abs() <= x.abs() * 2.0 ** -15).all() and ((hi - x).abs() > x.abs() * 2.0 ** -12).any()


def _filled(allocate, value):
    """``Workspace.allocate`` whose buffers are filled with ``value`` (the kernels get ``torch.empty``'s memory,
    which holds whatever the last user left)."""
    def filled(plan, v, cu_seqlens):
        ws = allocate(plan, v, cu_seqlens)
        ws.bf16.fill_(value)
        ws.fp32.fill_(value)
        return ws
    return staticmethod(filled)


@pytest.mark.parametrize("lengths, varlen, gate, v_slices, sequence_parallel", [
    ([0, 75, 1, 140], True, "lower_bound", 2, False), ([70, 70], False, "lower_bound", 2, False),
    ([0, 75, 1, 140], True, "precomputed", 1, False), ([0, 75, 1, 140], True, "weak", 1, 64)])
def test_workspace_memory_never_written_is_never_read(lengths, varlen, gate, v_slices, sequence_parallel,
                                                      monkeypatch):
    """The in-chunk matrices' sectors past the diagonal (``tiles.lower_sectors``) are read by no kernel, and left
    unwritten where the first kernel masks its stores (fixed-length inputs, the precomputed gate): a NaN-poisoned
    workspace gives the bits of a zeroed one, under both gates and layouts, V-slices and sequence parallelism."""
    inp = make_inputs(lengths, varlen=varlen, heads=1, key_dim=64, value_dim=64, gate=gate, seed=12)
    from fastkda.ops.prefill.layout import Workspace

    allocate, runs = Workspace.allocate, []
    for value in (0.0, float("nan")):
        monkeypatch.setattr(Workspace, "allocate", _filled(allocate, value))
        runs.append(run_triton(inp, v_slices, sequence_parallel=sequence_parallel))
    (zero_o, zero_s), (nan_o, nan_s) = runs
    assert torch.isfinite(nan_o).all() and torch.isfinite(nan_s).all()
    assert torch.equal(nan_o, zero_o) and torch.equal(nan_s, zero_s)


@pytest.fixture(scope="module")
def four_slice_run():
    """Inputs and their outputs under the plan's launch numbers at four V-slices, shared by the cases below."""
    inp = make_inputs([0, 80, 1, 45], heads=2, key_dim=64, value_dim=128, seed=4)
    return inp, run_triton(inp, 4)


@pytest.mark.parametrize("changes", [dict(state_rows_v=True), dict(prepare_warps=2),
                                     dict(solve_warps=2), dict(recurrence_stages=1),
                                     dict(prepare_registers=128)])
def test_other_launch_numbers_give_the_same_bits(changes, four_slice_run):
    """Launch numbers a sweep may set (warps, stages, register caps, the state's form) change how the kernels are
    scheduled, never what they add in which order (``prepare_token_run`` and ``prepare_channels`` do: they order
    the in-chunk cumulative sum and the products' sums)."""
    inp, (base_o, base_s) = four_slice_run
    out, final = run_triton(inp, 4, **changes)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)


def test_bf16_final_state_and_no_final_state():
    inp = make_inputs([70], seed=5, with_initial=False)
    ref_o, ref_s = reference(inp)
    out, final = run_triton(inp, final_dtype=torch.bfloat16)
    assert final.dtype == torch.bfloat16 and rel_err(final, ref_s) < STATE_BOUND
    out_only, none = run_triton(inp, use_final=False)
    assert none is None and torch.equal(out_only, out)


def test_every_launch_number_comes_from_the_plan(monkeypatch):
    """Each stage launches with the grid, warps, stages and tile sizes of the plan it is given: a plan whose numbers
    differ from the defaults reaches every launch unchanged (the kernels are not run here)."""
    from fastkda.ops.prefill import chunk_kda_forward, prepare, recurrence, solve

    launched = {}
    for module in (prepare, solve, recurrence):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **meta: launched.setdefault(
            kernel.__name__, (grid, meta)))
    inp = make_inputs([40, 90], heads=3, key_dim=64, value_dim=128, gate="precomputed", seed=5)
    plan = plan_for(inp, 2, prepare_warps=2, prepare_stages=1, prepare_channels=16, prepare_token_run=2,
                    solve_warps=1, solve_stages=2, recurrence_warps=8, recurrence_stages=2,
                    state_rows_v=False, horner_inverse=False, dot_precision="ieee")
    chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=None, dt_bias=None,
                      lower_bound=None, scale=0.125, initial_state=None, cu_seqlens=inp["cu_seqlens"],
                      use_qk_l2norm=True, use_beta_sigmoid=True, out=torch.empty_like(inp["v"]), final_state=None)
    expected = {
        "prepare_kernel": (plan.prepare_grid, dict(num_warps=2, num_stages=1, BK=16, RUN=2, C=32, BC=16, K=64)),
        "solve_kernel": (plan.prepare_grid, dict(num_warps=1, num_stages=2, C=32, BC=16)),
        "recurrence_kernel": (plan.recurrence_grid, dict(num_warps=8, num_stages=2, BV=64, C=32, K=64, V=128,
                                                         STATE_ROWS_V=False)),
    }
    assert set(launched) == set(expected)
    for name, (grid, numbers) in expected.items():
        assert launched[name][0] == grid, name
        assert {key: launched[name][1][key] for key in numbers} == numbers, name
        if name != "recurrence_kernel":  # the recurrence's products all have bf16 operands
            assert launched[name][1]["DOT_PRECISION"] == "ieee", name
    assert plan.prepare_grid == (plan.chunk_slots * 3, 1, 1) and plan.recurrence_grid == (2, 3, 2)
    assert launched["prepare_kernel"][1]["EARLY_CHUNKS_LAST"] and launched["solve_kernel"][1]["EARLY_CHUNKS_LAST"]


def test_the_warpgroup_recurrence_launches_the_plans_numbers(monkeypatch):
    """The Gluon kernels (``warpgroup_recurrence``, ``warpgroup_transition``) get the plan's grids, stages and
    warps; under the interpreter, which runs no Gluon kernel, and on a v whose rows their copies cannot take, the
    same plan launches the Triton kernels instead (the kernels are not run)."""
    from fastkda.ops.prefill import chunk_kda_forward, prepare, recurrence, solve
    from fastkda.ops.prefill.layout import Workspace

    launched = {}
    for module in (prepare, solve, recurrence):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **meta: launched.setdefault(
            kernel.__name__, (grid, meta)))
    inp = make_inputs([40, 90], heads=3, key_dim=128, value_dim=128, seed=5)
    plan = plan_for(inp, 2, warpgroup_recurrence=True, recurrence_stages=5)
    out = torch.empty_like(inp["v"])
    chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=inp["A_log"],
                      dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=0.125, initial_state=None,
                      cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True, use_beta_sigmoid=True, out=out,
                      final_state=None)
    assert "recurrence_kernel" in launched and "warpgroup_recurrence_kernel" not in launched
    errors = torch.zeros(3, dtype=torch.int32)
    recurrence.launch_recurrence(plan, Workspace.allocate(plan, inp["v"], inp["cu_seqlens"]), out, None, None, None,
                                 None, errors, emulate=False)
    grid, meta = launched["warpgroup_recurrence_kernel"]
    assert grid == plan.recurrence_grid == (2, 3, 2)
    assert {key: meta[key] for key in ("STAGES", "num_warps", "BV", "C", "K", "V", "SEGMENTED")} == dict(
        STAGES=5, num_warps=4, BV=64, C=32, K=128, V=128, SEGMENTED=False)
    segmented = plan_for(inp, 1, sequence_parallel=64, warpgroup_transition=True, transition_stages=4)
    recurrence.launch_transitions(segmented, Workspace.allocate(segmented, inp["v"], inp["cu_seqlens"]), None,
                                  emulate=False)
    grid, meta = launched["warpgroup_transition_kernel"]
    assert grid == segmented.transition_grid and (meta["STAGES"], meta["num_warps"], meta["BV"]) == (4, 4, 64)
    launched.clear()
    narrow = inp["v"].new_zeros(*inp["v"].shape[:2], 3 * 128 + 8)[..., :384].unflatten(2, (3, 128))
    recurrence.launch_recurrence(plan, Workspace.allocate(plan, narrow, inp["cu_seqlens"]), out, None, None, None,
                                 None, errors, emulate=False)
    recurrence.launch_transitions(segmented, Workspace.allocate(segmented, narrow, inp["cu_seqlens"]), None,
                                  emulate=False)
    # rows 392 elements apart: the Triton kernels, the transitions at the plan's transition_stages
    assert set(launched) == {"recurrence_kernel", "transition_kernel"}
    assert launched["transition_kernel"][1]["num_stages"] == segmented.transition_stages == 4
    assert launched["recurrence_kernel"][1]["num_stages"] == plan.recurrence_stages == 5


def test_no_module_level_launch_constants_in_ops():
    """Every launch number lives in the plan: no module of fastkda.ops holds a number (math constants aside)."""
    import importlib
    import pkgutil

    import fastkda.ops

    # log2(e), the precomputed gate's floor, and how many sequences the varlen lookup and the ordered scan's duties
    # cover in one load (properties of those loops, which give the same results either way): not launch numbers
    allowed = {"LOG2E", "LOG_DECAY_FLOOR", "OWNER_LOOKUP_WIDTH", "DUTY_LANES"}
    names = [m.name for m in pkgutil.walk_packages(fastkda.ops.__path__, "fastkda.ops.")]
    assert "fastkda.ops.prefill.recurrence" in names
    for name in names:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            number = type(value) in (int, float) or type(getattr(value, "value", None)) in (int, float)
            assert not number or attr in allowed, f"{name}.{attr} = {value!r}"


SP_CASES = [  # (inputs, segment chunks): many short segments, so every role of every kernel runs; one head but in
    # the last case (two), for the interpreter's time
    (dict(lengths=[0, 200, 1, 130, 33], varlen=True, gate="weak", heads=1), 2),
    (dict(lengths=[150, 150], varlen=False, gate="weak", state_dtype=torch.bfloat16, heads=1), 1),
    (dict(lengths=[190, 40], varlen=True, key_dim=128, value_dim=64, gate="weak", heads=1), 2),
    (dict(lengths=[100, 97], varlen=True, key_dim=64, value_dim=128, gate="lower_bound", with_initial=False), 1),
]


@pytest.mark.parametrize("case,segment_chunks", SP_CASES)
def test_sequence_parallel_kernels_match_float64(case, segment_chunks):
    """Transitions, scan and rerun against float64, with the state outliving the segments (weak gate): within the
    bar, or (where the weak gate's long-lived state takes the serial path past it) within 10% of the serial
    error."""
    inp = make_inputs(seed=sum(case["lengths"]) + 1, **case)
    out, final = run_triton(inp, 1, sequence_parallel=segment_chunks * 32)
    serial_o, serial_s = run_triton(inp, 1)
    ref_o, ref_s = reference(inp)
    assert rel_err(out, ref_o) < max(OUT_BOUND, 1.1 * rel_err(serial_o, ref_o))
    assert rel_err(final, ref_s) < max(STATE_BOUND, 1.1 * rel_err(serial_s, ref_s))


def test_sequence_parallel_bits_across_slices_and_widths():
    """One segmentation, any V-slices, transition width and scan width: the same bits; the first segment's tokens
    and a sequence of one segment: the serial bits; later segments: their own."""
    inp = make_inputs([0, 200, 1, 45], heads=1, key_dim=64, value_dim=128, gate="weak", seed=6)
    base_o, base_s = run_triton(inp, 1, sequence_parallel=64)
    for v_slices, width, scan_width in ((2, 32, 16), (4, 64, 32), (4, 16, 64)):
        out, final = run_triton(inp, v_slices, sequence_parallel=64, transition_width=width, scan_width=scan_width)
        assert torch.equal(out, base_o) and torch.equal(final, base_s), (v_slices, width, scan_width)
    serial_o, serial_s = run_triton(inp, 1)
    assert torch.equal(base_o[:, :64], serial_o[:, :64]) and torch.equal(base_o[:, 200:], serial_o[:, 200:])
    assert torch.equal(base_s[2:], serial_s[2:]) and not torch.equal(base_o[:, 64:200], serial_o[:, 64:200])


def test_sequence_parallel_launches_follow_the_plan(monkeypatch):
    from fastkda.ops.prefill import chunk_kda_forward, prepare, recurrence, scan, solve

    launched = []
    for module in (prepare, solve, recurrence, scan):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **meta: launched.append(
            (kernel.__name__, grid, meta)))
    inp = make_inputs([40, 290], heads=3, key_dim=64, value_dim=128, gate="weak", seed=5)
    plan = plan_for(inp, 2, sequence_parallel=96, transition_width=32, scan_warps=2, solve_registers=72)
    chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=None, dt_bias=None,
                      lower_bound=None, scale=0.125, initial_state=None, cu_seqlens=inp["cu_seqlens"],
                      use_qk_l2norm=True, use_beta_sigmoid=True, out=torch.empty_like(inp["v"]), final_state=None)
    names = [name for name, _, _ in launched]
    assert names == ["prepare_kernel", "solve_kernel", "transition_kernel", "segment_scan_kernel",
                     "recurrence_kernel"]
    assert launched[1][2]["maxnreg"] == 72 and launched[0][2]["maxnreg"] is None  # the precomputed gate: uncapped
    _, grid, meta = launched[2]
    assert grid == plan.transition_grid == (6, 3, 2 + 330 // 96 + 3) and meta["BV"] == 32
    assert meta["num_warps"] == plan.transition_warps
    _, grid, meta = launched[3]
    assert grid == plan.scan_grid == (8, 3, 2) and meta["num_warps"] == 2 and meta["SW"] == plan.scan_width
    _, grid, meta = launched[4]
    assert grid == plan.recurrence_grid == (2, 3, 2 + plan.segment_slots) and meta["SEGMENTED"]


OPEN_CASES = [  # (inputs, tokens per segment): several segments and a partial last one, one segment, K != V
    (dict(lengths=[150, 150], varlen=False, gate="weak", heads=1), 64),
    (dict(lengths=[40], varlen=False, gate="lower_bound"), 64),
    (dict(lengths=[97], varlen=False, key_dim=128, value_dim=64, gate="weak", heads=1), 32),
    (dict(lengths=[70], varlen=False, key_dim=64, value_dim=128, gate="weak", heads=1), 64),
]


@pytest.mark.parametrize("case,segment_tokens", OPEN_CASES)
def test_open_entry_kernels_match_float64(case, segment_tokens):
    """The map of every row (from the entry [0; I]) gives the float64 final state of any entry; the second half
    from an entry state gives the float64 prefill from it, as does the map applied to it: within the bar, or
    (where the weak gate's long-lived state takes the serial path past it) within 10% of the serial error."""
    inp = make_inputs(seed=sum(case["lengths"]) + 2, **case)
    inp["beta"] = inp["beta"] - 3.0  # sigmoid ~ 0.05: the entry state outlives the tokens, so a wrong 𝒜 shows
    entry = inp.pop("initial_state")
    exit_map, out, final = run_open_entry(inp, entry, segment_tokens=segment_tokens)
    ref_o, ref_s = reference(dict(inp, initial_state=entry))
    serial_o, serial_s = run_triton(dict(inp, initial_state=entry))
    out_bound = max(OUT_BOUND, 1.1 * rel_err(serial_o, ref_o))
    state_bound = max(STATE_BOUND, 1.1 * rel_err(serial_s, ref_s))
    _, from_zero = reference(dict(inp, initial_state=None))
    value_dim = inp["v"].shape[3]
    assert rel_err(out, ref_o) < out_bound and rel_err(final, ref_s) < state_bound
    assert rel_err(exit_map[:, :, :value_dim], from_zero) < STATE_BOUND
    mapped = entry.float() @ exit_map[:, :, value_dim:] + exit_map[:, :, :value_dim]  # X·𝒜ᵀ + ℬᵀ
    assert rel_err(mapped, ref_s) < state_bound
    if case["gate"] == "weak":  # the entry outlives the tokens: the map's linear part is tested
        assert rel_err(exit_map[:, :, :value_dim], ref_s) > 0.1


def test_open_entry_bits_across_slices_and_widths():
    """One segmentation, any V-slices and transition width: the same map, outputs and final state."""
    inp = make_inputs([130, 130], varlen=False, heads=1, key_dim=64, value_dim=128, gate="weak", seed=8)
    entry = inp.pop("initial_state")
    base = run_open_entry(inp, entry, 1)
    for v_slices, width in ((2, 32), (4, 64)):
        again = run_open_entry(inp, entry, v_slices, transition_width=width)
        assert all(torch.equal(a, b) for a, b in zip(again, base)), (v_slices, width)

"""The launch plans: pure functions of host-known facts, with overrides, that reject what the kernels cannot run."""

import dataclasses

import pytest

from fastkda.plan import (V_SLICE_CHOICES, DecodePlan, PrefillPlan, choose_decode_plan, choose_decode_step_plan,
                          choose_plan, conv_update_launch, decode_plan_request, parse_v_slices, phase_us,
                          prefill_plan_request, requested_decode_plan, requested_prefill_plan, requested_v_slices)


def plan(num_seqs, heads, value_dim=128, sms=132, **kw):
    """The plan of ``num_seqs`` 8192-token sequences; serial (the V-split's rule) unless ``kw`` says otherwise."""
    kw.setdefault("sequence_parallel", False)
    return choose_plan(num_seqs, heads, 8192 * num_seqs, 128, value_dim, sms, **kw)


@pytest.mark.parametrize("sms", [78, 132, 188])
def test_slices_never_decrease_as_parallelism_drops(sms):
    for heads in (1, 4, 8, 12, 16, 24, 48, 96):
        previous = None
        for num_seqs in range(64, 0, -1):
            chosen = plan(num_seqs, heads, sms=sms)
            assert chosen.v_slices in V_SLICE_CHOICES
            assert previous is None or chosen.v_slices >= previous
            previous = chosen.v_slices


def test_slices_respect_value_width():
    assert plan(1, 1, value_dim=64).slice_width == 64
    assert choose_plan(1, 1, 8192, 64, 64, 132, v_slices=4).slice_width == 16  # asked for: the narrowest allowed
    with pytest.raises(ValueError, match="at least 16 columns"):
        choose_plan(1, 1, 8192, 64, 64, 132).replace(v_slices=8)


def test_rule_boundaries():
    """The most slices of at least 64 columns whose s·N·H programs fit one per SM."""
    assert plan(1, 12).v_slices == 2  # 2*12 = 24: four 32-wide slices would fit, but their step is the slower one
    assert plan(2, 12).v_slices == 2
    assert plan(3, 12).v_slices == 2  # 2*36 = 72
    assert plan(5, 12).v_slices == 2  # 2*60 = 120 <= 132
    assert plan(6, 12).v_slices == 1  # 2*72 = 144 > 132
    assert plan(4, 16).v_slices == 2  # 2*64 = 128
    assert plan(1, 96).v_slices == 1  # 2*96 = 192 > 132
    assert plan(1, 1, value_dim=64).v_slices == 1  # V = 64 stays whole: no slice of 64 columns is narrower
    assert "2 slices would put 144 programs on 132 SMs" in plan(6, 12).reason
    assert "fit one per SM" in plan(5, 12).reason and "4 slices" not in plan(1, 12).reason
    assert plan(1, 12, v_slices=4).v_slices == 4  # asked for: 32-wide slices still run


def test_the_states_form():
    """Slices from 64 columns hold the state transposed, 128-column ones on 8 warps; every plan's steps form
    v_new from kd and v, the solve kernel only inverts."""
    assert plan(1, 96).state_rows_v and plan(1, 96).recurrence_warps == 8
    assert plan(1, 12).state_rows_v and plan(1, 12).recurrence_warps == 4
    assert not plan(1, 12, v_slices=4).state_rows_v and plan(1, 12, v_slices=4).recurrence_warps == 4


def test_preparation_numbers_follow_the_gate_and_key_dim():
    lower = choose_plan(1, 12, 8192, 128, 128, 132)
    assert (lower.prepare_channels, lower.prepare_token_run) == (128, 2)
    precomputed = choose_plan(1, 12, 8192, 64, 64, 132, lower_bound_gate=False)
    assert (precomputed.prepare_channels, precomputed.prepare_token_run) == (32, 2)


def test_grids_and_slots():
    fixed = choose_plan(3, 4, 100, 64, 64, 132, varlen=False)
    assert fixed.batch == 3 and fixed.chunk_slots == 3 * 4 and fixed.prepare_grid == (12 * 4, 1, 1)
    assert fixed.replace(early_chunks_last=False).prepare_grid == (12, 4, 1)
    varlen = choose_plan(3, 4, 100, 64, 64, 132)
    assert varlen.batch == 1 and varlen.chunk_slots == 100 // 32 + 3 + 1
    assert varlen.prepare_grid == (varlen.chunk_slots * 4, 1, 1)
    assert varlen.replace(early_chunks_last=False).prepare_grid == (varlen.chunk_slots, 4, 1)
    assert varlen.recurrence_grid == (varlen.v_slices, 4, 3)


def test_launch_numbers_round_trip_and_changes_are_validated():
    chosen = plan(2, 12)
    assert PrefillPlan.from_launch_numbers(chosen.launch_numbers(), chosen.dot_precision) == chosen
    assert all(type(n) is int for n in chosen.launch_numbers())
    changed = chosen.replace(prepare_warps=8, recurrence_stages=2)
    assert changed.prepare_warps == 8 and "overridden: prepare_warps=8, recurrence_stages=2" in changed.reason
    for bad, message in ((dict(v_slices=3), "v_slices=3 must cut"), (dict(v_slices=16), "v_slices=16 must cut"),
                         (dict(prepare_warps=3), "prepare_warps must be one of"),
                         (dict(solve_stages=0), "solve_stages must be >= 1"),
                         (dict(prepare_channels=16), "every key channel in one step"),
                         (dict(prepare_channels=64), "every key channel in one step"),
                         (dict(prepare_token_run=5), "prepare_token_run must divide"),
                         (dict(chunk=64), "chunks of two 16-token blocks"),
                         (dict(dot_precision="bf16"), "dot_precision must be"),
                         (dict(key_dim=96), "key_dim must be one of"), (dict(heads=0), "heads must be >= 1")):
        with pytest.raises(ValueError, match=f"fastkda plan: .*{message}"):  # its own check, not another's
            chosen.replace(**bad)
    assert DecodePlan.from_launch_numbers(choose_decode_plan(3, 4, 128, 132).launch_numbers()).v_slices == 8


def test_the_scan_width_is_a_launch_number_checked_against_the_state():
    segmented = plan(1, 12, sequence_parallel=1024)
    assert segmented.scan_width == 16 and segmented.scan_grid == (8, 12, 1)
    wider = segmented.replace(scan_width=64)
    assert wider.scan_grid == (2, 12, 1) and "scan over each sequence's segments (64 state columns" in wider.describe()
    assert PrefillPlan.from_launch_numbers(wider.launch_numbers(), wider.dot_precision) == wider
    narrow = choose_plan(1, 12, 8192, 128, 64, 132, sequence_parallel=1024)
    for chosen, bad in ((segmented, dict(scan_width=8)), (segmented, dict(scan_width=128)),
                        (narrow, dict(scan_width=128)), (segmented, dict(scan_width=48))):
        with pytest.raises(ValueError, match="fastkda plan: .*scan_width must be one of"):
            chosen.replace(**bad)


def test_the_warpgroup_recurrence_takes_slices_of_64_and_128_columns():
    serial = plan(4, 12).replace(v_slices=2)
    assert serial.slice_width == 64 and not serial.warpgroup_recurrence  # off unless asked for
    chosen = serial.replace(warpgroup_recurrence=True, recurrence_stages=4)
    assert "Gluon" in chosen.describe()
    assert PrefillPlan.from_launch_numbers(chosen.launch_numbers(), chosen.dot_precision) == chosen
    assert chosen.replace(v_slices=1, recurrence_warps=8).slice_width == 128
    assert chosen.replace(recurrence_stages=5).recurrence_stages == 5  # 64 columns: 5 stages fit, 6 do not
    segmented = plan(1, 12, sequence_parallel=1024).replace(warpgroup_recurrence=True, recurrence_stages=4)
    assert segmented.segment_chunks and not segmented.warpgroup_transition  # each kernel its own choice
    for bad in (dict(recurrence_stages=3), dict(recurrence_stages=6), dict(v_slices=1), dict(v_slices=4),
                dict(state_rows_v=False), dict(v_slices=1, recurrence_warps=8, recurrence_stages=5)):
        with pytest.raises(ValueError, match="warpgroup_recurrence"):
            chosen.replace(**bad)


def test_rows_of_one_token_keep_the_triton_recurrence():
    """Triton 3.6 fails to lower the Gluon kernels specialised to ``seq_len == 1`` (a one-token sequence run as a
    row): the automatic plan keeps the Triton kernel there, and a plan asking for Gluon is refused."""
    for facts, varlen in (((1, 3, 1, 64, 128), True), ((2, 3, 1, 128, 128), False), ((1, 4, 1, 128, 128), False)):
        one = choose_plan(*facts, 132, varlen=varlen, warpgroup_mma=True)
        assert one.seq_len == 1 and not one.warpgroup_recurrence, facts
        with pytest.raises(ValueError, match="seq_len > 1"):
            one.replace(warpgroup_recurrence=True, recurrence_stages=4)
    assert choose_plan(2, 3, 2, 128, 128, 132, varlen=False, warpgroup_mma=True).warpgroup_recurrence


def test_the_warpgroup_transitions_take_segments_of_64_and_128_column_slices():
    segmented = plan(1, 12, sequence_parallel=1024)
    assert segmented.transition_width == 64 and not segmented.warpgroup_transition  # off unless asked for
    chosen = segmented.replace(warpgroup_transition=True, transition_stages=4)
    assert "(the Gluon kernel)" in chosen.describe() and not chosen.warpgroup_recurrence
    back = PrefillPlan.from_launch_numbers(chosen.launch_numbers(), chosen.dot_precision)
    assert back == chosen and type(back.warpgroup_transition) is bool and back.transition_stages == 4
    assert chosen.replace(transition_width=128).transition_width == 128  # 128 columns: 4 stages fit, 5 do not
    for bad in (dict(transition_stages=3), dict(transition_stages=6), dict(transition_width=32),
                dict(segment_chunks=0), dict(transition_width=128, transition_stages=5)):
        with pytest.raises(ValueError, match="warpgroup_transition"):
            chosen.replace(**bad)
    with pytest.raises(ValueError, match="transition_stages must be >= 1"):
        segmented.replace(transition_stages=0)


def test_on_hopper_the_automatic_plan_runs_the_gluon_kernels_where_they_were_measured_faster():
    """With ``warpgroup_mma`` (an sm_90 GPU) the segments' transitions (64 columns in the automatic plan) and the
    recurrence of 64- and 128-column slices, serial or rerunning segments, run the Gluon kernels (the transitions
    at 4 stages, the recurrence at 5 at 64 columns and 4 at 128), also a serial recurrence whose programs fill
    less than half the SMs (H12 N1: 24), but not one of 32-column slices; without it, nothing changes."""
    from fastkda.plan import choose_open_entry_plan

    narrow = dict(warpgroup_recurrence=True, recurrence_stages=5)  # 64 columns
    wide = dict(warpgroup_recurrence=True, recurrence_stages=4)  # 128 columns
    transitions = dict(warpgroup_transition=True, transition_stages=4)
    for facts, expected in (((4, 12, 8192), narrow), ((5, 12, 1024), narrow), ((8, 96, 1024), wide),
                            ((1, 12, 1024), narrow), ((2, 12, 1024), narrow),
                            ((1, 12, 65536), dict(wide, **transitions)),
                            ((1, 24, 65536), dict(wide, **transitions))):
        triton_plan = choose_plan(*facts, 128, 128, 132)
        hopper = choose_plan(*facts, 128, 128, 132, warpgroup_mma=True)
        assert dataclasses.replace(triton_plan, **expected, reason=hopper.reason) == hopper, facts  # nothing else
        lines = hopper.describe().splitlines()
        recurrence_line = next(line for line in lines if line.startswith("recurrence:"))
        parallel_line = next(line for line in lines if line.startswith("sequence parallelism:"))
        assert ("the Gluon kernel" in recurrence_line) == hopper.warpgroup_recurrence, facts
        assert ("(the Gluon kernel)" in parallel_line) == hopper.warpgroup_transition, facts
    assert choose_plan(4, 12, 8192, 128, 128, 132, warpgroup_mma=True).slice_width == 64
    assert choose_plan(8, 96, 1024, 128, 128, 132, warpgroup_mma=True).slice_width == 128
    narrow = choose_plan(1, 12, 1024, 128, 128, 132, v_slices=4, sequence_parallel=False, warpgroup_mma=True)
    assert narrow.slice_width == 32 and not narrow.warpgroup_recurrence
    opened = choose_open_entry_plan(2, 12, 8192, 128, 128, 132, warpgroup_mma=True)
    assert opened.warpgroup_transition and opened.warpgroup_recurrence and opened.transition_width == 64


def test_longest_first_where_a_varlen_batchs_programs_take_turns():
    """The recurrence of a varlen batch whose programs outnumber the SMs takes its rows (sequences, or segment
    programs) longest first; a batch that fits one wave, fixed-length rows, a varlen batch whose ``max_seqlen`` hint
    says every sequence has one length (N·max_seqlen = T: it runs as rows) and one sequence keep the grid's order;
    the describe line says it; a fixed-length plan asking for it is refused."""
    mix = choose_plan(6, 96, 8192, 128, 128, 132, max_seqlen=3063)
    assert mix.longest_first and not mix.segment_chunks and mix.programs > 132
    assert "the longest first" in mix.describe()
    chunked = choose_plan(13, 24, 8192, 128, 128, 132, max_seqlen=6144)  # the chunked-prefill mix: 32 rows
    assert chunked.longest_first and chunked.segment_chunks and chunked.recurrence_grid[2] * 24 > 132
    equal = choose_plan(8, 96, 8192, 128, 128, 132, max_seqlen=1024)  # H96 1024x8: every sequence the hint's length
    assert equal.programs > 132 and choose_plan(8, 96, 8192, 128, 128, 132, max_seqlen=1100).longest_first
    assert "the max_seqlen hint gives every sequence one length" in equal.describe()
    for facts, changes in (((5, 12, 1024), {}), ((8, 96, 1024), dict(varlen=False)), ((1, 96, 8192), {}),
                           ((1, 12, 65536), {}), ((8, 96, 8192), dict(max_seqlen=1024))):
        plan = choose_plan(*facts, 128, 128, 132, **changes)
        assert not plan.longest_first, facts
        assert "longest first" not in plan.describe(), facts
    assert choose_plan(1, 12, 65536, 128, 128, 132).segment_chunks
    with pytest.raises(ValueError, match="longest_first orders the recurrence of a varlen batch"):
        choose_plan(8, 96, 1024, 128, 128, 132, varlen=False).replace(longest_first=True)


def test_early_chunks_last_in_every_automatic_plan():
    """The preparation runs from the last chunk slots back, heads innermost (one grid axis of slots x heads), in
    every automatic plan: rows, one sequence, a varlen batch run as rows or not (the longest first), in segments;
    the describe line says it, and a plan without it keeps the two-axis grid."""
    for facts, changes in (((5, 12, 1024), dict(varlen=False)), ((5, 12, 5120), dict(max_seqlen=1024)),
                           ((1, 12, 1024), {}), ((6, 96, 8192), dict(max_seqlen=3063)), ((1, 12, 65536), {}),
                           ((13, 24, 8192), dict(max_seqlen=6144))):
        plan = choose_plan(*facts, 128, 128, 132, **changes)
        assert plan.early_chunks_last and plan.prepare_grid == (plan.chunk_slots * plan.heads, 1, 1), facts
        assert "from the last chunks back to the first" in plan.describe(), facts
        off = plan.replace(early_chunks_last=False)
        assert off.prepare_grid == (plan.chunk_slots, plan.heads, 1)
        assert "from the last chunks back to the first" not in off.describe()
    assert choose_plan(1, 12, 65536, 128, 128, 132).segment_chunks
    assert choose_plan(6, 96, 8192, 128, 128, 132, max_seqlen=3063).longest_first


def test_transitions_in_order_where_the_longest_first_order_has_segments():
    """The transition kernel runs the order's first T // segment_tokens rows wherever a varlen plan in segments
    takes its rows longest first (the chunked mix: 5 of 32 segment programs at 24 heads), and the rerun the first
    N + T // segment_tokens (18); every other plan runs every segment program; the describe line says which, and
    the scan, where a plan sets it (the automatic plan does not), the order's first min(N, T // segment_tokens)
    places (5); the fields need the order and segments."""
    chunked = choose_plan(13, 24, 8192, 128, 128, 132, max_seqlen=6144, warpgroup_mma=True)
    assert chunked.longest_first and chunked.segment_chunks == 48 and chunked.transitions_in_order
    assert chunked.transition_rows == 8192 // (32 * 48) == 5 < chunked.segment_programs == 32
    assert chunked.transition_grid == (4, 24, 5) and chunked.recurrence_grid == (1, 24, 13 + 5)
    assert chunked.rerun_in_order and chunked.rerun_rows == 18 and chunked.program_rows == 32
    assert not chunked.scan_in_order and chunked.scan_grid == (8, 24, 13)  # not chosen: measured no faster
    assert "on the order's first 5 of 32 segment programs, the rerun on the order's first 18" in chunked.describe()
    assert "places" not in chunked.describe()
    chunked = chunked.replace(scan_in_order=True)
    assert chunked.scan_rows == 5 and chunked.scan_grid == (8, 24, 5)
    assert "16 state columns a program, on the order's first 5 places" in chunked.describe()
    off = chunked.replace(transitions_in_order=False, rerun_in_order=False, scan_in_order=False)
    assert off.transition_grid == (4, 24, 32) and off.recurrence_grid == (1, 24, 32) and off.scan_grid == (8, 24, 13)
    assert "segment programs" not in off.describe() and "the rerun on" not in off.describe()
    assert "places" not in off.describe()
    short = chunked.replace(seq_len=1000, segment_chunks=48)  # no full segment: one row, idle; the firsts alone
    assert short.transition_rows == 1 and short.rerun_rows == 13 and short.scan_rows == 1
    few = chunked.replace(num_seqs=3)  # fewer sequences than full segments: every sequence a place
    assert few.scan_rows == 3
    for facts, changes in (((1, 24, 65536), {}), ((2, 12, 65536), dict(max_seqlen=32768)),
                           ((6, 96, 8192), dict(max_seqlen=3063)), ((13, 24, 8192), {})):
        plan = choose_plan(*facts, 128, 128, 132, **changes)
        assert not plan.transitions_in_order and plan.transition_rows == plan.segment_programs, facts
        assert not plan.rerun_in_order and plan.recurrence_grid[2] == plan.program_rows, facts
        assert not plan.scan_in_order and plan.scan_grid[2] == plan.num_seqs, facts
        assert not (plan.longest_first and plan.segment_chunks), facts
    for changes in (dict(longest_first=False), dict(segment_chunks=0, transition_width=0,
                                                    warpgroup_transition=False)):
        with pytest.raises(ValueError, match="transitions_in_order takes the transitions' rows from the recurrence"):
            chunked.replace(**changes)
        with pytest.raises(ValueError, match="rerun_in_order takes the rerun's rows from the recurrence's order"):
            chunked.replace(transitions_in_order=False, **changes)
        with pytest.raises(ValueError, match="scan_in_order takes the scan's rows from the recurrence's order"):
            chunked.replace(transitions_in_order=False, rerun_in_order=False, **changes)


def test_horner_inverse_where_the_solve_runs_in_about_a_wave_and_only_with_tf32_products():
    """The solve's Horner form where the call's (chunk, head) pairs are at most HORNER_PROGRAMS_PER_SM an SM (H12
    N5 T1024: 1920 on 132 SMs; the chunked mix: 3072), the series past that (H96 1024x8: 24576; the chunked mix on
    90 SMs); counted from the tokens, so that a varlen call run as rows decides as without the hint (the same
    bits). The plan says which, and refuses it under exact ("ieee") products, which its fp16 operands would not
    keep."""
    from fastkda.plan import HORNER_PROGRAMS_PER_SM

    chunked_mix = (13, 12, 8192)
    for facts, sms, on in (((5, 12, 1024), 132, True), ((1, 12, 1024), 132, True), (chunked_mix, 132, True),
                           (chunked_mix, 90, False), ((8, 96, 1024), 132, False), ((1, 12, 65536), 132, False)):
        varlen = facts is chunked_mix
        plan = choose_plan(*facts, 128, 128, sms, varlen=varlen, warpgroup_mma=True)
        tokens = facts[2] * (1 if varlen else facts[0])
        assert (tokens // 32 * plan.heads <= HORNER_PROGRAMS_PER_SM * sms) == on, facts
        assert plan.horner_inverse == on and ("Horner's rule" in plan.describe()) == on, (facts, sms)
        assert ("Horner's rule" in plan.reason) == on, (facts, sms)
    # at the edge (4224 pairs on 132 SMs), with the max_seqlen hint (rows) and without (varlen)
    for heads, on in ((33, True), (34, False)):
        assert choose_plan(4, heads, 4096, 128, 128, 132).horner_inverse == on
        assert choose_plan(4, heads, 4096, 128, 128, 132, max_seqlen=1024).horner_inverse == on
    plan = choose_plan(5, 12, 5120, 128, 128, 132, max_seqlen=1024)
    assert plan.horner_inverse
    with pytest.raises(ValueError, match="replace horner_inverse=False"):
        plan.replace(dot_precision="ieee")
    exact = plan.replace(horner_inverse=False, dot_precision="ieee")
    assert "Horner's rule in fp16 operands" not in exact.describe()  # the reason keeps the plan's choice
    assert PrefillPlan.from_launch_numbers(plan.launch_numbers()) == plan  # as the custom op rebuilds it


def test_the_solve_s_registers_are_the_compiler_s_unless_a_plan_caps_them():
    """The solve kernel's register cap (``solve_registers``): the automatic plan leaves it to the compiler on every
    gate and shape (a cap of 80 measured no faster, docs/perf-notes.md "Session 52"); a plan that sets one says it
    in its description and carries it through the custom op's numbers; a cap outside 24..255 is refused."""
    for facts, gate in (((13, 24, 8192), True), ((13, 24, 8192), False), ((1, 24, 65536), True),
                        ((8, 96, 8192), True), ((5, 12, 1024), True)):
        chosen = choose_plan(*facts, 128, 128, 132, lower_bound_gate=gate, warpgroup_mma=True)
        assert chosen.solve_registers == 0 and "registers a thread: T" not in chosen.describe(), facts
    capped = choose_plan(13, 24, 8192, 128, 128, 132).replace(solve_registers=80)
    assert "solve kernel on 1 warp, 3 stages, at most 80 registers a thread" in capped.describe()
    for bad in (8, 256, -1):
        with pytest.raises(ValueError, match="fastkda plan: solve_registers must be 0 .* or 24..255"):
            capped.replace(solve_registers=bad)
    assert PrefillPlan.from_launch_numbers(capped.replace(solve_registers=72).launch_numbers()).solve_registers == 72


@pytest.mark.parametrize("facts", [dict(heads=0), dict(value_dim=96), dict(key_dim=32), dict(sms=0),
                                   dict(num_seqs=-1), dict(seq_len=-5)])
def test_shapes_the_api_rejects_are_rejected(facts):
    args = dict(num_seqs=1, heads=12, seq_len=8192, key_dim=128, value_dim=128, sms=132)
    with pytest.raises(ValueError, match="fastkda plan"):
        choose_plan(**{**args, **facts})


def test_override_precedence(monkeypatch):
    monkeypatch.setenv("FASTKDA_V_SLICES", "4")
    assert requested_v_slices("auto") == 4
    assert requested_v_slices(2) == 2  # the argument wins
    assert plan(64, 96).v_slices == 4
    monkeypatch.setenv("FASTKDA_V_SLICES", " AUTO ")
    assert requested_v_slices("auto") == "auto"


@pytest.mark.parametrize("bad", [0, 3, 8, "two", 2.0, True, None, ""])
def test_bad_values_are_rejected(bad):
    with pytest.raises(ValueError, match="v_slices"):
        parse_v_slices(bad, "v_slices")


def test_bad_environment_is_rejected(monkeypatch):
    monkeypatch.setenv("FASTKDA_V_SLICES", "3")
    with pytest.raises(ValueError, match="FASTKDA_V_SLICES"):
        requested_v_slices("auto")


def test_decode_plan_uses_narrow_slices_and_honours_overrides(monkeypatch):
    assert choose_decode_plan(256, 96, 128, 132).v_slices == 8  # 16-column slices
    assert choose_decode_plan(256, 96, 128, 132).warps == 1  # one token, a full grid: one warp a slice
    assert choose_decode_plan(1, 12, 128, 132).warps == 8  # 96 programs on 132 SMs: each alone, its chain counts
    assert choose_decode_plan(1, 16, 128, 132).warps == 8  # 128 programs: still fewer than SMs
    assert choose_decode_plan(1, 17, 128, 132).warps == 1  # 136 programs fill every SM: bytes in flight
    assert choose_decode_plan(64, 12, 128, 132, tokens=4).warps == 2  # speculative tokens: the chain counts
    assert choose_decode_plan(1, 12, 64, 132).v_slices == 4
    assert choose_decode_plan(1, 12, 128, 132, v_slices=1).warps == 8
    monkeypatch.setenv("FASTKDA_V_SLICES", "2")
    assert choose_decode_plan(1, 12, 128, 132).v_slices == 2
    with pytest.raises(ValueError, match="fastkda plan"):
        choose_decode_plan(1, 12, 96, 132)
    with pytest.raises(ValueError, match="narrower"):
        dataclasses.replace(choose_decode_plan(1, 12, 64, 132), v_slices=8)


@pytest.mark.parametrize("choices, env", [
    (dict(), {}), (dict(v_slices=2), {}), (dict(sequence_parallel=False), {}), (dict(sequence_parallel=256), {}),
    (dict(max_seqlen=4096), {}), (dict(), {"FASTKDA_V_SLICES": "1"}), (dict(), {"FASTKDA_SEQUENCE_PARALLEL": "off"}),
    (dict(), {"FASTKDA_SEQUENCE_PARALLEL": "512"})])
def test_a_plan_chosen_in_the_op_is_the_eager_call_s(choices, env, monkeypatch):
    """Under torch.compile the op chooses the plan from the sizes it runs on (:func:`prefill_plan_request`): for
    every choice of the caller's, and the environment read when the call was traced, the plan an eager call of
    those sizes chooses. The facts differ in what the choices change (segments, slices, the hint's rows), and the
    choices change the plans (checked: not every choice gives the automatic plan)."""
    facts = [((1, 12, 16384, 128, 128), True, True, True), ((4, 12, 16384, 128, 128), True, True, False),
             ((4, 12, 4096, 128, 128), False, True, False), ((2, 96, 16384, 64, 64), True, False, True),
             ((3, 2, 0, 64, 64), True, True, False)]

    def eager_plans(**chosen):
        return [choose_plan(*f, 132, varlen=varlen, lower_bound_gate=gate, warpgroup_mma=mma, **chosen)
                for f, varlen, gate, mma in facts]
    automatic = eager_plans()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    numbers, eager = prefill_plan_request(**choices), eager_plans(**choices)
    monkeypatch.delenv("FASTKDA_V_SLICES", raising=False)  # read when traced, not when run
    monkeypatch.delenv("FASTKDA_SEQUENCE_PARALLEL", raising=False)
    in_op = [requested_prefill_plan(numbers, *f, 132, varlen=varlen, lower_bound_gate=gate, warpgroup_mma=mma)
             for f, varlen, gate, mma in facts]
    assert in_op == eager and [p.reason for p in in_op] == [p.reason for p in eager]
    assert (eager != automatic) == bool(choices or env)


def test_a_plan_request_is_told_from_a_plan():
    """A request's numbers and a plan's cannot be mistaken for each other (a plan's first number is never
    negative), and a request of the wrong kind is refused by name."""
    plan = choose_plan(2, 12, 2048, 128, 128, 132)
    with pytest.raises(ValueError, match="expected a prefill plan request"):
        requested_prefill_plan(plan.launch_numbers(), 2, 12, 2048, 128, 128, 132, varlen=True, lower_bound_gate=True,
                               warpgroup_mma=False)
    with pytest.raises(ValueError, match="expected a decode plan request"):
        requested_decode_plan(prefill_plan_request(), 2, 12, 128, 132, 1)
    with pytest.raises(ValueError, match="max_seqlen must be None or an integer"):
        prefill_plan_request(max_seqlen=-1)


def test_a_decode_plan_chosen_in_the_op_is_the_eager_call_s(monkeypatch):
    """Decode's likewise (:func:`decode_plan_request`), ``$FASTKDA_V_SLICES`` read when traced; the facts take
    different warps (one token on few programs, on many, several tokens)."""
    facts = ((1, 1), (32, 1), (8, 3))
    for choice, env in (("auto", None), (2, None), ("auto", "4")):
        if env:
            monkeypatch.setenv("FASTKDA_V_SLICES", env)
        numbers = decode_plan_request(choice)
        eager = [choose_decode_plan(n, 12, 128, 132, choice, tokens=t) for n, t in facts]
        monkeypatch.delenv("FASTKDA_V_SLICES", raising=False)
        assert [requested_decode_plan(numbers, n, 12, 128, 132, t) for n, t in facts] == eager
        assert len({p.warps for p in eager}) > 1 or choice != "auto" or env
    with pytest.raises(ValueError, match="v_slices"):
        decode_plan_request(3)


def test_decode_step_fuses_only_where_it_is_latency_bound():
    fused = choose_decode_step_plan(1, 12, 128, 132)
    assert (fused.v_slices, fused.warps) == (4, 4)  # 32-column slices on 4 warps
    assert choose_decode_step_plan(44, 12, 128, 132).v_slices == 1  # 528 heads on 132 SMs: one program a head
    assert choose_decode_step_plan(22, 12, 128, 132).v_slices == 1  # 264: two heads an SM
    assert choose_decode_step_plan(21, 12, 128, 132).v_slices == 4  # 252: sliced, joined by tickets
    assert choose_decode_step_plan(45, 12, 128, 132) is None  # past four heads an SM: three launches
    assert choose_decode_step_plan(1, 96, 64, 132).v_slices == 2
    assert conv_update_launch(256, 4608, False) == (1, 128, 4) and conv_update_launch(256, 4608, True) == (4, 256, 4)
    assert conv_update_launch(1, 96, True)[:2] == (1, 128)


def test_sequence_parallelism_where_the_chain_leaves_sms_idle():
    """Few long chains on many SMs get segments; a GPU full of chains, a one-SM CPU and short inputs do not."""
    one = choose_plan(1, 12, 8192, 128, 128, 132)
    assert one.sequence_parallel and 4 <= one.segment_chunks < 8192 // 32
    assert one.transition_grid[0] == 256 // one.transition_width and one.scan_grid == (8, 12, 1)
    assert one.recurrence_grid == (one.v_slices, 12, 1 + one.segment_slots) == (one.v_slices, 12, one.segment_programs)
    assert "sequence parallelism: segments of" in one.describe() and "v_new = T·β·(v − kd·S)" in one.describe()
    for facts in ((8, 96, 8 * 8192, 132), (1, 12, 8192, 1), (1, 12, 200, 132), (1, 12, 1024, 132)):
        num_seqs, heads, tokens, sms = facts
        assert choose_plan(num_seqs, heads, tokens, 128, 128, sms).segment_chunks == 0, facts
    assert choose_plan(1, 12, 8192, 128, 128, 132, sequence_parallel=False).segment_chunks == 0
    forced = choose_plan(1, 12, 8192, 128, 128, 132, sequence_parallel=1024)
    assert forced.segment_chunks == 32 and forced.segment_tokens == 1024 and "requested" in forced.reason


def test_the_mean_length_does_not_hide_a_long_sequence():
    """A chunked-prefill batch (one 6144-token chunk beside 12 short sequences) plans for one sequence holding
    every token; a balanced batch of the same T and N keeps one segment per sequence where segments would not pay
    there."""
    mix = [6144, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1]
    hinted = choose_plan(len(mix), 12, sum(mix), 128, 128, 132, max_seqlen=6144)
    assert hinted.sequence_parallel and -(-6144 // hinted.segment_tokens) >= 4 and "max_seqlen=6144" in hinted.reason
    unhinted = choose_plan(len(mix), 12, sum(mix), 128, 128, 132)  # it cannot tell this batch from a balanced one
    assert not unhinted.sequence_parallel or -(-6144 // unhinted.segment_tokens) >= 4
    for hint in (None, 8192):  # a balanced batch of 8 sequences of 8192 tokens: the serial recurrence
        assert choose_plan(8, 12, 8 * 8192, 128, 128, 132, max_seqlen=hint).segment_chunks == 0
    assert choose_plan(2, 12, 2 * 8192, 128, 128, 132, max_seqlen=8192).segment_chunks == 64  # two long ones
    with pytest.raises(ValueError, match="max_seqlen"):
        choose_plan(2, 12, 100, 128, 128, 132, max_seqlen=-1)


def test_segment_slots_cover_any_lengths():
    """The segment slots of random ``cu_seqlens`` (varlen) and of fixed rows: every segment of every sequence gets
    its own slot below ``segment_slots`` (the layout of ``fastkda/ops/prefill/layout.py``, mirrored here)."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        lengths = [rng.choice([0, 1, rng.randint(1, 3000)]) for _ in range(rng.randint(1, 9))]
        lengths[0] += 1  # at least one token (an empty batch has no segments)
        plan = choose_plan(len(lengths), 2, sum(lengths), 64, 64, 132, sequence_parallel=rng.choice([32, 64, 96, 512]))
        tokens, used, start = plan.segment_tokens, set(), 0
        for n, length in enumerate(lengths):
            first = start // tokens + n
            slots = {first + j for j in range(max(-(-length // tokens), 1))}
            assert not slots & used and max(slots) < plan.segment_slots
            used |= slots
            start += length
    fixed = choose_plan(3, 2, 1000, 64, 64, 132, varlen=False, sequence_parallel=256)
    assert fixed.segment_slots == 3 * 4


def test_sequence_parallel_values_and_environment(monkeypatch):
    from fastkda.plan import parse_sequence_parallel, requested_sequence_parallel

    assert parse_sequence_parallel(" Auto ", "x") == "auto" and parse_sequence_parallel("off", "x") is False
    assert parse_sequence_parallel(False, "x") is False and parse_sequence_parallel("2048", "x") == 2048
    for bad in (0, 48, -32, True, 1.5, None, "some"):
        with pytest.raises(ValueError, match="sequence_parallel"):
            parse_sequence_parallel(bad, "sequence_parallel")
    monkeypatch.setenv("FASTKDA_SEQUENCE_PARALLEL", "0")
    assert requested_sequence_parallel("auto") is False and requested_sequence_parallel(64) == 64
    assert choose_plan(1, 12, 8192, 128, 128, 132).segment_chunks == 0
    monkeypatch.setenv("FASTKDA_SEQUENCE_PARALLEL", "33")
    with pytest.raises(ValueError, match="FASTKDA_SEQUENCE_PARALLEL"):
        requested_sequence_parallel("auto")
    with pytest.raises(ValueError, match="transition_width"):
        choose_plan(1, 12, 8192, 64, 64, 132, sequence_parallel=1024).replace(transition_width=128)


def test_a_hint_of_equal_lengths_runs_the_sequences_as_rows():
    """N·max_seqlen = T: every sequence has the hint's length, so the plan is the fixed-length rows' plan with
    ``equal_rows`` (no empty slots, the same segments as the varlen reading of the hint); so is one sequence's,
    without a hint; not several without one, nor where the hint leaves room for other lengths. Its launch numbers
    carry it; a caller's plan made so fits the varlen call it was made for; a varlen plan cannot ask for it."""
    rows = choose_plan(8, 96, 8192, 128, 128, 132, max_seqlen=1024)
    assert rows.equal_rows and not rows.varlen and (rows.num_seqs, rows.seq_len, rows.batch) == (8, 1024, 8)
    assert rows.replace(equal_rows=False) == choose_plan(8, 96, 1024, 128, 128, 132, varlen=False)
    assert rows.chunk_slots == 256 and "(varlen, run as rows)" in rows.describe()
    assert "cu_seqlens checked on the device" in rows.reason
    assert PrefillPlan.from_launch_numbers(rows.launch_numbers(), rows.dot_precision) == rows
    long = choose_plan(2, 12, 65536, 128, 128, 132, max_seqlen=32768)
    assert long.equal_rows and long.segment_chunks == choose_plan(2, 12, 32768, 128, 128, 132,
                                                                 varlen=False).segment_chunks > 0
    assert "max_seqlen" in choose_plan(2, 12, 65536, 128, 128, 132, max_seqlen=32000).reason  # a varlen reading
    for hint in (None, 1100, 1000, 0):
        assert not choose_plan(8, 96, 8192, 128, 128, 132, max_seqlen=hint).equal_rows, hint
    alone = choose_plan(1, 12, 1000, 128, 128, 132)  # one sequence: valid offsets give it every token, no hint needed
    assert alone.equal_rows and alone.seq_len == 1000 and "one sequence holds every token" in alone.reason
    assert not choose_plan(1, 12, 0, 128, 128, 132).equal_rows and not choose_plan(0, 12, 0, 128, 128, 132).equal_rows
    assert not choose_plan(8, 96, 1024, 128, 128, 132, varlen=False).equal_rows
    with pytest.raises(ValueError, match="equal_rows runs a varlen call as rows"):
        choose_plan(8, 96, 8192, 128, 128, 132).replace(equal_rows=True)


def test_shorter_sequences_share_the_rerun():
    """With a max_seqlen hint the other sequences' programs fill idle SMs before they add time (a chunked-prefill
    batch: one 6144-token chunk beside twelve short sequences runs segments of at most 32 chunks, where 48 measured
    12% slower at 420010d); empty sequences beside a hinted one add no chunks."""
    assert phase_us(48, 48, 128, 132, other_steps=48 * 80) == phase_us(48, 48, 128, 132)
    assert phase_us(120, 48, 128, 132, other_steps=48 * 100) > phase_us(120, 48, 128, 132)
    mix = choose_plan(13, 12, 8192, 128, 128, 132, max_seqlen=6144)
    assert 0 < mix.segment_chunks <= 32
    alone = choose_plan(1, 12, 8192, 128, 128, 132, max_seqlen=8192)
    beside_empty = choose_plan(1600, 12, 8192, 128, 128, 132, max_seqlen=8192)
    assert beside_empty.segment_chunks == alone.segment_chunks > 0


def test_segments_stay_within_the_grid_and_need_tokens():
    """Segment programs past CUDA's grid limit fall back to the serial recurrence (or, forced, raise); an empty
    batch has no segments."""
    many = choose_plan(65000, 1, 2_000_000 + 64999, 128, 128, 132, max_seqlen=2_000_000)  # one long, many 1-token
    assert many.segment_chunks == 0 and "grid rows" in many.reason
    with pytest.raises(ValueError, match="grid"):
        choose_plan(33000, 16, 98536, 128, 128, 132, sequence_parallel=64)
    assert choose_plan(2, 4, 0, 64, 64, 132, varlen=False, sequence_parallel=64).segment_chunks == 0


def test_open_entry_plans_are_always_segmented():
    """A prefill whose entry state comes later runs in segments at any length (1 to MAX_SEGMENTS of them), the
    forced length when one is given; no tokens, or sequence_parallel=False, is refused."""
    from fastkda.plan import MAX_SEGMENTS, choose_open_entry_plan

    for tokens in (1, 100, 4096, 262144):
        plan = choose_open_entry_plan(1, 12, tokens, 128, 128, 132)
        assert plan.segment_chunks and not plan.varlen
        assert -(-tokens // plan.segment_tokens) <= MAX_SEGMENTS
    long = choose_open_entry_plan(1, 12, 262144, 128, 128, 132)
    assert -(-262144 // long.segment_tokens) > 8  # a long part is cut across the SMs
    assert choose_open_entry_plan(2, 4, 1000, 64, 64, 132, sequence_parallel=96).segment_tokens == 96
    with pytest.raises(ValueError, match="seq_len"):
        choose_open_entry_plan(1, 12, 0, 128, 128, 132)
    with pytest.raises(ValueError, match="sequence_parallel"):
        choose_open_entry_plan(1, 12, 100, 128, 128, 132, sequence_parallel=False)


@pytest.mark.parametrize("args, name", [
    ((2, 12, 4096, 128, 128, 0), "sms"), ((2, 12, 4096, 128, 96, 132), "K and V"), ((0, 12, 4096, 128, 128, 132),
                                                                                      "num_seqs"),
    ((1.0, 12, 4096, 128, 128, 132), "num_seqs")], ids=["no SMs", "V 96", "no rows", "float rows"])
def test_open_entry_plans_name_a_bad_count(args, name):
    """Counts that are not positive ints and unsupported K, V are a ValueError naming them (not a
    ZeroDivisionError or KeyError inside the step model, nor a float served from the cache of its int)."""
    from fastkda.plan import choose_open_entry_plan

    choose_open_entry_plan(1, 12, 4096, 128, 128, 132)  # an int's plan in the cache first
    with pytest.raises(ValueError, match=name):
        choose_open_entry_plan(*args)


@pytest.mark.parametrize("args, name", [((1, 12, 128, 0), "sms"), ((1, 12, 128, 1.5), "sms"),
                                        ((1, 12, 128, "132"), "sms"), ((1000, 12, 96, 132), "V must be"),
                                        ((1.0, 12, 128, 132), "num_seqs")])
def test_decode_step_plans_name_a_bad_count(args, name):
    """As the decode plan: a ValueError naming the count or V, whatever the cache holds."""
    choose_decode_step_plan(1, 12, 128, 132)
    with pytest.raises(ValueError, match=name):
        choose_decode_step_plan(*args)


def test_an_empty_open_entry_prefill_checks_its_segments():
    """No rows or no tokens plan nothing, but ``sequence_parallel`` is still checked as with tokens."""
    import torch

    import fastkda

    empty = torch.zeros(2, 0, 2, 64)
    with pytest.raises(ValueError, match="sequence_parallel must be 'auto', False or a positive multiple"):
        fastkda.kda_prefill_open(empty, empty, empty, empty, torch.zeros(2, 0, 2), sequence_parallel="garbage")
    with pytest.raises(ValueError, match="not False"):
        fastkda.kda_prefill_open(empty, empty, empty, empty, torch.zeros(2, 0, 2), sequence_parallel=False)
    fastkda.kda_prefill_open(empty, empty, empty, empty, torch.zeros(2, 0, 2), sequence_parallel=64)


def test_open_entry_plans_ignore_the_environment_turning_segments_off(monkeypatch):
    """$FASTKDA_SEQUENCE_PARALLEL=0 turns kda_prefill's segments off; a prefill whose entry state comes later still
    plans its own, and takes a segment length the variable gives."""
    from fastkda.plan import choose_open_entry_plan

    monkeypatch.setenv("FASTKDA_SEQUENCE_PARALLEL", "0")
    assert choose_open_entry_plan(1, 12, 4096, 128, 128, 132).segment_chunks
    monkeypatch.setenv("FASTKDA_SEQUENCE_PARALLEL", "512")
    assert choose_open_entry_plan(1, 12, 4096, 128, 128, 132).segment_tokens == 512


def test_warpgroup_mma_is_read_from_the_device_capability(monkeypatch):
    """sm_90 (Hopper) runs the Gluon recurrence's warpgroup MMA; sm_80 and sm_100 do not."""
    import torch

    from fastkda.plan import has_warpgroup_mma

    for capability, expected in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        has_warpgroup_mma.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert has_warpgroup_mma(0) is expected
    has_warpgroup_mma.cache_clear()


@pytest.mark.parametrize("cpu_chunk", [7, 48, 64, 1024])
def test_the_cpu_chunk_divides_the_chunk(cpu_chunk):
    """The CPU path keeps checkpoints only at its own chunks' ends (64: the one at 32 was never written) and takes
    its cumulative decays over one chunk (1024: 13x the float64 output's norm off): a divisor of 32 or nothing."""
    plan = choose_plan(1, 2, 96, 64, 64, 1, varlen=False)
    with pytest.raises(ValueError, match="cpu_chunk must divide the chunk"):
        plan.replace(cpu_chunk=cpu_chunk)
    assert plan.replace(cpu_chunk=8).cpu_chunk == 8


@pytest.mark.parametrize("change, message", [
    (dict(v_slices=1.0), "v_slices must be an int"), (dict(v_slices=None), "v_slices must be an int"),
    (dict(recurrence_stages=2.5), "recurrence_stages must be an int"), (dict(heads=2.0), "heads must be an int"),
    (dict(cpu_chunk=True), "cpu_chunk must be an int"), (dict(longest_first=1), "longest_first must be a bool"),
    (dict(reason="mine"), "replace takes launch numbers")])
def test_plan_fields_are_typed(change, message):
    """A float was truncated on its way to the kernels (2.5 stages ran as 2), None and floats failed the range
    checks with a TypeError, and a reason given to replace collided with the one it writes."""
    with pytest.raises(ValueError, match=message):
        choose_plan(2, 2, 100, 64, 64, 1).replace(**change)
    with pytest.raises(ValueError, match="warps must be an int"):
        choose_decode_plan(2, 2, 64, 1).replace(warps=8.0)


@pytest.mark.parametrize("facts, message", [
    (dict(sms=0), "sms must be an integer >= 1"), (dict(sms=-5), "sms must be an integer >= 1"),
    (dict(sms=1.5), "sms must be an integer >= 1"), (dict(num_seqs=-1), "num_seqs must be an integer >= 0"),
    (dict(heads=0), "heads must be an integer >= 1"), (dict(tokens=0), "tokens must be an integer >= 1")])
def test_decode_plan_facts_are_checked_as_the_prefill_plan_s(facts, message):
    given = {**dict(num_seqs=3, heads=2, value_dim=64, sms=4, tokens=1), **facts}
    with pytest.raises(ValueError, match=message):
        choose_decode_plan(given.pop("num_seqs"), given.pop("heads"), given.pop("value_dim"), given.pop("sms"),
                           **given)
    with pytest.raises(ValueError, match="value_dim must be one of"):
        DecodePlan(1, 1, 32, 2, 1)  # 32-column V is no supported dimension, slices or not
    with pytest.raises(ValueError, match="num_seqs >= 0 and heads >= 1"):
        DecodePlan(-1, -2, 64, 1, 1)


def test_a_cached_plan_does_not_pass_an_argument_of_another_type():
    """The plans are cached by their facts, and True == 1 == 1.0: a cached 1 made 1.0 and True pass."""
    choose_plan(2, 2, 100, 64, 64, 1)
    choose_decode_plan(2, 2, 64, 1)
    for sms in (1.0, True):
        with pytest.raises(ValueError, match="sms must be an integer"):
            choose_plan(2, 2, 100, 64, 64, sms)
        with pytest.raises(ValueError, match="sms must be an integer"):
            choose_decode_plan(2, 2, 64, sms)


def test_inverse_in_prepare_where_the_first_kernel_runs_in_one_wave_under_the_lower_bound_gate():
    """The first kernel inverts its own chunk (no solve launch) where its grid (chunk slots x heads) fits one wave
    of PREPARE_PROGRAMS_PER_SM an SM (H12 N1 T1024: 384 programs on 396 slots); not past it (H12 N2 T1024: 768; a
    varlen batch's spare slots count: 3 x 352 tokens take 37 slots, 444 programs, and 33 run as rows), nor under
    the precomputed gate (unmeasured there). The plan says it and carries it through its launch numbers."""
    from fastkda.plan import PREPARE_PROGRAMS_PER_SM

    assert PREPARE_PROGRAMS_PER_SM * 132 == 396
    for num_seqs, tokens, hint, on in ((1, 1024, None, True), (1, 1056, None, True), (1, 1057, None, False),
                                       (2, 2048, 1024, False), (3, 1056, 352, True), (3, 1056, None, False),
                                       (3, 1059, 353, False), (2, 320, None, True)):  # tokens: the batch's
        plan = choose_plan(num_seqs, 12, tokens, 128, 128, 132, varlen=True, max_seqlen=hint, warpgroup_mma=True)
        assert plan.inverse_in_prepare == on, (num_seqs, tokens, hint)
        assert (plan.heads * plan.chunk_slots <= 396) == on, (num_seqs, tokens, hint)
        assert ("inverts its own chunk" in plan.reason) == on
        assert ("the first kernel then inverts its chunk" in plan.describe()) == on
        assert ("solve kernel on" in plan.describe()) != on
        assert PrefillPlan.from_launch_numbers(plan.launch_numbers()) == plan
    assert not choose_plan(1, 12, 1024, 128, 128, 132, lower_bound_gate=False).inverse_in_prepare
    assert not choose_plan(1, 12, 1024, 128, 128, 66).inverse_in_prepare  # 384 programs on 198 slots

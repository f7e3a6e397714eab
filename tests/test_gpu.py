"""GPU tests (run on the H200 by ``tools/device_tests.sh``; skipped without CUDA).

Every output buffer is NaN-poisoned before the call; errors are against the float64 recurrence."""

import random
from unittest import mock

import pytest
import torch

import fastkda
from fastkda.bench.timing import capture_graph
from fastkda.reference import kda_reference
from helpers import (CompileCounter, check_compiled_prefill, in_default_pool, make_inputs, plan_for, rel_err,
                     replay_with, run_prefill, solve_lower)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OUT_BOUND, STATE_BOUND = 4e-3, 3e-3
BF16_STATE_BOUND = 6e-3  # a bf16 final state adds its own rounding (≈2e-3 rms)
# (initial, final) dtype: none; in / out / in+out, each in bf16 and fp32
STATE_CASES = [(None, None)] + [case for d in (torch.bfloat16, torch.float32)
                                 for case in ((d, None), (None, d), (d, d))]


def reference(inp, h0):
    return kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                         dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], initial_state=h0,
                         cu_seqlens=inp["cu_seqlens"])


def random_case(rng):
    lengths = [rng.choice([0, 1, rng.randint(2, 63), 64, rng.randint(65, 300)]) for _ in range(rng.randint(1, 4))]
    if sum(lengths) == 0:
        lengths[-1] = 5
    return dict(lengths=lengths, heads=rng.choice([1, 3, 4]), key_dim=rng.choice([64, 128]),
                value_dim=rng.choice([64, 128]), gate=rng.choice(["lower_bound", "precomputed"]),
                cu_dtype=rng.choice([torch.int32, torch.int64]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("states", STATE_CASES, ids=lambda s: f"{s[0]}-{s[1]}".replace("torch.", ""))
def test_random_shapes_all_state_cases(seed, states):
    rng = random.Random(seed * 31 + STATE_CASES.index(states))
    case = random_case(rng)
    inp = make_inputs(device="cuda", seed=seed, **case)
    out, final, h0 = run_prefill(inp, *states)
    ref_o, ref_s = reference(inp, h0)
    assert rel_err(out, ref_o) < OUT_BOUND, case
    if final is not None:
        bound = BF16_STATE_BOUND if final.dtype == torch.bfloat16 else STATE_BOUND
        assert rel_err(final, ref_s) < bound, case


@pytest.mark.parametrize("case", [
    dict(lengths=[8192], heads=2, key_dim=128, varlen=False),
    dict(lengths=[0, 1, 700, 64, 65, 0], heads=3, key_dim=128),
    dict(lengths=[300, 300], heads=4, key_dim=64, varlen=False, gate="precomputed"),
])
def test_v_slices_bitwise_identical(case):
    inp = make_inputs(device="cuda", seed=7, **case)
    base_o, base_s, _ = run_prefill(inp, torch.float32, torch.float32, v_slices=1)
    for s in (2, 4):
        out, final, _ = run_prefill(inp, torch.float32, torch.float32, v_slices=s)
        assert torch.equal(out, base_o) and torch.equal(final, base_s), s


def test_accuracy_bar_spec_case():
    """Issue 2 acceptance: T = 2048, H = 4, K = V = 128, randn inputs, fp32 states."""
    inp = make_inputs([2048], heads=4, key_dim=128, device="cuda", seed=1)
    out, final, h0 = run_prefill(inp, torch.float32, torch.float32)
    ref_o, ref_s = reference(inp, h0)
    err_o, err_s = rel_err(out, ref_o), rel_err(final, ref_s)
    print(f"\n[accuracy] lower-bound gate T=2048 H=4: output {err_o:.3e}, final state {err_s:.3e}")
    assert err_o <= OUT_BOUND and err_s <= STATE_BOUND


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
def test_horner_inverse_accuracy(gate):
    """The plan's ``horner_inverse`` (the solve's diagonal blocks by Horner's rule in fp16 operands) on the spec's
    case under both gates: within the bar, as the series is."""
    inp = make_inputs([2048], heads=4, key_dim=128, device="cuda", seed=1, gate=gate)
    out, final, h0 = run_prefill(inp, torch.float32, torch.float32, plan=plan_for(inp, horner_inverse=True))
    ref_o, ref_s = reference(inp, h0)
    err_o, err_s = rel_err(out, ref_o), rel_err(final, ref_s)
    print(f"\n[accuracy] Horner inverse, {gate} gate T=2048 H=4: output {err_o:.3e}, final state {err_s:.3e}")
    assert err_o <= OUT_BOUND and err_s <= STATE_BOUND


def test_horner_inverse_keeps_the_series_past_entries_of_one():
    """The solve kernel alone on a β·L scratch of entries in ±0.3 (a well-conditioned inverse), where every other
    chunk has one entry of 2 in its first diagonal block. Under the plan's ``horner_inverse`` those chunks keep the
    series, with the bits of the plan without it; the others take Horner's rule, with other bits; both within 1e-3
    of float64. (An entry past 1 can take Horner's fp16 partial sums past fp16's range: the interpreter's test at
    entries of 4, ``tests/ops/test_prefill.py``, fails without this fallback.)"""
    inp = make_inputs([512], varlen=False, heads=3, key_dim=128, device="cuda", seed=11)
    plan = plan_for(inp)
    chunks, C = 512 // plan.chunk, plan.chunk
    gen = torch.Generator().manual_seed(12)
    entries = 0.3 * (2 * torch.rand(chunks, 3, C, C, generator=gen) - 1)
    entries[0::2, :, 9, 4] = 2.0
    beta = torch.rand(1, 512, 3, generator=gen).cuda()
    (series, expected), (horner, _) = [solve_lower(plan.replace(horner_inverse=on), inp, entries.cuda(), beta, False)
                                       for on in (False, True)]
    assert torch.equal(horner[0::2], series[0::2]) and not torch.equal(horner[1::2], series[1::2])
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device="cuda"))
    for got in (series, horner):
        assert rel_err(got.double()[..., lower], expected[..., lower]) < 1e-3


def test_precomputed_gate_down_to_minus_1e4():
    inp = make_inputs([2048], heads=4, key_dim=128, device="cuda", seed=2, gate="precomputed")
    inp["g"][0, 1000:1010] = -1e4
    out, final, h0 = run_prefill(inp, torch.float32, torch.float32)
    ref_o, ref_s = reference(inp, h0)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    err_o, err_s = rel_err(out, ref_o), rel_err(final, ref_s)
    print(f"\n[accuracy] precomputed gate with -1e4: output {err_o:.3e}, final state {err_s:.3e}")
    assert err_o <= OUT_BOUND and err_s <= STATE_BOUND


@pytest.mark.parametrize("lengths,varlen,v_slices", [([2, 700], True, "auto"), ([16] * 16, True, "auto"),
                                                     ([16] * 16, True, 1), ([333, 333], False, "auto")])
def test_cuda_graph_replay_with_new_inputs(lengths, varlen, v_slices):
    """Issue 3: a graph captured at N = 2 (auto: 4 slices, 4·2·12 <= 132), at N = 16 (auto: 2 slices) and at N = 16
    unsplit (v_slices=1) replays its plan on fresh inputs, equal to an eager call with the same plan."""
    inp = make_inputs(lengths, heads=12, key_dim=128, varlen=varlen, device="cuda", seed=3)
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")

    def step():
        fastkda.kda_prefill(*(inp[x] for x in names[:5]), A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                            lower_bound=inp["lower_bound"], initial_state=inp["initial_state"], final_state=final,
                            cu_seqlens=inp["cu_seqlens"], out=out, v_slices=v_slices)

    graph = capture_graph(step)
    fresh = make_inputs(lengths, heads=12, key_dim=128, varlen=varlen, device="cuda", seed=4)
    replay_with(graph, inp, fresh, names, (out, final))
    eager_o, eager_s, _ = run_prefill(fresh, torch.float32, torch.float32, v_slices=v_slices)
    assert torch.equal(out, eager_o) and torch.equal(final, eager_s)


def assert_same_bits_and_replays(inp, plan, base_plan, fresh):
    """``plan`` gives ``base_plan``'s bits on ``inp``; and a graph of ``plan`` captured on ``inp``, replayed after
    ``fresh``'s inputs (same N and T) are written into its buffers, equals an eager call on them."""
    base_o, base_s, _ = run_prefill(inp, torch.float32, torch.float32, plan=base_plan)
    out, final, _ = run_prefill(inp, torch.float32, torch.float32, plan=plan)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])
    graph = capture_graph(lambda: fastkda.kda_prefill(
        *(inp[x] for x in names[:5]), A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
        initial_state=inp["initial_state"], final_state=final, cu_seqlens=inp["cu_seqlens"], out=out, plan=plan))
    replay_with(graph, inp, fresh, names, (out, final))
    eager_o, eager_s, _ = run_prefill(fresh, torch.float32, torch.float32, plan=plan)
    assert torch.equal(out, eager_o) and torch.equal(final, eager_s)


@pytest.mark.parametrize("sequence_parallel", [False, 256])
@pytest.mark.parametrize("gluon", [False, True])
def test_longest_first_same_bits_and_replays_new_offsets(gluon, sequence_parallel):
    """The plan's ``longest_first`` (8 sequences × 24 heads: 192 serial programs, or 600 segment programs, take
    turns on 132 SMs): the grid order's bits, with the Triton and the Gluon recurrence; and a graph captured on
    one batch, replayed after another batch's offsets (same N and T) are written, equals an eager call on them."""
    lengths = [300, 5, 0, 1200, 64, 1, 700, 30]
    inp = make_inputs(lengths, heads=24, key_dim=128, device="cuda", seed=21)
    plan = plan_for(inp, sequence_parallel=sequence_parallel)
    assert plan.longest_first and plan.recurrence_grid[1] * plan.recurrence_grid[2] > 132
    if gluon:
        plan = plan.replace(warpgroup_recurrence=True, recurrence_stages=4)
    fresh = make_inputs([1200, 1, 700, 30, 0, 300, 64, 5], heads=24, key_dim=128, device="cuda", seed=22)
    assert_same_bits_and_replays(inp, plan, plan.replace(longest_first=False, transitions_in_order=False,
                                                         rerun_in_order=False, scan_in_order=False), fresh)


@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("cut", ["transitions", "rerun", "scan", "every one"])
def test_transitions_in_order_same_bits_and_replays_new_offsets(gluon, cut):
    """The automatic plan's ``transitions_in_order`` and ``rerun_in_order``, and ``scan_in_order`` set by hand, on
    the chunked mix's lengths at 24 heads with its hint (the transitions on the order's first 5 of 32 segment
    programs, the rerun on its first 18, the scan on its first 5 places): the bits of each, or all, on every row,
    with the Triton and the
    Gluon kernels; and a graph captured on
    one batch, replayed after another batch's offsets (the same lengths in another order) are written, equals an
    eager call on them."""
    lengths = [6144, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1]
    inp = make_inputs(lengths, heads=24, key_dim=128, device="cuda", seed=23)
    plan = plan_for(inp, sequence_parallel="auto", max_seqlen=6144)
    assert plan.transitions_in_order and plan.transition_grid[2] == 5 < plan.segment_programs
    assert plan.rerun_in_order and plan.recurrence_grid[2] == 18 < plan.segment_programs
    plan = plan.replace(scan_in_order=True)
    assert plan.scan_grid[2] == 5 < len(lengths)
    if gluon:
        plan = plan.replace(warpgroup_recurrence=True, recurrence_stages=4, warpgroup_transition=True,
                            transition_stages=4)
    fresh = make_inputs([1, 256, 2, 1024, 4, 6144, 8, 512, 16, 128, 32, 64, 1], heads=24, key_dim=128,
                        device="cuda", seed=24)
    off = {"transitions": dict(transitions_in_order=False), "rerun": dict(rerun_in_order=False),
           "scan": dict(scan_in_order=False),
           "every one": dict(transitions_in_order=False, rerun_in_order=False, scan_in_order=False)}[cut]
    assert_same_bits_and_replays(inp, plan, plan.replace(**off), fresh)


@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("lengths, hint, segments", [
    ([6144, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1], 6144, "auto"), ([8192], 8192, 1024)])
def test_scan_widths_same_bits_and_replay(lengths, hint, segments, width):
    """The segment scan over 32 or 64 state columns a program (the plan's ``scan_width``) against 16: the same bits
    on the chunked mix's lengths at 24 heads (the scan reading the order's ranks) and on one sequence in eight
    segments (seven scan steps); a graph captured once, replayed on fresh inputs, equals an eager call on them."""
    inp = make_inputs(lengths, heads=24, key_dim=128, device="cuda", seed=27)
    plan = plan_for(inp, sequence_parallel=segments, max_seqlen=hint)
    assert plan.segment_chunks
    fresh = make_inputs(lengths[::-1], heads=24, key_dim=128, device="cuda", seed=28)
    assert_same_bits_and_replays(inp, plan.replace(scan_width=width), plan.replace(scan_width=16), fresh)


@pytest.mark.parametrize("lengths, heads, varlen", [
    ([6144, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1], 24, True), ([2000] * 4, 24, False)])
def test_solve_register_cap_same_bits_and_replay(lengths, heads, varlen):
    """A cap on the series' solve registers (``solve_registers=80``) against the automatic plan's compiler's
    choice: the same bits on the chunked mix's lengths at 24 heads (in segments) and on fixed-length rows with a
    partial last chunk; a graph captured once, replayed on fresh inputs, equals an eager call on them."""
    inp = make_inputs(lengths, heads=heads, key_dim=128, varlen=varlen, device="cuda", seed=29)
    plan = plan_for(inp, sequence_parallel="auto", max_seqlen=max(lengths) if varlen else None)
    assert plan.solve_registers == 0 and not plan.horner_inverse and not plan.inverse_in_prepare
    fresh = make_inputs(lengths[::-1], heads=heads, key_dim=128, varlen=varlen, device="cuda", seed=30)
    assert_same_bits_and_replays(inp, plan.replace(solve_registers=80), plan, fresh)


@pytest.mark.parametrize("lengths, hint", [([1024], 1024), ([300, 5, 0, 200, 1, 64], None), ([352] * 3, 352)])
def test_inverse_in_prepare_same_bits_as_the_solve_kernel_and_replays(lengths, hint):
    """The automatic plan's ``inverse_in_prepare`` (H12 with the first kernel in one wave: the first kernel inverts
    its own chunk, no solve launch): the bits of the plan with the solve kernel, varlen and as rows; and a graph
    captured once, replayed after new inputs are written, equals an eager call on them."""
    inp = make_inputs(lengths, heads=12, key_dim=128, device="cuda", seed=23)
    plan = plan_for(inp, max_seqlen=hint)
    assert plan.inverse_in_prepare
    fresh = make_inputs(lengths, heads=12, key_dim=128, device="cuda", seed=24)
    assert_same_bits_and_replays(inp, plan, plan.replace(inverse_in_prepare=False), fresh)


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
@pytest.mark.parametrize("lengths, varlen, hint, segments", [
    ([1000] * 5, False, None, False), ([1000] * 5, True, 1000, False), ([1024], True, None, False),
    ([300, 5, 0, 1200, 64, 1, 700, 30], True, None, False), ([300, 5, 0, 1200, 64, 1, 700, 30], True, None, 256),
    ([2000] * 2, False, None, 256)])
def test_early_chunks_last_same_bits_as_the_slot_order_and_replays(lengths, varlen, hint, segments, gate):
    """The automatic plan's ``early_chunks_last`` (the preparation on one grid axis, heads innermost, from the last
    chunk slots back), on rows with a partial last chunk, a varlen batch run as rows, one sequence (the inverse in
    the first kernel), a varlen batch with empty and 1-token sequences (the longest first) and in segments: the
    slot order's bits, within the bar against float64; a graph captured once, replayed on fresh inputs, equals an
    eager call on them."""
    inp = make_inputs(lengths, heads=12, key_dim=128, varlen=varlen, gate=gate, device="cuda", seed=25)
    plan = plan_for(inp, max_seqlen=hint, sequence_parallel=segments)
    assert plan.early_chunks_last and bool(plan.segment_chunks) == bool(segments)
    fresh = make_inputs(lengths, heads=12, key_dim=128, varlen=varlen, gate=gate, device="cuda", seed=26)
    assert_same_bits_and_replays(inp, plan, plan.replace(early_chunks_last=False), fresh)
    out, final, _ = run_prefill(inp, torch.float32, torch.float32, plan=plan)
    ref_o, ref_s = reference(inp, inp["initial_state"])
    assert rel_err(out, ref_o) < OUT_BOUND and rel_err(final, ref_s) < STATE_BOUND


@pytest.mark.parametrize("gluon", [False, True])
def test_equal_rows_same_bits_offsets_counted_and_replayed(gluon):
    """8 sequences of 1000 tokens × 24 heads with the hint N·max_seqlen = T, run as rows (the plan's
    ``equal_rows``), with the Triton and the Gluon recurrence: the bits of the call without the hint; offsets that
    give other lengths raise in checked mode and are counted on the fast path, once per sequence whose entries
    disagree, eager and on a graph's replay; a graph captured with the hint, replayed on fresh inputs, equals an
    eager call on them."""
    inp = make_inputs([1000] * 8, heads=24, key_dim=128, device="cuda", seed=23)
    plan = plan_for(inp, max_seqlen=1000).replace(warpgroup_recurrence=gluon, recurrence_stages=4 if gluon else 3)
    assert plan.equal_rows and not plan.longest_first
    base_o, base_s, _ = run_prefill(inp, torch.float32, torch.float32, sequence_parallel=False)
    out, final, _ = run_prefill(inp, torch.float32, torch.float32, plan=plan)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")
    errors = torch.zeros(3, dtype=torch.int32, device="cuda")
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def call(**kw):  # the hint, or the plan made from it (which holds it)
        return fastkda.kda_prefill(
            *(inp[x] for x in names[:5]), A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
            initial_state=inp["initial_state"], final_state=final, cu_seqlens=inp["cu_seqlens"], out=out,
            max_seqlen=None if "plan" in kw else 1000, errors=errors, **kw)

    graph = capture_graph(lambda: call(plan=plan))
    fresh = make_inputs([1000] * 8, heads=24, key_dim=128, device="cuda", seed=24)
    replay_with(graph, inp, fresh, names, (out, final))
    eager_o, eager_s, _ = run_prefill(fresh, torch.float32, torch.float32, plan=plan)
    assert torch.equal(out, eager_o) and torch.equal(final, eager_s)
    assert errors.tolist() == [0, 0, 0]
    inp["cu_seqlens"].copy_(torch.tensor([0, 900, 2000, 3000, 4000, 5000, 6000, 7000, 8000]))  # 0 and 1 disagree
    graph.replay()
    assert errors.tolist() == [0, 0, 2]
    call()  # the auto plan: rows too
    assert errors.tolist() == [0, 0, 4]
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    with pytest.raises(ValueError, match="max_seqlen"):
        call(checks=True)


@pytest.mark.parametrize("pool_dtype,gate,spec,seqs", [(torch.float32, "lower_bound", False, 5),
                                                       (torch.bfloat16, "precomputed", False, 5),
                                                       (torch.float32, "lower_bound", True, 5),
                                                       (torch.float32, "precomputed", False, 3)])
def test_decode_matches_float64(pool_dtype, gate, spec, seqs):
    """Decode against float64 on 160 one-token programs (one warp each on a GPU of at most 160 SMs), speculative
    tokens (two warps) and 96 one-token programs (eight warps each on a GPU of more than 96 SMs)."""
    from fastkda.reference import kda_decode_reference

    tokens = 4 if spec else 1
    inp = make_inputs([tokens] * seqs, heads=4, key_dim=128, varlen=False, gate=gate, device="cuda", seed=8)
    pool = torch.full((3 * seqs * tokens, 4, 128, 128), 2.0 ** 100, device="cuda").to(pool_dtype)
    slots = (torch.randperm(3 * seqs * tokens, device="cuda")[:seqs * tokens].reshape(seqs, tokens) if spec
             else torch.randperm(3 * seqs, device="cuda")[:seqs]).int()
    slots[1] = -1  # a padding row
    accepted = torch.randint(1, tokens + 1, (seqs,), device="cuda", dtype=torch.int32) if spec else None
    read = slots[torch.arange(seqs), accepted.long() - 1] if spec else slots
    pool[read[read >= 0].long()] = torch.randn(int((read >= 0).sum()), 4, 128, 128, device="cuda").to(pool_dtype)
    expected = pool.double().clone()
    ref = kda_decode_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], expected, slots,
                               A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                               num_accepted_tokens=accepted, dtype=torch.float64)
    out = torch.full_like(inp["v"], float("nan"))
    fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, A_log=inp["A_log"],
                       dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], num_accepted_tokens=accepted, out=out)
    assert rel_err(out, ref) < OUT_BOUND
    touched = expected != 2.0 ** 100
    assert rel_err(pool.double()[touched], expected[touched]) < (BF16_STATE_BOUND if pool_dtype == torch.bfloat16
                                                                 else 1e-5)
    assert (pool.double()[~touched] == 2.0 ** 100).all()
    assert (out[1] == 0).all()


def test_decode_cuda_graph_replay():
    inp = make_inputs([1] * 8, heads=4, key_dim=128, varlen=False, device="cuda", seed=9)
    pool = torch.randn(16, 4, 128, 128, device="cuda")
    slots = torch.arange(8, device="cuda", dtype=torch.int32) * 2
    out = torch.empty_like(inp["v"])
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])

    def step():
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, **gate, out=out)

    graph = capture_graph(step)
    start = torch.randn_like(pool)
    pool.copy_(start)
    fresh = make_inputs([1] * 8, heads=4, key_dim=128, varlen=False, device="cuda", seed=10)
    for x in ("q", "k", "v", "g", "beta"):
        inp[x].copy_(fresh[x])
    graph.replay()
    torch.cuda.synchronize()
    eager_pool = start.clone()
    eager_out = fastkda.kda_decode(fresh["q"], fresh["k"], fresh["v"], fresh["g"], fresh["beta"], eager_pool, slots,
                                   **gate)
    assert torch.equal(out, eager_out) and torch.equal(pool, eager_pool)


def _misaligned(x):
    """A copy of ``x`` whose data starts 2 bytes past a 16-byte boundary (same values, same strides)."""
    buffer = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
    view = buffer[1:1 + x.numel()].view(x.shape)
    view.copy_(x)
    return view


def test_fast_launch_path_respecialises_misaligned_inputs():
    """fastkda launches a compiled kernel directly once it has run a specialisation (ops/common.py ``launch``);
    inputs that break the 16-byte alignment the first calls compiled for must get their own binary: the same
    values through misaligned views give bitwise the same results (a reused aligned binary faults or differs)."""
    inp = make_inputs([300, 77], heads=4, key_dim=128, device="cuda", seed=11)
    for _ in range(2):  # the second call takes the direct path
        base_o, base_s, _ = run_prefill(inp, torch.float32, torch.float32)
    for name in ("q", "k", "v", "g", "beta"):
        shifted = dict(inp, **{name: _misaligned(inp[name])})
        out, final, _ = run_prefill(shifted, torch.float32, torch.float32)
        assert torch.equal(out, base_o) and torch.equal(final, base_s), name


def test_repeated_call_skips_tritons_launch_path(monkeypatch):
    """After a shape's first call, fastkda launches the compiled kernels itself: Triton's JITFunction.run (its
    per-call argument binding, ~45 µs of host time per launch) is not entered again."""
    from triton.runtime.jit import JITFunction

    inp = make_inputs([500], heads=4, key_dim=128, device="cuda", seed=12)
    run_prefill(inp, torch.float32, torch.float32)
    entered = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: entered.append(self) or original(self, *a, **kw))
    out, final, _ = run_prefill(inp, torch.float32, torch.float32)
    assert not entered
    assert torch.isfinite(out).all() and torch.isfinite(final).all()


def test_bench_kernel_breakdown_times_each_kernel():
    from fastkda.bench.work import KERNELS, kernel_breakdown, kernel_work, plan_for_inputs
    from fastkda.bench.workloads import make_prefill_inputs

    workload = dict(name="w", H=4, lengths=[1024, 300], layout="varlen")
    copy_gbps, tflops = 4000.0, 600.0
    inp = make_prefill_inputs(workload, "cuda")
    rows = kernel_breakdown(inp, workload, copy_gbps, tflops)
    plan = plan_for_inputs(inp)
    work = kernel_work(workload, plan)  # the sequence-parallel kernels only where the plan segments the sequences
    assert [r["kernel"] for r in rows] == [name for name in KERNELS if name in work]
    assert rows[0]["v_slices"] == plan.v_slices
    for r in rows:
        # the rate is computed before ms is rounded to 5 decimals: a short kernel's rounding sets the tolerance
        rounding = max(1e-3, 0.5e-5 / r["ms"])
        assert r["ms"] > 0 and r["gbps"] == pytest.approx(work[r["kernel"]][0] / r["ms"] / 1e6, rel=rounding, abs=0.1)
        assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / copy_gbps, abs=0.1)


def test_compiled_prefill_and_decode_choose_each_shape_s_plan():
    """Under torch.compile the ops choose their plans from the sizes they run on
    (:func:`fastkda.plan.prefill_plan_request`): over lengths whose eager plans differ (one sequence of 12 heads:
    serial at 256 tokens, in segments from 8192; V-slices by the sequences) and over batches and token counts
    whose decode plans differ (warps by the programs and the tokens), a few graphs at most, each call the eager
    call's bits. Each op is the process's first fastkda call (its error counters not yet allocated), as in a
    served model compiled before any eager call: the trace must not allocate them."""
    import torch._dynamo

    torch._dynamo.reset()
    counter = CompileCounter()
    prefill = torch.compile(lambda *a, **kw: fastkda.kda_prefill(*a, **kw), backend=counter, fullgraph=True)
    plans = set()
    for lengths in ([256], [8192], [1024, 3000], [9000], [64] * 11, [16384, 1]):
        inp = make_inputs(lengths, heads=12, key_dim=128, seed=sum(lengths), device="cuda")
        with mock.patch.dict(fastkda.errors._COUNTERS, clear=lengths == [256]):  # the first: no counters yet
            check_compiled_prefill(prefill, inp)
        plan = fastkda.choose_plan(len(lengths), 12, sum(lengths), 128, 128, torch.cuda.get_device_properties(0)
                                   .multi_processor_count, warpgroup_mma=torch.cuda.get_device_capability()[0] == 9)
        plans.add((plan.segment_chunks, plan.v_slices))
    assert len(plans) > 2 and counter.graphs <= 3
    counter = CompileCounter()
    decode = torch.compile(lambda *a, **kw: fastkda.kda_decode(*a, **kw), backend=counter, fullgraph=True)
    for num_seqs, tokens in ((1, 1), (2, 1), (16, 1), (40, 1), (3, 2)):  # 96 programs alone on their SMs (8
        # warps), a full grid (1), several tokens (2)
        inp = make_inputs([tokens] * num_seqs, heads=12, key_dim=128, varlen=False, seed=num_seqs, device="cuda")
        args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
        gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
        pools = [torch.randn(num_seqs, 12, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
                 for _ in range(2)]
        slots = torch.arange(num_seqs, dtype=torch.int32, device="cuda").flip(0)
        with mock.patch.dict(fastkda.errors._COUNTERS, clear=num_seqs == 1):  # the first: no counters yet
            compiled = decode(*args, pools[0], slots, **gate)
        assert torch.equal(compiled, fastkda.kda_decode(*args, pools[1], slots, **gate))
        assert torch.equal(pools[0], pools[1])
    assert counter.graphs <= 3


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_reduce_overhead_compile_as_the_first_call_keeps_the_counters_out_of_its_graphs(op):
    """``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graphs) as a process's first fastkda call: its
    first run is a warm-up whose allocations go to the graphs' private pool, whose blocks later graphs reuse, so the
    device's error counters are made while the call is traced, in the default pool; replays give the eager bits."""
    import torch._dynamo

    torch._dynamo.reset()
    if op == "prefill":
        inp = make_inputs([300, 77], heads=4, key_dim=128, seed=5, device="cuda")
        args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
        kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                  cu_seqlens=inp["cu_seqlens"])

        def call():
            return fastkda.kda_prefill(*args, **kw)[0] * 2
    else:
        inp = make_inputs([1] * 3, heads=4, key_dim=128, varlen=False, seed=6, device="cuda")
        args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
        pool = torch.zeros(3, 4, 128, 128, device="cuda")
        torch._dynamo.mark_static_address(pool)  # a pool the graphs update in place (inductor skips them otherwise)
        slots = torch.arange(3, dtype=torch.int32, device="cuda")
        kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])

        def call():
            pool.zero_()
            return fastkda.kda_decode(*args, pool, slots, **kw) * 2
    compiled = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    torch._dynamo.utils.counters.clear()
    with mock.patch.dict(fastkda.errors._COUNTERS, clear=True):
        results = [compiled().clone() for _ in range(3)]  # warm-up, record, replay
        assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]  # the graphs ran, warm-up first
        assert in_default_pool(fastkda.errors._COUNTERS[torch.device("cuda", torch.cuda.current_device())])
    want = call()
    assert all(torch.equal(r, want) for r in results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_calls_on_a_gpu_other_than_the_current_one_run_there():
    """A model split over GPUs in one process calls fastkda with tensors on a GPU that is not the current device:
    prefill (in segments too), decode, the conv, the gated norm and the fused decode step on cuda:1 while cuda:0 is
    current give what the same calls give with cuda:1 current, and leave the current device as it was."""
    inp = make_inputs([3000, 700], heads=12, key_dim=128, seed=9, device="cuda:1")
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], output_final_state=True)
    step = make_inputs([1] * 4, heads=12, key_dim=128, varlen=False, seed=10, device="cuda:1")
    step_args = [step[x] for x in ("q", "k", "v", "g", "beta")]
    gate = dict(A_log=step["A_log"], dt_bias=step["dt_bias"], lower_bound=step["lower_bound"])
    slots = torch.arange(4, dtype=torch.int32, device="cuda:1")

    channels = 3 * 12 * 128
    mixed, weight = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to("cuda:1", torch.bfloat16)
                     for shape, seed in (((4, channels), 11), ((channels, 4), 12)))
    output_gate = torch.randn(4, 12, 128, generator=torch.Generator().manual_seed(13)).to("cuda:1", torch.bfloat16)
    norm_weight = torch.ones(128, device="cuda:1")

    def calls():
        pool, step_pool = (0.1 * torch.ones(4, 12, 128, 128, device="cuda:1") for _ in range(2))
        conv_pool = torch.ones(4, channels, 3, device="cuda:1", dtype=torch.bfloat16)
        conv = fastkda.causal_conv1d(inp["q"][0].flatten(-2).repeat(1, 3), weight, cu_seqlens=inp["cu_seqlens"])
        return (*fastkda.kda_prefill(*args, **kw), *fastkda.kda_prefill(*args, **kw, sequence_parallel=256),
                fastkda.kda_decode(*step_args, pool, slots, **gate), pool, conv,
                fastkda.gated_rmsnorm(step["v"], step["q"], norm_weight),
                fastkda.kda_decode_step(mixed, conv_pool, weight, step["g"][:, 0], step["beta"][:, 0], output_gate,
                                        norm_weight, step_pool, slots, **gate), step_pool, conv_pool)

    with torch.cuda.device(0):
        got = calls()
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        want = calls()
    assert all(torch.equal(a, b) for a, b in zip(got, want))

"""GPU tests of the Gluon recurrence (``fastkda/ops/prefill/recurrence_warpgroup.py``, the plan's
``warpgroup_recurrence`` and ``warpgroup_transition``): the Triton kernels' bits on every form (serial, the
segments' rerun and transitions, the open-entry halves) and input it takes, and the accuracy bar against the
float64 recurrence. Run on the H200 by ``tools/device_tests.sh``; skipped without CUDA. Every output buffer is
NaN-poisoned before the call."""

import pytest
import torch

import fastkda
from fastkda.bench.timing import capture_graph
from fastkda.plan import choose_open_entry_plan
from fastkda.reference import kda_reference
from helpers import make_inputs, plan_for, rel_err, replay_with, run_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OUT_BOUND, STATE_BOUND = 4e-3, 3e-3
CASES = [  # V = 128 in each: slices of 64 (v_slices=2) and 128 (v_slices=1) columns
    dict(lengths=[1024], heads=12, key_dim=128, varlen=False),
    dict(lengths=[0, 1, 31, 32, 33, 700, 64, 0], heads=3, key_dim=128),
    dict(lengths=[300, 300], heads=4, key_dim=64, value_dim=128, varlen=False, gate="precomputed"),
    dict(lengths=[2048, 5], heads=2, key_dim=128, gate="weak"),
]
STATES = [(None, None), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


def gluon(plan, stages=4):
    """``plan`` with the Gluon kernels at ``stages``: the recurrence and, where it is segmented, the transitions."""
    transitions = dict(warpgroup_transition=True, transition_stages=stages) if plan.segment_chunks else {}
    return plan.replace(warpgroup_recurrence=True, recurrence_stages=stages, **transitions)


def triton_only(plan):
    """``plan`` with the Triton kernels (whatever the automatic plan chose), at their usual 3 stages."""
    return plan.replace(warpgroup_recurrence=False, recurrence_stages=3, warpgroup_transition=False,
                        transition_stages=3)


def same_bits(inp, states, plan, stages=4):
    """The call under ``plan`` with the Triton kernels and with the Gluon ones: equal outputs and final states."""
    triton_o, triton_s, _ = run_prefill(inp, *states, plan=triton_only(plan))
    gluon_o, gluon_s, _ = run_prefill(inp, *states, plan=gluon(plan, stages))
    assert torch.equal(gluon_o, triton_o)
    assert (gluon_s is None) or torch.equal(gluon_s, triton_s)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("states", STATES, ids=["none", "fp32", "bf16"])
@pytest.mark.parametrize("stages,v_slices", [(4, 2), (5, 2), (4, 1)])
def test_serial_same_bits_as_the_triton_kernel(case, states, stages, v_slices):
    inp = make_inputs(device="cuda", seed=11, **case)
    same_bits(inp, states, plan_for(inp, v_slices=v_slices), stages)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("states", STATES, ids=["none", "fp32", "bf16"])
@pytest.mark.parametrize("v_slices", [1, 2])
def test_segments_same_bits_as_the_triton_kernels(case, states, v_slices):
    """Sequence parallelism: the transitions and the rerun, segments of 4 chunks (so that most sequences have
    several), both slice widths."""
    inp = make_inputs(device="cuda", seed=12, **case)
    same_bits(inp, states, plan_for(inp, v_slices=v_slices, sequence_parallel=128))


def test_open_entry_same_bits_as_the_triton_kernels():
    """Context parallelism's halves: every segment's transition from zero, the scan, the rerun from an entry."""
    from fastkda.ops.prefill import open_entry_finish, open_entry_transitions

    inp = make_inputs([1500, 1500], heads=2, key_dim=128, varlen=False, device="cuda", seed=13, gate="weak")
    plan = choose_open_entry_plan(2, 2, 1500, 128, 128, torch.cuda.get_device_properties(0).multi_processor_count,
                                  lower_bound_gate=False, sequence_parallel=256)
    results = []
    for chosen in (triton_only(plan), gluon(plan)):
        maps = torch.full((2, 2, 256, 128), float("nan"), device="cuda")
        ws = open_entry_transitions(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=chosen, A_log=None,
                                    dt_bias=None, lower_bound=None, scale=128 ** -0.5, use_qk_l2norm=True,
                                    use_beta_sigmoid=True, exit_maps=maps)
        out = torch.full_like(inp["v"], float("nan"))
        final = torch.full_like(inp["initial_state"], float("nan"))
        open_entry_finish(chosen, ws, inp["initial_state"], out, final)
        results.append((maps, out, final))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_fp32_inputs_and_a_strided_v():
    """fp32 q, k, v (the ring and the output's buffers hold them as they come: at 128 columns the most shared
    memory any plan takes); and a v view whose rows are not 16-byte multiples, which the Gluon kernels' copies
    cannot take, so the call runs the Triton kernels: the same bits either way."""
    inp = make_inputs([700, 300], heads=2, key_dim=128, device="cuda", seed=14)
    wide = {name: inp[name].float() for name in ("q", "k", "v")}
    for v_slices in (1, 2):
        same_bits(dict(inp, **wide), STATES[1], plan_for(inp, v_slices=v_slices))
    padded = torch.zeros(*inp["v"].shape[:2], 2 * 128 + 8, dtype=inp["v"].dtype, device="cuda")
    padded[..., :256] = inp["v"].flatten(2)
    strided = dict(inp, v=padded[..., :256].unflatten(2, (2, 128)))
    assert strided["v"].stride(1) % 16
    same_bits(strided, STATES[1], plan_for(inp, v_slices=2))


@pytest.mark.parametrize("sequence_parallel", [False, 256])
def test_cuda_graph_replay_with_new_cu_seqlens(sequence_parallel):
    """A graph captured once replays the Gluon kernels on new inputs and new ``cu_seqlens`` (the same total), bit
    for bit as an eager call on them."""
    lengths, moved = [100, 900, 24], [600, 1, 423]
    inp = make_inputs(lengths, heads=4, key_dim=128, device="cuda", seed=17)
    plan = gluon(plan_for(inp, v_slices=2, sequence_parallel=sequence_parallel))
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])
    names = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias")

    def step():
        fastkda.kda_prefill(*(inp[x] for x in names[:5]), A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                            lower_bound=inp["lower_bound"], initial_state=inp["initial_state"], final_state=final,
                            cu_seqlens=inp["cu_seqlens"], out=out, plan=plan)

    graph = capture_graph(step)
    fresh = make_inputs(moved, heads=4, key_dim=128, device="cuda", seed=18)
    replay_with(graph, inp, fresh, names, (out, final))
    eager_o, eager_s, _ = run_prefill(fresh, torch.float32, torch.float32, plan=plan)
    assert torch.equal(out, eager_o) and torch.equal(final, eager_s)


def test_accuracy_bar_at_t_8192():
    inp = make_inputs([8192], heads=4, key_dim=128, varlen=False, device="cuda", seed=15)
    out, final, h0 = run_prefill(inp, torch.float32, torch.float32, plan=gluon(plan_for(inp, v_slices=2)))
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                 dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], initial_state=h0)
    err_o, err_s = rel_err(out, ref_o), rel_err(final, ref_s)
    print(f"\n[accuracy] Gluon recurrence T=8192 H=4: output {err_o:.3e}, final state {err_s:.3e}")
    assert err_o <= OUT_BOUND and err_s <= STATE_BOUND


def test_checkpoints_and_errors_as_the_triton_kernel():
    """Checkpoints at 0, inside the sequence, at its end and past it, serial and segmented; and a malformed
    ``cu_seqlens`` counted."""
    inp = make_inputs([1000, 700], heads=2, key_dim=128, device="cuda", seed=16)
    offsets = torch.tensor([[320, 1000], [0, 704]], dtype=torch.int32, device="cuda")
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    gate = {x: inp[x] for x in ("A_log", "dt_bias", "lower_bound")}
    for sequence_parallel in (False, 256):
        results = []
        base = plan_for(inp, v_slices=2, sequence_parallel=sequence_parallel)
        for plan in (triton_only(base), gluon(base)):
            states = torch.full((2, 2, 2, 128, 128), float("nan"), device="cuda")
            out, final = fastkda.kda_prefill(*args, **gate, initial_state=inp["initial_state"], output_final_state=True,
                                             cu_seqlens=inp["cu_seqlens"], checkpoint_offsets=offsets,
                                             checkpoint_states=states, plan=plan)
            results.append((out, final, states))
        for a, b in zip(*results):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), sequence_parallel
    bad = inp["cu_seqlens"].clone()
    bad[1] = 5000  # past T: clamped, counted
    errors = torch.zeros(3, dtype=torch.int32, device="cuda")
    fastkda.kda_prefill(*args, **gate, initial_state=inp["initial_state"], cu_seqlens=bad,
                        plan=gluon(plan_for(inp, v_slices=2)), errors=errors, checks=False)
    assert errors[2].item() >= 1


def crafted_workspace(plan, v, fill):
    """A workspace for ``plan`` whose sections hold what ``fill`` says (zeros elsewhere): ``{"kd", "qg", "kg",
    "A", "T", "decay"}`` -> a tensor of the section's ``[rows, D]`` shape (rows = token·H + head; ``decay``: chunk
    slot·H + head), so that each of the kernel's products can be checked alone."""
    from fastkda.ops.prefill.layout import Workspace

    ws = Workspace.allocate(plan, v, None)
    ws.bf16.zero_()
    ws.fp32.zero_()
    rows, K, C = plan.batch * plan.seq_len * plan.heads, plan.key_dim, plan.chunk
    layout = ws.layout
    sections = dict(kd=(ws.bf16, 0, K), qg=(ws.bf16, layout.qg, K), kg=(ws.bf16, layout.kg, K),
                    A=(ws.bf16, layout.A, C), T=(ws.fp32, layout.scratch, C),
                    decay=(ws.fp32, 0, K))
    for name, value in fill.items():
        buffer, at, width = sections[name]
        count = plan.chunk_slots * plan.heads if name == "decay" else rows
        buffer[at:at + count * width].view(count, width).copy_(value(count, width))
    return ws


def identity_rows(count, width, heads):
    """Row r = token·H + head of an in-chunk matrix: 1 at column token mod C (the identity, chunk by chunk)."""
    token = torch.arange(count, device="cuda") // heads
    return torch.nn.functional.one_hot(token % width, width).float()


def test_products_one_at_a_time():
    """Hand-made workspaces whose answer is exact, each through the Gluon kernel and the Triton one (100 tokens: a
    partial last chunk):
    - kd = qg = kg = 0, T·β = M = I: the output is v itself (the copies of v, T's halves, M, the output's store);
    - kd = kg = M = 0, T·β = I, a chunk decay of 1/2, qg's row t = e_(t mod K): the output of token t is column
      t mod K of the state before its chunk, S·2^-c (the state's operand, qg, the decay), and the final state is
      S·2^-4."""
    from fastkda.ops.prefill.recurrence import launch_recurrence

    H, K, T = 2, 128, 100
    v = torch.randn(1, T, H, 128, device="cuda").to(torch.bfloat16)
    S0 = torch.randn(1, H, 128, K, device="cuda").to(torch.bfloat16).float()  # bf16 values: exact as operands
    plan = plan_for(dict(q=torch.empty(1, T, H, K), v=v, cu_seqlens=None, lower_bound=-5.0), v_slices=2)

    def identity(count, width):
        return identity_rows(count, width, H)

    def halves(count, width):
        return torch.full((count, width), 0.5, device="cuda")

    state_before = 0.5 ** (torch.arange(T, device="cuda") // 32)[:, None]  # token t's chunk's decay so far
    cases = [
        (dict(A=identity, T=identity, decay=lambda count, width: torch.ones(count, width, device="cuda")), None,
         v.float(), torch.zeros_like(S0)),
        (dict(T=identity, decay=halves, qg=identity), S0,
         torch.stack([S0[0, h][:, torch.arange(T) % K].T * state_before for h in range(H)], dim=1)[None],
         S0 * 0.5 ** 4),
    ]
    for fill, initial, expected_o, expected_s in cases:
        for chosen in (triton_only(plan), gluon(plan)):
            ws = crafted_workspace(chosen, v, fill)
            out = torch.full_like(v, float("nan"))
            final = torch.full_like(S0, float("nan"))
            launch_recurrence(chosen, ws, out, initial, final, None, None,
                              torch.zeros(3, dtype=torch.int32, device="cuda"), emulate=False)
            assert torch.equal(out.float(), expected_o.to(torch.bfloat16).float()), chosen.warpgroup_recurrence
            assert torch.equal(final, expected_s), chosen.warpgroup_recurrence

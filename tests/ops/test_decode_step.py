"""The fused decode step (``fastkda/ops/decode_step.py``) under Triton's interpreter against the public
function's CPU path (conv update, KDA decode, gated norm, each its own op), fp32: outputs, both pools, padding
rows that touch nothing, the tickets left at zero; and the public function's errors."""

import pytest
import torch

import fastkda
from fastkda.cache import conv_state_pool
from fastkda.plan import choose_decode_plan
from helpers import needs_interpreter, rel_err

HEADS, DIM, WIDTH = 2, 64, 4


def step_inputs(num_seqs, pool_rows, lower_bound=-5.0, seed=0, state_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    channels = 3 * HEADS * DIM

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return dict(
        mixed=randn(num_seqs, channels), conv_states=randn(pool_rows, channels, WIDTH - 1),
        conv_weight=randn(channels, WIDTH, scale=0.5), g=randn(num_seqs, HEADS, DIM), beta=randn(num_seqs, HEADS),
        output_gate=randn(num_seqs, HEADS, DIM), norm_weight=1 + 0.1 * randn(DIM),
        state_pool=randn(pool_rows, HEADS, DIM, DIM, scale=0.1).to(state_dtype),
        A_log=torch.rand(HEADS, generator=gen) if lower_bound is not None else None,
        dt_bias=torch.rand(HEADS, DIM, generator=gen) if lower_bound is not None else None,
        lower_bound=lower_bound)


def cpu_step(inp, slots):
    inp = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in inp.items()}
    out = fastkda.kda_decode_step(**{n: x for n, x in inp.items() if n not in ("conv_states", "state_pool")},
                                  conv_states=inp["conv_states"], state_pool=inp["state_pool"], slots=slots)
    return out, inp["conv_states"], inp["state_pool"]


def fused_step(inp, slots, v_slices, errors=None):
    """The fused kernel on ``inp`` (copied) under ``v_slices`` slices a head (1: one program a head), its error
    counts added to ``errors`` when given."""
    from fastkda.ops.decode_step import fused_decode_step

    inp = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in inp.items()}
    num_seqs = slots.shape[0]
    plan = choose_decode_plan(num_seqs, HEADS, DIM, 132, v_slices)
    tickets = torch.zeros(num_seqs * HEADS, dtype=torch.int32)
    out = torch.full((num_seqs, HEADS, DIM), float("nan"))
    fused_decode_step(inp["mixed"], inp["conv_states"], inp["conv_weight"], inp["g"], inp["beta"],
                      inp["output_gate"], inp["norm_weight"], inp["state_pool"], slots, plan=plan, A_log=inp["A_log"],
                      dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=DIM ** -0.5, eps=1e-5,
                      use_qk_l2norm=True, use_beta_sigmoid=True, tickets=tickets, out=out,
                      errors=torch.zeros(3, dtype=torch.int32) if errors is None else errors)
    assert torch.equal(tickets, torch.zeros_like(tickets))  # left as zeros for the next step (or graph replay)
    return out, inp["conv_states"], inp["state_pool"]


@needs_interpreter
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "precomputed"])
@pytest.mark.parametrize("v_slices", [1, 4])
def test_fused_step_equals_the_three_ops(lower_bound, v_slices):
    inp = step_inputs(3, 5, lower_bound)
    if lower_bound is None:
        inp["g"] = -torch.rand(inp["g"].shape, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    want = cpu_step(inp, slots)
    got = fused_step(inp, slots, v_slices)
    assert rel_err(got[0], want[0]) < 1e-5
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))  # the padding row
    for got_pool, want_pool, untouched in ((got[1], want[1], inp["conv_states"]), (got[2], want[2],
                                                                                   inp["state_pool"])):
        assert rel_err(got_pool[[4, 1]], want_pool[[4, 1]]) < 1e-5
        assert torch.equal(got_pool[[0, 2, 3]], untouched[[0, 2, 3]])  # rows no live sequence names


@needs_interpreter
@pytest.mark.parametrize("v_slices", [1, 4])
def test_a_slot_past_the_pool_is_counted_once_and_touches_nothing(v_slices):
    """A slot at or past the pool's size makes a padding row (zero output, neither pool touched) and is counted
    once per sequence under "slot", whatever the heads and slices."""
    inp = step_inputs(4, 5, seed=9)
    slots = torch.tensor([4, 5, 1, 9], dtype=torch.int32)  # two sequences name rows past the pool's five
    errors = torch.zeros(3, dtype=torch.int32)
    out, conv_states, state_pool = fused_step(inp, slots, v_slices, errors)
    assert errors.tolist() == [2, 0, 0]
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    assert torch.equal(conv_states[[0, 2, 3]], inp["conv_states"][[0, 2, 3]])
    assert torch.equal(state_pool[[0, 2, 3]], inp["state_pool"][[0, 2, 3]])
    assert not torch.equal(state_pool[[4, 1]], inp["state_pool"][[4, 1]])


@needs_interpreter
@pytest.mark.parametrize("v_slices", [1, 2])
def test_fused_step_over_a_channel_last_conv_pool(v_slices):
    """KDACache's conv pool layout (``[P, C, W−1]`` over ``[P, W−1, C]`` memory): the same outputs and pools as
    over a contiguous pool, bit for bit, the pool still channel-last."""
    inp = step_inputs(2, 4, seed=5)
    slots = torch.tensor([3, 0], dtype=torch.int32)
    want = fused_step(inp, slots, v_slices)
    channel_last = conv_state_pool(4, channels=inp["conv_states"].shape[1], kernel=WIDTH,
                                   dtype=torch.float32)
    channel_last.copy_(inp["conv_states"])
    got = fused_step({**inp, "conv_states": channel_last}, slots, v_slices)
    assert got[1].stride(1) == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cpu_path_equals_a_prefill_of_the_layer_conv_and_decode():
    """The CPU path's conv state after a step holds the newest W−1 inputs, oldest first."""
    inp = step_inputs(2, 2, seed=4)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    _, conv_states, _ = cpu_step(inp, slots)
    assert torch.equal(conv_states[1][:, :-1], inp["conv_states"][1][:, 1:])
    assert torch.equal(conv_states[1][:, -1], inp["mixed"][0])


def test_errors_name_the_argument():
    inp = step_inputs(2, 3)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="mixed"):
        fastkda.kda_decode_step(**{**inp, "mixed": inp["mixed"][:, :-1]}, slots=slots)
    with pytest.raises(ValueError, match="output_gate"):
        fastkda.kda_decode_step(**{**inp, "output_gate": inp["output_gate"][:, :, :32]}, slots=slots)
    with pytest.raises(ValueError, match="norm_weight"):
        fastkda.kda_decode_step(**{**inp, "norm_weight": torch.ones(DIM + 1)}, slots=slots)
    with pytest.raises(ValueError, match="slots"):
        fastkda.kda_decode_step(**inp, slots=slots[:, None].expand(2, 2))
    with pytest.raises(ValueError, match="conv_states"):  # a slot must address a row of each pool
        fastkda.kda_decode_step(**{**inp, "conv_states": inp["conv_states"][:2]}, slots=slots)
    wide = torch.zeros(*inp["conv_states"].shape[:2], WIDTH)  # the step's pools keep W−1 columns, no more
    with pytest.raises(ValueError, match="conv_states"):
        fastkda.kda_decode_step(**{**inp, "conv_states": wide}, slots=slots)
    with pytest.raises(ValueError, match="plan"):  # a plan of another shape
        fastkda.kda_decode_step(**inp, slots=slots, plan=choose_decode_plan(3, HEADS, DIM, 132, tokens=1))
    for beta in (inp["beta"][0, 0], inp["beta"][:, 0]):  # 0-d (was an IndexError), [N] (named decode's [N, 1, H])
        with pytest.raises(ValueError, match=rf"beta must be of shape \[2, {HEADS}\]"):
            fastkda.kda_decode_step(**{**inp, "beta": beta}, slots=slots)


@needs_interpreter
@pytest.mark.parametrize("v_slices", [1, 4])
def test_fused_step_reads_beta_through_its_head_stride(v_slices):
    inp = step_inputs(2, 3, seed=7)
    inp["beta"] = inp["beta"].t().contiguous().t()  # [N, H] with strides (1, N): heads strided
    slots = torch.tensor([2, 0], dtype=torch.int32)
    want = cpu_step(inp, slots)
    got = fused_step(inp, slots, v_slices)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[2], want[2]) < 1e-5


def test_bad_values_are_refused_before_a_pool_moves():
    inp = step_inputs(2, 3, seed=8)
    before = inp["conv_states"].clone(), inp["state_pool"].clone()
    with pytest.raises(ValueError, match="slots"):
        fastkda.kda_decode_step(**inp, slots=torch.tensor([1, 1], dtype=torch.int32))  # two sequences, one slot
    assert torch.equal(inp["conv_states"], before[0]) and torch.equal(inp["state_pool"], before[1])
    with pytest.raises(ValueError, match="eps"):
        fastkda.kda_decode_step(**inp, slots=torch.tensor([0, 1], dtype=torch.int32), eps=0.0)
    with pytest.raises(ValueError, match="tickets"):
        fastkda.kda_decode_step(**inp, slots=torch.tensor([0, 1], dtype=torch.int32),
                                tickets=torch.zeros(1, dtype=torch.int32).expand(2 * HEADS))


@pytest.mark.parametrize("bad", ["mixed", "conv_states", "state_pool", "A_log", "g_positive"])
def test_checked_mode_refuses_bad_values_before_a_pool_moves(bad, monkeypatch):
    """Under $FASTKDA_CHECKS the step checks what it reads (a live slot's conv and state rows too, not another's)
    before the conv writes its pool: a NaN in the projections, a live conv or state row or the gate's parameters,
    and a positive precomputed gate."""
    monkeypatch.setenv("FASTKDA_CHECKS", "1")
    inp = step_inputs(2, 3, seed=9, lower_bound=None if bad == "g_positive" else -5.0)
    inp["conv_states"][1, 0, 0] = float("nan")  # slot 1 is not in this call: its rows are not read, not checked
    inp["state_pool"][1, 0, 0, 0] = float("nan")
    slots = torch.tensor([0, 2], dtype=torch.int32)
    if bad == "g_positive":
        inp["g"] = inp["g"].abs()
    elif bad in ("conv_states", "state_pool"):
        inp[bad][2].view(-1)[7] = float("nan")
    else:
        inp[bad].view(-1)[0] = float("nan")
    before = inp["conv_states"].clone(), inp["state_pool"].clone()
    with pytest.raises(ValueError, match="g" if bad == "g_positive" else bad):
        fastkda.kda_decode_step(**inp, slots=slots)
    for pool, was in zip((inp["conv_states"], inp["state_pool"]), before):  # not one bit moved
        torch.testing.assert_close(pool, was, rtol=0, atol=0, equal_nan=True)


def test_checked_mode_refusing_the_conv_s_output_puts_the_conv_rows_back(monkeypatch):
    """Finite inputs whose conv overflows: the decode refuses the conv's output (q), which the conv has already
    written to its pool; the step puts those rows back, so neither pool has moved."""
    monkeypatch.setenv("FASTKDA_CHECKS", "1")
    inp = step_inputs(2, 3, seed=10)
    inp["mixed"][1, 3] = 3e38
    inp["conv_weight"][3] = 10.0
    before = inp["conv_states"].clone(), inp["state_pool"].clone()
    with pytest.raises(ValueError, match="q must be finite"):
        fastkda.kda_decode_step(**inp, slots=torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(inp["conv_states"], before[0]) and torch.equal(inp["state_pool"], before[1])


def test_torch_compile_traces_the_step_as_its_three_ops():
    """``fullgraph=True`` (the layer's default decode under torch.compile): the eager output and both pools."""
    inp = step_inputs(2, 3, seed=9)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    compiled, eager = ({n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in inp.items()} for _ in range(2))
    got = torch.compile(lambda **kw: fastkda.kda_decode_step(**kw), fullgraph=True)(**compiled, slots=slots)
    expected = fastkda.kda_decode_step(**eager, slots=slots)
    assert torch.equal(got, expected)
    assert torch.equal(compiled["conv_states"], eager["conv_states"])
    assert torch.equal(compiled["state_pool"], eager["state_pool"])
    assert not torch.equal(eager["state_pool"], inp["state_pool"])  # the step moved the pools


def test_an_empty_batch_returns_an_empty_output_and_touches_no_pool():
    """No sequence: an empty ``[0, H, V]`` output, as the three ops give it, both pools as they were."""
    inp = step_inputs(0, 3)
    out, conv_states, state_pool = cpu_step(inp, torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, HEADS, DIM)
    assert torch.equal(conv_states, inp["conv_states"]) and torch.equal(state_pool, inp["state_pool"])

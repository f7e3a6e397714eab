"""The decode benchmark's memory floor (``fastkda.bench.floor``) under Triton's interpreter, and its layer-step
runners on the CPU path: what they move and write, so that the floor measures a state's round trip and nothing
else, and the fused step's row times the same step as the three ops'."""

import pytest
import torch

from fastkda.bench import runners
from fastkda.bench.workloads import make_decode_inputs
from helpers import needs_interpreter


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 3])
def test_floor_moves_each_state_through_its_slots(tokens):
    from fastkda.bench.floor import state_chain_runner

    inp = make_decode_inputs(dict(name="w", H=2, N=3, tokens_per_seq=tokens), "cpu")
    before = inp["pool"].clone()
    state_chain_runner(inp)()
    slots = inp["slots"].reshape(3, tokens).long()
    for t in range(tokens):
        assert torch.equal(inp["pool"][slots[:, t]], before[slots[:, 0]] * 1.0009765625)
    assert torch.equal(inp["pool"][-1], before[-1])  # the spare slot: untouched


def test_step_runners_time_the_same_step_and_skip_speculative_workloads():
    inp = make_decode_inputs(dict(name="w", H=2, N=3, tokens_per_seq=1), "cpu")
    first = inp["pool"].clone()
    fused = runners.fastkda_step_runner(inp)()
    after_fused = inp["pool"].clone()
    inp["pool"].copy_(first)
    unfused = runners.fastkda_three_ops_runner(inp)()
    assert fused.shape == (3, 2, 128) and torch.equal(fused, unfused)
    assert torch.equal(after_fused, inp["pool"]) and not torch.equal(first, after_fused)
    speculative = make_decode_inputs(dict(name="s", H=2, N=3, tokens_per_seq=2), "cpu")
    assert runners.fastkda_step_runner(speculative) is None and runners.fastkda_three_ops_runner(speculative) is None

"""GPU tests of the Gluon recurrence (``fastkda/ops/prefill/recurrence_warpgroup.py``, the plan's
``warpgroup_recurrence``): the Triton kernel's bits on every input form it takes, and the accuracy bar against the
float64 recurrence. Run on the H200 by ``tools/device_tests.sh``; skipped without CUDA. Every output buffer is
NaN-poisoned before the call."""

import pytest
import torch

import fastkda
from fastkda.reference import kda_reference
from helpers import make_inputs, plan_for, rel_err, run_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OUT_BOUND, STATE_BOUND = 4e-3, 3e-3
CASES = [  # V = 128 in each: slices of 64 (v_slices=2) and 128 (v_slices=1) columns
    dict(lengths=[1024], heads=12, key_dim=128, varlen=False),
    dict(lengths=[0, 1, 31, 32, 33, 700, 64, 0], heads=3, key_dim=128),
    dict(lengths=[300, 300], heads=4, key_dim=64, value_dim=128, varlen=False, gate="precomputed"),
    dict(lengths=[2048, 5], heads=2, key_dim=128, gate="weak"),
]


def gluon_plan(inp, stages=4, v_slices=2):
    """The serial plan of ``inp`` at ``v_slices``, with the Gluon recurrence at ``stages``."""
    return plan_for(inp, v_slices=v_slices, warpgroup_recurrence=True, recurrence_stages=stages)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("states", [(None, None), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["none", "fp32", "bf16"])
@pytest.mark.parametrize("stages,v_slices", [(4, 2), (5, 2), (4, 1)])
def test_same_bits_as_the_triton_kernel(case, states, stages, v_slices):
    inp = make_inputs(device="cuda", seed=11, **case)
    triton_o, triton_s, _ = run_prefill(inp, *states, plan=plan_for(inp, v_slices=v_slices))
    gluon_o, gluon_s, _ = run_prefill(inp, *states, plan=gluon_plan(inp, stages, v_slices))
    assert torch.equal(gluon_o, triton_o)
    assert (gluon_s is None) or torch.equal(gluon_s, triton_s)


def test_same_bits_as_one_slice():
    """v_slices' promise holds across the kernels: the Gluon kernel's two slices equal the Triton kernel's one."""
    inp = make_inputs([4096], heads=4, key_dim=128, varlen=False, device="cuda", seed=12)
    one_o, one_s, _ = run_prefill(inp, torch.float32, torch.float32, v_slices=1, sequence_parallel=False)
    gluon_o, gluon_s, _ = run_prefill(inp, torch.float32, torch.float32, plan=gluon_plan(inp))
    assert torch.equal(gluon_o, one_o) and torch.equal(gluon_s, one_s)


def test_accuracy_bar_at_t_8192():
    inp = make_inputs([8192], heads=4, key_dim=128, varlen=False, device="cuda", seed=13)
    out, final, h0 = run_prefill(inp, torch.float32, torch.float32, plan=gluon_plan(inp))
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                 dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], initial_state=h0)
    err_o, err_s = rel_err(out, ref_o), rel_err(final, ref_s)
    print(f"\n[accuracy] Gluon recurrence T=8192 H=4: output {err_o:.3e}, final state {err_s:.3e}")
    assert err_o <= OUT_BOUND and err_s <= STATE_BOUND


def test_checkpoints_and_errors_as_the_triton_kernel():
    """Checkpoints at 0, inside the sequence, at its end and past it; and a malformed ``cu_seqlens`` counted."""
    inp = make_inputs([1000, 700], heads=2, key_dim=128, device="cuda", seed=14)
    offsets = torch.tensor([[320, 1000], [0, 704]], dtype=torch.int64, device="cuda")
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    results = []
    for plan in (plan_for(inp, v_slices=2), gluon_plan(inp)):
        states = torch.full((2, 2, 2, 128, 128), float("nan"), device="cuda")
        out, final = fastkda.kda_prefill(*args, initial_state=inp["initial_state"], output_final_state=True,
                                         cu_seqlens=inp["cu_seqlens"], checkpoint_offsets=offsets,
                                         checkpoint_states=states, plan=plan)
        results.append((out, final, states))
    for a, b in zip(*results):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    bad = inp["cu_seqlens"].clone()
    bad[1] = 5000  # past T: clamped, counted
    errors = torch.zeros(3, dtype=torch.int32, device="cuda")
    fastkda.kda_prefill(*args, initial_state=inp["initial_state"], cu_seqlens=bad, plan=gluon_plan(inp),
                        errors=errors, checks=False)
    assert errors[2].item() >= 1

"""The Triton kernels themselves, on the CPU interpreter (``TRITON_INTERPRET=1``), against float64.

The kernels keep bf16 operands as their exact bf16 roundings in fp32 under the interpreter (see
``fastkda/ops/common.py``), so these errors are the GPU's, up to summation order."""

import os

import pytest
import torch

from fastkda.reference import kda_reference
from helpers import make_inputs, rel_err

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests run where there is no GPU")

OUT_BOUND, STATE_BOUND = 4e-3, 3e-3  # issue 2's accuracy bar


def run_triton(inp, v_slices=1, final_dtype=torch.float32, use_final=True, w_u_in_recurrence=None):
    from fastkda.ops.prefill import chunk_kda_forward

    n = inp["cu_seqlens"].numel() - 1 if inp["cu_seqlens"] is not None else inp["q"].shape[0]
    heads, key_dim, value_dim = inp["q"].shape[2], inp["q"].shape[3], inp["v"].shape[3]
    out = torch.full_like(inp["v"], float("nan"))
    final = torch.full((n, heads, value_dim, key_dim), float("nan"), dtype=final_dtype) if use_final else None
    chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                      dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=key_dim ** -0.5,
                      initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True,
                      use_beta_sigmoid=True, v_slices=v_slices, out=out, final_state=final,
                      form_w_u_in_recurrence=w_u_in_recurrence)
    return out, final


def reference(inp):
    return kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                         dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                         initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])


CASES = [
    dict(lengths=[100], varlen=False),
    dict(lengths=[64, 64], varlen=False, with_initial=False),
    dict(lengths=[0, 70, 1, 130, 0], varlen=True),
    dict(lengths=[150, 20], varlen=True, gate="precomputed"),
    dict(lengths=[90], varlen=True, key_dim=128, state_dtype=torch.bfloat16),
    dict(lengths=[3, 65], varlen=True, cu_dtype=torch.int64),
    # 70 sequences, empty ones among them: a chunk lookup over many cu_seqlens entries (64 per step on the
    # varlen-lookup branch, so two steps)
    dict(lengths=[(7 * i) % 41 for i in range(70)], varlen=True, cu_dtype=torch.int64),
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
def test_saturated_lower_bound_gate(key_dim):
    """Every token decaying at the lower bound (-5 per token and channel): the preparation's factors reach their
    range's ends (2^±116 across 16 tokens), and must stay finite and accurate where they are kept."""
    inp = make_inputs([100], varlen=False, key_dim=key_dim, seed=11)
    inp["g"] = torch.full_like(inp["g"], 40.0)  # σ(e^A_log·(40 + b)) = 1 in fp32
    out, final = run_triton(inp)
    ref_o, ref_s = reference(inp)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert rel_err(out, ref_o) < OUT_BOUND
    assert rel_err(final, ref_s) < STATE_BOUND


@pytest.mark.parametrize("v_slices, w_u_in_recurrence", [(1, True), (2, False), (2, True), (4, False)])
def test_v_slices_and_w_u_forms_are_bitwise_identical(v_slices, w_u_in_recurrence):
    """Against one slice with the solve kernel's w and u: the 64-wide slice forms them itself or not, the 32-wide
    ones (the untransposed form) either way, the 16-wide ones as the plan has it."""
    inp = make_inputs([0, 80, 1, 45], heads=2, key_dim=64, seed=3)
    base_o, base_s = run_triton(inp, 1, w_u_in_recurrence=False)
    out, final = run_triton(inp, v_slices, w_u_in_recurrence=w_u_in_recurrence)
    assert torch.equal(out, base_o) and torch.equal(final, base_s)


def test_bf16_final_state_and_no_final_state():
    inp = make_inputs([70], seed=5, with_initial=False)
    ref_o, ref_s = reference(inp)
    out, final = run_triton(inp, final_dtype=torch.bfloat16)
    assert final.dtype == torch.bfloat16 and rel_err(final, ref_s) < STATE_BOUND
    out_only, none = run_triton(inp, use_final=False)
    assert none is None and torch.equal(out_only, out)

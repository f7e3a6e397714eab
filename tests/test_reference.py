"""The float64 truth (spec §1) and the CPU chunked path against it."""

import time

import pytest
import torch

from fastkda.reference import kda_chunked, kda_reference
from helpers import make_inputs, rel_err


def gate_args(inp):
    return dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])


def test_reference_single_token_closed_form():
    """One token from a zero state: S = k̂ (β v)ᵀ, so o = β v (k̂ · s q̂)."""
    inp = make_inputs([1], heads=3, key_dim=64, with_initial=False)
    o, state = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate_args(inp),
                             cu_seqlens=inp["cu_seqlens"])
    q, k, v = (inp[x][0, 0].double() for x in ("q", "k", "v"))
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() * 64 ** -0.5
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    beta = torch.sigmoid(inp["beta"][0, 0].double())
    expected = beta[:, None] * v * (k * q).sum(-1, keepdim=True)
    torch.testing.assert_close(o[0, 0], expected)
    torch.testing.assert_close(state[0], (beta[:, None] * v)[:, :, None] * k[:, None, :])


def test_reference_decays_initial_state():
    """Zero k and v: the state only decays, by exp(sum of a) per key channel."""
    inp = make_inputs([5], heads=2, key_dim=64)
    zeros = torch.zeros_like(inp["k"])
    _, state = kda_reference(inp["q"], zeros, zeros, inp["g"], inp["beta"], **gate_args(inp),
                             initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    a = inp["lower_bound"] * torch.sigmoid(inp["A_log"].double().exp()[:, None] * (inp["g"][0].double() + inp["dt_bias"].double()))
    expected = inp["initial_state"][0].double() * a.sum(0).exp()[:, None, :]
    torch.testing.assert_close(state[0], expected)


CASES = [
    dict(lengths=[100], varlen=False),
    dict(lengths=[40, 40, 40], varlen=False, with_initial=False),
    dict(lengths=[0, 70, 1, 33, 0], varlen=True),
    dict(lengths=[150, 20], varlen=True, gate="precomputed"),
    dict(lengths=[50], varlen=True, key_dim=128, state_dtype=torch.bfloat16),
    dict(lengths=[17, 64], varlen=True, cu_dtype=torch.int64, key_dim=64, value_dim=128),
]


@pytest.mark.parametrize("case", CASES)
def test_cpu_chunked_matches_float64(case):
    inp = make_inputs(seed=hash(str(case)) % 1000, **case)
    kw = dict(**gate_args(inp), initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
    o, s = kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
    assert rel_err(o, ref_o) < 2e-6
    assert rel_err(s, ref_s) < 2e-6


def test_cpu_chunked_survives_huge_precomputed_decay():
    inp = make_inputs([200], gate="precomputed")
    inp["g"][0, 50:60] = -1e4
    kw = dict(initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
    o, s = kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
    assert rel_err(o, ref_o) < 2e-6 and rel_err(s, ref_s) < 2e-6


def test_cpu_path_is_fast_enough():
    """Issue 2: T = 4096, H = 4 in seconds on two cores."""
    inp = make_inputs([4096], heads=4, key_dim=128)
    start = time.perf_counter()
    kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate_args(inp),
                initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert time.perf_counter() - start < 10.0

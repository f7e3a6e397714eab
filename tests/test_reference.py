"""The float64 truth (spec §1) and the CPU chunked path against it."""

import time

import pytest
import torch

from fastkda.reference import kda_chunked, kda_chunked_span, kda_decode_reference, kda_reference
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
    a = inp["lower_bound"] * torch.sigmoid(inp["A_log"].double().exp()[:, None]
                                           * (inp["g"][0].double() + inp["dt_bias"].double()))
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


@pytest.mark.parametrize("chunk", [1, 5, 24, 64])
def test_cpu_chunked_takes_any_chunk_length(chunk):
    """Chunks that are not a power of two, and chunks long enough that exp(-G) would overflow fp32 many times over
    under the precomputed gate (a run of -1e4 entries, clamped to -30)."""
    inp = make_inputs([150, 0, 77], gate="precomputed", seed=7)
    inp["g"][0, 10:40] = -1e4
    kw = dict(initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
    o, s = kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw, chunk=chunk)
    assert rel_err(o, ref_o) < 2e-6 and rel_err(s, ref_s) < 2e-6


def span_run(inp, spans, block_pairs, checkpoint_offsets=()):
    """``kda_chunked_span`` over ``spans`` of sequence 0, chained through the state: (out, state, checkpoints)."""
    args = [inp[x][0] for x in ("q", "k", "v", "g", "beta")]
    S = inp["initial_state"][0].float().transpose(-1, -2).clone()
    out = torch.full(inp["v"][0].shape, float("nan"))
    targets = {o: [torch.full_like(inp["initial_state"][0], float("nan"))] for o in checkpoint_offsets}
    for start, end in spans:
        kda_chunked_span(*args, S, out, start, end, **gate_args(inp), block_pairs=block_pairs,
                         checkpoints={o - start: t for o, t in targets.items() if start <= o <= end})
    return out, S, {o: t[0] for o, t in targets.items()}


def test_cpu_chunked_blocks_and_spans_agree():
    """One chunk per block, or one block for the whole sequence, or two spans chained through the state: the same
    results, checkpoints included (inside a block, on a block's edge, at the end)."""
    inp = make_inputs([203], heads=2, seed=8)
    offsets = (0, 32, 96, 192)
    whole = span_run(inp, [(0, 203)], 10 ** 9, offsets)
    for spans, pairs in (([(0, 203)], 1), ([(0, 96), (96, 203)], 64)):
        other = span_run(inp, spans, pairs, offsets)
        torch.testing.assert_close(other[0], whole[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(other[1], whole[1], rtol=1e-6, atol=1e-6)
        for o in offsets:
            torch.testing.assert_close(other[2][o], whole[2][o], rtol=1e-6, atol=1e-6)
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate_args(inp),
                                 initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert rel_err(whole[0], ref_o[0]) < 2e-6 and rel_err(whole[1].transpose(-1, -2), ref_s[0]) < 2e-6
    assert torch.equal(whole[2][0], inp["initial_state"][0])
    for o in offsets[1:]:
        _, prefix_s = kda_reference(*(inp[x][:, :o] for x in ("q", "k", "v", "g", "beta")), **gate_args(inp),
                                    initial_state=inp["initial_state"])
        assert rel_err(whole[2][o], prefix_s[0]) < 2e-6


def test_cpu_paths_leave_their_inputs_alone():
    """fp32 inputs are used as they are by the conversions; nothing may write to them."""
    inp = make_inputs([40, 3], gate="precomputed", seed=9)
    inp.update({x: inp[x].float() for x in ("q", "k", "v", "beta")})
    before = {x: inp[x].clone() for x in ("q", "k", "v", "g", "beta", "initial_state")}
    kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["initial_state"],
                cu_seqlens=inp["cu_seqlens"])
    step = {x: inp[x][:, :2].reshape(2, 1, *inp[x].shape[2:]) for x in ("q", "k", "v", "g", "beta")}
    pool = inp["initial_state"].clone()
    kda_decode_reference(step["q"], step["k"], step["v"], step["g"], step["beta"], pool, torch.tensor([0, 1]))
    assert all(torch.equal(inp[x], before[x]) for x in before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_reference_matches_the_token_loop(dtype):
    """Several tokens of several sequences: per-token slots take the state after each token, the outputs are the
    token loop's; with one slot per sequence the slot ends with the final state."""
    seqs, tokens, heads = 3, 4, 2
    inp = make_inputs([tokens] * seqs, heads=heads, varlen=False, seed=10)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    ref_o, ref_s = kda_reference(*args, **gate_args(inp), initial_state=inp["initial_state"])
    bound = 2e-6 if dtype == torch.float32 else 1e-12
    slots = 1 + torch.arange(seqs * tokens).reshape(seqs, tokens)
    pool = torch.zeros(1 + seqs * tokens, heads, 64, 64, dtype=torch.float64)
    pool[slots[:, 0]] = inp["initial_state"].double()
    o = kda_decode_reference(*args, pool, slots, **gate_args(inp), dtype=dtype)
    assert o.dtype == dtype and rel_err(o, ref_o) < bound
    for t in range(tokens):
        _, prefix_s = kda_reference(*(x[:, :t + 1] for x in args), **gate_args(inp), initial_state=inp["initial_state"])
        assert rel_err(pool[slots[:, t]], prefix_s) < bound
    pool = torch.zeros(5, heads, 64, 64, dtype=torch.float64)
    rows = torch.tensor([4, 0, 2])
    pool[rows] = inp["initial_state"].double()
    o = kda_decode_reference(*args, pool, rows.int(), **gate_args(inp), dtype=dtype)
    assert rel_err(o, ref_o) < bound and rel_err(pool[rows], ref_s) < bound


def test_cpu_path_is_fast_enough():
    """Issue 2: T = 4096, H = 4 in seconds on two cores."""
    inp = make_inputs([4096], heads=4, key_dim=128)
    start = time.perf_counter()
    kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **gate_args(inp),
                initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert time.perf_counter() - start < 10.0


@pytest.mark.parametrize("case", [
    dict(lengths=[0, 1, 31, 32, 33, 63, 64, 65, 197], gate="weak"),
    dict(lengths=[200, 200], varlen=False, gate="weak", state_dtype=torch.bfloat16),
    dict(lengths=[150, 9], gate="lower_bound", key_dim=64, value_dim=128),
    dict(lengths=[130], gate="weak", key_dim=128, value_dim=64, with_initial=False),
])
def test_segmented_cpu_path_matches_the_serial_one(case):
    """The sequence-parallel form on the CPU (segments of 64 tokens): the serial chunked path's results to fp32
    rounding, and float64's; checkpoints at 0, inside a segment, at a segment boundary and at the end."""
    inp = make_inputs(seed=17, **case)
    n = len(case["lengths"])
    heads, key_dim, value_dim = inp["q"].shape[2], inp["q"].shape[3], inp["v"].shape[3]
    kw = dict(**gate_args(inp), initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    offsets = torch.tensor([[96, 128]] * (n - 1) + [[0, 192]], dtype=torch.int32)
    states = {s: torch.full((n, 2, heads, value_dim, key_dim), float("nan")) for s in (0, 64)}
    results = {s: kda_chunked(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw, checkpoint_offsets=offsets,
                              checkpoint_states=states[s], segment_tokens=s) for s in (0, 64)}
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)
    (o, s), (serial_o, serial_s) = results[64], results[0]
    assert rel_err(o, serial_o) < 2e-6 and rel_err(s, serial_s) < 2e-6
    assert rel_err(o, ref_o) < 2e-6 and rel_err(s, ref_s) < 2e-6
    torch.testing.assert_close(states[64], states[0], rtol=1e-5, atol=1e-5, equal_nan=True)
    lengths = case["lengths"] if case.get("varlen", True) else [case["lengths"][0]] * n
    for m, length in enumerate(lengths):
        for j, offset in enumerate(offsets[m].tolist()):
            assert torch.isnan(states[64][m, j]).all() == (offset > length)


def test_segmented_cpu_path_through_the_api():
    import fastkda

    inp = make_inputs([300, 0, 70], gate="weak", seed=18)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    out, final = fastkda.kda_prefill(*args, initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"],
                                     output_final_state=True, sequence_parallel=64)
    expected_o, expected_s = kda_chunked(*args, initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"],
                                         segment_tokens=64)
    assert torch.equal(out, expected_o.to(out.dtype)) and torch.equal(final, expected_s)
    serial_o, _ = fastkda.kda_prefill(*args, initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"],
                                      sequence_parallel=False)
    assert rel_err(out, serial_o.float()) < 1e-2  # bf16 outputs of two fp32 paths


@pytest.mark.parametrize("function", [kda_reference, kda_chunked])
@pytest.mark.parametrize("change, message", [
    (dict(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens must be nondecreasing from 0 to T=8"),  # was: 3 tokens run
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens must be a 1-D int32/int64 tensor"),  # a TypeError
    (dict(beta=torch.randn(1, 8)), r"beta must be \[1, 8, 2\]"),  # broadcast over the heads by the reference
    (dict(k=torch.randn(1, 8, 2, 32)), "k must be of q's shape"),  # an einsum's RuntimeError
    (dict(initial_state=torch.zeros(2, 2, 64, 64)), r"initial_state must be \[N, H, V, K\]"),
    (dict(lower_bound=-5.0, A_log=torch.zeros(3), dt_bias=torch.zeros(2, 64)), "A_log must be a tensor of 2")])
def test_the_pytorch_paths_name_an_argument_of_the_wrong_shape(function, change, message):
    """The PyTorch paths take any float dtype and any K and V, but not shapes that broadcast into a wrong result
    or fail deep inside: the argument is named, as the kernels' validation names it."""
    inputs = dict(q=torch.randn(1, 8, 2, 64), k=torch.randn(1, 8, 2, 64), v=torch.randn(1, 8, 2, 64),
                  g=-torch.rand(1, 8, 2, 64), beta=torch.randn(1, 8, 2))
    inputs.update(change)
    operands = [inputs.pop(x) for x in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=message):
        function(*operands, **inputs)

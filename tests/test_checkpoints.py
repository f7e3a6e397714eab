"""Prefix-cache checkpoints in prefill: the state after an offset equals the final state of a prefill of that
prefix (bitwise for the Triton kernels, run on the interpreter without a GPU; the CPU path to fp32 rounding)."""

import pytest
import torch

import fastkda
import interpreter
from helpers import make_inputs, plan_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# "-sp": segments of 64 tokens (sequence parallelism), the prefix runs with the same segments
BACKENDS = ["api", "api-sp"] + (["triton", "triton-sp"] if interpreter.active() else [])


def prefill(backend, inp, final, checkpoint_offsets=None, checkpoint_states=None):
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    out = torch.full_like(inp["v"], float("nan"))
    segments = 64 if backend.endswith("-sp") else False
    if backend.startswith("api"):
        fastkda.kda_prefill(*args, **gate, initial_state=inp["initial_state"], final_state=final,
                            cu_seqlens=inp["cu_seqlens"], out=out, checkpoint_offsets=checkpoint_offsets,
                            checkpoint_states=checkpoint_states, sequence_parallel=segments)
    else:
        from fastkda.ops.prefill import chunk_kda_forward

        chunk_kda_forward(*args, plan=plan_for(inp, 2, sequence_parallel=segments), **gate,
                          scale=inp["q"].shape[-1] ** -0.5,
                          initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True,
                          use_beta_sigmoid=True, out=out, final_state=final, checkpoint_offsets=checkpoint_offsets,
                          checkpoint_states=checkpoint_states)
    return out


def prefix_of(inp, lengths, n, prefix, varlen):
    """Sequence n's first ``prefix`` tokens as a one-sequence input of the same layout."""
    cut = dict(inp)
    start = sum(lengths[:n]) if varlen else 0
    row = 0 if varlen else n
    for x in ("q", "k", "v", "g", "beta"):
        cut[x] = inp[x][row:row + 1, start:start + prefix].contiguous()
    cut["initial_state"] = inp["initial_state"][n:n + 1]
    if varlen:
        cut["cu_seqlens"] = torch.tensor([0, prefix], dtype=inp["cu_seqlens"].dtype, device=inp["q"].device)
    return cut


CASES = [
    dict(lengths=[200, 0, 130, 64], varlen=True, cu_dtype=torch.int32,
         offsets=[[128, 96], [0, 32], [64, 160], [32, 0]]),
    dict(lengths=[150, 150], varlen=False, cu_dtype=torch.int64, offsets=[[64, 128], [128, 64]]),
    dict(lengths=[70, 190], varlen=True, cu_dtype=torch.int64, offsets=[64, 128]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_checkpoints_equal_prefix_runs(backend, case):
    lengths, varlen = case["lengths"], case["varlen"]
    inp = make_inputs(lengths, heads=2, varlen=varlen, cu_dtype=case["cu_dtype"], seed=31, device=DEVICE)
    offsets = torch.tensor(case["offsets"], dtype=case["cu_dtype"], device=DEVICE)
    states = torch.full((len(lengths), 2, 2, 64, 64), float("nan"), device=DEVICE)
    final = torch.empty(len(lengths), 2, 64, 64, device=DEVICE)
    prefill(backend, inp, final, offsets, states)
    per_seq = offsets.reshape(len(lengths), -1).tolist()
    for n, seq_offsets in enumerate(per_seq):
        for j, offset in enumerate(seq_offsets):
            if offset > lengths[n]:
                continue
            prefix_final = torch.empty_like(final[:1])
            prefill(backend, prefix_of(inp, lengths, n, offset, varlen), prefix_final)
            if backend.startswith("triton") or DEVICE == "cuda":
                assert torch.equal(states[n, j], prefix_final[0]), (n, j)
            else:
                torch.testing.assert_close(states[n, j], prefix_final[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_beyond_the_sequence_are_ignored(backend):
    inp = make_inputs([100, 64], heads=2, seed=32, device=DEVICE)
    states = torch.full((2, 2, 2, 64, 64), float("nan"), device=DEVICE)
    prefill(backend, inp, None, torch.tensor([[128, 192], [128, 64]], dtype=torch.int32, device=DEVICE), states)
    assert torch.isnan(states[0]).all() and torch.isnan(states[1, 0]).all()
    assert torch.isfinite(states[1, 1]).all()


@pytest.mark.parametrize("varlen", [True, False], ids=["no sequence", "no row"])
def test_checkpoints_of_an_empty_batch(varlen):
    """An engine passes its checkpoint buffers every step, also a step with no sequence (``cu_seqlens = [0]``) or
    no row (B = 0): the call does nothing and returns empty outputs."""
    heads, dim = 2, 64
    x = torch.randn(1 if varlen else 0, 0 if varlen else 8, heads, dim)
    beta = torch.randn(*x.shape[:3])
    states = torch.full((0, 2, heads, dim, dim), float("nan"))
    o, final = fastkda.kda_prefill(x, x, x, -x.abs(), beta, checkpoint_offsets=torch.zeros(0, 2, dtype=torch.int32),
                                   checkpoint_states=states, output_final_state=True,
                                   cu_seqlens=torch.zeros(1, dtype=torch.int32) if varlen else None)
    assert o.shape == x.shape and final.shape == (0, heads, dim, dim)


def test_bad_checkpoint_arguments():
    inp = make_inputs([128], heads=2, seed=33)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"])
    states = torch.zeros(1, 2, 2, 64, 64)
    with pytest.raises(ValueError, match="multiples of the chunk"):
        fastkda.kda_prefill(*args, **kw, checkpoint_offsets=torch.tensor([[48, 64]], dtype=torch.int32),
                            checkpoint_states=states)
    with pytest.raises(ValueError, match="checkpoint_offsets"):
        fastkda.kda_prefill(*args, **kw, checkpoint_offsets=torch.tensor([[64, 64]]), checkpoint_states=states)
    with pytest.raises(ValueError, match="checkpoint_states"):
        fastkda.kda_prefill(*args, **kw, checkpoint_offsets=torch.tensor([64], dtype=torch.int32),
                            checkpoint_states=states.bfloat16())
    for run in (fastkda.kda_prefill, fastkda.kda_chunked):  # the CPU path's own function too
        with pytest.raises(ValueError, match="given together"):
            run(*args, **kw, checkpoint_offsets=torch.tensor([64], dtype=torch.int32))


def test_checkpoints_under_torch_compile():
    inp = make_inputs([130, 64], heads=2, seed=34)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    offsets = torch.tensor([[64, 128], [0, 64]], dtype=torch.int32)
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], checkpoint_offsets=offsets)

    def run(states):
        return fastkda.kda_prefill(*args, **kw, checkpoint_states=states)[0]

    eager_states, compiled_states = torch.zeros(2, 2, 2, 64, 64), torch.zeros(2, 2, 2, 64, 64)
    eager = run(eager_states)
    compiled = torch.compile(run, fullgraph=True)(compiled_states)
    assert torch.equal(compiled, eager) and torch.equal(compiled_states, eager_states)
    assert torch.equal(eager_states[1, 0], inp["initial_state"][1])  # offset 0: the initial state

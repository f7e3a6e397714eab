"""FLA's KDA entry points on fastkda (:mod:`fastkda.compat.fla`, fla-core 0.6.0 semantics) against the float64
token-by-token reference, on the CPU path."""

import warnings

import numpy as np
import pytest
import torch

from fastkda.compat import fla
from fastkda.reference import kda_reference
from helpers import make_inputs, rel_err

OUT_ERR, STATE_ERR = 4e-3, 1e-5  # bf16 outputs; fp32 states (as in tests/test_api.py)
H_ERR = 1e-2  # intermediate states are stored in k's dtype (bf16)


def kv(state):
    """A V-first state ``[..., V, K]`` in FLA's default K-first layout, or back."""
    return state.transpose(-1, -2).contiguous()


def lower_bound_gate(inp):
    """FLA's arguments for ``inp``'s lower-bound gate (raw g, beta logits, q/k normalised in the kernel)."""
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=inp["lower_bound"], A_log=inp["A_log"], dt_bias=inp["dt_bias"].reshape(-1))


def truth(inp, **overrides):
    """``kda_reference`` (float64) of ``inp`` with ``overrides``; returns ``(o, final_state [N, H, V, K])``."""
    args = {x: overrides.pop(x, inp[x]) for x in ("q", "k", "v", "g", "beta")}
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    kw.update(overrides)
    return kda_reference(*args.values(), **kw)


def test_lower_bound_is_ignored_without_gate_in_kernel():
    """FLA reads lower_bound only to fuse the gate (fla/ops/kda/chunk_fwd.py); g is the log-decay otherwise."""
    inp = make_inputs([50, 70], gate="precomputed", seed=41)
    ref_o, ref_s = truth(inp)
    o, s = fla.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], torch.sigmoid(inp["beta"].float()),
                         initial_state=kv(inp["initial_state"]), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                         cu_seqlens=inp["cu_seqlens"], A_log=torch.rand(2), dt_bias=torch.rand(2 * 64))
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(kv(s), ref_s) < STATE_ERR


@pytest.mark.parametrize("bound", [-8.0, np.float32(-8.0)], ids=["float", "numpy"])
def test_lower_bound_below_the_fused_range(bound):
    """FLA fuses any λ < 0 without ``safe_gate`` (fastkda's fused gate takes [-5, 0): below, the gate is computed
    here, also for a NumPy scalar); with ``safe_gate`` it requires [-5, 0)."""
    inp = make_inputs([45, 80], seed=51)
    ref_o, ref_s = truth(inp, lower_bound=-8.0)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(lower_bound_gate(inp), lower_bound=bound, initial_state=kv(inp["initial_state"]),
              output_final_state=True, cu_seqlens=inp["cu_seqlens"])
    o, s = fla.chunk_kda(*args, **kw)
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(kv(s), ref_s) < STATE_ERR
    with pytest.raises(ValueError, match="lower_bound"):
        fla.chunk_kda(*args, **kw, safe_gate=True)


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
def test_transpose_state_layout_is_state_v_first(entry):
    inp = make_inputs([40, 25], seed=42)
    ref_o, ref_s = truth(inp)
    call = getattr(fla, entry)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(lower_bound_gate(inp), initial_state=inp["initial_state"], output_final_state=True,
              cu_seqlens=inp["cu_seqlens"])
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o, s = call(*args, **kw, transpose_state_layout=True)
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(s, ref_s) < STATE_ERR  # V-first in and out
    with pytest.raises(ValueError, match="transpose_state_layout"):
        call(*args, **kw, state_v_first=True, transpose_state_layout=True)


def test_chunk_size_32_or_64_only():
    inp = make_inputs([100], seed=43)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(lower_bound_gate(inp), initial_state=kv(inp["initial_state"]), output_final_state=True,
              cu_seqlens=inp["cu_seqlens"])
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        fla.chunk_kda(*args, **kw, chunk_size=16)
    o, s = fla.chunk_kda(*args, **kw, chunk_size=32)  # chunking does not change the math
    o64, s64 = fla.chunk_kda(*args, **kw)
    assert torch.equal(o, o64) and torch.equal(s, s64)


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
def test_gate_in_kernel_refuses_a_missing_g(entry):
    """``use_gate_in_kernel`` forms the gate from g: g=None is a ``ValueError`` naming g (not an AttributeError
    from reading its shape)."""
    inp = make_inputs([5, 3], seed=54)
    with pytest.raises(ValueError, match="g must be a 4-D tensor"):
        getattr(fla, entry)(inp["q"], inp["k"], inp["v"], None, inp["beta"], **lower_bound_gate(inp),
                            cu_seqlens=inp["cu_seqlens"])


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
def test_grouped_value_heads(entry):
    """HV = 4 value heads on H = 2 q/k heads: value head i reads q/k head i // (HV // H) (FLA's ``i_h``)."""
    inp = make_inputs([30, 90], heads=4, seed=44)
    q, k = inp["q"][:, :, ::2].contiguous(), inp["k"][:, :, 1::2].contiguous()  # H = 2
    owner = torch.arange(4) // 2
    ref_o, ref_s = truth(inp, q=q[:, :, owner], k=k[:, :, owner])
    o, s = getattr(fla, entry)(q, k, inp["v"], inp["g"], inp["beta"], **lower_bound_gate(inp),
                               initial_state=kv(inp["initial_state"]), output_final_state=True,
                               cu_seqlens=inp["cu_seqlens"])
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(kv(s), ref_s) < STATE_ERR
    with pytest.raises(ValueError, match="v must be of a head count"):
        fla.chunk_kda(inp["q"][:, :, :3].contiguous(), inp["k"][:, :, :3].contiguous(), inp["v"], inp["g"],
                      inp["beta"], **lower_bound_gate(inp), cu_seqlens=inp["cu_seqlens"])


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
def test_allow_neg_eigval_doubles_beta(entry):
    inp = make_inputs([60, 20], seed=45)
    ref_o, ref_s = truth(inp, beta=2 * torch.sigmoid(inp["beta"].double()), use_beta_sigmoid=False)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(lower_bound_gate(inp), initial_state=kv(inp["initial_state"]), output_final_state=True,
              cu_seqlens=inp["cu_seqlens"])
    o, s = getattr(fla, entry)(*args, **kw, allow_neg_eigval=True)
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(kv(s), ref_s) < STATE_ERR
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        getattr(fla, entry)(*args, **dict(kw, use_beta_sigmoid_in_kernel=False), allow_neg_eigval=True)


def chunk_states_truth(inp, lengths, chunk, varlen):
    """Float64 states at the start of every ``chunk`` tokens of each sequence (FLA's ``h`` rows, V-first), chained
    through ``kda_reference`` chunk by chunk."""
    rows = []
    for n, length in enumerate(lengths):
        start, b = (sum(lengths[:n]), 0) if varlen else (0, n)
        state = inp["initial_state"][n:n + 1].double()
        for t in range(0, length, chunk):
            rows.append(state[0])
            piece = {x: inp[x][b:b + 1, start + t:start + min(t + chunk, length)] for x in ("q", "k", "v", "g", "beta")}
            _, state = truth(inp, **piece, initial_state=state, cu_seqlens=None)
    return torch.stack(rows)


@pytest.mark.parametrize("lengths,varlen,chunk,state_v_first", [
    ([0, 70, 200, 64, 130], True, 64, False),
    ([100, 100], False, 32, True),
])
def test_return_intermediate_states(lengths, varlen, chunk, state_v_first):
    inp = make_inputs(lengths, varlen=varlen, seed=46)
    ref_o, ref_s = truth(inp)
    ref_h = chunk_states_truth(inp, lengths, chunk, varlen)
    layout = (lambda x: x) if state_v_first else kv
    o, s, h = fla.chunk_kda(*(inp[x] for x in ("q", "k", "v", "g", "beta")), **lower_bound_gate(inp),
                            initial_state=layout(inp["initial_state"]), output_final_state=True,
                            return_intermediate_states=True, state_v_first=state_v_first,
                            cu_seqlens=inp["cu_seqlens"], chunk_size=chunk)
    rows = sum(-(-n // chunk) for n in lengths)
    assert h.shape == ((1, rows) if varlen else (len(lengths), rows // len(lengths))) + (2, 64, 64)
    assert h.dtype == inp["k"].dtype
    assert rel_err(layout(h.reshape(rows, 2, 64, 64).float()), ref_h) < H_ERR
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(layout(s), ref_s) < STATE_ERR
    _, none, _ = fla.chunk_kda(*(inp[x] for x in ("q", "k", "v", "g", "beta")), **lower_bound_gate(inp),
                               return_intermediate_states=True, cu_seqlens=inp["cu_seqlens"])
    assert none is None


def test_fused_recurrent_softplus_gate_and_refused_pool_arguments():
    """``use_gate_in_kernel`` without ``lower_bound``: Kimi-Linear's ``-exp(A_log)·softplus(g + dt_bias)``."""
    inp = make_inputs([3, 0, 5], seed=47)
    a = -inp["A_log"].double().exp()[:, None] * torch.nn.functional.softplus(inp["g"].double() + inp["dt_bias"])
    ref_o, ref_s = truth(inp, g=a, A_log=None, dt_bias=None, lower_bound=None)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"].reshape(-1), initial_state=kv(inp["initial_state"]),
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, cu_seqlens=inp["cu_seqlens"])
    o, s = fla.fused_recurrent_kda(*args, **kw)
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(kv(s), ref_s) < STATE_ERR
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fla.fused_recurrent_kda(*args, **kw, ssm_state_indices=torch.arange(3, dtype=torch.int32))


def pool_inputs(num_seqs, tokens, seed, pool_size=8):
    """``num_seqs`` sequences of ``tokens`` each (varlen layout), a V-first pool of ``pool_size`` random states."""
    inp = make_inputs([tokens] * num_seqs, seed=seed, with_initial=False)
    pool = torch.randn(pool_size, 2, 64, 64, generator=torch.Generator().manual_seed(seed))
    return inp, pool


@pytest.mark.parametrize("state_v_first", [False, True])
def test_fused_recurrent_fwd_decodes_over_a_pool(state_v_first):
    """vLLM's decode: one token per sequence, a slot each, a zero-length tail sequence (graph padding) that reads
    and writes nothing; the other slots are untouched."""
    inp, pool = pool_inputs(3, 1, seed=48)
    cu = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    slots = torch.tensor([5, 0, 2, 7], dtype=torch.int32)
    ref_o, ref_s = truth(inp, initial_state=pool[slots[:3].long()])
    layout = (lambda x: x) if state_v_first else kv
    states = layout(pool)
    o, returned = fla.fused_recurrent_kda_fwd(*(inp[x] for x in ("q", "k", "v", "g", "beta")),
                                              **lower_bound_gate(inp), initial_state=states, cu_seqlens=cu,
                                              ssm_state_indices=slots, state_v_first=state_v_first)
    assert returned is states and rel_err(o, ref_o) < OUT_ERR
    after = layout(states)
    assert rel_err(after[slots[:3].long()], ref_s) < STATE_ERR
    untouched = [1, 3, 4, 6, 7]
    assert torch.equal(after[untouched], pool[untouched])


def test_fused_recurrent_fwd_pool_pads_tokens_past_the_last_sequence_and_casts_into_out():
    """CUDA-graph padding: token rows past ``cu_seqlens[-1]`` belong to no sequence and come back zero, on the CPU
    as on the GPU (FLA's output starts as zeros); an ``out`` of another dtype than v's takes the output cast, as
    FLA's kernel stores it, and the pool moves once."""
    inp, pool = pool_inputs(4, 1, seed=54)
    slots = torch.tensor([5, 0, 2], dtype=torch.int32)
    short = torch.tensor([0, 1, 2, 3], dtype=torch.int32)  # the fourth token row is padding
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    want = fla.fused_recurrent_kda_fwd(*(x[:, :3] for x in args), **lower_bound_gate(inp), initial_state=pool.clone(),
                                       cu_seqlens=short, ssm_state_indices=slots, state_v_first=True)
    states, out = pool.clone(), torch.full(inp["v"].shape, 7.0)
    o, _ = fla.fused_recurrent_kda_fwd(*args, **lower_bound_gate(inp), initial_state=states, cu_seqlens=short,
                                       ssm_state_indices=slots, state_v_first=True, out=out)
    assert o is out and torch.equal(out[:, :3], want[0].float()) and bool((out[:, 3] == 0).all())
    assert torch.equal(states, want[1])


@pytest.mark.parametrize("slots, what", [([5, 9, 2, 7], "slots"), ([5, 0, 2], "ssm_state_indices")])
def test_fused_recurrent_fwd_refused_pool_call_leaves_out_and_pool_alone(slots, what):
    """A slot past the pool, or a row count that is not the sequences', is refused before ``out`` or the pool is
    written."""
    inp, pool = pool_inputs(3, 1, seed=52)
    cu = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    states = pool.clone()
    out = torch.full_like(inp["v"], 5.0)
    with pytest.raises(ValueError, match=what):
        fla.fused_recurrent_kda_fwd(*(inp[x] for x in ("q", "k", "v", "g", "beta")), **lower_bound_gate(inp),
                                    initial_state=states, cu_seqlens=cu, out=out, state_v_first=True,
                                    ssm_state_indices=torch.tensor(slots, dtype=torch.int32))
    assert bool((out == 5.0).all()) and torch.equal(states, pool)


POOL_CU = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)  # three one-token sequences and an empty one
POOL_SLOTS = torch.tensor([5, 0, 2, 7], dtype=torch.int32)


@pytest.mark.parametrize("cu, slots, what", [
    (torch.tensor([0.0, 1.5, 2.0, 3.0, 3.0]), POOL_SLOTS, "cu_seqlens must be of dtype"),  # not truncated
    (POOL_CU[None], POOL_SLOTS, "cu_seqlens must be a 1-D tensor"),
    (POOL_CU, torch.tensor(5, dtype=torch.int32), "ssm_state_indices must be a tensor"),
    (POOL_CU, POOL_SLOTS.view(4, 1, 1), "ssm_state_indices must be a tensor"),
    (POOL_CU, POOL_SLOTS.float(), "ssm_state_indices must be of dtype"),
    (POOL_CU[:0], POOL_SLOTS, "at least two entries"), (POOL_CU[:1], POOL_SLOTS, "at least two entries")],
    ids=["float cu_seqlens", "2-D cu_seqlens", "0-d indices", "3-D indices", "float indices", "empty cu_seqlens",
         "one offset"])
def test_fused_recurrent_fwd_refuses_malformed_offsets_and_indices(cu, slots, what):
    """The pool form takes ``cu_seqlens`` only as 1-D int32/int64 offsets (as without ``ssm_state_indices``) and
    ``ssm_state_indices`` only as the ``[N]`` or ``[N, S]`` integer slots its docstring gives: anything else is a
    ``ValueError`` naming it, before ``out`` or the pool is written."""
    inp, pool = pool_inputs(3, 1, seed=53)
    states = pool.clone()
    out = torch.full_like(inp["v"], 5.0)
    with pytest.raises(ValueError, match=what):
        fla.fused_recurrent_kda_fwd(*(inp[x] for x in ("q", "k", "v", "g", "beta")), **lower_bound_gate(inp),
                                    initial_state=states, cu_seqlens=cu, out=out, state_v_first=True,
                                    ssm_state_indices=slots)
    assert bool((out == 5.0).all()) and torch.equal(states, pool)


def test_fused_recurrent_fwd_speculative_decoding():
    """[N, S] slots: the state after token t goes to slot [n, t]; the initial state is read from slot
    [n, num_accepted_tokens[n] - 1]."""
    inp, pool = pool_inputs(2, 3, seed=49)
    slots = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    read = slots[torch.arange(2), accepted.long() - 1].long()
    ref_o, _ = truth(inp, initial_state=pool[read])
    states = kv(pool)
    o, _ = fla.fused_recurrent_kda_fwd(*(inp[x] for x in ("q", "k", "v", "g", "beta")), **lower_bound_gate(inp),
                                       initial_state=states, cu_seqlens=inp["cu_seqlens"], ssm_state_indices=slots,
                                       num_accepted_tokens=accepted)
    assert rel_err(o, ref_o) < OUT_ERR
    for n in range(2):
        for t in range(3):
            prefix = {x: inp[x][:, 3 * n:3 * n + t + 1] for x in ("q", "k", "v", "g", "beta")}
            _, ref_s = truth(inp, **prefix, initial_state=pool[read[n]][None], cu_seqlens=None)
            assert rel_err(kv(states[slots[n, t]]), ref_s[0]) < STATE_ERR, (n, t)


def test_fused_recurrent_fwd_in_place_final_state():
    """Without indices, ``inplace_final_state`` (the default) writes each final state into ``initial_state``."""
    inp = make_inputs([7, 2], seed=50)
    ref_o, ref_s = truth(inp)
    states = kv(inp["initial_state"])
    out = torch.full_like(inp["v"], float("nan"))
    o, returned = fla.fused_recurrent_kda_fwd(*(inp[x] for x in ("q", "k", "v", "g", "beta")),
                                              **lower_bound_gate(inp), initial_state=states,
                                              cu_seqlens=inp["cu_seqlens"], out=out)
    assert o is out and returned is states
    assert rel_err(o, ref_o) < OUT_ERR and rel_err(kv(states), ref_s) < STATE_ERR


def test_cu_seqlens_cpu_gives_the_plan_its_longest_length(monkeypatch):
    """FLA's host copy of the offsets gives ``max_seqlen`` when the caller passes none (the plan then knows the
    longest sequence, and runs equal lengths as rows); a given ``max_seqlen`` is kept; the results are the call's
    with that hint."""
    import fastkda

    seen = []

    def recording(*args, **kw):
        seen.append(kw["max_seqlen"])
        return fastkda.kda_prefill(*args, **kw)
    monkeypatch.setattr(fla, "kda_prefill", recording)
    inp = make_inputs([40, 40, 40], seed=71)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    cu = inp["cu_seqlens"]
    o, _ = fla.chunk_kda(*args, **lower_bound_gate(inp), cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    fla.chunk_kda(*args, **lower_bound_gate(inp), cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), max_seqlen=50)
    fla.chunk_kda(*args, **lower_bound_gate(inp), cu_seqlens=cu)
    assert seen == [40, 50, None]
    want, _ = fastkda.kda_prefill(*args, A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                                  cu_seqlens=cu, max_seqlen=40)
    assert torch.equal(o, want)


def test_cu_seqlens_cpu_compiles():
    """Under ``torch.compile(fullgraph=True)`` the host copy's values are not read for a hint (a trace has none;
    the op plans from the offsets it runs on): the compiled call gives the eager bits."""
    from torch import _dynamo

    _dynamo.reset()
    inp = make_inputs([40, 24, 56], seed=72)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(lower_bound_gate(inp), cu_seqlens=inp["cu_seqlens"], cu_seqlens_cpu=inp["cu_seqlens"].cpu())
    compiled = torch.compile(lambda *a: fla.chunk_kda(*a, **kw)[0], backend="eager", fullgraph=True)
    assert torch.equal(compiled(*args), fla.chunk_kda(*args, **kw)[0])


@pytest.mark.parametrize("intermediate", [False, True])
@pytest.mark.parametrize("cu_float,host,what", [
    (True, None, "cu_seqlens must be of dtype"),
    (False, torch.tensor([0.0, 40.0, 80.0, 120.0]), "cu_seqlens_cpu must be of dtype"),
    (False, [0, 40, 80, 120], "cu_seqlens_cpu must be a 1-D tensor"),
    (None, torch.tensor([0, 40, 80, 120]), "cu_seqlens_cpu must be None without cu_seqlens")],
    ids=["float cu_seqlens", "float host copy", "list host copy", "host copy alone"])
def test_chunk_kda_refuses_malformed_offsets(cu_float, host, what, intermediate):
    """``cu_seqlens`` and its host copy ``cu_seqlens_cpu`` are checked as offsets before their values are read,
    with and without ``return_intermediate_states`` (whose lengths come from them): a float tensor is not
    truncated, a list is not read, a host copy without the offsets it copies is refused; each by its name."""
    inp = make_inputs([40, 40, 40], seed=72)
    cu = {True: inp["cu_seqlens"].float(), False: inp["cu_seqlens"], None: None}[cu_float]
    with pytest.raises(ValueError, match=what):
        fla.chunk_kda(*(inp[x] for x in ("q", "k", "v", "g", "beta")), **lower_bound_gate(inp), cu_seqlens=cu,
                      cu_seqlens_cpu=host, return_intermediate_states=intermediate)


def test_fused_recurrent_fwd_refuses_more_accepted_tokens_than_a_sequence_has():
    """An accepted count past a sequence's own tokens would read the state from a column no token of it owns
    (FLA reads that slot anyway; fastkda cannot also skip its write): a ``ValueError`` naming
    ``num_accepted_tokens``, before ``out`` or the pool is written, where equal counts decode."""
    inp, pool = pool_inputs(2, 3, seed=54)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)  # the second sequence has one token of the batch's six
    rows = {x: inp[x][:, :4] for x in ("q", "k", "v", "g", "beta")}
    slots = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    states, out = kv(pool), torch.full_like(rows["v"], 5.0)
    with pytest.raises(ValueError, match="num_accepted_tokens must be at most.* 2 for sequence 1 of 1 tokens"):
        fla.fused_recurrent_kda_fwd(*rows.values(), **lower_bound_gate(inp), initial_state=states, cu_seqlens=cu,
                                    ssm_state_indices=slots, num_accepted_tokens=torch.tensor([1, 2]), out=out)
    assert bool((out == 5.0).all()) and torch.equal(states, kv(pool))
    o, _ = fla.fused_recurrent_kda_fwd(*rows.values(), **lower_bound_gate(inp), initial_state=states,
                                       cu_seqlens=cu, ssm_state_indices=slots, num_accepted_tokens=torch.tensor([3, 1]))
    ref_o, _ = truth(inp, **rows, initial_state=pool[torch.tensor([2, 3])], cu_seqlens=cu)
    assert rel_err(o, ref_o) < OUT_ERR


def test_chunk_kda_warns_where_autograd_records_the_call():
    """FLA's chunk_kda trains; fastkda's carries no gradient: with grad mode on and an input requiring grad it
    warns (a training script would otherwise train everything but its KDA layers), and computes the same output;
    under no_grad, or with nothing requiring grad, it is silent."""
    inp = make_inputs([40], seed=55)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    want, _ = fla.chunk_kda(*args, **lower_bound_gate(inp))
    trained = dict(lower_bound_gate(inp), A_log=torch.nn.Parameter(inp["A_log"].clone()))
    with pytest.warns(UserWarning, match="inference-only"):
        got, _ = fla.chunk_kda(*args, **trained)
    assert torch.equal(got, want) and not got.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fla.chunk_kda(*args, **trained)
        fla.chunk_kda(*args, **lower_bound_gate(inp))

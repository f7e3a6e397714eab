"""Decode over a state pool: the CPU path (kda_decode on CPU tensors) and, without a GPU, the Triton kernel on the
interpreter, against float64. Untouched pool slots are filled with 1e30 and must stay bitwise unchanged."""

import pytest
import torch

import fastkda
import interpreter
from fastkda.reference import kda_decode_reference, kda_reference
from helpers import make_inputs, rel_err

FILL = 2.0 ** 100  # exact in bf16 and fp32
BACKENDS = ["cpu"] + (["triton"] if interpreter.active() else [])


def decode(backend, inp, pool, slots, num_accepted=None, v_slices=1):
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    if backend == "cpu":
        return fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, **gate,
                                  num_accepted_tokens=num_accepted, v_slices=v_slices)
    from fastkda.ops.decode import recurrent_kda_decode
    from fastkda.plan import choose_decode_plan

    out = torch.full_like(inp["v"], float("nan"))
    plan = choose_decode_plan(inp["q"].shape[0], inp["q"].shape[2], inp["v"].shape[3], 132, v_slices)
    recurrent_kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, plan=plan, **gate,
                         scale=inp["q"].shape[-1] ** -0.5, num_accepted_tokens=num_accepted, use_qk_l2norm=True,
                         use_beta_sigmoid=True, out=out, errors=torch.zeros(3, dtype=torch.int32))
    return out


def step_inputs(inp, t):
    """Token t of every sequence of a fixed-length input, as a 1-token decode input."""
    return {x: (inp[x][:, t:t + 1].contiguous() if x in ("q", "k", "v", "g", "beta") else inp[x]) for x in inp}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate,pool_dtype", [("lower_bound", torch.float32), ("precomputed", torch.bfloat16)])
def test_decode_after_prefill_equals_longer_prefill(backend, gate, pool_dtype):
    prefix, extra, heads = 70, 3, 2
    inp = make_inputs([prefix + extra] * 2, heads=heads, varlen=False, gate=gate, seed=21)
    head = {x: (inp[x][:, :prefix].contiguous() if x in ("q", "k", "v", "g", "beta") else inp[x]) for x in inp}
    _, state = fastkda.kda_prefill(head["q"], head["k"], head["v"], head["g"], head["beta"], A_log=inp["A_log"],
                                   dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                                   initial_state=inp["initial_state"], output_final_state=True)
    pool = torch.full((5, heads, 64, 64), FILL, dtype=pool_dtype)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    pool[slots.long()] = state.to(pool_dtype)
    outs = [decode(backend, step_inputs(inp, prefix + t), pool, slots) for t in range(extra)]
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                 dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                                 initial_state=inp["initial_state"])
    assert rel_err(torch.cat(outs, dim=1), ref_o[:, prefix:]) < 4e-3
    assert rel_err(pool[slots.long()], ref_s) < (6e-3 if pool_dtype == torch.bfloat16 else 1e-4)
    untouched = torch.ones(5, dtype=torch.bool)
    untouched[slots.long()] = False
    assert (pool[untouched] == FILL).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_decode_with_accepted_counts(backend):
    seqs, tokens, heads = 3, 4, 2
    inp = make_inputs([tokens] * seqs, heads=heads, varlen=False, seed=22)
    pool = torch.full((20, heads, 64, 64), FILL)
    slots = torch.arange(seqs * tokens, dtype=torch.int64).reshape(seqs, tokens) + 2
    accepted = torch.tensor([1, 4, 2], dtype=torch.int32)
    for n in range(seqs):  # a distinct state at every draft slot, so reading the wrong one shows
        pool[slots[n]] = torch.randn(tokens, heads, 64, 64)
    expected_pool = pool.double().clone()
    ref = kda_decode_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], expected_pool, slots,
                               A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                               num_accepted_tokens=accepted, dtype=torch.float64)
    out = decode(backend, inp, pool, slots, num_accepted=accepted)
    assert rel_err(out, ref) < 4e-3
    assert rel_err(pool, expected_pool) < 1e-5
    assert (pool[:2] == FILL).all() and (pool[2 + seqs * tokens:] == FILL).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_null_slots_give_zero_rows_and_touch_nothing(backend):
    inp = make_inputs([2] * 3, heads=2, varlen=False, seed=23)
    pool = torch.full((4, 2, 64, 64), FILL)
    pool[1] = torch.randn(2, 64, 64)
    before = pool.clone()
    slots = torch.tensor([[-1, -1], [1, -1], [-1, 2]], dtype=torch.int32)
    out = decode(backend, inp, pool, slots)
    assert (out[0] == 0).all() and (out[2] == 0).all() and out[1].abs().sum() > 0
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])  # row 2 reads -1: a padding row writes nothing
    assert not torch.equal(pool[1], before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_pool_serves_padding_rows(backend):
    """A pool of no rows is legal when every row is padding (a graph's warm-up step, an engine's idle batch):
    zero outputs, nothing gathered from the empty pool."""
    inp = make_inputs([2] * 3, heads=2, varlen=False, seed=25)
    for slots in (torch.tensor([-1, -1, -1], dtype=torch.int32), torch.full((3, 2), -1, dtype=torch.int32)):
        out = decode(backend, inp, torch.zeros(0, 2, 64, 64), slots)
        assert out.shape == inp["v"].shape and bool((out == 0).all())


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cpu"])
def test_v_slices_agree(backend):
    """The kernel's slices of V agree (the CPU path takes v_slices only as an argument to check: it has no
    slices, so it is not a case here)."""
    inp = make_inputs([3] * 2, heads=2, varlen=False, seed=24)
    results = []
    for s in (1, 2, 4):
        pool = torch.randn(3, 2, 64, 64, generator=torch.Generator().manual_seed(0))
        out = decode(backend, inp, pool, torch.tensor([2, 0]), v_slices=s)
        results.append((out, pool))
    for out, pool in results[1:]:
        assert rel_err(out, results[0][0]) < 1e-6 and rel_err(pool, results[0][1]) < 1e-6


def test_decode_rejects_bad_slots():
    inp = make_inputs([2] * 2, heads=2, varlen=False, seed=25)
    pool = torch.zeros(3, 2, 64, 64)
    with pytest.raises(ValueError, match="slots"):
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="slots must be of dtype"):  # distinct slots: only the dtype is wrong
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, torch.tensor([0.0, 1.0]),
                           A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=-5.0)
    with pytest.raises(ValueError, match="state_pool"):
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool.half(), torch.zeros(2).int())
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                           torch.zeros(2, 2, dtype=torch.int32), num_accepted_tokens=torch.ones(3, dtype=torch.int32))


def test_decode_under_torch_compile_is_one_op():
    inp = make_inputs([1] * 3, heads=2, varlen=False, seed=26)
    slots = torch.tensor([0, 2, 1], dtype=torch.int32)
    pools = [torch.randn(3, 2, 64, 64, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])

    def step(pool):
        return fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, **gate) * 2

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(pools[0]), step(pools[1]))
    assert torch.equal(pools[0], pools[1])


def test_decode_into_a_given_out_compiles():
    """``out=`` under ``torch.compile(fullgraph=True)``: its overlap check reads addresses, which a trace has not,
    so it runs eagerly only (as prefill's does); the compiled call fills ``out`` as the eager one does."""
    from torch import _dynamo

    _dynamo.reset()
    inp = make_inputs([1] * 3, heads=2, varlen=False, seed=27)
    slots = torch.tensor([0, 2, 1], dtype=torch.int32)
    pools = [torch.randn(3, 2, 64, 64, generator=torch.Generator().manual_seed(2)) for _ in range(2)]
    outs = [torch.full_like(inp["v"], float("nan")) for _ in range(2)]
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])

    def step(pool, out):
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, **gate, out=out)

    torch.compile(step, backend="eager", fullgraph=True)(pools[0], outs[0])
    step(pools[1], outs[1])
    assert outs[0].isfinite().all() and torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])


def test_cpu_path_updates_consecutive_slots_in_place(monkeypatch):
    """Slots first, first + 1, ... take the CPU path's in-place view (through kda_decode: no gather from the pool,
    no scatter back): same results as the float64 walk, other rows untouched."""
    inp = make_inputs([2] * 3, heads=2, varlen=False, seed=31)
    pool = torch.randn(5, 2, 64, 64, generator=torch.Generator().manual_seed(1))
    truth_pool = pool.double()
    slots = torch.tensor([1, 2, 3])
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])

    def refused(*_, **__):
        raise AssertionError("the pool was gathered or scattered, not viewed in place")
    with monkeypatch.context() as patched:
        for name in ("index_select", "index_copy_"):
            patched.setattr(torch.Tensor, name, refused)
        out = fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, **gate)
    want = kda_decode_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], truth_pool, slots, **gate,
                                dtype=torch.float64)
    assert rel_err(out, want) < 4e-3 and rel_err(pool[1:4], truth_pool[1:4]) < 1e-5  # o in v's bf16
    assert torch.equal(pool[[0, 4]], truth_pool[[0, 4]].float())


def test_cpu_decode_reads_transformers_views_as_they_are():
    """q, k, v as transformers hands them to a decode step: thirds of one conv output ``[N, 1, 3·H·K]``, viewed
    ``[N, 1, H, K]`` (a token stride that is not the batch stride): the CPU path reads them in place, with the
    contiguous inputs' bits, into a fresh output of v's dtype or into ``out``."""
    inp = make_inputs([1] * 3, heads=2, varlen=False, seed=33)
    mixed = torch.cat([inp[x].flatten(-2) for x in "qkv"], -1)  # [3, 1, 384]
    q, k, v = (part.view(3, 1, 2, 64) for part in mixed.split(128, -1))
    assert q.stride(1) != q.stride(0) and not q.is_contiguous()
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    pools = [torch.randn(3, 2, 64, 64, generator=torch.Generator().manual_seed(2)) for _ in range(3)]
    slots = torch.arange(3, dtype=torch.int32)
    want = fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pools[0], slots, **gate)
    got = fastkda.kda_decode(q, k, v, inp["g"], inp["beta"], pools[1], slots, **gate)
    out = torch.full_like(inp["v"], float("nan"))
    into = fastkda.kda_decode(q, k, v, inp["g"], inp["beta"], pools[2], slots, **gate, out=out)
    assert got.dtype == v.dtype and got.is_contiguous() and into is out
    assert torch.equal(got, want) and torch.equal(out, want)
    assert torch.equal(pools[1], pools[0]) and torch.equal(pools[2], pools[0])

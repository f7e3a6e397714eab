"""The serving path's contract breaks on the CPU: each raises ``ValueError`` naming the argument before anything is
written (outputs, states and pools are sentinel-filled first and must stay bitwise unchanged); checked mode; the
precomputed gate above 0. The GPU side (kernels that neutralise and count) is in tests/ops/test_safety_kernels.py
and tests/test_gpu_safety.py."""

import pytest
import torch

import fastkda
from helpers import make_inputs

SENTINEL = 2.0 ** 100  # exact in bf16 and fp32


def decode_case(seqs=3, tokens=1, pool_slots=6, per_token=False, gate="lower_bound"):
    inp = make_inputs([tokens] * seqs, heads=2, key_dim=64, varlen=False, gate=gate, seed=41)
    pool = torch.full((pool_slots, 2, 64, 64), SENTINEL)
    slots = torch.arange(seqs * tokens, dtype=torch.int32).reshape(seqs, tokens) if per_token else \
        torch.arange(seqs, dtype=torch.int32)
    return inp, pool, slots


def decode(inp, pool, slots, out, **kw):
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    return fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, **gate, out=out, **kw)


DECODE_BREAKS = [  # (what, case arguments, slots edit, keyword arguments, argument the message names)
    ("slot equal to the pool size", {}, lambda s: s.index_fill_(0, torch.tensor([1]), 6), {}, "slots"),
    ("slot of 10^6", {}, lambda s: s.index_fill_(0, torch.tensor([2]), 10 ** 6), {}, "slots"),
    ("per-token write slot past the pool", dict(tokens=2, per_token=True), lambda s: s.__setitem__((0, 1), 6),
     {}, "slots"),
    ("two sequences, one slot", {}, lambda s: s.__setitem__(2, 0), {}, "slots"),
    ("per-token slots shared", dict(tokens=2, per_token=True), lambda s: s.__setitem__((1, 1), 0), {}, "slots"),
    ("accepted count 0", dict(tokens=2, per_token=True), None,
     dict(num_accepted_tokens=torch.tensor([1, 0, 2], dtype=torch.int32)), "num_accepted_tokens"),
    ("accepted count above T", dict(tokens=2, per_token=True), None,
     dict(num_accepted_tokens=torch.tensor([3, 1, 2], dtype=torch.int32)), "num_accepted_tokens"),
]


@pytest.mark.parametrize("what, case, edit, kw, name", DECODE_BREAKS, ids=[b[0] for b in DECODE_BREAKS])
def test_decode_index_breaks_raise_before_writing(what, case, edit, kw, name):
    inp, pool, slots = decode_case(**case)
    if edit is not None:
        edit(slots)
    out = torch.full_like(inp["v"], SENTINEL)
    with pytest.raises(ValueError, match=name):
        decode(inp, pool, slots, out, **kw)
    assert (pool == SENTINEL).all() and (out == SENTINEL).all(), what


def test_negative_slots_stay_padding_rows():
    inp, pool, slots = decode_case()
    pool[:3] = torch.randn(3, 2, 64, 64)
    slots[1] = -1
    before = pool.clone()
    out = decode(inp, pool, slots, None)
    assert (out[1] == 0).all() and not torch.equal(pool[0], before[0])
    assert torch.equal(pool[[1, 3, 4, 5]], before[[1, 3, 4, 5]])  # the padding row's state lands in no row


def test_decode_without_tokens_is_refused_clearly():
    inp, pool, slots = decode_case()
    empty = {x: inp[x][:, :0] for x in ("q", "k", "v", "g", "beta")}
    with pytest.raises(ValueError, match=r"T >= 1"):
        fastkda.kda_decode(*empty.values(), pool, slots, A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                           lower_bound=inp["lower_bound"])


def prefill(inp, out, final, **kw):
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    args = dict(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"])
    args.update({x: kw.pop(x) for x in list(kw) if x in args})
    return fastkda.kda_prefill(*args.values(), **gate, initial_state=inp["initial_state"],
                               cu_seqlens=kw.pop("cu_seqlens", inp["cu_seqlens"]), out=out, final_state=final, **kw)


@pytest.mark.parametrize("what, kw, name, words", [
    ("scale inf", dict(scale=float("inf")), "scale", "positive finite"),
    ("scale NaN", dict(scale=float("nan")), "scale", "positive finite"),
    ("scale past fp32", dict(scale=1e39), "scale", "at most fp32's largest"),
    ("scale True", dict(scale=True), "scale", "positive finite"),
    ("scale on the GPU side", dict(scale=torch.tensor([0.1])), "scale", "0-d CPU tensor"),
    ("cu_seqlens [0] with tokens", dict(cu_seqlens=torch.tensor([0], dtype=torch.int32)), "cu_seqlens",
     "at least two entries"),
    ("cu_seqlens past T", dict(cu_seqlens=torch.tensor([0, 10, 31], dtype=torch.int32)), "cu_seqlens", "T=30"),
    ("cu_seqlens decreasing", dict(cu_seqlens=torch.tensor([0, 20, 10], dtype=torch.int32)), "cu_seqlens",
     "nondecreasing"),
    ("checkpoint offset not a chunk multiple", dict(checkpoint_offsets=torch.tensor([16, 0], dtype=torch.int32),
                                                    checkpoint_states=torch.zeros(2, 2, 2, 64, 64)),
     "checkpoint_offsets", "multiples"),
    ("lower_bound True", dict(lower_bound=True), "lower_bound", "a number"),
    ("checks not a bool", dict(checks="yes"), "checks", "True, False or None"),
])
def test_prefill_breaks_raise_before_writing(what, kw, name, words):
    inp = make_inputs([10, 20], seed=42)
    out = torch.full_like(inp["v"], SENTINEL)
    final = torch.full_like(inp["initial_state"], SENTINEL)
    if "lower_bound" in kw:
        inp["lower_bound"] = kw.pop("lower_bound")
    with pytest.raises(ValueError, match=name) as raised:
        prefill(inp, out, final, **kw)
    assert words in str(raised.value), str(raised.value)
    assert (out == SENTINEL).all() and (final == SENTINEL).all(), what


def test_dt_bias_of_another_order_is_refused_and_its_two_forms_agree():
    """dt_bias as [H, K], [H*K] or with sizes of 1 around them gives the same bits; [K, H], as many values in
    another order, is refused by name."""
    inp = make_inputs([10, 20], seed=43)
    heads, key_dim = inp["q"].shape[2], inp["q"].shape[3]
    bias = inp["dt_bias"].reshape(heads, key_dim)
    outputs = []
    for form in (bias, bias.reshape(-1), bias[None]):
        inp["dt_bias"] = form
        outputs.append(prefill(inp, None, None)[0])
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    inp["dt_bias"] = bias.t().contiguous()
    with pytest.raises(ValueError, match=r"dt_bias must be a contiguous tensor of 128 values \(\[H, K\] = \[2, 64\]"):
        prefill(inp, None, None)


def test_a_zero_dim_cpu_scale_is_its_number():
    inp = make_inputs([10, 20], seed=43)
    as_tensor, _ = prefill(inp, None, None, scale=torch.tensor(0.1))
    as_number, _ = prefill(inp, None, None, scale=0.1)
    assert torch.equal(as_tensor, as_number)


def test_an_empty_varlen_batch_is_a_no_op():
    inp = make_inputs([1], seed=44)
    empty = {x: inp[x][:, :0] for x in ("q", "k", "v", "g", "beta")}
    out, final = fastkda.kda_prefill(*empty.values(), A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                                     lower_bound=inp["lower_bound"], output_final_state=True,
                                     cu_seqlens=torch.tensor([0], dtype=torch.int32))
    assert out.shape == (1, 0, 2, 64) and final.shape == (0, 2, 64, 64)


@pytest.mark.parametrize("heads, tokens", [(2 ** 23, 1), (2 ** 15, 2 ** 20)])
def test_shapes_past_the_kernels_offsets_are_refused(heads, tokens):
    """Checked on shapes alone (meta tensors: nothing allocated)."""
    q = torch.empty(1, tokens, heads, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="q must be of a shape whose index ranges fit"):
        fastkda.kda_prefill(q, q, q, q, torch.empty(1, tokens, heads, dtype=torch.bfloat16, device="meta"),
                            cu_seqlens=torch.tensor([0, tokens], device="meta"))


@pytest.mark.parametrize("shift", [0, 8, -8], ids=["v itself", "out before v", "out after v"])
def test_an_out_sharing_memory_with_an_input_is_refused(shift):
    """``out`` and ``v`` views of one buffer, ``shift`` elements apart (the first element alone would not show it)."""
    inp = make_inputs([10, 20], seed=45)
    size = inp["v"].numel()
    buffer = torch.zeros(size + abs(shift), dtype=inp["v"].dtype)
    v_at, out_at = (max(shift, 0), max(-shift, 0))
    inp["v"] = buffer[v_at:v_at + size].view(inp["v"].shape)
    out = buffer[out_at:out_at + size].view(inp["v"].shape)
    with pytest.raises(ValueError, match="out must be a buffer that shares no memory with v"):
        prefill(inp, out, None)


@pytest.mark.parametrize("other", ["v", "out", "final_state"])
def test_checkpoint_states_sharing_memory_with_another_tensor_is_refused(other):
    """Checkpoint states written over an input would change it (v came back modified), over ``out`` or
    ``final_state`` they would come back as the other's values: refused by name, nothing written."""
    inp = make_inputs([64, 96], seed=48)
    num, heads, value_dim, key_dim = inp["initial_state"].shape
    states = num * 2 * heads * value_dim * key_dim
    buffer = torch.zeros(4 * states + 2 * inp["v"].numel() + 32, dtype=torch.uint8)  # bytes, viewed as each dtype
    checkpoint_states = buffer[32:32 + 4 * states].view(torch.float32).view(num, 2, heads, value_dim, key_dim)
    out, final = None, None
    if other in ("v", "out"):  # bf16, its first 32 bytes before the checkpoint states
        shared = buffer[:2 * inp["v"].numel()].view(torch.bfloat16).view(inp["v"].shape)
        if other == "v":
            inp["v"] = shared.copy_(inp["v"])
        else:
            out = shared
    else:
        final = buffer[:4 * states // 2].view(torch.float32).view(inp["initial_state"].shape)
    before = buffer.clone()
    with pytest.raises(ValueError, match=f"checkpoint_states must be a buffer that shares no memory with {other}"):
        prefill(inp, out, final, checkpoint_offsets=torch.tensor([32, 64], dtype=inp["cu_seqlens"].dtype),
                checkpoint_states=checkpoint_states)
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("shift", [1, -1], ids=["final after initial", "final before initial"])
def test_a_final_state_partly_over_the_initial_state_is_refused(shift):
    """The final state may be the initial state itself (next test), not a tensor that overlaps it elsewhere: one
    program's final rows would land on another's initial rows before they are read."""
    inp = make_inputs([10, 20], seed=46)
    state = inp["initial_state"]
    row = state[0].numel()
    buffer = torch.zeros(state.numel() + row)
    initial_at, final_at = (0, row) if shift > 0 else (row, 0)
    inp["initial_state"] = buffer[initial_at:initial_at + state.numel()].view(state.shape).copy_(state)
    final = buffer[final_at:final_at + state.numel()].view(state.shape)
    before = buffer.clone()
    with pytest.raises(ValueError, match="final_state must be a buffer that shares no memory with initial_state"):
        prefill(inp, None, final)
    assert torch.equal(buffer, before)


def test_a_decode_input_over_the_state_pool_is_refused():
    """The pool is written in place as it is read: an input viewing part of it would be read after another
    sequence's update had overwritten it."""
    inp, pool, slots = decode_case()
    pool = pool.bfloat16().normal_()
    inp["v"] = pool[5, :, :3].permute(1, 0, 2).unsqueeze(1)  # [N=3, T=1, H=2, V=64] inside the pool's last row
    before = pool.clone()
    with pytest.raises(ValueError, match="state_pool must be a buffer that shares no memory with v"):
        decode(inp, pool, slots, None)
    assert torch.equal(pool, before)


def test_final_state_may_be_the_initial_state():
    """In place: each program reads its slice of the initial state before it writes the final one."""
    inp = make_inputs([10, 20], seed=46)
    expected_o, expected_s = prefill(inp, None, None, output_final_state=True)
    state = inp["initial_state"].clone()
    inp["initial_state"] = state
    o, s = prefill(inp, None, state)
    assert s is state and torch.equal(o, expected_o) and torch.equal(s, expected_s)


def test_precomputed_gate_above_zero_counts_as_zero():
    inp = make_inputs([40], gate="precomputed", seed=47)
    positive = inp["g"].clone()
    positive[0, 5:9] = 3.0
    o, s = prefill(dict(inp, g=positive), None, None, output_final_state=True)
    o0, s0 = prefill(dict(inp, g=positive.clamp(max=0)), None, None, output_final_state=True)
    assert torch.isfinite(o).all() and torch.equal(o, o0) and torch.equal(s, s0)


def test_a_nan_in_q_stays_in_its_row_without_checks():
    inp = make_inputs([40], seed=48)
    inp["q"][0, 7, 1, 3] = float("nan")
    o, s = prefill(inp, None, None, output_final_state=True)
    assert torch.isnan(o[0, 7, 1]).all() and torch.isfinite(o[0, 8:]).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("name", ["k", "v", "g", "beta"])
def test_a_nan_in_k_v_g_or_beta_stays_in_its_sequence_from_its_chunk_on(name):
    """Without checks, a NaN in token 40's k, v, g or β reaches its own and every later output of its sequence
    (through the state); the chunks before its own and the other sequences stay finite. (The earlier tokens of its
    own chunk may take it too: the chunk's products multiply it by zeros; the README says so.)"""
    inp = make_inputs([70, 30], seed=50)
    inp[name][0, 40].view(-1)[0] = float("nan")
    o, s = prefill(inp, None, None, output_final_state=True)
    assert torch.isfinite(o[0, :32]).all() and torch.isnan(o[0, 40:70]).any(-1).any(-1).all()
    assert torch.isfinite(o[0, 70:]).all() and torch.isfinite(s[1]).all() and not torch.isfinite(s[0]).all()


@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.parametrize("what, edit, name", [
    ("NaN in k", lambda inp: inp["k"].view(-1)[3:4].fill_(float("nan")), "k"),
    ("infinite beta", lambda inp: inp["beta"].view(-1)[0:1].fill_(float("inf")), "beta"),
    ("precomputed gate above 0", lambda inp: inp["g"].view(-1)[9:10].fill_(0.5), "g"),
])
def test_checked_mode_raises_for_values(how, what, edit, name, monkeypatch):
    inp = make_inputs([10, 20], seed=49, gate="precomputed" if name == "g" else "lower_bound")
    edit(inp)
    out = torch.full_like(inp["v"], SENTINEL)
    kw = dict(checks=True) if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("FASTKDA_CHECKS", "1")
    with pytest.raises(ValueError, match=f"^fastkda: {name} must be"):
        prefill(inp, out, None, **kw)
    assert (out == SENTINEL).all()
    prefill(inp, out, None, checks=False)  # without checks the call goes through


@pytest.mark.parametrize("per_token", [False, True], ids=["[N] slots", "[N, T] slots, accepted counts"])
def test_checked_mode_refuses_a_non_finite_state_the_decode_reads(per_token):
    """A NaN in a state row that a sequence reads is refused, as the prefill refuses a non-finite initial state;
    a NaN in a row no sequence reads (unused, or a per-token write slot) is not the call's."""
    inp, pool, slots = decode_case(tokens=2 if per_token else 1, per_token=per_token)
    pool.normal_()
    accepted = dict(num_accepted_tokens=torch.tensor([2, 1, 2], dtype=torch.int32)) if per_token else {}
    pool[4, 0, 0, 0] = float("nan")  # [N] slots: a row no slot names; [N, T]: sequence 2's first write slot
    decode(inp, pool.clone(), slots, None, checks=True, **accepted)
    pool[2 if per_token else 1, 1, 3, 5] = float("nan")  # sequence 1's read slot: slots[1, 0] or slots[1]
    before, out = pool.clone(), torch.full_like(inp["v"], SENTINEL)
    with pytest.raises(ValueError, match="^fastkda: state_pool must be finite"):
        decode(inp, pool, slots, out, checks=True, **accepted)
    assert torch.equal(pool.nan_to_num(), before.nan_to_num()) and (out == SENTINEL).all()


def test_checked_mode_covers_decode():
    inp, pool, slots = decode_case(gate="precomputed")
    inp["g"].view(-1)[0] = 1.0
    out = torch.full_like(inp["v"], SENTINEL)
    with pytest.raises(ValueError, match="^fastkda: g must be at most 0"):
        decode(inp, pool, slots, out, checks=True)
    assert (pool == SENTINEL).all() and (out == SENTINEL).all()

"""The KDA layer's causal conv (spec §9 step 2): the reference against independent formulations, the Triton kernel
on the CPU interpreter against the reference (fp32: the interpreter's bf16 arithmetic is wrong, triton issue
11584), the pool's rows outside the call's live slots bitwise untouched, and the public API's validation."""

import pytest
import torch
import torch.nn.functional as F

import fastkda
from fastkda.reference import causal_conv1d_reference
from helpers import needs_interpreter

POISON = float("nan")


def offsets(lengths, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist(), dtype=dtype)


def conv_inputs(channels, width, pool_rows, seed, tokens=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(tokens, channels, generator=gen), weight=torch.randn(channels, width, generator=gen),
                bias=torch.randn(channels, generator=gen) if bias else None,
                pool=torch.randn(pool_rows, channels, width - 1, generator=gen))


def guarded_pool(pool, live_rows):
    """The pool inside a buffer with a NaN row either side, the rows outside ``live_rows`` NaN too: returns the
    buffer and the pool (a view of it)."""
    buffer = torch.full((pool.shape[0] + 2, *pool.shape[1:]), POISON, dtype=pool.dtype)
    inner = buffer[1:-1]
    inner[live_rows] = pool[live_rows]
    return buffer, inner


def same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def torch_conv(x, weight, bias, earlier, activation):
    """One sequence ``x [L, C]`` after ``earlier [C, W-1]`` inputs through ``F.conv1d`` (the earlier inputs as the
    left padding); returns the output ``[L, C]``."""
    inputs = torch.cat((earlier, x.t()), 1).unsqueeze(0)
    y = F.conv1d(inputs, weight.unsqueeze(1), bias, groups=weight.shape[0])[0].t()
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_reference_is_f_conv1d_with_the_state_as_padding(width, activation):
    lengths = [0, 1, 2, 9, 3]
    inp = conv_inputs(6, width, 7, seed=width, tokens=sum(lengths))
    x, weight, bias, pool = (inp[k].double() for k in ("x", "weight", "bias", "pool"))
    slots = torch.tensor([4, 0, 6, 2, -1])
    starts = torch.tensor([True, False, True, True, True])
    cu = offsets(lengths)
    updated = pool.clone()
    out = causal_conv1d_reference(x, weight, bias, conv_states=updated, slots=slots, has_initial_state=starts,
                                  cu_seqlens=cu, activation=activation, dtype=torch.float64)
    for n in range(len(lengths)):
        seq = x[cu[n]:cu[n + 1]]
        slot = int(slots[n])
        earlier = pool[slot] if slot >= 0 and starts[n] else torch.zeros(6, width - 1, dtype=torch.float64)
        if len(seq):  # (F.conv1d takes no empty input)
            torch.testing.assert_close(out[cu[n]:cu[n + 1]], torch_conv(seq, weight, bias, earlier, activation))
        if slot >= 0:  # the last W-1 inputs of (earlier, sequence)
            torch.testing.assert_close(updated[slot], torch.cat((earlier, seq.t()), 1)[:, -(width - 1):])
    assert torch.equal(updated[[1, 3, 5]], pool[[1, 3, 5]])
    fixed = torch.randn(3, 5, 6, dtype=torch.float64)  # [B, T, C] without a pool: zeros before each sequence
    zeros = torch.zeros(6, width - 1, dtype=torch.float64)
    torch.testing.assert_close(causal_conv1d_reference(fixed, weight, None, activation=activation, dtype=fixed.dtype),
                               torch.stack([torch_conv(s, weight, None, zeros, activation) for s in fixed]))


@pytest.mark.parametrize("width, extra", [(4, 1), (2, 3), (3, 2)])
def test_wider_states_keep_the_last_s_inputs(width, extra):
    """A pool of S = W−1 + extra columns (transformers keeps S = W): the outputs of the W−1 column pool made of
    each row's last W−1 columns, and each row's last S inputs (the old row's tail for a sequence shorter than S)
    after prefills of every length against the inputs themselves, and after one-token updates."""
    lengths = [0, 1, 2, 5, 3]
    kept = width - 1 + extra
    gen = torch.Generator().manual_seed(width * 10 + extra)
    x = torch.randn(sum(lengths), 6, generator=gen)
    weight, bias = torch.randn(6, width, generator=gen), torch.randn(6)
    wide = torch.randn(7, 6, kept, generator=gen)
    narrow = wide[..., extra:].clone()
    slots, starts, cu = torch.tensor([4, 0, 6, 2, -1]), torch.tensor([True, False, True, True, True]), offsets(lengths)
    before = wide.clone()
    out = causal_conv1d_reference(x, weight, bias, conv_states=wide, slots=slots, has_initial_state=starts,
                                  cu_seqlens=cu)
    want = causal_conv1d_reference(x, weight, bias, conv_states=narrow, slots=slots, has_initial_state=starts,
                                   cu_seqlens=cu)
    assert torch.equal(out, want) and torch.equal(wide[..., extra:], narrow)
    for n in range(4):
        earlier = before[slots[n]] if starts[n] else torch.zeros(6, kept)
        assert torch.equal(wide[slots[n]], torch.cat((earlier, x[cu[n]:cu[n + 1]].t()), 1)[:, -kept:])
    assert torch.equal(wide[[1, 3, 5]], before[[1, 3, 5]])
    step = torch.randn(2, 6, generator=gen)
    rows = wide[[4, 2]].clone()
    got = fastkda.causal_conv1d_update(step, wide, weight, bias, slots=torch.tensor([4, 2]))
    assert torch.equal(got, fastkda.causal_conv1d_update(step, narrow, weight, bias, slots=torch.tensor([4, 2])))
    assert torch.equal(wide[[4, 2]], torch.cat((rows[..., 1:], step[..., None]), -1))


def test_prefill_then_updates_equals_one_prefill():
    """Prefill of T tokens, then updates of M tokens (one at a time, then several at once) == prefill of T+M, for
    T below, at and above W-1 (the public API's CPU path)."""
    inp = conv_inputs(5, 4, 4, seed=1)
    gen = torch.Generator().manual_seed(2)
    for prefix in (0, 1, 2, 3, 7):
        x = torch.randn(prefix + 5, 5, generator=gen)
        whole_pool = inp["pool"].clone()
        whole = fastkda.causal_conv1d(x, inp["weight"], inp["bias"], conv_states=whole_pool,
                                      slots=torch.tensor([2]))
        pool = inp["pool"].clone()
        parts = [fastkda.causal_conv1d(x[:prefix], inp["weight"], inp["bias"], conv_states=pool,
                                       slots=torch.tensor([2]))]
        for t in range(prefix, prefix + 2):  # one token per step, [N, C]
            parts.append(fastkda.causal_conv1d_update(x[t:t + 1], pool, inp["weight"], inp["bias"],
                                                      slots=torch.tensor([2])))
        parts.append(fastkda.causal_conv1d_update(x[None, prefix + 2:], pool, inp["weight"], inp["bias"],
                                                  slots=torch.tensor([2]))[0])  # three at once, [N, T, C]
        torch.testing.assert_close(torch.cat(parts), whole)
        assert torch.equal(pool, whole_pool)



@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_reference_batch_is_sequence_by_sequence(pool_dtype):
    """Sequences of one length run as one batch of ops: the outputs of each sequence on its own (to rounding: the
    CPU's vector loops and their scalar tails round SiLU differently, and the batch moves that boundary) and the
    same pool rows, bit for bit, for consecutive live slots (one block of the pool: the whole pool or part of it)
    and for slots out of order, null, past the pool or without an initial state."""
    inp = conv_inputs(10, 4, 6, seed=21)
    gen = torch.Generator().manual_seed(22)
    for length in (1, 2, 5):
        x = torch.randn(4, length, 10, generator=gen)
        for slots, starts in ((torch.arange(4), None), (torch.tensor([2, 3, 4, 5]), None),
                              (torch.tensor([5, 0, -1, 9]), torch.tensor([True, False, True, True]))):
            for pool in (inp["pool"].to(pool_dtype), inp["pool"][:4].to(pool_dtype)):
                batched, alone = pool.clone(), pool.clone()
                out = causal_conv1d_reference(x, inp["weight"], inp["bias"], conv_states=batched, slots=slots,
                                              has_initial_state=starts)
                want = torch.cat([causal_conv1d_reference(
                    x[n:n + 1], inp["weight"], inp["bias"], conv_states=alone, slots=slots[n:n + 1],
                    has_initial_state=None if starts is None else starts[n:n + 1]) for n in range(4)])
                torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
                assert torch.equal(batched, alone)

def run_both(x, weight, bias, pool, slots=None, has_initial_state=None, cu_seqlens=None, activation="silu"):
    """The kernel into a NaN-poisoned output, updating ``pool`` in place, and the reference on a copy of the pool
    taken before; checks that they agree and returns the kernel's output."""
    from fastkda.ops.conv import causal_conv1d_forward

    ref_pool = pool.clone() if pool is not None else None
    out = torch.full(x.shape, POISON)
    causal_conv1d_forward(x, weight, bias, pool, slots, has_initial_state, cu_seqlens, activation == "silu", out)
    ref = causal_conv1d_reference(x, weight, bias, conv_states=ref_pool, slots=slots,
                                  has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, activation=activation)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if pool is not None:
        torch.testing.assert_close(pool, ref_pool, rtol=0, atol=0, equal_nan=True)
    return out


@needs_interpreter
@pytest.mark.parametrize("width, channels, bias, activation", [(4, 40, True, "silu"), (2, 136, False, None),
                                                               (3, 17, True, "silu")])
def test_kernel_varlen_with_null_and_out_of_range_slots(width, channels, bias, activation):
    """Empty sequences, ones shorter than W-1, one spanning several token blocks; a null slot, slots at and far
    past the pool's size, a sequence starting from zeros: rows no live slot names stay bitwise as they were (NaN,
    like the guard rows around the pool), and the zero-start sequence's NaN row is never read."""
    lengths = [0, 2, 1, 70, 0, 3, 33, 5]
    inp = conv_inputs(channels, width, 9, seed=channels, tokens=sum(lengths), bias=bias)
    slots = torch.tensor([3, 1, -1, 7, 0, 9, 2, 10**6], dtype=torch.int64)
    starts = torch.tensor([True, True, True, False, True, True, True, True])
    live = [3, 1, 7, 0, 2]
    buffer, pool = guarded_pool(inp["pool"], [3, 1, 0, 2])  # row 7 (no initial state) stays NaN
    before = buffer.clone()
    out = run_both(inp["x"], inp["weight"], inp["bias"], pool, slots, starts, offsets(lengths), activation)
    assert torch.isfinite(out).all()
    untouched = [r for r in range(buffer.shape[0]) if r - 1 not in live]
    assert same_bits(buffer[untouched], before[untouched])
    assert torch.isfinite(pool[live]).all()


@needs_interpreter
def test_kernel_fixed_length_and_decode_batches():
    """``[B, T, C]`` without a pool, with slots, with per-sequence initial flags; the decode shapes (T = 1 and a
    few tokens); an int64 cu_seqlens and one packed sequence without cu_seqlens; a batch of empty sequences."""
    inp = conv_inputs(24, 4, 6, seed=3)
    gen = torch.Generator().manual_seed(4)
    weight, bias, pool = inp["weight"], inp["bias"], inp["pool"]
    run_both(torch.randn(2, 37, 24, generator=gen), weight, bias, None)
    run_both(torch.randn(3, 6, 24, generator=gen), weight, None, pool.clone(),
             torch.tensor([5, -1, 0], dtype=torch.int32), torch.tensor([False, True, True]))
    run_both(torch.randn(4, 1, 24, generator=gen), weight, bias, pool[:4].clone())  # slots None: row n
    run_both(torch.randn(3, 3, 24, generator=gen), weight, bias, pool.clone(), torch.tensor([1, 4, 2]))
    run_both(torch.randn(40, 24, generator=gen), weight, bias, pool.clone(), torch.tensor([3]), None,
             offsets([40], torch.int64))
    run_both(torch.randn(40, 24, generator=gen), weight, bias, pool[:1].clone())
    emptied = pool.clone()
    run_both(torch.randn(2, 0, 24), weight, bias, emptied, torch.tensor([1, 4]), torch.tensor([False, True]))
    assert not emptied[1].any() and torch.equal(emptied[4], pool[4])


@needs_interpreter
def test_kernel_reads_strided_views():
    """x as one third of a ``[T, 3C]`` projection (each of the three views), x channel-major (a transposed
    ``[C, T]``), a ``[B, T, C]`` slice of a wider batch, weight transposed, a pool laid out ``[P, W-1, C]``; the
    same for a decode step of one token per sequence."""
    lengths = [5, 0, 41, 2]
    channels, width = 20, 4
    inp = conv_inputs(channels, width, 5, seed=5)
    gen = torch.Generator().manual_seed(6)
    cu = offsets(lengths)
    slots = torch.tensor([0, 3, 4, 1])
    wide = torch.randn(sum(lengths), 3 * channels, generator=gen)
    channel_major = torch.randn(channels, sum(lengths), generator=gen).t()
    pool_cl = inp["pool"].transpose(1, 2).contiguous().transpose(1, 2)  # strides (C·(W-1), 1, C)
    weight_t = inp["weight"].t().contiguous().t()
    for x in (*wide.split(channels, 1), channel_major):
        assert not x.is_contiguous()
        run_both(x, inp["weight"], inp["bias"], inp["pool"].clone(), slots, None, cu)
    run_both(wide[:, :channels], weight_t, inp["bias"], pool_cl, slots, None, cu)
    assert pool_cl.stride() == (channels * (width - 1), 1, channels)
    batch = torch.randn(3, 20, 2 * channels, generator=gen)[:2, 3:, channels:]
    run_both(batch, inp["weight"], inp["bias"], inp["pool"].clone(), torch.tensor([2, 0]))
    # a decode step's one token per sequence (its own kernel), through the same views; a null and a past-end slot
    step_slots = torch.tensor([4, -1, 1, 5, 2])
    for x in (*wide[:5].split(channels, 1), channel_major[:5]):
        for seqs in (5, 4):  # a partial block of sequences too
            run_both(x[:seqs, None], inp["weight"], inp["bias"], inp["pool"].clone(), step_slots[:seqs])
            run_both(x[:seqs, None], weight_t, None, pool_cl.clone(), step_slots[:seqs], activation=None)


@needs_interpreter
@pytest.mark.parametrize("width, kept", [(4, 4), (2, 4), (3, 8)])
def test_kernels_take_wider_states(width, kept):
    """Pools of S >= W columns (transformers keeps S = W), row- and channel-last: varlen prefill with sequences
    shorter than S, a few tokens per sequence, and the one-token step's own kernel, against the reference; rows
    no live slot names, and the guard rows, bitwise untouched."""
    channels = 20
    lengths = [0, 2, 1, 41, 3]
    gen = torch.Generator().manual_seed(width * 10 + kept)
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    rows = torch.randn(6, channels, kept, generator=gen)
    slots = torch.tensor([3, 1, -1, 5, 0])
    for layout in ("rows", "channel-last"):
        buffer, pool = guarded_pool(rows, [3, 1, 5, 0])
        if layout == "channel-last":
            buffer = buffer.transpose(1, 2).contiguous().transpose(1, 2)
            pool = buffer[1:-1]
        before = buffer.clone()
        run_both(x, weight, bias, pool, slots, torch.tensor([True, False, True, True, True]), offsets(lengths))
        run_both(torch.randn(3, 2, channels, generator=gen), weight, bias, pool, torch.tensor([5, -1, 1]))
        run_both(torch.randn(4, 1, channels, generator=gen), weight, None, pool, torch.tensor([0, 7, 3, 5]))
        untouched = [r for r in range(buffer.shape[0]) if r - 1 not in (3, 1, 5, 0)]
        assert same_bits(buffer[untouched], before[untouched]) and torch.isfinite(pool[[3, 1, 5, 0]]).all()


@needs_interpreter
@pytest.mark.parametrize("width", [2, 3, 4, 8])
def test_decode_step_spans_several_channel_blocks(width):
    """The one-token step where a row takes several programs, the last one partial (300 channels), sequences
    past a sequence block, a null slot and one past the pool: rows no live slot names, and the guard rows either
    side, bitwise untouched; a channel-last pool (``[P, W−1, C]`` memory, as vLLM keeps it) gives the same."""
    from fastkda.plan import conv_update_launch

    channels, seqs = 300, 5
    assert conv_update_launch(seqs, channels, False)[1] < channels  # several channel blocks
    inp = conv_inputs(channels, width, 6, seed=width)
    x = torch.randn(seqs, 1, channels, generator=torch.Generator().manual_seed(width + 1))
    slots = torch.tensor([4, -1, 0, 6, 2])
    buffer, pool = guarded_pool(inp["pool"], [4, 0, 2])
    before = buffer.clone()
    out = run_both(x, inp["weight"], inp["bias"], pool, slots)
    untouched = [r for r in range(buffer.shape[0]) if r - 1 not in (4, 0, 2)]
    assert same_bits(buffer[untouched], before[untouched]) and torch.isfinite(pool[[4, 0, 2]]).all()
    channel_last = before[1:-1].transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(run_both(x, inp["weight"], inp["bias"], channel_last, slots), out, rtol=0, atol=0)
    torch.testing.assert_close(channel_last, pool, rtol=0, atol=0, equal_nan=True)


def test_api_runs_the_reference_on_the_cpu():
    """bf16 x with an fp32 pool and a bf16 pool: the output is x's dtype and contiguous; the update's [N, C] and
    [N, T, C] shapes; the pool as the reference leaves it."""
    inp = conv_inputs(12, 4, 6, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(30, 2 * 12, generator=gen).bfloat16()[:, 12:]
    cu = offsets([10, 0, 20])
    slots = torch.tensor([4, 0, -1])
    for pool in (inp["pool"], inp["pool"].bfloat16()):
        mine, theirs = pool.clone(), pool.clone()
        out = fastkda.causal_conv1d(x, inp["weight"], inp["bias"], conv_states=mine, slots=slots, cu_seqlens=cu)
        ref = causal_conv1d_reference(x, inp["weight"], inp["bias"], conv_states=theirs, slots=slots, cu_seqlens=cu)
        assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == x.shape
        assert torch.equal(out, ref.bfloat16()) and torch.equal(mine, theirs)
    for shape in ((3, 12), (3, 2, 12)):
        x = torch.randn(*shape, generator=gen)
        mine, theirs = inp["pool"].clone(), inp["pool"].clone()
        out = fastkda.causal_conv1d_update(x, mine, inp["weight"], None, slots=torch.tensor([5, -2, 1]),
                                           activation=None)
        ref = causal_conv1d_reference(x.view(3, -1, 12), inp["weight"], None, conv_states=theirs,
                                      slots=torch.tensor([5, -2, 1]), activation=None)
        assert out.shape == x.shape and torch.equal(out, ref.view(x.shape)) and torch.equal(mine, theirs)


def bad_conv_calls():
    """(description, call overrides, word the message must contain); the base call is valid."""
    x, weight, pool = torch.randn(9, 6), torch.randn(6, 4), torch.randn(4, 6, 3)
    cu, slots = offsets([4, 5]), torch.tensor([0, 2])
    return dict(x=x, weight=weight, bias=None, conv_states=pool, slots=slots, has_initial_state=None,
                cu_seqlens=cu, activation="silu"), [
        ("x 1-D", dict(x=torch.randn(9)), "x"),
        ("x int", dict(x=x.int()), "x"),
        ("3-D x with cu_seqlens", dict(x=x[None]), "packed"),
        ("weight width 1", dict(weight=weight[:, :1], conv_states=pool[..., :0]), "kernel size"),
        ("weight width 9", dict(weight=torch.randn(6, 9)), "kernel size"),
        ("weight channels", dict(weight=torch.randn(5, 4)), "weight"),
        ("weight device", dict(weight=weight.to("meta")), "where x is"),
        ("bias shape", dict(bias=torch.randn(5)), "bias"),
        ("activation", dict(activation="relu"), "activation"),
        ("cu_seqlens dtype", dict(cu_seqlens=cu.float()), "cu_seqlens"),
        ("cu_seqlens one entry", dict(cu_seqlens=cu[:1]), "cu_seqlens"),
        ("cu_seqlens values", dict(cu_seqlens=torch.tensor([0, 6, 4], dtype=torch.int32)), "cu_seqlens"),
        ("pool narrower than W-1", dict(conv_states=torch.randn(4, 6, 2)), "conv_states"),
        ("pool wider than 8", dict(conv_states=torch.randn(4, 6, 9)), "conv_states"),
        ("pool dtype", dict(conv_states=pool.half()), "conv_states"),
        ("pool rows without slots", dict(slots=None), "rows"),
        ("slots float", dict(slots=slots.float()), "slots"),
        ("slots shape", dict(slots=slots[:1]), "slots"),
        ("has_initial_state dtype", dict(has_initial_state=torch.ones(2, dtype=torch.int32)), "has_initial_state"),
        ("slots without a pool", dict(conv_states=None), "slots"),
        ("a pool row named twice", dict(slots=torch.tensor([2, 2])), "distinct"),
        ("pool overlaps x", dict(x=pool.view(-1)[:54].view(9, 6), conv_states=pool), "conv_states"),
    ]


@pytest.mark.parametrize("index", range(len(bad_conv_calls()[1])))
def test_bad_conv_call_is_rejected_before_writing(index):
    base, cases = bad_conv_calls()
    name, overrides, word = cases[index]
    kw = {**base, **overrides}
    pool = kw["conv_states"]
    before = pool.clone() if pool is not None else None
    with pytest.raises(ValueError, match=word):
        fastkda.causal_conv1d(kw.pop("x"), kw.pop("weight"), kw.pop("bias"), **kw)
    if pool is not None:
        assert torch.equal(pool, before), name


@pytest.mark.parametrize("overrides, word", [
    (dict(x=torch.randn(3, 0, 6)), "T >= 1"),
    (dict(x=torch.randn(3)), "x"),
    (dict(conv_states=None), "conv_states"),
    (dict(slots=None), "slots"),
    (dict(slots=torch.tensor([0, 1])), "slots"),
    (dict(slots=torch.tensor([1, 1, 2])), "distinct"),
])
def test_bad_update_call_is_rejected(overrides, word):
    kw = dict(x=torch.randn(3, 6), conv_states=torch.randn(4, 6, 3), weight=torch.randn(6, 4),
              slots=torch.tensor([0, 1, 2]))
    kw.update(overrides)
    with pytest.raises(ValueError, match=word):
        fastkda.causal_conv1d_update(kw.pop("x"), kw.pop("conv_states"), kw.pop("weight"), **kw)


def test_torch_compile_traces_prefill_and_update_as_ops():
    """``fullgraph=True`` (the ops stay opaque nodes, with their pool mutations): the eager results and pools."""
    inp = conv_inputs(8, 4, 3, seed=9, tokens=10)
    slots, cu = torch.tensor([2, 0]), offsets([4, 6])

    def step(x, pool):
        y = fastkda.causal_conv1d(x, inp["weight"], inp["bias"], conv_states=pool, slots=slots, cu_seqlens=cu)
        return y, fastkda.causal_conv1d_update(y[:2], pool, inp["weight"], slots=slots, activation=None)

    compiled_pool, eager_pool = inp["pool"].clone(), inp["pool"].clone()
    got = torch.compile(step, fullgraph=True)(inp["x"], compiled_pool)
    expected = step(inp["x"], eager_pool)
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(compiled_pool, eager_pool)

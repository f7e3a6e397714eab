"""fastkda.layers.KimiDeltaAttention on the CPU path: against transformers' own layers on the same weights, and
its cache semantics (decode continuing a prefill, packed batches, speculative steps, checkpoints, null slots)."""

import time
import warnings

import numpy as np
import pytest
import torch

from fastkda.cache import KDACache
from fastkda.layers import KimiDeltaAttention
from helpers import CompileCounter, rel_err

HIDDEN, HEADS, DIM = 64, 2, 64


def make_layer(lower_bound=None, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(HIDDEN, HEADS, DIM, lower_bound=lower_bound, dtype=dtype)
    with torch.no_grad():
        layer.forget_gate.A_log.uniform_(-1, 1)
        layer.forget_gate.dt_bias.uniform_(-1, 1)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def cache_for(layer, slots=8, state_dtype=torch.float32):
    return KDACache(slots, 1, HEADS, DIM, layer.conv_channels, layer.conv_kernel, state_dtype=state_dtype)


def hidden(*shape, seed=1):
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


def transformers_layer(lower_bound):
    transformers = pytest.importorskip("transformers")
    if lower_bound is None:
        config = transformers.KimiLinearConfig(
            hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=DIM, linear_conv_kernel_dim=4,
            num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-5)
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention as Layer
    else:
        config = transformers.Glm5NextTextConfig(
            hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=DIM, linear_conv_kernel_dim=4,
            num_hidden_layers=1, layer_types=["linear_attention"], linear_lower_bound=lower_bound,
            num_attention_heads=2, num_key_value_heads=2)
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention as Layer
    torch.manual_seed(3)
    theirs = Layer(config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(-0.5, 0.5)
        theirs.o_norm.weight.uniform_(0.5, 1.5)
    return theirs


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_matches_transformers_layer(lower_bound):
    theirs = transformers_layer(lower_bound)
    ours = KimiDeltaAttention.from_transformers(theirs)
    x = hidden(2, 70)
    with torch.no_grad():
        want = theirs(x)
        got = ours(x)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_decode_continues_prefill(lower_bound):
    """Prefill of T tokens, then M decode steps of one token (and one step of three), equals a prefill of T + M."""
    layer = make_layer(lower_bound)
    x = hidden(2, 45)
    cache = cache_for(layer)
    slots = cache.allocate(2)
    with torch.no_grad():
        whole = layer(x)
        parts = [layer(x[:, :40], cache, slots=slots)]
        for t in range(40, 42):
            parts.append(layer(x[:, t:t + 1], cache, slots=slots, decode=True))
        parts.append(layer(x[:, 42:], cache, slots=slots, decode=True))
    assert rel_err(torch.cat(parts, 1), whole) < 1e-5


def test_packed_batch_equals_separate_calls():
    layer = make_layer(-5.0)
    lengths = [5, 0, 70, 33]
    x = hidden(sum(lengths))
    cu = torch.tensor([0, 5, 5, 75, 108], dtype=torch.int32)
    cache = cache_for(layer)
    slots = cache.allocate(4)
    with torch.no_grad():
        packed = layer(x, cache, slots=slots, cu_seqlens=cu)
        alone_cache = cache_for(layer)
        alone = []
        for n, length in enumerate(lengths):
            one = alone_cache.allocate(1)
            alone.append(layer(x[cu[n]:cu[n + 1]][None], alone_cache, slots=one)[0])
            assert torch.allclose(alone_cache.recurrent[0, one.long()], cache.recurrent[0, slots[n:n + 1].long()],
                                  rtol=1e-5, atol=1e-5)
            assert torch.allclose(alone_cache.conv[0, one.long()], cache.conv[0, slots[n:n + 1].long()])
    assert rel_err(packed, torch.cat(alone)) < 1e-5


def test_null_slots_touch_no_row():
    """A padding slot reads zeros and writes nothing: every row but the live sequence's stays bitwise as it was."""
    layer = make_layer(-5.0)
    cache = cache_for(layer, slots=4)
    cache.recurrent.normal_()
    cache.conv.normal_()
    before = cache.recurrent.clone(), cache.conv.clone()
    slots = torch.tensor([-1, 2], dtype=torch.int32)
    others = [0, 1, 3]
    with torch.no_grad():
        out = layer(hidden(2, 40), cache, slots=slots, has_initial_state=torch.tensor([True, False]))
        assert rel_err(out[:1], layer(hidden(2, 40)[:1])) < 1e-6  # the padding row ran from zeros
        step = layer(hidden(2, 1, seed=2), cache, slots=slots, decode=True)
    assert torch.isfinite(out).all()
    assert torch.equal(cache.recurrent[:, others], before[0][:, others])
    assert torch.equal(cache.conv[:, others], before[1][:, others])
    assert not torch.equal(cache.recurrent[:, 2], before[0][:, 2])
    assert torch.equal(step[0], torch.zeros_like(step[0]))  # a decode padding row gives zeros


def test_out_of_range_slot_is_refused_on_the_cpu():
    layer = make_layer()
    cache = cache_for(layer, slots=4)
    with pytest.raises(ValueError, match="slots must be below"):
        with torch.no_grad():
            layer(hidden(2, 1), cache, slots=torch.tensor([0, 7], dtype=torch.int32), decode=True)


def test_has_initial_state_false_starts_from_zeros():
    layer = make_layer()
    cache = cache_for(layer)
    slots = cache.allocate(2)
    cache.recurrent.normal_()
    cache.conv.normal_()
    x = hidden(2, 37)
    with torch.no_grad():
        got = layer(x, cache, slots=slots, has_initial_state=torch.tensor([False, False]))
        want = layer(x)
    assert rel_err(got, want) < 1e-6


def test_speculative_decode_keeps_the_accepted_state():
    """Three draft tokens whose first is accepted, then a step from there, equal plain decode of those tokens."""
    layer = make_layer(-5.0)
    x = hidden(1, 36)
    drafts = hidden(1, 3, seed=5)
    follow = hidden(1, 2, seed=6)
    with torch.no_grad():
        plain = cache_for(layer)
        slot = plain.allocate(1)
        layer(x, plain, slots=slot)
        want = [layer(drafts[:, :1], plain, slots=slot, decode=True),
                layer(follow, plain, slots=slot, decode=True)]
        spec = cache_for(layer)
        rows = spec.allocate(3)
        layer(x, spec, slots=rows[:1])
        first = layer(drafts, spec, slots=rows[None], decode=True,
                      num_accepted_tokens=torch.tensor([1], dtype=torch.int32))
        later = torch.stack([rows[0], rows[0]])[None]  # accepted 1: the state after token 0 is in rows[0]
        got = layer(follow, spec, slots=later, decode=True, num_accepted_tokens=torch.tensor([1], dtype=torch.int32))
    assert rel_err(first[:, :1], want[0]) < 1e-5
    assert rel_err(got, want[1]) < 1e-5


def test_checkpoint_restored_into_a_new_slot():
    layer = make_layer(-5.0)
    x = hidden(2, 90)
    cache = cache_for(layer)
    slots = cache.allocate(2)
    offsets = torch.tensor([64, 32], dtype=torch.int32)
    with torch.no_grad():
        whole = layer(x)
        _, (recurrent, conv) = layer(x, cache, slots=slots, checkpoint_offsets=offsets)
        for n, offset in enumerate(offsets.tolist()):
            fresh = cache.allocate(1)
            cache.restore(fresh, recurrent[n:n + 1], conv[n:n + 1])
            rest = layer(x[n:n + 1, offset:], cache, slots=fresh)
            assert rel_err(rest, whole[n:n + 1, offset:]) < 1e-5


def test_bf16_state_pool():
    layer = make_layer(-5.0)
    x = hidden(2, 50)
    cache = cache_for(layer, state_dtype=torch.bfloat16)
    slots = cache.allocate(2)
    with torch.no_grad():
        whole = layer(x)
        parts = torch.cat([layer(x[:, :48], cache, slots=slots), layer(x[:, 48:], cache, slots=slots, decode=True)],
                          1)
    assert rel_err(parts, whole) < 1e-2


def test_errors_name_the_argument():
    layer = make_layer()
    with torch.no_grad(), pytest.raises(ValueError, match="decode=True needs a cache"):
        layer(hidden(1, 1), decode=True)
    with torch.no_grad(), pytest.raises(ValueError, match="cache and slots"):
        layer(hidden(1, 4), cache_for(layer))
    with torch.no_grad(), pytest.raises(ValueError, match="cu_seqlens takes packed"):
        layer(hidden(1, 4), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.parametrize("fused", [False, True])
def test_fused_decode_option_gives_the_same_steps(fused):
    """fused_decode routes one-token steps through fastkda.kda_decode_step (on the CPU, the same three ops)."""
    layer = make_layer(-5.0)
    layer.fused_decode = fused
    x = hidden(2, 34)
    cache = cache_for(layer)
    slots = cache.allocate(2)
    with torch.no_grad():
        whole = layer(x)
        parts = [layer(x[:, :33], cache, slots=slots), layer(x[:, 33:], cache, slots=slots, decode=True)]
    assert rel_err(torch.cat(parts, 1), whole) < 1e-5


def test_scratch_slot_is_out_of_range_for_the_kernels():
    """Slot P (the pools' scratch row) is no live slot: a prefill treats it as padding, a CPU decode refuses it."""
    layer = make_layer(-5.0)
    cache = cache_for(layer, slots=4)
    cache.recurrent.normal_()
    cache.conv.normal_()
    x = hidden(1, 40)
    with torch.no_grad():
        assert rel_err(layer(x, cache, slots=torch.tensor([4], dtype=torch.int32)), layer(x)) < 1e-6
        with pytest.raises(ValueError, match="slots must be below"):
            layer(hidden(1, 1), cache, slots=torch.tensor([4], dtype=torch.int32), decode=True)


def test_release_checks_every_slot_before_freeing_any():
    layer = make_layer()
    cache = cache_for(layer, slots=4)
    cache.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        cache.release([1, 1])
    assert cache.free_slots == 2


def test_cache_refuses_what_is_not_a_slot_before_changing_anything():
    """Non-integer slots (a float would free slot 0 twice), a negative count, and a restore whose states are not
    ``[layers, ...]`` (a broadcast would put one layer's states into every layer) are refused by name."""
    cache = KDACache(2, 3, 2, 64, 384, 4)
    taken = cache.allocate(1)
    for bad in ([0.5], torch.tensor([0.0]), [True]):
        with pytest.raises(ValueError, match="slots must be integers"):
            cache.release(bad)
    assert cache.free_slots == 1
    cache.release(taken[None])  # any integer shape, e.g. speculative [N, S] slots
    assert cache.free_slots == 2
    cache.release(cache.allocate(np.int64(2)).numpy())  # numpy's integers are integers
    assert cache.free_slots == 2
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        cache.allocate(-1)
    slot = cache.allocate(1)
    before = cache.recurrent.clone(), cache.conv.clone()
    with pytest.raises(ValueError, match=r"recurrent_states must be a tensor of shape \[3, 2, 64, 64\]"):
        cache.restore(slot, torch.ones(1, 2, 64, 64), torch.ones(3, 384, 3))
    with pytest.raises(ValueError, match=r"conv_states must be a tensor of shape \[3, 384, 3\]"):
        cache.restore(slot, torch.ones(3, 2, 64, 64), torch.ones(384, 3))
    with pytest.raises(ValueError, match="slot must be an int or a one-element integer tensor"):
        cache.restore(torch.tensor([0.0]), torch.ones(3, 2, 64, 64), torch.ones(3, 384, 3))
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])
    cache.restore(slot, torch.ones(3, 2, 64, 64), torch.ones(3, 384, 3))
    assert bool((cache.recurrent[:, int(slot)] == 1).all()) and bool((cache.conv[:, int(slot)] == 1).all())


def test_cache_restores_only_into_an_allocated_slot_and_takes_plain_sizes():
    """A restore into a free slot would be zeroed by the allocate() that hands it out: refused by name, nothing
    written. A single int releases one slot; sizes that are not positive ints are refused by name."""
    cache = KDACache(4, 1, 2, 64, 384, 4)
    slot = cache.allocate(1)
    before = cache.recurrent.clone(), cache.conv.clone()
    with pytest.raises(ValueError, match="slot 3 is not allocated"):
        cache.restore(3, torch.ones(1, 2, 64, 64), torch.ones(1, 384, 3))
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])
    cache.release(int(slot))
    assert cache.free_slots == 4
    for index, bad in ((0, 2.5), (2, 0), (4, True)):
        sizes = [4, 1, 2, 64, 384, 4]
        sizes[index] = bad
        with pytest.raises(ValueError, match="must be an int >= 1"):
            KDACache(*sizes)


@pytest.mark.parametrize("mode", ["prefill", "decode", "fused decode"])
def test_checked_mode_refuses_a_nan_before_the_pools_move(mode, monkeypatch):
    """Under $FASTKDA_CHECKS a NaN in the hidden states, or in the gate's parameters, is refused before the conv
    writes its pool (the kernels' own checks see q, k and v only after the conv): both pools keep every bit."""
    monkeypatch.setenv("FASTKDA_CHECKS", "1")
    layer = make_layer(-5.0)
    layer.fused_decode = mode == "fused decode"
    cache = cache_for(layer)
    slots = cache.allocate(2)
    with torch.no_grad():
        layer(hidden(2, 40), cache, slots=slots)
        before = cache.recurrent.clone(), cache.conv.clone()
        x = hidden(2, 1 if "decode" in mode else 40, seed=3)
        x[1, -1, 0] = float("nan")
        with pytest.raises(ValueError, match="mixed must be finite"):
            layer(x, cache, slots=slots, decode="decode" in mode)
        assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])
        layer.forget_gate.dt_bias.view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match="dt_bias"):
            layer(hidden(2, 1 if "decode" in mode else 40, seed=4), cache, slots=slots, decode="decode" in mode)
        assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


@pytest.mark.parametrize("bad", [dict(max_seqlen=20), dict(checkpoint_offsets=[5, 7]),
                                 dict(checkpoint_offsets=[32.0, 0.0])], ids=["max_seqlen", "offsets", "float offsets"])
def test_a_refused_prefill_leaves_both_pools(bad):
    """kda_prefill checks max_seqlen and the checkpoint offsets only after the conv has moved its pool rows: a call
    it refuses puts them back, so a corrected retry gives what a clean call gives."""
    layer = make_layer(-5.0)
    x, cu = hidden(40), torch.tensor([0, 10, 40], dtype=torch.int32)
    if "checkpoint_offsets" in bad:
        offsets = torch.tensor(bad["checkpoint_offsets"])
        bad = dict(checkpoint_offsets=offsets if offsets.is_floating_point() else offsets.int())
    clean, cache = cache_for(layer), cache_for(layer)
    for pools in (clean, cache):
        pools.allocate(2)
        pools.conv.normal_(generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with torch.no_grad():
        want = layer(x, clean, slots=slots, cu_seqlens=cu)
        before = cache.recurrent.clone(), cache.conv.clone()
        with pytest.raises(ValueError, match="max_seqlen|cu_seqlens|checkpoint_offsets"):
            layer(x, cache, slots=slots, cu_seqlens=cu, **bad)
        assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])
        assert torch.equal(layer(x, cache, slots=slots, cu_seqlens=cu), want)


@pytest.mark.parametrize("slots, accepted, message", [
    ([0, 1], [2, 2], "slots must be per-token"),
    ([0, 1], [1, 1], "slots must be per-token"),
    ([[0, 2, 3], [1, 4, 5]], [1.0, 1.0], "num_accepted_tokens must be of dtype"),
    ([[0, 2], [1, 4]], None, "slots must be of shape"),
    ([[0, 2, 3], [1, 4, 5]], [1, 1, 1], "num_accepted_tokens must be of shape"),
    (1, None, "slots must be of shape"),
], ids=["accepted with [N] slots", "accepted 1 with [N] slots", "float accepted", "[N, T-1] slots",
        "N+1 accepted", "0-d slot"])
def test_a_refused_decode_names_the_argument_and_moves_no_pool(slots, accepted, message):
    """A decode step's slots and accepted counts are checked as kda_decode checks them before the conv indexes
    with them or moves its pool: a named ValueError (not an IndexError from inside the layer), both pools kept."""
    layer = make_layer(-5.0)
    cache = cache_for(layer)
    cache.allocate(6)
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    before = cache.recurrent.clone(), cache.conv.clone()
    accepted = None if accepted is None else torch.tensor(accepted, dtype=None if isinstance(accepted[0], float)
                                                           else torch.int32)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        layer(hidden(2, 3), cache, slots=torch.tensor(slots, dtype=torch.int32), decode=True,
              num_accepted_tokens=accepted)
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


@pytest.mark.parametrize("fused", [False, True], ids=["decode", "fused decode"])
def test_a_bad_v_slices_environment_moves_no_pool(fused, monkeypatch):
    """kda_decode reads $FASTKDA_V_SLICES after the conv has moved its pool: a decode step checks it first, so a
    typo there is a named ValueError with both pools kept."""
    monkeypatch.setenv("FASTKDA_V_SLICES", "3")
    layer = make_layer(-5.0)
    layer.fused_decode = fused
    cache = cache_for(layer)
    slots = cache.allocate(2)
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    before = cache.recurrent.clone(), cache.conv.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="FASTKDA_V_SLICES"):
        layer(hidden(2, 1), cache, slots=slots, decode=True)
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


@pytest.mark.parametrize("bad, message", [
    (dict(checkpoint_offsets=torch.tensor([32])), r"checkpoint_offsets must be of shape \[2\]"),
    (dict(checkpoint_offsets=torch.tensor([[32, 0], [32, 0]])), r"checkpoint_offsets must be of shape \[2\]"),
    (dict(checkpoint_offsets=[32, 32]), "checkpoint_offsets must be a torch.Tensor"),
    (dict(slots=[0, 1]), "slots must be a torch.Tensor"),
    (dict(slots=torch.tensor(0)), r"slots must be of shape \[2\]"),
    (dict(slots=torch.tensor([0.0, 1.0])), "slots must be of dtype"),
    (dict(has_initial_state=[True, False]), "has_initial_state must be a torch.Tensor"),
    (dict(has_initial_state=torch.tensor([1, 0])), "has_initial_state must be of dtype torch.bool")],
    ids=["one offset", "[N, 2] offsets", "list offsets", "list slots", "0-d slots", "float slots",
         "list flags", "int flags"])
def test_a_prefill_names_a_malformed_per_sequence_argument(bad, message):
    """Slots, start flags and checkpoint offsets are ``[N]`` tensors on the inputs' device: anything else is a
    ValueError naming it (not an IndexError or AttributeError from the layer's index math), both pools kept."""
    layer = make_layer(-5.0)
    cache = cache_for(layer)
    kw = {"slots": cache.allocate(2), **bad}
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    before = cache.recurrent.clone(), cache.conv.clone()
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        layer(hidden(2, 40), cache, **kw)
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


def test_decode_of_several_tokens_compiles_as_one_graph():
    """Under ``torch.compile(fullgraph=True)`` a decode step of T > 1 tokens (no fused kernel) traces: the slots'
    values are not read in the trace (the op checks them), and the output and pools equal the eager step's."""
    layer = make_layer(-5.0).eval()
    caches = [cache_for(layer), cache_for(layer)]
    x = hidden(2, 3, seed=5)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        outs = [run(x, cache, slots=cache.allocate(2), decode=True) for run, cache in zip((compiled, layer), caches)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].recurrent, caches[1].recurrent) and torch.equal(caches[0].conv, caches[1].conv)


def test_a_compiled_step_keeps_the_cache_s_tickets():
    """Compiled, the one-token step runs as three ops (no join), so the layer asks the cache for no tickets: a
    batch padded past the cache's slots leaves the cache's buffer as it was (made in a graph, it would belong to
    the graph), and the step equals the eager one."""
    layer = make_layer(-5.0).eval()
    caches = [cache_for(layer, slots=2), cache_for(layer, slots=2)]
    kept = caches[0].step_tickets(1).data_ptr()
    slots = torch.tensor([0, 1, -1, -1], dtype=torch.int32)  # two padding rows: more tickets than the cache keeps
    x = hidden(4, 1, seed=6)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        outs = [run(x, cache, slots=slots, decode=True) for run, cache in zip((compiled, layer), caches)]
    assert caches[0].step_tickets(1).data_ptr() == kept
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0].recurrent, caches[1].recurrent)


def test_a_compiled_layer_keeps_its_graphs_over_new_batches():
    """A serving engine's batches change size every step: compiled with ``fullgraph=True``, the layer's prefill
    over packed batches of 1 to 8 sequences and its decode over 1 to 8 sequences take a few graphs each (the
    kernels' plans are chosen inside their ops, from the sizes they run on), not one per batch size up to torch's
    limit of 8, and every output and pool equals the eager layer's."""
    import itertools

    import torch._dynamo

    torch._dynamo.reset()
    counter = CompileCounter()
    layer = make_layer(-5.0).eval()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.no_grad():
        for count in range(1, 9):
            lengths = [33 + 5 * count + j for j in range(count)]
            cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)])
            caches = [cache_for(layer), cache_for(layer)]
            x = hidden(sum(lengths), seed=count)
            outs = [run(x, cache, slots=cache.allocate(count), cu_seqlens=cu_seqlens)
                    for run, cache in zip((compiled, layer), caches)]
            steps = [run(hidden(count, 1, seed=count), cache, slots=torch.arange(count), decode=True)
                     for run, cache in zip((compiled, layer), caches)]
            assert torch.equal(outs[0], outs[1]) and torch.equal(steps[0], steps[1])
            assert torch.equal(caches[0].recurrent, caches[1].recurrent) and torch.equal(caches[0].conv,
                                                                                         caches[1].conv)
    assert counter.graphs <= 6


def test_a_conv_checkpoint_past_its_sequence_is_nan():
    """An offset past its sequence has no state: the conv checkpoint is NaN there, as the recurrent one is (it
    read the next sequence's inputs before), and the other sequence's checkpoint is finite. Offsets as a column
    (``[N, 1]``, as kda_prefill also takes them) give the same checkpoints."""
    layer = make_layer(-5.0)
    results = []
    for offsets in (torch.tensor([64, 32]), torch.tensor([[64], [32]])):
        cache = cache_for(layer)
        with torch.no_grad():
            _, checkpoint = layer(hidden(80), cache, slots=cache.allocate(2), cu_seqlens=torch.tensor([0, 40, 80]),
                                  checkpoint_offsets=offsets)
        results.append(checkpoint)
    (recurrent, conv), (recurrent_column, conv_column) = results
    assert bool(recurrent[0].isnan().all()) and bool(conv[0].isnan().all())
    assert bool(recurrent[1].isfinite().all()) and bool(conv[1].isfinite().all())
    assert torch.equal(recurrent_column[1], recurrent[1]) and torch.equal(conv_column[1], conv[1])


def test_the_cache_refuses_a_layer_it_does_not_have():
    """A layer index outside the cache's layers is refused by name (-1 would have used the last layer's pools);
    from_transformers takes the KDA layer's own place for a cache of KDA layers alone."""
    layer = make_layer(-5.0)
    cache = cache_for(layer)
    slots = cache.allocate(1)
    for index in (-1, 1):
        layer.layer_idx = index
        with torch.no_grad(), pytest.raises(ValueError, match=r"index must be an int in \[0, 1\)"):
            layer(hidden(1, 4), cache, slots=slots)
    theirs = transformers_layer(-5.0)
    theirs.layer_idx = 3  # its place among all the model's layers
    assert KimiDeltaAttention.from_transformers(theirs).layer_idx == 3
    assert KimiDeltaAttention.from_transformers(theirs, layer_idx=0).layer_idx == 0


def test_from_transformers_refuses_what_it_cannot_copy():
    """A full-attention layer is a TypeError naming the layers it takes (not an AttributeError); a layer whose conv
    activation or output gate this layer does not compute is a ValueError (a silent copy would differ)."""
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match="takes a KimiLinearDeltaAttention or Glm5NextTextLinearAttention"):
        KimiDeltaAttention.from_transformers(torch.nn.Linear(2, 2))
    theirs = transformers_layer(-5.0)
    theirs.activation = "gelu"
    with pytest.raises(ValueError, match="conv activation must be 'silu' or 'swish'.*got 'gelu'"):
        KimiDeltaAttention.from_transformers(theirs)
    theirs.activation = "silu"
    theirs.o_norm.activation = "silu"
    with pytest.raises(ValueError, match="output norm's gate must be 'sigmoid'"):
        KimiDeltaAttention.from_transformers(theirs)


def test_a_conv_kept_in_fp32_is_loaded_as_it_is():
    """GLM-5.3-Flash keeps its conv in fp32 in a bf16 model: the copy's conv holds the same fp32 weights (loaded
    into a bf16 conv first, they lost their low bits when it was cast back)."""
    theirs = transformers_layer(-5.0).to(torch.bfloat16)
    theirs.conv1d.to(torch.float32)
    with torch.no_grad():
        theirs.conv1d.weight.uniform_(-0.5, 0.5)  # fp32 values past bf16's 8 bits
    ours = KimiDeltaAttention.from_transformers(theirs)
    assert ours.conv1d.weight.dtype == torch.float32 and ours.q_proj.weight.dtype == torch.bfloat16
    assert torch.equal(ours.conv1d.weight, theirs.conv1d.weight)


def test_the_pools_keep_no_autograd_history_outside_no_grad():
    """Called with autograd on (the layer's projections then track gradients), a speculative decode step and a
    restore of a checkpoint wrote tensors with history into the conv pool: the next allocate's in-place zeroing
    failed ("a leaf Variable that requires grad"). The pools stay plain state."""
    layer = make_layer(-5.0)
    cache = cache_for(layer)
    slots = cache.allocate(2)
    with pytest.warns(UserWarning, match="inference-only"):
        _, (recurrent, conv) = layer(hidden(2, 40), cache, slots=slots, checkpoint_offsets=torch.tensor([32, 32]))
    assert not conv.requires_grad
    cache.restore(cache.allocate(1), recurrent[:1], conv[:1] * layer.conv1d.weight.sum())  # a history on purpose
    drafts = cache.allocate(4).tolist()
    with pytest.warns(UserWarning, match="inference-only"):
        layer(hidden(2, 3), cache, slots=torch.tensor([[0, *drafts[:2]], [1, *drafts[2:]]], dtype=torch.int32),
              decode=True)
    assert not cache.recurrent.requires_grad and not cache.conv.requires_grad
    cache.release(drafts)
    cache.allocate(4)  # zeroes their rows in place


def test_a_call_autograd_records_warns_that_the_layer_is_inference_only():
    """fastkda's kernels carry no gradient: with grad mode on and parameters requiring grad, backward() reached
    o_proj alone, silently. Such a call (prefill or decode; the input requiring grad too) warns, naming
    torch.no_grad(), at the line that called the layer, and gives the no_grad call's output; under no_grad or
    inference_mode, or with nothing requiring grad, autograd records nothing and nothing is said."""
    layer = make_layer(-5.0)
    x = hidden(2, 40)
    with torch.no_grad():
        want = layer(x)
    with pytest.warns(UserWarning, match=r"inference-only.*o_proj.*torch\.no_grad\(\)") as record:
        got = layer(x)
    assert torch.equal(got, want)
    assert record[0].filename == __file__  # the caller's line, not torch's Module.__call__
    cache = cache_for(layer)
    with pytest.warns(UserWarning, match="inference-only"):
        layer(hidden(2, 1), cache, slots=cache.allocate(2), decode=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            layer(x)
        with torch.inference_mode():
            layer(x)
        layer.requires_grad_(False)
        layer(x)
    with pytest.warns(UserWarning, match="inference-only"):
        layer(x.clone().requires_grad_())


@pytest.mark.parametrize("bad", [
    dict(slots=torch.tensor([0, 1], dtype=torch.int32), num_accepted_tokens=torch.tensor([5, 0], dtype=torch.int32)),
    dict(slots=torch.tensor([0, 1], dtype=torch.int32), num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32)),
    dict(slots=[0, 1]),
    dict(slots=torch.tensor([0, 1, 2], dtype=torch.int32)),
], ids=["accepted out of range with [N] slots", "accepted with [N] slots", "list slots", "N+1 slots"])
def test_fused_decode_refuses_a_step_as_the_unfused_path_does(bad):
    """A one-token step with ``fused_decode=True`` went to kda_decode_step past the layer's own checks: accepted
    counts with ``[N]`` slots were ignored, list slots an AttributeError, ``N + 1`` slots named as the fused step
    takes them. Both settings give the same named ValueError, both pools kept."""
    messages = []
    for fused in (False, True):
        layer = make_layer(-5.0)
        layer.fused_decode = fused
        cache = cache_for(layer)
        cache.allocate(3)
        cache.conv.normal_(generator=torch.Generator().manual_seed(2))
        before = cache.recurrent.clone(), cache.conv.clone()
        with torch.no_grad(), pytest.raises(ValueError, match="slots must be") as error:
            layer(hidden(2, 1), cache, decode=True, **bad)
        assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])
        messages.append(str(error.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("bad", ["nan", "overflow"], ids=["NaN conv weight", "conv output overflows"])
@pytest.mark.parametrize("speculative", [False, True], ids=["one token", "speculative"])
def test_checked_mode_refuses_a_decode_step_whose_conv_is_not_finite_with_both_pools_kept(bad, speculative,
                                                                                           monkeypatch):
    """Under $FASTKDA_CHECKS the unfused step's kda_decode refused a non-finite q, k or v only after the conv had
    moved its pool, leaving the conv pool a step ahead of the recurrent one. A NaN conv weight is now named before
    the pools; a conv output that overflows to inf from finite inputs is refused with the conv rows put back."""
    monkeypatch.setenv("FASTKDA_CHECKS", "1")
    layer = make_layer(-5.0)
    layer.fused_decode = False
    cache = cache_for(layer)
    cache.allocate(6)
    cache.recurrent.normal_(generator=torch.Generator().manual_seed(1))
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([[0, 2, 3], [1, 4, 5]] if speculative else [0, 1], dtype=torch.int32)
    accepted = torch.tensor([1, 1], dtype=torch.int32) if speculative else None
    before = cache.recurrent.clone(), cache.conv.clone()
    with torch.no_grad():
        if bad == "nan":
            layer.conv1d.weight.view(-1)[0] = float("nan")
        else:  # finite weights whose products with the step's finite inputs pass fp32's largest value
            layer.conv1d.weight.fill_(3e38)
        with pytest.raises(ValueError, match="conv_weight must be finite" if bad == "nan" else "q must be finite"):
            layer(hidden(2, 3 if speculative else 1, seed=3), cache, slots=slots, decode=True,
                  num_accepted_tokens=accepted)
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


@pytest.mark.parametrize("decode, bad", [
    (True, dict(has_initial_state=torch.tensor([False, False]))),
    (True, dict(checkpoint_offsets=torch.tensor([0, 0]))),
    (True, dict(cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32))),
    (True, dict(max_seqlen=1)),
    (False, dict(num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32))),
], ids=["decode has_initial_state", "decode checkpoint_offsets", "decode cu_seqlens", "decode max_seqlen",
        "prefill num_accepted_tokens"])
def test_an_argument_of_the_other_mode_is_refused_with_both_pools_kept(decode, bad):
    """Arguments that one mode does not take were dropped without a word (a decode step with
    ``has_initial_state=False`` still read its slots' states; with ``checkpoint_offsets`` it returned no
    checkpoint): a ValueError names the argument, both pools kept."""
    layer = make_layer(-5.0)
    cache = cache_for(layer)
    slots = cache.allocate(2)
    cache.recurrent.normal_(generator=torch.Generator().manual_seed(1))
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    before = cache.recurrent.clone(), cache.conv.clone()
    name = next(iter(bad))
    with torch.no_grad(), pytest.raises(ValueError, match=f"{name} does not apply to a "
                                                          f"{'decode step' if decode else 'prefill'}"):
        layer(hidden(2, 1), cache, slots=slots, decode=decode, **bad)
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


def test_the_speculative_conv_makes_an_accepted_count_outside_its_tokens_a_padding_row():
    """On the GPU kda_decode makes a sequence whose accepted count is outside [1, T] a padding row (the CPU refuses
    it before the conv); the layer's speculative conv, which runs there too, clamped the count, read a live slot and
    wrote the sequence's conv rows. Called directly, as the GPU path reaches it: those rows keep every bit, and a
    sequence with a count in range still writes its own."""
    layer = make_layer(-5.0)
    cache = cache_for(layer, slots=6)
    cache.allocate(6)
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    before = cache.conv.clone()
    slots = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    accepted = torch.tensor([0, 3, 1], dtype=torch.int32)  # T = 2: below and above [1, T], then in range
    with torch.no_grad():
        mixed = layer._projections(hidden(3, 2))[0]
        layer._speculative_conv(mixed, cache.layer(0)[1], layer.conv1d.weight.squeeze(1), slots, accepted, cache)
    assert torch.equal(cache.conv[:, :4], before[:, :4])
    assert not torch.equal(cache.conv[:, 4:6], before[:, 4:6])


@pytest.mark.parametrize("sizes", [dict(conv_kernel=3), dict(conv_kernel=5), dict(head_dim=128), dict(heads=3),
                                   dict(conv_channels=3 * HEADS * DIM + 3)],
                         ids=["narrower conv", "wider conv", "head_dim", "heads", "conv_channels"])
@pytest.mark.parametrize("mode", ["prefill", "checkpoint", "decode", "fused decode", "speculative"])
def test_a_cache_built_for_another_layer_is_refused_with_both_pools_kept(sizes, mode):
    """A cache of another conv width worked for a prefill and failed in fused or speculative decode and checkpoints
    with a shape error from inside the layer: every mode now names the cache, both pools kept."""
    layer = make_layer(-5.0)
    layer.fused_decode = mode == "fused decode"
    built = {**dict(heads=HEADS, head_dim=DIM, conv_channels=layer.conv_channels, conv_kernel=layer.conv_kernel),
             **sizes}
    cache = KDACache(8, 1, built["heads"], built["head_dim"], built["conv_channels"], built["conv_kernel"])
    slots = cache.allocate(4)
    cache.conv.normal_(generator=torch.Generator().manual_seed(2))
    before = cache.recurrent.clone(), cache.conv.clone()
    call = {"prefill": dict(slots=slots[:2]),
            "checkpoint": dict(slots=slots[:2], checkpoint_offsets=torch.tensor([0, 0])),
            "decode": dict(slots=slots[:2], decode=True),
            "fused decode": dict(slots=slots[:2], decode=True),
            "speculative": dict(slots=slots.view(2, 2), decode=True,
                                num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32))}[mode]
    name = next(iter(sizes))
    with torch.no_grad(), pytest.raises(ValueError, match=f"cache must be built for this layer's sizes, got a cache "
                                                          f"of {name} {sizes[name]}"):
        layer(hidden(2, 2 if mode == "speculative" else 1), cache, **call)
    assert torch.equal(cache.recurrent, before[0]) and torch.equal(cache.conv, before[1])


@pytest.mark.parametrize("bad, message", [
    (dict(conv_kernel=9), r"conv_kernel must be in \[2, 8\]"),
    (dict(head_dim=96), r"head_dim must be one of \(64, 128\)"),
    (dict(conv_dtype=torch.int32), "conv_dtype must be one of")],
    ids=["conv_kernel 9", "head_dim 96", "int32 conv"])
def test_the_cache_refuses_sizes_and_dtypes_the_kernels_do_not_take(bad, message):
    """Caught when the cache is built, by name, rather than at a layer's first call."""
    sizes = dict(num_slots=2, num_layers=1, heads=2, head_dim=64, conv_channels=384, conv_kernel=4)
    sizes.update({name: value for name, value in bad.items() if name in sizes})
    dtypes = {name: value for name, value in bad.items() if name not in sizes}
    with pytest.raises(ValueError, match=message):
        KDACache(*sizes.values(), **dtypes)


def test_release_takes_many_slots_in_linear_time():
    """Each slot was checked against every slot before it: 40 000 slots took seconds; with a set, milliseconds."""
    cache = KDACache(40_000, 1, 1, 64, 192, 4, device="meta")  # no memory: the slots' bookkeeping is on the host
    cache.allocate(40_000)
    start = time.perf_counter()
    cache.release(range(40_000))
    assert time.perf_counter() - start < 1.0
    assert cache.free_slots == 40_000


@pytest.mark.parametrize("bad", [2.0, None, np.float64(1.0), torch.tensor(1.0)],
                         ids=["float", "None", "numpy float", "0-d float tensor"])
def test_release_names_slots_that_are_not_integers(bad):
    """A float, None or a numpy float were a TypeError ('float' object is not iterable) rather than the
    documented ValueError; nothing is freed."""
    cache = KDACache(4, 1, 2, 64, 384, 4)
    cache.allocate(2)
    with pytest.raises(ValueError, match="slots must be integers"):
        cache.release(bad)
    assert cache.free_slots == 2


def test_release_takes_a_list_of_the_slots_allocate_gives():
    """Iterating over an allocate() result gives 0-d int32 tensors: a list of them releases as the tensor does
    (one of them alone already did)."""
    cache = KDACache(4, 1, 2, 64, 384, 4)
    cache.release(list(cache.allocate(3)))
    assert cache.free_slots == 4


def test_checkpoint_offsets_past_int32_give_no_state_in_either_checkpoint():
    """kda_prefill takes offsets as int32 (cu_seqlens' dtype): 2**32 + 32 wrapped to 32 for the recurrent
    checkpoint while the conv checkpoint read it as past its sequence (NaN). Both now read it as past it."""
    layer = make_layer(-5.0)
    cache = cache_for(layer)
    with torch.no_grad():
        _, (recurrent, conv) = layer(hidden(2, 40), cache, slots=cache.allocate(2),
                                     checkpoint_offsets=torch.tensor([32, 2**32 + 32]))
    assert bool(recurrent[0].isfinite().all()) and bool(conv[0].isfinite().all())
    assert bool(recurrent[1].isnan().all()) and bool(conv[1].isnan().all())

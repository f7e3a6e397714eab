"""GPU tests of the layer's kernels and of the layer (run on the H200; skipped without CUDA): the conv and the gated
norm against their references in bf16 and fp32, CUDA-graph replay, the layer against transformers' own layer, its
decode continuing its prefill, and transformers' tiny models through ``fastkda.integrations.transformers``."""

import pytest
import torch

import fastkda
from fastkda.bench.timing import capture_graph
from fastkda.cache import KDACache
from fastkda.layers import KimiDeltaAttention
from fastkda.plan import choose_decode_step_plan, sm_count
from helpers import in_default_pool, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def randn(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device="cuda", dtype=dtype)


def channel_last(pool):
    """The same values in KDACache's conv pool layout (``[P, W−1, C]`` memory)."""
    return pool.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_prefill_and_update_match_the_reference(dtype, layout):
    lengths = [0, 1, 2, 3, 40, 300]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    channels, width = 3 * 2 * 128, 4
    wide = randn(int(cu[-1]), 2 * channels, dtype=dtype)
    x = wide[:, channels // 2:channels // 2 + channels]  # a strided view, as engines pass it
    weight, bias = randn(channels, width, seed=1), randn(channels, seed=2)
    pool = randn(8, channels, width - 1, dtype=torch.float32, seed=3)
    if layout == "channel_last":
        pool = channel_last(pool)
    slots = torch.tensor([5, -1, 2, 7, 0, 3], dtype=torch.int32, device="cuda")
    flags = torch.tensor([True, True, False, True, True, True], device="cuda")
    want_pool = pool.clone()
    want = fastkda.causal_conv1d_reference(x.cpu(), weight.cpu(), bias.cpu(), conv_states=want_pool.cpu(),
                                           slots=slots.cpu(), has_initial_state=flags.cpu(), cu_seqlens=cu.cpu())
    got = fastkda.causal_conv1d(x, weight, bias, conv_states=pool, slots=slots, has_initial_state=flags,
                                cu_seqlens=cu)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(got.cpu(), want) < tolerance
    step = randn(6, channels, dtype=dtype, seed=4)
    reference_pool = pool.cpu().clone()
    want = fastkda.causal_conv1d_reference(step.cpu()[:, None], weight.cpu(), bias.cpu(),
                                           conv_states=reference_pool, slots=slots.cpu())[:, 0]
    got = fastkda.causal_conv1d_update(step, pool, weight, bias, slots=slots)
    assert rel_err(got.cpu(), want) < tolerance
    assert torch.equal(pool.cpu(), reference_pool)


def test_gated_rmsnorm_matches_the_reference():
    x, gate, weight = randn(3, 77, 4, 128), randn(3, 77, 4, 128, seed=1), randn(128, dtype=torch.float32, seed=2)
    want = fastkda.gated_rmsnorm_reference(x.cpu(), gate.cpu(), weight.cpu(), 1e-5)
    assert rel_err(fastkda.gated_rmsnorm(x, gate, weight, 1e-5).cpu(), want) < 8e-3


def test_conv_and_norm_replay_in_a_cuda_graph():
    channels = 768
    x, weight = randn(1, 64, channels), randn(channels, 4, seed=1)
    pool = torch.zeros(2, channels, 3, device="cuda")
    slots = torch.tensor([1], dtype=torch.int32, device="cuda")
    gate, norm_weight = randn(64, 6, 128, seed=2), randn(128, seed=3)
    results = {}

    def step():
        results["conv"] = fastkda.causal_conv1d_update(x, pool, weight, slots=slots)
        results["norm"] = fastkda.gated_rmsnorm(results["conv"].view(64, 6, 128), gate, norm_weight)

    graph = capture_graph(step)
    pool.zero_()
    graph.replay()
    replayed = results["conv"].clone(), results["norm"].clone()
    pool.zero_()
    step()
    assert torch.equal(replayed[0], results["conv"]) and torch.equal(replayed[1], results["norm"])


@pytest.mark.parametrize("fused", [False, True])
def test_layer_decode_continues_prefill_on_the_gpu(fused):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(256, 2, 128, lower_bound=-5.0, fused_decode=fused, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.forget_gate.A_log.uniform_(-1, 1)
        layer.forget_gate.dt_bias.uniform_(-1, 1)
    x = randn(3, 300, 256)
    cache = KDACache(4, 1, 2, 128, layer.conv_channels, layer.conv_kernel, device="cuda")
    slots = cache.allocate(3)
    with torch.no_grad():
        whole = layer(x)
        parts = [layer(x[:, :296], cache, slots=slots)]
        parts += [layer(x[:, t:t + 1], cache, slots=slots, decode=True) for t in range(296, 300)]
    assert rel_err(torch.cat(parts, 1), whole) < 1e-2


@pytest.mark.parametrize("kind", ["kimi_linear", "glm5_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_tiny_models_on_the_gpu(kind, dtype):
    """Against transformers' own PyTorch path (its fallback, also where it bound FLA at import): fp32 logits to
    1e-5 and the same greedy tokens; bf16 logits no farther from the fp32 ones than its own bf16 path's."""
    pytest.importorskip("transformers")
    from fastkda.bench.models import bound_functions, modeling_module, use_path
    from fastkda.integrations.tiny_models import tiny_model

    module = modeling_module(kind)
    bound = bound_functions(module)
    ids = torch.randint(3, 128, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    generate = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    try:
        with torch.no_grad():
            use_path(module, "pytorch", bound)
            exact = tiny_model(kind, moe=False, device="cuda")(ids, attention_mask=mask).logits
            model = tiny_model(kind, moe=dtype == torch.float32, dtype=dtype, device="cuda")
            want = model(ids, attention_mask=mask).logits
            want_tokens = model.generate(ids, **generate)
            use_path(module, "fastkda", bound)
            got = model(ids, attention_mask=mask).logits
            got_tokens = model.generate(ids, **generate)
    finally:
        use_path(module, "fla", bound)  # as transformers bound it
    if dtype == torch.float32:
        print(f"\n{kind} fp32: logits rel err {rel_err(got, want):.2e}")
        assert rel_err(got, want) < 1e-5
        assert torch.equal(got_tokens, want_tokens)
    else:
        print(f"\n{kind} bf16: from fp32, fastkda {rel_err(got, exact):.2e}, transformers {rel_err(want, exact):.2e}")
        assert rel_err(got, exact) <= rel_err(want, exact) * 1.05


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("heads,num_seqs", [(12, 1), (12, 32), (96, 4), (12, 64)])  # the last: three launches
def test_fused_decode_step_equals_the_three_ops(heads, num_seqs, layout):
    """The one-launch step against the conv update, KDA decode and gated norm run one by one on the GPU, bf16
    inputs, fp32 pools; a padding row; and a CUDA-graph replay (its tickets left at zero)."""
    dim, width = 128, 4
    channels = 3 * heads * dim
    mixed = randn(num_seqs, channels)
    conv_weight, g, beta = randn(channels, width, seed=1), randn(num_seqs, heads, dim, seed=2), randn(num_seqs, heads,
                                                                                                       seed=3)
    output_gate, norm_weight = randn(num_seqs, heads, dim, seed=4), 1 + 0.1 * randn(dim, dtype=torch.float32, seed=5)
    gate = dict(A_log=torch.rand(heads, device="cuda"), dt_bias=torch.rand(heads, dim, device="cuda"), lower_bound=-5.0)
    conv_pool = randn(num_seqs + 2, channels, width - 1, dtype=torch.float32, seed=6)
    if layout == "channel_last":
        conv_pool = channel_last(conv_pool)
    state_pool = 0.1 * randn(num_seqs + 2, heads, dim, dim, dtype=torch.float32, seed=7)
    slots = torch.arange(num_seqs, dtype=torch.int32, device="cuda").flip(0) + 1
    if num_seqs > 1:
        slots[1] = -1
    def three_ops(activations):
        pools = conv_pool.clone(), state_pool.clone()
        conv = fastkda.causal_conv1d_update(activations, pools[0], conv_weight, slots=slots)
        q, k, v = (part.view(num_seqs, 1, heads, dim) for part in conv.chunk(3, dim=1))
        o = fastkda.kda_decode(q, k, v, g[:, None], beta[:, None], pools[1], slots, **gate)
        return fastkda.gated_rmsnorm(o[:, 0], output_gate, norm_weight, 1e-5).to(mixed.dtype), *pools
    # the fused kernel keeps the conv's output in fp32 registers, where the unfused conv rounds it to mixed's bf16
    # (a 1e-3 difference in the states, not a defect of either): it is held against the three ops on fp32
    # activations; the automatic plan's three-launch form against the three ops themselves, bit for bit
    fused_want, unfused_want = three_ops(mixed.float()), three_ops(mixed)
    tickets = torch.zeros(num_seqs * heads, dtype=torch.int32, device="cuda")
    auto_fused = choose_decode_step_plan(num_seqs, heads, dim, sm_count(0)) is not None
    for slices, warps in ((None, None), (8, 1), (8, 2), (4, 4), (2, 8), (1, 8)):  # the automatic plan, each form
        plan = None if slices is None else fastkda.DecodePlan(num_seqs, heads, dim, slices, warps)
        got_pools = conv_pool.clone(), state_pool.clone()
        got = fastkda.kda_decode_step(mixed, got_pools[0], conv_weight, g, beta, output_gate, norm_weight,
                                      got_pools[1], slots, **gate, tickets=tickets, plan=plan)
        if plan is None and not auto_fused:
            assert all(torch.equal(a, b) for a, b in zip((got, *got_pools), unfused_want))
            continue
        want, *pools = fused_want
        assert rel_err(got, want) < 1e-2, plan
        assert rel_err(got_pools[0], pools[0]) < 1e-6 and rel_err(got_pools[1], pools[1]) < 1e-5, plan
        assert torch.equal(tickets, torch.zeros_like(tickets))
    sliced = fastkda.DecodePlan(num_seqs, heads, dim, 8, 1)  # the ticketed form, replayed
    step = lambda: fastkda.kda_decode_step(mixed, got_pools[0], conv_weight, g, beta, output_gate,  # noqa: E731
                                           norm_weight, got_pools[1], slots, **gate, tickets=tickets, plan=sliced)
    graph = capture_graph(step)
    graph.replay()
    assert torch.equal(tickets, torch.zeros_like(tickets))


@pytest.mark.parametrize("num_seqs", [2, 64])  # eager fuses at 2 sequences of 12 heads, takes three launches at 64
def test_compiled_step_on_the_gpu_equals_eager(num_seqs):
    """``torch.compile(fullgraph=True)`` traces the step as its three opaque ops on the GPU too: bit for bit the
    eager three launches, and within bf16 rounding of the conv's output where eager fuses."""
    heads, dim, width = 12, 128, 4
    channels = 3 * heads * dim
    inputs = dict(mixed=randn(num_seqs, channels), conv_weight=randn(channels, width, seed=1),
                  g=randn(num_seqs, heads, dim, seed=2), beta=randn(num_seqs, heads, seed=3),
                  output_gate=randn(num_seqs, heads, dim, seed=4),
                  norm_weight=1 + 0.1 * randn(dim, dtype=torch.float32, seed=5),
                  A_log=torch.rand(heads, device="cuda"), dt_bias=torch.rand(heads, dim, device="cuda"),
                  lower_bound=-5.0, slots=torch.arange(num_seqs, dtype=torch.int32, device="cuda").flip(0))
    conv_pool = channel_last(randn(num_seqs + 1, channels, width - 1, seed=6))  # KDACache's layout
    state_pool = 0.1 * randn(num_seqs + 1, heads, dim, dim, dtype=torch.float32, seed=7)
    eager_pools, compiled_pools = (conv_pool.clone(), state_pool.clone()), (conv_pool.clone(), state_pool.clone())
    want = fastkda.kda_decode_step(**inputs, conv_states=eager_pools[0], state_pool=eager_pools[1])
    step = torch.compile(lambda **kw: fastkda.kda_decode_step(**kw), fullgraph=True)
    got = step(**inputs, conv_states=compiled_pools[0], state_pool=compiled_pools[1])
    if choose_decode_step_plan(num_seqs, heads, dim, sm_count(0)) is None:
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(compiled_pools, eager_pools))
    else:
        assert rel_err(got, want) < 1e-2 and rel_err(compiled_pools[1], eager_pools[1]) < 1e-2
        assert torch.equal(compiled_pools[0], eager_pools[0])


def test_a_layer_compiled_by_inductor_serves_new_batches_on_the_gpu():
    """An engine compiles the layer with inductor before any eager fastkda call, then serves packed prefills and
    decode steps of changing batch sizes: ``fullgraph=True`` traces (the error counters are looked up when the ops
    run, not allocated in the trace), a few graphs serve every size, and outputs and pools stay within bf16's
    rounding of the eager layer's (inductor fuses the projections' elementwise work its own way; eager fuses the
    decode step)."""
    import itertools
    from unittest import mock

    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    graphs = []

    def counting_inductor(graph, example_inputs):
        graphs.append(graph)
        return compile_fx(graph, example_inputs)

    torch.manual_seed(0)
    layer = KimiDeltaAttention(256, 2, 128, lower_bound=-5.0, device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        layer.forget_gate.A_log.uniform_(-1, 1)
        layer.forget_gate.dt_bias.uniform_(-1, 1)
    compiled = torch.compile(layer, backend=counting_inductor, fullgraph=True)
    with torch.no_grad(), mock.patch.dict(fastkda.errors._COUNTERS, clear=True):
        for count in (1, 3, 4):
            lengths = [97 + 31 * count + 7 * j for j in range(count)]
            cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
            caches = [KDACache(8, 1, 2, 128, layer.conv_channels, layer.conv_kernel, device="cuda") for _ in range(2)]
            slots = [cache.allocate(count) for cache in caches]
            x = randn(sum(lengths), 256, seed=count)
            outs = [run(x, cache, slots=s, cu_seqlens=cu_seqlens)
                    for run, cache, s in zip((compiled, layer), caches, slots)]
            for t in range(2):
                step = randn(count, 1, 256, seed=10 * count + t)
                outs += [run(step, cache, slots=s, decode=True)
                         for run, cache, s in zip((compiled, layer), caches, slots)]
            for got, want in zip(outs[::2], outs[1::2]):
                assert got.isfinite().all() and rel_err(got, want) < 1e-2
            assert rel_err(caches[0].recurrent, caches[1].recurrent) < 1e-2
            assert rel_err(caches[0].conv.float(), caches[1].conv.float()) < 1e-2
    assert len(graphs) <= 6


def test_a_captured_step_keeps_no_buffer_of_the_graph_s_pool():
    """A decode step captured in a CUDA graph over a batch padded past the cache's slots needs more join tickets
    than the cache keeps: the ones made during capture come from the graph's private memory pool, whose blocks
    other graphs reuse, so they stay the graph's (zeroed by each replay), and the cache keeps its own; replays give
    the eager step's output."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(256, 2, 128, lower_bound=-5.0, fused_decode=True, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, -1, -1], dtype=torch.int32, device="cuda")  # two null rows: 8 tickets, 4 kept
    x = randn(4, 1, 256)

    def fresh_cache():
        return KDACache(2, 1, 2, 128, layer.conv_channels, layer.conv_kernel, device="cuda")

    with torch.no_grad():
        want = layer(x, fresh_cache(), slots=slots, decode=True)  # also compiles the kernels before the capture
        cache = fresh_cache()
        kept = cache.step_tickets(1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = layer(x, cache, slots=slots, decode=True)
    assert cache.step_tickets(1).data_ptr() == kept.data_ptr() and in_default_pool(cache.step_tickets(1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)

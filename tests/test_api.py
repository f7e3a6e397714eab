"""The public API on the CPU: validation, adapters, torch.compile."""

import pytest
import torch

import fastkda
from fastkda.compat import fla, flash_kda
from fastkda.errors import counters
from fastkda.reference import kda_reference
from fastkda.validation import addressable
from helpers import CompileCounter, check_compiled_prefill, make_inputs, rel_err


def call(inp, **overrides):
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], output_final_state=True)
    kw.update(overrides)
    args = [overrides.pop(x, inp[x]) for x in ("q", "k", "v", "g", "beta")]
    for x in ("q", "k", "v", "g", "beta"):
        kw.pop(x, None)
    return fastkda.kda_prefill(*args, **kw)


def test_prefill_matches_reference_and_fills_buffers():
    inp = make_inputs([0, 30, 1, 90], seed=11)
    out = torch.full_like(inp["v"], float("nan"))
    final = torch.full_like(inp["initial_state"], float("nan"))
    o, s = call(inp, out=out, final_state=final)
    assert o is out and s is final
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                 dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                                 initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert rel_err(o, ref_o) < 4e-3 and rel_err(s, ref_s) < 1e-5
    assert torch.equal(s[0], inp["initial_state"][0])  # the empty sequence keeps its initial state


def test_switches_off_norm_and_sigmoid():
    inp = make_inputs([40], seed=12)
    q = torch.nn.functional.normalize(inp["q"].float(), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(inp["k"].float(), dim=-1).bfloat16()
    beta = torch.sigmoid(inp["beta"].float())
    o, s = call(inp, q=q, k=k, beta=beta, use_qk_l2norm=False, use_beta_sigmoid=False)
    ref_o, ref_s = kda_reference(q, k, inp["v"], inp["g"], beta, A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                                 lower_bound=inp["lower_bound"], initial_state=inp["initial_state"],
                                 cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=False, use_beta_sigmoid=False)
    assert rel_err(o, ref_o) < 4e-3 and rel_err(s, ref_s) < 1e-5


def bad_inputs():
    """(description, overrides, word the message must contain)."""
    inp = make_inputs([10, 20], seed=13)
    return inp, [
        ("q dtype int", dict(q=inp["q"].int()), "q"),
        ("k shape", dict(k=inp["k"][:, :-1]), "k"),
        ("v dtype mismatch", dict(v=inp["v"].float()), "v"),
        ("K unsupported", dict(q=torch.zeros(1, 30, 2, 32, dtype=torch.bfloat16)), "key dimension"),
        ("beta shape", dict(beta=inp["beta"][..., None]), "beta"),
        ("g device", dict(g=inp["g"].to("meta")), "g"),
        ("B>1 with cu_seqlens", {x: inp[x].expand(2, *inp[x].shape[1:]).contiguous()
                                 for x in ("q", "k", "v", "g", "beta")}, "batch size 1"),
        ("cu_seqlens float", dict(cu_seqlens=inp["cu_seqlens"].float()), "cu_seqlens"),
        ("cu_seqlens values", dict(cu_seqlens=torch.tensor([0, 25, 20], dtype=torch.int32)), "cu_seqlens"),
        ("state dtype", dict(initial_state=inp["initial_state"].half()), "initial_state"),
        ("state shape", dict(initial_state=inp["initial_state"][:1]), "initial_state"),
        ("final state layout", dict(final_state=torch.full((2, 2, 64, 64), float("nan")).transpose(-1, -2)),
         "final_state"),
        ("lower_bound range", dict(lower_bound=-6.0), "lower_bound"),
        ("lower_bound positive", dict(lower_bound=0.5), "lower_bound"),
        ("gate half given", dict(A_log=None), "A_log"),
        ("gate without its bound", dict(lower_bound=None), "all given"),
        ("dt_bias size", dict(dt_bias=inp["dt_bias"][:1]), "dt_bias"),
        ("A_log strided", dict(A_log=torch.rand(4)[::2]), "A_log"),
        ("out is an input", dict(out=inp["v"]), "out"),
        ("scale", dict(scale=-1.0), "scale"),
        ("out dtype", dict(out=torch.full((1, 30, 2, 64), float("nan"))), "out"),
        ("v_slices", dict(v_slices=3), "v_slices"),
    ]


@pytest.mark.parametrize("index", range(len(bad_inputs()[1])))
def test_bad_input_is_rejected_before_writing(index):
    """Neither the output nor the final state (the buffers the call was given, NaN-filled) is written before the
    error."""
    inp, cases = bad_inputs()
    name, overrides, word = cases[index]
    overrides.setdefault("final_state", torch.full((2, 2, 64, 64), float("nan")))
    overrides.setdefault("out", torch.full_like(inp["v"], float("nan")))
    with pytest.raises(ValueError, match=word):
        call(inp, **overrides)
    for buffer in ("final_state", "out"):
        given = overrides[buffer]
        if given is not inp["v"]:  # "out is an input": the input itself, untouched as such
            assert torch.isnan(given).all(), f"{name}: {buffer} was written before the error"


def test_remembered_validation_still_rejects_an_aliased_out():
    """Validation is remembered per signature (shapes, strides, dtypes, devices); whether ``out`` is an input
    depends on addresses, so it is checked on every call, also after the same signature passed."""
    inp = make_inputs([10, 20], seed=15)
    call(inp, out=torch.empty_like(inp["v"]))
    with pytest.raises(ValueError, match="out"):
        call(inp, out=inp["v"])


def test_strided_beta_view_is_accepted():
    inp = make_inputs([33], seed=14)
    wide = torch.randn(1, 33, 2, 3).bfloat16()
    wide[..., 1] = inp["beta"]
    o_view, _ = call(inp, beta=wide[..., 1])
    o_dense, _ = call(inp)
    assert not wide[..., 1].is_contiguous() and torch.equal(o_view, o_dense)


def test_engine_views_are_taken_as_they_are_or_copied():
    """Views as engines and transformers pass them: q/k/v thirds of one conv output are read in place; a size-1
    token or batch dimension gets a stride the kernels can use (same memory); channel-major views are copied. The
    result equals the contiguous call's, bit for bit."""
    inp = make_inputs([40], seed=17)
    fused = torch.cat([inp[name].flatten(-2) for name in "qkv"], dim=-1)  # [1, T, 3·H·K], one conv output
    thirds = {name: x.unflatten(-1, (2, 64)) for name, x in zip("qkv", fused.chunk(3, dim=-1))}
    assert addressable(thirds["q"], 4).data_ptr() == thirds["q"].data_ptr()
    channel_major = {name: x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1) for name, x in thirds.items()}
    assert addressable(channel_major["q"], 4).is_contiguous()
    step = torch.zeros(2, 7, 2, 64)[:, 3:4]  # T = 1, stride(0) != 1 * stride(1)
    assert addressable(step, 4).data_ptr() == step.data_ptr() and addressable(step, 4).stride(1) == step.stride(0)
    heads_first = torch.zeros(2, 2, 1, 64).transpose(1, 2)  # transformers' [B, H, 1, D] -> [B, 1, H, D]: contiguous,
    assert heads_first.is_contiguous() and addressable(heads_first, 4).stride(1) == 128  # a stride-64 token dim
    want, _ = call(inp)
    for views in (thirds, channel_major):
        got, _ = call(inp, **{name: x for name, x in views.items() if name != "v"}, v=views["v"])
        assert torch.equal(got, want)


def test_numpy_scalars_are_numbers():
    """``scale``, ``lower_bound`` and ``eps`` given as NumPy scalars (a config read with NumPy) act as the Python
    floats they equal; a NumPy bool is still refused."""
    np = pytest.importorskip("numpy")
    inp = make_inputs([20, 44], seed=17)
    want = call(inp, scale=0.125, lower_bound=-4.0)
    got = call(inp, scale=np.float32(0.125), lower_bound=np.float64(-4.0))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x = torch.randn(3, 64)
    assert torch.equal(fastkda.gated_rmsnorm(x, x, torch.ones(64), np.float32(1e-3)),
                       fastkda.gated_rmsnorm(x, x, torch.ones(64), float(np.float32(1e-3))))
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        call(inp, scale=np.bool_(True))


def test_flash_kda_adapter_matches_native():
    inp = make_inputs([12, 50], key_dim=128, seed=15)
    native_o, native_s = call(inp)
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])
    assert flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128 ** -0.5, out, inp["A_log"],
                         inp["dt_bias"], inp["lower_bound"], initial_state=inp["initial_state"], final_state=final,
                         cu_seqlens=inp["cu_seqlens"].long()) is None
    assert torch.equal(out, native_o) and torch.equal(final, native_s)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128 ** -0.5, out, inp["A_log"],
                      inp["dt_bias"], inp["lower_bound"], initial_state=inp["initial_state"],
                      final_state=final.bfloat16(), cu_seqlens=inp["cu_seqlens"])


@pytest.mark.parametrize("bound", [0.0, 0], ids=["float", "int"])
def test_flash_kda_adapter_takes_a_lower_bound_of_zero(bound):
    """FlashKDA documents λ in [-5, 0]: at 0 no token decays the state (a = 0·σ(...)), whatever A_log, dt_bias and
    g say; fastkda's fused gate takes λ < 0, so the adapter runs the precomputed log-decay 0 (the float64 truth's
    result)."""
    inp = make_inputs([12, 50], key_dim=64, seed=17)
    out, final = torch.empty_like(inp["v"]), torch.empty_like(inp["initial_state"])
    flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 64 ** -0.5, out, inp["A_log"],
                  inp["dt_bias"], bound, initial_state=inp["initial_state"], final_state=final,
                  cu_seqlens=inp["cu_seqlens"])
    want_o, want_s = kda_reference(inp["q"], inp["k"], inp["v"], torch.zeros_like(inp["g"]), inp["beta"],
                                   initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert rel_err(out, want_o) < 4e-3 and rel_err(final, want_s) < 1e-5


@pytest.mark.parametrize("name", ["initial_state", "final_state"])
def test_flash_kda_adapter_refuses_a_state_that_is_not_a_tensor(name):
    """A state that is not a tensor, beside one that is, is a ``ValueError`` naming it (not an AttributeError from
    comparing dtypes), before ``out`` or the other state is written."""
    inp = make_inputs([12, 50], key_dim=128, seed=15)
    out = torch.full_like(inp["v"], 5.0)
    states = dict(initial_state=inp["initial_state"], final_state=torch.full_like(inp["initial_state"], 5.0))
    states[name] = 3
    with pytest.raises(ValueError, match=f"{name} must be a torch.Tensor, got int"):
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128 ** -0.5, out, inp["A_log"],
                      inp["dt_bias"], inp["lower_bound"], **states, cu_seqlens=inp["cu_seqlens"])
    written = [out] + ([states["final_state"]] if name == "initial_state" else [])
    assert all(bool((x == 5.0).all()) for x in written)


@pytest.mark.parametrize("missing", ["A_log", "dt_bias", "lower_bound"])
def test_flash_kda_adapter_requires_the_raw_gates_parameters(missing):
    """FlashKDA's g is always the raw gate: without A_log, dt_bias or lower_bound kda_prefill would read it as a
    log-decay (another operator), so the adapter refuses the call by the missing name and leaves ``out`` alone."""
    inp = make_inputs([12, 50], key_dim=128, seed=15)
    out = torch.full_like(inp["v"], 5.0)
    gate = {name: None if name == missing else inp[name] for name in ("A_log", "dt_bias", "lower_bound")}
    with pytest.raises(ValueError, match=f"{missing} is required"):
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128 ** -0.5, out, **gate,
                      cu_seqlens=inp["cu_seqlens"])
    assert bool((out == 5.0).all())


@pytest.mark.parametrize("state_v_first", [False, True])
def test_fla_adapter_lower_bound_gate(state_v_first):
    inp = make_inputs([20, 44], seed=16)
    native_o, native_s = call(inp)
    h0 = inp["initial_state"] if state_v_first else inp["initial_state"].transpose(-1, -2).contiguous()
    o, s = fla.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], torch.sigmoid(inp["beta"].float()),
                         initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, safe_gate=True, lower_bound=inp["lower_bound"],
                         state_v_first=state_v_first, cu_seqlens=inp["cu_seqlens"].long(), A_log=inp["A_log"],
                         dt_bias=inp["dt_bias"].reshape(-1))
    assert rel_err(o, native_o) < 1e-2
    s = s if state_v_first else s.transpose(-1, -2)
    assert s.dtype == torch.float32 and rel_err(s, native_s) < 1e-5


def test_fla_adapter_softplus_gate_and_precomputed_gate():
    inp = make_inputs([64], seed=17)
    A_log, dt_bias = inp["A_log"], inp["dt_bias"]
    a = -A_log.exp()[:, None] * torch.nn.functional.softplus(inp["g"].float() + dt_bias)
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], a, inp["beta"], initial_state=inp["initial_state"],
                                 cu_seqlens=inp["cu_seqlens"])
    h0 = inp["initial_state"].transpose(-1, -2).contiguous()
    common = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, cu_seqlens=inp["cu_seqlens"])
    o, s = fla.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], use_gate_in_kernel=True,
                         A_log=A_log, dt_bias=dt_bias.reshape(-1), **common)
    assert rel_err(o, ref_o) < 4e-3 and rel_err(s.transpose(-1, -2), ref_s) < 1e-5
    o2, s2 = fla.chunk_kda(inp["q"], inp["k"], inp["v"], a, inp["beta"], **common)
    assert torch.equal(o2, o) and torch.equal(s2, s)


@pytest.mark.parametrize("lengths, hint", [([0, 25, 40], None), ([70], None), ([40, 40, 40], 40)])
def test_torch_compile_treats_prefill_as_one_op(lengths, hint):
    """Varlen, and run as rows (one sequence; a hint of equal lengths): the compiled graph gives the eager bits."""
    inp = make_inputs(lengths, seed=18)
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], output_final_state=True,
              max_seqlen=hint)

    def layer(q, k, v, g, beta):
        o, s = fastkda.kda_prefill(q, k, v, g, beta, **kw)
        return o * 2, s

    compiled = torch.compile(layer, fullgraph=True)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    o, s = compiled(*args)
    eager_o, eager_s = layer(*args)
    assert torch.equal(o, eager_o) and torch.equal(s, eager_s)


@pytest.mark.parametrize("sequence_parallel", ["auto", 64])
def test_prefill_compiles_with_dynamic_shapes(sequence_parallel):
    """``torch.compile(dynamic=True)`` traces with symbolic sizes, which no plan is made from (the op chooses it):
    the compiled prefill gives the eager bits at two lengths, forced segments too."""
    import torch._dynamo

    torch._dynamo.reset()
    kw = dict(sequence_parallel=sequence_parallel)
    compiled = torch.compile(lambda *a: fastkda.kda_prefill(*a, **kw)[0], backend="eager", fullgraph=True,
                             dynamic=True)
    for length in (64, 100):
        inp = make_inputs([length], seed=21, varlen=False, with_initial=False)
        args = [inp[x] for x in ("q", "k", "v")] + [-inp["g"].float().abs(), inp["beta"]]
        assert torch.equal(compiled(*args), fastkda.kda_prefill(*args, **kw)[0])


@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_prefill_keeps_one_graph_over_new_lengths_and_batches(varlen):
    """A plan chosen while tracing would be a constant of the graph, which then guards on every size it was made
    from: a recompile per new length or batch, and ``fullgraph`` fails at torch's limit of 8. The op chooses it
    from the sizes it runs on (:func:`fastkda.plan.prefill_plan_request`): eleven shapes take three graphs at most (the
    first, one with dynamic sizes, and one where torch specialises a size of 1), each call the eager bits."""
    import torch._dynamo

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda *a, **kw: fastkda.kda_prefill(*a, **kw), backend=counter, fullgraph=True)
    for count, length in enumerate(range(40, 40 + 11 * 60, 60)):
        lengths = [length // 2, 0, length][:count % 3 + 1] if varlen else [length] * (count % 3 + 1)
        check_compiled_prefill(compiled, make_inputs(lengths, seed=22 + count, varlen=varlen))
    assert counter.graphs <= 3


@pytest.mark.parametrize("gate, options", [
    ("lower_bound", dict()), ("precomputed", dict(sequence_parallel=64)),
    ("lower_bound", dict(sequence_parallel=False)), ("precomputed", dict(hint=True)),
    ("lower_bound", dict(hint=True, sequence_parallel=32))])
def test_a_compiled_prefill_s_op_builds_the_eager_plan(gate, options, monkeypatch):
    """The plan the op builds under torch.compile, recorded, is the one an eager call of the same sizes and choices
    makes (on the CPU the bits cannot tell: most of a plan's numbers do not change them): varlen batches of a
    changing count and length, both gates, forced or no segments, and a ``max_seqlen`` hint that changes with each
    call (a symbolic int in the trace, which must not be formatted there)."""
    import torch._dynamo

    from fastkda import api

    torch._dynamo.reset()
    built = []
    choose = api.requested_prefill_plan
    monkeypatch.setattr(api, "requested_prefill_plan", lambda *a, **kw: built.append(choose(*a, **kw)) or built[-1])
    hint = options.get("hint")
    choices = {k: v for k, v in options.items() if k != "hint"}
    counter = CompileCounter()
    compiled = torch.compile(lambda *a, **kw: fastkda.kda_prefill(*a, **kw)[0], backend=counter, fullgraph=True)
    for count, length in enumerate((40, 72, 100, 160, 200)):
        lengths = [length] * (count % 3 + 1)
        inp = make_inputs(lengths, seed=50 + count, gate=gate)
        args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
        kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                  cu_seqlens=inp["cu_seqlens"], max_seqlen=length if hint else None, **choices)
        assert torch.equal(compiled(*args, **kw), fastkda.kda_prefill(*args, **kw)[0])
        want = fastkda.choose_plan(len(lengths), 2, sum(lengths), 64, 64, 1, lower_bound_gate=gate == "lower_bound",
                                   max_seqlen=kw["max_seqlen"], **choices)
        assert built[-1] == want and built[-1].reason == want.reason
    assert len(built) == 5 and counter.graphs <= 3


def test_compiled_decode_keeps_one_graph_over_new_batches():
    """Decode's plan likewise (its warps follow the programs, so the sequences): eleven batch sizes take three
    graphs at most (as above), each step the eager step's bits and pool."""
    import torch._dynamo

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda *a, **kw: fastkda.kda_decode(*a, **kw), backend=counter, fullgraph=True)
    for num_seqs in range(1, 12):
        inp = make_inputs([1] * num_seqs, heads=2, varlen=False, seed=40 + num_seqs)
        pools = [torch.randn(num_seqs + 1, 2, 64, 64, generator=torch.Generator().manual_seed(num_seqs))
                 for _ in range(2)]
        slots = torch.arange(num_seqs, 0, -1, dtype=torch.int32)
        args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
        gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
        assert torch.equal(compiled(*args, pools[0], slots, **gate), fastkda.kda_decode(*args, pools[1], slots, **gate))
        assert torch.equal(pools[0], pools[1])
    assert counter.graphs <= 3


def test_compiled_conv_and_norm_keep_one_graph_over_new_lengths():
    """Validation remembered by sizes would make the trace guard on each size (a recompile per new length, and
    torch.compile's limit of 8 ends a ``fullgraph`` program at the 9th): compiled, the conv and the norm take a
    new length each call, past that limit, giving the eager bits."""
    import torch._dynamo

    torch._dynamo.reset()
    weight = torch.randn(96, 4)
    conv = torch.compile(lambda x: fastkda.causal_conv1d(x, weight), backend="eager", fullgraph=True)
    norm = torch.compile(lambda x: fastkda.gated_rmsnorm(x, x, weight[:, 0], 1e-5), backend="eager", fullgraph=True)
    for length in range(1, 12):
        x = torch.randn(length, 96)
        assert torch.equal(conv(x), fastkda.causal_conv1d(x, weight))
        assert torch.equal(norm(x), fastkda.gated_rmsnorm(x, x, weight[:, 0], 1e-5))


@pytest.mark.parametrize("setting, on", [("1", True), ("TRUE", True), (" on", True), ("yes", True), ("0", False),
                                         ("false", False), ("Off", False), ("", False)])
def test_the_checks_switch_takes_the_usual_spellings(setting, on, monkeypatch):
    """$FASTKDA_CHECKS takes the usual spellings of on and off (a NaN is then refused, or not)."""
    monkeypatch.setenv("FASTKDA_CHECKS", setting)
    inp = make_inputs([20], seed=20)
    inp["q"].view(-1)[3] = float("nan")
    if on:
        with pytest.raises(ValueError, match="q must be finite"):
            call(inp)
    else:
        call(inp)


@pytest.mark.parametrize("setting", ["ture", "2", "enabled"])
def test_a_misspelt_checks_switch_is_refused(setting, monkeypatch):
    """A safety switch that a typo turned off would fail silently: anything else is refused by name."""
    monkeypatch.setenv("FASTKDA_CHECKS", setting)
    with pytest.raises(ValueError, match="FASTKDA_CHECKS must be one of"):
        call(make_inputs([20], seed=20))


def test_eager_calls_skip_the_dispatcher_and_compiled_ones_use_the_op(monkeypatch):
    """Eager calls run the implementation directly (the custom-op dispatcher costs tens of µs per call);
    torch.compile still sees the opaque op (the compile test above fails without it)."""
    from fastkda import api

    inp = make_inputs([0, 25, 40], seed=19)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"])
    expected, _ = fastkda.kda_prefill(*args, **kw)

    def dispatched(*_):
        raise AssertionError("eager call went through the dispatcher")
    monkeypatch.setattr(api, "_prefill_op", dispatched)
    assert torch.equal(fastkda.kda_prefill(*args, **kw)[0], expected)


def test_bad_sequence_parallel_arguments_are_rejected():
    """``sequence_parallel`` and its ``max_seqlen`` hint: bad values raise naming them; with a plan given, only
    ``"auto"`` (the plan holds the segments)."""
    from helpers import plan_for

    inp = make_inputs([40, 30], seed=61)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"])
    for name, bad in (("sequence_parallel", 48), ("sequence_parallel", True), ("max_seqlen", -1),
                      ("max_seqlen", 2.5)):
        with pytest.raises(ValueError, match=name):
            fastkda.kda_prefill(*args, **kw, **{name: bad})
    with pytest.raises(ValueError, match="sequence_parallel"):
        fastkda.kda_prefill(*args, **kw, plan=plan_for(inp, sms=1), sequence_parallel=64)
    for hint in (50, -1, "abc"):  # the plan was made from its own hint (was: ignored, even a hint offsets refute)
        with pytest.raises(ValueError, match="max_seqlen must be None when a plan is given"):
            fastkda.kda_prefill(*args, **kw, plan=plan_for(inp, sms=1), max_seqlen=hint)


def test_remembered_validation_keys_each_argument_with_its_type():
    """Validation is remembered per signature of the arguments, and True == 1 == 1.0: a valid scale of 1 let a
    later scale=True through (refused by name in a fresh process)."""
    inp = make_inputs([40], seed=62)
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"])
    fastkda.kda_prefill(*args, **kw, scale=1)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        fastkda.kda_prefill(*args, **kw, scale=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the counters of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "meta"])
def test_error_counts_name_a_device_they_cannot_read(device):
    """Without CUDA (or on a meta device) the counters' device is refused by name, not by torch's assertion; the
    default device is then the CPU's (whose path raises for bad values, so its counts stay zero), so code written
    for a GPU runs."""
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        fastkda.error_counts(device)
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        fastkda.reset_error_counts(device)
    fastkda.reset_error_counts("cpu")
    assert fastkda.error_counts() == {"slot": 0, "accepted": 0, "cu_seqlens": 0}  # the interpreter's counters
    counters("cpu")[1] = 2  # as a kernel under the interpreter would count
    assert fastkda.error_counts()["accepted"] == 2
    fastkda.reset_error_counts()
    assert fastkda.error_counts("cpu")["accepted"] == 0


def test_a_hint_of_equal_lengths_needs_offsets_that_agree():
    """N·max_seqlen = T runs the sequences as rows: the CPU path gives what the call without the hint gives, a
    caller's plan made with the hint fits the call, and offsets that give another length raise naming max_seqlen
    (on CPU tensors always), before anything is written."""
    from helpers import plan_for

    inp = make_inputs([40, 40, 40], seed=62)
    want_o, want_s = call(inp)
    o, s = call(inp, max_seqlen=40)
    assert torch.equal(o, want_o) and torch.equal(s, want_s)
    plan = plan_for(inp, sms=1, max_seqlen=40)
    assert plan.equal_rows
    o, s = call(inp, plan=plan)
    assert torch.equal(o, want_o) and torch.equal(s, want_s)
    inp["cu_seqlens"] = torch.tensor([0, 30, 80, 120], dtype=inp["cu_seqlens"].dtype)
    out = torch.full_like(inp["v"], float("nan"))
    wrong = "cu_seqlens must be offsets that give every sequence 40 tokens.*max_seqlen.*sequence 1 of 50"
    with pytest.raises(ValueError, match=wrong):
        call(inp, max_seqlen=40, out=out)
    assert out.isnan().all()
    call(inp, max_seqlen=50)  # N·max_seqlen != T: a hint for the plan only


def test_open_entry_prefill_equals_the_prefill_from_its_entry():
    """The two halves of a prefill whose entry state comes later (several segments, K != V, two rows, bf16 entry)
    give what kda_prefill gives from that entry state, and its map gives the final state of any entry; the second
    half runs again with another entry; no tokens: the identity map."""
    inp = make_inputs([200, 200], varlen=False, key_dim=64, value_dim=128, gate="weak", seed=11)
    inp["beta"] = inp["beta"] - 3.0  # the entry outlives the tokens, so a wrong map shows
    tensors = [inp[name] for name in ("q", "k", "v", "g", "beta")]
    opened = fastkda.kda_prefill_open(*tensors, sequence_parallel=64)
    assert opened.plan.segment_tokens == 64 and opened.exit_map.shape == (2, 2, 192, 64)
    for entry in (inp["initial_state"], torch.randn(2, 2, 128, 64).to(torch.bfloat16)):
        want_o, want_s = fastkda.kda_prefill(*tensors, initial_state=entry, output_final_state=True)
        o, state = opened.finish(entry)
        assert rel_err(o, want_o) < 1e-3 and rel_err(state, want_s) < 1e-5  # o: bf16, rounded once here and there
        mapped = entry.float() @ opened.exit_map[:, :, 128:] + opened.exit_map[:, :, :128]
        assert rel_err(mapped, want_s) < 1e-5
        _, alone = fastkda.kda_prefill(*tensors, output_final_state=True)
        assert rel_err(alone, want_s) > 0.1  # the entry matters
    empty = fastkda.kda_prefill_open(*(x[:, :0] for x in tensors))
    entry = inp["initial_state"]
    assert torch.equal(empty.exit_map[:, :, 128:], torch.eye(64).expand(2, 2, 64, 64))
    assert not empty.exit_map[:, :, :128].any()
    o, state = empty.finish(entry)
    assert o.shape == (2, 0, 2, 128) and torch.equal(state, entry)


def test_open_entry_prefill_rejects_bad_arguments():
    inp = make_inputs([64], varlen=False, seed=12)
    tensors = [inp[name] for name in ("q", "k", "v", "g", "beta")]
    gate = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    with pytest.raises(ValueError, match="sequence_parallel"):
        fastkda.kda_prefill_open(*tensors, **gate, sequence_parallel=False)
    with pytest.raises(ValueError, match="beta"):
        fastkda.kda_prefill_open(*tensors[:4], tensors[4][:, :3], **gate)
    opened = fastkda.kda_prefill_open(*tensors, **gate)
    with pytest.raises(ValueError, match="entry_state"):
        opened.finish(torch.zeros(1, 2, 64, 32))
    with pytest.raises(ValueError, match="entry_state"):
        opened.finish(torch.zeros(1, 2, 64, 64, dtype=torch.float16))
    checked = fastkda.kda_prefill_open(*tensors, **gate, checks=True)
    with pytest.raises(ValueError, match="entry_state"):
        checked.finish(torch.full((1, 2, 64, 64), float("nan")))
    o, state = opened.finish()  # no entry: from zeros
    want_o, want_s = fastkda.kda_prefill(*tensors, **gate, output_final_state=True)
    assert rel_err(o, want_o) < 1e-3 and rel_err(state, want_s) < 1e-5


def test_a_gluon_plan_is_refused_on_a_gpu_without_warpgroup_mma(monkeypatch):
    """The plan's Gluon recurrence compiles only for Hopper (sm_90): elsewhere the call names the plan, before any
    kernel would fail to compile; the CPU path and a Hopper GPU take it."""
    import types

    from fastkda import api
    from helpers import make_inputs, plan_for

    plan = plan_for(make_inputs([100], heads=2, key_dim=64, value_dim=128), v_slices=2).replace(
        warpgroup_recurrence=True, recurrence_stages=4)
    on_gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(api, "has_warpgroup_mma", lambda index: False)
    with pytest.raises(ValueError, match=r"plan.*warpgroup_recurrence=True on compute capability 8\.0"):
        api._check_plan_runs_here(plan, on_gpu)
    segmented = plan_for(make_inputs([100], heads=2, key_dim=64, value_dim=128), v_slices=2,
                         sequence_parallel=64).replace(warpgroup_transition=True, transition_stages=4)
    with pytest.raises(ValueError, match=r"plan.*warpgroup_transition=True on compute capability 8\.0"):
        api._check_plan_runs_here(segmented, on_gpu)
    api._check_plan_runs_here(plan, torch.zeros(1))  # the CPU path
    api._check_plan_runs_here(plan.replace(warpgroup_recurrence=False, recurrence_stages=3), on_gpu)
    monkeypatch.setattr(api, "has_warpgroup_mma", lambda index: True)
    api._check_plan_runs_here(plan, on_gpu)


def test_cpu_paths_inside_autocast_compute_as_outside():
    """A caller's ``torch.autocast`` region (a model run under autocast) leaves the CPU paths and the references
    computing in their own dtypes: the same results as outside it, where autocast's bf16 products broke the CPU
    prefill's fp32 updates."""
    inp = make_inputs([40, 9])
    lengths = inp.pop("cu_seqlens")
    heads, key_dim = inp["q"].shape[2], inp["q"].shape[3]
    pool = torch.randn(3, heads, key_dim, key_dim)
    mixed = torch.randn(2, 12)
    calls = {
        "kda_prefill": lambda: fastkda.kda_prefill(**inp, cu_seqlens=lengths, output_final_state=True),
        "kda_chunked": lambda: fastkda.kda_chunked(**inp, cu_seqlens=lengths),
        "kda_reference": lambda: kda_reference(**make_inputs([5, 4], seed=1)),
        "kda_decode": lambda: fastkda.kda_decode(
            *(inp[n][:, :2].transpose(0, 1) for n in ("q", "k", "v", "g", "beta")), pool.clone(),
            torch.tensor([0, 2], dtype=torch.int32), A_log=inp["A_log"], dt_bias=inp["dt_bias"],
            lower_bound=inp["lower_bound"]),
        "causal_conv1d": lambda: fastkda.causal_conv1d(mixed[None], torch.randn(12, 4, generator=torch.Generator()
                                                                                .manual_seed(1))),
        "gated_rmsnorm": lambda: fastkda.gated_rmsnorm(mixed, mixed.flip(0), torch.ones(12)),
    }
    for name, call in calls.items():
        want = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call()
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name

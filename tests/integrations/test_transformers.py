"""fastkda.integrations.transformers on the CPU: transformers' tiny Kimi-Linear and GLM-5.3-Flash models give the
same logits (fp32, 1e-5 relative L2) and greedy tokens with and without fastkda, left padding included; in bf16 the
logits stay as close to the fp32 ones as transformers' own bf16 path keeps them."""

import warnings

import pytest
import torch

from helpers import rel_err

pytest.importorskip("transformers")

import fastkda.integrations.transformers as fastkda_transformers  # noqa: E402
from fastkda.integrations.tiny_models import MODEL_KINDS, tiny_model  # noqa: E402


@pytest.fixture
def routed():
    """Runs a test body with ``fastkda_transformers`` off; the body turns it on; off again afterwards."""
    fastkda_transformers.disable()
    yield fastkda_transformers
    fastkda_transformers.disable()


def prompts(batch, length, seed=0):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :7] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("batch,length", [(1, 64), (2, 64), (2, 2048)])
def test_fp32_logits_and_greedy_tokens_match(routed, kind, batch, length):
    model = tiny_model(kind)
    ids, mask = prompts(batch, length)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        want_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert any(kind in name for name in routed.enable())
        got = model(ids, attention_mask=mask).logits
        got_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_bf16_logits_no_farther_from_fp32(routed, kind):
    """Dense MLPs: with the tiny MoE, one expert choice flipped by rounding moves the logits more than any kernel."""
    ids, mask = prompts(2, 256, seed=1)
    with torch.no_grad():
        exact = tiny_model(kind, moe=False)(ids, attention_mask=mask).logits
        model = tiny_model(kind, moe=False, dtype=torch.bfloat16)
        theirs = rel_err(model(ids, attention_mask=mask).logits, exact)
        routed.enable()
        ours = rel_err(model(ids, attention_mask=mask).logits, exact)
    assert ours <= theirs * 1.05, (ours, theirs)


def test_disable_restores_transformers_functions(routed):
    """Every replaced function of both models' modules, and each gated norm's forward, is transformers' own object
    again after disable(), also after enable() twice."""
    import importlib

    modules = {name: importlib.import_module(name) for name in fastkda_transformers.MODELS}
    names = list(fastkda_transformers.REPLACEMENTS)

    def current():
        return [getattr(module, name) for module in modules.values() for name in names] + [
            getattr(module, norm).forward for module, norm in zip(modules.values(),
                                                                  fastkda_transformers.MODELS.values())]
    original = current()
    routed.enable()
    routed.enable()  # twice: still one set of originals
    module = modules["transformers.models.kimi_linear.modeling_kimi_linear"]
    assert module.chunk_kimi_delta_attention.__wrapped__ is fastkda_transformers.chunk_kimi_delta_attention
    assert not any(a is b for a, b in zip(current(), original))
    routed.disable()
    assert all(a is b for a, b in zip(current(), original))
    assert not routed.enabled()


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_generation_runs_every_layer_function_through_fastkda(routed, kind, monkeypatch):
    """The logit tests compare with transformers' own path, which an unrouted function would pass too: here each
    of fastkda's five functions the integration calls (prefill and decode KDA, the conv and its update, the gated
    norm) is seen running during a generation."""
    calls = set()
    for name in ("kda_prefill", "kda_decode", "causal_conv1d", "causal_conv1d_update", "gated_rmsnorm"):
        function = getattr(fastkda_transformers, name)
        monkeypatch.setattr(fastkda_transformers, name,
                            lambda *a, _function=function, _name=name, **kw: calls.add(_name) or _function(*a, **kw))
    routed.enable()
    ids, mask = prompts(2, 64)
    with torch.no_grad():
        tiny_model(kind).generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert calls == {"kda_prefill", "kda_decode", "causal_conv1d", "causal_conv1d_update", "gated_rmsnorm"}


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_gradients_reach_the_kda_layers_when_autograd_records(routed, kind, monkeypatch):
    """fastkda is inference-only: a backward pass with it enabled gives every parameter transformers' own
    gradient (its functions run where autograd records, with a warning), not a silently frozen KDA layer; without
    grad mode fastkda runs."""
    model = tiny_model(kind, moe=False)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    routed.enable()
    with pytest.warns(UserWarning, match="inference-only"):
        model(ids, labels=ids).loss.backward()
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and any("A_log" in name for name in got)
    assert all(torch.equal(got[name], want[name]) for name in want)
    calls = []
    prefill = fastkda_transformers.kda_prefill
    monkeypatch.setattr(fastkda_transformers, "kda_prefill", lambda *a, **kw: calls.append(1) or prefill(*a, **kw))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        model(ids)
    assert calls


@pytest.mark.parametrize("options, reason", [(dict(head_dim=32), "head dimensions K=32, V=32"),
                                             (dict(dtype=torch.float64, moe=False), "torch.float64 inputs")],
                         ids=["head_dim 32", "float64"])
def test_a_model_the_kernels_do_not_take_runs_transformers_path(routed, options, reason):
    """enable() covers every Kimi-Linear model: one whose head dimension (32) or dtype (float64) the kernels do
    not take runs transformers' own functions, with a warning naming why, and generates what it generates
    without fastkda."""
    model = tiny_model("kimi_linear", **options)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
        routed.enable()
        with pytest.warns(UserWarning, match=reason):
            got = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("columns,tokens", [(4, 1), (4, 3), (4, 5), (6, 1), (6, 3)])
def test_conv_update_keeps_transformers_state_layout(columns, tokens):
    """transformers keeps the last S >= W inputs as the conv state, fastkda's update the last W − 1: the whole
    state shifts by the new tokens (the older columns from the old state, or from the new tokens once they
    outnumber W − 1), and each output is the conv over the W inputs up to its token."""
    gen = torch.Generator().manual_seed(columns + tokens)
    x, state, weight = (torch.randn(2, 6, tokens, generator=gen), torch.randn(2, 6, columns, generator=gen),
                        torch.randn(6, 4, generator=gen))
    inputs = torch.cat([state, x], -1)
    want = torch.nn.functional.silu((inputs.unfold(-1, 4, 1)[..., -tokens:, :] * weight[:, None]).sum(-1))
    got = fastkda_transformers.causal_conv1d_update_fn(x, state, weight, None, "silu")
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(state, inputs[..., -columns:])


def test_decode_step_leaves_the_given_state_as_it_was():
    """The state as transformers' cache keeps it after fastkda's prefill (a K-first view of a V-first tensor) and a
    K-first contiguous one are both left as they were (transformers' cache keeps the state before each step for
    ``crop``), and both give the same output and final state."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 1, 2, 64, generator=gen) for _ in range(3))
    g, beta = -torch.rand(2, 1, 2, 64, generator=gen), torch.rand(2, 1, 2, generator=gen)
    v_first = torch.randn(2, 2, 64, 64, generator=gen)
    k_first = v_first.transpose(-1, -2).contiguous()
    cached = v_first.clone().transpose(-1, -2)
    step = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, final = fastkda_transformers.recurrent_kimi_delta_attention(q, k, v, initial_state=cached, **step)
    o_copy, final_copy = fastkda_transformers.recurrent_kimi_delta_attention(q, k, v, initial_state=k_first, **step)
    assert torch.equal(cached, v_first.transpose(-1, -2)) and torch.equal(k_first, v_first.transpose(-1, -2))
    assert torch.equal(o, o_copy) and torch.equal(final, final_copy) and not torch.equal(final, cached)
    from torch import _dynamo

    _dynamo.reset()  # compiled (fullgraph), the same: the copy decided by layout, the slots made in the graph
    compiled = torch.compile(fastkda_transformers.recurrent_kimi_delta_attention, backend="eager", fullgraph=True)
    with warnings.catch_warnings():  # dynamo traces a cached function only with a warning: an error here
        warnings.simplefilter("error")
        o_compiled, final_compiled = compiled(q, k, v, initial_state=cached, **step)
    assert torch.equal(cached, v_first.transpose(-1, -2))
    assert torch.equal(o_compiled, o) and torch.equal(final_compiled, final)


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("keep, drafts", [(4, "one forward"), (1, "one token a forward")])
def test_crop_after_drafts_gives_the_recomputed_logits(routed, kind, keep, drafts):
    """Assisted and speculative decoding's rollback: four draft tokens (in one forward, or one a forward), two of
    them kept by ``crop``, then the next token's logits equal a forward of the kept tokens from scratch, as with
    transformers' own path."""
    model = tiny_model(kind, moe=False)
    gen = torch.Generator().manual_seed(3)
    ids, new, nxt = (torch.randint(3, 128, (1, n), generator=gen) for n in (10, 4, 1))
    routed.enable()
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        cache.activate_past_recording(recurrent_states_to_keep=keep)
        for part in ([new] if drafts == "one forward" else new.split(1, dim=1)):
            model(part, past_key_values=cache, use_cache=True)
        cache.crop(-2)
        logits = model(nxt, past_key_values=cache, use_cache=True).logits
        whole = model(torch.cat([ids, new[:, :2], nxt], 1)).logits[:, -1:]
    assert rel_err(logits, whole) < 1e-5


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_model_run_under_autocast_runs_fastkda(routed, kind, monkeypatch):
    """A model run inside ``torch.autocast`` (bf16 on the CPU) runs fastkda's functions, whose CPU path computes
    in fp32 whatever autocast does around it, and its logits stay as close to the fp32 ones as transformers' own
    path under autocast keeps them."""
    model = tiny_model(kind, moe=False)
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(5))
    calls = []
    prefill = fastkda_transformers.kda_prefill
    monkeypatch.setattr(fastkda_transformers, "kda_prefill", lambda *a, **kw: calls.append(1) or prefill(*a, **kw))
    with torch.no_grad():
        exact = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = rel_err(model(ids).logits, exact)
            routed.enable()
            ours = rel_err(model(ids).logits, exact)
    assert calls and ours <= theirs * 1.05, (ours, theirs)


def _set_conv(model, activation=None, width=None):
    """Every KDA layer's conv given another activation (transformers reads ``config.hidden_act``) or kernel size."""
    for module in model.modules():
        conv = getattr(module, "conv1d", None)
        if isinstance(conv, torch.nn.Conv1d):
            if activation is not None:
                module.activation = activation
            if width is not None:
                module.conv1d = torch.nn.Conv1d(conv.in_channels, conv.out_channels, width, groups=conv.groups,
                                                padding=width - 1, bias=conv.bias is not None)


@pytest.mark.parametrize("activation, width, reason", [("swish", None, None),
                                                       ("gelu", None, "the conv's activation 'gelu'"),
                                                       (None, 9, "a conv kernel size of 9")])
def test_a_conv_fastkda_does_not_take_runs_transformers_conv(routed, activation, width, reason, monkeypatch):
    """transformers' name "swish" for SiLU runs fastkda's conv; an activation or a kernel size fastkda's conv does
    not take runs transformers' own conv, with a warning naming why, and the model generates what it generates
    without fastkda."""
    model = tiny_model("kimi_linear", moe=False)
    _set_conv(model, activation, width)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(6))
    calls = []
    conv = fastkda_transformers.causal_conv1d
    monkeypatch.setattr(fastkda_transformers, "causal_conv1d", lambda *a, **kw: calls.append(1) or conv(*a, **kw))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
        routed.enable()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    fastkda_warnings = [str(w.message) for w in seen if "fastkda" in str(w.message)]
    assert torch.equal(got, want)
    if reason is None:
        assert calls and not fastkda_warnings
    else:
        assert not calls and fastkda_warnings and all(reason in w for w in fastkda_warnings), fastkda_warnings


def test_packed_sequences_keep_apart_in_the_conv(routed):
    """The model's forward passes packed sequences' ``cu_seqlens`` to the conv as to the KDA call: each sequence's
    conv starts from zeros, as it does run alone; ``seq_idx`` (which fastkda's conv does not take) runs
    transformers' conv, with a warning."""
    import transformers.models.kimi_linear.modeling_kimi_linear as modeling

    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(1, 12, 40, generator=gen), torch.randn(12, 4, generator=gen)
    cu_seqlens = torch.tensor([0, 17, 17, 40], dtype=torch.int32)
    alone = [fastkda_transformers.causal_conv1d_fn(x[..., a:b], weight, None, "silu")
             for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if b > a]
    routed.enable()
    with torch.no_grad():
        packed = modeling.causal_conv1d_fn(x, weight, None, activation="silu", cu_seqlens=cu_seqlens)
        assert torch.equal(packed, torch.cat(alone, -1))
        with pytest.warns(UserWarning, match="seq_idx"), pytest.raises(ValueError, match="packed sequences"):
            modeling.causal_conv1d_fn(x, weight, None, activation="silu", seq_idx=torch.zeros(1, 40, dtype=torch.int32))


def test_kda_functions_take_transformers_positional_arguments():
    """transformers' KDA functions take g and β (and the prefill's chunk size, the decode's state and flag) by
    position: fastkda's take them in the same places."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 5, 2, 64, generator=gen) for _ in range(3))
    g, beta = -torch.rand(2, 5, 2, 64, generator=gen), torch.rand(2, 5, 2, generator=gen)
    state = torch.randn(2, 2, 64, 64, generator=gen)
    by_name = fastkda_transformers.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=state,
                                                             output_final_state=True)
    by_place = fastkda_transformers.chunk_kimi_delta_attention(q, k, v, g, beta, 64, state, True)
    assert all(torch.equal(a, b) for a, b in zip(by_name, by_place))
    one = (q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    by_name = fastkda_transformers.recurrent_kimi_delta_attention(*one[:3], g=one[3], beta=one[4],
                                                                 initial_state=state, output_final_state=True)
    by_place = fastkda_transformers.recurrent_kimi_delta_attention(*one, state, True)
    assert all(torch.equal(a, b) for a, b in zip(by_name, by_place))

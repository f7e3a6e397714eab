"""fastkda inside transformers' own KDA models: Kimi-Linear (``kimi_linear``) and GLM-5.3-Flash (``glm5_next``).

``enable()`` makes every such model, built before or after the call, run its KDA prefill and decode, its short
causal conv (prefill and decode update) and its gated RMSNorm through fastkda; ``disable()`` puts transformers' own
functions back. transformers looks these up at call time as module globals of each modeling module
(``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``, ``causal_conv1d_fn``, ``causal_conv1d_update``)
and as the gated norm class's ``forward``, so those are what is replaced. Their conventions are handled here:
recurrent states K-first ``[B, H, K, V]`` (fastkda keeps ``[B, H, V, K]``), β already passed through the sigmoid,
conv inputs ``[B, C, T]`` (channel-last views) with a conv state ``[B, C, W]`` of the last W inputs, and extra
keyword arguments that GLM-5.3-Flash forwards (ignored). fastkda is inference-only: where autograd records a call
(grad mode on and a parameter requiring grad: training, and also a plain ``model(...)`` in eval mode, which does
not turn gradients off), transformers' own function runs it instead, with a warning, so that gradients reach the
KDA layers; so does a model whose head dimension the kernels do not take (K, V outside {64, 128}) or whose dtype
they do not (float64). Inference under ``torch.no_grad()``, ``torch.inference_mode()`` or ``generate()`` runs
fastkda.

Precision follows the model's dtype: a bf16 (or fp16) model runs the KDA kernels, whose products take bf16
operands; an fp32 model on a GPU runs fastkda's fp32 chunked path (:func:`fastkda.kda_chunked`, PyTorch on the
GPU), so that its logits match transformers' own fp32 path to fp32 rounding, as they do on a CPU, where every
call takes that path anyway.

    import fastkda.integrations.transformers as fastkda_transformers
    fastkda_transformers.enable()
    model = KimiLinearForCausalLM(config)  # or a model built earlier
    model.generate(...)
"""

import functools
import importlib
import itertools
import warnings

import torch

from ..api import CONV_WIDTHS, causal_conv1d, causal_conv1d_update, gated_rmsnorm, kda_decode, kda_prefill
from ..plan import SUPPORTED_DIMS
from ..reference import kda_chunked
from ..validation import FLOAT_DTYPES, autograd_records, capturing

MODELS = {  # modeling module -> its gated norm class
    "transformers.models.kimi_linear.modeling_kimi_linear": "KimiLinearRMSNormGated",
    "transformers.models.glm5_next.modeling_glm5_next": "Glm5NextTextRMSNormGated",
}

_replaced = {}  # (module name, attribute) -> transformers' original, while enabled


def _v_first(state):
    return None if state is None else state.transpose(-1, -2).contiguous()


def _sequence_slots(batch, device):
    """Pool rows ``0 .. B−1`` (int32), the slots of transformers' per-sequence states: made once per batch size and
    device (fastkda only reads them, and an eager decode step's host time is what it launches), except while a CUDA
    graph is captured, where a new tensor belongs to the graph's private memory pool and must not outlive it, and
    while torch.compile traces, where the graph makes its own (and the capture check cannot be traced)."""
    if torch.compiler.is_compiling() or capturing(device):
        return torch.arange(batch, dtype=torch.int32, device=device)
    return _kept_sequence_slots(batch, device)


@functools.lru_cache(maxsize=64)
def _kept_sequence_slots(batch, device):
    return torch.arange(batch, dtype=torch.int32, device=device)


def _fp32_on_gpu(q):
    return q.dtype == torch.float32 and q.is_cuda


def chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """transformers' prefill KDA call on :func:`fastkda.kda_prefill` (fp32 on a GPU: :func:`fastkda.kda_chunked`,
    the module docstring), with its function's parameters in its order: q, k, v ``[B, T, H, D]`` (views), g the
    log-decay, β after its sigmoid, states ``[B, H, K, V]``; ``chunk_size`` is unread (fastkda's plan chooses its
    chunks, with the same results). Returns ``(o, final state [B, H, K, V] fp32 or None)``."""
    options = dict(initial_state=_v_first(initial_state), cu_seqlens=cu_seqlens,
                   use_qk_l2norm=use_qk_l2norm_in_kernel, use_beta_sigmoid=False)
    if _fp32_on_gpu(q):
        o, final = kda_chunked(q, k, v, g, beta, **options)
        final = final if output_final_state else None
    else:
        o, final = kda_prefill(q, k, v, g, beta, output_final_state=output_final_state, **options)
    return o, None if final is None else final.transpose(-1, -2)


def recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, **unused):
    """transformers' decode KDA call (one token per sequence from its state) on :func:`fastkda.kda_decode`, the
    states as a pool of one row per sequence; arguments and result as :func:`chunk_kimi_delta_attention`.

    The given state is left as it was, as transformers' own function leaves it: its cache keeps the state before
    each step (for ``crop`` in assisted and speculative decoding, it clones the cache's state after the forward,
    and a prefill of several tokens keeps each step's returned state), so the step decodes a V-first copy and
    returns that copy K-first. transformers keeps the prefill's K-first view of a V-first state, so its copy back
    into the cache is one contiguous copy."""
    if initial_state is None or _fp32_on_gpu(q):
        return chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    v_first = initial_state.transpose(-1, -2)
    pool = v_first.contiguous()
    if pool.dtype != torch.float32:
        pool = pool.float()
    elif v_first.is_contiguous():
        # a K-first view of V-first memory: contiguous() gave the caller's own tensor (asked by layout, not by
        # address, which torch.compile cannot trace)
        pool = pool.clone()
    o = kda_decode(q, k, v, g, beta, pool, _sequence_slots(q.shape[0], q.device), use_qk_l2norm=use_qk_l2norm_in_kernel,
                   use_beta_sigmoid=False)
    return o, pool.transpose(-1, -2) if output_final_state else None


SILU_NAMES = ("silu", "swish")  # transformers' names (``ACT2FN``) of x·σ(x), the conv's and the norm's


def _fastkda_activation(activation):
    """fastkda's name of an activation transformers names: ``"swish"`` is SiLU."""
    return "silu" if activation in SILU_NAMES else activation


def causal_conv1d_fn(x, weight, bias=None, activation=None, cu_seqlens=None, **unused):
    """transformers' prefill conv: x ``[B, C, T]``, weight ``[C, W]``; returns ``[B, C, T]`` (a view of a
    token-major output, so the q/k/v split after it needs no copy). Packed sequences (``cu_seqlens``, which the
    model's forward passes on, B = 1) each start from zeros, as they do in the KDA call after it."""
    tokens = x.transpose(1, 2)
    if cu_seqlens is not None:  # fastkda's packed tokens are [T, C] (B > 1 stays, and is refused there)
        return causal_conv1d(tokens.squeeze(0), weight, bias, cu_seqlens=cu_seqlens,
                             activation=_fastkda_activation(activation)).T.unsqueeze(0)
    return causal_conv1d(tokens, weight, bias, activation=_fastkda_activation(activation)).transpose(1, 2)


def causal_conv1d_update_fn(x, conv_state, weight, bias=None, activation=None, **unused):
    """transformers' decode conv: x ``[B, C, T]``, its conv state ``[B, C, S]`` (S >= W − 1, the last S inputs,
    oldest first; transformers keeps S = W) updated in place, every column shifted by the new tokens, as fastkda's
    update does it; returns ``[B, C, T]``."""
    out = causal_conv1d_update(x.transpose(1, 2), conv_state, weight, bias,
                               slots=_sequence_slots(x.shape[0], x.device), activation=_fastkda_activation(activation))
    return out.transpose(1, 2)


def _needs_gradient(args, kwargs):
    """Whether autograd records this call (:func:`fastkda.validation.autograd_records`) on its tensor arguments
    or a module argument's own parameters (the norm's weight)."""
    if not torch.is_grad_enabled():  # generate(), no_grad and inference_mode: the common case, decided at once
        return False
    given = (*args, *kwargs.values())
    return autograd_records(itertools.chain(given, *(x.parameters(recurse=False) for x in given
                                                     if isinstance(x, torch.nn.Module))))


def _unsupported_dtype(*args, **kwargs):
    """Why fastkda cannot take the dtype of a call's first tensor argument (the conv's x, the norm's hidden states
    after its module; None where it can): float64 and anything else outside bf16, fp16 and fp32."""
    first = next((x for x in args if isinstance(x, torch.Tensor)), None)
    if first is not None and first.dtype not in FLOAT_DTYPES:
        return f"{first.dtype} inputs (fastkda takes bf16, fp16 and fp32)"
    return None


def _unsupported_conv_weights(weight, activation):
    """Why fastkda's conv cannot take this kernel or activation (None where it can)."""
    if activation is not None and activation not in SILU_NAMES:
        return f"the conv's activation {activation!r} (fastkda's conv applies SiLU or none)"
    if weight.shape[-1] not in CONV_WIDTHS:
        return f"a conv kernel size of {weight.shape[-1]} (fastkda's conv takes {CONV_WIDTHS[0]} to {CONV_WIDTHS[-1]})"
    return None


def _unsupported_conv(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """Why fastkda's prefill conv cannot run this call (None where it can): its kernel, activation or dtype, or
    packed sequences marked by ``seq_idx`` (fastkda's conv keeps them apart by ``cu_seqlens``)."""
    if seq_idx is not None:
        return "packed sequences marked by seq_idx (fastkda's conv takes cu_seqlens)"
    return _unsupported_conv_weights(weight, activation) or _unsupported_dtype(x)


def _unsupported_conv_update(x, conv_state, weight, bias=None, activation=None, **kwargs):
    """Why fastkda's conv update cannot run this call (None where it can): its kernel, activation or dtype."""
    return _unsupported_conv_weights(weight, activation) or _unsupported_dtype(x)


def _unsupported_norm(norm, hidden_states, gate=None):
    """Why fastkda's gated norm cannot run this call (None where it can): its gate's activation or the dtype."""
    if gate is not None and norm.activation not in ("sigmoid", *SILU_NAMES):
        return f"the gate's activation {norm.activation!r} (fastkda's gated norm applies sigmoid or SiLU)"
    return _unsupported_dtype(hidden_states)


def _unsupported_kda(q, k, v, *args, **kwargs):
    """Why fastkda's KDA cannot run these q, k, v (None where it can): head dimensions outside
    :data:`fastkda.plan.SUPPORTED_DIMS`, or a dtype it does not take."""
    if q.shape[-1] not in SUPPORTED_DIMS or v.shape[-1] not in SUPPORTED_DIMS:
        return f"head dimensions K={q.shape[-1]}, V={v.shape[-1]} (fastkda runs {SUPPORTED_DIMS})"
    return _unsupported_dtype(q)


GRADIENT_REASON = ("autograd records the call: grad mode is on and parameters require grad (as in training, and in "
                   "a plain model(...) call: eval() does not turn gradients off); fastkda is inference-only, so run "
                   "inference under torch.no_grad() or torch.inference_mode() to use it")


def _inference_or_original(fastkda_function, original, name, unsupported_reason):
    """``fastkda_function`` where no gradient is asked for, transformers' ``original`` where one is: fastkda is
    inference-only (its outputs carry no gradient), and a model trained or differentiated with fastkda enabled must
    not silently leave its KDA layers without gradients. Likewise where ``unsupported_reason(*args, **kwargs)``
    gives one (a model the kernels do not cover still runs). Each fallback warns, naming transformers' ``name``
    (once per reason, Python's default filter)."""
    @functools.wraps(fastkda_function)
    def routed(*args, **kwargs):
        reason = GRADIENT_REASON if _needs_gradient(args, kwargs) else unsupported_reason(*args, **kwargs)
        if reason:
            warnings.warn(f"fastkda: transformers' own {name} runs this call, computed (and differentiated) as "
                          f"without fastkda: {reason}", stacklevel=2)
            return original(*args, **kwargs)
        return fastkda_function(*args, **kwargs)
    return routed


def gated_norm_forward(self, hidden_states, gate=None):
    """The gated RMSNorm classes' ``forward`` on :func:`fastkda.gated_rmsnorm` (without a gate: transformers'
    own)."""
    if gate is None:
        return _replaced[(type(self).__module__, type(self).__name__ + ".forward")](self, hidden_states)
    return gated_rmsnorm(hidden_states, gate, self.weight, self.variance_epsilon,
                         activation=_fastkda_activation(self.activation))


REPLACEMENTS = {  # transformers' module function -> fastkda's, and why fastkda cannot run a call (None: it can)
    "chunk_kimi_delta_attention": (chunk_kimi_delta_attention, _unsupported_kda),
    "recurrent_kimi_delta_attention": (recurrent_kimi_delta_attention, _unsupported_kda),
    "causal_conv1d_fn": (causal_conv1d_fn, _unsupported_conv),
    "causal_conv1d_update": (causal_conv1d_update_fn, _unsupported_conv_update),
}


def enable():
    """Route transformers' Kimi-Linear and GLM-5.3-Flash KDA layers through fastkda. Returns the model modules
    patched (those this transformers ships). Calling it again changes nothing."""
    patched = []
    for name, norm in MODELS.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if (name, norm + ".forward") in _replaced:  # enabled already
            patched.append(name)
            continue
        for attribute, (replacement, reason) in REPLACEMENTS.items():
            original = _replaced[(name, attribute)] = getattr(module, attribute)
            setattr(module, attribute, _inference_or_original(replacement, original, attribute, reason))
        norm_class = getattr(module, norm)
        original = _replaced[(name, norm + ".forward")] = norm_class.forward
        norm_class.forward = _inference_or_original(gated_norm_forward, original, norm + ".forward", _unsupported_norm)
        patched.append(name)
    return patched


def disable():
    """Put transformers' own functions back."""
    for (name, attribute), original in list(_replaced.items()):
        module = importlib.import_module(name)
        owner, _, method = attribute.partition(".")
        if method:
            setattr(getattr(module, owner), method, original)
        else:
            setattr(module, owner, original)
        del _replaced[(name, attribute)]


def enabled():
    """Whether :func:`enable` is in effect."""
    return bool(_replaced)

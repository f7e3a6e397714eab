"""The KDA layer of Kimi-Linear, GLM-5.3-Flash and Kimi-K3 (spec §9) on fastkda's kernels, with slot caches.

Parameter names are those of transformers' ``KimiLinearDeltaAttention`` and ``Glm5NextTextLinearAttention``, so a
state dict of either loads as it is (:meth:`KimiDeltaAttention.from_transformers` builds the layer from one); the
only difference, Kimi-Linear's ``A_log`` of shape ``[1, 1, H, 1]``, is reshaped to ``[H]`` on load.

A call is a prefill (any number of tokens per sequence, packed with ``cu_seqlens`` or ``[B, T]``) or a decode step
(``decode=True``: T >= 1 tokens per sequence, speculative ones with accepted counts). With a
:class:`fastkda.cache.KDACache` each sequence reads and writes its slot's conv and recurrent state; without one,
every sequence starts from zeros and nothing is kept.
"""

import itertools
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..api import causal_conv1d, causal_conv1d_update, gated_rmsnorm, kda_decode, kda_decode_step, kda_prefill
from ..cache import NULL_SLOT
from .. import checks
from ..checks import decode_indices
from ..plan import CHUNK, requested_v_slices
from ..validation import (INDEX_DTYPES, addressable_inputs, autograd_records, check_offsets, check_tensor, remembered,
                          restored_on_refusal, scalar_defaults, validate_decode)

INFERENCE_ONLY = ("KimiDeltaAttention is inference-only, but autograd records this call: grad mode is on and a "
                  "parameter or the input requires grad (as in training, and in a plain layer(x) call: eval() does "
                  "not turn gradients off). fastkda's kernels carry no gradient, so backward() reaches o_proj's "
                  "weight alone, none of the layer's other parameters and not its input; run inference under "
                  "torch.no_grad() or torch.inference_mode()")


class ForgetGate(nn.Module):
    """The gate's projections and parameters (spec §9 step 3): ``f_b_proj(f_a_proj(x)) + dt_bias``, then
    ``λ·sigmoid(exp(A_log)·…)`` with a lower bound λ (GLM-5.3-Flash, Kimi-K3; fused into the kernels) or
    ``-exp(A_log)·softplus(…)`` without (Kimi-Linear; computed here in fp32, passed as the log-decay)."""

    def __init__(self, hidden_size, num_heads, head_dim, lower_bound, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim, self.lower_bound = num_heads, head_dim, lower_bound
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False, device=device, dtype=dtype)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False, device=device, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim, dtype=torch.float32, device=device))
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32, device=device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "A_log"
        if key in state_dict and state_dict[key].numel() == self.num_heads:  # Kimi-Linear keeps [1, 1, H, 1]
            state_dict[key] = state_dict[key].reshape(self.num_heads)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def kernel_arguments(self, x):
        """``(g, gate keywords)`` for :func:`fastkda.kda_prefill` / :func:`fastkda.kda_decode` from hidden states
        ``x [..., hidden]``; g is ``[..., H, D]``."""
        raw = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        if self.lower_bound is not None:
            return raw, dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound)
        shifted = raw.float() + self.dt_bias.float().view(self.num_heads, self.head_dim)
        return -self.A_log.float().exp()[:, None] * F.softplus(shifted), {}


class GatedRMSNorm(nn.Module):
    """``rmsnorm(o)·weight ⊙ sigmoid(gate)`` over each head's D outputs, in fp32 (spec §9 step 6)."""

    def __init__(self, head_dim, eps, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, device=device))
        self.variance_epsilon = eps

    def forward(self, x, gate):
        return gated_rmsnorm(x, gate, self.weight, self.variance_epsilon, activation="sigmoid")


class KimiDeltaAttention(nn.Module):
    """One KDA layer (spec §9): projections, short causal conv + SiLU, gate, β, KDA, gated RMSNorm, output
    projection.

    Args:
        hidden_size, num_heads, head_dim: the model's width, the layer's (local) heads H and K = V = D (64, 128).
        conv_kernel: the short conv's kernel size W (``linear_conv_kernel_dim``, 4).
        lower_bound: λ in [-5, 0) for the lower-bound gate (GLM-5.3-Flash's ``linear_lower_bound``, Kimi-K3), or
            None for Kimi-Linear's softplus gate.
        norm_eps: the gated norm's epsilon (``rms_norm_eps``).
        layer_idx: which layer of a :class:`fastkda.cache.KDACache` this one uses.
        fused_decode: run one-token decode steps of ``[N]`` slots (no accepted counts) through
            :func:`fastkda.kda_decode_step` (on the GPU one kernel where the step is latency-bound, its three
            launches elsewhere, as its plan decides) instead of the conv update, KDA decode and gated norm always
            one by one. The same math and the same argument errors; the CPU path is the same either way.

    The layer is inference-only, as fastkda is: its kernels carry no gradient. Where autograd records a call (grad
    mode on and a parameter or the input requiring grad: training, and also a plain ``layer(x)`` in eval mode, since
    ``eval()`` does not turn gradients off) it warns (``UserWarning``) that ``backward()`` would reach ``o_proj``
    alone, and runs: its output is right, and an error would refuse every such inference call, where
    ``torch.no_grad()`` or ``torch.inference_mode()`` is what the warning asks for. A call inside torch.compile is
    not warned (a warning is not traceable: a ``fullgraph`` compile would fail on it).
    """

    def __init__(self, hidden_size, num_heads, head_dim, *, conv_kernel=4, lower_bound=None, norm_eps=1e-5,
                 layer_idx=0, fused_decode=True, device=None, dtype=None):
        super().__init__()
        self.fused_decode = fused_decode
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.layer_idx = layer_idx
        width = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, width, bias=False, device=device, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, width, bias=False, device=device, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, width, bias=False, device=device, dtype=dtype)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, conv_kernel, groups=3 * width, padding=conv_kernel - 1,
                                bias=False, device=device, dtype=dtype)
        self.forget_gate = ForgetGate(hidden_size, num_heads, head_dim, lower_bound, device=device, dtype=dtype)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False, device=device, dtype=dtype)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False, device=device, dtype=dtype)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False, device=device, dtype=dtype)
        self.o_norm = GatedRMSNorm(head_dim, norm_eps, device=device)
        self.o_proj = nn.Linear(width, hidden_size, bias=False, device=device, dtype=dtype)

    @property
    def conv_channels(self):
        return 3 * self.num_heads * self.head_dim

    @property
    def conv_kernel(self):
        return self.conv1d.kernel_size[0]

    @classmethod
    def from_transformers(cls, layer, *, layer_idx=None):
        """A copy of a transformers ``KimiLinearDeltaAttention`` or ``Glm5NextTextLinearAttention`` (its config
        read from the module, its weights loaded), on the same device. ``layer_idx``: the
        :class:`fastkda.cache.KDACache` layer it uses; by default transformers' own ``layer_idx``, its place among
        all the model's layers (attention layers too), so a cache then needs as many layers as the model; pass
        the layer's place among the KDA layers alone for a cache of just those. Raises ``TypeError`` for another
        kind of layer (a full-attention layer), ``ValueError`` for a conv activation other than SiLU or an output
        norm gate other than the sigmoid, which this layer does not compute."""
        parts = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
                 "o_proj")
        missing = [name for name in parts if not hasattr(layer, name)]
        if missing:
            raise TypeError(f"KimiDeltaAttention.from_transformers: takes a KimiLinearDeltaAttention or "
                            f"Glm5NextTextLinearAttention layer, got {type(layer).__name__} (no {', '.join(missing)})")
        for what, given, wanted in (("conv activation", getattr(layer, "activation", "silu"), ("silu", "swish")),
                                    ("output norm's gate", getattr(layer.o_norm, "activation", "sigmoid"),
                                     ("sigmoid",))):
            if given not in wanted:
                raise ValueError(f"KimiDeltaAttention.from_transformers: the layer's {what} must be "
                                 f"{' or '.join(map(repr, wanted))} (this layer computes only that), got {given!r}")
        gate = layer.forget_gate
        weight = layer.q_proj.weight
        ours = cls(layer.hidden_size, layer.num_heads, layer.head_dim, conv_kernel=layer.conv_kernel_size,
                   lower_bound=getattr(gate, "safe_gate_lower_bound", None), norm_eps=layer.o_norm.variance_epsilon,
                   layer_idx=layer.layer_idx if layer_idx is None else layer_idx, device=weight.device,
                   dtype=weight.dtype)
        ours.conv1d.to(layer.conv1d.weight.dtype)  # GLM-5.3-Flash keeps its conv in fp32: loaded as it is
        ours.load_state_dict(layer.state_dict())
        return ours

    def _projections(self, x):
        """``(mixed q|k|v [..., 3HD] before the conv, g, gate keywords, raw β [..., H], output gate [..., H, D])``."""
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g, gate = self.forget_gate.kernel_arguments(x)
        output_gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        return mixed, g, gate, self.b_proj(x), output_gate

    def _split_heads(self, mixed):
        """q, k, v ``[..., H, D]`` views of the conv output (no copy: the kernels read token-strided rows)."""
        return [part.unflatten(-1, (self.num_heads, self.head_dim)) for part in mixed.chunk(3, dim=-1)]

    def forward(self, hidden_states, cache=None, *, slots=None, cu_seqlens=None, has_initial_state=None,
                max_seqlen=None, decode=False, num_accepted_tokens=None, checkpoint_offsets=None):
        """Returns the layer's output, hidden_states' shape (with ``checkpoint_offsets``: ``(output, checkpoint)``,
        see below).

        Args:
            hidden_states: prefill ``[T, hidden]`` packed by ``cu_seqlens`` (``[N+1]``, empty sequences allowed;
                one sequence without) or ``[B, T, hidden]``; decode ``[N, T, hidden]``, T >= 1 tokens each.
            cache: a :class:`fastkda.cache.KDACache` (this layer's pools at ``layer_idx``), or None (each
                sequence from zeros, nothing kept; not with ``decode``).
            slots: with a cache, ``[N]`` device ints, each sequence's slot (negative: a padding row, zero output
                for decode, nothing read or written). Decode with speculative tokens: ``[N, T]``, the states after
                token t go to ``slots[n, t]`` and the step starts from ``slots[n, num_accepted_tokens[n] - 1]``
                (``[N]``, each in [1, T]) as :func:`fastkda.kda_decode` takes them.
            has_initial_state: prefill, ``[N]`` bool: False where a sequence starts from zeros whatever its slot
                holds; None reads every slot (a freshly allocated slot holds zeros).
            max_seqlen: prefill, the longest sequence's length if known on the host (as
                :func:`fastkda.kda_prefill` takes it: where it gives every sequence one length, they must have it).
            checkpoint_offsets: prefill with a cache, ``[N]`` token offsets (multiples of 32, each within its
                sequence) at which to keep a prefix-cache checkpoint: then returns ``(output, (recurrent [N, H,
                V, K] fp32, conv [N, C, W−1]))``, the states after that many tokens, for
                :meth:`fastkda.cache.KDACache.restore` (NaN for an offset past its sequence, which has no such
                state).
            num_accepted_tokens: decode with ``[N, T]`` slots, as above.

        An argument of the other mode (``cu_seqlens``, ``has_initial_state``, ``max_seqlen`` or
        ``checkpoint_offsets`` with ``decode=True``; ``num_accepted_tokens`` in a prefill) is refused, as is a cache
        whose heads, head_dim, conv channels or conv kernel are not the layer's: ``ValueError`` naming it, before
        anything is written.
        """
        if decode:
            other_mode = dict(cu_seqlens=cu_seqlens, has_initial_state=has_initial_state, max_seqlen=max_seqlen,
                              checkpoint_offsets=checkpoint_offsets)
        else:
            other_mode = dict(num_accepted_tokens=num_accepted_tokens)
        for name, given in other_mode.items():
            if given is not None:  # ignored, it would run another call than the one asked for
                raise ValueError(f"KimiDeltaAttention: {name} does not apply to "
                                 f"{'a decode step (decode=True)' if decode else 'a prefill (decode=False)'}")
        if cache is not None:
            self._check_cache(cache)
        if autograd_records(itertools.chain((hidden_states,), self.parameters())) and not (
                torch.compiler.is_compiling()):
            _warn_at_the_caller(INFERENCE_ONLY)
        if decode:
            if cache is None or slots is None:
                raise ValueError("KimiDeltaAttention: decode=True needs a cache and slots")
            if hidden_states.dim() != 3:
                raise ValueError(f"KimiDeltaAttention: decode takes hidden_states [N, T, hidden], got "
                                 f"{list(hidden_states.shape)}")
            return self._decode(hidden_states, cache, slots, num_accepted_tokens)
        if (cache is None) != (slots is None):
            raise ValueError("KimiDeltaAttention: a cache and slots go together")
        if checkpoint_offsets is not None and cache is None:
            raise ValueError("KimiDeltaAttention: checkpoint_offsets needs a cache")
        packed = hidden_states.dim() == 2
        if not packed and cu_seqlens is not None:
            raise ValueError("KimiDeltaAttention: cu_seqlens takes packed hidden_states [T, hidden]")
        x = hidden_states[None] if packed else hidden_states  # [B, T, hidden]
        _check_sequence_arguments(x, cu_seqlens, slots, has_initial_state, checkpoint_offsets)
        mixed, g, gate, beta, output_gate = self._projections(x)
        state_pool, conv_pool = cache.layer(self.layer_idx) if cache else (None, None)  # with the scratch row
        _check_before_the_pools(cache, conv_pool, slots, mixed=mixed, g=g, beta=beta, conv_weight=self.conv1d.weight,
                                conv_bias=self.conv1d.bias, **gate)
        weight = self.conv1d.weight.squeeze(1)
        tokens = mixed[0] if packed else mixed  # the conv's own layouts: [T, C] packed, [B, T, C]
        conv_checkpoint = None
        if checkpoint_offsets is not None:  # before the conv, which overwrites the pool rows
            checkpoint_offsets = _offsets_for_prefill(checkpoint_offsets, cu_seqlens)
            conv_checkpoint = self._conv_checkpoint(tokens, cache, slots, has_initial_state, cu_seqlens,
                                                    checkpoint_offsets)
        read, write, states = None, None, None
        if cache is not None:
            read, write = _rows(slots, cache, has_initial_state)
            states = torch.where(read[:, None, None, None], state_pool[write], 0).to(state_pool.dtype)
        checkpoint_states = None
        if checkpoint_offsets is not None:
            num = slots.shape[0]
            checkpoint_states = torch.full((num, 2, self.num_heads, self.head_dim, self.head_dim), float("nan"),
                                           device=x.device)  # an offset past its sequence leaves NaN
        # kda_prefill checks its own arguments (max_seqlen, checkpoint_offsets, the pool's shape, and on the CPU
        # their values) only once the conv has moved its pool: the rows the conv rewrites (padding: the scratch
        # row) are put back when it refuses
        with restored_on_refusal(conv_pool, write):
            mixed_conv = causal_conv1d(tokens, weight, self.conv1d.bias, conv_states=_live_rows(conv_pool),
                                       slots=slots, has_initial_state=has_initial_state,
                                       cu_seqlens=cu_seqlens).view(mixed.shape)
            q, k, v = self._split_heads(mixed_conv)
            o, _ = kda_prefill(q, k, v, g, beta, **gate, initial_state=states, final_state=states,
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, checkpoint_offsets=checkpoint_offsets,
                               checkpoint_states=checkpoint_states)
        if cache is not None:
            state_pool.index_copy_(0, write, states)
        out = self.o_proj(self.o_norm(o, output_gate).flatten(-2))
        out = out[0] if packed else out
        if checkpoint_offsets is None:
            return out
        return out, (checkpoint_states[:, 0], conv_checkpoint)

    def _check_cache(self, cache):
        """The cache's pools sized for this layer: one built for another layer would fail only in some modes, and
        there inside a kernel or an index_copy_ (or, with a wider conv row, not at all in a prefill)."""
        ours = dict(heads=self.num_heads, head_dim=self.head_dim, conv_channels=self.conv_channels,
                    conv_kernel=self.conv_kernel)
        differ = [f"{name} {getattr(cache, name)} (the layer's {size})" for name, size in ours.items()
                  if getattr(cache, name) != size]
        if differ:
            raise ValueError(f"KimiDeltaAttention: cache must be built for this layer's sizes, got a cache of "
                             f"{', '.join(differ)}")

    def _conv_checkpoint(self, mixed, cache, slots, has_initial_state, cu_seqlens, offsets):
        """The conv state ``[N, C, W−1]`` after ``offsets[n]`` tokens of each sequence: the W−1 inputs before that
        point, from the call's inputs ``mixed`` (``[T, C]`` packed, ``[B, T, C]``) or, near a sequence's start,
        from the state it started with."""
        width = self.conv_kernel - 1
        rows = mixed.reshape(-1, mixed.shape[-1])
        num = slots.shape[0]
        if cu_seqlens is not None:
            starts = cu_seqlens[:-1].long()
        else:
            starts = torch.arange(num, device=rows.device) * mixed.shape[1]
        position = offsets.reshape(num).long()[:, None] - width + torch.arange(width, device=rows.device)  # [N, W−1]
        if rows.shape[0]:
            from_inputs = rows[(starts[:, None] + position).clamp(0, rows.shape[0] - 1)]  # [N, W−1, C]
        else:  # no tokens: every column comes from the state
            from_inputs = rows.new_zeros(num, width, rows.shape[-1])
        read, row = _rows(slots, cache, has_initial_state)
        earlier = torch.where(read[:, None, None], cache.layer(self.layer_idx)[1][row], 0)  # [N, C, W−1]
        from_state = earlier.gather(2, (position + width).clamp(0, width - 1)[:, None, :].expand_as(earlier))
        state = torch.where((position >= 0)[:, None, :], from_inputs.transpose(1, 2).to(earlier.dtype), from_state)
        lengths = starts.diff(append=cu_seqlens[-1:].long()) if cu_seqlens is not None else mixed.shape[1]
        past = offsets.reshape(num).long() > lengths  # no such state: NaN, as the recurrent checkpoint leaves it
        return torch.where(past[:, None, None], float("nan"), state).detach()  # state for a cache, as the recurrent

    def _decode(self, hidden_states, cache, slots, num_accepted_tokens):
        mixed, g, gate, beta, output_gate = self._projections(hidden_states)
        state_pool, conv_pool = cache.layer(self.layer_idx)
        weight = self.conv1d.weight.squeeze(1)
        # the fused step takes exactly a one-token step of [N] slots: any other call (accepted counts, [N, T] slots,
        # slots that are no [N] tensor) runs the path below, whose checks name what is wrong in it, as with
        # fused_decode=False
        if (self.fused_decode and num_accepted_tokens is None and isinstance(slots, torch.Tensor)
                and slots.shape == mixed.shape[:1] and mixed.shape[1] == 1 and self.conv1d.bias is None):
            o = kda_decode_step(mixed[:, 0], _live_rows(conv_pool), weight, g[:, 0], beta[:, 0], output_gate[:, 0],
                                self.o_norm.weight, _live_rows(state_pool), slots, **gate,
                                eps=self.o_norm.variance_epsilon,
                                tickets=None if torch.compiler.is_compiling()  # compiled: three ops, no join
                                else cache.step_tickets(slots.shape[0] * self.num_heads))
            return self.o_proj(o.flatten(-2))[:, None]
        self._check_decode_call(mixed, g, beta, gate, _live_rows(state_pool), slots, num_accepted_tokens)
        checked = _check_before_the_pools(cache, conv_pool, slots, mixed=mixed, g=g, beta=beta,
                                          conv_weight=self.conv1d.weight, conv_bias=self.conv1d.bias, **gate)
        # kda_decode's checks of q, k and v (finite) see the conv's output only after the conv has moved its pool
        # rows (finite inputs can overflow in it): in checked mode the rows it may write are put back on a refusal
        with restored_on_refusal(conv_pool, _rows(slots.reshape(-1), cache, None)[1] if checked else None):
            if slots.dim() == 1:
                mixed_conv = causal_conv1d_update(mixed, _live_rows(conv_pool), weight, self.conv1d.bias, slots=slots)
            else:
                mixed_conv = self._speculative_conv(mixed, conv_pool, weight, slots, num_accepted_tokens, cache)
            q, k, v = self._split_heads(mixed_conv)
            o = kda_decode(q, k, v, g, beta, _live_rows(state_pool), slots, **gate,
                           num_accepted_tokens=num_accepted_tokens)
        return self.o_proj(self.o_norm(o, output_gate).flatten(-2))

    def _check_decode_call(self, mixed, g, beta, gate, state_pool, slots, num_accepted_tokens):
        """:func:`fastkda.kda_decode`'s own checks of a step's arguments, run before the conv: it moves its pool
        rows before kda_decode sees q, k and v, and the speculative conv indexes with the slots and accepted
        counts. Shapes and dtypes on views shaped as the conv's output, and ``$FASTKDA_V_SLICES``; on the CPU, the
        slots' and accepted counts' values too (on the GPU kda_decode counts bad ones instead)."""
        # as kda_decode sees them: a size-1 token dimension's stride is arbitrary (the GPU's projection gives 1-token
        # rows a stride other than the batch's), and kda_decode restrides such views before its own checks
        q, k, v, g, beta = addressable_inputs(*self._split_heads(mixed), g, beta)
        scale, lower_bound = scalar_defaults(q, None, gate.get("lower_bound"))
        remembered(validate_decode, q, k, v, g, beta, state_pool, slots, gate.get("A_log"), gate.get("dt_bias"),
                   lower_bound, scale, num_accepted_tokens, None)
        requested_v_slices()  # $FASTKDA_V_SLICES, which kda_decode reads
        if not mixed.is_cuda and not torch.compiler.is_compiling():  # a trace reads no values: the op checks them
            decode_indices(slots, num_accepted_tokens, state_pool.shape[0], mixed.shape[1])

    def _speculative_conv(self, mixed, conv_pool, weight, slots, num_accepted_tokens, cache):
        """The conv of T draft tokens per sequence from the state at its accepted token, the state after each
        token t written to ``slots[n, t]`` (as :func:`fastkda.kda_decode` keeps the recurrent states). An accepted
        count outside [1, T] (which the CPU refuses before this) makes its sequence a padding row, as kda_decode makes
        it on the GPU: it reads a zero state and its writes go to the scratch row (device-side, no host sync)."""
        first = slots[:, 0]
        if num_accepted_tokens is not None:
            accepted = num_accepted_tokens.long()
            counted = (accepted >= 1) & (accepted <= slots.shape[1])
            at_accepted = slots.gather(1, (accepted - 1).clamp(0, slots.shape[1] - 1)[:, None])[:, 0]
            first = torch.where(counted, at_accepted, NULL_SLOT)
        read, row = _rows(first, cache, None)
        start = torch.where(read[:, None, None], conv_pool[row], 0)  # [N, C, W−1]
        window = torch.cat([start, mixed.transpose(1, 2).to(start.dtype)], dim=2)  # [N, C, W−1+T]
        out = causal_conv1d(mixed, weight, self.conv1d.bias, conv_states=start.clone(),
                            slots=torch.arange(mixed.shape[0], device=mixed.device, dtype=torch.int32))
        width, tokens = self.conv_kernel - 1, mixed.shape[1]
        after = window.unfold(2, width, 1)[:, :, 1:tokens + 1].permute(0, 2, 1, 3)  # [N, T, C, W−1]
        _, targets = _rows(slots.reshape(-1), cache, None)
        targets = torch.where(read.repeat_interleave(tokens), targets, cache.scratch_slot)  # as kda_decode: a null
        # detached: a pool is state, never part of an autograd graph (a later in-place write would then fail)
        conv_pool.index_copy_(0, targets, after.reshape(-1, *after.shape[2:]).detach())  # read row writes no state
        return out


def _check_sequence_arguments(x, cu_seqlens, slots, has_initial_state, checkpoint_offsets):
    """A prefill's per-sequence arguments as tensors of one entry per sequence on x's device (``[B, T, hidden]``),
    checked by name before anything indexes with them (a list, a 0-d tensor or ``[N, 2]`` offsets would otherwise
    fail inside the layer's own index math)."""
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, x.device, x.shape[1], where="hidden_states")
    num_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if checkpoint_offsets is not None:  # [N], or kda_prefill's [N, 1]: one offset a sequence
        shape = checkpoint_offsets.shape if isinstance(checkpoint_offsets, torch.Tensor) else None
        check_tensor("checkpoint_offsets", checkpoint_offsets, shape if shape == (num_seqs, 1) else (num_seqs,),
                     INDEX_DTYPES, x.device, "hidden_states")
    for name, given, dtypes in (("slots", slots, INDEX_DTYPES),
                                ("has_initial_state", has_initial_state, (torch.bool,))):
        if given is not None:
            check_tensor(name, given, (num_seqs,), dtypes, x.device, "hidden_states")


def _offsets_for_prefill(checkpoint_offsets, cu_seqlens):
    """Checkpoint offsets in the dtype :func:`fastkda.kda_prefill` takes them (cu_seqlens', int32 without), cast
    before the conv checkpoint reads them, so that both checkpoints see the same offsets. Saturated to that dtype's
    largest multiple of the chunk, not wrapped: an offset past it stays past its sequence (NaN in both checkpoints,
    where a wrapped one would name an earlier token for the recurrent state alone)."""
    dtype = cu_seqlens.dtype if cu_seqlens is not None else torch.int32
    limits = torch.iinfo(dtype)
    return checkpoint_offsets.long().clamp(limits.min, limits.max - CHUNK + 1).to(dtype)


def _check_before_the_pools(cache, conv_pool, slots, **tensors):
    """Checked mode (``$FASTKDA_CHECKS``): the projections, the conv's and the gate's parameters and the conv rows of
    the call's live slots finite before the conv writes its pool, since the kernels' own checks see q, k and v only
    after it (on the GPU this reads device memory: not inside graph capture). Returns whether it checked: checked
    mode, outside a torch.compile trace (which reads no values)."""
    if not checks.requested(None) or torch.compiler.is_compiling():
        return False
    checks.outside_capture(tensors["mixed"])
    if cache is not None:
        flat = slots.reshape(-1).long()
        tensors["conv_states"] = conv_pool[flat[(flat >= 0) & (flat < cache.num_slots)]]
    checks.finite(**{name: x for name, x in tensors.items() if isinstance(x, torch.Tensor)})
    return True


_MODULE_CALL_FILE = nn.Module.__call__.__code__.co_filename  # torch's Module.__call__ and the frames it calls through


def _warn_at_the_caller(message):
    """``warnings.warn(message)`` attributed to the line that called the layer, past torch's ``Module.__call__``
    frames: the line shown is the caller's, and Python's default filter shows the warning once per such line."""
    level, frame = 3, sys._getframe(2)  # 1: this function, 2: forward, 3: forward's caller
    while frame is not None and frame.f_code.co_filename == _MODULE_CALL_FILE:
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def _rows(slots, cache, has_initial_state):
    """``(read [N] bool, row [N])`` for slots of ``cache``: a live slot's row, where it is read (not padding, not
    out of range, ``has_initial_state``); padding rows and out-of-range slots map to the scratch row, so a
    scatter through ``row`` never writes a live row for them."""
    live = (slots >= 0) & (slots < cache.num_slots)
    row = torch.where(live, slots.long(), cache.scratch_slot)
    read = live if has_initial_state is None else live & has_initial_state.bool()
    return read, row


def _live_rows(pool):
    """A pool without its scratch row: what the kernels get, so that a slot equal to the cache's size is out of
    range for them (padding on the GPU, an error on the CPU) as it is for :func:`_rows`. None without a cache."""
    return None if pool is None else pool[:-1]

"""FLA's KDA entry points (``fla.ops.kda`` of fla-core 0.6.0) on fastkda (spec §5): :func:`chunk_kda` for prefill,
:func:`fused_recurrent_kda` and :func:`fused_recurrent_kda_fwd` (vLLM's pool decode) for decode.

States keep FLA's layout: K-first ``[N, HV, K, V]`` unless ``state_v_first`` (fastkda's own layout, which then
needs no transposed copy). Grouped value heads (GVA: v, g and beta with HV heads, q and k with H, HV % H == 0)
give value head i the q/k head ``i // (HV // H)``, as FLA's kernels index them. Each argument that changes
results is honoured or refused with a ``ValueError`` naming it; training-only ones are ignored. fastkda is
inference-only: FLA's :func:`chunk_kda` trains (it has a backward), this one warns where autograd records the call
(its outputs carry no gradient).
"""

import warnings

import torch
import torch.nn.functional as F

from .. import checks
from ..api import kda_decode, kda_prefill
from ..validation import (INDEX_DTYPES, MIN_LOWER_BOUND, _describe, as_float, autograd_records, check_offsets,
                          check_tensor, fail)

TRAINING_WARNING = ("fastkda.compat.fla.chunk_kda is inference-only, but autograd records this call (grad mode is "
                    "on and an input requires grad): its outputs carry no gradient, so backward() reaches none of "
                    "its inputs, where FLA's chunk_kda would; run inference under torch.no_grad() or "
                    "torch.inference_mode(), and train with FLA's")
CHUNK_SIZES = (32, 64)  # FLA's KDA chunk sizes: they set the spacing of return_intermediate_states only
NAMES = ("q", "k", "v", "g", "beta")


def _renamed_layout(state_v_first, kwargs):
    """``state_v_first`` after FLA's deprecated ``transpose_state_layout`` (popped from ``kwargs``): the same
    switch under its old name, with a DeprecationWarning; both at once is an error (fla/ops/kda/chunk.py)."""
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    if state_v_first:
        fail("transpose_state_layout", "left out when state_v_first is given (it is state_v_first's old name)",
             kwargs["transpose_state_layout"])
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return kwargs.pop("transpose_state_layout")


def _other_layout(state, state_v_first):
    """A state tensor between FLA's layout and fastkda's V-first one (either way: a transpose of the last two
    dimensions), contiguous; ``state`` itself when it is already V-first and contiguous, or None."""
    if state is None:
        return None
    return (state if state_v_first else state.transpose(-1, -2)).contiguous()


def _inputs(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
            use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """:func:`fastkda.kda_prefill`'s / :func:`fastkda.kda_decode`'s arguments for FLA's: q and k repeated per value
    head (GVA); FLA's gate (``use_gate_in_kernel``: ``lower_bound`` given -> ``λ·sigmoid(exp(A_log)·(g + dt_bias))``,
    fused (computed here for λ below fastkda's fused range), with ``A_log=None`` meaning
    ``λ·sigmoid(g + dt_bias)``; else ``-exp(A_log)·softplus(g + dt_bias)``,
    computed here; otherwise g is the log-decay and the gate arguments are not read, fla/ops/kda/chunk_fwd.py);
    ``allow_neg_eigval`` with ``use_beta_sigmoid_in_kernel``: beta ``2·sigmoid(b)`` (fla/ops/kda/chunk.py)."""
    lower_bound = as_float(lower_bound)  # a NumPy scalar's bound below the fused range is computed here too
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == v.dim() == 4:
        heads, value_heads = q.shape[2], v.shape[2]
        if value_heads != heads:
            if value_heads % heads:
                fail("v", f"of a head count HV that q's H={heads} divides (grouped value heads)", f"HV={value_heads}")
            q, k = (x.repeat_interleave(value_heads // heads, dim=2) for x in (q, k))
    gate = {}
    if use_gate_in_kernel:
        if not isinstance(g, torch.Tensor) or g.dim() != 4:
            fail("g", "a 4-D tensor [B, T, HV, K] (the raw gate, use_gate_in_kernel=True)", _describe(g))
        value_heads, key_dim = g.shape[-2:]
        for name, x, size in (("A_log", A_log, value_heads), ("dt_bias", dt_bias, value_heads * key_dim)):
            if x is not None and (not isinstance(x, torch.Tensor) or x.numel() != size):
                fail(name, f"a tensor of {size} values", _describe(x))
        bias = torch.zeros(value_heads, key_dim, device=g.device) if dt_bias is None else dt_bias.reshape(
            value_heads, key_dim)
        if lower_bound is not None:
            A = torch.zeros(value_heads, device=g.device) if A_log is None else A_log.reshape(value_heads)
            gate = dict(A_log=A.contiguous(), dt_bias=bias.contiguous(), lower_bound=lower_bound)
            if isinstance(lower_bound, float) and lower_bound < MIN_LOWER_BOUND:  # past the fused range
                g = lower_bound * torch.sigmoid(A.float().exp().reshape(value_heads, 1) * (g.float() + bias.float()))
                gate = {}
        else:
            g = -A_log.float().reshape(value_heads, 1).exp() * F.softplus(g.float() + bias.float())
    if allow_neg_eigval and use_beta_sigmoid_in_kernel:
        beta, use_beta_sigmoid_in_kernel = 2 * torch.sigmoid(beta.float()), False
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta)
    return tensors, dict(scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel,
                         use_beta_sigmoid=use_beta_sigmoid_in_kernel, **gate)


def _needs_beta_sigmoid(allow_neg_eigval, use_beta_sigmoid_in_kernel):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:  # FLA's rule: it doubles the sigmoid it applies
        fail("allow_neg_eigval", "False unless use_beta_sigmoid_in_kernel=True", True)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, chunk_size=64,
              sequence_parallel="auto", max_seqlen=None, **kwargs):
    """FLA's ``chunk_kda``: returns ``(o, final_state)``, or ``(o, final_state, h)`` with
    ``return_intermediate_states``; the final state fp32 (None without ``output_final_state``).

    ``h`` holds the state at the start of every ``chunk_size``-token chunk of every sequence (the first is the
    initial state), FLA's ``[B, ceil(T / chunk_size), HV, K, V]``, or ``[1, Σ ceil(T_n / chunk_size), HV, K, V]``
    with ``cu_seqlens`` (``[.., V, K]`` with ``state_v_first``), in k's dtype; serving engines cache prefixes with
    it. It is computed in prefills of three chunks per sequence that carry the state (one call per three chunks
    of the longest sequence), the two inner chunk boundaries written by fastkda's checkpoints; the lengths come
    from ``cu_seqlens_cpu`` when given, else ``cu_seqlens`` is read (a sync on the GPU, as in FLA).

    ``chunk_size`` (32 or 64, as FLA accepts) changes only ``h``; fastkda chunks its own way, which does not change
    the math. ``safe_gate`` needs no switch: every gate runs overflow-free; FLA's rule that under
    ``use_gate_in_kernel`` it come with a ``lower_bound`` in [-5, 0) is kept (without it FLA takes any λ < 0, and
    so does this). ``lower_bound`` without ``use_gate_in_kernel`` is ignored, as in FLA (g is then the log-decay).
    ``cp_context`` (multi-device context parallelism) is refused.
    ``sequence_parallel`` and ``max_seqlen`` as in :func:`fastkda.kda_prefill`; without ``max_seqlen``,
    ``cu_seqlens_cpu`` (FLA's host copy of the offsets) gives it, so that the plan knows the longest sequence as
    FLA's own chunk indices do (except under torch.compile, which traces no values: pass ``max_seqlen`` there, or
    the plan is made from the batch's size and token count alone). ``disable_recompute``,
    ``use_graph``, ``max_num_seqs`` and other training-only arguments are ignored: fastkda's prefill takes any
    ``cu_seqlens`` (also zero-length tail sequences) inside CUDA-graph capture anyway."""
    state_v_first = _renamed_layout(state_v_first, kwargs)
    if autograd_records((q, k, v, g, beta, A_log, dt_bias, initial_state)) and not torch.compiler.is_compiling():
        warnings.warn(TRAINING_WARNING, UserWarning, stacklevel=2)
    if cp_context is not None:
        fail("cp_context", "None (context parallelism across devices is not supported)", type(cp_context).__name__)
    if chunk_size not in CHUNK_SIZES:
        fail("`chunk_size`", "either 32 or 64 for KDA", chunk_size)
    _needs_beta_sigmoid(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            fail("A_log", "given when use_gate_in_kernel=True and lower_bound is None", None)
        if safe_gate and not (lower_bound is not None and MIN_LOWER_BOUND <= lower_bound < 0):
            fail("lower_bound", f"in [{MIN_LOWER_BOUND}, 0) when safe_gate=True and use_gate_in_kernel=True",
                 lower_bound)
    else:
        A_log = dt_bias = lower_bound = None
    tensors, kw = _inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                          lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval)
    h0 = _other_layout(initial_state, state_v_first)
    _check_offset_pair(cu_seqlens, cu_seqlens_cpu, q)
    if (max_seqlen is None and cu_seqlens_cpu is not None and cu_seqlens_cpu.numel() > 1
            and not torch.compiler.is_compiling()):  # a hint from values, which a trace does not read
        offsets = cu_seqlens_cpu.tolist()
        max_seqlen = max(b - a for a, b in zip(offsets, offsets[1:]))
    if not return_intermediate_states:
        o, final = kda_prefill(*tensors.values(), **kw, initial_state=h0, output_final_state=output_final_state,
                               cu_seqlens=cu_seqlens, sequence_parallel=sequence_parallel, max_seqlen=max_seqlen)
        return o, _other_layout(final, state_v_first)
    o, final, h = _prefill_with_chunk_states(tensors, kw, h0, cu_seqlens, cu_seqlens_cpu, chunk_size,
                                             state_v_first, sequence_parallel)
    return o, _other_layout(final, state_v_first) if output_final_state else None, h


def _check_offset_pair(cu_seqlens, cu_seqlens_cpu, q):
    """``cu_seqlens`` and FLA's host copy ``cu_seqlens_cpu`` as token offsets, checked before any of their values is
    read (a float tensor would be truncated); the copy only beside the offsets it copies."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return  # _inputs names q
    tokens = q.shape[0] * q.shape[1]
    if cu_seqlens is not None:
        check_offsets(cu_seqlens, q.device, tokens)
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            fail("cu_seqlens_cpu", "None without cu_seqlens (it is the host copy of cu_seqlens)",
                 _describe(cu_seqlens_cpu))
        check_offsets(cu_seqlens_cpu, torch.device("cpu"), tokens, name="cu_seqlens_cpu", where=None)


def _token_rows(tensors):
    """The inputs as one row of B·T tokens ``[1, B*T, ...]`` (varlen layout), once their ``[B, T]`` agree."""
    batch, length = tensors["q"].shape[:2]
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor) or x.shape[:2] != (batch, length):
            fail(name, f"a tensor [B={batch}, T={length}, ...] like q", getattr(x, "shape", type(x).__name__))
    return {name: x.reshape(1, batch * length, *x.shape[2:]) for name, x in tensors.items()}


def _prefill_with_chunk_states(tensors, kw, initial_state, cu_seqlens, cu_seqlens_cpu, chunk, state_v_first,
                               sequence_parallel):
    """:func:`chunk_kda`'s ``(o, final_state [N, HV, V, K], h)``: prefills of up to three chunks per sequence in
    turn, each from the state the previous one left; a round's entry state and its checkpoints after one and two
    chunks are the rows of ``h`` for those chunks (checkpoints equal prefix runs' final states, spec §3)."""
    q, v = tensors["q"], tensors["v"]
    batch, length, heads, key_dim = q.shape
    value_dim, device = v.shape[-1], q.device
    if cu_seqlens is None:
        lengths = torch.full((batch,), length, dtype=torch.int64)
    else:
        if batch != 1:
            fail("q", "of batch size 1 when cu_seqlens is given", batch)
        host = cu_seqlens.cpu() if cu_seqlens_cpu is None else cu_seqlens_cpu
        checks.cu_seqlens_values(host, length)
        lengths = host.long().diff()
    num_seqs = lengths.numel()
    flat = _token_rows(tensors)
    chunks = (lengths + chunk - 1) // chunk  # per sequence: its rows of h
    first_row = chunks.cumsum(0) - chunks
    seq_start = lengths.cumsum(0) - lengths
    layout = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h = torch.empty(int(chunks.sum()), heads, *layout, dtype=tensors["k"].dtype, device=device)
    state = (torch.zeros(num_seqs, heads, value_dim, key_dim, device=device) if initial_state is None
             else initial_state.to(torch.float32, copy=True))
    out = torch.empty(flat["v"].shape, dtype=v.dtype, device=device)
    checkpoint_offsets = torch.tensor([chunk, 2 * chunk], dtype=torch.int32, device=device).repeat(num_seqs, 1)
    checkpoint_states = torch.empty(num_seqs, 2, heads, value_dim, key_dim, device=device)
    span = 3 * chunk
    rounds = -(-int(lengths.max()) // span) if num_seqs else 0
    for r in range(rounds):
        piece = (lengths - r * span).clamp(0, span)
        piece_end = piece.cumsum(0)
        tokens = (torch.arange(int(piece_end[-1])) + torch.repeat_interleave(seq_start + r * span - piece_end + piece,
                                                                              piece)).to(device)
        cu = torch.cat([piece_end.new_zeros(1), piece_end]).to(device=device, dtype=torch.int32)
        chunk_index = 3 * r + torch.arange(3)
        seq, which = (chunk_index < chunks[:, None]).nonzero(as_tuple=True)  # the states this round gives h
        row = (first_row[seq] + chunk_index[which]).to(device)
        seq, which, entry = seq.to(device), which.to(device), (which == 0).to(device)
        h.index_copy_(0, row[entry], _other_layout(state[seq[entry]], state_v_first).to(h.dtype))
        o, _ = kda_prefill(*(flat[name].index_select(1, tokens) for name in NAMES), **kw, initial_state=state,
                           final_state=state, cu_seqlens=cu, checkpoint_offsets=checkpoint_offsets,
                           checkpoint_states=checkpoint_states, sequence_parallel=sequence_parallel)
        out.index_copy_(1, tokens, o)
        inner = ~entry
        h.index_copy_(0, row[inner], _other_layout(checkpoint_states[seq[inner], which[inner] - 1],
                                                   state_v_first).to(h.dtype))
    h = h.view(batch, -(-length // chunk), *h.shape[1:]) if cu_seqlens is None else h.unsqueeze(0)
    return out.view(v.shape), state, h


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA's ``fused_recurrent_kda`` (fla/ops/kda/fused_recurrent.py): KDA over any number of tokens per
    sequence (here :func:`fastkda.kda_prefill`); returns ``(o, final_state)``, the final state fp32 in FLA's
    layout, or None without ``output_final_state``.

    The gate as in :func:`chunk_kda`, except that ``use_gate_in_kernel`` without ``lower_bound`` and without
    ``A_log`` is FLA's kernel's ``-e·softplus(g + dt_bias)`` (it takes a missing A_log as 1 before the exp).
    FLA's wrapper drops its kernel's pool arguments; given here (``ssm_state_indices``, ``num_accepted_tokens``,
    ``out``, ``inplace_final_state=True``) they are refused: :func:`fused_recurrent_kda_fwd` takes them."""
    state_v_first = _renamed_layout(state_v_first, kwargs)
    for name in ("ssm_state_indices", "num_accepted_tokens", "out"):
        if kwargs.get(name) is not None:
            fail(name, "None here (FLA's fused_recurrent_kda drops it; fused_recurrent_kda_fwd takes it)", "a value")
    if kwargs.get("inplace_final_state"):
        fail("inplace_final_state", "False here (FLA's fused_recurrent_kda drops it; fused_recurrent_kda_fwd "
             "takes it)", True)
    _needs_beta_sigmoid(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    return fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, scale=scale,
        output_final_state=output_final_state, inplace_final_state=False, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound)


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False,
                            cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                            **kwargs):
    """FLA's ``fused_recurrent_kda_fwd``, the kernel entry vLLM drives; returns ``(o, final_state)``. ``o`` is
    written into ``out`` when given; tokens no sequence owns stay zero, as in FLA.

    Without ``ssm_state_indices``: ``inplace_final_state`` (the default) writes each sequence's final state into
    ``initial_state`` (required) and returns it; else a new fp32 final state with ``output_final_state``.

    With ``ssm_state_indices`` (continuous batching, :func:`fastkda.kda_decode`): ``initial_state`` is a pool of
    states ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``), updated in place and returned.
    ``[N]`` indices: sequence n reads and writes slot ``[n]`` (at most one token per sequence, as FLA's indexing
    assumes); ``[N, S]``: it reads slot ``[n, num_accepted_tokens[n] - 1]`` (``[n, 0]`` without
    ``num_accepted_tokens``) and writes the state after its token t to slot ``[n, t]`` (t < S);
    ``num_accepted_tokens[n]`` may not exceed sequence n's token count (FLA would read a column past the sequence's
    tokens; refused on the CPU; on the GPU, without a sync, a padding row counted as ``accepted``,
    :func:`fastkda.error_counts`). A sequence of no tokens reads and writes nothing; a negative slot is padding
    (zero output, nothing written; FLA does not guard it). ``inplace_final_state=False`` is refused there (FLA
    then writes token states past an ``[N]`` buffer).
    Errors from :func:`fastkda.kda_decode` call the indices ``slots`` and the pool ``state_pool``. A K-first pool
    is transposed and written back whole on each call; V-first pools (``state_v_first``) are used in place.
    ``cu_seqlens`` stays on the device (no sync), so the V-first pool path can be captured in a CUDA graph.

    Beta of shape ``[B, T, HV, V]`` (FLA's per-channel beta) is refused. ``allow_neg_eigval`` acts only with
    ``use_beta_sigmoid_in_kernel``, as in FLA's kernel; the gate as in :func:`fused_recurrent_kda`."""
    if use_gate_in_kernel and lower_bound is None and A_log is None:
        A_log = torch.ones(v.shape[2], device=v.device)  # FLA's kernel: b_A = 1.0 when A_log is None, then exp
    tensors, kw = _inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                          lower_bound=lower_bound if use_gate_in_kernel else None,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    if out is not None and out.shape != v.shape:
        fail("out", f"of v's shape {list(v.shape)}", list(out.shape))
    if (inplace_final_state or ssm_state_indices is not None) and initial_state is None:
        fail("initial_state", "given when inplace_final_state=True or with ssm_state_indices (it is updated in "
             "place)", None)
    if ssm_state_indices is not None:
        if not inplace_final_state:
            fail("inplace_final_state", "True with ssm_state_indices", False)
        return _decode_pool(tensors, kw, initial_state, ssm_state_indices, num_accepted_tokens, cu_seqlens, out,
                            state_v_first), initial_state
    if not inplace_final_state:
        o, final = kda_prefill(*tensors.values(), **kw, initial_state=_other_layout(initial_state, state_v_first),
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, out=_own(out, v))
        return _written(out, o), _other_layout(final, state_v_first)
    o = _updated_in_place(initial_state, state_v_first, lambda states: kda_prefill(
        *tensors.values(), **kw, initial_state=states, final_state=states, cu_seqlens=cu_seqlens,
        out=_own(out, v))[0])
    return _written(out, o), initial_state


def _own(out, v):
    """``out`` where fastkda can write it directly (contiguous, v's dtype), else None (then :func:`_written`
    copies, casting as FLA's kernel stores)."""
    return out if out is not None and out.is_contiguous() and out.dtype == v.dtype else None


def _written(out, o):
    """The output FLA returns: ``out`` holding ``o`` when the caller gave one, else ``o``."""
    if out is None or out is o:
        return o
    return out.copy_(o)


def _updated_in_place(states, state_v_first, update):
    """``update(work)``'s result, ``work`` being ``states`` (FLA's layout) as the contiguous V-first tensor that
    ``update`` changes in place: ``states`` itself where it is one, else a transposed copy written back after."""
    work = _other_layout(states, state_v_first)
    result = update(work)
    if work is not states:
        states.copy_(_other_layout(work, state_v_first))
    return result


def _decode_pool(tensors, kw, pool, indices, num_accepted_tokens, cu_seqlens, out, state_v_first):
    """:func:`fused_recurrent_kda_fwd`'s continuous batching on :func:`fastkda.kda_decode`: every sequence's tokens
    gathered into a row of ``S`` tokens (the columns of ``indices``; 1 for ``[N]`` indices), the slots of tokens
    past a sequence's end set to -1 (not written; an empty sequence's whole row, so it reads nothing either), the
    outputs scattered back to the tokens they belong to. Device-side index math only: no sync."""
    q, v = tensors["q"], tensors["v"]
    batch, length = q.shape[:2]
    if not isinstance(indices, torch.Tensor) or indices.dim() not in (1, 2):
        fail("ssm_state_indices", "a tensor [N] or [N, S] of pool slots", _describe(indices))
    check_tensor("ssm_state_indices", indices, indices.shape, INDEX_DTYPES, q.device)
    per_token = indices.dim() == 2
    columns = indices.shape[1] if per_token else 1
    if num_accepted_tokens is not None and not per_token:
        fail("num_accepted_tokens", "None with [N] ssm_state_indices (it picks a column of [N, S] indices)",
             list(num_accepted_tokens.shape))
    if cu_seqlens is None:
        if length > columns:
            fail("ssm_state_indices", f"[N, S] with S >= T={length} (token t's slot is column t; [N] indices serve "
                 "one token per sequence)", list(indices.shape))
        cu_seqlens = torch.arange(batch + 1, device=q.device) * length
    else:
        check_offsets(cu_seqlens, q.device, batch * length)  # before its values are read as token offsets
        if batch != 1:
            fail("q", "of batch size 1 when cu_seqlens is given", batch)
    tensors = _token_rows(tensors)
    total, num_seqs = batch * length, cu_seqlens.numel() - 1
    if total == 0:  # no sequence at all only with no tokens: check_offsets refused fewer than two offsets for T > 0
        return torch.zeros_like(v) if out is None else out.zero_()
    if indices.shape[0] != num_seqs:
        fail("ssm_state_indices", f"of one row per sequence ({num_seqs})", list(indices.shape))
    # read on the CPU, and for the accepted counts (a GPU step without them launches nothing more)
    lengths = cu_seqlens.diff() if not cu_seqlens.is_cuda or num_accepted_tokens is not None else None
    if not cu_seqlens.is_cuda:  # free on the CPU; on the GPU the tokens past S of a sequence stay zero
        checks.cu_seqlens_values(cu_seqlens, total, padded=True)  # tokens past the last sequence: zero, as FLA
        longest = int(lengths.max())
        if longest > columns:
            fail("cu_seqlens", f"sequences of at most {columns} tokens (one column of ssm_state_indices each)",
                 f"one of {longest}")
    if (isinstance(num_accepted_tokens, torch.Tensor) and num_accepted_tokens.device == cu_seqlens.device
            and num_accepted_tokens.shape == (num_seqs,)):  # else kda_decode names what is wrong with it
        past = (num_accepted_tokens > lengths) & (lengths > 0)  # the read column would be padding's
        if not cu_seqlens.is_cuda and bool(past.any()):
            n = int(past.nonzero()[0])
            fail("num_accepted_tokens", "at most its sequence's token count (the state is read from the column "
                 "of its last accepted token, which must be one of the sequence's own)",
                 f"{int(num_accepted_tokens[n])} for sequence {n} of {int(lengths[n])} tokens")
        # the GPU: such a count set to 0 (outside [1, S]) makes kda_decode count it (`accepted`) and pad the row,
        # on the device, without a sync
        num_accepted_tokens = torch.where(past, 0, num_accepted_tokens)
    start = cu_seqlens[:-1].long()
    step = torch.arange(columns, device=q.device)
    inside = step < (cu_seqlens[1:].long() - start)[:, None]  # [N, S]: token t of sequence n exists
    token = torch.where(inside, start[:, None] + step, 0)
    slots = torch.where(inside, indices.reshape(num_seqs, columns), -1)
    rows = {name: x[0, token] for name, x in tensors.items()}  # [N, S, ...]
    decoded = _updated_in_place(pool, state_v_first, lambda states: kda_decode(
        *rows.values(), states, slots if per_token else slots[:, 0], **kw,
        num_accepted_tokens=num_accepted_tokens))
    # `out` is written only now, after every check has passed: a refused call leaves it as it was
    o = torch.empty_like(v) if out is None else out
    landing = torch.zeros(total + 1, *o.shape[2:], dtype=o.dtype, device=o.device)  # row `total`: padding's
    landing.index_copy_(0, torch.where(inside, token, total).reshape(-1),
                        decoded.reshape(-1, *o.shape[2:]).to(o.dtype))  # cast as FLA's kernel stores
    return o.copy_(landing[:total].view(o.shape))

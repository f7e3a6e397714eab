"""Public functions of fastkda.

``kda_prefill`` validates everything it can see on the host, then calls the ``fastkda::prefill`` custom op:
the Triton kernels on CUDA tensors, the vectorised PyTorch chunked path on CPU tensors. Nothing is written
when validation fails, and nothing synchronises host and device, so the call is CUDA-graph capturable.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .plan import SUPPORTED_DIMS, DecodePlan, PrefillPlan, choose_decode_plan, choose_plan, sm_count
from .reference import kda_chunked, kda_decode_reference

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.bfloat16, torch.float32)
MIN_LOWER_BOUND = -5.0  # exp(-G) over a 16-token block stays below e^80 (fp32/bf16 range) for λ >= -5


def _fail(name, expected, got):
    raise ValueError(f"fastkda: {name} must be {expected}, got {got}")


def _check_tensor(name, x, shape, dtypes, device):
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__)
    if x.shape != shape:
        _fail(name, f"of shape {list(shape)}", list(x.shape))
    if x.dtype not in dtypes:
        _fail(name, f"of dtype {' or '.join(str(d) for d in dtypes)}", x.dtype)
    if x.device != device:
        _fail(name, f"on {device} (where q is)", x.device)


def _check_token_rows(name, x):
    """The kernels address token t of batch b as ``base + (b*T + t) * stride(1)``, rows contiguous."""
    batch, length, heads, dim = x.shape
    stride = x.stride()
    if stride[3] != 1 or stride[2] != dim or (batch > 1 and stride[0] != length * stride[1]):
        _fail(name, "contiguous within each token ([H, D] rows) with batch rows back to back", f"strides {stride}")


def _check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale):
    """q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, the gate and the scale; returns the
    value dimension."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _fail("q", "a 4-D tensor [B, T, H, K]", getattr(q, "shape", type(q).__name__))
    batch, length, heads, key_dim = q.shape
    device = q.device
    if key_dim not in SUPPORTED_DIMS:
        _fail("q", f"of key dimension K in {SUPPORTED_DIMS}", key_dim)
    _check_tensor("q", q, q.shape, FLOAT_DTYPES, device)
    _check_tensor("k", k, q.shape, (q.dtype,), device)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.shape[-1] not in SUPPORTED_DIMS:
        _fail("v", f"a 4-D tensor [B, T, H, V] with V in {SUPPORTED_DIMS}", getattr(v, "shape", type(v).__name__))
    value_dim = v.shape[-1]
    _check_tensor("v", v, (batch, length, heads, value_dim), (q.dtype,), device)
    _check_tensor("g", g, q.shape, FLOAT_DTYPES, device)
    _check_tensor("beta", beta, (batch, length, heads), FLOAT_DTYPES, device)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _check_token_rows(name, x)
    if batch > 1 and beta.stride(0) != length * beta.stride(1):
        _fail("beta", "a view whose batch rows are back to back", f"strides {tuple(beta.stride())}")
    _check_gate(A_log, dt_bias, lower_bound, heads, key_dim, device)
    if not isinstance(scale, (int, float)) or not scale > 0:
        _fail("scale", "a positive number", scale)
    return value_dim


def _check_gate(A_log, dt_bias, lower_bound, heads, key_dim, device):
    """All three lower-bound gate arguments, or none (then g is the log-decay)."""
    gate_args = (A_log, dt_bias, lower_bound)
    if any(x is not None for x in gate_args) and any(x is None for x in gate_args):
        _fail("A_log, dt_bias and lower_bound", "all given (lower-bound gate) or all None (g is the log-decay)",
              f"A_log={'set' if A_log is not None else None}, dt_bias={'set' if dt_bias is not None else None}, "
              f"lower_bound={lower_bound}")
    if lower_bound is None:
        return
    if not isinstance(lower_bound, (int, float)) or not MIN_LOWER_BOUND <= lower_bound < 0:
        _fail("lower_bound", f"a number in [{MIN_LOWER_BOUND}, 0)", lower_bound)
    if not isinstance(A_log, torch.Tensor) or A_log.numel() != heads or not A_log.is_contiguous():
        _fail("A_log", f"a contiguous tensor of {heads} values ([H])", getattr(A_log, "shape", type(A_log).__name__))
    _check_tensor("A_log", A_log, A_log.shape, FLOAT_DTYPES, device)
    if not isinstance(dt_bias, torch.Tensor) or dt_bias.numel() != heads * key_dim or not dt_bias.is_contiguous():
        _fail("dt_bias", f"a contiguous tensor of {heads * key_dim} values ([H, K] or [H*K])",
              getattr(dt_bias, "shape", type(dt_bias).__name__))
    _check_tensor("dt_bias", dt_bias, dt_bias.shape, FLOAT_DTYPES, device)


def _check_out(out, v):
    if out is not None:
        _check_tensor("out", out, v.shape, (v.dtype,), v.device)
        if not out.is_contiguous():
            _fail("out", "contiguous", f"strides {tuple(out.stride())}")


def _check_not_an_input(out, inputs):
    """``out`` must not share its first element with an input (checked on every call: it depends on addresses)."""
    if out is not None and out.numel() and out.data_ptr() in {x.data_ptr() for x in inputs if x.numel()}:
        _fail("out", "a buffer that is not also an input", "an input tensor")


_VALIDATED = {}  # (validation function, signature of its arguments) -> what it returned
_NOT_YET = object()  # a signature not validated yet (validation may return None)


def _validated(validate, *args):
    """``validate(*args)``, remembered per signature of the arguments: validation reads only each tensor's shape,
    strides, dtype and device and the other arguments' values, and an eager call's host time counts (validation
    was a third of it). No signature holds a tensor; symbolic shapes (torch.compile) are validated afresh."""
    try:
        key = validate, tuple([(a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                               for a in args])
        result = _VALIDATED.get(key, _NOT_YET)
    except TypeError:  # an unhashable argument (a symbolic size, a list): no signature
        return validate(*args)
    if result is _NOT_YET:
        result = validate(*args)  # raises on bad input, so only valid signatures are remembered
        if len(_VALIDATED) > 4096:
            _VALIDATED.clear()
        _VALIDATED[key] = result
    return result


def _scalar_defaults(q, scale, lower_bound):
    """``scale`` defaulting to K^-1/2 (when q is a 4-D tensor with K > 0 to read it from; validation reports
    anything else) and an integer ``lower_bound`` as a float."""
    if scale is None and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[-1]:
        scale = q.shape[-1] ** -0.5
    if isinstance(lower_bound, int) and not isinstance(lower_bound, bool):
        lower_bound = float(lower_bound)
    return scale, lower_bound


def _sms_of(q):
    """The SM count of q's GPU (cached per device), or 1 on the CPU."""
    if not q.is_cuda:
        return 1
    return sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _opaque_when_compiling(op, impl):
    """The custom op while torch.compile traces (so it stays one opaque node), its implementation otherwise:
    the dispatcher costs tens of µs per eager call (92 µs on a 2-core CPU host), more than a small prefill's
    kernels take; CUDA-graph capture records the same kernels either way."""
    return op if torch.compiler.is_compiling() else impl


def validate_prefill(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state,
                     cu_seqlens, out, checkpoint_offsets=None, checkpoint_states=None):
    """Raise ``ValueError`` naming the first argument that breaks the contract (spec §3); return N."""
    value_dim = _check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    batch, length, heads, key_dim = q.shape
    device = q.device
    if cu_seqlens is None:
        num_seqs = batch
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail("cu_seqlens", "a 1-D tensor [N+1]", getattr(cu_seqlens, "shape", type(cu_seqlens).__name__))
        _check_tensor("cu_seqlens", cu_seqlens, cu_seqlens.shape, (torch.int32, torch.int64), device)
        if batch != 1:
            _fail("q", "of batch size 1 when cu_seqlens is given", batch)
        if not cu_seqlens.is_contiguous():
            _fail("cu_seqlens", "contiguous", f"strides {tuple(cu_seqlens.stride())}")
        num_seqs = cu_seqlens.numel() - 1
    state_shape = (num_seqs, heads, value_dim, key_dim)
    for name, state in (("initial_state", initial_state), ("final_state", final_state)):
        if state is not None:
            _check_tensor(name, state, state_shape, STATE_DTYPES, device)
            if not state.is_contiguous():
                _fail(name, "contiguous", f"strides {tuple(state.stride())}")
    _check_out(out, v)
    if (checkpoint_offsets is None) != (checkpoint_states is None):
        _fail("checkpoint_offsets and checkpoint_states", "given together",
              f"checkpoint_offsets={'set' if checkpoint_offsets is not None else None}, "
              f"checkpoint_states={'set' if checkpoint_states is not None else None}")
    if checkpoint_offsets is not None:
        if not isinstance(checkpoint_offsets, torch.Tensor) or tuple(checkpoint_offsets.shape) not in (
                (num_seqs,), (num_seqs, 1), (num_seqs, 2)):
            _fail("checkpoint_offsets", f"of shape [{num_seqs}] or [{num_seqs}, 2]",
                  getattr(checkpoint_offsets, "shape", type(checkpoint_offsets).__name__))
        dtypes = (cu_seqlens.dtype,) if cu_seqlens is not None else (torch.int32, torch.int64)
        _check_tensor("checkpoint_offsets", checkpoint_offsets, checkpoint_offsets.shape, dtypes, device)
        _check_tensor("checkpoint_states", checkpoint_states, (num_seqs, 2, heads, value_dim, key_dim),
                      (torch.float32,), device)
        if not checkpoint_states.is_contiguous():
            _fail("checkpoint_states", "contiguous", f"strides {tuple(checkpoint_states.stride())}")
    return num_seqs


def check_checkpoint_offsets_values(checkpoint_offsets, chunk):
    """Offsets non-negative multiples of the chunk. Reading them costs a device sync, so only CPU tensors are
    checked; on the GPU an offset that is not a multiple of the chunk never matches and is not written."""
    offsets = checkpoint_offsets.reshape(-1).tolist()
    if any(o < 0 or o % chunk for o in offsets):
        _fail("checkpoint_offsets", f"non-negative multiples of the chunk size {chunk}", offsets)


def check_cu_seqlens_values(cu_seqlens, length):
    """Offsets nondecreasing from 0 to T. Reading them costs a device sync, so only CPU tensors are checked."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != length or any(b < a for a, b in zip(offsets, offsets[1:])):
        _fail("cu_seqlens", f"nondecreasing from 0 to T={length}", offsets)


def _prefill_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], lower_bound: Optional[float], scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, launch_numbers: List[int], dot_precision: str, out: torch.Tensor,
    final_state: Optional[torch.Tensor], checkpoint_offsets: Optional[torch.Tensor],
    checkpoint_states: Optional[torch.Tensor],
) -> None:
    """One opaque op for torch.compile and CUDA graphs: Triton on CUDA, the chunked PyTorch path on CPU, both
    as the plan carried in ``launch_numbers`` says (:meth:`fastkda.plan.PrefillPlan.launch_numbers`)."""
    plan = PrefillPlan.from_launch_numbers(launch_numbers, dot_precision)
    gate = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    checkpoints = dict(checkpoint_offsets=checkpoint_offsets, checkpoint_states=checkpoint_states)
    if q.is_cuda:
        from .ops.prefill import chunk_kda_forward  # Triton is only needed on the GPU

        chunk_kda_forward(q, k, v, g, beta, plan=plan, **gate, scale=scale, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
                          out=out, final_state=final_state, **checkpoints)
        return
    if cu_seqlens is not None:
        check_cu_seqlens_values(cu_seqlens, q.shape[1])
    if checkpoint_offsets is not None:
        check_checkpoint_offsets_values(checkpoint_offsets, plan.chunk)
    o, state = kda_chunked(q, k, v, g, beta, **gate, scale=scale, initial_state=initial_state,
                           cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
                           chunk=plan.cpu_chunk, **checkpoints)
    out.copy_(o)
    if final_state is not None:
        final_state.copy_(state)


_prefill_op = torch.library.custom_op("fastkda::prefill", mutates_args=("out", "final_state", "checkpoint_states"))(
    _prefill_impl)


@_prefill_op.register_fake
def _prefill_fake(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens,
                  use_qk_l2norm, use_beta_sigmoid, launch_numbers, dot_precision, out, final_state, checkpoint_offsets,
                  checkpoint_states):
    return None


def kda_prefill(
    q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
    final_state=None, output_final_state=False, cu_seqlens=None, use_qk_l2norm=True, use_beta_sigmoid=True,
    out=None, v_slices="auto", checkpoint_offsets=None, checkpoint_states=None, plan=None,
):
    """Kimi Delta Attention prefill (spec §1, §3). Returns ``(o, final_state)``.

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` (any strides), K, V in {64, 128}.
            q/k/v share one dtype (bf16 on the GPU's fast path); g and beta may be bf16 or fp32.
        A_log ``[H]``, dt_bias ``[H, K]`` or ``[H*K]``, lower_bound in [-5, 0): the lower-bound gate
            ``a = λ·sigmoid(exp(A_log)·(g + dt_bias))``, fused. Leave all three None to pass the log-decay
            ``a`` itself as ``g`` (any value ≤ 0; values below -30 act as -30, a 1e-13 difference).
        scale: defaults to K^-1/2.
        initial_state / final_state: ``[N, H, V, K]`` (V-first), bf16 or fp32; ``final_state`` is filled in
            place. ``output_final_state=True`` without a buffer allocates an fp32 one.
        cu_seqlens: ``[N+1]`` int32/int64 token offsets for varlen (B must be 1); empty sequences allowed.
        use_qk_l2norm, use_beta_sigmoid: turn off for callers who already normalised q/k or applied σ to beta.
        out: optional preallocated output, shape and dtype of v, contiguous.
        v_slices: ``"auto"`` (the launch plan, :mod:`fastkda.plan`), or 1, 2, 4; ``$FASTKDA_V_SLICES``
            applies when this is ``"auto"``. Results are bitwise identical for every choice.
        checkpoint_offsets, checkpoint_states: prefix-cache checkpoints. Offsets ``[N]`` or ``[N, 2]`` (the
            dtype of ``cu_seqlens``) from each sequence's start, multiples of the chunk, 32 (CPU tensors are
            checked; on the GPU another value never matches); the fp32 state after that many tokens is written to
            ``checkpoint_states [N, 2, H, V, K]``, bitwise equal to the final state of a prefill of that prefix
            on the same device. An offset beyond its sequence is ignored.
        plan: a :class:`fastkda.plan.PrefillPlan` for this call's shape (``fastkda.choose_plan(...)``, changed with
            ``.replace(...)``) instead of the automatic one, for sweeps and experiments; ``v_slices`` must then
            stay ``"auto"``.
    """
    scale, lower_bound = _scalar_defaults(q, scale, lower_bound)
    num_seqs = _validated(validate_prefill, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                          final_state, cu_seqlens, out, checkpoint_offsets, checkpoint_states)
    _check_not_an_input(out, (q, k, v, g))
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    facts = (num_seqs, heads, length, key_dim, value_dim)
    varlen, lower_bound_gate = cu_seqlens is not None, lower_bound is not None
    if plan is None:
        plan = choose_plan(*facts, _sms_of(q), varlen=varlen, lower_bound_gate=lower_bound_gate, v_slices=v_slices)
    else:
        _check_plan_fits(plan, facts, varlen, lower_bound_gate, v_slices)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if final_state is None and output_final_state:
        final_state = torch.empty(num_seqs, heads, value_dim, key_dim, dtype=torch.float32, device=q.device)
    _opaque_when_compiling(_prefill_op, _prefill_impl)(
        q, k, v, g, beta, A_log, dt_bias, lower_bound, float(scale), initial_state, cu_seqlens, use_qk_l2norm,
        use_beta_sigmoid, plan.launch_numbers(), plan.dot_precision, out, final_state, checkpoint_offsets,
        checkpoint_states)
    return out, final_state


def _check_plan_fits(plan, facts, varlen, lower_bound_gate, v_slices):
    """A caller's plan must be a :class:`PrefillPlan` made for this call's shape and gate, without ``v_slices``."""
    if not isinstance(plan, PrefillPlan):
        _fail("plan", "a fastkda.PrefillPlan", type(plan).__name__)
    if v_slices != "auto":
        _fail("v_slices", "'auto' when a plan is given (the plan holds v_slices)", v_slices)
    made_for = (plan.num_seqs, plan.heads, plan.seq_len, plan.key_dim, plan.value_dim, plan.varlen,
                plan.lower_bound_gate)
    needed = (*facts, varlen, lower_bound_gate)
    if made_for != needed:
        names = ("num_seqs", "heads", "seq_len", "key_dim", "value_dim", "varlen", "lower_bound_gate")
        _fail("plan", f"made for this call ({', '.join(f'{n}={x}' for n, x in zip(names, needed))})",
              ", ".join(f"{n}={x}" for n, x in zip(names, made_for)))


def validate_decode(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale, num_accepted_tokens,
                    out):
    """Raise ``ValueError`` naming the first argument that breaks the decode contract (spec §5)."""
    value_dim = _check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    num_seqs, tokens, heads, key_dim = q.shape
    device = q.device
    if not isinstance(state_pool, torch.Tensor) or state_pool.dim() != 4:
        _fail("state_pool", "a 4-D tensor [P, H, V, K]", getattr(state_pool, "shape", type(state_pool).__name__))
    _check_tensor("state_pool", state_pool, (state_pool.shape[0], heads, value_dim, key_dim), STATE_DTYPES, device)
    if not state_pool.is_contiguous():
        _fail("state_pool", "contiguous", f"strides {tuple(state_pool.stride())}")
    if not isinstance(slots, torch.Tensor) or tuple(slots.shape) not in ((num_seqs,), (num_seqs, tokens)):
        _fail("slots", f"of shape [{num_seqs}] or [{num_seqs}, {tokens}]", getattr(slots, "shape", type(slots).__name__))
    _check_tensor("slots", slots, slots.shape, (torch.int32, torch.int64), device)
    if num_accepted_tokens is not None:
        if slots.dim() != 2:
            _fail("slots", "per-token [N, T] when num_accepted_tokens is given", list(slots.shape))
        _check_tensor("num_accepted_tokens", num_accepted_tokens, (num_seqs,), (torch.int32, torch.int64), device)
    _check_out(out, v)


def _decode_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float], scale: float, num_accepted_tokens: Optional[torch.Tensor], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, launch_numbers: List[int], out: torch.Tensor,
) -> None:
    """One opaque op: the Triton kernel on CUDA as the plan carried in ``launch_numbers`` says
    (:meth:`fastkda.plan.DecodePlan.launch_numbers`), the token-by-token PyTorch path on CPU."""
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
              num_accepted_tokens=num_accepted_tokens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid)
    if q.is_cuda:
        from .ops.decode import recurrent_kda_decode

        plan = DecodePlan.from_launch_numbers(launch_numbers)
        recurrent_kda_decode(q, k, v, g, beta, state_pool, slots, plan=plan, **kw, out=out)
        return
    out.copy_(kda_decode_reference(q, k, v, g, beta, state_pool, slots, **kw))


_decode_op = torch.library.custom_op("fastkda::decode", mutates_args=("state_pool", "out"))(_decode_impl)


@_decode_op.register_fake
def _decode_fake(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale, num_accepted_tokens,
                 use_qk_l2norm, use_beta_sigmoid, launch_numbers, out):
    return None


def kda_decode(
    q, k, v, g, beta, state_pool, slots, *, A_log=None, dt_bias=None, lower_bound=None, scale=None,
    num_accepted_tokens=None, use_qk_l2norm=True, use_beta_sigmoid=True, out=None, v_slices="auto", plan=None,
):
    """KDA decode over a state pool, updated in place (spec §5). Returns o ``[N, T, H, V]``.

    Args:
        q, k, g: ``[N, T, H, K]``; v: ``[N, T, H, V]``; beta: ``[N, T, H]``: T >= 1 tokens per sequence.
        state_pool: ``[P, H, V, K]``, fp32 or bf16, contiguous.
        slots: ``[N]`` int (each sequence reads and writes its slot) or ``[N, T]`` (the state after token t is
            written to ``slots[n, t]``; the initial state is read from ``slots[n, num_accepted_tokens[n] - 1]``
            when ``num_accepted_tokens [N]`` is given, else ``slots[n, 0]``). A negative read slot is a padding
            row: zero output, nothing read or written; a negative write slot skips that write.
        A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid: as in :func:`kda_prefill`.
        v_slices: ``"auto"`` (16-column slices of the state, :func:`fastkda.plan.choose_decode_plan`), or 1,
            2, 4 as in :func:`kda_prefill`.
        plan: a :class:`fastkda.plan.DecodePlan` for this call (``fastkda.choose_decode_plan(...)``) instead of
            the automatic one; ``v_slices`` must then stay ``"auto"``.
    """
    scale, lower_bound = _scalar_defaults(q, scale, lower_bound)
    _validated(validate_decode, q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale,
               num_accepted_tokens, out)
    _check_not_an_input(out, (q, k, v, g, state_pool))
    num_seqs, _, heads, _ = q.shape
    if plan is None:
        plan = choose_decode_plan(num_seqs, heads, v.shape[-1], _sms_of(q), v_slices)
    elif not isinstance(plan, DecodePlan) or v_slices != "auto" or (plan.num_seqs, plan.heads, plan.value_dim) != (
            num_seqs, heads, v.shape[-1]):
        _fail("plan", f"a fastkda.DecodePlan for num_seqs={num_seqs}, heads={heads}, value_dim={v.shape[-1]}, with "
              "v_slices='auto'", plan)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _opaque_when_compiling(_decode_op, _decode_impl)(
        q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, float(scale), num_accepted_tokens,
        use_qk_l2norm, use_beta_sigmoid, plan.launch_numbers(), out)
    return out

"""What the host can check of a call without reading device memory: shapes, dtypes, devices, strides, scalars,
sizes and buffer overlaps. Every failure raises ``ValueError`` naming the argument, what was expected and what
came, before anything is written. Values inside tensors are :mod:`fastkda.checks`'s."""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from .plan import SUPPORTED_DIMS

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP32_MAX = torch.finfo(torch.float32).max
MIN_LOWER_BOUND = -5.0  # exp(-G) over a 16-token block stays below e^80 (fp32/bf16 range) for λ >= -5
INT32_LIMIT = 2 ** 31  # the kernels form some offsets in 32 bits (fastkda/ops/)


def capturing(device) -> bool:
    """Whether the current CUDA stream is being captured into a graph, for work on ``device`` (never on the CPU):
    a tensor made then belongs to the graph's private memory pool, and a read of device memory ends the capture."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def autograd_records(tensors) -> bool:
    """Whether autograd records a call that reads ``tensors`` (an iterable, read only in grad mode): grad mode on
    and one of them requiring grad. fastkda is inference-only, its outputs carry no gradient: such a call is
    warned (or routed to a path that has one) rather than left to train everything but its KDA layers silently."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


@contextlib.contextmanager
def restored_on_refusal(pool, rows):
    """``pool``'s rows ``rows`` (an index tensor; None: nothing kept) as they are on entry, put back if the block
    raises: where a step writes a pool before a later check can refuse the call (the conv's rows before the KDA
    op's checks), the refused call still leaves the pool as it was."""
    kept = None if rows is None else pool[rows]
    try:
        yield
    except Exception:
        if kept is not None:
            pool.index_copy_(0, rows, kept)
        raise


def check_checkpoints_paired(checkpoint_offsets, checkpoint_states):
    """Prefix-cache checkpoints take both tensors or neither."""
    if (checkpoint_offsets is None) != (checkpoint_states is None):
        fail("checkpoint_offsets and checkpoint_states", "given together",
             f"checkpoint_offsets={'set' if checkpoint_offsets is not None else None}, "
             f"checkpoint_states={'set' if checkpoint_states is not None else None}")


def fail(name, expected, got):
    raise ValueError(f"fastkda: {name} must be {expected}, got {got}")


def _describe(x):
    return list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def check_tensor(name, x, shape, dtypes, device, where="q"):
    """``x`` a tensor of ``shape``, one of ``dtypes``, on ``device``: the device of the argument ``where`` names
    (None: a device of its own, such as the CPU for a host copy)."""
    if not isinstance(x, torch.Tensor):
        fail(name, "a torch.Tensor", type(x).__name__)
    if x.device != device:  # first: a tensor on the wrong device is the mistake its shape or dtype may follow from
        fail(name, f"on {device}" + (f" (where {where} is)" if where else ""), x.device)
    if x.shape != shape:
        fail(name, f"of shape {list(shape)}", list(x.shape))
    if x.dtype not in dtypes:
        fail(name, f"of dtype {' or '.join(str(d) for d in dict.fromkeys(dtypes))}", x.dtype)  # each named once


def check_contiguous(name, x):
    if x is not None and not x.is_contiguous():
        fail(name, "contiguous", f"strides {tuple(x.stride())}")


def _check_token_rows(name, x):
    """The kernels address token t of batch b as ``base + (b*T + t) * stride(1)``, rows contiguous."""
    batch, length, heads, dim = x.shape
    stride = x.stride()
    if x.numel() and (stride[3] != 1 or stride[2] != dim or (batch > 1 and stride[0] != length * stride[1])):
        fail(name, "contiguous within each token ([H, D] rows) with batch rows back to back", f"strides {stride}")


def addressable(x, dim):
    """``x`` (``[B, T, H, D]`` when ``dim`` is 4, ``[B, T, H]`` when 3) as the kernels address it, without a copy
    where its strides allow: token t of batch b at ``(b·T + t)·stride(1)``, each token's ``[H, D]`` contiguous
    (``[H]`` may be strided). A size-1 batch or token dimension gets the stride that makes this hold (a view of
    the same memory); any other layout (a channel-major conv output, batch rows with gaps) is copied. Anything
    but a tensor of that rank is returned as it is, for validation to report."""
    if not isinstance(x, torch.Tensor) or x.dim() != dim or not x.numel() or _contiguous_rows(x):
        return x
    batch, length = x.shape[:2]
    stride = list(x.stride())
    if length == 1:
        stride[1] = stride[0]
    elif batch == 1:
        stride[0] = length * stride[1]
    rows_ok = dim == 3 or (stride[3] == 1 and stride[2] == x.shape[3])
    if rows_ok and stride[0] == length * stride[1]:
        return x if stride == list(x.stride()) else x.as_strided(x.shape, stride)
    return x.contiguous()


def addressable_inputs(q, k, v, g, beta):
    """:func:`addressable` of q, k, v, g (4-D) and beta (3-D), with one early return for contiguous inputs (an
    eager decode step's host time counts: this costs a fraction of a microsecond then)."""
    try:
        if all(_contiguous_rows(x) for x in (q, k, v, g, beta)):
            return q, k, v, g, beta
    except (AttributeError, IndexError):  # not tensors of rank 3 or 4: validation reports them
        return q, k, v, g, beta
    return addressable(q, 4), addressable(k, 4), addressable(v, 4), addressable(g, 4), addressable(beta, 3)


def _contiguous_rows(x):
    """A contiguous tensor whose token stride the kernels can use as it is: ``is_contiguous`` ignores the stride of
    a size-1 dimension, and a single token per sequence (T = 1) is addressed through it."""
    return x.is_contiguous() and (x.shape[1] != 1 or x.shape[0] == 1 or x.stride(0) == x.stride(1))


def as_float(x):
    """A real number of any kind (int, NumPy's scalars: ``numbers.Real``), not a bool, as a Python float; anything
    else as it is, for validation to name."""
    if x is None or type(x) is float:  # the common cases, before the slower abstract-class check
        return x
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else x


def scalar_defaults(q, scale, lower_bound):
    """``scale`` defaulting to K^-1/2 (when q is a 4-D tensor to read K from; validation reports anything else), a
    0-d CPU tensor ``scale`` as its number, and both as Python floats where they are real numbers of another kind
    (an int, a NumPy scalar)."""
    if scale is None and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[-1]:
        scale = q.shape[-1] ** -0.5
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.device.type == "cpu":
        scale = scale.item()
    return as_float(scale), as_float(lower_bound)


def _check_scale(scale):
    if isinstance(scale, torch.Tensor):
        fail("scale", "a Python number or a 0-d CPU tensor (reading a GPU tensor would synchronise)",
             f"a tensor of shape {list(scale.shape)} on {scale.device}")
    # the kernels take it as fp32: past fp32's largest finite value it would be infinity there
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale <= FP32_MAX):
        fail("scale", f"a positive finite number, at most fp32's largest ({FP32_MAX:.6g})", repr(scale))


def check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale):
    """q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, the gate and the scale; returns the
    value dimension."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        fail("q", "a 4-D tensor [B, T, H, K]", _describe(q))
    batch, length, heads, key_dim = q.shape
    device = q.device
    if key_dim not in SUPPORTED_DIMS:
        fail("q", f"of key dimension K in {SUPPORTED_DIMS}", key_dim)
    if heads < 1:
        fail("q", "of at least one head (H >= 1)", f"H={heads}")
    check_tensor("q", q, q.shape, FLOAT_DTYPES, device)
    check_tensor("k", k, q.shape, (q.dtype,), device)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.shape[-1] not in SUPPORTED_DIMS:
        fail("v", f"a 4-D tensor [B, T, H, V] with V in {SUPPORTED_DIMS}", _describe(v))
    value_dim = v.shape[-1]
    check_tensor("v", v, (batch, length, heads, value_dim), (q.dtype,), device)
    check_tensor("g", g, q.shape, FLOAT_DTYPES, device)
    check_tensor("beta", beta, (batch, length, heads), FLOAT_DTYPES, device)
    if device.type == "cuda":  # the kernels' addressing; the CPU path reads any strides
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
            _check_token_rows(name, x)
        if beta.numel() and batch > 1 and beta.stride(0) != length * beta.stride(1):
            fail("beta", "a view whose batch rows are back to back", f"strides {tuple(beta.stride())}")
    _check_gate(A_log, dt_bias, lower_bound, heads, key_dim, device)
    _check_scale(scale)
    return value_dim


def _check_gate(A_log, dt_bias, lower_bound, heads, key_dim, device):
    """All three lower-bound gate arguments, or none (then g is the log-decay)."""
    gate_args = (A_log, dt_bias, lower_bound)
    if any(x is not None for x in gate_args) and any(x is None for x in gate_args):
        fail("A_log, dt_bias and lower_bound", "all given (lower-bound gate) or all None (g is the log-decay)",
             f"A_log={'set' if A_log is not None else None}, dt_bias={'set' if dt_bias is not None else None}, "
             f"lower_bound={lower_bound}")
    if lower_bound is None:
        return
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not (
            MIN_LOWER_BOUND <= lower_bound < 0):
        fail("lower_bound", f"a number in [{MIN_LOWER_BOUND}, 0)", repr(lower_bound))
    if not isinstance(A_log, torch.Tensor) or A_log.numel() != heads or not A_log.is_contiguous():
        fail("A_log", f"a contiguous tensor of {heads} values ([H])", _describe(A_log))
    check_tensor("A_log", A_log, A_log.shape, FLOAT_DTYPES, device)
    # its sizes other than 1 must be H then K, or H·K: a [K, H] tensor holds as many values, in another order
    if not isinstance(dt_bias, torch.Tensor) or not dt_bias.is_contiguous() or tuple(
            size for size in dt_bias.shape if size != 1) not in ((heads, key_dim), (heads * key_dim,)):
        fail("dt_bias", f"a contiguous tensor of {heads * key_dim} values ([H, K] = [{heads}, {key_dim}] or [H*K])",
             _describe(dt_bias))
    check_tensor("dt_bias", dt_bias, dt_bias.shape, FLOAT_DTYPES, device)


def check_out(out, v):
    if out is not None:
        check_tensor("out", out, v.shape, (v.dtype,), v.device)
        check_contiguous("out", out)


def byte_extent(x):
    """Bytes from a tensor's first element to one past the last element it can reach (0 if absent or empty): a
    fact of its shape, strides and dtype, so validation computes it once per signature."""
    if x is None or not x.numel():
        return 0
    return (sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride())) + 1) * x.element_size()


def check_disjoint(name, written, extent, others):
    """``written`` (an output buffer, ``extent`` bytes from its first element) must share no memory with any of
    ``others`` ``[(name, tensor, extent)]``. Checked on every call (addresses change between calls), from the
    extents validation remembered: two address ranges per pair."""
    if not extent:
        return
    start = written.data_ptr()
    end = start + extent
    for other_name, x, other_extent in others:
        if other_extent:
            other_start = x.data_ptr()
            if other_start < end and start < other_start + other_extent:
                fail(name, f"a buffer that shares no memory with {other_name}", f"a tensor overlapping {other_name}")


def check_index_ranges(**products):
    """Shapes the kernels' 32-bit offsets can address: each ``name=(factors...)`` product below 2^31."""
    for name, factors in products.items():
        if math.prod(factors) >= INT32_LIMIT:
            fail("q", "of a shape whose index ranges fit the kernels' 32-bit offsets (each below 2^31)",
                 f"{name.replace('_', ' x ')} = {' x '.join(map(str, factors))}")


def check_prefill_index_ranges(tokens, num_seqs, heads, key_dim, value_dim, chunk):
    """:func:`check_index_ranges` of a prefill of ``tokens`` tokens in all (B·T) in ``num_seqs`` sequences: its
    chunk slots by heads by K, and its states' N by H by V. Shared by :func:`validate_prefill` and the plan
    command (``python -m fastkda plan``), which refuses what the API refuses."""
    check_index_ranges(slots_H_K=(tokens // chunk + num_seqs + 1, heads, key_dim),
                       N_H_V=(num_seqs, heads, value_dim))


def check_offsets(cu_seqlens, device, length, name="cu_seqlens", where="q"):
    """``cu_seqlens`` a 1-D int32/int64 tensor on q's device, checked before anything reads its values as token
    offsets (a float tensor would be truncated), with as many entries as offsets of ``length`` tokens need: at
    least two, or one ([0]) for no tokens; its values are the caller's to check. ``name``: the argument's, for a
    copy of the offsets (FLA's ``cu_seqlens_cpu``); ``where``: as :func:`check_tensor` takes it."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        fail(name, "a 1-D tensor [N+1] of token offsets", _describe(cu_seqlens))
    check_tensor(name, cu_seqlens, cu_seqlens.shape, INDEX_DTYPES, device, where)
    if cu_seqlens.numel() == 0 or (cu_seqlens.numel() == 1 and length):
        fail(name, f"[N+1] offsets from 0 to T={length}: at least two entries when T > 0, one ([0]) "
             f"for an empty batch", f"{cu_seqlens.numel()} entr{'y' if cu_seqlens.numel() == 1 else 'ies'}")


_VALIDATED = {}  # (validation function, signature of its arguments) -> what it returned
_NOT_YET = object()  # a signature not validated yet (validation may return None)


def remembered(validate, *args):
    """``validate(*args)``, remembered per signature of the arguments: validation reads only each tensor's shape,
    strides, dtype and device and the other arguments' values, and an eager call's host time counts (validation
    was a third of it). No signature holds a tensor. Under torch.compile every call is validated afresh: a
    lookup keyed by sizes would make the trace guard on each size, one recompile per new batch or length. A CPU
    tensor's device is keyed as ``True`` (``is_cpu``): hashing a ``torch.device`` costs as much as the rest of a
    tensor's key."""
    if torch.compiler.is_compiling():
        return validate(*args)
    try:
        key = validate, tuple([(a.shape, a.stride(), a.dtype, a.is_cpu or a.device) if isinstance(a, torch.Tensor)
                               else (type(a), a) for a in args])  # typed: True == 1 == 1.0, not equally valid
        result = _VALIDATED.get(key, _NOT_YET)
    except TypeError:  # an unhashable argument (a symbolic size, a list): no signature
        return validate(*args)
    if result is _NOT_YET:
        result = validate(*args)  # raises on bad input, so only valid signatures are remembered
        if len(_VALIDATED) > 4096:
            _VALIDATED.clear()
        _VALIDATED[key] = result
    return result


def validate_prefill(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state,
                     cu_seqlens, out, checkpoint_offsets, checkpoint_states, chunk):
    """Raise ``ValueError`` naming the first argument that breaks the contract (spec §3); return N and the byte
    extents of q, k, v, g, beta, initial_state, final_state, out and checkpoint_states (:func:`check_disjoint`)."""
    value_dim = check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    batch, length, heads, key_dim = q.shape
    device = q.device
    if cu_seqlens is None:
        num_seqs = batch
    else:
        check_offsets(cu_seqlens, device, length)
        if batch != 1:
            fail("q", "of batch size 1 when cu_seqlens is given", batch)
        check_contiguous("cu_seqlens", cu_seqlens)
        num_seqs = cu_seqlens.numel() - 1
    state_shape = (num_seqs, heads, value_dim, key_dim)
    for name, state in (("initial_state", initial_state), ("final_state", final_state)):
        if state is not None:
            check_tensor(name, state, state_shape, STATE_DTYPES, device)
            check_contiguous(name, state)
    check_out(out, v)
    check_prefill_index_ranges(batch * length, num_seqs, heads, key_dim, value_dim, chunk)
    check_checkpoints_paired(checkpoint_offsets, checkpoint_states)
    if checkpoint_offsets is not None:
        if not isinstance(checkpoint_offsets, torch.Tensor) or tuple(checkpoint_offsets.shape) not in (
                (num_seqs,), (num_seqs, 1), (num_seqs, 2)):
            fail("checkpoint_offsets", f"of shape [{num_seqs}] or [{num_seqs}, 2]", _describe(checkpoint_offsets))
        dtypes = (cu_seqlens.dtype,) if cu_seqlens is not None else INDEX_DTYPES
        check_tensor("checkpoint_offsets", checkpoint_offsets, checkpoint_offsets.shape, dtypes, device)
        check_tensor("checkpoint_states", checkpoint_states, (num_seqs, 2, heads, value_dim, key_dim),
                     (torch.float32,), device)
        check_contiguous("checkpoint_states", checkpoint_states)
    return num_seqs, tuple(byte_extent(x) for x in (q, k, v, g, beta, initial_state, final_state, out,
                                                     checkpoint_states))


def validate_decode(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale, num_accepted_tokens,
                    out):
    """Raise ``ValueError`` naming the first argument that breaks the decode contract (spec §5); return the byte
    extents of q, k, v, g, beta, state_pool and out (:func:`check_disjoint`)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] < 1:
        fail("q", "[N, T, H, K] with at least one token per sequence (T >= 1)", f"T={q.shape[1]}")
    value_dim = check_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale)
    num_seqs, tokens, heads, key_dim = q.shape
    device = q.device
    if not isinstance(state_pool, torch.Tensor) or state_pool.dim() != 4:
        fail("state_pool", "a 4-D tensor [P, H, V, K]", _describe(state_pool))
    check_tensor("state_pool", state_pool, (state_pool.shape[0], heads, value_dim, key_dim), STATE_DTYPES, device)
    check_contiguous("state_pool", state_pool)
    if not isinstance(slots, torch.Tensor) or tuple(slots.shape) not in ((num_seqs,), (num_seqs, tokens)):
        fail("slots", f"of shape [{num_seqs}] or [{num_seqs}, {tokens}]", _describe(slots))
    check_tensor("slots", slots, slots.shape, INDEX_DTYPES, device)
    if num_accepted_tokens is not None:
        if slots.dim() != 2:
            fail("slots", "per-token [N, T] when num_accepted_tokens is given", list(slots.shape))
        check_tensor("num_accepted_tokens", num_accepted_tokens, (num_seqs,), INDEX_DTYPES, device)
    check_out(out, v)
    check_index_ranges(H_V_K=(heads, value_dim, key_dim), N_T=(num_seqs, tokens))
    return tuple(byte_extent(x) for x in (q, k, v, g, beta, state_pool, out))

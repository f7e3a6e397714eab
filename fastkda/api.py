"""Public functions of fastkda: prefill and decode.

Each validates what the host can see (:mod:`fastkda.validation`), makes the launch plan (:mod:`fastkda.plan`) and
calls its custom op (``fastkda::prefill``, ``fastkda::decode``): the Triton kernels on CUDA tensors, the PyTorch
path on CPU tensors. Nothing is written when validation fails. Without checked mode nothing synchronises host and
device, so calls are CUDA-graph capturable; on the GPU, bad values inside index tensors are made harmless and
counted (:mod:`fastkda.errors`), and checked mode (:mod:`fastkda.checks`) raises for them instead.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import checks as value_checks
from .errors import KINDS, counters
from .plan import CHUNK, DecodePlan, PrefillPlan, choose_decode_plan, choose_plan, sm_count
from .reference import kda_chunked, kda_decode_reference
from .validation import (check_disjoint, check_tensor, fail, remembered, scalar_defaults, validate_decode,
                         validate_prefill)


def _sms_of(q):
    """The SM count of q's GPU (cached per device), or 1 on the CPU."""
    if not q.is_cuda:
        return 1
    return sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _opaque_when_compiling(op, impl):
    """The custom op while torch.compile traces (so it stays one opaque node), its implementation otherwise:
    the dispatcher costs tens of µs per eager call, more than a small prefill's kernels take; CUDA-graph capture
    records the same kernels either way."""
    return op if torch.compiler.is_compiling() else impl


def _error_counters(errors, q):
    """The counters the kernels add to: the caller's ``errors`` (int32, one per kind of :mod:`fastkda.errors`, on
    q's device) or the device's."""
    if errors is None:
        return counters(q.device) if q.is_cuda else None
    check_tensor("errors", errors, (len(KINDS),), (torch.int32,), q.device)
    return errors


def _checked_mode_may_sync(q):
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        fail("checks", "off inside CUDA-graph capture (checked mode reads device memory)", True)


def _cpu_path(run, name, shape):
    """Run the CPU path, turning an allocation that cannot succeed into a ``ValueError`` naming the input."""
    try:
        return run()
    except RuntimeError as exc:
        if "DefaultCPUAllocator" not in str(exc):
            raise
        fail(name, "small enough for this machine's memory (the CPU path)", f"shape {list(shape)}: {exc}")


def _prefill_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], lower_bound: Optional[float], scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, launch_numbers: List[int], dot_precision: str, checks: bool, out: torch.Tensor,
    final_state: Optional[torch.Tensor], checkpoint_offsets: Optional[torch.Tensor],
    checkpoint_states: Optional[torch.Tensor], errors: Optional[torch.Tensor],
) -> None:
    """One opaque op for torch.compile and CUDA graphs: Triton on CUDA, the chunked PyTorch path on CPU, both
    as the plan carried in ``launch_numbers`` says (:meth:`fastkda.plan.PrefillPlan.launch_numbers`)."""
    plan = PrefillPlan.from_launch_numbers(launch_numbers, dot_precision)
    if checks or not q.is_cuda:  # index values: always on the CPU (free there), on the GPU in checked mode
        if checks:
            _checked_mode_may_sync(q)
        if cu_seqlens is not None and cu_seqlens.numel() > 1:
            value_checks.cu_seqlens_values(cu_seqlens, q.shape[1])
        if checkpoint_offsets is not None:
            value_checks.checkpoint_offsets_values(checkpoint_offsets, plan.chunk)
    if checks:
        if lower_bound is None:
            value_checks.precomputed_gate_values(g)
        value_checks.finite(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    gate = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    checkpoints = dict(checkpoint_offsets=checkpoint_offsets, checkpoint_states=checkpoint_states)
    if q.is_cuda:
        from .ops.prefill import chunk_kda_forward  # Triton is only needed on the GPU

        chunk_kda_forward(q, k, v, g, beta, plan=plan, **gate, scale=scale, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
                          out=out, final_state=final_state, **checkpoints, errors=errors)
        return
    o, state = _cpu_path(lambda: kda_chunked(
        q, k, v, g, beta, **gate, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, chunk=plan.cpu_chunk, **checkpoints,
        segment_tokens=plan.segment_tokens),
        "q", q.shape)
    out.copy_(o)
    if final_state is not None:
        final_state.copy_(state)


_prefill_op = torch.library.custom_op(
    "fastkda::prefill", mutates_args=("out", "final_state", "checkpoint_states", "errors"))(_prefill_impl)


@_prefill_op.register_fake
def _prefill_fake(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens, use_qk_l2norm,
                  use_beta_sigmoid, launch_numbers, dot_precision, checks, out, final_state, checkpoint_offsets,
                  checkpoint_states, errors):
    return None


def kda_prefill(
    q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
    final_state=None, output_final_state=False, cu_seqlens=None, use_qk_l2norm=True, use_beta_sigmoid=True,
    out=None, v_slices="auto", checkpoint_offsets=None, checkpoint_states=None, plan=None, checks=None, errors=None,
    sequence_parallel="auto", max_seqlen=None,
):
    """Kimi Delta Attention prefill (spec §1, §3). Returns ``(o, final_state)``.

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` (any strides), K, V in {64, 128}.
            q/k/v share one dtype (bf16 on the GPU's fast path); g and beta may be bf16 or fp32.
        A_log ``[H]``, dt_bias ``[H, K]`` or ``[H*K]``, lower_bound in [-5, 0): the lower-bound gate
            ``a = λ·sigmoid(exp(A_log)·(g + dt_bias))``, fused. Leave all three None to pass the log-decay
            ``a`` itself as ``g`` (any value ≤ 0; values below -30 act as -30, a 1e-13 difference; values above 0,
            outside the contract, act as 0).
        scale: a positive number (a Python number or a 0-d CPU tensor); defaults to K^-1/2.
        initial_state / final_state: ``[N, H, V, K]`` (V-first), bf16 or fp32; ``final_state`` is filled in
            place (it may be ``initial_state`` itself). ``output_final_state=True`` without a buffer allocates an
            fp32 one.
        cu_seqlens: ``[N+1]`` int32/int64 token offsets for varlen (B must be 1), nondecreasing from 0 to T; empty
            sequences allowed. CPU tensors are checked; on the GPU (without ``checks``) entries outside ``[0, T]``
            or out of order are clamped and counted (:func:`fastkda.error_counts`), the results then unspecified.
        use_qk_l2norm, use_beta_sigmoid: turn off for callers who already normalised q/k or applied σ to beta.
        out: optional preallocated output, shape and dtype of v, contiguous, sharing no memory with an input.
        v_slices: ``"auto"`` (the launch plan, :mod:`fastkda.plan`), or 1, 2, 4; ``$FASTKDA_V_SLICES``
            applies when this is ``"auto"``. Results are bitwise identical for every choice.
        sequence_parallel: ``"auto"`` (default; then ``$FASTKDA_SEQUENCE_PARALLEL``), ``False``, or tokens per
            segment (a multiple of 32). Cuts each sequence, from its first token, into segments that run on
            separate SMs and are joined by a scan over their transitions (``docs/sequence-parallel.md``): the auto
            plan does so where it predicts at least 10% off the serial recurrence for the longest sequence the
            call's shape allows. Results then depend on the segment length (deterministic, bitwise identical
            across ``v_slices``, within the same accuracy bound); ``False`` keeps the serial recurrence and its
            bits. Checkpoints equal a prefix run's final state bit for bit when both runs use the same segment
            length (``False``, or the same int).
        max_seqlen: with ``cu_seqlens``, the longest sequence's length if the caller knows it on the host (as
            flash-attn takes it; serving engines keep it in their batch metadata): the automatic plan then cuts
            sequences of that length. A hint only: a wrong value costs time, never correctness. Without it the plan
            assumes one sequence may hold every token, and cuts only where a balanced batch gains too.
        checkpoint_offsets, checkpoint_states: prefix-cache checkpoints. Offsets ``[N]`` or ``[N, 2]`` (the
            dtype of ``cu_seqlens``) from each sequence's start, multiples of the chunk, 32 (CPU tensors are
            checked; on the GPU another value never matches); the fp32 state after that many tokens is written to
            ``checkpoint_states [N, 2, H, V, K]``, bitwise equal to the final state of a prefill of that prefix
            on the same device. An offset beyond its sequence is ignored.
        plan: a :class:`fastkda.plan.PrefillPlan` for this call's shape (``fastkda.choose_plan(...)``, changed with
            ``.replace(...)``) instead of the automatic one, for sweeps and experiments; ``v_slices`` must then
            stay ``"auto"``.
        checks: True synchronises and raises ``ValueError`` for every contract break the host cannot see cheaply
            (``cu_seqlens`` and checkpoint offsets, a precomputed gate above 0, non-finite inputs); None (default)
            reads ``$FASTKDA_CHECKS`` ("1" turns it on). Not inside CUDA-graph capture.
        errors: int32 ``[3]`` counters (on q's device) the GPU kernels add malformed indices to, instead of the
            device's own (:mod:`fastkda.errors`).
    """
    scale, lower_bound = scalar_defaults(q, scale, lower_bound)
    num_seqs, extents = remembered(validate_prefill, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                                   initial_state, final_state, cu_seqlens, out, checkpoint_offsets, checkpoint_states,
                                   CHUNK)
    if out is not None or final_state is not None:  # buffers the caller passed must not alias an input
        others = list(zip(("q", "k", "v", "g", "beta", "initial_state", "final_state"),
                          (q, k, v, g, beta, initial_state, final_state), extents))
        check_disjoint("out", out, extents[7], others)
        check_disjoint("final_state", final_state, extents[6], others[:5])
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    facts = (num_seqs, heads, length, key_dim, value_dim)
    varlen, lower_bound_gate = cu_seqlens is not None, lower_bound is not None
    if plan is None:
        plan = choose_plan(*facts, _sms_of(q), varlen=varlen, lower_bound_gate=lower_bound_gate, v_slices=v_slices,
                           sequence_parallel=sequence_parallel, max_seqlen=max_seqlen)
    else:
        _check_plan_fits(plan, facts, varlen, lower_bound_gate, v_slices, sequence_parallel)
    errors = _error_counters(errors, q)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if final_state is None and output_final_state:
        final_state = torch.empty(num_seqs, heads, value_dim, key_dim, dtype=torch.float32, device=q.device)
    _opaque_when_compiling(_prefill_op, _prefill_impl)(
        q, k, v, g, beta, A_log, dt_bias, lower_bound, float(scale), initial_state, cu_seqlens, use_qk_l2norm,
        use_beta_sigmoid, plan.launch_numbers(), plan.dot_precision, value_checks.requested(checks), out,
        final_state, checkpoint_offsets, checkpoint_states, errors)
    return out, final_state


def _check_plan_fits(plan, facts, varlen, lower_bound_gate, v_slices, sequence_parallel):
    """A caller's plan must be a :class:`PrefillPlan` made for this call's shape and gate, without ``v_slices``
    or ``sequence_parallel``."""
    if not isinstance(plan, PrefillPlan):
        fail("plan", "a fastkda.PrefillPlan", type(plan).__name__)
    if v_slices != "auto":
        fail("v_slices", "'auto' when a plan is given (the plan holds v_slices)", v_slices)
    if not (isinstance(sequence_parallel, str) and sequence_parallel == "auto"):
        fail("sequence_parallel", "'auto' when a plan is given (the plan holds the segments)", sequence_parallel)
    made_for = (plan.num_seqs, plan.heads, plan.seq_len, plan.key_dim, plan.value_dim, plan.varlen,
                plan.lower_bound_gate)
    needed = (*facts, varlen, lower_bound_gate)
    if made_for != needed:
        names = ("num_seqs", "heads", "seq_len", "key_dim", "value_dim", "varlen", "lower_bound_gate")
        fail("plan", f"made for this call ({', '.join(f'{n}={x}' for n, x in zip(names, needed))})",
             ", ".join(f"{n}={x}" for n, x in zip(names, made_for)))


def _decode_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float], scale: float, num_accepted_tokens: Optional[torch.Tensor], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, launch_numbers: List[int], checks: bool, out: torch.Tensor,
    errors: Optional[torch.Tensor],
) -> None:
    """One opaque op: the Triton kernel on CUDA as the plan carried in ``launch_numbers`` says
    (:meth:`fastkda.plan.DecodePlan.launch_numbers`), the token-by-token PyTorch path on CPU."""
    if checks or not q.is_cuda:
        if checks:
            _checked_mode_may_sync(q)
        value_checks.decode_indices(slots, num_accepted_tokens, state_pool.shape[0], q.shape[1])
    if checks:
        if lower_bound is None:
            value_checks.precomputed_gate_values(g)
        value_checks.finite(q=q, k=k, v=v, g=g, beta=beta)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
              num_accepted_tokens=num_accepted_tokens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid)
    if q.is_cuda:
        from .ops.decode import recurrent_kda_decode

        plan = DecodePlan.from_launch_numbers(launch_numbers)
        recurrent_kda_decode(q, k, v, g, beta, state_pool, slots, plan=plan, **kw, out=out, errors=errors)
        return
    out.copy_(_cpu_path(lambda: kda_decode_reference(q, k, v, g, beta, state_pool, slots, **kw), "q", q.shape))


_decode_op = torch.library.custom_op("fastkda::decode", mutates_args=("state_pool", "out", "errors"))(_decode_impl)


@_decode_op.register_fake
def _decode_fake(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale, num_accepted_tokens,
                 use_qk_l2norm, use_beta_sigmoid, launch_numbers, checks, out, errors):
    return None


def kda_decode(
    q, k, v, g, beta, state_pool, slots, *, A_log=None, dt_bias=None, lower_bound=None, scale=None,
    num_accepted_tokens=None, use_qk_l2norm=True, use_beta_sigmoid=True, out=None, v_slices="auto", plan=None,
    checks=None, errors=None,
):
    """KDA decode over a state pool, updated in place (spec §5). Returns o ``[N, T, H, V]``.

    Args:
        q, k, g: ``[N, T, H, K]``; v: ``[N, T, H, V]``; beta: ``[N, T, H]``: T >= 1 tokens per sequence.
        state_pool: ``[P, H, V, K]``, fp32 or bf16, contiguous.
        slots: ``[N]`` int (each sequence reads and writes its slot) or ``[N, T]`` (the state after token t is
            written to ``slots[n, t]``; the initial state is read from ``slots[n, num_accepted_tokens[n] - 1]``
            when ``num_accepted_tokens [N]`` (each in ``[1, T]``) is given, else ``slots[n, 0]``). A negative read
            slot is a padding row: zero output, nothing read or written; a negative write slot skips that write.
            No slot may be used by two live sequences. CPU tensors are checked; on the GPU (without ``checks``)
            a read slot at or past P, or an accepted count outside ``[1, T]``, makes a padding row, a write slot
            past P skips that write, and each is counted (:func:`fastkda.error_counts`).
        A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid, checks, errors: as in
            :func:`kda_prefill` (``checks`` here also covers the slots and accepted counts).
        v_slices: ``"auto"`` (16-column slices of the state, :func:`fastkda.plan.choose_decode_plan`), or 1,
            2, 4 as in :func:`kda_prefill`.
        plan: a :class:`fastkda.plan.DecodePlan` for this call (``fastkda.choose_decode_plan(...)``) instead of
            the automatic one; ``v_slices`` must then stay ``"auto"``.
    """
    scale, lower_bound = scalar_defaults(q, scale, lower_bound)
    extents = remembered(validate_decode, q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale,
                         num_accepted_tokens, out)
    if out is not None:
        check_disjoint("out", out, extents[6], zip(("q", "k", "v", "g", "beta", "state_pool"),
                                                   (q, k, v, g, beta, state_pool), extents))
    num_seqs, _, heads, _ = q.shape
    if plan is None:
        plan = choose_decode_plan(num_seqs, heads, v.shape[-1], _sms_of(q), v_slices)
    elif not isinstance(plan, DecodePlan) or v_slices != "auto" or (plan.num_seqs, plan.heads, plan.value_dim) != (
            num_seqs, heads, v.shape[-1]):
        fail("plan", f"a fastkda.DecodePlan for num_seqs={num_seqs}, heads={heads}, value_dim={v.shape[-1]}, with "
             "v_slices='auto'", plan)
    errors = _error_counters(errors, q)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _opaque_when_compiling(_decode_op, _decode_impl)(
        q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, float(scale), num_accepted_tokens,
        use_qk_l2norm, use_beta_sigmoid, plan.launch_numbers(), value_checks.requested(checks), out, errors)
    return out

"""Public functions of fastkda: prefill and decode, and the layer's conv, gated norm and fused decode step.

Each validates what the host can see (:mod:`fastkda.validation`), makes the launch plan (:mod:`fastkda.plan`) and
calls its custom op (``fastkda::prefill``, ``fastkda::decode``): the Triton kernels on CUDA tensors, the PyTorch
path on CPU tensors. Eager CPU calls of decode, the conv and the norm return that path's result itself, without the
op and an output buffer to copy it into: a CPU decode step is many tiny ops, and its host time is what a model's
generation waits for. Nothing is written when validation fails. Without checked mode nothing synchronises host and
device, so calls are CUDA-graph capturable; on the GPU, bad values inside index tensors are made harmless and
counted (:mod:`fastkda.errors`), and checked mode (:mod:`fastkda.checks`) raises for them instead.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from . import checks as value_checks
from .errors import KINDS, counters
from .plan import (CHUNK, DOT_PRECISION, DecodePlan, PrefillPlan, choose_decode_plan, choose_decode_step_plan,
                   choose_open_entry_plan, choose_plan, decode_plan_request, has_warpgroup_mma, is_plan_request,
                   prefill_plan_request, requested_decode_plan, requested_open_entry_segments,
                   requested_prefill_plan, requested_v_slices, sm_count)
from .reference import (_as, autocast_off, causal_conv1d_reference, compose_segment_maps, gated_rmsnorm_reference,
                        kda_chunked, kda_decode_reference, open_segment_maps, run_from_segment_maps)
from .validation import (FLOAT_DTYPES, INDEX_DTYPES, STATE_DTYPES, _describe, addressable_inputs, as_float,
                         byte_extent, check_contiguous, check_disjoint, check_tensor, fail, remembered,
                         restored_on_refusal, scalar_defaults, validate_decode, validate_prefill)


def _device_index(q):
    """The index of q's CUDA device (the current one for an unindexed ``cuda``)."""
    return q.device.index if q.device.index is not None else torch.cuda.current_device()


def _sms_of(q):
    """The SM count of q's GPU (cached per device), or 1 on the CPU."""
    if not q.is_cuda:
        return 1
    return sm_count(_device_index(q))


def _warpgroup_mma_of(q):
    """Whether q's GPU runs Hopper's warpgroup MMA (:func:`fastkda.plan.has_warpgroup_mma`); False on the CPU."""
    return q.is_cuda and has_warpgroup_mma(_device_index(q))


def _opaque_when_compiling(op, impl):
    """The custom op while torch.compile traces (so it stays one opaque node), its implementation otherwise:
    the dispatcher costs tens of µs per eager call, more than a small prefill's kernels take; CUDA-graph capture
    records the same kernels either way."""
    return op if torch.compiler.is_compiling() else impl


@torch.compiler.assume_constant_result
def _counters_made(device) -> bool:
    """The device's error counters made while torch.compile traces, outside the graph, where the op finds them when
    it runs: made by the op's first run instead, under inductor's CUDA graphs ("reduce-overhead") they would come
    from a graph's private memory pool, whose blocks later graphs reuse. The decorator makes dynamo call this
    function while tracing rather than trace it (a trace cannot run the allocation's capture check); the True it
    returns is the constant it records, unused. Not while exporting: there tensors are fake, and a fake one would
    stay in the counters' table for later eager calls (``is_exporting`` is torch 2.6's; before it, export is not
    told apart)."""
    if not getattr(torch.compiler, "is_exporting", lambda: False)():
        counters(device)
    return True


def _error_counters(errors, q):
    """The counters the kernels add to: the caller's ``errors`` (int32, one per kind of :mod:`fastkda.errors`, on
    q's device) or the device's; None on the CPU, and while torch.compile traces (the op looks the device's up when
    it runs; :func:`_counters_made`)."""
    if errors is None:
        if q.is_cuda and torch.compiler.is_compiling():
            _counters_made(q.device)
            return None
        return counters(q.device) if q.is_cuda else None
    check_tensor("errors", errors, (len(KINDS),), (torch.int32,), q.device)
    return errors


def _cpu_path(run, name, shape):
    """Run the CPU path, turning an allocation that cannot succeed into a ``ValueError`` naming the input. It runs
    without autograd, as the GPU's custom ops do (fastkda is inference-only: outputs never require grad), and
    without autocast (:func:`fastkda.reference.autocast_off`)."""
    run = autocast_off(run)
    try:
        if not torch.is_grad_enabled():  # generation and inference already run without autograd
            return run()
        with torch.no_grad():
            return run()
    except RuntimeError as exc:
        if "DefaultCPUAllocator" not in str(exc):
            raise
        fail(name, "small enough for this machine's memory (the CPU path)", f"shape {list(shape)}: {exc}")


def _prefill_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], lower_bound: Optional[float], scale: float,
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, launch_numbers: List[int], dot_precision: str, checks: bool, take_views: bool,
    out: torch.Tensor, final_state: Optional[torch.Tensor], checkpoint_offsets: Optional[torch.Tensor],
    checkpoint_states: Optional[torch.Tensor], errors: Optional[torch.Tensor],
) -> None:
    """One opaque op for torch.compile and CUDA graphs: Triton on CUDA, the chunked PyTorch path on CPU, both
    as the plan carried in ``launch_numbers`` says (:meth:`fastkda.plan.PrefillPlan.launch_numbers`), or, under
    torch.compile, as the automatic plan of the sizes it runs on (:func:`fastkda.plan.prefill_plan_request`;
    ``dot_precision`` then unread). With
    ``take_views`` (under torch.compile) it gets the caller's q, k, v, g, beta and takes their kernel views here,
    where the tensors are real: a view restrided outside the op (``as_strided`` of a view of an intermediate
    buffer, such as the conv's output split three ways) was laid out anew by inductor, and the decode step read the
    wrong channels on the H200. Eagerly it gets the views its caller validated."""
    if take_views:
        q, k, v, g, beta = addressable_inputs(q, k, v, g, beta)
    if is_plan_request(launch_numbers):  # under torch.compile: the plan of the sizes this call runs on
        batch, length, heads, key_dim = q.shape
        plan = requested_prefill_plan(
            launch_numbers, batch if cu_seqlens is None else cu_seqlens.shape[0] - 1, heads, length, key_dim,
            v.shape[-1], _sms_of(q), varlen=cu_seqlens is not None, lower_bound_gate=lower_bound is not None,
            warpgroup_mma=_warpgroup_mma_of(q))
    else:
        plan = PrefillPlan.from_launch_numbers(launch_numbers, dot_precision)
    if checks or not q.is_cuda:  # index values: always on the CPU (free there), on the GPU in checked mode
        if checks:
            value_checks.outside_capture(q)
        if cu_seqlens is not None and cu_seqlens.numel() > 1:
            value_checks.cu_seqlens_values(cu_seqlens, q.shape[1], plan.seq_len if plan.equal_rows else None)
        if checkpoint_offsets is not None:
            value_checks.checkpoint_offsets_values(checkpoint_offsets, plan.chunk)
    if checks:
        if lower_bound is None:
            value_checks.precomputed_gate_values(g)
        value_checks.finite(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
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
                  use_beta_sigmoid, launch_numbers, dot_precision, checks, take_views, out, final_state,
                  checkpoint_offsets, checkpoint_states, errors):
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
            or out of order are clamped and counted (:func:`fastkda.error_counts`), the results then unspecified;
            a call run as rows (one sequence, or see ``max_seqlen``) reads no offsets but counts the sequences whose
            entries are not their row's.
        use_qk_l2norm, use_beta_sigmoid: turn off for callers who already normalised q/k or applied σ to beta.
        out: optional preallocated output, shape and dtype of v, contiguous, sharing no memory with an input.
        v_slices: ``"auto"`` (the launch plan, :mod:`fastkda.plan`), or 1, 2, 4; ``$FASTKDA_V_SLICES``
            applies when this is ``"auto"``. Results are bitwise identical for every choice.
        sequence_parallel: ``"auto"`` (default; then ``$FASTKDA_SEQUENCE_PARALLEL``), ``False``, or tokens per
            segment (a multiple of 32). Cuts each sequence, from its first token, into segments that run on
            separate SMs and are joined by a scan over their transitions (``docs/sequence-parallel.md``): the auto
            plan does so where it predicts at least 25% off the serial recurrence for the longest sequence the
            call's shape allows. Results then depend on the segment length (deterministic, bitwise identical
            across ``v_slices``, within the same accuracy bound); ``False`` keeps the serial recurrence and its
            bits. Checkpoints equal a prefix run's final state bit for bit when both runs use the same segment
            length (``False``, or the same int).
        max_seqlen: with ``cu_seqlens``, the longest sequence's length if the caller knows it on the host (as
            flash-attn takes it; serving engines keep it in their batch metadata): the automatic plan then cuts
            sequences of that length, and where it gives every sequence one length (N · max_seqlen = T) runs them
            as N rows of max_seqlen tokens (the same bits, faster), which needs ``cu_seqlens`` to agree: there,
            offsets that give another length break the contract (CPU tensors and checked mode raise
            ``ValueError``; on the GPU they are counted, :func:`fastkda.error_counts`, the results then
            unspecified). So a CUDA graph captured with such a hint replays only offsets of that length. Otherwise
            a wrong value costs time, never correctness. Without it the plan assumes one sequence may hold every
            token, and cuts only where a balanced batch gains too.
        checkpoint_offsets, checkpoint_states: prefix-cache checkpoints. Offsets ``[N]`` or ``[N, 2]`` (the
            dtype of ``cu_seqlens``) from each sequence's start, multiples of the chunk, 32 (CPU tensors are
            checked; on the GPU another value never matches); the fp32 state after that many tokens is written to
            ``checkpoint_states [N, 2, H, V, K]``, bitwise equal to the final state of a prefill of that prefix
            on the same device. An offset beyond its sequence is ignored.
        plan: a :class:`fastkda.plan.PrefillPlan` for this call's shape (``fastkda.choose_plan(...)``, changed with
            ``.replace(...)``) instead of the automatic one, for sweeps and experiments; ``v_slices`` and
            ``sequence_parallel`` must then stay ``"auto"`` and ``max_seqlen`` None (give them to ``choose_plan``).
        checks: True synchronises and raises ``ValueError`` for every contract break the host cannot see cheaply
            (``cu_seqlens`` and checkpoint offsets, a precomputed gate above 0, non-finite inputs); None (default)
            reads ``$FASTKDA_CHECKS`` ("1" turns it on). Not inside CUDA-graph capture.
        errors: int32 ``[3]`` counters (on q's device) the GPU kernels add malformed indices to, instead of the
            device's own (:mod:`fastkda.errors`).
    """
    scale, lower_bound = scalar_defaults(q, scale, lower_bound)
    given = q, k, v, g, beta  # what the op takes under torch.compile (_prefill_impl's take_views)
    q, k, v, g, beta = addressable_inputs(q, k, v, g, beta)  # engines' views: no copy where strides allow
    num_seqs, extents = remembered(validate_prefill, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
                                   initial_state, final_state, cu_seqlens, out, checkpoint_offsets, checkpoint_states,
                                   CHUNK)
    compiling = torch.compiler.is_compiling()
    if not compiling and (out is not None or final_state is not None or checkpoint_states is not None):
        # buffers the caller passed must not alias an input, nor each other (final_state may be initial_state;
        # addresses exist on eager calls only, as for the conv's pool)
        others = list(zip(("q", "k", "v", "g", "beta", "initial_state", "final_state", "out"),
                          (q, k, v, g, beta, initial_state, final_state, out), extents))
        check_disjoint("out", out, extents[7], others[:7])
        in_place = final_state is not None and initial_state is not None and (
            final_state.data_ptr(), final_state.dtype) == (initial_state.data_ptr(), initial_state.dtype)
        check_disjoint("final_state", final_state, extents[6], others[:5] if in_place else others[:6])
        check_disjoint("checkpoint_states", checkpoint_states, extents[8], others)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    facts = (num_seqs, heads, length, key_dim, value_dim)
    varlen, lower_bound_gate = cu_seqlens is not None, lower_bound is not None
    if plan is None and compiling:  # the op chooses it from the sizes it runs on: the graph guards on none
        launch_numbers, dot_precision = prefill_plan_request(v_slices, sequence_parallel, max_seqlen), DOT_PRECISION
    else:
        if plan is None:
            plan = choose_plan(*facts, _sms_of(q), varlen=varlen, lower_bound_gate=lower_bound_gate,
                               v_slices=v_slices, sequence_parallel=sequence_parallel, max_seqlen=max_seqlen,
                               warpgroup_mma=_warpgroup_mma_of(q))
        else:
            _check_plan_fits(plan, facts, varlen, lower_bound_gate, v_slices, sequence_parallel, max_seqlen)
            _check_plan_runs_here(plan, q)
        launch_numbers, dot_precision = plan.launch_numbers(), plan.dot_precision
    errors = _error_counters(errors, q)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if final_state is None and output_final_state:
        final_state = torch.empty(num_seqs, heads, value_dim, key_dim, dtype=torch.float32, device=q.device)
    _opaque_when_compiling(_prefill_op, _prefill_impl)(
        *(given if compiling else (q, k, v, g, beta)), A_log, dt_bias, lower_bound, float(scale), initial_state,
        cu_seqlens, use_qk_l2norm, use_beta_sigmoid, launch_numbers, dot_precision,
        value_checks.requested(checks), compiling, out, final_state, checkpoint_offsets, checkpoint_states, errors)
    return out, final_state


def _check_plan_runs_here(plan, q):
    """A plan's Gluon kernels need Hopper's warpgroup MMA: refused on another GPU (they would not compile there);
    the CPU path runs no kernel and takes any plan."""
    asked = [name for name in ("warpgroup_recurrence", "warpgroup_transition") if getattr(plan, name)]
    if asked and q.is_cuda and not _warpgroup_mma_of(q):
        major, minor = torch.cuda.get_device_capability(_device_index(q))
        fail("plan", f"{' and '.join(f'{name}=False' for name in asked)} on this GPU (the Gluon kernels run on "
             "Hopper's warpgroup MMA, compute capability 9.x)",
             f"{' and '.join(f'{name}=True' for name in asked)} on compute capability {major}.{minor}")


def _check_plan_fits(plan, facts, varlen, lower_bound_gate, v_slices, sequence_parallel, max_seqlen):
    """A caller's plan must be a :class:`PrefillPlan` made for this call's shape and gate, without ``v_slices``,
    ``sequence_parallel`` or ``max_seqlen`` (the plan was made from its own hint, and holds what it decided)."""
    if not isinstance(plan, PrefillPlan):
        fail("plan", "a fastkda.PrefillPlan", type(plan).__name__)
    if v_slices != "auto":
        fail("v_slices", "'auto' when a plan is given (the plan holds v_slices)", v_slices)
    if not (isinstance(sequence_parallel, str) and sequence_parallel == "auto"):
        fail("sequence_parallel", "'auto' when a plan is given (the plan holds the segments)", sequence_parallel)
    if max_seqlen is not None:
        fail("max_seqlen", "None when a plan is given (pass it to choose_plan: the plan holds the rows and segments "
             "it decided)", max_seqlen)
    made_for = (plan.num_seqs, plan.heads, plan.seq_len * (plan.num_seqs if plan.equal_rows else 1),
                plan.key_dim, plan.value_dim, plan.varlen or plan.equal_rows, plan.lower_bound_gate)
    needed = (*facts, varlen, lower_bound_gate)
    if made_for != needed:
        names = ("num_seqs", "heads", "seq_len", "key_dim", "value_dim", "varlen", "lower_bound_gate")
        fail("plan", f"made for this call ({', '.join(f'{n}={x}' for n, x in zip(names, needed))})",
             ", ".join(f"{n}={x}" for n, x in zip(names, made_for)))


class OpenEntryPrefill:
    """A prefill whose entry state is not known when it starts (:func:`kda_prefill_open`): its ``exit_map`` is
    ready at once; :meth:`finish` runs the rest from the entry state once that is known.

    ``exit_map [B, H, V + K, K]`` (fp32): for row b and an entry state ``X [H, V, K]`` (V-first, as
    :func:`kda_prefill` takes ``initial_state``), the state after the row's tokens is ``X·𝒜ᵀ + ℬᵀ``, with
    ``ℬᵀ = exit_map[b, :, :V]`` (the exit from a zero state) and ``𝒜ᵀ = exit_map[b, :, V:]`` (the transition).
    ``plan``: the segmented :class:`fastkda.plan.PrefillPlan` both halves run (None for rows of no tokens)."""

    def __init__(self, inputs, options, plan, exit_map, halfway, checks):
        self._inputs, self._options, self.plan, self.exit_map, self._halfway = inputs, options, plan, exit_map, halfway
        self._checks = checks

    def finish(self, entry_state=None):
        """``(o, final_state)`` from ``entry_state [B, H, V, K]`` (bf16 or fp32, contiguous; None: zeros): o
        ``[B, T, H, V]`` in v's dtype and the fp32 state after the tokens, what :func:`kda_prefill` with that
        ``initial_state`` gives, within its accuracy bound. It may be called again with another entry state, on
        the stream of the first call (on the GPU each call rewrites the segments' entries in the workspace)."""
        q, k, v, g, beta = self._inputs
        batch, length, heads, key_dim = q.shape
        value_dim = v.shape[-1]
        if entry_state is not None:
            check_tensor("entry_state", entry_state, (batch, heads, value_dim, key_dim), STATE_DTYPES, q.device)
            check_contiguous("entry_state", entry_state)
            if self._checks:
                value_checks.outside_capture(q)
                value_checks.finite(entry_state=entry_state)
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
        final_state = torch.empty(batch, heads, value_dim, key_dim, dtype=torch.float32, device=q.device)
        if self.plan is None:  # no tokens: the state passes through
            final_state.zero_()
            if entry_state is not None:
                final_state.copy_(entry_state)
            return out, final_state
        if q.is_cuda:
            from .ops.prefill import open_entry_finish

            open_entry_finish(self.plan, self._halfway, entry_state, out, final_state, _error_counters(None, q))
            return out, final_state

        def run_rest():
            for b, maps in enumerate(self._halfway):
                state = torch.zeros(heads, key_dim, value_dim, dtype=torch.float32)  # the CPU path's [H, K, V]
                if entry_state is not None:
                    state.copy_(entry_state[b].transpose(-1, -2))
                rows = torch.empty(length, heads, value_dim, dtype=torch.float32)
                run_from_segment_maps(q[b], k[b], v[b], g[b], beta[b], maps, self.plan.segment_tokens, state, rows,
                                      **self._options)
                out[b] = rows
                final_state[b] = state.transpose(-1, -2)
        _cpu_path(run_rest, "q", q.shape)
        return out, final_state


def kda_prefill_open(q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None,
                     use_qk_l2norm=True, use_beta_sigmoid=True, sequence_parallel="auto", checks=None):
    """The first half of a prefill whose entry state comes later: context parallelism, where the tokens before
    these run on another GPU (:mod:`fastkda.distributed`, spec §8). Returns an :class:`OpenEntryPrefill` whose
    ``exit_map`` maps any entry state to the state after the tokens, and whose ``finish(entry_state)`` gives the
    prefill's ``(o, final_state)`` from it.

    q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, the gate, the flags and ``checks`` as in
    :func:`kda_prefill`; each of the B rows is one sequence (no ``cu_seqlens``). The tokens always run in
    segments (:func:`fastkda.plan.choose_open_entry_plan`; ``sequence_parallel``: ``"auto"`` or tokens per
    segment): each segment's transition is formed here once, from a zero state and identity columns, composed
    into ``exit_map``, and reused by ``finish``, which composes every segment's entry from the given state and
    reruns the segments from there; the two halves cost about one sequence-parallel :func:`kda_prefill` of the
    same tokens. Eager only (no custom op: it does not go through torch.compile). The inputs are borrowed, not
    copied: ``finish`` reads them again, so they must stay as they are until the last ``finish``."""
    scale, lower_bound = scalar_defaults(q, scale, lower_bound)
    q, k, v, g, beta = addressable_inputs(q, k, v, g, beta)
    remembered(validate_prefill, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, None, None, None, None, None,
               None, CHUNK)
    checks = value_checks.requested(checks)
    if checks:
        value_checks.outside_capture(q)
        if lower_bound is None:
            value_checks.precomputed_gate_values(g)
        value_checks.finite(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    exit_map = torch.zeros(batch, heads, value_dim + key_dim, key_dim, dtype=torch.float32, device=q.device)
    options = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=float(scale),
                   use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid)
    if not batch or not length:  # the identity map
        requested_open_entry_segments(sequence_parallel)  # checked as with tokens, though nothing is planned
        exit_map[:, :, value_dim:] = torch.eye(key_dim, device=q.device)
        return OpenEntryPrefill((q, k, v, g, beta), options, None, exit_map, None, checks)
    plan = choose_open_entry_plan(batch, heads, length, key_dim, value_dim, _sms_of(q),
                                  lower_bound_gate=lower_bound is not None, sequence_parallel=sequence_parallel,
                                  warpgroup_mma=_warpgroup_mma_of(q))
    if q.is_cuda:
        from .ops.prefill import open_entry_transitions

        workspace = open_entry_transitions(q, k, v, g, beta, plan=plan, **options, exit_maps=exit_map,
                                           errors=_error_counters(None, q))
        return OpenEntryPrefill((q, k, v, g, beta), options, plan, exit_map, workspace, checks)
    options["chunk"] = plan.cpu_chunk

    def open_rows():
        maps = [open_segment_maps(q[b], k[b], v[b], g[b], beta[b], plan.segment_tokens, **options)
                for b in range(batch)]
        for b, row_maps in enumerate(maps):
            offset, transition = compose_segment_maps(row_maps, heads, key_dim, value_dim)
            exit_map[b, :, :value_dim] = offset.transpose(-1, -2)
            exit_map[b, :, value_dim:] = transition.transpose(-1, -2)
        return maps
    return OpenEntryPrefill((q, k, v, g, beta), options, plan, exit_map, _cpu_path(open_rows, "q", q.shape), checks)


def _decode_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float], scale: float, num_accepted_tokens: Optional[torch.Tensor], use_qk_l2norm: bool,
    use_beta_sigmoid: bool, launch_numbers: List[int], checks: bool, take_views: bool, out: torch.Tensor,
    errors: Optional[torch.Tensor],
) -> None:
    """One opaque op: the Triton kernel on CUDA as the plan carried in ``launch_numbers`` says
    (:meth:`fastkda.plan.DecodePlan.launch_numbers`; under torch.compile the automatic plan of the sizes it runs on,
    :func:`fastkda.plan.decode_plan_request`), the token-by-token PyTorch path on CPU; ``take_views`` as
    :func:`_prefill_impl` takes it."""
    if take_views:
        q, k, v, g, beta = addressable_inputs(q, k, v, g, beta)
    _check_decode_values(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, num_accepted_tokens,
                         checks)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
              num_accepted_tokens=num_accepted_tokens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid)
    if q.is_cuda:
        from .ops.decode import recurrent_kda_decode

        if is_plan_request(launch_numbers):  # under torch.compile: the plan of the sizes this call runs on
            num_seqs, tokens, heads, _ = q.shape
            plan = requested_decode_plan(launch_numbers, num_seqs, heads, v.shape[-1], _sms_of(q), tokens)
        else:
            plan = DecodePlan.from_launch_numbers(launch_numbers)
        recurrent_kda_decode(q, k, v, g, beta, state_pool, slots, plan=plan, **kw, out=out, errors=errors)
        return
    out.copy_(_decode_on_cpu(q, k, v, g, beta, state_pool, slots, **kw))


def _check_decode_values(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, num_accepted_tokens,
                         checks):
    """The values a decode call depends on: the slots and accepted counts always on the CPU (free there), on the
    GPU in checked mode, which also checks the gate and the inputs (:mod:`fastkda.checks`)."""
    if checks or not q.is_cuda:
        if checks:
            value_checks.outside_capture(q)
        value_checks.decode_indices(slots, num_accepted_tokens, state_pool.shape[0], q.shape[1])
    if checks:
        if lower_bound is None:
            value_checks.precomputed_gate_values(g)
        value_checks.finite(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                            state_pool=state_pool[value_checks.read_rows(slots, num_accepted_tokens)])


def _decode_on_cpu(q, k, v, g, beta, state_pool, slots, **options):
    """The CPU path of decode (:func:`fastkda.reference.kda_decode_reference`, fp32): o ``[N, T, H, V]``."""
    return _cpu_path(lambda: kda_decode_reference(q, k, v, g, beta, state_pool, slots, **options), "q", q.shape)


_decode_op = torch.library.custom_op("fastkda::decode", mutates_args=("state_pool", "out", "errors"))(_decode_impl)


@_decode_op.register_fake
def _decode_fake(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale, num_accepted_tokens,
                 use_qk_l2norm, use_beta_sigmoid, launch_numbers, checks, take_views, out, errors):
    return None


def _decode_plan(plan, v_slices, num_seqs, heads, value_dim, tokens, anchor):
    """The decode plan of a call: ``plan`` checked against the call's shape, or the automatic one."""
    if plan is None:
        return choose_decode_plan(num_seqs, heads, value_dim, _sms_of(anchor), v_slices, tokens=tokens)
    if not isinstance(plan, DecodePlan) or v_slices != "auto" or (plan.num_seqs, plan.heads, plan.value_dim) != (
            num_seqs, heads, value_dim):
        fail("plan", f"a fastkda.DecodePlan for num_seqs={num_seqs}, heads={heads}, value_dim={value_dim}, with "
             "v_slices='auto'", plan)
    return plan


def _check_cpu_decode_plan(plan, v_slices, num_seqs, heads, value_dim, tokens, anchor):
    """What the CPU path keeps of :func:`_decode_plan`: its checks of the ``plan`` and ``v_slices`` arguments
    (and of ``$FASTKDA_V_SLICES``), so a call that fails on the GPU fails alike on the CPU, which uses no plan. An
    automatic plan can only fail in :func:`fastkda.plan.requested_v_slices` (validation admits V in
    :data:`fastkda.plan.SUPPORTED_DIMS` alone, and every choice it parses slices those), so only that runs."""
    if plan is None:
        requested_v_slices(v_slices)
    else:
        _decode_plan(plan, v_slices, num_seqs, heads, value_dim, tokens, anchor)


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
    given = q, k, v, g, beta  # what the op takes under torch.compile (_decode_impl's take_views)
    compiling = torch.compiler.is_compiling()
    cpu_eager = isinstance(q, torch.Tensor) and not q.is_cuda and not compiling
    if not cpu_eager:  # engines' views as the kernels address them, no copy where strides allow (the CPU reads any)
        q, k, v, g, beta = addressable_inputs(q, k, v, g, beta)
    extents = remembered(validate_decode, q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound, scale,
                         num_accepted_tokens, out)
    if not compiling:  # eagerly: torch.compile traces without addresses
        named = list(zip(("q", "k", "v", "g", "beta", "state_pool"), (q, k, v, g, beta, state_pool), extents))
        check_disjoint("state_pool", state_pool, extents[5], named[:5])  # written in place, as it is read
        if out is not None:
            check_disjoint("out", out, extents[6], named)
    num_seqs, tokens, heads, _ = q.shape
    if cpu_eager:  # the CPU path's result is the output: no plan, no op, no buffer to copy it into
        _check_cpu_decode_plan(plan, v_slices, num_seqs, heads, v.shape[-1], tokens, q)
        if errors is not None:  # checked as on the GPU; the CPU path raises for bad indices, counting none
            _error_counters(errors, q)
        checks = value_checks.requested(checks)
        _check_decode_values(q, k, v, g, beta, state_pool, slots, A_log, dt_bias, lower_bound,
                             num_accepted_tokens, checks)
        o = _decode_on_cpu(q, k, v, g, beta, state_pool, slots, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                           scale=float(scale), num_accepted_tokens=num_accepted_tokens, use_qk_l2norm=use_qk_l2norm,
                           use_beta_sigmoid=use_beta_sigmoid)
        if out is not None:
            return out.copy_(o)
        return _as(o, v.dtype)  # a same-dtype .to would still dispatch an op
    if plan is None and compiling:  # the op chooses it from the sizes it runs on: the graph guards on none
        launch_numbers = decode_plan_request(v_slices)
    else:
        launch_numbers = _decode_plan(plan, v_slices, num_seqs, heads, v.shape[-1], tokens, q).launch_numbers()
    errors = _error_counters(errors, q)
    checks = value_checks.requested(checks)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _opaque_when_compiling(_decode_op, _decode_impl)(
        *(given if compiling else (q, k, v, g, beta)), state_pool, slots, A_log, dt_bias, lower_bound, float(scale),
        num_accepted_tokens, use_qk_l2norm, use_beta_sigmoid, launch_numbers, checks, compiling, out, errors)
    return out


# The KDA layer around the operator (spec §9): its short causal conv (step 2) and output norm (step 6).

CONV_WIDTHS = range(2, 9)  # kernel sizes W the conv takes (Kimi-Linear: 4)
MAX_CONV_STATE = 8  # columns S of a conv state row at most (S >= W−1; transformers keeps S = W)
MAX_NORM_DIM = 16384  # the norm holds each row of D values in registers


def _check_activation(activation, allowed):
    if not (activation is None or isinstance(activation, str)) or activation not in allowed:
        fail("activation", " or ".join(repr(a) for a in allowed), repr(activation))


def _validate_conv(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, activation):
    """Raise ``ValueError`` naming the first argument of a conv call that breaks its contract; return the byte
    extents of x, weight, bias and conv_states (:func:`check_disjoint`)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        fail("x", "a 2-D tensor [T, C] (packed tokens) or a 3-D tensor [B, T, C]", _describe(x))
    device, channels = x.device, x.shape[-1]
    check_tensor("x", x, x.shape, FLOAT_DTYPES, device)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] not in CONV_WIDTHS:
        fail("weight", f"a 2-D tensor [C, W] with a kernel size W in [{CONV_WIDTHS[0]}, {CONV_WIDTHS[-1]}]",
             _describe(weight))
    width = weight.shape[1]
    check_tensor("weight", weight, (channels, width), FLOAT_DTYPES, device, where="x")
    if bias is not None:
        check_tensor("bias", bias, (channels,), FLOAT_DTYPES, device, where="x")
    _check_activation(activation, ("silu", None))
    if cu_seqlens is None:
        num_seqs = x.shape[0] if x.dim() == 3 else 1
    else:
        if x.dim() != 2:
            fail("x", "packed tokens [T, C] when cu_seqlens is given", list(x.shape))
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 + (
                x.shape[0] > 0):
            fail("cu_seqlens", f"a 1-D tensor [N+1] of offsets from 0 to T={x.shape[0]} (two entries at least, [0] "
                 "for no tokens)", _describe(cu_seqlens))
        check_tensor("cu_seqlens", cu_seqlens, cu_seqlens.shape, INDEX_DTYPES, device, where="x")
        check_contiguous("cu_seqlens", cu_seqlens)
        num_seqs = cu_seqlens.numel() - 1
    if conv_states is None:
        for name, given in (("slots", slots), ("has_initial_state", has_initial_state)):
            if given is not None:
                fail(name, "None when conv_states is None (no pool to index)", _describe(given))
    else:
        if (not isinstance(conv_states, torch.Tensor) or conv_states.dim() != 3
                or not width - 1 <= conv_states.shape[2] <= MAX_CONV_STATE):
            fail("conv_states", f"a 3-D tensor [P, C, S] = [P, {channels}, S] with W-1 = {width - 1} <= S <= "
                 f"{MAX_CONV_STATE} (the last S inputs of each row's sequence)", _describe(conv_states))
        check_tensor("conv_states", conv_states, (conv_states.shape[0], channels, conv_states.shape[2]),
                       (x.dtype, torch.float32), device, where="x")
        if slots is None and conv_states.shape[0] != num_seqs:
            fail("conv_states", f"of {num_seqs} rows (one per sequence) when slots is None", list(conv_states.shape))
        if slots is not None:
            check_tensor("slots", slots, (num_seqs,), INDEX_DTYPES, device, where="x")
        if has_initial_state is not None:
            check_tensor("has_initial_state", has_initial_state, (num_seqs,), (torch.bool,), device, where="x")
    return tuple(byte_extent(t) for t in (x, weight, bias, conv_states))


def _conv_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv_states: Optional[torch.Tensor],
    slots: Optional[torch.Tensor], has_initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
    silu: bool, out: torch.Tensor,
) -> None:
    """One opaque op: the Triton kernel on CUDA, the reference on the CPU (after checking ``cu_seqlens``' values,
    free there)."""
    if x.is_cuda:
        from .ops.conv import causal_conv1d_forward

        causal_conv1d_forward(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, silu, out)
        return
    out.copy_(_conv_on_cpu(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, silu))


def _conv_on_cpu(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, silu):
    """The CPU path of the conv (:func:`fastkda.reference.causal_conv1d_reference`, fp32), after checking
    ``cu_seqlens``' and the slots' values (free on the CPU)."""
    if cu_seqlens is not None:
        value_checks.cu_seqlens_values(cu_seqlens, x.shape[0])
    if slots is not None and conv_states is not None:
        value_checks.conv_slots_values(slots, conv_states.shape[0])
    return _cpu_path(lambda: causal_conv1d_reference(
        x, weight, bias, conv_states=conv_states, slots=slots, has_initial_state=has_initial_state,
        cu_seqlens=cu_seqlens, activation="silu" if silu else None), "x", x.shape)


_conv_op = torch.library.custom_op("fastkda::causal_conv1d", mutates_args=("conv_states", "out"))(_conv_impl)


@_conv_op.register_fake
def _conv_fake(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, silu, out):
    return None


def _run_conv(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, activation, extents):
    """The conv op on validated inputs into a fresh contiguous output, the pool checked not to overlap an input
    (eagerly: torch.compile traces without addresses); eagerly on the CPU, the CPU path's own result."""
    compiling = torch.compiler.is_compiling()
    if conv_states is not None and not compiling:
        check_disjoint("conv_states", conv_states, extents[3], zip(("x", "weight", "bias"), (x, weight, bias), extents))
    if not x.is_cuda and not compiling:
        return _as(_conv_on_cpu(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens,
                                activation == "silu"), x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _opaque_when_compiling(_conv_op, _conv_impl)(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens,
                                                 activation == "silu", out)
    return out


def causal_conv1d(x, weight, bias=None, *, conv_states=None, slots=None, has_initial_state=None, cu_seqlens=None,
                  activation="silu"):
    """The KDA layer's depthwise causal conv over a prefill batch (spec §9 step 2). Returns the output: x's shape and
    dtype, contiguous, computed in fp32.

    ``out[t, c] = act(bias[c] + Σ_j weight[c, j]·u[t − (W−1) + j, c])``, u being a sequence's inputs preceded by
    W−1 earlier ones: its conv state, or zeros (``torch.nn.functional.conv1d`` with ``groups=C`` and W−1 left
    padding, when the state is zeros).

    Args:
        x: ``[T, C]`` packed tokens, the sequences given by ``cu_seqlens`` (one sequence without), as serving
            engines batch them; or ``[B, T, C]``, B sequences of T tokens, as transformers does. Any strides (views
            of a wider projection, channel-major layouts); contiguous channels within a token is the fast case.
            bf16, fp16 or fp32.
        weight: ``[C, W]`` (transformers' ``conv1d.weight [C, 1, W]`` squeezed), kernel size W in [2, 8];
            bias: ``[C]`` or None; any float dtype.
        conv_states: the pool ``[P, C, S]`` (x's dtype or fp32, any strides), a row per cached sequence: its
            last S inputs per channel, oldest first, S from W−1 (what the conv reads; vLLM's and fastkda's
            pools) to 8 (transformers keeps S = W). Sequence n reads row ``slots[n]``'s last W−1 columns as its
            earlier inputs (unless ``has_initial_state[n]`` is False: zeros) and, after the call, the row holds
            its last S inputs (for a sequence shorter than S tokens, the old row's tail followed by its tokens, as
            a token-by-token update leaves it; a row read as zeros is written too, zeros before the tokens). It
            must share no memory with x, weight or bias (checked on eager calls).
        slots: ``[N]`` int32/int64 pool rows; None: sequence n uses row n (then P must be N). A negative slot is a
            null row: zeros before the first token, nothing written. A slot at or past P is treated the same way, so
            no slot value makes an access outside the pool. Two sequences must not share a live slot.
        has_initial_state: ``[N]`` bool, False where a sequence starts from zeros (a new prompt); None: every
            sequence with a live slot reads it (a continued prefill).
        cu_seqlens: ``[N+1]`` int32/int64 token offsets for packed x, nondecreasing from 0 to T, empty sequences
            allowed. CPU tensors are checked; on the GPU other values are clamped into ``[0, T]`` (results
            unspecified, all accesses inside the buffers).
        activation: ``"silu"`` (the KDA layer's) or None.

    Runs the PyTorch reference on CPU tensors and one Triton kernel on CUDA ones, with no host-device
    synchronisation on the GPU (CUDA-graph capturable).
    """
    extents = remembered(_validate_conv, x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens,
                         activation)
    return _run_conv(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, activation, extents)


def _validate_conv_update(x, conv_states, weight, bias, slots, activation):
    """:func:`_validate_conv` for a decode step: x ``[N, C]`` or ``[N, T, C]`` with T >= 1, a pool and slots."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] < 1):
        fail("x", "a tensor [N, C] (a token per sequence) or [N, T, C] with T >= 1", _describe(x))
    for name, given in (("conv_states", conv_states), ("slots", slots)):
        if not isinstance(given, torch.Tensor):
            fail(name, "a tensor (the update reads and writes the pool rows slots names)", _describe(given))
    rows = x.unsqueeze(1) if x.dim() == 2 else x
    return _validate_conv(rows, weight, bias, conv_states, slots, None, None, activation)


def causal_conv1d_update(x, conv_states, weight, bias=None, *, slots, activation="silu"):
    """A decode step of the causal conv (spec §9 step 2): each sequence's pool row read, shifted by its new tokens
    and written back. Returns the output, x's shape and dtype, contiguous.

    ``x``: ``[N, C]`` (one token per sequence) or ``[N, T, C]`` (T >= 1 tokens, e.g. speculative), any strides;
    ``conv_states [P, C, S]`` (S >= W−1; every column shifts by the T tokens) and ``slots [N]`` as in
    :func:`causal_conv1d` (every live row is read; negative or
    out-of-range slots are null rows: zeros before the first token, nothing written); ``weight``, ``bias`` and
    ``activation`` as there. Equal to :func:`causal_conv1d` over the same tokens as ``[N, T, C]``.
    """
    extents = remembered(_validate_conv_update, x, conv_states, weight, bias, slots, activation)
    if x.dim() == 3:
        return _run_conv(x, weight, bias, conv_states, slots, None, None, activation, extents)
    return _run_conv(x.unsqueeze(1), weight, bias, conv_states, slots, None, None, activation, extents).view(x.shape)


def _row_levels(x, gate):
    """The leading dimensions of x and gate (one shape) as three ``(size, x stride, gate stride)`` levels,
    outermost first: size-1 dimensions dropped, neighbours merged where both tensors allow it, size-1 levels
    prepended to make three."""
    levels = []
    for size, stride_x, stride_g in zip(x.shape[:-1], x.stride()[:-1], gate.stride()[:-1]):
        if size == 1:
            continue
        if levels and levels[-1][1] == stride_x * size and levels[-1][2] == stride_g * size:
            levels[-1] = (levels[-1][0] * size, stride_x, stride_g)
        else:
            levels.append((size, stride_x, stride_g))
    if len(levels) > 3:
        fail("x and gate", "views whose leading dimensions merge into at most three strided levels (the norm "
             "kernel's addressing; make one of them contiguous)", f"strides {x.stride()} and {gate.stride()}")
    return [(1, 0, 0)] * (3 - len(levels)) + levels


def _check_eps(eps, positive):
    """The norm's epsilon: a finite number, > 0 when ``positive`` (else >= 0)."""
    number = isinstance(as_float(eps), float)  # any real number but a bool (NumPy's scalars too)
    if not (number and (0 < eps if positive else 0 <= eps) and eps < math.inf):
        fail("eps", "a positive finite number" if positive else "a finite number >= 0", repr(eps))


def _validate_norm(x, gate, weight, eps, activation):
    """Raise ``ValueError`` naming the first argument of a norm call that breaks its contract; return the row
    levels (:func:`_row_levels`), flattened."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not 1 <= x.shape[-1] <= MAX_NORM_DIM:
        fail("x", f"a tensor [..., D] with D in [1, {MAX_NORM_DIM}]", _describe(x))
    device = x.device
    check_tensor("x", x, x.shape, FLOAT_DTYPES, device)
    check_tensor("gate", gate, x.shape, FLOAT_DTYPES, device, where="x")
    check_tensor("weight", weight, x.shape[-1:], FLOAT_DTYPES, device, where="x")
    _check_eps(eps, positive=False)
    _check_activation(activation, ("sigmoid", "silu"))
    return [number for level in _row_levels(x, gate) for number in level]


def _norm_impl(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, silu: bool,
               levels: List[int], out: torch.Tensor) -> None:
    """One opaque op: the Triton kernel on CUDA (rows addressed through ``levels``), the reference on the CPU."""
    if x.is_cuda:
        from .ops.norm import gated_rmsnorm_forward

        gated_rmsnorm_forward(x, gate, weight, eps, silu, (levels[0:3], levels[3:6], levels[6:9]), out)
        return
    out.copy_(_norm_on_cpu(x, gate, weight, eps, silu))


def _norm_on_cpu(x, gate, weight, eps, silu):
    """The CPU path of the norm (:func:`fastkda.reference.gated_rmsnorm_reference`, fp32)."""
    return _cpu_path(lambda: gated_rmsnorm_reference(x, gate, weight, eps, activation="silu" if silu else "sigmoid"),
                     "x", x.shape)


_norm_op = torch.library.custom_op("fastkda::gated_rmsnorm", mutates_args=("out",))(_norm_impl)


@_norm_op.register_fake
def _norm_fake(x, gate, weight, eps, silu, levels, out):
    return None


def gated_rmsnorm(x, gate, weight, eps=1e-6, *, activation="sigmoid"):
    """The KDA layer's gated RMSNorm over the last dimension D (spec §9 step 6):
    ``x·rsqrt(mean(x²) + eps)·weight ⊙ act(gate)`` in fp32. Returns x's shape and dtype, contiguous.

    Args:
        x, gate: ``[..., D]`` (one shape; any float dtypes), D in [1, 16384], any strides (the leading
            dimensions of both must merge into at most three strided levels: any view of a contiguous tensor
            with up to three leading dimensions, or of a wider projection, does).
        weight: ``[D]``, any float dtype. eps: a number >= 0.
        activation: the gate's, ``"sigmoid"`` (transformers' Kimi-Linear) or ``"silu"``.

    Runs the PyTorch reference on CPU tensors and one Triton kernel on CUDA ones, with no host-device
    synchronisation on the GPU (CUDA-graph capturable).
    """
    levels = remembered(_validate_norm, x, gate, weight, eps, activation)
    if not x.is_cuda and not torch.compiler.is_compiling():  # the CPU path's result is the output
        return _as(_norm_on_cpu(x, gate, weight, float(eps), activation == "silu"), x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _opaque_when_compiling(_norm_op, _norm_impl)(x, gate, weight, float(eps), activation == "silu", levels, out)
    return out


# The layer's whole decode step (conv update, KDA decode, gated norm): one launch on the GPU where it pays, else three.


def _token_heads(mixed, heads, key_dim, value_dim):
    """q, k, v ``[N, 1, H, D]`` views of a token's q | k | v channels ``[N, H·(2K + V)]``."""
    return (part.view(mixed.shape[0], 1, heads, dim)
            for part, dim in zip(mixed.split([heads * key_dim, heads * key_dim, heads * value_dim], dim=1),
                                 (key_dim, key_dim, value_dim)))


def _validate_decode_step(mixed, conv_states, conv_weight, g, beta, output_gate, norm_weight, state_pool, slots,
                          A_log, dt_bias, lower_bound, scale, eps, tickets):
    """Raise ``ValueError`` naming the first argument of :func:`kda_decode_step` that breaks its contract: the
    conv's and the decode's own checks on the same tensors, and the fused kernel's layouts."""
    if not isinstance(g, torch.Tensor) or g.dim() != 3:
        fail("g", "a 3-D tensor [N, H, K]", _describe(g))
    num_seqs, heads, key_dim = g.shape
    if not isinstance(state_pool, torch.Tensor) or state_pool.dim() != 4:
        fail("state_pool", "a 4-D tensor [P, H, V, K]", _describe(state_pool))
    value_dim = state_pool.shape[2]
    channels = heads * (2 * key_dim + value_dim)
    if not isinstance(mixed, torch.Tensor) or tuple(mixed.shape) != (num_seqs, channels) or (
            mixed.numel() and mixed.stride(1) != 1):
        fail("mixed", f"[N, H·(2K + V)] = [{num_seqs}, {channels}] (q | k | v before the conv), channels contiguous",
             _describe(mixed))
    _validate_conv_update(mixed, conv_states, conv_weight, None, slots, "silu")
    if conv_states.shape[0] != state_pool.shape[0]:  # one slot addresses a row of each pool
        fail("conv_states", f"as many rows as state_pool ({state_pool.shape[0]})", _describe(conv_states))
    if conv_states.shape[2] != conv_weight.shape[1] - 1:  # the fused kernel keeps the W−1 columns the conv reads
        fail("conv_states", f"[P, C, W-1] = [P, {channels}, {conv_weight.shape[1] - 1}] (the step's pools)",
             _describe(conv_states))
    q, k, v = _token_heads(mixed, heads, key_dim, value_dim)
    check_tensor("beta", beta, (num_seqs, heads), FLOAT_DTYPES, mixed.device)  # its own shape, not decode's
    beta = beta[:, None]
    validate_decode(*addressable_inputs(q, k, v, g[:, None], beta), state_pool, slots, A_log, dt_bias, lower_bound,
                    scale, None, None)
    for name, x, shape in (("g", g, (num_seqs, heads, key_dim)), ("output_gate", output_gate,
                                                                   (num_seqs, heads, value_dim))):
        check_tensor(name, x, shape, FLOAT_DTYPES, mixed.device)
        if x.numel() and (x.stride(2) != 1 or x.stride(1) != x.shape[2]):
            fail(name, "contiguous within each sequence's row", f"strides {tuple(x.stride())}")
    check_tensor("norm_weight", norm_weight, (value_dim,), FLOAT_DTYPES, mixed.device)
    check_contiguous("norm_weight", norm_weight)
    if tickets is not None:
        check_tensor("tickets", tickets, (num_seqs * heads,), (torch.int32,), mixed.device)
        check_contiguous("tickets", tickets)
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
        fail("slots", f"of shape [{num_seqs}] (one token per sequence)", _describe(slots))
    _check_eps(eps, positive=True)  # a padding row's zeros are normalised too
    return tuple(byte_extent(x) for x in (mixed, conv_states, g, beta, output_gate, state_pool))


def kda_decode_step(mixed, conv_states, conv_weight, g, beta, output_gate, norm_weight, state_pool, slots, *,
                    A_log=None, dt_bias=None, lower_bound=None, scale=None, eps=1e-5, use_qk_l2norm=True,
                    use_beta_sigmoid=True, tickets=None, plan=None):
    """The KDA layer's decode step for one token per sequence (spec §9 steps 2, 5 and 6): the conv update of q, k
    and v with SiLU, KDA decode over the state pool, and the gated RMSNorm of each head's output. Returns
    ``[N, H, V]`` in mixed's dtype (before ``o_proj``). On the GPU one kernel (``fastkda/ops/decode_step.py``:
    slices of a head joined by tickets, or one program a head) where the step is latency-bound, else the three
    launches :func:`causal_conv1d_update`, :func:`kda_decode` and
    :func:`gated_rmsnorm` (:func:`fastkda.plan.choose_decode_step_plan` decides); on the CPU, and in checked mode,
    those three (a refusal of the conv's output puts the conv rows back). The fused
    kernel keeps the conv's output in fp32 where the three round it to mixed's dtype: outputs agree to bf16's
    rounding, not bit for bit.

    Args:
        mixed: ``[N, H·(2K + V)]``, each sequence's q | k | v projections before the conv (channels contiguous).
        conv_states ``[P, C, W−1]`` (exactly W−1 columns), conv_weight ``[C, W]`` (no bias): as
            :func:`causal_conv1d_update` takes them.
        g ``[N, H, K]``, beta ``[N, H]``: the gate's and β's inputs as :func:`kda_decode` takes them (with
            ``A_log``, ``dt_bias``, ``lower_bound``, ``scale``, ``use_qk_l2norm``, ``use_beta_sigmoid``).
        output_gate ``[N, H, V]``: the norm's gate before its sigmoid; norm_weight ``[V]``; eps: the norm's.
        state_pool ``[P, H, V, K]`` (fp32 or bf16), slots ``[N]``: as :func:`kda_decode`; a negative slot is a
            padding row (zero output, neither pool read or written).
        tickets: ``[N·H]`` int32 zeros the kernel uses to join a head's slices and leaves as zeros (a caller that
            keeps one saves a memset per step); None allocates one where the plan has several slices a head.
        plan: a :class:`fastkda.plan.DecodePlan` for the fused kernel on the GPU, whatever the automatic choice
            (:func:`fastkda.plan.choose_decode_step_plan`'s; one slice a head runs one program a head).
    """
    one_token = g[:, None] if isinstance(g, torch.Tensor) and g.dim() == 3 else None  # [N, 1, H, K], as decode's q
    scale, lower_bound = scalar_defaults(one_token, scale, lower_bound)
    extents = remembered(_validate_decode_step, mixed, conv_states, conv_weight, g, beta, output_gate, norm_weight,
                         state_pool, slots, A_log, dt_bias, lower_bound, scale, eps, tickets)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # eagerly: torch.compile traces without addresses
        named = list(zip(("mixed", "conv_states", "g", "beta", "output_gate", "state_pool"),
                         (mixed, conv_states, g, beta, output_gate, state_pool), extents))
        check_disjoint("conv_states", conv_states, extents[1], named[:1] + named[2:])  # the pools: written in place
        check_disjoint("state_pool", state_pool, extents[5], named[:5])
        if tickets is not None:
            check_disjoint("tickets", tickets, byte_extent(tickets), named)
    num_seqs, heads, key_dim = g.shape
    value_dim = state_pool.shape[2]
    if plan is not None:
        plan = _decode_plan(plan, "auto", num_seqs, heads, value_dim, 1, mixed)
    on_gpu = mixed.device.type == "cuda"
    checked = not compiling and value_checks.requested(None)
    if on_gpu and not compiling and not checked:
        plan = plan or choose_decode_step_plan(num_seqs, heads, value_dim, _sms_of(mixed))
    else:  # the CPU, torch.compile's traces (the three ops are opaque to it; the fused kernel is not) and checked
        # mode (the three ops check the conv's output, which the fused kernel keeps in registers)
        plan = None
    rows = None
    if checked:
        # checked mode: every value the step reads, before either pool moves (kda_decode's own checks would see q,
        # k and v only after the conv had written its pool)
        value_checks.outside_capture(mixed)
        value_checks.decode_indices(slots, None, state_pool.shape[0], 1)
        if lower_bound is None:
            value_checks.precomputed_gate_values(g)
        rows = value_checks.read_rows(slots)  # the rows both pools read and the conv writes, kept for a refusal
        value_checks.finite(mixed=mixed, conv_states=conv_states[rows], conv_weight=conv_weight, g=g, beta=beta,
                            output_gate=output_gate, norm_weight=norm_weight, A_log=A_log, dt_bias=dt_bias,
                            state_pool=state_pool[rows])
    if plan is None:
        requested_v_slices()  # $FASTKDA_V_SLICES, which kda_decode reads, checked before the conv moves its pool
        if not on_gpu and not compiling:
            # the slots' values first: the conv would otherwise have moved its pool before the decode refused them
            # (a trace reads no values: there the decode's op refuses them, after the conv's)
            value_checks.decode_indices(slots, None, state_pool.shape[0], 1)
        # checked mode: finite inputs can overflow in the conv, whose output kda_decode checks after the conv wrote
        with restored_on_refusal(conv_states, rows):
            conv = causal_conv1d_update(mixed, conv_states, conv_weight, slots=slots)
            q, k, v = _token_heads(conv, heads, key_dim, value_dim)
            o = kda_decode(q, k, v, g[:, None], beta[:, None], state_pool, slots, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm,
                           use_beta_sigmoid=use_beta_sigmoid)
        return gated_rmsnorm(o[:, 0], output_gate, norm_weight, eps)
    if tickets is None and plan.v_slices > 1:  # one program a head needs no join
        tickets = torch.zeros(num_seqs * heads, dtype=torch.int32, device=mixed.device)
    out = torch.empty(num_seqs, heads, value_dim, dtype=mixed.dtype, device=mixed.device)
    from .ops.decode_step import fused_decode_step  # Triton is only needed on the GPU

    fused_decode_step(mixed, conv_states, conv_weight, g, beta, output_gate, norm_weight, state_pool, slots,
                      plan=plan, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale, eps=float(eps),
                      use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, tickets=tickets, out=out,
                      errors=_error_counters(None, mixed))
    return out

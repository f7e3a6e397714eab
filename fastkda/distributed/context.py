"""Context parallelism: one sequence's tokens split over the ranks of a process group, in rank order (spec §8
across processes instead of SMs).

Each token's update is affine in the state, so a rank's tokens map its entry state ``X`` (fastkda's V-first
``[H, V, K]``, the transpose of spec §8's ``S``) to its exit state as ``X_out = X·𝒜ᵀ + ℬᵀ``. Every rank runs the
first half of a prefill whose entry state comes later (:func:`fastkda.kda_prefill_open`: the preparation, each of
its segments' transitions, composed into its map ``(𝒜ᵀ, ℬᵀ)``), the first rank applying its map to the
sequence's initial state; one all-gather gives every rank the first rank's exit state and the maps of the ranks
before it, from which it composes its true entry state, and the second half reruns its segments from there. A
rank's two halves cost about one sequence-parallel prefill of its tokens (the segments' transitions, which a
single GPU's prefill of the whole sequence forms too, are formed once), so the ranks scale with the tokens they
hold. Outputs equal a single run's within the accuracy bound; the last rank's exit state is the sequence's final
state.

A rank whose call fails still enters each exchange, with a flag: every rank then raises at once (the failing one
its own error, the others one naming it). A rank that dies, or never calls, leaves the others in the exchange
until the process group's timeout (``torch.distributed.init_process_group(timeout=...)``) expires or its
connection closes; on gloo they then raise an error naming the exchange (NCCL's watchdog aborts the process).
"""

import torch
import torch.distributed as dist

from .. import checks
from ..api import kda_prefill_open
from ..validation import STATE_DTYPES, check_contiguous, check_tensor


def segment_transition(q, k, v, g, beta, **prefill_kw):
    """``(𝒜ᵀ [H, K, K], ℬᵀ [H, V, K])``, fp32, of one sequence's tokens (spec §8, transposed to fastkda's V-first
    states): the state after them is ``X·𝒜ᵀ + ℬᵀ`` for an entry state ``X [H, V, K]``. q, k, g ``[1, T, H, K]``,
    v ``[1, T, H, V]``, beta ``[1, T, H]``; ``prefill_kw``: the gate's and flags' keywords of
    :func:`fastkda.kda_prefill_open`, whose ``exit_map`` this is."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:  # one map: one sequence's
        raise ValueError(f"segment_transition: q must be [1, T, H, K] (one sequence's tokens), got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    exit_map = kda_prefill_open(q, k, v, g, beta, **prefill_kw).exit_map[0]
    value_dim = v.shape[-1]
    return exit_map[:, value_dim:].contiguous(), exit_map[:, :value_dim].contiguous()


def _exchange(tensor, group, rank, what):
    """All-gather ``tensor`` over ``group``; a failed or timed-out collective raised with what was exchanged."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, tensor, group=group)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise RuntimeError(f"context_parallel_prefill on rank {rank}: the exchange of {what} failed (another rank "
                           f"failed, or the process group's timeout expired): {exc}") from exc
    return parts


def context_parallel_prefill(q, k, v, g, beta, *, group=None, initial_state=None, **prefill_kw):
    """KDA prefill of one sequence whose tokens are split over the ranks of ``group``, rank r holding the r-th
    contiguous part (any lengths, zero too). Called on every rank with its part; returns ``(o, exit_state)``: its
    tokens' output ``[1, T_r, H, V]`` and the state after its last token ``[1, H, V, K]`` (fp32; the last rank's
    is the sequence's final state).

    q, k, g ``[1, T_r, H, K]``, v ``[1, T_r, H, V]``, beta ``[1, T_r, H]`` as :func:`fastkda.kda_prefill` takes one
    sequence; ``initial_state [1, H, V, K]`` (bf16 or fp32, contiguous), read on rank 0 only; ``prefill_kw``: the
    gate, flags and segment length of :func:`fastkda.kda_prefill_open` (``A_log``, ``dt_bias``, ``lower_bound``,
    ``scale``, ``use_qk_l2norm``, ``use_beta_sigmoid``, ``sequence_parallel``, ``checks``), the same on every
    rank. Tensors live on the device the group's backend serves (CPU for gloo, the rank's GPU for NCCL)."""
    rank = dist.get_rank(group)
    if rank < 0:  # a rank outside the group takes no part in its exchanges (none of its ranks waits for it)
        raise ValueError("context_parallel_prefill: this rank is not in group")
    device = next((x.device for x in (k, q, v, g, beta) if isinstance(x, torch.Tensor)), torch.device("cpu"))
    failure = None
    try:  # every rank enters every exchange, a failed one with a flag: a rank's error fails all of them at once
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != 1:
                raise ValueError(f"context_parallel_prefill: {name} must be [1, T, H, D] (one sequence's part), "
                                 f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        heads, key_dim = k.shape[2:]
        value_dim = v.shape[-1]
        mine = torch.tensor([heads, key_dim, value_dim], device=device)
    except ValueError as exc:
        failure, mine = exc, torch.full((3,), -1, dtype=torch.int64, device=device)
    shapes = _exchange(mine, group, rank, "shapes")
    _raise_together(failure, [bool(s[0] < 0) for s in shapes], rank, "the exchange of shapes")
    if any(not torch.equal(s, shapes[0]) for s in shapes):
        raise ValueError("context_parallel_prefill: every rank must hold the same heads and dimensions, got (H, K, "
                         f"V) = {[tuple(s.tolist()) for s in shapes]}")
    try:  # this rank's map, and the first rank's exit state in place of its ℬᵀ
        if rank == 0 and initial_state is not None:  # checked here, so that a bad one fails every rank at once
            check_tensor("initial_state", initial_state, (1, heads, value_dim, key_dim), STATE_DTYPES, device)
            check_contiguous("initial_state", initial_state)
            if checks.requested(prefill_kw.get("checks")):  # by its own name, before the exchange carries it
                checks.finite(initial_state=initial_state)
        opened = kda_prefill_open(q, k, v, g, beta, **prefill_kw)
        exit_map = opened.exit_map[0]
        transition, offset = exit_map[:, value_dim:], exit_map[:, :value_dim]
        if rank == 0 and initial_state is not None:
            offset = apply_map(initial_state[0], transition, offset)
        payload = torch.cat((torch.cat((transition, offset), dim=1).reshape(-1), torch.zeros(1, device=device)))
    except Exception as exc:  # re-raised below, after the others have been told
        failure = exc
        payload = torch.ones(heads * (key_dim + value_dim) * key_dim + 1, dtype=torch.float32, device=device)
    parts = _exchange(payload, group, rank, "segment transitions")
    _raise_together(failure, [bool(p[-1] != 0) for p in parts], rank, "the exchange of segment transitions")
    if rank == 0:
        return opened.finish(initial_state)
    parts = [p[:-1].view(heads, key_dim + value_dim, key_dim) for p in parts]
    entry = parts[0][:, key_dim:]  # rank 0's exit state
    for part in parts[1:rank]:
        entry = apply_map(entry, part[:, :key_dim], part[:, key_dim:])
    return opened.finish(entry[None].contiguous())


def apply_map(entry, transition, offset):
    """``X·𝒜ᵀ + ℬᵀ`` (fp32) for ``X [H, V, K]``, ``𝒜ᵀ [H, K, K]``, ``ℬᵀ [H, V, K]``: in float64, so that the
    entry, which dominates the exit of a part deep in a long sequence, keeps fp32's accuracy whatever the caller's
    matmul precision (``torch.backends.cuda.matmul.allow_tf32`` would round it to tf32)."""
    return torch.baddbmm(offset.double(), entry.double(), transition.double()).float()


def _raise_together(failure, failed, rank, stage):
    """After an exchange that carried every rank's failure flag: this rank's own error, or one that names the
    ranks that failed before ``stage``."""
    if failure is not None:
        raise failure
    if any(failed):
        raise RuntimeError(f"context_parallel_prefill on rank {rank}: rank(s) {[r for r, f in enumerate(failed) if f]} "
                           f"failed before {stage} (their own errors say why)")

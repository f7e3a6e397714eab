"""Context parallelism: one sequence's tokens split over the ranks of a process group, in rank order (spec §8
across processes instead of SMs).

Each token's update is affine in the state, so a rank's tokens map its entry state ``X`` (fastkda's V-first
``[H, V, K]``, the transpose of spec §8's ``S``) to its exit state as ``X_out = X·𝒜ᵀ + ℬᵀ``. Every rank but the
first forms its transition ``(𝒜ᵀ, ℬᵀ)`` from its own tokens (:func:`segment_transition`, one prefill call over a
small batch), while the first runs its tokens from the sequence's initial state; one all-gather then gives every
rank the first rank's exit state and the transitions before its own, from which it composes its true entry state,
and runs its tokens from there. Outputs equal a single run's within fp32 rounding of the composition; the last
rank's exit state is the sequence's final state.

A rank that fails before the exchange leaves the others waiting in it: they fail when the process group's timeout
expires (``torch.distributed.init_process_group(timeout=...)``) or its connection closes, with an error that names
the exchange, rather than hanging.
"""

import torch
import torch.distributed as dist

from ..api import kda_prefill


def segment_transition(q, k, v, g, beta, **prefill_kw):
    """``(𝒜ᵀ [H, K, K], ℬᵀ [H, V, K])``, fp32, of one sequence's tokens (spec §8, transposed to fastkda's V-first
    states): the state after them is ``X·𝒜ᵀ + ℬᵀ`` for an entry state ``X [H, V, K]``. One
    :func:`fastkda.kda_prefill` over a small batch: the tokens from a zero state (``ℬᵀ``), and ``ceil(K / V)``
    copies of them with ``v = 0`` from identity rows of the state (the rows of ``𝒜ᵀ``). q, k, g ``[1, T, H, K]``,
    v ``[1, T, H, V]``, beta ``[1, T, H]``; ``prefill_kw``: the gate's and flags' keywords of
    :func:`fastkda.kda_prefill`."""
    _, tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    blocks = -(-key_dim // value_dim)
    entry = torch.zeros(1 + blocks, heads, value_dim, key_dim, dtype=torch.float32, device=k.device)
    for b in range(blocks):
        rows = torch.arange(min(value_dim, key_dim - b * value_dim), device=k.device)
        entry[1 + b, :, rows, b * value_dim + rows] = 1.0

    def repeat(x):
        return x.expand(1 + blocks, *x.shape[1:])
    values = torch.cat((v, v.new_zeros(blocks, tokens, heads, value_dim)))
    _, exits = kda_prefill(repeat(q), repeat(k), values, repeat(g), repeat(beta), initial_state=entry,
                           output_final_state=True, **prefill_kw)
    rows_of_a = exits[1:].transpose(0, 1).reshape(heads, blocks * value_dim, key_dim)[:, :key_dim]
    return rows_of_a.contiguous(), exits[0]


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
    sequence; ``initial_state [1, H, V, K]``, read on rank 0 only; ``prefill_kw``: the gate and flags of
    :func:`fastkda.kda_prefill` (``A_log``, ``dt_bias``, ``lower_bound``, ``scale``, ``use_qk_l2norm``,
    ``use_beta_sigmoid``), the same on every rank. Tensors live on the device the group's backend serves (CPU for
    gloo, the rank's GPU for NCCL)."""
    rank = dist.get_rank(group)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != 1:
            raise ValueError(f"context_parallel_prefill: {name} must be [1, T, H, D] (one sequence's part), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    tokens, heads, key_dim = k.shape[1:]
    value_dim = v.shape[-1]
    shapes = _exchange(torch.tensor([heads, key_dim, value_dim], device=k.device), group, rank, "shapes")
    if any(not torch.equal(s, shapes[0]) for s in shapes):
        raise ValueError("context_parallel_prefill: every rank must hold the same heads and dimensions, got (H, K, "
                         f"V) = {[tuple(s.tolist()) for s in shapes]}")
    if rank == 0:  # runs from the true initial state now; its exit state is the next rank's entry
        o, exit_state = _run(q, k, v, g, beta, initial_state, prefill_kw)
        transition = torch.zeros(heads, key_dim, key_dim, dtype=torch.float32, device=k.device)
        offset = exit_state[0]
    elif tokens == 0:  # no tokens: the identity map
        transition = torch.eye(key_dim, device=k.device).expand(heads, key_dim, key_dim).contiguous()
        offset = torch.zeros(heads, value_dim, key_dim, device=k.device)
    else:
        transition, offset = segment_transition(q, k, v, g, beta, **prefill_kw)
    parts = _exchange(torch.cat((transition, offset), dim=1), group, rank, "segment transitions")
    if rank == 0:
        return o, exit_state
    entry = parts[0][:, key_dim:]  # rank 0's exit state
    for part in parts[1:rank]:
        entry = torch.baddbmm(part[:, key_dim:], entry, part[:, :key_dim])  # X·𝒜ᵀ + ℬᵀ
    return _run(q, k, v, g, beta, entry[None].contiguous(), prefill_kw)


def _run(q, k, v, g, beta, initial_state, prefill_kw):
    """:func:`fastkda.kda_prefill` of one part from ``initial_state`` (None: zeros): ``(o, fp32 exit state)``."""
    if q.shape[1] == 0:
        heads, key_dim, value_dim = k.shape[2], k.shape[3], v.shape[3]
        exit_state = (initial_state.float().clone() if initial_state is not None else
                      torch.zeros(1, heads, value_dim, key_dim, device=k.device))
        return v.new_zeros(v.shape), exit_state
    o, exit_state = kda_prefill(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                **prefill_kw)
    return o, exit_state.float()

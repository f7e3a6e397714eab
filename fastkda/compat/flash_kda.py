"""FlashKDA's ``flash_kda.fwd`` signature on fastkda (spec §5): ``from fastkda.compat import flash_kda``."""

import numbers

import torch

from ..api import kda_prefill


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, sequence_parallel="auto", max_seqlen=None):
    """Write KDA's output into ``out`` (FlashKDA semantics): beta are logits, g is the raw gate fused with
    ``A_log``, ``dt_bias`` and ``lower_bound`` (in [-5, 0], as FlashKDA documents; 0: no decay); states
    ``[N, H, V, K]``, bf16 or fp32, one dtype when both are given; ``final_state`` is filled in place;
    ``sequence_parallel`` and ``max_seqlen`` as in :func:`fastkda.kda_prefill`.
    Returns None."""
    # a state that is not a tensor is left to kda_prefill's validation, which names it
    if isinstance(initial_state, torch.Tensor) and isinstance(final_state, torch.Tensor) and (
            initial_state.dtype != final_state.dtype):
        raise ValueError(f"flash_kda.fwd: initial_state and final_state must share a dtype, got "
                         f"{initial_state.dtype} and {final_state.dtype}")
    if out is None:
        raise ValueError("flash_kda.fwd: out must be a preallocated tensor shaped like v, got None")
    # FlashKDA's gate is always the raw gate fused with these three; without them kda_prefill would read g as a
    # log-decay (its precomputed mode), a different operator
    for name, given in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
        if given is None:
            raise ValueError(f"flash_kda.fwd: {name} is required (g is the raw gate fused with A_log, dt_bias and "
                             f"lower_bound), got None")
    gate = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    if isinstance(lower_bound, numbers.Real) and lower_bound == 0 and isinstance(g, torch.Tensor):
        # FlashKDA takes λ in [-5, 0]; at 0 every decay is exp(0 · σ(...)) = 1, which fastkda's fused gate (λ < 0)
        # does not take: its precomputed log-decay of zeros is the same operator
        g, gate = torch.zeros_like(g), dict(A_log=None, dt_bias=None, lower_bound=None)
    kda_prefill(q, k, v, g, beta, **gate, scale=scale,
                initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens, out=out,
                sequence_parallel=sequence_parallel, max_seqlen=max_seqlen)

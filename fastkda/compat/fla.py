"""FLA's ``fla.ops.kda.chunk_kda`` inference arguments on fastkda (spec §5)."""

import torch
import torch.nn.functional as F

from ..api import kda_prefill


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              safe_gate=False, lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None,
              sequence_parallel="auto", max_seqlen=None, **unused):
    """Returns ``(o, final_state)`` like FLA: final state fp32, ``[N, H, K, V]`` unless ``state_v_first``.

    With ``use_gate_in_kernel``: ``lower_bound`` given -> ``λ·sigmoid(exp(A_log)·(g + dt_bias))`` (fused);
    no ``lower_bound`` -> Kimi-Linear's ``-exp(A_log)·softplus(g + dt_bias)``. Otherwise g is the log-decay.
    ``safe_gate`` needs no switch here: every gate is computed overflow-free. ``sequence_parallel`` and
    ``max_seqlen`` as in :func:`fastkda.kda_prefill`. Training-only arguments (``**unused``) are ignored."""
    heads, key_dim = q.shape[-2], q.shape[-1]
    gate = {}
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("chunk_kda: use_gate_in_kernel=True without lower_bound needs A_log, got None")
        if A_log is None:  # FLA: lower_bound without A_log gates with λ·sigmoid(g + dt_bias)
            A_log = torch.zeros(heads, dtype=torch.float32, device=q.device)
        bias = torch.zeros(heads, key_dim, device=q.device) if dt_bias is None else dt_bias.reshape(heads, key_dim)
        if lower_bound is not None:
            gate = dict(A_log=A_log, dt_bias=bias.contiguous(), lower_bound=lower_bound)
        else:
            g = -A_log.float().reshape(heads, 1).exp() * F.softplus(g.float() + bias.float())
    elif lower_bound is not None:
        raise ValueError("chunk_kda: lower_bound applies only with use_gate_in_kernel=True")
    if initial_state is not None and not state_v_first:
        initial_state = initial_state.transpose(-1, -2).contiguous()
    o, final = kda_prefill(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           use_qk_l2norm=use_qk_l2norm_in_kernel, use_beta_sigmoid=use_beta_sigmoid_in_kernel,
                           sequence_parallel=sequence_parallel, max_seqlen=max_seqlen, **gate)
    if final is not None and not state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final

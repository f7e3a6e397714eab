"""PyTorch implementations of KDA: the token-by-token truth (spec §1) and the chunked CPU path (spec §2).

Both take the operator's raw inputs (bf16 or any float dtype) and compute in ``dtype``. States are V-first,
``[N, H, V, K]``. Neither is fast on a GPU; the Triton path in :mod:`fastkda.ops` is.
"""

from __future__ import annotations

import torch

CPU_CHUNK = 16  # chunk length of the CPU path: the decay matrix of a chunk is formed element-wise
# Chunked paths clamp a precomputed log-decay here: exp(-30) keeps 1e-13 of the state (below fp32
# resolution), and the floor bounds the in-chunk cumulative decay, so its fp32 ulp stays small.
LOG_DECAY_FLOOR = -30.0


def log_decay(g, A_log=None, dt_bias=None, lower_bound=None, dtype=torch.float32):
    """Per-token log-decay ``a`` (spec §1 step 2): the lower-bound gate when ``lower_bound`` is given, else ``g``."""
    g = g.to(dtype)
    if lower_bound is None:
        return g
    heads = g.shape[-2]
    A = A_log.to(dtype).reshape(heads, 1).exp()
    bias = dt_bias.to(dtype).reshape(heads, -1)
    return lower_bound * torch.sigmoid(A * (g + bias))


def l2_normalize(x):
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dimension (spec §1 step 1)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare_inputs(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid, dtype):
    """Apply the token-local parts of spec §1: norms, scale, gate and beta sigmoid, all in ``dtype``."""
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    a = log_decay(g, A_log, dt_bias, lower_bound, dtype)
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta)
    return q * scale, k, v, a, beta


def sequence_bounds(batch, length, cu_seqlens):
    """``[(batch_index, start, end)]`` of each sequence: the B rows, or the ``cu_seqlens`` spans of row 0."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    offsets = cu_seqlens.tolist()
    return [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]


def _token_step(S, q, k, v, a, beta):
    """One token of spec §1 on states ``S [..., K, V]`` (updated in place); returns ``o [..., V]``."""
    S.mul_(a.exp().unsqueeze(-1))
    u = beta.unsqueeze(-1) * (v - torch.einsum("...kv,...k->...v", S, k))
    S.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("...kv,...k->...v", S, q)


def _zero_outputs(q, v, bounds, initial_state, dtype):
    """Zeroed output ``[B, T, H, V]`` and per-sequence states ``[N, H, K, V]`` set from ``initial_state``."""
    batch, length, heads, key_dim = q.shape
    out = torch.zeros(batch, length, heads, v.shape[-1], dtype=dtype, device=q.device)
    states = torch.zeros(len(bounds), heads, key_dim, v.shape[-1], dtype=dtype, device=q.device)
    if initial_state is not None:
        states.copy_(initial_state.to(dtype).transpose(-1, -2))
    return out, states


def kda_reference(
    q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
    cu_seqlens=None, use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float64,
):
    """Token-by-token recurrence of spec §1 in ``dtype``; returns ``(o [B,T,H,V], final_state [N,H,V,K])``."""
    q, k, v, a, beta = prepare_inputs(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, dtype=dtype,
    )
    bounds = sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)
    out, final = _zero_outputs(q, v, bounds, initial_state, dtype)
    for n, (b, start, end) in enumerate(bounds):
        S = final[n]
        for t in range(start, end):
            out[b, t] = _token_step(S, q[b, t], k[b, t], v[b, t], a[b, t], beta[b, t])
    return out, final.transpose(-1, -2).contiguous()


def _chunk_decay_matrix(G):
    """``exp(G_i - G_j)`` for i >= j inside each chunk, zero above the diagonal: ``[..., C, C, K]``.

    Formed element-wise, so an unbounded precomputed gate cannot overflow (no ``exp(-G)`` factor)."""
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)
    size = G.shape[-2]
    lower = torch.ones(size, size, dtype=torch.bool, device=G.device).tril()
    return torch.where(lower.unsqueeze(-1), diff.clamp(max=0), float("-inf")).exp()


def _chunked_sequence(q, k, v, a, beta, S, chunk, checkpoints):
    """Chunked form (spec §2) for one sequence, all heads at once: q,k,a ``[T,H,K]``, v ``[T,H,V]``,
    beta ``[T,H]``, S ``[H,K,V]`` (updated in place), ``checkpoints [(offset, [H,V,K] target)]`` (offsets
    multiples of ``chunk``, 0 < offset <= T). Returns o ``[T,H,V]``."""
    length, heads, key_dim = q.shape
    pad = (-length) % chunk
    if pad:  # padded tokens: zero k and beta, zero decay: they leave the state unchanged
        q, k, v, a, beta = (torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) for x in (q, k, v, a, beta))
    n_chunks = (length + pad) // chunk
    # [H, n_chunks, C, ...]
    q, k, v, a = (x.reshape(n_chunks, chunk, heads, -1).permute(2, 0, 1, 3) for x in (q, k, v, a))
    beta = beta.reshape(n_chunks, chunk, heads).permute(2, 0, 1)
    G = a.cumsum(-2)
    decay = _chunk_decay_matrix(G)  # [H, n, C, C, K]
    kk = torch.einsum("hnik,hnjk,hnijk->hnij", k, k, decay)
    qk = torch.einsum("hnik,hnjk,hnijk->hnij", q, k, decay)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = eye + (beta.unsqueeze(-1) * kk).tril(-1)  # I + L
    kd = k * G.exp()
    qd = q * G.exp()
    kr = k * (G[:, :, -1:] - G).exp()
    w = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * kd, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    chunk_decay = G[:, :, -1].exp()  # [H, n, K]
    out = torch.empty_like(v)
    for c in range(n_chunks):
        for offset, target in checkpoints:
            if offset == c * chunk:
                target.copy_(S.transpose(-1, -2))
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = qd[:, c] @ S + qk[:, c] @ v_new
        S.mul_(chunk_decay[:, c].unsqueeze(-1)).add_(kr[:, c].transpose(-1, -2) @ v_new)
    for offset, target in checkpoints:
        if offset == n_chunks * chunk == length:
            target.copy_(S.transpose(-1, -2))
    return out.permute(1, 2, 0, 3).reshape(n_chunks * chunk, heads, -1)[:length]


def kda_chunked(
    q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
    cu_seqlens=None, use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float32, chunk=CPU_CHUNK,
    checkpoint_offsets=None, checkpoint_states=None,
):
    """Vectorised chunked KDA (the CPU path); same arguments and results as :func:`kda_reference`, plus
    prefix-cache checkpoints: the state after ``checkpoint_offsets[n, j]`` tokens (a multiple of ``chunk``;
    beyond the sequence: ignored) is written to ``checkpoint_states[n, j]`` (``[N, 2, H, V, K]``)."""
    q, k, v, a, beta = prepare_inputs(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, dtype=dtype,
    )
    a = a.clamp(min=LOG_DECAY_FLOOR)
    bounds = sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)
    out, final = _zero_outputs(q, v, bounds, initial_state, dtype)
    offsets = [] if checkpoint_offsets is None else checkpoint_offsets.reshape(len(bounds), -1).tolist()
    for n, (b, start, end) in enumerate(bounds):
        checkpoints = [(o, checkpoint_states[n, j]) for j, o in enumerate(offsets[n] if offsets else [])
                       if 0 <= o <= end - start]
        for offset, target in checkpoints:
            if offset == 0:
                target.copy_(final[n].transpose(-1, -2))
        checkpoints = [(o, t) for o, t in checkpoints if o > 0]
        if end > start:
            span = slice(start, end)
            out[b, span] = _chunked_sequence(q[b, span], k[b, span], v[b, span], a[b, span], beta[b, span], final[n],
                                             chunk, checkpoints)
    return out, final.transpose(-1, -2).contiguous()


def kda_decode_reference(
    q, k, v, g, beta, state_pool, slots, *, A_log=None, dt_bias=None, lower_bound=None, scale=None,
    num_accepted_tokens=None, use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float32,
):
    """Decode over a state pool, token by token in ``dtype`` (the CPU path; float64 is the truth).

    q, k, g ``[N, T, H, K]``, v ``[N, T, H, V]``, beta ``[N, T, H]``; ``state_pool [P, H, V, K]`` updated in
    place; ``slots [N]`` or ``[N, T]`` (see :mod:`fastkda.ops.decode`). Returns o ``[N, T, H, V]`` in ``dtype``."""
    q, k, v, a, beta = prepare_inputs(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, dtype=dtype,
    )
    num_seqs, tokens = q.shape[:2]
    per_token = slots.dim() == 2
    rows = torch.arange(num_seqs, device=slots.device)
    read_t = (num_accepted_tokens.long() - 1) if num_accepted_tokens is not None else torch.zeros_like(rows)
    read_slot = (slots[rows, read_t] if per_token else slots).long()
    live = read_slot >= 0
    S = torch.zeros(num_seqs, q.shape[2], q.shape[3], v.shape[3], dtype=dtype, device=q.device)
    S[live] = state_pool[read_slot[live]].to(dtype).transpose(-1, -2)
    out = torch.zeros_like(v)
    for t in range(tokens):
        out[:, t] = _token_step(S, q[:, t], k[:, t], v[:, t], a[:, t], beta[:, t])
        if per_token:
            write = live & (slots[:, t] >= 0)
            state_pool[slots[write, t].long()] = S[write].transpose(-1, -2).to(state_pool.dtype)
    if not per_token:
        state_pool[read_slot[live]] = S[live].transpose(-1, -2).to(state_pool.dtype)
    out[~live] = 0
    return out

"""KDA decode on the GPU: a few tokens per sequence, states read from and written back to a pool in place.

One program per (sequence, head, V-slice) (:class:`fastkda.plan.DecodePlan`) holds its ``[BV, K]`` slice of the
state in fp32 registers and walks the sequence's tokens (spec §1, token by token). Slots: ``[N]`` (read and write
one slot per sequence) or ``[N, T]`` (the state after token t goes to ``slots[n, t]``; the initial state comes from
``slots[n, num_accepted_tokens[n] - 1]``, or ``slots[n, 0]``). A negative read slot marks a padding row: zero
output, no pool access; a negative write slot skips that write. Whatever the index tensors hold, nothing outside
the pool or the slot table is touched: a read slot at or past the pool's size, or an accepted count outside
``[1, T]``, makes the sequence a null row too, and a write slot past the pool skips that write; each such event
is counted in :mod:`fastkda.errors`. A precomputed gate above 0 (outside the contract) counts as 0.
"""

import triton
import triton.language as tl

from ..errors import counters
from .common import interpreting, launch, load_f32, store_as


@triton.jit
def token_inputs(q, k, v, g, beta, n, t, T, h, kk, vv, stride_q, stride_k, stride_v, stride_g, stride_beta_n,
                  stride_beta_t, stride_beta_h, K: tl.constexpr, V: tl.constexpr):
    """Token ``t`` of sequence ``n``: q, k, g ``[K]``, v ``[BV]`` as fp32 and β (raw), zeros past ``T``."""
    ok = t < T
    row = (n * T + t).to(tl.int64)  # q, k, v, g are [N, T, H, D] with rows of one token contiguous
    q_t = load_f32(q + row * stride_q + h * K + kk, (kk < K) & ok)
    k_t = load_f32(k + row * stride_k + h * K + kk, (kk < K) & ok)
    v_t = load_f32(v + row * stride_v + h * V + vv, (vv < V) & ok)
    g_t = load_f32(g + row * stride_g + h * K + kk, (kk < K) & ok)
    b_t = tl.load(beta + n * stride_beta_n + t * stride_beta_t + h * stride_beta_h, mask=ok, other=0.0).to(tl.float32)
    return q_t, k_t, v_t, g_t, b_t


@triton.jit
def gate_parameters(A_log, dt_bias, h, kk, K: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr):
    """Head h's ``(exp(A_log[h]), dt_bias[h, kk])`` for the lower-bound gate; placeholders without it (unused by
    :func:`token_coefficients` then)."""
    if LOWER_BOUND_GATE:
        a_scale = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.load(dt_bias + h * K + kk).to(tl.float32)
    else:  # tensors, not Python numbers: a jit function returns values of one kind
        a_scale = tl.zeros_like(kk).to(tl.float32)
        bias = tl.zeros_like(kk).to(tl.float32)
    return a_scale, bias


@triton.jit
def token_coefficients(q_t, k_t, g_t, b_t, a_scale, bias, lower_bound, scale, LOWER_BOUND_GATE: tl.constexpr,
                       L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """What a token's update needs of its raw inputs, the same for every V column: the scaled query, the key
    (norms, gate and β's sigmoid as the flags say), the decay ``[K]`` and β."""
    if L2NORM:
        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t) + 1e-6)
        k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t) + 1e-6)
    if LOWER_BOUND_GATE:
        a_t = lower_bound * tl.sigmoid(a_scale * (g_t + bias))
    else:
        a_t = tl.minimum(g_t, 0.0)
    if BETA_SIGMOID:
        b_t = tl.sigmoid(b_t)
    return q_t * scale, k_t, tl.exp(a_t), b_t


@triton.jit
def state_update(S, q_s, k_t, v_t, decay, b_t):
    """One token of spec §1 on a ``[BV, K]`` fp32 state slice from :func:`token_coefficients`' values and the
    slice's ``v [BV]``: returns the new slice and the slice's output ``[BV]``."""
    # the state is held as [BV, K] (memory order, K reductions inside a warp);
    # (diag(decay)·S)ᵀk = Sᵀ(decay ⊙ k): one pass over S for the product, one for the update
    u = b_t * (v_t - tl.sum(S * (decay * k_t)[None, :], axis=1))
    S = S * decay[None, :] + u[:, None] * k_t[None, :]
    return S, tl.sum(S * q_s[None, :], axis=1)


@triton.jit
def token_step(S, q_t, k_t, v_t, g_t, b_t, a_scale, bias, lower_bound, scale, LOWER_BOUND_GATE: tl.constexpr,
               L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """One token of spec §1 on a ``[BV, K]`` fp32 state slice from raw inputs: returns the new slice and the
    slice's output ``[BV]``."""
    q_s, k_t, decay, b_t = token_coefficients(q_t, k_t, g_t, b_t, a_scale, bias, lower_bound, scale,
                                              LOWER_BOUND_GATE, L2NORM, BETA_SIGMOID)
    return state_update(S, q_s, k_t, v_t, decay, b_t)


@triton.jit
def decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, pool, slots, num_accepted, out, errors,
    stride_q, stride_k, stride_v, stride_g, stride_beta_n, stride_beta_t, stride_beta_h, stride_slot_n,
    stride_slot_t, lower_bound, scale, T, pool_slots,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    PER_TOKEN_SLOTS: tl.constexpr, T_SLOTS: tl.constexpr, HAS_ACCEPTED: tl.constexpr, EMULATE: tl.constexpr,
):
    vs = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    kk = tl.arange(0, K)
    vv = vs * BV + tl.arange(0, BV)
    # the first token's inputs (and the gate's parameters) are requested before the slot, so that their round trip
    # to memory overlaps the slot -> state chain instead of following it; each later token's while the previous
    # one computes
    q_t, k_t, v_t, g_t, b_t = token_inputs(q, k, v, g, beta, n, 0, T, h, kk, vv, stride_q, stride_k, stride_v,
                                            stride_g, stride_beta_n, stride_beta_t, stride_beta_h, K, V)
    a_scale, bias = gate_parameters(A_log, dt_bias, h, kk, K, LOWER_BOUND_GATE)
    if PER_TOKEN_SLOTS:
        # the sequence's slots in one request beside its first inputs: the read slot is picked from them rather
        # than loaded after the accepted count, and each token's write slot is in registers before its store
        tt = tl.arange(0, T_SLOTS)
        seq_slots = tl.load(slots + n * stride_slot_n + tt * stride_slot_t, mask=tt < T, other=-1).to(tl.int64)
    if HAS_ACCEPTED:
        read_t = tl.load(num_accepted + n).to(tl.int32) - 1
    else:
        read_t = 0
    if PER_TOKEN_SLOTS:
        read_slot = tl.sum(tl.where(tt == read_t, seq_slots, 0))
    else:
        read_slot = tl.load(slots + n * stride_slot_n).to(tl.int64)
    if HAS_ACCEPTED:
        accepted_ok = (read_t >= 0) & (read_t < T)
        read_slot = tl.where(accepted_ok, read_slot, -1)  # a bad count: a null row
        bad_counts = (~accepted_ok).to(tl.int32)
    else:
        bad_counts = 0
    bad_slots = (read_slot >= pool_slots).to(tl.int32)
    live = (read_slot >= 0) & (read_slot < pool_slots)
    counting = (vs == 0) & (h == 0)  # each event is counted once, by one program of its sequence
    state_cols = (h * V + vv[:, None]) * K + kk[None, :]  # S[v, k] = pool[slot, h, v, k]; int32 within a slot
    m_state = live & (vv[:, None] < V) & (kk[None, :] < K)
    S = load_f32(pool + read_slot * (H * V * K) + state_cols, m_state)
    for t in range(T):
        q_n, k_n, v_n, g_n, b_n = token_inputs(q, k, v, g, beta, n, t + 1, T, h, kk, vv, stride_q, stride_k,
                                                stride_v, stride_g, stride_beta_n, stride_beta_t, stride_beta_h, K, V)
        S, o_t = token_step(S, q_t, k_t, v_t, g_t, b_t, a_scale, bias, lower_bound, scale, LOWER_BOUND_GATE, L2NORM,
                            BETA_SIGMOID)
        row = (n * T + t).to(tl.int64)
        store_as(out + row * (H * V) + h * V + vv, tl.where(live, o_t, 0.0), vv < V, EMULATE)
        if PER_TOKEN_SLOTS:
            write_slot = tl.sum(tl.where(tt == t, seq_slots, 0))
            tl.atomic_add(errors, 1, mask=counting & live & (write_slot >= pool_slots), sem="relaxed")  # "slot"
            writes = m_state & (write_slot >= 0) & (write_slot < pool_slots)
            store_as(pool + write_slot * (H * V * K) + state_cols, S, writes, EMULATE)
        q_t, k_t, v_t, g_t, b_t = q_n, k_n, v_n, g_n, b_n
    if not PER_TOKEN_SLOTS:
        store_as(pool + read_slot * (H * V * K) + state_cols, S, m_state, EMULATE)
    # a bad read slot or count is added last, after every load and store (fastkda.errors: "slot", "accepted")
    tl.atomic_add(errors, bad_slots, mask=counting & (bad_slots > 0), sem="relaxed")
    if HAS_ACCEPTED:
        tl.atomic_add(errors + 1, bad_counts, mask=counting & (bad_counts > 0), sem="relaxed")


def recurrent_kda_decode(q, k, v, g, beta, state_pool, slots, *, plan, A_log, dt_bias, lower_bound, scale,
                         num_accepted_tokens, use_qk_l2norm, use_beta_sigmoid, out, errors):
    """Launch the decode kernel on validated inputs as the :class:`fastkda.plan.DecodePlan` says; ``out [N, T, H,
    V]`` contiguous, written in place, the pool updated in place, bad indices counted in ``errors`` (None: the
    device's :func:`fastkda.errors.counters`, as the prefill's kernels take them)."""
    num_seqs, tokens, heads, key_dim = q.shape
    if num_seqs == 0 or tokens == 0:
        return
    if errors is None:
        errors = counters(q.device)
    lower_bound_gate = lower_bound is not None
    per_token = slots.dim() == 2
    absent = slots  # stands for absent optional tensors; never dereferenced
    launch(
        decode_kernel, (plan.v_slices, heads, num_seqs),
        q, k, v, g, beta, A_log if lower_bound_gate else absent, dt_bias if lower_bound_gate else absent,
        state_pool, slots, num_accepted_tokens if num_accepted_tokens is not None else absent, out, errors,
        q.stride(1), k.stride(1), v.stride(1), g.stride(1), beta.stride(0), beta.stride(1), beta.stride(2),
        slots.stride(0), slots.stride(1) if per_token else 0,
        float(lower_bound) if lower_bound_gate else 0.0, float(scale), tokens, state_pool.shape[0],
        H=heads, K=key_dim, V=plan.value_dim, BV=plan.slice_width, LOWER_BOUND_GATE=lower_bound_gate,
        L2NORM=use_qk_l2norm, BETA_SIGMOID=use_beta_sigmoid, PER_TOKEN_SLOTS=per_token,
        T_SLOTS=triton.next_power_of_2(tokens) if per_token else 1, HAS_ACCEPTED=num_accepted_tokens is not None,
        EMULATE=interpreting(), num_warps=plan.warps,
    )

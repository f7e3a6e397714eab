"""The KDA layer's decode step in one launch (spec §9 steps 2, 5, 6 for one token per sequence): the short conv's
update, the q/k/v split, KDA decode over the state pool, and the gated RMSNorm.

One program per (V-slice, head, sequence), as :mod:`fastkda.ops.decode`: each program runs the conv for the K q and
K k channels of its head and its slice's v channels (the W−1 state columns of its slot and the new token), then the
token's KDA update on its ``[BV, K]`` state slice (:func:`fastkda.ops.decode.token_step`) and writes that slice back.

Two things are shared by a head's slices. The norm needs the whole head's output: each program writes its slice's
output (fp32) and sum of squares to a workspace row, then takes a ticket (an atomic add, acquire-release); the
program that takes the last ticket reads every slice's sum in slice order (deterministic), normalises the head's
output, applies the gate and writes it, and puts the ticket back to 0 (so a CUDA graph replays from zeros). And the
q/k channels' conv state: every slice reads it, so only the last program, which knows that every slice has read it
(their reads come before their tickets), writes its new value; each program writes its own v channels' state.
With one slice per head (a plan that asks for it) the step is another kernel, :func:`head_step_kernel`: one program
a head walks the head's state in chunks of :func:`fastkda.plan.decode_step_chunk` columns, normalises the head and
writes the q/k state itself, without ticket.

A negative slot, or one at or past the pool's size, is a padding row: zeros for the conv state and the recurrent
state, a zero output, nothing written to either pool (counted as the decode kernel counts it).
"""

import torch
import triton
import triton.language as tl

from ..plan import decode_step_chunk
from .common import interpreting, launch, load_f32, store_as
from .conv import conv_sum, load_columns, store_shifted
from .decode import gate_parameters, state_update, token_coefficients, token_step


@triton.jit
def conv_column(conv_row, channels, stride_cc):
    """Pointers to column 0 of ``channels`` in a pool row (64-bit: pools past 2**31 elements)."""
    return conv_row + channels.to(tl.int64) * stride_cc


@triton.jit
def conv_output(x_t, columns, weight, channels, ok, stride_wc, stride_wj, W: tl.constexpr):
    """The conv's output (SiLU applied, no bias) of one token ``x_t`` whose W−1 earlier inputs are ``columns``."""
    acc = conv_sum(x_t, columns, weight + channels.to(tl.int64) * stride_wc, ok, stride_wj, W, W - 1)
    return acc * tl.sigmoid(acc)


@triton.jit
def shift_qk_conv_state(mixed_row, conv_row, q_ch, k_ch, ok, stride_cc, stride_cj, W: tl.constexpr,
                        EMULATE: tl.constexpr):
    """Write a head's new q and k conv state (``ok``: live channels of a live row), read whole before any of it is
    written (the program's threads may hold copies of one element)."""
    q_column, k_column = conv_column(conv_row, q_ch, stride_cc), conv_column(conv_row, k_ch, stride_cc)
    q_columns = load_columns(q_column, ok, stride_cj, W - 1)
    k_columns = load_columns(k_column, ok, stride_cj, W - 1)
    q_x = load_f32(mixed_row + q_ch, ok)
    k_x = load_f32(mixed_row + k_ch, ok)
    tl.debug_barrier()
    store_shifted(q_column, q_columns, q_x, ok, stride_cj, W - 1, EMULATE)
    store_shifted(k_column, k_columns, k_x, ok, stride_cj, W - 1, EMULATE)


@triton.jit
def sequence_rows(slots, n, stride_slot, pool_slots, mixed, stride_mixed, conv_pool, stride_cp):
    """Sequence n's slot, whether it is live (a slot inside the pool), the pool row it reads (0 for a padding row),
    and pointers to its conv input row and its conv pool row."""
    slot = tl.load(slots + n * stride_slot).to(tl.int64)
    live = (slot >= 0) & (slot < pool_slots)
    row = tl.where(live, slot, 0)
    return slot, live, row, mixed + n.to(tl.int64) * stride_mixed, conv_pool + row * stride_cp


@triton.jit
def normalised_head(o, total, n, h, out_gate, norm_weight, stride_gate, eps, live, V: tl.constexpr):
    """The gated RMSNorm of one head's output ``o [V]`` (fp32) whose sum of squares is ``total``."""
    dd = tl.arange(0, V)
    rstd = tl.rsqrt(total / V + eps)
    gate = load_f32(out_gate + n.to(tl.int64) * stride_gate + h * V + dd, dd < V)
    return tl.where(live, o * rstd * load_f32(norm_weight + dd, dd < V) * tl.sigmoid(gate), 0.0)


@triton.jit
def decode_step_kernel(
    mixed, conv_pool, conv_weight, g, beta, out_gate, norm_weight, A_log, dt_bias, pool, slots, partial, sums,
    tickets, out, errors,
    stride_mixed, stride_cp, stride_cc, stride_cj, stride_wc, stride_wj, stride_g, stride_beta, stride_beta_h,
    stride_gate,
    stride_slot, lower_bound, scale, eps, pool_slots,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, SLICES: tl.constexpr, W: tl.constexpr,
    LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    EMULATE: tl.constexpr,
):
    vs = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    kk = tl.arange(0, K)
    vv = vs * BV + tl.arange(0, BV)
    k_ok = kk < K
    v_ok = vv < V
    slot, live, row, mixed_row, conv_row = sequence_rows(slots, n, stride_slot, pool_slots, mixed, stride_mixed,
                                                         conv_pool, stride_cp)
    q_ch = h * K + kk  # the conv's channels: q | k | v, H heads each
    k_ch = H * K + h * K + kk
    v_ch = 2 * H * K + h * V + vv
    q_columns = load_columns(conv_column(conv_row, q_ch, stride_cc), k_ok & live, stride_cj, W - 1)
    k_columns = load_columns(conv_column(conv_row, k_ch, stride_cc), k_ok & live, stride_cj, W - 1)
    v_column = conv_column(conv_row, v_ch, stride_cc)
    v_columns = load_columns(v_column, v_ok & live, stride_cj, W - 1)  # kept for the v state's shift
    v_x = load_f32(mixed_row + v_ch, v_ok)
    q_t = conv_output(load_f32(mixed_row + q_ch, k_ok), q_columns, conv_weight, q_ch, k_ok, stride_wc, stride_wj, W)
    k_t = conv_output(load_f32(mixed_row + k_ch, k_ok), k_columns, conv_weight, k_ch, k_ok, stride_wc, stride_wj, W)
    v_t = conv_output(v_x, v_columns, conv_weight, v_ch, v_ok, stride_wc, stride_wj, W)
    g_t = load_f32(g + n.to(tl.int64) * stride_g + h * K + kk, k_ok)
    b_t = tl.load(beta + n * stride_beta + h * stride_beta_h).to(tl.float32)
    a_scale, bias = gate_parameters(A_log, dt_bias, h, kk, K, LOWER_BOUND_GATE)
    state_cols = (h * V + vv[:, None]) * K + kk[None, :]
    m_state = live & v_ok[:, None] & k_ok[None, :]
    S = load_f32(pool + row * (H * V * K) + state_cols, m_state)
    S, o_t = token_step(S, q_t, k_t, v_t, g_t, b_t, a_scale, bias, lower_bound, scale, LOWER_BOUND_GATE, L2NORM,
                        BETA_SIGMOID)
    o_t = tl.where(live, o_t, 0.0)
    store_as(pool + row * (H * V * K) + state_cols, S, m_state, EMULATE)
    tl.debug_barrier()  # every thread's reads of the old conv row before any thread's writes
    store_shifted(v_column, v_columns, v_x, v_ok & live, stride_cj, W - 1, EMULATE)
    tl.atomic_add(errors, (slot >= pool_slots).to(tl.int32), mask=(vs == 0) & (h == 0) & (slot >= pool_slots),
                  sem="relaxed")  # "slot", as the decode kernel counts it
    head = n.to(tl.int64) * H + h
    tl.store(partial + head * V + vv, o_t, mask=v_ok)
    tl.store(sums + head * SLICES + vs, tl.sum(o_t * o_t))
    tl.debug_barrier()  # every thread's stores and q/k state reads of this program before its ticket (release)
    ticket = tl.atomic_add(tickets + head, 1, sem="acq_rel")
    if ticket == SLICES - 1:  # every slice of this head has read the q/k state and written its output
        shift_qk_conv_state(mixed_row, conv_row, q_ch, k_ch, k_ok & live, stride_cc, stride_cj, W, EMULATE)
        ss = tl.arange(0, SLICES)
        dd = tl.arange(0, V)
        y = normalised_head(tl.load(partial + head * V + dd), tl.sum(tl.load(sums + head * SLICES + ss)), n, h,
                            out_gate, norm_weight, stride_gate, eps, live, V)
        store_as(out + head * V + dd, y, dd < V, EMULATE)
        tl.store(tickets + head, 0)


@triton.jit
def head_step_kernel(
    mixed, conv_pool, conv_weight, g, beta, out_gate, norm_weight, A_log, dt_bias, pool, slots, partial, out, errors,
    stride_mixed, stride_cp, stride_cc, stride_cj, stride_wc, stride_wj, stride_g, stride_beta, stride_beta_h,
    stride_gate, stride_slot, lower_bound, scale, eps, pool_slots,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, W: tl.constexpr,
    LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, EMULATE: tl.constexpr,
):
    """The step with one program per (head, sequence): the head's q/k conv and the token's coefficients once, then
    its state in chunks of BC columns, one after another (unrolled): each chunk's v conv, update and stores, its
    output to the program's workspace row and its sum of squares to the total; then, behind a barrier, the
    head's norm and the q/k conv state's shift by the same program: no ticket or fence (its one atomic is the
    bad-slot count's), and a chunk's registers (a BC-column slice's) rather than the head's."""
    h = tl.program_id(1)
    n = tl.program_id(2)
    kk = tl.arange(0, K)
    k_ok = kk < K
    slot, live, row, mixed_row, conv_row = sequence_rows(slots, n, stride_slot, pool_slots, mixed, stride_mixed,
                                                         conv_pool, stride_cp)
    q_ch = h * K + kk  # the conv's channels: q | k | v, H heads each
    k_ch = H * K + h * K + kk
    q_columns = load_columns(conv_column(conv_row, q_ch, stride_cc), k_ok & live, stride_cj, W - 1)
    k_columns = load_columns(conv_column(conv_row, k_ch, stride_cc), k_ok & live, stride_cj, W - 1)
    q_t = conv_output(load_f32(mixed_row + q_ch, k_ok), q_columns, conv_weight, q_ch, k_ok, stride_wc, stride_wj, W)
    k_t = conv_output(load_f32(mixed_row + k_ch, k_ok), k_columns, conv_weight, k_ch, k_ok, stride_wc, stride_wj, W)
    g_t = load_f32(g + n.to(tl.int64) * stride_g + h * K + kk, k_ok)
    b_t = tl.load(beta + n * stride_beta + h * stride_beta_h).to(tl.float32)
    a_scale, bias = gate_parameters(A_log, dt_bias, h, kk, K, LOWER_BOUND_GATE)
    q_s, k_n, decay, b_n = token_coefficients(q_t, k_t, g_t, b_t, a_scale, bias, lower_bound, scale,
                                              LOWER_BOUND_GATE, L2NORM, BETA_SIGMOID)
    head = n.to(tl.int64) * H + h
    total = 0.0
    for c in tl.static_range(V // BC):
        vv = c * BC + tl.arange(0, BC)
        v_ok = vv < V  # all true (BC divides V); the conv's helpers take a mask
        v_ch = 2 * H * K + h * V + vv
        v_column = conv_column(conv_row, v_ch, stride_cc)
        v_columns = load_columns(v_column, live, stride_cj, W - 1)  # kept for the v state's shift
        v_x = load_f32(mixed_row + v_ch, v_ok)
        v_t = conv_output(v_x, v_columns, conv_weight, v_ch, v_ok, stride_wc, stride_wj, W)
        state = pool + row * (H * V * K) + (h * V + vv[:, None]) * K + kk[None, :]
        m_state = live & k_ok[None, :]
        S, o_t = state_update(load_f32(state, m_state), q_s, k_n, v_t, decay, b_n)
        o_t = tl.where(live, o_t, 0.0)
        store_as(state, S, m_state, EMULATE)
        tl.debug_barrier()  # every thread's reads of the chunk's old conv columns before any thread's writes
        store_shifted(v_column, v_columns, v_x, live, stride_cj, W - 1, EMULATE)
        tl.store(partial + head * V + vv, o_t)
        total += tl.sum(o_t * o_t)
    tl.atomic_add(errors, (slot >= pool_slots).to(tl.int32), mask=(h == 0) & (slot >= pool_slots),
                  sem="relaxed")  # "slot", as the decode kernel counts it
    tl.debug_barrier()  # the chunks' outputs in the workspace before they are read back
    shift_qk_conv_state(mixed_row, conv_row, q_ch, k_ch, k_ok & live, stride_cc, stride_cj, W, EMULATE)
    dd = tl.arange(0, V)
    y = normalised_head(tl.load(partial + head * V + dd), total, n, h, out_gate, norm_weight, stride_gate, eps, live,
                        V)
    store_as(out + head * V + dd, y, dd < V, EMULATE)


def fused_decode_step(mixed, conv_pool, conv_weight, g, beta, out_gate, norm_weight, state_pool, slots, *, plan,
                      A_log, dt_bias, lower_bound, scale, eps, use_qk_l2norm, use_beta_sigmoid, tickets, out, errors):
    """Launch the step on validated inputs (``fastkda.api.kda_decode_step``) as the decode plan says: one program a
    head (:func:`head_step_kernel`) for one slice a head, else the sliced form joined by tickets
    (:func:`decode_step_kernel`); ``out [N, H, V]`` contiguous, written; both pools updated in place; ``tickets
    [N·H]`` int32 zeros, left as zeros (unread by one program a head, where it may be None)."""
    num_seqs, heads, key_dim = g.shape
    if num_seqs == 0:
        return
    value_dim = plan.value_dim
    partial = torch.empty(num_seqs, heads, value_dim, dtype=torch.float32, device=out.device)
    lower_bound_gate = lower_bound is not None
    absent = slots  # stands for absent optional tensors; never dereferenced
    inputs = (mixed, conv_pool, conv_weight, g, beta, out_gate, norm_weight, A_log if lower_bound_gate else absent,
              dt_bias if lower_bound_gate else absent, state_pool, slots, partial)
    strides = (mixed.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2), conv_weight.stride(0),
               conv_weight.stride(1), g.stride(0), beta.stride(0), beta.stride(1), out_gate.stride(0), slots.stride(0),
               float(lower_bound) if lower_bound_gate else 0.0, float(scale), float(eps), state_pool.shape[0])
    flags = dict(H=heads, K=key_dim, V=value_dim, W=conv_weight.shape[1], LOWER_BOUND_GATE=lower_bound_gate,
                 L2NORM=use_qk_l2norm, BETA_SIGMOID=use_beta_sigmoid, EMULATE=interpreting(), num_warps=plan.warps)
    if plan.v_slices == 1:
        launch(head_step_kernel, (1, heads, num_seqs), *inputs, out, errors, *strides,
               BC=decode_step_chunk(value_dim), **flags)
        return
    sums = torch.empty(num_seqs, heads, plan.v_slices, dtype=torch.float32, device=out.device)
    launch(decode_step_kernel, (plan.v_slices, heads, num_seqs), *inputs, sums, tickets, out, errors, *strides,
           BV=plan.slice_width, SLICES=plan.v_slices, **flags)

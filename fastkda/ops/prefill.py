"""Chunked KDA prefill on the GPU: token-parallel preparation kernels and a serial recurrence kernel.

Spec §2 in the WY form, chunk ``C`` = 64 tokens split into 16-token blocks:

* Preparation computes everything that does not depend on the state: gate, in-chunk cumulative decay ``G``,
  normalised q/k, the in-chunk matrices ``M = lower_incl(qd·kiᵀ)`` and ``L = strictly_lower(β·kd·kiᵀ)`` and
  ``T = (I + L)⁻¹``, and writes the bf16 workspace ``w = T·β·kd``, ``u = T·β·v``, ``qg = qd``, ``kg = kr``,
  ``A = M`` and the fp32 chunk decay ``exp(G_C)``. Two implementations (``PREPARE_PATH``): "split",
  ``_intra_kernel`` per (chunk, head, 16-token row block) then ``_solve_kernel`` per (chunk, head), and
  "fused", ``_prepare_kernel`` per (chunk, head). No factor ``exp(-G)`` is ever formed across more than one
  16-token block, so nothing overflows: off-diagonal blocks use ``exp(G_i - G_end(J))·exp(G_end(J) - G_j)``
  (both ≤ 1); diagonal blocks use ``exp(G_i - G_end(J)) ≤ e^75`` for the lower-bound gate, and an
  element-wise decay for an unbounded precomputed gate.
* ``_recurrence_kernel`` (one program per (sequence, head, V-slice)) walks the chunks in order with the
  state in fp32 registers: ``v_new = u - w·S``, ``o = qg·S + A·v_new``, ``S = diag(exp(G_C))·S + kgᵀ·v_new``,
  and writes prefix-cache checkpoints at chunk boundaries. No step reduces over V, and every slice runs the
  same instructions over K, so results are bitwise identical for any number of V-slices.

Chunks are numbered by *slot*: sequence ``n`` owns slots from ``cu[n] // C + n`` (varlen) or
``n · ceil(T / C)`` (fixed length), a layout both kernels derive from host-known values, with no
host-device synchronisation.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..plan import CHUNK  # tokens per chunk (one serial step of the recurrence)
from ..reference import LOG_DECAY_FLOOR as _FLOOR
from .common import bf16_operand, interpreting, load_f32, store_as

BLOCK = 16  # tokens per block inside a chunk (the range over which exp(-G) factors are formed)
# Two implementations of the preparation step, kept side by side until the H200 decides between them
# (docs/perf-notes.md): "fused", one program per (chunk, head) (_prepare_kernel), and "split", one program per
# 16-token row block for the in-chunk products (_intra_kernel) then one per (chunk, head) for the inverse
# and w, u (_solve_kernel), with an fp32 scratch for β·L between them.
PREPARE_PATH = "columns"
BLOCKED_WARPS = 8
BLOCKED_CHANNELS = 32
COLUMNS_CHANNELS = 16  # key channels per pass-1 step of _columns_prepare_kernel
COLUMNS_WARPS = 8  # with 16 channels: 237 registers, no spills (ptxas, sm_90a); 4 warps spill
COLUMNS_CHANNELS_MAXNREG = None  # a register cap (launch option maxnreg), for two programs per SM
INTRA_WARPS = 4  # ptxas (sm_90a): 226 registers, no spills; 8 warps: 208 registers, 1 program per SM
SOLVE_CHANNEL_BLOCK = 32  # channels _solve_kernel holds in registers at a time
SOLVE_WARPS = 8  # with 32 channels: 196 registers, no spills; 4 warps with 64 channels spill 1.4 KB
CHANNEL_BLOCK = 16  # key/value channels the fused preparation kernel holds in registers at a time
PREPARE_WARPS = 8  # with CHANNEL_BLOCK = 16: no register spills (ptxas, sm_90a); 4 warps or 32 channels spill
LOG_DECAY_FLOOR: tl.constexpr = tl.constexpr(_FLOOR)  # precomputed gates are clamped here (reference.py)


@triton.jit
def _sequence_span(cu_seqlens, n, seq_len, IS_VARLEN: tl.constexpr):
    """First and one-past-last flattened token of sequence ``n``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int32)
    else:
        bos = n * seq_len
        eos = bos + seq_len
    return bos, eos


@triton.jit
def _first_slot(n, bos, seq_len, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Slot of sequence ``n``'s first chunk (see the module docstring)."""
    if IS_VARLEN:
        return bos // C + n
    else:
        return n * tl.cdiv(seq_len, C)


@triton.jit
def _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token of chunk ``slot`` and one past its sequence's last token (a slot past the end of its
    sequence gives an empty chunk)."""
    if IS_VARLEN:  # the last sequence whose first slot is <= slot
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(cu_seqlens + mid).to(tl.int32) // C + mid <= slot:
                lo = mid
            else:
                hi = mid - 1
        n = lo
    else:
        n = slot // tl.cdiv(seq_len, C)
    bos, eos = _sequence_span(cu_seqlens, n, seq_len, IS_VARLEN)
    return bos + (slot - _first_slot(n, bos, seq_len, C, IS_VARLEN)) * C, eos


@triton.jit
def _expand_blocks(x, NB: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
    """``[NB, D]`` per-block rows -> ``[NB*BC, D]``, each block's row repeated over its BC tokens."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (NB, BC, D)), (NB * BC, D))


@triton.jit
def _row_at(x, i, C: tl.constexpr):
    """Row ``i`` of ``x [C, D]`` as a ``[D]`` vector."""
    return tl.sum(tl.where((tl.arange(0, C) == i)[:, None], x, 0.0), axis=0)


@triton.jit
def _beta_rows(beta, tok, valid, stride_tok, stride_head, h, BETA_SIGMOID: tl.constexpr):
    """β of tokens ``tok`` (σ applied unless the caller did), zero outside ``valid``."""
    bv = load_f32(beta + tok * stride_tok + h * stride_head, valid)
    if BETA_SIGMOID:
        bv = tl.sigmoid(bv)
    return tl.where(valid, bv, 0.0)


@triton.jit
def _log_decay_block(g, tok64, stride_g, h, kk, mask, A_log, dt_bias, lower_bound,
                     K: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr):
    """Log-decay ``a`` of one ``[C, BK]`` block of key channels, zero outside ``mask``."""
    gv = load_f32(g + tok64[:, None] * stride_g + h * K + kk[None, :], mask)
    if LOWER_BOUND_GATE:
        a_scale = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.load(dt_bias + h * K + kk).to(tl.float32)
        a = lower_bound * tl.sigmoid(a_scale * (gv + bias[None, :]))
    else:  # floor: exp(-30) leaves 1e-13 of the state, below fp32 resolution; keeps G's ulp small
        a = tl.maximum(gv, LOG_DECAY_FLOOR)
    return tl.where(mask, a, 0.0)


@triton.jit
def _prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens,
    w_ws, u_ws, qg_ws, kg_ws, A_ws, decay_ws,
    stride_q, stride_k, stride_v, stride_g, stride_beta_tok, stride_beta_head,
    seq_len, num_seqs, lower_bound, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """One (chunk, head). Key channels are independent except in the q·k reductions, so every
    ``[C, K]`` quantity is handled ``BK`` channels at a time: registers hold ``[C, BK]`` blocks and the
    ``[C, C]`` matrices, never a whole ``[C, K]`` set (that spilled)."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    NB: tl.constexpr = C // BC
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)

    r = tl.arange(0, C)
    cols = tl.arange(0, C)
    blk = r // BC
    tok = chunk_start + r
    valid = tok < eos
    tok64 = tok.to(tl.int64)
    q_rows = q + tok64[:, None] * stride_q + h * K
    k_rows = k + tok64[:, None] * stride_k + h * K

    # row scales: 1/||q||·scale and 1/||k|| (spec §1 step 1)
    q_ss = tl.zeros((C,), dtype=tl.float32)
    k_ss = tl.zeros((C,), dtype=tl.float32)
    if L2NORM:
        for kb in tl.static_range(K // BK):
            kk = kb * BK + tl.arange(0, BK)
            m = valid[:, None] & (kk[None, :] < K)
            qb = load_f32(q_rows + kk[None, :], m)
            kb_ = load_f32(k_rows + kk[None, :], m)
            q_ss += tl.sum(qb * qb, axis=1)
            k_ss += tl.sum(kb_ * kb_, axis=1)
        q_scale = tl.rsqrt(q_ss + 1e-6) * scale
        k_scale = tl.rsqrt(k_ss + 1e-6)
    else:
        q_scale = q_ss + scale
        k_scale = k_ss + 1.0
    bv = _beta_rows(beta, tok64, valid, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)

    M = tl.zeros((C, C), dtype=tl.float32)
    L = tl.zeros((C, C), dtype=tl.float32)
    row_k = tok64[:, None] * (H * K) + h * K
    for kb in tl.static_range(K // BK):
        kk = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (kk[None, :] < K)
        qv = load_f32(q_rows + kk[None, :], m) * q_scale[:, None]
        kv = load_f32(k_rows + kk[None, :], m) * k_scale[:, None]
        a = _log_decay_block(g, tok64, stride_g, h, kk, m, A_log, dt_bias, lower_bound, K, LOWER_BOUND_GATE)
        G = tl.cumsum(a, axis=0)  # in-chunk cumulative log-decay, <= 0, non-increasing
        G_last = tl.sum(a, axis=0)
        G_own_end = tl.zeros((C, BK), dtype=tl.float32)
        for J in tl.static_range(NB):
            G_own_end = tl.where((blk == J)[:, None], _row_at(G, J * BC + BC - 1, C)[None, :], G_own_end)
        k_col = kv * tl.exp(G_own_end - G)  # k_j·exp(G_end(J) - G_j), <= 1
        for J in tl.static_range(NB):
            # columns of block J: exp(G_i - G_j) = exp(G_i - G_end(J)) · exp(G_end(J) - G_j). Full-width dots
            # on zero-masked operands keep every tensor 2-D (block extraction spilled registers).
            G_ref = _row_at(G, J * BC + BC - 1, C)
            if LOWER_BOUND_GATE:  # diagonal block too: exp(G_i - G_end(J)) <= e^(15*5) for i in block J
                rows_used = blk >= J
            else:
                rows_used = blk > J
            row_factor = tl.where(rows_used[:, None], tl.exp(tl.where(rows_used[:, None], G - G_ref[None, :], 0.0)),
                                  0.0)
            col_J = tl.trans(tl.where((blk == J)[:, None], k_col, 0.0))
            M = tl.dot(qv * row_factor, col_J, M, input_precision=DOT_PRECISION)
            L = tl.dot(kv * row_factor, col_J, L, input_precision=DOT_PRECISION)
        if not LOWER_BOUND_GATE:  # diagonal blocks element-wise: exp(G_i - G_j) is never split in two factors
            local = r % BC
            for jj in range(BC):  # a runtime loop: unrolling it made compiles take minutes
                pick = (tl.arange(0, BC) == jj)[None, :, None]
                G_j = _expand_blocks(tl.sum(tl.where(pick, tl.reshape(G, (NB, BC, BK)), 0.0), axis=1), NB, BC, BK)
                k_j = _expand_blocks(tl.sum(tl.where(pick, tl.reshape(kv, (NB, BC, BK)), 0.0), axis=1), NB, BC, BK)
                below = local >= jj
                decay = tl.where(below[:, None], tl.exp(tl.minimum(G - G_j, 0.0)), 0.0) * k_j
                at_col = (cols[None, :] == (blk * BC + jj)[:, None]) & below[:, None]
                M += tl.where(at_col, tl.sum(qv * decay, axis=1)[:, None], 0.0)
                L += tl.where(at_col, tl.sum(kv * decay, axis=1)[:, None], 0.0)
        store_as(qg_ws + row_k + kk[None, :], qv * tl.exp(G), m, EMULATE)
        store_as(kg_ws + row_k + kk[None, :], kv * tl.exp(G_last[None, :] - G), m, EMULATE)
        tl.store(decay_ws + (slot * H + h) * K + kk, tl.exp(G_last))
    store_as(A_ws + tok64[:, None] * (H * C) + h * C + cols[None, :], tl.where(r[:, None] >= cols[None, :], M, 0.0),
             valid[:, None] & (cols[None, :] < C), EMULATE)

    L = tl.where(r[:, None] > cols[None, :], L * bv[:, None], 0.0)
    T_inv = _unit_lower_inverse(L, C, BC, DOT_PRECISION)
    _write_w_u(T_inv, k, v, g, tok64, valid, k_scale, bv, stride_k, stride_v, stride_g, h, A_log, dt_bias,
               lower_bound, w_ws, u_ws, H, K, V, BK, LOWER_BOUND_GATE, DOT_PRECISION, EMULATE)


@triton.jit
def _unit_lower_inverse(L, C: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(I + L)^-1`` for a strictly lower ``[C, C]`` L: the block-diagonal part by the nilpotent product
    formula, then the Neumann series of the C/BC = 4 block-lower part (it ends at the third power)."""
    r = tl.arange(0, C)
    eye = r[:, None] == r[None, :]
    power = tl.where((r // BC)[:, None] == (r // BC)[None, :], L, 0.0)
    off_diagonal = L - power
    D_inv = tl.where(eye, 1.0, 0.0) - power
    for _ in tl.static_range(3):  # (I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8)
        power = tl.dot(power, power, input_precision=DOT_PRECISION)
        D_inv = tl.dot(D_inv, tl.where(eye, 1.0, 0.0) + power, input_precision=DOT_PRECISION)
    Y = tl.dot(D_inv, off_diagonal, input_precision=DOT_PRECISION)
    Y2 = tl.dot(Y, Y, input_precision=DOT_PRECISION)
    return tl.dot(tl.dot(tl.where(eye, 1.0, 0.0) - Y, tl.where(eye, 1.0, 0.0) + Y2, input_precision=DOT_PRECISION),
                  D_inv, input_precision=DOT_PRECISION)


@triton.jit
def _write_w_u(T_inv, k, v, g, tok64, valid, k_scale, bv, stride_k, stride_v, stride_g, h, A_log, dt_bias,
               lower_bound, w_ws, u_ws, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               LOWER_BOUND_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """``w = T·β·kd`` and ``u = T·β·v`` for one chunk, BK channels at a time; kd = k̂·exp(G) is recomputed
    from the inputs (cheaper than a round trip through memory)."""
    for kb in tl.static_range(K // BK):
        kk = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (kk[None, :] < K)
        kv = load_f32(k + tok64[:, None] * stride_k + h * K + kk[None, :], m) * k_scale[:, None]
        G = tl.cumsum(_log_decay_block(g, tok64, stride_g, h, kk, m, A_log, dt_bias, lower_bound, K,
                                       LOWER_BOUND_GATE), axis=0)
        w = tl.dot(T_inv, kv * tl.exp(G) * bv[:, None], input_precision=DOT_PRECISION)
        store_as(w_ws + tok64[:, None] * (H * K) + h * K + kk[None, :], w, m, EMULATE)
    for vb in tl.static_range(V // BK):
        vv = vb * BK + tl.arange(0, BK)
        m = valid[:, None] & (vv[None, :] < V)
        vvv = load_f32(v + tok64[:, None] * stride_v + h * V + vv[None, :], m)
        u = tl.dot(T_inv, vvv * bv[:, None], input_precision=DOT_PRECISION)
        store_as(u_ws + tok64[:, None] * (H * V) + h * V + vv[None, :], u, m, EMULATE)


@triton.jit
def _diagonal_block_elementwise(q_b, k_b, G_b, BC: tl.constexpr):
    """``[BC, BC]`` blocks ``q_i·k_j`` and ``k_i·k_j`` weighted by ``exp(G_i - G_j)`` for i >= j, the exponent
    never split in two factors (for an unbounded precomputed gate)."""
    cb = tl.arange(0, BC)
    m_blk = tl.zeros((BC, BC), dtype=tl.float32)
    l_blk = tl.zeros((BC, BC), dtype=tl.float32)
    for jj in range(BC):
        k_j = _row_at(k_b, jj, BC)
        G_j = _row_at(G_b, jj, BC)
        decay = tl.where((cb >= jj)[:, None], tl.exp(tl.minimum(G_b - G_j[None, :], 0.0)), 0.0) * k_j[None, :]
        at_col = cb[None, :] == jj
        m_blk += tl.where(at_col, tl.sum(q_b * decay, axis=1)[:, None], 0.0)
        l_blk += tl.where(at_col, tl.sum(k_b * decay, axis=1)[:, None], 0.0)
    return m_blk, l_blk


@triton.jit
def _intra_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens,
    qg_ws, kg_ws, A_ws, L_ws, k_scale_ws, decay_ws,
    stride_q, stride_k, stride_g, stride_beta_tok, stride_beta_head,
    seq_len, num_seqs, lower_bound, scale,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """Split preparation, step 1: one 16-token row block ``I`` of one (chunk, head). Writes rows I of
    ``M`` (the A workspace) and of ``β·L`` (fp32 scratch), qg/kg and the key scale of its tokens, and (I = 0)
    the chunk decay. Each block pair is one ``[16, K] @ [K, 16]`` product: small programs, many per SM."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    I = tl.program_id(2)
    NB: tl.constexpr = C // BC
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    kk = tl.arange(0, K)
    cb = tl.arange(0, BC)

    G_before = tl.zeros((K,), dtype=tl.float32)  # log-decay summed over the blocks before I, and over the chunk
    G_last = tl.zeros((K,), dtype=tl.float32)
    for J in range(NB):  # runtime loops here and below: unrolled, their loads were hoisted and spilled
        tok_J = (chunk_start + J * BC + cb).to(tl.int64)
        m_J = (tok_J < eos)[:, None] & (kk[None, :] < K)
        total = tl.sum(_log_decay_block(g, tok_J, stride_g, h, kk, m_J, A_log, dt_bias, lower_bound, K,
                                        LOWER_BOUND_GATE), axis=0)
        G_last += total
        G_before += tl.where(J < I, total, 0.0)

    tok = (chunk_start + I * BC + cb).to(tl.int64)
    valid = tok < eos
    m_I = valid[:, None] & (kk[None, :] < K)
    q_I = load_f32(q + tok[:, None] * stride_q + h * K + kk[None, :], m_I)
    k_I = load_f32(k + tok[:, None] * stride_k + h * K + kk[None, :], m_I)
    if L2NORM:
        q_I = q_I * (tl.rsqrt(tl.sum(q_I * q_I, axis=1) + 1e-6) * scale)[:, None]
        k_scale = tl.rsqrt(tl.sum(k_I * k_I, axis=1) + 1e-6)
        k_I = k_I * k_scale[:, None]
    else:
        q_I = q_I * scale
        k_scale = tl.zeros((BC,), dtype=tl.float32) + 1.0
    tl.store(k_scale_ws + tok * H + h, k_scale, mask=valid)
    G_I = G_before[None, :] + tl.cumsum(_log_decay_block(g, tok, stride_g, h, kk, m_I, A_log, dt_bias, lower_bound,
                                                         K, LOWER_BOUND_GATE), axis=0)
    bv = _beta_rows(beta, tok, valid, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    row_k = tok[:, None] * (H * K) + h * K + kk[None, :]
    store_as(qg_ws + row_k, q_I * tl.exp(G_I), m_I, EMULATE)
    store_as(kg_ws + row_k, k_I * tl.exp(G_last[None, :] - G_I), m_I, EMULATE)
    tl.store(decay_ws + (slot * H + h) * K + kk, tl.exp(G_last), mask=(kk < K) & (I == 0))

    row_c = tok[:, None] * (H * C) + h * C
    m_row = valid[:, None] & (cb[None, :] < BC)
    G_start_J = tl.zeros((K,), dtype=tl.float32)
    for J in range(I + 1):
        tok_J = (chunk_start + J * BC + cb).to(tl.int64)
        m_J = (tok_J < eos)[:, None] & (kk[None, :] < K)
        k_J = load_f32(k + tok_J[:, None] * stride_k + h * K + kk[None, :], m_J)
        if L2NORM:
            k_J = k_J * tl.rsqrt(tl.sum(k_J * k_J, axis=1) + 1e-6)[:, None]
        a_J = _log_decay_block(g, tok_J, stride_g, h, kk, m_J, A_log, dt_bias, lower_bound, K, LOWER_BOUND_GATE)
        G_J = G_start_J[None, :] + tl.cumsum(a_J, axis=0)
        G_end_J = G_start_J + tl.sum(a_J, axis=0)
        # exp(G_i - G_j) = exp(G_i - G_end(J)) * exp(G_end(J) - G_j); the first factor is <= 1 for J < I and
        # <= e^(15*5) on the diagonal block under the lower-bound gate
        exponent = G_I - G_end_J[None, :]
        if not LOWER_BOUND_GATE:
            exponent = tl.minimum(exponent, 0.0)  # the diagonal block is replaced below
        row_factor = tl.exp(exponent)
        col = tl.trans(k_J * tl.exp(G_end_J[None, :] - G_J))
        m_blk = tl.dot(q_I * row_factor, col, input_precision=DOT_PRECISION)
        l_blk = tl.dot(k_I * row_factor, col, input_precision=DOT_PRECISION)
        if not LOWER_BOUND_GATE:
            if J == I:
                m_blk, l_blk = _diagonal_block_elementwise(q_I, k_I, G_I, BC)
        earlier = J < I
        m_blk = tl.where((cb[:, None] >= cb[None, :]) | earlier, m_blk, 0.0)
        l_blk = tl.where((cb[:, None] > cb[None, :]) | earlier, l_blk * bv[:, None], 0.0)
        store_as(A_ws + row_c + J * BC + cb[None, :], m_blk, m_row, EMULATE)
        tl.store(L_ws + row_c + J * BC + cb[None, :], l_blk, mask=m_row)
        G_start_J = G_end_J
    zeros = tl.zeros((BC, BC), dtype=tl.float32)
    for J in range(I + 1, NB):  # the blocks above the diagonal
        store_as(A_ws + row_c + J * BC + cb[None, :], zeros, m_row, EMULATE)
        tl.store(L_ws + row_c + J * BC + cb[None, :], zeros, mask=m_row)


@triton.jit
def _solve_kernel(
    k, v, g, beta, A_log, dt_bias, cu_seqlens, L_ws, k_scale_ws, w_ws, u_ws,
    stride_k, stride_v, stride_g, stride_beta_tok, stride_beta_head, seq_len, num_seqs, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """Split preparation, step 2: one (chunk, head). ``T = (I + β·L)^-1`` from the scratch, then
    ``w = T·β·kd`` and ``u = T·β·v``."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    r = tl.arange(0, C)
    tok64 = (chunk_start + r).to(tl.int64)
    valid = tok64 < eos
    L = tl.load(L_ws + tok64[:, None] * (H * C) + h * C + r[None, :], mask=valid[:, None] & (r[None, :] < C),
                other=0.0)
    T_inv = _unit_lower_inverse(L, C, BC, DOT_PRECISION)
    k_scale = tl.load(k_scale_ws + tok64 * H + h, mask=valid, other=0.0)
    bv = _beta_rows(beta, tok64, valid, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    _write_w_u(T_inv, k, v, g, tok64, valid, k_scale, bv, stride_k, stride_v, stride_g, h, A_log, dt_bias,
               lower_bound, w_ws, u_ws, H, K, V, BK, LOWER_BOUND_GATE, DOT_PRECISION, EMULATE)


# ---- "blocked" preparation: one program per (chunk, head), each piece of work done once ------------------------
# Rows of the chunk are visited one 16-token block I at a time. Block I's decays are taken relative to its own
# start, G_i = G_start(I) + cs_i (cs: in-block cumulative sum, |cs| <= 16·5), so only per-channel *vectors* carry
# the chunk-level factors: exp(G_i - G_end(J)) = exp(cs_i) · exp(G_start(I) - G_end(J)), both <= 1 for J < I.
# Kept from block to block: colᴶ = k̂·exp(G_end(J) - G) (<= 1, the column operand of M and L, and kg up to a
# per-channel factor), kdᴶ = k̂·exp(G) (the operand of w) and the 16x16 blocks of T = (I + β·L)⁻¹. T is built
# block by block (16x16 inverses of the diagonal blocks, then T_IJ = -T_II·Σ_K L_IK·T_KJ), so every product is a
# 16-row one and nothing of size C x C is formed.


@triton.jit
def _load_rows(q, k, g, beta, A_log, dt_bias, chunk_start, eos, h, I: tl.constexpr,
               stride_q, stride_k, stride_g, stride_beta_tok, stride_beta_head, lower_bound, scale,
               K: tl.constexpr, BC: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr,
               BETA_SIGMOID: tl.constexpr):
    """Tokens, validity, scaled unit q, unit k, log-decay a and β of row block ``I`` (``[BC, K]`` each)."""
    kk = tl.arange(0, K)
    tok = (chunk_start + I * BC + tl.arange(0, BC)).to(tl.int64)
    valid = tok < eos
    m = valid[:, None] & (kk[None, :] < K)
    q_b = load_f32(q + tok[:, None] * stride_q + h * K + kk[None, :], m)
    k_b = load_f32(k + tok[:, None] * stride_k + h * K + kk[None, :], m)
    if L2NORM:
        q_b = q_b * (tl.rsqrt(tl.sum(q_b * q_b, axis=1) + 1e-6) * scale)[:, None]
        k_b = k_b * tl.rsqrt(tl.sum(k_b * k_b, axis=1) + 1e-6)[:, None]
    else:
        q_b = q_b * scale
    a = _log_decay_block(g, tok, stride_g, h, kk, m, A_log, dt_bias, lower_bound, K, LOWER_BOUND_GATE)
    bv = _beta_rows(beta, tok, valid, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    return tok, valid, q_b, k_b, a, bv


@triton.jit
def _store_rows(ptr, tok, valid, h, x, D: tl.constexpr, H: tl.constexpr, EMULATE: tl.constexpr):
    """Store a ``[BC, D]`` block into a ``[tokens, H, D]`` workspace."""
    dd = tl.arange(0, D)
    store_as(ptr + tok[:, None] * (H * D) + h * D + dd[None, :], x, valid[:, None] & (dd[None, :] < D), EMULATE)


@triton.jit
def _store_A_block(A_ws, tok, valid, h, J: tl.constexpr, x, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                   EMULATE: tl.constexpr):
    """Store the ``[BC, BC]`` block of columns ``J`` of M into the A workspace."""
    cb = tl.arange(0, BC)
    store_as(A_ws + tok[:, None] * (H * C) + h * C + J * BC + cb[None, :], x, valid[:, None] & (cb[None, :] < BC),
             EMULATE)


@triton.jit
def _off_diagonal(q_e, k_e, G_start, G_end_J, col_J, bv, DOT_PRECISION: tl.constexpr):
    """Blocks (I, J < I) of M and β·L: ``q̂_i·exp(G_i - G_end(J))`` against ``colᴶ``."""
    d = tl.exp(G_start - G_end_J)[None, :]
    col_t = tl.trans(col_J)
    m = tl.dot(q_e * d, col_t, input_precision=DOT_PRECISION)
    l = tl.dot(k_e * d, col_t, input_precision=DOT_PRECISION)
    return m, l * bv[:, None]


@triton.jit
def _diagonal(q_b, k_b, q_e, k_e, cs, total, col, bv, BC: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """Block (I, I) of M (i >= j) and of β·L (i > j). Lower-bound gate: one product, the row factor
    exp(cs_i - total) <= e^(16·5); unbounded precomputed gate: element-wise, exp(cs_i - cs_j) never split."""
    cb = tl.arange(0, BC)
    if LOWER_BOUND_GATE:
        d = tl.exp(-total)[None, :]
        col_t = tl.trans(col)
        m = tl.dot(q_e * d, col_t, input_precision=DOT_PRECISION)
        l = tl.dot(k_e * d, col_t, input_precision=DOT_PRECISION)
    else:
        m, l = _diagonal_block_elementwise(q_b, k_b, cs, BC)
    m = tl.where(cb[:, None] >= cb[None, :], m, 0.0)
    l = tl.where(cb[:, None] > cb[None, :], l * bv[:, None], 0.0)
    return m, l


@triton.jit
def _unit_lower_inverse_block(L, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(I + L)⁻¹`` for a strictly lower ``[BC, BC]`` L (BC = 16): (I - L)(I + L²)(I + L⁴)(I + L⁸)."""
    cb = tl.arange(0, BC)
    eye = tl.where(cb[:, None] == cb[None, :], 1.0, 0.0)
    power = L
    inverse = eye - L
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision=DOT_PRECISION)
        inverse = tl.dot(inverse, eye + power, input_precision=DOT_PRECISION)
    return inverse


@triton.jit
def _mm(a, b, DOT_PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _blocked_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens,
    w_ws, u_ws, qg_ws, kg_ws, A_ws, decay_ws,
    stride_q, stride_k, stride_v, stride_g, stride_beta_tok, stride_beta_head,
    seq_len, num_seqs, lower_bound, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """One (chunk, head), four 16-token row blocks in order (see the comment above)."""
    tl.static_assert(C == 4 * BC)
    slot = tl.program_id(0)
    h = tl.program_id(1)
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    vv = tl.arange(0, V)
    zeros = tl.zeros((BC, BC), dtype=tl.float32)

    # row block 0
    tok0, ok0, q0, k0, a0, b0 = _load_rows(q, k, g, beta, A_log, dt_bias, chunk_start, eos, h, 0, stride_q, stride_k,
        stride_g, stride_beta_tok, stride_beta_head, lower_bound, scale, K, BC, LOWER_BOUND_GATE, L2NORM,
        BETA_SIGMOID)
    cs = tl.cumsum(a0, axis=0)
    t0 = tl.sum(a0, axis=0)
    e = tl.exp(cs)
    _store_rows(qg_ws, tok0, ok0, h, q0 * e, K, H, EMULATE)
    col0 = k0 * tl.exp(t0[None, :] - cs)
    kd0 = bf16_operand(k0 * e, EMULATE)
    m, l00 = _diagonal(q0, k0, q0 * e, k0 * e, cs, t0, col0, b0, BC, LOWER_BOUND_GATE, DOT_PRECISION)
    _store_A_block(A_ws, tok0, ok0, h, 0, m, H, C, BC, EMULATE)
    for J in tl.static_range(1, 4):
        _store_A_block(A_ws, tok0, ok0, h, J, zeros, H, C, BC, EMULATE)
    T00 = _unit_lower_inverse_block(l00, BC, DOT_PRECISION)
    v0 = tl.load(v + tok0[:, None] * stride_v + h * V + vv[None, :], ok0[:, None] & (vv[None, :] < V), other=0.0)
    _store_rows(w_ws, tok0, ok0, h, _mm(T00 * b0[None, :], kd0.to(tl.float32), DOT_PRECISION), K, H, EMULATE)
    _store_rows(u_ws, tok0, ok0, h, _mm(T00 * b0[None, :], v0.to(tl.float32), DOT_PRECISION), V, H, EMULATE)
    G1 = t0  # log-decay at the end of block 0

    # row block 1
    tok1, ok1, q1, k1, a1, b1 = _load_rows(q, k, g, beta, A_log, dt_bias, chunk_start, eos, h, 1, stride_q, stride_k,
        stride_g, stride_beta_tok, stride_beta_head, lower_bound, scale, K, BC, LOWER_BOUND_GATE, L2NORM,
        BETA_SIGMOID)
    cs = tl.cumsum(a1, axis=0)
    t1 = tl.sum(a1, axis=0)
    e = tl.exp(cs)
    x = tl.exp(G1)[None, :]
    q_e = q1 * e
    k_e = k1 * e
    _store_rows(qg_ws, tok1, ok1, h, q_e * x, K, H, EMULATE)
    col1 = k1 * tl.exp(t1[None, :] - cs)
    kd1 = bf16_operand(k_e * x, EMULATE)
    m, l10 = _off_diagonal(q_e, k_e, G1, G1, col0, b1, DOT_PRECISION)
    _store_A_block(A_ws, tok1, ok1, h, 0, m, H, C, BC, EMULATE)
    m, l11 = _diagonal(q1, k1, q_e, k_e, cs, t1, col1, b1, BC, LOWER_BOUND_GATE, DOT_PRECISION)
    _store_A_block(A_ws, tok1, ok1, h, 1, m, H, C, BC, EMULATE)
    for J in tl.static_range(2, 4):
        _store_A_block(A_ws, tok1, ok1, h, J, zeros, H, C, BC, EMULATE)
    T11 = _unit_lower_inverse_block(l11, BC, DOT_PRECISION)
    T10 = -_mm(T11, _mm(l10, T00, DOT_PRECISION), DOT_PRECISION)
    v1 = tl.load(v + tok1[:, None] * stride_v + h * V + vv[None, :], ok1[:, None] & (vv[None, :] < V), other=0.0)
    w = _mm(T10 * b0[None, :], kd0.to(tl.float32), DOT_PRECISION) + _mm(T11 * b1[None, :], kd1.to(tl.float32), DOT_PRECISION)
    u = _mm(T10 * b0[None, :], v0.to(tl.float32), DOT_PRECISION) + _mm(T11 * b1[None, :], v1.to(tl.float32), DOT_PRECISION)
    _store_rows(w_ws, tok1, ok1, h, w, K, H, EMULATE)
    _store_rows(u_ws, tok1, ok1, h, u, V, H, EMULATE)
    G2 = G1 + t1

    # row block 2
    tok2, ok2, q2, k2, a2, b2 = _load_rows(q, k, g, beta, A_log, dt_bias, chunk_start, eos, h, 2, stride_q, stride_k,
        stride_g, stride_beta_tok, stride_beta_head, lower_bound, scale, K, BC, LOWER_BOUND_GATE, L2NORM,
        BETA_SIGMOID)
    cs = tl.cumsum(a2, axis=0)
    t2 = tl.sum(a2, axis=0)
    e = tl.exp(cs)
    x = tl.exp(G2)[None, :]
    q_e = q2 * e
    k_e = k2 * e
    _store_rows(qg_ws, tok2, ok2, h, q_e * x, K, H, EMULATE)
    col2 = k2 * tl.exp(t2[None, :] - cs)
    kd2 = bf16_operand(k_e * x, EMULATE)
    m, l20 = _off_diagonal(q_e, k_e, G2, G1, col0, b2, DOT_PRECISION)
    _store_A_block(A_ws, tok2, ok2, h, 0, m, H, C, BC, EMULATE)
    m, l21 = _off_diagonal(q_e, k_e, G2, G2, col1, b2, DOT_PRECISION)
    _store_A_block(A_ws, tok2, ok2, h, 1, m, H, C, BC, EMULATE)
    m, l22 = _diagonal(q2, k2, q_e, k_e, cs, t2, col2, b2, BC, LOWER_BOUND_GATE, DOT_PRECISION)
    _store_A_block(A_ws, tok2, ok2, h, 2, m, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok2, ok2, h, 3, zeros, H, C, BC, EMULATE)
    T22 = _unit_lower_inverse_block(l22, BC, DOT_PRECISION)
    T21 = -_mm(T22, _mm(l21, T11, DOT_PRECISION), DOT_PRECISION)
    T20 = -_mm(T22, _mm(l20, T00, DOT_PRECISION) + _mm(l21, T10, DOT_PRECISION), DOT_PRECISION)
    v2 = tl.load(v + tok2[:, None] * stride_v + h * V + vv[None, :], ok2[:, None] & (vv[None, :] < V), other=0.0)
    w = (_mm(T20 * b0[None, :], kd0.to(tl.float32), DOT_PRECISION) + _mm(T21 * b1[None, :], kd1.to(tl.float32), DOT_PRECISION)
         + _mm(T22 * b2[None, :], kd2.to(tl.float32), DOT_PRECISION))
    u = (_mm(T20 * b0[None, :], v0.to(tl.float32), DOT_PRECISION) + _mm(T21 * b1[None, :], v1.to(tl.float32), DOT_PRECISION)
         + _mm(T22 * b2[None, :], v2.to(tl.float32), DOT_PRECISION))
    _store_rows(w_ws, tok2, ok2, h, w, K, H, EMULATE)
    _store_rows(u_ws, tok2, ok2, h, u, V, H, EMULATE)
    G3 = G2 + t2

    # row block 3
    tok3, ok3, q3, k3, a3, b3 = _load_rows(q, k, g, beta, A_log, dt_bias, chunk_start, eos, h, 3, stride_q, stride_k,
        stride_g, stride_beta_tok, stride_beta_head, lower_bound, scale, K, BC, LOWER_BOUND_GATE, L2NORM,
        BETA_SIGMOID)
    cs = tl.cumsum(a3, axis=0)
    t3 = tl.sum(a3, axis=0)
    e = tl.exp(cs)
    x = tl.exp(G3)[None, :]
    q_e = q3 * e
    k_e = k3 * e
    _store_rows(qg_ws, tok3, ok3, h, q_e * x, K, H, EMULATE)
    col3 = k3 * tl.exp(t3[None, :] - cs)
    kd3 = bf16_operand(k_e * x, EMULATE)
    m, l30 = _off_diagonal(q_e, k_e, G3, G1, col0, b3, DOT_PRECISION)
    _store_A_block(A_ws, tok3, ok3, h, 0, m, H, C, BC, EMULATE)
    m, l31 = _off_diagonal(q_e, k_e, G3, G2, col1, b3, DOT_PRECISION)
    _store_A_block(A_ws, tok3, ok3, h, 1, m, H, C, BC, EMULATE)
    m, l32 = _off_diagonal(q_e, k_e, G3, G3, col2, b3, DOT_PRECISION)
    _store_A_block(A_ws, tok3, ok3, h, 2, m, H, C, BC, EMULATE)
    m, l33 = _diagonal(q3, k3, q_e, k_e, cs, t3, col3, b3, BC, LOWER_BOUND_GATE, DOT_PRECISION)
    _store_A_block(A_ws, tok3, ok3, h, 3, m, H, C, BC, EMULATE)
    T33 = _unit_lower_inverse_block(l33, BC, DOT_PRECISION)
    T32 = -_mm(T33, _mm(l32, T22, DOT_PRECISION), DOT_PRECISION)
    T31 = -_mm(T33, _mm(l31, T11, DOT_PRECISION) + _mm(l32, T21, DOT_PRECISION), DOT_PRECISION)
    T30 = -_mm(T33, _mm(l30, T00, DOT_PRECISION) + _mm(l31, T10, DOT_PRECISION) + _mm(l32, T20, DOT_PRECISION),
               DOT_PRECISION)
    v3 = tl.load(v + tok3[:, None] * stride_v + h * V + vv[None, :], ok3[:, None] & (vv[None, :] < V), other=0.0)
    w = (_mm(T30 * b0[None, :], kd0.to(tl.float32), DOT_PRECISION) + _mm(T31 * b1[None, :], kd1.to(tl.float32), DOT_PRECISION)
         + _mm(T32 * b2[None, :], kd2.to(tl.float32), DOT_PRECISION) + _mm(T33 * b3[None, :], kd3.to(tl.float32), DOT_PRECISION))
    u = (_mm(T30 * b0[None, :], v0.to(tl.float32), DOT_PRECISION) + _mm(T31 * b1[None, :], v1.to(tl.float32), DOT_PRECISION)
         + _mm(T32 * b2[None, :], v2.to(tl.float32), DOT_PRECISION) + _mm(T33 * b3[None, :], v3.to(tl.float32), DOT_PRECISION))
    _store_rows(w_ws, tok3, ok3, h, w, K, H, EMULATE)
    _store_rows(u_ws, tok3, ok3, h, u, V, H, EMULATE)
    G_last = G3 + t3

    # kg = k̂·exp(G_last - G) = colᴶ·exp(G_last - G_end(J)), and the chunk decay
    _store_rows(kg_ws, tok0, ok0, h, col0 * tl.exp(G_last - G1)[None, :], K, H, EMULATE)
    _store_rows(kg_ws, tok1, ok1, h, col1 * tl.exp(G_last - G2)[None, :], K, H, EMULATE)
    _store_rows(kg_ws, tok2, ok2, h, col2 * tl.exp(G_last - G3)[None, :], K, H, EMULATE)
    _store_rows(kg_ws, tok3, ok3, h, col3, K, H, EMULATE)
    kk = tl.arange(0, K)
    tl.store(decay_ws + (slot * H + h) * K + kk, tl.exp(G_last))


@triton.jit
def _row_scales(q, k, tok, valid, h, stride_q, stride_k, scale, K: tl.constexpr, L2NORM: tl.constexpr):
    """Per-row scales of a block: ``scale/||q||`` and ``1/||k||`` (or ``scale`` and 1 without the norm)."""
    kk = tl.arange(0, K)
    m = valid[:, None] & (kk[None, :] < K)
    if L2NORM:
        q_b = load_f32(q + tok[:, None] * stride_q + h * K + kk[None, :], m)
        k_b = load_f32(k + tok[:, None] * stride_k + h * K + kk[None, :], m)
        return tl.rsqrt(tl.sum(q_b * q_b, axis=1) + 1e-6) * scale, tl.rsqrt(tl.sum(k_b * k_b, axis=1) + 1e-6)
    else:
        ones = tl.where(valid, 1.0, 1.0)
        return ones * scale, ones


@triton.jit
def _channel_rows(q, k, g, A_log, dt_bias, tok, valid, h, kk, stride_q, stride_k, stride_g, lower_bound, qs, ks,
                  K: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr):
    """Scaled q, k and log-decay of one ``[BC, BK]`` (row block, channel block) tile."""
    m = valid[:, None] & (kk[None, :] < K)
    q_b = load_f32(q + tok[:, None] * stride_q + h * K + kk[None, :], m) * qs[:, None]
    k_b = load_f32(k + tok[:, None] * stride_k + h * K + kk[None, :], m) * ks[:, None]
    a = _log_decay_block(g, tok, stride_g, h, kk, m, A_log, dt_bias, lower_bound, K, LOWER_BOUND_GATE)
    return q_b, k_b, a


@triton.jit
def _store_tile(ptr, tok, valid, h, dd, x, D: tl.constexpr, H: tl.constexpr, EMULATE: tl.constexpr):
    """Store a ``[BC, BD]`` tile (columns ``dd``) into a ``[tokens, H, D]`` workspace."""
    store_as(ptr + tok[:, None] * (H * D) + h * D + dd[None, :], x, valid[:, None] & (dd[None, :] < D), EMULATE)


@triton.jit
def _load_tile(ptr, tok, valid, h, dd, D: tl.constexpr, H: tl.constexpr):
    """Load a ``[BC, BD]`` tile of a ``[tokens, H, D]`` tensor as fp32."""
    return load_f32(ptr + tok[:, None] * (H * D) + h * D + dd[None, :], valid[:, None] & (dd[None, :] < D))


@triton.jit
def _mask_diagonal(m, l, bv, BC: tl.constexpr):
    """Diagonal blocks: M keeps i >= j, β·L keeps i > j."""
    cb = tl.arange(0, BC)
    return tl.where(cb[:, None] >= cb[None, :], m, 0.0), tl.where(cb[:, None] > cb[None, :], l * bv[:, None], 0.0)


@triton.jit
def _diagonal_raw(q_b, k_b, q_e, k_e, cs, total, col, BC: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Block (I, I) of M and L before masking (see ``_diagonal``)."""
    if LOWER_BOUND_GATE:
        d = tl.exp(-total)[None, :]
        col_t = tl.trans(col)
        m = tl.dot(q_e * d, col_t, input_precision=DOT_PRECISION)
        l = tl.dot(k_e * d, col_t, input_precision=DOT_PRECISION)
    else:
        m, l = _diagonal_block_elementwise(q_b, k_b, cs, BC)
    return m, l


@triton.jit
def _pair_raw(q_e, k_e, G_start, G_end_J, col_J, DOT_PRECISION: tl.constexpr):
    """Block (I, J < I) of M and L before β."""
    d = tl.exp(G_start - G_end_J)[None, :]
    col_t = tl.trans(col_J)
    return (tl.dot(q_e * d, col_t, input_precision=DOT_PRECISION),
            tl.dot(k_e * d, col_t, input_precision=DOT_PRECISION))


@triton.jit
def _channel_blocked_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens,
    w_ws, u_ws, qg_ws, kg_ws, A_ws, decay_ws,
    stride_q, stride_k, stride_v, stride_g, stride_beta_tok, stride_beta_head,
    seq_len, num_seqs, lower_bound, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """One (chunk, head), the blocked scheme with ``BK`` key channels at a time: M and L accumulate over
    channel blocks in 16x16 tiles, then T is built, then w (from kd, parked in the w workspace) and u."""
    tl.static_assert(C == 4 * BC)
    slot = tl.program_id(0)
    h = tl.program_id(1)
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    cb = tl.arange(0, BC)
    tok0 = (chunk_start + cb).to(tl.int64)
    tok1 = tok0 + BC
    tok2 = tok0 + 2 * BC
    tok3 = tok0 + 3 * BC
    ok0 = tok0 < eos
    ok1 = tok1 < eos
    ok2 = tok2 < eos
    ok3 = tok3 < eos
    qs0, ks0 = _row_scales(q, k, tok0, ok0, h, stride_q, stride_k, scale, K, L2NORM)
    qs1, ks1 = _row_scales(q, k, tok1, ok1, h, stride_q, stride_k, scale, K, L2NORM)
    qs2, ks2 = _row_scales(q, k, tok2, ok2, h, stride_q, stride_k, scale, K, L2NORM)
    qs3, ks3 = _row_scales(q, k, tok3, ok3, h, stride_q, stride_k, scale, K, L2NORM)

    z = tl.zeros((BC, BC), dtype=tl.float32)
    M00, M10, M11, M20, M21, M22, M30, M31, M32, M33 = z, z, z, z, z, z, z, z, z, z
    L00, L10, L11, L20, L21, L22, L30, L31, L32, L33 = z, z, z, z, z, z, z, z, z, z
    for c in range(K // BK):
        kk = c * BK + tl.arange(0, BK)
        # row block 0
        q_b, k_b, a = _channel_rows(q, k, g, A_log, dt_bias, tok0, ok0, h, kk, stride_q, stride_k, stride_g,
                                    lower_bound, qs0, ks0, K, LOWER_BOUND_GATE)
        cs = tl.cumsum(a, axis=0)
        t0 = tl.sum(a, axis=0)
        e = tl.exp(cs)
        q_e = q_b * e
        k_e = k_b * e
        _store_tile(qg_ws, tok0, ok0, h, kk, q_e, K, H, EMULATE)
        _store_tile(w_ws, tok0, ok0, h, kk, k_e, K, H, EMULATE)  # kd, until w replaces it
        col0 = k_b * tl.exp(t0[None, :] - cs)
        m, l = _diagonal_raw(q_b, k_b, q_e, k_e, cs, t0, col0, BC, LOWER_BOUND_GATE, DOT_PRECISION)
        M00 += m
        L00 += l
        G1 = t0
        # row block 1
        q_b, k_b, a = _channel_rows(q, k, g, A_log, dt_bias, tok1, ok1, h, kk, stride_q, stride_k, stride_g,
                                    lower_bound, qs1, ks1, K, LOWER_BOUND_GATE)
        cs = tl.cumsum(a, axis=0)
        t1 = tl.sum(a, axis=0)
        e = tl.exp(cs)
        q_e = q_b * e
        k_e = k_b * e
        x = tl.exp(G1)[None, :]
        _store_tile(qg_ws, tok1, ok1, h, kk, q_e * x, K, H, EMULATE)
        _store_tile(w_ws, tok1, ok1, h, kk, k_e * x, K, H, EMULATE)
        col1 = k_b * tl.exp(t1[None, :] - cs)
        m, l = _pair_raw(q_e, k_e, G1, G1, col0, DOT_PRECISION)
        M10 += m
        L10 += l
        m, l = _diagonal_raw(q_b, k_b, q_e, k_e, cs, t1, col1, BC, LOWER_BOUND_GATE, DOT_PRECISION)
        M11 += m
        L11 += l
        G2 = G1 + t1
        # row block 2
        q_b, k_b, a = _channel_rows(q, k, g, A_log, dt_bias, tok2, ok2, h, kk, stride_q, stride_k, stride_g,
                                    lower_bound, qs2, ks2, K, LOWER_BOUND_GATE)
        cs = tl.cumsum(a, axis=0)
        t2 = tl.sum(a, axis=0)
        e = tl.exp(cs)
        q_e = q_b * e
        k_e = k_b * e
        x = tl.exp(G2)[None, :]
        _store_tile(qg_ws, tok2, ok2, h, kk, q_e * x, K, H, EMULATE)
        _store_tile(w_ws, tok2, ok2, h, kk, k_e * x, K, H, EMULATE)
        col2 = k_b * tl.exp(t2[None, :] - cs)
        m, l = _pair_raw(q_e, k_e, G2, G1, col0, DOT_PRECISION)
        M20 += m
        L20 += l
        m, l = _pair_raw(q_e, k_e, G2, G2, col1, DOT_PRECISION)
        M21 += m
        L21 += l
        m, l = _diagonal_raw(q_b, k_b, q_e, k_e, cs, t2, col2, BC, LOWER_BOUND_GATE, DOT_PRECISION)
        M22 += m
        L22 += l
        G3 = G2 + t2
        # row block 3
        q_b, k_b, a = _channel_rows(q, k, g, A_log, dt_bias, tok3, ok3, h, kk, stride_q, stride_k, stride_g,
                                    lower_bound, qs3, ks3, K, LOWER_BOUND_GATE)
        cs = tl.cumsum(a, axis=0)
        t3 = tl.sum(a, axis=0)
        e = tl.exp(cs)
        q_e = q_b * e
        k_e = k_b * e
        x = tl.exp(G3)[None, :]
        _store_tile(qg_ws, tok3, ok3, h, kk, q_e * x, K, H, EMULATE)
        _store_tile(w_ws, tok3, ok3, h, kk, k_e * x, K, H, EMULATE)
        col3 = k_b * tl.exp(t3[None, :] - cs)
        m, l = _pair_raw(q_e, k_e, G3, G1, col0, DOT_PRECISION)
        M30 += m
        L30 += l
        m, l = _pair_raw(q_e, k_e, G3, G2, col1, DOT_PRECISION)
        M31 += m
        L31 += l
        m, l = _pair_raw(q_e, k_e, G3, G3, col2, DOT_PRECISION)
        M32 += m
        L32 += l
        m, l = _diagonal_raw(q_b, k_b, q_e, k_e, cs, t3, col3, BC, LOWER_BOUND_GATE, DOT_PRECISION)
        M33 += m
        L33 += l
        G_last = G3 + t3
        # kg = k̂·exp(G_last - G) = colᴶ·exp(G_last - G_end(J)); the chunk decay
        _store_tile(kg_ws, tok0, ok0, h, kk, col0 * tl.exp(G_last - G1)[None, :], K, H, EMULATE)
        _store_tile(kg_ws, tok1, ok1, h, kk, col1 * tl.exp(G_last - G2)[None, :], K, H, EMULATE)
        _store_tile(kg_ws, tok2, ok2, h, kk, col2 * tl.exp(G_last - G3)[None, :], K, H, EMULATE)
        _store_tile(kg_ws, tok3, ok3, h, kk, col3, K, H, EMULATE)
        tl.store(decay_ws + (slot * H + h) * K + kk, tl.exp(G_last))

    b0 = _beta_rows(beta, tok0, ok0, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    b1 = _beta_rows(beta, tok1, ok1, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    b2 = _beta_rows(beta, tok2, ok2, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    b3 = _beta_rows(beta, tok3, ok3, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    M00, L00 = _mask_diagonal(M00, L00, b0, BC)
    M11, L11 = _mask_diagonal(M11, L11, b1, BC)
    M22, L22 = _mask_diagonal(M22, L22, b2, BC)
    M33, L33 = _mask_diagonal(M33, L33, b3, BC)
    _store_A_block(A_ws, tok0, ok0, h, 0, M00, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok0, ok0, h, 1, z, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok0, ok0, h, 2, z, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok0, ok0, h, 3, z, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok1, ok1, h, 0, M10, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok1, ok1, h, 1, M11, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok1, ok1, h, 2, z, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok1, ok1, h, 3, z, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok2, ok2, h, 0, M20, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok2, ok2, h, 1, M21, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok2, ok2, h, 2, M22, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok2, ok2, h, 3, z, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok3, ok3, h, 0, M30, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok3, ok3, h, 1, M31, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok3, ok3, h, 2, M32, H, C, BC, EMULATE)
    _store_A_block(A_ws, tok3, ok3, h, 3, M33, H, C, BC, EMULATE)

    L10 = L10 * b1[:, None]
    L20 = L20 * b2[:, None]
    L21 = L21 * b2[:, None]
    L30 = L30 * b3[:, None]
    L31 = L31 * b3[:, None]
    L32 = L32 * b3[:, None]
    _solve_blocks(L00, L10, L11, L20, L21, L22, L30, L31, L32, L33, b0, b1, b2, b3, v, w_ws, u_ws,
                  tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, h, stride_v, H, K, V, BC, BK, DOT_PRECISION, EMULATE)


@triton.jit
def _solve_blocks(L00, L10, L11, L20, L21, L22, L30, L31, L32, L33, b0, b1, b2, b3, v, w_ws, u_ws,
                  tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, h, stride_v, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  EMULATE: tl.constexpr):
    """From the 16x16 blocks of β·L (diagonal ones strictly lower) and β per block: T = (I + β·L)⁻¹ by blocks
    (inverses of the diagonal blocks, then T_IJ = -T_II·Σ_K L_IK·T_KJ), then w = T·β·kd over the kd parked in
    the w workspace, last row block first (w_I overwrites kd_I, which no later block needs), and u = T·β·v."""
    T00 = _unit_lower_inverse_block(L00, BC, DOT_PRECISION)
    T11 = _unit_lower_inverse_block(L11, BC, DOT_PRECISION)
    T22 = _unit_lower_inverse_block(L22, BC, DOT_PRECISION)
    T33 = _unit_lower_inverse_block(L33, BC, DOT_PRECISION)
    T10 = -_mm(T11, _mm(L10, T00, DOT_PRECISION), DOT_PRECISION)
    T21 = -_mm(T22, _mm(L21, T11, DOT_PRECISION), DOT_PRECISION)
    T32 = -_mm(T33, _mm(L32, T22, DOT_PRECISION), DOT_PRECISION)
    T20 = -_mm(T22, _mm(L20, T00, DOT_PRECISION) + _mm(L21, T10, DOT_PRECISION), DOT_PRECISION)
    T31 = -_mm(T33, _mm(L31, T11, DOT_PRECISION) + _mm(L32, T21, DOT_PRECISION), DOT_PRECISION)
    T30 = -_mm(T33, _mm(L30, T00, DOT_PRECISION) + _mm(L31, T10, DOT_PRECISION) + _mm(L32, T20, DOT_PRECISION),
               DOT_PRECISION)
    T00 = T00 * b0[None, :]
    T10 = T10 * b0[None, :]
    T20 = T20 * b0[None, :]
    T30 = T30 * b0[None, :]
    T11 = T11 * b1[None, :]
    T21 = T21 * b1[None, :]
    T31 = T31 * b1[None, :]
    T22 = T22 * b2[None, :]
    T32 = T32 * b2[None, :]
    T33 = T33 * b3[None, :]

    tl.debug_barrier()  # every thread's kd is in the w workspace before any thread reads it back
    for c in range(K // BK):
        kk = c * BK + tl.arange(0, BK)
        kd0 = _load_tile(w_ws, tok0, ok0, h, kk, K, H)
        kd1 = _load_tile(w_ws, tok1, ok1, h, kk, K, H)
        kd2 = _load_tile(w_ws, tok2, ok2, h, kk, K, H)
        kd3 = _load_tile(w_ws, tok3, ok3, h, kk, K, H)
        tl.debug_barrier()
        _store_tile(w_ws, tok3, ok3, h, kk, _mm(T30, kd0, DOT_PRECISION) + _mm(T31, kd1, DOT_PRECISION)
                    + _mm(T32, kd2, DOT_PRECISION) + _mm(T33, kd3, DOT_PRECISION), K, H, EMULATE)
        _store_tile(w_ws, tok2, ok2, h, kk, _mm(T20, kd0, DOT_PRECISION) + _mm(T21, kd1, DOT_PRECISION)
                    + _mm(T22, kd2, DOT_PRECISION), K, H, EMULATE)
        _store_tile(w_ws, tok1, ok1, h, kk, _mm(T10, kd0, DOT_PRECISION) + _mm(T11, kd1, DOT_PRECISION), K, H,
                    EMULATE)
        _store_tile(w_ws, tok0, ok0, h, kk, _mm(T00, kd0, DOT_PRECISION), K, H, EMULATE)
    for c in range(V // BK):
        vv = c * BK + tl.arange(0, BK)
        v0 = load_f32(v + tok0[:, None] * stride_v + h * V + vv[None, :], ok0[:, None] & (vv[None, :] < V))
        v1 = load_f32(v + tok1[:, None] * stride_v + h * V + vv[None, :], ok1[:, None] & (vv[None, :] < V))
        v2 = load_f32(v + tok2[:, None] * stride_v + h * V + vv[None, :], ok2[:, None] & (vv[None, :] < V))
        v3 = load_f32(v + tok3[:, None] * stride_v + h * V + vv[None, :], ok3[:, None] & (vv[None, :] < V))
        _store_tile(u_ws, tok0, ok0, h, vv, _mm(T00, v0, DOT_PRECISION), V, H, EMULATE)
        _store_tile(u_ws, tok1, ok1, h, vv, _mm(T10, v0, DOT_PRECISION) + _mm(T11, v1, DOT_PRECISION), V, H, EMULATE)
        _store_tile(u_ws, tok2, ok2, h, vv, _mm(T20, v0, DOT_PRECISION) + _mm(T21, v1, DOT_PRECISION)
                    + _mm(T22, v2, DOT_PRECISION), V, H, EMULATE)
        _store_tile(u_ws, tok3, ok3, h, vv, _mm(T30, v0, DOT_PRECISION) + _mm(T31, v1, DOT_PRECISION)
                    + _mm(T32, v2, DOT_PRECISION) + _mm(T33, v3, DOT_PRECISION), V, H, EMULATE)


@triton.jit
def _block_rows(x, J: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
    """Rows of block ``J`` of ``x [NB*BC, D]`` as a ``[BC, D]`` tile."""
    pick = (tl.arange(0, NB) == J)[:, None, None]
    return tl.sum(tl.where(pick, tl.reshape(x, (NB, BC, D)), 0.0), axis=0)


@triton.jit
def _block_row(x, J: tl.constexpr, NB: tl.constexpr):
    """Row ``J`` of a per-block table ``x [NB, D]``."""
    return tl.sum(tl.where((tl.arange(0, NB) == J)[:, None], x, 0.0), axis=0)


@triton.jit
def _diagonal_elementwise(q_b, k_b, cs, NB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """For an unbounded precomputed gate: ``[C, BC]`` tiles whose row i, column jj is the product of row i with
    token jj of i's own block, ``exp(cs_i - cs_j)`` formed element-wise and only for jj <= i."""
    C: tl.constexpr = NB * BC
    local = tl.arange(0, C) % BC
    cb = tl.arange(0, BC)
    m_diag = tl.zeros((C, BC), dtype=tl.float32)
    l_diag = tl.zeros((C, BC), dtype=tl.float32)
    for jj in range(BC):  # a runtime loop: unrolled, compiles took minutes
        pick = (cb == jj)[None, :, None]
        cs_j = _expand_blocks(tl.sum(tl.where(pick, tl.reshape(cs, (NB, BC, BK)), 0.0), axis=1), NB, BC, BK)
        k_j = _expand_blocks(tl.sum(tl.where(pick, tl.reshape(k_b, (NB, BC, BK)), 0.0), axis=1), NB, BC, BK)
        below = (local >= jj)[:, None]
        decay = tl.where(below, tl.exp(tl.where(below, cs - cs_j, 0.0)), 0.0) * k_j
        at = cb[None, :] == jj
        m_diag += tl.where(at, tl.sum(q_b * decay, axis=1)[:, None], 0.0)
        l_diag += tl.where(at, tl.sum(k_b * decay, axis=1)[:, None], 0.0)
    return m_diag, l_diag


@triton.jit
def _column_products(q_b, k_b, E, G_start, G_end, col, J: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Column block J of M and L over all C rows. Row factor exp(G_i - G_end(J)) = E_i · F[blk(i)] with
    F[I] = exp(G_start(I) - G_end(J)) <= 1 for I > J; for I = J, exp(-total_J) <= e^(16·5) under the lower-bound
    gate (the unbounded gate's diagonal blocks are element-wise, ``_diagonal_elementwise``); 0 for I < J."""
    nb = tl.arange(0, NB)[:, None]
    if LOWER_BOUND_GATE:
        rows = nb >= J
    else:
        rows = nb > J
    F = tl.where(rows, tl.exp(tl.where(rows, G_start - _block_row(G_end, J, NB)[None, :], 0.0)), 0.0)
    R = E * _expand_blocks(F, NB, BC, BK)
    col_t = tl.trans(_block_rows(col, J, NB, BC, BK))
    return (tl.dot(q_b * R, col_t, input_precision=DOT_PRECISION),
            tl.dot(k_b * R, col_t, input_precision=DOT_PRECISION))


@triton.jit
def _columns_prepare_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens,
    w_ws, u_ws, qg_ws, kg_ws, A_ws, L_ws, decay_ws,
    stride_q, stride_k, stride_v, stride_g, stride_beta_tok, stride_beta_head,
    seq_len, num_seqs, lower_bound, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """One (chunk, head). Pass 1, ``BK`` key channels at a time over all C rows: gate, in-block cumulative
    decays, qg, kg, kd (parked in the w workspace), and M, L accumulated as four ``[C, BC]`` column blocks.
    Then M goes to the A workspace, β·L to an fp32 scratch, T = (I + β·L)⁻¹ is built from 16x16 blocks, and
    pass 2 forms w = T·β·kd and u = T·β·v."""
    NB: tl.constexpr = C // BC
    tl.static_assert(NB == 4)
    slot = tl.program_id(0)
    h = tl.program_id(1)
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    r = tl.arange(0, C)
    cb = tl.arange(0, BC)
    nb = tl.arange(0, NB)
    blk = r // BC
    tok = (chunk_start + r).to(tl.int64)
    valid = tok < eos
    qs, ks = _row_scales(q, k, tok, valid, h, stride_q, stride_k, scale, K, L2NORM)

    zero = tl.zeros((C, BC), dtype=tl.float32)
    M0, M1, M2, M3, L0, L1, L2, L3 = zero, zero, zero, zero, zero, zero, zero, zero
    for c in range(K // BK):
        kk = c * BK + tl.arange(0, BK)
        m = valid[:, None] & (kk[None, :] < K)
        q_b = load_f32(q + tok[:, None] * stride_q + h * K + kk[None, :], m) * qs[:, None]
        k_b = load_f32(k + tok[:, None] * stride_k + h * K + kk[None, :], m) * ks[:, None]
        a3 = tl.reshape(_log_decay_block(g, tok, stride_g, h, kk, m, A_log, dt_bias, lower_bound, K,
                                         LOWER_BOUND_GATE), (NB, BC, BK))
        cs = tl.reshape(tl.cumsum(a3, axis=1), (C, BK))  # G_i - G_start(blk(i))
        total = tl.sum(a3, axis=1)  # [NB, BK] per-block log-decay
        G_end = tl.cumsum(total, axis=0)
        G_start = G_end - total
        G_last = _block_row(G_end, NB - 1, NB)
        E = tl.exp(cs)  # <= 1
        col = k_b * tl.exp(_expand_blocks(total, NB, BC, BK) - cs)  # k̂_j·exp(G_end(J) - G_j) <= 1
        x = _expand_blocks(tl.exp(G_start), NB, BC, BK)
        row_k = tok[:, None] * (H * K) + h * K + kk[None, :]
        store_as(qg_ws + row_k, q_b * E * x, m, EMULATE)
        store_as(w_ws + row_k, k_b * E * x, m, EMULATE)  # kd, until pass 2 replaces it with w
        store_as(kg_ws + row_k, col * _expand_blocks(tl.exp(G_last[None, :] - G_end), NB, BC, BK), m, EMULATE)
        tl.store(decay_ws + (slot * H + h) * K + kk, tl.exp(G_last))
        m_J, l_J = _column_products(q_b, k_b, E, G_start, G_end, col, 0, NB, BC, BK, LOWER_BOUND_GATE, DOT_PRECISION)
        M0 += m_J
        L0 += l_J
        m_J, l_J = _column_products(q_b, k_b, E, G_start, G_end, col, 1, NB, BC, BK, LOWER_BOUND_GATE, DOT_PRECISION)
        M1 += m_J
        L1 += l_J
        m_J, l_J = _column_products(q_b, k_b, E, G_start, G_end, col, 2, NB, BC, BK, LOWER_BOUND_GATE, DOT_PRECISION)
        M2 += m_J
        L2 += l_J
        m_J, l_J = _column_products(q_b, k_b, E, G_start, G_end, col, 3, NB, BC, BK, LOWER_BOUND_GATE, DOT_PRECISION)
        M3 += m_J
        L3 += l_J
        if not LOWER_BOUND_GATE:
            m_d, l_d = _diagonal_elementwise(q_b, k_b, cs, NB, BC, BK)
            M0 += tl.where((blk == 0)[:, None], m_d, 0.0)
            L0 += tl.where((blk == 0)[:, None], l_d, 0.0)
            M1 += tl.where((blk == 1)[:, None], m_d, 0.0)
            L1 += tl.where((blk == 1)[:, None], l_d, 0.0)
            M2 += tl.where((blk == 2)[:, None], m_d, 0.0)
            L2 += tl.where((blk == 2)[:, None], l_d, 0.0)
            M3 += tl.where((blk == 3)[:, None], m_d, 0.0)
            L3 += tl.where((blk == 3)[:, None], l_d, 0.0)

    bv = _beta_rows(beta, tok, valid, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID)
    _store_column_block(A_ws, L_ws, tok, valid, h, M0, L0, bv, 0, H, C, BC, EMULATE)
    _store_column_block(A_ws, L_ws, tok, valid, h, M1, L1, bv, 1, H, C, BC, EMULATE)
    _store_column_block(A_ws, L_ws, tok, valid, h, M2, L2, bv, 2, H, C, BC, EMULATE)
    _store_column_block(A_ws, L_ws, tok, valid, h, M3, L3, bv, 3, H, C, BC, EMULATE)
    tl.debug_barrier()  # β·L is in the scratch before its 16x16 blocks are read back
    tok0 = (chunk_start + cb).to(tl.int64)
    tok1 = tok0 + BC
    tok2 = tok0 + 2 * BC
    tok3 = tok0 + 3 * BC
    ok0 = tok0 < eos
    ok1 = tok1 < eos
    ok2 = tok2 < eos
    ok3 = tok3 < eos
    _solve_blocks(
        _load_block(L_ws, tok0, ok0, h, 0, H, C, BC), _load_block(L_ws, tok1, ok1, h, 0, H, C, BC),
        _load_block(L_ws, tok1, ok1, h, 1, H, C, BC), _load_block(L_ws, tok2, ok2, h, 0, H, C, BC),
        _load_block(L_ws, tok2, ok2, h, 1, H, C, BC), _load_block(L_ws, tok2, ok2, h, 2, H, C, BC),
        _load_block(L_ws, tok3, ok3, h, 0, H, C, BC), _load_block(L_ws, tok3, ok3, h, 1, H, C, BC),
        _load_block(L_ws, tok3, ok3, h, 2, H, C, BC), _load_block(L_ws, tok3, ok3, h, 3, H, C, BC),
        _beta_rows(beta, tok0, ok0, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID),
        _beta_rows(beta, tok1, ok1, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID),
        _beta_rows(beta, tok2, ok2, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID),
        _beta_rows(beta, tok3, ok3, stride_beta_tok, stride_beta_head, h, BETA_SIGMOID),
        v, w_ws, u_ws, tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, h, stride_v, H, K, V, BC, BK, DOT_PRECISION,
        EMULATE)


@triton.jit
def _store_column_block(A_ws, L_ws, tok, valid, h, M_J, L_J, bv, J: tl.constexpr, H: tl.constexpr,
                        C: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr):
    """Column block J of M (i >= j) to the A workspace and of β·L (i > j) to the fp32 scratch."""
    r = tl.arange(0, C)
    cols = J * BC + tl.arange(0, BC)
    offsets = tok[:, None] * (H * C) + h * C + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < C)
    store_as(A_ws + offsets, tl.where(r[:, None] >= cols[None, :], M_J, 0.0), mask, EMULATE)
    tl.store(L_ws + offsets, tl.where(r[:, None] > cols[None, :], L_J * bv[:, None], 0.0), mask=mask)


@triton.jit
def _load_block(L_ws, tok, valid, h, J: tl.constexpr, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """The 16x16 block (rows ``tok``, column block J) of the β·L scratch."""
    cols = J * BC + tl.arange(0, BC)
    return tl.load(L_ws + tok[:, None] * (H * C) + h * C + cols[None, :], mask=valid[:, None] & (cols[None, :] < C),
                   other=0.0)


@triton.jit
def _recurrence_kernel(
    w_ws, u_ws, qg_ws, kg_ws, A_ws, decay_ws, out, initial_state, final_state, cu_seqlens,
    ckpt_offsets, ckpt_states, stride_out, seq_len, stride_ckpt_n, stride_ckpt_j,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_FINAL: tl.constexpr, NUM_CKPT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    vs = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    bos, eos = _sequence_span(cu_seqlens, n, seq_len, IS_VARLEN)
    slot0 = _first_slot(n, bos, seq_len, C, IS_VARLEN)
    kk = tl.arange(0, K)
    vv = vs * BV + tl.arange(0, BV)
    r = tl.arange(0, C)
    cc = tl.arange(0, C)
    state_offsets = ((n * H + h) * V).to(tl.int64) * K + vv[None, :] * K + kk[:, None]  # S[k, v] = state[v, k]
    if HAS_INITIAL:
        S = tl.load(initial_state + state_offsets).to(tl.float32)
    else:
        S = tl.zeros((K, BV), dtype=tl.float32)
    num_chunks = tl.cdiv(eos - bos, C)
    for c in range(num_chunks):
        for j in tl.static_range(NUM_CKPT):  # prefix-cache checkpoint: the state after c*C tokens
            _store_checkpoint(ckpt_offsets, ckpt_states, n, j, stride_ckpt_n, stride_ckpt_j, c * C, eos - bos, S,
                              state_offsets, H, V, K, EMULATE)
        tok = (bos + c * C + r).to(tl.int64)
        valid = tok < eos
        m_k = valid[:, None] & (kk[None, :] < K)
        m_v = valid[:, None] & (vv[None, :] < V)
        row_k = tok[:, None] * (H * K) + h * K + kk[None, :]
        w = tl.load(w_ws + row_k, mask=m_k, other=0.0)
        qg = tl.load(qg_ws + row_k, mask=m_k, other=0.0)
        kg = tl.load(kg_ws + row_k, mask=m_k, other=0.0)
        u = load_f32(u_ws + tok[:, None] * (H * V) + h * V + vv[None, :], m_v)
        A = tl.load(A_ws + tok[:, None] * (H * C) + h * C + cc[None, :], mask=valid[:, None] & (cc[None, :] < C),
                    other=0.0)
        chunk_decay = tl.load(decay_ws + ((slot0 + c) * H + h) * K + kk)
        S_op = bf16_operand(S, EMULATE)
        v_new = u - tl.dot(bf16_operand(w, EMULATE), S_op)
        v_op = bf16_operand(v_new, EMULATE)
        o = tl.dot(bf16_operand(qg, EMULATE), S_op) + tl.dot(bf16_operand(A, EMULATE), v_op)
        store_as(out + tok[:, None] * stride_out + h * V + vv[None, :], o, m_v, EMULATE)
        S = S * chunk_decay[:, None] + tl.dot(tl.trans(bf16_operand(kg, EMULATE)), v_op)
    for j in tl.static_range(NUM_CKPT):
        _store_checkpoint(ckpt_offsets, ckpt_states, n, j, stride_ckpt_n, stride_ckpt_j, num_chunks * C, eos - bos, S,
                          state_offsets, H, V, K, EMULATE)
    if HAS_FINAL:
        store_as(final_state + state_offsets, S, None, EMULATE)


@triton.jit
def _store_checkpoint(ckpt_offsets, ckpt_states, n, j, stride_n, stride_j, done, length, S, state_offsets,
                      H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, EMULATE: tl.constexpr):
    """Write ``S`` (the state after ``done`` tokens) to checkpoint ``j`` of sequence ``n`` if its offset is
    ``done`` and inside the sequence. ``state_offsets`` address ``[n, h, v, k]`` of an ``[N, H, V, K]``
    tensor; checkpoints are ``[N, 2, H, V, K]``."""
    offset = tl.load(ckpt_offsets + n * stride_n + j * stride_j).to(tl.int32)
    if (offset == done) & (offset <= length):
        per_seq = H * V * K
        target = n.to(tl.int64) * (2 * per_seq) + j * per_seq + (state_offsets - n.to(tl.int64) * per_seq)
        store_as(ckpt_states + target, S, None, EMULATE)


def num_slots(batch, seq_len, num_seqs, varlen):
    """Chunk slots the workspace holds (see the module docstring)."""
    if varlen:
        return batch * seq_len // CHUNK + num_seqs + 1
    return batch * triton.cdiv(seq_len, CHUNK)


@dataclass
class Workspace:
    """What the preparation kernel writes for the recurrence (bf16 per token, fp32 decay per chunk slot)."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    A: torch.Tensor
    decay: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    seq_len: int
    num_seqs: int


def prepare(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, cu_seqlens, use_qk_l2norm, use_beta_sigmoid,
            dot_precision="tf32"):
    """Run the preparation kernel on validated inputs (``q, k, g [B, T, H, K]``, ``v [B, T, H, V]`` with
    ``[H, K]`` contiguous per token, ``beta [B, T, H]`` any strides) and return its :class:`Workspace`."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    varlen = cu_seqlens is not None
    num_seqs = cu_seqlens.numel() - 1 if varlen else batch
    tokens = batch * seq_len
    slots = num_slots(batch, seq_len, num_seqs, varlen)
    bf16 = dict(dtype=torch.bfloat16, device=q.device)
    ws = Workspace(w=torch.empty(tokens, heads, key_dim, **bf16), u=torch.empty(tokens, heads, value_dim, **bf16),
                   qg=torch.empty(tokens, heads, key_dim, **bf16), kg=torch.empty(tokens, heads, key_dim, **bf16),
                   A=torch.empty(tokens, heads, CHUNK, **bf16),
                   decay=torch.empty(slots, heads, key_dim, dtype=torch.float32, device=q.device),
                   cu_seqlens=cu_seqlens, seq_len=seq_len, num_seqs=num_seqs)
    lower_bound_gate = lower_bound is not None
    absent = ws.decay  # stands for absent optional tensors; never dereferenced
    gate = (A_log if lower_bound_gate else absent, dt_bias if lower_bound_gate else absent)
    cu = cu_seqlens if varlen else absent
    flags = dict(IS_VARLEN=varlen, LOWER_BOUND_GATE=lower_bound_gate, BETA_SIGMOID=use_beta_sigmoid,
                 DOT_PRECISION=dot_precision, EMULATE=interpreting())
    bound = float(lower_bound) if lower_bound_gate else 0.0
    if slots == 0:
        return ws
    if PREPARE_PATH == "split":
        L_ws = torch.empty(tokens, heads, CHUNK, dtype=torch.float32, device=q.device)
        k_scale_ws = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
        _intra_kernel[(slots, heads, CHUNK // BLOCK)](
            q, k, g, beta, *gate, cu, ws.qg, ws.kg, ws.A, L_ws, k_scale_ws, ws.decay,
            q.stride(1), k.stride(1), g.stride(1), beta.stride(1), beta.stride(2),
            seq_len, num_seqs, bound, float(scale),
            H=heads, K=key_dim, C=CHUNK, BC=BLOCK, L2NORM=use_qk_l2norm, **flags, num_warps=INTRA_WARPS,
        )
        _solve_kernel[(slots, heads)](
            k, v, g, beta, *gate, cu, L_ws, k_scale_ws, ws.w, ws.u,
            k.stride(1), v.stride(1), g.stride(1), beta.stride(1), beta.stride(2), seq_len, num_seqs, bound,
            H=heads, K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, BK=SOLVE_CHANNEL_BLOCK, **flags,
            num_warps=SOLVE_WARPS,
        )
    elif PREPARE_PATH == "columns":
        L_ws = torch.empty(tokens, heads, CHUNK, dtype=torch.float32, device=q.device)
        _columns_prepare_kernel[(slots, heads)](
            q, k, v, g, beta, *gate, cu, ws.w, ws.u, ws.qg, ws.kg, ws.A, L_ws, ws.decay,
            q.stride(1), k.stride(1), v.stride(1), g.stride(1), beta.stride(1), beta.stride(2),
            seq_len, num_seqs, bound, float(scale),
            H=heads, K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, BK=COLUMNS_CHANNELS, L2NORM=use_qk_l2norm, **flags,
            num_warps=COLUMNS_WARPS, **({} if COLUMNS_CHANNELS_MAXNREG is None else dict(maxnreg=COLUMNS_CHANNELS_MAXNREG)),
        )
    elif PREPARE_PATH == "blocked_channels":
        _channel_blocked_prepare_kernel[(slots, heads)](
            q, k, v, g, beta, *gate, cu, ws.w, ws.u, ws.qg, ws.kg, ws.A, ws.decay,
            q.stride(1), k.stride(1), v.stride(1), g.stride(1), beta.stride(1), beta.stride(2),
            seq_len, num_seqs, bound, float(scale),
            H=heads, K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, BK=BLOCKED_CHANNELS, L2NORM=use_qk_l2norm, **flags,
            num_warps=BLOCKED_WARPS,
        )
    elif PREPARE_PATH == "blocked":
        _blocked_prepare_kernel[(slots, heads)](
            q, k, v, g, beta, *gate, cu, ws.w, ws.u, ws.qg, ws.kg, ws.A, ws.decay,
            q.stride(1), k.stride(1), v.stride(1), g.stride(1), beta.stride(1), beta.stride(2),
            seq_len, num_seqs, bound, float(scale),
            H=heads, K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, L2NORM=use_qk_l2norm, **flags,
            num_warps=BLOCKED_WARPS,
        )
    else:
        _prepare_kernel[(slots, heads)](
            q, k, v, g, beta, *gate, cu, ws.w, ws.u, ws.qg, ws.kg, ws.A, ws.decay,
            q.stride(1), k.stride(1), v.stride(1), g.stride(1), beta.stride(1), beta.stride(2),
            seq_len, num_seqs, bound, float(scale),
            H=heads, K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, BK=CHANNEL_BLOCK, L2NORM=use_qk_l2norm, **flags,
            num_warps=PREPARE_WARPS,
        )
    return ws


def recur(ws, *, initial_state, final_state, out, v_slices, checkpoint_offsets=None, checkpoint_states=None):
    """Run the recurrence over a :class:`Workspace` with ``v_slices`` programs per (sequence, head);
    writes ``out [B, T, H, V]`` (contiguous), ``final_state [N, H, V, K]`` and the prefix-cache checkpoints
    ``checkpoint_states [N, 2, H, V, K]`` at ``checkpoint_offsets [N]`` or ``[N, 2]`` (if given) in place."""
    if ws.num_seqs == 0:
        return
    tokens, heads, key_dim = ws.w.shape
    value_dim = ws.u.shape[-1]
    absent = ws.decay
    checkpoints = 0 if checkpoint_offsets is None else (1 if checkpoint_offsets.dim() == 1 else checkpoint_offsets.shape[1])
    _recurrence_kernel[(v_slices, heads, ws.num_seqs)](
        ws.w, ws.u, ws.qg, ws.kg, ws.A, ws.decay, out,
        initial_state if initial_state is not None else absent,
        final_state if final_state is not None else absent,
        ws.cu_seqlens if ws.cu_seqlens is not None else absent,
        checkpoint_offsets if checkpoints else absent, checkpoint_states if checkpoints else absent,
        out.stride(1), ws.seq_len,
        checkpoint_offsets.stride(0) if checkpoints else 0, checkpoint_offsets.stride(-1) if checkpoints else 0,
        H=heads, K=key_dim, V=value_dim, BV=value_dim // v_slices, C=CHUNK,
        IS_VARLEN=ws.cu_seqlens is not None, HAS_INITIAL=initial_state is not None,
        HAS_FINAL=final_state is not None, NUM_CKPT=checkpoints, EMULATE=interpreting(), num_warps=4,
        num_stages=2,
    )


def chunk_kda_forward(
    q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens,
    use_qk_l2norm, use_beta_sigmoid, v_slices, out, final_state, checkpoint_offsets=None, checkpoint_states=None,
    dot_precision="tf32",
):
    """Both kernels on validated inputs: :func:`prepare`, then :func:`recur`."""
    ws = prepare(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                 cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
                 dot_precision=dot_precision)
    recur(ws, initial_state=initial_state, final_state=final_state, out=out, v_slices=v_slices,
          checkpoint_offsets=checkpoint_offsets, checkpoint_states=checkpoint_states)

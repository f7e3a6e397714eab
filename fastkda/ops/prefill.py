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
PREPARE_PATH = "split"
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

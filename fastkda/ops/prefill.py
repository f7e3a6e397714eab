"""Chunked KDA prefill on the GPU: token-parallel preparation kernels and a serial recurrence kernel.

Spec §2 in the WY form, chunk ``C`` = 32 tokens (``plan.CHUNK``) split into two 16-token blocks:

* Preparation computes everything that does not depend on the state: gate, in-chunk cumulative decay ``G``,
  normalised q/k, the in-chunk matrices ``M = lower_incl(qd·kiᵀ)`` and ``L = strictly_lower(β·kd·kiᵀ)`` and
  ``T = (I + L)⁻¹``, and writes the bf16 workspace ``w = T·β·kd``, ``u = T·β·v``, ``qg = qd``, ``kg = kr``,
  ``A = M`` and the fp32 chunk decay ``exp(G_C)``, in two kernels per (chunk, head): ``_prepare_kernel``
  (4 warps; everything but T, β·L to an fp32 scratch) and ``_solve_kernel`` (4 warps; T by 16x16 blocks, then w
  and u, or, when the plan says so, T·diag(β) for the recurrence to form w and u:
  ``fastkda.plan.w_u_in_recurrence``). Decays are base-2 (``a·log2 e``). No factor spans more than 16 tokens of
  decay, so nothing overflows: under the lower-bound gate every factor is referred to the decay at the middle of
  the chunk (``_midpoint_products``, within 2^±116) and M and β·L are one ``[C, C]`` product each; under a
  precomputed gate they are built as two 16-column blocks, off-diagonal blocks from
  ``exp(G_i - G_end(J))·exp(G_end(J) - G_j)`` (both ≤ 1) and diagonal blocks from element-wise decays.
* ``_recurrence_kernel`` (one program per (sequence, head, V-slice)) walks the chunks in order with the
  state in fp32 registers: ``v_new = u - w·S``, ``o = qg·S + A·v_new``, ``S = diag(exp(G_C))·S + kgᵀ·v_new``
  (slices from 64 columns wide compute the same products transposed, ``state_rows_v``), and writes prefix-cache
  checkpoints at chunk boundaries. No step reduces over V, and every slice adds the same products over K in the
  same order, so results are bitwise identical for any number of V-slices.

Chunks are numbered by *slot*: sequence ``n`` owns slots from ``cu[n] // C + n`` (varlen) or
``n · ceil(T / C)`` (fixed length), a layout both kernels derive from host-known values, with no
host-device synchronisation.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..plan import CHUNK, w_u_in_recurrence  # CHUNK: tokens per chunk (one serial step of the recurrence)
from ..reference import LOG_DECAY_FLOOR as _FLOOR
from .common import bf16_operand, fast_exp2, fast_reciprocal, interpreting, launch, load_f32, store_as

BLOCK = 16  # tokens per block inside a chunk (the range over which exp(-G) factors are formed)
PREPARE_CHANNELS = 32  # key channels per step of the first kernel under the precomputed gate (H200: 32 beat
# 16; 64 see PREPARE_STAGES); the lower-bound gate takes every channel in one step (prepare_channels)
PREPARE_WARPS = 4  # with 32-token chunks: two programs per SM (docs/perf-notes.md, session 6)
SOLVE_CHANNELS = 128  # channels per step of _solve_kernel's w and u pass (H200: one step on 4 warps beat 16
SOLVE_WARPS = 4  # channels on 2 warps, 0.93 -> 0.64 ms at H96 B1 T8192; 32 on 2 warps 0.76; 64 on 4 warps 0.74)
RECURRENCE_WARPS = 4  # per program, but 8 for slices of WIDE_SLICE columns (recurrence_warps)
WIDE_SLICE = 128
RECURRENCE_STAGES = 3  # the next chunks' workspace loads overlap the current step (H200, 64-token chunks at four
# slices: 0.501 ms whole call at H12 N1 T8192 against 0.585 at 2). The depth changes when loads are issued, never
# the arithmetic, so results stay bitwise identical across slice counts; 32-token chunks fit 3 stages at every width
PREPARE_MAXNREG = None  # a register cap for _prepare_kernel (Triton's maxnreg); H200: every cap was slower
PREPARE_STAGES = 3  # pipelining depth of its channel loop (num_stages). 1 stage at 64 channels was 5% faster
# but an exactness-matrix run with it hit an illegal memory access (84a3ad0, docs/perf-notes.md): not used
SOLVE_STAGES = 3
LOG_DECAY_FLOOR: tl.constexpr = tl.constexpr(_FLOOR)  # precomputed gates are clamped here (reference.py)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


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
def _beta_rows(beta_c, rows, valid, stride_tok, BETA_SIGMOID: tl.constexpr):
    """β of the chunk's ``rows`` (``beta_c`` points at its first token and head; σ applied unless the caller
    did), zero outside ``valid``."""
    bv = load_f32(beta_c + rows * stride_tok, valid)
    if BETA_SIGMOID:
        bv = tl.sigmoid(bv)
    return tl.where(valid, bv, 0.0)


@triton.jit
def _log2_decay_block(g_c, rows, valid, stride_g, h, kk, A_log, dt_bias, lower_bound,
                      K: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, EMULATE: tl.constexpr):
    """Log-decay of one ``[C, BK]`` block of key channels **in base 2** (``a·log2(e)``, so every decay factor
    is one ``ex2``), zero outside the ``valid`` rows (``g_c`` points at the chunk's first token and head)."""
    gv = load_f32(g_c + rows[:, None] * stride_g + kk[None, :], valid[:, None])
    if LOWER_BOUND_GATE:  # λ·σ(e^A_log·(g + b)) = λ / (1 + 2^(-e^A_log·log2(e)·(g + b)))
        slope = tl.exp(tl.load(A_log + h).to(tl.float32)) * LOG2E
        bias = tl.load(dt_bias + h * K + kk).to(tl.float32)
        a = (lower_bound * LOG2E) * fast_reciprocal(1.0 + fast_exp2(-slope * (gv + bias[None, :]), EMULATE), EMULATE)
    else:  # floor: exp(-30) leaves 1e-13 of the state, below fp32 resolution; keeps G's ulp small
        a = tl.maximum(gv, LOG_DECAY_FLOOR) * LOG2E
    return tl.where(valid[:, None], a, 0.0)


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
def _row_scales(q_t, k_t, valid, scale, L2NORM: tl.constexpr):
    """Per-row scales ``scale/||q||`` and ``1/||k||`` (or ``scale`` and 1 without the norm) of whole ``[C, K]``
    tiles, loaded in one phase (summing over a loop of channel blocks instead cost 2.75 ms at H96 B1 T8192, each
    block a dependent round trip to memory)."""
    if L2NORM:
        return tl.rsqrt(tl.sum(q_t * q_t, axis=1) + 1e-6) * scale, tl.rsqrt(tl.sum(k_t * k_t, axis=1) + 1e-6)
    else:
        ones = tl.where(valid, 1.0, 1.0)  # the tiles go unused (and unloaded) unless one step takes them
        return ones * scale, ones


@triton.jit
def _store_tile(ptr_c, rows, valid, dd, x, D: tl.constexpr, stride, EMULATE: tl.constexpr):
    """Store a ``[BC, BD]`` tile (columns ``dd`` of ``rows``) through a chunk's base pointer ``ptr_c``."""
    store_as(ptr_c + rows[:, None] * stride + dd[None, :], x, valid[:, None] & (dd[None, :] < D), EMULATE)


@triton.jit
def _load_tile(ptr_c, rows, valid, dd, D: tl.constexpr, stride):
    """Load a ``[BC, BD]`` tile (columns ``dd`` of ``rows``) through a chunk's base pointer ``ptr_c``, as fp32."""
    return load_f32(ptr_c + rows[:, None] * stride + dd[None, :], valid[:, None] & (dd[None, :] < D))


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
def _diagonal_elementwise(q_b, k_b, cs, NB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                          EMULATE: tl.constexpr):
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
        decay = tl.where(below, fast_exp2(tl.where(below, cs - cs_j, 0.0), EMULATE), 0.0) * k_j
        at = cb[None, :] == jj
        m_diag += tl.where(at, tl.sum(q_b * decay, axis=1)[:, None], 0.0)
        l_diag += tl.where(at, tl.sum(k_b * decay, axis=1)[:, None], 0.0)
    return m_diag, l_diag


@triton.jit
def _column_products(q_b, k_b, E, G_start, G_end, col, J: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """Column block J of M and L over all C rows under a precomputed gate, but for the diagonal block (element-wise,
    ``_diagonal_elementwise``). Row factor exp(G_i - G_end(J)) = E_i · F[blk(i)] with F[I] = exp(G_start(I) -
    G_end(J)) <= 1 for I > J, 0 for I <= J."""
    rows = tl.arange(0, NB)[:, None] > J
    F = tl.where(rows, fast_exp2(tl.where(rows, G_start - _block_row(G_end, J, NB)[None, :], 0.0), EMULATE), 0.0)
    R = E * _expand_blocks(F, NB, BC, BK)
    col_t = tl.trans(_block_rows(col, J, NB, BC, BK))
    # M from tf32 operands (bf16 ones cost the output 3.1e-3 -> 3.7e-3 of relative error); L from bf16 ones, which
    # moved nothing measurable (its inverse meets bf16 k and v anyway) and took 4% off the call (docs/perf-notes.md)
    return (tl.dot(q_b * R, col_t, input_precision=DOT_PRECISION),
            tl.dot(bf16_operand(k_b * R, EMULATE), bf16_operand(col_t, EMULATE)))


@triton.jit
def _workspace(ws_bf16, ws_fp32, rows, total_slots, H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """Pointers to the workspace's sections (:class:`Workspace`): bf16 ``w``, ``qg``, ``kg`` ``[rows, K]``, ``u``
    ``[rows, V]``, ``A`` ``[rows, C]``; fp32 ``decay`` ``[total_slots, H, K]`` and the β·L scratch ``[rows, C]``
    (``rows`` = tokens·H, each token's heads back to back)."""
    n = tl.cast(rows, tl.int64)  # a cast, not .to(): Triton passes an argument equal to 1 as a plain int
    qg = ws_bf16 + n * K
    kg = qg + n * K
    u = kg + n * K
    return ws_bf16, qg, kg, u, u + n * V, ws_fp32, ws_fp32 + tl.cast(total_slots, tl.int64) * (H * K)


@triton.jit(do_not_specialize=["H"])  # one compile for every head count
def _prepare_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens, ws_bf16, ws_fp32,
    stride_q, stride_k, stride_g, stride_beta_tok, stride_beta_head,
    seq_len, num_seqs, rows, total_slots, lower_bound, scale,
    H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    RUN: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """Preparation, first kernel, one (chunk, head): norms, gate, cumulative decays, qg, kg, kd (parked in the w
    workspace until ``_solve_kernel`` replaces it with w), M to the A workspace and β·L to an fp32 scratch. Under
    the lower-bound gate all K channels at once (``_midpoint_products``); under a precomputed gate ``BK`` channels
    at a time, M and L accumulated as ``C / BC`` ``[C, BC]`` column blocks."""
    NB: tl.constexpr = C // BC
    tl.static_assert(NB == 2)
    slot = tl.program_id(0)
    h = tl.program_id(1)
    w_ws, qg_ws, kg_ws, _, A_ws, decay_ws, L_ws = _workspace(ws_bf16, ws_fp32, rows, total_slots, H, K, V, C)
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    if LOWER_BOUND_GATE:  # row i holds token r[i]: each thread's rows are RUN consecutive tokens (token_run)
        r = (tl.arange(0, C) % (C // RUN)) * RUN + tl.arange(0, C) // (C // RUN)
    else:
        r = tl.arange(0, C)
    valid = r < eos - chunk_start
    # 64-bit base pointers per program, 32-bit offsets inside the chunk (fewer registers than 64-bit tiles)
    row0 = chunk_start.to(tl.int64)
    q_c = q + row0 * stride_q + h * K
    k_c = k + row0 * stride_k + h * K
    g_c = g + row0 * stride_g + h * K
    qg_c = qg_ws + row0 * (H * K) + h * K  # the chunk's first row in the [tokens, H, K] workspaces
    kd_c = w_ws + row0 * (H * K) + h * K
    kg_c = kg_ws + row0 * (H * K) + h * K
    kall = tl.arange(0, K)
    q_t = load_f32(q_c + r[:, None] * stride_q + kall[None, :], valid[:, None])  # whole rows, for the norms
    k_t = load_f32(k_c + r[:, None] * stride_k + kall[None, :], valid[:, None])
    qs, ks = _row_scales(q_t, k_t, valid, scale, L2NORM)

    bv = _beta_rows(beta + row0 * stride_beta_tok + h * stride_beta_head, r, valid, stride_beta_tok, BETA_SIGMOID)
    A_c = A_ws + row0 * (H * C) + h * C  # the chunk's first row in the [tokens, H, C] A and β·L workspaces
    L_c = L_ws + row0 * (H * C) + h * C
    if LOWER_BOUND_GATE:
        _midpoint_products(q_t * qs[:, None], k_t * ks[:, None], g_c, r, valid, stride_g, h, kall, A_log, dt_bias,
                           lower_bound, bv, qg_c, kd_c, kg_c, A_c, L_c, decay_ws + (slot * H + h) * K, H, K, C, BC,
                           RUN, DOT_PRECISION, EMULATE)
    else:
        zero = tl.zeros((C, BC), dtype=tl.float32)
        M0, M1, L0, L1 = zero, zero, zero, zero
        blk = r // BC
        for c in range(K // BK):
            kk = c * BK + tl.arange(0, BK)
            m = valid[:, None]
            q_b = load_f32(q_c + r[:, None] * stride_q + kk[None, :], m) * qs[:, None]
            k_b = load_f32(k_c + r[:, None] * stride_k + kk[None, :], m) * ks[:, None]
            a3 = tl.reshape(_log2_decay_block(g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, K,
                                              False, EMULATE), (NB, BC, BK))
            cs = tl.reshape(tl.cumsum(a3, axis=1), (C, BK))  # G_i - G_start(blk(i))
            total = tl.sum(a3, axis=1)  # [NB, BK] per-block log-decay
            G_end = tl.cumsum(total, axis=0)
            G_start = G_end - total
            G_last = _block_row(G_end, NB - 1, NB)
            E = fast_exp2(cs, EMULATE)  # <= 1
            col = k_b * fast_exp2(_expand_blocks(total, NB, BC, BK) - cs, EMULATE)  # k̂_j·exp(G_end(J) - G_j) <= 1
            x = _expand_blocks(fast_exp2(G_start, EMULATE), NB, BC, BK)
            row_k = r[:, None] * (H * K) + kk[None, :]
            store_as(qg_c + row_k, q_b * E * x, m, EMULATE)
            store_as(kd_c + row_k, k_b * E * x, m, EMULATE)  # kd, until _solve_kernel replaces it with w
            store_as(kg_c + row_k, col * _expand_blocks(fast_exp2(G_last[None, :] - G_end, EMULATE), NB, BC, BK),
                     m, EMULATE)
            tl.store(decay_ws + (slot * H + h) * K + kk, fast_exp2(G_last, EMULATE))
            m_J, l_J = _column_products(q_b, k_b, E, G_start, G_end, col, 0, NB, BC, BK, DOT_PRECISION, EMULATE)
            M0 += m_J
            L0 += l_J
            m_J, l_J = _column_products(q_b, k_b, E, G_start, G_end, col, 1, NB, BC, BK, DOT_PRECISION, EMULATE)
            M1 += m_J
            L1 += l_J
            m_d, l_d = _diagonal_elementwise(q_b, k_b, cs, NB, BC, BK, EMULATE)
            M0 += tl.where((blk == 0)[:, None], m_d, 0.0)
            L0 += tl.where((blk == 0)[:, None], l_d, 0.0)
            M1 += tl.where((blk == 1)[:, None], m_d, 0.0)
            L1 += tl.where((blk == 1)[:, None], l_d, 0.0)
        _store_column_block(A_c, L_c, valid, M0, L0, bv, 0, H, C, BC, EMULATE)
        _store_column_block(A_c, L_c, valid, M1, L1, bv, 1, H, C, BC, EMULATE)


@triton.jit
def _columns_in_token_order(x, C: tl.constexpr, RUN: tl.constexpr):
    """A ``[C, C]`` tile whose column i holds token r[i] (``_prepare_kernel``) with its columns in token order (a
    layout conversion, so that the store is row-contiguous)."""
    return tl.reshape(tl.permute(tl.reshape(x, (C, RUN, C // RUN)), (0, 2, 1)), (C, C))


@triton.jit
def _midpoint_products(q_b, k_b, g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, bv, qg_c, kd_c, kg_c,
                       A_c, L_c, decay_c, H, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, RUN: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """The first kernel's work under the lower-bound gate, from a chunk's normalised ``[C, K]`` q and k rows (row
    i holding token ``r[i]``). Every decay is referred to G_mid, the cumulative log-decay through token BC - 1, so
    that M = lower_incl((q̂·2^(G - G_mid))·(k̂·2^(G_mid - G))ᵀ) and β·L are one ``[C, C]`` product each. A factor
    spans at most BC tokens of decay, 2^±(16·5·log2 e) = 2^±116 for λ >= -5, inside fp32's range; a product of
    two overflows only above the diagonal, which is discarded. qg, kd and kg are the same factors times
    per-channel decays. The cumulative sum runs over each thread's RUN consecutive tokens, then over the C / RUN
    run totals, the only part that crosses threads (a scan over all C rows crosses warps through shared memory),
    the products take K in two halves, and M and β·L get their columns back in token order before they are stored
    (stored as they come, each element was a 2-byte store to a scattered address: L2 69% busy, the kernel 0.86 ->
    1.12 ms). H200, H96 B1 T8192, whole call: 1.520 ms with the two column blocks, 1.431 with one reference point,
    1.386 with all of the above (docs/perf-notes.md, session 8)."""
    RUNS: tl.constexpr = C // RUN
    a = tl.reshape(_log2_decay_block(g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, K, True, EMULATE),
                   (RUN, RUNS, K))  # [j, s]: token s·RUN + j
    run_total = tl.sum(a, axis=0)
    G = tl.reshape(tl.cumsum(a, axis=0) + (tl.cumsum(run_total, axis=0) - run_total)[None, :, :], (C, K))
    G_mid = tl.sum(tl.where((tl.arange(0, RUNS) < BC // RUN)[:, None], run_total, 0.0), axis=0)
    G_last = tl.sum(run_total, axis=0)
    up = fast_exp2(G - G_mid[None, :], EMULATE)
    q_up = q_b * up
    k_up = k_b * up
    k_down = k_b * fast_exp2(G_mid[None, :] - G, EMULATE)
    at_mid = fast_exp2(G_mid, EMULATE)[None, :]
    row_k = r[:, None] * (H * K) + kk[None, :]
    m = valid[:, None]
    store_as(qg_c + row_k, q_up * at_mid, m, EMULATE)
    store_as(kd_c + row_k, k_up * at_mid, m, EMULATE)  # kd, until _solve_kernel replaces it with w
    store_as(kg_c + row_k, k_down * fast_exp2(G_last - G_mid, EMULATE)[None, :], m, EMULATE)
    tl.store(decay_c + kk, fast_exp2(G_last, EMULATE))
    q_even, q_odd = tl.split(tl.reshape(q_up, (C, K // 2, 2)))
    k_even, k_odd = tl.split(tl.reshape(k_up, (C, K // 2, 2)))
    down_even, down_odd = tl.split(tl.reshape(k_down, (C, K // 2, 2)))
    # M from tf32 operands (bf16 ones cost the output 3.1e-3 -> 3.7e-3 of relative error); L from bf16 ones, which
    # moved nothing measurable (its inverse meets bf16 k and v anyway) and took 4% off the call (docs/perf-notes.md).
    # Both products of one half before the other's: M, M, L, L kept every operand alive (240 registers)
    M = tl.dot(q_even, tl.trans(down_even), input_precision=DOT_PRECISION)
    L = tl.dot(bf16_operand(k_even, EMULATE), bf16_operand(tl.trans(down_even), EMULATE))
    M = tl.dot(q_odd, tl.trans(down_odd), M, input_precision=DOT_PRECISION)
    L = tl.dot(bf16_operand(k_odd, EMULATE), bf16_operand(tl.trans(down_odd), EMULATE), L)
    cc = tl.arange(0, C)
    offsets = r[:, None] * (H * C) + cc[None, :]
    M = _columns_in_token_order(tl.where(r[:, None] >= r[None, :], M, 0.0), C, RUN)
    L = _columns_in_token_order(tl.where(r[:, None] > r[None, :], L * bv[:, None], 0.0), C, RUN)
    store_as(A_c + offsets, M, m, EMULATE)
    tl.store(L_c + offsets, L, mask=m)


@triton.jit(do_not_specialize=["H"])  # one compile for every head count
def _solve_kernel(
    v, beta, cu_seqlens, ws_bf16, ws_fp32,
    stride_v, stride_beta_tok, stride_beta_head, seq_len, num_seqs, rows, total_slots,
    H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, BETA_SIGMOID: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
    FORM_W_U: tl.constexpr,
):
    """Preparation, second kernel, one (chunk, head) on few warps (its products are 16x16 blocks, which more
    warps would only replicate): T = (I + β·L)⁻¹ from the 16x16 blocks of the β·L scratch (diagonal ones
    strictly lower), then w = T·β·kd and u = T·β·v (``FORM_W_U``), or T·diag(β) over the scratch for the
    recurrence to form them (:func:`fastkda.plan.w_u_in_recurrence`)."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    w_ws, _, _, u_ws, _, _, L_ws = _workspace(ws_bf16, ws_fp32, rows, total_slots, H, K, V, C)
    chunk_start, eos = _chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    cb = tl.arange(0, BC)
    rows0 = cb  # the rows of the chunk's two blocks, counted from its first token
    rows1 = rows0 + BC
    ok0 = rows0 < eos - chunk_start
    ok1 = rows1 < eos - chunk_start
    row0 = chunk_start.to(tl.int64)  # 64-bit base pointers per program, 32-bit offsets inside the chunk
    L_c = L_ws + row0 * (H * C) + h * C
    w_c = w_ws + row0 * (H * K) + h * K
    u_c = u_ws + row0 * (H * V) + h * V
    v_c = v + row0 * stride_v + h * V
    beta_c = beta + row0 * stride_beta_tok + h * stride_beta_head
    L00 = _load_tile(L_c, rows0, ok0, cb, C, H * C)
    L10 = _load_tile(L_c, rows1, ok1, cb, C, H * C)
    L11 = _load_tile(L_c, rows1, ok1, BC + cb, C, H * C)
    b0 = _beta_rows(beta_c, rows0, ok0, stride_beta_tok, BETA_SIGMOID)
    b1 = _beta_rows(beta_c, rows1, ok1, stride_beta_tok, BETA_SIGMOID)
    # T = (I + β·L)⁻¹ by blocks: inverses of the diagonal blocks, then T10 = -T11·L10·T00; then w = T·β·kd over
    # the kd parked in the w workspace (row block 1 first: w_1 overwrites kd_1, which row block 0 does not need)
    # and u = T·β·v, in the same channel steps
    T00 = _unit_lower_inverse_block(L00, BC, DOT_PRECISION)
    T11 = _unit_lower_inverse_block(L11, BC, DOT_PRECISION)
    T10 = -_mm(T11, _mm(L10, T00, DOT_PRECISION), DOT_PRECISION)
    T00 = T00 * b0[None, :]
    T10 = T10 * b0[None, :]
    T11 = T11 * b1[None, :]
    if FORM_W_U:
        for c in range(tl.cdiv(max(K, V), BK)):  # w and u together: one load phase per step for both
            dd = c * BK + tl.arange(0, BK)
            kd0 = _load_tile(w_c, rows0, ok0, dd, K, H * K)
            kd1 = _load_tile(w_c, rows1, ok1, dd, K, H * K)
            v0 = _load_tile(v_c, rows0, ok0, dd, V, stride_v)
            v1 = _load_tile(v_c, rows1, ok1, dd, V, stride_v)
            tl.debug_barrier()  # every thread's kd loaded before any w overwrites it
            _store_tile(w_c, rows1, ok1, dd, _mm(T10, kd0, DOT_PRECISION) + _mm(T11, kd1, DOT_PRECISION), K, H * K,
                        EMULATE)
            _store_tile(w_c, rows0, ok0, dd, _mm(T00, kd0, DOT_PRECISION), K, H * K, EMULATE)
            _store_tile(u_c, rows0, ok0, dd, _mm(T00, v0, DOT_PRECISION), V, H * V, EMULATE)
            _store_tile(u_c, rows1, ok1, dd, _mm(T10, v0, DOT_PRECISION) + _mm(T11, v1, DOT_PRECISION), V, H * V,
                        EMULATE)
    else:  # T·diag(β) over the scratch, whose upper-right block (rows 0, columns BC..) is zero already
        tl.debug_barrier()  # every thread's L loaded before any T overwrites it
        _store_tile(L_c, rows0, ok0, cb, T00, C, H * C, EMULATE)
        _store_tile(L_c, rows1, ok1, cb, T10, C, H * C, EMULATE)
        _store_tile(L_c, rows1, ok1, BC + cb, T11, C, H * C, EMULATE)


@triton.jit
def _store_column_block(A_c, L_c, valid, M_J, L_J, bv, J: tl.constexpr, H,
                        C: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr):
    """Column block J of M (i >= j) to the A workspace and of β·L (i > j) to the fp32 scratch, through the
    chunk's base pointers ``A_c`` and ``L_c``."""
    r = tl.arange(0, C)
    cols = J * BC + tl.arange(0, BC)
    offsets = r[:, None] * (H * C) + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < C)
    store_as(A_c + offsets, tl.where(r[:, None] >= cols[None, :], M_J, 0.0), mask, EMULATE)
    tl.store(L_c + offsets, tl.where(r[:, None] > cols[None, :], L_J * bv[:, None], 0.0), mask=mask)


@triton.jit
def _recurrence_kernel(
    ws_bf16, ws_fp32, out, initial_state, final_state, cu_seqlens,
    ckpt_offsets, ckpt_states, stride_out, seq_len, rows, total_slots, stride_ckpt_n, stride_ckpt_j, v, stride_v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_FINAL: tl.constexpr, NUM_CKPT: tl.constexpr,
    STATE_ROWS_V: tl.constexpr, W_U_FORMED: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """One (V-slice, head, sequence): the chunks in order, the state in fp32 registers. ``STATE_ROWS_V``
    (:func:`state_rows_v`) holds it as Sᵀ ``[BV, K]`` and computes every product transposed, so that the slice's
    BV rows are each product's M (wgmma from 64 rows) and its first operand, the state or v_newᵀ, stays in
    registers; otherwise S ``[K, BV]``, whose products have the chunk's C rows as M. Both forms add the same
    products over K in the same order, so they give the same bits (checked across slice counts). Unless
    ``W_U_FORMED`` (by the solve kernel), each step forms w and u itself from T·diag(β), kd and v with the solve's
    products (the same bits, :func:`fastkda.plan.w_u_in_recurrence`)."""
    vs = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    w_ws, qg_ws, kg_ws, u_ws, A_ws, decay_ws, T_ws = _workspace(ws_bf16, ws_fp32, rows, total_slots, H, K, V, C)
    bos, eos = _sequence_span(cu_seqlens, n, seq_len, IS_VARLEN)
    slot0 = _first_slot(n, bos, seq_len, C, IS_VARLEN)
    kk = tl.arange(0, K)
    vv = vs * BV + tl.arange(0, BV)
    r = tl.arange(0, C)
    cc = tl.arange(0, C)
    base = ((n * H + h) * V).to(tl.int64) * K
    if STATE_ROWS_V:
        state_offsets = base + vv[:, None] * K + kk[None, :]  # Sᵀ[v, k] = state[v, k]
    else:
        state_offsets = base + vv[None, :] * K + kk[:, None]  # S[k, v] = state[v, k]
    if HAS_INITIAL:
        S = tl.load(initial_state + state_offsets).to(tl.float32)
    elif STATE_ROWS_V:
        S = tl.zeros((BV, K), dtype=tl.float32)
    else:
        S = tl.zeros((K, BV), dtype=tl.float32)
    num_chunks = tl.cdiv(eos - bos, C)
    if STATE_ROWS_V:  # the first chunk's uᵀ and decay; each step then loads the next chunk's (below)
        if W_U_FORMED:
            u_T = _u_transposed(u_ws, (bos + r).to(tl.int64), eos, h, vv, H, V)
        decay = tl.load(decay_ws + (slot0 * H + h) * K + kk, mask=(kk < K) & (num_chunks > 0), other=1.0)
    for c in range(num_chunks):
        for j in tl.static_range(NUM_CKPT):  # prefix-cache checkpoint: the state after c*C tokens
            _store_checkpoint(ckpt_offsets, ckpt_states, n, j, stride_ckpt_n, stride_ckpt_j, c * C, eos - bos, S,
                              state_offsets, H, V, K, EMULATE)
        tok = (bos + c * C + r).to(tl.int64)
        valid = tok < eos
        m_k = valid[:, None] & (kk[None, :] < K)
        row_k = tok[:, None] * (H * K) + h * K + kk[None, :]
        if W_U_FORMED:
            w = bf16_operand(tl.load(w_ws + row_k, mask=m_k, other=0.0), EMULATE)
        else:  # w = T·β·kd and u = T·β·v, rounded to bf16 as the workspace would hold them
            T_beta = tl.load(T_ws + tok[:, None] * (H * C) + h * C + cc[None, :],
                             mask=valid[:, None] & (cc[None, :] < C), other=0.0)
            w = bf16_operand(tl.dot(T_beta, load_f32(w_ws + row_k, m_k), input_precision=DOT_PRECISION), EMULATE)
            v_c = load_f32(v + tok[:, None] * stride_v + h * V + vv[None, :], valid[:, None] & (vv[None, :] < V))
            u = bf16_operand(tl.dot(T_beta, v_c, input_precision=DOT_PRECISION), EMULATE).to(tl.float32)
        qg = bf16_operand(tl.load(qg_ws + row_k, mask=m_k, other=0.0), EMULATE)
        kg = bf16_operand(tl.load(kg_ws + row_k, mask=m_k, other=0.0), EMULATE)
        A = bf16_operand(tl.load(A_ws + tok[:, None] * (H * C) + h * C + cc[None, :],
                                 mask=valid[:, None] & (cc[None, :] < C), other=0.0), EMULATE)
        S_op = bf16_operand(S, EMULATE)
        if STATE_ROWS_V:  # v_newᵀ = uᵀ - Sᵀwᵀ, oᵀ = Sᵀqgᵀ + v_newᵀAᵀ, Sᵀ = Sᵀ·diag(decay) + v_newᵀ·kg
            # uᵀ and the decay were loaded a step ahead, and the next chunk's are loaded right after their last
            # use here, so that the loads land in the loop-carried registers: Triton's own prefetch of u and a
            # plain load of the decay both left the step waiting on global memory (H200, ncu, s = 1 at H12 N1
            # T8192: the recurrence 525 -> 327 µs; docs/perf-notes.md, session 7)
            m_v = (vv[:, None] < V) & valid[None, :]
            S_decayed = S * decay[None, :]
            decay = tl.load(decay_ws + ((slot0 + tl.minimum(c + 1, num_chunks - 1)) * H + h) * K + kk)
            if W_U_FORMED:
                v_new = u_T.to(tl.float32) - tl.dot(S_op, tl.trans(w))
                u_T = _u_transposed(u_ws, tok + C, eos, h, vv, H, V)
            else:
                v_new = tl.trans(u) - tl.dot(S_op, tl.trans(w))
            v_op = bf16_operand(v_new, EMULATE)
            o = tl.dot(S_op, tl.trans(qg)) + tl.dot(v_op, tl.trans(A))
            store_as(out + tok[None, :] * stride_out + h * V + vv[:, None], o, m_v, EMULATE)
            S = S_decayed + tl.dot(v_op, kg)
        else:  # v_new = u - w·S, o = qg·S + A·v_new, S = diag(decay)·S + kgᵀ·v_new
            chunk_decay = tl.load(decay_ws + ((slot0 + c) * H + h) * K + kk)
            m_v = valid[:, None] & (vv[None, :] < V)
            if W_U_FORMED:
                u = load_f32(u_ws + tok[:, None] * (H * V) + h * V + vv[None, :], m_v)
            v_new = u - tl.dot(w, S_op)
            v_op = bf16_operand(v_new, EMULATE)
            o = tl.dot(qg, S_op) + tl.dot(A, v_op)
            store_as(out + tok[:, None] * stride_out + h * V + vv[None, :], o, m_v, EMULATE)
            S = S * chunk_decay[:, None] + tl.dot(tl.trans(kg), v_op)
    for j in tl.static_range(NUM_CKPT):
        _store_checkpoint(ckpt_offsets, ckpt_states, n, j, stride_ckpt_n, stride_ckpt_j, num_chunks * C, eos - bos, S,
                          state_offsets, H, V, K, EMULATE)
    if HAS_FINAL:
        store_as(final_state + state_offsets, S, None, EMULATE)


@triton.jit
def _u_transposed(u_ws, tok, eos, h, vv, H: tl.constexpr, V: tl.constexpr):
    """uᵀ ``[BV, C]`` (bf16) of tokens ``tok`` and columns ``vv`` of head ``h``, zeros from ``eos`` on."""
    return tl.load(u_ws + tok[None, :] * (H * V) + h * V + vv[:, None], mask=(vv[:, None] < V) & (tok[None, :] < eos),
                   other=0.0)


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


def prepare_channels(key_dim, lower_bound_gate):
    """Key channels per step of ``_prepare_kernel``: all of them under the lower-bound gate (one load-and-compute
    phase, ``_midpoint_products``; H200: 0.76 -> 0.59 ms whole call at H12 N1 T8192, 4.54 -> 3.24 at H96 B1
    T8192); PREPARE_CHANNELS under the precomputed gate, whose element-wise diagonal blocks needed 311 KB of shared
    memory in one step at 64-token chunks (at 32 one step compiles, 78 KB, but has not been timed)."""
    return key_dim if lower_bound_gate else min(PREPARE_CHANNELS, key_dim)


def token_run(key_dim):
    """Consecutive tokens per thread in ``_prepare_kernel`` under the lower-bound gate: Triton lays a ``[C, K]`` bf16
    tile over PREPARE_WARPS warps in 8-element rows of K / 8 threads, so each thread holds C·K / (warps·256) rows,
    which the kernel fills with consecutive tokens."""
    return max(CHUNK * key_dim // (PREPARE_WARPS * 256), 1)


def state_rows_v(slice_width):
    """Whether the recurrence holds a slice's state as Sᵀ (rows = V): from 64 columns, where that makes every
    product a wgmma with the state in registers (H200, H96 B1 T8192 at s = 2: 1.97 -> 1.81 ms whole call); a 32-wide
    slice keeps S (rows = K): transposed, its 32-row products fall to mma.sync (H12 N1 T8192 at s = 4: 0.46 -> 0.61)."""
    return slice_width >= 64


def recurrence_warps(slice_width):
    """Warps per recurrence program: 8 for a 128-wide slice (the ``[128, 128]`` fp32 state is 64 registers per
    thread; on 4 warps it spilled, H200 s = 1 at H12 N1 T8192 1.88 -> 0.68 ms whole call), else RECURRENCE_WARPS
    (4-warp programs fit two per SM)."""
    return 8 if slice_width >= WIDE_SLICE else RECURRENCE_WARPS


def num_slots(batch, seq_len, num_seqs, varlen):
    """Chunk slots the workspace holds (see the module docstring)."""
    if varlen:
        return batch * seq_len // CHUNK + num_seqs + 1
    return batch * triton.cdiv(seq_len, CHUNK)


@dataclass
class Workspace:
    """What the preparation kernels write for the recurrence, in two buffers (one allocation per dtype: an eager
    call's host time counts) whose sections the kernels locate themselves (``_workspace``): per token and head,
    bf16 ``w``, ``qg``, ``kg`` (K values each), ``u`` (V), ``A`` (C); per chunk slot and head, the fp32 chunk decay
    (K values), then the preparation's fp32 β·L scratch (C per token and head). Unless ``w_u_formed``, the w
    workspace still holds kd, the scratch holds T·diag(β), and the recurrence forms w and u with ``v``."""

    bf16: torch.Tensor
    fp32: torch.Tensor
    rows: int  # (token, head) pairs
    slots: int
    heads: int
    key_dim: int
    value_dim: int
    cu_seqlens: Optional[torch.Tensor]
    seq_len: int
    num_seqs: int
    w_u_formed: bool
    v: torch.Tensor
    dot_precision: str


def prepare(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, cu_seqlens, use_qk_l2norm, use_beta_sigmoid,
            dot_precision="tf32", form_w_u=True):
    """Run the preparation kernels on validated inputs (``q, k, g [B, T, H, K]``, ``v [B, T, H, V]`` with
    ``[H, K]`` contiguous per token, ``beta [B, T, H]`` any strides) and return their :class:`Workspace`; w and u
    are left to the recurrence unless ``form_w_u`` (:func:`fastkda.plan.w_u_in_recurrence`)."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    varlen = cu_seqlens is not None
    num_seqs = cu_seqlens.numel() - 1 if varlen else batch
    rows = batch * seq_len * heads
    slots = num_slots(batch, seq_len, num_seqs, varlen)
    ws = Workspace(
        bf16=torch.empty(rows * (3 * key_dim + value_dim + CHUNK), dtype=torch.bfloat16, device=q.device),
        fp32=torch.empty(slots * heads * key_dim + rows * CHUNK, dtype=torch.float32, device=q.device),
        rows=rows, slots=slots, heads=heads, key_dim=key_dim, value_dim=value_dim, cu_seqlens=cu_seqlens,
        seq_len=seq_len, num_seqs=num_seqs, w_u_formed=form_w_u, v=v, dot_precision=dot_precision)
    if slots == 0:
        return ws
    lower_bound_gate = lower_bound is not None
    absent = ws.fp32  # stands for absent optional tensors; never dereferenced
    gate = (A_log if lower_bound_gate else absent, dt_bias if lower_bound_gate else absent)
    cu = cu_seqlens if varlen else absent
    flags = dict(IS_VARLEN=varlen, BETA_SIGMOID=use_beta_sigmoid, DOT_PRECISION=dot_precision,
                 EMULATE=interpreting())
    bound = float(lower_bound) if lower_bound_gate else 0.0
    launch(
        _prepare_kernel, (slots, heads, 1),
        q, k, g, beta, *gate, cu, ws.bf16, ws.fp32, q.stride(1), k.stride(1), g.stride(1), beta.stride(1),
        beta.stride(2), seq_len, num_seqs, rows, slots, bound, float(scale), heads,
        K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, BK=prepare_channels(key_dim, lower_bound_gate),
        L2NORM=use_qk_l2norm, RUN=token_run(key_dim),
        LOWER_BOUND_GATE=lower_bound_gate, **flags,
        num_warps=PREPARE_WARPS, num_stages=PREPARE_STAGES,
        **({} if PREPARE_MAXNREG is None else dict(maxnreg=PREPARE_MAXNREG)),
    )
    launch(
        _solve_kernel, (slots, heads, 1),
        v, beta, cu, ws.bf16, ws.fp32, v.stride(1), beta.stride(1), beta.stride(2), seq_len, num_seqs, rows, slots,
        heads, K=key_dim, V=value_dim, C=CHUNK, BC=BLOCK, BK=min(SOLVE_CHANNELS, max(key_dim, value_dim)), **flags,
        FORM_W_U=form_w_u, num_warps=SOLVE_WARPS,
        num_stages=SOLVE_STAGES,
    )
    return ws


def recur(ws, *, initial_state, final_state, out, v_slices, checkpoint_offsets=None, checkpoint_states=None):
    """Run the recurrence over a :class:`Workspace` with ``v_slices`` programs per (sequence, head);
    writes ``out [B, T, H, V]`` (contiguous), ``final_state [N, H, V, K]`` and the prefix-cache checkpoints
    ``checkpoint_states [N, 2, H, V, K]`` at ``checkpoint_offsets [N]`` or ``[N, 2]`` (if given) in place."""
    if ws.num_seqs == 0:
        return
    heads, key_dim, value_dim = ws.heads, ws.key_dim, ws.value_dim
    absent = ws.fp32
    checkpoints = 0 if checkpoint_offsets is None else (1 if checkpoint_offsets.dim() == 1 else checkpoint_offsets.shape[1])
    launch(
        _recurrence_kernel, (v_slices, heads, ws.num_seqs),
        ws.bf16, ws.fp32, out,
        initial_state if initial_state is not None else absent,
        final_state if final_state is not None else absent,
        ws.cu_seqlens if ws.cu_seqlens is not None else absent,
        checkpoint_offsets if checkpoints else absent, checkpoint_states if checkpoints else absent,
        out.stride(1), ws.seq_len, ws.rows, ws.slots,
        checkpoint_offsets.stride(0) if checkpoints else 0, checkpoint_offsets.stride(-1) if checkpoints else 0,
        ws.v, ws.v.stride(1), H=heads, K=key_dim, V=value_dim, BV=value_dim // v_slices, C=CHUNK,
        IS_VARLEN=ws.cu_seqlens is not None, HAS_INITIAL=initial_state is not None,
        HAS_FINAL=final_state is not None, NUM_CKPT=checkpoints, STATE_ROWS_V=state_rows_v(value_dim // v_slices),
        W_U_FORMED=ws.w_u_formed, DOT_PRECISION=ws.dot_precision, EMULATE=interpreting(),
        num_warps=recurrence_warps(value_dim // v_slices), num_stages=RECURRENCE_STAGES,
    )


def chunk_kda_forward(
    q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens,
    use_qk_l2norm, use_beta_sigmoid, v_slices, out, final_state, checkpoint_offsets=None, checkpoint_states=None,
    dot_precision="tf32", form_w_u_in_recurrence=None,
):
    """Both kernels on validated inputs: :func:`prepare`, then :func:`recur`. Who forms w and u follows the plan
    (:func:`fastkda.plan.w_u_in_recurrence`) unless ``form_w_u_in_recurrence`` says (the bits are the same)."""
    if form_w_u_in_recurrence is None:
        pairs = (cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]) * q.shape[2]
        form_w_u_in_recurrence = w_u_in_recurrence(v.shape[-1] // v_slices, pairs)
    ws = prepare(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                 cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
                 dot_precision=dot_precision, form_w_u=not form_w_u_in_recurrence)
    recur(ws, initial_state=initial_state, final_state=final_state, out=out, v_slices=v_slices,
          checkpoint_offsets=checkpoint_offsets, checkpoint_states=checkpoint_states)

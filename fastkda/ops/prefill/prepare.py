"""Preparation, first kernel: everything of a chunk that does not depend on the state, but the inverse (which it
also does, at its end, under the plan's ``inverse_in_prepare``: ``solve.invert_chunk``).

One program per (chunk slot, head) (``layout.py``). It loads the chunk's q, k, g and β rows, applies the norms and
the gate, forms the cumulative log-decay ``G`` (base 2) over the chunk, and writes ``qg = qd``, ``kg = kr``, kd
(into the ``kd`` section, for the recurrence), the chunk decay ``exp(G_C)``, ``M = lower_incl(qd·kiᵀ)`` to ``A``
and ``β·L = strictly_lower(β·kd·kiᵀ)`` to the fp32 scratch. M and β·L are written up to their diagonal's sectors
(``tiles.lower_sectors``; the kernels after it read no more), except under the lower-bound gate on varlen inputs,
where whole rows are written: the masked stores made the fixed-length kernel faster and the varlen one no faster,
in every form tried (docs/perf-notes.md, "The in-chunk matrices' zero sectors left unread").

No factor it forms spans more than half the chunk's decay (16 tokens at the lower bound), so nothing overflows:

* Lower-bound gate (``midpoint_products``): every decay is referred to the midpoint of the chunk's log-decay,
  ``G_last / 2`` (G runs from 0 down to ``G_last >= C·λ·log2 e``), so M and β·L are a ``[C, C]`` product each
  over all K channels of factors within ``2^±116`` (16 tokens at λ = −5); a product of two overflows only
  above the diagonal, which is discarded. Each thread holds ``RUN`` consecutive tokens (the plan's
  ``prepare_token_run``: the cumulative sum stays in-thread but for the run totals), the products take the
  channels in two interleaved halves, and M and β·L get their columns back in token order before the store (so
  that stores stay 128-bit and row-contiguous).
* Precomputed gate (unbounded below): ``BK`` channels per step, M and L accumulated as two 16-column blocks; the
  off-diagonal blocks from ``exp(G_i − G_end(J))·exp(G_end(J) − G_j)`` (both ≤ 1), the diagonal ones from
  element-wise decays (``diagonal_elementwise``).

M takes tf32 operands and L bf16 ones (L's inverse meets bf16 k and v anyway); the measurements behind each
choice are in ``docs/perf-notes.md``.
"""

import triton
import triton.language as tl

from ..common import bf16_operand, fast_exp2, launch
from ..tiles import load_rows, store_lower, store_rows
from .inputs import beta_rows, log2_decay_block, row_scales
from .layout import chunk_of_slot, preparation_program
from .solve import inverse_arguments, invert_chunk, offsets_argument

# the inverse's constexprs where the first kernel does not invert (INVERT=False reads none of them)
UNREAD_INVERSE_CONSTANTS = dict(LONGEST_FIRST=False, SEGMENTED=False, EQUAL_ROWS=False, HORNER=False)


@triton.jit
def expand_blocks(x, NB: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
    """``[NB, D]`` per-block rows -> ``[NB*BC, D]``, each block's row repeated over its BC tokens."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (NB, BC, D)), (NB * BC, D))


@triton.jit
def block_rows(x, J: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
    """Rows of block ``J`` of ``x [NB*BC, D]`` as a ``[BC, D]`` tile."""
    pick = (tl.arange(0, NB) == J)[:, None, None]
    return tl.sum(tl.where(pick, tl.reshape(x, (NB, BC, D)), 0.0), axis=0)


@triton.jit
def block_row(x, J: tl.constexpr, NB: tl.constexpr):
    """Row ``J`` of a per-block table ``x [NB, D]``."""
    return tl.sum(tl.where((tl.arange(0, NB) == J)[:, None], x, 0.0), axis=0)


@triton.jit
def diagonal_elementwise(q_b, k_b, cs, NB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                         EMULATE: tl.constexpr):
    """For an unbounded precomputed gate: ``[C, BC]`` tiles whose row i, column jj is the product of row i with
    token jj of i's own block, ``exp(cs_i - cs_j)`` formed element-wise and only for jj <= i."""
    C: tl.constexpr = NB * BC
    local = tl.arange(0, C) % BC
    cb = tl.arange(0, BC)
    m_diag = tl.zeros((C, BC), dtype=tl.float32)
    l_diag = tl.zeros((C, BC), dtype=tl.float32)
    for jj in range(BC):  # a runtime loop: unrolled, it compiles for minutes
        pick = (cb == jj)[None, :, None]
        cs_j = expand_blocks(tl.sum(tl.where(pick, tl.reshape(cs, (NB, BC, BK)), 0.0), axis=1), NB, BC, BK)
        k_j = expand_blocks(tl.sum(tl.where(pick, tl.reshape(k_b, (NB, BC, BK)), 0.0), axis=1), NB, BC, BK)
        below = (local >= jj)[:, None]
        decay = tl.where(below, fast_exp2(tl.where(below, cs - cs_j, 0.0), EMULATE), 0.0) * k_j
        at = cb[None, :] == jj
        m_diag += tl.where(at, tl.sum(q_b * decay, axis=1)[:, None], 0.0)
        l_diag += tl.where(at, tl.sum(k_b * decay, axis=1)[:, None], 0.0)
    return m_diag, l_diag


@triton.jit
def column_products(q_b, k_b, E, G_start, G_end, col, J: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
                    BK: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """Column block J of M and L over all C rows under a precomputed gate, but for the diagonal block (element-wise,
    :func:`diagonal_elementwise`). Row factor exp(G_i - G_end(J)) = E_i · F[blk(i)] with F[I] = exp(G_start(I) -
    G_end(J)) <= 1 for I > J, 0 for I <= J."""
    rows = tl.arange(0, NB)[:, None] > J
    F = tl.where(rows, fast_exp2(tl.where(rows, G_start - block_row(G_end, J, NB)[None, :], 0.0), EMULATE), 0.0)
    R = E * expand_blocks(F, NB, BC, BK)
    col_t = tl.trans(block_rows(col, J, NB, BC, BK))
    return (tl.dot(q_b * R, col_t, input_precision=DOT_PRECISION),
            tl.dot(bf16_operand(k_b * R, EMULATE), bf16_operand(col_t, EMULATE)))


@triton.jit
def store_column_block(A_c, L_c, valid, M_J, L_J, bv, J: tl.constexpr, H,
                       C: tl.constexpr, BC: tl.constexpr, EMULATE: tl.constexpr):
    """Column block J of M (i >= j) to the A section and of β·L (i > j) to the fp32 scratch, through the
    chunk's base pointers ``A_c`` and ``L_c``."""
    r = tl.arange(0, C)
    cols = J * BC + tl.arange(0, BC)
    store_lower(A_c, r, valid, r, cols, H * C, tl.where(r[:, None] >= cols[None, :], M_J, 0.0), EMULATE)
    store_lower(L_c, r, valid, r, cols, H * C, tl.where(r[:, None] > cols[None, :], L_J * bv[:, None], 0.0),
                EMULATE)


@triton.jit
def columns_in_token_order(x, C: tl.constexpr, RUN: tl.constexpr):
    """A ``[C, C]`` tile whose column i holds token r[i] (:func:`prepare_kernel`) with its columns in token order
    (a layout conversion, so that the store is row-contiguous)."""
    return tl.reshape(tl.permute(tl.reshape(x, (C, RUN, C // RUN)), (0, 2, 1)), (C, C))


@triton.jit
def sum_over_rows(x):
    """``tl.sum(x, axis=0)`` of a ``[R, D]`` tile whose rows cross warps, as four sums over every fourth column,
    interleaved back. Triton stages a cross-warp sum in shared memory with consecutive columns one word per warp
    apart: when each thread holds 8 contiguous columns, neighbouring lanes store 128 B apart (16-way bank
    conflicts); with 2 columns a thread in each part, the replays drop by 4 (ncu in ``docs/perf-notes.md``)."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, (R, D // 2, 2)))
    e0, e1 = tl.split(tl.reshape(even, (R, D // 4, 2)))
    o0, o1 = tl.split(tl.reshape(odd, (R, D // 4, 2)))
    even_sums = tl.reshape(tl.join(tl.sum(e0, axis=0), tl.sum(e1, axis=0)), (D // 2,))
    odd_sums = tl.reshape(tl.join(tl.sum(o0, axis=0), tl.sum(o1, axis=0)), (D // 2,))
    return tl.reshape(tl.join(even_sums, odd_sums), (D,))


@triton.jit
def midpoint_products(q_b, k_b, g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, bv, qg_c, kd_c, kg_c,
                      A_c, L_c, decay_c, H, K: tl.constexpr, C: tl.constexpr, RUN: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The first kernel's work under the lower-bound gate (module docstring), from a chunk's normalised ``[C, K]``
    q and k rows (row i holding token ``r[i]``): M = lower_incl((q̂·2^(G - G_last/2))·(k̂·2^(G_last/2 - G))ᵀ), β·L
    likewise, and qg, kd, kg as the same factors times per-channel decays, all K channels at once (channel steps,
    which hold a fraction of the registers, were slower: docs/perf-notes.md)."""
    RUNS: tl.constexpr = C // RUN
    a = tl.reshape(log2_decay_block(g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, K, True, EMULATE),
                   (RUN, RUNS, K))  # [j, s]: token s·RUN + j
    run_total = tl.sum(a, axis=0)  # in-thread
    run_end = tl.cumsum(run_total, axis=0)  # G at each run's last token
    G = tl.reshape(tl.cumsum(a, axis=0) + (run_end - run_total)[None, :, :], (C, K))
    G_last = sum_over_rows(run_total)[None, :]
    ref = 0.5 * G_last
    up = fast_exp2(G - ref, EMULATE)
    q_up = q_b * up
    k_up = k_b * up
    k_down = k_b * fast_exp2(ref - G, EMULATE)
    at_ref = fast_exp2(ref, EMULATE)  # = 2^(G_last - ref) too
    store_rows(qg_c, r, valid, kk, H * K, q_up * at_ref, EMULATE)
    store_rows(kd_c, r, valid, kk, H * K, k_up * at_ref, EMULATE)  # kd, until the solve kernel makes it w
    store_rows(kg_c, r, valid, kk, H * K, k_down * at_ref, EMULATE)
    tl.store(decay_c + kk, tl.reshape(fast_exp2(G_last, EMULATE), (K,)))
    M = tl.zeros((C, C), dtype=tl.float32)
    L = tl.zeros((C, C), dtype=tl.float32)
    q_even, q_odd = tl.split(tl.reshape(q_up, (C, K // 2, 2)))
    k_even, k_odd = tl.split(tl.reshape(k_up, (C, K // 2, 2)))
    down_even, down_odd = tl.split(tl.reshape(k_down, (C, K // 2, 2)))
    # both products of one half before the other's: M, M, L, L would keep every operand alive at once
    M = tl.dot(q_even, tl.trans(down_even), M, input_precision=DOT_PRECISION)
    L = tl.dot(bf16_operand(k_even, EMULATE), bf16_operand(tl.trans(down_even), EMULATE), L)
    M = tl.dot(q_odd, tl.trans(down_odd), M, input_precision=DOT_PRECISION)
    L = tl.dot(bf16_operand(k_odd, EMULATE), bf16_operand(tl.trans(down_odd), EMULATE), L)
    cc = tl.arange(0, C)
    M = columns_in_token_order(tl.where(r[:, None] >= r[None, :], M, 0.0), C, RUN)
    L = columns_in_token_order(tl.where(r[:, None] > r[None, :], L * bv[:, None], 0.0), C, RUN)
    if IS_VARLEN:  # whole rows, zeros included (module docstring)
        store_rows(A_c, r, valid, cc, H * C, M, EMULATE)
        store_rows(L_c, r, valid, cc, H * C, L, EMULATE)
    else:
        store_lower(A_c, r, valid, r, cc, H * C, M, EMULATE)
        store_lower(L_c, r, valid, r, cc, H * C, L, EMULATE)


@triton.jit(do_not_specialize=["H"])  # one compile for every head count
def prepare_kernel(
    q, k, g, beta, A_log, dt_bias, cu_seqlens, ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at,
    stride_q, stride_k, stride_g, stride_beta_tok, stride_beta_head, seq_len, num_seqs, lower_bound, scale,
    errors, order_at, order_count, segment_chunks,
    H, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    RUN: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr, INVERT: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, SEGMENTED: tl.constexpr, EQUAL_ROWS: tl.constexpr, HORNER: tl.constexpr,
    EARLY_CHUNKS_LAST: tl.constexpr,
):
    """One (chunk slot, head) (:func:`fastkda.ops.prefill.layout.preparation_program`): norms, gate, cumulative
    decays, qg, kg, kd, the chunk decay, M and β·L (module docstring): under the lower-bound gate
    :func:`midpoint_products`, over all K channels at once; under a precomputed gate ``BK`` channels at a time, M
    and L accumulated as ``C / BC`` ``[C, BC]`` column blocks.
    Under ``INVERT`` (the plan's ``inverse_in_prepare``) it then does the solve kernel's work on its own chunk
    (:func:`fastkda.ops.prefill.solve.invert_chunk`, whose other arguments it passes through): β·L, just stored,
    is read back behind a barrier, so that no launch and no trip through DRAM lies between the two."""
    NB: tl.constexpr = C // BC
    tl.static_assert(NB == 2)
    slot, h, slots = preparation_program(seq_len, num_seqs, H, C, IS_VARLEN, EARLY_CHUNKS_LAST)
    chunk_start, eos = chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    if LOWER_BOUND_GATE:  # row i holds token r[i]: each thread's rows are RUN consecutive tokens
        r = (tl.arange(0, C) % (C // RUN)) * RUN + tl.arange(0, C) // (C // RUN)
    else:
        r = tl.arange(0, C)
    valid = r < eos - chunk_start
    # 64-bit base pointers per program, 32-bit offsets inside the chunk (fewer registers than 64-bit tiles)
    row0 = chunk_start.to(tl.int64)
    q_c = q + row0 * stride_q + h * K
    k_c = k + row0 * stride_k + h * K
    g_c = g + row0 * stride_g + h * K
    qg_c = ws_bf16 + qg_at + row0 * (H * K) + h * K  # the chunk's first row in the [tokens, H, K] sections
    kd_c = ws_bf16 + row0 * (H * K) + h * K
    kg_c = ws_bf16 + kg_at + row0 * (H * K) + h * K
    decay_c = ws_fp32 + (slot * H + h) * K
    kall = tl.arange(0, K)
    q_t = load_rows(q_c, r, valid, kall, stride_q).to(tl.float32)  # whole rows, for the norms
    k_t = load_rows(k_c, r, valid, kall, stride_k).to(tl.float32)
    qs, ks = row_scales(q_t, k_t, valid, scale, L2NORM)

    bv = beta_rows(beta + row0 * stride_beta_tok + h * stride_beta_head, r, valid, stride_beta_tok, BETA_SIGMOID)
    A_c = ws_bf16 + A_at + row0 * (H * C) + h * C  # the chunk's first row in the [tokens, H, C] A and scratch
    L_c = ws_fp32 + scratch_at + row0 * (H * C) + h * C
    if LOWER_BOUND_GATE:
        tl.static_assert(BK == K)  # one channel step (the plan's rule under this gate)
        midpoint_products(q_t * qs[:, None], k_t * ks[:, None], g_c, r, valid, stride_g, h, kall, A_log, dt_bias,
                          lower_bound, bv, qg_c, kd_c, kg_c, A_c, L_c, decay_c, H, K, C, RUN, DOT_PRECISION,
                          EMULATE, IS_VARLEN)
    else:
        zero = tl.zeros((C, BC), dtype=tl.float32)
        M0, M1, L0, L1 = zero, zero, zero, zero
        blk = r // BC
        for c in range(K // BK):
            kk = c * BK + tl.arange(0, BK)
            q_b = load_rows(q_c, r, valid, kk, stride_q).to(tl.float32) * qs[:, None]
            k_b = load_rows(k_c, r, valid, kk, stride_k).to(tl.float32) * ks[:, None]
            a3 = tl.reshape(log2_decay_block(g_c, r, valid, stride_g, h, kk, A_log, dt_bias, lower_bound, K,
                                             False, EMULATE), (NB, BC, BK))
            cs = tl.reshape(tl.cumsum(a3, axis=1), (C, BK))  # G_i - G_start(blk(i))
            total = tl.sum(a3, axis=1)  # [NB, BK] per-block log-decay
            G_end = tl.cumsum(total, axis=0)
            G_start = G_end - total
            G_last = block_row(G_end, NB - 1, NB)
            E = fast_exp2(cs, EMULATE)  # <= 1
            col = k_b * fast_exp2(expand_blocks(total, NB, BC, BK) - cs, EMULATE)  # k̂_j·exp(G_end(J) - G_j) <= 1
            x = expand_blocks(fast_exp2(G_start, EMULATE), NB, BC, BK)
            store_rows(qg_c, r, valid, kk, H * K, q_b * E * x, EMULATE)
            store_rows(kd_c, r, valid, kk, H * K, k_b * E * x, EMULATE)  # kd, until the solve kernel makes it w
            store_rows(kg_c, r, valid, kk, H * K,
                       col * expand_blocks(fast_exp2(G_last[None, :] - G_end, EMULATE), NB, BC, BK), EMULATE)
            tl.store(decay_c + kk, fast_exp2(G_last, EMULATE))
            m_J, l_J = column_products(q_b, k_b, E, G_start, G_end, col, 0, NB, BC, BK, DOT_PRECISION, EMULATE)
            M0 += m_J
            L0 += l_J
            m_J, l_J = column_products(q_b, k_b, E, G_start, G_end, col, 1, NB, BC, BK, DOT_PRECISION, EMULATE)
            M1 += m_J
            L1 += l_J
            m_d, l_d = diagonal_elementwise(q_b, k_b, cs, NB, BC, BK, EMULATE)
            M0 += tl.where((blk == 0)[:, None], m_d, 0.0)
            L0 += tl.where((blk == 0)[:, None], l_d, 0.0)
            M1 += tl.where((blk == 1)[:, None], m_d, 0.0)
            L1 += tl.where((blk == 1)[:, None], l_d, 0.0)
        store_column_block(A_c, L_c, valid, M0, L0, bv, 0, H, C, BC, EMULATE)
        store_column_block(A_c, L_c, valid, M1, L1, bv, 1, H, C, BC, EMULATE)
    if INVERT:
        tl.debug_barrier()  # every thread's β·L stored before any thread reads the blocks back
        invert_chunk(slot, h, slots, beta, cu_seqlens, errors, ws_fp32, scratch_at, order_at, order_count,
                     segment_chunks, stride_beta_tok, stride_beta_head, seq_len, num_seqs, H, C, BC, IS_VARLEN,
                     BETA_SIGMOID, DOT_PRECISION, EMULATE, LONGEST_FIRST, SEGMENTED, EQUAL_ROWS, HORNER)


def launch_prepare(plan, ws, q, k, g, beta, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid,
                   errors, emulate):
    """Launch :func:`prepare_kernel` over the plan's grid into the workspace ``ws`` (under the plan's
    ``inverse_in_prepare``, the solve kernel's work too, counting in ``errors`` as it does)."""
    absent = ws.fp32  # stands for absent optional tensors; never dereferenced
    gate = (A_log, dt_bias) if plan.lower_bound_gate else (absent, absent)
    layout = ws.layout
    if plan.inverse_in_prepare:
        offsets = offsets_argument(plan, ws)
        inverse_runtime, inverse_constants = inverse_arguments(plan, ws, errors)
    else:  # the inverse's arguments unread: fixed stand-ins, so that the kernel compiles no more variants than the
        # plans it serves (a count or a dtype that only the inverse reads would key Triton's specialisations)
        offsets = ws.cu_seqlens if plan.varlen else absent
        inverse_runtime, inverse_constants = (absent, 0, 0, 0), UNREAD_INVERSE_CONSTANTS
    launch(
        prepare_kernel, plan.prepare_grid,
        q, k, g, beta, *gate, offsets, ws.bf16, ws.fp32,
        layout.qg, layout.kg, layout.A, layout.scratch, q.stride(1), k.stride(1), g.stride(1), beta.stride(1),
        beta.stride(2), plan.seq_len, plan.num_seqs, float(lower_bound) if plan.lower_bound_gate else 0.0,
        float(scale), *inverse_runtime, plan.heads,
        K=plan.key_dim, C=plan.chunk, BC=plan.block, BK=plan.prepare_channels, IS_VARLEN=plan.varlen,
        LOWER_BOUND_GATE=plan.lower_bound_gate, L2NORM=use_qk_l2norm, BETA_SIGMOID=use_beta_sigmoid,
        RUN=plan.prepare_token_run, DOT_PRECISION=plan.dot_precision, EMULATE=emulate,
        INVERT=plan.inverse_in_prepare, **inverse_constants, EARLY_CHUNKS_LAST=plan.early_chunks_last,
        num_warps=plan.prepare_warps, num_stages=plan.prepare_stages, maxnreg=plan.prepare_registers or None,
    )

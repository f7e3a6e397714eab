"""The serial recurrence over chunks: one program per (V-slice, head, sequence), the state in fp32 registers.

Per chunk, in order (spec §2 in the WY form): ``v_new = u − w·S``, ``o = qg·S + A·v_new``,
``S = diag(exp(G_C))·S + kgᵀ·v_new``, with prefix-cache checkpoints written at chunk boundaries. No step reduces
over V, and every slice adds the same products over K in the same order, so results are bitwise identical for
any number of V-slices (the plan's ``v_slices``).

Two forms of the same arithmetic (the plan's ``state_rows_v``):

* slices from 64 columns hold the state transposed, ``Sᵀ [BV, K]``, and compute every product transposed, so that
  the slice's columns are each product's M (a wgmma from 64 rows) and its first operand, the state or
  ``v_newᵀ``, stays in registers. The next chunk's ``vᵀ`` and decay are loaded right after their last use in the
  current step, so that the loads land in the loop-carried registers and overlap the step (loaded at the top of
  the step, or left to Triton's pipeliner, the step waited on them);
* narrower slices hold ``S [K, BV]``, whose products have the chunk's C rows as M.

Each step takes kd (the ``kd`` section) and v as they are and the solve kernel's T·diag(β): w = T·β·kd and u = T·β·v
enter only as ``v_new = u − w·S = T·β·(v − kd·S)``, so it forms ``Y = v − kd·S`` (the state's K-wide product) and
then ``v_new = T·β·Y``, a product over the chunk's C tokens, with T·β split into two bf16 tiles (hi + lo: its
diagonal holds β, which one bf16 tile would round) and Y rounded to bf16 as v_new is for the state's products.
Every operand is bf16, as in the state's products, so the wide forms' wgmma and the narrow form's mma.sync give
the same bits. A product that adds onto a value (the state's onto the decayed state, the output's second onto its
first) takes that value as ``tl.dot``'s accumulator: the code generator fuses ``x + tl.dot(a, b)`` the same way
(the SASS of every plan's recurrence and transition kernels is the same either way), and on the interpreter the
terms then add onto the accumulator as on the tensor cores (term by term in k order there, ``tests/interpreter.py``),
as the Gluon kernels' emulation (``tests/gluon_interpreter.py``) adds them.
"""

import triton
import triton.language as tl

from ..common import bf16_operand, launch, store_as
from ..tiles import load_lower, load_tile, load_tile_t, store_tile, store_tile_t, tile_offsets
from .layout import (OWNER_LOOKUP_WIDTH, entry_state, first_slot, segment_exit, sequence_of_slot_with,
                     sequence_order, sequence_span)


@triton.jit
def store_checkpoint(ckpt_offsets, ckpt_states, n, j, stride_n, stride_j, done, skip, length, S, state_offsets,
                     H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, EMULATE: tl.constexpr):
    """Write ``S`` (the state after ``done`` tokens) to checkpoint ``j`` of sequence ``n`` if its offset is
    ``done`` and inside the sequence, unless ``skip``. ``state_offsets`` address ``[n, h, v, k]`` of an
    ``[N, H, V, K]`` tensor; checkpoints are ``[N, 2, H, V, K]``. The offset is compared in its own dtype (an int64
    offset is never truncated into a match)."""
    offset = tl.load(ckpt_offsets + n * stride_n + j * stride_j)
    if (offset == done) & (offset <= length) & ~skip:
        per_seq = H * V * K
        target = n.to(tl.int64) * (2 * per_seq) + j * per_seq + (state_offsets - n.to(tl.int64) * per_seq)
        store_as(ckpt_states + target, S, None, EMULATE)


@triton.jit
def concat_columns(a, b, R: tl.constexpr, D: tl.constexpr):
    """``[a | b]`` for two ``[R, D]`` tiles, as one ``[R, 2D]`` operand: on the tensor cores a product over it
    accumulates a's columns, then b's, as two chained products do (the same bits, checked on the GPU), in one wgmma
    group with one wait instead of two (faster in 64-wide slices, docs/perf-notes.md "v_new from kd and v")."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (R, 2 * D))


@triton.jit
def split_bf16(x, EMULATE: tl.constexpr):
    """fp32 ``x`` as two bf16 operands ``hi + lo`` (about 16 significant bits)."""
    hi = bf16_operand(x, EMULATE)
    return hi, bf16_operand(x - hi.to(tl.float32), EMULATE)


@triton.jit
def starting_state(ws_fp32, entries_at, initial_state, state_offsets, local, zero, vv, kk, slot, h, j, c1,
                   num_chunks, active, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, HAS_INITIAL: tl.constexpr,
                   STATE_ROWS_V: tl.constexpr, SEGMENTED: tl.constexpr, TRANSITION: tl.constexpr):
    """The state a :func:`walk_chunks` program starts from, in the form and layout of ``zero`` (its zero tile;
    ``state_offsets`` address it in ``[N, H, V, K]``, ``local`` in one (slot, head)'s ``[V, K]`` rows). A segment
    program that walks nothing (not ``active``: it stores nothing either) reads nothing: its loads are masked off,
    not branched around, so that the walk's pipelining is as before (docs/perf-notes.md, "Session 51: idle segment
    programs load a state they never use")."""
    if TRANSITION:  # identity columns: the state of column V + p starts as the unit vector e_p
        if STATE_ROWS_V:
            S = tl.where(vv[:, None] - V == kk[None, :], 1.0, 0.0)
        else:
            S = tl.where(vv[None, :] - V == kk[:, None], 1.0, 0.0)
        if HAS_INITIAL:
            if j == 0:  # the value columns only (an identity slice's rows lie past the state's V)
                if STATE_ROWS_V:
                    S += tl.load(initial_state + state_offsets, mask=(vv[:, None] < V) & active,
                                 other=0.0).to(tl.float32)
                else:
                    S += tl.load(initial_state + state_offsets, mask=(vv[None, :] < V) & active,
                                 other=0.0).to(tl.float32)
    elif SEGMENTED:
        # a sequence of several segments: the scan's entry state (the first segment's initial state too: it may be
        # the final state's buffer, which the last segment writes while the first runs); of one: the serial start
        if (c1 < num_chunks) | (j > 0):
            S = tl.load(entry_state(ws_fp32, entries_at, slot, h, H, V, K) + local, mask=active, other=0.0)
        elif HAS_INITIAL:
            S = tl.load(initial_state + state_offsets, mask=active, other=0.0).to(tl.float32)
        else:
            S = zero
    elif HAS_INITIAL:
        S = tl.load(initial_state + state_offsets).to(tl.float32)
    else:
        S = zero
    return S


@triton.jit
def finish_walk(S, ws_fp32, transitions_at, final_state, ckpt_offsets, ckpt_states, errors, cu_seqlens, n, slot, h,
                vs, bos, eos, in_order, num_chunks, c1, active, first_segment, own_slot, seq_len, num_seqs,
                segment_chunks, stride_ckpt_n, stride_ckpt_j, state_offsets, local, lanes, H: tl.constexpr,
                V: tl.constexpr, K: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr,
                HAS_FINAL: tl.constexpr, NUM_CKPT: tl.constexpr, EMULATE: tl.constexpr, SEGMENTED: tl.constexpr,
                TRANSITION: tl.constexpr):
    """What a :func:`walk_chunks` program writes after its last chunk, from its state ``S``: a transition's
    exit, or the checkpoints at the segment's end and the final state; malformed ``cu_seqlens`` counted
    (``lanes``: :func:`fastkda.ops.prefill.layout.sequence_of_slot_with`'s)."""
    if TRANSITION:  # the segment's exit: [exit state from zero | transition], rows of the V + K columns
        if active:
            tl.store(segment_exit(ws_fp32, transitions_at, slot, h, H, V, K) + local, S)
    elif active:  # the checkpoint at the segment's end (so that it is the final state of a run of that prefix with
        # the same segments, whose last segment ends there), and after the last segment the final state
        for i in tl.static_range(NUM_CKPT):
            store_checkpoint(ckpt_offsets, ckpt_states, n, i, stride_ckpt_n, stride_ckpt_j, c1 * C, False, eos - bos,
                             S, state_offsets, H, V, K, EMULATE)
        if HAS_FINAL:
            last = c1 == num_chunks
            if SEGMENTED and IS_VARLEN:  # malformed cu_seqlens can hand a sequence's last slot to another sequence:
                # then its first segment writes a final state (unspecified, but written), as no other program does
                if first_segment & ~last:
                    last_slot = own_slot + tl.cdiv(num_chunks, segment_chunks) - 1
                    last = sequence_of_slot_with(lanes, last_slot, cu_seqlens, seq_len, num_seqs,
                                                 C * segment_chunks, IS_VARLEN) != n
            if last:
                store_as(final_state + state_offsets, S, None, EMULATE)
    if IS_VARLEN and not SEGMENTED:  # fastkda.errors: "cu_seqlens", counted last, once per sequence
        tl.atomic_add(errors + 2, 1, mask=(vs == 0) & (h == 0) & ~in_order, sem="relaxed")


@triton.jit
def head_sections(ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, v, out, h, K: tl.constexpr, V: tl.constexpr,
                  C: tl.constexpr):
    """Head ``h``'s first column in each workspace section, in v, in the output and in the chunk decays: rows are
    then tokens (chunk slots for the decays), ``layout.py``'s strides apart."""
    return (ws_bf16 + h * K, ws_bf16 + qg_at + h * K, ws_bf16 + kg_at + h * K, ws_bf16 + A_at + h * C,
            ws_fp32 + scratch_at + h * C, v + h * V, out + h * V, ws_fp32 + h * K)


@triton.jit
def program_chunks(cu_seqlens, seq_len, num_seqs, segment_chunks, vs, lanes, order, V: tl.constexpr,
                   BV: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr, SEGMENTED: tl.constexpr,
                   TRANSITION: tl.constexpr, OPEN_ENTRY: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """What program ``(vs, ·, program_id(2))`` of :func:`walk_chunks` walks: its sequence ``n`` (``bos``,
    ``eos``, whether its ``cu_seqlens`` entries are in order, its first chunk slot, its chunks), and under
    sequence parallelism its segment slot and index ``j``; the chunks ``[c0, c_end)`` it steps over (none when
    not ``active``), ``c1`` the segment's end; whether it holds the sequence's first segment and that segment's
    slot (under ``SEGMENTED``; the serial program's own sequence and first chunk slot otherwise). ``lanes``:
    :func:`fastkda.ops.prefill.layout.sequence_of_slot_with`'s. ``LONGEST_FIRST``: program ``program_id(2)``
    takes the row (sequence, or segment program) at that place of ``order``, the most work first, so that the
    longest chains start in the first wave."""
    row = tl.program_id(2)
    if LONGEST_FIRST:
        row = tl.load(order + row)
    if SEGMENTED:  # rows 0..N-1: each sequence's first segment; then one per segment slot, for the others
        first_segment = row < num_seqs
        slot = tl.maximum(row - num_seqs, 0)
        n = tl.where(first_segment, row,
                     sequence_of_slot_with(lanes, slot, cu_seqlens, seq_len, num_seqs, C * segment_chunks,
                                           IS_VARLEN))
    else:
        n = row
    bos, eos, in_order = sequence_span(cu_seqlens, n, seq_len, num_seqs, IS_VARLEN)
    slot0 = first_slot(n, bos, seq_len, C, IS_VARLEN)
    num_chunks = tl.cdiv(eos - bos, C)
    if SEGMENTED:  # the first segments come first in the grid, so that a batch of one segment per sequence runs
        # its programs in the first wave, one per SM, as the serial recurrence does
        own_slot = first_slot(n, bos, seq_len, C * segment_chunks, IS_VARLEN)  # the sequence's first segment slot
        slot = tl.where(first_segment, own_slot, slot)
        j = slot - own_slot
        c0 = j * segment_chunks
        c1 = tl.minimum(c0 + segment_chunks, num_chunks)
        later = ~first_segment & (j > 0)  # a slot program of a later segment (j <= 0 there: the first's, or none)
        if TRANSITION and OPEN_ENTRY:  # the entry state is not known yet: every segment, every column
            active = (first_segment | later) & (c0 < num_chunks)
        elif TRANSITION:  # every segment but the last; the identity columns from the second
            active = (first_segment | later) & (c1 < num_chunks) & ((vs * BV < V) | (j > 0))
        else:  # every segment; the first also for an empty sequence (its final state and checkpoint 0)
            active = first_segment | (later & (c0 < num_chunks))
        c0 = tl.where(active, c0, 0)  # an idle program walks no chunk (no branch around the loop, which would
        c_end = tl.where(active, c1, 0)  # keep Triton from pipelining its loads), prefetches in range, stores nothing
    else:
        first_segment = True
        own_slot = slot0
        slot = slot0
        j = 0
        c0 = 0
        c1 = num_chunks
        c_end = c1
        active = True
    return n, bos, eos, in_order, slot0, num_chunks, slot, j, c0, c1, c_end, active, first_segment, own_slot


@triton.jit
def walk_chunks(
    ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, transitions_at, entries_at, order_at, out, initial_state,
    final_state, cu_seqlens, errors, ckpt_offsets, ckpt_states, stride_out, seq_len, num_seqs, stride_ckpt_n,
    stride_ckpt_j, v, stride_v, segment_chunks,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_FINAL: tl.constexpr, NUM_CKPT: tl.constexpr,
    STATE_ROWS_V: tl.constexpr, EMULATE: tl.constexpr, SEGMENTED: tl.constexpr, TRANSITION: tl.constexpr,
    OPEN_ENTRY: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    """One (V-slice, head, sequence), or under sequence parallelism one (slice, head, segment slot): the chunks
    in order (module docstring); ``TRANSITION``: the segment's transition instead (:func:`transition_kernel`;
    ``OPEN_ENTRY``: of every segment, the first's and the last's too)."""
    vs = tl.program_id(0)
    h = tl.program_id(1)
    kd_ws, qg_ws, kg_ws, A_ws, T_ws, v_h, out_h, decay_h = head_sections(ws_bf16, ws_fp32, qg_at, kg_at, A_at,
                                                                          scratch_at, v, out, h, K, V, C)
    lanes = tl.arange(0, OWNER_LOOKUP_WIDTH)
    n, bos, eos, in_order, slot0, num_chunks, slot, j, c0, c1, c_end, active, first_segment, own_slot = \
        program_chunks(cu_seqlens, seq_len, num_seqs, segment_chunks, vs, lanes, sequence_order(ws_fp32, order_at), V,
                       BV, C, IS_VARLEN, SEGMENTED, TRANSITION, OPEN_ENTRY, LONGEST_FIRST)
    kk = tl.arange(0, K)
    vv = vs * BV + tl.arange(0, BV)  # TRANSITION: columns V.. are the identity columns
    r = tl.arange(0, C)
    cc = tl.arange(0, C)
    base = ((n * H + h) * V).to(tl.int64) * K
    if STATE_ROWS_V:
        state_offsets = base + tile_offsets(vv, kk, K, 1)  # Sᵀ[v, k] = state[v, k]
        local = tile_offsets(vv, kk, K, 1)
    else:
        state_offsets = base + tile_offsets(kk, vv, 1, K)  # S[k, v] = state[v, k]
        local = tile_offsets(kk, vv, 1, K)
    zero = tl.zeros((BV, K), dtype=tl.float32) if STATE_ROWS_V else tl.zeros((K, BV), dtype=tl.float32)
    S = starting_state(ws_fp32, entries_at, initial_state, state_offsets, local, zero, vv, kk, slot, h, j, c1,
                       num_chunks, active, H, V, K, HAS_INITIAL, STATE_ROWS_V, SEGMENTED, TRANSITION)
    # the next chunk's vᵀ is carried over the step as fp32 in 128-wide slices and, for bf16 v, as bf16 in narrower
    # ones (each measured faster than the other there; docs/perf-notes.md, "v_new from kd and v"); fp16 or fp32 v
    # stays fp32, so that every slice width subtracts the same values
    V_CARRIED: tl.constexpr = tl.bfloat16 if (BV < 128) and (v.dtype.element_ty == tl.bfloat16) else tl.float32
    if STATE_ROWS_V:  # the first chunk's vᵀ and decay; each step then loads the next chunk's (below)
        first = (bos + c0 * C + r).to(tl.int64)
        v_T = load_tile_t(v_h, first, first < eos, vv, V, stride_v).to(V_CARRIED)
        decay = tl.load(decay_h + (slot0 + c0) * (H * K) + kk, mask=(kk < K) & (c_end > c0), other=1.0)
    for c in range(c0, c_end):
        if not TRANSITION:
            # under SEGMENTED a later segment's start is its predecessor's end, which that one writes
            skip = (c == c0) & (j > 0) if SEGMENTED else False
            for i in tl.static_range(NUM_CKPT):  # prefix-cache checkpoint: the state after c*C tokens
                store_checkpoint(ckpt_offsets, ckpt_states, n, i, stride_ckpt_n, stride_ckpt_j, c * C, skip,
                                 eos - bos, S, state_offsets, H, V, K, EMULATE)
        tok = (bos + c * C + r).to(tl.int64)
        valid = tok < eos
        T_hi, T_lo = split_bf16(load_lower(T_ws, tok, valid, r, cc, H * C), EMULATE)
        kd = bf16_operand(load_tile(kd_ws, tok, valid, kk, K, H * K), EMULATE)
        if not TRANSITION:
            qg = bf16_operand(load_tile(qg_ws, tok, valid, kk, K, H * K), EMULATE)
            A = bf16_operand(load_lower(A_ws, tok, valid, r, cc, H * C), EMULATE)
        kg = bf16_operand(load_tile(kg_ws, tok, valid, kk, K, H * K), EMULATE)
        S_op = bf16_operand(S, EMULATE)
        if STATE_ROWS_V:  # v_newᵀ = (vᵀ - Sᵀkdᵀ)·(T·β)ᵀ, oᵀ = Sᵀqgᵀ + v_newᵀAᵀ, Sᵀ = Sᵀ·diag(decay) + v_newᵀ·kg
            S_decayed = S * decay[None, :]
            decay = tl.load(decay_h + (slot0 + tl.minimum(c + 1, c1 - 1)) * (H * K) + kk)
            Y = bf16_operand(v_T.to(tl.float32) - tl.dot(S_op, tl.trans(kd)), EMULATE)
            v_T = load_tile_t(v_h, tok + C, tok + C < eos, vv, V, stride_v).to(V_CARRIED)
            v_new = tl.dot(concat_columns(Y, Y, BV, C), tl.trans(concat_columns(T_lo, T_hi, C, C)))
            v_op = bf16_operand(v_new, EMULATE)
            if not TRANSITION:
                o = tl.dot(v_op, tl.trans(A), tl.dot(S_op, tl.trans(qg)))
                store_tile_t(out_h, tok, valid, vv, V, stride_out, o, EMULATE)
            S = tl.dot(v_op, kg, S_decayed)
        else:  # v_new = T·β·(v - kd·S), o = qg·S + A·v_new, S = diag(decay)·S + kgᵀ·v_new
            chunk_decay = tl.load(decay_h + (slot0 + c) * (H * K) + kk)
            v_c = load_tile(v_h, tok, valid, vv, V, stride_v).to(tl.float32)
            Y = bf16_operand(v_c - tl.dot(kd, S_op), EMULATE)
            v_new = tl.dot(T_hi, Y, tl.dot(T_lo, Y))  # as the wide forms' one product over [T_lo | T_hi]
            v_op = bf16_operand(v_new, EMULATE)
            if not TRANSITION:
                o = tl.dot(A, v_op, tl.dot(qg, S_op))
                store_tile(out_h, tok, valid, vv, V, stride_out, o, EMULATE)
            S = tl.dot(tl.trans(kg), v_op, S * chunk_decay[:, None])
    finish_walk(S, ws_fp32, transitions_at, final_state, ckpt_offsets, ckpt_states, errors, cu_seqlens, n, slot, h,
                vs, bos, eos, in_order, num_chunks, c1, active, first_segment, own_slot, seq_len, num_seqs,
                segment_chunks, stride_ckpt_n, stride_ckpt_j, state_offsets, local, lanes, H, V, K, C, IS_VARLEN,
                HAS_FINAL, NUM_CKPT, EMULATE, SEGMENTED, TRANSITION)


@triton.jit
def recurrence_kernel(
    ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, entries_at, order_at, out, initial_state, final_state, cu_seqlens,
    errors, ckpt_offsets, ckpt_states, stride_out, seq_len, num_seqs, stride_ckpt_n, stride_ckpt_j, v, stride_v,
    segment_chunks, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_FINAL: tl.constexpr, NUM_CKPT: tl.constexpr,
    STATE_ROWS_V: tl.constexpr, EMULATE: tl.constexpr, SEGMENTED: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    """The recurrence: one (V-slice, head, sequence) over its chunks, or under sequence parallelism one (V-slice,
    head, segment slot) from the segment's entry state; outputs, checkpoints and final states."""
    walk_chunks(ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, 0, entries_at, order_at, out, initial_state,
                final_state, cu_seqlens, errors, ckpt_offsets, ckpt_states, stride_out, seq_len, num_seqs,
                stride_ckpt_n, stride_ckpt_j, v, stride_v, segment_chunks, H, K, V, BV, C, IS_VARLEN, HAS_INITIAL,
                HAS_FINAL, NUM_CKPT, STATE_ROWS_V, EMULATE, SEGMENTED, False, False, LONGEST_FIRST)


@triton.jit
def transition_kernel(
    ws_bf16, ws_fp32, kg_at, scratch_at, transitions_at, order_at, initial_state, cu_seqlens, seq_len, num_seqs, v,
    stride_v, segment_chunks, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_INITIAL: tl.constexpr, STATE_ROWS_V: tl.constexpr, EMULATE: tl.constexpr,
    OPEN_ENTRY: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    """Sequence parallelism's first phase: one (slice of the V + K columns, head, segment slot), every segment but
    its sequence's last, from a zero state (the first segment from the initial state) and identity columns,
    steps without outputs; writes the segment's exit and transition (``scan.py``). ``OPEN_ENTRY`` (the entry state
    comes later: :func:`fastkda.ops.prefill.open_entry_transitions`): every segment from zero and identity
    columns, the first and the last too. ``LONGEST_FIRST`` (the plan's ``transitions_in_order``): program row z
    takes the row at place z of the recurrence's order, whose first places hold every segment with a transition."""
    walk_chunks(ws_bf16, ws_fp32, 0, kg_at, 0, scratch_at, transitions_at, 0, order_at, ws_fp32, initial_state,
                ws_fp32, cu_seqlens, ws_fp32, ws_fp32, ws_fp32, 0, seq_len, num_seqs, 0, 0, v, stride_v,
                segment_chunks, H, K, V, BV, C, IS_VARLEN, HAS_INITIAL, False, 0, STATE_ROWS_V, EMULATE, True, True,
                OPEN_ENTRY, LONGEST_FIRST)


def recurrence_arguments(plan, ws, out, initial_state, final_state, checkpoint_offsets, checkpoint_states, errors):
    """The arguments and shared constexprs of a recurrence launch under ``plan`` (both recurrence kernels take
    them): ``out [B, T, H, V]`` (contiguous), ``final_state [N, H, V, K]`` and the checkpoints ``checkpoint_states
    [N, 2, H, V, K]`` at ``checkpoint_offsets [N]`` or ``[N, 2]`` (if given), written in place; malformed
    ``cu_seqlens`` counted in ``errors``."""
    absent = ws.fp32  # stands for absent optional tensors; never dereferenced
    checkpoints = 0 if checkpoint_offsets is None else (1 if checkpoint_offsets.dim() == 1 else
                                                        checkpoint_offsets.shape[1])
    layout = ws.layout
    args = (ws.bf16, ws.fp32, layout.qg, layout.kg, layout.A, layout.scratch, layout.entries, layout.order, out,
            initial_state if initial_state is not None else absent,
            final_state if final_state is not None else absent,
            ws.cu_seqlens if plan.varlen else absent, errors,
            checkpoint_offsets if checkpoints else absent, checkpoint_states if checkpoints else absent,
            out.stride(1), plan.seq_len, plan.num_seqs,
            checkpoint_offsets.stride(0) if checkpoints else 0, checkpoint_offsets.stride(-1) if checkpoints else 0,
            ws.v, ws.v.stride(1), plan.segment_chunks)
    constexprs = dict(H=plan.heads, K=plan.key_dim, V=plan.value_dim, BV=plan.slice_width, C=plan.chunk,
                      IS_VARLEN=plan.varlen, HAS_INITIAL=initial_state is not None,
                      HAS_FINAL=final_state is not None, NUM_CKPT=checkpoints, LONGEST_FIRST=plan.longest_first)
    return args, constexprs


def warpgroup_runs(wanted, ws, emulate):
    """Whether a Gluon kernel the plan asks for (``wanted``: its ``warpgroup_recurrence`` or
    ``warpgroup_transition``) runs on this call: not under the interpreter, which runs no Gluon kernel, and only on
    a v whose token rows start 16-byte aligned (its first element, and a row stride that is a multiple of 16
    elements, as Triton's launcher specialises them), which its 16-byte ``cp.async`` copies need; any other call
    runs the Triton kernel, the same bits."""
    return wanted and not emulate and ws.v.data_ptr() % 16 == 0 and ws.v.stride(1) % 16 == 0


def launch_recurrence(plan, ws, out, initial_state, final_state, checkpoint_offsets, checkpoint_states, errors,
                      emulate):
    """Launch :func:`recurrence_kernel`, or its Gluon form where :func:`warpgroup_runs`, over the plan's grid
    (:func:`recurrence_arguments`; under sequence parallelism it reruns every segment from the entry state the
    scan wrote, and the scan counts malformed ``cu_seqlens`` instead)."""
    args, constexprs = recurrence_arguments(plan, ws, out, initial_state, final_state, checkpoint_offsets,
                                            checkpoint_states, errors)
    if warpgroup_runs(plan.warpgroup_recurrence, ws, emulate):
        from .recurrence_warpgroup import warpgroup_recurrence_kernel  # Gluon: imported only where it runs
        launch(warpgroup_recurrence_kernel, plan.recurrence_grid, *args, **constexprs,
               SEGMENTED=plan.sequence_parallel, STAGES=plan.recurrence_stages, num_warps=plan.recurrence_warps)
    else:
        launch(recurrence_kernel, plan.recurrence_grid, *args, **constexprs, STATE_ROWS_V=plan.state_rows_v,
               EMULATE=emulate, SEGMENTED=plan.sequence_parallel, num_warps=plan.recurrence_warps,
               num_stages=plan.recurrence_stages)


def launch_transitions(plan, ws, initial_state, emulate, open_entry=False):
    """Launch :func:`transition_kernel`, or its Gluon form where :func:`warpgroup_runs`, over
    ``plan.transition_grid`` (sequence parallelism's first phase, under the plan's ``transitions_in_order`` on the
    rows the recurrence's order puts first; with ``open_entry``, every segment's, none from ``initial_state``)."""
    args = (ws.bf16, ws.fp32, ws.layout.kg, ws.layout.scratch, ws.layout.transitions, ws.layout.order,
            initial_state if initial_state is not None else ws.fp32, ws.cu_seqlens if plan.varlen else ws.fp32,
            plan.seq_len, plan.num_seqs, ws.v, ws.v.stride(1), plan.segment_chunks)
    ordered = plan.transitions_in_order and not open_entry  # open entry maps the last segments too: every row
    constexprs = dict(H=plan.heads, K=plan.key_dim, V=plan.value_dim, BV=plan.transition_width, C=plan.chunk,
                      IS_VARLEN=plan.varlen, HAS_INITIAL=initial_state is not None, OPEN_ENTRY=open_entry,
                      LONGEST_FIRST=ordered)
    grid = plan.transition_grid if ordered else (*plan.transition_grid[:2], plan.segment_programs)
    if warpgroup_runs(plan.warpgroup_transition, ws, emulate):
        from .recurrence_warpgroup import warpgroup_transition_kernel
        launch(warpgroup_transition_kernel, grid, *args, **constexprs, STAGES=plan.transition_stages,
               num_warps=plan.transition_warps)
    else:
        launch(transition_kernel, grid, *args, **constexprs, STATE_ROWS_V=plan.transition_rows_v, EMULATE=emulate,
               num_warps=plan.transition_warps, num_stages=plan.transition_stages)

"""Preparation, second kernel: the in-chunk inverse ``T = (I + β·L)⁻¹``, stored as T·diag(β) over the scratch
(:func:`invert_chunk`, which the first kernel calls at its end instead under the plan's ``inverse_in_prepare``).

One program per (chunk slot, head), on few warps: its products are 16×16 blocks, which more warps would only
replicate. T is formed by blocks from the β·L scratch of the first kernel: the diagonal blocks' inverses by
``(I − L)(I + L²)(I + L⁴)(I + L⁸)`` (L is strictly lower, so nilpotent), then ``T10 = −T11·L10·T00``. Neither w
nor u is formed: the recurrence takes T·diag(β) with kd and v (``recurrence.py``).

Under the plan's ``horner_inverse`` (tf32 products only), a diagonal block whose entries are all at most 1 in size
(so with normalised keys, β ≤ 1 and decays ≤ 1) is inverted by Horner's rule instead, ``X ← I − X·L`` fourteen
times, with fp16 operands and fp32 sums: each product's left operand is the last one's sum, which an fp16 product
takes where it lies, and its right one is ``−L``, laid out once, so the loop changes no layout (the series changes
two operands' a step, in shuffles: most of its instructions). fp16 keeps tf32's 10 mantissa bits, rounded to nearest
(entries below 2^-14 keep fewer, off by at most 2^-25), and no operand leaves its range: X is a partial sum of the
powers (−L)^m, an entry of which sums at most 2^14 paths of products of entries ≤ 1. Other blocks (larger entries,
NaN) and T10, whose factors have no such bound, keep the series at the plan's precision.

Under the plan's ``longest_first`` it also writes the order in which the recurrence's programs take the sequences
(:func:`fastkda.ops.prefill.layout.write_longest_first`).
"""

import triton
import triton.language as tl

from ..common import launch
from ..tiles import load_lower, store_lower
from .inputs import beta_rows
from .layout import chunk_of_slot, preparation_program, write_longest_first


@triton.jit
def unit_lower_inverse_block(L, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
def unit_lower_inverse_horner_fp16(L, BC: tl.constexpr):
    """:func:`unit_lower_inverse_block` for an L whose entries are at most 1 in size, by Horner's rule:
    ``X ← I − X·L`` from ``X = I − L``, BC − 2 times (L^BC = 0, so the last X is the inverse), in fp16 operands with
    fp32 sums (the module docstring says why nothing leaves fp16's range). Each product's left operand is the last
    one's sum, which an fp16 product takes in place, and its right one ``−L``, laid out once: no layout change in
    the loop, where the product form changes the layout of two of its operands a step."""
    cb = tl.arange(0, BC)
    eye = tl.where(cb[:, None] == cb[None, :], 1.0, 0.0)
    minus_L = (-L).to(tl.float16)
    X = eye - L
    for _ in tl.static_range(BC - 2):
        X = tl.dot(X.to(tl.float16), minus_L, eye)
    return X


@triton.jit
def diagonal_inverses(L00, L11, BC: tl.constexpr, DOT_PRECISION: tl.constexpr, HORNER: tl.constexpr):
    """The inverses of ``I + L00`` and ``I + L11``: under ``HORNER``, by Horner's rule in fp16 operands where the
    module docstring allows it; else by the series at the plan's precision."""
    if HORNER:
        # entries past 1 in size, NaN included (it fails the comparison; a max would skip it on the GPU)
        outside = tl.sum(tl.where(tl.abs(L00) <= 1.0, 0, 1)) + tl.sum(tl.where(tl.abs(L11) <= 1.0, 0, 1))
        if outside == 0:
            T00 = unit_lower_inverse_horner_fp16(L00, BC)
            T11 = unit_lower_inverse_horner_fp16(L11, BC)
        else:
            T00 = unit_lower_inverse_block(L00, BC, DOT_PRECISION)
            T11 = unit_lower_inverse_block(L11, BC, DOT_PRECISION)
    else:
        T00 = unit_lower_inverse_block(L00, BC, DOT_PRECISION)
        T11 = unit_lower_inverse_block(L11, BC, DOT_PRECISION)
    return T00, T11


@triton.jit
def mm(a, b, DOT_PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def invert_chunk(
    slot, h, slots, beta, cu_seqlens, errors, ws_fp32, scratch_at, order_at, order_count, segment_chunks,
    stride_beta_tok, stride_beta_head, seq_len, num_seqs, H, C: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    SEGMENTED: tl.constexpr, EQUAL_ROWS: tl.constexpr, HORNER: tl.constexpr,
):
    """Chunk slot ``slot`` of head ``h``: T from the scratch's 16×16 blocks (diagonal ones strictly lower), then
    T·diag(β) over the scratch (module docstring); under ``LONGEST_FIRST`` the chunk slots of head 0 also place the
    recurrence's program rows ``slot``, ``slot + slots``, ... below ``order_count`` in its order (``slots``: the
    chunk slots, :func:`fastkda.ops.prefill.layout.preparation_program`). Under
    ``EQUAL_ROWS`` (a varlen call run as rows: the plan's ``equal_rows``) each row's first chunk of head 0 counts
    the row's sequence in ``errors`` if its ``cu_seqlens`` entries are not the row's. The body of
    :func:`solve_kernel`, and the tail of the first kernel under the plan's ``inverse_in_prepare``."""
    if EQUAL_ROWS:
        if h == 0:
            row_slots = tl.cdiv(seq_len, C)
            if slot % row_slots == 0:  # fastkda.errors: "cu_seqlens", once per sequence
                n = slot // row_slots
                start = tl.load(cu_seqlens + n)
                end = tl.load(cu_seqlens + n + 1)
                tl.atomic_add(errors + 2, 1, mask=(start != n * seq_len) | (end - start != seq_len), sem="relaxed")
    chunk_start, eos = chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    cb = tl.arange(0, BC)
    rows0 = cb  # the rows of the chunk's two blocks, counted from its first token
    rows1 = rows0 + BC
    ok0 = rows0 < eos - chunk_start
    ok1 = rows1 < eos - chunk_start
    row0 = chunk_start.to(tl.int64)  # 64-bit base pointers per program, 32-bit offsets inside the chunk
    L_c = ws_fp32 + scratch_at + row0 * (H * C) + h * C
    beta_c = beta + row0 * stride_beta_tok + h * stride_beta_head
    L00 = load_lower(L_c, rows0, ok0, rows0, cb, H * C)
    L10 = load_lower(L_c, rows1, ok1, rows1, cb, H * C)
    L11 = load_lower(L_c, rows1, ok1, rows1, BC + cb, H * C)
    b0 = beta_rows(beta_c, rows0, ok0, stride_beta_tok, BETA_SIGMOID)
    b1 = beta_rows(beta_c, rows1, ok1, stride_beta_tok, BETA_SIGMOID)
    T00, T11 = diagonal_inverses(L00, L11, BC, DOT_PRECISION, HORNER)
    T10 = -mm(T11, mm(L10, T00, DOT_PRECISION), DOT_PRECISION)
    tl.debug_barrier()  # every thread's L loaded before any T overwrites it
    # the upper-right block (rows 0.., columns BC..) lies past the diagonal's sectors: no kernel reads it
    store_lower(L_c, rows0, ok0, rows0, cb, H * C, T00 * b0[None, :], EMULATE)
    store_lower(L_c, rows1, ok1, rows1, cb, H * C, T10 * b0[None, :], EMULATE)
    store_lower(L_c, rows1, ok1, rows1, BC + cb, H * C, T11 * b1[None, :], EMULATE)
    if LONGEST_FIRST:
        if h == 0:
            for z in range(slot, order_count, slots):
                write_longest_first(ws_fp32, order_at, cu_seqlens, z, order_count, seq_len, num_seqs,
                                    segment_chunks, C, SEGMENTED)


@triton.jit(do_not_specialize=["H"])  # one compile for every head count
def solve_kernel(
    beta, cu_seqlens, errors, ws_fp32, scratch_at, order_at, order_count, segment_chunks, stride_beta_tok,
    stride_beta_head, seq_len, num_seqs, H, C: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    SEGMENTED: tl.constexpr, EQUAL_ROWS: tl.constexpr, HORNER: tl.constexpr, EARLY_CHUNKS_LAST: tl.constexpr,
):
    """One (chunk slot, head) (:func:`fastkda.ops.prefill.layout.preparation_program`): :func:`invert_chunk`."""
    slot, h, slots = preparation_program(seq_len, num_seqs, H, C, IS_VARLEN, EARLY_CHUNKS_LAST)
    invert_chunk(slot, h, slots, beta, cu_seqlens, errors, ws_fp32, scratch_at, order_at,
                 order_count, segment_chunks, stride_beta_tok, stride_beta_head, seq_len, num_seqs, H, C, BC,
                 IS_VARLEN, BETA_SIGMOID, DOT_PRECISION, EMULATE, LONGEST_FIRST, SEGMENTED, EQUAL_ROWS, HORNER)


def inverse_arguments(plan, ws, errors):
    """The runtime arguments of :func:`invert_chunk` that only it takes (``errors``, where the plan's
    ``equal_rows`` checks the rows; the ``order`` section, its length and the segment length, for its
    ``longest_first``) and its own constexprs, for the launch of :func:`solve_kernel` or of the first kernel under
    the plan's ``inverse_in_prepare``."""
    runtime = (errors if plan.equal_rows else ws.fp32, ws.layout.order, plan.program_rows, plan.segment_chunks)
    constants = dict(LONGEST_FIRST=plan.longest_first, SEGMENTED=plan.sequence_parallel, EQUAL_ROWS=plan.equal_rows,
                     HORNER=plan.horner_inverse)
    return runtime, constants


def offsets_argument(plan, ws):
    """``cu_seqlens`` where a kernel of the preparation reads it (varlen chunk slots, or :func:`invert_chunk`'s
    check of the rows under ``equal_rows``), else the fp32 workspace, which stands for it unread."""
    return ws.cu_seqlens if plan.varlen or plan.equal_rows else ws.fp32


def launch_solve(plan, ws, beta, use_beta_sigmoid, errors, emulate):
    """Launch :func:`solve_kernel` over the plan's grid on the workspace ``ws`` (and, under the plan's
    ``longest_first``, its ``order`` section); under its ``equal_rows``, ``cu_seqlens`` that disagree with the rows
    are counted in ``errors``."""
    (errors_or_absent, order_at, order_count, segment_chunks), constants = inverse_arguments(plan, ws, errors)
    launch(
        solve_kernel, plan.prepare_grid,
        beta, offsets_argument(plan, ws), errors_or_absent, ws.fp32, ws.layout.scratch, order_at, order_count,
        segment_chunks, beta.stride(1), beta.stride(2), plan.seq_len, plan.num_seqs, plan.heads,
        C=plan.chunk, BC=plan.block, IS_VARLEN=plan.varlen, BETA_SIGMOID=use_beta_sigmoid,
        DOT_PRECISION=plan.dot_precision, EMULATE=emulate, **constants, EARLY_CHUNKS_LAST=plan.early_chunks_last,
        num_warps=plan.solve_warps, num_stages=plan.solve_stages, maxnreg=plan.solve_registers or None,
    )

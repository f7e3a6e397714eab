"""The scan over each sequence's segments (sequence parallelism, ``docs/sequence-parallel.md`` §1, §4.4).

The transition kernel (``recurrence.py`` with ``TRANSITION``) leaves, for every segment j but a sequence's last,
its exit from a zero state ``ℬ_j`` and its transition ``𝒜_j`` (the exit of the identity columns), the first
segment's exit from the sequence's initial state (its true exit). The first segment's entry is the initial state
itself, copied here for a sequence of several segments, so that their rerun never reads ``initial_state`` (which
may be the final state's buffer, written by the last segment). Segments compose as affine maps, so the entry
state of segment j + 1 is ``S_{j+1} = 𝒜_j·S_j + ℬ_j``, walked here in segment order: one program per (slice of
the plan's ``scan_width`` state columns, head, sequence). In the state's ``[v, k]`` layout the step is
``S_{j+1}[v, :] = S_j[v, :]·𝒜_jᵀ + ℬ_j[v, :]``, and the stored transition rows are ``𝒜_jᵀ`` already. The state
stays fp32; the products run at the plan's ``dot_precision``. The scan goes in segment order, and each state row
is its own product's row, so an entry state depends only on the segments before it, in one order, whatever the
plan's slices and scan width (a wider program loads each transition once for more rows: fewer programs, more
work a step).

It also counts malformed ``cu_seqlens`` (:mod:`fastkda.errors`), once per sequence, as the serial recurrence does.
Under the plan's ``transitions_in_order`` (``ORDERED``) the transition kernel ran only the first ``run_rows`` rows
of the recurrence's order, which hold every segment with a transition on valid offsets; on offsets outside the
contract (overlapping spans) more segments can need one than that, and a segment whose row ranks past them (the
ranks are in the order section) is read as zero rather than as a transition never written. That covers what the
cut adds, not every malformed case: where offsets are out of order, the kernels' slot-to-sequence lookups can
disagree, so a slot's transition may go unwritten in any grid (the known gap of ``tests/ops/test_safety_kernels.py``).
Under the plan's ``rerun_in_order`` the rerun runs only the order's first ``rerun_rows`` rows, likewise every
segment with work on valid offsets; on overlapping spans a sequence's first or last segment can rank past them,
and then no rerun program would write its final state, so the scan writes it (``FINAL_FALLBACK``: its initial
state, or zeros, as unspecified as :mod:`fastkda.errors` says of such offsets, but written). Only the last segment
can rank so: a sequence of several segments has the most work a first segment can have, and only the first
segments of the sequences before it rank before it, so it stays inside the N + T // segment_tokens rows. The rank
is one load, independent of the walk.

Under the plan's ``scan_in_order`` (``IN_ORDER``) the grid's rows are the order's first ``scan_rows`` places
rather than every sequence: in a batch of many short sequences most scan programs would only count errors, and
each holds the shared memory of a transition while it does (three programs an SM), so they queue behind one
another. A place holding a sequence's first segment row walks that sequence; on valid offsets every sequence of
several segments is there: its first segment has the largest key of the order, equal work ranks in grid order, so
only the first rows of the sequences of several before it rank ahead of it, and there are fewer than ``min(N, T //
segment_tokens)`` of those. The duties every sequence has (the error count, the fallback above, and on
malformed offsets the walk of a sequence of several whose first row ranks past the places: the ranks are a
permutation, so each such sequence is walked once, and no entry the rerun reads is left unwritten) are taken by
program p for the sequences p, p + P, ... (P places), as vectors of :data:`DUTY_LANES` sequences (two loads in
series a round, after the walk), the malformed offsets' work behind one branch.

With ``OPEN_ENTRY`` (a prefill whose entry state comes later, :func:`fastkda.ops.prefill.open_entry_transitions`)
the transition kernel has left every segment's map, the first's and the last's too, and the scan applies all of
them from the first segment's entry. Twice: ``COMPOSE``, before the entry is known, walks V + K rows from the
entry ``[0; I]`` (the identity rows take the maps' linear part alone) and writes the exit, ``[ℬᵀ; 𝒜ᵀ]`` of the
whole sequence; then, given the entry state (``initial_state``), it writes every segment's entry for the rerun.
Both take their products as three tf32 products of split operands (``"tf32x3"``, about fp32's accuracy on the
tensor cores), whatever the plan's ``dot_precision``: there the entry state, which dominates the exit of a part
deep in a long sequence, passes through every segment's map, and one tf32 product's 10-bit operands cost about
1e-3 of it, where fp32 FMA products ("ieee") cost 11% of a 1M-token part's time (docs/perf-notes.md, "Context
parallelism in one pass").
"""

import triton
import triton.language as tl

from ..common import launch
from ..tiles import tile_offsets
from .layout import entry_state, first_slot, program_ranks, segment_exit, sequence_order, sequence_span


DUTY_LANES = tl.constexpr(16)  # sequences whose per-sequence duties an in-order scan program takes in one round


@triton.jit
def initial_rows(initial_state, n, h, rows, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, SW: tl.constexpr,
                 HAS_INITIAL: tl.constexpr):
    """The ``[SW, K]`` rows ``rows`` of sequence n's initial state (fp32), or zeros."""
    if HAS_INITIAL:
        return tl.load(initial_state + ((n * H + h) * V).to(tl.int64) * K + rows).to(tl.float32)
    else:
        return tl.zeros((SW, K), dtype=tl.float32)


@triton.jit
def transition_ran(ws_fp32, order_at, order_count, run_rows, row, ORDERED: tl.constexpr):
    """Whether the transition kernel ran segment program ``row``: always, or under ``ORDERED`` if its rank in the
    recurrence's order (stored after the ``order_count`` places) is below ``run_rows`` (module docstring)."""
    if ORDERED:
        return tl.load(program_ranks(ws_fp32, order_at, order_count) + row) < run_rows
    return row >= 0  # a tensor, as a load's mask takes it


@triton.jit
def rerun_left_out(ws_fp32, order_at, order_count, rerun_rows, row):
    """Whether the rerun's grid (the order's first ``rerun_rows`` places) leaves segment program ``row`` out: its
    rank (stored after the ``order_count`` places) is past them."""
    return tl.load(program_ranks(ws_fp32, order_at, order_count) + row) >= rerun_rows


@triton.jit
def walk_entries(ws_fp32, transitions_at, entries_at, order_at, initial_state, n, h, first, segments, rows, matrix,
                 num_seqs, order_count, run_rows, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 SW: tl.constexpr, HAS_INITIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, ORDERED: tl.constexpr):
    """The entry states of the ``segments`` (> 1) segments of sequence ``n`` from slot ``first``, rows ``rows``
    of head ``h``: the first segment's is the initial state, each next one the previous one's map applied to it."""
    S = initial_rows(initial_state, n, h, rows, H, V, K, SW, HAS_INITIAL)
    tl.store(entry_state(ws_fp32, entries_at, first, h, H, V, K) + rows, S)
    ran = transition_ran(ws_fp32, order_at, order_count, run_rows, n, ORDERED)  # the first segment's row: n
    S = tl.load(segment_exit(ws_fp32, transitions_at, first, h, H, V, K) + rows, mask=ran, other=0.0)
    for j in range(1, segments):  # no branch in the loop, so that Triton prefetches the next transition
        slot = first + j
        tl.store(entry_state(ws_fp32, entries_at, slot, h, H, V, K) + rows, S)
        exits = segment_exit(ws_fp32, transitions_at, slot, h, H, V, K)
        ran = transition_ran(ws_fp32, order_at, order_count, run_rows, num_seqs + slot, ORDERED)
        # after the last segment's entry this reads its slot's unwritten transition: in the buffer, unused
        S = (tl.dot(S, tl.load(exits + matrix, mask=ran, other=0.0), input_precision=DOT_PRECISION)
             + tl.load(exits + rows, mask=ran, other=0.0))


@triton.jit
def sequence_segments(cu_seqlens, n, seq_len, num_seqs, segment_chunks, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence ``n``'s segment count, first segment slot, and whether its ``cu_seqlens`` entries are in order."""
    bos, eos, in_order = sequence_span(cu_seqlens, n, seq_len, num_seqs, IS_VARLEN)
    segments = tl.cdiv(tl.cdiv(eos - bos, C), segment_chunks)
    return segments, first_slot(n, bos, seq_len, C * segment_chunks, IS_VARLEN), in_order


@triton.jit
def last_segment_row(n, first, segments, num_seqs):
    """The order's row of sequence ``n``'s last segment (``n`` may be a vector): ``n`` itself, its first segment's,
    or that of its last segment slot (its first segment's row n ranks inside the rerun's rows whenever it has
    several: no row ranks before it but rows m < n)."""
    return tl.where(segments > 1, num_seqs + first + segments - 1, n)


@triton.jit
def write_final_fallback(ws_fp32, order_at, initial_state, final_state, n, h, first, segments, rows, num_seqs,
                         order_count, rerun_rows, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         SW: tl.constexpr, HAS_INITIAL: tl.constexpr):
    """Sequence ``n``'s final state rows ``rows`` of head ``h`` (its initial state, or zeros) where the rerun's
    grid leaves its last segment's row out (module docstring)."""
    if rerun_left_out(ws_fp32, order_at, order_count, rerun_rows, last_segment_row(n, first, segments, num_seqs)):
        tl.store(final_state + ((n * H + h) * V).to(tl.int64) * K + rows,
                 initial_rows(initial_state, n, h, rows, H, V, K, SW, HAS_INITIAL))


@triton.jit
def segment_scan_kernel(ws_fp32, transitions_at, entries_at, order_at, initial_state, exit_maps, final_state,
                        cu_seqlens, errors, seq_len, num_seqs, segment_chunks, order_count, run_rows, rerun_rows,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SW: tl.constexpr, C: tl.constexpr,
                        IS_VARLEN: tl.constexpr, HAS_INITIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        OPEN_ENTRY: tl.constexpr, COMPOSE: tl.constexpr, ORDERED: tl.constexpr,
                        FINAL_FALLBACK: tl.constexpr, IN_ORDER: tl.constexpr):
    """One (row slice, head, sequence): the entry state of each of the sequence's segments after the first; with
    ``OPEN_ENTRY`` of every segment, or (``COMPOSE``) the sequence's exit map into ``exit_maps [N, H, V + K, K]``.
    ``ORDERED``: a transition that the transition kernel did not run reads as zero; ``FINAL_FALLBACK``: the final
    state ``[N, H, V, K]`` of a sequence that the rerun's grid leaves without a writer; ``IN_ORDER``: one (row
    slice, head, place p of the order's first ones) instead, and the sequences p, p + P, ... (module docstring)."""
    vs = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    rr = vs * SW + tl.arange(0, SW)
    kk = tl.arange(0, K)
    rows = tile_offsets(rr, kk, K, 1)  # [SW, K] of a state's [v, k] (COMPOSE: of the V + K rows)
    matrix = tile_offsets(V + kk, kk, K, 1)  # the transition's rows, 𝒜ᵀ [K, K]
    if IN_ORDER:
        places = tl.num_programs(2)
        row = tl.load(sequence_order(ws_fp32, order_at) + p)
        if row < num_seqs:  # a sequence's first segment: on valid offsets, every sequence of several is here
            segments, first, _ = sequence_segments(cu_seqlens, row, seq_len, num_seqs, segment_chunks, C,
                                                   IS_VARLEN)
            if segments > 1:
                walk_entries(ws_fp32, transitions_at, entries_at, order_at, initial_state, row, h, first, segments,
                             rows, matrix, num_seqs, order_count, run_rows, H, K, V, SW, HAS_INITIAL,
                             DOT_PRECISION, ORDERED)
        # every sequence's other duties, for the sequences p, p + P, ...: DUTY_LANES of them a round, each round two
        # loads in series (offsets, then ranks), the rare work of malformed offsets behind one branch
        ranks = program_ranks(ws_fp32, order_at, order_count)
        lanes = tl.arange(0, DUTY_LANES)
        for base in range(p, num_seqs, places * DUTY_LANES):
            inside = base + places * lanes < num_seqs
            n = tl.where(inside, base + places * lanes, 0)
            segments, first, in_order = sequence_segments(cu_seqlens, n, seq_len, num_seqs, segment_chunks, C,
                                                          IS_VARLEN)
            rare = inside & (segments > 1) & (tl.load(ranks + n, mask=inside, other=0) >= places)  # unwalked
            if FINAL_FALLBACK:
                last_row = last_segment_row(n, first, segments, num_seqs)
                rare = rare | (inside & (tl.load(ranks + last_row, mask=inside, other=0) >= rerun_rows))
            if IS_VARLEN:  # fastkda.errors: "cu_seqlens", once per sequence
                malformed = tl.sum((inside & ~in_order).to(tl.int32), axis=0)
                tl.atomic_add(errors + 2, malformed, mask=(vs == 0) & (h == 0) & (malformed > 0), sem="relaxed")
            if tl.max(rare.to(tl.int32), axis=0) > 0:  # malformed offsets only: one sequence at a time
                for i in range(0, DUTY_LANES):
                    m = base + places * i
                    if m < num_seqs:
                        segments_m, first_m, _ = sequence_segments(cu_seqlens, m, seq_len, num_seqs,
                                                                   segment_chunks, C, IS_VARLEN)
                        if FINAL_FALLBACK:
                            write_final_fallback(ws_fp32, order_at, initial_state, final_state, m, h, first_m,
                                                 segments_m, rows, num_seqs, order_count, rerun_rows, H, K, V, SW,
                                                 HAS_INITIAL)
                        if segments_m > 1:  # a first row ranked past the places: walked here
                            if tl.load(ranks + m) >= places:
                                walk_entries(ws_fp32, transitions_at, entries_at, order_at, initial_state, m, h,
                                             first_m, segments_m, rows, matrix, num_seqs, order_count, run_rows,
                                             H, K, V, SW, HAS_INITIAL, DOT_PRECISION, ORDERED)
    else:
        n = p
        segments, first, in_order = sequence_segments(cu_seqlens, n, seq_len, num_seqs, segment_chunks, C,
                                                      IS_VARLEN)
        if FINAL_FALLBACK:
            write_final_fallback(ws_fp32, order_at, initial_state, final_state, n, h, first, segments, rows,
                                 num_seqs, order_count, rerun_rows, H, K, V, SW, HAS_INITIAL)
        if OPEN_ENTRY:
            if COMPOSE:  # the entry [0; I]: value rows from zero, identity rows
                S = tl.where(rr[:, None] - V == kk[None, :], 1.0, 0.0)
            else:
                S = initial_rows(initial_state, n, h, rows, H, V, K, SW, HAS_INITIAL)
            for j in range(0, segments):
                slot = first + j
                if not COMPOSE:
                    tl.store(entry_state(ws_fp32, entries_at, slot, h, H, V, K) + rows, S)
                maps = segment_exit(ws_fp32, transitions_at, slot, h, H, V, K)
                S = (tl.dot(S, tl.load(maps + matrix), input_precision=DOT_PRECISION)
                     + tl.load(maps + rows, mask=rr[:, None] < V, other=0.0))  # the identity rows: the linear part
            if COMPOSE:
                tl.store(exit_maps + ((n * H + h) * (V + K)).to(tl.int64) * K + rows, S)
        elif segments > 1:  # (the rerun of a sequence of one segment reads the initial state itself)
            walk_entries(ws_fp32, transitions_at, entries_at, order_at, initial_state, n, h, first, segments, rows,
                         matrix, num_seqs, order_count, run_rows, H, K, V, SW, HAS_INITIAL, DOT_PRECISION, ORDERED)
        if IS_VARLEN and not COMPOSE:  # fastkda.errors: "cu_seqlens", once per sequence
            tl.atomic_add(errors + 2, 1, mask=(vs == 0) & (h == 0) & ~in_order, sem="relaxed")


def launch_scan(plan, ws, initial_state, errors, final_state=None, open_entry=False, exit_maps=None):
    """Launch :func:`segment_scan_kernel` between the transitions and the rerun, over the plan's ``scan_grid`` (and,
    under the plan's ``rerun_in_order``, the fallback into ``final_state`` if given); with ``open_entry``, over
    every segment's map (:func:`fastkda.ops.prefill.open_entry_transitions`), and given ``exit_maps [N, H, V + K,
    K]`` (fp32, contiguous), composing them into it over V + K rows instead; both over every sequence."""
    layout = ws.layout
    compose = exit_maps is not None
    open_form = open_entry or compose  # every segment's map, the last's too: none left out of the transitions
    precision = "tf32x3" if open_form else plan.dot_precision  # the module docstring says why
    in_order = plan.scan_in_order and not open_form
    rows = plan.value_dim + plan.key_dim if compose else plan.value_dim
    grid = (rows // plan.scan_width, plan.heads, plan.scan_rows if in_order else plan.num_seqs)
    launch(segment_scan_kernel, grid, ws.fp32, layout.transitions, layout.entries, layout.order,
           initial_state if initial_state is not None else ws.fp32, exit_maps if compose else ws.fp32,
           final_state if final_state is not None else ws.fp32, ws.cu_seqlens if plan.varlen else ws.fp32, errors,
           plan.seq_len, plan.num_seqs, plan.segment_chunks, plan.program_rows, plan.transition_rows,
           plan.rerun_rows, H=plan.heads, K=plan.key_dim, V=plan.value_dim, SW=plan.scan_width, C=plan.chunk,
           IS_VARLEN=plan.varlen, HAS_INITIAL=initial_state is not None, DOT_PRECISION=precision,
           OPEN_ENTRY=open_form, COMPOSE=compose, ORDERED=plan.transitions_in_order and not open_form,
           FINAL_FALLBACK=plan.rerun_in_order and final_state is not None and not open_form, IN_ORDER=in_order,
           num_warps=plan.scan_warps, num_stages=plan.scan_stages)

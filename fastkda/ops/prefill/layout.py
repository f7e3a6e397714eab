"""Where the prefill's chunks and workspace live: the one definition both the host and the kernels use.

Chunk slots. The preparation runs one program per (chunk slot, head). Sequence ``n`` owns ``ceil(len_n / C)``
consecutive slots from ``n · ceil(T / C)`` (fixed length, ``B`` rows of ``T`` tokens) or from
``cu_seqlens[n] // C + n`` (varlen, one row): the varlen formula never lets two sequences share a slot and needs
no prefix sum, so every kernel finds a slot's chunk from ``cu_seqlens`` alone, with no host-device
synchronisation. Slots past the end of their sequence are empty chunks. The host side of this layout is
:attr:`fastkda.plan.PrefillPlan.chunk_slots`.

Whatever ``cu_seqlens`` holds on the device, no kernel leaves its buffers: every span is clamped into ``[0, T]``
with its end at or after its start (:func:`sequence_span`), which keeps every token row below T and every slot
below ``chunk_slots``, and a slot its sequence does not own is an empty chunk. Only valid offsets (0 first, T last,
nondecreasing) give meaningful results; the recurrence counts the others (:mod:`fastkda.errors`).

Workspace (:class:`Workspace`). What the preparation writes for the recurrence, in one bf16 and one fp32 buffer
(one allocation per dtype: an eager call's host time counts). Per (token, head) row, the row index being
``token · H + head``:

=========  =====  ==============  ======================================================================
section    dtype  per row         holds
=========  =====  ==============  ======================================================================
``kd``     bf16   K               kd = k̂·exp(G) (the recurrence forms T·β·(v − kd·S), never w = T·β·kd)
``qg``     bf16   K               qd = s·q̂·exp(G)
``kg``     bf16   K               kr = k̂·exp(G_C − G)
``A``      bf16   C               M = lower_incl(qd·kiᵀ)
``scratch`` fp32  C               β·L from the first kernel; T·diag(β) from the solve kernel (or the first)
=========  =====  ==============  ======================================================================

and per (chunk slot, head), the fp32 chunk decay ``decay = exp(G_C)`` (K values) at the start of the fp32 buffer.
Under sequence parallelism the fp32 buffer then has two sections per (segment slot, head), rows of K values
laid out as a state ``[v, k]``: ``transitions`` (V + K rows: the segment's exit state from a zero state, then the
exit of the K identity columns, i.e. its transition matrix) and ``entries`` (V rows: the segment's entry state).
Segment slots are laid out as the chunk slots are, with segments in place of chunks. Last, ``order`` (two int32
per recurrence program row, in fp32 slots): under the plan's ``longest_first``, those rows (sequences, or under
sequence parallelism segment programs) from the most work down, then each row's rank in that order, which the solve
kernel writes (the first kernel under the plan's ``inverse_in_prepare``; :func:`write_longest_first`) and the
recurrence's programs take in turn (under the plan's ``transitions_in_order`` the transition kernel's too, and the
scan reads the ranks).
Kernels receive the two buffers and each section's element offset (:class:`Workspace` fields); they address
rows from their chunk's first token.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def sequence_span(cu_seqlens, n, seq_len, num_seqs, IS_VARLEN: tl.constexpr):
    """First and one-past-last flattened token of sequence ``n``, and whether its ``cu_seqlens`` entries are as the
    contract says (in ``[0, T]``, in order, 0 first and T last; varlen: ``seq_len`` is the row's T; the span is
    clamped as the module docstring says)."""
    if IS_VARLEN:
        start = tl.load(cu_seqlens + n)
        end = tl.load(cu_seqlens + n + 1)
        in_order = ((start >= 0) & (start <= end) & (end <= seq_len) & ((n > 0) | (start == 0))
                    & ((n < num_seqs - 1) | (end == seq_len)))
        bos = tl.minimum(tl.maximum(start, 0), seq_len).to(tl.int32)
        eos = tl.minimum(tl.maximum(end, bos), seq_len).to(tl.int32)
    else:
        bos = n * seq_len
        eos = bos + seq_len
        in_order = True
    return bos, eos, in_order


@triton.jit
def first_slot(n, bos, seq_len, tokens, IS_VARLEN: tl.constexpr):
    """Slot of sequence ``n``'s first chunk, or first segment, for slots of ``tokens`` tokens (a chunk or a
    segment; see the module docstring)."""
    if IS_VARLEN:
        return bos // tokens + n
    else:
        return n * tl.cdiv(seq_len, tokens)


OWNER_LOOKUP_WIDTH = tl.constexpr(64)  # sequences whose first slots one load covers (beyond: a binary search)


@triton.jit
def sequence_of_slot(slot, cu_seqlens, seq_len, num_seqs, tokens, IS_VARLEN: tl.constexpr):
    """The sequence a slot of ``tokens`` tokens belongs to: varlen, the last whose first slot is <= slot.

    Up to :data:`OWNER_LOOKUP_WIDTH` sequences, one load of every first slot and a count of those <= slot: one
    round trip to memory before the kernel's own loads, where a binary search takes log2 N dependent ones. The
    first slots grow strictly with n for valid offsets, so the count is the search's answer; for any offsets it
    is a sequence index in ``[0, N)``, as the search's is."""
    return sequence_of_slot_with(tl.arange(0, OWNER_LOOKUP_WIDTH), slot, cu_seqlens, seq_len, num_seqs, tokens,
                                 IS_VARLEN)


@triton.jit
def sequence_of_slot_with(lanes, slot, cu_seqlens, seq_len, num_seqs, tokens, IS_VARLEN: tl.constexpr):
    """:func:`sequence_of_slot` with its lookup's lanes given: ``tl.arange(0, OWNER_LOOKUP_WIDTH)`` in the
    caller's layout (a Gluon kernel's tensors need one)."""
    if IS_VARLEN:
        lo = 0
        if num_seqs <= OWNER_LOOKUP_WIDTH:
            if num_seqs > 1:
                n = lanes
                inside = n < num_seqs
                firsts = tl.load(cu_seqlens + n, mask=inside, other=0).to(tl.int32) // tokens + n
                lo = tl.maximum(tl.sum((inside & (firsts <= slot)).to(tl.int32), axis=0) - 1, 0)
        else:
            hi = num_seqs - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if tl.load(cu_seqlens + mid).to(tl.int32) // tokens + mid <= slot:
                    lo = mid
                else:
                    hi = mid - 1
        return lo
    else:
        return slot // tl.cdiv(seq_len, tokens)


@triton.jit
def chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token of chunk ``slot`` and one past its sequence's last token (a slot past the end of its
    sequence gives an empty chunk)."""
    n = sequence_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    bos, eos, _ = sequence_span(cu_seqlens, n, seq_len, num_seqs, IS_VARLEN)
    first = first_slot(n, bos, seq_len, C, IS_VARLEN)
    chunk_start = bos + (slot - first) * C
    return chunk_start, tl.where(slot >= first, eos, chunk_start)  # a slot before its sequence's: an empty chunk


@triton.jit
def preparation_program(seq_len, num_seqs, H, C: tl.constexpr, IS_VARLEN: tl.constexpr,
                        EARLY_CHUNKS_LAST: tl.constexpr):
    """The (chunk slot, head) of this program of a preparation kernel (the plan's ``prepare_grid``) and the number
    of chunk slots: the grid's first two axes; under ``EARLY_CHUNKS_LAST`` (the plan's ``early_chunks_last``) one
    axis, heads innermost, from the last chunk slots back to the first: rows a chunk of every row at a time (each
    row's first chunks are the last ones written), a varlen batch slot by slot."""
    if EARLY_CHUNKS_LAST:
        program = tl.program_id(0)
        slots = tl.num_programs(0) // H
        rest = program // H
        if IS_VARLEN:
            slot = slots - 1 - rest
        else:
            row_slots = tl.cdiv(seq_len, C)
            slot = (rest % num_seqs) * row_slots + row_slots - 1 - rest // num_seqs
        return slot, program % H, slots
    return tl.program_id(0), tl.program_id(1), tl.num_programs(0)


@triton.jit
def clamped_spans(cu_seqlens, m, inside, seq_len):
    """First token and length of sequences ``m`` (a vector; ``inside`` masks it) as :func:`sequence_span` clamps
    their spans."""
    start = tl.load(cu_seqlens + m, mask=inside, other=0)
    end = tl.load(cu_seqlens + m + 1, mask=inside, other=0)
    bos = tl.minimum(tl.maximum(start, 0), seq_len).to(tl.int32)
    return bos, tl.minimum(tl.maximum(end, bos), seq_len).to(tl.int32) - bos


@triton.jit
def sequence_order(ws_fp32, order_at):
    """The workspace's ``order`` section as int32 (module docstring)."""
    return (ws_fp32 + order_at).to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def program_ranks(ws_fp32, order_at, count):
    """The ranks in the ``order`` section (int32): program row z's rank in the order of ``count`` places, stored
    after them (:func:`write_longest_first`)."""
    return sequence_order(ws_fp32, order_at) + count


@triton.jit
def program_keys(z, inside, cu_seqlens, seq_len, num_seqs, segment_chunks, C: tl.constexpr,
                 SEGMENTED: tl.constexpr):
    """The sort keys of recurrence programs ``z`` (a vector; ``inside`` masks it): twice their work, serial their
    sequence's tokens; under ``SEGMENTED`` their segment's chunks (programs 0..N-1 each sequence's first segment,
    then one per segment slot, 0 for a slot that holds no later segment), as ``recurrence.program_chunks`` finds
    them, the slot's sequence by a binary search at every N (the order needs the same keys in every program, not
    the lookup's exact path), plus one for a segment that is not its sequence's last: among equal work, the
    segments with a transition first (:func:`write_longest_first`)."""
    if SEGMENTED:
        first = z < num_seqs
        tokens = C * segment_chunks
        slot = tl.maximum(z - num_seqs, 0)
        lo = tl.zeros_like(z)
        hi = lo + (num_seqs - 1)
        steps = 1
        width = 1
        while width < num_seqs:
            width *= 2
            steps += 1
        for _ in range(steps):  # the last sequence whose first slot is <= slot
            mid = (lo + hi + 1) // 2
            go = tl.load(cu_seqlens + mid, mask=inside, other=0).to(tl.int32) // tokens + mid <= slot
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        n = tl.where(first, z, lo)
    else:
        n = z
    bos, length = clamped_spans(cu_seqlens, n, inside, seq_len)
    if SEGMENTED:
        chunks = tl.cdiv(length, C)
        j = slot - (bos // tokens + n)
        later = tl.where((j > 0) & (j * segment_chunks < chunks),
                         tl.minimum(j * segment_chunks + segment_chunks, chunks) - j * segment_chunks, 0)
        length = tl.where(first, tl.minimum(chunks, segment_chunks), later)
        not_last = tl.where(first, chunks > segment_chunks, (j > 0) & ((j + 1) * segment_chunks < chunks))
        return tl.where(inside, 2 * length + not_last.to(tl.int32), 0)
    return tl.where(inside, 2 * length, 0)


@triton.jit
def write_longest_first(ws_fp32, order_at, cu_seqlens, z, count, seq_len, num_seqs, segment_chunks,
                        C: tl.constexpr, SEGMENTED: tl.constexpr):
    """Place recurrence program ``z`` of ``count`` in the ``order`` section, and its rank after the ``count``
    places: its rank when the programs are sorted by their work (:func:`program_keys`), the most first, among equal
    work the segments that are not their sequence's last first, ties in grid order. Every program ranks by the same
    keys, so the ranks of 0..count-1 are a permutation whatever ``cu_seqlens`` holds. Under sequence parallelism
    every segment with a transition (every one but its sequence's last) has ``segment_chunks`` chunks, the most a
    segment has, so those rank first: on valid offsets, where each holds ``C · segment_chunks`` tokens of its own,
    within the first ``T // (C · segment_chunks)`` places (the plan's ``transition_rows``)."""
    lanes = tl.arange(0, OWNER_LOOKUP_WIDTH)
    own = tl.sum(tl.where(lanes == 0, program_keys(z + 0 * lanes, lanes == 0, cu_seqlens, seq_len, num_seqs,
                                                   segment_chunks, C, SEGMENTED), 0), axis=0)
    rank = 0
    for first in range(0, count, OWNER_LOOKUP_WIDTH):
        m = first + lanes
        inside = m < count
        others = program_keys(m, inside, cu_seqlens, seq_len, num_seqs, segment_chunks, C, SEGMENTED)
        ahead = inside & ((others > own) | ((others == own) & (m < z)))
        rank += tl.sum(ahead.to(tl.int32), axis=0)
    tl.store(sequence_order(ws_fp32, order_at) + rank, z)
    tl.store(program_ranks(ws_fp32, order_at, count) + z, rank)


@triton.jit
def entry_state(ws_fp32, entries_at, slot, h, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr):
    """Pointer to the ``entries`` rows (``[V, K]``, fp32) of segment slot ``slot``, head ``h``."""
    return ws_fp32 + entries_at + ((slot * H + h) * V).to(tl.int64) * K


@triton.jit
def segment_exit(ws_fp32, transitions_at, slot, h, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr):
    """Pointer to the ``transitions`` rows (``[V + K, K]``, fp32: exit from zero, then the transition) of segment
    slot ``slot``, head ``h``."""
    return ws_fp32 + transitions_at + ((slot * H + h) * (V + K)).to(tl.int64) * K


@dataclass(frozen=True)
class WorkspaceLayout:
    """Element offsets of the workspace's sections (module docstring) and the two buffers' sizes."""

    qg: int
    kg: int
    A: int
    scratch: int
    transitions: int
    entries: int
    order: int
    bf16_elements: int
    fp32_elements: int


@functools.lru_cache(maxsize=4096)
def workspace_layout(rows: int, slots: int, heads: int, key_dim: int, value_dim: int, chunk: int,
                     segment_slots: int = 0, ordered_rows: int = 0) -> WorkspaceLayout:
    """The layout for ``rows`` (token, head) rows, ``slots`` chunk slots, ``segment_slots`` segment slots and
    ``ordered_rows`` recurrence program rows in the ``order`` section (``kd`` and ``decay`` at offset 0)."""
    qg = rows * key_dim
    kg = qg + rows * key_dim
    A = kg + rows * key_dim
    scratch = slots * heads * key_dim
    transitions = scratch + rows * chunk
    entries = transitions + segment_slots * heads * (value_dim + key_dim) * key_dim
    order = entries + segment_slots * heads * value_dim * key_dim
    return WorkspaceLayout(qg=qg, kg=kg, A=A, scratch=scratch, transitions=transitions, entries=entries,
                           order=order, bf16_elements=A + rows * chunk, fp32_elements=order + 2 * ordered_rows)


def plan_layout(plan) -> WorkspaceLayout:
    """The workspace layout of a prefill plan (its ``order`` section two entries per recurrence program row under
    ``longest_first``, else none)."""
    return workspace_layout(plan.batch * plan.seq_len * plan.heads, plan.chunk_slots, plan.heads, plan.key_dim,
                            plan.value_dim, plan.chunk, plan.segment_slots,
                            plan.program_rows if plan.longest_first else 0)


@dataclass
class Workspace:
    """The preparation's output for one call: the two buffers, their :class:`WorkspaceLayout`, and what the
    recurrence needs besides (``v``, ``cu_seqlens``)."""

    bf16: torch.Tensor
    fp32: torch.Tensor
    layout: WorkspaceLayout
    cu_seqlens: Optional[torch.Tensor]
    v: torch.Tensor

    @staticmethod
    def allocate(plan, v, cu_seqlens) -> "Workspace":
        layout = plan_layout(plan)
        return Workspace(bf16=torch.empty(layout.bf16_elements, dtype=torch.bfloat16, device=v.device),
                         fp32=torch.empty(layout.fp32_elements, dtype=torch.float32, device=v.device),
                         layout=layout, cu_seqlens=cu_seqlens, v=v)

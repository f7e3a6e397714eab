"""Launch plans: the one place that decides every number fastkda's kernels run with.

A plan is a pure function of host-known facts (sequences, heads, tokens, dimensions, gate mode and the GPU's SM
count), so a CUDA graph replays the plan it was captured with and no launch synchronises with the device. The API
makes one plan per call and hands it to the kernels whole (through the custom ops as a tuple of integers,
:meth:`PrefillPlan.launch_numbers`); nothing below the API decides a launch number again, except that under
torch.compile the custom op asks this module for the automatic plan of the sizes it runs on
(:func:`prefill_plan_request`). Sweeps and variants change a plan (:meth:`PrefillPlan.replace`) or the facts it is
made from, never module state.

Prefill (:class:`PrefillPlan`) runs three kernels (``fastkda/ops/prefill/``): a token-parallel preparation of
each chunk (``prepare``), the in-chunk inverse (``solve``), and the serial recurrence over chunks, one program per
(sequence, head, V-slice). No step of the recurrence reduces over the value dimension V, so V can be cut into
``v_slices`` slices, each program bitwise identical to the unsplit computation of its columns: the plan takes the
most slices whose programs still fit one per SM, so that few sequences of few heads use more of the GPU.
Decode (:class:`DecodePlan`) and the CPU path (``cpu_chunk``) are planned here too. The measurements behind each
choice are in ``docs/perf-notes.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

V_SLICE_CHOICES = (1, 2, 4)  # what the API accepts for ``v_slices``
ENV_V_SLICES = "FASTKDA_V_SLICES"
SUPPORTED_DIMS = (64, 128)  # key and value dimensions the kernels are built for
MIN_SLICE_WIDTH = 16  # a V-slice narrower than this cannot feed a tensor-core product
NARROW_SLICE_WIDTH = 64  # the auto plan never cuts V into slices narrower than this (a 32-wide step is the slower one)
CHUNK = 32  # tokens per serial step of the GPU recurrence
BLOCK = 16  # tokens per block of the in-chunk inverse (and the span of any decay factor the preparation forms)
CPU_CHUNK = 16  # tokens per step of the CPU path (its in-chunk decays are formed element-wise)
DECODE_SLICE_WIDTH = 16  # state columns per decode program
WARP_CHOICES = (1, 2, 4, 8, 16)
REGISTERS_PER_SM = 65536  # 32-bit registers of one SM's register file (sm_80 and sm_90 alike)
PREPARE_PROGRAMS_PER_SM = 3  # first preparation kernel programs an SM holds, by the register cap
PREPARE_TOKEN_RUN = 2  # consecutive tokens per thread in the first preparation kernel, at most (prepare_token_run)
WARPGROUP_STAGES = 4  # the Gluon kernels' ring of chunks in the automatic plan (the fewest they take); the
# transitions keep it (five measured 7-8% slower: two of their programs an SM no longer fit)
WARPGROUP_RECURRENCE_STAGES = {64: 5, 128: 4}  # the Gluon recurrence's ring by slice width: at 64 columns a fifth
# chunk fits (with an fp32 v) and measured 4.7-5.8% faster calls on an H100 (docs/perf-notes.md, "A ring of five
# chunks at 64 columns"); at 128 columns no fifth fits
WARPGROUP_SLICE_WIDTHS = (64, 128)  # the Gluon recurrence's slices: a warpgroup per 64 columns (the products' rows)
SHARED_MEMORY_PER_PROGRAM = 232448  # bytes of shared memory one program may take on sm_90 (227 KB)
SOLVE_WARPS = 1  # the inverse works in 16x16 blocks: one warp holds them, and more programs per SM hide latency
HORNER_PROGRAMS_PER_SM = 32  # (chunk, head) pairs an SM at most for Horner's rule (horner_inverse): in about one
# wave of solve programs a program's chain of layout changes is the kernel's time, past that its tensor-core products
ENV_SEQUENCE_PARALLEL = "FASTKDA_SEQUENCE_PARALLEL"
SCAN_WIDTH = 16  # state columns per program of the segment scan in every automatic plan (scan_width)
SCAN_WIDTHS = (16, 32, 64)  # the scan's widths a plan may take: rows of its products, 16 at least
MAX_SEGMENTS = 32  # segments of one sequence at most (each adds a step to the scan, and rounding to the state)
MIN_SEGMENT_CHUNKS = 4  # chunks per segment at least (shorter ones pay two launches for too little)
MIN_SP_CHAIN = 128  # chunks the longest possible sequence must have for the auto plan to cut it (measured: at 32
# and 64 chunks the segments gained 0-12% or lost 5-10%, within the step model's error)
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third axis (sequences, or segment programs)
SP_GAIN = 0.75  # segments only where the model predicts at least 25% off the serial recurrence: at two segments it
# is that far off (predicted 16% off at H12 N4/N5 T8192 and H64 B1 T8192, measured 10-11% slower at 420010d+refit)
# The step model behind the choice of segment length (docs/sequence-parallel.md §3.1; perf-notes "Recurrence"):
# the latency of one step of one program alone by slice width (µs), what a step costs per SM at full occupancy
# per 32 columns, the transition-only steps' share of a full step, a scan step, and the gap per kernel boundary.
# Refitted to the segment sweep at 420010d, after the reassociated step (docs/perf-notes.md, "Sequence parallelism").
STEP_LATENCY_US = {16: 1.5, 32: 1.5, 64: 1.3, 128: 1.3}
STEP_THROUGHPUT_US = 0.35
TRANSITION_SHARE = 0.55
SCAN_STEP_US = 4.0
LAUNCH_GAP_US = 2.5
TRANSITION_WIDTHS = (64,)  # the sweep's winner everywhere (128 columns: 1-6% slower)
RERUN_SLICE_CHOICES = (1, 2)  # slices of the rerun the auto plan weighs (64 columns and up)
DOT_PRECISION = "tf32"  # the kernels' fp32 products in every automatic plan
PLAN_REQUEST = -1  # the first of the launch numbers that ask a custom op to choose the automatic plan itself (a
# plan's own first number, its seq_len or num_seqs, is never negative)


def warpgroup_shared_bytes(width: int, key_dim: int, stages: int, chunk: int = 32, v_bytes: int = 4) -> int:
    """Shared memory of the Gluon recurrence (``recurrence_warpgroup.py``): ``stages`` ring slots of a chunk's kd,
    qg, kg (bf16 ``[C, K]``), M (bf16 ``[C, C]``), T·β (fp32 ``[C, C]``), v (``[C, width]`` of ``v_bytes``) and
    decay (fp32 ``[K]``), two buffers of T·β's bf16 halves, and two of the output (``[C, width]``, v's dtype).
    The transitions need less (no qg, M or output): this bound covers them too."""
    per_stage = (3 * chunk * key_dim + chunk * chunk) * 2 + chunk * chunk * 4 + chunk * width * v_bytes + 4 * key_dim
    return stages * per_stage + 2 * 2 * chunk * chunk * 2 + 2 * chunk * width * v_bytes


def slot_count(seq_len: int, num_seqs: int, span: int, varlen: bool) -> int:
    """Slots of ``span`` tokens (0: none) for ``num_seqs`` sequences, each owning ``ceil(len / span)`` of them:
    ``num_seqs`` rows of ``seq_len`` tokens, or (varlen) ``seq_len`` tokens in all, a bound that holds for any
    cut into sequences. Chunk slots (:attr:`PrefillPlan.chunk_slots`), segment slots, the conv's token blocks."""
    if not span:
        return 0
    if varlen:
        return seq_len // span + num_seqs + 1
    return num_seqs * -(-seq_len // span)


def _counted(count: int, noun: str) -> str:
    """``"1 warp"``, ``"4 warps"``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _check(condition, message):
    """Raise ``ValueError`` with ``message`` unless ``condition``; a message that takes formatting comes as a
    function, called only for a failed check (a plan is checked on every new shape, and formatting its ~70
    messages was most of a small plan's host time)."""
    if not condition:
        raise ValueError(f"fastkda plan: {message() if callable(message) else message}")


def _check_field_types(plan):
    """Every number of a plan an int (not a bool: True would pass for 1), every flag a bool, before the ranges are
    checked: a float or None would fail the range checks with a TypeError, or be truncated on the way to the
    kernels."""
    for field in dataclasses.fields(plan):
        value = getattr(plan, field.name)
        if field.type == "int":
            _check(isinstance(value, int) and not isinstance(value, bool),
                   lambda: f"{field.name} must be an int, got {value!r}")
        elif field.type == "bool":
            _check(isinstance(value, bool), lambda: f"{field.name} must be a bool, got {value!r}")


def _replaced(plan, changes):
    """``plan`` with ``changes`` (validated by its class), its reason saying which; the reason itself is not a
    number to change."""
    _check("reason" not in changes, "replace takes launch numbers; the reason records them")
    changed = ", ".join(f"{name}={value!r}" for name, value in changes.items())
    return dataclasses.replace(plan, **changes, reason=f"{plan.reason}; overridden: {changed}")


@dataclass(frozen=True)
class PrefillPlan:
    """Every number one prefill call launches with, the facts it was made from, and why (``reason``).

    Facts: ``num_seqs`` sequences, each a row of ``seq_len`` tokens or, when ``varlen``, the ``cu_seqlens`` spans
    of one row of ``seq_len`` tokens; ``heads`` heads, key and value dimensions, the gate mode, the SM count.
    Chunking: ``chunk`` tokens per serial step, ``block`` tokens per inverse block, ``cpu_chunk`` for the CPU path.
    Recurrence: ``v_slices`` programs per (sequence, head); ``state_rows_v``: the state is
    held transposed (rows = V), so that a slice's columns are each product's rows; warps and pipeline stages.
    Preparation: warps, stages, key channels per step (all K under the lower-bound gate) and
    ``prepare_token_run`` (consecutive tokens per thread, which keeps the in-chunk cumulative sum inside threads;
    it sets that sum's order, so it and the precomputed gate's channels per step, which order the products' sums,
    are the numbers here besides ``chunk`` and ``dot_precision`` that change the results' last
    bits) of the first kernel, and
    ``prepare_registers``, its cap on registers per thread (0: the compiler's choice; a cap fits more programs on
    an SM at the price of spills; derived from the warps, so a plan changed to other warps keeps the old cap unless
    it is changed too); warps, stages and register cap (``solve_registers``: 0 or a cap as above; the automatic plan
    leaves it to the compiler, since a cap of 80, 25 programs an SM against 21, measured no faster) of the solve
    kernel. Sequence parallelism (``docs/sequence-parallel.md``): ``segment_chunks`` (0: off) cuts every
    sequence, from its first token, into segments of that many chunks; the transition kernel runs each segment from
    a zero state over the V value columns and K identity columns in slices of ``transition_width``, the scan
    (``scan_width`` state columns a program, ``scan_warps``, ``scan_stages``: the next segment's transition is
    loaded while the current one is applied) composes them into each segment's entry state, and the recurrence
    reruns every segment from its entry state in ``v_slices`` slices.
    ``warpgroup_recurrence``: the recurrence of 64- or 128-column slices runs the Gluon kernel
    (``fastkda/ops/prefill/recurrence_warpgroup.py``: the same bits, its layouts and product order set by hand;
    ``recurrence_stages`` chunks in its shared-memory ring, at least 4) instead of the Triton one;
    ``warpgroup_transition``: the segments' transitions of 64- or 128-column slices likewise (``transition_stages``
    chunks in their ring, at least 4; the Triton transition kernel pipelines that many too); the CPU path and
    Triton's interpreter run the Triton kernels. ``longest_first`` (varlen): the recurrence's programs take their
    rows (sequences, or segment programs) from the most work down (an order the solve kernel writes from
    ``cu_seqlens``), so that the longest chains start in the first wave; the bits do not change. ``equal_rows``: a
    varlen call of one sequence, or whose ``max_seqlen`` hint says every sequence has one length (N·max_seqlen =
    T), runs as ``num_seqs`` rows of ``seq_len`` tokens (``varlen`` False: the chunk slots and the recurrence's
    programs laid out from the rows alone, no lookup in ``cu_seqlens``, the same bits), and the solve kernel counts
    the sequences whose ``cu_seqlens`` entries are not the rows' (:mod:`fastkda.errors`). ``horner_inverse`` (tf32
    products only): the solve kernel inverts a diagonal block whose entries are at most 1 by Horner's rule in fp16
    operands (``fastkda/ops/prefill/solve.py``; other bits, as accurate or more); the automatic plan sets it where
    the call's (chunk, head) pairs are at most :data:`HORNER_PROGRAMS_PER_SM` an SM (the ``replace`` to "ieee"
    products must clear it too). ``inverse_in_prepare``: the first kernel does the solve kernel's work on its own
    chunk after storing β·L, and the solve kernel is not launched (the same bits: the same code on the same values).
    ``early_chunks_last``: both preparation kernels run on one grid axis, heads innermost, from the last chunk slots
    back to the first (:attr:`prepare_grid`; rows a chunk of every row at a time), so that a run of programs reads
    one chunk's rows of every head (contiguous in memory); on rows the chunks the serial recurrence reads first are
    also the last ones written (the same bits: only the programs' order changes).
    ``transitions_in_order`` (under ``longest_first`` and sequence parallelism): the transition kernel runs the
    first :attr:`transition_rows` rows of the recurrence's order, where every segment with a transition ranks (on
    valid offsets), instead of every row, most of which have none in a batch of many sequences (the same bits).
    ``rerun_in_order`` (likewise): the rerun's grid is the order's first :attr:`rerun_rows` rows, where every
    segment with work ranks on valid offsets, instead of every row; the scan writes the final state of a sequence
    whose last segment ranks past them (malformed offsets only; the same bits). ``scan_in_order`` (likewise): the
    scan's grid is the order's first :attr:`scan_rows` places, which hold every sequence of several segments on
    valid offsets (its first segment has a transition), instead of every sequence; each of its programs also takes
    every :attr:`scan_rows`-th sequence for the duties of every sequence (the error count, the fallback, and the
    walk of a sequence of several whose first row ranks past the places, on malformed offsets; the same bits; off
    in the automatic plan until measured faster).
    ``dot_precision``: the kernels' fp32 products ("tf32" or "ieee")."""

    seq_len: int
    num_seqs: int
    varlen: bool
    heads: int
    key_dim: int
    value_dim: int
    lower_bound_gate: bool
    sms: int
    chunk: int
    block: int
    cpu_chunk: int
    v_slices: int
    state_rows_v: bool
    recurrence_warps: int
    recurrence_stages: int
    prepare_warps: int
    prepare_stages: int
    prepare_channels: int
    prepare_token_run: int
    solve_warps: int
    solve_stages: int
    prepare_registers: int = 0
    solve_registers: int = 0
    segment_chunks: int = 0
    transition_width: int = 0
    scan_warps: int = 4
    scan_stages: int = 2
    scan_width: int = SCAN_WIDTH
    transition_stages: int = 3
    warpgroup_recurrence: bool = False
    warpgroup_transition: bool = False
    longest_first: bool = False
    equal_rows: bool = False
    horner_inverse: bool = False
    inverse_in_prepare: bool = False
    early_chunks_last: bool = False
    transitions_in_order: bool = False
    rerun_in_order: bool = False
    scan_in_order: bool = False
    dot_precision: str = DOT_PRECISION
    reason: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        _check_field_types(self)
        for name in ("seq_len", "num_seqs", "heads", "sms"):
            least = 0 if name in ("seq_len", "num_seqs") else 1
            _check(getattr(self, name) >= least, lambda: f"{name} must be >= {least}, got {getattr(self, name)}")
        for name in ("key_dim", "value_dim"):
            _check(getattr(self, name) in SUPPORTED_DIMS, lambda: (f"{name} must be one of {SUPPORTED_DIMS}, got "
                                                                   f"{getattr(self, name)}"))
        _check(self.block == 16 and self.chunk == 2 * self.block,
               lambda: f"the kernels take chunks of two 16-token blocks, got chunk={self.chunk}, block={self.block}")
        # a divisor of the chunk: checkpoints and segments fall on chunk multiples, which the CPU path keeps only at
        # its own chunks' ends, and its cumulative decays are taken over one chunk (a long one loses them)
        _check(self.cpu_chunk >= 1 and self.chunk % self.cpu_chunk == 0,
               lambda: f"cpu_chunk must divide the chunk ({self.chunk}), got {self.cpu_chunk}")
        width = self.value_dim // max(self.v_slices, 1)
        _check(self.v_slices >= 1 and self.value_dim % self.v_slices == 0 and width >= MIN_SLICE_WIDTH
               and width & (width - 1) == 0,
               lambda: (f"v_slices={self.v_slices} must cut V={self.value_dim} into power-of-two slices of at least "
                        f"{MIN_SLICE_WIDTH} columns"))
        for name in ("recurrence_warps", "prepare_warps", "solve_warps"):
            _check(getattr(self, name) in WARP_CHOICES, lambda: (f"{name} must be one of {WARP_CHOICES}, got "
                                                                 f"{getattr(self, name)}"))
        for name in ("prepare_registers", "solve_registers"):
            _check(getattr(self, name) == 0 or 24 <= getattr(self, name) <= 255,
                   lambda: f"{name} must be 0 (the compiler's choice) or 24..255, got {getattr(self, name)}")
        for name in ("recurrence_stages", "prepare_stages", "solve_stages", "transition_stages"):
            _check(getattr(self, name) >= 1, lambda: f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.prepare_channels in (16, 32, 64, 128) and self.key_dim % self.prepare_channels == 0,
               lambda: (f"prepare_channels must be 16, 32, 64 or 128 and divide K={self.key_dim}, got "
                        f"{self.prepare_channels}"))
        _check(not self.lower_bound_gate or self.prepare_channels == self.key_dim,
               lambda: (f"under the lower-bound gate the first kernel takes every key channel in one step "
                        f"(prepare_channels={self.key_dim}), got prepare_channels={self.prepare_channels}"))
        _check(self.prepare_token_run >= 1 and self.chunk % self.prepare_token_run == 0,
               lambda: f"prepare_token_run must divide the chunk ({self.chunk}), got {self.prepare_token_run}")
        _check(self.segment_chunks >= 0, lambda: f"segment_chunks must be >= 0, got {self.segment_chunks}")
        if self.segment_chunks:
            narrow = min(self.key_dim, self.value_dim)
            _check(self.transition_width in (16, 32, 64, 128) and self.transition_width <= narrow,
                   lambda: (f"transition_width must be 16, 32, 64 or 128 and at most min(K, V)={narrow}, got "
                            f"{self.transition_width}"))
            _check(self.scan_warps in WARP_CHOICES, lambda: (f"scan_warps must be one of {WARP_CHOICES}, got "
                                                             f"{self.scan_warps}"))
            _check(self.scan_stages >= 1, lambda: f"scan_stages must be >= 1, got {self.scan_stages}")
            # each divides every supported K and V (64 or 128), so the scan's grid covers the state's columns
            _check(self.scan_width in SCAN_WIDTHS,
                   lambda: f"scan_width must be one of {SCAN_WIDTHS}, got {self.scan_width}")
        _check(self.dot_precision in ("tf32", "ieee"), lambda: (f"dot_precision must be 'tf32' or 'ieee', got "
                                                                f"{self.dot_precision!r}"))
        if self.warpgroup_recurrence:
            _check(self.slice_width in WARPGROUP_SLICE_WIDTHS and self.state_rows_v
                   and self.recurrence_warps == self.slice_width // 16 and self.recurrence_stages >= 4
                   and warpgroup_shared_bytes(self.slice_width, self.key_dim, self.recurrence_stages, self.chunk)
                   <= SHARED_MEMORY_PER_PROGRAM,
                   lambda: (f"warpgroup_recurrence runs slices of {WARPGROUP_SLICE_WIDTHS} columns, held transposed "
                            f"on a warp per 16 columns, with at least 4 stages and at most what fits "
                            f"{SHARED_MEMORY_PER_PROGRAM} bytes of shared memory with an fp32 v; got slice_width="
                            f"{self.slice_width}, state_rows_v="
                            f"{self.state_rows_v}, recurrence_warps={self.recurrence_warps}, recurrence_stages="
                            f"{self.recurrence_stages}"))
        _check(self.seq_len != 1 or not (self.warpgroup_recurrence or self.warpgroup_transition),
               "warpgroup_recurrence and warpgroup_transition need seq_len > 1 (Triton 3.6 fails to compile the "
               "Gluon kernels for rows of one token); got seq_len=1")
        _check(not self.longest_first or self.varlen,
               "longest_first orders the recurrence of a varlen batch (varlen=True), got varlen=False")
        for name, kernel in (("transitions_in_order", "transitions'"), ("rerun_in_order", "rerun's"),
                             ("scan_in_order", "scan's")):
            _check(not getattr(self, name) or (self.longest_first and self.segment_chunks > 0),
                   lambda: (f"{name} takes the {kernel} rows from the recurrence's order: it needs longest_first "
                            f"and segments (segment_chunks > 0), got longest_first={self.longest_first}, "
                            f"segment_chunks={self.segment_chunks}"))
        _check(not self.horner_inverse or self.dot_precision == "tf32",
               lambda: (f"horner_inverse takes fp16 operands in place of tf32 ones (dot_precision='tf32'), got "
                        f"dot_precision={self.dot_precision!r}: replace horner_inverse=False with it"))
        _check(not (self.equal_rows and self.varlen),
               "equal_rows runs a varlen call as rows (varlen=False), got varlen=True")
        if self.warpgroup_transition:
            _check(self.segment_chunks > 0 and self.transition_width in WARPGROUP_SLICE_WIDTHS
                   and self.transition_stages >= 4
                   and warpgroup_shared_bytes(self.transition_width, self.key_dim, self.transition_stages, self.chunk)
                   <= SHARED_MEMORY_PER_PROGRAM,
                   lambda: (f"warpgroup_transition runs the segments' transitions (segment_chunks > 0) in slices of "
                            f"{WARPGROUP_SLICE_WIDTHS} columns, with at least 4 stages and at most what fits "
                            f"{SHARED_MEMORY_PER_PROGRAM} bytes of shared memory; got segment_chunks="
                            f"{self.segment_chunks}, "
                            f"transition_width={self.transition_width}, transition_stages={self.transition_stages}"))

    @property
    def batch(self) -> int:
        """Rows of the inputs: one holding every sequence (varlen), else one per sequence."""
        return 1 if self.varlen else self.num_seqs

    @property
    def slice_width(self) -> int:
        """Value columns per recurrence program."""
        return self.value_dim // self.v_slices

    @property
    def programs(self) -> int:
        """Recurrence programs: one per (sequence, head, V-slice)."""
        return self.v_slices * self.num_seqs * self.heads

    @property
    def chunk_slots(self) -> int:
        """Chunk slots of the preparation's grid and workspace: sequence n owns ``ceil(len_n / chunk)``
        consecutive slots from ``n·ceil(seq_len / chunk)`` (fixed length) or ``cu_seqlens[n] // chunk + n``
        (varlen), a layout every kernel derives from host-known values (``fastkda/ops/prefill/layout.py``)."""
        return slot_count(self.seq_len, self.num_seqs, self.chunk, self.varlen)

    @property
    def prepare_grid(self) -> tuple:
        """Grid of both preparation kernels: one program per (chunk slot, head); under ``early_chunks_last`` on one
        axis, in the order :func:`fastkda.ops.prefill.layout.preparation_program` reads it."""
        if self.early_chunks_last:
            return (self.chunk_slots * self.heads, 1, 1)
        return (self.chunk_slots, self.heads, 1)

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequences are cut into segments (``segment_chunks``)."""
        return self.segment_chunks > 0

    @property
    def segment_tokens(self) -> int:
        """Tokens per segment (0: sequence parallelism off)."""
        return self.chunk * self.segment_chunks

    @property
    def segment_slots(self) -> int:
        """Segment slots, laid out as the chunk slots are with segments in place of chunks: sequence n owns
        ``ceil(len_n / segment_tokens)`` slots from ``n·ceil(seq_len / segment_tokens)`` (fixed length) or
        ``cu_seqlens[n] // segment_tokens + n`` (varlen), whatever the lengths (0 when off)."""
        return slot_count(self.seq_len, self.num_seqs, self.segment_tokens, self.varlen)

    @property
    def transition_rows_v(self) -> bool:
        """Whether the transition kernel holds its slices' state transposed (:func:`state_rows_v`)."""
        return state_rows_v(self.transition_width)

    @property
    def transition_warps(self) -> int:
        """Warps per transition program (:func:`recurrence_warps`)."""
        return recurrence_warps(self.transition_width)

    @property
    def segment_programs(self) -> int:
        """Programs per (slice, head) of the segmented kernels: each sequence's first segment, then one per segment
        slot for the later segments (a slot holding a first segment then exits), so that the first segments come
        first in the grid (0 when off)."""
        return self.num_seqs + self.segment_slots if self.segment_chunks else 0

    @property
    def transition_rows(self) -> int:
        """Segment programs the transition kernel runs: every one, or under ``transitions_in_order`` the first
        ``seq_len // segment_tokens`` (at least one) of the recurrence's order. A segment with a transition (every
        one but its sequence's last) holds ``segment_tokens`` tokens of its own, so on valid offsets there are no
        more of them than that, and they rank first (:func:`fastkda.ops.prefill.layout.write_longest_first`)."""
        if self.transitions_in_order:
            return min(self.segment_programs, max(self.seq_len // self.segment_tokens, 1))
        return self.segment_programs

    @property
    def rerun_rows(self) -> int:
        """Segment programs the rerun runs: every one, or under ``rerun_in_order`` the first ``num_seqs + seq_len //
        segment_tokens`` of the recurrence's order. On valid offsets no more segments have work: each sequence's
        first (which writes its final state, even when empty), and at most ``seq_len // segment_tokens`` later ones,
        since each follows ``segment_tokens`` tokens of its own sequence; the idle slots rank after them
        (:func:`fastkda.ops.prefill.layout.write_longest_first`)."""
        if self.rerun_in_order:
            return min(self.segment_programs, self.num_seqs + self.seq_len // self.segment_tokens)
        return self.segment_programs

    @property
    def program_rows(self) -> int:
        """Rows of recurrence programs that the order ranks (under ``longest_first``): sequences, or under sequence
        parallelism segment programs, whatever part of them the rerun's grid runs."""
        return self.segment_programs if self.segment_chunks else self.num_seqs

    @property
    def transition_grid(self) -> tuple:
        """Grid of the transition kernel: one program per (slice of the V + K columns, head, segment program)."""
        return ((self.value_dim + self.key_dim) // max(self.transition_width, 1), self.heads, self.transition_rows)

    @property
    def scan_rows(self) -> int:
        """The scan's grid rows: every sequence, or under ``scan_in_order`` the order's first ``seq_len //
        segment_tokens`` places (at least one, at most N). A sequence of several segments has a first segment of
        ``segment_chunks`` chunks with a transition, the most work a row has, and equal work ranks in grid order,
        so only the first rows of the sequences of several before it rank ahead of it: on valid offsets each owns
        ``segment_tokens`` tokens, so fewer than this many (:func:`fastkda.ops.prefill.layout.write_longest_first`)."""
        if self.scan_in_order:
            return min(self.num_seqs, max(self.seq_len // self.segment_tokens, 1))
        return self.num_seqs

    @property
    def scan_grid(self) -> tuple:
        """Grid of the segment scan: one program per (slice of ``scan_width`` columns, head, sequence), or per
        (slice, head, place of the order's first :attr:`scan_rows`) under ``scan_in_order``."""
        return (self.value_dim // self.scan_width, self.heads, self.scan_rows)

    @property
    def recurrence_grid(self) -> tuple:
        """Grid of the recurrence: one program per (V-slice, head, sequence), or per (V-slice, head, segment
        program) under sequence parallelism (:attr:`rerun_rows` of them)."""
        return (self.v_slices, self.heads, self.rerun_rows if self.segment_chunks else self.num_seqs)

    def replace(self, **changes) -> "PrefillPlan":
        """This plan with some numbers changed (validated), its reason saying which."""
        return _replaced(self, changes)

    def launch_numbers(self) -> tuple:
        """The plan as plain integers (bools as 0/1), the form the custom op carries; see
        :meth:`from_launch_numbers`. ``dot_precision`` and ``reason`` travel apart."""
        return _launch_numbers(self)

    @staticmethod
    def from_launch_numbers(numbers, dot_precision=DOT_PRECISION) -> "PrefillPlan":
        """The plan :meth:`launch_numbers` gave (the reason is not carried)."""
        return _plan_from_numbers(tuple(numbers), dot_precision)

    def describe(self) -> str:
        """The plan in words, one line per stage."""
        chain = -(-self.seq_len // self.chunk)
        layout = (f"{self.num_seqs} sequence(s), {self.seq_len} tokens in all (varlen)" if self.varlen
                  else f"{self.batch} sequence(s) of {self.seq_len} tokens"
                  + (" (varlen, run as rows)" if self.equal_rows else ""))
        gate = "lower-bound gate" if self.lower_bound_gate else "precomputed gate"
        return "\n".join([
            f"shape: {layout}, {self.heads} heads, K={self.key_dim}, V={self.value_dim}, {gate}, {self.sms} SMs",
            f"chunks: {self.chunk} tokens per serial step (inverse blocks of {self.block}); the longest sequence "
            f"walks at most {chain} chunk(s) in order",
            f"preparation: {self.chunk_slots} chunk slots x {self.heads} heads; first kernel on "
            f"{_counted(self.prepare_warps, 'warp')}, {self.prepare_stages} stages, "
            f"{self.prepare_channels} key channels per step, {self.prepare_token_run} consecutive tokens per thread"
            + (f", at most {self.prepare_registers} registers a thread" if self.prepare_registers else "") + "; "
            + ("the first kernel then inverts its chunk" if self.inverse_in_prepare
               else f"solve kernel on {_counted(self.solve_warps, 'warp')}, {self.solve_stages} stages"
               + (f", at most {self.solve_registers} registers a thread" if self.solve_registers else ""))
            + ": T·diag(β)" + (", diagonal blocks by Horner's rule in fp16 operands" if self.horner_inverse else "")
            + ("; both from the last chunks back to the first, heads innermost" if self.early_chunks_last else ""),
            f"recurrence: v_slices={self.v_slices} (V cut into {self.v_slices} slice(s) of {self.slice_width} "
            f"columns): {self.programs} programs "
            + ("per segment of each sequence" if self.segment_chunks else f"on {self.sms} SMs")
            + f", {self.recurrence_warps} warps, "
            f"{self.recurrence_stages} stages, state held as "
            + ("Sᵀ (rows = V)" if self.state_rows_v else "S (rows = K)")
            + ", v_new = T·β·(v − kd·S) each step"
            + ("; the Gluon kernel, a warpgroup per 64 columns" if self.warpgroup_recurrence else "")
            + ("; the longest first" if self.longest_first else ""),
            ("sequence parallelism: off" if not self.segment_chunks else
             f"sequence parallelism: segments of {self.segment_chunks} chunks ({self.segment_tokens} tokens) from "
             f"each sequence's first token, {self.segment_slots} segment slots; transitions over V+K="
             f"{self.value_dim + self.key_dim} columns in slices of {self.transition_width}, "
             f"{self.transition_stages} stages"
             + (" (the Gluon kernel)" if self.warpgroup_transition else "")
             + (f", on the order's first {self.transition_rows} of {self.segment_programs} segment programs"
                if self.transitions_in_order else "")
             + (f", the rerun on the order's first {self.rerun_rows}" if self.rerun_in_order else "")
             + f", a scan over each sequence's segments ({self.scan_width} state columns a program, "
             + (f"on the order's first {self.scan_rows} places, " if self.scan_in_order else "")
             + f"{_counted(self.scan_warps, 'warp')}), then the recurrence over every segment from its entry state"),
            f"why: {self.reason}",
            f"CPU path: chunks of {self.cpu_chunk} tokens",
        ])


_NUMBER_FIELDS = tuple(f.name for f in dataclasses.fields(PrefillPlan) if f.name not in ("dot_precision", "reason"))
_BOOL_FIELDS = frozenset(f.name for f in dataclasses.fields(PrefillPlan) if f.type == "bool")


@functools.lru_cache(maxsize=4096)
def _launch_numbers(plan):
    return tuple(int(getattr(plan, name)) for name in _NUMBER_FIELDS)


@functools.lru_cache(maxsize=4096)  # the custom op rebuilds the plan on every call: an eager call's host time counts
def _plan_from_numbers(numbers, dot_precision):
    _check(len(numbers) == len(_NUMBER_FIELDS),
           lambda: f"expected {len(_NUMBER_FIELDS)} launch numbers, got {len(numbers)}")
    values = {name: bool(n) if name in _BOOL_FIELDS else int(n) for name, n in zip(_NUMBER_FIELDS, numbers)}
    return PrefillPlan(**values, dot_precision=dot_precision)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def has_warpgroup_mma(device_index: int) -> bool:
    """Whether a CUDA device runs Hopper's warpgroup MMA (compute capability 9.x, sm_90), which the Gluon
    recurrence (the plan's ``warpgroup_recurrence``) is made of (read once per device)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def parse_v_slices(value, source: str):
    """``"auto"`` or one of :data:`V_SLICE_CHOICES`; anything else raises ``ValueError`` naming ``source``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value not in V_SLICE_CHOICES:
        raise ValueError(f"{source} must be 'auto' or one of {V_SLICE_CHOICES}, got {value!r}")
    return value


def _requested(argument, parse, name, env):
    """The caller's choice of ``name``: the argument unless it is ``"auto"``, then ``$env``, then auto; each read
    with ``parse``, which names its source in the ``ValueError`` it raises."""
    choice = parse(argument, name)
    if isinstance(choice, str) and choice == "auto" and os.environ.get(env):
        choice = parse(os.environ[env], env)
    return choice


def requested_v_slices(argument="auto"):
    """The caller's choice: the argument unless it is ``"auto"``, then ``$FASTKDA_V_SLICES``, then auto."""
    return _requested(argument, parse_v_slices, "v_slices", ENV_V_SLICES)


def state_rows_v(slice_width: int) -> bool:
    """Whether the recurrence holds a slice's state as Sᵀ (rows = V): from 64 columns, where that makes every
    product a wgmma with the state in registers; a narrower slice keeps S (rows = K), whose products have the
    chunk's rows as M (transposed, 32-row products fall back to mma.sync)."""
    return slice_width >= 64


def recurrence_warps(slice_width: int) -> int:
    """8 warps for a 128-column slice (its ``[128, 128]`` fp32 state is 64 registers a thread; on 4 warps it
    spills), else 4 (programs of 4 warps fit two per SM)."""
    return 8 if slice_width >= 128 else 4


def prepare_channels(key_dim: int, lower_bound_gate: bool) -> int:
    """Key channels per step of the first preparation kernel: all of them under the lower-bound gate (one
    load-and-compute phase; steps were slower, docs/perf-notes.md); 32 under the precomputed gate, whose
    element-wise diagonal blocks grow with the channels per step."""
    return key_dim if lower_bound_gate else min(32, key_dim)


def prepare_registers(lower_bound_gate: bool, warps: int) -> int:
    """The first preparation kernel's cap on registers per thread: under the lower-bound gate, what lets
    :data:`PREPARE_PROGRAMS_PER_SM` of its programs share an SM's register file (rounded down to ptxas's
    allocation unit of 8). The kernel waits on its loads' latency, and a third program per SM hides more of it
    than the few spilled registers cost (docs/perf-notes.md, "Register caps and the solve kernel's warps").
    Under the precomputed gate, 0 (the compiler's choice): its shared memory admits two programs per SM anyway."""
    if not lower_bound_gate:
        return 0
    return min(REGISTERS_PER_SM // (PREPARE_PROGRAMS_PER_SM * warps * 32) // 8 * 8, 255)


def prepare_token_run(chunk: int, key_dim: int, warps: int) -> int:
    """Consecutive tokens per thread in the first preparation kernel: Triton lays a ``[chunk, K]`` bf16 tile over
    the warps in 8-element rows of K / 8 threads, so each thread holds chunk·K / (warps·256) rows, filled with runs
    of :data:`PREPARE_TOKEN_RUN` consecutive tokens (or one run, if it holds fewer rows). Runs of two rather than
    one run of all four rows keep fewer values of the in-thread cumulative sum live at the register cap, so fewer
    spill, and the kernel is faster (docs/perf-notes.md, "token runs of two")."""
    return max(min(chunk * key_dim // (warps * 256), chunk, PREPARE_TOKEN_RUN), 1)


def parse_sequence_parallel(value, source: str):
    """``"auto"``, ``False`` (off) or tokens per segment, a positive multiple of :data:`CHUNK`; anything else
    raises ``ValueError`` naming ``source``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text in ("0", "off", "false"):
            return False
        if text.isdigit():
            value = int(text)
    if value is False:
        return False
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % CHUNK:
        raise ValueError(f"{source} must be 'auto', False or a positive multiple of {CHUNK} (tokens per segment), "
                         f"got {value!r}")
    return value


def requested_sequence_parallel(argument="auto"):
    """The caller's choice: the argument unless it is ``"auto"``, then ``$FASTKDA_SEQUENCE_PARALLEL``, then auto."""
    return _requested(argument, parse_sequence_parallel, "sequence_parallel", ENV_SEQUENCE_PARALLEL)


def phase_us(programs: int, steps: int, width: int, sms: int, share: float = 1.0, other_steps: int = 0) -> float:
    """Modelled time of a phase of ``programs`` equal programs of ``steps`` chunk steps on ``width``-column
    slices: the busiest SM runs ``ceil(programs / sms)`` of them, two at a time up to 64 columns (4 warps) and one
    at a time beyond; each step takes the longer of one program's latency and the SM's throughput for the programs
    it runs together (``share``: a transition-only step's fraction of a full one). ``other_steps``: the program
    steps of shorter programs beside them (other sequences of a batch), which fill idle SMs before they add time."""
    if not programs or not steps:
        return 0.0
    per_sm = -(-programs // sms)
    together = 1 if width >= 128 else 2
    step = max(STEP_LATENCY_US[width], min(per_sm, together) * width / 32 * STEP_THROUGHPUT_US) * share
    rounds = max(-(-per_sm // together), (programs * steps + other_steps) / (sms * together * steps))
    return rounds * steps * step


def segmented_us(sequences: int, chunks: int, segment_chunks: int, heads: int, key_dim: int, value_dim: int,
                 transition_width: int, v_slices: int, sms: int, other_chunks: int = 0,
                 open_entry: bool = False) -> float:
    """Modelled time of the sequence-parallel form for ``sequences`` sequences of ``chunks`` chunks each: the
    transitions of all but each sequence's last segment (the first over the value columns alone), the scan, and
    the rerun of every segment, with the gaps between the three kernels. ``other_chunks``: chunks per head of the
    batch's other, shorter sequences, whose rerun steps share the SMs (their transitions and scan steps, where they
    are long enough to be cut too, are not counted). ``open_entry`` (:func:`choose_open_entry_plan`): every
    segment's transition over all V + K columns, and two scans over every segment."""
    segments = -(-chunks // segment_chunks)
    if open_entry:
        transitions = sequences * heads * (value_dim + key_dim) // transition_width * segments
        scan_steps = 2 * segments
    else:
        transitions = sequences * heads * (value_dim // transition_width * (segments - 1)
                                           + key_dim // transition_width * max(segments - 2, 0))
        scan_steps = segments - 1
    rerun = sequences * heads * v_slices * segments
    return (phase_us(transitions, segment_chunks, transition_width, sms, TRANSITION_SHARE)
            + scan_steps * SCAN_STEP_US + 2 * LAUNCH_GAP_US
            + phase_us(rerun, segment_chunks, value_dim // v_slices, sms,
                       other_steps=heads * v_slices * other_chunks))


def _segmentation(num_seqs, heads, seq_len, key_dim, value_dim, sms, varlen, serial_slices, requested, choice,
                  max_seqlen):
    """``(segment_chunks, transition_width, v_slices, reason)`` for sequence parallelism, or None for the serial
    recurrence. Plans for the longest sequence the facts allow, never for the mean: fixed-length rows are exact;
    varlen, with the caller's ``max_seqlen`` hint, for as many sequences of that length as the tokens allow; with no
    hint, for one sequence holding every token, and then only where the most balanced reading (N sequences of T/N
    tokens) gains too: a balanced batch whose sequences would each fit one segment pays the two extra launches and
    gains nothing."""
    if varlen and max_seqlen:
        longest = min(max_seqlen, seq_len)
        worst = max(1, min(num_seqs, seq_len // max(longest, 1)))
    else:
        longest, worst = seq_len, 1 if varlen else num_seqs
    chunks = -(-longest // CHUNK)
    others = num_seqs - worst if varlen and max_seqlen else 0  # shorter sequences beside the longest ones
    rest = max(seq_len - worst * longest, 0)  # their tokens: at most one partial chunk each, none when empty
    other_chunks = -(-rest // CHUNK) + min(others, rest) if others > 0 else 0
    widths = [w for w in TRANSITION_WIDTHS if w <= min(key_dim, value_dim)] or [min(key_dim, value_dim)]
    slices = [requested] if requested != "auto" else [s for s in RERUN_SLICE_CHOICES if value_dim // s >= 64]
    serial = phase_us(worst * heads * serial_slices, chunks, value_dim // serial_slices, sms,
                      other_steps=heads * serial_slices * other_chunks)

    def best(segment_chunks, sequences, chunk_count, other_count=0):
        return min((segmented_us(sequences, chunk_count, segment_chunks, heads, key_dim, value_dim, w, s, sms,
                                 other_count), w, s)
                   for w in widths for s in slices)

    reading = (f"{worst} sequence(s) of {chunks} chunks" + (f" (max_seqlen={max_seqlen})" if varlen and max_seqlen
                                                            else " (one sequence of every token)" if varlen else ""))
    if not chunks:
        return None
    if choice != "auto":
        segment_chunks = choice // CHUNK
        predicted, width, v_slices = best(segment_chunks, worst, chunks, other_chunks)
        return segment_chunks, width, v_slices, (
            f"sequence_parallel={choice} requested: segments of {segment_chunks} chunks, predicted "
            f"{round(predicted)} µs against {round(serial)} µs serial for {reading}")
    if chunks < MIN_SP_CHAIN:
        return None
    candidates = []
    for segments in range(2, MAX_SEGMENTS + 1):
        segment_chunks = -(-chunks // segments)
        if segment_chunks < MIN_SEGMENT_CHUNKS:
            break
        candidates.append((*best(segment_chunks, worst, chunks, other_chunks), segment_chunks))
    predicted, width, v_slices, segment_chunks = min(candidates)
    if predicted > SP_GAIN * serial:
        return None
    if varlen and not max_seqlen and num_seqs > 1:
        balanced = -(-seq_len // num_seqs // CHUNK)
        balanced_serial = phase_us(num_seqs * heads * serial_slices, balanced, value_dim // serial_slices, sms)
        if balanced <= segment_chunks or best(segment_chunks, num_seqs, balanced)[0] > 1.02 * balanced_serial:
            return None
    return segment_chunks, width, v_slices, (
        f"sequence parallelism: segments of {segment_chunks} chunks, predicted {round(predicted)} µs against "
        f"{round(serial)} µs serial for {reading}")


def choose_plan(num_seqs: int, heads: int, seq_len: int, key_dim: int, value_dim: int, sms: int, *,
                varlen: bool = True, lower_bound_gate: bool = True, v_slices="auto",
                sequence_parallel="auto", max_seqlen=None, warpgroup_mma: bool = False) -> PrefillPlan:
    """The prefill plan for ``num_seqs`` sequences of ``heads`` heads on ``sms`` SMs: varlen, one row of
    ``seq_len`` tokens holding them all (``cu_seqlens``); else ``num_seqs`` rows of ``seq_len`` tokens each.

    ``v_slices``: ``"auto"`` (then ``$FASTKDA_V_SLICES`` if set) takes the most slices, at least
    :data:`NARROW_SLICE_WIDTH` columns wide, whose ``s·N·H`` programs fit one per SM, else one slice; or one of
    :data:`V_SLICE_CHOICES`. ``sequence_parallel``: ``"auto"`` (then ``$FASTKDA_SEQUENCE_PARALLEL`` if set) cuts
    sequences into segments where the step model predicts at least 25% off the serial recurrence for the longest
    sequence the facts allow; ``False`` keeps the serial recurrence; an int forces segments of that many tokens.
    ``max_seqlen`` (varlen): the longest sequence's length if the caller knows it (as flash-attn takes it): the
    segment length is planned for it, and where it gives every sequence one length (N·max_seqlen = T) the plan runs
    the sequences as rows (``equal_rows``, which needs ``cu_seqlens`` to agree; one sequence runs so without a
    hint); without it the plan assumes one sequence may hold every token. ``warpgroup_mma``: the GPU runs Hopper's
    warpgroup MMA (:func:`has_warpgroup_mma`); then the segments' transitions and the recurrence of 64- or
    128-column slices run the Gluon kernels (the plan's ``warpgroup_transition`` and ``warpgroup_recurrence``:
    where they measured faster), the transitions at :data:`WARPGROUP_STAGES` stages, the recurrence at
    :data:`WARPGROUP_RECURRENCE_STAGES`. Raises ``ValueError`` for shapes the kernels do not take."""
    return _choose_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, bool(varlen), bool(lower_bound_gate),
                        requested_v_slices(v_slices), requested_sequence_parallel(sequence_parallel),
                        _checked_max_seqlen(max_seqlen), bool(warpgroup_mma))


def _checked_max_seqlen(max_seqlen) -> int:
    """The ``max_seqlen`` hint as the plan reads it (0: none), after checking it (the message is formatted only for
    a bad value: under torch.compile a hint that changes between calls is a symbolic int, which a trace cannot
    format)."""
    _check(max_seqlen is None or isinstance(max_seqlen, int) and not isinstance(max_seqlen, bool) and max_seqlen >= 0,
           lambda: f"max_seqlen must be None or an integer >= 0, got {max_seqlen!r}")
    return max_seqlen or 0


def _request_number(choice) -> int:
    """A caller's choice among a plan request's numbers: ``"auto"`` as -1, ``False`` as 0, an int as itself."""
    return -1 if isinstance(choice, str) else int(choice)


def _requested_choice(number):
    """The choice :func:`_request_number` wrote: -1 as ``"auto"``, 0 as ``False``, an int as itself."""
    return "auto" if number < 0 else number or False


def is_plan_request(numbers) -> bool:
    """Whether a custom op's launch numbers ask it to choose the automatic plan itself
    (:func:`prefill_plan_request`, :func:`decode_plan_request`) rather than carry a plan."""
    return numbers[0] == PLAN_REQUEST


def prefill_plan_request(v_slices="auto", sequence_parallel="auto", max_seqlen=None) -> tuple:
    """Launch numbers that ask a prefill's custom op to choose the automatic plan itself, from the sizes it runs on
    (:func:`requested_prefill_plan`), with the caller's choices, checked and read now (``$FASTKDA_V_SLICES`` and
    ``$FASTKDA_SEQUENCE_PARALLEL`` included, as an eager call reads them). For torch.compile: a plan chosen while
    tracing is a constant of the graph, so the graph would guard on every size the choice read, recompiling for
    each new batch or length until torch's limit of recompiles (where ``fullgraph=True`` fails)."""
    return (PLAN_REQUEST, _request_number(requested_v_slices(v_slices)),
            _request_number(requested_sequence_parallel(sequence_parallel)), _checked_max_seqlen(max_seqlen))


def requested_prefill_plan(numbers, num_seqs, heads, seq_len, key_dim, value_dim, sms, *, varlen, lower_bound_gate,
                           warpgroup_mma) -> PrefillPlan:
    """The automatic plan of these facts with the choices of :func:`prefill_plan_request`'s ``numbers``: the plan
    an eager call of these sizes chooses (the same cached function, the same arguments)."""
    _check(len(numbers) == 4 and is_plan_request(numbers), lambda: f"expected a prefill plan request, got {numbers!r}")
    _, v_choice, sp_choice, max_seqlen = numbers
    return _choose_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, bool(varlen), bool(lower_bound_gate),
                        _requested_choice(v_choice), _requested_choice(sp_choice), max_seqlen, bool(warpgroup_mma))


@functools.lru_cache(maxsize=4096, typed=True)  # an eager call's host time counts: a repeated shape reuses its plan
def _choose_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, varlen, lower_bound_gate, choice,
                 sp_choice="auto", max_seqlen=0, warpgroup_mma=False):
    # the facts' types and ranges, before the step model reads them
    _check_counts(num_seqs=(num_seqs, 0), heads=(heads, 1), seq_len=(seq_len, 0), sms=(sms, 1))
    for name, value in (("key_dim", key_dim), ("value_dim", value_dim)):
        _check(value in SUPPORTED_DIMS, lambda: f"{name} must be one of {SUPPORTED_DIMS}, got {value}")
    if varlen and seq_len and (num_seqs == 1 or max_seqlen and num_seqs * max_seqlen == seq_len):
        # every sequence has one length (one sequence: all T tokens, as valid offsets say; several: the hint's
        # length): as rows, the preparation's slots need no lookup in cu_seqlens and no empty slots, and the first
        # kernel stores only the in-chunk matrices' lower sectors (H96 and H64 1024x8 2.3% and 3.1% faster, H12 N5
        # T1024 2.6%, on the H200 in a same-run A/B: docs/perf-notes.md, "Session 25")
        length = seq_len // num_seqs
        as_rows = _choose_plan(num_seqs, heads, length, key_dim, value_dim, sms, False, lower_bound_gate, choice,
                               sp_choice, 0, warpgroup_mma)
        why = ("one sequence holds every token" if num_seqs == 1 else
               f"the max_seqlen hint gives every sequence one length ({num_seqs} x {max_seqlen} = {seq_len} tokens)")
        return dataclasses.replace(as_rows, equal_rows=True, reason=(
            f"{why}: run as rows, cu_seqlens checked on the device; {as_rows.reason}"))
    pairs = max(num_seqs * heads, 1)
    if choice != "auto":
        slices = choice
        _check(value_dim // slices >= MIN_SLICE_WIDTH,
               lambda: f"v_slices={choice} leaves slices narrower than {MIN_SLICE_WIDTH} columns of V={value_dim}")
        reason = f"v_slices={choice} requested"
    else:
        splits = [s for s in V_SLICE_CHOICES if s > 1 and value_dim // s >= NARROW_SLICE_WIDTH]
        fitting = [s for s in splits if s * pairs <= sms]
        if fitting:
            slices = max(fitting)
            reason = (f"{pairs} (sequence, head) pairs leave SMs idle, so V is cut into {slices} slices: "
                      f"{slices * pairs} programs fit one per SM on {sms} SMs")
            larger = [s for s in splits if s > slices]
            if larger:
                reason += f" ({min(larger)} slices would put {min(larger) * pairs} programs on {sms} SMs)"
        else:
            slices = 1
            reason = f"{pairs} (sequence, head) pairs"
            reason += (f" fill the GPU: V stays whole ({min(splits)} slices would put {min(splits) * pairs} programs "
                       f"on {sms} SMs, two on some)" if splits else " and no narrower slices are allowed")
    segmentation = None
    if sp_choice is not False and num_seqs:
        segmentation = _segmentation(num_seqs, heads, seq_len, key_dim, value_dim, sms, varlen, slices, choice,
                                     sp_choice, max_seqlen)
    segment_chunks, transition_width = 0, 0
    # reasons round their numbers with round(), not a format spec, which torch.compile's dynamic shapes cannot trace
    serial_reason = ("sequence parallelism off (requested)" if sp_choice is False
                     else f"the serial recurrence (segments are not predicted to gain {round(100 * (1 - SP_GAIN))}%)")
    if segmentation:
        programs = num_seqs + slot_count(seq_len, num_seqs, CHUNK * segmentation[0], varlen)
        if programs > MAX_GRID_Z:  # the segmented kernels' grid would not launch
            _check(sp_choice == "auto", lambda: (f"sequence_parallel={sp_choice} needs {programs} programs on the "
                                                 f"grid's third axis, more than CUDA's {MAX_GRID_Z}"))
            segmentation = None
            serial_reason = f"the serial recurrence (segments would need over {MAX_GRID_Z} grid rows)"
    if segmentation:
        segment_chunks, transition_width, slices, sp_reason = segmentation
        reason += f"; {sp_reason}, reruns in {slices} slice(s)"
    else:
        reason += f"; {serial_reason}"
    width = value_dim // slices
    # measured on the H200 (docs/perf-notes.md, "The Gluon kernels' first run" and "The Gluon recurrence's output
    # through shared memory"): the Gluon transitions are faster at the automatic plan's 64 columns, the Gluon
    # recurrence at 64 and 128 columns, serial or rerunning segments; and on an H100 since its copies from scalar
    # bases and its ring of five also where its programs fill less than half the SMs (perf-notes, "The Gluon
    # recurrence on the few-program rows": H12 N1 and N2 T1024 10% faster)
    # (rows of one token: Triton 3.6 fails to lower the Gluon kernels specialised to seq_len = 1)
    gluon_recurrence = warpgroup_mma and width in WARPGROUP_SLICE_WIDTHS and seq_len > 1
    gluon_transition = (warpgroup_mma and bool(segment_chunks) and transition_width in WARPGROUP_SLICE_WIDTHS
                        and seq_len > 1)
    if gluon_recurrence or gluon_transition:
        gluon_parts = [part for part, on in (("transitions", gluon_transition), ("recurrence", gluon_recurrence)) if on]
        reason += f"; the {' and the '.join(gluon_parts)} on Gluon warpgroup kernels (Hopper)"
    # more programs than SMs take turns: the longest sequences' programs first, else a long sequence late in the
    # batch starts its chain in the last wave (H64 varlen mix: a makespan of 132 chunk steps against 177 in
    # cu_seqlens order, at one program an SM; docs/perf-notes.md, "Longest sequences first")
    rows = num_seqs + slot_count(seq_len, num_seqs, CHUNK * segment_chunks, varlen) if segment_chunks \
        else num_seqs  # the recurrence's grid rows: sequences, or segment programs
    longest_first = varlen and num_seqs > 1 and slices * heads * rows > sms
    if longest_first:
        reason += "; the recurrence's longest programs first, as more programs than SMs take turns"
    # the transitions on the order's first rows alone: in a batch of many sequences most segment programs have no
    # transition, and each would hold a transition slot of an SM while it finds that out (docs/perf-notes.md,
    # "Session 49")
    transitions_in_order = longest_first and bool(segment_chunks)
    if transitions_in_order:
        reason += "; the transitions on the rows that the order puts first"
    # the rerun likewise on the rows with work alone: its idle programs, last in the order, landed on the few SMs
    # that the long segments leave (docs/perf-notes.md, "Session 52": the H24 chunked mix 0.6% faster in one
    # process on an H100, the H12 mix within noise)
    rerun_in_order = transitions_in_order
    if rerun_in_order:
        reason += ", and the rerun"
    # not the scan (scan_in_order, a field a plan may set): its first form measured within noise of a program row
    # per sequence on an H100, and its vector form has not run on a GPU (docs/perf-notes.md, "Session 53")
    prepare_warps = 4
    # the solve's busy programs, counted from the tokens alone, so that a varlen call run as rows (equal_rows)
    # decides as the varlen plan would: the same bits with or without the max_seqlen hint. Measured in one process
    # on an H100 (docs/perf-notes.md, "Session 27"): H12 N1 / N4 / N5 T1024 and the H12 chunked mix 0.8-1.4%
    # faster, the rows of 24576 programs 0.3-0.4% slower
    solve_programs = heads * -(-seq_len * (1 if varlen else num_seqs) // CHUNK)
    horner_inverse = solve_programs <= HORNER_PROGRAMS_PER_SM * sms
    if horner_inverse:
        reason += (f"; the solve's diagonal blocks by Horner's rule ({solve_programs} chunks x heads, at most "
                   f"{HORNER_PROGRAMS_PER_SM} an SM)")
    # the inverse at the first kernel's tail where its programs (its grid: chunk slots x heads) fit in one wave: no
    # program waits for a slot behind another's inverse, and the solve's launch and one boundary go. Measured (H100,
    # session 33, docs/perf-notes.md "The inverse in the first kernel"): H12 N1 T1024 2% faster; 4-10% slower
    # wherever the first kernel runs in several waves. The same bits either way, so a varlen call and the same call
    # run as rows may choose differently
    prepare_programs = heads * slot_count(seq_len, num_seqs, CHUNK, varlen)
    inverse_in_prepare = lower_bound_gate and prepare_programs <= PREPARE_PROGRAMS_PER_SM * sms
    if inverse_in_prepare:
        reason += (f"; the first kernel inverts its own chunk ({prepare_programs} programs in one wave of "
                   f"{PREPARE_PROGRAMS_PER_SM} an SM)")
    # a run of programs reads one chunk's rows of every head (docs/perf-notes.md, "Session 48", on an H100 in
    # same-run A/Bs: the rows 1.2-2.8% faster but H12 N1 and N4 T1024, within noise; the varlen mixes about 3%, the
    # segmented rows 1.8-4.5%, H12 N1 and N2 T8192 under 1%; the gain is the first kernel's reads more than the
    # recurrence's L2 hits)
    reason += "; the preparation from the last chunks back, heads innermost"
    return PrefillPlan(
        seq_len=seq_len, num_seqs=num_seqs, varlen=varlen, heads=heads, key_dim=key_dim, value_dim=value_dim,
        lower_bound_gate=lower_bound_gate, sms=sms, chunk=CHUNK, block=BLOCK, cpu_chunk=CPU_CHUNK,
        v_slices=slices, state_rows_v=state_rows_v(width), warpgroup_recurrence=gluon_recurrence,
        warpgroup_transition=gluon_transition, longest_first=longest_first, recurrence_warps=recurrence_warps(width),
        recurrence_stages=WARPGROUP_RECURRENCE_STAGES[width] if gluon_recurrence else 3,
        transition_stages=WARPGROUP_STAGES if gluon_transition else 3,
        prepare_warps=prepare_warps, prepare_stages=3, prepare_channels=prepare_channels(key_dim, lower_bound_gate),
        prepare_token_run=prepare_token_run(CHUNK, key_dim, prepare_warps),
        prepare_registers=prepare_registers(lower_bound_gate, prepare_warps), solve_warps=SOLVE_WARPS,
        solve_stages=3, horner_inverse=horner_inverse, inverse_in_prepare=inverse_in_prepare,
        early_chunks_last=True, transitions_in_order=transitions_in_order,
        rerun_in_order=rerun_in_order,
        segment_chunks=segment_chunks, transition_width=transition_width, scan_warps=8 if key_dim >= 128 else 4,
        reason=reason)


def requested_open_entry_segments(sequence_parallel="auto"):
    """:func:`choose_open_entry_plan`'s ``sequence_parallel``, checked: ``"auto"`` or tokens per segment (not False:
    such a prefill always runs in segments); returns ``"auto"`` or the segment length, ``$FASTKDA_SEQUENCE_PARALLEL``
    read as :func:`requested_sequence_parallel` reads it (its "off" leaves the choice automatic)."""
    _check(parse_sequence_parallel(sequence_parallel, "sequence_parallel") is not False,
           "a prefill whose entry state comes later runs in segments: sequence_parallel must be 'auto' or tokens "
           "per segment, not False")
    choice = requested_sequence_parallel(sequence_parallel)
    return "auto" if choice is False else choice


def choose_open_entry_plan(num_seqs: int, heads: int, seq_len: int, key_dim: int, value_dim: int, sms: int, *,
                           lower_bound_gate: bool = True, sequence_parallel="auto",
                           warpgroup_mma: bool = False) -> PrefillPlan:
    """The plan of a prefill whose entry state is not known when it starts (:func:`fastkda.kda_prefill_open`:
    ``num_seqs`` rows of ``seq_len`` tokens): always segmented, since the sequence's map is needed whatever its
    length. ``sequence_parallel``: ``"auto"`` (then ``$FASTKDA_SEQUENCE_PARALLEL`` if it gives a segment length;
    its "off", meant for :func:`fastkda.kda_prefill`, leaves this automatic) takes the segment length of 1 to
    :data:`MAX_SEGMENTS` segments, within the grid's limit, that the step model predicts fastest, every segment's
    transition over the V + K columns counted (``segmented_us(open_entry=True)``); an int forces segments of that
    many tokens; ``warpgroup_mma`` as :func:`choose_plan` takes it. Raises ``ValueError`` for ``False`` and for
    shapes the kernels do not take."""
    _check_counts(num_seqs=(num_seqs, 1), heads=(heads, 1), seq_len=(seq_len, 1), sms=(sms, 1))
    _check(key_dim in SUPPORTED_DIMS and value_dim in SUPPORTED_DIMS,
           lambda: f"K and V must be in {SUPPORTED_DIMS}, got K={key_dim}, V={value_dim}")
    choice = requested_open_entry_segments(sequence_parallel)
    return _choose_open_entry_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, bool(lower_bound_gate),
                                   choice, bool(warpgroup_mma))


@functools.lru_cache(maxsize=4096, typed=True)  # an eager call's host time counts: the model is weighed at 64 points
def _choose_open_entry_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, lower_bound_gate, choice,
                            warpgroup_mma=False):
    chunks = -(-seq_len // CHUNK)
    width = min(TRANSITION_WIDTHS[0], key_dim, value_dim)
    slices = [s for s in RERUN_SLICE_CHOICES if value_dim // s >= 64] or [1]
    if choice == "auto":
        lengths = sorted({-(-chunks // segments) for segments in range(1, MAX_SEGMENTS + 1)})  # chunks a segment
        fitting = [n for n in lengths if num_seqs + slot_count(seq_len, num_seqs, CHUNK * n, False)
                   <= MAX_GRID_Z]
        _check(bool(fitting), lambda: (f"{num_seqs} rows of {seq_len} tokens need more than CUDA's {MAX_GRID_Z} grid "
                                       f"rows even in one segment each: split the batch"))
        predicted, segment_chunks, v_slices = min(
            (segmented_us(num_seqs, chunks, segment_chunks, heads, key_dim, value_dim, width, s, sms,
                          open_entry=True), segment_chunks, s)
            for segment_chunks in fitting for s in slices)
        reason = f"entry state later: segments of {segment_chunks} chunks, predicted {round(predicted)} µs"
    else:
        segment_chunks = choice // CHUNK
        v_slices = min(slices, key=lambda s: segmented_us(num_seqs, chunks, segment_chunks, heads, key_dim,
                                                          value_dim, width, s, sms, open_entry=True))
        reason = f"entry state later: sequence_parallel={choice} requested"
    plan = _choose_plan(num_seqs, heads, seq_len, key_dim, value_dim, sms, False, lower_bound_gate, v_slices,
                        segment_chunks * CHUNK, 0, warpgroup_mma)
    return dataclasses.replace(plan, reason=f"{reason}, reruns in {plan.v_slices} slice(s)")


@dataclass(frozen=True)
class DecodePlan:
    """What the decode kernel launches with: ``v_slices`` programs per (sequence, head), each holding a
    ``[value_dim / v_slices, key_dim]`` fp32 slice of the state on ``warps`` warps, and why."""

    num_seqs: int
    heads: int
    value_dim: int
    v_slices: int
    warps: int
    reason: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        _check_field_types(self)
        _check(self.num_seqs >= 0 and self.heads >= 1, lambda: (f"decode needs num_seqs >= 0 and heads >= 1, got "
                                                                f"{self.num_seqs} and {self.heads}"))
        _check(self.value_dim in SUPPORTED_DIMS,
               lambda: f"value_dim must be one of {SUPPORTED_DIMS}, got {self.value_dim}")
        width = self.value_dim // max(self.v_slices, 1)
        _check(self.v_slices >= 1 and self.value_dim % self.v_slices == 0 and width >= MIN_SLICE_WIDTH,
               lambda: (f"v_slices={self.v_slices} leaves decode slices narrower than {MIN_SLICE_WIDTH} columns of "
                        f"V={self.value_dim}"))
        _check(self.warps in WARP_CHOICES, lambda: f"decode warps must be one of {WARP_CHOICES}, got {self.warps}")

    @property
    def slice_width(self) -> int:
        return self.value_dim // self.v_slices

    def launch_numbers(self) -> tuple:
        """The plan as plain integers, the form the custom op carries (:meth:`from_launch_numbers`)."""
        return (self.num_seqs, self.heads, self.value_dim, self.v_slices, self.warps)

    @staticmethod
    def from_launch_numbers(numbers) -> "DecodePlan":
        return _decode_plan_from_numbers(tuple(numbers))

    def replace(self, **changes) -> "DecodePlan":
        """This plan with some numbers changed (validated), its reason saying which."""
        return _replaced(self, changes)


@functools.lru_cache(maxsize=4096)
def _decode_plan_from_numbers(numbers):
    return DecodePlan(*numbers)


def decode_warps(slice_width: int) -> int:
    """Warps per decode program: 2 for 16 state columns, 4 for 32, 8 beyond (32 state elements a thread)."""
    return 2 if slice_width <= 16 else 4 if slice_width <= 32 else 8


def choose_decode_plan(num_seqs: int, heads: int, value_dim: int, sms: int, v_slices="auto", *,
                       tokens: int = 1) -> DecodePlan:
    """Decode's plan: slices of :data:`DECODE_SLICE_WIDTH` columns unless overridden. Decode is bound by the
    state's bytes, not by a serial chain, so the slice width is set by registers: a narrow slice leaves room for
    several programs per SM to keep loads in flight. The warps of a 16-column slice walking one token per sequence
    follow the grid (:func:`one_token_decode_warps`)."""
    return _choose_decode_plan(num_seqs, heads, value_dim, sms, requested_v_slices(v_slices), tokens)


def decode_plan_request(v_slices="auto") -> tuple:
    """Launch numbers that ask the decode op to choose the automatic plan itself from the sizes it runs on
    (:func:`requested_decode_plan`), with the caller's ``v_slices`` checked and read now: for
    :func:`prefill_plan_request`'s reason."""
    return (PLAN_REQUEST, _request_number(requested_v_slices(v_slices)))


def requested_decode_plan(numbers, num_seqs: int, heads: int, value_dim: int, sms: int, tokens: int) -> "DecodePlan":
    """The automatic decode plan of these facts with the choice of :func:`decode_plan_request`'s ``numbers``."""
    _check(len(numbers) == 2 and is_plan_request(numbers), lambda: f"expected a decode plan request, got {numbers!r}")
    return _choose_decode_plan(num_seqs, heads, value_dim, sms, _requested_choice(numbers[1]), tokens)


LONE_DECODE_WARPS = 8  # warps of a one-token 16-column decode program on a grid of fewer programs than SMs


def one_token_decode_warps(programs: int, sms: int) -> int:
    """Warps of a 16-column decode slice when one token per sequence is walked. Where the grid fills every SM the
    step is bound by bytes in flight and one warp keeps more programs resident. Where the grid leaves SMs idle
    (H12 N1: 96 programs on 132) each program is alone on its SM and its time is its own instruction chain: eight
    warps give each thread two state rows of the slice's sixteen rather than eight, so the K reductions take fewer
    steps (ptxas, sm_90a: 736 SASS instructions a warp on two warps, 456 on eight). Several tokens (speculative
    decode) keep two warps, which eight lose to. Measured in docs/perf-notes.md, "Session 31" and the decode sweeps
    of 2026-12-01."""
    return 1 if programs >= sms else LONE_DECODE_WARPS


def _check_counts(**counts):
    """Each ``name=(value, least)``: an int (not a bool) of at least ``least``, else a ``ValueError`` naming it."""
    for name, (value, least) in counts.items():
        _check(isinstance(value, int) and not isinstance(value, bool) and value >= least,
               lambda: f"{name} must be an integer >= {least}, got {value!r}")


@functools.lru_cache(maxsize=4096, typed=True)  # typed: a cached 1 must not pass True or 1.0 (checked here)
def _choose_decode_plan(num_seqs, heads, value_dim, sms, choice, tokens):
    _check_counts(num_seqs=(num_seqs, 0), heads=(heads, 1), sms=(sms, 1), tokens=(tokens, 1))
    _check(value_dim in SUPPORTED_DIMS, lambda: f"V must be in {SUPPORTED_DIMS}, got {value_dim}")
    if choice == "auto":
        slices = max(value_dim // DECODE_SLICE_WIDTH, 1)
        reason = f"{slices} slices of {DECODE_SLICE_WIDTH} columns: decode is bound by the state's bytes"
    else:
        slices = choice
        reason = f"v_slices={choice} requested"
    warps = decode_warps(value_dim // slices)
    if value_dim // slices == DECODE_SLICE_WIDTH and tokens == 1:
        programs = num_seqs * heads * slices
        warps = one_token_decode_warps(programs, sms)
        reason += (f"; {warps} warp(s) a slice: one token per sequence on {programs} programs for {sms} SMs "
                   f"({'bytes in flight' if warps == 1 else 'each program alone on its SM: its chain'} sets the time)")
    return DecodePlan(num_seqs, heads, value_dim, slices, warps, reason)


DECODE_STEP_SLICE_WIDTH = 32  # state columns per program of the fused decode step (on DECODE_STEP_WARPS warps)
DECODE_STEP_WARPS = 4
DECODE_STEP_CHUNK = 32  # state columns a one-slice step program updates at once (it walks its head's chunks in turn)


def decode_step_chunk(value_dim: int) -> int:
    """State columns the one-program-a-head step (``decode_step.head_step_kernel``) updates at once: a 32-column
    slice's registers, so that several programs share an SM."""
    return min(DECODE_STEP_CHUNK, value_dim)


@functools.lru_cache(maxsize=4096, typed=True)  # called on every eager decode step; typed as _choose_decode_plan
def choose_decode_step_plan(num_seqs: int, heads: int, value_dim: int, sms: int):
    """The layer's decode step (:func:`fastkda.kda_decode_step`): the plan of its one fused kernel, or None where
    it runs as three launches (the conv's decode step, KDA decode, the gated norm).

    Fused up to four heads per SM: there the step is latency-bound, or nearly, and two launches fewer save more
    than the fused kernel adds. Past that the step is bound by bytes and the three launches, each stage at its own
    occupancy, are faster than either fused form. The two fused forms:

    - from two heads per SM, one program a head (one slice: ``head_step_kernel``, its state in chunks in turn, no
      join between programs), where every SM holds several heads and the sliced form's join and its repeated q/k
      conv cost more than a head's chunks in turn;
    - below that, 32-column slices on 4 warps joined by tickets (four slices a head at V = 128), where a head's
      chunks in turn would be its program's whole chain.

    Measured in docs/perf-notes.md ("The fused step's head in one program", session 31; "Session 32"; the step
    sweeps before them): the ticket form wins at 1.45 heads an SM and one program a head at 2.18 (192 and 288
    heads, V = 128, on two head counts each); V = 64 takes the same rule unmeasured. Raises ``ValueError`` for
    counts that are not positive ints and for V outside :data:`SUPPORTED_DIMS`."""
    _check_counts(num_seqs=(num_seqs, 0), heads=(heads, 1), sms=(sms, 1))
    _check(value_dim in SUPPORTED_DIMS, lambda: f"V must be in {SUPPORTED_DIMS}, got {value_dim}")
    total = num_seqs * heads
    if total > 4 * sms:
        return None
    if total >= 2 * sms:
        return DecodePlan(num_seqs, heads, value_dim, 1, DECODE_STEP_WARPS,
                          f"fused: {total} heads on {sms} SMs, one program a head on {DECODE_STEP_WARPS} warps "
                          f"(its state in chunks of {decode_step_chunk(value_dim)} columns)")
    slices = max(value_dim // DECODE_STEP_SLICE_WIDTH, 1)
    return DecodePlan(num_seqs, heads, value_dim, slices, DECODE_STEP_WARPS,
                      f"fused: {total} heads on {sms} SMs, {slices} slice(s) a head of "
                      f"{value_dim // slices} columns on {DECODE_STEP_WARPS} warps")


CONV_TOKENS = 32  # tokens per conv program in prefill (fewer for decode's few tokens per sequence)
CONV_CHANNELS = 128  # channels per conv program
NORM_ELEMENTS = 4096  # elements (rows × padded D) per gated-norm program


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def conv_launch(tokens: int, channels: int, width: int) -> tuple:
    """``(token block, channel block, warps)`` of the short conv (``fastkda/ops/conv.py``). The token block is at
    least W−1, so that only a sequence's first block reaches back into its conv state."""
    block_t = max(_next_power_of_2(width - 1), min(CONV_TOKENS, _next_power_of_2(max(tokens, 1))))
    return block_t, min(CONV_CHANNELS, _next_power_of_2(channels)), 4


# the conv's one-token decode step (sweep at 8e3f7c0, H12 and H96 N256, bf16 and fp32 pools): (sequences,
# channels) a program on 4 warps by the pool's layout. Rows [C, W−1] contiguous: a sequence of 128 channels
# (12.4 us at H12 bf16; more sequences a program were slower, their stride-(W−1) columns scalar loads);
# channel-last rows (a column's channels contiguous, as vLLM keeps them): 4 sequences of 256 (10.3 us, 82% of copy
# at H96)
CONV_UPDATE_BLOCKS = {False: (1, 128), True: (4, 256)}


def conv_update_launch(num_seqs: int, channels: int, channel_last: bool) -> tuple:
    """``(sequence block, channel block, warps)`` of the conv's decode step (``conv_update_kernel``): a program
    holds its sequences' pool-row columns in registers, all loaded before any store, so its sequences' slot -> row
    chains are in flight together (:data:`CONV_UPDATE_BLOCKS`)."""
    seqs, block = CONV_UPDATE_BLOCKS[channel_last]
    return min(seqs, _next_power_of_2(num_seqs)), min(block, _next_power_of_2(channels)), 4


def norm_launch(rows: int, dim: int) -> tuple:
    """``(row block, padded D, warps)`` of the gated RMSNorm (``fastkda/ops/norm.py``): whole rows in registers,
    about :data:`NORM_ELEMENTS` elements per program."""
    block_d = _next_power_of_2(dim)
    block_r = max(1, min(_next_power_of_2(rows), NORM_ELEMENTS // block_d))
    return block_r, block_d, 4 if block_d <= 4096 else 8

"""Launch plan of the prefill recurrence: how many V-slices each (sequence, head) is split into.

The recurrence runs one program per (sequence, head, V-slice) through a long serial chain of chunks, so
with few sequences and heads most SMs idle. Splitting V into ``s`` slices gives ``s·N·H`` programs, each
bitwise identical to the unsplit computation of its columns (no step reduces over V). The plan depends
only on host-known facts (N, H, T, K, V and the device's SM count), so a CUDA graph replays the plan it was
captured with and no launch synchronises with the device.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

V_SLICE_CHOICES = (1, 2, 4)
ENV_V_SLICES = "FASTKDA_V_SLICES"
MIN_SLICE_WIDTH = 16  # a V-slice narrower than this cannot feed a tensor-core dot
# Auto takes the most slices, at least NARROW_SLICE_WIDTH columns wide, whose programs fit one per SM, else one slice
# (H200 sweep of the recurrence, 42 shapes, docs/perf-notes.md session 7: at H12 T8192 four 32-wide slices 0.290 ms
# at N1 but 0.466 at N3, where 144 programs put two on some SMs; two 64-wide ones 0.309 there; one 128-wide slice
# per head 0.363 at N6 against 0.378 for two, and 0.384 against 0.418 at H96 N1)
NARROW_SLICE_WIDTH = 32
CHUNK = 32  # tokens per serial step of the prefill recurrence (fastkda.ops.prefill uses this one; H200: 32 beat 64,
# docs/perf-notes.md session 6)


@dataclass(frozen=True)
class Plan:
    """What the prefill launches: ``v_slices`` programs per (sequence, head), whether the recurrence forms w and
    u itself (:func:`w_u_in_recurrence`), and why."""

    v_slices: int
    programs: int
    sms: int
    reason: str
    w_u_in_recurrence: bool = False


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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


def requested_v_slices(argument="auto"):
    """The caller's choice: the argument unless it is ``"auto"``, then ``$FASTKDA_V_SLICES``, then auto."""
    choice = parse_v_slices(argument, "v_slices")
    if choice == "auto" and os.environ.get(ENV_V_SLICES):
        choice = parse_v_slices(os.environ[ENV_V_SLICES], ENV_V_SLICES)
    return choice


def choose_plan(num_seqs: int, heads: int, tokens: int, value_dim: int, sms: int, v_slices="auto") -> Plan:
    """The plan for ``num_seqs`` sequences of about ``tokens`` tokens and ``heads`` heads on ``sms`` SMs.

    Auto: the largest ``s`` whose ``s·N·H`` programs fit one per SM, with slices at least
    :data:`NARROW_SLICE_WIDTH` columns wide; otherwise one slice (one program per sequence and head)."""
    return _plan(num_seqs, heads, tokens, value_dim, sms, requested_v_slices(v_slices))


def w_u_in_recurrence(slice_width: int, pairs: int) -> bool:
    """Whether each recurrence step forms w = T·β·kd and u = T·β·v itself (the solve kernel then only inverts)
    instead of loading the solve kernel's. Same bits either way (the same tf32 products in the same order). It
    saves the solve kernel's w and u traffic, ~12 ns of the whole GPU per (sequence, head) pair and chunk, and costs
    each step of the serial chain two products: ~0.75 µs at 128 columns, about half at 64, more than it saves at 32
    (every slice forms all of w). So it pays from about one pair per two columns of slice width (H200, whole call:
    H96 B1 T8192 1.626 -> 1.522 ms, H12 N4 T8192 at two slices 0.935 -> 0.888; H12 N1 T8192 at one slice 0.495 ->
    0.623; docs/perf-notes.md, session 8)."""
    return slice_width >= 2 * NARROW_SLICE_WIDTH and 2 * pairs >= slice_width


@functools.lru_cache(maxsize=4096)  # an eager call's host time counts: a repeated shape reuses its plan
def _plan(num_seqs, heads, tokens, value_dim, sms, choice):
    pairs = max(num_seqs * heads, 1)
    if choice != "auto":
        if value_dim // choice < MIN_SLICE_WIDTH or value_dim % choice:
            raise ValueError(f"v_slices={choice} leaves slices narrower than {MIN_SLICE_WIDTH} for V={value_dim}")
        return _make_plan(choice, pairs, sms, tokens, value_dim, f"v_slices={choice} requested")
    splits = [s for s in V_SLICE_CHOICES if s > 1 and value_dim % s == 0 and value_dim // s >= NARROW_SLICE_WIDTH]
    fitting = [s for s in splits if s * pairs <= sms]
    if fitting:
        slices = max(fitting)
        reason = f"{slices} slices of {value_dim // slices} columns: {slices * pairs} programs, one per SM on {sms} SMs"
    else:
        slices = 1
        reason = f"1 slice of {value_dim} columns: {pairs} programs" + (
            f"; {min(splits)} slices would be {min(splits) * pairs} programs > {sms} SMs" if splits else "")
    return _make_plan(slices, pairs, sms, tokens, value_dim, reason)


def _make_plan(slices, pairs, sms, tokens, value_dim, reason):
    """The :class:`Plan` of ``slices`` per pair, its reason completed with the serial chain and who forms w, u."""
    in_recurrence = w_u_in_recurrence(value_dim // slices, pairs)
    reason += (f"; each program walks {-(-tokens // CHUNK)} chunk(s) of {CHUNK} tokens in order, forming w and u "
               + ("itself" if in_recurrence else "in the solve kernel"))
    return Plan(slices, slices * pairs, sms, reason, in_recurrence)


DECODE_SLICE_WIDTH = 16  # decode holds a [16, K] fp32 state slice per 2-warp program: 168 registers, 6 programs
# per SM (32 columns on 4 warps took 245 registers, 2 per SM; docs/perf-notes.md)


def choose_decode_plan(num_seqs: int, heads: int, value_dim: int, sms: int, v_slices="auto") -> Plan:
    """Decode's plan: slices of :data:`DECODE_SLICE_WIDTH` columns unless overridden. Decode is bound by the
    state's bytes, not a serial chain, so the slice width is set by registers (to be tuned on the device)."""
    choice = requested_v_slices(v_slices)
    pairs = max(num_seqs * heads, 1)
    if choice == "auto":
        slices = max(value_dim // DECODE_SLICE_WIDTH, 1)
        return Plan(slices, slices * pairs, sms, f"{slices} slice(s) of {DECODE_SLICE_WIDTH} columns (decode)")
    if value_dim // choice < MIN_SLICE_WIDTH or value_dim % choice:
        raise ValueError(f"v_slices={choice} leaves slices narrower than {MIN_SLICE_WIDTH} for V={value_dim}")
    return Plan(choice, choice * pairs, sms, f"v_slices={choice} requested (decode)")

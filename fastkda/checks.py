"""Checks of the values inside the index and input tensors, which the host can only read by synchronising.

On CPU tensors the index checks (``cu_seqlens``, checkpoint offsets, decode slots and accepted counts) always run
before anything is written: reading them costs nothing there. On the GPU the kernels never leave their buffers
whatever these hold (:mod:`fastkda.errors`), so the fast path reads nothing; checked mode (``checks=True`` on a
call, or ``FASTKDA_CHECKS=1``) synchronises and runs every check, also that a precomputed gate is at most 0 and
that the inputs are finite, raising ``ValueError`` naming the argument before any kernel runs.
"""

from __future__ import annotations

import os

import torch

from .validation import capturing, fail

ENV_CHECKS = "FASTKDA_CHECKS"


ENV_SWITCH = {"": False, "0": False, "false": False, "no": False, "off": False,
              "1": True, "true": True, "yes": True, "on": True}  # $FASTKDA_CHECKS's spellings, case aside


def requested(checks) -> bool:
    """The call's ``checks`` argument, or ``$FASTKDA_CHECKS`` when it is None: "1", "true", "yes", "on" (any case)
    turn checked mode on, "", "0", "false", "no", "off" leave it off; anything else is a ``ValueError`` naming it
    (a safety switch must not turn itself off over a spelling)."""
    if checks is None:
        setting = os.environ.get(ENV_CHECKS, "")
        switch = ENV_SWITCH.get(setting.strip().lower())
        if switch is None:
            fail(ENV_CHECKS, f"one of {', '.join(repr(s) for s in ENV_SWITCH if s)} (or unset)", repr(setting))
        return switch
    if not isinstance(checks, bool):
        fail("checks", "True, False or None (then $FASTKDA_CHECKS decides)", repr(checks))
    return checks


def outside_capture(anchor):
    """Checked mode reads device memory: refused by name while ``anchor``'s CUDA stream is being captured into a
    graph (the read would end the capture with CUDA's own error)."""
    if capturing(anchor.device):
        fail("checks", "off inside CUDA-graph capture (checked mode reads device memory)", True)


def cu_seqlens_values(cu_seqlens, length, row_length=None, padded=False):
    """Offsets nondecreasing from 0 to T (``padded``: to at most T, the tokens past the last offset padding that
    no sequence owns); with ``row_length``, every sequence that many tokens long, as a plan
    that runs the sequences as rows of that length needs (:attr:`fastkda.plan.PrefillPlan.equal_rows`: a
    ``max_seqlen`` hint with N·max_seqlen = T). Offsets from 0 to T that give another length give some sequence
    more, which is named (the hint is below the longest length). One read of the offsets for both checks."""
    offsets = cu_seqlens.tolist()
    ends_right = offsets[-1] <= length if padded else offsets[-1] == length
    if offsets[0] != 0 or not ends_right or any(b < a for a, b in zip(offsets, offsets[1:])):
        shown = offsets if len(offsets) <= 16 else offsets[:8] + ["..."] + offsets[-8:]
        fail("cu_seqlens", f"nondecreasing from 0 to {'at most ' if padded else ''}T={length}", shown)
    if row_length is None:
        return
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if any(x != row_length for x in lengths):
        longer = next(n for n, x in enumerate(lengths) if x > row_length)
        fail("cu_seqlens", f"offsets that give every sequence {row_length} tokens, the plan's rows (a max_seqlen "
                           f"hint with N·max_seqlen = T, or a plan made with one, runs the sequences as rows: the "
                           f"hint must be at least the longest sequence's length)",
             f"sequence {longer} of {lengths[longer]} tokens")


def checkpoint_offsets_values(checkpoint_offsets, chunk):
    """Offsets non-negative multiples of the chunk (on the GPU without checks, another value never matches a
    chunk boundary and is not written)."""
    offsets = checkpoint_offsets.reshape(-1).tolist()
    if any(o < 0 or o % chunk for o in offsets):
        fail("checkpoint_offsets", f"non-negative multiples of the chunk size {chunk}", offsets)


def conv_slots_values(slots, pool_size):
    """No conv-state row named by two sequences (rows outside ``[0, P)`` name none): each row is read and written
    by one sequence, else the result would depend on the order the sequences run in."""
    owner = {}
    for n, row in enumerate(slots.tolist()):
        if 0 <= row < pool_size and owner.setdefault(row, n) != n:
            fail("slots", "distinct between sequences (each conv-state row read and written by one sequence)",
                 f"row {row} in sequences {owner[row]} and {n}")


def decode_indices(slots, num_accepted_tokens, pool_size, tokens):
    """Accepted counts in ``[1, T]``; slots below the pool's size (negative ones are padding); no slot read or
    written by two live sequences (their updates would race). ``[N]`` slots that pass take one ``tolist`` and a
    set (an eager decode step's host time counts); any failure is found, and reported, by the loop below."""
    if slots.dim() == 1 and num_accepted_tokens is None:
        live = [slot for slot in slots.tolist() if slot >= 0]
        if (not live or max(live) < pool_size) and len(set(live)) == len(live):
            return
    rows = slots.tolist() if slots.dim() == 2 else [[slot] for slot in slots.tolist()]
    if num_accepted_tokens is not None:
        accepted = num_accepted_tokens.tolist()
        bad = [n for n, a in enumerate(accepted) if not 1 <= a <= tokens]
        if bad:
            fail("num_accepted_tokens", f"in [1, T={tokens}] for every sequence",
                 f"{accepted[bad[0]]} for sequence {bad[0]}")
    owner = {}
    for n, row in enumerate(rows):
        read = row[accepted[n] - 1] if num_accepted_tokens is not None else row[0]
        if read < 0:  # a padding row reads and writes nothing
            continue
        used = {read} | {s for s in row if s >= 0} if len(row) > 1 else {read}
        for slot in sorted(used):
            if slot >= pool_size:
                fail("slots", f"below the pool's size {pool_size} (negative for padding)",
                     f"{slot} for sequence {n}")
            if owner.setdefault(slot, n) != n:
                fail("slots", "distinct between live sequences (each slot read and written by one sequence)",
                     f"slot {slot} in sequences {owner[slot]} and {n}")


def read_rows(slots, num_accepted_tokens=None):
    """The pool rows a decode call reads, for slots that passed :func:`decode_indices`: each live sequence's read
    slot (``[N, T]`` slots: its last accepted token's, else its first), none for a padding row."""
    if slots.dim() == 2:
        picked = (num_accepted_tokens.long() - 1 if num_accepted_tokens is not None
                  else torch.zeros(slots.shape[0], dtype=torch.long, device=slots.device))
        slots = slots.gather(1, picked[:, None].to(slots.device))[:, 0]
    return slots[slots >= 0].long()


def precomputed_gate_values(g):
    """A precomputed gate is a log-decay: at most 0 (the kernels take a larger value as 0)."""
    largest = g.max().item() if g.numel() else 0.0
    if largest > 0:
        fail("g", "at most 0 with the precomputed gate (a log-decay; A_log, dt_bias and lower_bound are None)",
             f"a maximum of {largest}")


def finite(**tensors):
    """Every given tensor finite (NaN or infinity in an input spreads to its outputs and states)."""
    for name, x in tensors.items():
        if x is not None and x.numel() and not bool(torch.isfinite(x).all()):
            fail(name, "finite (no NaN or infinity)", f"{int((~torch.isfinite(x)).sum())} non-finite value(s)")

"""Counts of bad device-side indices that the GPU kernels met and made harmless, per device.

The kernels never read or write outside their buffers, whatever the index tensors on the device hold, and they
cannot raise without a host-device synchronisation. So each such event is neutralised as the API documents (a
slot outside the pool is a null row, a count out of range nulls its sequence, ``cu_seqlens`` entries are clamped)
and counted here, in a small int32 tensor per device that every fastkda call on that device adds to (CUDA graphs
captured with fastkda calls add to it on every replay). Reading the counts synchronises, so do it when it suits:
``fastkda.error_counts()``. For a check that raises at the call instead, use checked mode (``checks=True`` or
``FASTKDA_CHECKS=1``, :mod:`fastkda.checks`).

The counters, in their order in the tensor (the kernels add to them by position):

0. ``slot``: a decode state slot at or past the pool's size (a read slot: the sequence is a null row, zero output,
   nothing read or written; a per-token write slot: that write is skipped). Negative slots are padding, not errors.
1. ``accepted``: a ``num_accepted_tokens`` entry outside ``[1, T]`` (the sequence is a null row).
2. ``cu_seqlens``: a prefill sequence whose ``cu_seqlens`` entries lie outside ``[0, T]`` or decrease (its span is
   clamped into ``[0, T]`` and to a non-negative length; its outputs are then unspecified but stay in their buffers),
   or, in a call run as rows (one sequence, or a ``max_seqlen`` hint with N·max_seqlen = T: the plan's
   ``equal_rows``), whose entries are not its row's (nothing is clamped there: the rows run as the plan says, the
   offsets unread but for this count; the outputs are then unspecified, and stay in their buffers).
"""

from __future__ import annotations

import torch

from .validation import capturing

KINDS = ("slot", "accepted", "cu_seqlens")
_COUNTERS: dict = {}  # torch.device -> int32 tensor [len(KINDS)]


def _device(device) -> torch.device:
    """The device whose counters are meant (None: the current CUDA device, or the CPU on a machine without CUDA,
    whose path raises for bad values and counts none): a CPU device (the kernels under the interpreter) or a CUDA
    device this process can use; anything else is a ``ValueError`` naming ``device``."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"fastkda: device must name a device, got {device!r} ({exc})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"fastkda: device must be a CUDA device this process can use (the counters live on "
                             f"the GPU that runs the kernels), got {device} without CUDA")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"fastkda: device must be a CUDA device (or cpu, for the interpreter), got {device}")
    return device


def counters(device=None) -> torch.Tensor:
    """The counters tensor of a device (allocated, zeroed, on first use), as the kernels take it (the kernels run
    on CPU tensors too, under Triton's interpreter)."""
    found = _COUNTERS.get(device)  # a CUDA tensor's device names its index: the common case, looked up as is
    if found is not None:
        return found
    device = _device(device)
    found = _COUNTERS.get(device)
    if found is None:
        if capturing(device):  # zeroing would be recorded, and
            # redone on every replay
            raise ValueError("fastkda: errors must be passed (an int32 tensor of 3 zeros) to a call captured in a "
                             "CUDA graph before any fastkda call ran on its device, got None")
        found = _COUNTERS[device] = torch.zeros(len(KINDS), dtype=torch.int32, device=device)
    return found


def error_counts(device=None) -> dict:
    """``{kind: count}`` on a CUDA device since the last reset (this synchronises with the device); None: the
    current one (the CPU's, all zeros, on a machine without CUDA)."""
    return dict(zip(KINDS, counters(device).tolist()))


def reset_error_counts(device=None) -> None:
    """Zero the counters of a CUDA device (asynchronously, on the current stream)."""
    counters(device).zero_()

"""Argument types and checks shared by the bench's command lines (:mod:`.models`, :mod:`.layer`,
:mod:`.parallel`), so that a bad value is argparse's ``error:`` line (exit 2) before anything is measured."""

from __future__ import annotations

import argparse

import torch


def positive_int(text):
    """An argparse type: an integer of at least 1 (a count of repeats, steps, processes or tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text):
    """An argparse type: a finite number above 0 (a scale of the workloads' lengths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def supported_head_dim(text):
    """An argparse type: K = V, one the kernels take (:data:`fastkda.plan.SUPPORTED_DIMS`)."""
    from ..plan import SUPPORTED_DIMS

    value = positive_int(text)
    if value not in SUPPORTED_DIMS:
        raise argparse.ArgumentTypeError(f"must be one of {SUPPORTED_DIMS}, got {value}")
    return value


def batch_by_length(text):
    """An argparse type: a ``BxT`` case (B sequences of T tokens, both at least 1) as ``(B, T)``."""
    parts = text.split("x")
    try:
        batch, length = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxT (e.g. 2x1024), got {text!r}") from None
    if batch < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"B and T must be at least 1, got {text!r}")
    return batch, length


def checked_device(parser, name):
    """``torch.device(name)``, or ``parser.error`` where torch does not know the name or it is a CUDA device and
    CUDA is not available here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        parser.error(f"--device {name}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: CUDA is not available here")
    return device

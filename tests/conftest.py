"""Without a GPU, the Triton kernels run on Triton's CPU interpreter where its versions allow (``interpreter.py``);
``TRITON_INTERPRET`` must be set before ``triton.jit`` runs, so here, before any test imports fastkda's kernels."""

import os
import sys


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Under pytest-xdist (the README's test command), each worker's OpenMP threads (torch, and the BLAS numpy uses) get
# an equal share of the cores, not all of them each (faster: docs/perf-notes.md, "Session 28"). Set before torch
# is imported, which reads it then; a value the caller set is kept.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers.py and interpreter.py, from any subfolder

import interpreter  # noqa: E402

if not torch.cuda.is_available() and interpreter.unavailable_reason() is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if interpreter.active():
    interpreter.install_ordered_dot()
    interpreter.install_one_patch_per_launch()
    interpreter.skip_dead_overflow_checks()

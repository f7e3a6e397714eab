"""Without a GPU, the Triton kernels run on Triton's CPU interpreter where its versions allow (``interpreter.py``);
``TRITON_INTERPRET`` must be set before ``triton.jit`` runs, so here, before any test imports fastkda's kernels."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers.py and interpreter.py, from any subfolder

import interpreter  # noqa: E402

if not torch.cuda.is_available() and interpreter.unavailable_reason() is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if interpreter.active():
    interpreter.install_ordered_dot()
    interpreter.install_one_patch_per_launch()

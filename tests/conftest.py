"""Without a GPU, Triton kernels run on the CPU interpreter (must be set before triton.jit runs)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

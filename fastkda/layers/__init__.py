"""Model layers built on fastkda's kernels (spec §9)."""

from .kda import KimiDeltaAttention
from .parallel import TensorParallelKimiDeltaAttention

__all__ = ["KimiDeltaAttention", "TensorParallelKimiDeltaAttention"]

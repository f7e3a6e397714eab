"""Model layers built on fastkda's kernels (spec §9)."""

from .kda import KimiDeltaAttention

__all__ = ["KimiDeltaAttention"]

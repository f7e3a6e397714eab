"""Per-request caches of KDA layers: recurrent-state and conv-state pools indexed by slot (spec §9)."""

from .pools import NULL_SLOT, KDACache, conv_state_pool

__all__ = ["KDACache", "NULL_SLOT", "conv_state_pool"]

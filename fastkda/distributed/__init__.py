"""KDA across processes: context parallelism of one long sequence over a ``torch.distributed`` group
(:mod:`fastkda.distributed.context`). The tensor-parallel layer is :class:`fastkda.layers.
TensorParallelKimiDeltaAttention`."""

from .context import context_parallel_prefill, segment_transition

__all__ = ["context_parallel_prefill", "segment_transition"]

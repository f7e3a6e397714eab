"""Tensor parallelism of the KDA layer over a ``torch.distributed`` process group (issue 20's first part).

Each rank holds ``H / world`` of the heads: the q, k, v, gate (``f_b_proj``, ``dt_bias``, ``A_log``), β and output
gate (``g_b_proj``) projections column-parallel (its heads' rows), the conv's channels of its heads, the gated
norm (per head, so whole on every rank), and ``o_proj`` row-parallel (its heads' columns), whose partial outputs
are summed by an all-reduce. ``f_a_proj`` and ``g_a_proj`` (hidden → D, shared by every head) are replicated. A
rank's :class:`fastkda.cache.KDACache` holds its heads' states; the slots are the same on every rank.
"""

import torch
import torch.distributed as dist
from torch import nn

from .kda import KimiDeltaAttention


def _shard_rows(weight, rank, world):
    return weight.chunk(world, dim=0)[rank]


class TensorParallelKimiDeltaAttention(nn.Module):
    """A :class:`KimiDeltaAttention` sharded by heads over ``group`` (``world`` ranks, ``H % world == 0``); called
    exactly as the unsharded layer, with the same arguments on every rank, it returns the same output on every
    rank (fp32 rounding of the all-reduce's sum aside)."""

    def __init__(self, local, group=None):
        super().__init__()
        self.local = local
        self.group = group

    @classmethod
    def from_unsharded(cls, layer, group=None):
        """This rank's shard of ``layer`` (the whole layer's weights, the same on every rank)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError("TensorParallelKimiDeltaAttention: this rank is not in group")
        heads, dim = layer.num_heads, layer.head_dim
        if heads % world:
            raise ValueError(f"TensorParallelKimiDeltaAttention: {heads} heads do not split over {world} ranks")
        weight = layer.q_proj.weight
        local = KimiDeltaAttention(layer.hidden_size, heads // world, dim, conv_kernel=layer.conv_kernel,
                                   lower_bound=layer.forget_gate.lower_bound, norm_eps=layer.o_norm.variance_epsilon,
                                   layer_idx=layer.layer_idx, fused_decode=layer.fused_decode, device=weight.device,
                                   dtype=weight.dtype)
        local.conv1d.to(layer.conv1d.weight.dtype)  # a conv kept in fp32 (GLM-5.3-Flash's) stays fp32
        conv = layer.conv1d.weight.chunk(3, dim=0)  # q | k | v channels, each [H·D, 1, W]
        shard = {
            "q_proj.weight": _shard_rows(layer.q_proj.weight, rank, world),
            "k_proj.weight": _shard_rows(layer.k_proj.weight, rank, world),
            "v_proj.weight": _shard_rows(layer.v_proj.weight, rank, world),
            "conv1d.weight": torch.cat([_shard_rows(part, rank, world) for part in conv]),
            "forget_gate.f_a_proj.weight": layer.forget_gate.f_a_proj.weight,
            "forget_gate.f_b_proj.weight": _shard_rows(layer.forget_gate.f_b_proj.weight, rank, world),
            "forget_gate.dt_bias": _shard_rows(layer.forget_gate.dt_bias, rank, world),
            "forget_gate.A_log": _shard_rows(layer.forget_gate.A_log, rank, world),
            "b_proj.weight": _shard_rows(layer.b_proj.weight, rank, world),
            "g_a_proj.weight": layer.g_a_proj.weight,
            "g_b_proj.weight": _shard_rows(layer.g_b_proj.weight, rank, world),
            "o_norm.weight": layer.o_norm.weight,
            "o_proj.weight": layer.o_proj.weight.chunk(world, dim=1)[rank],
        }
        local.load_state_dict({name: tensor.detach().clone() for name, tensor in shard.items()})
        return cls(local, group)

    @property
    def num_heads(self):
        """This rank's heads (what its cache holds)."""
        return self.local.num_heads

    def forward(self, hidden_states, cache=None, **kwargs):
        """:meth:`KimiDeltaAttention.forward` on this rank's heads, the partial outputs summed over the group
        (checkpoints, when asked for, are this rank's heads')."""
        result = self.local(hidden_states, cache, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        dist.all_reduce(out, group=self.group)
        return result

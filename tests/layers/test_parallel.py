"""Tensor parallelism of the KDA layer on the CPU: 2 and 4 processes over gloo, each holding its heads; the
packed prefill and the decode steps after it equal the unsharded layer's outputs within fp32 rounding."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastkda.bench.parallel import free_port

HIDDEN, HEADS, DIM = 64, 4, 64


def _rank_main(rank, world, port, lower_bound):
    import datetime

    from fastkda.cache import KDACache
    from fastkda.layers import KimiDeltaAttention
    from fastkda.layers.parallel import TensorParallelKimiDeltaAttention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        whole = KimiDeltaAttention(HIDDEN, HEADS, DIM, lower_bound=lower_bound)
        with torch.no_grad():
            whole.forget_gate.A_log.uniform_(-1, 1)
            whole.forget_gate.dt_bias.uniform_(-1, 1)
            whole.o_norm.weight.uniform_(0.5, 1.5)
        sharded = TensorParallelKimiDeltaAttention.from_unsharded(whole)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(75, HIDDEN, generator=gen)
        steps = [torch.randn(3, 1, HIDDEN, generator=gen) for _ in range(2)]
        cu = torch.tensor([0, 40, 41, 75], dtype=torch.int32)
        outputs = {}
        for name, layer in (("whole", whole), ("sharded", sharded)):
            cache = KDACache(3, 1, layer.num_heads, DIM, 3 * layer.num_heads * DIM, 4)
            slots = cache.allocate(3)
            with torch.no_grad():
                outs = [layer(x, cache, slots=slots, cu_seqlens=cu)]
                outs += [layer(step, cache, slots=slots, decode=True).flatten(0, 1) for step in steps]
            outputs[name] = torch.cat(outs)
        err = ((outputs["sharded"] - outputs["whole"]).norm() / outputs["whole"].norm()).item()
        assert err < 1e-5, f"rank {rank}: relative error {err:.2e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
def test_sharded_layer_equals_the_whole_layer(world, lower_bound):
    mp.spawn(_rank_main, args=(world, free_port(), lower_bound), nprocs=world, join=True)


def _indivisible_main(rank, world, port):
    from fastkda.layers import KimiDeltaAttention
    from fastkda.layers.parallel import TensorParallelKimiDeltaAttention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with pytest.raises(ValueError, match="3 heads do not split over 2 ranks"):
            TensorParallelKimiDeltaAttention.from_unsharded(KimiDeltaAttention(HIDDEN, 3, DIM))
    finally:
        dist.destroy_process_group()


def test_heads_must_divide_over_the_ranks():
    mp.spawn(_indivisible_main, args=(2, free_port()), nprocs=2, join=True)


def _fp32_conv_main(rank, world, port):
    from fastkda.layers import KimiDeltaAttention
    from fastkda.layers.parallel import TensorParallelKimiDeltaAttention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        whole = KimiDeltaAttention(HIDDEN, HEADS, DIM, lower_bound=-5.0, dtype=torch.bfloat16)
        whole.conv1d.to(torch.float32)
        with torch.no_grad():
            whole.conv1d.weight.uniform_(-0.5, 0.5)  # fp32 values past bf16's 8 bits
        local = TensorParallelKimiDeltaAttention.from_unsharded(whole).local
        assert local.conv1d.weight.dtype == torch.float32
        shards = [part.chunk(world, dim=0)[rank] for part in whole.conv1d.weight.chunk(3, dim=0)]
        assert torch.equal(local.conv1d.weight, torch.cat(shards))
    finally:
        dist.destroy_process_group()


def test_a_conv_kept_in_fp32_stays_fp32_in_each_shard():
    """GLM-5.3-Flash's fp32 conv in a bf16 layer: each rank's shard keeps its fp32 weights (a bf16 shard was 5.6e-3
    off the whole layer's output)."""
    mp.spawn(_fp32_conv_main, args=(2, free_port()), nprocs=2, join=True)

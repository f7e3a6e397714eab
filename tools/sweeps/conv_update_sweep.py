"""The conv's one-token decode step on the device under sequence blocks, channel blocks and warps, CUDA-graph
replay, against the copy rate of the same run: the numbers behind :func:`fastkda.plan.conv_update_launch`. Two
pool layouts: ``contiguous`` (``[P, C, W−1]`` memory) and ``channel_last`` (the same values in ``[P, W−1, C]``
memory, as ``KDACache`` and vLLM keep their conv states).

python tools/sweeps/conv_update_sweep.py [--layouts contiguous channel_last] [--seq-blocks 1 2] [--blocks 128 256]
    [--warps 2 4 8]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*", default=["contiguous", "channel_last"],
                        choices=["contiguous", "channel_last"])
    parser.add_argument("--seq-blocks", nargs="*", type=int, default=[1, 2], help="sequences per program")
    parser.add_argument("--blocks", nargs="*", type=int, default=[128, 256], help="channels per program (powers of 2)")
    parser.add_argument("--warps", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--seqs", type=int, default=256)
    args = parser.parse_args(argv)
    import torch

    from fastkda.bench.timing import copy_bandwidth_gbps, time_graph
    from fastkda.ops.conv import conv_update_forward
    from fastkda.plan import conv_update_launch

    copy = copy_bandwidth_gbps()
    print(f"[conv-update] copy {copy:.0f} GB/s; the plan's choice (contiguous, channel-last) "
          f"{conv_update_launch(args.seqs, 3 * 12 * 128, False)}, {conv_update_launch(args.seqs, 3 * 12 * 128, True)}")
    for heads in (12, 96):
        channels, width, seqs = 3 * heads * 128, 4, args.seqs
        x = torch.randn(seqs, 1, channels, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(channels, width, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(seqs, device="cuda", dtype=torch.int32)
        out = torch.empty_like(x)
        for pool_dtype in (torch.bfloat16, torch.float32):
            values = torch.randn(seqs + 1, channels, width - 1, device="cuda").to(pool_dtype)
            pools = dict(contiguous=values, channel_last=values.transpose(1, 2).contiguous().transpose(1, 2))
            moved = 2 * x.numel() * 2 + 2 * seqs * channels * (width - 1) * values.element_size()
            for layout in args.layouts:
                pool = pools[layout]
                for seq_block in args.seq_blocks:
                    for block in args.blocks:
                        for warps in args.warps:
                            ms = time_graph(lambda: conv_update_forward(x, weight, None, pool, slots, True, out,
                                                                        seq_block, block, warps))
                            gbps = moved / ms / 1e6
                            print(f"[conv-update] H{heads} N{seqs} {str(pool_dtype)[6:]} pool {layout} BS{seq_block} "
                                  f"BC{block} {warps} warps: {ms * 1e3:.1f} us, {gbps:.0f} GB/s "
                                  f"({100 * gbps / copy:.0f}% of copy)", flush=True)


if __name__ == "__main__":
    main()

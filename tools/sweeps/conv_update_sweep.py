"""The conv's one-token decode step on the device under sequence blocks, channel blocks and warps, CUDA-graph
replay, against the copy rate of the same run: the numbers behind :func:`fastkda.plan.conv_update_launch`. Both
kernels: ``rows`` (``conv_update_rows_kernel``, a contiguous pool) and ``tile`` (``conv_update_kernel``, the same
values in a pool whose rows are not contiguous: a ``[P, C, W]`` buffer's first W−1 columns).

python tools/sweeps/conv_update_sweep.py [--forms rows tile] [--seq-blocks 1 2] [--blocks 128 336] [--warps 2 4 8]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", nargs="*", default=["rows", "tile"], choices=["rows", "tile"])
    parser.add_argument("--seq-blocks", nargs="*", type=int, default=[1, 2], help="sequences per program")
    parser.add_argument("--blocks", nargs="*", type=int, default=[128, 336], help="channels per program (tile: powers of 2 only)")
    parser.add_argument("--warps", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--seqs", type=int, default=256)
    args = parser.parse_args(argv)
    import torch

    from fastkda.bench.timing import copy_bandwidth_gbps, time_graph
    from fastkda.ops.conv import conv_update_forward
    from fastkda.plan import conv_update_launch

    copy = copy_bandwidth_gbps()
    print(f"[conv-update] copy {copy:.0f} GB/s; the plan's choice (rows, tile): "
          f"{conv_update_launch(args.seqs, 3 * 12 * 128, 4, True)}, {conv_update_launch(args.seqs, 3 * 12 * 128, 4, False)}")
    for heads in (12, 96):
        channels, width, seqs = 3 * heads * 128, 4, args.seqs
        x = torch.randn(seqs, 1, channels, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(channels, width, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(seqs, device="cuda", dtype=torch.int32)
        out = torch.empty_like(x)
        for pool_dtype in (torch.bfloat16, torch.float32):
            values = torch.randn(seqs + 1, channels, width, device="cuda").to(pool_dtype)
            pools = dict(rows=values[..., :width - 1].contiguous(), tile=values[..., :width - 1])
            moved = 2 * x.numel() * 2 + 2 * seqs * channels * (width - 1) * values.element_size()
            for form in args.forms:
                pool = pools[form]
                for seq_block in args.seq_blocks:
                    for block in [b for b in args.blocks if form == "rows" or b & (b - 1) == 0]:  # tile: powers of 2
                        for warps in args.warps:
                            ms = time_graph(lambda: conv_update_forward(x, weight, None, pool, slots, True, out,
                                                                        seq_block, block, warps))
                            gbps = moved / ms / 1e6
                            print(f"[conv-update] H{heads} N{seqs} {str(pool_dtype)[6:]} pool {form} BS{seq_block} "
                                  f"BC{block} {warps} warps: {ms * 1e3:.1f} us, {gbps:.0f} GB/s "
                                  f"({100 * gbps / copy:.0f}% of copy)", flush=True)


if __name__ == "__main__":
    main()

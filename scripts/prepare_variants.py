"""Time the preparation kernel's launch variants (channel block x warps) in one device call, and check each
variant's output against the default's (they differ only in summation order, so within 1e-2 relative).

python scripts/prepare_variants.py [--only H96_B1_T8192 ...] [--blocks 16 32] [--warps 4 8]"""

import argparse
import itertools

from triton.testing import do_bench

from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs
from fastkda.ops import prefill

parser = argparse.ArgumentParser()
parser.add_argument("--only", nargs="*", default=["H12_N1_T8192", "H96_B1_T8192"])
parser.add_argument("--blocks", nargs="*", type=int, default=[16, 32])
parser.add_argument("--warps", nargs="*", type=int, default=[4, 8])
args = parser.parse_args()
default = (prefill.CHANNEL_BLOCK, prefill.PREPARE_WARPS)
for w in load_workloads()["prefill"]:
    if w["name"] not in args.only:
        continue
    run = fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")
    prefill.CHANNEL_BLOCK, prefill.PREPARE_WARPS = default
    expected = run()[0].clone()
    for block, warps in itertools.product(args.blocks, args.warps):
        prefill.CHANNEL_BLOCK, prefill.PREPARE_WARPS = block, warps
        out = run()[0]
        err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        ms = do_bench(run, warmup=10, rep=50, return_mode="median")
        print(f"[variants] {w['name']} channel_block={block} warps={warps}: {ms:.3f} ms (whole call), "
              f"vs default {err:.1e}")
prefill.CHANNEL_BLOCK, prefill.PREPARE_WARPS = default

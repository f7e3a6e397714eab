"""What ptxas says of fastkda's kernels compiled for sm_90a on this machine (no GPU, no device time): registers,
spills, shared memory, barrier and wgmma counts, for exactly what a launch under the plan of a shape compiles.

python tools/profiling/compile_stats.py [--workload H12_N1_T8192 | --heads 12 --seqs 1 --tokens 8192]
    [--kernels prepare solve recurrence decode] [--set prepare_warps=8,...] [--decode-set warps=4] [--checkpoints 2]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from tools.profiling.hopper import (KERNELS, add_plan_arguments, compile_stats, launches,  # noqa: E402
                                    plans_from_arguments)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_plan_arguments(parser)
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=KERNELS)
    args = parser.parse_args(argv)
    plan, decode_plan = plans_from_arguments(args)
    print(f"[compile] plan: {plan.describe()}".replace("\n", "\n[compile]   "))
    print(f"[compile] decode plan: v_slices={decode_plan.v_slices}, warps={decode_plan.warps}")
    found = {}
    launched = launches(plan, decode_plan, args.kernels, args.checkpoints)
    for name, (fn, kernel_args, warps, stages, maxnreg) in launched.items():
        found[name] = compile_stats(fn, kernel_args, warps, stages, maxnreg)
        print(f"[compile] {name} warps={warps} stages={stages}: {found[name]}", flush=True)
    for name in args.kernels:
        if name not in launched:  # e.g. the solve under inverse_in_prepare, the SP kernels under a serial plan
            print(f"[compile] {name}: not launched under this plan", flush=True)
    return found


if __name__ == "__main__":
    main()

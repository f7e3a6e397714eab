"""One decode call for Nsight Compute to count: fastkda's KDA decode step, the benchmark's memory floor
(:mod:`fastkda.bench.floor`, slot -> state -> store on decode's plan) and, for a one-token workload, the layer's
fused decode step on its own plan, on one decode workload's inputs, so that the stall reasons of the steps and of
their floor are read side by side (``-k`` picks ``decode_kernel``, ``state_chain_kernel`` or
``decode_step_kernel``, the fused step's sliced form, which its plan takes below two heads an SM).

ncu --clock-control none --set full --import-source yes -k regex:decode_kernel --launch-count 1 \\
    python tools/profiling/ncu_decode.py [--only decode_H12_N1]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.bench.runners import fastkda_decode_runner, fastkda_step_runner, floor_decode_runner  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_decode_inputs  # noqa: E402


def main(argv=None):
    workloads = {w["name"]: w for w in load_workloads()["decode"]}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="decode_H12_N1", choices=list(workloads),
                        help="the decode workload to run once")
    args = parser.parse_args(argv)
    workload = workloads[args.only]
    inp = make_decode_inputs(workload, "cuda")
    fastkda_decode_runner(inp)()
    floor_decode_runner(inp)()
    step = fastkda_step_runner(inp)  # None for several tokens a sequence
    if step is not None:
        step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""One prefill call for Nsight Compute to count, to tell where a kernel's time goes (``-k`` picks the kernel; H96 B1
T8192 unless ``--only`` names another workload; ``--package`` runs a commit's package that
``tools/variants/ab_packages.py --make`` copied into ``.ab/`` instead of this tree's fastkda, so that a branch's
kernel and main's are counted on the same inputs).

ncu --clock-control none -k regex:prepare_kernel --section ... python tools/profiling/ncu_prepare.py [--only NAME]
    [--package COMMIT]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.bench.runners import fastkda_runner  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_prefill_inputs  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="H96_B1_T8192", help="the prefill workload to run once")
    parser.add_argument("--package", metavar="COMMIT", help="run .ab/fastkda_COMMIT (ab_packages.py --make)")
    args = parser.parse_args(argv)
    workload = next(w for w in load_workloads()["prefill"] if w["name"] == args.only)
    inp = make_prefill_inputs(workload, "cuda")
    if args.package:
        from tools.variants.ab_packages import package_runner  # puts .ab on the import path

        package_runner(args.package, inp)()
    else:
        fastkda_runner(inp)()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

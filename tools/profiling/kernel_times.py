"""Per-kernel GPU time of one prefill call (torch.profiler, mean of 10 calls after 3), for docs/perf-notes.md.

python tools/profiling/kernel_times.py [--only NAME ...] [--shapes H:T ...] [--v-slices 1] [--set NAME=VALUE,...]
    [--impl fla] [--package COMMIT]
(--shapes: one sequence of T tokens at H heads each, varlen, besides the named workloads: e.g. the first kernel's
time against its programs per SM at short lengths)
(--impl: any implementation of the bench, peers too; fastkda's plan follows --v-slices and --set; --package: the
package of a commit that ``tools/variants/ab_packages.py --make`` copied into ``.ab/``, under its own automatic plan)"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from fastkda.bench.runners import IMPLS, fastkda_runner  # noqa: E402
from fastkda.bench.timing import profile_kernels  # noqa: E402
from fastkda.bench.work import plan_for_inputs  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_prefill_inputs  # noqa: E402
from tools.plan_changes import add_set_argument, describe, parse_arguments  # noqa: E402


def shape_workload(shape):
    """The workload of ``--shapes``' ``H:T``: one varlen sequence of T tokens at H heads."""
    heads, tokens = (int(x) for x in shape.split(":"))
    return {"name": f"H{heads}_N1_T{tokens}", "H": heads, "lengths": [tokens], "layout": "varlen"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["H96_B1_T8192", "H12_N1_T8192", "H12_N1_T1024",
                                                      "H12_N1_T65536"])
    parser.add_argument("--v-slices", default="auto")
    parser.add_argument("--impl", default="fastkda", choices=list(IMPLS), help="whose kernels to time")
    parser.add_argument("--package", metavar="COMMIT", help="time .ab/fastkda_COMMIT (ab_packages.py --make)")
    parser.add_argument("--shapes", nargs="*", default=[], metavar="H:T", help="one H-head sequence of T tokens each")
    add_set_argument(parser)
    args, changes = parse_arguments(parser, argv)
    v_slices = args.v_slices if args.v_slices == "auto" else int(args.v_slices)
    named = [w for w in load_workloads()["prefill"] if w["name"] in args.only]
    for w in named + [shape_workload(shape) for shape in args.shapes]:
        inp = make_prefill_inputs(w, "cuda")
        if args.package:
            from tools.variants.ab_packages import package_runner  # puts .ab on the import path

            run = package_runner(args.package, inp)
        elif args.impl == "fastkda":
            plan = plan_for_inputs(inp, v_slices=v_slices)
            run = fastkda_runner(inp, plan=plan.replace(**changes) if changes else plan)
        else:
            run = IMPLS[args.impl].make(inp)
        times = {key: us / launches for key, (us, launches) in profile_kernels(run, 10, warmup=3).items()}
        line = ", ".join(f"{k[:40]} {v / 1000:.3f} ms" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
        who = f"fastkda_{args.package}" if args.package else args.impl
        print(f"[kernels] {who} {w['name']} v_slices={v_slices} {describe(changes)}: {line}", flush=True)


if __name__ == "__main__":
    main()

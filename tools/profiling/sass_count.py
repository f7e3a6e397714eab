"""Static SASS instruction counts of one of fastkda's kernels (sm_90a, no GPU), a local proxy for its dynamic
instruction count, compiled exactly as a launch under the plan of a shape compiles it (``hopper.py``).

python tools/profiling/sass_count.py KERNEL [--workload NAME | --heads H --seqs N --tokens T] [--set NAME=VALUE,...]
KERNEL: prepare, solve, recurrence, transition, scan, decode or decode_step;
e.g. ``sass_count.py prepare --set prepare_warps=8``."""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from tools.profiling.hopper import KERNELS, add_plan_arguments, launches, plans_from_arguments, sass  # noqa: E402

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")  # an instruction line of nvdisasm's listing


def parser_for(description):
    """The command line of this tool and of ``sass_lines.py``: a kernel and the shape and plan changes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("kernel", choices=KERNELS)
    add_plan_arguments(parser)
    return parser


def sass_of_arguments(args, line_info=False):
    """The SASS of ``args.kernel`` under the plan ``args`` describe."""
    plan, decode_plan = plans_from_arguments(args)
    found = launches(plan, decode_plan, [args.kernel], args.checkpoints)
    # an SP kernel under a serial plan, the solve under inverse_in_prepare, the fused step past four heads an SM
    if args.kernel not in found:
        raise SystemExit(f"{args.kernel} does not run under this shape's plans")
    fn, kernel_args, warps, stages, maxnreg = found[args.kernel]
    return sass(fn, kernel_args, warps, stages, maxnreg, line_info)


def loop_bodies(text):
    """Instructions in each loop body: code between a label and a later branch back to it."""
    labels, position, loops = {}, 0, []
    for ln in text.splitlines():
        label = re.match(r"(\.L_x_\d+):", ln)
        if label:
            labels[label.group(1)] = position
        elif INSTRUCTION.match(ln):
            target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
            if target and target.group(1) in labels:
                loops.append(position - labels[target.group(1)] + 1)
            position += 1
    return loops


def counts(text):
    """Instructions in all and of the kinds that matter for these kernels."""
    body = [ln for ln in text.splitlines() if INSTRUCTION.match(ln)]
    kinds = dict(BAR=("BAR.SYNC",), MUFU=("MUFU",), HGMMA=("HGMMA",), HMMA=("HMMA",), LDS=(" LDS", "LDSM"),
                 STS=(" STS",), SHFL=("SHFL",), LDG=("LDG",), STG=("STG",), local=("LDL", "STL"))
    return dict(instructions=len(body), **{kind: sum(any(w in ln for w in words) for ln in body)
                                          for kind, words in kinds.items()})


def main(argv=None):
    args = parser_for(__doc__.split("\n\n")[0]).parse_args(argv)
    text = sass_of_arguments(args)
    found = counts(text)
    print("[sass] loop bodies (instructions):", loop_bodies(text))
    print(f"[sass] {args.kernel}:", ", ".join(f"{kind} {n}" for kind, n in found.items()))
    return found


if __name__ == "__main__":
    main()

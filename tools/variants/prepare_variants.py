"""Time prefill variants in one device call (the whole call, eager or CUDA-graph replay), each checked against the
first (they differ only in rounding) and against float64 on the spec's accuracy case. A variant is a set of plan changes
(``--set``) on the committed kernels, or another copy of the whole prefill package (``--source DIR``,
``variant.py``); it runs that package's ``chunk_kda_forward`` under the plan ``fastkda.kda_prefill`` would make,
changed.

python tools/variants/prepare_variants.py [--only H96_B1_T8192 ...] [--source PREFILL_DIR ...]
    [--set prepare_warps=8,solve_stages=2 ...] [--mode eager|graph]
(graph: for the short rows, whose eager time is the host's)
Every variant is first compiled in a process of its own, all at once (Triton's cache is shared on disk), so the
device call pays for one compile, not one per variant."""

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from fastkda.bench.runners import accuracy  # noqa: E402
from fastkda.bench.timing import time_mode  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_prefill_inputs  # noqa: E402
from tools.plan_changes import add_set_argument  # noqa: E402
from tools.variants.variant import Variant, variant_package, variant_runner  # noqa: E402

VARIANTS = (Variant(),)  # the built-in variants, first the kernels as committed


def variants(sources=(), changes_list=()):
    """The built-in variants, then one per ``--set`` (plan changes on the committed kernels) and one per
    ``--source`` folder (a whole other prefill package, e.g. an older one)."""
    return list(VARIANTS) + [Variant(changes) for changes in changes_list] + [Variant(source=s) for s in sources]


def parser():
    found = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    found.add_argument("--only", nargs="*", default=["H96_B1_T8192", "H12_N1_T8192"])
    found.add_argument("--source", nargs="*", default=[], help="other prefill package folders to time as variants")
    add_set_argument(found, what="plan changes to time as variants, one variant per argument")
    found.add_argument("--mode", choices=("eager", "graph"), default="eager", help="how each call is timed")
    found.add_argument("--compile-only", type=int, help="run variant INDEX once on each workload (cache warm-up)")
    return found


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    chosen = variants(args.source, args.set)
    workloads = [w for w in load_workloads()["prefill"] if w["name"] in args.only]
    if args.compile_only is not None:  # fills Triton's on-disk cache; many of these run at once
        variant = chosen[args.compile_only]
        with variant_package(variant, f"_variant_{args.compile_only}") as package:
            for w in workloads:  # the timed shapes themselves: Triton specialises on some of their values
                variant_runner(package, variant.changes, make_prefill_inputs(w, "cuda"))()
        return {}
    started = time.time()
    workers = [subprocess.Popen([sys.executable, __file__, *argv, "--compile-only", str(index)])
               for index in range(len(chosen))]
    for worker in workers:
        worker.wait()
    print(f"[variants] {len(chosen)} variants compiled in parallel in {time.time() - started:.0f} s", flush=True)
    found = {}
    with contextlib.ExitStack() as stack:
        packages = [stack.enter_context(variant_package(v, f"_variant_{index}")) for index, v in enumerate(chosen)]
        errors = {}
        for w in workloads:
            inp = make_prefill_inputs(w, "cuda")
            expected = None
            for variant, package in zip(chosen, packages):
                label = variant.label
                try:
                    run = variant_runner(package, variant.changes, inp)
                    out = run()[0]
                    if expected is None:
                        expected = out.float().clone()
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    ms = time_mode(run, args.mode)
                    if label not in errors:  # against float64 on the spec's accuracy case, once per variant
                        errors[label] = accuracy(lambda i: variant_runner(package, variant.changes, i), "cuda")
                    found[(w["name"], label)] = ms
                    print(f"[variants] {w['name']} {label}: {ms:.4f} ms (whole call, {args.mode}), vs first {err:.1e}, "
                          f"vs float64 output {errors[label][0]:.2e} state {errors[label][1]:.2e}", flush=True)
                except Exception as error:  # one broken variant must not hide the others' numbers
                    print(f"[variants] {w['name']} {label}: failed: {type(error).__name__}: {str(error)[:300]}",
                          flush=True)
    return found


if __name__ == "__main__":
    main()

"""Sweep of the launch plan: prefill time for V-slices s in {1, 2, 4} over N x H x tokens, on the GPU.

The whole call is timed for each s (CUDA-graph replay, median of do_bench) under the plan made for that s (the
slice width also decides the state's form), with the ``--set`` changes on top; outputs and final states are
compared bitwise across s. Rows go to ``OUT/<date>-<gpu>-plan-sweep.json`` after every configuration, so a run
cut short keeps what it measured. Then it prints how often the automatic plan is within 2% of the best.

python tools/sweeps/plan_sweep.py [--out DIR] [--budget-s 400] [--rep-ms 25] [--seqs 1 2 ...] [--heads 4 8 ...]
    [--tokens 256 1024 8192] [--set NAME=VALUE,...]
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.bench.report import tool_results_file, write_tool_results  # noqa: E402
from fastkda.bench.runners import fastkda_runner  # noqa: E402
from fastkda.bench.timing import time_graph  # noqa: E402
from fastkda.bench.work import plan_for_inputs  # noqa: E402
from fastkda.bench.workloads import make_prefill_inputs  # noqa: E402
from fastkda.plan import V_SLICE_CHOICES  # noqa: E402
from tools.plan_changes import add_set_argument, describe, parse_arguments  # noqa: E402


def sweep_plans(inp, changes):
    """``{s: plan}``: the plan for each slice count, with ``changes``."""
    plans = {s: plan_for_inputs(inp, v_slices=s) for s in V_SLICE_CHOICES}
    return {s: plan.replace(**changes) if changes else plan for s, plan in plans.items()}


def sweep_one(heads, seqs, tokens, rep_ms, changes):
    """``({s: ms}, auto s)`` for one configuration, after checking every s gives the same bits."""
    inp = make_prefill_inputs(dict(H=heads, lengths=[tokens] * seqs, layout="varlen"), "cuda")
    times, first = {}, None
    for s, plan in sweep_plans(inp, changes).items():
        run = fastkda_runner(inp, plan=plan)
        out, final = run()
        if first is None:
            first = (out.clone(), final.clone())
        elif not (torch.equal(out, first[0]) and torch.equal(final, first[1])):
            raise AssertionError(f"v_slices={s} differs from v_slices=1 at H={heads} N={seqs} T={tokens}")
        times[s] = time_graph(run, rep_ms)
    return times, plan_for_inputs(inp).v_slices


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", nargs="*", type=int, default=list(range(1, 17)))
    parser.add_argument("--heads", nargs="*", type=int, default=[4, 8, 12, 16, 24, 48, 96])
    parser.add_argument("--tokens", nargs="*", type=int, default=[256, 1024, 8192])
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--rep-ms", type=int, default=25, help="graph replay time per measurement")
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    add_set_argument(parser, what="launch numbers to change in every plan", fixed=("v_slices",))
    args, changes = parse_arguments(parser, argv)
    path, meta = tool_results_file(args.out, "plan-sweep", changes=describe(changes))
    rows, start = [], time.time()
    for tokens, heads, seqs in itertools.product(args.tokens, args.heads, args.seqs):
        if time.time() - start > args.budget_s:
            print(f"[sweep] budget reached after {len(rows)} configurations")
            break
        times, auto = sweep_one(heads, seqs, tokens, args.rep_ms, changes)
        best = min(times, key=times.get)
        rows.append(dict(H=heads, N=seqs, T=tokens, ms={str(s): round(t, 5) for s, t in times.items()}, best=best,
                         auto=auto, auto_over_best=round(times[auto] / times[best], 4)))
        write_tool_results(path, meta, rows)
    within = sum(r["auto_over_best"] <= 1.02 for r in rows)
    print(f"[sweep] {len(rows)} configurations, auto within 2% of the best in {within}; results in {path}")
    for r in rows:
        if r["auto_over_best"] > 1.02:
            print(f"[sweep] auto s={r['auto']} is {r['auto_over_best']:.2f}x the best s={r['best']} at "
                  f"H={r['H']} N={r['N']} T={r['T']}")


if __name__ == "__main__":
    main()

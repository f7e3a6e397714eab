"""What running the preparation beside a one-wave recurrence would cost: a probe of the streamed-preparation design
(issue 18), before any kernel is written for it.

Where the recurrence runs one program an SM or fewer (the low-parallelism rows), the preparation's first kernel and
its solve could run on the SMs and registers the recurrence leaves free, a chunk ahead of it, instead of before it.
This times, on each workload's inputs under fastkda's own plan, CUDA-graph replay:

- ``serial``: the preparation, then the recurrence (what ``fastkda.kda_prefill`` runs; sequence-parallel plans are
  left out);
- ``preparation`` and ``recurrence`` alone;
- ``side by side``: the preparation of a second workspace on a side stream while the recurrence walks a first one
  prepared beforehand: what the two cost together when they share the GPU. Not a correct prefill (the halves work on
  independent copies); an upper bound on what a producer running ahead of the recurrence could gain, as the real
  design adds the waits on the producer's flags.

python tools/profiling/overlap_probe.py [--only NAME ...] [--set NAME=VALUE,...] [--out DIR]
    ->  <date>-<gpu>-overlap-probe.json
(``--set``: launch numbers of the plan changed for both halves, as ``kernel_times.py`` takes them)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from fastkda.bench.report import tool_results_file, write_tool_results  # noqa: E402
from fastkda.bench.work import plan_for_inputs  # noqa: E402
from fastkda.bench.workloads import LOWER_BOUND, load_workloads, make_prefill_inputs  # noqa: E402
from tools.plan_changes import add_set_argument, describe, parse_arguments  # noqa: E402

GROUP = "low_parallelism"


def stages(inp, plan):
    """``(prepare(ws), recur(ws), allocate())``: the preparation into a workspace, the recurrence from one (into
    the same output and final state each time), and a fresh workspace, as ``chunk_kda_forward`` runs them."""
    import torch

    from fastkda.errors import counters
    from fastkda.ops.prefill import prepare_stages
    from fastkda.ops.prefill.layout import Workspace
    from fastkda.ops.prefill.recurrence import launch_recurrence

    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])
    errors = counters(inp["q"].device)

    def prepare(ws):
        prepare_stages(plan, ws, inp["q"], inp["k"], inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"], LOWER_BOUND,
                       inp["scale"], True, True, errors, False)

    def recur(ws):
        launch_recurrence(plan, ws, out, inp["initial_state"], final, None, None, errors, False)

    return prepare, recur, lambda: Workspace.allocate(plan, inp["v"], inp["cu_seqlens"])


def probe(workload, side, changes):
    """The row of one workload (None under a sequence-parallel plan): its stages' times, serial and side by side,
    under its plan with ``changes``."""
    import torch

    from fastkda.bench.timing import time_graph

    inp = make_prefill_inputs(workload, "cuda")
    plan = plan_for_inputs(inp)
    plan = plan.replace(**changes) if changes else plan
    if plan.sequence_parallel:
        print(f"[overlap] {workload['name']}: a sequence-parallel plan, left out", flush=True)
        return None
    prepare, recur, allocate = stages(inp, plan)
    first, second = allocate(), allocate()
    prepare(first)

    def serial():
        prepare(first)
        recur(first)

    def side_by_side():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prepare(second)
        recur(first)
        torch.cuda.current_stream().wait_stream(side)

    times = dict(serial=time_graph(serial), preparation=time_graph(lambda: prepare(second)),
                 recurrence=time_graph(lambda: recur(first)), side_by_side=time_graph(side_by_side))
    print(f"[overlap] {workload['name']} ({describe(changes)}): {plan.programs} recurrence programs; "
          + ", ".join(f"{name} {ms:.4f} ms" for name, ms in times.items())
          + f"; side by side / serial {times['side_by_side'] / times['serial']:.3f}", flush=True)
    return dict(workload=workload["name"], programs=plan.programs, v_slices=plan.v_slices, plan=describe(changes),
                ms={name: round(ms, 5) for name, ms in times.items()})


def main(argv=None):
    workloads = load_workloads()["prefill"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=[w["name"] for w in workloads],
                        help=f"prefill workloads (default: the {GROUP} group)")
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    add_set_argument(parser)
    args, changes = parse_arguments(parser, argv)
    import torch

    rows = []
    side = torch.cuda.Stream()
    for w in workloads:
        if (args.only and w["name"] not in args.only) or (not args.only and w["group"] != GROUP):
            continue
        row = probe(w, side, changes)
        if row:
            rows.append(row)
        torch.cuda.empty_cache()
    path, meta = tool_results_file(args.out, "overlap-probe")
    write_tool_results(path, meta, rows)
    print(f"[overlap] results in {path}")


if __name__ == "__main__":
    main()

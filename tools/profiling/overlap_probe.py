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

python tools/profiling/overlap_probe.py [--only NAME ...] [--out DIR]   ->  <date>-<gpu>-overlap-probe.json
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from fastkda.bench.report import git_commit, results_stem  # noqa: E402
from fastkda.bench.work import plan_for_inputs  # noqa: E402
from fastkda.bench.workloads import LOWER_BOUND, load_workloads, make_prefill_inputs  # noqa: E402

GROUP = "low_parallelism"


def stages(inp, plan):
    """``(prepare(ws), recur(ws), allocate())``: the preparation into a workspace, the recurrence from one (into
    the same output and final state each time), and a fresh workspace, as ``chunk_kda_forward`` runs them."""
    import torch

    from fastkda.errors import counters
    from fastkda.ops.prefill import _prepare
    from fastkda.ops.prefill.layout import Workspace
    from fastkda.ops.prefill.recurrence import launch_recurrence

    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])
    errors = counters(inp["q"].device)

    def prepare(ws):
        _prepare(plan, ws, inp["q"], inp["k"], inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"], LOWER_BOUND,
                 inp["scale"], True, True, False)

    def recur(ws):
        launch_recurrence(plan, ws, out, inp["initial_state"], final, None, None, errors, False)

    return prepare, recur, lambda: Workspace.allocate(plan, inp["v"], inp["cu_seqlens"])


def main(argv=None):
    workloads = load_workloads()["prefill"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=[w["name"] for w in workloads],
                        help=f"prefill workloads (default: the {GROUP} group)")
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    args = parser.parse_args(argv)
    import torch

    from fastkda.bench.timing import time_graph

    rows = []
    side = torch.cuda.Stream()
    for w in workloads:
        if (args.only and w["name"] not in args.only) or (not args.only and w["group"] != GROUP):
            continue
        inp = make_prefill_inputs(w, "cuda")
        plan = plan_for_inputs(inp)
        if plan.sequence_parallel:
            print(f"[overlap] {w['name']}: a sequence-parallel plan, left out", flush=True)
            continue
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
        rows.append(dict(workload=w["name"], programs=plan.programs, v_slices=plan.v_slices,
                         ms={name: round(ms, 5) for name, ms in times.items()}))
        print(f"[overlap] {w['name']}: {plan.programs} recurrence programs; "
              + ", ".join(f"{name} {ms:.4f} ms" for name, ms in times.items())
              + f"; side by side / serial {times['side_by_side'] / times['serial']:.3f}", flush=True)
        del inp, first, second
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    meta = dict(gpu=props.name, sms=props.multi_processor_count, commit=git_commit(),
                date=datetime.date.today().isoformat())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(f"{results_stem(out, props.name)}-overlap-probe.json")
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"[overlap] results in {path}")


if __name__ == "__main__":
    main()

"""Decode launch settings on the device: every decode workload under decode plans of 16, 32 and 64 state columns
per program (and 32 columns on 8 warps), CUDA-graph replay, so that the decode plan rests on measurements; with
``--step``, the layer's fused decode step (``fastkda.kda_decode_step``) on its one-token workloads instead.

python tools/sweeps/decode_sweep.py [--out DIR] [--settings 16 32 32:8 64] [--step] [--only decode_H12_N1 ...]
    ->  <date>-<gpu>-decode-sweep.json (or -decode-step-sweep.json)
A setting is COLUMNS[:WARPS]; without WARPS, the plan's own warps for that width (fastkda.plan.decode_warps). With
--step, the step's automatic plan (fused or three launches, as it chooses) comes first in each workload."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from fastkda.bench.report import tool_results_file, write_tool_results  # noqa: E402
from fastkda.bench.runners import fastkda_decode_runner, fastkda_step_runner  # noqa: E402
from fastkda.bench.timing import time_graph  # noqa: E402
from fastkda.bench.work import decode_state_bytes  # noqa: E402
from fastkda.bench.workloads import DIM, load_workloads, make_decode_inputs  # noqa: E402
from fastkda.plan import DecodePlan, decode_warps  # noqa: E402

SETTINGS = ("16", "32", "32:8", "64")
STEP_SETTINGS = ("16:1", "16:2", "32:2", "32:4", "64:4", "64:8", "128:8")  # the fused step's candidates


def decode_plan(workload, setting, value_dim=DIM):
    """The :class:`fastkda.DecodePlan` of a ``COLUMNS[:WARPS]`` setting for ``workload``."""
    columns, _, warps = setting.partition(":")
    columns = int(columns)
    if columns < 1 or value_dim % columns:
        raise ValueError(f"setting {setting!r}: the columns must divide V={value_dim}")
    return DecodePlan(workload["N"], workload["H"], value_dim, value_dim // columns,
                      int(warps) if warps else decode_warps(columns), reason=f"decode sweep: {setting}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    parser.add_argument("--settings", nargs="*", metavar="COLUMNS[:WARPS]",
                        help=f"default {' '.join(SETTINGS)}; with --step {' '.join(STEP_SETTINGS)}")
    parser.add_argument("--step", action="store_true", help="sweep the fused decode step instead of decode")
    parser.add_argument("--only", nargs="*", metavar="NAME", choices=[w["name"] for w in load_workloads()["decode"]],
                        help="decode workloads to sweep (default: all)")
    args = parser.parse_args(argv)
    settings = args.settings or list(STEP_SETTINGS if args.step else SETTINGS)
    runner = fastkda_step_runner if args.step else fastkda_decode_runner
    rows = []
    for w in load_workloads()["decode"]:
        if (args.step and w["tokens_per_seq"] != 1) or (args.only and w["name"] not in args.only):
            continue
        inp = make_decode_inputs(w, "cuda")
        state_bytes = decode_state_bytes(w)
        # with --step, first the KDA-only step under its own plan: what the fused step is held against
        for setting in ([None, "auto"] if args.step else []) + settings:
            if setting is None:
                ms = time_graph(fastkda_decode_runner(inp))
                rows.append(dict(workload=w["name"], setting="KDA-only step, auto plan", ms=round(ms, 5),
                                 gbps=round(state_bytes / ms / 1e6, 1)))
                print(f"[decode-sweep] {w['name']} KDA-only step: {ms * 1e3:.1f} us", flush=True)
                continue
            plan = None if setting == "auto" else decode_plan(w, setting)
            ms = time_graph(runner(inp, plan=plan))
            label = "the step's automatic plan" if plan is None else f"{plan.slice_width} columns, {plan.warps} warps"
            rows.append(dict(workload=w["name"], setting=label, ms=round(ms, 5), gbps=round(state_bytes / ms / 1e6, 1)))
            print(f"[decode-sweep] {w['name']} {label}: {ms * 1e3:.1f} us, {state_bytes / ms / 1e6:.0f} GB/s",
                  flush=True)
    path, meta = tool_results_file(args.out, f"decode{'-step' if args.step else ''}-sweep", step=args.step)
    write_tool_results(path, meta, rows)
    print(f"[decode-sweep] results in {path}")


if __name__ == "__main__":
    main()

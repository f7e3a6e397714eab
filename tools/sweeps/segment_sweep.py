"""Sweep of sequence parallelism's numbers on the GPU: the whole prefill call (CUDA-graph replay, median) for the
serial recurrence and for segments of several lengths, transition widths and rerun slices, per workload.

For each workload of the shipped workloads file: the serial plan (``sequence_parallel=False``), the automatic plan,
and segments cutting the longest sequence into G ∈ ``--segments`` pieces at each transition width and rerun slice
count. Each segment length's outputs and final states are compared bitwise across its variants (the slices never
change the bits). Rows go to ``OUT/<date>-<gpu>-segment-sweep.json`` after every workload, each with the GPU, date
and commit, so a run cut short keeps what it measured; the last lines print, per workload, serial, auto and best.

python tools/sweeps/segment_sweep.py [--only NAME ...] [--segments 2 4 6 8 11 16] [--widths 64 128]
    [--slices 1 2] [--budget-s 300] [--rep-ms 25] [--out DIR]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.bench.report import tool_results_file, write_tool_results  # noqa: E402
from fastkda.bench.runners import fastkda_runner  # noqa: E402
from fastkda.bench.timing import time_graph  # noqa: E402
from fastkda.bench.work import plan_for_inputs  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_prefill_inputs  # noqa: E402
from fastkda.plan import CHUNK, WARPGROUP_RECURRENCE_STAGES, recurrence_warps, state_rows_v  # noqa: E402

DEFAULT_ONLY = ("H12_N1_T1024", "H12_N1_T8192", "H12_N2_T1024", "H12_N2_T8192", "H12_N1_T65536", "H12_N2_T32768",
                "H24_N1_T65536", "H16_N1_T131072", "H12_N1_T262144", "H12_chunked_mix", "H24_chunked_mix")


def variants(inp, segments, widths, slices):
    """``[(label, plan)]``: serial, auto, then every (segment length, width, slices) asked for."""
    serial = plan_for_inputs(inp, sequence_parallel=False)
    auto = plan_for_inputs(inp)
    found = [("serial", serial), ("auto", auto)]
    chain = -(-max(inp["lengths"]) // CHUNK)  # chunks of the longest sequence
    for chunks in sorted({-(-chain // g) for g in segments if g <= chain}):
        base = plan_for_inputs(inp, sequence_parallel=chunks * CHUNK)
        for width in widths:
            for s in slices:
                if width <= min(base.key_dim, base.value_dim) and base.value_dim // s >= 32:
                    width_v = base.value_dim // s
                    # the Gluon rerun's ring is set by its slice width (the base plan's may be another width's)
                    gluon = base.warpgroup_recurrence and width_v in WARPGROUP_RECURRENCE_STAGES
                    found.append((f"L{chunks}-w{width}-s{s}", base.replace(
                        transition_width=width, v_slices=s, state_rows_v=state_rows_v(width_v),
                        recurrence_warps=recurrence_warps(width_v), warpgroup_recurrence=gluon,
                        recurrence_stages=WARPGROUP_RECURRENCE_STAGES[width_v] if gluon else 3)))
    return found


def sweep_workload(workload, segments, widths, slices, rep_ms):
    inp = make_prefill_inputs(workload, "cuda")
    inp["lengths"] = workload["lengths"]
    rows, bits = [], {}
    for label, plan in variants(inp, segments, widths, slices):
        run = fastkda_runner(inp, plan=plan)
        out, final = run()
        key = plan.segment_chunks
        if key in bits and not (torch.equal(out, bits[key][0]) and torch.equal(final, bits[key][1])):
            raise AssertionError(f"{workload['name']}: {label} differs from the same segmentation's first variant")
        bits.setdefault(key, (out.clone(), final.clone()))
        ms = time_graph(run, rep_ms)
        rows.append(dict(workload=workload["name"], variant=label, segment_chunks=plan.segment_chunks,
                         transition_width=plan.transition_width, v_slices=plan.v_slices, ms=round(ms, 5)))
        print(f"[segments] {workload['name']} {label}: {ms:.4f} ms", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=list(DEFAULT_ONLY))
    parser.add_argument("--segments", nargs="*", type=int, default=[2, 4, 6, 8, 11, 16])
    parser.add_argument("--widths", nargs="*", type=int, default=[64, 128])
    parser.add_argument("--slices", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--rep-ms", type=int, default=25, help="graph replay time per measurement")
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    args = parser.parse_args(argv)
    path, meta = tool_results_file(args.out, "segment-sweep")
    by_name = {w["name"]: w for w in load_workloads()["prefill"]}
    rows, start = [], time.time()
    for name in args.only:
        if time.time() - start > args.budget_s:
            print(f"[segments] budget reached before {name}")
            break
        rows += sweep_workload(by_name[name], args.segments, args.widths, args.slices, args.rep_ms)
        write_tool_results(path, meta, rows)
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["variant"]: r for r in rows if r["workload"] == name}
        best = min(mine.values(), key=lambda r: r["ms"])
        print(f"[segments] {name}: serial {mine['serial']['ms']:.4f}, auto {mine['auto']['ms']:.4f} "
              f"(L={mine['auto']['segment_chunks']}), best {best['ms']:.4f} ({best['variant']})")
    print(f"[segments] results in {path}")


if __name__ == "__main__":
    main()

"""``fastkda-bench`` (``python -m fastkda.bench``): the run of the benchmark.

Order: the decode workloads (small, and their peer compiles in seconds), the accuracy case for every
implementation (before the timings, so a run cut short still has it), then each prefill workload: every available
implementation in each of its modes, then fastkda's per-kernel breakdown. The results are rewritten after every
step, so a run cut short by a time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .report import earlier_results, merge_files, run_id, write_results
from .runners import DECODE_IMPLS, DEFAULT_IMPLS, IMPLS, accuracy
from .timing import copy_bandwidth_gbps, matmul_tflops, time_mode
from .work import decode_state_bytes, kernel_breakdown
from .workloads import load_workloads, make_decode_inputs, make_prefill_inputs, select, select_decode

DESCRIPTION = ("Side-by-side benchmark of KDA prefill and decode: fastkda (auto plan and one V-slice), FLA chunk_kda "
               "and FlashKDA on the same inputs, eager and CUDA-graph replay, with fastkda's per-kernel breakdown.")
EPILOG = ("Results go to OUT/<date>-<gpu>.{json,md,png} (OUT defaults to ./fastkda-results in the current "
          "directory). Needs a CUDA GPU, except for --merge.")
PROBE = dict(name="probe", H=1, lengths=[64], layout="varlen")  # a call that shows whether an implementation runs


def build_parser():
    parser = argparse.ArgumentParser(prog="fastkda-bench", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--only", nargs="*", metavar="NAME", help="workloads to run, in the order given")
    parser.add_argument("--group", help="run one group of prefill workloads (low_parallelism, long_sequence, "
                                        "chunked_prefill, high_parallelism)")
    parser.add_argument("--quick", action="store_true", help="only the small prefill workloads")
    parser.add_argument("--impls", nargs="*", default=list(DEFAULT_IMPLS), choices=list(IMPLS), metavar="IMPL",
                        help=f"prefill implementations to time, of {', '.join(IMPLS)} (default: "
                             f"{' '.join(DEFAULT_IMPLS)}; fla_cp, FLA's intra-card context parallelism, runs eager "
                             "on the long_sequence workloads only when asked for)")
    parser.add_argument("--workloads", metavar="PATH", help="a workloads JSON file (default: the one shipped with "
                                                            "fastkda)")
    parser.add_argument("--out", "--out-dir", dest="out", default="fastkda-results", metavar="DIR",
                        help="folder for the results files (default: ./fastkda-results)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode workloads")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip fastkda's per-kernel breakdown (torch.profiler) after each workload")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of today's results file in OUT that this run does not re-measure")
    parser.add_argument("--merge", nargs=2, metavar=("EARLIER", "LATER"),
                        help="no timing: add EARLIER.json's rows for what LATER.json lacks or measured in an older "
                             "run, re-render LATER")
    return parser


def progress(items, desc):
    """``items`` with a tqdm progress bar where tqdm is installed and stderr is a terminal."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(items, desc=desc)
        except ImportError:
            pass
    return items


def available_impls(impls, device="cuda"):
    """The implementations of ``impls`` that import and run here (one small call each); the others reported."""
    available = {}
    for name, impl in impls.items():
        try:
            impl.make(make_prefill_inputs(PROBE, device))()
            available[name] = impl
        except Exception as exc:  # a peer that does not import or run is reported, not fatal
            print(f"[bench] {name} unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    return available


def run_benchmark(workload, impls, device="cuda"):
    """Rows ``{workload, group, impl, mode, ms}`` for one prefill workload: each implementation that runs on it,
    in each of its modes."""
    rows = []
    inp = make_prefill_inputs(workload, device)
    for name, impl in (item for item in impls.items() if item[1].runs_on(workload)):
        run = None
        for mode in impl.modes:
            try:
                run = run or impl.make(inp)  # one runner (and its output buffers) for every mode
                ms = time_mode(run, mode)
            except Exception as exc:  # reported, not fatal: the other implementations and modes still run
                print(f"[bench] {workload['name']} {name} {mode} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            rows.append(dict(workload=workload["name"], group=workload["group"], impl=name, mode=mode, ms=round(ms, 4)))
            print(f"[bench] {workload['name']} {name} {mode}: {ms:.4f} ms", flush=True)
    del inp
    torch.cuda.empty_cache()
    return rows


def run_decode_benchmark(workloads, impls, modes=("eager", "graph"), device="cuda", copy_gbps=None):
    """Rows for decode workloads, with ``gbps``: state bytes read and written per second (in the pool's dtype),
    and the copy rate measured in the same run."""
    rows = []
    for w in workloads:
        inp = make_decode_inputs(w, device)
        state_bytes = decode_state_bytes(w)
        for name, factory in impls.items():
            try:
                run = factory(inp)
                if run is None:  # not an implementation of this workload (the one-token step at T > 1)
                    continue
                for mode in modes:
                    ms = time_mode(run, mode)
                    rows.append(dict(workload=w["name"], group="decode", impl=name, mode=mode, ms=round(ms, 5),
                                     gbps=round(state_bytes / ms / 1e6, 1), copy_gbps=copy_gbps))
                    print(f"[bench] {w['name']} {name} {mode}: {ms * 1e3:.1f} us, {state_bytes / ms / 1e6:.0f} GB/s",
                          flush=True)
            except Exception as exc:  # a peer that does not run here is reported, not fatal
                print(f"[bench] {w['name']} {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return rows


def measure_accuracy(impls, device="cuda"):
    """``{impl: (output error, state error)}`` on the accuracy case, for the implementations measured there."""
    errors = {}
    for name, impl in impls.items():
        if not impl.accuracy:
            continue
        try:
            errors[name] = accuracy(impl.make, device)
            print(f"[bench] accuracy {name}: output {errors[name][0]:.2e}, state {errors[name][1]:.2e}", flush=True)
        except Exception as exc:
            print(f"[bench] {name} accuracy not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    return errors


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        try:
            print(merge_files(*args.merge))
        except ValueError as exc:  # a file missing or not a results file, refused before anything is written
            parser.error(str(exc))
        return 0
    try:  # a bad workloads file, an unknown --only name or --group: refused before anything is measured
        workloads = load_workloads(args.workloads)
        chosen = select(workloads, args.only, args.group, args.quick)
    except ValueError as exc:
        parser.error(str(exc))
    decode = [] if args.no_decode else select_decode(workloads, args.only)
    if not chosen and not decode:
        parser.error("no workload chosen (check --only, --group, --quick and --no-decode)")
    if not torch.cuda.is_available():
        print("fastkda-bench needs a CUDA GPU; `python -m fastkda demo` runs the CPU path.", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    try:  # made before the first measurement, so that a folder that cannot be made does not cost a run
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot make the folder: {exc.strerror or exc}")
    try:
        earlier = earlier_results(out_dir) if args.append else None
    except ValueError as exc:  # today's results file is unreadable: --append would lose its rows
        parser.error(f"--append: {exc}")
    run = run_id()
    print(f"[bench] run {run}; results in {out_dir.resolve()}", flush=True)
    impls = {name: IMPLS[name] for name in args.impls}
    copy_gbps = copy_bandwidth_gbps()
    print(f"[bench] device-to-device copy: {copy_gbps} GB/s", flush=True)
    breakdown = "fastkda" in impls and not args.no_kernels
    matmul = matmul_tflops() if breakdown else None
    if breakdown:
        print(f"[bench] bf16 matrix product: {matmul} TFLOP/s", flush=True)
    rows, kernels, errors = [], [], {}

    def results():
        return write_results(rows, out_dir, errors, run, copy_gbps, earlier, kernels, matmul)
    if decode:
        rows += run_decode_benchmark(decode, DECODE_IMPLS, copy_gbps=copy_gbps)
        results()
    if chosen:
        impls = available_impls(impls)
        errors.update(measure_accuracy(impls))
    for w in progress(chosen, "workloads"):
        rows += run_benchmark(w, impls)
        if breakdown and "fastkda" in impls:
            kernels += kernel_breakdown(make_prefill_inputs(w, "cuda"), w, copy_gbps, matmul)
            torch.cuda.empty_cache()
        results()
    print(results())
    return 0

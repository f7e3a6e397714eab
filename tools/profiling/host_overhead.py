"""Host time of one eager prefill call (issue 4's eager bar): wall time per call of a loop that never waits for
the GPU, before and after a CUDA graph of the same call is captured and timed (the bench times graph replay
before eager), the eager and graph medians, then a cProfile of the same loop: the functions that take the
host's time.

python tools/profiling/host_overhead.py [--only H12_N1_T1024 ...] [--calls 300]"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.bench.runners import fastkda_runner  # noqa: E402
from fastkda.bench.timing import time_eager, time_graph  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_prefill_inputs  # noqa: E402


def host_time_us(run, calls):
    """Host µs per call of ``run`` over ``calls`` calls that never wait for the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def print_profile(run, calls, label):
    """cProfile of ``calls`` calls of ``run``: the 18 functions with the most own time, per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    width = sum(stat[2] for stat in stats.stats.values()) / calls  # profiled seconds per call
    print(f"[host] {label} cProfile: {width * 1e6:.1f} us per call under the profiler; by own time:")
    by_own_time = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])
    for (path, line, name), (_, count, own, cumulative, _) in by_own_time[:18]:
        print(f"[host] {own / calls * 1e6:7.1f} us own {cumulative / calls * 1e6:7.1f} us cum "
              f"{count // calls:3d}x {path.split('site-packages/')[-1][-50:]}:{line} {name}")


def main(argv=None):
    workloads = {w["name"]: w for w in load_workloads()["prefill"]}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["H12_N1_T1024"], choices=list(workloads), metavar="NAME")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    for name in args.only:
        run = fastkda_runner(make_prefill_inputs(workloads[name], "cuda"))
        for _ in range(20):
            run()
        before, eager_before = host_time_us(run, args.calls), time_eager(run)
        graph = time_graph(run)
        after, eager_after = host_time_us(run, args.calls), time_eager(run)
        print(f"[host] {name}: {before:.1f} us of host time per call before a graph, {after:.1f} after; eager "
              f"{eager_before:.4f} ms before, {eager_after:.4f} after; graph {graph:.4f} ms", flush=True)
        print_profile(run, args.calls, name)


if __name__ == "__main__":
    main()

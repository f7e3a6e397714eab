"""Host time of one eager prefill call (issue 4's eager bar): wall time per call of a loop that never waits for
the GPU, then a cProfile of the same loop, the functions that take the host's time.

python tools/profiling/host_overhead.py [--only H12_N1_T1024] [--calls 300]"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.bench.runners import fastkda_runner  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_prefill_inputs  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="H12_N1_T1024")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    workload = next(w for w in load_workloads()["prefill"] if w["name"] == args.only)
    run = fastkda_runner(make_prefill_inputs(workload, "cuda"))
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        run()
    host = (time.perf_counter() - start) / args.calls
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / args.calls
    print(f"[host] {args.only}: {host * 1e6:.1f} us of host time per call, {total * 1e6:.1f} us per call with the GPU")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        run()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    width = sum(stat[2] for stat in stats.stats.values()) / args.calls  # profiled seconds per call
    print(f"[host] cProfile: {width * 1e6:.1f} us per call under the profiler; by own time:")
    for (path, line, name), (_, calls, own, cumulative, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:18]:
        print(f"[host] {own / args.calls * 1e6:7.1f} us own {cumulative / args.calls * 1e6:7.1f} us cum "
              f"{calls // args.calls:3d}x {path.split('site-packages/')[-1][-50:]}:{line} {name}")


if __name__ == "__main__":
    main()

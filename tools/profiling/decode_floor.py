"""What a decode step's latency is made of, on the device, for the latency-bound decode workloads (CUDA-graph
replay, timed as the benchmark times it): an empty kernel on decode's grid (the replay itself), a kernel that only
moves each program's state slice through the slot index (slot -> state -> store: the memory chain), the same
without the slot indirection, and the decode step. Also back-to-back replays without the L2 flush between them
(bound by the host's replay rate), and each kernel launched 20 times in one graph (the L2 flushed before the graph
only, so 19 of the 20 find their code and data in L2: the warm per-launch time, which the flushed time less
this one prices as the cost of a cold start).
The grid, slice width and warps are those of the decode plan of each workload; the chain kernel is the benchmark's
floor (:mod:`fastkda.bench.floor`).

python tools/profiling/decode_floor.py [--max-seqs 32]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402
import triton  # noqa: E402

from fastkda.bench.floor import state_chain_runner  # noqa: E402
from fastkda.bench.runners import fastkda_decode_runner  # noqa: E402
from fastkda.bench.timing import capture_graph, time_graph  # noqa: E402
from fastkda.bench.workloads import load_workloads, make_decode_inputs  # noqa: E402
from fastkda.plan import choose_decode_plan, sm_count  # noqa: E402


@triton.jit
def empty_kernel(pool):
    pass


def replay_back_to_back(run, replays=200):
    """Microseconds per replay of a graph of ``run`` replayed ``replays`` times in a row (no flush between)."""
    graph = capture_graph(run)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def in_one_graph(run, launches=20):
    """Microseconds per launch of a graph of ``launches`` calls of ``run`` in a row (the L2 flushed before it)."""
    return time_graph(lambda: [run() for _ in range(launches)]) / launches * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seqs", type=int, default=32, help="the decode workloads of at most this many sequences")
    args = parser.parse_args(argv)
    for w in load_workloads()["decode"]:
        if w["N"] > args.max_seqs or w["tokens_per_seq"] != 1:
            continue
        inp = make_decode_inputs(w, "cuda")
        pool = inp["pool"]
        heads, dim = w["H"], pool.shape[-1]
        plan = choose_decode_plan(w["N"], heads, dim, sm_count(torch.cuda.current_device()), tokens=1)
        grid, warps = (plan.v_slices, heads, w["N"]), plan.warps
        runs = {
            "empty kernel": lambda: empty_kernel[grid](pool, num_warps=warps),
            "slot -> state -> store": state_chain_runner(inp, plan),
            "state -> store (no slot)": state_chain_runner(inp, plan, indirect=False),
            "decode step": fastkda_decode_runner(inp, plan=plan),
        }
        for label, run in runs.items():
            run()
            flushed = time_graph(run) * 1e3
            back_to_back = replay_back_to_back(run)
            warm = in_one_graph(run)
            print(f"[decode-floor] {w['name']} {label}: {flushed:.2f} us (graph, L2 flushed), "
                  f"{back_to_back:.2f} us back to back, {warm:.2f} us a launch of 20 in one graph", flush=True)


if __name__ == "__main__":
    main()

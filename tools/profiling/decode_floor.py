"""What a decode step's latency is made of, on the device, for the latency-bound decode workloads (CUDA-graph
replay, timed as the benchmark times it): an empty kernel on decode's grid (the replay itself), a kernel that only
moves each program's state slice through the slot index (slot -> state -> store: the memory chain), the same
without the slot indirection, and the decode step. Also back-to-back replays without the L2 flush between them.

python scripts/decode_floor.py"""

import torch
import triton
import triton.language as tl

from fastkda.bench import LOWER_BOUND, capture_graph, load_workloads, make_decode_inputs, time_graph
from fastkda.ops.decode import decode_warps, recurrent_kda_decode
from fastkda.plan import DECODE_SLICE_WIDTH


@triton.jit
def _empty_kernel(pool):
    pass


@triton.jit
def _state_chain_kernel(pool, slots, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                        INDIRECT: tl.constexpr):
    vs = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    slot = tl.load(slots + n).to(tl.int64) if INDIRECT else n.to(tl.int64)
    vv = vs * BV + tl.arange(0, BV)
    kk = tl.arange(0, K)
    ptrs = pool + slot * (H * V * K) + (h * V + vv[:, None]) * K + kk[None, :]
    tl.store(ptrs, tl.load(ptrs) * 1.0009765625)


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


def main():
    for w in load_workloads()["decode"]:
        if w["N"] > 32 or w["tokens_per_seq"] != 1:
            continue
        inp = make_decode_inputs(w, "cuda")
        pool, slots = inp["pool"], inp["slots"]
        heads, dim = w["H"], pool.shape[-1]
        grid = (dim // DECODE_SLICE_WIDTH, heads, w["N"])
        warps = decode_warps(DECODE_SLICE_WIDTH)
        out = torch.empty_like(inp["v"])
        runs = {
            "empty kernel": lambda: _empty_kernel[grid](pool, num_warps=warps),
            "slot -> state -> store": lambda: _state_chain_kernel[grid](pool, slots, heads, dim, dim, DECODE_SLICE_WIDTH,
                                                                        True, num_warps=warps),
            "state -> store (no slot)": lambda: _state_chain_kernel[grid](pool, slots, heads, dim, dim,
                                                                          DECODE_SLICE_WIDTH, False, num_warps=warps),
            "decode step": lambda: recurrent_kda_decode(
                inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots, A_log=inp["A_log"],
                dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"], num_accepted_tokens=None,
                use_qk_l2norm=True, use_beta_sigmoid=True, v_slices=dim // DECODE_SLICE_WIDTH, out=out),
        }
        for label, run in runs.items():
            run()
            flushed = time_graph(run) * 1e3
            back_to_back = replay_back_to_back(run)
            print(f"[decode-floor] {w['name']} {label}: {flushed:.2f} us (graph, L2 flushed), "
                  f"{back_to_back:.2f} us back to back", flush=True)


if __name__ == "__main__":
    main()

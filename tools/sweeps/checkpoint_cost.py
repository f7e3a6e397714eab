"""Prefill time with and without two prefix-cache checkpoints per sequence (issue 5's bar: at most 5% more on
H12 N4 T8192), CUDA-graph replay.

python tools/sweeps/checkpoint_cost.py [--only H12_N4_T8192 ...]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import torch  # noqa: E402

from fastkda.api import kda_prefill  # noqa: E402
from fastkda.bench.timing import time_graph  # noqa: E402
from fastkda.bench.work import plan_for_inputs  # noqa: E402
from fastkda.bench.workloads import DIM, LOWER_BOUND, load_workloads, make_prefill_inputs  # noqa: E402


def checkpoint_offsets(lengths, chunk, device="cpu", dtype=torch.int32):
    """Two offsets per sequence, near a third and a half of it, rounded down to the chunk (as offsets must be)."""
    return torch.tensor([[n // 3 // chunk * chunk, n // 2 // chunk * chunk] for n in lengths], device=device,
                        dtype=dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["H12_N4_T8192"])
    args = parser.parse_args(argv)
    for w in load_workloads()["prefill"]:
        if w["name"] not in args.only:
            continue
        inp = make_prefill_inputs(w, "cuda")
        plan = plan_for_inputs(inp)
        cu = inp["cu_seqlens"]
        offsets = checkpoint_offsets(w["lengths"], plan.chunk, "cuda", cu.dtype if cu is not None else torch.int32)
        states = torch.empty(len(w["lengths"]), 2, w["H"], DIM, DIM, device="cuda")
        out = torch.empty_like(inp["v"])
        final = torch.empty_like(inp["initial_state"])

        def run(with_checkpoints):
            kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                        dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, initial_state=inp["initial_state"],
                        final_state=final, cu_seqlens=cu, out=out, plan=plan,
                        checkpoint_offsets=offsets if with_checkpoints else None,
                        checkpoint_states=states if with_checkpoints else None)

        plain = time_graph(lambda: run(False))
        with_ckpt = time_graph(lambda: run(True))
        print(f"[checkpoints] {w['name']}: {plain:.4f} ms without, {with_ckpt:.4f} ms with two per sequence "
              f"({(with_ckpt / plain - 1) * 100:+.1f}%)", flush=True)


if __name__ == "__main__":
    main()

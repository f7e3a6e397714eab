"""Prefill time with and without two prefix-cache checkpoints per sequence (issue 5: <= 5% on H12 N4 T8192).

python scripts/checkpoint_cost.py [--only H12_N4_T8192]"""

import argparse

import torch

from fastkda.api import kda_prefill
from fastkda.bench import LOWER_BOUND, load_workloads, make_prefill_inputs, time_graph

parser = argparse.ArgumentParser()
parser.add_argument("--only", nargs="*", default=["H12_N4_T8192"])
args = parser.parse_args()
for w in load_workloads()["prefill"]:
    if w["name"] not in args.only:
        continue
    inp = make_prefill_inputs(w, "cuda")
    seqs = len(w["lengths"])
    offsets = torch.tensor([[n // 3 // 64 * 64, n // 2 // 64 * 64] for n in w["lengths"]], device="cuda",
                           dtype=inp["cu_seqlens"].dtype if inp["cu_seqlens"] is not None else torch.int32)
    states = torch.empty(seqs, 2, w["H"], 128, 128, device="cuda")
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def run(with_checkpoints):
        kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                    lower_bound=LOWER_BOUND, initial_state=inp["initial_state"], final_state=final,
                    cu_seqlens=inp["cu_seqlens"], out=out, checkpoint_offsets=offsets if with_checkpoints else None,
                    checkpoint_states=states if with_checkpoints else None)

    plain = time_graph(lambda: run(False))
    with_ckpt = time_graph(lambda: run(True))
    print(f"[checkpoints] {w['name']}: {plain:.4f} ms without, {with_ckpt:.4f} ms with two per sequence "
          f"({(with_ckpt / plain - 1) * 100:+.1f}%)")

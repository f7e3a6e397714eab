"""Decode launch settings on the device: every decode workload with state slices of 16, 32 and 64 columns
(and 32 columns on 8 warps), CUDA-graph replay, so that the decode plan rests on measurements.

python scripts/decode_sweep.py [--out DIR]  ->  <date>-<gpu>-decode-sweep.json"""

import argparse
import datetime
import json
from pathlib import Path

import torch

from fastkda.bench import (LOWER_BOUND, RESULTS, decode_state_bytes, git_commit, load_workloads,
                           make_decode_inputs, results_stem, time_graph)
from fastkda.ops import decode



def runner(inp, v_slices):
    """The decode kernel launched directly, so that any slice count can be timed (the API takes 1, 2, 4)."""
    out = torch.empty_like(inp["v"])
    return lambda: decode.recurrent_kda_decode(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"], inp["slots"], A_log=inp["A_log"],
        dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"], num_accepted_tokens=inp["accepted"],
        use_qk_l2norm=True, use_beta_sigmoid=True, v_slices=v_slices, out=out)


SETTINGS = [(16, None), (32, None), (32, 8), (64, None)]  # (state columns per program, warps; None: default)

parser = argparse.ArgumentParser()
parser.add_argument("--out", default=str(RESULTS))
args = parser.parse_args()
default_warps = decode.decode_warps
rows = []
for w in load_workloads()["decode"]:
    inp = make_decode_inputs(w, "cuda")
    state_bytes = decode_state_bytes(w)
    for columns, warps in SETTINGS:
        decode.decode_warps = default_warps if warps is None else (lambda block_v, warps=warps: warps)
        run = runner(inp, inp["v"].shape[-1] // columns)
        ms = time_graph(run)
        label = f"{columns} columns, {warps or default_warps(columns)} warps"
        rows.append(dict(workload=w["name"], setting=label, ms=round(ms, 5), gbps=round(state_bytes / ms / 1e6, 1)))
        print(f"[decode-sweep] {w['name']} {label}: {ms * 1e3:.1f} us, {state_bytes / ms / 1e6:.0f} GB/s", flush=True)
    decode.decode_warps = default_warps
props = torch.cuda.get_device_properties(0)
meta = dict(gpu=props.name, sms=props.multi_processor_count, commit=git_commit(), date=datetime.date.today().isoformat())
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
Path(f"{results_stem(out)}-decode-sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

"""Sweep of the launch plan (issue 3): prefill time for V-slices s in {1, 2, 4} over N x H x tokens.

The whole call is timed for each s (CUDA-graph replay, median of do_bench), since the slice width and the pair count
also decide whether the solve kernel or the recurrence forms w and u (``fastkda.plan.w_u_in_recurrence``); outputs
and final states are also compared bitwise across s. Rows go to ``benchmarks/results/<date>-<gpu>-plan-sweep.json``
after every configuration, so a run cut short keeps what it measured. Then it prints how often the auto plan is
within 2% of the best.

python benchmarks/plan_sweep.py [--budget-s 400] [--rep-ms 25] [--seqs 1 2 ...] [--heads 4 8 ...] [--tokens 256 1024 8192]
"""

import argparse
import datetime
import itertools
import json
import time
from pathlib import Path

import torch

from fastkda.bench import fastkda_runner, git_commit, make_prefill_inputs, results_stem, time_graph
from fastkda.plan import V_SLICE_CHOICES, choose_plan

RESULTS = Path(__file__).resolve().parent / "results"


def sweep_one(heads, seqs, tokens, rep_ms):
    """``{s: ms}`` for one configuration, after checking every s gives the same bits."""
    inp = make_prefill_inputs(dict(H=heads, lengths=[tokens] * seqs, layout="varlen"), "cuda")
    times, first = {}, None
    for s in V_SLICE_CHOICES:
        run = fastkda_runner(inp, s)
        out, final = run()
        if first is None:
            first = (out.clone(), final.clone())
        elif not (torch.equal(out, first[0]) and torch.equal(final, first[1])):
            raise AssertionError(f"v_slices={s} differs from v_slices=1 at H={heads} N={seqs} T={tokens}")
        times[s] = time_graph(run, rep_ms)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", nargs="*", type=int, default=list(range(1, 17)))
    parser.add_argument("--heads", nargs="*", type=int, default=[4, 8, 12, 16, 24, 48, 96])
    parser.add_argument("--tokens", nargs="*", type=int, default=[256, 1024, 8192])
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--rep-ms", type=int, default=25, help="graph replay time per measurement")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    out = Path(args.out)
    path = Path(f"{results_stem(out)}-plan-sweep.json")
    out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.time()
    for tokens, heads, seqs in itertools.product(args.tokens, args.heads, args.seqs):
        if time.time() - start > args.budget_s:
            print(f"[sweep] budget reached after {len(rows)} configurations")
            break
        times = sweep_one(heads, seqs, tokens, args.rep_ms)
        auto = choose_plan(seqs, heads, tokens, 128, props.multi_processor_count).v_slices
        best = min(times, key=times.get)
        rows.append(dict(H=heads, N=seqs, T=tokens, ms={str(s): round(t, 5) for s, t in times.items()}, best=best,
                         auto=auto, auto_over_best=round(times[auto] / times[best], 4)))
        path.write_text(json.dumps(dict(meta=dict(gpu=props.name, sms=props.multi_processor_count, commit=git_commit(),
                                                  date=datetime.date.today().isoformat()), rows=rows), indent=1))
    within = sum(r["auto_over_best"] <= 1.02 for r in rows)
    print(f"[sweep] {len(rows)} configurations, auto within 2% of the best in {within}; results in {path}")
    for r in rows:
        if r["auto_over_best"] > 1.02:
            print(f"[sweep] auto s={r['auto']} is {r['auto_over_best']:.2f}x the best s={r['best']} at "
                  f"H={r['H']} N={r['N']} T={r['T']}")


if __name__ == "__main__":
    main()

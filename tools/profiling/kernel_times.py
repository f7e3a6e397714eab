"""Per-kernel GPU time of one prefill call (torch.profiler), for docs/perf-notes.md.

python scripts/kernel_times.py [--v-slices 1] [--impl fla]   (--impl: any of fastkda.bench.IMPLS, peers too)"""

import argparse

from fastkda.bench import IMPLS, fastkda_runner, load_workloads, make_prefill_inputs, profile_kernels

parser = argparse.ArgumentParser()
parser.add_argument("--only", nargs="*", default=["H96_B1_T8192", "H12_N1_T8192", "H12_N1_T1024", "H12_N1_T65536"])
parser.add_argument("--v-slices", default="auto")
parser.add_argument("--impl", default="fastkda", choices=list(IMPLS), help="whose kernels to time (fastkda honours --v-slices)")
args = parser.parse_args()
v_slices = args.v_slices if args.v_slices == "auto" else int(args.v_slices)
for w in load_workloads()["prefill"]:
    if w["name"] not in args.only:
        continue
    inp = make_prefill_inputs(w, "cuda")
    run = fastkda_runner(inp, v_slices) if args.impl == "fastkda" else IMPLS[args.impl](inp)
    times = {key: us / launches for key, (us, launches) in profile_kernels(run, 10, warmup=3).items()}
    line = ", ".join(f"{k[:40]} {v / 1000:.3f} ms" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
    print(f"[kernels] {args.impl} {w['name']} v_slices={v_slices}: {line}")

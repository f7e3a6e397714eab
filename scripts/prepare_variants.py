"""Time the preparation step's implementations and launch settings in one device call (whole prefill call,
auto plan), checking each variant's output against the first's (they differ only in summation order).

python scripts/prepare_variants.py [--only H12_N1_T8192 H96_B1_T8192]"""

import argparse

from triton.testing import do_bench

from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs
from fastkda.ops import prefill

# (label, module settings): the split path's solve kernel and the fused kernel's channel block and warps
VARIANTS = [
    ("split solve32/w8", dict(PREPARE_PATH="split", SOLVE_CHANNEL_BLOCK=32, SOLVE_WARPS=8, INTRA_WARPS=4)),
    ("split solve16/w4", dict(PREPARE_PATH="split", SOLVE_CHANNEL_BLOCK=16, SOLVE_WARPS=4, INTRA_WARPS=4)),
    ("split solve64/w8", dict(PREPARE_PATH="split", SOLVE_CHANNEL_BLOCK=64, SOLVE_WARPS=8, INTRA_WARPS=4)),
    ("split intra w8", dict(PREPARE_PATH="split", SOLVE_CHANNEL_BLOCK=32, SOLVE_WARPS=8, INTRA_WARPS=8)),
    ("fused 16/w8", dict(PREPARE_PATH="fused", CHANNEL_BLOCK=16, PREPARE_WARPS=8)),
    ("fused 32/w4", dict(PREPARE_PATH="fused", CHANNEL_BLOCK=32, PREPARE_WARPS=4)),
]

parser = argparse.ArgumentParser()
parser.add_argument("--only", nargs="*", default=["H12_N1_T8192", "H96_B1_T8192"])
args = parser.parse_args()
defaults = {name: getattr(prefill, name) for _, settings in VARIANTS for name in settings}
for w in load_workloads()["prefill"]:
    if w["name"] not in args.only:
        continue
    run = fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")
    expected = None
    for label, settings in VARIANTS:
        for name, value in settings.items():
            setattr(prefill, name, value)
        out = run()[0]
        if expected is None:
            expected = out.float().clone()
        err = ((out.float() - expected).norm() / expected.norm()).item()
        ms = do_bench(run, warmup=10, rep=50, return_mode="median")
        print(f"[variants] {w['name']} {label}: {ms:.3f} ms (whole call), vs first variant {err:.1e}")
    for name, value in defaults.items():
        setattr(prefill, name, value)

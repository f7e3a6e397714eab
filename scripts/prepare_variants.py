"""Time the preparation kernels' launch settings in one device call (whole prefill call,
auto plan), checking each variant's output against the first's (they differ only in summation order).

python scripts/prepare_variants.py [--only H12_N1_T8192 H96_B1_T8192]"""

import argparse

from triton.testing import do_bench

from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs
from fastkda.ops import prefill

# (label, module settings): channel blocks, warps and register caps of the two preparation kernels
VARIANTS = [
    ("32 channels, 8 warps", dict(PREPARE_CHANNELS=32, PREPARE_WARPS=8, PREPARE_MAXNREG=None)),
    ("32 channels, 8 warps, 128 registers", dict(PREPARE_CHANNELS=32, PREPARE_WARPS=8, PREPARE_MAXNREG=128)),
    ("16 channels, 8 warps, 128 registers", dict(PREPARE_CHANNELS=16, PREPARE_WARPS=8, PREPARE_MAXNREG=128)),
    ("solve: 32 channels, 4 warps", dict(SOLVE_CHANNELS=32, SOLVE_WARPS=4)),
]

parser = argparse.ArgumentParser()
parser.add_argument("--only", nargs="*", default=["H96_B1_T8192"])
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
        try:
            out = run()[0]
            if expected is None:
                expected = out.float().clone()
            err = ((out.float() - expected).norm() / expected.norm()).item()
            ms = do_bench(run, warmup=10, rep=50, return_mode="median")
            print(f"[variants] {w['name']} {label}: {ms:.3f} ms (whole call), vs first variant {err:.1e}", flush=True)
        except Exception as error:  # one broken variant must not hide the others' numbers
            print(f"[variants] {w['name']} {label}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
    for name, value in defaults.items():
        setattr(prefill, name, value)

"""Time variants of the preparation kernels in one device call (whole prefill call, auto plan), each checked
against the first (they differ only in rounding). A variant is either module settings or a source edit of
``fastkda/ops/prefill.py``, imported as a separate module so that Triton compiles it afresh.

python scripts/prepare_variants.py [--only H96_B1_T8192 ...]"""

import argparse
import importlib
from pathlib import Path

from triton.testing import do_bench

import fastkda.api
from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs

SOURCE = Path(fastkda.api.__file__).parent / "ops" / "prefill.py"
LIBDEVICE_MATH = '''

@triton.jit
def fast_exp2(x, EMULATE: tl.constexpr):
    return tl.exp2(x)


@triton.jit
def fast_reciprocal(x, EMULATE: tl.constexpr):
    return 1.0 / x
'''


def libdevice_math(src):
    """ex2/rcp through Triton's own exp2 and IEEE division instead of the one-instruction approximations."""
    src = src.replace("from .common import bf16_operand, fast_exp2, fast_reciprocal, interpreting, load_f32, store_as",
                      "from .common import bf16_operand, interpreting, load_f32, store_as")
    return src.replace("\nBLOCK = 16", LIBDEVICE_MATH + "\nBLOCK = 16", 1)


def v5(src):
    """The preparation as of cae26b8 (one kernel, natural-exp decays, inverse and w/u in the same program):
    ``git show cae26b8:fastkda/ops/prefill.py > .variants/v5_prefill.py`` (carried to the device)."""
    return (SOURCE.parents[2] / ".variants" / "v5_prefill.py").read_text()


# (label, module settings, source edit or None)
VARIANTS = [
    ("as committed", {}, None),
    ("Triton exp2 and IEEE division", {}, libdevice_math),
    ("prepare capped at 128 registers", dict(PREPARE_MAXNREG=128), None),
    ("v5 of cae26b8, 32 channels", dict(COLUMNS_CHANNELS=32), v5),
]


def variant_module(index, settings, edit):
    """``fastkda.ops.prefill`` reloaded (its defaults back), or a source-edited copy of it; then ``settings``
    applied. The API imports ``chunk_kda_forward`` from ``fastkda.ops.prefill`` at each call, so the variant's
    is put there."""
    prefill = importlib.reload(importlib.import_module("fastkda.ops.prefill"))
    module = prefill
    if edit is not None:
        path = SOURCE.parent / f"_variant{index}.py"
        path.write_text(edit(SOURCE.read_text()))
        module = importlib.import_module(f"fastkda.ops._variant{index}")
    for name, value in settings.items():
        setattr(module, name, value)
    prefill.chunk_kda_forward = module.chunk_kda_forward
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=["H96_B1_T8192"])
    args = parser.parse_args()
    try:
        for w in load_workloads()["prefill"]:
            if w["name"] not in args.only:
                continue
            run = fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")
            expected = None
            for index, (label, settings, edit) in enumerate(VARIANTS):
                try:
                    variant_module(index, settings, edit)
                    out = run()[0]
                    if expected is None:
                        expected = out.float().clone()
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                    print(f"[variants] {w['name']} {label}: {ms:.3f} ms (whole call), vs first {err:.1e}", flush=True)
                except Exception as error:  # one broken variant must not hide the others' numbers
                    print(f"[variants] {w['name']} {label}: failed: {type(error).__name__}: {str(error)[:300]}",
                          flush=True)
    finally:
        importlib.reload(importlib.import_module("fastkda.ops.prefill"))
        for path in SOURCE.parent.glob("_variant*.py"):
            path.unlink()


if __name__ == "__main__":
    main()

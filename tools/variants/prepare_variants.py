"""Time variants of the preparation kernels in one device call (whole prefill call, auto plan), each checked
against the first (they differ only in rounding) and against float64 on the spec's accuracy case. A variant is either module settings or a source edit of
``fastkda/ops/prefill.py``, imported as a separate module so that Triton compiles it afresh.

python scripts/prepare_variants.py [--only H96_B1_T8192 ...] [--source OLD_PREFILL.py ...] [--set NAME=VALUE,...]
Every variant is first compiled in a process of its own, all at once (Triton's cache is shared on disk), so
the device call pays for one compile, not one per variant."""

import argparse
import importlib
import subprocess
import sys
import time
from pathlib import Path

from triton.testing import do_bench

import fastkda.api
from fastkda.bench import accuracy, fastkda_runner, load_workloads, make_prefill_inputs
from variant_accuracy import load_variant  # a sibling script (its directory is on sys.path)

SOURCE = Path(fastkda.api.__file__).parent / "ops" / "prefill.py"
# (label, module settings, source edit or None)
VARIANTS = [  # the next ones to time
    ("as committed", {}, None),
]


def variant_module(index, settings, edit):
    """``fastkda.ops.prefill`` reloaded (its defaults back), or a source-edited copy of it; then ``settings``
    applied. The API imports ``chunk_kda_forward`` from ``fastkda.ops.prefill`` at each call, so the variant's
    is put there."""
    prefill = importlib.reload(importlib.import_module("fastkda.ops.prefill"))
    module = prefill if edit is None else load_variant(edit(SOURCE.read_text()), f"_variant{index}")
    for name, value in settings.items():
        setattr(module, name, value)
    prefill.chunk_kda_forward = module.chunk_kda_forward
    return module


def parse_settings(text):
    """``"NAME=VALUE,NAME=VALUE"`` -> module settings (integer values, or ``None``); a name that
    ``fastkda.ops.prefill`` does not have is an error (it would time the committed kernels under a wrong label)."""
    pairs = (item.split("=", 1) for item in text.split(","))
    settings = {name: None if value == "None" else int(value) for name, value in pairs}
    prefill = importlib.import_module("fastkda.ops.prefill")
    unknown = [name for name in settings if not hasattr(prefill, name)]
    if unknown:
        raise SystemExit(f"--set {text}: fastkda.ops.prefill has no {', '.join(unknown)}")
    return settings


def variants(source_files, settings=()):
    """The built-in variants, then one per ``--set`` (module settings of the committed kernels) and one per
    ``--source`` file (a whole other ``prefill.py``, e.g. an older one)."""
    extra = [(f"set {text}", parse_settings(text), None) for text in settings]
    extra += [(f"source {path}", {}, lambda _, text=Path(path).read_text(): text) for path in source_files]
    return VARIANTS + extra


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=["H96_B1_T8192", "H12_N1_T8192"])
    parser.add_argument("--source", nargs="*", default=[], help="other prefill.py files to time as variants")
    parser.add_argument("--set", nargs="*", default=[], dest="settings",
                        help="module settings to time as variants, each NAME=VALUE[,NAME=VALUE]")
    parser.add_argument("--compile-only", type=int, help="run variant INDEX once on a small case (cache warm-up)")
    args = parser.parse_args()
    chosen = variants(args.source, args.settings)
    try:
        if args.compile_only is not None:  # fills Triton's on-disk cache; many of these run at once
            variant_module(args.compile_only, *chosen[args.compile_only][1:])
            for w in load_workloads()["prefill"]:
                if w["name"] in args.only:  # the timed shapes themselves: Triton specialises on some of their values
                    fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")()
            return
        started = time.time()
        workers = [subprocess.Popen([sys.executable, __file__, "--compile-only", str(index), "--only", *args.only,
                                     "--source", *args.source, "--set", *args.settings])
                   for index in range(len(chosen))]
        for worker in workers:
            worker.wait()
        print(f"[variants] {len(chosen)} variants compiled in parallel in {time.time() - started:.0f} s", flush=True)
        errors = {}
        for w in load_workloads()["prefill"]:
            if w["name"] not in args.only:
                continue
            run = fastkda_runner(make_prefill_inputs(w, "cuda"), "auto")
            expected = None
            for index, (label, settings, edit) in enumerate(chosen):
                try:
                    variant_module(index, settings, edit)
                    out = run()[0]
                    if expected is None:
                        expected = out.float().clone()
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                    if label not in errors:  # against float64 on the spec's accuracy case, once per variant
                        errors[label] = accuracy(lambda inp: fastkda_runner(inp, "auto"), "cuda")
                    print(f"[variants] {w['name']} {label}: {ms:.3f} ms (whole call), vs first {err:.1e}, vs float64 "
                          f"output {errors[label][0]:.2e} state {errors[label][1]:.2e}", flush=True)
                except Exception as error:  # one broken variant must not hide the others' numbers
                    print(f"[variants] {w['name']} {label}: failed: {type(error).__name__}: {str(error)[:300]}",
                          flush=True)
    finally:
        if args.compile_only is None:
            importlib.reload(importlib.import_module("fastkda.ops.prefill"))


if __name__ == "__main__":
    main()

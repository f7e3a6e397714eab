"""Float64 error of prefill variants on the spec's accuracy case, on the CPU (no GPU, no device time).

python tools/variants/variant_accuracy.py [PREFILL_DIR ...] [--tokens 2048] [--v-slices 1] [--set NAME=VALUE,...]
Each PREFILL_DIR is a whole ``fastkda/ops/prefill/`` package (``variant.py``); without any, the committed kernels.
``--v-slices`` picks the recurrence's form, as the launch plan would; ``--set`` changes every variant's plan.

The Triton kernels run on Triton's CPU interpreter with bf16 rounding emulated as on the GPU
(``fastkda.ops.common``), so variants that differ in bf16 operands get about the GPU's error; tf32 is *not*
emulated (the interpreter multiplies tf32 operands in fp32), so a variant that differs only there looks the same
here."""

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (an importer, e.g. a test, sets its own)
    # the preparation's products overflow above their diagonal, which the kernels discard (prepare.py)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from fastkda.bench.runners import relative_error  # noqa: E402
from fastkda.bench.workloads import ACCURACY_CASE, LOWER_BOUND, make_prefill_inputs  # noqa: E402
from fastkda.reference import kda_reference  # noqa: E402
from tools.plan_changes import add_set_argument, parse_arguments  # noqa: E402
from tools.variants.variant import Variant, variant_package, variant_runner  # noqa: E402


def errors(package, changes, inp, reference, v_slices=1):
    """(output, final state) relative L2 error of ``package``'s prefill at ``v_slices`` against ``reference``."""
    out, final = variant_runner(package, changes, inp, v_slices)()
    return relative_error(out, reference[0]), relative_error(final, reference[1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", help="prefill package folders (default: the committed one)")
    parser.add_argument("--tokens", type=int, default=ACCURACY_CASE["lengths"][0])
    parser.add_argument("--v-slices", type=int, default=1, choices=(1, 2, 4),
                        help="V-slices of the recurrence (its form follows the slice width)")
    add_set_argument(parser, what="launch numbers to change in every variant's plan")
    args, changes = parse_arguments(parser, argv)
    inp = make_prefill_inputs(dict(ACCURACY_CASE, lengths=[args.tokens]), "cpu", seed=1)
    reference = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                              dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    found = {}
    for index, source in enumerate(args.sources or [None]):
        variant = Variant(changes, source)
        started = time.time()
        # the process id in the copy's name: two runs side by side (tests on xdist workers) keep their own copies
        with variant_package(variant, f"_accuracy_variant_{os.getpid()}_{index}") as package:
            found[variant.label] = errors(package, changes, inp, reference, args.v_slices)
        print(f"[accuracy] {variant.label}: output {found[variant.label][0]:.3e} state {found[variant.label][1]:.3e} "
              f"({time.time() - started:.0f} s, CPU interpreter)", flush=True)
    return found


if __name__ == "__main__":
    main()

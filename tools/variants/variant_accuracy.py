"""Float64 error of prefill kernel variants on the spec's accuracy case, on the CPU (no GPU, no device time).

python scripts/variant_accuracy.py [--tokens 2048] [--v-slices 1] PREFILL.py ...   (each a whole
``fastkda/ops/prefill.py``; ``--v-slices`` picks the recurrence's form, as the launch plan would)

The Triton kernels run on Triton's CPU interpreter with bf16 rounding emulated as on the GPU (``fastkda.ops.common``),
so variants that differ in bf16 operands get the GPU's error to about 1% (M from bf16 operands: 3.689e-3 here, 3.73e-3
on the H200). tf32 is *not* emulated: the interpreter multiplies tf32 operands in fp32 (the committed kernel: 2.893e-3
here, 3.09e-3 on the H200)."""

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (an importer, e.g. a test, sets its own)

import torch  # noqa: E402

from fastkda.bench import ACCURACY_CASE, LOWER_BOUND, make_prefill_inputs, relative_error  # noqa: E402
from fastkda.reference import kda_reference  # noqa: E402

OPS = Path(__file__).resolve().parent.parent / "fastkda" / "ops"


def load_variant(text, name):
    """``text``, a whole ``prefill.py``, imported as ``fastkda.ops.<name>`` (its relative imports resolve
    there) from a copy inside ``fastkda/ops/`` that is removed at once (Triton keeps each kernel's source)."""
    target = OPS / f"{name}.py"
    target.write_text(text)
    spec = importlib.util.spec_from_file_location(f"fastkda.ops.{name}", target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        target.unlink()
    return module


def errors(module, inp, reference, v_slices=1):
    """(output, final state) relative L2 error of ``module.chunk_kda_forward`` at ``v_slices`` against
    ``reference``."""
    out, final = torch.empty_like(inp["v"]), torch.empty_like(inp["initial_state"])
    module.chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                             dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                             initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True,
                             use_beta_sigmoid=True, v_slices=v_slices, out=out, final_state=final)
    return relative_error(out, reference[0]), relative_error(final, reference[1])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("sources", nargs="+", help="prefill.py variants")
    parser.add_argument("--tokens", type=int, default=ACCURACY_CASE["lengths"][0])
    parser.add_argument("--v-slices", type=int, default=1, choices=(1, 2, 4),
                        help="V-slices of the recurrence (its form follows the slice width)")
    args = parser.parse_args(argv)
    inp = make_prefill_inputs(dict(ACCURACY_CASE, lengths=[args.tokens]), "cpu", seed=1)
    reference = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                              dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    found = {}
    for index, path in enumerate(args.sources):
        started = time.time()
        variant = load_variant(Path(path).read_text(), f"_accuracy_variant{index}")
        found[path] = errors(variant, inp, reference, args.v_slices)
        print(f"[accuracy] {path}: output {found[path][0]:.3e} state {found[path][1]:.3e} "
              f"({time.time() - started:.0f} s, CPU interpreter)", flush=True)
    return found


if __name__ == "__main__":
    main()

"""Static SASS instruction counts of the preparation kernels (sm_90a, no GPU), a local proxy for their
dynamic instruction count: ``python scripts/sass_count.py PATH [PATH ...]`` with PATH a kernel name in
fastkda.ops.prefill, settings as NAME=VALUE (BK, num_warps, num_stages; the last defaults to the launch's)."""

import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

from compile_stats import BIN, PREPARATION_SIGNATURE, compile_for_hopper  # noqa: E402
from fastkda.ops import prefill  # noqa: E402

STAGES = dict(_prepare_kernel="PREPARE_STAGES", _solve_kernel="SOLVE_STAGES")  # the knobs their launches use
WARPS = dict(_prepare_kernel="PREPARE_WARPS", _solve_kernel="SOLVE_WARPS")


def sass(fn, constants, num_warps, num_stages):
    kernel = compile_for_hopper(fn, PREPARATION_SIGNATURE, constants, num_warps, num_stages)
    Path("/tmp/fastkda_sass.cubin").write_bytes(kernel.asm["cubin"])
    return subprocess.run([str(BIN / "nvdisasm"), "-c", "/tmp/fastkda_sass.cubin"], capture_output=True,
                          text=True).stdout


def sass_of_arguments(kernel_name, settings):
    """SASS of ``kernel_name`` in fastkda.ops.prefill with ``NAME=VALUE`` settings (constexprs, num_warps,
    num_stages) on a K = V = 128, H = 12, lower-bound-gate varlen launch."""
    settings = dict(arg.split("=") for arg in settings)
    warps = int(settings.pop("num_warps", getattr(prefill, WARPS[kernel_name])))
    stages = int(settings.pop("num_stages", getattr(prefill, STAGES[kernel_name])))
    consts = dict(H=12, K=128, V=128, C=prefill.CHUNK, BC=prefill.BLOCK, IS_VARLEN=True, LOWER_BOUND_GATE=True, L2NORM=True,
                  BETA_SIGMOID=True, DOT_PRECISION="tf32", EMULATE=False, FORM_W_U=True, RUN=prefill.token_run(128))
    consts.update({k: int(v) for k, v in settings.items()})  # a setting may replace a default (FORM_W_U=0)
    return sass(getattr(prefill, kernel_name), consts, warps, stages)


if __name__ == "__main__":
    text = sass_of_arguments(sys.argv[1], sys.argv[2:])
    Path("/tmp/fastkda.sass").write_text(text)
    body = [ln for ln in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    labels, position, loops = {}, 0, []
    for ln in text.splitlines():  # loop bodies: code between a label and a later branch back to it
        label = re.match(r"(\.L_x_\d+):", ln)
        if label:
            labels[label.group(1)] = position
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln):
            target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
            if target and target.group(1) in labels:
                loops.append(position - labels[target.group(1)] + 1)
            position += 1
    print("loop bodies (instructions):", loops)
    print(sys.argv[1:], "SASS instructions:", len(body),
          "BAR:", sum("BAR.SYNC" in ln for ln in body), "MUFU:", sum("MUFU" in ln for ln in body),
          "HGMMA:", sum("HGMMA" in ln for ln in body), "HMMA:", sum("HMMA" in ln for ln in body),
          "LDS:", sum(" LDS" in ln or "LDSM" in ln for ln in body), "STS:", sum(" STS" in ln for ln in body),
          "SHFL:", sum("SHFL" in ln for ln in body), "LDG:", sum("LDG" in ln for ln in body),
          "STG:", sum("STG" in ln for ln in body), "local:", sum("LDL" in ln or "STL" in ln for ln in body))

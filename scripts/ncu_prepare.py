"""Hardware counters of the preparation kernels (Nsight Compute), to tell where their time goes.

ncu --clock-control none -k regex:prepare_kernel --launch-count 3 --section ... \
    python scripts/ncu_prepare.py PATH [PATH ...]   (one H96 B1 T8192 call per preparation path)"""

import sys

import torch

from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs
from fastkda.ops import prefill

workload = next(w for w in load_workloads()["prefill"] if w["name"] == "H96_B1_T8192")
run = fastkda_runner(make_prefill_inputs(workload, "cuda"), "auto")
for path in sys.argv[1:]:
    prefill.PREPARE_PATH = path
    run()
    torch.cuda.synchronize()

"""Hardware counters of the preparation kernel (Nsight Compute), to tell where its time goes.

ncu --clock-control none -k regex:prepare_kernel --section ... python scripts/ncu_prepare.py
(one H96 B1 T8192 call)"""

import torch

from fastkda.bench import fastkda_runner, load_workloads, make_prefill_inputs

workload = next(w for w in load_workloads()["prefill"] if w["name"] == "H96_B1_T8192")
fastkda_runner(make_prefill_inputs(workload, "cuda"), "auto")()
torch.cuda.synchronize()

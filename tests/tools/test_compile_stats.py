"""The sm_90a compile tools compile what a launch compiles: the kernels' arguments as the launch functions pass
them under a plan, compiled and read back with Triton's own ptxas and nvdisasm (no GPU). They run in processes of
their own, since the tests interpret the kernels and these tools must not."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiles with Triton's ptxas")


def run_tool(*args, code=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", code] if code else [sys.executable, str(ROOT / "tools" / "profiling" / args[0]),
                                                         *args[1:]]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# Records every launch of chunk_kda_forward and recurrent_kda_decode on CPU tensors (no kernel runs), as the
# compile tools would describe the same launches; prints both as JSON.
RECORD = r"""
import json, sys
sys.path.insert(0, ".")
from tools.profiling import hopper
import torch
from fastkda.bench.work import plan_for_inputs
from fastkda.bench.workloads import make_decode_inputs, make_prefill_inputs
from fastkda.ops import decode
from fastkda.ops.prefill import chunk_kda_forward, prepare, recurrence, solve
from fastkda.plan import choose_decode_plan

POINTERS = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}
recorded = {}

def record(kernel, grid, *args, **meta):
    values = dict(zip([p.name for p in kernel.params], args), **meta)
    values = {k: POINTERS[v.dtype] if isinstance(v, torch.Tensor) else v for k, v in values.items()}
    recorded[kernel.__name__] = [values, values.pop("num_warps"), values.pop("num_stages", 3),
                                 values.pop("maxnreg", None)]

for module in (prepare, solve, recurrence, decode):
    module.launch = record
inp = make_prefill_inputs(dict(H=3, lengths=[100, 37], layout="varlen"), "cpu")
plan = plan_for_inputs(inp, sms=132).replace(prepare_warps=8, solve_stages=2, prepare_registers=128,
                                             inverse_in_prepare=INVERSE_IN_PREPARE)
offsets = torch.tensor([[32, 64], [0, 32]], dtype=torch.int32)
chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=inp["A_log"],
                  dt_bias=inp["dt_bias"], lower_bound=-5.0, scale=inp["scale"], initial_state=inp["initial_state"],
                  cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True, use_beta_sigmoid=True,
                  out=torch.empty_like(inp["v"]), final_state=torch.empty_like(inp["initial_state"]),
                  checkpoint_offsets=offsets, checkpoint_states=torch.empty(2, 2, 3, 128, 128),
                  errors=torch.zeros(3, dtype=torch.int32))
dec = make_decode_inputs(dict(H=3, N=2, tokens_per_seq=1), "cpu")
decode_plan = choose_decode_plan(2, 3, 128, 132)
decode.recurrent_kda_decode(dec["q"], dec["k"], dec["v"], dec["g"], dec["beta"], dec["pool"], dec["slots"],
                            plan=decode_plan, A_log=dec["A_log"], dt_bias=dec["dt_bias"], lower_bound=-5.0,
                            scale=dec["scale"], num_accepted_tokens=None, use_qk_l2norm=True, use_beta_sigmoid=True,
                            out=torch.empty_like(dec["v"]), errors=torch.zeros(3, dtype=torch.int32))
from fastkda.bench.runners import step_inputs
from fastkda.ops import decode_step
from fastkda.plan import choose_decode_step_plan
decode_step.launch = record
step, step_plan = step_inputs(dec), choose_decode_step_plan(2, 3, 128, 132)
decode_step.fused_decode_step(step["mixed"], step["conv_states"], step["conv_weight"], dec["g"][:, 0],
                              dec["beta"][:, 0], step["output_gate"], step["norm_weight"], dec["pool"], dec["slots"],
                              plan=step_plan, A_log=dec["A_log"], dt_bias=dec["dt_bias"], lower_bound=-5.0,
                              scale=dec["scale"], eps=1e-5, use_qk_l2norm=True, use_beta_sigmoid=True,
                              tickets=torch.zeros(6, dtype=torch.int32),
                              out=torch.empty(2, 3, 128, dtype=torch.bfloat16),
                              errors=torch.zeros(3, dtype=torch.int32))
described = {fn.__name__: [args, warps, stages, maxnreg]
             for fn, args, warps, stages, maxnreg in hopper.launches(plan, decode_plan, checkpoints=2).values()}
print(json.dumps(dict(recorded=recorded, described=described)))
"""


@pytest.mark.parametrize("inverse_in_prepare", [False, True])  # True: the first kernel inverts, no solve launch
def test_the_tools_describe_each_launch_as_the_launch_functions_make_it(inverse_in_prepare):
    found = json.loads(run_tool(code=RECORD.replace("INVERSE_IN_PREPARE", str(inverse_in_prepare))))
    solve = set() if inverse_in_prepare else {"solve_kernel"}
    assert set(found["recorded"]) == {"prepare_kernel", "recurrence_kernel", "decode_kernel",
                                      "decode_step_kernel"} | solve
    assert found["described"] == found["recorded"]


def test_compile_stats_compiles_a_kernel_under_a_changed_plan():
    out = run_tool("compile_stats.py", "--heads", "2", "--tokens", "64", "--kernels", "solve", "--set",
                   "solve_warps=2,inverse_in_prepare=0")
    line = next(ln for ln in out.splitlines() if ln.startswith("[compile] solve"))
    assert "warps=2 stages=3" in line and "'regs': " in line and "'spill_st': " in line


@pytest.mark.parametrize("shape", [
    ("--seqs", "1", "--tokens", "1", "--dim", "64"), ("--seqs", "1", "--tokens", "1", "--dim", "128"),
    ("--seqs", "2", "--tokens", "1", "--fixed"), ("--seqs", "3", "--tokens", "33", "--precomputed-gate"),
])
def test_the_automatic_plan_compiles_on_edge_shapes(shape):
    """Lengths Triton specialises (a one-token row has ``seq_len = 1``, a constant to it) and partial chunks: every
    kernel of the automatic Hopper plan compiles (Triton 3.6 fails to lower the Gluon recurrence specialised to
    ``seq_len = 1``, so the plan keeps the Triton one there)."""
    out = run_tool("compile_stats.py", "--heads", "3", *shape, "--checkpoints", "1", "--kernels", "prepare", "solve",
                   "recurrence")
    compiled = {ln.split()[1] for ln in out.splitlines() if ln.startswith("[compile] ") and "'regs': " in ln}
    # under the lower-bound gate these small shapes fold the inverse into the first kernel (inverse_in_prepare)
    folded = "--precomputed-gate" not in shape
    assert compiled == {"prepare", "recurrence"} | (set() if folded else {"solve"}), out
    assert ("[compile] solve: not launched under this plan" in out) == folded, out


def test_sass_count_reads_the_decode_kernels_sass():
    out = run_tool("sass_count.py", "decode", "--heads", "2", "--decode-set", "warps=4")
    line = next(ln for ln in out.splitlines() if ln.startswith("[sass] decode:"))
    assert int(line.split("instructions ")[1].split(",")[0]) > 100 and "LDG" in line



WORKLOAD_SHAPES = r"""
import sys
sys.path.insert(0, ".")
from tools.profiling import hopper
print(hopper.workload_shape("decode_H12_N32"), hopper.workload_shape("H12_N2_T1024"))
for name in ("decode_H12_N64_spec4", "decode_H12_N256_bf16", "no_such_workload"):
    try:
        hopper.workload_shape(name)
    except SystemExit as refused:
        print(name, "refused:", refused)
"""


def test_a_one_token_decode_workload_names_its_shape_and_other_decode_workloads_are_refused():
    lines = run_tool(code=WORKLOAD_SHAPES).splitlines()
    assert lines[0] == f"(12, {[1] * 32}, False) (12, [1024, 1024], True)"
    assert [line.split(" refused:")[0] for line in lines[1:]] == ["decode_H12_N64_spec4", "decode_H12_N256_bf16",
                                                                   "no_such_workload"]
    assert "not a one-token step on an fp32 pool" in lines[1] and "not a one-token step" in lines[2]

# The Gluon recurrence (plan.warpgroup_recurrence) compiled as its launches compile it, in each of its forms: a
# Gluon API change, a spill, or ptxas serialising the wgmma products (warning C7514: a cp.async between a wgmma and
# its wait did it once) fails here, on any machine with Triton's ptxas.
GLUON = r"""
import argparse, sys
sys.path.insert(0, ".")
from tools.profiling import hopper
for workload, extra in (("H12_N4_T1024", []), ("H12_N1_T8192", []), ("H12_N4_T8192", ["--fixed"]),
                        ("H12_N8_T1024", ["--checkpoints", "2"])):
    parser = argparse.ArgumentParser()
    hopper.add_plan_arguments(parser)
    args = parser.parse_args(["--workload", workload, "--set", "warpgroup_recurrence=1,recurrence_stages=4", *extra])
    plan, decode = hopper.plans_from_arguments(args)
    for name, (fn, kernel_args, warps, stages, maxnreg) in hopper.launches(
            plan, decode, ("recurrence", "transition"), args.checkpoints).items():
        kernel = hopper.compile_for_hopper(fn, kernel_args, warps, stages, maxnreg)
        report = hopper.ptxas_report(kernel)
        print(workload, name, fn.__name__, "C7514" in report, "0 bytes spill stores" in report,
              kernel.asm["ptx"].count("wgmma.mma_async"))
"""


def test_the_gluon_recurrence_compiles_without_spill_or_serialised_products():
    lines = [line.split() for line in run_tool(code=GLUON).splitlines()]
    assert {line[2] for line in lines} == {"warpgroup_recurrence_kernel", "warpgroup_transition_kernel"}
    for workload, name, kernel, serialised, no_spill, wgmma in lines:
        assert serialised == "False" and no_spill == "True" and int(wgmma) >= 14, (workload, name)

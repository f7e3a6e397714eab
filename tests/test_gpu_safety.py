"""Bad device-side indices on the GPU (issue 16): each group of cases of tests/gpu_faults.py in its own process,
under compute-sanitizer's memcheck where it is installed (0 errors), guards unchanged, counters as documented, the
CUDA context usable afterwards; checked mode raises the named ValueError. Skipped without CUDA."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastkda
from helpers import make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FAULTS = Path(__file__).resolve().parent / "gpu_faults.py"


def sanitizer():
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


@pytest.mark.parametrize("group", ["decode", "prefill"])
def test_faults_stay_inside_the_buffers(group):
    tool = sanitizer()
    command = [sys.executable, str(FAULTS), group]
    if tool:
        command = [tool, "--tool", "memcheck", "--error-exitcode", "97", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    print(done.stdout[-4000:], done.stderr[-2000:])
    assert done.returncode == 0 and "ALL OK" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]
    if tool:
        assert "ERROR SUMMARY: 0 errors" in done.stdout + done.stderr


def decode_inputs():
    inp = make_inputs([2] * 3, heads=4, key_dim=128, varlen=False, device="cuda", seed=65)
    pool = torch.randn(8, 4, 128, 128, device="cuda")
    return inp, pool


@pytest.mark.parametrize("slots, accepted, name", [
    ([[0, 1], [2, 8], [4, 5]], None, "slots"), ([[0, 1], [2, 3], [0, 5]], None, "slots"),
    ([[0, 1], [2, 3], [4, 5]], [1, 0, 2], "num_accepted_tokens"), ([[0, 1], [2, 3], [4, 5]], [1, 3, 2],
                                                                  "num_accepted_tokens")])
def test_checked_mode_raises_for_decode_indices(slots, accepted, name):
    inp, pool = decode_inputs()
    before = pool.clone()
    with pytest.raises(ValueError, match=f"^fastkda: {name} must be"):
        fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                           torch.tensor(slots, dtype=torch.int32, device="cuda"), A_log=inp["A_log"],
                           dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], checks=True,
                           num_accepted_tokens=None if accepted is None else torch.tensor(accepted, device="cuda"))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("edit, name", [
    (lambda inp: inp.update(cu_seqlens=torch.tensor([0, 50, 40, 120], dtype=torch.int32, device="cuda")),
     "cu_seqlens"),
    (lambda inp: inp["q"].view(-1)[5:6].fill_(float("nan")), "q")])
def test_checked_mode_raises_for_prefill_values(edit, name):
    inp = make_inputs([40, 40, 40], heads=4, key_dim=128, device="cuda", seed=66)
    edit(inp)
    out = torch.full_like(inp["v"], 7.0)
    with pytest.raises(ValueError, match=f"^fastkda: {name} must be"):
        fastkda.kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                            dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"],
                            out=out, checks=True)
    assert (out == 7.0).all()


def test_the_pool_drop_in_counts_more_accepted_tokens_than_a_sequence_has():
    """FLA's pool form on the GPU (no sync): a sequence whose accepted count passes its own tokens is a padding
    row (zero output, its slots unwritten) counted as ``accepted``; the other sequence decodes as alone."""
    from fastkda.compat import fla

    inp = make_inputs([3, 1], heads=2, key_dim=64, device="cuda", seed=66, with_initial=False)
    pool = torch.randn(8, 2, 64, 64, device="cuda")
    slots = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device="cuda")
    gate = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                lower_bound=inp["lower_bound"], A_log=inp["A_log"], dt_bias=inp["dt_bias"].reshape(-1))
    tensors = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    alone = pool.clone()
    want, _ = fla.fused_recurrent_kda_fwd(*(x[:, :3] for x in tensors), **gate, initial_state=alone,
                                          state_v_first=True, cu_seqlens=inp["cu_seqlens"][:2],
                                          ssm_state_indices=slots[:1],
                                          num_accepted_tokens=torch.tensor([3], device="cuda"))
    fastkda.reset_error_counts()
    states = pool.clone()
    o, _ = fla.fused_recurrent_kda_fwd(*tensors, **gate, initial_state=states, state_v_first=True,
                                       cu_seqlens=inp["cu_seqlens"], ssm_state_indices=slots,
                                       num_accepted_tokens=torch.tensor([3, 2], device="cuda"))
    assert fastkda.error_counts()["accepted"] == 1
    assert bool((o[0, 3] == 0).all()) and torch.equal(o[:, :3], want)
    assert torch.equal(states[3:6], pool[3:6]) and torch.equal(states[:3], alone[:3])

"""``python -m fastkda``: the demo on the CPU path and the plan command."""

import subprocess
import sys

import pytest
import torch

from fastkda.plan import CHUNK
from fastkda.validation import validate_prefill


def fastkda(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "fastkda", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_and_checks_on_cpu():
    done = fastkda("demo", "--cpu", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout and "CPU" in done.stdout


def test_plan_command_prints_the_whole_plan():
    done = fastkda("plan", "--heads", "12", "--seqs", "1", "--tokens", "8192", "--sms", "132",
                   "--sequence-parallel", "off")
    assert done.returncode == 0, done.stderr
    for words in ("v_slices=2", "V cut into 2 slice(s) of 64 columns", "24 programs fit one per SM", "leave SMs idle",
                  "solve kernel on 1 warp,", "256 chunk(s)", "CPU path", "sequence parallelism: off"):
        assert words in done.stdout, words
    done = fastkda("plan", "--heads", "12", "--seqs", "1", "--tokens", "8192", "--sms", "132")
    for words in ("sequence parallelism: segments of", "predicted", "transitions over V+K=256 columns",
                  "programs per segment"):
        assert words in done.stdout, words
    for wrong in ("48", "foo", "none"):  # in the command line's words ("off"), not the API's (False)
        done = fastkda("plan", "--heads", "12", "--seqs", "1", "--tokens", "8192", "--sms", "132",
                       "--sequence-parallel", wrong)
        assert done.returncode == 2 and "argument --sequence-parallel: expected auto, off" in done.stderr, wrong


def test_plan_command_refuses_a_length_hint_for_fixed_rows():
    done = fastkda("plan", "--heads", "12", "--seqs", "2", "--tokens", "64", "--sms", "132", "--layout", "fixed",
                   "--max-seqlen", "64")
    assert done.returncode == 2 and "--max-seqlen applies to --layout varlen" in done.stderr and not done.stdout


def test_plan_command_stops_quietly_when_its_reader_does():
    """``python -m fastkda plan ... | head -1``: no traceback when the pipe closes before the plan is printed (a
    reader that reads nothing and exits at once, so that the pipe is closed by then)."""
    done = subprocess.run(f"{sys.executable} -m fastkda plan --heads 12 --seqs 1 --tokens 8192 --sms 132 | true",
                          shell=True, capture_output=True, text=True, timeout=60)
    assert done.stderr == "", done.stderr


@pytest.mark.parametrize("args, word", [
    (["--v-slices", "3"], "--v-slices: expected auto, 1, 2 or 4"), (["--heads", "0"], "--heads"),
    (["--seqs", "0"], "--seqs"), (["--tokens", "0"], "--tokens"), (["--value-dim", "96"], "value-dim"),
    (["--sms", "0"], "sms must be")])
def test_plan_command_rejects_what_the_api_rejects(args, word):
    options = {"--heads": "12", "--seqs": "1", "--tokens": "8", "--sms": "132", args[0]: args[1]}
    done = fastkda("plan", *[x for pair in options.items() for x in pair])
    assert done.returncode == 2 and word in done.stderr, done.stderr


def test_plan_command_explains_an_open_entry_plan():
    done = fastkda("plan", "--heads", "12", "--seqs", "1", "--tokens", "262144", "--sms", "132", "--entry-later")
    assert done.returncode == 0, done.stderr
    for words in ("entry state later: segments of", "sequence parallelism: segments of", "1 sequence(s) of 262144"):
        assert words in done.stdout, words
    done = fastkda("plan", "--heads", "12", "--seqs", "1", "--tokens", "64", "--sms", "132", "--entry-later",
                   "--sequence-parallel", "off")
    assert done.returncode == 2 and "sequence_parallel" in done.stderr


def test_plan_command_takes_the_gpus_warpgroup_mma():
    """``--warpgroup-mma`` (an sm_90 GPU): the Gluon recurrence where the plan takes it; ``--no-warpgroup-mma``,
    and the default on a machine without a CUDA GPU, keep the Triton kernels."""
    shape = ("plan", "--heads", "12", "--seqs", "4", "--tokens", "1024", "--sms", "132")
    hopper, other = fastkda(*shape, "--warpgroup-mma"), fastkda(*shape, "--no-warpgroup-mma")
    assert hopper.returncode == 0 and other.returncode == 0, hopper.stderr + other.stderr
    assert "the Gluon kernel, a warpgroup per 64 columns" in hopper.stdout and "Gluon" not in other.stdout
    if not torch.cuda.is_available():
        default = fastkda(*shape)
        assert default.returncode == 0 and "Gluon" not in default.stdout, default.stderr


@pytest.mark.parametrize("option", [["--v-slices", "2"], ["--max-seqlen", "-5"]])
def test_plan_command_refuses_what_an_open_entry_plan_does_not_take(option):
    done = fastkda("plan", "--heads", "12", "--seqs", "1", "--tokens", "8192", "--sms", "132", "--entry-later",
                   *option)
    assert done.returncode == 2 and f"{option[0]} does not apply with --entry-later" in done.stderr, done.stderr


@pytest.mark.parametrize("heads, seqs, tokens, layout", [
    (64, 1, 2 ** 23, "varlen"), (100000, 100000, 100000, "varlen"), (64, 2, 2 ** 22, "fixed"),
    (64, 2, 2 ** 22, "entry-later")])
def test_plan_command_refuses_shapes_past_the_kernels_32_bit_offsets(heads, seqs, tokens, layout):
    """A shape whose index ranges the API refuses (validate_prefill, which kda_prefill_open runs too) is refused
    by the plan command in the same words, with no plan printed."""
    batch, length = (1, seqs * tokens) if layout == "varlen" else (seqs, tokens)
    cu_seqlens = torch.arange(seqs + 1) * tokens if layout == "varlen" else None

    def shaped(*shape):  # no memory: validation reads shapes only
        return torch.zeros(1).expand(*shape)
    with pytest.raises(ValueError, match="32-bit offsets") as api:
        validate_prefill(*(shaped(batch, length, heads, 128) for _ in range(4)), shaped(batch, length, heads), None,
                         None, None, 0.1, None, None, cu_seqlens, None, None, None, CHUNK)
    done = fastkda("plan", "--heads", str(heads), "--seqs", str(seqs), "--tokens", str(tokens), "--sms", "132",
                   *(["--entry-later"] if layout == "entry-later" else ["--layout", layout]))
    assert done.returncode == 2 and done.stderr == f"error: {api.value}\n" and not done.stdout, done.stdout


def test_the_cpu_path_needs_no_triton():
    """A CPU-only torch comes without triton (the README's CPU install): the package, its CPU paths, the layer and
    the plan command import and run with triton unimportable."""
    script = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
import fastkda
from fastkda.cache import KDACache
from fastkda.layers import KimiDeltaAttention
from fastkda.compat import fla, flash_kda
import fastkda.__main__
layer = KimiDeltaAttention(64, 2, 64, lower_bound=-5.0)
cache = KDACache(2, 1, 2, 64, layer.conv_channels, layer.conv_kernel)
slots = cache.allocate(2)
with torch.no_grad():
    layer(torch.randn(2, 40, 64), cache, slots=slots)
    print(layer(torch.randn(2, 1, 64), cache, slots=slots, decode=True).shape)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "torch.Size([2, 1, 64])" in done.stdout, done.stderr

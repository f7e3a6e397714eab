"""The tools that need a GPU parse their command lines here (their first real run costs device time)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # decode_floor defines Triton kernels of its own
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tools package

from tools.profiling import decode_floor, host_overhead, kernel_times, ncu_prepare, overlap_probe  # noqa: E402
from tools.sweeps import (checkpoint_cost, conv_update_sweep, decode_sweep, exactness_matrix, plan_sweep,  # noqa: E402
                          segment_sweep)
from tools.variants import decode_variants, prepare_variants  # noqa: E402

TOOLS = [decode_floor, host_overhead, kernel_times, ncu_prepare, overlap_probe, checkpoint_cost, conv_update_sweep,
         decode_sweep, exactness_matrix, plan_sweep, segment_sweep, decode_variants, prepare_variants]


@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: tool.__name__.rsplit(".", 1)[-1])
def test_help(tool, capsys):
    with pytest.raises(SystemExit) as done:
        tool.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("tool", [kernel_times, plan_sweep], ids=["kernel_times", "plan_sweep"])
def test_set_rejects_what_is_not_a_launch_number(tool, capsys):
    with pytest.raises(SystemExit):
        tool.main(["--set", "prepare_wraps=8"])
    assert "no launch number 'prepare_wraps'" in capsys.readouterr().err


def test_kernel_times_shapes_are_one_varlen_sequence():
    assert kernel_times.shape_workload("12:288") == {"name": "H12_N1_T288", "H": 12, "lengths": [288],
                                                    "layout": "varlen"}


def test_overlap_probe_stages_resolve_on_the_cpu():
    """The probe's halves import the prefill's stage functions only when built: build them here, so that a renamed
    stage function fails on the CPU and not in a device call."""
    from fastkda.bench.work import plan_for_inputs
    from fastkda.bench.workloads import make_prefill_inputs

    inp = make_prefill_inputs({"name": "tiny", "H": 2, "lengths": [64], "layout": "varlen"}, "cpu")
    assert all(callable(half) for half in overlap_probe.stages(inp, plan_for_inputs(inp)))

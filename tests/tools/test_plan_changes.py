"""``--set``: plan changes that name launch numbers, rejected when they name anything else."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tools package

from fastkda.plan import DecodePlan, choose_decode_plan, choose_plan  # noqa: E402
from tools.plan_changes import add_set_argument, changeable_fields, combined, describe, parse_changes  # noqa: E402


def test_changes_take_the_types_of_the_plans_fields():
    assert parse_changes("prepare_warps=8, solve_stages=2") == dict(prepare_warps=8, solve_stages=2)
    assert parse_changes("state_rows_v=0,dot_precision=ieee") == dict(state_rows_v=False, dot_precision="ieee")
    assert parse_changes("state_rows_v=true") == dict(state_rows_v=True)
    assert parse_changes("warps=4,v_slices=2", DecodePlan) == dict(warps=4, v_slices=2)
    assert parse_changes("") == {}
    assert combined([dict(prepare_warps=8), dict(prepare_warps=2, solve_warps=1)]) == dict(prepare_warps=2,
                                                                                          solve_warps=1)
    assert describe(dict(prepare_warps=8, solve_stages=2)) == "prepare_warps=8,solve_stages=2"


@pytest.mark.parametrize("text, message", [
    ("prepare_wraps=8", "no launch number 'prepare_wraps'"),  # misspelt: it would time the unchanged kernels
    ("PREPARE_WARPS=8", "no launch number 'PREPARE_WARPS'"),  # the former module knob
    ("heads=4", "no launch number 'heads'"),  # a fact the plan is made for, not a launch number
    ("reason=x", "no launch number 'reason'"),
    ("prepare_warps", "not NAME=VALUE"),
    ("prepare_warps=eight", "takes an integer"),
    ("state_rows_v=maybe", "takes 0/1"),
])
def test_anything_but_a_launch_number_is_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        parse_changes(text)


def test_the_set_argument_is_a_usage_error_for_unknown_names(capsys):
    parser = argparse.ArgumentParser()
    add_set_argument(parser)
    assert parser.parse_args(["--set", "prepare_warps=8", "solve_stages=2"]).set == [dict(prepare_warps=8),
                                                                                   dict(solve_stages=2)]
    with pytest.raises(SystemExit):
        parser.parse_args(["--set", "prepare_wraps=8"])
    assert "no launch number 'prepare_wraps'" in capsys.readouterr().err


def test_changes_apply_to_a_plan_which_checks_the_values():
    plan = choose_plan(1, 12, 8192, 128, 128, 132)
    changed = plan.replace(**parse_changes("prepare_warps=8,solve_stages=2"))
    assert (changed.prepare_warps, changed.solve_stages) == (8, 2) and "overridden" in changed.reason
    with pytest.raises(ValueError, match="prepare_warps"):
        plan.replace(**parse_changes("prepare_warps=3"))
    assert set(changeable_fields()) >= {"v_slices", "prepare_warps", "recurrence_stages", "state_rows_v"}
    decode = choose_decode_plan(4, 12, 128, 132)
    assert decode.replace(**parse_changes("warps=8", DecodePlan)).warps == 8

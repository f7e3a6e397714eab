"""The bench's command line: its flags, and an installed package's view of it from any directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastkda.bench import main
from fastkda.bench.cli import build_parser
from fastkda.bench.runners import DEFAULT_IMPLS, IMPLS

ROOT = Path(__file__).resolve().parents[2]


def test_flags_and_defaults():
    args = build_parser().parse_args([])
    assert args.out == "fastkda-results" and args.workloads is None  # the current directory, the shipped file
    assert args.impls == list(DEFAULT_IMPLS) and "fla_cp" not in args.impls
    assert build_parser().parse_args(["--out-dir", "x"]).out == "x"  # the former name still works
    args = build_parser().parse_args(["--only", "a", "b", "--group", "g", "--quick", "--impls", "fastkda", "fla_cp",
                                      "--append", "--no-decode", "--no-kernels", "--workloads", "w.json"])
    assert (args.only, args.group, args.quick, args.impls, args.append, args.no_decode, args.no_kernels,
            args.workloads) == (["a", "b"], "g", True, ["fastkda", "fla_cp"], True, True, True, "w.json")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--impls", "nonsense"])


def test_fla_cp_is_an_eager_row_on_long_sequences_when_asked_for():
    cp = IMPLS["fla_cp"]
    assert cp.modes == ("eager",) and not cp.by_default and not cp.accuracy
    assert cp.runs_on(dict(group="long_sequence")) and not cp.runs_on(dict(group="low_parallelism"))
    assert IMPLS["fla"].runs_on(dict(group="low_parallelism")) and IMPLS["fla"].modes == ("eager", "graph")


def test_help_and_no_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "--out" in capsys.readouterr().out
    if not __import__("torch").cuda.is_available():
        assert main(["--only", "H12_N1_T1024"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_module_runs_from_another_directory(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "fastkda.bench", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fastkda-bench" in done.stdout and "--out DIR, --out-dir DIR" in done.stdout
    assert not list(tmp_path.iterdir())  # --help writes nothing

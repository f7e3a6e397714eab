"""The bench's command line: its flags, and an installed package's view of it from any directory."""

import datetime
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

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


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as the command line can see, on which measuring fails: an argument the bench refuses
    must end the run (exit 2) before its first measurement."""
    from fastkda.bench import cli

    def measured():
        raise AssertionError("measured before the arguments were refused")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: types.SimpleNamespace(name="Fake GPU", multi_processor_count=132))
    monkeypatch.setattr(cli, "copy_bandwidth_gbps", measured)


def refused(argparse_error, argv, words):
    """``main(argv)`` ends with argparse's ``error:`` line matching ``words`` and exit status 2."""
    err = argparse_error(main, argv)
    assert re.search(f"fastkda-bench: error: .*{words}", err), err


@pytest.mark.parametrize("args, words", [
    (["--only", "H12_N1_T1024", "nonsense"], "unknown workload.*nonsense"), (["--group", "nonsense"], "unknown group"),
    (["--group", "long_sequence", "--quick", "--no-decode"], "no workload chosen"),
    (["--only", "decode_H12_N1", "--no-decode"], "no workload chosen")])
def test_unknown_workload_or_group_is_refused_before_anything_is_measured(fake_gpu, tmp_path, argparse_error, args,
                                                                          words):
    refused(argparse_error, args + ["--out", str(tmp_path / "out")], words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, words", [
    (None, "cannot read workloads file"), ("{not json", "cannot read workloads file"),
    ('{"prefill": []}', "no \"decode\" list"),
    ('{"prefill": [{"name": "x", "H": 4, "lengths": [64], "layout": "varlen"}], "decode": []}',
     r"prefill entry 0 \(x\): missing group")])
def test_a_bad_workloads_file_is_refused_before_anything_is_measured(fake_gpu, tmp_path, argparse_error, content,
                                                                     words):
    path = tmp_path / "w.json"
    if content is not None:
        path.write_text(content)
    refused(argparse_error, ["--workloads", str(path), "--out", str(tmp_path / "out")], words)
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_made_is_refused_before_anything_is_measured(fake_gpu, tmp_path, argparse_error):
    (tmp_path / "afile").write_text("")
    refused(argparse_error, ["--only", "H12_N1_T1024", "--out", str(tmp_path / "afile" / "out")],
            "--out .*cannot make")


def test_append_to_a_corrupt_results_file_is_refused_before_anything_is_measured(fake_gpu, tmp_path, argparse_error):
    today = tmp_path / f"{datetime.date.today().isoformat()}-Fake_GPU.json"
    today.write_text("{not json")
    refused(argparse_error, ["--only", "H12_N1_T1024", "--append", "--out", str(tmp_path)],
            "--append: cannot read results")
    assert [p.name for p in tmp_path.iterdir()] == [today.name] and today.read_text() == "{not json"

"""fastkda.bench.parallel on the CPU at a tiny size: one and two gloo processes, both workloads, its files."""

import json
import re

import pytest

from fastkda.bench import parallel


def test_parallel_bench_runs_and_writes_its_rows(tmp_path):
    assert parallel.main(["--world", "2", "--tokens", "256", "--heads", "4", "--dim", "64", "--hidden", "64",
                          "--scale", "0.01", "--repeats", "1", "--out", str(tmp_path)]) == 0
    [results] = tmp_path.glob("*-parallel.json")
    rows = json.loads(results.read_text())["rows"]
    assert sorted((r["workload"], r["world"]) for r in rows) == [("context", 1), ("context", 2), ("tensor", 1),
                                                                 ("tensor", 2)]
    assert all(r["ms"] > 0 and r["tokens_per_s_per_rank"] > 0 for r in rows)
    assert [r["scaling"] for r in rows if r["world"] == 1] == [1.0, 1.0]
    assert (tmp_path / results.name.replace(".json", ".md")).read_text().count("| context |") == 2


def test_one_device_rows_scale_against_the_whole_prefill(tmp_path):
    """``--one-device``: the whole sequence's prefill, then one rank's work per world, scaling against the first."""
    assert parallel.main(["--one-device", "--worlds", "1", "2", "--tokens", "128", "--heads", "2", "--dim", "64",
                          "--repeats", "1", "--out", str(tmp_path)]) == 0
    [results] = tmp_path.glob("*-parallel-one-device.json")
    data = json.loads(results.read_text())
    assert data["meta"]["backend"] == "one device"
    rows = data["rows"]
    assert [(r["workload"], r["world"]) for r in rows] == [("prefill", 1), ("context rank", 1), ("context rank", 2)]
    assert rows[0]["scaling"] == 1.0 and all(r["ms"] > 0 and r["scaling"] > 0 for r in rows)


@pytest.mark.parametrize("args, words", [
    (["--world", "0"], "--world: must be at least 1"), (["--repeats", "0"], "--repeats: must be at least 1"),
    (["--one-device", "--worlds", "1", "0"], "--worlds: must be at least 1"),
    (["--one-device", "--worlds"], "--worlds: expected at least one argument"),
    (["--world", "4", "--tokens", "2"], "--tokens 2 is fewer than the world size 4"),
    (["--one-device", "--worlds", "1", "8", "--tokens", "4"], "--tokens 4 is fewer than the world size 8"),
    (["--tokens", "0"], "--tokens: must be at least 1"), (["--dim", "32"], r"--dim: must be one of \(64, 128\)"),
    (["--heads", "0"], "--heads: must be at least 1"), (["--hidden", "-1"], "--hidden: must be at least 1"),
    (["--scale", "nan"], "--scale: must be a finite number above 0"),
    (["--workloads"], "--workloads: expected at least one argument"),
    (["--one-device", "--workloads", "tensor"], "--workloads does not apply to --one-device")])
def test_bad_arguments_are_refused_before_anything_is_measured(tmp_path, argparse_error, args, words):
    err = argparse_error(parallel.main, ["--out", str(tmp_path / "out")] + args)
    assert re.search(f"error: {words}|error: argument {words}", err), err
    assert not (tmp_path / "out").exists()

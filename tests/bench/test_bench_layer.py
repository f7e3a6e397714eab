"""fastkda.bench.layer on the CPU, at a tiny scale: it runs, writes its files, and fastkda's decode outputs equal
transformers' layer's (fp32) on the same weights after the same prefill."""

import json
import re

import pytest

pytest.importorskip("transformers")

from fastkda.bench import layer as layer_bench  # noqa: E402


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_layer_bench_runs_and_agrees(tmp_path, gate):
    layer_bench.main(["--device", "cpu", "--scale", "0.01", "--steps", "2", "--hidden", "64", "--repeats", "1",
                      "--gate", gate, "--out", str(tmp_path)])
    [results] = tmp_path.glob("*-layer.json")
    rows = json.loads(results.read_text())["rows"]
    assert [r["path"] for r in rows] == ["fastkda", "fastkda fused step", "transformers+pytorch"]
    assert rows[1]["decode_rel_err"] < 1e-6 and rows[2]["decode_rel_err"] < 1e-5
    assert all(r["prefill_ms"] > 0 and r["decode_step_ms"] > 0 for r in rows)
    assert (tmp_path / results.name.replace(".json", ".md")).exists()


@pytest.mark.parametrize("args, words", [
    (["--workload", "decode_H12_N1"], "--workload: invalid choice"), (["--workload", "nonsense"], "invalid choice"),
    (["--steps", "0"], "--steps: must be at least 1"), (["--repeats", "0"], "--repeats: must be at least 1"),
    (["--repeats", "-2"], "--repeats: must be at least 1"), (["--hidden", "0"], "--hidden: must be at least 1"),
    (["--scale", "-1"], "--scale: must be a finite number above 0"),
    (["--scale", "nan"], "--scale: must be a finite number above 0")])
def test_bad_arguments_are_refused_before_anything_is_measured(tmp_path, argparse_error, args, words):
    err = argparse_error(layer_bench.main, ["--device", "cpu", "--out", str(tmp_path / "out")] + args)
    assert re.search(f"error: .*{words}", err), err
    assert not (tmp_path / "out").exists()

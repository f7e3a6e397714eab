"""fastkda.bench.models on the CPU, one tiny case: every path runs, and the files are written with each row's
commit."""

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from fastkda.bench import models  # noqa: E402


def test_models_bench_runs(tmp_path):
    models.main(["--device", "cpu", "--cases", "1x8", "--repeats", "1", "--out", str(tmp_path)])
    [results] = tmp_path.glob("*-models.json")
    rows = json.loads(results.read_text())["rows"]
    assert {(r["model"], r["path"]) for r in rows} == {(m, p) for m in models.MODEL_KINDS for p in ("pytorch",
                                                                                                  "fastkda")}
    assert all(r["forward_ms"] > 0 and r["per_token_ms"] > 0 and r["commit"] for r in rows)
    by_path = {(r["model"], r["path"]): r for r in rows}
    for (model, path), row in by_path.items():  # one round: the paired difference is the difference of the times
        fastkda = by_path[(model, "fastkda")]
        assert row["per_token_beyond_fastkda_ms"] == pytest.approx(row["per_token_ms"] - fastkda["per_token_ms"])
        assert row["forward_beyond_fastkda_ms"] == pytest.approx(row["forward_ms"] - fastkda["forward_ms"])
    assert "| kimi_linear | 1 | 8 |" in (tmp_path / results.name.replace(".json", ".md")).read_text()


@pytest.mark.parametrize("args, words", [
    (["--cases", "0x8"], "--cases: B and T must be at least 1"), (["--cases", "1x"], "--cases: expected BxT"),
    (["--cases", "2"], "--cases: expected BxT"), (["--cases"], "--cases: expected at least one argument"),
    (["--repeats", "0"], "--repeats: must be at least 1"), (["--device", "nonsense"], "--device nonsense"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--repeats", "x"], "--device cuda|--repeats")])
def test_bad_arguments_are_refused_before_anything_is_measured(tmp_path, argparse_error, args, words):
    err = argparse_error(models.main, ["--device", "cpu", "--out", str(tmp_path / "out")] + args)
    assert re.search(f"error: .*({words})", err), err
    assert not (tmp_path / "out").exists()


def test_profile_writes_each_path_s_operators_and_functions(tmp_path):
    models.main(["--device", "cpu", "--cases", "1x8", "--repeats", "1", "--out", str(tmp_path), "--profile"])
    [profile] = tmp_path.glob("*-models-profile.txt")
    text = profile.read_text()
    for kind in models.MODEL_KINDS:
        for path in ("pytorch", "fastkda"):
            assert f"## {kind} {path} B1 T8: {models.PROFILED_TOKENS} generated tokens" in text
    assert "fastkda/integrations/transformers.py" in text  # cProfile saw fastkda's functions
    assert "aten::" in text  # the profiler's operators


def test_append_keeps_the_cases_this_run_does_not_measure_and_replaces_the_ones_it_does(tmp_path):
    models.main(["--device", "cpu", "--cases", "1x8", "1x4", "--repeats", "1", "--out", str(tmp_path)])
    [results] = tmp_path.glob("*-models.json")
    first = json.loads(results.read_text())["rows"]
    models.main(["--device", "cpu", "--cases", "1x4", "--repeats", "2", "--out", str(tmp_path), "--append"])
    rows = json.loads(results.read_text())["rows"]
    assert sorted(map(json.dumps, (r for r in rows if r["length"] == 8))) == sorted(
        map(json.dumps, (r for r in first if r["length"] == 8)))  # the case not measured again: as it was
    again = [r for r in rows if r["length"] == 4]
    assert len(again) == len(first) // 2 and all(r["repeats"] == 2 for r in again)  # every path of the case, new
    table = (tmp_path / results.name.replace(".json", ".md")).read_text()
    assert "| kimi_linear | 1 | 8 |" in table and "| kimi_linear | 1 | 4 |" in table
    models.main(["--device", "cpu", "--cases", "1x4", "--repeats", "1", "--out", str(tmp_path)])  # no --append
    assert {r["length"] for r in json.loads(results.read_text())["rows"]} == {4}


def test_append_refuses_a_file_that_is_not_a_models_file_before_measuring(tmp_path, argparse_error):
    name = f"{models.date.today().isoformat()}-{models.device_name(torch.device('cpu')).replace(' ', '_')}-models.json"
    (tmp_path / name).write_text('{"rows": [{"model": "kimi_linear"}]}')
    err = argparse_error(models.main, ["--device", "cpu", "--cases", "1x4", "--out", str(tmp_path), "--append"])
    assert "--append:" in err and "not a models results file" in err
    assert (tmp_path / name).read_text() == '{"rows": [{"model": "kimi_linear"}]}'

"""The results files: tables, merges across runs, and the run each row came from, on the CPU."""

import datetime
import importlib.util
import json
import re
import types

import pytest
import torch

from fastkda.bench import main
from fastkda.bench.report import (decode_table, earlier_results, git_commit, kernel_table, markdown_table,
                                  render_results, run_id, run_numbers, tool_results_file, write_results,
                                  write_tool_results)

META = dict(gpu="G", sms=1, torch="t", triton="3.6.0", commit="new", commits=["new"], date="d", peers={})


def row(workload, ms, commit, impl="fastkda", run=None, mode="graph"):
    found = dict(workload=workload, group="g", impl=impl, mode=mode, ms=ms, commit=commit)
    if run:
        found["run"] = run
    return found


def test_table_of_one_run_has_no_run_column():
    rows = [row("w", 0.5, "c", run="r1"), row("w", 1.0, "c", impl="fla", run="r1")]
    table = markdown_table(rows, ["fastkda", "fla"], "graph")
    assert "| w | 0.500 | 1.000 | 2.00× | c |" in table and "run" not in table


def test_rows_of_several_runs_name_their_run():
    rows = [row("w", 1.0, "old", impl="fla", run="run A"), row("w", 0.5, "new", run="run B")]
    runs = run_numbers(rows)
    assert runs == {"run A": 1, "run B": 2}
    table = markdown_table(rows, ["fastkda", "fla"], "graph", runs)
    assert table.splitlines()[0].endswith("| commit | run |")
    assert "| w | 0.500 | 1.000 [1] | 2.00× | new | 2 |" in table  # the peer's row came from the earlier run
    # rows written before runs were recorded are told apart by their commit
    legacy = [row("w", 1.0, "old", impl="fla"), row("w", 0.5, "new")]
    assert "| w | 0.500 | 1.000 [1] | 2.00× | new | 2 |" in markdown_table(legacy, ["fastkda", "fla"], "graph")


def test_run_id_names_the_start_and_the_host():
    import datetime
    import socket

    start = datetime.datetime(2026, 12, 1, 9, 30, 5, tzinfo=datetime.timezone.utc)
    assert run_id(start) == f"2026-12-01T09:30:05Z {socket.gethostname()}"


def test_commit_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("FASTKDA_COMMIT", "abc1234")
    assert git_commit() == "abc1234"


def test_decode_table():
    rows = [dict(workload="w", group="decode", impl="fastkda", mode="graph", ms=0.01, gbps=9.0)]
    assert "| w | 10.0 | 9.0 | — | — | — | — | — | — | — | — | — | — |" in decode_table(rows)
    rows += [dict(workload="w", group="decode", impl="fla", mode="graph", ms=0.02, gbps=4.5, run="other"),
             dict(workload="w", group="decode", impl="floor", mode="graph", ms=0.008, gbps=11.0),
             dict(workload="w", group="decode", impl="fastkda_step", mode="graph", ms=0.012, gbps=7.5)]
    table = decode_table(rows)
    assert "| w | 10.0 | 9.0 | — | 8.0 | 1.25× | 12.0 | 1.20× | — | — | 20.0 [2] | 4.5 | 2.00× | 1 |" in table


def test_merge_keeps_earlier_rows_and_replaces_remeasured_ones(tmp_path):
    earlier, later = tmp_path / "earlier.json", tmp_path / "later.json"
    earlier.write_text(json.dumps(dict(meta=dict(META, commit="old"), rows=[
        row("a", 1.0, "old", run="r-old"), row("b", 2.0, "old", run="r-old"),
        row("b", 5.0, "old", impl="fla", run="r-old")])))
    later.write_text(json.dumps(dict(meta=META, rows=[row("b", 3.0, "new", run="r-new")])))  # fastkda alone
    assert main(["--merge", str(earlier), str(later)]) == 0
    merged = json.loads(later.read_text())
    assert [(r["workload"], r["impl"], r["ms"], r["commit"], r["run"]) for r in merged["rows"]] == [
        ("a", "fastkda", 1.0, "old", "r-old"), ("b", "fla", 5.0, "old", "r-old"), ("b", "fastkda", 3.0, "new", "r-new")]
    assert merged["meta"]["commits"] == ["new", "old"] and merged["meta"]["runs"] == ["r-old", "r-new"]
    md = (tmp_path / "later.md").read_text()
    assert "| a | 1.000 | — | — | old | 1 |" in md and "| b | 3.000 | 5.000 [1] | 1.67× | new | 2 |" in md
    assert "- [1] r-old, commit old" in md and "- [2] r-new, commit new" in md


def test_kernel_table_and_merge_of_kernel_rows(tmp_path):
    meta = dict(META, copy_gbps=4000.0, matmul_tflops=600.0)

    def kernel(name, ms, commit, run, workload="w"):
        return dict(workload=workload, kernel=name, v_slices=2, ms=ms, gbps=1.0, pct_copy=10.0, tflops=2.0,
                    pct_matmul=20.0, commit=commit, run=run)
    rows = [row("w", 0.9, "new", run="r2"), row("x", 0.7, "old", run="r1")]
    earlier, later = tmp_path / "earlier.json", tmp_path / "later.json"
    earlier.write_text(json.dumps(dict(meta=meta, rows=rows, kernels=[
        kernel("prepare", 0.5, "old", "r1"), kernel("transition", 0.1, "old", "r1"),
        kernel("prepare", 0.6, "old", "r1", workload="x")])))
    later.write_text(json.dumps(dict(meta=meta, rows=rows, kernels=[kernel("prepare", 0.4, "new", "r2"),
                                                                    kernel("recurrence", 0.3, "new", "r2")])))
    assert main(["--merge", str(earlier), str(later)]) == 0
    merged = json.loads(later.read_text())["kernels"]
    # a workload's later breakdown replaces all of its earlier one: another plan may run other kernels (here no
    # transition), and a cell left from the earlier run would add to a sum that no call ran
    assert [(k["workload"], k["kernel"], k["ms"]) for k in merged] == [
        ("x", "prepare", 0.6), ("w", "prepare", 0.4), ("w", "recurrence", 0.3)]
    md = (tmp_path / "later.md").read_text()
    assert "where fastkda's time goes" in md and "4000.0 GB/s, 600.0 TFLOP/s" in md
    # runs are numbered in order of first appearance (the timing rows first); the graph time is the one measured in
    # the run of the line's first kernel
    assert "| w | 2 | 0.400 (10%, 20%) | — | — | — | 0.300 (10%, 20%) | 0.700 | 0.900 | new | 1 |" in md
    assert "| x | 2 | 0.600 (10%, 20%) | — | — | — | — | 0.600 | 0.700 | old | 2 |" in md
    assert "- [1] r2, commit new" in md and "- [2] r1, commit old" in md
    one_run = [kernel(k, 0.2, "new", "r2") for k in ("prepare", "solve", "recurrence")]
    expected = "| w | 2 | 0.200 (10%, 20%) | 0.200 (10%, 20%) | — | — | 0.200 (10%, 20%) | 0.600 | 0.900 | new |"
    assert expected in kernel_table(one_run, rows)


def test_merge_keeps_the_newer_run_of_each_row_whichever_file_holds_it(tmp_path):
    """Two copies of one results file that two calls appended to, merged in either order: each (workload,
    implementation, mode) keeps the rows of its newest run, a workload's breakdown too; a row that only one file
    has is kept."""
    first, second, third = (f"2026-12-06T{t}Z host" for t in ("10:00:00", "10:10:00", "10:20:00"))

    def kernel(ms, run, workload="w3"):
        return dict(workload=workload, kernel="prepare", v_slices=1, ms=ms, gbps=1.0, pct_copy=10.0, tflops=2.0,
                    pct_matmul=20.0, commit="c", run=run)
    one = dict(meta=META, rows=[row("w1", 1.0, "c", run=first), row("w2", 2.0, "c", run=first),
                                row("w3", 3.0, "c", run=third)], kernels=[kernel(0.3, third)])
    two = dict(meta=META, rows=[row("w1", 1.5, "c", run=second), row("w3", 3.5, "c", run=second)],
               kernels=[kernel(0.35, second), kernel(0.1, second, workload="w1")])
    for earlier, later in ((one, two), (two, one)):
        paths = tmp_path / "earlier.json", tmp_path / "later.json"
        for path, found in zip(paths, (earlier, later)):
            path.write_text(json.dumps(found))
        assert main(["--merge", *map(str, paths)]) == 0
        merged = json.loads(paths[1].read_text())
        assert sorted((r["workload"], r["ms"]) for r in merged["rows"]) == [("w1", 1.5), ("w2", 2.0), ("w3", 3.0)]
        assert sorted((k["workload"], k["ms"]) for k in merged["kernels"]) == [("w1", 0.1), ("w3", 0.3)]


@pytest.mark.parametrize("content, words", [
    (None, "cannot read results file .*: No such file or directory"),
    ("{not json", "cannot read results file .*: Expecting property name"),
    ("[1]", "is not a results file"), ('{"rows": []}', "is not a results file")])
def test_merge_refuses_a_missing_or_malformed_file_as_an_argument_error(tmp_path, argparse_error, content, words):
    """``--merge`` of a file that is missing, not JSON or not a results file: argparse's ``error:`` line and
    exit status 2 (no traceback), naming the file, before anything is written."""
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    files = {"good.json": json.dumps(dict(meta=META, rows=[row("w", 1.0, "c")]))}
    if content is not None:
        files["bad.json"] = content
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for paths in ((bad, good), (good, bad)):
        err = argparse_error(main, ["--merge", *map(str, paths)])
        assert re.search(f"fastkda-bench: error: .*{words}", err) and str(bad) in err, err
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files  # no .md or .png, no file changed


def test_kernel_heading_keeps_the_rates_its_rows_were_measured_against(tmp_path):
    """An --append run without the breakdown (--no-kernels: no matrix-product rate in its meta) keeps the earlier
    kernel rows, and the heading still names the rates those rows carry."""
    meta = dict(META, copy_gbps=4100.0, matmul_tflops=None)
    kernels = [dict(workload="w", kernel="prepare", v_slices=1, ms=0.5, gbps=1.0, pct_copy=10.0, tflops=2.0,
                    pct_matmul=20.0, commit="old", copy_gbps=4000.0, matmul_tflops=600.0)]
    md = render_results(meta, [row("w", 0.9, "new")], str(tmp_path / "r"), kernels)
    assert "measured in the same run: 4000.0 GB/s, 600.0 TFLOP/s)" in md and "None TFLOP/s" not in md
    assert (tmp_path / "r.json").exists()
    assert (tmp_path / "r.png").exists() or importlib.util.find_spec("matplotlib") is None  # the plot is optional


def test_write_results_gives_each_row_its_run_and_commit(tmp_path, monkeypatch):
    import torch

    class Props:
        name, multi_processor_count = "Test GPU", 4
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props)
    monkeypatch.setenv("FASTKDA_COMMIT", "c0ffee0")
    earlier = dict(rows=[row("w", 2.0, "old", impl="fla", run="before")], kernels=[])
    md = write_results([dict(workload="w", group="g", impl="fastkda", mode="graph", ms=1.0)], tmp_path / "out", {},
                       "now", earlier=earlier)
    written = json.loads(next((tmp_path / "out").glob("*-Test_GPU.json")).read_text())
    assert [(r["impl"], r["commit"], r["run"]) for r in written["rows"]] == [("fla", "old", "before"),
                                                                             ("fastkda", "c0ffee0", "now")]
    assert written["meta"]["run"] == "now" and "| w | 1.000 | 2.000 [1] | 2.00× | c0ffee0 | 2 |" in md


def test_an_eager_only_peer_has_a_column_in_the_eager_table_only():
    rows = [row("w", 2.0, "c", run="r"), row("w", 2.0, "c", mode="eager", run="r"),
            row("w", 4.0, "c", impl="fla_cp", mode="eager", run="r")]
    assert "fla_cp" not in markdown_table(rows, ["fastkda", "fla_cp"], "graph")
    assert "| w | 2.000 | 4.000 | 2.00× | c |" in markdown_table(rows, ["fastkda", "fla_cp"], "eager")


def test_a_tool_results_file_is_named_by_date_and_gpu_and_carries_the_meta(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132))
    monkeypatch.setenv("FASTKDA_COMMIT", "abc1234")
    path, meta = tool_results_file(tmp_path / "made", "plan-sweep", changes="none")
    assert path == tmp_path / "made" / f"{datetime.date.today().isoformat()}-NVIDIA_H200-plan-sweep.json"
    assert path.parent.is_dir()
    assert meta == dict(gpu="NVIDIA H200", sms=132, commit="abc1234", date=datetime.date.today().isoformat(),
                        changes="none")
    write_tool_results(path, meta, [dict(ms=1.0)])
    assert json.loads(path.read_text()) == dict(meta=meta, rows=[dict(ms=1.0)])


@pytest.mark.parametrize("later, words", [
    (dict(meta={k: v for k, v in META.items() if k != "gpu"}, rows=[]), "meta lacks gpu"),
    (dict(meta={k: v for k, v in META.items() if k not in ("torch", "peers")}, rows=[]), "meta lacks torch, peers"),
    (dict(meta=META, rows=[{k: v for k, v in row("w", 1.0, "c").items() if k != "group"}]), "row 0 lacks group"),
    (dict(meta=META, rows=[dict(workload="w", ms=1.0)]), "row 0 lacks impl, mode, group"),
    (dict(meta=META, rows=[], kernels={}), "is not a results file")])
def test_merge_refuses_a_results_file_the_tables_cannot_be_built_from(tmp_path, argparse_error, later, words):
    """A file whose meta or rows lack what the markdown reads is refused as an argument error, nothing written."""
    files = {"earlier.json": json.dumps(dict(meta=META, rows=[row("w", 1.0, "c")])), "later.json": json.dumps(later)}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    err = argparse_error(main, ["--merge", str(tmp_path / "earlier.json"), str(tmp_path / "later.json")])
    assert re.search(f"fastkda-bench: error: .*later.json.*{words}", err), err
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files


def test_merge_refuses_a_later_file_not_named_json(tmp_path, argparse_error):
    text = json.dumps(dict(meta=META, rows=[row("w", 1.0, "c")]))
    for name in ("earlier.json", "later"):
        (tmp_path / name).write_text(text)
    assert "must end in .json" in argparse_error(main, ["--merge", str(tmp_path / "earlier.json"),
                                                         str(tmp_path / "later")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json", "later"]


def test_render_writes_nothing_when_the_markdown_cannot_be_built(tmp_path):
    with pytest.raises(KeyError):
        render_results(META, [row("w", 1.0, "c")], str(tmp_path / "r"), [dict(workload="w", kernel="prepare")])
    assert not list(tmp_path.iterdir())


def test_earlier_results_refuse_a_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: types.SimpleNamespace(name="Test GPU", multi_processor_count=4))
    assert earlier_results(tmp_path) == dict(rows=[], kernels=[])
    (tmp_path / f"{datetime.date.today().isoformat()}-Test_GPU.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="is not a results file"):
        earlier_results(tmp_path)

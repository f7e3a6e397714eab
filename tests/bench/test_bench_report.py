"""The command-line entry points and the benchmark's bookkeeping, on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastkda import bench

SHARED = Path(__file__).resolve().parents[2] / "shared" / "workloads.json"


@pytest.mark.skipif(not SHARED.exists(), reason="../shared is not beside this checkout")
def test_workloads_copy_matches_shared():
    assert json.loads(SHARED.read_text()) == bench.load_workloads()


def test_select_and_table():
    workloads = bench.load_workloads()
    low = bench.select(workloads, group="low_parallelism")
    assert low and all(w["group"] == "low_parallelism" for w in low)
    assert [w["name"] for w in bench.select(workloads, only=["H12_N1_T1024"])] == ["H12_N1_T1024"]
    rows = [dict(workload="w", impl="fastkda", mode="graph", ms=0.5), dict(workload="w", impl="fla", mode="graph", ms=1.0)]
    table = bench.markdown_table(rows, ["fastkda", "fla"], "graph")
    assert "| w | 0.500 | 1.000 | 2.00× |" in table
    rows = [dict(r, commit=c) for r, c in zip(rows, ("new", "old"))]  # the peer's row from an earlier run
    assert "| w | 0.500 | 1.000* | 2.00× | new |" in bench.markdown_table(rows, ["fastkda", "fla"], "graph")


def test_decode_workload_inputs_run_on_cpu():
    workload = dict(name="decode_test", H=2, N=3, tokens_per_seq=2)
    inp = bench.make_decode_inputs(workload, "cpu")
    assert inp["slots"].shape == (3, 2) and inp["accepted"].tolist() == [2, 2, 2]
    before = inp["pool"].clone()
    out = bench.fastkda_decode_runner(inp)()
    assert torch.isfinite(out).all() and not torch.equal(inp["pool"][:6], before[:6])
    assert torch.equal(inp["pool"][6], before[6])  # the spare slot is untouched
    table = bench.decode_table([dict(workload="w", group="decode", impl="fastkda", mode="graph", ms=0.01, gbps=9.0)])
    assert "| w | 10.0 | 9.0 | — | — | — |" in table


def test_merge_keeps_earlier_rows_and_replaces_remeasured_ones(tmp_path):
    meta = dict(gpu="G", sms=1, torch="t", triton="3.6.0", commit="new", commits=["new"], date="d", peers={})
    row = lambda workload, ms, commit, impl="fastkda": dict(workload=workload, group="g", impl=impl,  # noqa: E731
                                                            mode="graph", ms=ms, commit=commit)
    earlier, later = tmp_path / "earlier.json", tmp_path / "later.json"
    earlier.write_text(json.dumps(dict(meta=dict(meta, commit="old"), rows=[
        row("a", 1.0, "old"), row("b", 2.0, "old"), row("b", 5.0, "old", impl="fla")])))
    later.write_text(json.dumps(dict(meta=meta, rows=[row("b", 3.0, "new")])))  # a run of fastkda alone
    assert bench.main(["--merge", str(earlier), str(later)]) == 0
    merged = json.loads(later.read_text())
    assert [(r["workload"], r["impl"], r["ms"], r["commit"]) for r in merged["rows"]] == [
        ("a", "fastkda", 1.0, "old"), ("b", "fla", 5.0, "old"), ("b", "fastkda", 3.0, "new")]
    assert merged["meta"]["commits"] == ["new", "old"]
    md = (tmp_path / "later.md").read_text()
    assert "| a | 1.000 | — | — | old |" in md and "| b | 3.000 | 5.000* | 1.67× | new |" in md


def test_kernel_work_follows_the_kernels_shapes():
    from fastkda.plan import CHUNK

    one_chunk = dict(H=2, lengths=[CHUNK])
    work = bench.kernel_work(one_chunk, v_slices=1)
    assert set(work) == set(bench.KERNELS)
    # one token more is two chunks: the products double, the bytes grow by one token's share plus a chunk's decay
    two_chunks = bench.kernel_work(dict(H=2, lengths=[CHUNK + 1]), v_slices=1)
    assert all(two_chunks[k][1] == 2 * work[k][1] for k in bench.KERNELS)
    assert all(work[k][0] < two_chunks[k][0] < 2 * work[k][0] for k in ("prepare", "solve"))
    # V-slices re-read the K-side workspace, never add products; the other kernels do not see them
    split = bench.kernel_work(one_chunk, v_slices=4)
    assert split["recurrence"][1] == work["recurrence"][1] and split["recurrence"][0] > work["recurrence"][0]
    assert split["prepare"] == work["prepare"] and split["solve"] == work["solve"]
    # the recurrence moves each sequence's fp32 state in and out: 2 * N * H * V * K * 4 bytes on top of the tokens'
    more_seqs = bench.kernel_work(dict(H=2, lengths=[CHUNK // 2, CHUNK // 2]), v_slices=1)
    assert more_seqs["recurrence"][0] - work["recurrence"][0] == 2 * 2 * 128 * 128 * 4 + 2 * 4 * 128 * 1
    # from one (sequence, head) pair per two columns the recurrence forms w and u (plan.w_u_in_recurrence): per head,
    # the solve kernel moves less and multiplies nothing it counts, the recurrence loads and multiplies more
    formed_here = bench.kernel_work(dict(H=64, lengths=[CHUNK]), v_slices=1)
    solved = bench.kernel_work(dict(H=63, lengths=[CHUNK]), v_slices=1)
    assert formed_here["solve"][0] / 64 < solved["solve"][0] / 63 and formed_here["solve"][1] == 0 < solved["solve"][1]
    assert all(formed_here["recurrence"][i] / 64 > solved["recurrence"][i] / 63 for i in (0, 1))
    assert formed_here["prepare"][0] / 64 == solved["prepare"][0] / 63


def test_kernel_table_and_merge_of_kernel_rows(tmp_path):
    meta = dict(gpu="G", sms=1, torch="t", triton="3.6.0", commit="new", commits=["new"], date="d", peers={},
                copy_gbps=4000.0, matmul_tflops=600.0)
    kernel = lambda name, ms, commit: dict(workload="w", kernel=name, v_slices=2, ms=ms, gbps=1.0,  # noqa: E731
                                          pct_copy=10.0, tflops=2.0, pct_matmul=20.0, commit=commit)
    rows = [dict(workload="w", group="g", impl="fastkda", mode="graph", ms=0.9, commit="new")]
    earlier, later = tmp_path / "earlier.json", tmp_path / "later.json"
    earlier.write_text(json.dumps(dict(meta=meta, rows=rows, kernels=[kernel("prepare", 0.5, "old"),
                                                                      kernel("solve", 0.1, "old")])))
    later.write_text(json.dumps(dict(meta=meta, rows=rows, kernels=[kernel("prepare", 0.4, "new"),
                                                                    kernel("recurrence", 0.3, "new")])))
    assert bench.main(["--merge", str(earlier), str(later)]) == 0
    merged = json.loads(later.read_text())["kernels"]
    assert [(k["kernel"], k["ms"]) for k in merged] == [("solve", 0.1), ("prepare", 0.4), ("recurrence", 0.3)]
    md = (tmp_path / "later.md").read_text()
    assert "where fastkda's time goes" in md and "4000.0 GB/s, 600.0 TFLOP/s" in md
    assert "| w | 2 | 0.400 (10%, 20%) | 0.100 (10%, 20%) | 0.300 (10%, 20%) | 0.800 |" in md


def test_kernel_heading_keeps_the_rates_its_rows_were_measured_against(tmp_path):
    """An --append run without the breakdown (--no-kernels: no matrix-product rate in its meta) keeps the earlier
    kernel rows, and the heading still names the rates those rows carry."""
    meta = dict(gpu="G", sms=1, torch="t", triton="3.6.0", commit="new", commits=["new"], date="d", peers={},
                copy_gbps=4100.0, matmul_tflops=None)
    kernels = [dict(workload="w", kernel="prepare", v_slices=1, ms=0.5, gbps=1.0, pct_copy=10.0, tflops=2.0,
                    pct_matmul=20.0, commit="old", copy_gbps=4000.0, matmul_tflops=600.0)]
    rows = [dict(workload="w", group="g", impl="fastkda", mode="graph", ms=0.9, commit="new")]
    md = bench.render_results(meta, rows, str(tmp_path / "r"), kernels)
    assert "measured in the same run: 4000.0 GB/s, 600.0 TFLOP/s)" in md and "None TFLOP/s" not in md

"""tools/variants/ab_packages.py: a commit's package copied beside the working tree's, importable at once."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_a_commits_package_imports_beside_the_current_one(tmp_path, monkeypatch):
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs the git history of this checkout")
    from tools.variants import ab_packages

    target = ab_packages.make_package("HEAD", root=tmp_path)
    assert (target / "api.py").exists() and target.name == "fastkda_HEAD"
    assert '"fastkda::' not in (target / "api.py").read_text() and '"fastkda_HEAD::prefill"' in \
        (target / "api.py").read_text()
    monkeypatch.syspath_prepend(str(tmp_path))
    copy = importlib.import_module("fastkda_HEAD")
    import fastkda

    assert copy is not fastkda and copy.kda_prefill is not fastkda.kda_prefill
    sys.modules.pop("fastkda_HEAD", None)


def test_render_writes_the_table_beside_the_json(tmp_path):
    import json

    from tools.variants import ab_packages

    found = dict(meta=dict(gpu="G", date="d", torch="t", packages=["current", "base"], current="abc1234"),
                 rows=[dict(workload="w", kind="prefill", mode="graph", ms=dict(current=1.1, base=1.0),
                            equal=dict(current=True, base=True))])
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(found))
    ab_packages.render(path)
    assert "| w | graph | 1.1000 | 1.0000 | 1.100 | equal |" in (tmp_path / "ab.md").read_text()


def test_prefill_call_passes_the_length_hint_where_the_package_takes_one():
    """The A/B runs a varlen workload under the plan the benchmark gets (with ``max_seqlen``), and still runs a
    package of a commit from before the hint."""
    from types import SimpleNamespace

    from tools.variants import ab_packages

    seen = []

    def with_hint(*tensors, max_seqlen=None, **options):
        seen.append(max_seqlen)

    def without_hint(*tensors, **options):
        seen.append("no hint")

    inp = {name: None for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "lower_bound", "scale",
                                   "initial_state", "cu_seqlens")}
    inp["max_seqlen"] = 4096
    for kda_prefill in (with_hint, without_hint):
        ab_packages.prefill_call(SimpleNamespace(kda_prefill=kda_prefill), inp, None, None)()
    assert seen == [4096, "no hint"]


def test_package_runner_runs_a_commits_prefill(tmp_path, monkeypatch):
    """The profiling tools' ``--package``: a commit's prefill on the bench's inputs, as this tree's would run."""
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs the git history of this checkout")
    import torch

    import fastkda
    from fastkda.bench.workloads import make_prefill_inputs
    from tools.variants import ab_packages

    ab_packages.make_package("HEAD", root=tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    inp = make_prefill_inputs(dict(name="w", H=2, lengths=[40, 9], layout="varlen"), "cpu")
    copy_out, copy_final = ab_packages.package_runner("HEAD", inp)()  # kda_prefill's (output, final state)
    own_out, own_final = ab_packages.prefill_call(fastkda, inp, torch.empty_like(inp["v"]),
                                                  torch.empty_like(inp["initial_state"]))()
    assert torch.equal(copy_out, own_out) and torch.equal(copy_final, own_final)
    assert torch.isfinite(copy_out).all() and torch.isfinite(copy_final).all()
    sys.modules.pop("fastkda_HEAD", None)

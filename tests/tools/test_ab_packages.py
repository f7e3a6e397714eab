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

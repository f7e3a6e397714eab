"""``tools/device_tests.sh`` on this machine, with stand-ins for ``nvidia-smi`` and ``python3`` on its ``PATH``: what
its GPU-test steps print, since a device call that prints the wrong summary costs device time to find out; and
``tools/pytest_progress.py``, the plugin those steps count from, under a real pytest."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
# stands in for python3: a pytest run reports five tests to the progress plugin's file and prints a summary; a test
# file named slow* reports two, then outlives any limit; every other command succeeds silently
case "$*" in
  *"-m pytest"*)
    case "$*" in *tools.pytest_progress*) ;; *) echo "no progress plugin"; exit 3 ;; esac
    printf 'passed a\\npassed b\\n' >> "$FASTKDA_TEST_PROGRESS"
    case "$*" in *slow*) exec sleep 30 ;; esac
    printf 'failed c\\nskipped d\\nerror e\\n' >> "$FASTKDA_TEST_PROGRESS"
    printf '..F.[accuracy] output 3e-3\\nsE\\n1 failed, 2 passed, 1 skipped, 1 error in 1.0s\\n' ;;
esac
exit 0
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def run_script(tmp_path, **env):
    """``device_tests.sh`` in an empty folder (no peer wheels, no autotune cache, as in a clean clone), every step
    but the GPU tests off, its temporary files under ``tmp_path``; its stdout."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'Fake GPU, 1980 MHz, 2619 MHz, 40'\n")
    (fake / "python3").write_text(FAKE_PYTHON)
    for tool in fake.iterdir():
        tool.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    settings = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), BENCH_S="0",
                    KERNELS_S="0", TMPDIR=str(tmp_path / "tmp"), TRITON_CACHE_DIR=str(tmp_path / "cache"), **env)
    done = subprocess.run(["bash", str(ROOT / "tools" / "device_tests.sh")], cwd=tmp_path, env=settings,
                          capture_output=True, text=True, timeout=60)
    return done.stdout


def test_each_test_file_is_a_step_with_its_own_summary(tmp_path):
    out = run_script(tmp_path, TESTS_S="20", TEST_FILES="tests/test_a.py tests/test_b.py")
    assert "== gpu-tests-test_a (rc=0)" in out and "== gpu-tests-test_b (rc=0)" in out
    assert out.count("1 failed, 2 passed, 1 skipped, 1 error") == 2
    assert out.count("(progress: 2 passed, 2 failed or errors, 1 skipped)") == 2


def test_a_file_cut_by_the_limit_leaves_the_others_their_summaries(tmp_path):
    out = run_script(tmp_path, TESTS_S="8", TEST_FILES="tests/test_a.py tests/slow_test.py tests/test_b.py")
    assert "== gpu-tests-test_a (rc=0)" in out
    assert "== gpu-tests-slow_test (rc=124)" in out and "(progress: 2 passed, 0 failed or errors, 0 skipped)" in out
    assert "== gpu-tests-test_b: not run (TESTS_S spent)" in out


@pytest.mark.parametrize("seconds", ["0", "10m"])
def test_no_gpu_tests_at_zero_or_malformed_seconds(tmp_path, seconds):
    out = run_script(tmp_path, TESTS_S=seconds, TEST_FILES="tests/test_a.py")
    assert "== gpu-tests" not in out and "Fake GPU" in out
    assert ("TESTS_S must be whole seconds" in out) == (seconds != "0")


@pytest.mark.parametrize("seconds", [None, "5"])
def test_the_models_bench_is_a_step_of_its_own_when_asked(tmp_path, seconds):
    out = run_script(tmp_path, TESTS_S="0", **({"MODELS_S": seconds, "MODELS_ARGS": "--cases 1x64"} if seconds else {}))
    assert ("== models (rc=0)" in out) == (seconds is not None)


def test_the_progress_plugin_writes_each_outcome_as_it_is_known(tmp_path):
    (tmp_path / "test_outcomes.py").write_text(
        "import sys\nimport pytest\n\n"
        "def test_passes():\n    print('PASSED in the text, F without a newline', end='')\n\n"
        "def test_fails():\n    assert False\n\n"
        "@pytest.mark.skip(reason='skipped')\ndef test_skipped():\n    pass\n\n"
        "@pytest.mark.xfail\ndef test_xfails():\n    assert False\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError\n\n"
        "def test_setup_error(broken):\n    pass\n")
    progress = tmp_path / "progress"
    env = dict(os.environ, FASTKDA_TEST_PROGRESS=str(progress), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "tools.pytest_progress", "-p", "no:cacheprovider",
                    "-p", "no:xdist", str(tmp_path / "test_outcomes.py")], cwd=tmp_path, env=env,
                   capture_output=True, text=True, timeout=120)
    lines = progress.read_text().splitlines()
    assert sorted(line.split()[0] + " " + line.split("::")[-1] for line in lines) == [
        "error test_setup_error", "failed test_fails", "passed test_passes", "skipped test_skipped",
        "skipped test_xfails"]

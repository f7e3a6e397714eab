"""``tools/device_tests.sh`` on this machine, with stand-ins for ``nvidia-smi`` and ``python3`` on its ``PATH``: what
its GPU-test steps print, since a device call that prints the wrong summary costs device time to find out."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
# stands in for python3: a pytest run prints progress characters and some test output, a test file named slow*
# outlives any limit; every other command succeeds silently
case "$*" in
  *"-m pytest"*)
    case "$*" in *slow*) printf '..\\n'; exec sleep 30 ;; esac
    printf '..F.[accuracy] output 3e-3\\nsome line the test printed\\n.s\\n1 failed, 4 passed, 1 skipped in 1.0s\\n' ;;
esac
exit 0
"""


def run_script(tmp_path, **env):
    """``device_tests.sh`` from the repository root with every step but the GPU tests off; its stdout."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'Fake GPU, 1980 MHz, 2619 MHz, 40'\n")
    (fake / "python3").write_text(FAKE_PYTHON)
    for tool in fake.iterdir():
        tool.chmod(0o755)
    settings = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), BENCH_S="0",
                    KERNELS_S="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), **env)
    done = subprocess.run(["bash", str(ROOT / "tools" / "device_tests.sh")], cwd=ROOT, env=settings,
                          capture_output=True, text=True, timeout=60)
    return done.stdout


pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def test_each_test_file_is_a_step_with_its_own_summary(tmp_path):
    # every test here names its files apart: the script keeps each step's log in /tmp under the file's name
    out = run_script(tmp_path, TESTS_S="20", TEST_FILES="tests/test_a1.py tests/test_b1.py")
    assert "== gpu-tests-test_a1 (rc=0)" in out and "== gpu-tests-test_b1 (rc=0)" in out
    assert out.count("1 failed, 4 passed, 1 skipped") == 2
    assert out.count("(progress: 4 passed, 1 failed or errors, 1 skipped)") == 2


def test_a_file_cut_by_the_limit_leaves_the_others_their_summaries(tmp_path):
    out = run_script(tmp_path, TESTS_S="8", TEST_FILES="tests/test_a2.py tests/slow_test.py tests/test_b2.py")
    assert "== gpu-tests-test_a2 (rc=0)" in out
    assert "== gpu-tests-slow_test (rc=124)" in out and "(progress: 2 passed, 0 failed or errors, 0 skipped)" in out
    assert "== gpu-tests-test_b2: not run (TESTS_S spent)" in out


def test_no_gpu_tests_at_zero_seconds(tmp_path):
    out = run_script(tmp_path, TESTS_S="0", TEST_FILES="tests/test_a3.py")
    assert "gpu-tests" not in out and "Fake GPU" in out

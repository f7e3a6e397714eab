"""A pytest plugin for ``tools/device_tests.sh`` (``-p tools.pytest_progress``): each test's outcome, one line a
test, appended to the file that ``FASTKDA_TEST_PROGRESS`` names as soon as it is known, so that a run a time limit
kills still says how far it got. Its lines are ``passed``, ``failed``, ``error`` (setup or teardown) or ``skipped``
(xfail included), then the test's id; without the variable it does nothing."""

import os

PROGRESS = "FASTKDA_TEST_PROGRESS"


def outcome(report) -> str:
    """A phase report's outcome as one word, or "" where the phase says nothing new (a passed setup or teardown)."""
    if report.skipped:
        return "skipped"
    if report.when == "call":
        return report.outcome
    return "error" if report.failed else ""


def pytest_runtest_logreport(report):
    path = os.environ.get(PROGRESS)
    word = outcome(report)
    if path and word:
        with open(path, "a") as progress:
            progress.write(f"{word} {report.nodeid}\n")

"""Run a peer's own test file against fastkda's drop-in: the file is copied with its import of the peer's function
rewritten to fastkda's compat module, then run by pytest; the peer's reference functions stay the peer's.

    python tools/peer_tests.py fla path/to/fla/tests/ops/test_kda.py [pytest arguments]

Prints pytest's summary; exits with pytest's status. Needs the peer installed (its references) and, for FLA's
tests, a GPU."""

import subprocess
import sys
import tempfile
from pathlib import Path

REWRITES = {
    "fla": [("from fla.ops.kda import chunk_kda, fused_recurrent_kda",
             "from fastkda.compat.fla import chunk_kda, fused_recurrent_kda")],
}


def rewritten(peer, text):
    """The test file's text with the peer's imports of the functions under test pointing at fastkda; raises if
    an import to rewrite is missing (the file changed: the run would test the peer, not fastkda)."""
    for old, new in REWRITES[peer]:
        if old not in text:
            raise SystemExit(f"peer_tests: {old!r} not found in the test file")
        text = text.replace(old, new)
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in REWRITES:
        raise SystemExit(f"usage: python tools/peer_tests.py {{{','.join(REWRITES)}}} TEST_FILE [pytest args]")
    peer, source, extra = argv[0], Path(argv[1]), argv[2:]
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / f"test_{peer}_against_fastkda.py"
        target.write_text(rewritten(peer, source.read_text()))
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                                "--rootdir", folder, str(target), *extra])


if __name__ == "__main__":
    sys.exit(main())

"""Run a peer's own test file against fastkda's drop-in: the file is copied with its import of the peer's function
rewritten to fastkda's compat module, then run by pytest; the peer's reference functions stay the peer's.

fastkda is inference-only, and FLA's tests run a backward pass after each forward. Their forward parts are what is
measured: a backward call on a tensor that does not require grad (fastkda's outputs) does nothing, and a comparison
whose fastkda side is None and whose name is a gradient's (``dq``, ``dh0``, ...) is skipped; the peer's reference
still runs its own backward, and every forward output is compared with the test's own tolerance.

    python tools/peer_tests.py fla path/to/fla/tests/ops/test_kda.py [pytest arguments]

Prints pytest's summary; exits with pytest's status. Needs the peer installed (its references) and, for FLA's
tests, a GPU."""

import subprocess
import sys
import tempfile
from pathlib import Path

FORWARD_ONLY = {
    "fla": """

_peer_assert_close = assert_close


def assert_close(prefix, ref, tri, *args, **kwargs):  # peer_tests: gradients are not fastkda's (inference-only)
    if tri is None and prefix.startswith("d"):  # dq, dk, dv, dg, db, dh0, ...: a None forward output still fails
        return None
    return _peer_assert_close(prefix, ref, tri, *args, **kwargs)


_peer_backward = torch.Tensor.backward


def _backward_where_grad(self, *args, **kwargs):  # peer_tests: fastkda's outputs take no backward pass
    if self.requires_grad:
        return _peer_backward(self, *args, **kwargs)
    return None


torch.Tensor.backward = _backward_where_grad
""",
}

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
    return text + FORWARD_ONLY.get(peer, "")


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

"""tools/peer_tests.py: the rewrite points the peer's test at fastkda, and refuses a file it cannot rewrite."""

import pytest

from tools.peer_tests import rewritten


def test_rewrites_the_import_under_test_only():
    text = "from fla.ops.kda import chunk_kda, fused_recurrent_kda\nfrom fla.ops.kda.naive import naive_chunk_kda\n"
    out = rewritten("fla", text)
    assert out.splitlines() == ["from fastkda.compat.fla import chunk_kda, fused_recurrent_kda",
                                "from fla.ops.kda.naive import naive_chunk_kda"]


def test_refuses_a_file_without_the_import():
    with pytest.raises(SystemExit, match="not found"):
        rewritten("fla", "from fla.ops.kda import chunk_kda\n")

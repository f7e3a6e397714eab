"""The decode kernels' source variants (tools/variants/decode_variants.py): every edit still applies to the
committed source, and a variant's module comes and goes without touching fastkda's own."""

import os
import sys

import pytest

pytest.importorskip("triton")  # the variants are Triton kernels

from tools.variants.decode_variants import KERNELS, MODULE, edited_source, variant_module  # noqa: E402


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_variant_applies_to_the_committed_source(kernel):
    committed, variants = KERNELS[kernel]
    source = open(committed.__file__).read()
    for name, edits in variants.items():
        text = edited_source(edits, source)
        compile(text, name, "exec")
        assert (text == source) == (not edits), name


def test_an_edit_that_does_not_match_once_is_refused():
    with pytest.raises(ValueError, match="matches 0 times"):
        edited_source([("no such line", "")], "text")
    with pytest.raises(ValueError, match="matches 2 times"):
        edited_source([("a", "b")], "a a")


def test_a_variant_module_is_imported_beside_the_committed_one_and_removed():
    committed, variants = KERNELS["decode"]
    with variant_module(committed, variants["state stores streaming"]) as module:
        assert module.__name__ == f"fastkda.ops.{MODULE}"
        assert module.decode_kernel is not committed.decode_kernel
        path = module.__file__
    assert not os.path.exists(path) and module.__name__ not in sys.modules


def test_a_variant_of_the_other_kernel_is_refused(capsys):
    from tools.variants import decode_variants

    with pytest.raises(SystemExit):
        decode_variants.main(["--kernel", "decode", "--variants", "without the join"])
    assert "unknown decode variants ['without the join']" in capsys.readouterr().err


def test_extra_shapes_are_one_token_fp32_workloads_and_bad_ones_are_refused(capsys):
    from tools.variants import decode_variants

    assert decode_variants.extra_workload("96:2") == dict(name="decode_H96_N2", H=96, N=2, tokens_per_seq=1)
    for bad in ("96", "96:x", "0:2"):
        with pytest.raises(SystemExit):
            decode_variants.main(["--shapes", bad])
        assert "--shapes" in capsys.readouterr().err

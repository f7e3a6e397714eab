"""The device A/B script's source edits still apply to the current kernels (so a device call is not wasted)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import prepare_variants  # noqa: E402


def test_every_source_edit_applies_and_parses():
    source = prepare_variants.SOURCE.read_text()
    for label, _, edit in prepare_variants.VARIANTS:
        if edit is not None:
            edited = edit(source)
            assert edited != source, label
            compile(edited, label, "exec")

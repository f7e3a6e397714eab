"""The device A/B script's variants are well-formed before a device call is spent on them."""

import importlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import prepare_variants  # noqa: E402
from fastkda.ops import prefill  # noqa: E402


def test_settings_name_existing_knobs_and_source_files_are_read(tmp_path):
    for label, settings, _ in prepare_variants.VARIANTS:
        for name in settings:
            assert hasattr(prefill, name), f"{label}: fastkda.ops.prefill has no {name}"
    other = tmp_path / "prefill_old.py"
    other.write_text("# an older prefill.py\n")
    label, settings, edit = prepare_variants.variants([str(other)])[-1]
    assert str(other) in label and settings == {}
    assert edit(prepare_variants.SOURCE.read_text()) == "# an older prefill.py\n"


def test_source_edits_apply_to_the_current_kernel():
    source = prepare_variants.SOURCE.read_text()
    for label, _, edit in prepare_variants.VARIANTS:
        if edit is not None:
            assert edit(source) != source, f"{label}: its edit no longer matches fastkda/ops/prefill.py"


def test_a_source_variant_is_imported_with_its_settings_and_its_copy_removed():
    try:
        module = prepare_variants.variant_module(7, dict(SOLVE_WARPS=1), lambda text: text + "\nEDITED = True\n")
        assert module.EDITED and module.SOLVE_WARPS == 1 and module is not prefill
        assert prefill.chunk_kda_forward is module.chunk_kda_forward  # where the API looks it up
        assert not list(prepare_variants.SOURCE.parent.glob("_variant*.py"))
    finally:
        importlib.reload(prefill)
    assert prefill.SOLVE_WARPS != 1 and not hasattr(prefill, "EDITED")


def test_command_line_settings_become_variants():
    label, settings, edit = prepare_variants.variants([], ["PREPARE_WARPS=8,PREPARE_MAXNREG=None"])[-1]
    assert settings == dict(PREPARE_WARPS=8, PREPARE_MAXNREG=None) and edit is None and "PREPARE_WARPS=8" in label
    with pytest.raises(SystemExit, match="PREPARE_WRAPS"):  # a misspelt knob would time the committed kernels
        prepare_variants.variants([], ["PREPARE_WRAPS=8"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels on the CPU interpreter")
@pytest.mark.parametrize("v_slices", ["1", "4"])
def test_variant_accuracy_runs_a_source_on_the_interpreter(v_slices):
    import variant_accuracy

    found = variant_accuracy.main(["--tokens", "40", "--v-slices", v_slices, str(prepare_variants.SOURCE)])
    (out_err, state_err), = found.values()
    assert 0 < out_err < 4e-3 and 0 < state_err < 3e-3
    assert not list(variant_accuracy.OPS.glob("_accuracy_variant*.py"))  # the copy is removed

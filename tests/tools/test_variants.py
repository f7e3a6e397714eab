"""The variant tools: their variants are well formed before a device call is spent on them, a source variant is a
whole prefill package imported apart and removed afterwards, and its error is measured on the CPU interpreter."""

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the variants are Triton kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tools package

import fastkda.ops.prefill as committed  # noqa: E402
from tools.variants import prepare_variants, variant_accuracy  # noqa: E402
from tools.variants.variant import (OPS, PREFILL, Variant, plan_the_package_reads, prefill_package,  # noqa: E402
                                    variant_package)


def leftovers():
    """This process's copies still beside the committed package (another xdist worker's may be there meanwhile)."""
    mine = ("_variant_test", "_variant_unused", "_variant_bad", "_variant_old", f"_accuracy_variant_{os.getpid()}_")
    return [p.name for p in OPS.iterdir() if p.name.startswith(mine)]


def test_command_line_variants(tmp_path, capsys):
    args = prepare_variants.parser().parse_args(["--set", "prepare_warps=8,solve_stages=2", "recurrence_warps=8",
                                                 "--source", str(tmp_path)])
    chosen = prepare_variants.variants(args.source, args.set)
    assert [v.label for v in chosen] == ["as committed", "as committed, prepare_warps=8,solve_stages=2",
                                         "as committed, recurrence_warps=8", f"source {tmp_path}"]
    assert chosen[1].changes == dict(prepare_warps=8, solve_stages=2) and chosen[3].source == str(tmp_path)
    with pytest.raises(SystemExit):  # a misspelt launch number would time the committed kernels under its label
        prepare_variants.parser().parse_args(["--set", "PREPARE_WARPS=8"])
    assert "no launch number 'PREPARE_WARPS'" in capsys.readouterr().err


def test_a_source_variant_is_a_whole_package_imported_apart_and_removed(tmp_path):
    source = tmp_path / "prefill"
    shutil.copytree(PREFILL, source, ignore=shutil.ignore_patterns("__pycache__"))
    with open(source / "__init__.py", "a") as f:
        f.write("\nEDITED = True\n")
    with prefill_package(source, "_variant_test") as package:
        assert package.__name__ == "fastkda.ops._variant_test" and package.EDITED
        assert package.prepare.prepare_kernel is not committed.prepare.prepare_kernel  # compiled afresh
        assert package.prepare.launch is committed.prepare.launch  # its relative imports resolve in fastkda.ops
        assert (OPS / "_variant_test").is_dir()
    assert not leftovers() and "fastkda.ops._variant_test" not in sys.modules
    assert not hasattr(committed, "EDITED")
    with variant_package(Variant(), "_variant_unused") as package:  # no source: the committed package, no copy
        assert package is committed and not leftovers()
    with pytest.raises(ValueError, match="not a prefill package"):
        with prefill_package(tmp_path, "_variant_bad"):
            pass


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels on the CPU interpreter")
@pytest.mark.parametrize("v_slices", ["1", "4"])
def test_variant_accuracy_runs_a_source_on_the_interpreter(v_slices):
    found = variant_accuracy.main([str(PREFILL), "--tokens", "40", "--v-slices", v_slices, "--set", "solve_stages=2"])
    (label, (out_err, state_err)), = found.items()
    assert label == f"source {PREFILL}, solve_stages=2"
    assert 0 < out_err < 4e-3 and 0 < state_err < 3e-3
    assert not leftovers()  # the copy is removed


def test_a_package_from_before_the_one_axis_grid_gets_the_two_axis_grid(tmp_path):
    """A source package whose layout has no ``preparation_program`` (from before ``early_chunks_last``) reads the
    head from the preparation grid's second axis: it runs with the two-axis grid, and the committed package with the
    plan as chosen."""
    from fastkda.plan import choose_plan

    plan = choose_plan(5, 12, 1024, 128, 128, 132)
    assert plan.early_chunks_last
    source = tmp_path / "prefill"  # a package whose layout has none of the new mapping
    source.mkdir()
    (source / "__init__.py").write_text("")
    (source / "layout.py").write_text("def chunk_of_slot():\n    pass\n")
    with prefill_package(source, "_variant_old") as package:
        assert not plan_the_package_reads(package, plan).early_chunks_last
    assert plan_the_package_reads(committed, plan) == plan


def old_prefill_source(tmp_path, layout_functions, scan_functions=None):
    """A stand-in prefill source package from before a change: its layout (and, if given, its scan module) defines
    only the named functions, which is all ``plan_the_package_reads`` looks at."""
    def module_text(names):
        return "\n\n".join(f"def {name}():\n    pass\n" for name in names)

    source = tmp_path / "prefill"
    source.mkdir()
    (source / "__init__.py").write_text("")
    (source / "layout.py").write_text(module_text(layout_functions))
    if scan_functions is not None:
        (source / "scan.py").write_text(module_text(scan_functions))
    return source


def read_by_old_package(tmp_path, plan, layout_functions, scan_functions=None):
    """``plan`` as the stand-in package of :func:`old_prefill_source` reads it."""
    with prefill_package(old_prefill_source(tmp_path, layout_functions, scan_functions), "_variant_old") as package:
        return plan_the_package_reads(package, plan)


def test_a_package_from_before_the_ordered_transitions_runs_every_segment_program(tmp_path):
    """A source package whose layout has no ``program_keys`` (from before ``transitions_in_order``) runs its
    transitions on every segment program; the committed package keeps the plan as chosen."""
    from fastkda.plan import choose_plan

    plan = choose_plan(13, 24, 8192, 128, 128, 132, max_seqlen=6144)
    assert plan.transitions_in_order
    read = read_by_old_package(tmp_path, plan, ["preparation_program"])
    assert not read.transitions_in_order and read.early_chunks_last
    assert plan_the_package_reads(committed, plan) == plan


def test_a_package_from_before_the_rerun_s_grid_cut_reruns_every_segment_program(tmp_path):
    """A source package whose scan has no ``rerun_left_out`` (from before ``rerun_in_order``) writes no final state
    for a sequence left out of a cut grid: it reruns every segment program, its ordered transitions kept."""
    from fastkda.plan import choose_plan

    plan = choose_plan(13, 24, 8192, 128, 128, 132, max_seqlen=6144)
    assert plan.rerun_in_order and plan.transitions_in_order
    read = read_by_old_package(tmp_path, plan, ["preparation_program", "program_keys"], [])
    assert not read.rerun_in_order and read.transitions_in_order and read.early_chunks_last
    assert plan_the_package_reads(committed, plan) == plan


def test_a_package_from_before_the_scan_s_places_scans_every_sequence(tmp_path):
    """A source package whose scan has no ``walk_entries`` (from before ``scan_in_order``) takes a sequence per
    grid row: it scans every sequence, its rerun's cut kept."""
    from fastkda.plan import choose_plan

    plan = choose_plan(13, 24, 8192, 128, 128, 132, max_seqlen=6144).replace(scan_in_order=True)
    assert plan.rerun_in_order
    read = read_by_old_package(tmp_path, plan, ["preparation_program", "program_keys"], ["rerun_left_out"])
    assert not read.scan_in_order and read.rerun_in_order and read.transitions_in_order
    assert plan_the_package_reads(committed, plan) == plan

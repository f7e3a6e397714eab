"""A prefill variant, as both variant tools take it: changes to the launch plan and, optionally, a whole other copy
of the prefill kernels.

A source variant is a folder holding a whole ``fastkda/ops/prefill/`` package (e.g. an older one from git, or an
edited copy). It is copied beside the committed package as ``fastkda/ops/<name>/``, so that its relative imports
(``from ..common import ...``, ``from ... import reference``) resolve to this fastkda, and imported under that
name, so that its kernels are new functions Triton compiles afresh; the copy is removed when the variant is done
with. A variant runs ``chunk_kda_forward`` of its package directly, under the plan ``fastkda.kda_prefill`` would
make for the inputs with the variant's changes: nothing in fastkda's modules is replaced.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import fastkda.ops.prefill as committed
from fastkda.bench.work import plan_for_inputs
from fastkda.bench.workloads import LOWER_BOUND
from tools.plan_changes import describe

PREFILL = Path(committed.__file__).resolve().parent  # the committed package, the default source
OPS = PREFILL.parent


@dataclass(frozen=True)
class Variant:
    """Plan ``changes`` on the kernels of ``source`` (a prefill package folder; None: the committed one)."""

    changes: dict = field(default_factory=dict)
    source: Optional[str] = None

    @property
    def label(self) -> str:
        where = f"source {self.source}" if self.source else "as committed"
        return f"{where}, {describe(self.changes)}" if self.changes else where


@contextlib.contextmanager
def prefill_package(source, name):
    """The prefill package in the folder ``source`` imported as ``fastkda.ops.<name>`` from a copy beside the
    committed one (a stale copy of that name, left by a run that was killed, is replaced); the copy is removed and
    forgotten on leaving."""
    source = Path(source)
    if not (source / "__init__.py").is_file():
        raise ValueError(f"{source} is not a prefill package folder (no __init__.py)")
    target = OPS / name
    module_name = f"fastkda.ops.{name}"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        yield importlib.import_module(module_name)
    finally:
        shutil.rmtree(target, ignore_errors=True)
        for loaded in [m for m in sys.modules if m == module_name or m.startswith(module_name + ".")]:
            del sys.modules[loaded]


@contextlib.contextmanager
def variant_package(variant, name):
    """The package ``variant`` runs: the committed one, or its source's copy (:func:`prefill_package`)."""
    if variant.source is None:
        yield committed
    else:
        with prefill_package(variant.source, name) as module:
            yield module


def defines(package, module, name):
    """Whether ``package``'s module ``module`` exists and defines ``name``."""
    full = f"{package.__name__}.{module}"
    return importlib.util.find_spec(full) is not None and hasattr(importlib.import_module(full), name)


def plan_the_package_reads(package, plan):
    """``plan`` as ``package`` launches it: a prefill package from before the preparation's one-axis grid (its
    layout has no ``preparation_program``) reads the head from the grid's second axis, so it gets the two-axis grid
    (``early_chunks_last`` off); one from before the transitions took their rows from the order (no
    ``program_keys``) runs them on every segment program (``transitions_in_order`` off); one from before the
    rerun's grid cut (its scan has no ``rerun_left_out``) reruns every segment program (``rerun_in_order`` off);
    one from before the scan took its rows from the order (no ``walk_entries``) scans every sequence
    (``scan_in_order`` off). The same bits."""
    if plan.early_chunks_last and not defines(package, "layout", "preparation_program"):
        plan = plan.replace(early_chunks_last=False)
    if plan.transitions_in_order and not defines(package, "layout", "program_keys"):
        plan = plan.replace(transitions_in_order=False)
    if plan.rerun_in_order and not defines(package, "scan", "rerun_left_out"):
        plan = plan.replace(rerun_in_order=False)
    if plan.scan_in_order and not defines(package, "scan", "walk_entries"):
        plan = plan.replace(scan_in_order=False)
    return plan


def variant_runner(package, changes, inp, v_slices="auto"):
    """``run()`` of ``package.chunk_kda_forward`` on the bench's inputs ``inp`` into preallocated buffers, under
    the plan for ``inp`` (``v_slices`` as ``fastkda.kda_prefill`` takes it) with ``changes``, as the package
    launches it (:func:`plan_the_package_reads`); returns ``(output, final state)``."""
    plan = plan_for_inputs(inp, v_slices=v_slices)
    plan = plan_the_package_reads(package, plan.replace(**changes) if changes else plan)
    out, final = torch.empty_like(inp["v"]), torch.empty_like(inp["initial_state"])

    def run():
        package.chunk_kda_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], plan=plan, A_log=inp["A_log"],
                                  dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                                  initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"],
                                  use_qk_l2norm=True, use_beta_sigmoid=True, out=out, final_state=final)
        return out, final
    return run

"""``python -m fastkda.bench.models``: transformers' tiny Kimi-Linear and GLM-5.3-Flash models run three ways in one
process: transformers' PyTorch path, FLA's kernels where transformers found FLA at import (CUDA only), and fastkda
(:mod:`fastkda.integrations.transformers`). Times the forward over a prompt and each generated token (greedy,
with the model's cache), median of repeats with the paths taking turns, eager; writes
``OUT/<date>-<device>-models.{json,md}``. A token's time is read inside one generation: the median of the
intervals between consecutive generated tokens' logits. So the prompt's prefill stays out of it (its spread from
run to run, at T2048 on a CPU, exceeds what 48 tokens take), and so do the few steps the host stalls (a
collection, a page fault), which move a mean of 48 steps by more than the paths differ (docs/perf-notes.md).

transformers binds FLA or its PyTorch fallback when the modeling module is imported; the fallback stays reachable
as the ``__wrapped__`` of transformers' wrapper, which is how the PyTorch path is timed beside FLA here. Since
transformers 5.25 (which requires the ``kernels`` package) the module holds that wrapper inside a ``kernels``
function module (:func:`transformers_wrapper`).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import pstats
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from ..integrations import transformers as fastkda_transformers
from ..integrations.tiny_models import MODEL_KINDS, tiny_model
from .arguments import batch_by_length, checked_device, positive_int
from .report import git_commit, merge_rows, run_id
from .timing import synced_median_ms

CASES = [(1, 64), (2, 64), (1, 2048), (2, 2048)]  # (batch, prompt length)
CASE_FIELDS = ("model", "batch", "length")  # what --append replaces as a whole: one case, every path
ROW_FIELDS = CASE_FIELDS + ("path", "forward_ms", "per_token_ms", "commit", "device", "dtype", "date")  # what
# markdown reads of every row (the paired differences and the repeats are newer: shown where a row has them)
NEW_TOKENS = 48  # generated tokens timed per case (past the first): enough for a median that host stalls miss
KDA_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                 "causal_conv1d_update")


def modeling_module(kind):
    return importlib.import_module(next(name for name in fastkda_transformers.MODELS if kind in name))


def closure_cells(function):
    """``{name: value}`` of the variables ``function`` closes over."""
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))


def transformers_wrapper(bound):
    """transformers' wrapper behind a KDA function bound in a modeling module: ``bound`` itself, or, where the
    ``kernels`` package made it an ``nn.Module`` (transformers >= 5.25), the function its ``forward`` calls."""
    if isinstance(bound, torch.nn.Module):
        return closure_cells(type(bound).forward)["func"]
    return bound


def binds_fla(function):
    """Whether a KDA function transformers bound at import is FLA's (else its PyTorch fallback): the
    implementation its wrapper closes over."""
    implementation = closure_cells(transformers_wrapper(function)).get("implementation")
    return getattr(implementation, "__module__", "").startswith("fla")


def bound_functions(module):
    """The KDA functions transformers bound in ``module`` at import (fastkda's routing turned off first)."""
    fastkda_transformers.disable()
    return {name: getattr(module, name) for name in KDA_FUNCTIONS}


def use_path(module, path, bound):
    """Point the module's KDA functions at ``path``: "fastkda", "fla" (as bound at import), or "pytorch" (the
    fallbacks behind the bound functions)."""
    fastkda_transformers.disable()
    for name in KDA_FUNCTIONS:
        setattr(module, name, bound[name] if path != "pytorch" else transformers_wrapper(bound[name]).__wrapped__)
    if path == "fastkda":
        fastkda_transformers.enable()


def prompt_ids(batch, length, device):
    """The prompt of a case: ``[batch, length]`` token ids, the same on every call."""
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)


def greedy_generate(model, ids, tokens, processors=()):
    """Exactly ``tokens`` new tokens, greedy, with the model's cache (no end-of-sequence stop) and the logits
    ``processors``."""
    from transformers import LogitsProcessorList

    return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                          logits_processor=LogitsProcessorList(processors))


def step_clock(stamps, device):
    """A logits processor for ``generate`` that appends to ``stamps`` the time at which each step's logits are
    ready (the device synchronised first on a GPU): the stamps after the first one time the generated tokens."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())
            return scores

    return StepClock()


def measure_case(kind, paths, model, module, bound, batch, length, device, repeats):
    """Rows for one (batch, prompt length) case, one per path: the paths take turns within every repeat, each
    round starting with the next path, so that a drift of the host's or the card's clocks falls on all of them
    alike; medians of the forward, and of the time per generated token (the median interval between the 48 tokens
    after the first of one generation, :func:`step_clock`); and, for each path, the median over the rounds of
    what it took beyond fastkda in the same round."""
    ids = prompt_ids(batch, length, device)

    def generate(tokens, processors=()):
        return greedy_generate(model, ids, tokens, processors)

    def per_token_ms():
        stamps = []
        generate(1 + NEW_TOKENS, [step_clock(stamps, device)])
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:])) * 1e3
    times = {path: dict(forward=[], per_token=[]) for path in paths}
    with torch.no_grad():
        for path in paths:  # warm-up: compiles and autotunes
            use_path(module, path, bound)
            model(ids)
            generate(2)
        for round_ in range(repeats):
            for path in paths[round_ % len(paths):] + paths[:round_ % len(paths)]:
                use_path(module, path, bound)
                times[path]["forward"].append(synced_median_ms(lambda: model(ids), device, 1))
                times[path]["per_token"].append(per_token_ms())
    rows = []
    for path in paths:
        median = {name: statistics.median(values) for name, values in times[path].items()}
        # what this path takes beyond fastkda, paired round by round: a drift of the host's clocks between rounds
        # falls on both terms of a difference, where it moves the medians of the two paths apart
        beyond = {name: statistics.median(a - b for a, b in zip(values, times["fastkda"][name]))
                  for name, values in times[path].items()}
        rows.append(dict(model=kind, path=path, batch=batch, length=length, forward_ms=median["forward"],
                         per_token_ms=median["per_token"], forward_beyond_fastkda_ms=beyond["forward"],
                         per_token_beyond_fastkda_ms=beyond["per_token"]))
    return rows


PROFILED_TOKENS = 16  # generated tokens under the profilers, per path


def profile_generation(kind, paths, model, module, bound, batch, length, device):
    """Where a generated token's host time goes, per path, as text: the torch profiler's table of operators (host
    time each, and on a GPU the kernels launched) and cProfile's functions by cumulative time, over a generation of
    ``PROFILED_TOKENS`` tokens past its prompt (a tiny model's token is host-bound, so the host's work is what the
    paths differ by). Called after :func:`measure_case`, whose warm-up compiled and autotuned every path."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompt_ids(batch, length, device)

    def generate():
        greedy_generate(model, ids, PROFILED_TOKENS)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sections = []
    with torch.no_grad():
        for path in paths:  # each already warm: measure_case ran it first (compiled, autotuned)
            use_path(module, path, bound)
            with profile(activities=activities) as operators:
                generate()
            functions = cProfile.Profile()
            functions.runcall(generate)
            text = io.StringIO()
            pstats.Stats(functions, stream=text).sort_stats("cumulative").print_stats(40)
            sections.append(f"## {kind} {path} B{batch} T{length}: {PROFILED_TOKENS} generated tokens\n\n"
                            + operators.key_averages().table(sort_by="cpu_time_total", row_limit=40)
                            + "\n" + text.getvalue())
    return "\n".join(sections)


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastkda.bench.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--cases", nargs="+", type=batch_by_length, default=list(CASES), metavar="BxT")
    parser.add_argument("--out", default="fastkda-results")
    parser.add_argument("--append", action="store_true",
                        help="keep the cases of today's models file in OUT that this run does not measure")
    parser.add_argument("--profile", action="store_true",
                        help="also profile a generation per path and case (host operators and Python functions), "
                             "written to OUT/<date>-<device>-models-profile.txt")
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    cases = args.cases
    rows, profiles, commit, run = [], [], git_commit(), run_id()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{date.today().isoformat()}-{device_name(device).replace(' ', '_')}-models"
    try:
        earlier = earlier_rows(stem.with_suffix(".json")) if args.append else []
    except ValueError as exc:  # an unreadable file: --append would lose its rows
        parser.error(f"--append: {exc}")

    def write():  # after every case, so that a run cut short by a time limit keeps the cases it finished
        kept = merge_rows(earlier, rows, CASE_FIELDS)  # a case's rows all from one run: its paired differences
        stem.with_suffix(".json").write_text(json.dumps(dict(rows=kept), indent=1))
        stem.with_suffix(".md").write_text(markdown(kept))
        if profiles:
            Path(f"{stem}-profile.txt").write_text(f"# commit {commit}, run {run}\n\n" + "\n".join(profiles))
    for kind in MODEL_KINDS:
        module = modeling_module(kind)
        bound = bound_functions(module)
        with_fla = device.type == "cuda" and binds_fla(bound["chunk_kimi_delta_attention"])
        paths = ["pytorch", "fastkda"] + (["fla"] if with_fla else [])
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = tiny_model(kind, dtype=dtype, device=device)
        for batch, length in cases:
            for row in measure_case(kind, paths, model, module, bound, batch, length, device, args.repeats):
                row.update(commit=commit, run=run, device=device_name(device), dtype=str(dtype).replace("torch.", ""),
                           date=date.today().isoformat(), repeats=args.repeats)
                rows.append(row)
                print(f"[models] {kind:12s} {row['path']:8s} B{batch} T{length:<5d} forward {row['forward_ms']:8.2f} "
                      f"ms  per token {row['per_token_ms']:7.2f} ms  (beyond fastkda: forward "
                      f"{row['forward_beyond_fastkda_ms']:+.3f}, per token "
                      f"{row['per_token_beyond_fastkda_ms']:+.3f} ms)",
                      flush=True)
            if args.profile:
                profiles.append(profile_generation(kind, paths, model, module, bound, batch, length, device))
            write()
        use_path(module, "fla", bound)  # the functions as transformers bound them (FLA's or its own wrappers): a
        # later bound_functions must find them, not the fallbacks behind them (the layer bench read those and failed)
        fastkda_transformers.disable()
    print(f"[models] wrote {stem}.json")


def earlier_rows(path):
    """The rows of a models file written earlier (``--append``), none if there is no such file; ``ValueError``
    naming the file where it is not one."""
    if not path.exists():
        return []
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON or not UTF-8 text
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    rows = found.get("rows") if isinstance(found, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(f in r for f in ROW_FIELDS) for r in rows):
        raise ValueError(f"{path} is not a models results file (a JSON object with \"rows\" of "
                         f"{', '.join(ROW_FIELDS)})")
    return rows


def markdown(rows):
    """One table: forward and per-token ms per (model, case), a column per path."""
    paths = [p for p in ("fastkda", "fla", "pytorch") if any(r["path"] == p for r in rows)]
    others = paths[1:]
    head = (["model", "B", "T"] + [f"{p} forward ms" for p in paths] + [f"{p} ms/token" for p in paths]
            + [f"{p} − fastkda forward ms" for p in others] + [f"{p} − fastkda ms/token" for p in others]
            + ["repeats", "commit"])
    lines = [f"# Tiny transformers models with KDA layers, {rows[0]['device']}, {rows[0]['date']}, {rows[0]['dtype']}",
             "", "Eager, median of repeats in which the paths take turns; generation: greedy with the model's cache, "
             "time per token past the first (the median interval between consecutive tokens' logits, without the "
             "prefill). \"p − fastkda\": the median over the rounds of what path p took beyond fastkda in the same "
             "round (positive: fastkda faster), the figure that decides which is faster where the medians differ by "
             "less than the host's drift between rounds.",
             "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(r["model"], r["batch"], r["length"]) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    for model, batch, length in keys:
        by_path = {r["path"]: r for r in rows if (r["model"], r["batch"], r["length"]) == (model, batch, length)}
        cells = [model, str(batch), str(length)]
        cells += [f"{by_path[p]['forward_ms']:.2f}" if p in by_path else "" for p in paths]
        cells += [f"{by_path[p]['per_token_ms']:.2f}" if p in by_path else "" for p in paths]
        for key in ("forward_beyond_fastkda_ms", "per_token_beyond_fastkda_ms"):
            cells += [f"{by_path[p][key]:+.3f}" if p in by_path and key in by_path[p] else "" for p in others]
        first = next(iter(by_path.values()))
        cells += [str(first.get("repeats", "")), first["commit"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

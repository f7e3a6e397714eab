"""Same-run A/B of fastkda at other commits: each package times the same inputs, interleaved, in one process.

A refactor or a kernel change is judged against the commit before it on the same GPU, in the same process, on
the same inputs: the packages take turns on every workload (graph replay and eager), ``--rounds`` times, each
round starting with the next package (so that no package is always timed first, after the idle gap of making
the inputs), and the fastest of each package's medians counts, so drift of the card's clocks falls on all alike. It also
says whether the packages' outputs and final states are bitwise equal (a change that moves code should keep
every bit).

Here (needs git): ``python tools/variants/ab_packages.py --make ce73160 [--make ...]`` copies the ``fastkda``
package of each commit into ``.ab/fastkda_<commit>/`` (ignored by git; carry ``.ab`` to the device), renamed so
that it imports beside the working tree's, its custom ops in their own namespace.
On the device: ``python tools/variants/ab_packages.py --against ce73160 [--only NAME ...] [--step] [--out DIR]``
prints one line per workload and mode (the working tree's time, each other package's, their ratios) and writes
``ab-<commits>.json`` under ``--out`` (the working tree's commit from ``$FASTKDA_COMMIT`` or git);
``--render FILE.json`` writes its table as ``FILE.md``.
"""

import argparse
import datetime
import importlib
import inspect
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
AB = REPO / ".ab"
sys.path[:0] = [str(REPO), str(AB)]


def make_package(commit, root=AB):
    """``root/fastkda_<commit>/``: the ``fastkda`` package of ``commit``, its custom ops renamed."""
    name = f"fastkda_{commit}"
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit, "fastkda"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        shutil.move(str(Path(tmp) / "fastkda"), target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        if '"fastkda::' in text:
            path.write_text(text.replace('"fastkda::', f'"{name}::'))
    return target


def prefill_call(package, inp, out, final):
    """One prefill of ``inp`` (a bench workload's inputs) through ``package``'s public function, with the inputs'
    ``max_seqlen`` hint as the benchmark passes it, where the package takes one (commits before the hint do not)."""
    hint = ({"max_seqlen": inp.get("max_seqlen")}
            if "max_seqlen" in inspect.signature(package.kda_prefill).parameters else {})
    return lambda: package.kda_prefill(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
        lower_bound=inp["lower_bound"], scale=inp["scale"], initial_state=inp["initial_state"], final_state=final,
        cu_seqlens=inp["cu_seqlens"], out=out, **hint)


def package_runner(commit, inp):
    """``run()``: one prefill of the bench's inputs ``inp`` through ``.ab/fastkda_<commit>`` (made by ``--make``),
    into buffers of its own; for the tools that time or profile a branch's kernels beside this tree's."""
    from fastkda.bench.workloads import LOWER_BOUND

    inp.setdefault("lower_bound", LOWER_BOUND)
    package = importlib.import_module(f"fastkda_{commit}")
    return prefill_call(package, inp, torch.empty_like(inp["v"]), torch.empty_like(inp["initial_state"]))


def decode_call(package, inp, pool, out):
    return lambda: package.kda_decode(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, inp["slots"], A_log=inp["A_log"],
        dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], scale=inp["scale"],
        num_accepted_tokens=inp["accepted"], out=out)


def step_call(package, inp, step, pools, tickets):
    """The layer's decode step (``kda_decode_step``) of a one-token decode workload through ``package``, over the
    state and conv pools ``pools``."""
    pool, conv = pools
    return lambda: package.kda_decode_step(
        step["mixed"], conv, step["conv_weight"], inp["g"][:, 0], inp["beta"][:, 0], step["output_gate"],
        step["norm_weight"], pool, inp["slots"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
        lower_bound=inp["lower_bound"], scale=inp["scale"], tickets=tickets)


def compare(packages, workloads, rounds=2, on_row=lambda rows: None):
    """Rows ``{workload, mode, ms: {package: ms}, equal: {package: bool}}``: the packages' times, interleaved;
    ``on_row(rows)`` after each workload (so that a run cut short keeps what it measured)."""
    from fastkda.bench.timing import time_eager, time_graph
    from fastkda.bench.runners import step_inputs
    from fastkda.bench.workloads import LOWER_BOUND, make_decode_inputs, make_prefill_inputs

    rows = []
    for kind, workload in workloads:
        inp = (make_prefill_inputs if kind == "prefill" else make_decode_inputs)(workload, "cuda")
        inp.setdefault("lower_bound", LOWER_BOUND)
        step = step_inputs(inp) if kind == "step" else None
        calls, results = {}, {}
        for name, package in packages.items():
            if kind == "prefill":
                out, final = torch.empty_like(inp["v"]), torch.empty_like(inp["initial_state"])
                calls[name] = prefill_call(package, inp, out, final)
                calls[name]()
                results[name] = (out, final)
            elif kind == "decode":
                pool, out = inp["pool"].clone(), torch.empty_like(inp["v"])
                start = pool.clone()
                calls[name] = decode_call(package, inp, pool, out)
                pool.copy_(start)
                calls[name]()
                results[name] = (out.clone(), pool.clone())
                pool.copy_(start)
            else:  # the layer's decode step: both pools from the same start for each package
                pools = (inp["pool"].clone(), step["conv_states"].clone())
                tickets = torch.zeros(inp["q"].shape[0] * inp["q"].shape[2], dtype=torch.int32, device="cuda")
                calls[name] = step_call(package, inp, step, pools, tickets)
                results[name] = (calls[name](), *(p.clone() for p in pools))
                for p, start in zip(pools, (inp["pool"], step["conv_states"])):
                    p.copy_(start)
        torch.cuda.synchronize()
        first = next(iter(results))
        equal = {name: all(torch.equal(a, b) for a, b in zip(results[first], results[name])) for name in results}
        label = workload["name"] + (" layer step" if kind == "step" else "")
        for mode, timer in (("graph", time_graph), ("eager", time_eager)):
            best = {name: float("inf") for name in calls}
            order = list(calls)
            for round_index in range(rounds):
                for name in order[round_index % len(order):] + order[:round_index % len(order)]:
                    best[name] = min(best[name], timer(calls[name]))
            rows.append(dict(workload=label, kind=kind, mode=mode, ms={k: round(v, 5) for k, v in
                                                                                  best.items()}, equal=equal))
            line = "  ".join(f"{name} {ms:.4f}" + ("" if name == first else f" ({ms / best[first]:.3f}x)")
                             for name, ms in best.items())
            print(f"[ab] {label:<22} {mode:<5} {line}  bits {'equal' if all(equal.values()) else 'DIFFER'}",
                  flush=True)
        del inp, calls, results
        torch.cuda.empty_cache()
        on_row(rows)
    return rows


def render(path):
    """``path`` (an A/B JSON) as a markdown table beside it: each package's ms and its time over the first
    base's (the last package named on the command line's ``--against`` comes last)."""
    found = json.loads(Path(path).read_text())
    meta, rows = found["meta"], found["rows"]
    names = meta["packages"]
    label = {name: meta.get("current", "current") if name == "current" else name for name in names}
    base = names[1]
    head = ["workload", "mode"] + [f"{label[n]} ms" for n in names] + [f"{label[n]} / {label[base]}" for n in names
                                                                        if n != base] + ["bits"]
    lines = [f"# Same-run A/B, {meta['gpu']}, {meta['date']}, torch {meta['torch']}",
             "", "Median ms (the fastest of the rounds), CUDA-graph replay and eager; packages interleaved in one "
             "process on the same inputs (tools/variants/ab_packages.py). A ratio above 1 is slower than "
             f"{label[base]}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = r["ms"]
        cells = [r["workload"], r["mode"]] + [f"{ms[n]:.4f}" for n in names]
        cells += [f"{ms[n] / ms[base]:.3f}" for n in names if n != base]
        cells.append("equal" if all(r["equal"].values()) else "DIFFER")
        lines.append("| " + " | ".join(cells) + " |")
    Path(path).with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", action="append", default=[], metavar="COMMIT", help="copy a commit's package")
    parser.add_argument("--against", nargs="*", default=[], metavar="COMMIT", help="packages made by --make")
    parser.add_argument("--only", nargs="*", help="workload names (default: every prefill and decode workload)")
    parser.add_argument("--step", action="store_true",
                        help="also the layer's decode step (kda_decode_step) on the one-token decode workloads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="fastkda-results")
    parser.add_argument("--render", metavar="FILE", help="write an A/B JSON's table as markdown, no timing")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    for commit in args.make:
        print(f"made {make_package(commit)}")
    if not args.against:
        return 0
    if not torch.cuda.is_available():
        print("the A/B needs a CUDA GPU", file=sys.stderr)
        return 2
    from fastkda.bench.workloads import load_workloads

    packages = {"current": importlib.import_module("fastkda")}
    packages.update({commit: importlib.import_module(f"fastkda_{commit}") for commit in args.against})
    found = load_workloads()
    workloads = [(kind, w) for kind in ("prefill", "decode") for w in found[kind]
                 if not args.only or w["name"] in args.only]
    if args.step:
        workloads += [("step", w) for kind, w in workloads if kind == "decode" and w["tokens_per_seq"] == 1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from fastkda.bench.report import git_commit

    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                packages=list(packages), current=git_commit(), torch=torch.__version__)
    path = out / f"ab-{'-'.join(args.against)}.json"
    rows = compare(packages, workloads, args.rounds,
                   lambda done: path.write_text(json.dumps(dict(meta=meta, rows=done), indent=1)))
    slower = [(r["workload"], r["mode"], r["ms"]["current"] / r["ms"][c]) for r in rows for c in args.against
              if r["ms"]["current"] > 1.02 * r["ms"][c]]
    print(f"[ab] wrote {path}; {len(slower)} row(s) more than 2% slower than a base: {slower}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bench's results: ``<out>/<date>-<gpu>.json`` (every row), ``.md`` (tables) and ``.png`` (plot).

Each row carries the ``commit`` it measured and the ``run`` it came from (the run's start time and host), so a file
that merges runs (``--append``, ``--merge``) still says where every number came from: where rows of several runs
meet in a table, each row names its run by number and a legend under the tables resolves the numbers.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

PEERS = ("flashkda", "fla", "fla_cp")  # the implementations fastkda's rows are compared with, by name
KERNEL_FIELDS = ("workload",)  # a workload's breakdown is replaced whole: the plan decides which kernels run
ROW_FIELDS = ("workload", "impl", "mode")  # what identifies a timing row
META_FIELDS = ("gpu", "sms", "date", "torch", "triton", "peers")  # the meta render_results reads
RESULT_ROW_FIELDS = ROW_FIELDS + ("group", "ms")  # what render_results reads of every row


def git_commit():
    """The commit measured: ``$FASTKDA_COMMIT`` when set (a copied tree may have no .git, or a stale one), else
    the commit of the git checkout this fastkda is imported from, else "unknown" (an installed package)."""
    if os.environ.get("FASTKDA_COMMIT"):
        return os.environ["FASTKDA_COMMIT"]
    source = Path(__file__).resolve().parents[2]  # the folder that holds the fastkda package
    try:
        top, commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                                     capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"
    return commit if Path(top).resolve() == source else "unknown"


def run_id(now=None):
    """A run's name: its start (UTC, to the second) and the host, e.g. ``2026-12-01T09:30:00Z gpu-host``."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{now.strftime('%Y-%m-%dT%H:%M:%SZ')} {socket.gethostname()}"


def run_of(row):
    """The run a row came from; rows written before runs were recorded are named by their commit."""
    return row.get("run") or f"at {row.get('commit', 'unknown')} (run not recorded)"


def run_numbers(*row_lists):
    """``{run: number}``, numbered from 1 in order of first appearance over the rows."""
    found = {}
    for rows in row_lists:
        for r in rows:
            found.setdefault(run_of(r), len(found) + 1)
    return found


def _tag(row, reference, runs):
    """`` [n]`` after a cell whose row came from another run than the line's ``reference`` row, when runs mix."""
    if len(runs) < 2 or row is None or reference is None or run_of(row) == run_of(reference):
        return ""
    return f" [{runs[run_of(row)]}]"


def results_stem(out_dir, gpu=None):
    """``out_dir/<date>-<gpu>``, the name every results file of today's runs on this GPU starts with."""
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_properties(0).name
    return Path(out_dir) / f"{datetime.date.today().isoformat()}-{gpu.replace(' ', '_')}"


def tool_results_file(out_dir, suffix, **extra):
    """``(path, meta)`` of a device tool's results file (the sweeps, variants and probes under ``tools/``):
    ``out_dir/<date>-<gpu>-<suffix>.json`` (the folder made), and the meta it starts with: the GPU, its SM count,
    the commit measured, the date, and ``extra``."""
    import torch

    props = torch.cuda.get_device_properties(0)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=props.name, sms=props.multi_processor_count, commit=git_commit(),
                date=datetime.date.today().isoformat(), **extra)
    return Path(f"{results_stem(out_dir, props.name)}-{suffix}.json"), meta


def write_tool_results(path, meta, rows):
    """Write a device tool's rows under its meta (:func:`tool_results_file`), as JSON."""
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def earlier_results(out_dir):
    """Today's results file for this GPU (``--append``): ``{"rows": [...], "kernels": [...]}``, empty if none;
    :func:`read_results`'s ``ValueError`` where it is not a results file."""
    path = Path(f"{results_stem(out_dir)}.json")
    found = read_results(path) if path.exists() else {}  # a corrupt file: ValueError, not rows silently lost
    return dict(rows=found.get("rows", []), kernels=found.get("kernels", []))


def run_started(row):
    """When the run a row came from started (the UTC time its run id begins with, :func:`run_id`), or None for a
    row whose run id carries none."""
    try:
        return datetime.datetime.strptime(run_of(row).split(" ")[0], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None


def merge_rows(earlier, later, fields=ROW_FIELDS):
    """For each ``fields`` value (by default (workload, implementation, mode)) the rows of one side: ``later``'s
    where it has any, unless every one of them comes from a run that started before one of ``earlier``'s (files
    merged out of order, e.g. copies of one results file that two calls each appended to); ``earlier``'s where
    ``later`` has none, so a run of some implementations (``--impls``) keeps the others' earlier rows."""
    def key(r):
        return tuple(r[f] for f in fields)

    def latest_starts(rows):  # {key: the latest start of its rows' runs, or None where no run id has one}
        found = {}
        for r in rows:
            started, k = run_started(r), key(r)
            if k not in found or (started is not None and (found[k] is None or started > found[k])):
                found[k] = started
        return found
    earlier_starts, later_starts = latest_starts(earlier), latest_starts(later)

    def earlier_kept(k):
        if k not in later_starts:
            return True
        if k not in earlier_starts:
            return False
        return None not in (earlier_starts[k], later_starts[k]) and earlier_starts[k] > later_starts[k]
    return [r for r in earlier if earlier_kept(key(r))] + [r for r in later if not earlier_kept(key(r))]


def markdown_table(rows, impls, mode, runs=None):
    """One line per workload: each implementation measured in ``mode`` with its ms, the peers' time over
    fastkda's, fastkda's commit and, where rows of several runs mix, the run of fastkda's row (a cell from another
    run names its own)."""
    runs = runs if runs is not None else run_numbers(rows)
    mixed = len(runs) > 1
    by = {(r["workload"], r["impl"]): r for r in rows if r["mode"] == mode}
    names = list(dict.fromkeys(r["workload"] for r in rows))
    impls = [i for i in impls if any(impl == i for _, impl in by)]  # e.g. fla_cp has no graph rows
    peers = [p for p in PEERS if p in impls]
    head = ["workload"] + [f"{i} ms" for i in impls] + [f"vs {p}" for p in peers] + ["commit"]
    head += ["run"] if mixed else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        ours = by.get((n, "fastkda"))
        reference = ours or next((by[(n, i)] for i in impls if (n, i) in by), None)
        cells = [n] + [f"{by[(n, i)]['ms']:.3f}{_tag(by[(n, i)], reference, runs)}" if (n, i) in by else "—"
                       for i in impls]
        for p in peers:
            cells.append(f"{by[(n, p)]['ms'] / ours['ms']:.2f}×" if (n, p) in by and ours else "—")
        cells.append(ours.get("commit", "") if ours else "")
        if mixed:
            cells.append(str(runs[run_of(reference)]) if reference else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(rows, runs=None):
    """Per decode workload, from graph-mode rows: fastkda's KDA-only step (µs, state GB/s read + written, its share
    of the copy rate), the memory floor of its plan and fastkda's ratio to it, the layer's decode step
    (``kda_decode_step``: conv update, KDA, gated norm, fused where its plan says) and the same three ops
    launched one by one, each against the KDA-only step, and FLA; the run
    of a cell whose row came from another run than fastkda's, where rows of several runs mix."""
    runs = runs if runs is not None else run_numbers(rows)
    mixed = len(runs) > 1
    by = {(r["workload"], r["impl"]): r for r in rows}
    lines = ["| workload | fastkda µs | fastkda GB/s | % of copy | floor µs | vs floor | layer step µs | step / KDA | "
             "3 ops µs | 3 ops / KDA | fla µs | fla GB/s | vs fla |" + (" run |" if mixed else ""),
             "|---" * 13 + "|" + ("---|" if mixed else "")]
    for name in dict.fromkeys(r["workload"] for r in rows):
        ours = by.get((name, "fastkda"))

        def us(impl):
            r = by.get((name, impl))
            return f"{r['ms'] * 1e3:.1f}{_tag(r, ours, runs)}" if r else "—"

        def ratio(impl, over):
            a, b = by.get((name, impl)), by.get((name, over))
            return f"{a['ms'] / b['ms']:.2f}×" if a and b else "—"
        peer = by.get((name, "fla"))
        share = f"{100 * ours['gbps'] / ours['copy_gbps']:.0f}%" if ours and ours.get("copy_gbps") else "—"
        line = (f"| {name} | {us('fastkda')} | {ours['gbps'] if ours else '—'} | {share} | {us('floor')} | "
                f"{ratio('fastkda', 'floor')} | {us('fastkda_step')} | {ratio('fastkda_step', 'fastkda')} | "
                f"{us('fastkda_3ops')} | {ratio('fastkda_3ops', 'fastkda')} | {us('fla')} | "
                f"{peer['gbps'] if peer else '—'} | {ratio('fla', 'fastkda')} |")
        if mixed:
            line += f" {runs[run_of(ours or next(r for (w, _), r in by.items() if w == name))]} |"
        lines.append(line)
    return "\n".join(lines)


def kernel_table(kernels, rows, runs=None):
    """One line per workload: each fastkda kernel's ms with its share of the copy rate and of the matrix-product
    rate, their sum, and the call's CUDA-graph time when measured in the same run."""
    from .work import KERNELS

    runs = runs if runs is not None else run_numbers(kernels)
    mixed = len(runs) > 1
    graph = {(r["workload"], run_of(r)): r["ms"] for r in rows if r["impl"] == "fastkda" and r["mode"] == "graph"}
    by = {(k["workload"], k["kernel"]): k for k in kernels}
    lines = ["| workload | s | " + " | ".join(f"{k} ms (% copy, % matmul)" for k in KERNELS) + " | sum ms | graph ms | "
             "commit |" + (" run |" if mixed else ""),
             "|" + "---|" * (len(KERNELS) + 5 + mixed)]
    for name in dict.fromkeys(k["workload"] for k in kernels):
        found = [by[(name, k)] for k in KERNELS if (name, k) in by]
        cells = [f"{by[(name, k)]['ms']:.3f} ({by[(name, k)]['pct_copy']:.0f}%, {by[(name, k)]['pct_matmul']:.0f}%)"
                 f"{_tag(by[(name, k)], found[0], runs)}" if (name, k) in by else "—" for k in KERNELS]
        call = graph.get((name, run_of(found[0])))
        line = (f"| {name} | {found[0]['v_slices']} | " + " | ".join(cells) + f" | {sum(k['ms'] for k in found):.3f} | "
                f"{f'{call:.3f}' if call else '—'} | {found[0].get('commit')} |")
        if mixed:
            line += f" {runs[run_of(found[0])]} |"
        lines.append(line)
    return "\n".join(lines)


def runs_legend(runs, rows):
    """One line per run: its number, its name and the commit(s) its rows measured."""
    commits = {}
    for r in rows:
        commits.setdefault(run_of(r), set()).add(r.get("commit", "unknown"))
    return [f"- [{n}] {run}, commit {', '.join(sorted(commits.get(run, {'unknown'})))}" for run, n in runs.items()]


def plot(rows, impls, path):
    """Bars of each implementation's CUDA-graph ms per workload (log scale), labelled with fastkda's speed-up
    over the faster peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph = [r for r in rows if r["mode"] == "graph"]
    names = list(dict.fromkeys(r["workload"] for r in graph))
    ms = {(r["workload"], r["impl"]): r["ms"] for r in graph}
    impls = [i for i in impls if any(i == impl for _, impl in ms)]
    if not names or not impls:
        return
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs = [j + i * width for j, n in enumerate(names) if (n, impl) in ms]
        ax.bar(xs, [ms[(n, impl)] for n in names if (n, impl) in ms], width, label=impl)
    for j, n in enumerate(names):
        peer_best = min((ms[(n, p)] for p in PEERS if (n, p) in ms), default=None)
        if peer_best and (n, "fastkda") in ms:
            ax.annotate(f"{peer_best / ms[(n, 'fastkda')]:.2f}×", (j, ms[(n, "fastkda")]), ha="center",
                        va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (CUDA-graph replay, log scale)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=45, ha="right", fontsize=7)
    ax.set_title("KDA prefill; label: fastkda speed-up over the faster peer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_results(meta, rows, stem, kernels=()):
    """Write ``stem.json``, ``.md`` and ``.png`` from ``meta``, ``rows`` and the kernel breakdown; returns the
    markdown. The markdown is built before any file is written, so rows it cannot be built from raise without
    leaving a rewritten ``stem.json`` beside a stale ``.md``."""
    from .runners import IMPLS

    kernels = list(kernels)
    prefill_rows = [r for r in rows if r["group"] != "decode"]
    known = [i for i in IMPLS if any(r["impl"] == i for r in prefill_rows)]
    impls = known + [i for i in dict.fromkeys(r["impl"] for r in prefill_rows) if i not in known]
    runs = run_numbers(rows, kernels)
    md = [f"# KDA prefill, {meta['gpu']} ({meta['sms']} SMs), {meta['date']}, commit(s) {', '.join(meta['commits'])}",
          f"torch {meta['torch']}, triton {meta['triton']}, peers {meta['peers']}. Median ms.", ""]
    if meta.get("note"):  # what a reader must know about where the rows came from
        md += [f"Note: {meta['note']}", ""]
    for mode in ("graph", "eager"):
        md += [f"## {mode}", "", markdown_table(prefill_rows, impls, mode, runs), ""]
    measured = {r["impl"]: (r["rel_err"], r["rel_err_state"]) for r in rows if "rel_err" in r}
    if measured:
        md += ["## accuracy (relative L2 vs float64, H=4 T=2048: output, final state)", ""]
        md += [f"- {impl}: {o:.2e}, {s:.2e}" for impl, (o, s) in measured.items()]
    if kernels:  # the rates the rows were measured against, which a later run without them (--no-kernels) keeps
        rates = dict.fromkeys((k.get("copy_gbps", meta.get("copy_gbps")),
                               k.get("matmul_tflops", meta.get("matmul_tflops"))) for k in kernels)
        md += ["", "## where fastkda's time goes (auto plan, torch.profiler; against the copy rate and the bf16 "
               "matrix-product rate measured in the same run: "
               + "; ".join(f"{gbps} GB/s, {tflops} TFLOP/s" for gbps, tflops in rates) + ")", "",
               "Bytes and FLOPs are what each kernel loads, stores and multiplies under the call's plan "
               "(`fastkda.bench.work.kernel_work`); a share of the copy rate above 100% means loads served from L2 "
               "(V-slices re-read the same K-side tiles).", "", kernel_table(kernels, rows, runs)]
    decode = [r for r in rows if r["group"] == "decode" and r["mode"] == "graph"]
    if decode:
        md += ["", "## decode (CUDA graph; % of the device-to-device copy rate measured in the same run; the floor: "
               "each state slice through its slot and back on fastkda's decode plan, `fastkda.bench.floor`)", "",
               decode_table(decode, runs)]
    if len(runs) > 1:
        md += ["", "## runs", "", "Rows of several runs meet in this file; a table's run column and a bracketed "
               "number after a cell name the run a row came from:", ""] + runs_legend(runs, rows + kernels)
    text = "\n".join(md) + "\n"
    with open(f"{stem}.json", "w") as f:  # only now: rows the markdown cannot be built from leave the files be
        json.dump(dict(meta=meta, rows=rows, kernels=kernels), f, indent=1)
    Path(f"{stem}.md").write_text(text)
    try:
        plot(prefill_rows, impls, f"{stem}.png")
    except ImportError:
        print("[bench] matplotlib missing: no plot", file=sys.stderr)
    return text


def write_results(rows, out_dir, errors, run, copy_gbps=None, earlier=None, kernels=(), matmul=None):
    """Write ``<out_dir>/<date>-<gpu>.json/.md/.png`` for this run's ``rows`` and kernel breakdown (each row given
    this ``run`` and the commit), merged after the ``earlier`` results' (``--append``: a (workload,
    implementation, mode) this run measured replaces its earlier row, a workload's breakdown its whole earlier one,
    the others are kept);
    returns the markdown."""
    import importlib.metadata

    import torch

    from .runners import peer_versions

    try:  # a CPU-only torch comes without triton (the bench's own runs are on GPUs, whose torch brings it)
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None

    earlier = earlier or dict(rows=[], kernels=[])
    commit = git_commit()
    for r in rows:
        r.setdefault("commit", commit)
        r.setdefault("run", run)
        if r["impl"] in errors:
            r["rel_err"], r["rel_err_state"] = (round(e, 6) for e in errors[r["impl"]])
    for r in kernels:
        r.setdefault("commit", commit)
        r.setdefault("run", run)
        r.setdefault("copy_gbps", copy_gbps)
        r.setdefault("matmul_tflops", matmul)
    rows = merge_rows(earlier["rows"], rows)
    kernels = merge_rows(earlier["kernels"], kernels, KERNEL_FIELDS)
    props = torch.cuda.get_device_properties(0)
    meta = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton_version,
                commit=commit, commits=sorted({r.get("commit", commit) for r in rows}), run=run,
                runs=list(run_numbers(rows, kernels)), date=datetime.date.today().isoformat(), peers=peer_versions(),
                copy_gbps=copy_gbps, matmul_tflops=matmul)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return render_results(meta, rows, results_stem(out_dir, props.name), kernels)


def read_results(path):
    """A results file's ``{"meta": {...}, "rows": [...], ...}``; ``ValueError`` naming the file where it is missing,
    unreadable, not JSON or not a results file: a meta without :data:`META_FIELDS` or a row without
    :data:`RESULT_ROW_FIELDS`, which :func:`render_results` reads."""
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON (JSONDecodeError) or not UTF-8 text
        raise ValueError(f"cannot read results file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not (isinstance(found, dict) and isinstance(found.get("meta"), dict) and isinstance(found.get("rows"), list)
            and isinstance(found.get("kernels", []), list)):
        raise ValueError(f"{path} is not a results file (a JSON object with \"meta\" and \"rows\")")
    missing = [k for k in META_FIELDS if k not in found["meta"]]
    if missing:
        raise ValueError(f"{path} is not a results file: its meta lacks {', '.join(missing)}")
    for i, r in enumerate(found["rows"]):
        lacks = [k for k in RESULT_ROW_FIELDS if k not in r] if isinstance(r, dict) else ["a JSON object"]
        if lacks:
            raise ValueError(f"{path} is not a results file: row {i} lacks {', '.join(lacks)}")
    return found


def merge_files(earlier_path, later_path):
    """``--merge``: rewrite ``later_path`` (and its .md/.png) with ``earlier_path``'s rows for what it lacks, e.g.
    after a run cut short by a time limit, and for what ``earlier_path`` measured in a newer run
    (:func:`merge_rows`). A file that :func:`read_results` refuses raises its ``ValueError`` before anything is
    written, as does a ``later_path`` not named ``*.json`` (its .md and .png are named by cutting that off)."""
    if not str(later_path).endswith(".json"):
        raise ValueError(f"{later_path} is not a results file: the file rewritten must end in .json")
    earlier, later = (read_results(p) for p in (earlier_path, later_path))
    rows = merge_rows(earlier["rows"], later["rows"])
    kernels = merge_rows(earlier.get("kernels", []), later.get("kernels", []), KERNEL_FIELDS)
    meta = dict(later["meta"], commits=sorted({r["commit"] for r in rows if "commit" in r}),
                runs=list(run_numbers(rows, kernels)))
    return render_results(meta, rows, str(later_path)[:-len(".json")], kernels)

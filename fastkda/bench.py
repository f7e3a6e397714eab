"""Side-by-side benchmark: fastkda (auto plan and s = 1), FLA ``chunk_kda`` and FlashKDA on the same inputs.

``python -m fastkda.bench [--only NAME] [--group G] [--quick] [--out-dir DIR]`` runs the workloads of
``benchmarks/workloads.json`` in eager mode and CUDA-graph replay (median of ``triton.testing.do_bench``),
prints a table and writes ``<date>-<gpu>.json``, ``.md`` and ``.png`` to ``benchmarks/results/``.
Peers are timed when they import; FLA is forced onto its own Triton path (``FLA_FLASH_KDA=0``). After each
workload, fastkda's kernels are timed one by one (``--no-kernels`` skips it) and set against the copy rate and
the bf16 matrix-product rate measured at the start of the run: where the time goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA would otherwise dispatch to FlashKDA when it imports

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "benchmarks" / "workloads.json"
RESULTS = REPO / "benchmarks" / "results"
LOWER_BOUND = -5.0
DIM = 128
ACCURACY_CASE = dict(name="accuracy_H4_T2048", H=4, lengths=[2048], layout="varlen")  # spec §6


def load_workloads(path=WORKLOADS):
    with open(path) as f:
        return json.load(f)


def make_prefill_inputs(workload, device, seed=0):
    """Inputs as the workloads file describes them: randn bf16, A_log/dt_bias ~ U(0,1), fp32 states."""
    gen = torch.Generator(device=device).manual_seed(seed)
    heads, lengths = workload["H"], workload["lengths"]
    varlen = workload["layout"] == "varlen"
    batch, length = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return dict(
        q=randn(batch, length, heads, DIM), k=randn(batch, length, heads, DIM), v=randn(batch, length, heads, DIM),
        g=randn(batch, length, heads, DIM), beta=randn(batch, length, heads),
        A_log=torch.rand(heads, generator=gen, device=device), dt_bias=torch.rand(heads, DIM, generator=gen, device=device),
        initial_state=torch.randn(len(lengths), heads, DIM, DIM, generator=gen, device=device),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device) if varlen else None,
        scale=DIM ** -0.5,
    )


def fastkda_runner(inp, v_slices="auto"):
    from .api import kda_prefill

    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def run():
        kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                    lower_bound=LOWER_BOUND, scale=inp["scale"], initial_state=inp["initial_state"], final_state=final,
                    cu_seqlens=inp["cu_seqlens"], out=out, v_slices=v_slices)
        return out, final
    return run


def fla_runner(inp):
    from fla.ops.kda import chunk_kda

    cu = inp["cu_seqlens"]
    cu_long = cu.long() if cu is not None else None
    cu_cpu = cu_long.cpu() if cu is not None else None
    dt_flat = inp["dt_bias"].reshape(-1)

    def run():
        return chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=inp["scale"],
                         initial_state=inp["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=LOWER_BOUND, state_v_first=True, cu_seqlens=cu_long, cu_seqlens_cpu=cu_cpu,
                         A_log=inp["A_log"], dt_bias=dt_flat)
    return run


def flashkda_runner(inp):
    import flash_kda

    cu = inp["cu_seqlens"].long() if inp["cu_seqlens"] is not None else None
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def run():
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out, inp["A_log"],
                      inp["dt_bias"], LOWER_BOUND, initial_state=inp["initial_state"], final_state=final, cu_seqlens=cu)
        return out, final
    return run


def make_decode_inputs(workload, device, seed=0):
    """One decode step: N sequences x tokens_per_seq tokens, an fp32 pool with one slot per token (plus a
    spare), slots ``[N]`` or ``[N, T]`` and, for T > 1, every draft accepted."""
    gen = torch.Generator(device=device).manual_seed(seed)
    heads, seqs, tokens = workload["H"], workload["N"], workload["tokens_per_seq"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    slots = torch.arange(seqs * tokens, dtype=torch.int32, device=device)
    return dict(
        q=randn(seqs, tokens, heads, DIM), k=randn(seqs, tokens, heads, DIM), v=randn(seqs, tokens, heads, DIM),
        g=randn(seqs, tokens, heads, DIM), beta=randn(seqs, tokens, heads),
        A_log=torch.rand(heads, generator=gen, device=device), dt_bias=torch.rand(heads, DIM, generator=gen, device=device),
        pool=torch.randn(seqs * tokens + 1, heads, DIM, DIM, generator=gen, device=device),
        slots=slots.reshape(seqs, tokens) if tokens > 1 else slots,
        accepted=torch.full((seqs,), tokens, dtype=torch.int32, device=device) if tokens > 1 else None,
        scale=DIM ** -0.5,
    )


def fastkda_decode_runner(inp):
    from .api import kda_decode

    out = torch.empty_like(inp["v"])

    def run():
        return kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"], inp["slots"],
                          A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                          num_accepted_tokens=inp["accepted"], out=out)
    return run


def fla_decode_runner(inp):
    """FLA's fused_recurrent_kda_fwd as vLLM drives it: varlen tokens, pool + ssm_state_indices, in place."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    seqs, tokens, heads, _ = inp["q"].shape
    flat = {x: inp[x].reshape(1, seqs * tokens, *inp[x].shape[2:]) for x in ("q", "k", "v", "g", "beta")}
    cu = torch.arange(0, seqs * tokens + 1, tokens, dtype=torch.long, device=inp["q"].device)

    def run():
        return fused_recurrent_kda_fwd(flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"], A_log=inp["A_log"],
                                       dt_bias=inp["dt_bias"].reshape(-1), initial_state=inp["pool"],
                                       scale=inp["scale"], inplace_final_state=True, state_v_first=True,
                                       cu_seqlens=cu, ssm_state_indices=inp["slots"],
                                       num_accepted_tokens=inp["accepted"], use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                       lower_bound=LOWER_BOUND)
    return run


DECODE_IMPLS = {"fastkda": fastkda_decode_runner, "fla": fla_decode_runner}


def decode_state_bytes(workload):
    """fp32 state bytes one decode step reads and writes (each sequence's state once each way)."""
    return 2 * workload["N"] * workload["H"] * DIM * DIM * 4


def run_decode_benchmark(workloads, impls, modes=("eager", "graph"), device="cuda", copy_gbps=None):
    """Rows for decode workloads, with ``gbps``: state bytes read and written per second, and the copy rate
    measured in the same run."""
    rows = []
    for w in workloads:
        inp = make_decode_inputs(w, device)
        state_bytes = decode_state_bytes(w)
        for name, factory in impls.items():
            try:
                run = factory(inp)
                for mode in modes:
                    ms = time_eager(run) if mode == "eager" else time_graph(run)
                    rows.append(dict(workload=w["name"], group="decode", impl=name, mode=mode, ms=round(ms, 5),
                                     gbps=round(state_bytes / ms / 1e6, 1), copy_gbps=copy_gbps))
                    print(f"[bench] {w['name']} {name} {mode}: {ms * 1e3:.1f} us, {state_bytes / ms / 1e6:.0f} GB/s",
                          flush=True)
            except Exception as exc:  # a peer that does not run here is reported, not fatal
                print(f"[bench] {w['name']} {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return rows


IMPLS = {
    "fastkda": lambda inp: fastkda_runner(inp, "auto"),
    "fastkda_s1": lambda inp: fastkda_runner(inp, 1),
    "flashkda": flashkda_runner,
    "fla": fla_runner,
}


def peer_versions():
    from importlib import metadata

    found = {}
    for impl, dist in (("fla", "fla-core"), ("flashkda", "tokenspeed-flashkda")):
        try:
            found[impl] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def time_eager(run):
    from triton.testing import do_bench

    return do_bench(run, warmup=25, rep=100, return_mode="median")


def capture_graph(run):
    """A CUDA graph holding one call of ``run`` (warmed up on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def time_graph(run, rep_ms=100):
    """Median replay time of a CUDA graph holding one call (replayed for about ``rep_ms``)."""
    from triton.testing import do_bench

    return do_bench(capture_graph(run).replay, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")


def copy_bandwidth_gbps(device="cuda", nbytes=1 << 30):
    """Device-to-device copy rate (bytes read + written per second), the ceiling the decode bar refers to."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return round(2 * nbytes / ms / 1e6, 1)


def matmul_tflops(device="cuda", n=8192):
    """bf16 matrix-product rate (``torch.matmul``, n x n x n), the FLOP ceiling the kernel breakdown refers to."""
    from triton.testing import do_bench

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    return round(2 * n ** 3 / ms / 1e9, 1)


KERNELS = ("prepare", "solve", "recurrence")  # fastkda's kernels, in launch order (``<name>_kernel``)


def kernel_work(workload, v_slices, key_dim=DIM, value_dim=DIM):
    """Bytes each fastkda kernel moves and tensor-core FLOPs it issues in one call (bf16 inputs, fp32 states
    in and out), from the kernels' loads, stores and products: ``{kernel: (bytes, flops)}``. Each chunk's
    products are counted at full chunk size (the kernels compute them so); the solve kernel's 16x16 inverse is
    left out (under 1% of its products when it forms w and u, its only products when the recurrence does)."""
    from .plan import BLOCK, CHUNK, w_u_in_recurrence

    heads, lengths = workload["H"], workload["lengths"]
    rows = heads * sum(lengths)  # (token, head) pairs
    chunks = heads * sum(-(-n // CHUNK) for n in lengths)  # (chunk, head) pairs
    K, V, C, s = key_dim, value_dim, CHUNK, v_slices
    blocks = C // BLOCK
    block_pairs = blocks * (blocks + 1) // 2  # the 16x16 blocks of T on and below the diagonal
    state = len(lengths) * heads * V * K * 4
    prepare = (rows * (3 * K * 2 + 2 + 3 * K * 2 + C * 2 + C * 4) + chunks * K * 4, chunks * 2 * 2 * C * C * K)
    recurrence_flops = chunks * 2 * (3 * C * K + C * C) * V
    if w_u_in_recurrence(V // s, len(lengths) * heads):  # the solve kernel writes T·diag(β) over β·L, and each
        # slice loads it (fp32) with kd and its v columns and forms w (all K columns) and its u columns
        solve = (rows * (C * 4 + 2 + C * 4), 0)
        recurrence = (rows * (s * (3 * K * 2 + C * 2 + C * 4) + V * 2 + V * 2) + chunks * s * K * 4 + 2 * state,
                      recurrence_flops + chunks * 2 * C * C * (s * K + V))
    else:
        solve = (rows * (C * 4 + K * 2 + V * 2 + 2 + K * 2 + V * 2),
                 chunks * block_pairs * 2 * BLOCK * BLOCK * (K + V))
        recurrence = (rows * (s * (3 * K * 2 + C * 2) + V * 2 + V * 2) + chunks * s * K * 4 + 2 * state,
                      recurrence_flops)
    return dict(prepare=prepare, solve=solve, recurrence=recurrence)


def profile_kernels(run, calls, warmup=1):
    """GPU time of every CUDA kernel over ``calls`` calls of ``run`` (torch.profiler, after ``warmup`` calls):
    ``{kernel name: (total µs, launches)}``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    device_us = lambda e: e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total  # noqa: E731
    return {e.key: (device_us(e), e.count) for e in prof.key_averages()
            if e.device_type.name == "CUDA" or device_us(e)}


def kernel_breakdown(inp, workload, copy_gbps, tflops, calls=5):
    """fastkda's per-kernel GPU time (torch.profiler, mean over ``calls`` auto-plan calls), each against the copy
    rate and the bf16 matrix-product rate measured in the same run: rows ``{workload, kernel, ms, gbps,
    pct_copy, tflops, pct_matmul, v_slices}``."""
    from .api import _sms_of
    from .plan import choose_plan

    heads, lengths = workload["H"], workload["lengths"]
    v_slices = choose_plan(len(lengths), heads, inp["q"].shape[1], DIM, DIM, _sms_of(inp["q"]),
                           varlen=inp["cu_seqlens"] is not None).v_slices
    total_us = {name: 0.0 for name in KERNELS}
    for key, (us, _) in profile_kernels(fastkda_runner(inp, "auto"), calls).items():
        for name in KERNELS:
            if f"{name}_kernel" in key:
                total_us[name] += us
    rows = []
    for name, (nbytes, flops) in kernel_work(workload, v_slices).items():
        ms = total_us[name] / calls / 1e3
        if ms <= 0:
            continue
        gbps, rate = nbytes / ms / 1e6, flops / ms / 1e9
        rows.append(dict(workload=workload["name"], kernel=name, v_slices=v_slices, ms=round(ms, 5),
                         gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
                         tflops=round(rate, 1), pct_matmul=round(100 * rate / tflops, 1)))
        print(f"[kernels] {workload['name']} {name}: {ms:.4f} ms, {gbps:.0f} GB/s ({100 * gbps / copy_gbps:.0f}% of "
              f"copy), {rate:.0f} TFLOP/s ({100 * rate / tflops:.0f}% of matmul)", flush=True)
    return rows


def relative_error(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def accuracy(impl_factory, device):
    """Relative L2 error of (output, final state) against the float64 recurrence on the spec §6 case."""
    from .reference import kda_reference

    inp = make_prefill_inputs(ACCURACY_CASE, device, seed=1)
    ref_o, ref_s = kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                 dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"],
                                 initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    o, s = impl_factory(inp)()
    torch.cuda.synchronize()
    return relative_error(o, ref_o), relative_error(s, ref_s)


def git_commit():
    """The commit measured: ``$FASTKDA_COMMIT`` when set (a copied tree's .git may be stale), else git's."""
    if os.environ.get("FASTKDA_COMMIT"):
        return os.environ["FASTKDA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def select(workloads, only=None, group=None, quick=False):
    chosen = [w for w in workloads["prefill"] if (not only or w["name"] in only) and (not group or w["group"] == group)]
    if only:  # in the order asked for, so that a run cut short has measured the ones that matter most
        chosen.sort(key=lambda w: only.index(w["name"]))
    if quick:
        chosen = [w for w in chosen if sum(w["lengths"]) * w["H"] <= 12 * 8192]
    return chosen


def progress(items, desc):
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(items, desc=desc)
        except ImportError:
            pass
    return items


def run_benchmark(workloads, impls, modes=("eager", "graph"), device="cuda"):
    """Rows ``{workload, impl, mode, ms}`` for every workload x available impl x mode."""
    rows, available = [], {}
    for name, factory in impls.items():
        try:
            available[name] = factory
            factory(make_prefill_inputs(dict(H=1, lengths=[64], layout="varlen"), device))()
        except Exception as exc:  # a peer that does not import or run is reported, not fatal
            available.pop(name)
            print(f"[bench] {name} unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    for w in progress(workloads, "workloads"):
        inp = make_prefill_inputs(w, device)
        for name, factory in available.items():
            run = factory(inp)
            for mode in modes:
                try:
                    ms = time_eager(run) if mode == "eager" else time_graph(run)
                except Exception as exc:
                    print(f"[bench] {w['name']} {name} {mode} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    continue
                rows.append(dict(workload=w["name"], group=w["group"], impl=name, mode=mode, ms=round(ms, 4)))
                print(f"[bench] {w['name']} {name} {mode}: {ms:.4f} ms", flush=True)
        del inp
        torch.cuda.empty_cache()
    return rows, list(available)


def markdown_table(rows, impls, mode):
    """One line per workload: each implementation's ms (``*``: measured at another commit than fastkda's row,
    i.e. in an earlier run), the peers' time over fastkda's, and fastkda's commit."""
    names = list(dict.fromkeys(r["workload"] for r in rows))
    ms = {(r["workload"], r["impl"]): r["ms"] for r in rows if r["mode"] == mode}
    row_commit = {(r["workload"], r["impl"]): r.get("commit", "") for r in rows if r["mode"] == mode}
    commit = {r["workload"]: r.get("commit", "") for r in rows if r["impl"] == "fastkda"}
    peers = [p for p in ("flashkda", "fla") if p in impls]
    head = ["workload"] + [f"{i} ms" for i in impls] + [f"vs {p}" for p in peers] + ["commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        earlier = lambda i: "*" if row_commit[(n, i)] != commit.get(n, row_commit[(n, i)]) else ""  # noqa: E731
        cells = [n] + [f"{ms[(n, i)]:.3f}{earlier(i)}" if (n, i) in ms else "—" for i in impls]
        for p in peers:
            ok = (n, p) in ms and (n, "fastkda") in ms
            cells.append(f"{ms[(n, p)] / ms[(n, 'fastkda')]:.2f}×" if ok else "—")
        lines.append("| " + " | ".join(cells + [commit.get(n, "")]) + " |")
    return "\n".join(lines)


def decode_table(rows):
    """µs per step, state GB/s (read + written) and its share of the copy rate, per implementation, from
    graph-mode decode rows."""
    by = {(r["workload"], r["impl"]): r for r in rows}
    lines = ["| workload | fastkda µs | fastkda GB/s | % of copy | fla µs | fla GB/s | vs fla |",
             "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["workload"] for r in rows):
        ours, peer = by.get((name, "fastkda")), by.get((name, "fla"))
        cell = lambda r, key, f: f(r[key]) if r else "—"  # noqa: E731
        ratio = f"{peer['ms'] / ours['ms']:.2f}×" if ours and peer else "—"
        share = f"{100 * ours['gbps'] / ours['copy_gbps']:.0f}%" if ours and ours.get("copy_gbps") else "—"
        lines.append(f"| {name} | {cell(ours, 'ms', lambda x: f'{x * 1e3:.1f}')} | {cell(ours, 'gbps', str)} | {share} | "
                     f"{cell(peer, 'ms', lambda x: f'{x * 1e3:.1f}')} | {cell(peer, 'gbps', str)} | {ratio} |")
    return "\n".join(lines)


def kernel_table(kernels, rows):
    """One line per workload: each fastkda kernel's ms with its share of the copy rate and of the matrix-product
    rate, their sum, and the call's CUDA-graph time when measured at the same commit."""
    graph = {(r["workload"], r.get("commit")): r["ms"] for r in rows if r["impl"] == "fastkda" and r["mode"] == "graph"}
    by = {(k["workload"], k["kernel"]): k for k in kernels}
    lines = ["| workload | s | " + " | ".join(f"{k} ms (% copy, % matmul)" for k in KERNELS) + " | sum ms | graph ms | commit |",
             "|" + "---|" * (len(KERNELS) + 5)]
    for name in dict.fromkeys(k["workload"] for k in kernels):
        found = [by[(name, k)] for k in KERNELS if (name, k) in by]
        cells = [f"{by[(name, k)]['ms']:.3f} ({by[(name, k)]['pct_copy']:.0f}%, {by[(name, k)]['pct_matmul']:.0f}%)"
                 if (name, k) in by else "—" for k in KERNELS]
        commit = found[0].get("commit")
        call = graph.get((name, commit))
        lines.append(f"| {name} | {found[0]['v_slices']} | " + " | ".join(cells) +
                     f" | {sum(k['ms'] for k in found):.3f} | {f'{call:.3f}' if call else '—'} | {commit} |")
    return "\n".join(lines)


def plot(rows, impls, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph = [r for r in rows if r["mode"] == "graph"]
    names = list(dict.fromkeys(r["workload"] for r in graph))
    ms = {(r["workload"], r["impl"]): r["ms"] for r in graph}
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs = [j + i * width for j, n in enumerate(names) if (n, impl) in ms]
        ax.bar(xs, [ms[(n, impl)] for n in names if (n, impl) in ms], width, label=impl)
    for j, n in enumerate(names):
        peer_best = min((ms[(n, p)] for p in ("flashkda", "fla") if (n, p) in ms), default=None)
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


def results_stem(out_dir):
    """``out_dir/<date>-<gpu>``, the name every results file of today's runs on this GPU starts with."""
    props = torch.cuda.get_device_properties(0)
    return out_dir / f"{datetime.date.today().isoformat()}-{props.name.replace(' ', '_')}"


def earlier_results(out_dir):
    """Today's results file for this GPU (``--append``): ``{"rows": [...], "kernels": [...]}``, empty if none."""
    path = Path(f"{results_stem(out_dir)}.json")
    found = json.loads(path.read_text()) if path.exists() else {}
    return dict(rows=found.get("rows", []), kernels=found.get("kernels", []))


def merge_rows(earlier, later, fields=("workload", "impl", "mode")):
    """``later``'s rows, after ``earlier``'s rows for the ``fields`` values (by default (workload, implementation,
    mode)) that ``later`` did not measure: a run of some implementations (``--impls``) keeps the others' earlier
    rows of the same workload."""
    key = lambda r: tuple(r[f] for f in fields)  # noqa: E731
    measured = {key(r) for r in later}
    return [r for r in earlier if key(r) not in measured] + list(later)


KERNEL_FIELDS = ("workload", "kernel")  # what identifies a kernel-breakdown row


def render_results(meta, rows, stem, kernels=()):
    """Write ``stem.json``, ``.md`` and ``.png`` from ``meta``, ``rows`` and the kernel breakdown; returns the
    markdown."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows if r["group"] != "decode")]
    with open(f"{stem}.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, kernels=list(kernels)), f, indent=1)
    md = [f"# KDA prefill, {meta['gpu']} ({meta['sms']} SMs), {meta['date']}, commit(s) {', '.join(meta['commits'])}",
          f"torch {meta['torch']}, triton {meta['triton']}, peers {meta['peers']}. Median ms.", ""]
    if meta.get("note"):  # what a reader must know about where the rows came from
        md += [f"Note: {meta['note']}", ""]
    prefill_rows = [r for r in rows if r["group"] != "decode"]
    for mode in ("graph", "eager"):
        md += [f"## {mode}", "", markdown_table(prefill_rows, impls, mode), ""]
    md += ["\\* measured at another commit than the fastkda row beside it (an earlier run; each JSON row has its "
           "commit).", ""]
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
               "Bytes and FLOPs are what each kernel loads, stores and multiplies (`fastkda.bench.kernel_work`); "
               "a share of the copy rate above 100% means loads served from L2 (V-slices re-read the same "
               "K-side tiles).", "", kernel_table(kernels, rows)]
    decode = [r for r in rows if r["group"] == "decode" and r["mode"] == "graph"]
    if decode:
        md += ["", "## decode (CUDA graph; % of the device-to-device copy rate measured in the same run)", "",
               decode_table(decode)]
    text = "\n".join(md) + "\n"
    Path(f"{stem}.md").write_text(text)
    try:
        plot(prefill_rows, impls, f"{stem}.png")
    except ImportError:
        print("[bench] matplotlib missing: no plot", file=sys.stderr)
    return text


def write_results(rows, out_dir, errors, copy_gbps=None, earlier=None, kernels=(), matmul=None):
    """Write ``<date>-<gpu>.json/.md/.png`` for this run's ``rows`` and kernel breakdown merged after the
    ``earlier`` results' (``--append``: a (workload, implementation, mode) or (workload, kernel) this run measured
    replaces its earlier row, the others are kept); returns the markdown."""
    earlier = earlier or dict(rows=[], kernels=[])
    import triton

    commit = git_commit()
    for r in rows:
        r.setdefault("commit", commit)
        if r["impl"] in errors:
            r["rel_err"], r["rel_err_state"] = (round(e, 6) for e in errors[r["impl"]])
    for r in kernels:
        r.setdefault("commit", commit)
        r.setdefault("copy_gbps", copy_gbps)
        r.setdefault("matmul_tflops", matmul)
    rows = merge_rows(earlier["rows"], rows)
    kernels = merge_rows(earlier["kernels"], kernels, KERNEL_FIELDS)
    props = torch.cuda.get_device_properties(0)
    meta = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                commit=commit, commits=sorted({r.get("commit", commit) for r in rows}),
                date=datetime.date.today().isoformat(), peers=peer_versions(), copy_gbps=copy_gbps,
                matmul_tflops=matmul)
    out_dir.mkdir(parents=True, exist_ok=True)
    return render_results(meta, rows, results_stem(out_dir), kernels)


def merge_files(earlier_path, later_path):
    """``--merge``: rewrite ``later_path`` (and its .md/.png) with ``earlier_path``'s rows for the workloads it
    lacks, e.g. after a run cut short by a time limit."""
    earlier, later = (json.loads(Path(p).read_text()) for p in (earlier_path, later_path))
    rows = merge_rows(earlier["rows"], later["rows"])
    kernels = merge_rows(earlier.get("kernels", []), later.get("kernels", []), KERNEL_FIELDS)
    meta = dict(later["meta"], commits=sorted({r["commit"] for r in rows if "commit" in r}))
    return render_results(meta, rows, str(later_path)[:-len(".json")], kernels)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="workload names to run")
    parser.add_argument("--group", help="run one group (low_parallelism, long_sequence, high_parallelism)")
    parser.add_argument("--quick", action="store_true", help="only the small workloads")
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), help="implementations to time")
    parser.add_argument("--workloads", default=str(WORKLOADS))
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--no-decode", action="store_true", help="skip the decode workloads")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip fastkda's per-kernel breakdown (torch.profiler) after each workload")
    parser.add_argument("--append", action="store_true",
                        help="keep today's earlier rows for the workloads this run does not measure")
    parser.add_argument("--merge", nargs=2, metavar=("EARLIER", "LATER"),
                        help="no timing: add EARLIER.json's rows for the workloads LATER.json lacks, re-render LATER")
    args = parser.parse_args(argv)
    if args.merge:
        print(merge_files(*args.merge))
        return 0
    if not torch.cuda.is_available():
        print("fastkda.bench needs a CUDA GPU; `python -m fastkda demo` runs the CPU path.", file=sys.stderr)
        return 2
    workloads = load_workloads(args.workloads)
    chosen = select(workloads, args.only, args.group, args.quick)
    impls = {k: IMPLS[k] for k in args.impls}
    copy_gbps = copy_bandwidth_gbps()
    print(f"[bench] device-to-device copy: {copy_gbps} GB/s", flush=True)
    breakdown = "fastkda" in impls and not args.no_kernels
    matmul = matmul_tflops() if breakdown else None
    if breakdown:
        print(f"[bench] bf16 matrix product: {matmul} TFLOP/s", flush=True)
    decode = [] if args.no_decode else [d for d in workloads.get("decode", []) if not args.only or d["name"] in args.only]
    out_dir = Path(args.out_dir)
    earlier = earlier_results(out_dir) if args.append else None
    rows, kernels = [], []
    if decode:  # first: small, and their peer compiles in seconds
        rows += run_decode_benchmark(decode, {k: v for k, v in DECODE_IMPLS.items() if k in ("fastkda", "fla")},
                                     copy_gbps=copy_gbps)
        write_results(rows, out_dir, {}, copy_gbps, earlier)
    errors = {}
    for impl, factory in impls.items() if chosen else ():  # before the timings: a run cut short still has them
        try:
            errors[impl] = accuracy(factory, "cuda")
            print(f"[bench] accuracy {impl}: output {errors[impl][0]:.2e}, state {errors[impl][1]:.2e}", flush=True)
        except Exception as exc:
            print(f"[bench] {impl} accuracy not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
    available = list(impls)
    results = lambda: write_results(rows, out_dir, errors, copy_gbps, earlier, kernels, matmul)  # noqa: E731
    for w in chosen:  # results are rewritten after every workload, so a run cut short still leaves them
        new_rows, available = run_benchmark([w], {k: impls[k] for k in available})
        rows += new_rows
        if breakdown:
            kernels += kernel_breakdown(make_prefill_inputs(w, "cuda"), w, copy_gbps, matmul)
            torch.cuda.empty_cache()
        results()
    print(results())
    return 0


if __name__ == "__main__":
    sys.exit(main())

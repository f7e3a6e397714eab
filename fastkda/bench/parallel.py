"""``python -m fastkda.bench.parallel``: KDA across processes, scaling from one process to ``--world``.

Two workloads, each at every world size from 1 to ``--world`` (processes of one machine, spawned here):
- context parallelism (:func:`fastkda.distributed.context_parallel_prefill`): one sequence of ``--tokens`` tokens
  at ``--heads`` heads, split evenly over the ranks;
- tensor parallelism (:class:`fastkda.layers.TensorParallelKimiDeltaAttention`): the layer's packed prefill of the
  chunked mix's lengths (scaled by ``--scale``), its heads split over the ranks.

``--one-device`` measures instead, on this one device and without a process group, what context parallelism's
scaling is made of: the single-device prefill of the whole sequence (:func:`fastkda.kda_prefill`, its automatic
plan), and for each of ``--worlds`` the work of one rank of that many (a part of ``--tokens / world`` tokens: the
first half of :func:`fastkda.kda_prefill_open`, the composition of an entry state from ``world − 1`` maps, and the
second half), so that ``scaling`` is the whole prefill's time over ``world`` times a rank's: what NCCL runs would
reach but for the one all-gather of each rank's map (``H·(K + V)·K`` fp32 values).

Each call is timed on every rank between barriers (the slowest rank's time, as a caller sees it), median of
``--repeats``; the rows give ms per call, tokens per second per rank and the scaling against one process
(tokens/s per rank over one process's tokens/s: 1.0 is linear). NCCL over the machine's GPUs where it
has ``--world`` of them, else gloo on the CPU (whose "scaling" shares one machine's cores: a correctness run of
the machinery, not a measurement of it). Writes ``OUT/<date>-<device>-parallel.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .arguments import positive_float, positive_int, supported_head_dim
from .models import device_name
from .report import git_commit, run_id
from .workloads import load_workloads


def free_port():
    """A TCP port free on this host now, for a process group's rendezvous (``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(run, device, repeats, between_barriers=True):
    """Median ms of ``run`` over ``repeats`` calls after a warm-up one, synchronised around each and, in a process
    group, each between barriers."""
    run()
    times = []
    for _ in range(repeats):
        if between_barriers:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if between_barriers:
            dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _context_call(args, rank, world, device):
    from ..distributed import context_parallel_prefill

    part = args.tokens // world
    inputs, gate = _sequence_part(args, part, device)
    return lambda: context_parallel_prefill(*inputs, **gate), part * world


def _tensor_call(args, rank, world, device):
    from ..cache import KDACache
    from ..layers import KimiDeltaAttention, TensorParallelKimiDeltaAttention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    whole = KimiDeltaAttention(args.hidden, args.heads, args.dim, lower_bound=-5.0, device=device, dtype=dtype)
    layer = TensorParallelKimiDeltaAttention.from_unsharded(whole) if world > 1 else whole
    mix = next(w for w in load_workloads()["prefill"] if w["name"] == "H12_chunked_mix")
    lengths = [max(1, round(n * args.scale)) for n in mix["lengths"]]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), args.hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    cache = KDACache(len(lengths), 1, args.heads // world, args.dim, 3 * args.heads // world * args.dim, 4,
                     device=device)
    slots = cache.allocate(len(lengths))

    def run():
        with torch.no_grad():
            return layer(x, cache, slots=slots, cu_seqlens=cu, max_seqlen=max(lengths),
                         has_initial_state=torch.zeros(len(lengths), dtype=torch.bool, device=device))
    return run, sum(lengths)


WORKLOADS = {"context": _context_call, "tensor": _tensor_call}


def _sequence_part(args, tokens, device):
    """Random inputs of one sequence's ``tokens`` tokens (bf16 on a GPU) and the lower-bound gate's keywords."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    inputs = [randn(1, tokens, args.heads, args.dim) for _ in range(4)] + [randn(1, tokens, args.heads)]
    gate = dict(A_log=torch.rand(args.heads, device=device), dt_bias=torch.rand(args.heads, args.dim, device=device),
                lower_bound=-5.0)
    return inputs, gate


def _whole_prefill_ms(args, device):
    """Median ms of the single-device prefill of the whole ``--tokens`` sequence."""
    from ..api import kda_prefill

    inputs, gate = _sequence_part(args, args.tokens, device)
    return _timed(lambda: kda_prefill(*inputs, **gate), device, args.repeats, between_barriers=False)


def _rank_work_ms(args, world, device):
    """Median ms of one rank's work among ``world``: the open-entry prefill of its part, its entry composed from
    ``world − 1`` maps, and the second half from it."""
    from ..api import kda_prefill_open
    from ..distributed.context import apply_map

    inputs, gate = _sequence_part(args, args.tokens // world, device)
    earlier = torch.randn(world, args.heads, 2 * args.dim, args.dim, device=device) * 0.01  # exit maps [ℬᵀ; 𝒜ᵀ]

    def rank_work():
        opened = kda_prefill_open(*inputs, **gate)
        entry = earlier[0, :, :args.dim]  # the first rank's exit state
        for exit_map in earlier[1:world - 1]:  # the ranks between it and this one, as context.py composes them
            entry = apply_map(entry, exit_map[:, args.dim:], exit_map[:, :args.dim])
        return opened.finish(entry[None].contiguous())
    return _timed(rank_work, device, args.repeats, between_barriers=False)


def one_device_rows(args, device):
    """The ``--one-device`` rows (module docstring): the whole sequence's prefill, then one rank's work per world."""
    ms = _whole_prefill_ms(args, device)
    rows = [dict(workload="prefill", world=1, ms=round(ms, 4), tokens=args.tokens,
                 tokens_per_s_per_rank=round(args.tokens / ms * 1e3, 1))]
    for world in args.worlds:
        part = args.tokens // world
        ms = _rank_work_ms(args, world, device)
        rows.append(dict(workload="context rank", world=world, ms=round(ms, 4), tokens=part * world,
                         tokens_per_s_per_rank=round(part / ms * 1e3, 1)))
        print(f"[parallel] {rows[-1]}", flush=True)
    for r in rows:
        r["scaling"] = round(r["tokens_per_s_per_rank"] / rows[0]["tokens_per_s_per_rank"], 3)
    return rows


def _rank_main(rank, world, port, backend, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        for name in args.workloads:
            run, tokens = WORKLOADS[name](args, rank, world, device)
            ms = _timed(run, device, args.repeats)
            if rank == 0:
                results.put(dict(workload=name, world=world, ms=round(ms, 4), tokens=tokens,
                                 tokens_per_s_per_rank=round(tokens / ms * 1e3 / world, 1)))
    finally:
        dist.destroy_process_group()


def process_rows(args, backend):
    """The rows of every workload at each world size from 1 to ``--world`` (processes spawned here), scaling
    against the workload's one-process row."""
    results = mp.get_context("spawn").SimpleQueue()
    rows = []
    for world in range(1, args.world + 1):
        chosen = [name for name in args.workloads if name != "tensor" or args.heads % world == 0]
        if chosen != args.workloads:
            print(f"[parallel] world {world}: {args.heads} heads do not split, tensor parallelism skipped", flush=True)
        spawned = argparse.Namespace(**{**vars(args), "workloads": chosen})
        mp.spawn(_rank_main, args=(world, free_port(), backend, spawned, results), nprocs=world, join=True)
        while not results.empty():
            rows.append(results.get())
            print(f"[parallel] {rows[-1]}", flush=True)
    single = {r["workload"]: r["tokens_per_s_per_rank"] for r in rows if r["world"] == 1}
    for r in rows:
        r["scaling"] = round(r["tokens_per_s_per_rank"] / single[r["workload"]], 3) if r["workload"] in single else None
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastkda.bench.parallel", description=__doc__.split("\n\n")[0])
    on_gpu = torch.cuda.is_available()
    parser.add_argument("--world", type=positive_int, default=torch.cuda.device_count() if on_gpu else 2,
                        help="the largest world size (default: the GPUs here, or 2 CPU processes)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="default: all (not with --one-device)")
    parser.add_argument("--tokens", type=positive_int, help="context parallelism's sequence length (default 1048576 on "
                                                   "GPUs, 4096 on the CPU)")
    parser.add_argument("--heads", type=positive_int, default=12)
    parser.add_argument("--dim", type=supported_head_dim, help="K = V (default 128 on GPUs, 64 on the CPU)")
    parser.add_argument("--hidden", type=positive_int, help="the layer's width (default 2048 on GPUs, 256 on the CPU)")
    parser.add_argument("--scale", type=positive_float,
                        help="the chunked mix's lengths times this (default 1; 0.1 on the CPU)")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--one-device", action="store_true",
                        help="context parallelism's parts one after another on this one device (module docstring)")
    parser.add_argument("--worlds", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="world sizes whose rank's work --one-device measures")
    parser.add_argument("--out", default="fastkda-results")
    args = parser.parse_args(argv)
    if args.one_device and args.workloads:
        parser.error("--workloads does not apply to --one-device (which times context parallelism's parts alone)")
    args.workloads = args.workloads or list(WORKLOADS)
    if args.one_device:
        backend, gpu = "one device", on_gpu
    else:
        backend = "nccl" if on_gpu and torch.cuda.device_count() >= args.world else "gloo"
        gpu = backend == "nccl"
    args.tokens = args.tokens or (1 << 20 if gpu else 4096)
    largest = max(args.worlds) if args.one_device else args.world
    if args.tokens < largest:  # every rank needs a part of the sequence
        parser.error(f"--tokens {args.tokens} is fewer than the world size {largest}: every rank needs a token")
    args.dim = args.dim or (128 if gpu else 64)
    args.hidden = args.hidden or (2048 if gpu else 256)
    args.scale = args.scale if args.scale is not None else 1.0 if gpu else 0.1
    if args.one_device:
        rows = one_device_rows(args, torch.device("cuda" if gpu else "cpu"))
    else:
        rows = process_rows(args, backend)
    device = torch.device("cuda") if gpu else torch.device("cpu")
    meta = dict(backend=backend, device=device_name(device), commit=git_commit(), run=run_id(),
                date=datetime.date.today().isoformat(), **{k: getattr(args, k) for k in
                                                          ("tokens", "heads", "dim", "hidden", "scale", "repeats")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-one-device" if args.one_device else ""
    stem = out / f"{meta['date']}-{meta['device'].replace(' ', '_')}-parallel{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# KDA across processes, {meta['device']} ({backend}), {meta['date']}, commit {meta['commit']}", "",
             f"Context parallelism: one sequence of {args.tokens} tokens at H = {args.heads}, D = {args.dim}. Tensor "
             f"parallelism: the layer's prefill of the chunked mix ×{args.scale}, hidden {args.hidden}. Median ms "
             "between barriers; scaling = tokens/s per rank against one process's (1.0 is linear)."
             + (" One device (--one-device): a rank's work alone, scaling against the whole sequence's single-device "
                "prefill (the `prefill` row), without the exchange." if args.one_device else ""), "",
             "| workload | world | ms | tokens/s per rank | scaling |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['world']} | {r['ms']:.3f} | {r['tokens_per_s_per_rank']:.0f} | "
              f"{r['scaling'] if r['scaling'] is not None else '—'} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"[parallel] wrote {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

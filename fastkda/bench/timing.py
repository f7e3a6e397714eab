"""How the bench measures: eager and CUDA-graph medians, the device's ceilings, and per-kernel GPU time.

Eager and graph times are medians of ``triton.testing.do_bench`` (which flushes L2 before each call). The ceilings
each run measures at its start, the device-to-device copy rate and the bf16 matrix-product rate, are what the
decode rows and the kernel breakdown are set against.
"""

from __future__ import annotations

import statistics
import time

import torch


def _do_bench(fn, warmup, rep):
    from triton.testing import do_bench  # Triton comes with CUDA builds of torch; --help and --merge need none

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_eager(run):
    """Median ms of plain calls of ``run``."""
    return _do_bench(run, 25, 100)


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
    """Median ms of a CUDA-graph replay of one call of ``run`` (replayed for about ``rep_ms``)."""
    return _do_bench(capture_graph(run).replay, max(rep_ms // 4, 5), rep_ms)


def time_mode(run, mode):
    """Median ms of ``run`` in ``mode``: "eager" or "graph"."""
    if mode not in ("eager", "graph"):
        raise ValueError(f"mode must be 'eager' or 'graph', got {mode!r}")
    return time_eager(run) if mode == "eager" else time_graph(run)


def copy_bandwidth_gbps(device="cuda", nbytes=1 << 30):
    """Device-to-device copy rate (bytes read + written per second), the ceiling the decode rows refer to."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = _do_bench(lambda: dst.copy_(src), 10, 50)
    return round(2 * nbytes / ms / 1e6, 1)


def matmul_tflops(device="cuda", n=8192):
    """bf16 matrix-product rate (``torch.matmul``, n x n x n), the FLOP ceiling the kernel breakdown refers to."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _do_bench(lambda: a @ b, 10, 50)
    return round(2 * n ** 3 / ms / 1e9, 1)


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

    def device_us(event):
        return event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return {e.key: (device_us(e), e.count) for e in prof.key_averages()
            if e.device_type.name == "CUDA" or device_us(e)}


def synced_median_ms(run, device, repeats, before=None):
    """Median ms of ``repeats`` calls of ``run``, each timed on the host between CUDA synchronisations (on a CPU
    device, plainly), ``before()`` (untimed) ahead of each: for end-to-end work (a model's forward, a layer's steps)
    that holds Python between its kernels."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

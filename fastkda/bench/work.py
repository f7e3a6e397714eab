"""Where fastkda's time goes: the bytes and FLOPs each kernel of a call moves and issues (a model read from the
kernels' loads, stores and products, for the plan the call runs with), and each kernel's measured time against
the copy rate and the matrix-product rate measured in the same run.
"""

from __future__ import annotations

from .workloads import DIM, state_dtype

KERNELS = ("prepare", "solve", "transition", "scan", "recurrence")  # fastkda's prefill kernels in launch order
# (``<name>_kernel``; transition and scan under sequence parallelism only)


def plan_for_inputs(inp, sms=None, v_slices="auto", sequence_parallel="auto"):
    """The :class:`fastkda.PrefillPlan` ``fastkda.kda_prefill`` makes for the bench's inputs ``inp`` (same facts:
    sequences, heads, ``seq_len = q.shape[1]``, K, V, the device's SM count unless ``sms`` is given, varlen when
    there are ``cu_seqlens`` with the inputs' ``max_seqlen`` hint, the lower-bound gate, whether the GPU runs
    Hopper's warpgroup MMA)."""
    from ..api import _sms_of, _warpgroup_mma_of
    from ..plan import choose_plan

    q, cu = inp["q"], inp["cu_seqlens"]
    num_seqs = cu.numel() - 1 if cu is not None else q.shape[0]
    return choose_plan(num_seqs, q.shape[2], q.shape[1], q.shape[3], inp["v"].shape[3],
                       _sms_of(q) if sms is None else sms, varlen=cu is not None, lower_bound_gate=True,
                       v_slices=v_slices, sequence_parallel=sequence_parallel, max_seqlen=inp.get("max_seqlen"),
                       warpgroup_mma=_warpgroup_mma_of(q))


def lower_row_bytes(chunk, itemsize, sector=32):
    """Mean bytes a row of a ``[chunk, chunk]`` lower-triangular matrix moves when only the sectors up to the
    diagonal's are written and read (``fastkda.ops.tiles.lower_sectors``): row i takes ``i // S + 1`` sectors of S
    elements."""
    per_sector = sector // itemsize
    return sum(i // per_sector + 1 for i in range(chunk)) * sector / chunk


def kernel_work(workload, plan):
    """Bytes each fastkda kernel moves and tensor-core FLOPs it issues in one call of ``workload`` under ``plan``
    (bf16 inputs, fp32 states in and out): ``{kernel: (bytes, flops)}``. The chunk and the V-slices come from the
    plan. Each chunk's products are counted at full chunk size (the kernels compute them so); the solve kernel's
    16x16 inverse, its only products, is left out (under the plan's ``inverse_in_prepare`` its bytes are the first
    kernel's, and there is no solve entry)."""
    heads, lengths = workload["H"], workload["lengths"]
    if (heads, len(lengths)) != (plan.heads, plan.num_seqs):
        raise ValueError(f"the plan is for {plan.num_seqs} sequence(s) of {plan.heads} heads, the workload has "
                         f"{len(lengths)} of {heads}")
    K, V, C, s = plan.key_dim, plan.value_dim, plan.chunk, plan.v_slices
    rows = heads * sum(lengths)  # (token, head) pairs
    chunks = heads * sum(-(-n // C) for n in lengths)  # (chunk, head) pairs
    state = len(lengths) * heads * V * K * 4
    # the in-chunk matrices M (bf16) and β·L, then T·diag(β) (fp32) move their rows' sectors up to the diagonal; the
    # first kernel writes whole rows of varlen inputs under the lower-bound gate
    m_row, t_row = lower_row_bytes(C, 2), lower_row_bytes(C, 4)
    written = C * 2 + C * 4 if plan.varlen and plan.lower_bound_gate else m_row + t_row
    prepare = (rows * (3 * K * 2 + 2 + 3 * K * 2 + written) + chunks * K * 4, chunks * 2 * 2 * C * C * K)
    recurrence_flops = chunks * 2 * (3 * C * K + C * C) * V
    # the solve kernel reads β·L and writes T·diag(β) over it; each slice loads T and M with kd, qg, kg and its v
    # columns
    solve = (rows * (2 * t_row + 2), 0)
    recurrence = (rows * (s * (3 * K * 2 + m_row + t_row) + V * 2 + V * 2) + chunks * s * K * 4 + 2 * state,
                  recurrence_flops + chunks * 2 * 2 * C * C * V)  # v_new = T·β·Y as two bf16 products (hi + lo)
    work = dict(prepare=prepare, solve=solve)
    if plan.inverse_in_prepare:  # the first kernel does the solve's work, and no solve kernel runs
        work = dict(prepare=(prepare[0] + solve[0], prepare[1]))
    if plan.sequence_parallel:  # every segment but each sequence's last runs once more, over V + K columns
        L = plan.segment_tokens
        segments = heads * sum(-(-n // L) for n in lengths)
        moved = heads * sum(n - (n - 1) // L * L for n in lengths if n)  # the tokens of the last segments
        rows_t, chunks_t = rows - moved, chunks - heads * sum(-(-(n - (n - 1) // L * L) // C) for n in lengths if n)
        columns = V + K
        work["transition"] = (rows_t * (columns // plan.transition_width * (2 * K * 2 + C * 4) + V * 2)
                              + chunks_t * columns // plan.transition_width * K * 4 + segments * columns * K * 4,
                              chunks_t * 2 * (2 * C * K + 2 * C * C) * columns)
        work["scan"] = (segments * (columns * K * 4 + 2 * V * K * 4), segments * 2 * K * K * V)
        recurrence = (recurrence[0] + segments * V * K * 4, recurrence[1])
    work["recurrence"] = recurrence
    return work


def decode_state_bytes(workload):
    """State bytes one decode step reads and writes: each sequence's state once each way, in the pool's dtype."""
    return 2 * workload["N"] * workload["H"] * DIM * DIM * state_dtype(workload).itemsize


def kernel_breakdown(inp, workload, copy_gbps, tflops, calls=5):
    """fastkda's per-kernel GPU time (torch.profiler, mean over ``calls`` calls under the automatic plan), each
    against the copy rate and the bf16 matrix-product rate measured in the same run: rows ``{workload, kernel,
    v_slices, ms, gbps, pct_copy, tflops, pct_matmul}``."""
    from .runners import fastkda_runner
    from .timing import profile_kernels

    plan = plan_for_inputs(inp)
    total_us = {name: 0.0 for name in KERNELS}
    for key, (us, _) in profile_kernels(fastkda_runner(inp, plan=plan), calls).items():
        for name in KERNELS:
            if f"{name}_kernel" in key:
                total_us[name] += us
    rows = []
    for name, (nbytes, flops) in kernel_work(workload, plan).items():
        ms = total_us[name] / calls / 1e3
        if ms <= 0:
            continue
        gbps, rate = nbytes / ms / 1e6, flops / ms / 1e9
        rows.append(dict(workload=workload["name"], kernel=name, v_slices=plan.v_slices, ms=round(ms, 5),
                         gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
                         tflops=round(rate, 1), pct_matmul=round(100 * rate / tflops, 1)))
        print(f"[kernels] {workload['name']} {name}: {ms:.4f} ms, {gbps:.0f} GB/s ({100 * gbps / copy_gbps:.0f}% of "
              f"copy), {rate:.0f} TFLOP/s ({100 * rate / tflops:.0f}% of matmul)", flush=True)
    return rows

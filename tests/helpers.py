"""Random KDA inputs, plans and error measures shared by the tests."""

import pytest
import torch

import fastkda
import interpreter

LOWER_BOUND = -5.0
needs_interpreter = pytest.mark.skipif(
    not interpreter.active(),
    reason=interpreter.unavailable_reason() or "a GPU runs the kernels natively here (tests/test_gpu.py)")


def make_inputs(lengths, heads=2, key_dim=64, value_dim=None, varlen=True, gate="lower_bound", seed=0,
                device="cpu", state_dtype=torch.float32, with_initial=True, cu_dtype=torch.int32):
    """Fresh randn inputs (bf16 like the operator's callers). ``gate``: "lower_bound", "precomputed" (log-decay in
    (-3, 0] with 5% of entries at -1e4) or "weak" (precomputed log-decay in (-0.02, 0]: a state that outlives
    many chunks, so that sequence parallelism's transitions matter)."""
    value_dim = value_dim or key_dim
    gen = torch.Generator().manual_seed(seed)
    batch, length = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)

    inp = dict(q=randn(batch, length, heads, key_dim), k=randn(batch, length, heads, key_dim),
               v=randn(batch, length, heads, value_dim), beta=randn(batch, length, heads))
    if gate == "lower_bound":
        inp.update(g=randn(batch, length, heads, key_dim), A_log=torch.rand(heads, generator=gen).to(device),
                   dt_bias=torch.rand(heads, key_dim, generator=gen).to(device), lower_bound=LOWER_BOUND)
    elif gate == "weak":
        g = -0.02 * torch.rand(batch, length, heads, key_dim, generator=gen)
        inp.update(g=g.to(device), A_log=None, dt_bias=None, lower_bound=None)
    else:
        g = -3 * torch.rand(batch, length, heads, key_dim, generator=gen)
        g[torch.rand(g.shape, generator=gen) < 0.05] = -1e4
        inp.update(g=g.to(device), A_log=None, dt_bias=None, lower_bound=None)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    inp["cu_seqlens"] = torch.tensor(offsets, dtype=cu_dtype, device=device) if varlen else None
    if with_initial:
        inp["initial_state"] = torch.randn(len(lengths), heads, value_dim, key_dim, generator=gen).to(
            device=device, dtype=state_dtype)
    else:
        inp["initial_state"] = None
    return inp


def rel_err(x, ref):
    """Relative L2 error; NaN anywhere in ``x`` gives inf, so a NaN can never pass."""
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_prefill(inp, state_in, state_out, v_slices="auto", plan=None, sequence_parallel="auto", max_seqlen=None):
    """``kda_prefill`` into NaN-poisoned buffers; ``state_in``/``state_out``: dtype of the initial/final state,
    or None for none; ``plan``: a plan for ``inp`` (:func:`plan_for`) instead of ``v_slices`` and
    ``sequence_parallel`` (and its ``max_seqlen`` hint). Returns ``(out, final, initial_state)``."""
    import fastkda

    device = inp["q"].device
    n = inp["cu_seqlens"].numel() - 1 if inp["cu_seqlens"] is not None else inp["q"].shape[0]
    heads, key_dim, value_dim = inp["q"].shape[2], inp["q"].shape[3], inp["v"].shape[3]
    out = torch.full_like(inp["v"], float("nan"))
    final = (torch.full((n, heads, value_dim, key_dim), float("nan"), dtype=state_out, device=device)
             if state_out else None)
    h0 = inp["initial_state"].to(state_in) if state_in else None
    fastkda.kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                        dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], initial_state=h0, final_state=final,
                        cu_seqlens=inp["cu_seqlens"], out=out, v_slices=v_slices, plan=plan,
                        sequence_parallel=sequence_parallel, max_seqlen=max_seqlen)
    return out, final, h0


def plan_for(inp, v_slices="auto", sms=132, sequence_parallel=False, max_seqlen=None, **changes):
    """The prefill plan of ``inp`` (from :func:`make_inputs`) on ``sms`` SMs, with ``changes`` to its numbers;
    serial unless ``sequence_parallel`` says otherwise (as :func:`fastkda.choose_plan` takes it)."""
    from fastkda.plan import choose_plan

    q, cu = inp["q"], inp["cu_seqlens"]
    plan = choose_plan(cu.numel() - 1 if cu is not None else q.shape[0], q.shape[2], q.shape[1], q.shape[3],
                       inp["v"].shape[3], sms, varlen=cu is not None, lower_bound_gate=inp["lower_bound"] is not None,
                       v_slices=v_slices, sequence_parallel=sequence_parallel, max_seqlen=max_seqlen)
    return plan.replace(**changes) if changes else plan


def replay_with(graph, inp, fresh, names, buffers):
    """Copy ``fresh``'s tensors ``names`` into ``inp``'s (the ones a captured graph reads), NaN-poison the graph's
    output ``buffers`` and replay it."""
    import torch

    for x in names:
        if inp[x] is not None:  # absent in both (cu_seqlens of rows, the lower-bound gate's terms of another gate)
            inp[x].copy_(fresh[x])
    for buffer in buffers:
        buffer.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def solve_lower(plan, inp, entries, beta, emulate):
    """The solve kernel alone on a β·L scratch of ``entries`` (``[chunks, heads, C, C]``, strictly lower below
    its diagonal after ``tril``) under ``plan`` (for ``inp``, one sequence of ``chunks`` full chunks), with
    ``beta`` (``[1, tokens, heads]``): its T·diag(β) as ``[chunks, heads, C, C]``, and float64's."""
    from fastkda.ops.prefill.layout import Workspace
    from fastkda.ops.prefill.solve import launch_solve

    chunks, heads, C, _ = entries.shape
    S = torch.tril(entries, -1)
    ws = Workspace.allocate(plan, inp["v"], None)
    rows = ws.fp32[ws.layout.scratch:ws.layout.scratch + chunks * C * heads * C].view(chunks, C, heads, C)
    rows.copy_(S.permute(0, 2, 1, 3))  # row (token, head) of the chunk: its β·L row
    launch_solve(plan, ws, beta, False, None, emulate)
    eye = torch.eye(C, dtype=torch.float64, device=S.device)
    beta_columns = beta.double().view(chunks, C, heads).permute(0, 2, 1)[:, :, None, :]
    return rows.permute(0, 2, 1, 3), torch.linalg.inv(eye + S.double()) * beta_columns


class CompileCounter:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph


def in_default_pool(tensor):
    """Whether a CUDA tensor's memory lies in a segment of the caching allocator's default pool (not a CUDA graph's
    private pool, whose blocks later captures reuse)."""
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= tensor.data_ptr() < segment["address"] + segment["total_size"]:
            return tuple(segment["segment_pool_id"]) == (0, 0)
    raise AssertionError("the tensor lies in no segment of the caching allocator")


def check_compiled_prefill(compiled, inp):
    """``compiled`` (a compiled ``fastkda.kda_prefill``) on ``inp``, with its gate, initial state and offsets and a
    final state, gives the eager call's bits; returns nothing."""
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
              initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"], output_final_state=True)
    o, s = compiled(*args, **kw)
    eager_o, eager_s = fastkda.kda_prefill(*args, **kw)
    assert torch.equal(o, eager_o) and torch.equal(s, eager_s)

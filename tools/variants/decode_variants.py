"""Source variants of the decode kernels (``--kernel decode_step``: the layer's fused decode step; ``--kernel
decode``: KDA decode), timed beside the committed kernel, the KDA-only step, (for the step) its three launches
and (for decode) its memory floor on the auto plan and on each setting, in one process (CUDA-graph replay), so
that a change to a kernel, or the cost of one of its parts, is measured before it is made.

A variant is a list of text edits to the kernel's module (``fastkda/ops/decode_step.py`` or ``decode.py``; each
must match exactly once). The edited source is written beside the committed module as
``fastkda/ops/_decode_variant.py``, so that its relative imports resolve to this fastkda, imported as a new module
(Triton compiles its kernel afresh), and removed when the variant is done with; nothing in fastkda's modules is
replaced. The variants whose names start with "without" leave out a part of the step to price it: their outputs
are wrong, their times are what counts.

python tools/variants/decode_variants.py [--kernel decode_step|decode] [--only decode_H12_N1 ...] [--shapes 96:2 ...]
    [--settings auto 32:4 16:2] [--variants NAME ...] [--out DIR]   ->  <date>-<gpu>-<kernel>-variants.json
"""

import argparse
import contextlib
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import fastkda.ops.decode as committed_decode  # noqa: E402
import fastkda.ops.decode_step as committed_step  # noqa: E402
from fastkda.bench.report import tool_results_file, write_tool_results  # noqa: E402
from fastkda.bench.floor import state_chain_runner  # noqa: E402
from fastkda.bench.runners import (fastkda_decode_runner, fastkda_three_ops_runner, floor_decode_runner,  # noqa: E402
                                   step_inputs)
from fastkda.bench.workloads import LOWER_BOUND, load_workloads, make_decode_inputs  # noqa: E402
from fastkda.plan import choose_decode_plan, choose_decode_step_plan  # noqa: E402
from fastkda.errors import KINDS  # noqa: E402
from tools.sweeps.decode_sweep import decode_plan  # noqa: E402

MODULE = "_decode_variant"

_ERRORS_COUNT = ("    tl.atomic_add(errors, (slot >= pool_slots).to(tl.int32), "
                 "mask=(vs == 0) & (h == 0) & (slot >= pool_slots),\n"
                 '                  sem="relaxed")  # "slot", as the decode kernel counts it\n')
_JOIN = """        tl.store(tickets + head, 0)
"""  # the ticket kernel's last line
_V_CONV = "    v_t = conv_output(v_x, v_columns, conv_weight, v_ch, v_ok, stride_wc, stride_wj, W)\n"
_QK_CONV = ("    q_t = conv_output(load_f32(mixed_row + q_ch, k_ok), q_columns, conv_weight, q_ch, k_ok, "
            "stride_wc, stride_wj, W)\n"
            "    k_t = conv_output(load_f32(mixed_row + k_ch, k_ok), k_columns, conv_weight, k_ch, k_ok, "
            "stride_wc, stride_wj, W)\n" + _V_CONV)  # the sliced kernel's (the one-program kernel has the same two)
_STATE_LOAD = "    S = load_f32(pool + row * (H * V * K) + state_cols, m_state)\n"
_STATE_STORE = "    store_as(pool + row * (H * V * K) + state_cols, S, m_state, EMULATE)\n"

STEP_VARIANTS = {
    "committed": [],
    # a real candidate: the bad-slot count after the join, off the chain that ends in the ticket
    "errors counted last": [(_ERRORS_COUNT, ""), (_JOIN, _JOIN + _ERRORS_COUNT)],
    # prices of the parts (wrong outputs)
    "without the q/k conv": [(_QK_CONV, "    q_t = load_f32(mixed_row + q_ch, k_ok)\n"
                                        "    k_t = load_f32(mixed_row + k_ch, k_ok)\n" + _V_CONV)],
    # one program a head at five programs an SM (ptxas: 4 bytes of spill), where uncapped it holds 128 registers
    # and four fit (the one-program kernel's only variant: ONE_PROGRAM_VARIANTS)
    "one program capped at 96 registers": [("BC=decode_step_chunk(value_dim), **flags)",
                                            "BC=decode_step_chunk(value_dim), maxnreg=96, **flags)")],
    "without the join": [("""    tl.store(partial + head * V + vv, o_t, mask=v_ok)
    tl.store(sums + head * SLICES + vs, tl.sum(o_t * o_t))
    tl.debug_barrier()  # every thread's stores and q/k state reads of this program before its ticket (release)
    ticket = tl.atomic_add(tickets + head, 1, sem="acq_rel")
    if ticket == SLICES - 1:""", """    store_as(out + head * V + vv, o_t, v_ok, EMULATE)
    if SLICES < 0:""")],
    "without the state": [(_STATE_LOAD, "    S = tl.zeros((BV, K), dtype=tl.float32)\n"), (_STATE_STORE, "")],
}

ONE_PROGRAM_VARIANTS = {"one program capped at 96 registers"}  # step variants of head_step_kernel; the rest edit
# the sliced kernel

_DECODE_STATE_LOAD = "    S = load_f32(pool + read_slot * (H * V * K) + state_cols, m_state)\n"
_DECODE_STATE_STORE = "        store_as(pool + read_slot * (H * V * K) + state_cols, S, m_state, EMULATE)\n"
_DECODE_TOKEN_SLOT_STORE = "            store_as(pool + write_slot * (H * V * K) + state_cols, S, writes, EMULATE)\n"
DECODE_VARIANTS = {
    "committed": [],
    # the state is read once and written once: L2 need not keep it
    "state loads evict first": [(_DECODE_STATE_LOAD, "    S = tl.load(pool + read_slot * (H * V * K) + state_cols, "
                                "mask=m_state, other=0.0, eviction_policy='evict_first').to(tl.float32)\n")],
    "state stores streaming": [
        (_DECODE_STATE_STORE, "        tl.store(pool + read_slot * (H * V * K) + state_cols, "
         "S.to(pool.dtype.element_ty), mask=m_state, cache_modifier='.cs')\n"),
        (_DECODE_TOKEN_SLOT_STORE, "            tl.store(pool + write_slot * (H * V * K) + state_cols, "
         "S.to(pool.dtype.element_ty), mask=writes, cache_modifier='.cs')\n")],
}
# the output from the decayed old state, S_new·q = (S·diag(decay))·q + u·(k·q): its K reduction no longer waits
# for u and the update, so the two passes over S are independent (fewer dependent steps on a lone program's chain)
DECODE_VARIANTS["output in one pass"] = [
    ("""    u = b_t * (v_t - tl.sum(S * (decay * k_t)[None, :], axis=1))
    S = S * decay[None, :] + u[:, None] * k_t[None, :]
    return S, tl.sum(S * q_s[None, :], axis=1)
""", """    u = b_t * (v_t - tl.sum(S * (decay * k_t)[None, :], axis=1))
    o = tl.sum(S * (decay * q_s)[None, :], axis=1) + u * tl.sum(k_t * q_s)
    S = S * decay[None, :] + u[:, None] * k_t[None, :]
    return S, o
""")]
# the token's K-wide inputs loaded as [BV, K] tiles in the state's layout (every row the same channels), so that no
# layout conversion (a shared-memory round trip behind a barrier) sits between one input's load and the next's
_INPUTS_2D = [
    ("""        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t) + 1e-6)
        k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t) + 1e-6)
""", """        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t, axis=1, keep_dims=True) + 1e-6)
        k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t, axis=1, keep_dims=True) + 1e-6)
"""),
    ("""    u = b_t * (v_t - tl.sum(S * (decay * k_t)[None, :], axis=1))
    S = S * decay[None, :] + u[:, None] * k_t[None, :]
    return S, tl.sum(S * q_s[None, :], axis=1)
""", """    u = b_t * (v_t - tl.sum(S * (decay * k_t), axis=1))
    S = S * decay + u[:, None] * k_t
    return S, tl.sum(S * q_s, axis=1)
"""),
    ("""    vv = vs * BV + tl.arange(0, BV)
    # the first token's inputs""", """    vv = vs * BV + tl.arange(0, BV)
    kin = kk[None, :] + tl.zeros((BV, 1), dtype=tl.int32)
    # the first token's inputs"""),
    ("token_inputs(q, k, v, g, beta, n, 0, T, h, kk, vv,", "token_inputs(q, k, v, g, beta, n, 0, T, h, kin, vv,"),
    ("token_inputs(q, k, v, g, beta, n, t + 1, T, h, kk, vv,",
     "token_inputs(q, k, v, g, beta, n, t + 1, T, h, kin, vv,"),
    ("gate_parameters(A_log, dt_bias, h, kk, K, LOWER_BOUND_GATE)",
     "gate_parameters(A_log, dt_bias, h, kin, K, LOWER_BOUND_GATE)"),
]
DECODE_VARIANTS["inputs in the state's layout"] = _INPUTS_2D
KERNELS = {"decode_step": (committed_step, STEP_VARIANTS), "decode": (committed_decode, DECODE_VARIANTS)}


def edited_source(edits, text):
    """``text`` with each ``(old, new)`` of ``edits`` applied; an edit that does not match exactly once fails."""
    for old, new in edits:
        found = text.count(old)
        if found != 1:
            raise ValueError(f"an edit matches {found} times: {old.strip()[:60]!r}")
        text = text.replace(old, new)
    return text


@contextlib.contextmanager
def variant_module(committed, edits):
    """The module ``committed`` with ``edits`` applied, imported from a copy beside it (removed and forgotten on
    leaving)."""
    source = Path(committed.__file__)
    target = source.with_name(MODULE + ".py")
    name = f"fastkda.ops.{MODULE}"
    target.write_text(edited_source(edits, source.read_text()))
    try:
        yield importlib.import_module(name)
    finally:
        target.unlink()
        sys.modules.pop(name, None)


def step_runner(module, inp, plan):
    """``run()`` of ``module.fused_decode_step`` under ``plan`` on the bench's inputs for a one-token workload, as
    ``fastkda.kda_decode_step`` calls it after validation."""
    import torch

    step = step_inputs(inp)
    seqs, _, heads, dim = inp["q"].shape
    device = inp["q"].device
    tickets = torch.zeros(seqs * heads, dtype=torch.int32, device=device)
    errors = torch.zeros(len(KINDS), dtype=torch.int32, device=device)
    out = torch.empty(seqs, heads, dim, dtype=step["mixed"].dtype, device=device)

    def run():
        module.fused_decode_step(step["mixed"], step["conv_states"], step["conv_weight"], inp["g"][:, 0],
                                 inp["beta"][:, 0], step["output_gate"], step["norm_weight"], inp["pool"],
                                 inp["slots"], plan=plan, A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                                 lower_bound=LOWER_BOUND, scale=inp["scale"], eps=1e-5, use_qk_l2norm=True,
                                 use_beta_sigmoid=True, tickets=tickets, out=out, errors=errors)
        return out
    return run


def decode_runner(module, inp, plan):
    """``run()`` of ``module.recurrent_kda_decode`` under ``plan`` on the bench's inputs for a decode workload, as
    ``fastkda.kda_decode`` calls it after validation."""
    import torch

    errors = torch.zeros(len(KINDS), dtype=torch.int32, device=inp["q"].device)
    out = torch.empty_like(inp["v"])

    def run():
        module.recurrent_kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["pool"], inp["slots"],
                                    plan=plan, A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND,
                                    scale=inp["scale"], num_accepted_tokens=inp["accepted"], use_qk_l2norm=True,
                                    use_beta_sigmoid=True, out=out, errors=errors)
        return out
    return run


def extra_workload(spec):
    """A one-token fp32-pool decode workload from ``HEADS:SEQS`` (a head count the workloads file lacks, e.g. to
    place a plan's threshold between two of its rows)."""
    try:
        heads, seqs = (int(part) for part in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEADS:SEQS, got {spec!r}") from None
    if heads < 1 or seqs < 1:
        raise argparse.ArgumentTypeError(f"heads and sequences must be positive, got {spec!r}")
    return dict(name=f"decode_H{heads}_N{seqs}", H=heads, N=seqs, tokens_per_seq=1)


def plan_of(workload, setting, kernel="decode"):
    """The plan of ``setting`` for ``kernel``: "auto" (the kernel's own plan for the workload on 132 SMs: None
    where the step runs as three launches) or ``COLUMNS:WARPS``."""
    if setting == "auto" and kernel == "decode_step":
        return choose_decode_step_plan(workload["N"], workload["H"], 128, 132)
    if setting == "auto":
        return choose_decode_plan(workload["N"], workload["H"], 128, 132, tokens=workload["tokens_per_seq"])
    return decode_plan(workload, setting)


def main(argv=None):
    names = [w["name"] for w in load_workloads()["decode"]]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=list(KERNELS), default="decode_step")
    parser.add_argument("--only", nargs="*", choices=names,
                        help="decode workloads (default: all; the fused step takes the one-token ones)")
    parser.add_argument("--settings", nargs="*", metavar="auto|COLUMNS:WARPS",
                        help="the kernel's slices (default: 32:4 for the step, auto for decode)")
    parser.add_argument("--shapes", nargs="*", default=[], metavar="HEADS:SEQS", type=extra_workload,
                        help="one-token fp32-pool decode shapes to time besides the workloads (e.g. 96:2)")
    parser.add_argument("--variants", nargs="*", metavar="NAME", help="default: all of the kernel's")
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    args = parser.parse_args(argv)
    committed, variants = KERNELS[args.kernel]
    chosen = args.variants or list(variants)
    unknown = sorted(set(chosen) - set(variants))
    if unknown:
        parser.error(f"unknown {args.kernel} variants {unknown}; known: {list(variants)}")
    settings = args.settings or (["32:4"] if args.kernel == "decode_step" else ["auto"])
    runner = step_runner if args.kernel == "decode_step" else decode_runner
    from fastkda.bench.timing import time_graph

    rows = []
    # shapes alone: those, not every workload besides them
    chosen_workloads = [] if args.shapes and not args.only else [
        w for w in load_workloads()["decode"] if w["name"] in (args.only or names)]
    for w in chosen_workloads + args.shapes:
        if args.kernel == "decode_step" and w["tokens_per_seq"] != 1:
            continue
        inp = make_decode_inputs(w, "cuda")
        references = {"KDA-only step, auto plan": fastkda_decode_runner(inp)}
        if args.kernel == "decode_step":  # the step's other form: conv update, KDA decode, gated norm in turn
            references["three launches"] = fastkda_three_ops_runner(inp)
        if args.kernel == "decode":  # what the bars of decode are held against, on each setting's grid and warps
            references["memory floor, auto plan"] = floor_decode_runner(inp)
            for setting in settings:
                if setting != "auto":
                    references[f"memory floor, {setting}"] = state_chain_runner(inp, plan_of(w, setting))
        for label, run in references.items():
            ms = time_graph(run)
            rows.append(dict(workload=w["name"], setting=label, variant=None, ms=round(ms, 5)))
            print(f"[variants] {w['name']} {label}: {ms * 1e3:.1f} us", flush=True)
        for variant in chosen:
            with variant_module(committed, variants[variant]) as module:
                for setting in settings:
                    plan = plan_of(w, setting, args.kernel)
                    if plan is None or (args.kernel == "decode_step" and variants[variant]
                                        and (plan.v_slices == 1) != (variant in ONE_PROGRAM_VARIANTS)):
                        # three launches (a reference row above), or a kernel the variant's edits leave as it is
                        # (each step variant edits one of the two kernels): nothing of this variant to time
                        print(f"[variants] {w['name']} {setting} {variant}: not timed", flush=True)
                        continue
                    ms = time_graph(runner(module, inp, plan))
                    rows.append(dict(workload=w["name"], setting=setting, variant=variant, ms=round(ms, 5)))
                    print(f"[variants] {w['name']} {setting} {variant}: {ms * 1e3:.1f} us", flush=True)
    path, meta = tool_results_file(args.out, f"{args.kernel.replace('_', '-')}-variants")
    write_tool_results(path, meta, rows)
    print(f"[variants] results in {path}")


if __name__ == "__main__":
    main()

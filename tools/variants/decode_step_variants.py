"""Source variants of the fused decode step's kernel, timed beside the committed kernel and the KDA-only step in one
process (CUDA-graph replay), so that a change to the step, or the cost of one of its parts, is measured before it
is made.

A variant is a list of text edits to ``fastkda/ops/decode_step.py`` (each must match exactly once). The edited
source is written beside the committed module as ``fastkda/ops/_decode_step_variant.py``, so that its relative
imports resolve to this fastkda, imported as a new module (Triton compiles its kernel afresh), and removed when
the variant is done with; nothing in fastkda's modules is replaced. The variants whose names start with
"without" leave out a part of the step to price it: their outputs are wrong, their times are what counts.

python tools/variants/decode_step_variants.py [--only decode_H12_N1 ...] [--settings 32:4 16:2]
    [--variants NAME ...] [--out DIR]   ->  <date>-<gpu>-decode-step-variants.json
"""

import argparse
import contextlib
import datetime
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

import fastkda.ops.decode_step as committed  # noqa: E402
from fastkda.bench.report import git_commit, results_stem  # noqa: E402
from fastkda.bench.runners import fastkda_decode_runner, step_inputs  # noqa: E402
from fastkda.bench.workloads import LOWER_BOUND, load_workloads, make_decode_inputs  # noqa: E402
from fastkda.errors import KINDS  # noqa: E402
from tools.sweeps.decode_sweep import decode_plan  # noqa: E402

SOURCE = Path(committed.__file__)
MODULE = "_decode_step_variant"

_ERRORS_COUNT = """    tl.atomic_add(errors, (slot >= pool_slots).to(tl.int32), mask=(vs == 0) & (h == 0) & (slot >= pool_slots),
                  sem="relaxed")  # "slot", as the decode kernel counts it
"""
_JOIN = """            tl.store(tickets + head, 0)
"""  # the kernel's last line
_QK_CONV = """    q_t = conv_output(load_f32(mixed_row + q_ch, k_ok), q_columns, conv_weight, q_ch, k_ok, stride_wc, stride_wj, W)
    k_t = conv_output(load_f32(mixed_row + k_ch, k_ok), k_columns, conv_weight, k_ch, k_ok, stride_wc, stride_wj, W)
"""
_STATE_LOAD = "    S = load_f32(pool + row * (H * V * K) + state_cols, m_state)\n"
_STATE_STORE = "    store_as(pool + row * (H * V * K) + state_cols, S, m_state, EMULATE)\n"

VARIANTS = {
    "committed": [],
    # a real candidate: the bad-slot count after the join, off the chain that ends in the ticket
    "errors counted last": [(_ERRORS_COUNT, ""), (_JOIN, _JOIN + _ERRORS_COUNT)],
    # prices of the parts (wrong outputs)
    "without the q/k conv": [(_QK_CONV, "    q_t = load_f32(mixed_row + q_ch, k_ok)\n"
                                        "    k_t = load_f32(mixed_row + k_ch, k_ok)\n")],
    "without the join": [("    if SLICES == 1:", "    store_as(out + head * V + vv, o_t, v_ok, EMULATE)\n    if SLICES < 0:"),
                         ("    else:\n        tl.store(partial", "    elif SLICES < 0:\n        tl.store(partial")],
    "without the state": [(_STATE_LOAD, "    S = tl.zeros((BV, K), dtype=tl.float32)\n"), (_STATE_STORE, "")],
}


def edited_source(edits, text):
    """``text`` with each ``(old, new)`` of ``edits`` applied; an edit that does not match exactly once fails."""
    for old, new in edits:
        found = text.count(old)
        if found != 1:
            raise ValueError(f"an edit matches {found} times in {SOURCE.name}: {old.strip()[:60]!r}")
        text = text.replace(old, new)
    return text


@contextlib.contextmanager
def variant_module(edits):
    """The decode step's module with ``edits`` applied, imported from a copy beside the committed one (removed and
    forgotten on leaving)."""
    target = SOURCE.with_name(MODULE + ".py")
    name = f"fastkda.ops.{MODULE}"
    target.write_text(edited_source(edits, SOURCE.read_text()))
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


def main(argv=None):
    one_token = [w["name"] for w in load_workloads()["decode"] if w["tokens_per_seq"] == 1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=one_token, help="one-token decode workloads (default: all)")
    parser.add_argument("--settings", nargs="*", default=["32:4"], metavar="COLUMNS:WARPS",
                        help="the fused kernel's slices (default 32:4)")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default="fastkda-results", help="folder for the results file")
    args = parser.parse_args(argv)
    import torch

    from fastkda.bench.timing import time_graph

    rows = []
    for w in load_workloads()["decode"]:
        if w["name"] not in (args.only or one_token):
            continue
        inp = make_decode_inputs(w, "cuda")
        ms = time_graph(fastkda_decode_runner(inp))
        rows.append(dict(workload=w["name"], setting="KDA-only step, auto plan", variant=None, ms=round(ms, 5)))
        print(f"[step-variants] {w['name']} KDA-only step: {ms * 1e3:.1f} us", flush=True)
        for variant in args.variants:
            with variant_module(VARIANTS[variant]) as module:
                for setting in args.settings:
                    ms = time_graph(step_runner(module, inp, decode_plan(w, setting)))
                    rows.append(dict(workload=w["name"], setting=setting, variant=variant, ms=round(ms, 5)))
                    print(f"[step-variants] {w['name']} {setting} {variant}: {ms * 1e3:.1f} us", flush=True)
    props = torch.cuda.get_device_properties(0)
    meta = dict(gpu=props.name, sms=props.multi_processor_count, commit=git_commit(),
                date=datetime.date.today().isoformat())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(f"{results_stem(out, props.name)}-decode-step-variants.json")
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"[step-variants] results in {path}")


if __name__ == "__main__":
    main()

"""``python -m fastkda demo``: run the prefill on an embedded workload, check it against float64, print the plan
and the time (GPU: 12 heads, one 8192-token sequence; CPU: 4 heads, two sequences of about 1000 tokens).
``python -m fastkda plan --heads 12 --seqs 4 --tokens 8192 [--sms 132]``: print the launch plan of a shape and why
(``--entry-later``: of a prefill whose entry state comes later, a context-parallel rank's part)."""

import argparse
import os
import sys
import time

import torch

from .api import kda_prefill
from .plan import (CHUNK, SUPPORTED_DIMS, choose_open_entry_plan, choose_plan, has_warpgroup_mma,
                   parse_sequence_parallel, parse_v_slices, sm_count)
from .reference import kda_reference
from .validation import check_prefill_index_ranges

DEMO_GPU = dict(heads=12, lengths=[8192])  # the seed's low-parallelism prefill: one sequence of TP8's local heads
DEMO_CPU = dict(heads=4, lengths=[1000, 1048])
DIM = 128
LOWER_BOUND = -5.0
CHECK_TOKENS = 512  # the float64 token-by-token check runs on a prefix of the first sequence


def demo_inputs(heads, lengths, device):
    """One varlen batch of ``lengths`` tokens: bf16 q, k, v, gate and beta logits, the gate's parameters, an fp32
    initial state, int32 ``cu_seqlens``."""
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = sum(lengths)
    draw = {name: torch.randn(1, tokens, heads, *dims, generator=gen, device=device).bfloat16()
            for name, dims in (("q", [DIM]), ("k", [DIM]), ("v", [DIM]), ("g", [DIM]), ("beta", []))}
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0).int()
    return draw, dict(A_log=torch.rand(heads, generator=gen, device=device),
                      dt_bias=torch.rand(heads, DIM, generator=gen, device=device), lower_bound=LOWER_BOUND,
                      initial_state=torch.randn(len(lengths), heads, DIM, DIM, generator=gen, device=device),
                      cu_seqlens=offsets)


def demo(args):
    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    workload = DEMO_GPU if cuda else DEMO_CPU
    heads, lengths = workload["heads"], workload["lengths"]
    tensors, kw = demo_inputs(heads, lengths, device)
    sms = sm_count(torch.cuda.current_device()) if cuda else 1
    try:  # the environment's $FASTKDA_V_SLICES and $FASTKDA_SEQUENCE_PARALLEL are read here first
        plan = choose_plan(len(lengths), heads, sum(lengths), DIM, DIM, sms,
                           warpgroup_mma=cuda and has_warpgroup_mma(torch.cuda.current_device()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    qkvgb = [tensors[x] for x in ("q", "k", "v", "g", "beta")]

    def run():
        return kda_prefill(*qkvgb, **kw, output_final_state=True)

    name = torch.cuda.get_device_name() if cuda else "CPU (PyTorch chunked path)"
    print(f"fastkda demo on {name}: H={heads}, sequences={lengths}, K=V={DIM}, lower-bound gate {LOWER_BOUND}")
    print("plan:\n  " + plan.describe().replace("\n", "\n  ") if cuda else
          f"plan: the CPU path, chunks of {plan.cpu_chunk} tokens")
    run()
    if cuda:
        torch.cuda.synchronize()
    repeats = 20 if cuda else 1
    start = time.perf_counter()
    for _ in range(repeats):
        out, final = run()
    if cuda:
        torch.cuda.synchronize()
    print(f"time: {(time.perf_counter() - start) / repeats * 1e3:.3f} ms per call (eager, wall clock)")
    prefix = [x[:, :CHECK_TOKENS] for x in qkvgb]
    ref_o, _ = kda_reference(*prefix, **{**kw, "initial_state": kw["initial_state"][:1], "cu_seqlens": None})
    err = ((out[:, :CHECK_TOKENS].double() - ref_o).norm() / ref_o.norm()).item()
    ok = err < 4e-3 and bool(torch.isfinite(final).all())
    print(f"check: relative L2 error of the first {CHECK_TOKENS} outputs vs float64: {err:.2e} "
          f"({'OK' if ok else 'FAILED'}, bound 4e-3)")
    return 0 if ok else 1


def plan_command(args):
    sms = args.sms if args.sms is not None else (
        sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else None)
    if sms is None:
        print("error: no GPU here: pass --sms (e.g. 132 for an H200)", file=sys.stderr)
        return 2
    wgmma = args.warpgroup_mma
    if wgmma is None:  # this GPU's; without a GPU, off unless asked for
        wgmma = has_warpgroup_mma(torch.cuda.current_device()) if torch.cuda.is_available() else False
    try:
        for name in ("heads", "seqs", "tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
        # the API's index-range check: B·T = seqs·tokens in either layout (varlen: one row of them all)
        check_prefill_index_ranges(args.seqs * args.tokens, args.seqs, args.heads, args.key_dim, args.value_dim,
                                   CHUNK)
        varlen = args.layout == "varlen"
        if not varlen and args.max_seqlen is not None:  # kda_prefill reads the hint with cu_seqlens only
            raise ValueError(f"--max-seqlen applies to --layout varlen (fixed rows have their length), got "
                             f"{args.max_seqlen}")
        if args.entry_later:  # fixed-length rows, always segmented
            for option, value, unset in (("--v-slices", args.v_slices, "auto"),
                                         ("--max-seqlen", args.max_seqlen, None)):
                if value != unset:  # kda_prefill_open takes neither
                    raise ValueError(f"{option} does not apply with --entry-later (fixed rows, its own slices), got "
                                     f"{value}")
            plan = choose_open_entry_plan(args.seqs, args.heads, args.tokens, args.key_dim, args.value_dim, sms,
                                          lower_bound_gate=args.gate == "lower-bound",
                                          sequence_parallel=args.sequence_parallel, warpgroup_mma=wgmma)
            print(plan.describe())
            return 0
        plan = choose_plan(args.seqs, args.heads, args.tokens * args.seqs if varlen else args.tokens, args.key_dim,
                           args.value_dim, sms, varlen=varlen, lower_bound_gate=args.gate == "lower-bound",
                           v_slices=args.v_slices, sequence_parallel=args.sequence_parallel,
                           max_seqlen=args.max_seqlen, warpgroup_mma=wgmma)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(plan.describe())
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastkda")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the prefill on an embedded workload and check it")
    d.add_argument("--cpu", action="store_true", help="use the CPU path even where a GPU is present")
    p = sub.add_parser("plan", help="print the launch plan of a shape, and why")
    p.add_argument("--heads", type=int, required=True, help="heads on this GPU (local heads under tensor parallelism)")
    p.add_argument("--seqs", type=int, required=True, help="sequences in the batch")
    p.add_argument("--tokens", type=int, required=True, help="tokens per sequence")
    p.add_argument("--key-dim", type=int, default=128, choices=SUPPORTED_DIMS)
    p.add_argument("--value-dim", type=int, default=128, choices=SUPPORTED_DIMS)
    p.add_argument("--layout", choices=("varlen", "fixed"), default="varlen",
                   help="varlen: one row with cu_seqlens; fixed: one row per sequence")
    p.add_argument("--gate", choices=("lower-bound", "precomputed"), default="lower-bound")
    p.add_argument("--sms", type=int, help="SM count (default: this GPU's)")
    p.add_argument("--v-slices", default="auto", type=cli_choice(parse_v_slices, "auto, 1, 2 or 4"),
                   help="auto (default) or 1, 2, 4")
    segments = f"off, or tokens per segment (a multiple of {CHUNK})"
    p.add_argument("--sequence-parallel", default="auto", type=cli_choice(parse_sequence_parallel, f"auto, {segments}"),
                   help=f"auto (default), {segments}")
    p.add_argument("--max-seqlen", type=int, help="varlen: the longest sequence's length, if known (a hint)")
    p.add_argument("--warpgroup-mma", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the GPU runs Hopper's warpgroup MMA (sm_90, as an H200), which the Gluon "
                        "recurrence needs (default: this GPU's; without a GPU, no)")
    p.add_argument("--entry-later", action="store_true",
                   help="the plan of a prefill whose entry state comes later (fastkda.kda_prefill_open: a context-"
                        "parallel rank's part, one row per sequence)")
    args = parser.parse_args(argv)
    try:
        return demo(args) if args.command == "demo" else plan_command(args)
    except BrokenPipeError:  # the reader stopped early (`... | head`): the rest of the output is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush does not raise
        return 1


def cli_choice(parse, expected):
    """An argparse type from one of the plan's parsers: the value it parses to, or argparse's error in the command
    line's own words (``off``, not the API's ``False``)."""
    def parsed(text):
        try:
            return parse(text, "")
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return parsed


if __name__ == "__main__":
    sys.exit(main())

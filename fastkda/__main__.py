"""``python -m fastkda demo``: run the prefill on an embedded workload, check it, print the plan and time.
``python -m fastkda plan --heads 12 --seqs 4 --tokens 8192 [--sms 132]``: print the launch plan and why."""

import argparse
import sys
import time

import torch

from .api import kda_prefill
from .plan import choose_plan, sm_count
from .reference import kda_reference

DEMO_GPU = dict(H=12, lengths=[8192], layout="varlen")  # the seed's low-parallelism prefill
DEMO_CPU = dict(H=4, lengths=[1000, 1048], layout="varlen")
CHECK_TOKENS = 512  # the float64 token-by-token check runs on a prefix of the first sequence


def demo(args):
    from .bench import LOWER_BOUND, make_prefill_inputs

    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    workload = DEMO_GPU if cuda else DEMO_CPU
    inp = make_prefill_inputs(workload, device)
    heads, lengths = workload["H"], workload["lengths"]
    sms = sm_count(torch.cuda.current_device()) if cuda else 1
    plan = choose_plan(len(lengths), heads, sum(lengths) // len(lengths), 128, sms)
    kw = dict(A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=LOWER_BOUND, scale=inp["scale"])

    def run():
        return kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw,
                           initial_state=inp["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"])

    name = torch.cuda.get_device_name() if cuda else "CPU (PyTorch chunked path)"
    print(f"fastkda demo on {name}: H={heads}, sequences={lengths}, K=V=128, lower-bound gate {LOWER_BOUND}")
    print(f"plan: v_slices={plan.v_slices} ({plan.reason})" if cuda else "plan: none (CPU path)")
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
    prefix = slice(0, CHECK_TOKENS)
    ref_o, _ = kda_reference(*(inp[x][:, prefix] for x in ("q", "k", "v", "g", "beta")), **kw,
                             initial_state=inp["initial_state"][:1])
    err = ((out[:, prefix].double() - ref_o).norm() / ref_o.norm()).item()
    ok = err < 4e-3 and bool(torch.isfinite(final).all())
    print(f"check: relative L2 error of the first {CHECK_TOKENS} outputs vs float64: {err:.2e} "
          f"({'OK' if ok else 'FAILED'}, bound 4e-3)")
    return 0 if ok else 1


def plan_command(args):
    sms = args.sms or (sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else None)
    if sms is None:
        print("no GPU here: pass --sms (e.g. 132 for an H200)", file=sys.stderr)
        return 2
    try:
        plan = choose_plan(args.seqs, args.heads, args.tokens, args.value_dim, sms, args.v_slices)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    occupancy = min(plan.programs, sms) / sms
    print(f"v_slices={plan.v_slices} programs={plan.programs} sms={plan.sms} "
          f"occupancy={occupancy:.0%} reason: {plan.reason}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastkda")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the prefill on an embedded workload and check it")
    d.add_argument("--cpu", action="store_true", help="use the CPU path even where a GPU is present")
    p = sub.add_parser("plan", help="print the launch plan for a shape")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seqs", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True, help="tokens per sequence")
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--sms", type=int, help="SM count (default: this GPU's)")
    p.add_argument("--v-slices", default="auto")
    args = parser.parse_args(argv)
    return demo(args) if args.command == "demo" else plan_command(args)


if __name__ == "__main__":
    sys.exit(main())

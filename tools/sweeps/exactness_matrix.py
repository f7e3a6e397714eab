"""Issue 3's exactness matrix on a GPU: every shape run with v_slices 1, 2, 4 into NaN-poisoned buffers; outputs
and final states must be bitwise equal across slice counts and within the accuracy bar against float64.

python tools/sweeps/exactness_matrix.py [--shapes 140] [--seed 0] [--workers 8] [--set prepare_stages=1,...]
Prints how many shapes, how many the auto plan splits, how many are identical and accurate; exits 1 on any
failure. Shapes cover fixed and varlen layouts, int32/int64 cu_seqlens, empty sequences at the start, middle
and end, 1-token and non-multiple-of-chunk tails, the 7 state cases, K = V in {64, 128}, H from 1 to 96, both
gates. ``--set`` changes every plan's launch numbers (e.g. a setting under suspicion) but v_slices."""

import argparse
import multiprocessing
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root: fastkda and tools
sys.path.insert(1, str(ROOT / "tests"))  # the tests' input makers

import torch  # noqa: E402
from helpers import make_inputs, plan_for, rel_err, run_prefill  # noqa: E402

import fastkda  # noqa: E402
from fastkda.plan import V_SLICE_CHOICES, sm_count  # noqa: E402
from tools.plan_changes import add_set_argument, parse_arguments  # noqa: E402

STATE_CASES = [(None, None)] + [c for d in (torch.bfloat16, torch.float32) for c in ((d, None), (None, d), (d, d))]
HEADS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]
OUT_BOUND, STATE_BOUND, BF16_STATE_BOUND = 4e-3, 3e-3, 6e-3


def shape(index, rng):
    """The index-th shape: layouts, edge lengths and state cases cycle so that each appears often."""
    heads = HEADS[index % len(HEADS)]
    varlen = index % 4 != 3
    if varlen:
        lengths = [rng.choice([1, 17, 63, 64, 65, 130, 200]) for _ in range(rng.randint(1, 6))]
        empty_at = index % 5  # 0: start, 1: middle, 2: end, 3-4: none
        if empty_at == 0:
            lengths.insert(0, 0)
        elif empty_at == 1:
            lengths.insert(len(lengths) // 2, 0)
        elif empty_at == 2:
            lengths.append(0)
    else:
        lengths = [rng.choice([1, 50, 64, 100, 193])] * rng.randint(1, 4)
    return dict(lengths=lengths, heads=heads, key_dim=(64, 128)[index % 2], varlen=varlen,
                cu_dtype=(torch.int32, torch.int64)[(index // 2) % 2], gate="precomputed" if index % 7 == 6 else
                "lower_bound"), STATE_CASES[index % len(STATE_CASES)]


def check(index, seed, device, changes=None):
    """(split by auto, bitwise identical across v_slices, accurate) for shape ``index`` under plans with
    ``changes``; prints a failure."""
    changes = changes or {}
    case, states = shape(index, random.Random(seed * 1_000_003 + index))
    inp = make_inputs(device=device, seed=index, **case)
    split = plan_for(inp, sms=sms(device)).v_slices > 1
    results = [run_prefill(inp, *states, plan=plan_for(inp, v_slices=s, sms=sms(device), **changes))
               for s in V_SLICE_CHOICES]
    same = all(torch.equal(o, results[0][0]) and (f is None or torch.equal(f, results[0][1]))
               for o, f, _ in results[1:])
    ref_o, ref_s = fastkda.kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                         dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                                         initial_state=results[0][2], cu_seqlens=inp["cu_seqlens"])
    out, final, _ = results[0]
    bound = BF16_STATE_BOUND if states[1] == torch.bfloat16 else STATE_BOUND
    ok = rel_err(out, ref_o) < OUT_BOUND and (final is None or rel_err(final, ref_s) < bound)
    if not (same and ok):
        print(f"[exactness] FAILED shape {index}: {case} states={states} identical={same} accurate={ok}", flush=True)
    return split, same, ok


def check_many(indices, seed, device, changes):
    return [check(index, seed, device, changes) for index in indices]


def sms(device):
    """The GPU's SM count; on the CPU (a dry run of this script) the H200's 132."""
    return sm_count(torch.cuda.current_device()) if device == "cuda" else 132


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=int, default=140)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=8, help="processes sharing the GPU (they compile in parallel)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run through the CPU path")
    add_set_argument(parser, what="launch numbers to change in every plan", fixed=("v_slices",))
    args, changes = parse_arguments(parser, argv)
    shards = [list(range(w, args.shapes, args.workers)) for w in range(args.workers)]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        results = [r for shard in pool.starmap(check_many, [(shard, args.seed, args.device, changes)
                                                            for shard in shards]) for r in shard]
    total = len(results)
    split, identical, accurate = (sum(r[i] for r in results) for i in range(3))
    print(f"[exactness] {total} shapes, {split} split by the auto plan on {sms(args.device)} SMs, {identical} bitwise "
          f"identical across v_slices {'/'.join(map(str, V_SLICE_CHOICES))}, {accurate} within the accuracy bar")
    return 0 if identical == accurate == total else 1


if __name__ == "__main__":
    sys.exit(main())

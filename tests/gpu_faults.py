"""Bad device-side indices on the GPU, one process for a group of cases (run by tests/test_gpu_safety.py, under
compute-sanitizer's memcheck where it works). Each case puts guard regions around the pool or the output, makes
one call with a bad slot, count or ``cu_seqlens`` entry on the device, and checks that the guards are bitwise
unchanged, that the bad row is neutralised as documented and that the error counters say what happened; at the
end a valid call must still run and match the float64 reference (the CUDA context survived).

python tests/gpu_faults.py decode|prefill|all"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fastkda  # noqa: E402
from helpers import make_inputs, rel_err  # noqa: E402

SENTINEL = 2.0 ** 100
GUARD = 1 << 16  # elements of guard on each side


def guarded(shape, fill, dtype):
    size = torch.Size(shape).numel()
    whole = torch.full((size + 2 * GUARD,), SENTINEL, dtype=dtype, device="cuda")
    view = whole[GUARD:GUARD + size].view(shape)
    view.copy_(fill)
    return view, whole


def guards_intact(whole):
    return bool((whole[:GUARD] == SENTINEL).all() and (whole[-GUARD:] == SENTINEL).all())


def counts():
    return fastkda.error_counts()


def decode_case(slots, accepted=None, tokens=1, pool_slots=6, pool_dtype=torch.float32):
    seqs = slots.shape[0]
    inp = make_inputs([tokens] * seqs, heads=4, key_dim=128, varlen=False, device="cuda", seed=61)
    states = torch.randn(pool_slots, 4, 128, 128, device="cuda").to(pool_dtype)
    pool, pool_whole = guarded(states.shape, states, pool_dtype)
    fastkda.reset_error_counts()
    out = fastkda.kda_decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, slots.cuda(),
                             A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                             num_accepted_tokens=None if accepted is None else accepted.cuda())
    torch.cuda.synchronize()
    assert guards_intact(pool_whole), "pool guards changed"
    return out, pool, states, counts()


def decode_cases():
    for bad in (6, 10 ** 6, 2 ** 40):
        out, pool, before, errors = decode_case(torch.tensor([0, bad, 2], dtype=torch.int64))
        assert (out[1] == 0).all() and torch.isfinite(out).all()
        assert torch.equal(pool[1], before[1]) and torch.equal(pool[3:], before[3:])
        assert errors == dict(slot=1, accepted=0, cu_seqlens=0), errors
        print(f"decode read slot {bad}: null row, counted", flush=True)
    out, pool, before, errors = decode_case(torch.tensor([[0, 1], [2, 99], [-1, -1]], dtype=torch.int32), tokens=2)
    assert (out[2] == 0).all() and torch.equal(pool[3:], before[3:]) and errors["slot"] == 1, errors
    print("decode write slot past the pool: skipped, counted", flush=True)
    for accepted in ([0, 2, 1], [3, 1, 2], [-1000, 1, 1]):
        slots = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
        out, pool, before, errors = decode_case(slots, torch.tensor(accepted, dtype=torch.int32), tokens=2)
        bad = [n for n, a in enumerate(accepted) if not 1 <= a <= 2]
        assert all((out[n] == 0).all() for n in bad) and errors["accepted"] == len(bad), errors
        assert all(torch.equal(pool[s], before[s]) for n in bad for s in slots[n].tolist())
        print(f"decode accepted {accepted}: null rows, counted", flush=True)


def prefill_case(offsets, lengths, sequence_parallel=False):
    inp = make_inputs(lengths, heads=4, key_dim=128, device="cuda", seed=62)
    out, out_whole = guarded(inp["v"].shape, torch.zeros_like(inp["v"]), inp["v"].dtype)
    final, final_whole = guarded(inp["initial_state"].shape, torch.zeros_like(inp["initial_state"]), torch.float32)
    fastkda.reset_error_counts()
    fastkda.kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                        dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], initial_state=inp["initial_state"],
                        final_state=final, out=out, cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device="cuda"),
                        sequence_parallel=sequence_parallel)
    torch.cuda.synchronize()
    assert guards_intact(out_whole) and guards_intact(final_whole), "output guards changed"
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    return counts()


def prefill_cases():
    for segments in (False, 64):  # the serial recurrence, and segments of 64 tokens (transitions, scan, rerun)
        for offsets in ([0, 300, 5000], [0, 700, 300, 1000], [-4000, 500, 1000], [0, 2 ** 30, 1000], [0, 400, 900]):
            errors = prefill_case(offsets, [500, 500] if len(offsets) == 3 else [300, 300, 400], segments)
            assert errors["cu_seqlens"] >= 1 and errors["slot"] == errors["accepted"] == 0, (offsets, errors)
            print(f"prefill cu_seqlens {offsets}, sequence_parallel={segments}: clamped, counted "
                  f"{errors['cu_seqlens']}", flush=True)
    inp = make_inputs([200], heads=4, key_dim=128, device="cuda", seed=63, gate="precomputed")
    inp["g"][0, 50:60] = 5.0  # above 0: outside the contract, counts as 0
    o, s = fastkda.kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], output_final_state=True,
                               initial_state=inp["initial_state"], cu_seqlens=inp["cu_seqlens"])
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    print("prefill precomputed gate above 0: finite", flush=True)


def context_still_usable():
    inp = make_inputs([300, 77], heads=4, key_dim=128, device="cuda", seed=64)
    o, _ = fastkda.kda_prefill(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                               dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"], cu_seqlens=inp["cu_seqlens"])
    ref, _ = fastkda.kda_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                   dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"],
                                   cu_seqlens=inp["cu_seqlens"])
    assert rel_err(o, ref) < 4e-3
    print("a valid call after the faults: correct", flush=True)


if __name__ == "__main__":
    group = sys.argv[1] if len(sys.argv) > 1 else "all"
    if group in ("decode", "all"):
        decode_cases()
    if group in ("prefill", "all"):
        prefill_cases()
    context_still_usable()
    print("ALL OK")

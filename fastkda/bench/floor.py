"""A decode step's memory floor: a kernel that only moves each program's state slice through the slot index, on
the decode plan's grid, slice width and warps (slot -> state -> store, no arithmetic on the chain). Its time is
what no decode kernel of that plan can beat on that device; the decode benchmark times it beside decode, in the
same run, so that "within 1.10× of the floor" compares like with like.

With per-token slots ``[N, T]`` (speculative decode) it reads the state of ``slots[n, 0]`` and writes it to each
``slots[n, t]``, as decode writes a state after every token."""

import triton
import triton.language as tl

from ..api import _sms_of
from ..plan import choose_decode_plan


@triton.jit
def state_chain_kernel(pool, slots, stride_slot_n, stride_slot_t, T, H: tl.constexpr, V: tl.constexpr,
                       K: tl.constexpr, BV: tl.constexpr, INDIRECT: tl.constexpr):
    vs = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    read_slot = tl.load(slots + n * stride_slot_n).to(tl.int64) if INDIRECT else n.to(tl.int64)
    vv = vs * BV + tl.arange(0, BV)
    kk = tl.arange(0, K)
    cols = (h * V + vv[:, None]) * K + kk[None, :]
    state = tl.load(pool + read_slot * (H * V * K) + cols) * 1.0009765625
    for t in range(T):
        write_slot = tl.load(slots + n * stride_slot_n + t * stride_slot_t).to(tl.int64) if INDIRECT else read_slot
        tl.store(pool + write_slot * (H * V * K) + cols, state)


def state_chain_runner(inp, plan=None, indirect=True):
    """``run()`` of the floor kernel over a decode input set (:func:`fastkda.bench.workloads.make_decode_inputs`),
    on ``plan`` or the decode plan of those inputs; ``indirect=False`` drops the slot lookup (sequence n's state in
    row n)."""
    pool, slots = inp["pool"], inp["slots"]
    num_seqs, tokens, heads, _ = inp["q"].shape
    dim = pool.shape[-1]
    if plan is None:
        plan = choose_decode_plan(num_seqs, heads, dim, _sms_of(pool), tokens=tokens)
    grid = (plan.v_slices, heads, num_seqs)
    stride_t = slots.stride(1) if slots.dim() == 2 else 0

    def run():
        state_chain_kernel[grid](pool, slots, slots.stride(0), stride_t, tokens, heads, dim, dim, plan.slice_width,
                                 indirect, num_warps=plan.warps)
    return run

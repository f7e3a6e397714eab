"""Preparation, second kernel: the in-chunk inverse ``T = (I + β·L)⁻¹``, then w and u, or T·diag(β) alone.

One program per (chunk slot, head), on few warps: its products are 16×16 blocks, which more warps would only
replicate. T is formed by blocks from the β·L scratch of the first kernel: the diagonal blocks' inverses by
``(I − L)(I + L²)(I + L⁴)(I + L⁸)`` (L is strictly lower, so nilpotent), then ``T10 = −T11·L10·T00``. Then
either w = T·β·kd over the kd the first kernel parked in the ``w`` section and u = T·β·v, ``solve_channels``
columns per step, or, when the plan has the recurrence form w and u itself (``w_u_in_recurrence``), T·diag(β)
over the scratch.
"""

import triton
import triton.language as tl

from ..common import launch
from ..tiles import load_tile, store_tile
from .inputs import beta_rows
from .layout import chunk_of_slot


@triton.jit
def unit_lower_inverse_block(L, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(I + L)⁻¹`` for a strictly lower ``[BC, BC]`` L (BC = 16): (I - L)(I + L²)(I + L⁴)(I + L⁸)."""
    cb = tl.arange(0, BC)
    eye = tl.where(cb[:, None] == cb[None, :], 1.0, 0.0)
    power = L
    inverse = eye - L
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision=DOT_PRECISION)
        inverse = tl.dot(inverse, eye + power, input_precision=DOT_PRECISION)
    return inverse


@triton.jit
def mm(a, b, DOT_PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["H"])  # one compile for every head count
def solve_kernel(
    v, beta, cu_seqlens, ws_bf16, ws_fp32, u_at, scratch_at,
    stride_v, stride_beta_tok, stride_beta_head, seq_len, num_seqs,
    H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, BETA_SIGMOID: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE: tl.constexpr,
    FORM_W_U: tl.constexpr,
):
    """One (chunk slot, head): T from the scratch's 16×16 blocks (diagonal ones strictly lower), then w and u
    (``FORM_W_U``) or T·diag(β) over the scratch (module docstring)."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    chunk_start, eos = chunk_of_slot(slot, cu_seqlens, seq_len, num_seqs, C, IS_VARLEN)
    cb = tl.arange(0, BC)
    rows0 = cb  # the rows of the chunk's two blocks, counted from its first token
    rows1 = rows0 + BC
    ok0 = rows0 < eos - chunk_start
    ok1 = rows1 < eos - chunk_start
    row0 = chunk_start.to(tl.int64)  # 64-bit base pointers per program, 32-bit offsets inside the chunk
    L_c = ws_fp32 + scratch_at + row0 * (H * C) + h * C
    w_c = ws_bf16 + row0 * (H * K) + h * K
    u_c = ws_bf16 + u_at + row0 * (H * V) + h * V
    v_c = v + row0 * stride_v + h * V
    beta_c = beta + row0 * stride_beta_tok + h * stride_beta_head
    L00 = load_tile(L_c, rows0, ok0, cb, C, H * C)
    L10 = load_tile(L_c, rows1, ok1, cb, C, H * C)
    L11 = load_tile(L_c, rows1, ok1, BC + cb, C, H * C)
    b0 = beta_rows(beta_c, rows0, ok0, stride_beta_tok, BETA_SIGMOID)
    b1 = beta_rows(beta_c, rows1, ok1, stride_beta_tok, BETA_SIGMOID)
    # T = (I + β·L)⁻¹ by blocks; then w = T·β·kd over the kd parked in the w section (row block 1 first: w_1
    # overwrites kd_1, which row block 0 does not need) and u = T·β·v, in the same channel steps
    T00 = unit_lower_inverse_block(L00, BC, DOT_PRECISION)
    T11 = unit_lower_inverse_block(L11, BC, DOT_PRECISION)
    T10 = -mm(T11, mm(L10, T00, DOT_PRECISION), DOT_PRECISION)
    T00 = T00 * b0[None, :]
    T10 = T10 * b0[None, :]
    T11 = T11 * b1[None, :]
    if FORM_W_U:
        for c in range(tl.cdiv(max(K, V), BK)):  # w and u together: one load phase per step for both
            dd = c * BK + tl.arange(0, BK)
            kd0 = load_tile(w_c, rows0, ok0, dd, K, H * K).to(tl.float32)
            kd1 = load_tile(w_c, rows1, ok1, dd, K, H * K).to(tl.float32)
            v0 = load_tile(v_c, rows0, ok0, dd, V, stride_v).to(tl.float32)
            v1 = load_tile(v_c, rows1, ok1, dd, V, stride_v).to(tl.float32)
            tl.debug_barrier()  # every thread's kd loaded before any w overwrites it
            store_tile(w_c, rows1, ok1, dd, K, H * K, mm(T10, kd0, DOT_PRECISION) + mm(T11, kd1, DOT_PRECISION),
                       EMULATE)
            store_tile(w_c, rows0, ok0, dd, K, H * K, mm(T00, kd0, DOT_PRECISION), EMULATE)
            store_tile(u_c, rows0, ok0, dd, V, H * V, mm(T00, v0, DOT_PRECISION), EMULATE)
            store_tile(u_c, rows1, ok1, dd, V, H * V, mm(T10, v0, DOT_PRECISION) + mm(T11, v1, DOT_PRECISION),
                       EMULATE)
    else:  # T·diag(β) over the scratch, whose upper-right block (rows 0, columns BC..) is zero already
        tl.debug_barrier()  # every thread's L loaded before any T overwrites it
        store_tile(L_c, rows0, ok0, cb, C, H * C, T00, EMULATE)
        store_tile(L_c, rows1, ok1, cb, C, H * C, T10, EMULATE)
        store_tile(L_c, rows1, ok1, BC + cb, C, H * C, T11, EMULATE)


def launch_solve(plan, ws, v, beta, use_beta_sigmoid, emulate):
    """Launch :func:`solve_kernel` over the plan's grid on the workspace ``ws``."""
    layout = ws.layout
    launch(
        solve_kernel, plan.prepare_grid,
        v, beta, ws.cu_seqlens if plan.varlen else ws.fp32, ws.bf16, ws.fp32, layout.u, layout.scratch,
        v.stride(1), beta.stride(1), beta.stride(2), plan.seq_len, plan.num_seqs, plan.heads,
        K=plan.key_dim, V=plan.value_dim, C=plan.chunk, BC=plan.block, BK=plan.solve_channels,
        IS_VARLEN=plan.varlen, BETA_SIGMOID=use_beta_sigmoid, DOT_PRECISION=plan.dot_precision, EMULATE=emulate,
        FORM_W_U=not plan.w_u_in_recurrence, num_warps=plan.solve_warps, num_stages=plan.solve_stages,
    )

"""Token-local inputs of the preparation kernels: β, the log-decay of either gate (in base 2), the q/k norms."""

import triton
import triton.language as tl

from ... import reference
from ..common import fast_exp2, fast_reciprocal, load_f32
from ..tiles import load_rows

LOG_DECAY_FLOOR: tl.constexpr = tl.constexpr(reference.LOG_DECAY_FLOOR)  # precomputed gates are clamped here
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def beta_rows(beta_c, rows, valid, stride_tok, BETA_SIGMOID: tl.constexpr):
    """β of the chunk's ``rows`` (``beta_c`` points at its first token and head; σ applied unless the caller
    did), zero outside ``valid``."""
    bv = load_f32(beta_c + rows * stride_tok, valid)
    if BETA_SIGMOID:
        bv = tl.sigmoid(bv)
    return tl.where(valid, bv, 0.0)


@triton.jit
def log2_decay_block(g_c, rows, valid, stride_g, h, kk, A_log, dt_bias, lower_bound,
                     K: tl.constexpr, LOWER_BOUND_GATE: tl.constexpr, EMULATE: tl.constexpr):
    """Log-decay of one ``[C, BK]`` block of key channels **in base 2** (``a·log2(e)``, so every decay factor
    is one ``ex2``), zero outside the ``valid`` rows (``g_c`` points at the chunk's first token and head)."""
    gv = load_rows(g_c, rows, valid, kk, stride_g).to(tl.float32)
    if LOWER_BOUND_GATE:  # λ·σ(e^A_log·(g + b)) = λ / (1 + 2^(-e^A_log·log2(e)·(g + b)))
        tl.debug_barrier()  # every load of g issued before bias's layout conversion waits for bias
        slope = tl.exp(tl.load(A_log + h).to(tl.float32)) * LOG2E
        bias = tl.load(dt_bias + h * K + kk).to(tl.float32)
        a = (lower_bound * LOG2E) * fast_reciprocal(1.0 + fast_exp2(-slope * (gv + bias[None, :]), EMULATE), EMULATE)
    else:  # floor: exp(-30) leaves 1e-13 of the state, below fp32 resolution, and keeps G's ulp small; a value
        # above 0 (outside the contract) counts as 0, so finite inputs always give finite outputs
        a = tl.minimum(tl.maximum(gv, LOG_DECAY_FLOOR), 0.0) * LOG2E
    return tl.where(valid[:, None], a, 0.0)


@triton.jit
def row_scales(q_t, k_t, valid, scale, L2NORM: tl.constexpr):
    """Per-row scales ``scale/||q||`` and ``1/||k||`` (or ``scale`` and 1 without the norm) of whole ``[C, K]``
    tiles, loaded in one phase (a loop over channel blocks would make each block a dependent round trip to
    memory)."""
    if L2NORM:
        return tl.rsqrt(tl.sum(q_t * q_t, axis=1) + 1e-6) * scale, tl.rsqrt(tl.sum(k_t * k_t, axis=1) + 1e-6)
    else:
        ones = tl.where(valid, 1.0, 1.0)  # the tiles go unused (and unloaded) unless one step takes them
        return ones * scale, ones

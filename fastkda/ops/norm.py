"""The KDA layer's gated RMSNorm (spec §9 step 6) on the GPU: ``x·rsqrt(mean(x²) + eps)·w ⊙ act(gate)``.

One program per block of rows, a row being one vector of the last dimension D, whole in registers (D padded to a
power of two), in fp32. Rows are addressed through up to three strided leading levels (the host merges the leading
dimensions of x and gate into them), so views of a wider projection (a head's slice of ``[T, H, D]`` inside
``[T, 3·H·D]``) are read in place; the output is contiguous.
"""

import triton
import triton.language as tl

from ..plan import norm_launch
from .common import interpreting, launch, load_f32, store_as


@triton.jit
def gated_rmsnorm_kernel(
    x, gate, weight, out, rows, size1, size2, stride_x0, stride_x1, stride_x2, stride_xd, stride_g0, stride_g1,
    stride_g2, stride_gd, stride_w, eps, D,
    BR: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, EMULATE: tl.constexpr,
):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    i2 = r % size2
    i1 = (r // size2) % size1
    i0 = r // size2 // size1
    dd = tl.arange(0, BD)
    d_ok = dd < D
    m = (r < rows)[:, None] & d_ok[None, :]
    cols = dd.to(tl.int64)[None, :]
    xv = load_f32(x + (i0 * stride_x0 + i1 * stride_x1 + i2 * stride_x2)[:, None] + cols * stride_xd, m)
    gv = load_f32(gate + (i0 * stride_g0 + i1 * stride_g1 + i2 * stride_g2)[:, None] + cols * stride_gd, m)
    w = load_f32(weight + dd * stride_w, d_ok)
    rstd = tl.rsqrt(tl.sum(xv * xv, axis=1) / D + eps)
    if SILU:
        act = gv * tl.sigmoid(gv)
    else:
        act = tl.sigmoid(gv)
    store_as(out + r[:, None] * D + dd[None, :], xv * rstd[:, None] * w[None, :] * act, m, EMULATE)


def gated_rmsnorm_forward(x, gate, weight, eps, silu, levels, out):
    """Launch the norm on validated inputs. ``levels``: the leading dimensions as three ``(size, x stride, gate
    stride)`` levels, outermost first (size-1 levels where fewer); ``out`` contiguous, x's shape, written."""
    dim = x.shape[-1]
    (size0, sx0, sg0), (size1, sx1, sg1), (size2, sx2, sg2) = levels
    rows = size0 * size1 * size2
    if rows == 0 or dim == 0:
        return
    block_r, block_d, warps = norm_launch(rows, dim)
    launch(
        gated_rmsnorm_kernel, (triton.cdiv(rows, block_r), 1, 1),
        x, gate, weight, out, rows, size1, size2, sx0, sx1, sx2, x.stride(-1), sg0, sg1, sg2, gate.stride(-1),
        weight.stride(0), float(eps), dim,
        BR=block_r, BD=block_d, SILU=silu, EMULATE=interpreting(), num_warps=warps,
    )

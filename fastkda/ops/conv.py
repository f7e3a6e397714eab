"""The KDA layer's depthwise causal conv (spec §9 step 2) on the GPU: varlen prefill (and decode of several tokens)
in one kernel, a decode step of one token per sequence in another (:func:`conv_update_kernel`).

One program per (token block, channel block). A token block is up to ``BT`` consecutive tokens of one sequence,
laid out as the prefill's chunk slots (:mod:`fastkda.ops.prefill.layout`, with ``BT`` for the chunk): every
program finds its sequence from ``cu_seqlens`` alone, with no host-device synchronisation, and every sequence,
an empty one too, owns a first block. Each output is ``act(bias + Σ_j w_j·u_{t−(W−1)+j})`` in fp32, from W loads
of shifted token rows (they overlap in cache) read through x's strides.

The conv state. A sequence's W−1 inputs before its first token come from its pool row ``conv_states[slot]``
(``[C, W−1]`` through its strides, oldest first) when the slot is live (in ``[0, P)``) and its
``has_initial_state`` flag is set, else are zeros. Only the first block's tokens reach back that far
(``BT ≥ W−1``), so the first block's program is the only one that reads the row, and it also writes it: after a
barrier (its threads' reads of the old row come first), the last W−1 inputs, which for a sequence shorter than
W−1 tokens include the old row's tail. A negative slot or one at or past the pool's size reads and writes
nothing, so whatever ``slots`` holds no access leaves the pool; ``cu_seqlens`` spans are clamped into
``[0, T]`` as the prefill's are. Two live sequences must not share a slot (their programs would race).
"""

import torch
import triton
import triton.language as tl

from .common import interpreting, launch, load_f32, store_as
from .prefill.layout import first_slot, sequence_of_slot, sequence_span
from ..plan import conv_launch, conv_update_launch, segment_slot_count


@triton.jit
def conv_kernel(
    x, weight, bias, states, slots, has_initial, cu_seqlens, out,
    stride_xb, stride_xt, stride_xc, stride_wc, stride_wj, stride_bias, stride_sp, stride_sc, stride_sj,
    stride_slot, stride_initial, seq_len, num_seqs, channels, pool_rows,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, WP: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATES: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
    SILU: tl.constexpr, EMULATE: tl.constexpr,
):
    block = tl.program_id(0)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = cc < channels
    n = sequence_of_slot(block, cu_seqlens, seq_len, num_seqs, BT, IS_VARLEN)
    bos, eos, _ = sequence_span(cu_seqlens, n, seq_len, num_seqs, IS_VARLEN)
    first = first_slot(n, bos, seq_len, BT, IS_VARLEN)
    length = eos - bos
    pos = (block - first) * BT + tl.arange(0, BT)  # the block's tokens, as positions in their sequence
    t_ok = (pos < length) & (block >= first)
    if IS_VARLEN:  # packed [T, C]: token rows from the sequence's first
        x_seq = x + bos.to(tl.int64) * stride_xt
    else:  # [B, T, C]
        x_seq = x + n.to(tl.int64) * stride_xb
    x_cols = cc.to(tl.int64) * stride_xc
    if HAS_STATES:
        if HAS_SLOTS:
            slot = tl.load(slots + n * stride_slot).to(tl.int64)
        else:
            slot = n.to(tl.int64)
        live = (slot >= 0) & (slot < pool_rows)
        reads = live
        if HAS_INITIAL_FLAGS:
            reads = reads & (tl.load(has_initial + n * stride_initial) != 0)
        row = states + tl.where(live, slot, 0) * stride_sp + cc.to(tl.int64) * stride_sc  # [BC] pointers
    if HAS_BIAS:
        acc = tl.zeros((BT, BC), dtype=tl.float32) + load_f32(bias + cc * stride_bias, c_ok)[None, :]
    else:
        acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        src = pos - (W - 1 - j)  # the input tap j multiplies: a token of the sequence, or (< 0) of its state
        u = load_f32(x_seq + src.to(tl.int64)[:, None] * stride_xt + x_cols[None, :],
                     (t_ok & (src >= 0))[:, None] & c_ok[None, :])
        acc += u * load_f32(weight + cc * stride_wc + j * stride_wj, c_ok)[None, :]
    if HAS_STATES:
        if block == first:  # only a sequence's first block reaches back into its state (BT >= W−1)
            for j in tl.static_range(W - 1):
                src = pos - (W - 1 - j)
                u = load_f32(row[None, :] + (W - 1 + src)[:, None] * stride_sj,
                             (t_ok & (src < 0) & reads)[:, None] & c_ok[None, :])
                acc += u * load_f32(weight + cc * stride_wc + j * stride_wj, c_ok)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out_rows = (bos + pos).to(tl.int64) * channels  # out is contiguous, token rows in x's order
    store_as(out + out_rows[:, None] + cc[None, :], acc, t_ok[:, None] & c_ok[None, :], EMULATE)
    if HAS_STATES:
        if block == first:
            # the new row's column i is input length − (W−1) + i: a token, or (< 0) column i + length of the old row
            ii = tl.arange(0, WP)
            kept = length - (W - 1) + ii
            cols = (ii < W - 1)[None, :] & c_ok[:, None]
            new = load_f32(x_seq + kept.to(tl.int64)[None, :] * stride_xt + x_cols[:, None],
                           cols & (kept >= 0)[None, :])
            new += load_f32(row[:, None] + (W - 1 + kept)[None, :] * stride_sj, cols & ((kept < 0) & reads)[None, :])
            tl.debug_barrier()  # every read of the old row, by any thread of this program, before the writes
            store_as(row[:, None] + ii[None, :] * stride_sj, new, cols & live, EMULATE)


@triton.jit
def conv_update_kernel(
    x, weight, bias, states, slots, out, stride_xn, stride_xc, stride_wc, stride_wj, stride_bias, stride_sp, stride_sc,
    stride_sj, stride_slot, num_seqs, channels, pool_rows,
    W: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, WP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SILU: tl.constexpr, EMULATE: tl.constexpr,
):
    """One token per sequence (a decode step): program (sequence block, channel block) reads the W−1 columns of
    its BS sequences' pool rows once, as one ``[BS, BC, WP]`` tile (BS slot -> row chains in flight at once), writes
    the outputs and, after a barrier, the shifted rows. A sequence past N, or whose slot is negative or at or past
    the pool's size, reads zeros and writes no row."""
    nn = tl.program_id(0) * BS + tl.arange(0, BS)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    n_ok = nn < num_seqs
    c_ok = cc < channels
    if HAS_SLOTS:
        slot = tl.load(slots + nn * stride_slot, mask=n_ok, other=-1).to(tl.int64)
    else:
        slot = nn.to(tl.int64)
    live = n_ok & (slot >= 0) & (slot < pool_rows)
    channel = cc.to(tl.int64)  # offsets of pools and inputs past 2**31 elements
    cols = tl.arange(0, WP)
    token_ok = n_ok[:, None] & c_ok[None, :]  # [BS, BC]
    x_t = load_f32(x + nn.to(tl.int64)[:, None] * stride_xn + channel[None, :] * stride_xc, token_ok)
    rows = states + tl.where(live, slot, 0)[:, None, None] * stride_sp + channel[None, :, None] * stride_sc + \
        cols[None, None, :] * stride_sj  # [BS, BC, WP] pointers to the old row's columns
    row_ok = (live[:, None] & c_ok[None, :])[:, :, None]
    state = load_f32(rows, row_ok & (cols < W - 1)[None, None, :])
    taps = load_f32(weight + channel[:, None] * stride_wc + cols[None, :] * stride_wj,
                    c_ok[:, None] & (cols < W - 1)[None, :])
    acc = tl.sum(state * taps[None, :, :], axis=2) + x_t * load_f32(weight + channel * stride_wc + (W - 1) * stride_wj,
                                                                    c_ok)[None, :]
    if HAS_BIAS:
        acc += load_f32(bias + channel * stride_bias, c_ok)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    store_as(out + nn.to(tl.int64)[:, None] * channels + channel[None, :], acc, token_ok, EMULATE)
    # the new row's column j is the old column j + 1 (j < W−2) or the token (j = W−2)
    shifted = load_f32(rows + stride_sj, row_ok & (cols < W - 2)[None, None, :])
    new_rows = tl.where((cols == W - 2)[None, None, :], x_t[:, :, None], shifted)
    tl.debug_barrier()  # every read of the old rows, by any thread of this program, before the writes
    store_as(rows, new_rows, row_ok & (cols < W - 1)[None, None, :], EMULATE)


@triton.jit
def conv_update_rows_kernel(
    x, weight, bias, states, slots, out, stride_xn, stride_xc, stride_wc, stride_wj, stride_bias, stride_sp,
    stride_slot, num_seqs, channels, pool_rows,
    W: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, BCP: tl.constexpr, F: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SILU: tl.constexpr, EMULATE: tl.constexpr,
):
    """One token per sequence where each pool row is contiguous (``[C, W−1]`` with strides ``(W−1, 1)``): program
    (sequence block, channel block) takes its BC channels of each of its BS rows as one flat span of ``BC·(W−1)``
    elements (an ``[F]`` tile: vector loads and stores), the taps and the shifted row taken apart in shared memory
    (``tl.gather``), so that an element costs a few instructions where the tile kernel's padded, stride-(W−1)
    scalar accesses cost many. The same sums as :func:`conv_update_kernel` in the same tap order; a sequence past
    N, or whose slot is negative or at or past the pool's size, reads zeros and writes no row. (One sequence at a
    time: Triton 3.6 fails to compile a gather along the second axis of a ``[BS, F]`` tile.)"""
    c0 = tl.program_id(1) * BC
    flat = tl.arange(0, F)
    flat_ok = (flat < BC * (W - 1)) & (c0 * (W - 1) + flat < channels * (W - 1))
    local = tl.arange(0, BCP)  # the program's channels, c0 + local
    c_ok = (local < BC) & (c0 + local < channels)
    channel = (c0 + local).to(tl.int64)
    for s in tl.static_range(BS):
        n = tl.program_id(0) * BS + s
        n_ok = n < num_seqs
        if HAS_SLOTS:
            slot = tl.load(slots + n * stride_slot, mask=n_ok, other=-1).to(tl.int64)
        else:
            slot = n.to(tl.int64)
        live = n_ok & (slot >= 0) & (slot < pool_rows)
        row = states + tl.where(live, slot, 0) * stride_sp + c0 * (W - 1)  # 64-bit base; in-row offsets in 32 bits
        old = load_f32(row + flat, live & flat_ok)
        x_t = load_f32(x + n.to(tl.int64) * stride_xn + channel * stride_xc, n_ok & c_ok)
        acc = x_t * load_f32(weight + channel * stride_wc + (W - 1) * stride_wj, c_ok)
        for j in tl.static_range(W - 1):  # oldest tap first, as the tile kernel's sum
            tap = tl.gather(old, tl.minimum(local * (W - 1) + j, F - 1), 0)
            acc += tap * load_f32(weight + channel * stride_wc + j * stride_wj, c_ok)
        if HAS_BIAS:
            acc += load_f32(bias + channel * stride_bias, c_ok)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        store_as(out + n.to(tl.int64) * channels + channel, acc, n_ok & c_ok, EMULATE)
        # the new row's element e (channel e // (W−1), column e % (W−1)) is the old e + 1, or the token last
        shifted = tl.gather(old, tl.minimum(flat + 1, F - 1), 0)
        token = tl.gather(x_t, tl.minimum(flat // (W - 1), BCP - 1), 0)
        new_row = tl.where(flat % (W - 1) == W - 2, token, shifted)
        tl.debug_barrier()  # every read of the old row, by any thread of this program, before the writes
        store_as(row + flat, new_row, live & flat_ok, EMULATE)


def conv_update_forward(x, weight, bias, conv_states, slots, silu, out, block_s, block_c, warps):
    """Launch the conv's decode step on validated inputs: ``x [N, 1, C]`` any strides, ``out`` contiguous, the
    pool rows of live slots shifted in place; ``block_s`` sequences and ``block_c`` channels per program on
    ``warps`` warps. Contiguous pool rows take :func:`conv_update_rows_kernel`, other layouts
    :func:`conv_update_kernel`."""
    num_seqs, _, channels = x.shape
    width = weight.shape[1]
    absent = weight  # stands for absent optional tensors; never dereferenced
    grid = (triton.cdiv(num_seqs, block_s), triton.cdiv(channels, block_c), 1)
    common = (x, weight, bias if bias is not None else absent, conv_states, slots if slots is not None else absent, out,
              x.stride(0), x.stride(2), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0)
    flags = dict(W=width, BS=block_s, BC=block_c, HAS_BIAS=bias is not None, HAS_SLOTS=slots is not None, SILU=silu,
                 EMULATE=interpreting(), num_warps=warps)
    slot_args = (slots.stride(0) if slots is not None else 0, num_seqs, channels, conv_states.shape[0])
    if contiguous_rows(conv_states):
        launch(conv_update_rows_kernel, grid, *common, conv_states.stride(0), *slot_args,
               BCP=triton.next_power_of_2(block_c), F=triton.next_power_of_2(block_c * (width - 1)), **flags)
    else:
        launch(conv_update_kernel, grid, *common, *conv_states.stride(), *slot_args,
               WP=triton.next_power_of_2(width - 1), **flags)


def contiguous_rows(conv_states):
    """Whether each pool row ``[C, W−1]`` is one contiguous span (strides ``(W−1, 1)``; size-1 dimensions count
    as contiguous), the layout :func:`conv_update_rows_kernel` reads."""
    _, channels, columns = conv_states.shape
    return (columns == 1 or conv_states.stride(2) == 1) and (channels == 1 or conv_states.stride(1) == columns)


def causal_conv1d_forward(x, weight, bias, conv_states, slots, has_initial_state, cu_seqlens, silu, out):
    """Launch the conv on validated inputs: ``x [T, C]`` (``cu_seqlens [N+1]``, or None for one sequence) or
    ``[B, T, C]``, any strides; ``out`` contiguous, x's shape, written; the pool rows of live slots updated in place
    (module docstring)."""
    if x.dim() == 2 and cu_seqlens is None:  # one sequence of every token
        x = x.unsqueeze(0)
    varlen = x.dim() == 2
    channels, width = weight.shape
    if varlen:
        tokens, num_seqs = x.shape[0], cu_seqlens.numel() - 1
        stride_b, stride_t = 0, x.stride(0)
    else:
        num_seqs, tokens = x.shape[0], x.shape[1]
        stride_b, stride_t = x.stride(0), x.stride(1)
        if tokens == 0:  # no token rows to address, but states to write: a varlen batch of empty sequences
            varlen, cu_seqlens = True, torch.zeros(num_seqs + 1, dtype=torch.int32, device=x.device)
    if num_seqs == 0 or channels == 0:
        return
    if not varlen and tokens == 1 and conv_states is not None and has_initial_state is None:  # a decode step
        conv_update_forward(x, weight, bias, conv_states, slots, silu, out,
                            *conv_update_launch(num_seqs, channels, width, contiguous_rows(conv_states)))
        return
    block_t, block_c, warps = conv_launch(tokens, channels, width)
    has_states = conv_states is not None
    absent = weight  # stands for absent optional tensors; never dereferenced
    launch(
        conv_kernel,  # token blocks laid out as the prefill's chunk slots, counted by the same function
        (segment_slot_count(tokens, num_seqs, block_t, varlen), triton.cdiv(channels, block_c), 1),
        x, weight, bias if bias is not None else absent, conv_states if has_states else absent,
        slots if slots is not None else absent, has_initial_state if has_initial_state is not None else absent,
        cu_seqlens if varlen else absent, out,
        stride_b, stride_t, x.stride(-1), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
        *(conv_states.stride() if has_states else (0, 0, 0)), slots.stride(0) if slots is not None else 0,
        has_initial_state.stride(0) if has_initial_state is not None else 0, tokens, num_seqs, channels,
        conv_states.shape[0] if has_states else 0,
        W=width, BT=block_t, BC=block_c, WP=triton.next_power_of_2(width - 1), IS_VARLEN=varlen,
        HAS_BIAS=bias is not None, HAS_STATES=has_states, HAS_SLOTS=slots is not None,
        HAS_INITIAL_FLAGS=has_initial_state is not None, SILU=silu, EMULATE=interpreting(), num_warps=warps,
    )

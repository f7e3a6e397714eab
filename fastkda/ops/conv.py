"""The KDA layer's depthwise causal conv (spec §9 step 2) on the GPU: varlen prefill (and decode of several tokens)
in one kernel, a decode step of one token per sequence in another (:func:`conv_update_kernel`).

One program per (token block, channel block). A token block is up to ``BT`` consecutive tokens of one sequence,
laid out as the prefill's chunk slots (:mod:`fastkda.ops.prefill.layout`, with ``BT`` for the chunk): every
program finds its sequence from ``cu_seqlens`` alone, with no host-device synchronisation, and every sequence,
an empty one too, owns a first block. Each output is ``act(bias + Σ_j w_j·u_{t−(W−1)+j})`` in fp32, from W loads
of shifted token rows (they overlap in cache) read through x's strides.

The conv state. A sequence's W−1 inputs before its first token are the last W−1 columns of its pool row
``conv_states[slot]`` (``[C, S]`` through its strides, the last S >= W−1 inputs, oldest first) when the slot is
live (in ``[0, P)``) and its ``has_initial_state`` flag is set, else are zeros. Only the first block's tokens reach
back that far (``BT ≥ W−1``), so the first block's program is the only one that reads the row, and it also writes
it: after a barrier (its threads' reads of the old row come first), the last S inputs, which for a sequence
shorter than S tokens include the old row's tail. A negative slot or one at or past the pool's size reads and writes
nothing, so whatever ``slots`` holds no access leaves the pool; ``cu_seqlens`` spans are clamped into
``[0, T]`` as the prefill's are. Two live sequences must not share a slot (their programs would race).
"""

import torch
import triton
import triton.language as tl

from .common import interpreting, launch, load_f32, store_as
from .prefill.layout import first_slot, sequence_of_slot, sequence_span
from ..plan import conv_launch, conv_update_launch, slot_count


@triton.jit
def conv_kernel(
    x, weight, bias, states, slots, has_initial, cu_seqlens, out,
    stride_xb, stride_xt, stride_xc, stride_wc, stride_wj, stride_bias, stride_sp, stride_sc, stride_sj,
    stride_slot, stride_initial, seq_len, num_seqs, channels, pool_rows,
    W: tl.constexpr, S: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SP: tl.constexpr, IS_VARLEN: tl.constexpr,
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
                u = load_f32(row[None, :] + (S + src)[:, None] * stride_sj,
                             (t_ok & (src < 0) & reads)[:, None] & c_ok[None, :])
                acc += u * load_f32(weight + cc * stride_wc + j * stride_wj, c_ok)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out_rows = (bos + pos).to(tl.int64) * channels  # out is contiguous, token rows in x's order
    store_as(out + out_rows[:, None] + cc[None, :], acc, t_ok[:, None] & c_ok[None, :], EMULATE)
    if HAS_STATES:
        if block == first:
            # the new row's column i is input length − S + i: a token, or (< 0) column i + length of the old row
            ii = tl.arange(0, SP)
            kept = length - S + ii
            cols = (ii < S)[None, :] & c_ok[:, None]
            new = load_f32(x_seq + kept.to(tl.int64)[None, :] * stride_xt + x_cols[:, None],
                           cols & (kept >= 0)[None, :])
            new += load_f32(row[:, None] + (S + kept)[None, :] * stride_sj, cols & ((kept < 0) & reads)[None, :])
            tl.debug_barrier()  # every read of the old row, by any thread of this program, before the writes
            store_as(row[:, None] + ii[None, :] * stride_sj, new, cols & live, EMULATE)


@triton.jit
def load_columns(column, ok, stride_j, S: tl.constexpr):
    """The S columns of pool rows, oldest first, from ``column`` (pointers to column 0, any shape) on: a tuple of
    fp32 tensors, zeros where not ``ok``. The pointers advance column by column (no product j·stride past
    2**31)."""
    columns = ()
    for j in tl.static_range(S):
        columns = columns + (load_f32(column, ok),)
        column += stride_j
    return columns


@triton.jit
def conv_sum(x_t, columns, taps, ok, stride_wj, W: tl.constexpr, S: tl.constexpr):
    """``Σ_j w_j·u_j + w_{W−1}·x`` in fp32 over the last W−1 of the S ``columns`` (:func:`load_columns`), the
    oldest input first (no bias, no activation); ``taps`` pointers to each channel's first tap (zeros where not
    ``ok``)."""
    acc = tl.zeros_like(x_t)
    for j in tl.static_range(W - 1):
        acc += columns[S - (W - 1) + j] * load_f32(taps + j * stride_wj, ok)
    return acc + x_t * load_f32(taps + (W - 1) * stride_wj, ok)


@triton.jit
def store_shifted(column, columns, x_t, ok, stride_j, S: tl.constexpr, EMULATE: tl.constexpr):
    """Write the new conv state's S columns from ``column`` on: column j is the old column j + 1 (``columns``), the
    last the token ``x_t``. Its caller stores it only after every read of the old state it must not overtake."""
    for j in tl.static_range(S):
        if j < S - 1:
            store_as(column, columns[j + 1], ok, EMULATE)
        else:
            store_as(column, x_t, ok, EMULATE)
        column += stride_j


@triton.jit
def conv_update_kernel(
    x, weight, bias, states, slots, out, stride_xn, stride_xc, stride_wc, stride_wj, stride_bias, stride_sp, stride_sc,
    stride_sj, stride_slot, num_seqs, channels, pool_rows,
    W: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SILU: tl.constexpr, EMULATE: tl.constexpr,
):
    """One token per sequence (a decode step): program (sequence block, channel block) loads the S columns of its
    BS sequences' pool rows as S ``[BS, BC]`` tiles held in registers (a tuple), every load issued before any
    store so that BS slot -> row chains are in flight at once; it writes the outputs (from the last W−1 columns)
    and, after a barrier, the shifted columns from the same registers. Per channel and token that is S loads and
    stores from one address, where a ``[BS, BC, S]`` tile padded to a power of two cost several times the
    instructions. Any strides (a channel-last pool's columns are vector loads). A sequence past N, or whose slot
    is negative or at or past the pool's size, reads zeros and writes no row."""
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
    column = states + tl.where(live, slot, 0)[:, None] * stride_sp + channel[None, :] * stride_sc  # column 0's
    row_ok = live[:, None] & c_ok[None, :]
    token_ok = n_ok[:, None] & c_ok[None, :]
    old = load_columns(column, row_ok, stride_sj, S)
    x_t = load_f32(x + nn.to(tl.int64)[:, None] * stride_xn + channel[None, :] * stride_xc, token_ok)
    acc = conv_sum(x_t, old, weight + channel * stride_wc, c_ok, stride_wj, W, S)  # taps [BC] against [BS, BC]
    if HAS_BIAS:
        acc += load_f32(bias + channel * stride_bias, c_ok)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    store_as(out + nn.to(tl.int64)[:, None] * channels + channel[None, :], acc, token_ok, EMULATE)
    tl.debug_barrier()  # every read of the old rows, by any thread of this program, before the writes
    store_shifted(column, old, x_t, row_ok, stride_sj, S, EMULATE)


def conv_update_forward(x, weight, bias, conv_states, slots, silu, out, block_s, block_c, warps):
    """Launch :func:`conv_update_kernel` on validated inputs: ``x [N, 1, C]`` any strides, ``out`` contiguous, the
    pool rows of live slots shifted in place; ``block_s`` sequences and ``block_c`` channels per program on
    ``warps`` warps."""
    num_seqs, _, channels = x.shape
    width = weight.shape[1]
    absent = weight  # stands for absent optional tensors; never dereferenced
    launch(
        conv_update_kernel, (triton.cdiv(num_seqs, block_s), triton.cdiv(channels, block_c), 1),
        x, weight, bias if bias is not None else absent, conv_states, slots if slots is not None else absent, out,
        x.stride(0), x.stride(2), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
        *conv_states.stride(), slots.stride(0) if slots is not None else 0, num_seqs, channels, conv_states.shape[0],
        W=width, S=conv_states.shape[2], BS=block_s, BC=block_c, HAS_BIAS=bias is not None,
        HAS_SLOTS=slots is not None, SILU=silu, EMULATE=interpreting(), num_warps=warps,
    )


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
        channel_last = conv_states.stride(1) == 1  # a column's channels contiguous (any pool of W = 2 too)
        conv_update_forward(x, weight, bias, conv_states, slots, silu, out,
                            *conv_update_launch(num_seqs, channels, channel_last))
        return
    block_t, block_c, warps = conv_launch(tokens, channels, width)
    has_states = conv_states is not None
    state_columns = conv_states.shape[2] if has_states else width - 1
    absent = weight  # stands for absent optional tensors; never dereferenced
    launch(
        conv_kernel,  # token blocks laid out as the prefill's chunk slots, counted by the same function
        (slot_count(tokens, num_seqs, block_t, varlen), triton.cdiv(channels, block_c), 1),
        x, weight, bias if bias is not None else absent, conv_states if has_states else absent,
        slots if slots is not None else absent, has_initial_state if has_initial_state is not None else absent,
        cu_seqlens if varlen else absent, out,
        stride_b, stride_t, x.stride(-1), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
        *(conv_states.stride() if has_states else (0, 0, 0)), slots.stride(0) if slots is not None else 0,
        has_initial_state.stride(0) if has_initial_state is not None else 0, tokens, num_seqs, channels,
        conv_states.shape[0] if has_states else 0,
        W=width, S=state_columns, BT=block_t, BC=block_c, SP=triton.next_power_of_2(state_columns),
        IS_VARLEN=varlen, HAS_BIAS=bias is not None, HAS_STATES=has_states, HAS_SLOTS=slots is not None,
        HAS_INITIAL_FLAGS=has_initial_state is not None, SILU=silu, EMULATE=interpreting(), num_warps=warps,
    )

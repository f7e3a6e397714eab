"""The recurrence's walk over chunks on a warpgroup per 64 columns of a 64- or 128-column slice, in Gluon (the
plan's ``warpgroup_recurrence``): the serial recurrence, the rerun of every segment under sequence parallelism,
and the segments' transitions.

The arithmetic is :func:`fastkda.ops.prefill.recurrence.walk_chunks`'s transposed form, product for product:
``Y = bf16(vᵀ − Sᵀ·kdᵀ)``, ``v_new = Y·T_loᵀ + Y·T_hiᵀ`` (one accumulation, the low half first),
``Sᵀ = Sᵀ·diag(decay) + bf16(v_new)·kg``, ``oᵀ = Sᵀ·qgᵀ + bf16(v_new)·Aᵀ``, every operand bf16 and every product
accumulated from zero in fp32 but the state's, which accumulates onto the decayed state; which chunks a program
walks, the state it starts from and what it writes at the end are ``walk_chunks``'s own helpers. So its results
are the Triton kernel's bits, and every V-slice plan keeps its bitwise promise. What Gluon adds is the placement
that plain Triton does not let a kernel choose (docs/perf-notes.md, "The recurrence on a warpgroup per 64
columns"):

* every tile a step reads (kd, qg, kg, A, T·β, v, the chunk decay) is copied into a shared-memory ring
  ``stages − 1`` chunks ahead with ``cp.async``, one commit group per chunk, and each is read from there in the
  layout its use needs: v transposed straight into the products' accumulator layout, the decay into the state's
  column layout, so that no step converts a layout through shared memory;
* T·β is split into its bf16 halves a step ahead, into one of two buffers, while the products run;
* one barrier a step publishes the chunk's tiles and the halves and frees the ring slot it refills (the compiler
  adds a second before the halves are written, while the products run: it cannot tell the two buffers apart);
* the state's product is issued before the output's two, and the step waits for the state alone before forming
  the next step's operand; the output is waited for after that, within its step (ptxas waits at the loop's head
  for any product still in flight over the back edge, so carrying it into the next step gains nothing:
  docs/perf-notes.md, "Session 39"), and put into one of two shared-memory buffers,
  transposed; the next step, past its barrier, stores it from there with 16-byte stores along V while its own
  products run (the accumulator's layout would store two bytes at a time);
* the serial recurrence and the segments' reruns issue the refill of the ring slot the last chunk freed while
  the step's first product (Y) runs, this chunk's v and decay read out of the ring just before it (then Gluon's
  shared-memory analysis puts its barrier before the copies and none after them, and ptxas runs the decay's
  multiplies beside the product too); issued after the step's last product, as the transitions still do (ptxas
  in triton 3.6 crashes compiling them in the early order), the copies' address arithmetic runs with the tensor
  cores idle (docs/perf-notes.md, "The refills' copies issued while the step's first product runs").

Gluon has no interpreter: on the CPU the Triton kernel runs the same arithmetic, and the GPU tests compare the two
bit for bit.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ..tiles import lower_sectors, tile_offsets
from .layout import OWNER_LOOKUP_WIDTH, sequence_order
from .recurrence import finish_walk, head_sections, program_chunks, starting_state, store_checkpoint

cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # a barrier of the program's threads (bar.sync): its
# name since triton 3.7, thread_barrier in 3.6


@gluon.jit
def copy_chunk(c, c_end, bos, eos, slot0, stage, kd_ws, qg_ws, kg_ws, A_ws, T_ws, v_h, decay_h, stride_v,
               kd_s, qg_s, kg_s, A_s, T_s, v_s, decay_s,
               H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr, vs,
               ROWS_K: gl.constexpr, ROWS_C: gl.constexpr, ROWS_T: gl.constexpr, ROWS_V: gl.constexpr,
               VECTOR: gl.constexpr, OUTPUTS: gl.constexpr):
    """Start the copies of chunk ``c``'s tiles into ring slot ``stage`` and commit them as one group (qg and M
    only for ``OUTPUTS``); a chunk at or past ``c_end`` copies nothing (its slot fills with zeros) but still
    commits, so that every step waits for the same group count. v's columns past V (a transition's identity
    columns) read as zeros."""
    # one scalar base a tile (64-bit) and 32-bit offsets inside the chunk: no 64-bit product an element
    first = bos + c * C  # the chunk's first token
    rows_left = gl.minimum(eos - first, (c_end - c) * C)  # rows inside the sequence: none past c_end
    row0 = first.to(gl.int64)
    r_k = gl.arange(0, C, layout=gl.SliceLayout(1, ROWS_K))
    at_k = r_k[:, None] * (H * K) + gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_K))[None, :]
    ok_k = (r_k < rows_left)[:, None]
    async_copy.async_copy_global_to_shared(kd_s.index(stage), kd_ws + row0 * (H * K) + at_k, mask=ok_k)
    async_copy.async_copy_global_to_shared(kg_s.index(stage), kg_ws + row0 * (H * K) + at_k, mask=ok_k)
    if OUTPUTS:
        async_copy.async_copy_global_to_shared(qg_s.index(stage), qg_ws + row0 * (H * K) + at_k, mask=ok_k)
        r_c = gl.arange(0, C, layout=gl.SliceLayout(1, ROWS_C))
        cols_c = gl.arange(0, C, layout=gl.SliceLayout(0, ROWS_C))
        async_copy.async_copy_global_to_shared(A_s.index(stage),
                                               A_ws + row0 * (H * C) + (r_c[:, None] * (H * C) + cols_c[None, :]),
                                               mask=lower_sectors(A_ws, r_c, r_c < rows_left, cols_c))
    r_t = gl.arange(0, C, layout=gl.SliceLayout(1, ROWS_T))
    cols_t = gl.arange(0, C, layout=gl.SliceLayout(0, ROWS_T))
    async_copy.async_copy_global_to_shared(T_s.index(stage),
                                           T_ws + row0 * (H * C) + (r_t[:, None] * (H * C) + cols_t[None, :]),
                                           mask=lower_sectors(T_ws, r_t, r_t < rows_left, cols_t))
    r_v = gl.arange(0, C, layout=gl.SliceLayout(1, ROWS_V))
    cols_v = vs * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, ROWS_V))
    async_copy.async_copy_global_to_shared(v_s.index(stage),
                                           v_h + row0 * stride_v + (r_v.to(gl.int64)[:, None] * stride_v
                                                                    + cols_v[None, :]),
                                           mask=(r_v < rows_left)[:, None] & (cols_v < V)[None, :])
    kk = gl.arange(0, K, layout=VECTOR)
    async_copy.async_copy_global_to_shared(decay_s.index(stage), decay_h + (slot0 + c).to(gl.int64) * (H * K) + kk,
                                           mask=(kk < K) & (c < c_end))
    async_copy.commit_group()


@gluon.jit
def ring_slots(c, c0, carried, STAGES: gl.constexpr):
    """Chunk c's ring slot ``(c − c0) % STAGES``, the next chunk's, and the one that chunk ``c + STAGES − 1``
    refills. A ring of a power of two takes them as remainders (masks); another (five chunks) from ``carried``,
    chunk c's slot carried over the loop, by a compare and a select, since a remainder by five cost the step about
    40 instructions (docs/perf-notes.md, "The ring's slot carried")."""
    if STAGES & (STAGES - 1) == 0:
        return (c - c0) % STAGES, (c - c0 + 1) % STAGES, (c - c0 + STAGES - 1) % STAGES
    else:
        return (carried, carried + 1 - STAGES * (carried == STAGES - 1).to(gl.int32),
                carried - 1 + STAGES * (carried == 0).to(gl.int32))


@gluon.jit
def split_t(T_s, stage, lo_s, hi_s, half, ROWS_T: gl.constexpr):
    """T·β of ring slot ``stage`` (fp32) as its bf16 halves ``hi + lo`` into buffer ``half`` of the halves, made
    visible to the tensor cores' proxy (the next barrier makes them visible to the other warps)."""
    t = T_s.index(stage).load(ROWS_T)
    hi = t.to(gl.bfloat16)
    lo = (t - hi.to(gl.float32)).to(gl.bfloat16)
    hi_s.index(half).store(hi)
    lo_s.index(half).store(lo)
    fence_async_shared()


@gluon.jit
def store_output(o_s, half, out_h, bos, c, eos, stride_out, vs, BV: gl.constexpr, C: gl.constexpr,
                 ROWS_V: gl.constexpr):
    """Chunk ``c``'s output, which buffer ``half`` of ``o_s`` holds (``[C, BV]``), to its tokens' rows: whole
    16-byte runs along V, the tokens past the sequence's end left alone."""
    first = bos + c * C  # the chunk's first token: a scalar 64-bit base, the rows' offsets from it
    r = gl.arange(0, C, layout=gl.SliceLayout(1, ROWS_V))
    cols = vs * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, ROWS_V))
    gl.store(out_h + first.to(gl.int64) * stride_out + (r.to(gl.int64)[:, None] * stride_out + cols[None, :]),
             o_s.index(half).load(ROWS_V), mask=(r < eos - first)[:, None])


@gluon.jit
def warpgroup_walk(
    ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, transitions_at, entries_at, order_at, out, initial_state,
    final_state, cu_seqlens, errors, ckpt_offsets, ckpt_states, stride_out, seq_len, num_seqs, stride_ckpt_n,
    stride_ckpt_j, v, stride_v, segment_chunks,
    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
    IS_VARLEN: gl.constexpr, HAS_INITIAL: gl.constexpr, HAS_FINAL: gl.constexpr, NUM_CKPT: gl.constexpr,
    SEGMENTED: gl.constexpr, TRANSITION: gl.constexpr, OPEN_ENTRY: gl.constexpr, LONGEST_FIRST: gl.constexpr,
    STAGES: gl.constexpr,
):
    """:func:`fastkda.ops.prefill.recurrence.walk_chunks` (its arguments, the state held transposed) on a
    warpgroup per 64 columns, with a ring of ``STAGES`` chunks (module docstring)."""
    W: gl.constexpr = BV // 16  # a warp per 16 rows of the products: a warpgroup per 64 columns
    gl.static_assert((BV == 64) | (BV == 128))
    gl.static_assert(C == 32)
    gl.static_assert(STAGES >= 4)
    gl.static_assert(gl.num_warps() == W)
    OUTPUTS: gl.constexpr = not TRANSITION
    # the refills issued while Y's product runs (module docstring), wherever the step has outputs: a transition's
    # compile crashes ptxas (triton 3.6) in that order
    EARLY_REFILL: gl.constexpr = OUTPUTS
    EARLY_DECAY: gl.constexpr = EARLY_REFILL and NUM_CKPT == 0  # with checkpoints, held over Y it spills (ptxas)
    # products: the slice's BV columns are M; [BV, C] accumulators (Y, v_new, o) and the [BV, K] state
    ACC_C: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, C, 16])
    ACC_K: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, K, 16])
    OP_C: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_C, k_width=2)
    OP_K: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_K, k_width=2)
    # the copies: each tile's rows across the threads, each thread's elements along a row (16 bytes but A's at
    # 8 warps), no element held twice but the decay's below 32·W channels
    ROWS_K: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // K, K // 8], [W, 1], [1, 0])
    ROWS_C: gl.constexpr = gl.BlockedLayout([1, C // W], [32 // W, W], [W, 1], [1, 0])
    ROWS_T: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [W, 1], [1, 0])
    ROWS_V: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BV, BV // 8], [W, 1], [1, 0])  # v and the output
    VECTOR: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])  # the decay, 4 bytes a thread
    SHARED_K: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, K], gl.bfloat16)
    SHARED_C: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], gl.bfloat16)
    SHARED_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], v.dtype.element_ty)
    SHARED_O: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], out.dtype.element_ty)
    PLAIN_T: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PLAIN_1D: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    vs = gl.program_id(0)
    h = gl.program_id(1)
    kd_ws, qg_ws, kg_ws, A_ws, T_ws, v_h, out_h, decay_h = head_sections(ws_bf16, ws_fp32, qg_at, kg_at, A_at,
                                                                          scratch_at, v, out, h, K, V, C)
    lanes = gl.arange(0, OWNER_LOOKUP_WIDTH, layout=VECTOR)
    n, bos, eos, in_order, slot0, num_chunks, slot, j, c0, c1, c_end, active, first_segment, own_slot = \
        program_chunks(cu_seqlens, seq_len, num_seqs, segment_chunks, vs, lanes, sequence_order(ws_fp32, order_at), V,
                       BV, C, IS_VARLEN, SEGMENTED, TRANSITION, OPEN_ENTRY, LONGEST_FIRST)

    kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], SHARED_K)
    kg_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], SHARED_K)
    if OUTPUTS:
        qg_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, K], SHARED_K)
        A_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, C, C], SHARED_C)
        o_s = gl.allocate_shared_memory(out.dtype.element_ty, [2, C, BV], SHARED_O)
    else:  # a transition reads none of these: the copies skip them, nothing reads these names
        qg_s = kd_s
        A_s = kd_s
        o_s = kd_s
    T_s = gl.allocate_shared_memory(gl.float32, [STAGES, C, C], PLAIN_T)
    v_s = gl.allocate_shared_memory(v.dtype.element_ty, [STAGES, C, BV], SHARED_V)
    decay_s = gl.allocate_shared_memory(gl.float32, [STAGES, K], PLAIN_1D)
    lo_s = gl.allocate_shared_memory(gl.bfloat16, [2, C, C], SHARED_C)
    hi_s = gl.allocate_shared_memory(gl.bfloat16, [2, C, C], SHARED_C)

    for i in gl.static_range(STAGES - 1):  # the first chunks' copies, in flight while the state loads
        copy_chunk(c0 + i, c_end, bos, eos, slot0, i, kd_ws, qg_ws, kg_ws, A_ws, T_ws, v_h, decay_h, stride_v,
                   kd_s, qg_s, kg_s, A_s, T_s, v_s, decay_s, H, K, V, BV, C, vs, ROWS_K, ROWS_C, ROWS_T, ROWS_V,
                   VECTOR, OUTPUTS)
    # the state Sᵀ [BV, K] in the state product's accumulator layout (a transition's columns from V on are its
    # identity columns), its addresses in [N, H, V, K] and in one (slot, head)'s [V, K] rows
    sv = vs * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, ACC_K))
    sk = gl.arange(0, K, layout=gl.SliceLayout(0, ACC_K))
    local = tile_offsets(sv, sk, K, 1)  # as walk_chunks addresses the transposed state
    state_offsets = ((n * H + h) * V).to(gl.int64) * K + local
    S = starting_state(ws_fp32, entries_at, initial_state, state_offsets, local, gl.zeros([BV, K], gl.float32, ACC_K),
                       sv, sk, slot, h, j, c1, num_chunks, active, H, V, K, HAS_INITIAL, True, SEGMENTED, TRANSITION)
    zero_C = gl.zeros([BV, C], gl.float32, ACC_C)

    async_copy.wait_group(STAGES - 2)  # the first chunk
    cta_barrier()
    split_t(T_s, 0, lo_s, hi_s, 0, ROWS_T)
    S_op = gl.convert_layout(S.to(gl.bfloat16), OP_C, assert_trivial=True)
    next_stage = 0  # the first chunk's ring slot (ring_slots)
    for c in range(c0, c_end):
        stage, next_stage, refill = ring_slots(c, c0, next_stage, STAGES)
        half = (c - c0) % 2
        if OUTPUTS:
            # under SEGMENTED a later segment's start is its predecessor's end, which that one writes
            skip = (c == c0) & (j > 0) if SEGMENTED else False
            for i in gl.static_range(NUM_CKPT):  # prefix-cache checkpoint: the state after c*C tokens
                store_checkpoint(ckpt_offsets, ckpt_states, n, i, stride_ckpt_n, stride_ckpt_j, c * C, skip,
                                 eos - bos, S, state_offsets, H, V, K, False)
        async_copy.wait_group(STAGES - 3)  # chunks c and c + 1 landed (this thread's copies)
        cta_barrier()  # everyone's copies and halves visible; every warp past chunk c - 1's products
        Y = warpgroup_mma(S_op, kd_s.index(stage).permute((1, 0)), zero_C, use_acc=False, is_async=True)
        # while Y's product runs: this chunk's v (and decay) out of the ring, then the refill of the slot chunk c − 1
        # freed (every warp is past its products: the barrier above)
        v_T = v_s.index(stage).permute((1, 0)).load(ACC_C).to(gl.float32)
        if EARLY_DECAY:
            decay = decay_s.index(stage).load(gl.SliceLayout(0, ACC_K))
        if EARLY_REFILL:
            copy_chunk(c + STAGES - 1, c_end, bos, eos, slot0, refill, kd_ws, qg_ws, kg_ws, A_ws, T_ws, v_h,
                       decay_h, stride_v, kd_s, qg_s, kg_s, A_s, T_s, v_s, decay_s, H, K, V, BV, C, vs, ROWS_K,
                       ROWS_C, ROWS_T, ROWS_V, VECTOR, OUTPUTS)
        Y = warpgroup_mma_wait(0, deps=[Y])
        Y_op = gl.convert_layout((v_T - Y).to(gl.bfloat16), OP_C, assert_trivial=True)
        v_new = warpgroup_mma(Y_op, lo_s.index(half).permute((1, 0)), zero_C, use_acc=False, is_async=True)
        v_new = warpgroup_mma(Y_op, hi_s.index(half).permute((1, 0)), v_new, is_async=True)
        if EARLY_DECAY:
            S_decayed = S * decay[None, :]  # ptxas runs the multiplies beside Y's product
        else:  # here, while v_new's products run
            S_decayed = S * decay_s.index(stage).load(gl.SliceLayout(0, ACC_K))[None, :]
        v_new = warpgroup_mma_wait(0, deps=[v_new])
        v_op = v_new.to(gl.bfloat16)
        S = warpgroup_mma(gl.convert_layout(v_op, OP_K, assert_trivial=True), kg_s.index(stage), S_decayed,
                          is_async=True)
        if OUTPUTS:
            o = warpgroup_mma(S_op, qg_s.index(stage).permute((1, 0)), zero_C, use_acc=False, is_async=True)
            o = warpgroup_mma(gl.convert_layout(v_op, OP_C, assert_trivial=True), A_s.index(stage).permute((1, 0)),
                              o, is_async=True)
        split_t(T_s, next_stage, lo_s, hi_s, 1 - half, ROWS_T)  # the next chunk's, beside the products
        if OUTPUTS:
            if c > c0:  # the previous chunk's output, which the barrier above published
                store_output(o_s, 1 - half, out_h, bos, c - 1, eos, stride_out, vs, BV, C, ROWS_V)
            S = warpgroup_mma_wait(2, deps=[S])  # the state's product only
        else:
            S = warpgroup_mma_wait(0, deps=[S])
        S_op = gl.convert_layout(S.to(gl.bfloat16), OP_C, assert_trivial=True)
        if OUTPUTS:
            o = warpgroup_mma_wait(0, deps=[o])
            o_s.index(half).permute((1, 0)).store(o.to(out.dtype.element_ty))
        if not EARLY_REFILL:
            copy_chunk(c + STAGES - 1, c_end, bos, eos, slot0, refill, kd_ws, qg_ws, kg_ws, A_ws, T_ws, v_h,
                       decay_h, stride_v, kd_s, qg_s, kg_s, A_s, T_s, v_s, decay_s, H, K, V, BV, C, vs, ROWS_K,
                       ROWS_C, ROWS_T, ROWS_V, VECTOR, OUTPUTS)
    async_copy.wait_group(0)  # no copy outlives the program
    if OUTPUTS:
        if c_end > c0:  # the last chunk's output
            cta_barrier()
            store_output(o_s, (c_end - 1 - c0) % 2, out_h, bos, c_end - 1, eos, stride_out, vs, BV, C, ROWS_V)
    finish_walk(S, ws_fp32, transitions_at, final_state, ckpt_offsets, ckpt_states, errors, cu_seqlens, n, slot, h,
                vs, bos, eos, in_order, num_chunks, c1, active, first_segment, own_slot, seq_len, num_seqs,
                segment_chunks, stride_ckpt_n, stride_ckpt_j, state_offsets, local, lanes, H, V, K, C, IS_VARLEN,
                HAS_FINAL, NUM_CKPT, False, SEGMENTED, TRANSITION)


@gluon.jit
def warpgroup_recurrence_kernel(
    ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, entries_at, order_at, out, initial_state, final_state, cu_seqlens,
    errors, ckpt_offsets, ckpt_states, stride_out, seq_len, num_seqs, stride_ckpt_n, stride_ckpt_j, v, stride_v,
    segment_chunks, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
    IS_VARLEN: gl.constexpr, HAS_INITIAL: gl.constexpr, HAS_FINAL: gl.constexpr, NUM_CKPT: gl.constexpr,
    SEGMENTED: gl.constexpr, LONGEST_FIRST: gl.constexpr, STAGES: gl.constexpr,
):
    """:func:`fastkda.ops.prefill.recurrence.recurrence_kernel` (its arguments) on a warpgroup per 64 columns."""
    warpgroup_walk(ws_bf16, ws_fp32, qg_at, kg_at, A_at, scratch_at, 0, entries_at, order_at, out, initial_state,
                   final_state, cu_seqlens, errors, ckpt_offsets, ckpt_states, stride_out, seq_len, num_seqs,
                   stride_ckpt_n, stride_ckpt_j, v, stride_v, segment_chunks, H, K, V, BV, C, IS_VARLEN, HAS_INITIAL,
                   HAS_FINAL, NUM_CKPT, SEGMENTED, False, False, LONGEST_FIRST, STAGES)


@gluon.jit
def warpgroup_transition_kernel(
    ws_bf16, ws_fp32, kg_at, scratch_at, transitions_at, order_at, initial_state, cu_seqlens, seq_len, num_seqs, v,
    stride_v, segment_chunks, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, C: gl.constexpr,
    IS_VARLEN: gl.constexpr, HAS_INITIAL: gl.constexpr, OPEN_ENTRY: gl.constexpr, LONGEST_FIRST: gl.constexpr,
    STAGES: gl.constexpr,
):
    """:func:`fastkda.ops.prefill.recurrence.transition_kernel` (its arguments) on a warpgroup per 64 columns."""
    warpgroup_walk(ws_bf16, ws_fp32, 0, kg_at, 0, scratch_at, transitions_at, 0, order_at, ws_fp32, initial_state,
                   ws_fp32, cu_seqlens, ws_fp32, ws_fp32, ws_fp32, 0, seq_len, num_seqs, 0, 0, v, stride_v,
                   segment_chunks, H, K, V, BV, C, IS_VARLEN, HAS_INITIAL, False, 0, True, True, OPEN_ENTRY,
                   LONGEST_FIRST, STAGES)

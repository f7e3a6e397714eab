"""PyTorch implementations of KDA: the token-by-token truth (spec §1) and the chunked CPU path (spec §2).

Both take the operator's raw inputs (bf16 or any float dtype) and compute in ``dtype``. States are V-first,
``[N, H, V, K]``. Neither is fast on a GPU; the Triton path in :mod:`fastkda.ops` is.
"""

from __future__ import annotations

import functools
import math

import torch

from .checks import cu_seqlens_values
from .validation import INDEX_DTYPES, _describe, check_checkpoints_paired, fail

CPU_CHUNK = 16  # chunk length of the CPU path (spec §2)
# Chunked paths clamp a precomputed log-decay here: exp(-30) keeps 1e-13 of the state (below fp32
# resolution), and the floor bounds the in-chunk cumulative decay, so its fp32 ulp stays small. Like the GPU
# kernels, the CPU paths also take a precomputed value above 0 (outside the contract) as 0.
LOG_DECAY_FLOOR = -30.0


def autocast_off(function):
    """``function`` run with autocast off (CPU and CUDA): the reference and the CPU path compute in the dtypes they
    are given or name (fp32, float64), and inside a caller's ``torch.autocast`` region (a model run under autocast)
    their products would run in bf16, and their in-place updates of fp32 tensors from those products fail."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):  # the common case
            return function(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return function(*args, **kwargs)
    return run


def log_decay(g, A_log=None, dt_bias=None, lower_bound=None, dtype=torch.float32):
    """Per-token log-decay ``a`` (spec §1 step 2): the lower-bound gate when ``lower_bound`` is given, else ``g``."""
    g = g.to(dtype)
    if lower_bound is None:
        return g
    heads = g.shape[-2]
    A = A_log.to(dtype).reshape(heads, 1).exp()
    bias = dt_bias.to(dtype).reshape(heads, -1)
    return lower_bound * torch.sigmoid(A * (g + bias))


def l2_normalize(x):
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dimension (spec §1 step 1)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare_inputs(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid, dtype):
    """Apply the token-local parts of spec §1: norms, scale, gate and beta sigmoid, all in ``dtype``."""
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    a = log_decay(g, A_log, dt_bias, lower_bound, dtype)
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta)
    return q * scale, k, v, a, beta


def check_reference_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens):
    """Spec §3's shapes for the PyTorch paths, which take any float dtype and any K and V (the kernels' own
    validation, :mod:`fastkda.validation`, is narrower): ``ValueError`` naming the first argument that breaks them,
    where a mismatch would broadcast into a wrong result or fail deep inside an einsum. ``cu_seqlens`` values are
    read on the host (0 first, T last, in order), as the paths read them anyway."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            fail(name, "a floating-point tensor", _describe(x))
    if q.dim() != 4:
        fail("q", "[B, T, H, K]", list(q.shape))
    batch, length, heads, key_dim = q.shape
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            fail(name, f"of q's shape {list(q.shape)}", list(x.shape))
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        fail("v", f"[{batch}, {length}, {heads}, V]", list(v.shape))
    if beta.shape != q.shape[:3]:
        fail("beta", f"[{batch}, {length}, {heads}]", list(beta.shape))
    if lower_bound is not None:
        for name, x, size in (("A_log", A_log, heads), ("dt_bias", dt_bias, heads * key_dim)):
            if not isinstance(x, torch.Tensor) or x.numel() != size:
                fail(name, f"a tensor of {size} values (the lower-bound gate)", _describe(x))
    num_seqs = batch
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in INDEX_DTYPES:
            fail("cu_seqlens", "a 1-D int32/int64 tensor [N+1]", _describe(cu_seqlens) if not isinstance(
                cu_seqlens, torch.Tensor) else f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
        if batch != 1:
            fail("q", "of batch size 1 when cu_seqlens is given", batch)
        if cu_seqlens.numel() < 1:
            fail("cu_seqlens", "[N+1] offsets from 0 to T", "no entries")
        cu_seqlens_values(cu_seqlens, length)
        num_seqs = cu_seqlens.numel() - 1
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor)
                                      or initial_state.shape != (num_seqs, heads, v.shape[-1], key_dim)):
        fail("initial_state", f"[N, H, V, K] = [{num_seqs}, {heads}, {v.shape[-1]}, {key_dim}]",
             _describe(initial_state))


def sequence_bounds(batch, length, cu_seqlens):
    """``[(batch_index, start, end)]`` of each sequence: the B rows, or the ``cu_seqlens`` spans of row 0."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    offsets = cu_seqlens.tolist()
    return [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]


def _token_step(S, q, k, v, a, beta):
    """One token of spec §1 on states ``S [..., K, V]`` (updated in place); returns ``o [..., V]``."""
    S.mul_(a.exp().unsqueeze(-1))
    u = beta.unsqueeze(-1) * (v - torch.einsum("...kv,...k->...v", S, k))
    S.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("...kv,...k->...v", S, q)


def _zero_outputs(q, v, bounds, initial_state, dtype):
    """Zeroed output ``[B, T, H, V]`` and per-sequence states ``[N, H, K, V]`` set from ``initial_state``."""
    batch, length, heads, key_dim = q.shape
    out = torch.zeros(batch, length, heads, v.shape[-1], dtype=dtype, device=q.device)
    states = torch.zeros(len(bounds), heads, key_dim, v.shape[-1], dtype=dtype, device=q.device)
    if initial_state is not None:
        states.copy_(initial_state.to(dtype).transpose(-1, -2))
    return out, states


@autocast_off
def kda_reference(
    q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
    cu_seqlens=None, use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float64,
):
    """Token-by-token recurrence of spec §1 in ``dtype``; returns ``(o [B,T,H,V], final_state [N,H,V,K])``."""
    check_reference_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens)
    q, k, v, a, beta = prepare_inputs(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, dtype=dtype,
    )
    bounds = sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)
    out, final = _zero_outputs(q, v, bounds, initial_state, dtype)
    for n, (b, start, end) in enumerate(bounds):
        S = final[n]
        for t in range(start, end):
            out[b, t] = _token_step(S, q[b, t], k[b, t], v[b, t], a[b, t], beta[b, t])
    return out, final.transpose(-1, -2).contiguous()


def _chunk_decay_matrix(G):
    """``exp(G_i - G_j)`` for i >= j inside each chunk, zero above the diagonal: ``[..., C, C, K]``.

    Formed element-wise, so an unbounded precomputed gate cannot overflow (no ``exp(-G)`` factor)."""
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)
    size = G.shape[-2]
    lower = torch.ones(size, size, dtype=torch.bool, device=G.device).tril()
    return torch.where(lower.unsqueeze(-1), diff.clamp(max=0), float("-inf")).exp()


def _decay_factor(x):
    """``exp(x)`` in place for exponents ``x ≤ 0``, with those whose exp would be subnormal flushed to 0: such
    factors change nothing at the working precision, and subnormal operands slow the CPU's arithmetic many-fold."""
    tiny = math.log(torch.finfo(x.dtype).tiny)
    return torch.nn.functional.threshold_(x, tiny, -math.inf).exp_()


def _in_chunk_sums(a, inclusive):
    """Cumulative sums of ``a [..., C, K]`` along the chunk: ``Σ_{t ≤ i} a_t`` (inclusive) or ``Σ_{t > i} a_t``
    (the rest of the chunk), as one matmul with a 0/1 triangle."""
    size = a.shape[-2]
    ones = torch.ones(size, size, dtype=a.dtype, device=a.device)
    return torch.matmul(ones.tril_() if inclusive else ones.triu_(1), a)


def _in_chunk_products(q, k, a):
    """The in-chunk matrices of spec §2 for a batch of chunks: q, k, a ``[B, C, K]`` (a the per-token log-decay).
    Returns ``[B, 2, C, C]``: ``[:, 0]`` is M, ``Σ_k q_i k_j exp(G_i − G_j)`` for i ≥ j, ``[:, 1]`` the same with
    k_i in place of q_i for i > j (L without β); zero elsewhere.

    Never forms ``exp(−G)``: the lower triangle is split recursively into halves, and the block (second half) ×
    (first half) factors through the first half's last token b as ``exp(G_i − G_b) · exp(G_b − G_j)``, both ≤ 1,
    each exponent a sum of ``a`` inside one half (not a difference of cumulative sums, whose rounding grows with
    the decay before them). So any log-decay ≤ 0 is safe (the unbounded precomputed gate too), and every product
    is a batched matmul over K. A chunk length that is not a power of two is padded with tokens of zero q, k, a."""
    batch, size, key_dim = q.shape
    span = 1 << (size - 1).bit_length()
    if span != size:
        pad = (0, 0, 0, span - size)
        q, k, a = (torch.nn.functional.pad(x, pad) for x in (q, k, a))
    out = q.new_zeros(batch, 2, span, span)
    torch.diagonal(out[:, 0], dim1=-2, dim2=-1).copy_(torch.linalg.vecdot(q, k))
    half = span // 2
    while half:
        groups = span // (2 * half)
        split = lambda x: x.view(batch, groups, 2, half, key_dim)  # noqa: E731
        a_split, k_split = split(a), split(k)
        row = _decay_factor(_in_chunk_sums(a_split[:, :, 1], True))  # second half: exp(G_i − G_b) ≤ 1
        col = _decay_factor(_in_chunk_sums(a_split[:, :, 0], False)).mul_(k_split[:, :, 0]).transpose(-1, -2)
        blocks = torch.diagonal(out.view(batch, 2, groups, 2, half, groups, 2, half), dim1=2, dim2=5)
        for side, x in enumerate((q, k)):  # rows i of the second half, columns j of the first
            blocks[:, side, 1, :, 0].copy_(torch.matmul(split(x)[:, :, 1] * row, col).permute(0, 2, 3, 1))
        half //= 2
    return out[:, :, :size, :size] if span != size else out


def _unit_lower_inverse(L):
    """``(I + L)⁻¹`` for strictly lower triangular ``L [B, C, C]``: ``(I − L)(I + L²)(I + L⁴)…`` (L^C = 0)."""
    size = L.shape[-1]
    inv = torch.eye(size, dtype=L.dtype, device=L.device) - L
    power, covered = L, 2  # inv holds the terms (−L)^0 … (−L)^(covered−1)
    while covered < size:
        power = torch.bmm(power, power)
        inv = torch.baddbmm(inv, inv, power)
        covered *= 2
    return inv


def _to_chunks(x, n_chunks, chunk, dtype):
    """Token rows ``[T, H, ...]`` (T ≤ n_chunks·chunk) as zero-padded chunks ``[n_chunks, H, chunk, X]``, in
    ``dtype`` (always a fresh tensor)."""
    length, heads = x.shape[:2]
    x = x.reshape(length, heads, -1)
    full = length // chunk
    out = torch.empty(n_chunks, heads, chunk, x.shape[-1], dtype=dtype, device=x.device)
    if full:
        out[:full].copy_(x[:full * chunk].reshape(full, chunk, heads, -1).transpose(1, 2))
    if full < n_chunks:
        out[full:].zero_()
        out[full, :, :length - full * chunk].copy_(x[full * chunk:].transpose(0, 1))
    return out


def _prepare_block(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid, dtype,
                   chunk):
    """Token-parallel part of spec §2 (K1) for a block of chunks of one sequence: raw token rows q, k, g ``[T, H, K]``,
    v ``[T, H, V]``, beta ``[T, H]`` (a tail shorter than a chunk is padded with tokens that leave the state
    unchanged). Returns ``{w, u, qd, M, kr, decay}``, each ``[n_chunks, H, ...]``: ``w = (I+L)⁻¹·diag(β)·kd`` and
    ``u = (I+L)⁻¹·diag(β)·v`` (spec §7's WY form, so ``U = u − w·S``), ``qd``, ``M`` ``[.., C, C]``, ``kr`` and
    ``decay = exp(G_C)`` ``[.., K, 1]``."""
    length, heads, key_dim = q.shape
    n_chunks = -(-length // chunk)
    q, k, v, g, beta = (_to_chunks(x, n_chunks, chunk, dtype) for x in (q, k, v, g, beta))
    scale = key_dim ** -0.5 if scale is None else scale
    if use_qk_l2norm:  # l2_normalize, in place on the fresh copies
        q.mul_(torch.linalg.vector_norm(q, dim=-1, keepdim=True).square_().add_(1e-6).rsqrt_().mul_(scale))
        k.mul_(torch.linalg.vector_norm(k, dim=-1, keepdim=True).square_().add_(1e-6).rsqrt_())
    else:
        q.mul_(scale)
    if lower_bound is None:
        a = g.clamp_(min=LOG_DECAY_FLOOR, max=0.0)
    else:  # log_decay, with the head dimension third from last; a >= lower_bound, above the floor in [-5, 0)
        A = A_log.to(dtype).reshape(heads, 1, 1).exp()
        a = torch.addcmul(A * dt_bias.to(dtype).reshape(heads, 1, key_dim), A, g).sigmoid_().mul_(lower_bound)
        if lower_bound < LOG_DECAY_FLOOR:
            a.clamp_(min=LOG_DECAY_FLOOR)
    if length % chunk:  # padded tokens: zero q, k, v and zero decay
        a[-1, :, length % chunk:] = 0
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta)
    flat = n_chunks * heads
    q, k, v, a, beta = (x.view(flat, chunk, x.shape[-1]) for x in (q, k, v, a, beta))
    G = _in_chunk_sums(a, True)
    products = _in_chunk_products(q, k, a)
    solve = _unit_lower_inverse(products[:, 1] * beta).mul_(beta.transpose(-1, -2))  # (I + L)⁻¹·diag(β)
    growth = _decay_factor(G)
    w = torch.bmm(solve, k * growth)
    u = torch.bmm(solve, v)
    block = dict(w=w, u=u, qd=q.mul_(growth), M=products[:, 0], kr=k.mul_(_decay_factor(_in_chunk_sums(a, False))),
                 decay=growth[:, -1:].transpose(-1, -2))
    return {name: x.view(n_chunks, heads, *x.shape[1:]) for name, x in block.items()}


def _serial_chunks(block, S, out, checkpoints, first):
    """Serial part of spec §2 (K2) over a block's chunks from the state ``S [H, K, V]`` (updated in place): writes the
    outputs ``out [n_chunks, H, C, V]``; ``checkpoints`` maps a token offset to the ``[H, V, K]`` tensors that take
    the state there, ``first`` is the offset of the block's first token."""
    chunk = block["u"].shape[-2]
    names = ("w", "u", "qd", "M", "kr", "decay")
    for c, (w, u, qd, M, kr, decay, o) in enumerate(zip(*(block[x].unbind(0) for x in names), out.unbind(0))):
        for target in checkpoints.get(first + c * chunk, ()):
            target.copy_(S.transpose(-1, -2))
        v_new = u.baddbmm_(w, S, alpha=-1)  # U = u − w·S, in u's place
        torch.bmm(qd, S, out=o).baddbmm_(M, v_new)  # o = qd·S + M·U
        S.mul_(decay).baddbmm_(kr.transpose(-1, -2), v_new)  # S = diag(exp(G_C))·S + krᵀ·U


CPU_BLOCK_PAIRS = 2048  # (token, head) pairs the chunked CPU path prepares at once: bounds its working memory


def kda_chunked_span(q, k, v, g, beta, S, out, start, end, *, A_log=None, dt_bias=None, lower_bound=None, scale=None,
                     use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float32, chunk=CPU_CHUNK,
                     checkpoints=None, block_pairs=CPU_BLOCK_PAIRS):
    """Chunked form (spec §2) of one sequence's tokens ``[start, end)`` from the entry state ``S [H, K, V]`` (in
    ``dtype``, updated in place to the exit state). q, k, g ``[T, H, K]``, v ``[T, H, V]``, beta ``[T, H]``: raw
    token rows of one sequence; ``out [T, H, V]`` receives rows ``[start, end)``. Chunks start at ``start``.
    ``checkpoints``: ``{offset: [targets]}``, offsets from ``start``, multiples of ``chunk`` in ``[0, end − start]``;
    each ``[H, V, K]`` target takes the state after that many tokens. The tokens go in blocks of at most
    ``block_pairs`` (token, head) pairs (whole chunks, at least one): a block's chunks are prepared together
    (:func:`_prepare_block`, token-parallel), then walked in order from the carried state (:func:`_serial_chunks`),
    so the working memory does not grow with the length."""
    checkpoints = checkpoints or {}
    heads = q.shape[1]
    prep = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm,
                use_beta_sigmoid=use_beta_sigmoid, dtype=dtype, chunk=chunk)
    step = max(1, block_pairs // (heads * chunk)) * chunk
    for first in range(start, end, step):
        last = min(first + step, end)
        span = slice(first, last)
        block = _prepare_block(q[span], k[span], v[span], g[span], beta[span], **prep)
        o = torch.empty(block["u"].shape, dtype=dtype, device=q.device)
        _serial_chunks(block, S, o, checkpoints, first - start)
        out[span] = o.transpose(1, 2).reshape(-1, heads, o.shape[-1])[:last - first]
    for target in checkpoints.get(end - start, ()):
        target.copy_(S.transpose(-1, -2))


def _walk_segment(q, k, v, g, beta, span, state, **prep):
    """Walk the tokens ``span`` of one sequence's rows (``[T, H, ·]``) from ``state [H, K, V + E]`` (updated in
    place), outputs discarded: the value columns take v, the E columns past them (a transition's identity columns)
    take zeros."""
    tokens = span.stop - span.start
    heads, width = state.shape[0], state.shape[-1]
    columns = v[span]
    if width > v.shape[-1]:
        columns = torch.cat((columns, v.new_zeros(tokens, heads, width - v.shape[-1])), -1)
    discard = torch.empty(tokens, heads, width, dtype=state.dtype)
    kda_chunked_span(q[span], k[span], columns, g[span], beta[span], state, discard, 0, tokens, **prep)


def segment_map(q, k, v, g, beta, span, **prep):
    """``(ℬ [H, K, V], 𝒜 [H, K, K])`` of the tokens ``span`` of one sequence's rows: the state after them is
    ``𝒜·S + ℬ`` for an entry state ``S [H, K, V]`` (the exit from a zero state, and that of K identity columns,
    walked together)."""
    heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    state = torch.zeros(heads, key_dim, value_dim + key_dim, dtype=prep.get("dtype", torch.float32))
    state[:, :, value_dim:] = torch.eye(key_dim, dtype=state.dtype)
    _walk_segment(q, k, v, g, beta, span, state, **prep)
    return state[:, :, :value_dim], state[:, :, value_dim:]


def open_segment_maps(q, k, v, g, beta, segment_tokens, **prep):
    """The maps :func:`segment_map` of one sequence's segments of ``segment_tokens`` tokens from its first (rows
    ``[T, H, ·]``), every one from a zero state, the first too: the CPU path of a prefill whose entry state comes
    later (:func:`fastkda.kda_prefill_open`; on the GPU :func:`fastkda.ops.prefill.open_entry_transitions`)."""
    length = q.shape[0]
    return [segment_map(q, k, v, g, beta, slice(first, min(first + segment_tokens, length)), **prep)
            for first in range(0, length, segment_tokens)]


def compose_segment_maps(maps, heads, key_dim, value_dim, dtype=torch.float32):
    """``(ℬ, 𝒜)`` of segments one after the other, from their maps in order (the identity map for none)."""
    offset = torch.zeros(heads, key_dim, value_dim, dtype=dtype)
    transition = torch.eye(key_dim, dtype=dtype).expand(heads, key_dim, key_dim).clone()
    for segment_offset, segment_transition in maps:
        offset = torch.baddbmm(segment_offset, segment_transition, offset)
        transition = torch.bmm(segment_transition, transition)
    return offset, transition


def run_from_segment_maps(q, k, v, g, beta, maps, segment_tokens, S, out, **prep):
    """The rest of :func:`open_segment_maps`'s prefill once its entry state ``S [H, K, V]`` is known (updated in
    place to the exit state): each segment's entry composed from the one before by its map, then every segment
    walked from its entry, writing its rows of ``out [T, H, V]``."""
    entry = S.clone()
    length = q.shape[0]
    for first, (segment_offset, segment_transition) in zip(range(0, length, segment_tokens), maps):
        S.copy_(entry)
        kda_chunked_span(q, k, v, g, beta, S, out, first, min(first + segment_tokens, length), **prep)
        entry = torch.baddbmm(segment_offset, segment_transition, entry)


def kda_segmented_span(q, k, v, g, beta, S, out, start, end, segment_tokens, *, checkpoints=None, **prep):
    """:func:`kda_chunked_span` in the sequence-parallel form (``docs/sequence-parallel.md``), the GPU's
    segmentation on the CPU: the tokens ``[start, end)`` cut into segments of ``segment_tokens`` from ``start``;
    each segment but the last run from a zero state over the value columns and K identity columns (the first from
    ``S`` over the value columns alone), giving its exit ``ℬ_j`` and transition ``𝒜_j``; the entry states composed
    in order, ``S_{j+1} = 𝒜_j·S_j + ℬ_j``; then every segment rerun from its entry state, writing ``out``, the
    checkpoints (offsets from ``start``, as :func:`kda_chunked_span` takes them) and, into ``S``, the exit
    state."""
    checkpoints = checkpoints or {}
    firsts = list(range(start, end, segment_tokens))
    entries = [S.clone()]
    for j, first in enumerate(firsts[:-1]):
        span = slice(first, first + segment_tokens)
        if j == 0:  # the first segment starts from the true entry state: its exit needs no transition
            state = entries[0].clone()
            _walk_segment(q, k, v, g, beta, span, state, **prep)
            entries.append(state)
        else:
            exit_state, transition = segment_map(q, k, v, g, beta, span, **prep)
            entries.append(torch.baddbmm(exit_state, transition, entries[-1]))
    for first, entry in zip(firsts, entries):
        last = min(first + segment_tokens, end)
        offset = first - start
        mine = {o - offset: targets for o, targets in checkpoints.items()  # a boundary: the segment ending there
                if (offset < o or first == start) and o <= last - start}
        S.copy_(entry)
        kda_chunked_span(q, k, v, g, beta, S, out, first, last, **prep, checkpoints=mine)


@autocast_off
def kda_chunked(
    q, k, v, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, scale=None, initial_state=None,
    cu_seqlens=None, use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float32, chunk=CPU_CHUNK,
    checkpoint_offsets=None, checkpoint_states=None, segment_tokens=0,
):
    """Vectorised chunked KDA (the CPU path); same arguments and results as :func:`kda_reference`, plus
    prefix-cache checkpoints: the state after ``checkpoint_offsets[n, j]`` tokens (a multiple of ``chunk``;
    beyond the sequence: ignored) is written to ``checkpoint_states[n, j]`` (``[N, 2, H, V, K]``).

    Each sequence runs through :func:`kda_chunked_span` in blocks of chunks, so besides the output the working
    memory is bounded (``CPU_BLOCK_PAIRS``), whatever the length. ``segment_tokens`` (a multiple of ``chunk``;
    0: off) runs sequences longer than that in the sequence-parallel form (:func:`kda_segmented_span`)."""
    check_reference_inputs(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens)
    check_checkpoints_paired(checkpoint_offsets, checkpoint_states)
    bounds = sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)
    out, final = _zero_outputs(q, v, bounds, initial_state, dtype)
    # no sequence (an empty batch) has no checkpoint: reshape cannot infer the row length of zero rows
    offsets = [] if checkpoint_offsets is None or not bounds else checkpoint_offsets.reshape(len(bounds), -1).tolist()
    prep = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale, use_qk_l2norm=use_qk_l2norm,
                use_beta_sigmoid=use_beta_sigmoid, dtype=dtype, chunk=chunk)
    for n, (b, start, end) in enumerate(bounds):
        checkpoints = {}
        for j, offset in enumerate(offsets[n] if offsets else []):
            if 0 <= offset <= end - start and offset % chunk == 0:
                checkpoints.setdefault(offset, []).append(checkpoint_states[n, j])
        if segment_tokens and end - start > segment_tokens:
            kda_segmented_span(q[b], k[b], v[b], g[b], beta[b], final[n], out[b], start, end, segment_tokens,
                               **prep, checkpoints=checkpoints)
        elif end > start:
            kda_chunked_span(q[b], k[b], v[b], g[b], beta[b], final[n], out[b], start, end, **prep,
                             checkpoints=checkpoints)
        else:
            for target in checkpoints.get(0, ()):
                target.copy_(final[n].transpose(-1, -2))
    return out, final.transpose(-1, -2).contiguous()


def _as(x, dtype):
    return x if x.dtype == dtype else x.to(dtype)  # skips the dispatch of a no-op .to


def _decode_inputs(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, use_qk_l2norm, use_beta_sigmoid, dtype):
    """:func:`prepare_inputs` for the decode path in few (tiny) torch ops, token-major over (sequence, head) rows
    ``r = n·H + h``: ``kq [T, R, 2, K]`` (rows k̂ and s·q̂), ``exp(a) [T, R, 1, K]``, ``β [T, R, 1]``,
    ``β·v [T, R, V]`` and ``k̂·s·q̂ [T, R, 1]``, without the T dimension for one token. Each elementwise op runs
    on the inputs' own layout and its fresh result is regrouped into rows (a view when N or T is 1, as in a decode
    step), so no input is copied only to be regrouped: an eager step's time is the number of ops it dispatches."""
    num_seqs, tokens, heads, key_dim = q.shape
    leading = (num_seqs * heads,) if tokens == 1 else (tokens, num_seqs * heads)

    def rows(x, *trailing):  # [N, T, H, ...] -> [T, N·H, *trailing], or [N·H, *trailing] for one token
        return (x if num_seqs == 1 or tokens == 1 else x.transpose(0, 1)).reshape(*leading, *trailing)

    kq = torch.stack((k, q) if k.dtype == q.dtype else (_as(k, dtype), _as(q, dtype)), -2)
    kq = _as(rows(kq, 2, key_dim), dtype)  # fresh
    scale = key_dim ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        factor = torch.linalg.vector_norm(kq, dim=-1, keepdim=True).square_().add_(1e-6).rsqrt_()
        factor.select(-2, 1).mul_(scale)
        kq.mul_(factor)
    else:
        kq.select(-2, 1).mul_(scale)
    g = _as(g, dtype)
    if lower_bound is None:
        a = g.clamp(max=0.0)
    else:
        A = _as(A_log, dtype).exp().view(heads, 1)
        a = torch.sigmoid(A * (g + _as(dt_bias, dtype).reshape(heads, -1))).mul_(lower_bound)
    beta = _as(beta, dtype)
    beta = torch.sigmoid(beta) if use_beta_sigmoid else beta
    beta_v = rows(_as(v, dtype) * beta.unsqueeze(-1), v.shape[-1])
    kdotq = kq.prod(-2).sum(-1, keepdim=True)  # k̂·s·q̂: the pair's product rounds once, as k̂ ⊙ s·q̂ does
    return kq, rows(a, 1, key_dim).exp_(), rows(beta, 1), beta_v, kdotq


@autocast_off
def kda_decode_reference(
    q, k, v, g, beta, state_pool, slots, *, A_log=None, dt_bias=None, lower_bound=None, scale=None,
    num_accepted_tokens=None, use_qk_l2norm=True, use_beta_sigmoid=True, dtype=torch.float32,
):
    """Decode over a state pool, token by token in ``dtype`` (the CPU path; float64 is the truth).

    q, k, g ``[N, T, H, K]``, v ``[N, T, H, V]``, beta ``[N, T, H]`` (any strides); ``state_pool [P, H, V, K]``
    updated in place; ``slots [N]`` or ``[N, T]`` (see :mod:`fastkda.ops.decode`). Returns o ``[N, T, H, V]`` in
    ``dtype``.

    The state stays V-first (``S[v, k]``), one ``[V, K]`` matrix per (sequence, head), and a token passes over it
    three times: ``S ← S·diag(exp(a))``, ``[Sk̂, s·Sq̂] = S·[k̂, s·q̂]``, then ``u = β(v − Sk̂)``,
    ``o = s·Sq̂ + u(k̂·s·q̂)`` (the output of the updated state) and ``S ← S + u·k̂ᵀ``. The read slots are read on
    the host once: where every sequence is live and they are consecutive (a batch that took its slots together,
    as transformers' cache rows are), the pool rows are updated in place, an fp32 pool's without a copy."""
    num_seqs, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    kq, decay, beta, beta_v, kdotq = _decode_inputs(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, dtype=dtype,
    )
    per_token = slots.dim() == 2
    if not per_token:
        read_slot = slots
    elif num_accepted_tokens is None:
        read_slot = slots[:, 0]
    else:
        read_slot = slots.gather(1, num_accepted_tokens.long().sub(1).unsqueeze(1)).squeeze(1)
    reads = read_slot.tolist()
    first = reads[0] if reads else 0
    all_live = all(slot >= 0 for slot in reads)
    in_place = (all_live and not per_token and state_pool.dtype == dtype and state_pool.is_contiguous()
                and reads == list(range(first, first + num_seqs)))
    if in_place:  # a view (the whole pool for transformers' cache): the updates below reach the pool
        S = state_pool if num_seqs == state_pool.shape[0] else state_pool[first:first + num_seqs]
    else:
        read_slot = read_slot.long()
        if state_pool.shape[0]:
            S = state_pool.index_select(0, read_slot if all_live else read_slot.clamp(min=0)).to(dtype)  # [N, H, V, K]
        else:  # an empty pool: every row is padding (a read slot past P is refused), none to gather
            S = state_pool.new_zeros(num_seqs, *state_pool.shape[1:], dtype=dtype)
    if not all_live:
        live = read_slot >= 0
        S = torch.where(live.view(-1, 1, 1, 1), S, 0)
    rows = S.view(num_seqs * heads, value_dim, key_dim)  # S itself: the updates below reach S (and a pool slot)
    outs = []
    steps = [(kq, decay, beta, beta_v, kdotq)] if tokens == 1 else zip(kq, decay, beta, beta_v, kdotq)
    for t, (kq_t, decay_t, beta_t, beta_v_t, kdotq_t) in enumerate(steps):
        y = torch.bmm(kq_t, rows.mul_(decay_t).transpose(-1, -2))  # [R, 2, V]: S·k̂, s·S·q̂ of the decayed state
        state_k, state_q = y.unbind(1)
        u = torch.addcmul(beta_v_t, beta_t, state_k, value=-1)
        outs.append(torch.addcmul(state_q, u, kdotq_t))
        rows.addcmul_(u.unsqueeze(-1), kq_t.narrow(1, 0, 1))
        if per_token:
            slot_t = slots[:, t].long()
            write = (slot_t >= 0) if all_live else live & (slot_t >= 0)
            if bool(write.all()):
                state_pool.index_copy_(0, slot_t, S.to(state_pool.dtype))
            elif bool(write.any()):
                state_pool[slot_t[write]] = S[write].to(state_pool.dtype)
    if not per_token and not in_place:
        if all_live:
            state_pool.index_copy_(0, read_slot, S.to(state_pool.dtype))
        elif bool(live.any()):
            state_pool[read_slot[live]] = S[live].to(state_pool.dtype)
    if tokens == 1:
        out = outs[0].view(num_seqs, 1, heads, value_dim)
    elif tokens:
        out = torch.stack(outs).view(tokens, num_seqs, heads, value_dim).transpose(0, 1).contiguous()
    else:
        out = torch.zeros(num_seqs, 0, heads, value_dim, dtype=dtype, device=v.device)
    return out if all_live else torch.where(live.view(-1, 1, 1, 1), out, 0)


@autocast_off
def causal_conv1d_reference(x, weight, bias=None, *, conv_states=None, slots=None, has_initial_state=None,
                            cu_seqlens=None, activation="silu", dtype=torch.float32):
    """Depthwise causal conv of the KDA layer (spec §9 step 2) in ``dtype``; the truth for the conv kernel and its
    CPU path. Returns the output, shape of ``x``, in ``dtype``.

    ``x``: ``[T, C]`` packed tokens (``cu_seqlens [N+1]`` offsets, or one sequence without) or ``[B, T, C]`` (B
    sequences of T tokens); ``weight [C, W]``; ``bias [C]`` or None. A sequence's inputs are preceded by S >= W−1
    earlier ones (its pool row ``conv_states[slots[n]]``, ``[C, S]`` oldest first, when that row exists and
    ``has_initial_state[n]`` is not False; zeros otherwise), and
    ``out[t, c] = act(bias[c] + Σ_j weight[c, j]·u[t − (W−1) + j, c])``, act being SiLU or none. The row (a
    ``slots`` entry outside ``[0, P)`` names none; ``slots`` None: sequence n's row is n) then takes the last S of
    those inputs, in place: the old row's tail shifted by the sequence's tokens. Sequences of one length (all but
    packed ones) run together, as one batch of torch ops: a decode step's time is the number of ops it dispatches."""
    rows = x if x.dim() == 3 else x.unsqueeze(0)
    num_seqs = rows.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    pool_size = 0 if conv_states is None else conv_states.shape[0]
    pool_rows = [row if 0 <= row < pool_size else -1 for row in (slots.tolist() if slots is not None else
                                                                 range(num_seqs))]
    reads = has_initial_state.tolist() if has_initial_state is not None else [True] * num_seqs
    conv = dict(weight=_as(weight, dtype), bias=None if bias is None else _as(bias, dtype), conv_states=conv_states,
                activation=activation, dtype=dtype)
    if cu_seqlens is None:
        return _conv_sequences(rows, pool_rows, reads, **conv).view(x.shape)
    out = torch.zeros(rows.shape, dtype=dtype, device=x.device)
    offsets = cu_seqlens.tolist()
    for n in range(num_seqs):
        span = slice(offsets[n], offsets[n + 1])
        out[:, span] = _conv_sequences(rows[:, span], pool_rows[n:n + 1], reads[n:n + 1], **conv)
    return out.view(x.shape)


def _conv_sequences(tokens, pool_rows, reads, *, weight, bias, conv_states, activation, dtype):
    """:func:`causal_conv1d_reference` over B sequences of one length, ``tokens [B, L, C]``: sequence b's earlier
    inputs are pool row ``pool_rows[b]`` where that is not -1 and ``reads[b]``, else zeros; each such row then takes
    its sequence's last S inputs. Rows taken together (consecutive, all live and read: transformers' cache) are
    read and written as one slice of the pool. Returns ``[B, L, C]`` in ``dtype``."""
    batch, length, channels = tokens.shape
    width = weight.shape[1]
    kept = width - 1 if conv_states is None else conv_states.shape[2]  # a row's S >= W−1 columns
    first = pool_rows[0] if pool_rows else 0
    together = (conv_states is not None and first >= 0 and all(reads)
                and pool_rows == list(range(first, first + batch)))
    if together:  # the pool's rows first, first + 1, ...: one block, the whole pool for transformers' cache
        block = conv_states if batch == conv_states.shape[0] else conv_states[first:first + batch]
        earlier = _as(block, dtype)
    else:
        earlier = torch.zeros(batch, channels, kept, dtype=dtype, device=tokens.device)
        for b, (row, read) in enumerate(zip(pool_rows, reads)):
            if row >= 0 and read:
                earlier[b] = conv_states[row]
    inputs = torch.cat((earlier.transpose(1, 2), _as(tokens, dtype)), 1)  # [B, S+L, C]
    if length:  # windows [B, L, C, W] of W consecutive inputs, from the last W−1 earlier ones on
        y = (inputs[:, kept - (width - 1):].unfold(1, width, 1) * weight).sum(-1)
        if bias is not None:
            y = y + bias
        out = torch.nn.functional.silu(y) if activation == "silu" else y
    else:
        out = torch.zeros(batch, 0, channels, dtype=dtype, device=tokens.device)
    last = inputs[:, -kept:].transpose(1, 2)
    if together:
        block.copy_(last)
    else:
        for b, row in enumerate(pool_rows):
            if row >= 0:
                conv_states[row] = last[b]
    return out


@autocast_off
def gated_rmsnorm_reference(x, gate, weight, eps=1e-6, *, activation="sigmoid", dtype=torch.float32):
    """The KDA layer's output norm (spec §9 step 6) over the last dimension, in ``dtype``:
    ``x·rsqrt(mean(x²) + eps)·weight ⊙ act(gate)``, act being sigmoid or SiLU."""
    gate = _as(gate, dtype)
    y = torch.nn.functional.rms_norm(_as(x, dtype), x.shape[-1:], _as(weight, dtype), eps)  # x·rsqrt(..)·weight
    return y.mul_(torch.sigmoid(gate) if activation == "sigmoid" else torch.nn.functional.silu(gate))

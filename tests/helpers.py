"""Random KDA inputs and error measures shared by the tests."""

import torch

LOWER_BOUND = -5.0


def make_inputs(lengths, heads=2, key_dim=64, value_dim=None, varlen=True, gate="lower_bound", seed=0,
                device="cpu", state_dtype=torch.float32, with_initial=True, cu_dtype=torch.int32):
    """Fresh randn inputs (bf16 like the operator's callers). ``gate``: "lower_bound" or "precomputed"
    (log-decay in (-3, 0] with 5% of entries at -1e4)."""
    value_dim = value_dim or key_dim
    gen = torch.Generator().manual_seed(seed)
    batch, length = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)

    inp = dict(q=randn(batch, length, heads, key_dim), k=randn(batch, length, heads, key_dim),
               v=randn(batch, length, heads, value_dim), beta=randn(batch, length, heads))
    if gate == "lower_bound":
        inp.update(g=randn(batch, length, heads, key_dim), A_log=torch.rand(heads, generator=gen).to(device),
                   dt_bias=torch.rand(heads, key_dim, generator=gen).to(device), lower_bound=LOWER_BOUND)
    else:
        g = -3 * torch.rand(batch, length, heads, key_dim, generator=gen)
        g[torch.rand(g.shape, generator=gen) < 0.05] = -1e4
        inp.update(g=g.to(device), A_log=None, dt_bias=None, lower_bound=None)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    inp["cu_seqlens"] = torch.tensor(offsets, dtype=cu_dtype, device=device) if varlen else None
    if with_initial:
        inp["initial_state"] = torch.randn(len(lengths), heads, value_dim, key_dim, generator=gen).to(
            device=device, dtype=state_dtype)
    else:
        inp["initial_state"] = None
    return inp


def rel_err(x, ref):
    """Relative L2 error; NaN anywhere in ``x`` gives inf, so a NaN can never pass."""
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()

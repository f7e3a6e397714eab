"""Where the bf16/tf32 rounding of the chunk-64 WY form costs accuracy (CPU, float64 with injected rounding).

Reproduces the table in docs/perf-notes.md: T = 2048, H = 4, K = V = 128, randn bf16 inputs, lower-bound gate
-5, fp32 initial state; relative L2 error of the bf16 output and of the final state against the token-by-token
float64 recurrence. python benchmarks/precision_sim.py  (about a minute on two cores)"""

import torch

from fastkda.reference import _chunk_decay_matrix, kda_reference, prepare_inputs

T, H, D, C = 2048, 4, 128, 64


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def tf32(x):
    bits = x.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


def exact(x):
    return x


def simulate(inp, ref, workspace, state_op, qk_op):
    """Chunk-64 WY form: ``workspace`` rounds w, u, qg, kg, A; ``state_op`` rounds S and v_new as dot operands;
    ``qk_op`` rounds the normalised q, k entering the in-chunk products."""
    q, k, v, a, beta = prepare_inputs(*inp["args"], **inp["gate"], scale=None, use_qk_l2norm=True,
                                      use_beta_sigmoid=True, dtype=torch.float64)
    n = T // C
    q, k, v, a = (x[0].reshape(n, C, H, -1).permute(2, 0, 1, 3) for x in (q, k, v, a))
    beta = beta[0].reshape(n, C, H).permute(2, 0, 1)
    G = a.cumsum(-2)
    decay = _chunk_decay_matrix(G)
    kk = torch.einsum("hnik,hnjk,hnijk->hnij", qk_op(k), qk_op(k), decay)
    qk = torch.einsum("hnik,hnjk,hnijk->hnij", qk_op(q), qk_op(k), decay)
    system = torch.eye(C, dtype=q.dtype) + (beta.unsqueeze(-1) * kk).tril(-1)
    w = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * k * G.exp(), upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    w, u, A = workspace(w), workspace(u), workspace(qk)
    qg, kg = workspace(q * G.exp()), workspace(k * (G[:, :, -1:] - G).exp())
    S = inp["h0"][0].double().transpose(-1, -2).clone()
    out = torch.empty_like(u)
    for c in range(n):
        S_op = state_op(S)
        v_new = state_op(u[:, c] - w[:, c] @ S_op)
        out[:, c] = qg[:, c] @ S_op + A[:, c] @ v_new
        S = S * G[:, c, -1].exp().unsqueeze(-1) + kg[:, c].transpose(-1, -2) @ v_new
    o = bf16(out.permute(1, 2, 0, 3).reshape(T, H, D))
    err = lambda x, y: ((x - y).norm() / y.norm()).item()  # noqa: E731
    return err(o, ref[0][0]), err(S.transpose(-1, -2), ref[1][0])


def main():
    gen = torch.Generator().manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    args = (randn(1, T, H, D), randn(1, T, H, D), randn(1, T, H, D), randn(1, T, H, D), randn(1, T, H))
    gate = dict(A_log=torch.rand(H, generator=gen), dt_bias=torch.rand(H, D, generator=gen), lower_bound=-5.0)
    inp = dict(args=args, gate=gate, h0=torch.randn(1, H, D, D, generator=gen))
    ref = kda_reference(*args, **gate, initial_state=inp["h0"])
    cases = [("no rounding but the bf16 output", exact, exact, exact),
             ("bf16 workspace, bf16 S and v_new operands", bf16, bf16, exact),
             ("+ bf16 q, k in the in-chunk products", bf16, bf16, bf16),
             ("+ tf32 q, k in the in-chunk products instead", bf16, bf16, tf32)]
    for name, workspace, state_op, qk_op in cases:
        o, s = simulate(inp, ref, workspace, state_op, qk_op)
        print(f"{name}: output {o:.2e}, state {s:.2e}")


if __name__ == "__main__":
    main()

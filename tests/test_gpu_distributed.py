"""GPU tests of context parallelism's arithmetic (run on the H200; skipped without CUDA): the transitions of three
parts of one H12 sequence, formed on the GPU by ``segment_transition`` (the map of
:func:`fastkda.kda_prefill_open`), composed in order, against the float64 recurrence of the whole sequence: within
the accuracy bar and within twice the error of the GPU's own prefill of the whole sequence (the two differ by their
bf16 roundings, up to 4e-3 here, so neither is the other's reference); and the open-entry prefill's second half
from an entry state against the float64 prefill from it."""

import pytest
import torch

import fastkda
from fastkda.distributed import segment_transition
from fastkda.reference import kda_reference
from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("key_dim,value_dim", [(128, 128), (128, 64), (64, 128)])
def test_composed_transitions_equal_the_whole_prefill(key_dim, value_dim):
    heads, tokens, cuts = 12, 1024, (0, 600, 632, 1024)
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    q, k, g = (randn(1, tokens, heads, key_dim) for _ in range(3))
    v, beta = randn(1, tokens, heads, value_dim), randn(1, tokens, heads) - 3.0
    # a weak decay (about -4e-4 a token) and a small beta (about 0.06): what the last part's 392 tokens leave of
    # its entry state is far from zero, so a wrong transition shows (at -0.0025 a token and beta 0.15 only 4-7%
    # of it was left past a 692-token part: too little to tell)
    gate = dict(A_log=torch.zeros(heads, device="cuda"), dt_bias=torch.full((heads, key_dim), -10.0, device="cuda"),
                lower_bound=-5.0)
    initial = 0.1 * torch.randn(1, heads, value_dim, key_dim, device="cuda")
    cpu = {name: x.cpu() for name, x in gate.items() if isinstance(x, torch.Tensor)}
    _, exact = kda_reference(*(x.cpu() for x in (q, k, v, g, beta)), **cpu, lower_bound=gate["lower_bound"],
                             initial_state=initial.cpu())
    _, whole = fastkda.kda_prefill(q, k, v, g, beta, initial_state=initial, output_final_state=True, **gate)
    _, last_alone = fastkda.kda_prefill(*(x[:, cuts[-2]:] for x in (q, k, v, g, beta)), output_final_state=True,
                                        **gate)
    assert rel_err(last_alone.cpu(), exact) > 0.1, rel_err(last_alone.cpu(), exact)  # the earlier parts matter
    whole_err = rel_err(whole.cpu(), exact)  # 3.03e-3 at K = 64 on the H200 (8e3f7c0): a weak decay, a large state
    state = initial[0]
    for a, b in zip(cuts[:-1], cuts[1:]):
        transition, offset = segment_transition(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], **gate)
        assert transition.shape == (heads, key_dim, key_dim) and offset.shape == (heads, value_dim, key_dim)
        state = torch.baddbmm(offset, state, transition)
    composed_err = rel_err(state.cpu(), exact[0])
    assert composed_err < 4e-3 and composed_err < 2 * whole_err, (composed_err, whole_err)


@pytest.mark.parametrize("key_dim,value_dim,segment_tokens,weak", [
    (128, 128, "auto", False), (128, 128, "auto", True), (128, 128, 512, True), (64, 128, 320, True)])
def test_open_entry_prefill_from_its_entry(key_dim, value_dim, segment_tokens, weak):
    """``kda_prefill_open`` then ``finish(entry)`` on the GPU (several segments, a partial last one) against the
    float64 prefill from that entry: within the bar, or within 1.1x of kda_prefill's own error where a long-lived
    state takes that past it; its map applied to the entry, alike; finishing twice gives the same bits. Inputs: the
    benchmark's (randn, A_log and dt_bias ~ U(0, 1)), or ``weak``: a weak decay, a small β and a large entry (a
    tenth or more of the final state, so that 𝒜 is tested; at 3b2be17, with the scans in tf32, the state's error
    was 3.4-3.6e-3 there against kda_prefill's 2.4-3.0e-3)."""
    heads, tokens = 12, 3000
    gen = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    q, k, g = (randn(1, tokens, heads, key_dim) for _ in range(3))
    v, beta = randn(1, tokens, heads, value_dim), randn(1, tokens, heads) - (3.0 if weak else 0.0)
    if weak:
        gate = dict(A_log=torch.zeros(heads, device="cuda"), lower_bound=-5.0,
                    dt_bias=torch.full((heads, key_dim), -10.0, device="cuda"))
    else:
        gate = dict(A_log=torch.rand(heads, generator=gen).cuda(), lower_bound=-5.0,
                    dt_bias=torch.rand(heads, key_dim, generator=gen).cuda())
    entry = (3.0 if weak else 1.0) * torch.randn(1, heads, value_dim, key_dim, device="cuda")
    cpu = {name: x.cpu() for name, x in gate.items() if isinstance(x, torch.Tensor)}
    exact_o, exact_s = kda_reference(*(x.cpu() for x in (q, k, v, g, beta)), **cpu, lower_bound=gate["lower_bound"],
                                     initial_state=entry.cpu())
    whole_o, whole_s = fastkda.kda_prefill(q, k, v, g, beta, initial_state=entry, output_final_state=True, **gate)
    opened = fastkda.kda_prefill_open(q, k, v, g, beta, sequence_parallel=segment_tokens, **gate)
    assert -(-tokens // opened.plan.segment_tokens) > 1
    o, state = opened.finish(entry)
    for got, want, whole, bar in ((o, exact_o, whole_o, 4e-3), (state, exact_s, whole_s, 3e-3)):
        err = rel_err(got.cpu(), want)
        assert err < max(bar, 1.1 * rel_err(whole.cpu(), want)), (err, rel_err(whole.cpu(), want))
    mapped = entry @ opened.exit_map[:, :, value_dim:] + opened.exit_map[:, :, :value_dim]
    assert rel_err(mapped.cpu(), exact_s) < max(3e-3, 1.1 * rel_err(whole_s.cpu(), exact_s))
    if weak:
        assert rel_err(opened.exit_map[:, :, :value_dim].cpu(), exact_s) > 0.1  # the entry matters
    again_o, again_state = opened.finish(entry)
    assert torch.equal(again_o, o) and torch.equal(again_state, state)

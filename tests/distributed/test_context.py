"""Context parallelism on the CPU: one sequence's tokens split over 2 and 4 gloo processes (uneven parts, an empty
one, an initial state, both gate modes) against a single process's prefill of the whole sequence; a rank that
fails mid-call makes the others fail at once, and one that dies makes them fail within the group's timeout; and the
transition of a part against composing its tokens' prefill."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastkda
from fastkda.bench.parallel import free_port
from fastkda.distributed import segment_transition
from helpers import rel_err

HEADS, DIM = 2, 64


def _sequence(tokens, lower_bound, seed=0, key_dim=DIM, value_dim=DIM):
    """One sequence's inputs with a weak decay (a state that outlives the parts, so that each part's transition is
    far from zero and a wrong one shows), its gate keywords and an initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)
    q, k, v = randn(1, tokens, HEADS, key_dim), randn(1, tokens, HEADS, key_dim), randn(1, tokens, HEADS, value_dim)
    beta = randn(1, tokens, HEADS) - 2.0  # sigmoid ~ 0.1: each token keeps most of the state
    if lower_bound is None:  # the precomputed log-decay
        g, gate = -0.002 * torch.rand(1, tokens, HEADS, key_dim, generator=gen), {}
    else:  # lower_bound · sigmoid(exp(A_log)·(g + dt_bias)) ~ -0.002
        g = randn(1, tokens, HEADS, key_dim)
        gate = dict(A_log=torch.zeros(HEADS), dt_bias=torch.full((HEADS, key_dim), -8.0), lower_bound=lower_bound)
    return (q, k, v, g, beta), gate, 0.1 * randn(1, HEADS, value_dim, key_dim)


def _init(rank, world, port, seconds):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=seconds))


def _rank_main(rank, world, port, cuts, lower_bound):
    from fastkda.distributed import context_parallel_prefill

    _init(rank, world, port, 60)
    try:
        inputs, gate, initial = _sequence(cuts[-1], lower_bound)
        want_o, want_state = fastkda.kda_prefill(*inputs, initial_state=initial, output_final_state=True, **gate)
        part = slice(cuts[rank], cuts[rank + 1])
        o, state = context_parallel_prefill(*(x[:, part] for x in inputs), initial_state=initial, **gate)
        assert o.shape == (1, cuts[rank + 1] - cuts[rank], HEADS, DIM)
        if o.numel():
            assert rel_err(o, want_o[:, part]) < 1e-5, f"rank {rank}: output {rel_err(o, want_o[:, part]):.2e}"
        if rank == world - 1:
            assert rel_err(state, want_state) < 1e-5, f"final state {rel_err(state, want_state):.2e}"
            _, alone = fastkda.kda_prefill(*(x[:, part] for x in inputs), output_final_state=True, **gate)
            assert rel_err(alone, want_state) > 0.1  # the earlier parts matter: their transitions are tested
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cuts", [[0, 70, 200], [0, 33, 33, 130, 200], [0, 9, 40, 41, 72]],
                         ids=["2 ranks", "4 ranks, one empty", "4 ranks, short parts"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "precomputed"])
def test_context_parallel_equals_one_process(cuts, lower_bound):
    mp.spawn(_rank_main, args=(len(cuts) - 1, free_port(), cuts, lower_bound), nprocs=len(cuts) - 1, join=True)


def _failing_main(rank, world, port, outcomes, how):
    from fastkda.distributed import context_parallel_prefill

    _init(rank, world, port, 5)
    inputs, gate, _ = _sequence(64, -5.0)
    q, k, v, g, beta = inputs
    if rank == 1 and how == "dies":  # leaves without entering the call's exchanges
        os._exit(0)
    if rank == 1:  # fails inside the call, between its two exchanges: beta of the wrong length
        beta = beta[:, :-1]
    start = time.monotonic()
    try:
        context_parallel_prefill(q, k, v, g, beta, **gate)
        outcomes.put((rank, "returned", time.monotonic() - start))
    except Exception as exc:  # what each rank saw, for the test to judge
        outcomes.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_failing_rank_makes_the_others_fail_not_hang(how):
    outcomes = mp.get_context("spawn").SimpleQueue()
    workers = mp.spawn(_failing_main, args=(2, free_port(), outcomes, how), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not workers.join(timeout=5):  # True once both processes have ended: none may hang
        assert time.monotonic() < deadline, "a rank still waits two minutes after the other failed"
    seen = {}
    while not outcomes.empty():
        rank, text, seconds = outcomes.get()
        seen[rank] = (text, seconds)
    if how == "raises":  # told through the exchange: at once
        assert seen[1][0].startswith("ValueError") and "beta" in seen[1][0]
        assert seen[0][0] == ("RuntimeError: context_parallel_prefill on rank 0: rank(s) [1] failed before the "
                              "exchange of segment transitions (their own errors say why)"), seen[0][0]
        assert seen[0][1] < 5
    else:  # the exchange itself fails: a closed connection or the group's 5 s timeout
        assert set(seen) == {0}
        assert seen[0][0].startswith("RuntimeError: context_parallel_prefill on rank 0: the exchange of"), seen[0][0]
        assert seen[0][1] < 60


@pytest.mark.parametrize("key_dim,value_dim", [(64, 64), (128, 64), (64, 128)])
def test_a_parts_transition_maps_its_entry_state_to_its_exit(key_dim, value_dim):
    inputs, gate, initial = _sequence(90, -5.0, seed=3, key_dim=key_dim, value_dim=value_dim)
    _, want = fastkda.kda_prefill(*inputs, initial_state=initial, output_final_state=True, **gate)
    _, from_zero = fastkda.kda_prefill(*inputs, output_final_state=True, **gate)
    transition, offset = segment_transition(*inputs, **gate)
    assert transition.shape == (HEADS, key_dim, key_dim) and offset.shape == (HEADS, value_dim, key_dim)
    assert rel_err(want, from_zero) > 0.1  # the entry state matters: a wrong transition cannot hide
    assert rel_err(torch.baddbmm(offset, initial[0], transition), want[0]) < 1e-5


def _bad_initial_main(rank, world, port, how):
    from fastkda.distributed import context_parallel_prefill

    _init(rank, world, port, 60)
    try:
        inputs, gate, initial = _sequence(64, -5.0)
        part = slice(32 * rank, 32 * (rank + 1))
        if how == "fp16":
            initial, checked = initial.half(), {}
        else:  # a NaN, which only checked mode looks for
            initial, checked = initial.clone(), dict(checks=True)
            initial.view(-1)[5] = float("nan")
        with pytest.raises((ValueError, RuntimeError)) as caught:
            context_parallel_prefill(*(x[:, part] for x in inputs), initial_state=initial, **gate, **checked)
        assert ("initial_state" in str(caught.value)) == (rank == 0), str(caught.value)
        assert "entry_state" not in str(caught.value), str(caught.value)  # no name the caller did not pass
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["fp16", "NaN under checks"])
def test_a_bad_initial_state_fails_every_rank(how):
    """Rank 0's initial state is checked before the exchange: a bad one (a dtype, or in checked mode a NaN) fails
    rank 0 with its own error naming it and the others with one naming rank 0, none returning a result from a
    wrong entry."""
    mp.spawn(_bad_initial_main, args=(2, free_port(), how), nprocs=2, join=True)


def test_a_transition_is_one_sequence_s():
    """segment_transition maps one sequence's tokens: a batch of several (or none) is refused by name, not reduced
    to its first row's map."""
    inputs, gate, _ = _sequence(40, -5.0)
    for rows in (2, 0):
        with pytest.raises(ValueError, match=r"q must be \[1, T, H, K\]"):
            segment_transition(*(x.expand(rows, *x.shape[1:]) for x in inputs), **gate)

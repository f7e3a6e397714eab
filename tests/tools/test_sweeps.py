"""The sweeps set up what they time from plans (no module state), checked on the CPU before a device call."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tools package

from fastkda.bench.workloads import make_prefill_inputs  # noqa: E402
from fastkda.plan import CHUNK, V_SLICE_CHOICES  # noqa: E402
from tools.sweeps import checkpoint_cost, decode_sweep, exactness_matrix, plan_sweep, segment_sweep  # noqa: E402


def test_decode_sweep_settings_are_decode_plans():
    workload = dict(name="d", H=12, N=4, tokens_per_seq=1)
    plans = [decode_sweep.decode_plan(workload, s) for s in decode_sweep.SETTINGS]
    assert [(p.slice_width, p.warps) for p in plans] == [(16, 2), (32, 4), (32, 8), (64, 8)]
    assert all((p.num_seqs, p.heads, p.value_dim) == (4, 12, 128) for p in plans)
    with pytest.raises(ValueError):
        decode_sweep.decode_plan(workload, "48")
    with pytest.raises(ValueError, match="warps"):
        decode_sweep.decode_plan(workload, "32:3")
    with pytest.raises(SystemExit):  # a misspelt workload is refused before anything runs, not swept as none
        decode_sweep.main(["--step", "--only", "decode_H12_N3"])


def test_plan_sweep_times_one_plan_per_slice_count_with_the_changes():
    inp = make_prefill_inputs(dict(H=2, lengths=[70, 30], layout="varlen"), "cpu")
    plans = plan_sweep.sweep_plans(inp, dict(solve_stages=2))
    assert list(plans) == list(V_SLICE_CHOICES) and all(plans[s].v_slices == s for s in plans)
    assert all(p.solve_stages == 2 and (p.num_seqs, p.seq_len) == (2, 100) for p in plans.values())


def test_checkpoint_offsets_are_multiples_of_the_chunk():
    offsets = checkpoint_cost.checkpoint_offsets([8192, 100, 31], CHUNK)
    assert offsets.shape == (3, 2) and offsets.dtype == torch.int32
    assert (offsets % CHUNK == 0).all() and offsets.tolist()[0] == [2720, 4096]


def test_exactness_shapes_cover_every_case():
    cases = [exactness_matrix.shape(i, exactness_matrix.random.Random(i)) for i in range(140)]
    shapes = [case for case, _ in cases]
    assert {s["varlen"] for s in shapes} == {True, False} and {s["key_dim"] for s in shapes} == {64, 128}
    assert {s["cu_dtype"] for s in shapes} == {torch.int32, torch.int64}
    assert {s["gate"] for s in shapes} == {"lower_bound", "precomputed"}
    assert {s["heads"] for s in shapes} == set(exactness_matrix.HEADS)
    assert {states for _, states in cases} == set(exactness_matrix.STATE_CASES)
    varlen = [s["lengths"] for s in shapes if s["varlen"]]
    assert any(ls[0] == 0 for ls in varlen) and any(ls[-1] == 0 for ls in varlen)
    assert any(0 in ls[1:-1] for ls in varlen)  # an empty sequence in the middle
    assert any(1 in ls for ls in varlen) and any(n % CHUNK for ls in varlen for n in ls)
    assert all(len(set(s["lengths"])) == 1 for s in shapes if not s["varlen"])


def test_exactness_check_runs_dry_on_the_cpu_path_with_plan_changes():
    split, same, ok = exactness_matrix.check(2, 0, "cpu", dict(solve_stages=2))  # a small shape, a bf16 final state
    assert same and ok


def test_exactness_rejects_v_slices_among_the_changes(capsys):
    with pytest.raises(SystemExit):
        exactness_matrix.main(["--set", "v_slices=2", "--device", "cpu", "--shapes", "0"])
    assert "v_slices: this tool sets it itself" in capsys.readouterr().err


def test_segment_sweep_variants_are_valid_plans_on_a_hopper_gpu(monkeypatch):
    """Every variant the segment sweep builds for its default workloads, as an H200 would plan them (132 SMs,
    warpgroup MMA: the Gluon kernels' rings), is a valid plan: a base plan of 64-column rerun slices (5 stages)
    swept at one slice once failed a device call. Shapes only (meta tensors)."""
    import fastkda.api
    from fastkda.bench.workloads import load_workloads

    monkeypatch.setattr(fastkda.api, "_sms_of", lambda q: 132)
    monkeypatch.setattr(fastkda.api, "_warpgroup_mma_of", lambda q: True)
    by_name = {w["name"]: w for w in load_workloads()["prefill"]}
    for name in segment_sweep.DEFAULT_ONLY:
        lengths, heads = by_name[name]["lengths"], by_name[name]["H"]
        tokens = sum(lengths)
        q = torch.empty(1, tokens, heads, 128, device="meta")
        inp = dict(q=q, v=q, cu_seqlens=torch.empty(len(lengths) + 1, device="meta"), max_seqlen=max(lengths),
                   lengths=lengths)
        found = segment_sweep.variants(inp, [2, 3, 4, 5, 6, 7, 8, 16], [64, 128], [1, 2])
        assert len(found) > 2 and all(plan.heads == heads for _, plan in found), name
        assert any(plan.warpgroup_recurrence for _, plan in found), name

"""The byte and FLOP model of fastkda's kernels follows the plan a call runs with."""

import pytest

from fastkda.bench.work import KERNELS, kernel_work, plan_for_inputs
from fastkda.bench.workloads import make_prefill_inputs
from fastkda.plan import CHUNK


def plan_of(workload, v_slices="auto", sms=132):
    return plan_for_inputs(make_prefill_inputs(dict(workload, layout="varlen"), "cpu"), sms=sms, v_slices=v_slices)


def work_of(workload, v_slices="auto", **changes):
    """The work of ``workload`` under its plan with ``changes``; by default with the solve kernel launched (the
    automatic plan folds it into the first kernel where that runs in one wave, as these small workloads do)."""
    return kernel_work(workload, plan_of(workload, v_slices).replace(**dict(dict(inverse_in_prepare=False),
                                                                            **changes)))


def test_plan_for_inputs_takes_the_facts_the_api_takes():
    inp = make_prefill_inputs(dict(H=3, lengths=[40, 0, 9], layout="varlen"), "cpu")
    plan = plan_for_inputs(inp, sms=132)
    assert (plan.num_seqs, plan.heads, plan.seq_len, plan.varlen, plan.lower_bound_gate) == (3, 3, 49, True, True)
    assert plan_for_inputs(inp).sms == 1  # the API plans a CPU call for one SM
    fixed = plan_for_inputs(make_prefill_inputs(dict(H=2, lengths=[7, 7], layout="fixed"), "cpu"), sms=132)
    assert (fixed.num_seqs, fixed.seq_len, fixed.varlen) == (2, 7, False)


def test_kernel_work_follows_the_kernels_shapes():
    one_chunk = dict(H=2, lengths=[CHUNK])
    work = work_of(one_chunk, 1)
    assert set(work) == set(KERNELS) - {"transition", "scan"}  # a serial plan's kernels
    # one token more is two chunks: the products double, the bytes grow by one token's share plus a chunk's decay
    two_chunks = work_of(dict(H=2, lengths=[CHUNK + 1]), 1)
    assert all(two_chunks[k][1] == 2 * work[k][1] for k in work)
    assert all(work[k][0] < two_chunks[k][0] < 2 * work[k][0] for k in ("prepare", "solve"))
    # V-slices re-read the K-side workspace, never add products; the other kernels do not see them
    split = work_of(one_chunk, 4)
    assert split["recurrence"][1] == work["recurrence"][1] and split["recurrence"][0] > work["recurrence"][0]
    assert split["prepare"] == work["prepare"] and split["solve"] == work["solve"]
    # the recurrence moves each sequence's fp32 state in and out: 2 * N * H * V * K * 4 bytes on top of the tokens'
    more_seqs = work_of(dict(H=2, lengths=[CHUNK // 2, CHUNK // 2]), 1)
    assert more_seqs["recurrence"][0] - work["recurrence"][0] == 2 * 2 * 128 * 128 * 4 + 2 * 4 * 128 * 1


def test_kernel_work_counts_the_solve_as_the_inverse_alone():
    # the solve kernel reads β (2 B) and β·L's sectors up to the diagonal (rows 0-7 of a chunk one 32-byte sector,
    # 8-15 two, 16-23 three, 24-31 four: 80 B a row), writes T·diag(β) over them, and multiplies nothing counted;
    # the recurrence loads T with kd and multiplies T·β·Y (two bf16 products) on top of the state's
    assert CHUNK == 32
    work = work_of(dict(H=4, lengths=[CHUNK]), 1)
    assert work["solve"] == (4 * CHUNK * (80 + 80 + 2), 0)
    assert work["recurrence"][1] == 4 * 2 * (3 * CHUNK * 128 + CHUNK * CHUNK) * 128 + 4 * 2 * 2 * CHUNK * CHUNK * 128
    # the inverse in the first kernel: its bytes are the first kernel's, no solve kernel
    folded = work_of(dict(H=4, lengths=[CHUNK]), 1, inverse_in_prepare=True)
    assert set(folded) == {"prepare", "recurrence"} and folded["recurrence"] == work["recurrence"]
    assert folded["prepare"] == (work["prepare"][0] + work["solve"][0], work["prepare"][1])


def test_lower_row_bytes_counts_sectors_up_to_the_diagonal():
    from fastkda.bench.work import lower_row_bytes

    assert lower_row_bytes(32, 2) == 48  # bf16: rows 0-15 one sector, 16-31 two
    assert lower_row_bytes(32, 4) == 80
    assert lower_row_bytes(16, 4) == 48  # rows 0-7 one sector, 8-15 two


def test_kernel_work_counts_the_first_kernels_writes_as_its_stores_mask_them():
    """Whole rows of M and β·L on varlen inputs under the lower-bound gate; their sectors up to the diagonal on
    fixed-length inputs and under the precomputed gate (``prepare.py``)."""
    workload = dict(H=4, lengths=[CHUNK, 0])  # two lengths: one sequence alone would run as rows (equal_rows)
    varlen = plan_of(workload, 1)
    assert varlen.varlen
    masked = (48 + 80) * 4 * CHUNK  # M's and β·L's bytes a row, sector by sector
    whole = (CHUNK * 2 + CHUNK * 4) * 4 * CHUNK
    assert kernel_work(workload, varlen)["prepare"][0] - kernel_work(
        workload, varlen.replace(varlen=False))["prepare"][0] == whole - masked
    assert kernel_work(workload, varlen.replace(lower_bound_gate=False))["prepare"][0] == kernel_work(
        workload, varlen.replace(varlen=False))["prepare"][0]


def test_kernel_work_rejects_a_plan_for_another_shape():
    with pytest.raises(ValueError, match="plan is for"):
        kernel_work(dict(H=4, lengths=[CHUNK]), plan_of(dict(H=2, lengths=[CHUNK])))

"""The shipped workloads file and the inputs made from it, on the CPU."""

import json
import re
from pathlib import Path

import pytest
import torch

from fastkda.bench.runners import fastkda_decode_runner
from fastkda.bench.work import decode_state_bytes
from fastkda.bench.workloads import load_workloads, make_decode_inputs, make_prefill_inputs, select, select_decode

SHARED = Path(__file__).resolve().parents[3] / "shared" / "workloads.json"


@pytest.mark.skipif(not SHARED.exists(), reason="../shared is not beside this checkout")
def test_workloads_copy_matches_shared():
    assert json.loads(SHARED.read_text()) == load_workloads()


def test_workloads_load_from_a_path_too(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(dict(prefill=[], decode=[dict(name="d", H=1, N=1, tokens_per_seq=1)])))
    assert select_decode(load_workloads(path)) == [dict(name="d", H=1, N=1, tokens_per_seq=1)]


def test_select_by_name_group_and_size():
    workloads = load_workloads()
    for group in ("low_parallelism", "long_sequence", "chunked_prefill", "high_parallelism"):
        chosen = select(workloads, group=group)
        assert chosen and all(w["group"] == group for w in chosen)
    # in the order asked for, so that a run cut short has measured the ones asked for first
    assert [w["name"] for w in select(workloads, only=["H12_N2_T1024", "H12_N1_T1024"])] == ["H12_N2_T1024",
                                                                                             "H12_N1_T1024"]
    quick = select(workloads, quick=True)
    assert quick and all(sum(w["lengths"]) * w["H"] <= 12 * 8192 for w in quick)
    assert not select(workloads, group="long_sequence", quick=True)
    assert [w["name"] for w in select_decode(workloads, ["decode_H12_N1"])] == ["decode_H12_N1"]


def test_prefill_inputs_follow_the_layout():
    varlen = make_prefill_inputs(dict(H=2, lengths=[5, 0, 3], layout="varlen"), "cpu")
    assert varlen["q"].shape == (1, 8, 2, 128) and varlen["cu_seqlens"].tolist() == [0, 5, 5, 8]
    assert varlen["initial_state"].shape == (3, 2, 128, 128) and varlen["q"].dtype == torch.bfloat16
    fixed = make_prefill_inputs(dict(H=2, lengths=[4, 4], layout="fixed"), "cpu")
    assert fixed["q"].shape == (2, 4, 2, 128) and fixed["cu_seqlens"] is None


@pytest.mark.parametrize("state_dtype", [None, "fp32", "bf16"])
def test_decode_inputs_run_on_cpu_with_their_pool_dtype(state_dtype):
    workload = dict(name="decode_test", H=2, N=3, tokens_per_seq=2)
    if state_dtype:
        workload["state_dtype"] = state_dtype
    inp = make_decode_inputs(workload, "cpu")
    dtype = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    assert inp["pool"].dtype == dtype and inp["pool"].shape == (7, 2, 128, 128)
    assert inp["slots"].shape == (3, 2) and inp["accepted"].tolist() == [2, 2, 2]
    before = inp["pool"].clone()
    out = fastkda_decode_runner(inp)()
    assert torch.isfinite(out).all() and not torch.equal(inp["pool"][:6], before[:6])
    assert torch.equal(inp["pool"][6], before[6])  # the spare slot is untouched
    assert decode_state_bytes(workload) == 2 * 3 * 2 * 128 * 128 * (2 if state_dtype == "bf16" else 4)


def test_shipped_bf16_decode_workloads_count_two_bytes_per_state_element():
    decode = {w["name"]: w for w in load_workloads()["decode"]}
    bf16 = [w for w in decode.values() if w.get("state_dtype") == "bf16"]
    assert bf16
    for w in bf16:
        fp32 = dict(w, state_dtype="fp32")
        assert 2 * decode_state_bytes(w) == decode_state_bytes(fp32)
    with pytest.raises(ValueError, match="state_dtype"):
        make_decode_inputs(dict(bf16[0], state_dtype="fp16", N=1), "cpu")


PREFILL = dict(name="x", group="g", H=4, lengths=[64, 32], layout="varlen")


@pytest.mark.parametrize("found, words", [
    ("{not json", "Expecting property name"), ([], "not a JSON object"),
    (dict(decode=[]), 'no "prefill" list'), (dict(prefill=[]), 'no "decode" list'),
    (dict(prefill=[{k: v for k, v in PREFILL.items() if k != "group"}], decode=[]), r"prefill entry 0 \(x\): .*group"),
    (dict(prefill=[{k: v for k, v in PREFILL.items() if k != "layout"}], decode=[]), r"entry 0 \(x\): .*layout"),
    (dict(prefill=[dict(PREFILL, layout="packed")], decode=[]), r"entry 0 \(x\): layout must be one of"),
    (dict(prefill=[dict(PREFILL, layout="fixed")], decode=[]), r"entry 0 \(x\): a fixed layout needs"),
    (dict(prefill=[], decode=[dict(name="d", H=1, N=1)]), r"decode entry 0 \(d\): missing tokens_per_seq")])
def test_a_malformed_workloads_file_is_refused_naming_the_file_and_entry(tmp_path, found, words):
    path = tmp_path / "w.json"
    path.write_text(found if isinstance(found, str) else json.dumps(found))
    with pytest.raises(ValueError, match=f"workloads file {re.escape(str(path))}: .*{words}"):
        load_workloads(path)
    with pytest.raises(ValueError, match="cannot read workloads file"):
        load_workloads(tmp_path / "missing.json")


def test_select_refuses_unknown_names_and_groups():
    workloads = load_workloads()
    with pytest.raises(ValueError, match="unknown workload.*nonsense"):
        select(workloads, only=["H12_N1_T1024", "nonsense"])
    with pytest.raises(ValueError, match="unknown group nonsense"):
        select(workloads, group="nonsense")
    assert select(workloads, only=["decode_H12_N1"]) == []  # a decode name is known: select_decode runs it

"""The ncu source-page reader finds the stalled lines (checked on a page in ncu's CSV shape)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tools package

from tools.profiling import ncu_hotspots  # noqa: E402

PAGE = '''==PROF== Connected to process 1
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x7f0","LDG.E.128 R4, desc[UR4][R2.64]","10","9"
"0x800","@P0 BAR.SYNC.DEFER_BLOCKING 0x0","70","70"
"0x810","FMUL R5, R4, R4","20","5"
'''


def test_ranks_lines_and_opcodes_by_stall_samples(tmp_path, capsys):
    path = tmp_path / "page.csv"
    path.write_text(PAGE)
    assert ncu_hotspots.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[ncu] stall samples by opcode: BAR 70.0%, FMUL 20.0%, LDG 10.0%"
    assert "70.00%" in out[1] and "BAR.SYNC" in out[1] and "FMUL" in out[2] and len(out) == 3


def test_stall_reasons_lead_when_the_page_has_them(tmp_path, capsys):
    path = tmp_path / "page.csv"
    path.write_text('"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_no_instruction",'
                    '"stall_Not Issued"\n"0x0","BAR.SYNC 0x0","8","6","2","5"\n"0x10","NOP","2","0","2","1"\n')
    assert ncu_hotspots.main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[ncu] stall reasons: barrier 60.0%, no_instruction 40.0%"
    assert out[1].startswith("[ncu] stall samples by opcode: BAR 80.0%")

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

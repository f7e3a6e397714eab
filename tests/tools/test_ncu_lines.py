"""The ncu page summed per source line: addresses matched through an nvdisasm line table (checked on a page in
ncu's CSV shape and a listing in nvdisasm's, no GPU)."""

import gzip
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tools package

INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
from tools.profiling import ncu_lines  # noqa: E402
from tools.profiling.ncu_hotspots import read_page, stall_reasons  # noqa: E402
from tools.profiling.sass_lines import instructions  # noqa: E402

LISTING = '''\t//## File "/src/kernel.py", line 10
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
\t//## File "/src/std.py", line 293
        /*0010*/                   STS [R5], R84 ;
        /*0020*/               @P4 LDS R74, [R14] ;
\t//## File "/src/kernel.py", line 12
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
'''

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"L1 Wavefronts Shared Excessive","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal",'
          '"stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')
PAGE = '\n'.join([
    '"Kernel Name","k",',
    HEADER,
    '"0x7f00","LDG.E.128 R4, desc[UR4][R2.64]","30","20","0","0","0","0","30","0"',
    '"0x7f10","STS [R5], R84","40","30","150","160","10","40","0","40"',
    '"0x7f20","@P4 LDS R74, [R14]","20","10","150","160","10","20","0","20"',
    '"0x7f30","HMMA.16816.F32.BF16 R8, R12, R16, R8","10","5","0","8","8","10","0","10"',
]) + "\n"


def test_listing_addresses_map_to_their_lines():
    assert [(a, w[1], op) for a, w, op in instructions(LISTING)] == [
        (0x0, 10, "LDG"), (0x10, 293, "STS"), (0x20, 293, "LDS"), (0x30, 12, "HMMA")]


def test_page_summed_per_line_with_conflicts_and_stall_reasons(tmp_path):
    path = tmp_path / "page.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(PAGE)
    rows = read_page(path)
    line_of = {a: w for a, w, _ in instructions(LISTING)}
    found = ncu_lines.per_source_line(rows, line_of)
    assert found[("/src/std.py", 293)] == dict(samples=60.0, shared=320.0, excessive=300.0)
    assert found[("/src/kernel.py", 10)]["samples"] == 30.0 and found[("/src/kernel.py", 12)]["shared"] == 8.0
    assert stall_reasons(rows) == [("barrier", 0.7), ("long_sb", 0.3)]
    out = ncu_lines.report(rows, line_of, top=2)
    assert "shared-memory wavefronts 0.00 M" in out[1] and len(out) == 4
    assert "60.0%" in out[2] and "std.py:293" in out[2] and "kernel.py:10" in out[3]


def test_importing_the_tool_leaves_the_interpreter_setting_alone():
    """Importing it at collection must not clear ``TRITON_INTERPRET`` (``hopper.py`` does, for compiling), or the
    kernels that later tests import would be made for a GPU."""
    assert os.environ.get("TRITON_INTERPRET") == INTERPRET_BEFORE

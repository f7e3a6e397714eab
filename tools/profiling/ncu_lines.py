"""An ncu source page (SASS, ``--csv``) summed per source line of the kernel: stall samples, shared-memory
wavefronts and their bank-conflict replays ("excessive"), with the stall reasons of the whole kernel. The
addresses are matched to lines through the line table of the same kernel compiled here for sm_90a, as its launch
compiles it under the plan of a shape (``sass_lines.py``); the page's addresses count from the kernel's first
instruction, as the local listing's do, so both must come from the same Triton and ptxas.

On the device (one kernel, one launch; the page is the input here):
  ncu --clock-control none --set full --import-source yes -k regex:prepare_kernel --launch-count 1 -f -o /tmp/k \\
      python3 tools/profiling/ncu_prepare.py --only H96_B1_T8192
  ncu -i /tmp/k.ncu-rep --page source --print-source sass --csv | gzip > k-sass.csv.gz
Here (no GPU):
  python tools/profiling/ncu_lines.py prepare k-sass.csv.gz --workload H96_B1_T8192 [--set ...] [--top 25]"""

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools

from tools.profiling.ncu_hotspots import column, columns, number, read_page, stall_reasons  # noqa: E402
from tools.profiling.sass_lines import instructions, source_text  # noqa: E402

EXCESSIVE = ("l1 wavefronts shared excessive",)


def shared_column(header):
    """The column of all shared-memory wavefronts (not its "excessive" or "ideal" siblings)."""
    return next((name for name in header if name.lower().strip() == "l1 wavefronts shared"), None)


def per_source_line(rows, line_of):
    """``{(file, line) or None: dict(samples=, shared=, excessive=)}``: the page's rows summed by the source line
    of their address (``line_of``: offset from the kernel's first instruction -> (file, line)); None holds the
    rows the table does not know."""
    header = list(rows[0])
    samples, _, address = columns(rows)
    shared, excessive = shared_column(header), column(header, *EXCESSIVE)
    base = int(rows[0][address], 16)
    found = collections.defaultdict(lambda: dict(samples=0.0, shared=0.0, excessive=0.0))
    for r in rows:
        where = line_of.get(int(r[address], 16) - base)
        for key, name in (("samples", samples), ("shared", shared), ("excessive", excessive)):
            if name:
                found[where][key] += number(r[name])
    return dict(found)


def report(rows, line_of, top):
    """The summary lines: stall reasons, shared-memory totals, then the ``top`` lines by stall samples."""
    lines_found = per_source_line(rows, line_of)
    samples = sum(v["samples"] for v in lines_found.values()) or 1.0
    shared = sum(v["shared"] for v in lines_found.values())
    excessive = sum(v["excessive"] for v in lines_found.values())
    out = ["[ncu-lines] stalls: " + ", ".join(f"{reason} {share:.1%}" for reason, share in stall_reasons(rows)[:10]),
           f"[ncu-lines] shared-memory wavefronts {shared / 1e6:.2f} M, of which bank-conflict replays "
           f"{excessive / 1e6:.2f} M"]
    ranked = sorted(lines_found.items(), key=lambda kv: -kv[1]["samples"])[:top]
    for where, v in ranked:
        name = f"{Path(where[0]).name}:{where[1]}" if where else "(no line)"
        text = source_text(*where) if where else ""
        out.append(f"[ncu-lines] {v['samples'] / samples:6.1%}  shared {v['shared'] / 1e6:6.2f} M  replays "
                   f"{v['excessive'] / 1e6:6.2f} M  {name:18s} {text[:60]}")
    return out


def main(argv=None):
    # imported here: sass_count clears TRITON_INTERPRET (hopper.py), which an importer of the functions above (a
    # test on the interpreter) needs kept
    from tools.profiling.sass_count import parser_for, sass_of_arguments

    parser = parser_for(__doc__.split("\n\n")[0])
    parser.add_argument("page", help="ncu's SASS source page of the kernel, as --csv (.gz or plain)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    line_of = {address: where for address, where, _ in instructions(sass_of_arguments(args, line_info=True))}
    print("\n".join(report(read_page(args.page), line_of, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

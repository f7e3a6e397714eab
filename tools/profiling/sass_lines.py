"""Where a kernel's SASS instructions come from, per source line (sm_90a, no GPU): the static counterpart of ncu's
source view, from the line info in Triton's cubin (an inlined helper's instructions count against the helper's
line). Arguments as ``sass_count.py``, plus ``--top N``; prints the lines with the most instructions and their
main opcodes.

python tools/profiling/sass_lines.py KERNEL [--workload NAME | --heads H ...] [--set NAME=VALUE,...] [--top 25]"""

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fastkda and tools


def instructions(text):
    """``(address, (file, line), opcode)`` of each instruction of an ``nvdisasm -g`` listing that has a source
    line (addresses as offsets from the kernel's start, as the listing prints them)."""
    where = None
    for ln in text.splitlines():
        source = re.match(r'\s*//## File "(.+)", line (\d+)', ln)
        if source:
            where = (source.group(1), int(source.group(2)))
            continue
        op = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if op and where:
            yield int(op.group(1), 16), where, op.group(2)


def per_line(text):
    """``{(file, line): Counter of opcodes}`` from an ``nvdisasm -g`` listing."""
    found = collections.defaultdict(collections.Counter)
    for _, where, opcode in instructions(text):
        found[where][opcode] += 1
    return found


def source_text(path, line):
    """Line ``line`` of the file ``path``, stripped ("" where the file is not on this machine)."""
    return Path(path).read_text().splitlines()[line - 1].strip() if Path(path).exists() else ""


def main(argv=None):
    # imported here: sass_count clears TRITON_INTERPRET (hopper.py), which an importer of the parsers above may need
    from tools.profiling.sass_count import parser_for, sass_of_arguments

    parser = parser_for(__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    found = per_line(sass_of_arguments(args, line_info=True))
    total = sum(sum(c.values()) for c in found.values())
    print(f"[sass-lines] {args.kernel}: {total} instructions per warp")
    for (path, line), ops in sorted(found.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]:
        source = source_text(path, line)
        main_ops = " ".join(f"{op}:{n}" for op, n in ops.most_common(4))
        print(f"{sum(ops.values()):5d} {Path(path).name}:{line:<4d} {main_ops:44s} {source[:70]}")
    return found


if __name__ == "__main__":
    main()

"""Where a preparation kernel's SASS instructions come from, per source line (sm_90a, no GPU): the static
counterpart of ncu's source view, from the line info in Triton's cubin (an inlined helper's instructions count
against the helper's line). ``python scripts/sass_lines.py KERNEL [NAME=VALUE ...] [--top N]``, arguments as
``scripts/sass_count.py``; prints the lines with the most instructions and their main opcodes."""

import collections
import re
import subprocess
import sys
from pathlib import Path

import sass_count  # noqa: E402  (sets up a GPU-less compile of fastkda.ops.prefill)


def per_line(cubin):
    """{(file, line): Counter of opcodes} from ``nvdisasm -g`` of ``cubin``."""
    text = subprocess.run([str(sass_count.BIN / "nvdisasm"), "-c", "-g", str(cubin)], capture_output=True,
                          text=True).stdout
    where, counts = None, collections.defaultdict(collections.Counter)
    for ln in text.splitlines():
        source = re.match(r'\s*//## File "(.+)", line (\d+)', ln)
        if source:
            where = (source.group(1), int(source.group(2)))
            continue
        op = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if op and where:
            counts[where][op.group(1)] += 1
    return counts


def main():
    top = 25
    args = sys.argv[1:]
    if "--top" in args:
        top = int(args[args.index("--top") + 1])
        del args[args.index("--top"):args.index("--top") + 2]
    sass_count.sass_of_arguments(args[0], args[1:])  # writes /tmp/fastkda_sass.cubin
    counts = per_line(Path("/tmp/fastkda_sass.cubin"))
    total = sum(sum(c.values()) for c in counts.values())
    print(f"{' '.join(args)}: {total} instructions per warp")
    for (path, line), ops in sorted(counts.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        source = Path(path).read_text().splitlines()[line - 1].strip() if Path(path).exists() else ""
        main_ops = " ".join(f"{op}:{n}" for op, n in ops.most_common(4))
        print(f"{sum(ops.values()):5d} {Path(path).name}:{line:<4d} {main_ops:44s} {source[:70]}")


if __name__ == "__main__":
    main()

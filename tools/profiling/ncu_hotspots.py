"""The SASS lines where a kernel's warps stall most, from Nsight Compute's source page (one device call, no GUI).

On the device:
  ncu --clock-control none --set full --import-source yes -k regex:prepare_kernel --launch-count 1 \\
      -o /tmp/prep python3 tools/profiling/ncu_prepare.py
  ncu -i /tmp/prep.ncu-rep --page source --print-source sass --csv > /tmp/prep-sass.csv
  python3 tools/profiling/ncu_hotspots.py /tmp/prep-sass.csv [--top 40]
Prints the top lines by sampled stalls with their share, the instruction and its neighbourhood's opcode, so
the next kernel change can aim at the phase that holds the time."""

import argparse
import csv
import gzip
import re
import sys


def column(header, *words):
    """The first column whose name contains every word (case-insensitive): ncu's names vary by version."""
    for name in header:
        if all(w.lower() in name.lower() for w in words):
            return name
    return None


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def columns(rows):
    """The names of the (stall samples, source line, address) columns of a source page."""
    header = list(rows[0].keys())
    samples = column(header, "warp stall sampling", "all") or column(header, "stall", "sampl")
    source = column(header, "source")
    if samples is None or source is None:
        raise SystemExit(f"no stall-sampling or source column among {header}")
    return samples, source, column(header, "address") or column(header, "pc")


def read_page(path):
    """The rows of an ncu source page written with ``--csv`` (its preamble lines skipped; gzip read as well)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line)
    return list(csv.DictReader(lines[start:]))


def hotspots(rows, top):
    """``(share, samples, address, source)`` of the ``top`` lines with the most stall samples."""
    samples, source, address = columns(rows)
    total = sum(number(r[samples]) for r in rows) or 1.0
    ranked = sorted(rows, key=lambda r: -number(r[samples]))[:top]
    return [(number(r[samples]) / total, number(r[samples]), r.get(address, ""), r[source].strip()) for r in ranked]


def opcode_totals(rows):
    """Stall samples summed by opcode (the first word of the SASS line, predicates dropped)."""
    samples, source, _ = columns(rows)
    totals = {}
    for r in rows:
        match = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", r[source])
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + number(r[samples])
    return sorted(totals.items(), key=lambda kv: -kv[1])


def stall_reasons(rows):
    """``[(reason, share)]`` of the stall samples over the whole kernel, largest first (ncu's ``stall_*``
    columns, the "Not Issued" ones left out)."""
    names = [name for name in rows[0] if name.startswith("stall_") and "Not Issued" not in name]
    totals = {name[len("stall_"):]: sum(number(r[name]) for r in rows) for name in names}
    whole = sum(totals.values()) or 1.0
    return sorted(((reason, t / whole) for reason, t in totals.items()), key=lambda kv: -kv[1])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("csv_path")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    rows = read_page(args.csv_path)
    by_opcode = opcode_totals(rows)
    total = sum(s for _, s in by_opcode) or 1.0
    reasons = stall_reasons(rows)
    if reasons:  # pages printed without ncu's per-reason columns have none
        print("[ncu] stall reasons: " + ", ".join(f"{reason} {share:.1%}" for reason, share in reasons[:10]))
    print("[ncu] stall samples by opcode: " + ", ".join(f"{op} {s / total:.1%}" for op, s in by_opcode[:15]))
    for share, count, address, source in hotspots(rows, args.top):
        print(f"[ncu] {share:6.2%} {int(count):7d}  {address}  {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

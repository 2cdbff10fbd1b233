"""Warp-stall samples of an ncu report, per SASS instruction: the top instructions and the totals per opcode.

    ncu --clock-control none --section SourceCounters --section WarpStateStats -o rep -k regex:gemm -c 1 CMD
    python3 tools/ncu_source_stalls.py rep.ncu-rep [--top 30]

Reads `ncu --import REP --page source --csv --print-source sass` (ncu must be on PATH).
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import subprocess
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    txt = subprocess.run(["ncu", "--import", a.report, "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True).stdout
    lines = [ln for ln in txt.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    at = next((i for i, r in enumerate(rows) if any(c.strip().lower() == "source" for c in r)), None)
    if at is None:
        print(txt[:3000])
        return 1
    head, rows = rows[at], rows[at:]
    print("columns:", head[:40])
    def col(*keys):
        for i, h in enumerate(head):
            if all(k.lower() in h.lower() for k in keys):
                return i
        return None
    c_src = next((i for i, h in enumerate(head) if h.strip().lower() == "source"), None)
    c_addr = col("address")
    c_all = col("warp stall sampling", "all")
    c_exec = col("instructions executed")
    if c_src is None or c_all is None:
        print("no source / stall columns")
        return 1
    data = []
    for r in rows[1:]:
        if len(r) <= max(c_src, c_all):
            continue
        try:
            n = float(r[c_all] or 0)
        except ValueError:
            continue
        ex = r[c_exec] if c_exec is not None and c_exec < len(r) else ""
        data.append((n, r[c_addr] if c_addr is not None else "", r[c_src].strip(), ex))
    total = sum(d[0] for d in data) or 1
    print(f"{len(data)} instructions, {total:.0f} stall samples")
    for n, ad, src, ex in sorted(data, reverse=True)[:a.top]:
        print(f"{n:8.0f} {100 * n / total:5.1f}%  {ad:>8}  exec {ex:>10}  {src}")
    per = collections.Counter()
    for n, _, src, _ in data:
        per[src.split()[0] if src else "?"] += n
    print("per opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in per.most_common(15)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

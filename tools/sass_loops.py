"""The loop layout of built kernels, from their SASS: the largest loops, their tensor-core instructions, and the
warp-synchronisation fallbacks ptxas inserted.

    python3 tools/sass_loops.py ARTIFACTS [ARTIFACTS ...] [--match quantize] [--top 4] [--json] [--compare]

For each cubin whose name contains --match: registers and stack frame (from its .nv.info), the SASS
instruction count, the --top largest loops (a backward branch and its target: the instructions a converged warp
runs between them, and how many are HMMA / HGMMA), and how many ``WARPSYNC.COLLECTIVE`` blocks the kernel holds.
ptxas emits those where it cannot prove a warp converged at a warp-level barrier (``bar.warp.sync``,
``shfl.sync``, ``vote.sync``) that follows divergent code: a ``BRA.DIV`` check before the barrier, and for a
diverged warp a copy of the code placed after the kernel's exit, which branches back (those copies are left out
of the loop sizes).  docs/PERF.md, session 20: a per-warp LoRA meeting whose retry loop could diverge brought 18
of them, a step loop of 458 instead of 422 instructions, and a quantize_act 4-26 % slower even in the forms that
never run the meeting.  No GPU needed.

``--compare`` (two or more folders, e.g. a plain build and one with a ``SVDQ_KERNEL_*`` switch): one row per cubin
name found in the first folder and another, with its registers and its main loop (the innermost loop holding
MMAs) in each, and the loop's change against the first folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kernel_checks import collectives, cuobjdump, instructions, loops  # noqa: E402
from svdq_loader.cubin_info import cubin_info  # noqa: E402


def resources(path: str) -> dict:
    """Registers and stack frame of the cubin's (first) kernel, from its .nv.info (the loader's own reader)."""
    with open(path, "rb") as f:
        k = next(iter(cubin_info(f.read()).kernels.values()))
    return dict(registers=k.regcount, stack=k.frame_size or 0)


def report(tool: str, path: str, top: int) -> dict:
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    ins = instructions(sass)
    return dict(cubin=os.path.basename(path), **resources(path), sass=len(ins),
                collectives=collectives(ins), loops=loops(ins)[:top])


def main_loop(row: dict) -> dict | None:
    """The innermost of a report's loops that holds MMAs (None if none does)."""
    with_mma = [lp for lp in row["loops"] if lp["hmma"]]
    return min(with_mma, key=lambda lp: lp["instructions"]) if with_mma else None


def compare(rows: list[dict], folders: list[str]) -> list[dict]:
    """Per cubin of the first folder that another folder also holds: registers and main-loop sizes side by side."""
    by = {(r["folder"], r["cubin"]): r for r in rows}
    out = []
    for r in rows:
        if r["folder"] != folders[0]:
            continue
        base = main_loop(r)
        for f in folders[1:]:
            o = by.get((f, r["cubin"]))
            if o is None:
                continue
            other = main_loop(o)
            change = None
            if base and other:
                change = (other["instructions"] - base["instructions"]) / base["instructions"]
            out.append(dict(cubin=r["cubin"], folder=f, registers=(r["registers"], o["registers"]),
                            stack=(r["stack"], o["stack"]),
                            loop=(base and base["instructions"], other and other["instructions"]),
                            mma=(base and base["hmma"], other and other["hmma"]), change=change))
    return out


def compare_table(pairs: list[dict], first: str) -> str:
    lines = [f"| cubin | against {first} | registers | stack | main loop (instructions / MMA) | change |",
             "|---|---|---|---|---|---|"]
    for p in pairs:
        loop = " → ".join(f"{n} / {m}" if n is not None else "none" for n, m in zip(p["loop"], p["mma"]))
        ch = "–" if p["change"] is None else f"{100 * p['change']:+.1f} %"
        lines.append(f"| {p['cubin']} | {p['folder']} | {p['registers'][0]} → {p['registers'][1]} | "
                     f"{p['stack'][0]} → {p['stack'][1]} | {loop} | {ch} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", help="artifact folders (their *.cubin files)")
    ap.add_argument("--match", default="", help="only cubins whose file name contains this")
    ap.add_argument("--top", type=int, default=4, help="loops shown per kernel (default 4)")
    ap.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    ap.add_argument("--compare", action="store_true",
                    help="with two or more folders: each cubin's registers and main loop against the first folder's")
    a = ap.parse_args(argv)
    if a.compare and len(a.artifacts) < 2:
        print("--compare needs two or more artifact folders", file=sys.stderr)
        return 2
    tool = cuobjdump()
    if tool is None:
        print("cuobjdump not found: install the test extra (nvidia-cuda-cuobjdump)", file=sys.stderr)
        return 1
    rows = []
    for folder in a.artifacts:
        if not os.path.isdir(folder):
            print(f"{folder}: not a folder", file=sys.stderr)
            return 1
        for name in sorted(os.listdir(folder)):
            if name.endswith(".cubin") and a.match in name:
                rows.append(dict(folder=folder, **report(tool, os.path.join(folder, name), a.top)))
    if not rows:
        print(f"no cubin in {', '.join(a.artifacts)} has {a.match!r} in its name", file=sys.stderr)
        return 1
    if a.compare:
        pairs = compare(rows, a.artifacts)
        if not pairs:
            print(f"no cubin of {a.artifacts[0]} is also in {', '.join(a.artifacts[1:])}", file=sys.stderr)
            return 1
        print(json.dumps(pairs, indent=1) if a.json else compare_table(pairs, a.artifacts[0]))
        return 0
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| folder | cubin | registers | stack | SASS | WARPSYNC.COLLECTIVE | largest loops (instructions / HMMA) |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        lp = ", ".join(f"{d['instructions']} / {d['hmma']}" for d in r["loops"]) or "none"
        print(f"| {r['folder']} | {r['cubin']} | {r['registers']} | {r['stack']} | {r['sass']} | {r['collectives']} "
              f"| {lp} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

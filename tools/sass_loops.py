"""The loop layout of built kernels, from their SASS: the largest loops, their tensor-core instructions, and the
warp-synchronisation fallbacks ptxas inserted.

    python3 tools/sass_loops.py ARTIFACTS [ARTIFACTS ...] [--match quantize] [--top 4] [--json]

For each cubin whose name contains --match: registers and stack frame (from its .nv.info), the SASS
instruction count, the --top largest loops (a backward branch and its target: the instructions a converged warp
runs between them, and how many are HMMA / HGMMA), and how many ``WARPSYNC.COLLECTIVE`` blocks the kernel holds.
ptxas emits those where it cannot prove a warp converged at a warp-level barrier (``bar.warp.sync``,
``shfl.sync``, ``vote.sync``) that follows divergent code: a ``BRA.DIV`` check before the barrier, and for a
diverged warp a copy of the code placed after the kernel's exit, which branches back (those copies are left out
of the loop sizes).  docs/PERF.md, session 20: a per-warp LoRA meeting whose retry loop could diverge brought 18
of them, a step loop of 458 instead of 422 instructions, and a quantize_act 4-26 % slower even in the forms that
never run the meeting.  No GPU needed.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", help="artifact folders (their *.cubin files)")
    ap.add_argument("--match", default="", help="only cubins whose file name contains this")
    ap.add_argument("--top", type=int, default=4, help="loops shown per kernel (default 4)")
    ap.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    a = ap.parse_args(argv)
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

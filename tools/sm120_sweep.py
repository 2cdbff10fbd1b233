"""Static checks over every sm_120a / sm_121a variant of a built artifact set (CPU, no GPU).

    svdq-aot build configs/flux.yaml -o artifacts -j 2
    python tools/sm120_sweep.py artifacts

Both operators: registers <= 255, no stack frame, no STL/LDL, static + dynamic SMEM within sm_120's
101376 B per block; the GEMM's block-scaled OMMA and LoRA HMMA counts, TMA loads, ldmatrix and
mbarrier waits; quantize_act's HMMA exactly when R > 0 (tests/sm120_static.py has the rules).
Exit status 1 if any variant fails or none is found.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import sm120_static  # noqa: E402
from kernel_checks import cuobjdump  # noqa: E402


def main(argv: list[str]) -> int:
    folder = argv[0] if argv else "artifacts"
    tool = cuobjdump()
    if tool is None:
        print("cuobjdump / nvdisasm not found: install the test extra")
        return 1
    t0 = time.time()
    checked, problems = sm120_static.check_artifacts(folder, tool)
    for p in problems:
        print("BAD", p)
    print(f"{checked} sm_120a/sm_121a variant(s) checked, {len(problems)} problem(s), {time.time() - t0:.0f} s")
    return 1 if problems or not checked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

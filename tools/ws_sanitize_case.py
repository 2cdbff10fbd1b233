"""Small gemm_w4a4 calls that the selection sends to the warp-specialised sm_90a form (M <= 256), for
compute-sanitizer racecheck / synccheck of its mbarrier ring:

    compute-sanitizer --tool racecheck python3 tools/ws_sanitize_case.py artifacts

Each case is checked against the float64 reference (the selftest's check); exit status 1 on a failure."""
from __future__ import annotations

import sys

import svdq_loader
from svdq_loader.testing import gpu_checks


def main() -> int:
    lib = svdq_loader.load(sys.argv[1] if len(sys.argv) > 1 else "artifacts")
    bad = 0
    for i, (m, k, n) in enumerate(((1, 256, 256), (77, 1024, 512), (256, 512, 384))):
        chosen = lib.explain("gemm_w4a4", "sm_90a", m=m, n=n, k=k, rank=32, dtype="bf16").chosen
        res = gpu_checks.gemm_case(lib, m, n, k, 32, "bf16", True, True, seed=7 + i, prepared=True)
        bad += not res.ok
        print(res.what, "ok" if res.ok else f"FAIL {res.problems}", "->", getattr(chosen, "name", chosen))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

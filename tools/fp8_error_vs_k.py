"""The FP8-compute GEMM's distance from its float64 reference as K grows (fp16 and bf16 outputs, R = 0 and 32), on
this GPU: how much the FP8 tensor cores' own accumulation adds (docs/PERF.md, session 27).

    SVDQ_ARTIFACTS=artifacts_fp8 python3 tools/fp8_error_vs_k.py [--m 1024] [--n 3072] [--k 768,3072,12288,15360]
"""
import argparse
import os

import svdq_loader
from svdq_loader.testing import gpu_checks

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--m", type=int, default=1024)
ap.add_argument("--n", type=int, default=3072)
ap.add_argument("--k", default="768,3072,12288,15360")
a = ap.parse_args()
lib = svdq_loader.load(os.environ.get("SVDQ_ARTIFACTS", "artifacts"))
print("| K | dtype | R | exact mode | FP8-compute mode |\n|---|---|---|---|---|")
for k in (int(v) for v in a.k.split(",")):
    for dt in ("fp16", "bf16"):
        for r in (0, 32):
            row = []
            for compute in ("exact", "fp8"):
                res = gpu_checks.gemm_case(lib, a.m, a.n, k, r, dt, True, True, seed=k + r, compute=compute)
                row.append(f"{res.error:.2e}" + ("" if res.ok else " (over tol)"))
            print(f"| {k} | {dt} | {r} | {row[0]} | {row[1]} |", flush=True)

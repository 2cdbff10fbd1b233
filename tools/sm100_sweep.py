"""Compile every tile x rank x dtype of the sm_100a/sm_103a GEMM family on the CPU and check each statically.

    python tools/sm100_sweep.py            # about 2 minutes on a 2-core machine

For each combination (wcscale and bias on): the validity predicate either rejects it (printed with
its numbers) or the variant must compile with no stack frame, <= 255 registers, no STL/LDL, four
block-scaled MMAs, UTCHMMA exactly when R > 0, and static + dynamic SMEM within the per-CTA limit.
Exit status 1 if any accepted variant fails a check.  sm_103a is swept in bf16 only (same source).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kernel_checks import cuobjdump, dump_sass  # noqa: E402

from svdq_kernels import sm100_gemm_w4a4 as fam  # noqa: E402
from svdq_kernels import sm100_plan as plan  # noqa: E402

TILES = ((1, 128, 128), (1, 128, 256), (2, 256, 128), (2, 256, 256))
RANKS = (0, 16, 32, 48, 64, 96, 128, 256)


def main() -> int:
    tool = cuobjdump()
    if tool is None:
        print("cuobjdump / nvdisasm not found")
        return 1
    ok = bad = rejected = 0
    t0 = time.time()
    for arch in fam.ARCHS:
        for cg, tm, tn in TILES:
            for r in RANKS:
                for dt in (("bf16",) if arch == "sm_103a" else ("bf16", "fp16")):
                    k = fam.resolve(arch, dict(out_dtype=dt, rank=r, wcscale=True, bias=True, scale_layout="blocked",
                                               cta_group=cg, tile_m=tm, tile_n=tn, ab_stages="auto"))
                    why = fam.invalid_reason(arch, k)
                    if why:
                        rejected += 1
                        print(f"rejected {arch} cta{cg} {tm}x{tn} R={r} {dt}: {why}")
                        continue
                    with tempfile.TemporaryDirectory() as d:
                        ck = fam.compile(arch, k, "svdq_sweep", d)
                        path = os.path.join(d, "k.cubin")
                        with open(path, "wb") as f:
                            f.write(ck.cubin)
                        sass = dump_sass(path, tool) or ""
                    ru = next(iter(ck.resource_usage.values()))
                    good = (ru["stack_frame_bytes"] == 0 and ru["registers"] <= 255
                            and not re.search(r"\b(STL|LDL)\b", sass)
                            and ck.smem_bytes + plan.STATIC_SMEM_BYTES <= plan.SMEM_LIMIT_BYTES
                            and len(re.findall(r"\bUTC[OQ]MMA", sass)) == 4 and ("UTCHMMA" in sass) == (r > 0))
                    ok += good
                    bad += not good
                    print(f"{'ok ' if good else 'BAD'} {arch} cta{cg} {tm}x{tn} R={r} {dt}: {k['ab_stages']} stages, "
                          f"{ru['registers']} registers, {ck.smem_bytes} B SMEM")
    print(f"{ok} ok, {bad} bad, {rejected} rejected in {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Does cutting one gemm_w4a4 call into two calls along M beat the wave quantization of the one call?

    python3 tools/sm90_msplit_probe.py ARTIFACTS [--case 4608x3072x3072:4096,3840 ...] [--quick]

A case is ``MxKxN:B1,B2,...``: the call at M is timed as one call and, for each boundary B, as two calls of the
public API on row slices (rows [0, B) and [B, M), each picked by the loader's own selection), against cuBLAS
in the same run.  Inputs rotate as in `svdq-aot bench`.  Both forms are checked against each other (they must
agree to rounding: each row's result does not depend on the other rows).  An experiment tool, not the product.
"""
from __future__ import annotations

import argparse
import sys

import torch

import svdq_loader
from svdq_loader.testing import bench, reference as ref

DEFAULT_CASES = ("4608x3072x3072:4096,3840,3584", "4608x12288x3072:4096,3840,3584",
                 "4608x3072x12288:4352,4096", "1024x3072x3072:512,768")


def _name(lib, m, k, n):
    e = lib.explain("gemm_w4a4", "sm_90a", m=m, n=n, k=k, rank=32, dtype="bf16",
                    sm_count=torch.cuda.get_device_properties(0).multi_processor_count).chosen.knobs
    return f"{e['tile_m']}x{e['tile_n']} {e['schedule']} {e.get('act_source', 'nvfp4')}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--case", action="append", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    st = bench.QUICK if a.quick else bench.Settings(reps=9, warmup=2, target_ms=2.0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    lib = svdq_loader.load(a.artifacts)
    for case in a.case or DEFAULT_CASES:
        shape, _, cuts = case.partition(":")
        m, k, n = (int(x) for x in shape.split("x"))
        p = ref.random_problem(m, n, k, 32, seed=m + k + n, out_dtype="bf16", device="cuda")
        sets = bench.gemm_input_sets(p, m, k, n, 32, l2)
        nsets = len(sets)
        ws = [lib.prepare_weight(q["wgt"], q["wscales"], lora_up=q["lora_up"], wcscale=q["wcscale"], bias=q["bias"])
              for q in sets]
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in sets]
        dense = bench._dense_case(m, k, n, torch.bfloat16, st, l2)

        def one(i):
            q = sets[i]
            lib.gemm_w4a4(q["act"], ws[i], q["ascales"], lora_act_in=q["lora_act_in"], out=outs[i])

        one(0)
        torch.cuda.synchronize()
        want = outs[0].float().clone()
        t1 = bench.time_calls(one, nsets, st)["us"]
        print(f"M={m} K={k} N={n}: cuBLAS {dense['us']:.1f} us; one call ({_name(lib, m, k, n)}) {t1:.1f} us "
              f"= {dense['us'] / t1:.3f}x cuBLAS", flush=True)
        for b in (int(x) for x in cuts.split(",") if x):
            def two(i, b=b):
                q = sets[i]
                lib.gemm_w4a4(q["act"][:b], ws[i], q["ascales"][:b], lora_act_in=q["lora_act_in"][:b],
                              out=outs[i][:b])
                lib.gemm_w4a4(q["act"][b:], ws[i], q["ascales"][b:], lora_act_in=q["lora_act_in"][b:],
                              out=outs[i][b:])
            outs[0].fill_(float("nan"))
            two(0)
            torch.cuda.synchronize()
            diff = float((outs[0].float() - want).abs().max())
            t2 = bench.time_calls(two, nsets, st)["us"]
            print(f"   split at {b}: [{_name(lib, b, k, n)}] + [{_name(lib, m - b, k, n)}] {t2:.1f} us "
                  f"= {dense['us'] / t2:.3f}x cuBLAS ({t1 / t2:.3f}x the one call); max |diff| {diff:.3g}", flush=True)
        sets = ws = outs = None
        bench._free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

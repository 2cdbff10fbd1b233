"""One call of one named sm_90a gemm_w4a4 variant (the target of ncu): bypasses selection.

    python3 tools/sm90_pick_call.py ARTIFACTS --m 16 --k 3072 --n 12288 --match tilem64 --match schedulews_w

Every --match must be a substring of the variant's name (R = 32, bf16, wcscale and bias); exactly one variant
must match.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import sys

import torch

import svdq_loader
from svdq_loader.ops import gemm_w4a4 as gop
from svdq_loader.testing import reference as ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--match", action="append", default=[])
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    lib = svdq_loader.load(a.artifacts)
    names = [e.name for e in lib.variants if e.op == "gemm_w4a4" and "rank32_wcscale1_bias1_" in e.name
             and "outdtypebf16" in e.name
             and all(s in e.name for s in a.match)]
    if len(names) != 1:
        print(f"{len(names)} variants match {a.match}: {names[:6]}")
        return 2
    p = ref.random_problem(a.m, a.n, a.k, 32, seed=1, out_dtype="bf16", device="cuda")
    w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
    out = torch.empty(a.m, a.n, dtype=torch.bfloat16, device="cuda")
    args = gop.fast_args("sm_90a", p["act"], w, p["ascales"], p["lora_act_in"], out, None)[3]
    args[gop.SM_COUNT_INDEX] = torch.cuda.get_device_properties(0).multi_processor_count
    args[gop.STREAM_INDEX] = torch.cuda.current_stream().cuda_stream
    ln = lib._launcher(names[0], 0, False)
    for _ in range(a.calls):
        ln.launch(args)
    torch.cuda.synchronize()
    print("ok", names[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

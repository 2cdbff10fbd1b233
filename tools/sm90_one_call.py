"""One gemm_w4a4 call per M at K, N (R=32, bf16; default M = 4608 and 1000 at K=3072, N=12288): the target of
ncu in tools/h200_issue7.sh.  Needs a GPU and artifacts (SVDQ_ARTIFACTS, default artifacts/).

    python3 tools/sm90_one_call.py [--m 4608,1000] [--k 3072] [--n 12288] [--compute fp8]
"""
import argparse
import os

import torch

import svdq_loader
from svdq_loader.testing import reference as ref

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--m", default="4608,1000", help="comma list of M (the first is the largest)")
ap.add_argument("--k", type=int, default=3072)
ap.add_argument("--n", type=int, default=12288)
ap.add_argument("--compute", choices=("exact", "fp8"), default="exact", help="the GEMM's compute mode")
a = ap.parse_args()
ms = [int(v) for v in a.m.split(",")]
lib = svdq_loader.load(os.environ.get("SVDQ_ARTIFACTS", "artifacts"))
p = ref.random_problem(max(ms), a.n, a.k, 32, seed=1, out_dtype="bf16", device="cuda")
w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"],
                       compute=a.compute)
for m in ms:
    y = lib.gemm_w4a4(p["act"][:m], w, p["ascales"][:m], lora_act_in=p["lora_act_in"][:m])
    torch.cuda.synchronize()
    print("ok", m, tuple(y.shape))

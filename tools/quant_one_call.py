"""quantize_act calls at M=4608, K in {3072, 15360}, bf16, smooth on: the target of ncu for the quantize
kernel (one launch per K and rank after a warm-up).  Needs a GPU and artifacts (SVDQ_ARTIFACTS, default
artifacts/).

    python3 tools/quant_one_call.py [--ranks 32] [--ks 3072,15360]
"""
import argparse
import os

import torch

import svdq_loader

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--ranks", default="32", help="comma list of LoRA ranks (0: no lora_down)")
ap.add_argument("--ks", default="3072,15360", help="comma list of K")
a = ap.parse_args()
lib = svdq_loader.load(os.environ.get("SVDQ_ARTIFACTS", "artifacts"))
g = torch.Generator(device="cuda").manual_seed(1)
for r in (int(v) for v in a.ranks.split(",")):
    for k in (int(v) for v in a.ks.split(",")):
        x = torch.randn(4608, k, device="cuda", generator=g).to(torch.bfloat16)
        sm = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        ld = (torch.randn(k, r, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16) if r else None
        act, sc, la = lib.quantize_act(x, smooth=sm, lora_down=ld)
        torch.cuda.synchronize()
        print("ok", r, k, tuple(act.shape), tuple(sc.shape), None if la is None else tuple(la.shape))

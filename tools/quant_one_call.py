"""quantize_act calls at M=4608, K in {3072, 15360}, R=32, bf16, smooth on: the target of ncu for the
quantize kernel (one launch per K after a warm-up).  Needs a GPU and artifacts (SVDQ_ARTIFACTS, default
artifacts/)."""
import os

import torch

import svdq_loader

lib = svdq_loader.load(os.environ.get("SVDQ_ARTIFACTS", "artifacts"))
g = torch.Generator(device="cuda").manual_seed(1)
for k in (3072, 15360):
    x = torch.randn(4608, k, device="cuda", generator=g).to(torch.bfloat16)
    sm = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    ld = (torch.randn(k, 32, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    act, sc, la = lib.quantize_act(x, smooth=sm, lora_down=ld)
torch.cuda.synchronize()
print("ok", tuple(act.shape), tuple(sc.shape), tuple(la.shape))

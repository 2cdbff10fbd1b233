"""One gemm_w4a4 call per built tile at M=4608, K=3072, N=12288 (R=32, bf16): the target of ncu in
tools/h200_issue7.sh.  Needs a GPU and artifacts (SVDQ_ARTIFACTS, default artifacts/)."""
import os

import torch

import svdq_loader
from svdq_loader.testing import reference as ref

lib = svdq_loader.load(os.environ.get("SVDQ_ARTIFACTS", "artifacts"))
p = ref.random_problem(4608, 12288, 3072, 32, seed=1, out_dtype="bf16", device="cuda")
w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
for m in (4608, 1000):
    y = lib.gemm_w4a4(p["act"][:m], w, p["ascales"][:m], lora_act_in=p["lora_act_in"][:m])
torch.cuda.synchronize()
print("ok", tuple(y.shape))

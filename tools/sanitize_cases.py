"""A few launches of both operators over M tails, for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_cases.py artifacts

Checks quantize_act against the exact reference and quantize_act -> gemm_w4a4 for finite output.
"""
from __future__ import annotations

import sys

import torch

import svdq_loader
from svdq_loader.testing import reference as ref
from svdq_loader.testing.quantize_ref import quantize_act_ref_torch


def main() -> int:
    lib = svdq_loader.load(sys.argv[1] if len(sys.argv) > 1 else "artifacts")
    k, n, bad = 3072, 3072, 0
    for m in (1, 77, 1000, 4592):
        for r in (0, 32):
            for smooth_on in (False, True):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                sm = torch.rand(k, device="cuda").add_(0.5).to(torch.bfloat16) if smooth_on else None
                ld = (torch.randn(k, r, device="cuda") / k ** 0.5).to(torch.bfloat16) if r else None
                act, sc, la = lib.quantize_act(x, smooth=sm, lora_down=ld)
                ra, rs, _ = quantize_act_ref_torch(x, sm, ld, "logical")
                ok = torch.equal(act.cpu(), ra) and torch.equal(sc.view(torch.uint8).cpu(), rs)
                p = ref.random_problem(m, n, k, r, seed=m + r, out_dtype="bf16", device="cuda")
                y = lib.gemm_w4a4(act, p["wgt"], sc, p["wscales"], lora_act_in=la, lora_up=p.get("lora_up"),
                                  wcscale=p["wcscale"], bias=p["bias"])
                ok = ok and bool(torch.isfinite(y).all())
                bad += not ok
                print(f"M={m} R={r} smooth={int(smooth_on)}: {'ok' if ok else 'MISMATCH'}", flush=True)
    torch.cuda.synchronize()
    print("sanitize cases:", "all ok" if not bad else f"{bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

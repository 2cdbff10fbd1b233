"""Host cost per call of both operators next to torch.matmul's dispatch, interleaved rounds (H200 numbers in PERF.md).

    python3 tools/host_cost.py artifacts [--rounds 5]

Tiny cached problems (the GPU is never the bottleneck): back-to-back calls, no
synchronisation in the loop, median µs per call of each round; rounds
alternate ours / torch so machine noise hits both.  Also the cost of one call
with a never-seen M (selection + launch binding: a cache miss).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import svdq_loader
from svdq_loader.testing.bench import Settings, _tiny_gemm, _tiny_quant, host_us_per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    lib = svdq_loader.load(a.artifacts)
    st = Settings()
    k, n, gemm, _ = _tiny_gemm(lib, 32, "bf16", [])
    qk, quant, _ = _tiny_quant(lib, 32, "bf16", [])
    x = torch.randn(16, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    y = torch.empty(16, n, dtype=torch.bfloat16, device="cuda")
    fns = {"gemm_w4a4": gemm, "quantize_act": quant, "torch.matmul": lambda: torch.matmul(x, b),
           "torch.matmul(out=)": lambda: torch.matmul(x, b, out=y)}
    res = {name: [] for name in fns}
    for _ in range(a.rounds):
        for name, fn in fns.items():
            res[name].append(host_us_per_call(fn, st)["us"])
    med = {name: statistics.median(v) for name, v in res.items()}
    print(f"problem: M=16 K={k} N={n} R=32 bf16 (quantize_act: M=16 K={qk})")
    print("| call | µs/call (median of rounds) | rounds | / torch.matmul | / torch.matmul(out=) |\n|---|---|---|---|---|")
    for name in fns:
        print(f"| {name} | {med[name]:.2f} | {', '.join(f'{v:.1f}' for v in res[name])} | "
              f"{med[name] / med['torch.matmul']:.2f}× | {med[name] / med['torch.matmul(out=)']:.2f}× |")
    # a cache miss: a new M every call (selection, recipe binding, then the launch)
    from svdq_loader.testing import reference as ref
    p = ref.random_problem(4000, n, k, 32, seed=3, out_dtype="bf16", device="cuda")
    w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
    miss = []
    for m in range(3001, 3041):
        args = (p["act"][:m], w, p["ascales"][:m])
        t0 = time.perf_counter()
        lib.gemm_w4a4(*args, lora_act_in=p["lora_act_in"][:m])
        miss.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    print(f"| gemm_w4a4, first call of a new M (cache miss) | {statistics.median(miss):.1f} | 40 Ms | | |")


if __name__ == "__main__":
    main()

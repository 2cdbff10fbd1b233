"""10^5 calls over varying M: host and device memory must stay flat (no per-call growth, bounded caches).

    python3 tools/long_run.py artifacts [--calls 100000] [--json out.json]

Pairs of quantize_act -> gemm_w4a4 (K = N = 3072, R = 32, bf16) with M cycling over 1024 distinct values
(so the selection and launch caches see misses throughout), outputs allocated per call by torch.  Prints
RSS, torch's allocated/reserved bytes and the driver's free memory at checkpoints; exit 1 when the growth
after the first checkpoint exceeds the bound.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import svdq_loader
from svdq_loader.weights import quantize_weight


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rss-bound-mb", type=float, default=64.0)
    a = ap.parse_args()
    lib = svdq_loader.load(a.artifacts)
    k = n = 3072
    r = 32
    qw = quantize_weight(torch.randn(n, k, device="cuda"))
    w = lib.prepare_weight(qw.wgt, qw.wscales, lora_up=torch.randn(n, r, device="cuda").to(torch.bfloat16),
                           wcscale=qw.wcscale, bias=torch.randn(n, device="cuda"))
    smooth = torch.rand(k, device="cuda").add_(0.5).to(torch.bfloat16)
    ld = (torch.randn(k, r, device="cuda") / k ** 0.5).to(torch.bfloat16)
    xbig = torch.randn(1024, k, device="cuda").to(torch.bfloat16)
    lib.preload()
    rows, t0 = [], time.perf_counter()
    step = max(1, a.calls // 10)
    for i in range(a.calls):
        m = 1 + (i * 1543) % 1024
        x = xbig[:m]
        act, sc, la = lib.quantize_act(x, smooth=smooth, lora_down=ld)
        lib.gemm_w4a4(act, w, sc, lora_act_in=la)
        if i % step == step - 1 or i == 0:
            torch.cuda.synchronize()
            free, _total = torch.cuda.mem_get_info()
            rows.append(dict(calls=i + 1, seconds=round(time.perf_counter() - t0, 2), rss_mb=rss_bytes() / 2**20,
                             torch_allocated_mb=torch.cuda.memory_allocated() / 2**20,
                             torch_reserved_mb=torch.cuda.memory_reserved() / 2**20,
                             device_free_mb=free / 2**20, choice_cache=len(lib._choice)))
            print(json.dumps(rows[-1]), flush=True)
    first, last = rows[1] if len(rows) > 1 else rows[0], rows[-1]
    growth = {key: round(last[key] - first[key], 2) for key in ("rss_mb", "torch_allocated_mb", "torch_reserved_mb")}
    growth["device_free_mb"] = round(first["device_free_mb"] - last["device_free_mb"], 2)
    ok = growth["rss_mb"] <= a.rss_bound_mb and growth["torch_allocated_mb"] <= 1 and growth["device_free_mb"] <= 64
    print(f"{a.calls} call pairs, {len(set(1 + (i * 1543) % 1024 for i in range(min(a.calls, 1024))))} distinct M; "
          f"growth from the 2nd checkpoint to the last: {growth} -> {'flat' if ok else 'GROWS'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, growth=growth, flat=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""How far the FP8-compute mode lies from the exact W4A4 operator, per shape, on SVDQuant-like inputs (CPU, float64).

    python3 tools/fp8_distance.py [--config configs/flux.yaml] [--m 1024] [--rank 32] [--seed 0] [--json F]

Inputs, per (K, N) of the config (a stand-in for a real layer; no checkpoint is read):
* activations x [M, K] in bf16: unit gaussians times a per-channel scale exp(N(0, 1)), with 1 % of the channels
  (outliers) 20x larger, as diffusion transformers' activations have;
* weights W [N, K]: gaussians of RMS 1/sqrt(K);
* SVDQuant's transformation: smoothing λ_k = sqrt(max|x_k| / max|W_k|) (x / λ, W · λ), then the top-R singular
  directions of the smoothed weight go to the low-rank branch and the residual is quantized
  (`svdq_loader.weights.quantize_weight`, per-channel wcscale); the activations are quantized by the rules of
  ``quantize_act`` (`quantize_ref.quantize_act_ref`).

Printed per shape, each a relative Frobenius distance of the residual branch's product (the low-rank branch, bias
and the affine are the same in both modes):
* ``exact vs math``: the exact W4A4 operator against the unquantized product (x̂ · Ŵ_resᵀ in float64);
* ``fp8 vs math``: the FP8-compute mode against the same;
* ``fp8 vs exact``: the mode against the exact operator (`fp8_reference.fp8_distance`'s measure);
and the same three for the whole linear (both branches), which is what a user sees.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _shapes(config: str):
    from svdq_aot.config import load_config
    cfg = load_config(config)
    return [(s.name, int(s.k), int(s.n)) for s in cfg.shapes]


def _layer(m: int, k: int, n: int, rank: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(k, generator=g))
    chan[torch.randperm(k, generator=g)[: max(1, k // 100)]] *= 20.0
    x = (torch.randn(m, k, generator=g) * chan).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    lam = (x.float().abs().amax(0) / w.abs().amax(0)).sqrt().clamp(min=1e-4)
    xs = (x.float() / lam).to(torch.bfloat16)                     # what quantize_act sees (smoothing applied)
    ws = w * lam
    if rank:
        u, s, v = torch.svd_lowrank(ws, q=rank + 8, niter=2, M=None)
        low = (u[:, :rank] * s[:rank]) @ v[:, :rank].T
    else:
        low = torch.zeros_like(ws)
    return xs, (ws - low), low


def measure(m: int, k: int, n: int, rank: int, seed: int) -> dict:
    import torch

    from svdq_loader.testing import fp8_reference as f8
    from svdq_loader.testing import reference as ref
    from svdq_loader.testing.quantize_ref import quantize_act_ref_torch
    from svdq_loader.weights import quantize_weight

    xs, wres, low = _layer(m, k, n, rank, seed)
    act, asc, _ = quantize_act_ref_torch(xs)
    qw = quantize_weight(wres)
    act, asc = act.numpy(), asc.numpy()
    wgt, wsc = qw.wgt.numpy(), qw.wscales.view(torch.uint8).numpy()
    wc = qw.wcscale.double().numpy()
    exact = ref.reference_gemm_w4a4(act, wgt, asc, wsc) * wc[None, :]
    fp8 = f8.reference_gemm_w4a4_fp8(act, wgt, asc, wsc) * wc[None, :]
    x64 = xs.double().numpy()
    math_res = x64 @ wres.double().numpy().T
    lora = x64 @ low.double().numpy().T

    def dist(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    return {"residual": {"exact_vs_math": dist(exact, math_res), "fp8_vs_math": dist(fp8, math_res),
                         "fp8_vs_exact": dist(fp8, exact)},
            "linear": {"exact_vs_math": dist(exact + lora, math_res + lora),
                       "fp8_vs_math": dist(fp8 + lora, math_res + lora),
                       "fp8_vs_exact": dist(fp8 + lora, exact + lora)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", default="configs/flux.yaml", help="the (K, N) pairs come from its shapes")
    ap.add_argument("--m", type=int, default=1024, help="tokens (rows of x); default 1024")
    ap.add_argument("--rank", type=int, default=32, help="low-rank branch rank R (default 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the numbers to this file")
    a = ap.parse_args(argv)
    if a.m < 1 or a.rank < 0:
        ap.error(f"--m must be >= 1 and --rank >= 0, got {a.m}, {a.rank}")
    rows = []
    print(f"M = {a.m}, R = {a.rank}, seed {a.seed}: relative Frobenius distances, residual branch / whole linear")
    print("| shape | K | N | exact vs math | fp8 vs math | fp8 vs exact |")
    print("|---|---|---|---|---|---|")
    for name, k, n in _shapes(a.config):
        t0 = time.time()
        d = measure(a.m, k, n, a.rank, a.seed)
        rows.append({"shape": name, "m": a.m, "k": k, "n": n, "rank": a.rank, **d})
        r, li = d["residual"], d["linear"]
        print(f"| {name} | {k} | {n} | {100 * r['exact_vs_math']:.2f} / {100 * li['exact_vs_math']:.2f} % "
              f"| {100 * r['fp8_vs_math']:.2f} / {100 * li['fp8_vs_math']:.2f} % "
              f"| {100 * r['fp8_vs_exact']:.2f} / {100 * li['fp8_vs_exact']:.2f} % |", flush=True)
        print(f"  ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

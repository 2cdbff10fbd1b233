"""Host cost per call of both operators next to torch.matmul's dispatch, interleaved rounds (H200 numbers in PERF.md).

    python3 tools/host_cost.py artifacts [--rounds 5] [--breakdown]

Tiny cached problems (the GPU is never the bottleneck): back-to-back calls, no
synchronisation in the loop, median µs per call of each round; within a round
the calls' batches alternate ours / torch so machine noise hits both.  Also the cost of one call
with a never-seen M (selection + launch binding: a cache miss).  ``--breakdown``
adds what a cached quantize_act call is made of: the one-pass checks, the
selection lookup, torch's current stream, the context check, the launcher
(grid plan, recipe, cuLaunchKernelEx) and cuLaunchKernelEx alone, each timed
the same way, beside torch.empty of one output.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import svdq_loader
from svdq_loader.testing.bench import Settings, _tiny_gemm, _tiny_quant, host_us_interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true", help="also time the parts of a cached quantize_act call")
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
    res = timed_rounds(fns, st, a.rounds)
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
    if a.breakdown:
        breakdown(lib, qk, st, a.rounds, med["torch.matmul"])


def timed_rounds(fns: dict, st, rounds: int) -> dict:
    """{name: [µs per call in each round]}: every round times all of `fns` in interleaved batches (the bench's
    `host_us_interleaved`), so machine noise hits them alike."""
    res = {name: [] for name in fns}
    for _ in range(rounds):
        for name, r in host_us_interleaved(fns, st).items():
            res[name].append(r["us"])
    return res


def quant_parts(lib, k: int) -> dict:
    """Callables timing a cached quantize_act call (M = 16, R = 32, bf16, outputs given): the whole call first,
    then its parts in call order (the parts but the last two add up to about the whole; cuLaunchKernelEx alone is
    inside the launcher's time, and torch.empty of one output is there for scale: the call allocates nothing)."""
    from svdq_loader import library as L
    from svdq_loader.ops import quantize_act as qop
    from svdq_loader.testing.bench import _quant_inputs
    x, smooth, ld = _quant_inputs(16, k, 32, torch.bfloat16)
    act, sc, la = lib.quantize_act(x, smooth=smooth, lora_down=ld)
    arch = lib._arch.get(0) or lib._device_arch(0)
    feats, dims, _, args = qop.fast_args(arch, x, smooth, ld, act, sc, la)
    key = ("quantize_act", 0, feats, dims)
    ln = lib._choice[key]
    args[qop.STREAM_INDEX] = L._current_stream(0)
    ln.launch(args)                     # binds the recipe's entry
    inner = ln.inner
    entry = inner._entries[inner._scalars_of(args)]   # laid out by Launcher._bind
    cfg_addr, func, kp = entry[5], entry[6], entry[7]
    raw = inner._fn
    torch.cuda.synchronize()
    return {
        "quantize_act, whole call": lambda: lib.quantize_act(x, smooth=smooth, lora_down=ld, out_act=act,
                                                             out_scales=sc, out_lora=la),
        "checks (fast_args)": lambda: qop.fast_args(arch, x, smooth, ld, act, sc, la),
        "selection lookup": lambda: lib._choice.get(key),
        "torch's current stream": lambda: L._current_stream(0),
        "context check": lambda: ln.device.foreign_context(),
        "launcher (plan, recipe, cuLaunchKernelEx)": lambda: ln.launch(args),
        "cuLaunchKernelEx alone (ctypes)": lambda: raw(cfg_addr, func, kp, None),
        "torch.empty, one [16, K/2] uint8": lambda: torch.empty((16, k // 2), dtype=torch.uint8, device=x.device),
    }


def breakdown(lib, k: int, st, rounds: int, matmul_us: float) -> None:
    res = timed_rounds(quant_parts(lib, k), st, rounds)
    print(f"\nparts of a cached quantize_act call (M=16 K={k} R=32 bf16, outputs given; torch.matmul "
          f"{matmul_us:.2f} µs above)")
    print("| part | µs/call (median of rounds) | rounds | / torch.matmul |\n|---|---|---|---|")
    for name, v in res.items():
        m = statistics.median(v)
        print(f"| {name} | {m:.2f} | {', '.join(f'{u:.1f}' for u in v)} | {m / matmul_us:.2f}× |")


if __name__ == "__main__":
    main()

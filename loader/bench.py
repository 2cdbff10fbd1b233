"""Benchmark `gemm_w4a4` through the loader (needs a GPU; no DSL).

    python -m svdq_loader.bench --artifacts artifacts --json bench.json
    svdq-aot bench --artifacts artifacts --json bench.json      (same thing)

For each (M, K, N): median kernel time over CUDA-graph replays of a batch of
launches (so launch gaps do not count), TFLOP/s = 2·M·N·K / time, and the
host cost of one `gemm_w4a4` call (Python checks, selection, launch) timed
on the CPU without synchronising.  Writes JSON and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

DEFAULT_SHAPES = [  # (M, K, N): FLUX.1 linears at 1024² (dev: M=4608) plus a small-M case
    (4608, 3072, 9216), (4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072),
    (4608, 3072, 21504), (4608, 15360, 3072), (4352, 3840, 3072), (256, 3072, 3072),
]


def bench_one(lib, m, k, n, *, rank=32, out_dtype="bf16", reps=20, inner=10):
    import torch

    from . import reference as ref
    p = ref.random_problem(m, n, k, rank, seed=m + n + k, out_dtype=out_dtype, device="cuda")
    w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
    out = torch.empty((m, n), dtype=p["lora_act_in"].dtype if rank else torch.bfloat16, device="cuda")
    call = lambda: lib.gemm_w4a4(p["act"], w, p["ascales"], lora_act_in=p["lora_act_in"], out=out)  # noqa: E731
    call()
    torch.cuda.synchronize()
    # host cost per call (no sync inside the loop; the GPU queue absorbs the launches)
    t0 = time.perf_counter()
    for _ in range(50):
        call()
    host_us = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    # device time: graph of `inner` launches, replayed `reps` times
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(inner):
            call()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    ms = statistics.median(times)
    return dict(m=m, k=k, n=n, rank=rank, out_dtype=out_dtype, median_ms=ms,
                tflops=2 * m * n * k / (ms * 1e-3) / 1e12, host_us_per_call=host_us,
                spread_ms=[min(times), max(times)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--json", default="bench.json")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--shapes", default=None, help="M,K,N;M,K,N;... (default: FLUX set)")
    a = ap.parse_args(argv)
    import torch

    import svdq_loader
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = DEFAULT_SHAPES if not a.shapes else [tuple(int(x) for x in s.split(",")) for s in a.shapes.split(";")]
    lib = svdq_loader.load(a.artifacts)
    rows = []
    for m, k, n in shapes:
        r = bench_one(lib, m, k, n, rank=a.rank, out_dtype=a.dtype)
        rows.append(r)
        print(f"M={m:6d} K={k:6d} N={n:6d}  {r['median_ms']:8.3f} ms  {r['tflops']:7.1f} TFLOP/s  "
              f"host {r['host_us_per_call']:6.1f} us/call", flush=True)
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
               loader=svdq_loader.__version__, artifacts=a.artifacts, results=rows)
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print("\n| M | K | N | R | dtype | ms | TFLOP/s | host µs/call |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {r['k']} | {r['n']} | {r['rank']} | {r['out_dtype']} | {r['median_ms']:.3f} | "
              f"{r['tflops']:.1f} | {r['host_us_per_call']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

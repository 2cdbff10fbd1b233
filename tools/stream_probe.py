"""How fast the gemv form's weight reads could go with no compute: a Triton kernel that reads exactly what the
sm_90a gemv tile reads (one program per 64-row weight block, its k-tiles in order: 2048 weight bytes and 256 scale
bytes each, loads pipelined `--stages` deep) and a grid-stride read of the same weight bytes, timed as the bench
times an op (`bench.time_calls`: CUDA-graph medians over `--copies` input sets, so the L2 holds none of them),
beside the bench's 1 GiB copy rate.  Needs a GPU and Triton (the device machine has both).  docs/PERF.md, session
38, has the numbers of its first form (a scratch script with these two kernels, its own CUDA-graph timer and a
graph-captured copy, which ran on the copy engine); session 39 has this file's own run (H100).

    python3 tools/stream_probe.py [--kn 3072x21504,3072x12288,3072x3072] [--stages 2,4,6,8] [--copies 8]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from svdq_loader.testing import bench


@triton.jit
def _block_streams(w, s, out, KT: tl.constexpr, WB: tl.constexpr, SB: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, WB)
    soffs = tl.arange(0, SB)
    acc = tl.zeros([WB], dtype=tl.int32)
    sacc = tl.zeros([SB], dtype=tl.int32)
    wb = w + pid.to(tl.int64) * KT * WB
    sb = s + pid.to(tl.int64) * KT * SB
    for kt in tl.range(0, KT, num_stages=STAGES):
        acc ^= tl.load(wb + kt * WB + offs)
        sacc ^= tl.load(sb + kt * SB + soffs)
    tl.store(out + pid, tl.sum(acc, 0) + tl.sum(sacc, 0))


@triton.jit
def _grid_stride(w, out, n, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(pid, n // BLOCK, tl.num_programs(0), num_stages=STAGES):
        acc ^= tl.load(w + i.to(tl.int64) * BLOCK + offs)
    tl.store(out + pid, tl.sum(acc, 0))


def _words(nbytes: int):
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kn", default="3072x21504,3072x12288,3072x3072", help="comma list of KxN")
    ap.add_argument("--stages", default="2,4,6,8", help="load pipeline depths of the block-stream kernel")
    ap.add_argument("--copies", type=int, default=8, help="input sets rotated per graph replay")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_probe: no CUDA device")
        return 2
    print(torch.cuda.get_device_name(0))
    st = bench.Settings(reps=9, warmup=2, target_ms=2.0)
    bench.warm_gpu()
    copy = bench.copy_bandwidth(st)
    print(f"1 GiB copy (launched directly): {copy['us']:.1f} µs, {copy['gbps']:.0f} GB/s (read + write)")
    out = torch.empty(1 << 14, dtype=torch.int32, device="cuda")
    for kn in a.kn.split(","):
        k, n = (int(x) for x in kn.lower().split("x"))
        kt, blocks = k // 64, n // 64
        wb, sb = 64 * 32, 64 * 4             # bytes per (64-row block, 64-k tile): weights, scales
        W = [_words(blocks * kt * wb) for _ in range(a.copies)]
        S = [_words(blocks * kt * sb) for _ in range(a.copies)]
        total = (W[0].numel() + S[0].numel()) * 4
        for depth in (int(x) for x in a.stages.split(",")):
            us = bench.time_calls(
                lambda i: _block_streams[(blocks,)](W[i], S[i], out, kt, wb // 4, sb // 4, depth, num_warps=4),
                a.copies, st)["us"]
            print(f"K={k} N={n}: {blocks} block streams x {kt} k-tiles, {depth} stages: {us:.1f} µs, "
                  f"{total / us / 1e3:.0f} GB/s")
        for progs in (132, 264, 528):
            us = bench.time_calls(lambda i: _grid_stride[(progs,)](W[i], out, W[i].numel(), 1024, 4, num_warps=4),
                                  a.copies, st)["us"]
            print(f"K={k} N={n}: grid-stride read of the weight bytes, {progs} programs: {us:.1f} µs, "
                  f"{W[0].numel() * 4 / us / 1e3:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast the gemv form's weight reads could go with no compute: a Triton kernel that reads exactly what the
sm_90a gemv tile reads (one program per 64-row weight block, its k-tiles in order: 2048 weight bytes and 256 scale
bytes each, loads pipelined `--stages` deep) and a grid-stride read of the same weight bytes, timed as CUDA-graph
replays over `--copies` input sets (so the L2 holds none of them), beside a 1 GiB copy launched directly.  Needs a
GPU and Triton (the device machine has both).  docs/PERF.md, session 38, has the numbers of its first form, a scratch
script with these two kernels and this timer (and a graph-captured copy, which ran on the copy engine); this file,
its command line added, has not yet run on a GPU.

    python3 tools/stream_probe.py [--kn 3072x21504,3072x12288,3072x3072] [--stages 2,4,6,8] [--copies 8]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


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


def graph_us(fn, copies: int) -> float:
    """Median µs per call of `fn(i)` for i over the copies, replayed as one CUDA graph (9 replays)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(9):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(ts)[len(ts) // 2]


def launched_us(fn) -> float:
    """Median µs of `fn()` launched directly (9 timed calls after one): a copy captured in a CUDA graph becomes a
    copy-engine node, slower than the copy kernel a direct launch runs."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(9):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


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
    src = torch.empty(1 << 28, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    us = launched_us(lambda: dst.copy_(src))
    print(f"1 GiB copy (launched directly): {us:.1f} µs, {2 * src.numel() * 4 / us / 1e3:.0f} GB/s (read + write)")
    del src, dst
    out = torch.empty(1 << 14, dtype=torch.int32, device="cuda")
    for kn in a.kn.split(","):
        k, n = (int(x) for x in kn.lower().split("x"))
        kt, blocks = k // 64, n // 64
        wb, sb = 64 * 32, 64 * 4             # bytes per (64-row block, 64-k tile): weights, scales
        W = [_words(blocks * kt * wb) for _ in range(a.copies)]
        S = [_words(blocks * kt * sb) for _ in range(a.copies)]
        total = (W[0].numel() + S[0].numel()) * 4
        for st in (int(x) for x in a.stages.split(",")):
            us = graph_us(lambda i: _block_streams[(blocks,)](W[i], S[i], out, kt, wb // 4, sb // 4, st, num_warps=4),
                          a.copies)
            print(f"K={k} N={n}: {blocks} block streams x {kt} k-tiles, {st} stages: {us:.1f} µs, "
                  f"{total / us / 1e3:.0f} GB/s")
        for progs in (132, 264, 528):
            us = graph_us(lambda i: _grid_stride[(progs,)](W[i], out, W[i].numel(), 1024, 4, num_warps=4), a.copies)
            print(f"K={k} N={n}: grid-stride read of the weight bytes, {progs} programs: {us:.1f} µs, "
                  f"{W[0].numel() * 4 / us / 1e3:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-CTA timeline of a quantize_act launch, from a diagnosis build (SVDQ_KERNEL_QUANT_PROBE=1 at build time).

    SVDQ_KERNEL_QUANT_PROBE=1 svdq-aot build CONFIG -o artifacts_qprobe               # CPU, rank > 0 variants
    python3 tools/quant_timeline.py artifacts_qprobe --m 4608 --k 3072,12288 --ksplit 1,2,4   # on a GPU

Such a build writes, per CTA, its SM id and its first / last %globaltimer reading into lora_act_in
(32 bytes per CTA) instead of the LoRA sums.  This tool launches each case several times back to back
(rotating inputs) and summarises the last launch: the span, CTA durations, how late CTAs start (waves),
and the busy span per SM.  The LoRA output of such a build is meaningless; codes and scales still are.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import svdq_loader
from quant_sweep import direct_calls, timed_pass         # tools/ is this script's own folder on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--m", default="4608")
    ap.add_argument("--k", default="3072,12288")
    ap.add_argument("--ksplit", default="1,2,4")
    a = ap.parse_args()
    lib = svdq_loader.load(a.artifacts)
    for e in lib.variants:
        if e.op != "quantize_act" or e.arch != "sm_90a" or not e.knobs["rank"]:
            continue
        r = e.knobs["rank"]
        for m in (int(v) for v in a.m.split(",")):
            for k in (int(v) for v in a.k.split(",")):
                for ks in (int(v) for v in a.ksplit.split(",")):
                    _case(lib, e, m, k, r, ks)


def _case(lib, e, m, k, r, ks):
    copies = 6
    ln, _, _, _, calls, _ = direct_calls(lib, e, m, k, r, ks, copies)
    for _ in range(3):
        for c in calls:
            c[2][2].fill_(0)
        us = timed_pass(ln, calls)
    grid = -(-m // 16) * ks
    raw = calls[-1][2][2].view(torch.int64).flatten()[: grid * 4].cpu().view(grid, 4)
    smid = (raw[:, 0] & 0xFFFFFFFF).tolist()
    ts = raw[:, 1].tolist()
    te = raw[:, 2].tolist()
    base = min(ts)
    ts = [(v - base) / 1e3 for v in ts]
    te = [(v - base) / 1e3 for v in te]
    dur = sorted(b - a for a, b in zip(ts, te))
    span = max(te)
    late = sum(1 for v in ts if v > 1.0)
    per_sm: dict[int, list] = {}
    for s, a0, b0 in zip(smid, ts, te):
        per_sm.setdefault(s, []).append((a0, b0))
    ends = sorted(max(b for _, b in v) for v in per_sm.values())
    ctas = sorted(len(v) for v in per_sm.values())
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]   # noqa: E731
    print(f"M={m} K={k} R={r} ksplit={ks}: {us:.1f} us per launch (events, {copies} back to back); "
          f"last launch span {span:.1f} us, {grid} CTAs on {len(per_sm)} SMs "
          f"(CTAs per SM {ctas[0]}..{ctas[-1]}, median {statistics.median(ctas)})")
    print(f"    CTA duration us: min {dur[0]:.1f} p10 {q(dur, .1):.1f} median {statistics.median(dur):.1f} "
          f"p90 {q(dur, .9):.1f} max {dur[-1]:.1f};  CTAs starting > 1 us late: {late};  "
          f"start p50 {statistics.median(ts):.2f} p90 {q(sorted(ts), .9):.2f} max {max(ts):.2f}")
    print(f"    SM last end us: min {ends[0]:.1f} p10 {q(ends, .1):.1f} median {statistics.median(ends):.1f} "
          f"max {ends[-1]:.1f}", flush=True)


if __name__ == "__main__":
    main()

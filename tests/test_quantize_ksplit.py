"""`quantize_act`'s K split per row tile (`ops.quantize_act.ksplit_for`): the loader's rule, on the CPU.

The values at the measured points are the fastest (or within 2 %) of the H200 sweeps in docs/PERF.md
(session 5; R = 0 at M = 4608 and K >= 12288: session 10; R = 32 at M = 1024 and the points added with it:
session 14, where M = 64, K = 3072 is the one point the rule missed: 8 where 2 or 4 were faster; R = 32 at
M >= 4608: session 15); R = 32 at K = 3072 and M <= 1024 (three steps per warp at least) and the cluster
residency (M = 1536): session 36, on an H100 with CUDA-graph timing.  Everywhere the split is a power of two, at
most KSPLIT_MAX, at most one step per warp, with LoRA at most one per three steps.
"""
from __future__ import annotations

import pytest

from svdq_loader.ops import quantize_act as qop


@pytest.mark.parametrize("m,k,rank,want", [
    (4608, 3072, 32, 1), (4608, 12288, 32, 2), (4608, 15360, 32, 2),       # session 15: 1 and 2 tie at K = 3072
    (9216, 3072, 32, 1), (9216, 12288, 32, 2), (9216, 15360, 32, 2),                            # session 15
    (18432, 3072, 32, 1), (18432, 12288, 32, 1), (18432, 15360, 32, 1),
    (1024, 3072, 32, 4), (1024, 12288, 32, 4), (1024, 15360, 32, 4),      # session 14 (was 2: 5-9 % slower)
    (64, 12288, 32, 8), (256, 12288, 32, 8), (1024, 12288, 0, 8), (64, 15360, 0, 8),
    (256, 3072, 32, 4), (256, 15360, 32, 8), (64, 3072, 32, 4),    # session 36, M = 256: 4 5.2 us, 8 6.0
    (4608, 3072, 0, 4), (4608, 12288, 0, 8), (4608, 15360, 0, 8),
    (1024, 3072, 0, 4), (256, 15360, 0, 8),
])
def test_measured_points(m, k, rank, want):
    assert qop.ksplit_for(m, k, rank, 132) == want


#: clusters of 2 / 4 / 8 CTAs an H100 holds at once (the driver's count, session 36): rank 32 (3 CTAs per SM)
H100_R32 = ((2, 198), (4, 92), (8, 45))


@pytest.mark.parametrize("m,k,want,want_ideal", [
    (1536, 3072, 2, 4),      # 96 tiles: 96 clusters of 4 do not all fit (92); 13.6 us at 4, 10.1 at 2
    (1536, 12288, 2, 4),     # 29.0 us at 2, 33.8 at 4
    (1024, 3072, 4, 4),      # 64 clusters of 4 fit: 8.7 us at 4 and at 2
    (768, 12288, 4, 8),      # 48 clusters of 8 do not all fit (45)
    (640, 12288, 8, 8),      # 40 do
])
def test_cluster_residency(m, k, want, want_ideal):
    assert qop.ksplit_for(m, k, 32, 132, H100_R32) == want
    assert qop.ksplit_for(m, k, 32, 132) == want_ideal          # no driver: every resident CTA counts


def test_bounds():
    for sms in (1, 114, 132, 148, 170):
        for rank in (0, 16, 32, 128):
            for m in (1, 15, 16, 17, 255, 1000, 1536, 4608, 1 << 20):
                for k in (64, 128, 256, 512, 1024, 3072, 15360):
                    for clusters in (None, H100_R32, ((2, 1), (4, 1), (8, 1))):
                        s = qop.ksplit_for(m, k, rank, sms, clusters)
                        assert 1 <= s <= qop.KSPLIT_MAX and s & (s - 1) == 0, (m, k, rank, sms, s)
                        assert s == 1 or s <= k // 256, (m, k, rank, sms, s)
                        assert s == 1 or not rank or 3 * s <= k // 256, (m, k, rank, sms, s)
                        tiles = -(-m // 16)
                        if clusters and s > 1 and tiles * s <= 3 * sms:     # a one-round split: its clusters fit
                            assert tiles <= dict(clusters)[s], (m, k, rank, sms, s, clusters)


def test_host_argument():
    assert qop.SPEC.arg_names[qop.KSPLIT_INDEX] == "ksplit" and dict(qop.SPEC.host_args)["ksplit"] == "i32"

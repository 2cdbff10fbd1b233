"""`quantize_act`'s K split per row tile (`ops.quantize_act.ksplit_for`): the loader's rule, on the CPU.

The values at the measured points are the fastest (or within 2 %) of the H200 sweeps in docs/PERF.md
(session 5; R = 0 at M = 4608 and K >= 12288: session 10; R = 32 at M = 1024 and the points added with it:
session 14, where M = 64, K = 3072 is the one point the rule misses: 8 where 2 or 4 were faster; R = 32 at
M >= 4608: session 15); everywhere the split is a power of two, at most KSPLIT_MAX, at most one step per warp.
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
    (256, 3072, 32, 8), (256, 15360, 32, 8),
    (4608, 3072, 0, 4), (4608, 12288, 0, 8), (4608, 15360, 0, 8),
    (1024, 3072, 0, 4), (256, 15360, 0, 8),
])
def test_measured_points(m, k, rank, want):
    assert qop.ksplit_for(m, k, rank, 132) == want


def test_bounds():
    for sms in (1, 114, 132, 148, 170):
        for rank in (0, 16, 32, 128):
            for m in (1, 15, 16, 17, 255, 1000, 4608, 1 << 20):
                for k in (64, 128, 256, 512, 1024, 3072, 15360):
                    s = qop.ksplit_for(m, k, rank, sms)
                    assert 1 <= s <= qop.KSPLIT_MAX and s & (s - 1) == 0, (m, k, rank, sms, s)
                    assert s == 1 or s <= k // 256, (m, k, rank, sms, s)


def test_host_argument():
    assert qop.SPEC.arg_names[qop.KSPLIT_INDEX] == "ksplit" and dict(qop.SPEC.host_args)["ksplit"] == "i32"

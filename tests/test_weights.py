"""Offline weight quantization (svdq_loader.weights), on the CPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402
from svdq_loader.weights import dequantize_weight, e2m1_codes, quantize_blocks, quantize_weight  # noqa: E402

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def slow_code(v: float) -> int:
    """Nearest E2M1 magnitude, ties to the even code, saturating; sign bit for v < 0."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(MAGS[i] - a), i % 2))
    return best | (8 if v < 0 else 0)


def test_e2m1_every_tie_and_midpoint():
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2499, 0.2501, 5.0001, 7.0, 100.0, 0.0, -0.75, -5.0, -0.1]
    got = e2m1_codes(torch.tensor(vals, dtype=torch.float32)).tolist()
    assert got == [slow_code(v) for v in vals]
    assert got[:7] == [0, 2, 2, 4, 4, 6, 6]                 # ties go to the even code


def test_blocks_match_a_slow_per_element_quantizer():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-3, 2, 8).unsqueeze(1)
    x[0, :16] = 0.0                                         # a zero group
    packed, scales = quantize_blocks(x)
    s8 = scales.view(torch.uint8).numpy()
    for r in range(8):
        for gi in range(4):
            blk = x[r, gi * 16:(gi + 1) * 16].double().numpy()
            amax = np.float32(np.abs(blk).max())
            want = ref.encode_e4m3(np.array([np.float32(amax) / np.float32(6.0)]))[0]
            assert s8[r, gi] == want, (r, gi)
            sc = float(ref.decode_e4m3(np.array([want]))[0])
            for j in range(16):
                k = gi * 16 + j
                code = (int(packed[r, k // 2]) >> (4 * (k % 2))) & 0xF
                expect = 0 if sc == 0 else slow_code(float(np.float32(blk[j]) / np.float32(sc)))
                assert code == expect, (r, k)


def test_quantize_weight_per_channel_and_tensor_scale():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-4, 1, 64).unsqueeze(1)   # rows over 5 decades
    qw = quantize_weight(w.to(torch.bfloat16))
    assert qw.wgt.shape == (64, 128) and qw.wgt.dtype == torch.uint8
    assert qw.wscales.shape == (64, 16) and qw.wscales.dtype == torch.float8_e4m3fn
    assert torch.equal(qw.wscales.float().amax(dim=1), torch.full((64,), 448.0))   # full E4M3 range per row
    d = dequantize_weight(qw)
    rel = float((d - w.to(torch.bfloat16).float()).norm() / w.norm())
    assert 0.02 < rel < 0.12                                   # NVFP4-sized error, not zero, not garbage
    qt = quantize_weight(w.to(torch.bfloat16) * 8, tensor_scale=8.0)
    assert torch.equal(qt.wgt, qw.wgt) and torch.equal(qt.wscales.view(torch.uint8), qw.wscales.view(torch.uint8))
    assert torch.allclose(qt.wcscale, qw.wcscale * 8)          # the per-tensor scale is folded into wcscale
    none = quantize_weight(w[:4] * 1e-3, wcscale="none")
    assert torch.equal(none.wcscale, torch.ones(4))


@pytest.mark.parametrize("bad, words", [
    (lambda: quantize_weight(torch.zeros(4, 24)), "multiple of 16"),
    (lambda: quantize_weight(torch.zeros(4)), "2-D"),
    (lambda: quantize_weight(torch.full((2, 16), math.inf)), "inf or NaN"),
    (lambda: quantize_weight(torch.ones(2, 16), wcscale="row"), "per_channel"),
    (lambda: quantize_weight(torch.ones(2, 16), tensor_scale=0), "positive"),
])
def test_bad_input(bad, words):
    with pytest.raises(InvalidArgument, match=words):
        bad()

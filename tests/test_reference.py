"""Tests of the numerical reference (svdq_loader.testing.reference).  CPU only, fast.

Expected values are worked out by hand or with independent code written here
(explicit tables, math.ldexp, Python loops) — not with the module's helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from svdq_loader.testing import reference as ref

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

# Independent tables, typed in from the spec.
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def spec_e4m3(b: int) -> float:
    """E4M3FN byte -> float, written out from the format definition."""
    s = -1.0 if b >> 7 else 1.0
    e = (b >> 3) & 15
    m = b & 7
    if e == 15 and m == 7:
        return math.copysign(math.nan, s)
    if e == 0:
        return s * m * 2.0**-9
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


# ---------------------------------------------------------------- E2M1 / E4M3

def test_e2m1_table():
    assert list(ref.E2M1_VALUES) == SPEC_E2M1
    assert np.signbit(ref.E2M1_VALUES[8])
    got = ref.decode_e2m1(np.arange(16, dtype=np.uint8))
    assert got.dtype == np.float64 and list(got) == SPEC_E2M1


def test_e4m3_known_bytes():
    d = lambda b: float(ref.decode_e4m3(np.uint8(b)))  # noqa: E731
    assert d(0x38) == 1.0
    assert d(0x40) == 2.0
    assert d(0x30) == 0.5
    assert d(0x7E) == 448.0
    assert d(0xFE) == -448.0
    assert d(0x01) == 2.0**-9
    assert d(0x07) == 7 * 2.0**-9
    assert d(0x08) == 2.0**-6
    assert d(0x39) == 1.125
    v = d(0x80)
    assert v == 0.0 and math.copysign(1.0, v) == -1.0
    assert d(0x00) == 0.0 and math.copysign(1.0, d(0x00)) == 1.0
    assert math.isnan(d(0x7F)) and math.isnan(d(0xFF))
    allb = ref.decode_e4m3(np.arange(256, dtype=np.uint8))
    assert allb.dtype == np.float64
    assert np.isnan(allb).sum() == 2


def test_e4m3_decode_matches_spec_formula():
    allb = ref.decode_e4m3(np.arange(256, dtype=np.uint8))
    exp = np.array([spec_e4m3(b) for b in range(256)])
    np.testing.assert_array_equal(allb, exp)  # NaNs compare equal here
    assert (np.signbit(allb) == np.signbit(exp)).all()


@needs_torch
def test_e4m3_decode_matches_torch_all_bytes():
    t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    exp = t.to(torch.float64).numpy()
    got = ref.decode_e4m3(np.arange(256, dtype=np.uint8))
    np.testing.assert_array_equal(got, exp)
    assert (np.signbit(got) == np.signbit(exp)).all()


def test_e4m3_encode_roundtrip_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(ref.decode_e4m3(b))
    enc = ref.encode_e4m3(ref.decode_e4m3(b[finite]))
    assert enc.dtype == np.uint8
    np.testing.assert_array_equal(enc, b[finite])  # incl. -0.0 -> 0x80


def test_e4m3_encode_rounding_and_saturation():
    e = lambda x: int(ref.encode_e4m3(x))  # noqa: E731
    assert e(1.0625) == 0x38      # tie 1.0 / 1.125 -> even mantissa (1.0)
    assert e(1.1875) == 0x3A      # tie 1.125 / 1.25 -> 1.25
    assert e(1.07) == 0x39
    assert e(2.0**-10) == 0x00    # tie 0 / 2^-9 -> 0
    assert e(3 * 2.0**-10) == 0x02  # tie 2^-9 / 2^-8 -> 2^-8 (even)
    assert e(2.0**-11) == 0x00
    assert e(-2.0**-11) == 0x80
    assert e(448.0) == 0x7E
    assert e(460.0) == 0x7E
    assert e(1e6) == 0x7E and e(-1e6) == 0xFE
    assert e(math.inf) == 0x7E and e(-math.inf) == 0xFE
    assert e(math.nan) & 0x7F == 0x7F
    assert e(0.0) == 0x00 and e(-0.0) == 0x80


@needs_torch
def test_e4m3_encode_matches_torch_in_range():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.uniform(-448, 448, 20000),
        np.exp2(rng.uniform(-12, 8.8, 20000)) * rng.choice([-1, 1], 20000),
        # all midpoints between adjacent codes (exact ties)
        (ref.decode_e4m3(np.arange(0, 0x7E, dtype=np.uint8))
         + ref.decode_e4m3(np.arange(1, 0x7F, dtype=np.uint8))) / 2,
    ])
    x = x[np.abs(x) <= 448]
    exp = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = ref.encode_e4m3(x)
    np.testing.assert_array_equal(got, exp)


def test_e2m1_encode():
    e = lambda x: int(ref.encode_e2m1(x))  # noqa: E731
    for code in range(16):
        assert e(SPEC_E2M1[code]) == code
    assert e(0.25) == 0 and e(0.75) == 2 and e(1.25) == 2 and e(1.75) == 4
    assert e(2.5) == 4 and e(3.5) == 6 and e(5.0) == 6 and e(5.01) == 7
    assert e(0.26) == 1 and e(2.6) == 5
    assert e(7.0) == 7 and e(1e9) == 7 and e(math.inf) == 7
    assert e(-0.75) == 10 and e(-100.0) == 15 and e(-0.1) == 8
    with pytest.raises(ValueError):
        ref.encode_e2m1(math.nan)
    x = np.linspace(-7, 7, 1001)
    np.testing.assert_array_equal(ref.encode_e2m1(ref.decode_e2m1(ref.encode_e2m1(x))),
                                  ref.encode_e2m1(x))


@needs_torch
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_e2m1_times_e4m3_exact_in_half(dt):
    """docs/design.md section 3: every E2M1·E4M3 product is exact in fp16 and bf16."""
    tdt = torch.bfloat16 if dt == "bf16" else torch.float16
    b = np.arange(256, dtype=np.uint8)
    s = ref.decode_e4m3(b)
    s = s[~np.isnan(s)]
    prod = (np.array(SPEC_E2M1)[:, None] * s[None, :]).ravel()
    back = torch.from_numpy(prod).to(tdt).to(torch.float64).numpy()
    np.testing.assert_array_equal(back, prod)


# ---------------------------------------------------------------- nibbles

def test_nibble_order_hand():
    assert ref.pack_nibbles(np.array([[1, 2]], dtype=np.uint8)).tolist() == [[0x21]]
    assert ref.unpack_nibbles(np.array([[0x21, 0xF0]], dtype=np.uint8)).tolist() == [[1, 2, 0, 15]]
    packed = np.zeros((1, 8), dtype=np.uint8)
    packed[0, 0] = 0x21
    deq = ref.dequantize_nvfp4(packed, np.array([[0x38]], dtype=np.uint8))
    assert deq[0, 0] == 0.5 and deq[0, 1] == 1.0
    assert (deq[0, 2:] == 0).all()


def test_pack_unpack_roundtrip():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(5, 64), dtype=np.uint8)
    p = ref.pack_nibbles(codes)
    assert p.shape == (5, 32) and p.dtype == np.uint8
    np.testing.assert_array_equal(ref.unpack_nibbles(p), codes)
    np.testing.assert_array_equal(p, codes[:, 0::2] + 16 * codes[:, 1::2])


# ---------------------------------------------------------------- quantize

def test_quantize_dequantize_error_bound():
    rng = np.random.default_rng(2)
    rows, k = 33, 256
    x = rng.standard_normal((rows, k)) * np.exp2(rng.integers(-8, 6, size=(rows, k // 16))).repeat(16, 1)
    x[0, :16] = 0.0                      # zero block
    x[1, :16] = 1e-5 * np.arange(16)     # block below the smallest scale
    packed, scales = ref.quantize_nvfp4(x)
    assert packed.shape == (rows, k // 2) and scales.shape == (rows, k // 16)
    assert packed.dtype == np.uint8 and scales.dtype == np.uint8
    assert scales[0, 0] == 0 and (packed[0, :8] == 0).all()
    assert scales[1, 0] == 0x01
    deq = ref.dequantize_nvfp4(packed, scales)
    s = np.repeat(np.array([[spec_e4m3(int(b)) for b in row] for row in scales]), 16, axis=1)
    err = np.abs(deq - x)
    slack = 1 + 1e-12
    assert (err <= np.maximum.reduce([np.abs(x) / 4, s / 4, np.abs(x) - 6 * s]) * slack).all()
    # blocks whose amax/6 is in the normal E4M3 range: no saturation beyond |x|/4
    amax = np.repeat(np.abs(x).reshape(rows, -1, 16).max(-1), 16, axis=1)
    normal = (amax / 6 >= 2.0**-6) & (amax / 6 <= 448)
    assert normal.mean() > 0.5
    assert (err[normal] <= (np.maximum(np.abs(x) / 4, s / 4) * slack)[normal]).all()
    # amax/6 lands near the top of the grid: relative error of the block amax is small
    rel = np.linalg.norm(deq - x) / np.linalg.norm(x)
    assert rel < 0.15


def test_quantize_exact_roundtrip_when_block_max_is_6():
    """Data already on the NVFP4 grid with a ±6 in every block re-quantizes to the same bytes."""
    rng = np.random.default_rng(4)
    rows, k = 7, 128
    codes = rng.integers(0, 16, size=(rows, k), dtype=np.uint8)
    codes[:, ::16] = rng.choice([7, 15], size=(rows, k // 16))
    scales = rng.integers(0x01, 0x7F, size=(rows, k // 16), dtype=np.uint8)  # every positive finite byte
    packed = ref.pack_nibbles(codes)
    p2, s2 = ref.quantize_nvfp4(ref.dequantize_nvfp4(packed, scales))
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(p2, packed)


def test_quantize_hand_block():
    x = np.zeros((1, 16))
    x[0, :4] = [6.0, -3.0, 1.0, 0.2]
    packed, scales = ref.quantize_nvfp4(x)
    assert scales.tolist() == [[0x38]]                 # amax/6 = 1.0
    assert packed[0, :2].tolist() == [0xD7, 0x02]      # (6, -3) -> 0x7 | 0xD<<4 ; (1, 0.2->0) -> 0x2


# ---------------------------------------------------------------- blocked layout

def _blocked_index(r, g, groups):
    gb = -(-groups // 4)
    return ((((r // 128) * gb + g // 4) * 32 + r % 32) * 4 + (r // 32) % 4) * 4 + g % 4


@pytest.mark.parametrize("rows,groups", [(77, 6), (1, 1), (128, 4), (300, 9), (129, 3)])
def test_blocked_roundtrip(rows, groups):
    rng = np.random.default_rng(rows * 10 + groups)
    s = rng.integers(1, 256, size=(rows, groups), dtype=np.uint8)
    b = ref.to_blocked(s)
    rp, gp = -(-rows // 128) * 128, -(-groups // 4) * 4
    assert b.shape == (rp * gp,) and b.dtype == np.uint8
    assert ref.blocked_size(rows, groups) == rp * gp
    np.testing.assert_array_equal(ref.from_blocked(b, rows, groups), s)
    # every element at its formula position; everything else is zero padding
    expect = np.zeros(rp * gp, dtype=np.uint8)
    for r in range(rows):
        for g in range(groups):
            expect[_blocked_index(r, g, groups)] = s[r, g]
    np.testing.assert_array_equal(b, expect)


def test_blocked_specific_positions():
    s = np.zeros((77, 6), dtype=np.uint8)
    marks = {(0, 0): 1, (1, 0): 2, (32, 0): 3, (0, 1): 4, (0, 4): 5, (76, 5): 6, (33, 2): 7}
    for (r, g), v in marks.items():
        s[r, g] = v
    b = ref.to_blocked(s)
    assert b.size == 128 * 8
    # hand-computed: ((gb_idx*32 + r%32)*4 + (r//32)%4)*4 + g%4  (one row block, Gb = 2)
    where = {1: 0, 2: 16, 3: 4, 4: 1, 5: 512, 6: (1 * 32 + 12) * 16 + 2 * 4 + 1, 7: 16 + 4 + 2}
    for v, idx in where.items():
        assert b[idx] == v, (v, idx)
    assert np.count_nonzero(b) == len(marks)
    s3 = np.zeros((300, 6), dtype=np.uint8)
    s3[130, 5] = 9
    assert np.flatnonzero(ref.to_blocked(s3)).tolist() == [((1 * 2 + 1) * 32 + 2) * 16 + 1]


@needs_torch
def test_blocked_matches_torchao_algorithm():
    """The torchao to_blocked recipe (view/permute/transpose), written out in torch."""
    rows, groups = 200, 10
    rng = np.random.default_rng(5)
    s = rng.integers(0, 256, size=(rows, groups), dtype=np.uint8)
    rb, gb = -(-rows // 128), -(-groups // 4)
    padded = torch.zeros(rb * 128, gb * 4, dtype=torch.uint8)
    padded[:rows, :groups] = torch.from_numpy(s)
    blocks = padded.view(rb, 128, gb, 4).permute(0, 2, 1, 3)
    exp = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten().numpy()
    np.testing.assert_array_equal(ref.to_blocked(s), exp)


# ---------------------------------------------------------------- GEMM

def test_gemm_hand_k16():
    # act: every byte 0x21 -> (k even 0.5, k odd 1.0), ascale 0x40 = 2.0 -> A = [1, 2, 1, 2, ...]
    # wgt: every byte 0xA3 -> (k even 1.5, k odd -1.0), wscale 0x30 = 0.5 -> W = [0.75, -0.5, ...]
    # Σ = 8·(1·0.75 + 2·(-0.5)) = -2;  ·wcscale 3 -> -6;  + bias 0.25 -> -5.75
    # LoRA: [1, 2]·[0.5, -1] = -1.5  ->  -7.25
    act = np.full((1, 8), 0x21, np.uint8)
    wgt = np.full((1, 8), 0xA3, np.uint8)
    asc = np.array([[0x40]], np.uint8)
    wsc = np.array([[0x30]], np.uint8)
    y = ref.reference_gemm_w4a4(act, wgt, asc, wsc)
    assert y.shape == (1, 1) and y.dtype == np.float64 and y[0, 0] == -2.0
    y = ref.reference_gemm_w4a4(act, wgt, asc, wsc, wcscale=np.array([3.0]))
    assert y[0, 0] == -6.0
    y = ref.reference_gemm_w4a4(act, wgt, asc, wsc, wcscale=np.array([3.0]), bias=np.array([0.25]))
    assert y[0, 0] == -5.75
    y = ref.reference_gemm_w4a4(act, wgt, asc, wsc, wcscale=np.array([3.0]), bias=np.array([0.25]),
                                lora_act_in=np.array([[1.0, 2.0]]), lora_up=np.array([[0.5, -1.0]]))
    assert y[0, 0] == -7.25


def test_gemm_hand_two_groups_two_columns():
    # K = 32, M = 1, N = 2.
    # act group 0: k0 = code 7 (6.0), rest 0; scale 0x01 (2^-9)          -> A[0] = 6·2^-9
    # act group 1: k16 = code 0xC (-2.0), k17 = code 5 (3.0); scale 0x48 (4.0) -> A[16] = -8, A[17] = 12
    act = np.zeros((1, 16), np.uint8)
    act[0, 0] = 0x07
    act[0, 8] = 0x5C
    asc = np.array([[0x01, 0x48]], np.uint8)
    # wgt row 0: k0 = 4.0 (code 6), k16 = 1.0 (code 2), k17 = 0.5 (code 1); scales (1.0, 0.5)
    #   -> W0[0] = 4, W0[16] = 0.5, W0[17] = 0.25
    #   Σ0 = 6·2^-9·4 + (-8)(0.5) + 12(0.25) = 0.046875 - 4 + 3 = -0.953125
    # wgt row 1: k1 = -6 (code 0xF) (k1 has A = 0), k17 = -1.5 (code 0xB); scales (448, 2^-6)
    #   -> W1[17] = -1.5·2^-6;  Σ1 = 12·(-1.5/64) = -0.28125
    wgt = np.zeros((2, 16), np.uint8)
    wgt[0, 0] = 0x06
    wgt[0, 8] = 0x12
    wgt[1, 0] = 0xF0
    wgt[1, 8] = 0xB0
    wsc = np.array([[0x38, 0x30], [0x7E, 0x08]], np.uint8)
    y = ref.reference_gemm_w4a4(act, wgt, asc, wsc, wcscale=np.array([2.0, -4.0]), bias=np.array([1.0, 0.0]))
    assert y.tolist() == [[-0.953125 * 2 + 1.0, -0.28125 * -4.0]]


def _naive(act, wgt, asc, wsc, la, lu, wc, bias):
    m_, n_ = act.shape[0], wgt.shape[0]
    k_ = act.shape[1] * 2

    def val(packed, scales, row, k):
        byte = int(packed[row, k // 2])
        nib = byte & 15 if k % 2 == 0 else byte >> 4
        return SPEC_E2M1[nib] * spec_e4m3(int(scales[row, k // 16]))

    y = [[0.0] * n_ for _ in range(m_)]
    for m in range(m_):
        for n in range(n_):
            acc = math.fsum(val(act, asc, m, k) * val(wgt, wsc, n, k) for k in range(k_))
            lora = math.fsum(float(la[m, r]) * float(lu[n, r]) for r in range(la.shape[1]))
            y[m][n] = acc * float(wc[n]) + float(bias[n]) + lora
    return np.array(y)


def test_gemm_matches_naive_loop():
    rng = np.random.default_rng(3)
    M, N, K, R = 3, 5, 48, 16
    act = rng.integers(0, 256, (M, K // 2), dtype=np.uint8)
    wgt = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    # finite scale bytes across the whole range incl. subnormals and negatives
    asc = rng.choice(np.r_[0:0x7F, 0x80:0xFF].astype(np.uint8), (M, K // 16))
    wsc = rng.choice(np.r_[0:0x7F, 0x80:0xFF].astype(np.uint8), (N, K // 16))
    la, lu = rng.standard_normal((M, R)), rng.standard_normal((N, R))
    wc, bias = rng.uniform(0.5, 2, N), rng.standard_normal(N)
    y = ref.reference_gemm_w4a4(act, wgt, asc, wsc, lora_act_in=la, lora_up=lu, wcscale=wc, bias=bias)
    exp = _naive(act, wgt, asc, wsc, la, lu, wc, bias)
    np.testing.assert_allclose(y, exp, rtol=1e-12, atol=1e-12 * np.abs(exp).max())
    # blocked (1-D) scales are accepted and give the same result
    y2 = ref.reference_gemm_w4a4(act, wgt, ref.to_blocked(asc), ref.to_blocked(wsc),
                                 lora_act_in=la, lora_up=lu, wcscale=wc, bias=bias)
    np.testing.assert_array_equal(y, y2)


def test_gemm_rejects_bad_shapes():
    act = np.zeros((2, 8), np.uint8)
    wgt = np.zeros((3, 8), np.uint8)
    s2, s3 = np.zeros((2, 1), np.uint8), np.zeros((3, 1), np.uint8)
    with pytest.raises(ValueError):
        ref.reference_gemm_w4a4(act, np.zeros((3, 16), np.uint8), s2, s3)
    with pytest.raises(ValueError):
        ref.reference_gemm_w4a4(act, wgt, s2, s3, bias=np.zeros(2))
    with pytest.raises(ValueError):
        ref.reference_gemm_w4a4(act, wgt, s2, s3, lora_act_in=np.zeros((2, 16)))


# ---------------------------------------------------------------- torch-facing

@needs_torch
def test_reference_from_torch_matches_numpy():
    p = ref.random_problem(9, 24, 64, 16, seed=11, out_dtype="fp16")
    y = ref.reference_from_torch(**p)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float64 and y.device.type == "cpu"
    yn = ref.reference_gemm_w4a4(
        p["act"].numpy(), p["wgt"].numpy(),
        p["ascales"].view(torch.uint8).numpy(), p["wscales"].view(torch.uint8).numpy(),
        lora_act_in=p["lora_act_in"].double().numpy(), lora_up=p["lora_up"].double().numpy(),
        wcscale=p["wcscale"].double().numpy(), bias=p["bias"].double().numpy())
    np.testing.assert_array_equal(y.numpy(), yn)
    # blocked scales passed as torch float8 1-D
    asb = torch.from_numpy(ref.to_blocked(p["ascales"].view(torch.uint8).numpy())).view(torch.float8_e4m3fn)
    y2 = ref.reference_from_torch(**{**p, "ascales": asb})
    assert torch.equal(y, y2)


@needs_torch
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_random_problem_contents(out_dtype):
    M, N, K, R = 77, 64, 128, 32
    p = ref.random_problem(M, N, K, R, seed=7, out_dtype=out_dtype)
    tdt = torch.bfloat16 if out_dtype == "bf16" else torch.float16
    assert p["act"].dtype == torch.uint8 and p["act"].shape == (M, K // 2)
    assert p["wgt"].dtype == torch.uint8 and p["wgt"].shape == (N, K // 2)
    assert p["ascales"].dtype == torch.float8_e4m3fn and p["ascales"].shape == (M, K // 16)
    assert p["wscales"].dtype == torch.float8_e4m3fn and p["wscales"].shape == (N, K // 16)
    assert p["lora_act_in"].dtype == tdt and p["lora_act_in"].shape == (M, R)
    assert p["lora_up"].dtype == tdt and p["lora_up"].shape == (N, R)
    assert p["wcscale"].dtype == torch.float32 and p["wcscale"].shape == (N,)
    assert p["bias"].dtype == torch.float32 and p["bias"].shape == (N,)
    codes = ref.unpack_nibbles(p["act"].numpy())
    assert set(np.unique(codes).tolist()) == set(range(16))
    assert (codes != 0).any(axis=1).all()
    sc = ref.decode_e4m3(p["ascales"].view(torch.uint8).numpy())
    assert np.isfinite(sc).all() and (sc > 0).all()
    assert np.log2(sc.max() / sc.min()) >= 2.0          # spread over binades
    wc = p["wcscale"].numpy()
    assert (wc >= 0.5).all() and (wc <= 2.0).all() and (np.abs(wc - 1) >= 0.25).all()
    assert wc.std() > 0.2
    # deterministic
    q = ref.random_problem(M, N, K, R, seed=7, out_dtype=out_dtype)
    assert all(torch.equal(p[k].view(torch.uint8) if p[k].dtype == torch.float8_e4m3fn else p[k],
                           q[k].view(torch.uint8) if q[k].dtype == torch.float8_e4m3fn else q[k]) for k in p)
    y = ref.reference_from_torch(**p)
    rms = float(y.pow(2).mean().sqrt())
    assert 1.0 < rms < 10.0 and float(y.abs().max()) < 200.0


@needs_torch
@pytest.mark.parametrize("M", [1, 77])
@pytest.mark.parametrize("N,K,R", [(64, 16, 16), (128, 256, 32), (96, 3072, 48)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_term_sensitivity(M, N, K, R, seed):
    p = ref.random_problem(M, N, K, R, seed=seed)
    s = ref.term_sensitivity(p)
    assert set(s) == {"main", "lora", "wcscale", "bias"}
    for term, v in s.items():
        assert v >= 0.1, (term, v)


@needs_torch
def test_term_flags():
    p = ref.random_problem(4, 32, 32, 0, seed=0, wcscale=False, bias=False)
    assert p["wcscale"] is None and p["bias"] is None and p["lora_act_in"] is None
    assert set(ref.term_sensitivity(p)) == {"main"}
    # flags do not change the other tensors
    q = ref.random_problem(4, 32, 32, 0, seed=0)
    assert torch.equal(p["act"], q["act"]) and torch.equal(p["wgt"], q["wgt"])


def test_torch_f64_reference_matches_numpy_reference():
    torch = pytest.importorskip("torch")
    from svdq_loader.testing.reference import random_problem, reference_from_torch, reference_torch_f64
    for m, r, wc, b in [(1, 0, False, False), (77, 32, True, True), (33, 16, True, False)]:
        p = random_problem(m, 64, 256, r, seed=m + r, wcscale=wc, bias=b)
        a = reference_from_torch(**p)
        g = reference_torch_f64(**p)
        assert g.dtype == torch.float64
        assert torch.allclose(a, g, rtol=1e-12, atol=1e-12)

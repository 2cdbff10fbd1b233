"""The exact rules of the quantize_act reference (loader/testing/quantize_ref.py), on the CPU."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from svdq_loader.testing import quantize_ref as qr
from svdq_loader.testing.reference import decode_e4m3, from_blocked, to_blocked


def _codes(act):
    out = np.empty((act.shape[0], act.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = act & 0xF
    out[:, 1::2] = act >> 4
    return out


def _group(vals, fill=0.0):
    g = np.full(16, fill, dtype=np.float32)
    g[: len(vals)] = vals
    return g


def _q(rows, **kw):
    x = np.stack([np.asarray(r, dtype=np.float32) for r in rows])
    return qr.quantize_act_ref(x, **kw)


# ---------------------------------------------------------------------------
# E2M1: every tie, saturation, sign
# ---------------------------------------------------------------------------

def test_every_e2m1_tie_and_grid_point():
    # amax 6 -> sc = 1 -> scale byte 0x38 (1.0): q = x̂ exactly
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, 0.1875]
    act, sc, _ = _q([vals])
    assert sc[0, 0] == 0x38
    want = [7, 0, 2, 2, 4, 4, 6, 6, 1, 2, 3, 4, 5, 6, 0, 0]
    assert _codes(act)[0].tolist() == want


def test_just_off_ties():
    vals = [6.0, 0.25 + 2**-9, 0.75 - 2**-8, 1.25 + 2**-7, 1.75 - 2**-7, 2.5 + 2**-6, 3.5 - 2**-6, 5.0 + 2**-5]
    act, _, _ = _q([_group(vals)])
    assert _codes(act)[0, :8].tolist() == [7, 1, 1, 3, 3, 5, 5, 7]


def test_sign_bit_is_the_sign_of_x_hat():
    vals = [-6.0, -0.125, -0.0, 0.0, -0.25, -0.75, 1.0, -1.0]
    act, _, _ = _q([_group(vals)])
    assert _codes(act)[0, :8].tolist() == [15, 8, 8, 0, 8, 10, 2, 10]


def test_saturation_at_6_when_the_scale_rounds_down():
    # amax 6.25 -> sc 1.0417 -> E4M3 1.0 (grid 1.0, 1.125) -> q = 6.25 > 6 -> code 7
    act, sc, _ = _q([_group([6.25, -6.125, 4.75])])
    assert decode_e4m3(sc)[0, 0] == 1.0
    assert _codes(act)[0, :3].tolist() == [7, 15, 6]


def test_scale_saturates_at_448():
    act, sc, _ = _q([_group([3008.0, 2304.0, 448.0 * 2.5, 2000.0])])
    assert sc[0, 0] == 0x7E and decode_e4m3(sc)[0, 0] == 448.0
    assert _codes(act)[0, :4].tolist() == [7, 7, 4, 6]


def test_packing_low_nibble_even_k():
    act, _, _ = _q([_group([6.0, 1.0])])
    assert act[0, 0] == (7 | (2 << 4))


# ---------------------------------------------------------------------------
# zero / subnormal scales
# ---------------------------------------------------------------------------

def test_zero_group():
    act, sc, _ = _q([np.zeros(16, np.float32)])
    assert sc[0, 0] == 0 and (act == 0).all()


def test_scale_rounding_to_zero_gives_zero_codes():
    # amax/6 = 2^-10 exactly: a tie between 0 and 2^-9 -> 0 (even); negatives too get code 0
    a = 6.0 * 2**-10
    act, sc, _ = _q([_group([a, -a, a / 2])])
    assert sc[0, 0] == 0 and (act == 0).all()
    act, sc, _ = _q([_group([2**-20, -(2**-30)])])
    assert sc[0, 0] == 0 and (act == 0).all()


def test_subnormal_scale_groups():
    # amax/6 just above 2^-10 -> 2^-9 (0x01): q = amax / 2^-9 ~ 3.03 -> code 5
    a = float(qr.round_to_bf16(np.float32(6.0 * 2**-10 * 1.02)))
    act, sc, _ = _q([_group([a, -a / 2])])
    assert sc[0, 0] == 0x01
    assert _codes(act)[0, :2].tolist() == [5, 8 | 3]
    # 3 * 2^-9 (0x03): amax = 6 * 3 * 2^-9
    a = 18 * 2**-9
    act, sc, _ = _q([_group([a, 3 * 2**-9 * 0.25, 3 * 2**-9 * 0.75])])
    assert sc[0, 0] == 0x03
    assert _codes(act)[0, :3].tolist() == [7, 0, 2]


def test_e4m3_rne():
    b = qr.e4m3_rne_satfinite(np.array([2**-10, 3 * 2**-10, 1.0625, 1.0625 + 2**-20, 464.0, 1e30, np.nan],
                                       dtype=np.float32))
    assert b.tolist() == [0x00, 0x02, 0x38, 0x39, 0x7E, 0x7E, 0x7F]


# ---------------------------------------------------------------------------
# non-finite policy
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_group(bad):
    x = np.zeros((1, 32), np.float32)
    x[0, :16] = qr.round_to_bf16(np.linspace(-3, 3, 16).astype(np.float32))
    x[0, 5] = bad
    x[0, 16:] = qr.round_to_bf16(np.linspace(-1, 1, 16).astype(np.float32))
    act, sc, _ = qr.quantize_act_ref(x)
    assert sc[0, 0] == 0x7F
    assert (_codes(act)[0, :16] == 0).all()
    ref_ok, sc_ok, _ = qr.quantize_act_ref(x[:, 16:].copy())     # the other group is untouched
    assert sc[0, 1] == sc_ok[0, 0] and (act[0, 8:] == ref_ok[0]).all()


def test_smooth_overflow_is_non_finite_fp16():
    x = np.full((1, 16), 60000.0, dtype=np.float16)
    smooth = np.full(16, 0.5, dtype=np.float16)
    _, sc, _ = qr.quantize_act_ref(x, smooth)
    assert sc[0, 0] == 0x7F


# ---------------------------------------------------------------------------
# smooth, LoRA, layouts
# ---------------------------------------------------------------------------

def test_smooth_rule_bf16_and_fp16():
    rng = np.random.default_rng(0)
    k = 64
    for dt in ("bf16", "fp16"):
        xs = rng.standard_normal((3, k)).astype(np.float32)
        sm = rng.uniform(0.1, 4.0, k).astype(np.float32)
        if dt == "fp16":
            xs, sm = xs.astype(np.float16), sm.astype(np.float16)
        else:
            xs, sm = qr.round_to_bf16(xs), qr.round_to_bf16(sm)
        xh = qr.smooth_input(xs, sm, dt)
        rs = (np.float32(1) / sm.astype(np.float32)).astype(np.float32)
        rs = rs.astype(np.float16).astype(np.float32) if dt == "fp16" else qr.round_to_bf16(rs)
        prod = (xs.astype(np.float32) * rs).astype(np.float32)     # exact: two 16-bit values, normal range
        want = prod.astype(np.float16).astype(np.float32) if dt == "fp16" else qr.round_to_bf16(prod)
        assert np.array_equal(xh, want)
        # rs is rounded to D: the fp32 reciprocal itself gives other x̂ for some k (so the rule is seen)
        rs32 = (np.float32(1) / sm.astype(np.float32)).astype(np.float32)
        p32 = (xs.astype(np.float32) * rs32).astype(np.float32)
        old = p32.astype(np.float16).astype(np.float32) if dt == "fp16" else qr.round_to_bf16(p32)
        assert not np.array_equal(xh, old)
        a1, s1, _ = qr.quantize_act_ref(xs, sm, dtype=dt)
        a2, s2, _ = qr.quantize_act_ref(want.astype(np.float16) if dt == "fp16" else want, dtype=dt)
        assert np.array_equal(a1, a2) and np.array_equal(s1, s2)


def _every_16bit(dt):
    """Every 16-bit pattern of dt as a torch tensor (CPU)."""
    import torch
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16 if dt == "bf16" else torch.float16)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_smooth_reciprocals_are_the_rule_for_every_16bit_value(dt):
    """The loader's smooth_reciprocals (torch) gives rule 1's rs = RN_D(RN32(1 / smooth)) for all 65,536 values
    (NaN for NaN), so quantize_act(smooth_rcp=smooth_reciprocals(s)) is quantize_act(smooth=s)."""
    import torch
    from svdq_loader.ops.quantize_act import smooth_reciprocals
    s = _every_16bit(dt)
    got = smooth_reciprocals(s)
    assert got.dtype == s.dtype and got.shape == s.shape
    sn = s.float().numpy() if dt == "bf16" else s.numpy()
    want = qr.smooth_reciprocals_ref(sn, dt)
    g32 = got.float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(g32), nan)
    assert np.array_equal(g32[~nan].view(np.uint32), want[~nan].view(np.uint32))    # bit for bit, signed zeros too
    # the range's ends: 1 / +-0 = +-inf, 1 / +-inf = +-0, and (fp16) reciprocals past fp16's range
    assert np.isinf(want[sn == 0]).all() and (want[np.isinf(sn)] == 0).all()


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_smooth_rcp_gives_the_smooth_result(dt):
    rng = np.random.default_rng(7)
    k = 128
    xs = rng.standard_normal((9, k)).astype(np.float32) * 3
    sm = rng.uniform(0.05, 8.0, k).astype(np.float32)
    ld = rng.standard_normal((k, 16)).astype(np.float32)
    if dt == "fp16":
        xs, sm, ld = xs.astype(np.float16), sm.astype(np.float16), ld.astype(np.float16)
    else:
        xs, sm, ld = qr.round_to_bf16(xs), qr.round_to_bf16(sm), qr.round_to_bf16(ld)
    rs = qr.smooth_reciprocals_ref(sm, dt)
    a1, s1, l1 = qr.quantize_act_ref(xs, sm, ld, dtype=dt)
    a2, s2, l2 = qr.quantize_act_ref(xs, None, ld, dtype=dt, smooth_rcp=rs.astype(np.float16) if dt == "fp16"
                                     else rs)
    assert np.array_equal(a1, a2) and np.array_equal(s1, s2) and np.array_equal(l1, l2)
    a0, s0, _ = qr.quantize_act_ref(xs, None, ld, dtype=dt)          # smoothing changes the result
    assert not np.array_equal(a0, a1)
    with pytest.raises(ValueError, match="smooth and smooth_rcp"):
        qr.quantize_act_ref(xs, sm, dtype=dt, smooth_rcp=rs)
    with pytest.raises(ValueError, match=r"smooth_rcp shape \(64,\)"):
        qr.quantize_act_ref(xs, dtype=dt, smooth_rcp=rs[:64])


def test_round_once_is_one_rounding():
    """round_once rounds a float64 once: no detour through float32 (which would round twice)."""
    for dt, ulp in (("bf16", 2.0**-7), ("fp16", 2.0**-10)):
        v = 1 + ulp / 2 + 2.0**-30          # float32 rounds it to the midpoint 1 + ulp / 2, then RNE gives 1
        assert qr.round_once(np.array([v, -v]), dt).tolist() == [1 + ulp, -(1 + ulp)]
        assert qr.round_once(np.array([1 + ulp / 2, 1 + 1.5 * ulp]), dt).tolist() == [1.0, 1 + 2 * ulp]
    # subnormals and overflow
    assert qr.round_once(np.array([2.0**-133 * 1.5, 2.0**-133 * 0.5, 2.0**-134 * 1.0000001]), "bf16").tolist() == \
        [2.0**-132, 0.0, 2.0**-133]
    assert qr.round_once(np.array([2.0**-24 * 2.5, 65519.9, 65520.0, -1e300, np.inf]), "fp16").tolist() == \
        [2.0**-23, 65504.0, np.inf, -np.inf, np.inf]
    assert qr.round_once(np.array([3.3961e38, 3.4e38]), "bf16").tolist() == [3.3895313892515355e38, np.inf]
    assert np.isnan(qr.round_once(np.array([np.nan]), "bf16")[0])
    assert str(qr.round_once(np.array([-0.0]), "fp16")[0]) == "-0.0"
    # against numpy's float64 -> float16 and against float32 -> bf16 where float32 holds the value exactly
    rng = np.random.default_rng(5)
    v = rng.standard_normal(20000) * np.exp2(rng.uniform(-30, 17, 20000))
    with np.errstate(over="ignore"):
        assert np.array_equal(qr.round_once(v, "fp16"), v.astype(np.float16).astype(np.float32))
    v32 = v.astype(np.float32)
    assert np.array_equal(qr.round_once(v32.astype(np.float64), "bf16"), qr.round_to_bf16(v32))


def test_lora_down_is_x_hat_times_lora_down():
    rng = np.random.default_rng(1)
    x = qr.round_to_bf16(rng.standard_normal((5, 128)).astype(np.float32))
    sm = qr.round_to_bf16(rng.uniform(0.5, 2, 128).astype(np.float32))
    ld = qr.round_to_bf16(rng.standard_normal((128, 32)).astype(np.float32))
    _, _, lora = qr.quantize_act_ref(x, sm, ld)
    assert lora.dtype == np.float64 and lora.shape == (5, 32)
    assert np.allclose(lora, qr.smooth_input(x, sm, "bf16").astype(np.float64) @ ld.astype(np.float64))
    assert qr.quantize_act_ref(x)[2] is None


@pytest.mark.parametrize("m", [1, 77, 128, 130])
def test_blocked_layout_and_padding(m):
    rng = np.random.default_rng(m)
    x = qr.round_to_bf16(rng.standard_normal((m, 128)).astype(np.float32) * 3)
    _, lg, _ = qr.quantize_act_ref(x, scale_layout="logical")
    _, bl, _ = qr.quantize_act_ref(x, scale_layout="blocked")
    assert bl.shape == (-(-m // 128), 2, 32, 4, 4)
    assert np.array_equal(bl.reshape(-1), to_blocked(lg))
    assert np.array_equal(from_blocked(bl.reshape(-1), m, 8), lg)
    pad = np.zeros(bl.shape[0] * 128, bool)
    pad[m:] = True
    full = bl.reshape(-1, 2, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1, 8)    # back to [rows_padded, G]
    assert (full[pad] == 0).all()


def test_rejects_non_bf16_values():
    with pytest.raises(ValueError):
        qr.quantize_act_ref(np.full((1, 16), 1.0 + 2**-12, np.float32))


# ---------------------------------------------------------------------------
# the kernel's division-free code rule == E2M1(RN32(x̂ / s))
# ---------------------------------------------------------------------------

def test_threshold_rule_equals_fp32_division():
    rng = np.random.default_rng(7)
    svals = decode_e4m3(np.arange(1, 0x7F, dtype=np.uint8)).astype(np.float32)
    for s in svals:
        # random fp32 x̂ around every threshold: t*s times (1 + a few ulps), plus exact ties
        base = np.array([t for t, _ in qr.THRESHOLDS] + [6.0, 0.1, 7.5], np.float32) * s
        ulps = rng.integers(-3, 4, size=(base.size, 8)).astype(np.int64)
        xb = (base.view(np.int32)[:, None].astype(np.int64) + ulps).astype(np.int32).view(np.float32).ravel()
        xr = (rng.uniform(0, 8, 64).astype(np.float32) * s).astype(np.float32)
        xh = np.concatenate([xb, xr, base])
        by_div = qr.e2m1_code((xh / s).astype(np.float32))
        by_cmp = np.zeros(xh.shape, np.uint8)
        for t, up in qr.THRESHOLDS:
            T = np.float32(t) * s
            by_cmp += (xh >= T) if up else (xh > T)
        assert np.array_equal(by_div, by_cmp), f"s={s}"


# ---------------------------------------------------------------------------
# an independent slow implementation (Python floats, per element)
# ---------------------------------------------------------------------------

def _r32(v: float) -> float:
    """float64 -> nearest float32 (RNE), overflow to inf."""
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _rbf16(v: float) -> float:
    u = struct.unpack("<I", struct.pack("<f", v))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


def _rf16(v: float) -> float:
    try:
        return struct.unpack("<e", struct.pack("<e", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


_E4M3 = [float(v) for v in decode_e4m3(np.arange(0x7F, dtype=np.uint8))]


def _slow_e4m3(sc: float) -> int:
    if sc >= 448.0:
        return 0x7E
    best = None
    for i, v in enumerate(_E4M3):
        d = abs(v - sc)
        if best is None or d < best[0] or (d == best[0] and i % 2 == 0):
            best = (d, i)
    return best[1]


def _slow_e2m1(q: float) -> int:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    a = abs(q)
    if a >= 6.0:
        return 7
    best = None
    for i, v in enumerate(grid):
        d = abs(v - a)
        if best is None or d < best[0] or (d == best[0] and i % 2 == 0):
            best = (d, i)
    return best[1]


def _slow(x, smooth, dt):
    rnd = _rbf16 if dt == "bf16" else _rf16
    m, k = len(x), len(x[0])
    act = [[0] * (k // 2) for _ in range(m)]
    sc = [[0] * (k // 16) for _ in range(m)]
    for r in range(m):
        xh = []
        for c in range(k):
            v = float(x[r][c])
            if smooth is not None:
                rs = rnd(_r32(1.0 / float(smooth[c])))
                v = rnd(v * rs)             # the float64 product of two 16-bit values is exact
            xh.append(v)
        for g in range(k // 16):
            grp = xh[16 * g: 16 * g + 16]
            amax = max(abs(v) for v in grp)
            b = _slow_e4m3(_r32(amax / 6.0))
            s = _E4M3[b]
            codes = []
            for v in grp:
                if s == 0:
                    codes.append(0)
                else:
                    codes.append(_slow_e2m1(_r32(v / s)) | (8 if math.copysign(1.0, v) < 0 else 0))
            sc[r][g] = b
            for j in range(8):
                act[r][8 * g + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return np.array(act, np.uint8), np.array(sc, np.uint8)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("use_smooth", [False, True])
def test_matches_slow_python_implementation(dt, use_smooth):
    rng = np.random.default_rng(11 + use_smooth + 2 * (dt == "fp16"))
    m, k = 6, 128
    # rows with several magnitudes per group (incl. tiny and subnormal-scale groups)
    mag = np.exp2(rng.uniform(-14, 6, size=(m, k // 16, 1)))
    x = (rng.standard_normal((m, k // 16, 16)) * mag).reshape(m, k).astype(np.float32)
    x[0, :16] = 0.0
    sm = rng.uniform(0.25, 4.0, k).astype(np.float32) if use_smooth else None
    if dt == "fp16":
        x = x.astype(np.float16)
        sm = None if sm is None else sm.astype(np.float16)
    else:
        x = qr.round_to_bf16(x)
        sm = None if sm is None else qr.round_to_bf16(sm)
    act, sc, _ = qr.quantize_act_ref(x, sm, dtype=dt)
    want_act, want_sc = _slow(x.tolist(), None if sm is None else sm.tolist(), dt)
    assert np.array_equal(sc, want_sc)
    assert np.array_equal(act, want_act)


def test_torch_wrapper_matches_numpy():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    sm = (torch.rand(64, generator=g) + 0.5).to(torch.bfloat16)
    ld = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    a, s, lo = qr.quantize_act_ref_torch(x, sm, ld, "blocked")
    a2, s2, lo2 = qr.quantize_act_ref(x.float().numpy(), sm.float().numpy(), ld.float().numpy(), "blocked")
    assert np.array_equal(a.numpy(), a2) and np.array_equal(s.numpy(), s2)
    assert np.allclose(lo.numpy(), lo2)
    xf = x.to(torch.float16)
    a3, s3, _ = qr.quantize_act_ref_torch(xf)
    a4, s4, _ = qr.quantize_act_ref(xf.numpy())
    assert np.array_equal(a3.numpy(), a4) and np.array_equal(s3.numpy(), s4)


# ---------------------------------------------------------------------------
# the kernel's division-free amax / 6 and 1 / smooth (inputs are 16-bit values)
# ---------------------------------------------------------------------------

def _sixteen_bit_values(step):
    bf = [np.array(u << 16, np.uint32).view(np.float32).item() for u in range(1, 0x7F80, step)]
    hf = [float(np.array(u, np.uint16).view(np.float16)) for u in range(1, 0x7C00, step)]
    return bf + hf + [65504.0, 2.0**-24, 2.0**-133, 3.3895313892515355e38]


def _rn64(fr):
    return float(fr)                       # Fraction -> float is correctly rounded


def test_kernel_div6_is_ieee_division():
    from fractions import Fraction as Fr
    y = Fr(float(np.float32(1) / np.float32(6)))
    for a in _sixteen_bit_values(37):
        A = Fr(a)
        q0 = Fr(float(np.float32(_rn64(A * y))))
        r = Fr(float(np.float32(_rn64(A - 6 * q0))))
        q = np.float32(_rn64(q0 + r * y))
        assert q == np.float32(a) / np.float32(6), a


def test_kernel_reciprocal_is_ieee_division():
    from fractions import Fraction as Fr
    for a in _sixteen_bit_values(37):
        d = Fr(a)
        for delta in (2.0**-20, -(2.0**-20)):          # rcp.approx.f64 start error (bound assumed <= 2^-20)
            y = _rn64(1 / d * (1 + Fr(delta)))
            for _ in range(2):
                e = _rn64(1 - d * Fr(y))
                y = _rn64(Fr(y) + Fr(e) * Fr(y))
            with np.errstate(over="ignore"):
                assert np.float32(y) == np.float32(1) / np.float32(a), a

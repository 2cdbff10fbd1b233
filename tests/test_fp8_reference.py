"""The FP8-compute mode's reference (svdq_loader.testing.fp8_reference).  CPU only.

Expected values come from code written here: Python's math (frexp / ldexp), torch's own float8_e4m3fn cast (an
independent E4M3 rounding) and hand-worked cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

from svdq_loader.testing import fp8_reference as f8
from svdq_loader.testing import reference as ref

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def _spec_pow2_floor(x: float) -> float:
    e = math.floor(math.log2(x))
    while 2.0 ** e > x:
        e -= 1
    while 2.0 ** (e + 1) <= x:
        e += 1
    return 2.0 ** e


def test_pow2_floor_matches_math_and_rejects_bad_input():
    rng = np.random.default_rng(1)
    xs = np.concatenate([np.exp2(rng.uniform(-40, 40, 500)), np.exp2(np.arange(-30, 30, dtype=np.float64)),
                         np.nextafter(np.exp2(np.arange(-30, 30, dtype=np.float64)), 0)])
    got = f8.pow2_floor(xs)
    assert [float(g) for g in got] == [_spec_pow2_floor(float(x)) for x in xs]
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError):
            f8.pow2_floor(np.array([1.0, bad]))


def test_row_pow2_puts_each_bound_in_the_top_binade():
    rng = np.random.default_rng(2)
    b = np.exp2(rng.uniform(-14, 12, 200))
    b[:6] = [0.0, 448.0, 2688.0, 224.0, 448.0 * 1.0000001, 6 * 2.0 ** -9]
    r = f8.row_pow2(b)
    assert list(r[:6]) == [1.0, 1.0, 0.125, 2.0, 0.5, 2.0 ** 15]
    top = b[1:] * r[1:]
    assert np.all(top <= 448.0) and np.all(top > 224.0)
    assert np.all(np.frexp(r)[0] == 0.5)       # powers of two
    for bad in (-1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="negative, inf or NaN"):
            f8.row_pow2(np.array([1.0, bad]))


def test_scale_pow2_reads_the_largest_block_scale_only():
    """r comes from 6 x the row's largest E4M3 scale (worked by hand), never from the codes."""
    sc = np.array([[0x38, 0x30, 0x00],          # scales 1, 0.5, 0: bound 6 -> r = 64 (6 · 64 = 384)
                   [0x7E, 0x01, 0x00],          # 448: bound 2688 -> r = 1/8
                   [0x00, 0x00, 0x00],          # no scale: r = 1
                   [0x01, 0x00, 0x01]],         # 2^-9: bound 6 · 2^-9 -> r = 2^15 (bound · r = 384)
                  dtype=np.uint8)
    assert list(f8.scale_pow2(sc)) == [64.0, 0.125, 1.0, 2.0 ** 15]
    with pytest.raises(ValueError, match="NaN"):
        f8.scale_pow2(np.array([[0x38, 0x7F]], dtype=np.uint8))


def test_the_bound_is_the_row_max_for_quantized_rows():
    """For NVFP4-quantized data with E4M3-normal scales the block with the largest scale holds a ±6, so r puts the
    row's largest |A| itself in E4M3's top binade."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((50, 256)) * np.exp2(rng.uniform(-3, 6, (50, 1)))
    packed, sc = ref.quantize_nvfp4(x)
    vals = ref.dequantize_nvfp4(packed, sc)
    r = f8.scale_pow2(sc)
    top = np.abs(vals).max(axis=1) * r
    assert np.all(top <= 448.0) and np.all(top > 224.0)


@needs_torch
def test_fp8_operand_is_one_rounding_of_the_exact_value():
    """a8 = e4m3(A · ra): checked against torch's own E4M3 cast of the exact float64 product."""
    p = ref.random_problem(33, 40, 256, 0, seed=3)
    act = p["act"].numpy()
    asc = p["ascales"].view(torch.uint8).numpy()
    a8, ra = f8.fp8_operand(act, asc)
    exact = ref.dequantize_nvfp4(act, asc) * ra[:, None]
    want = torch.from_numpy(exact).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    # torch rounds ±0 results with their sign; so does the reference
    assert a8.dtype == np.uint8 and a8.shape == (33, 256)
    np.testing.assert_array_equal(a8, want)
    # the operand's relative error is that of one E4M3 rounding (≤ 2^-4) wherever the value is E4M3-normal
    dec = ref.decode_e4m3(a8)
    normal = np.abs(exact) >= 2.0 ** -6
    assert np.all(np.abs(dec - exact)[normal] <= 2.0 ** -4 * np.abs(exact)[normal])
    assert np.abs(dec - exact).max() > 0       # the random scales do need rounding: the test can see it


@needs_torch
def test_power_of_two_scales_make_the_mode_exact():
    """With power-of-two block scales spanning under 14 binades, every A·ra and W·rw is an E4M3 value: the mode
    equals the exact operator bit for bit (the K-sums are exact in float64)."""
    rng = np.random.default_rng(4)
    m, n, k = 24, 32, 128
    p = ref.random_problem(m, n, k, 16, seed=4)
    act, wgt = p["act"].numpy(), p["wgt"].numpy()
    asc = ref.encode_e4m3(np.exp2(rng.integers(-5, 3, (m, k // 16)).astype(np.float64)))
    wsc = ref.encode_e4m3(np.exp2(rng.integers(-5, 3, (n, k // 16)).astype(np.float64)))
    kw = dict(lora_act_in=p["lora_act_in"].float().numpy(), lora_up=p["lora_up"].float().numpy(),
              wcscale=p["wcscale"].numpy(), bias=p["bias"].numpy())
    exact = ref.reference_gemm_w4a4(act, wgt, asc, wsc, **kw)
    np.testing.assert_array_equal(f8.reference_gemm_w4a4_fp8(act, wgt, asc, wsc, **kw), exact)


@needs_torch
def test_mode_against_an_independent_torch_computation():
    """The whole formula, recomputed with torch (its E4M3 cast, float64 matmul) from the exact operand values."""
    p = ref.random_problem(40, 48, 512, 32, seed=5)
    act, wgt = p["act"].numpy(), p["wgt"].numpy()
    asc, wsc = p["ascales"].view(torch.uint8).numpy(), p["wscales"].view(torch.uint8).numpy()
    kw = dict(lora_act_in=p["lora_act_in"].float().numpy(), lora_up=p["lora_up"].float().numpy(),
              wcscale=p["wcscale"].numpy(), bias=p["bias"].numpy())
    got = f8.reference_gemm_w4a4_fp8(act, wgt, asc, wsc, **kw)

    def side(packed, sc):
        v = torch.from_numpy(ref.dequantize_nvfp4(packed, sc))
        amax = v.abs().amax(dim=1)
        r = torch.tensor([_spec_pow2_floor(448.0 / float(a)) for a in amax], dtype=torch.float64)
        return (v * r[:, None]).to(torch.float8_e4m3fn).to(torch.float64), r

    a8, ra = side(act, asc)
    w8, rw = side(wgt, wsc)
    want = (a8 @ w8.T) / (ra[:, None] * rw[None, :]) * torch.from_numpy(kw["wcscale"]).double()
    want = want + torch.from_numpy(kw["bias"]).double() + (p["lora_act_in"].double() @ p["lora_up"].double().T)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-12 * float(want.abs().max()))
    # LoRA, wcscale and bias are the exact operator's: the modes differ only by the main product times wcscale
    exact = ref.reference_gemm_w4a4(act, wgt, asc, wsc, **kw)
    main_diff = (f8.reference_gemm_w4a4_fp8(act, wgt, asc, wsc) - ref.reference_gemm_w4a4(act, wgt, asc, wsc))
    np.testing.assert_allclose(got - exact, main_diff * kw["wcscale"][None, :], rtol=0, atol=1e-12)


@needs_torch
def test_distance_is_one_e4m3_rounding_per_operand():
    """On random operands the mode sits about 2^-5 (E4M3's mean relative rounding, per operand) from the exact
    operator: between 0.5 % and 5 %, and it is not 0 (the test sees the rounding)."""
    p = ref.random_problem(64, 64, 1024, 0, seed=6)
    d = f8.fp8_distance(p["act"].numpy(), p["wgt"].numpy(), p["ascales"].view(torch.uint8).numpy(),
                        p["wscales"].view(torch.uint8).numpy())
    assert 0.005 < d < 0.05


def test_shape_and_dtype_errors():
    a = np.zeros((2, 8), np.uint8)
    s = np.zeros((2, 1), np.uint8)
    with pytest.raises(TypeError):
        f8.fp8_operands(a.astype(np.int32), s, a, s)
    with pytest.raises(ValueError, match="K mismatch"):
        f8.fp8_operands(a, s, np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="together"):
        f8.reference_gemm_w4a4_fp8(a, a, s, s, lora_act_in=np.zeros((2, 16)))
    with pytest.raises(ValueError, match="all zeros"):
        f8.fp8_distance(a, a, s, s)


@needs_torch
def test_distance_tool_measures_the_three_distances(tmp_path):
    """tools/fp8_distance.py on a small layer: the mode adds its rounding to the quantization error, and its whole
    run over a config writes a row per shape."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "tools" / "fp8_distance.py"
    spec = importlib.util.spec_from_file_location("fp8_distance_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    d = tool.measure(32, 512, 64, 8, 0)["residual"]
    assert 0.05 < d["exact_vs_math"] < 0.2            # 4-bit quantization
    assert 0.01 < d["fp8_vs_exact"] < 0.06            # two E4M3 roundings
    assert d["exact_vs_math"] < d["fp8_vs_math"] < d["exact_vs_math"] + d["fp8_vs_exact"]
    cfg = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    out = tmp_path / "d.json"
    assert tool.main(["--config", str(cfg), "--m", "16", "--rank", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["k"], r["n"]) for r in rows] == [("square", 256, 256), ("wide", 128, 512)]
    assert rows[0]["linear"]["fp8_vs_exact"] > 0


def test_act_fp8_workspace_reference_matches_the_documented_offsets():
    """The pre-pass's reference workspace: every element where `act_fp8.image_offset` puts it (checked element by
    element with Python ints), 1 / ra as float32 first, the pad rows zero with 1 / ra = 1."""
    from svdq_loader.ops import act_fp8
    from svdq_loader.ops.decode_act import image_rows
    rng = np.random.default_rng(9)
    m, k = 70, 512
    act = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    asc = rng.integers(0, 0x7F, (m, k // 16), dtype=np.uint8)
    asc[3] = 0                                          # a row of zero scales: ra = 1
    ws = f8.reference_act_fp8_workspace(act, asc)
    mp = image_rows(m)
    assert ws.size == act_fp8.workspace_bytes(m, k) == 4 * mp + k * mp
    a8, ra = f8.fp8_operand(act, asc)
    ira = ws[: 4 * mp].view(np.float32)
    np.testing.assert_array_equal(ira[:m], (1.0 / ra).astype(np.float32))
    assert (ira[m:] == 1.0).all() and ira[3] == 1.0
    for r in (0, 5, 69):
        for kk in (0, 17, 130, 511):
            t, rem = divmod(kk, 128)
            c, e = divmod(rem, 16)
            off = 4 * mp + ((t * mp + r) * 8 + (c ^ (r % 8))) * 16 + e
            assert off == act_fp8.image_offset(m, r, kk)
            assert ws[off] == a8[r, kk]
    pad = [act_fp8.image_offset(m, r, kk) for r in range(m, mp) for kk in range(0, k, 37)]
    assert (ws[pad] == 0).all()


@needs_torch
def test_the_torch_reference_agrees_with_the_numpy_one():
    p = ref.random_problem(37, 64, 384, 16, seed=11)
    asc, wsc = p["ascales"].view(torch.uint8), p["wscales"].view(torch.uint8)
    asc[5] = 0                                                     # a row of zero scales
    want = f8.reference_gemm_w4a4_fp8(p["act"].numpy(), p["wgt"].numpy(), asc.numpy(), wsc.numpy(),
                                      lora_act_in=p["lora_act_in"].double().numpy(),
                                      lora_up=p["lora_up"].double().numpy(), wcscale=p["wcscale"].numpy(),
                                      bias=p["bias"].numpy())
    got = f8.reference_torch_f64_fp8(p["act"], p["wgt"], p["ascales"], p["wscales"], lora_act_in=p["lora_act_in"],
                                     lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12 * np.abs(want).max())

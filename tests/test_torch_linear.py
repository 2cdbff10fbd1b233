"""W4A4Linear construction on the CPU: SVD branch, smoothing, wcscale, reference math, state dict, errors.

Every number is checked against an independent float64 computation (numpy SVD,
the numpy NVFP4 quantizer of `svdq_loader.testing.reference`).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402
from svdq_loader.torch import STATE_NAMES, W4A4Linear, quantize_linear  # noqa: E402
from svdq_loader.torch.recipe import smooth_factor  # noqa: E402

SEED = int(os.environ.get("SVDQ_SEED", int.from_bytes(os.urandom(3), "little")))


def planted_linear(n, k, *, seed, dtype=torch.bfloat16, rank=8, outlier_cols=()):
    """A linear whose weight is a strong rank-`rank` part plus noise (and a few outlier input channels)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, rank, generator=g) @ torch.randn(rank, k, generator=g)) / rank ** 0.5
    w = w + 0.05 * torch.randn(n, k, generator=g)
    for c in outlier_cols:
        w[:, c] *= 8.0
    lin = torch.nn.Linear(k, n).to(dtype).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(w.to(dtype))
        lin.bias.copy_(torch.randn(n, generator=g).to(dtype))
    return lin


def acts(m, k, *, seed, dtype=torch.bfloat16, outlier_cols=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    for c in outlier_cols:
        x[:, c] *= 30.0
    return x.to(dtype)


def test_svd_branch_is_the_best_rank_r_approximation():
    lin = planted_linear(256, 192, seed=SEED, rank=40)
    q = quantize_linear(lin.weight, lin.bias, rank=32, svd="exact")
    w = lin.weight.double().numpy()
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    best = (u[:, :32] * s[:32]) @ vt[:32]
    got = q.lora_up.double().numpy() @ q.lora_down.double().numpy().T
    assert q.lora_up.shape == (256, 32) and q.lora_down.shape == (192, 32)
    assert q.lora_up.dtype == torch.bfloat16 == q.lora_down.dtype
    # bf16 rounding of the two factors only (2^-8 relative each), seed printed on failure
    assert np.linalg.norm(got - best) / np.linalg.norm(best) < 1.5e-2, SEED
    # the residual the NVFP4 weight holds is W - up·downᵀ (with the rounded factors)
    res = w - got
    deq = ref.dequantize_nvfp4(q.qweight.numpy(), q.wscales.view(torch.uint8).numpy()) * q.wcscale.double().numpy()[:, None]
    assert np.linalg.norm(deq - res) / np.linalg.norm(res) < 0.2, SEED
    # the dropped singular values are what remains
    tail = np.sqrt((s[32:] ** 2).sum())
    assert abs(np.linalg.norm(res) - tail) / tail < 0.05, SEED


def test_lowrank_svd_is_close_to_exact_on_a_planted_spectrum():
    lin = planted_linear(256, 256, seed=SEED + 1, rank=16)
    ex = quantize_linear(lin.weight, None, rank=16, svd="exact")
    lr = quantize_linear(lin.weight, None, rank=16, svd="lowrank")
    a = ex.lora_up.double() @ ex.lora_down.double().T
    b = lr.lora_up.double() @ lr.lora_down.double().T
    assert float((a - b).norm() / a.norm()) < 2e-2, SEED


def test_wcscale_makes_every_row_use_the_largest_e4m3_scale():
    lin = planted_linear(128, 256, seed=SEED + 2)
    q = quantize_linear(lin.weight, lin.bias, rank=16)
    res = lin.weight.double() - q.lora_up.double() @ q.lora_down.double().T
    want = res.abs().amax(dim=1) / (6 * 448)
    assert torch.allclose(q.wcscale.double(), want, rtol=1e-6), SEED
    s = q.wscales.float()
    assert float(s.max()) <= 448.0
    assert torch.equal(s.amax(dim=1), torch.full((128,), 448.0)), SEED
    # codes and scales: the numpy float64 quantizer on res / wcscale agrees on all but rare ties
    codes, sb = ref.quantize_nvfp4((res / q.wcscale.double()[:, None]).numpy())
    assert (sb == q.wscales.view(torch.uint8).numpy()).mean() > 0.999
    assert (codes == q.qweight.numpy()).mean() > 0.999
    assert torch.equal(q.bias, lin.bias.float())


def test_smoothing_factor_and_invariance():
    cols = (3, 77)
    lin = planted_linear(128, 192, seed=SEED + 3, outlier_cols=(5,))
    x = acts(64, 192, seed=SEED + 4, outlier_cols=cols)
    amax = x.abs().amax(dim=0).float()
    s = smooth_factor(lin.weight, amax, alpha=0.5, dtype=torch.bfloat16)
    want = (amax.double() ** 0.5) / (lin.weight.double().abs().amax(dim=0) ** 0.5)
    assert s.dtype == torch.bfloat16
    assert torch.allclose(s.double(), want, rtol=2 ** -7), SEED            # one bf16 rounding
    layer = W4A4Linear.from_linear(lin, rank=32, act_amax=amax)
    assert torch.equal(layer.smooth, s)
    # the smoothed weight is what the layer factorises: up·downᵀ + dequant(res) ≈ W·diag(s)
    ws = lin.weight.double() * s.double()[None, :]
    deq = ref.dequantize_nvfp4(layer.qweight.numpy(), layer.wscales.view(torch.uint8).numpy()) \
        * layer.wcscale.double().numpy()[:, None]
    recon = layer.lora_up.double().numpy() @ layer.lora_down.double().numpy().T + deq
    assert np.linalg.norm(recon - ws.numpy()) / np.linalg.norm(ws.numpy()) < 0.1, SEED
    # with activation outliers, smoothing lowers the error of the quantized weight against the float64 linear: at
    # rank 0, where the 4-bit weight carries it all, to 0.45x or less on 300 random seeds (at rank 32 the SVD branch
    # absorbs most of this low-rank weight, and smoothing's gain there is within the seeds' spread: 10 of 300 lose)
    y = x.double() @ lin.weight.double().T + lin.bias.double()
    smoothed = W4A4Linear.from_linear(lin, rank=0, act_amax=amax)
    plain = W4A4Linear.from_linear(lin, rank=0)
    e_s = float((smoothed.reference(x) - y).norm() / y.norm())
    e_p = float((plain.reference(x) - y).norm() / y.norm())
    assert e_s < 0.6 * e_p, (e_s, e_p, SEED)


def test_svd_branch_lowers_the_error_of_a_low_rank_weight():
    lin = planted_linear(256, 256, seed=SEED + 5, rank=16)
    x = acts(32, 256, seed=SEED + 6)
    y = x.double() @ lin.weight.double().T + lin.bias.double()
    errs = {r: float((W4A4Linear.from_linear(lin, rank=r).reference(x) - y).norm() / y.norm()) for r in (0, 32)}
    assert errs[32] < 0.5 * errs[0], (errs, SEED)
    assert errs[0] < 0.2, (errs, SEED)              # plain NVFP4 of a gaussian-ish weight


def test_reference_is_the_quantized_math_in_float64():
    lin = planted_linear(128, 128, seed=SEED + 7)
    x = acts(37, 128, seed=SEED + 8, outlier_cols=(9,))
    layer = W4A4Linear.from_linear(lin, rank=16, act_amax=x.abs().amax(dim=0).float())
    # independent: x̂ = x times the bf16 reciprocal of smooth, the product (exact in float64) rounded to bf16,
    # numpy NVFP4 quantizer, dequantize, float64 products
    rs = (1.0 / layer.smooth.float()).to(torch.bfloat16)
    xh = (x.double() * rs.double()).to(torch.bfloat16)
    a_codes, a_sc = ref.quantize_nvfp4(xh.double().numpy())
    a = ref.dequantize_nvfp4(a_codes, a_sc)
    w = ref.dequantize_nvfp4(layer.qweight.numpy(), layer.wscales.view(torch.uint8).numpy())
    xd = xh.double().numpy()
    y = (a @ w.T) * layer.wcscale.double().numpy() + layer.bias.double().numpy() \
        + (xd @ layer.lora_down.double().numpy()) @ layer.lora_up.double().numpy().T
    got = layer.reference(x.reshape(1, 37, 128)).reshape(37, 128).numpy()
    assert np.allclose(got, y, rtol=1e-12, atol=1e-12), SEED


def test_dtype_casts_keep_the_format():
    layer = W4A4Linear.from_linear(planted_linear(128, 128, seed=SEED + 9), rank=16)
    wc = layer.wcscale.clone()
    layer.to(torch.float16)
    assert layer.qweight.dtype == torch.uint8 and layer.wscales.dtype == torch.float8_e4m3fn
    assert layer.wcscale.dtype == torch.float32 and layer.bias.dtype == torch.float32
    assert torch.equal(layer.wcscale, wc)
    assert layer.lora_up.dtype == torch.float16 == layer.lora_down.dtype == layer.dtype


def test_state_dict_round_trips_through_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    lin = planted_linear(256, 128, seed=SEED + 10)
    x = acts(16, 128, seed=SEED + 11)
    layer = W4A4Linear.from_linear(lin, rank=32, act_amax=x.abs().amax(dim=0).float())
    sd = layer.state_dict()
    assert list(sd) == list(STATE_NAMES)
    path = tmp_path / "layer.safetensors"
    st.save_file(sd, str(path))
    back = W4A4Linear.from_state_dict(st.load_file(str(path)))
    for name in STATE_NAMES:
        a, b = getattr(layer, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b), name
    assert torch.equal(back.reference(x), layer.reference(x))


def test_from_tensors_checks_and_no_lib_is_a_clear_error():
    q = quantize_linear(planted_linear(128, 128, seed=SEED + 12).weight, None, rank=16)
    ok = dict(qweight=q.qweight, wscales=q.wscales, wcscale=q.wcscale, lora_down=q.lora_down, lora_up=q.lora_up)
    layer = W4A4Linear.from_tensors(**ok)
    assert (layer.in_features, layer.out_features, layer.rank, layer.bias) == (128, 128, 16, None)
    with pytest.raises(InvalidArgument, match="lora_down and lora_up"):
        W4A4Linear.from_tensors(**{**ok, "lora_up": None})
    with pytest.raises(InvalidArgument, match=r"wscales must have shape \(128, 8\)"):
        W4A4Linear.from_tensors(**{**ok, "wscales": q.wscales[:, :4]})
    with pytest.raises(InvalidArgument, match="wscales must have dtype"):
        W4A4Linear.from_tensors(**{**ok, "wscales": q.wscales.float()})
    with pytest.raises(InvalidArgument, match="share one dtype"):
        W4A4Linear.from_tensors(**{**ok, "lora_up": q.lora_up.half()})
    with pytest.raises(InvalidArgument, match="rank must be 0 or a positive multiple of 16"):
        W4A4Linear(128, 128, rank=8)
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        W4A4Linear(100, 128)
    with pytest.raises(InvalidArgument, match="no kernel library attached"):
        layer(torch.randn(2, 128, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match=r"input must be a tensor \[\.\.\., 128\]"):
        layer.attach(object())(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match="bfloat16 or torch.float16"):
        quantize_linear(torch.randn(128, 128), None, rank=16)

"""The sm_100a/sm_103a weight format (loader/ops/blackwell_weight.py) and its prepare_weight hook. CPU, torch only."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.ops import blackwell_weight as bw  # noqa: E402
from svdq_loader.ops import gemm_w4a4 as gemm_mod  # noqa: E402
from svdq_loader.ops.layouts import SCALE_LAYOUT_BY_ARCH, WEIGHT_FORMAT_BY_ARCH, scale_shape  # noqa: E402
from svdq_loader.testing.reference import decode_e4m3, from_blocked, to_blocked  # noqa: E402


def _scales(rows, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    # random E4M3 bytes without NaN codes (0x7F / 0xFF), so the comparison is bytewise meaningful
    b = torch.randint(0, 0x7F, (rows, groups), dtype=torch.uint8, generator=g)
    b |= torch.randint(0, 2, (rows, groups), dtype=torch.uint8, generator=g) << 7
    return b.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows,groups", [(1, 4), (77, 8), (128, 192), (129, 12), (300, 3), (3072, 768)])
def test_to_blocked_scales_matches_the_reference_layout(rows, groups):
    s = _scales(rows, groups, seed=rows)
    got = bw.to_blocked_scales(s)
    assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
    assert tuple(got.shape) == scale_shape("blocked", rows, groups * 16)
    want = to_blocked(s.view(torch.uint8).numpy())
    assert np.array_equal(got.view(torch.uint8).reshape(-1).numpy(), want)
    back = from_blocked(got.view(torch.uint8).reshape(-1).numpy(), rows, groups)
    assert np.array_equal(back, s.view(torch.uint8).numpy())


def test_lora_up_over_wcscale_keeps_the_formula():
    """(Σ A·W + Σ la·(lu/wc))·wc == (Σ A·W)·wc + Σ la·lu up to one rounding of lu/wc to the dtype."""
    g = torch.Generator().manual_seed(3)
    n, r, m = 64, 32, 9
    for dt in (torch.float16, torch.bfloat16):
        lu = torch.randn(n, r, generator=g).to(dt)
        wc = (torch.rand(n, generator=g) * 4 + 0.01) * torch.where(torch.rand(n, generator=g) < 0.3, -1.0, 1.0)
        la = torch.randn(m, r, generator=g).to(dt)
        q = bw.lora_up_over_wcscale(lu, wc)
        assert q.dtype == dt and q.shape == lu.shape
        exact = lu.double() / wc.double()[:, None]
        ulp = 2.0 ** -10 if dt == torch.float16 else 2.0 ** -7
        assert torch.all((q.double() - exact).abs() <= exact.abs() * ulp / 2 + 1e-30)
        kernel_like = (la.double() @ q.double().T) * wc.double()[None, :]
        formula = la.double() @ lu.double().T
        scale = la.double().abs() @ lu.double().abs().T
        assert torch.all((kernel_like - formula).abs() <= scale * ulp)


@pytest.mark.parametrize("bad, pattern", [
    (0.0, r"wcscale\[5\] = 0.0: the sm_100 GEMM folds 1/wcscale into lora_up"),
    (float("inf"), r"wcscale\[5\] = inf"),
    (float("nan"), r"wcscale\[5\] = nan"),
])
def test_unrepresentable_wcscale_is_refused(bad, pattern):
    wc = torch.ones(8)
    wc[5] = bad
    with pytest.raises(InvalidArgument, match=pattern):
        bw.lora_up_over_wcscale(torch.ones(8, 16, dtype=torch.float16), wc)


def test_overflowing_quotient_is_refused():
    wc = torch.ones(8)
    wc[2] = 1e-6
    lu = torch.ones(8, 16, dtype=torch.float16)
    with pytest.raises(InvalidArgument, match=r"lora_up\[2, 0\] / wcscale\[2\] = 1.0 / 9.99.*overflows torch.float16"):
        bw.lora_up_over_wcscale(lu, wc)


def test_prepare_weight_converts_for_blackwell_per_arch(monkeypatch):
    monkeypatch.setattr(gemm_mod, "check_devices", lambda named: None)     # CPU tensors stand in
    g = torch.Generator().manual_seed(5)
    n, k, r = 256, 512, 32
    wgt = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    ws = _scales(n, k // 16, seed=9)
    lu = torch.randn(n, r, generator=g).to(torch.bfloat16)
    wc = torch.rand(n, generator=g) + 0.5
    plain = gemm_mod.prepare_weight(wgt, ws, lora_up=lu, wcscale=wc)        # no arch: as given
    assert plain.weight_format == "logical" and plain.wscales is ws and plain.lora_up is lu
    hop = gemm_mod.prepare_weight(wgt, ws, lora_up=lu, wcscale=wc, arch="sm_90a")
    # Hopper has its own format (fragment order); LoRA stays outside the wcscale multiply there
    assert hop.weight_format == "sm90_frag" and hop.lora_up is lu
    for arch in ("sm_100a", "sm_103a"):
        assert WEIGHT_FORMAT_BY_ARCH[arch] == "blackwell_weight" and SCALE_LAYOUT_BY_ARCH[arch] == "blocked"
        w = gemm_mod.prepare_weight(wgt, ws, lora_up=lu, wcscale=wc, arch=arch)
        assert w.weight_format == "blackwell_weight"
        assert tuple(w.wscales.shape) == (2, 8, 32, 4, 4)
        assert np.array_equal(w.wscales.view(torch.uint8).reshape(-1).numpy(), to_blocked(ws.view(torch.uint8).numpy()))
        assert torch.equal(w.lora_up, (lu.float() / wc[:, None]).to(torch.bfloat16))
        # without wcscale the kernel multiplies by nothing: lora_up is used as given
        w1 = gemm_mod.prepare_weight(wgt, ws, lora_up=lu, arch=arch)
        assert w1.lora_up is lu
    # the decoded scales survive the conversion (the reference reads the logical layout)
    dec = decode_e4m3(from_blocked(w.wscales.view(torch.uint8).reshape(-1).numpy(), n, k // 16))
    assert np.array_equal(dec, decode_e4m3(ws.view(torch.uint8).numpy()))


def test_a_weight_prepared_for_another_format_is_refused(monkeypatch):
    monkeypatch.setattr(gemm_mod, "check_devices", lambda named: None)
    n, k, m = 128, 256, 5
    wgt = torch.zeros(n, k // 2, dtype=torch.uint8)
    ws = _scales(n, k // 16)
    act = torch.zeros(m, k // 2, dtype=torch.uint8)
    hop = gemm_mod.prepare_weight(wgt, ws, arch="sm_90a")
    blk = bw.to_blocked_scales(_scales(m, k // 16))
    with pytest.raises(InvalidArgument, match=r"the weight is in the 'sm90_frag' format but the sm_100a GEMM reads "
                                              r"'blackwell_weight'"):
        gemm_mod.plan_call("sm_100a", act, hop, blk)
    bwt = gemm_mod.prepare_weight(wgt, ws, arch="sm_100a")
    assert gemm_mod.plan_call("sm_100a", act, bwt, blk).features[-1] == "blocked"
    with pytest.raises(InvalidArgument, match=r"the weight is in the 'blackwell_weight' format but the sm_90a GEMM"):
        gemm_mod.plan_call("sm_90a", act, bwt, _scales(m, k // 16))
    # the one-pass fast path never takes a Blackwell weight (plan_call does, with its checks)
    assert gemm_mod.fast_args("sm_100a", act, bwt, blk, None, None, None) is None

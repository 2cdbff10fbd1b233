"""The loader with sm_120a artifacts, on the CPU: refusal on other archs, weight format, launches (fake driver).

One real build (gemm_w4a4 + quantize_act for sm_120a, bf16, R = 32) and tensors with CUDA metadata but
no storage.  On a device reporting sm_90a (the H200) both ops are refused before anything is loaded or
launched, naming the device's arch; on a device reporting sm_120a the calls launch the sm_120a
kernels, the weight must have been prepared in this GEMM's format (blocked scales) and the activation
scales must come in the blocked layout.  `sm120_weight.convert` is checked against the reference
`to_blocked` (and leaves lora_up as given).  Nothing runs on a GPU.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

import svdq_loader  # noqa: E402
from svdq_aot.build import build  # noqa: E402
from svdq_loader.errors import InvalidArgument, UnsupportedProblem  # noqa: E402
from svdq_loader.ops import gemm_w4a4 as gemm_op  # noqa: E402
from svdq_loader.ops.layouts import WEIGHT_FORMAT_BY_ARCH, scale_shape  # noqa: E402
from svdq_loader.ops.sm120_weight import convert  # noqa: E402
from svdq_loader.testing.reference import to_blocked  # noqa: E402

from fake_cuda import FakeCuda, fake_driver  # noqa: E402

U8, F8, BF = torch.uint8, torch.float8_e4m3fn, torch.bfloat16
M, N, K, R = 77, 256, 256, 32
CONFIG = """
name: sm120-loader
archs: [sm_120a]
out_dtypes: [bf16]
ranks: [32]
wcscale: [true]
bias: [true]
shapes:
  square: {k: 256, n: 256}
variants:
  sm_120a:
    gemm_w4a4: {tiles: [[128, 128, 128]], stages: [auto]}
    quantize_act: {warps: [2]}
"""


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("sm120")
    cfg = d / "c.yaml"
    cfg.write_text(CONFIG)
    build(cfg, d / "art")
    return str(d / "art")


def _driver(monkeypatch, **kw):
    """The recording fake driver, with the real per-arch weight formats: these tests build their
    PreparedWeights directly (nothing is converted on the data-less tensors) and check the formats."""
    rec = fake_driver(monkeypatch, **kw)
    from svdq_loader.ops import layouts
    monkeypatch.setitem(layouts.WEIGHT_FORMATS_BY_COMPUTE, "exact", dict(WEIGHT_FORMAT_BY_ARCH))
    return rec


def T(shape, dtype, device="cuda:0"):
    return FakeCuda(shape, dtype, device)


def _weight(fmt):
    shape = scale_shape("blocked", N, K) if fmt == "sm120_weight" else (N, K // 16)
    return gemm_op.PreparedWeight(T((N, K // 2), U8), T(shape, F8), T((N, R), BF), T((N,), torch.float32),
                                  T((N,), torch.float32), N, K, R, fmt)


def _gemm(lib, w, ascales_shape=None):
    return lib.gemm_w4a4(T((M, K // 2), U8), w, T(ascales_shape or scale_shape("blocked", M, K), F8),
                         lora_act_in=T((M, R), BF), out=T((M, N), BF))


def _quant(lib, layout_shape=None):
    return lib.quantize_act(T((M, K), BF), lora_down=T((K, R), BF), out_act=T((M, K // 2), U8),
                            out_scales=T(layout_shape or scale_shape("blocked", M, K), F8), out_lora=T((M, R), BF))


def test_refused_on_the_h200_naming_its_arch(artifacts, monkeypatch):
    lib = svdq_loader.load(artifacts)
    rec = _driver(monkeypatch, arch="sm_90a")
    with pytest.raises(UnsupportedProblem, match=r"no gemm_w4a4 kernel built for this device's arch sm_90a; "
                                                 r"the artifacts hold gemm_w4a4 for \['sm_120a'\]"):
        _gemm(lib, _weight("sm90_frag"), ascales_shape=(M, K // 16))
    with pytest.raises(UnsupportedProblem, match=r"no quantize_act kernel built for this device's arch sm_90a; "
                                                 r"the artifacts hold quantize_act for \['sm_120a'\]"):
        _quant(lib, layout_shape=(M, K // 16))
    # a weight prepared for sm_120a is refused on the sm_90a device by its format, before selection
    with pytest.raises(InvalidArgument, match=r"the weight is in the 'sm120_weight' format but the sm_90a GEMM "
                                              r"reads 'sm90_frag'"):
        _gemm(lib, _weight("sm120_weight"), ascales_shape=(M, K // 16))
    from svdq_loader import library
    monkeypatch.setattr(library, "_ordinal", lambda device: 0)
    assert lib.preload() == 0                      # nothing of these artifacts loads on an sm_90a device
    assert rec.loads == [] and rec.launches == []


def test_launches_on_an_sm120_device(artifacts, monkeypatch):
    lib = svdq_loader.load(artifacts)
    rec = _driver(monkeypatch, arch="sm_120a", optin_smem=101376, sms=188)
    _gemm(lib, _weight("sm120_weight"))
    _quant(lib)
    assert len(rec.loads) == 2 and len(rec.launches) == 2
    assert all("_sm120a_" in s for syms in rec.loads for s in syms)
    for fmt in ("logical", "sm90_frag", "blackwell_weight"):
        with pytest.raises(InvalidArgument, match=rf"the weight is in the '{fmt}' format but the sm_120a GEMM "
                                                  r"reads 'sm120_weight'"):
            _gemm(lib, _weight(fmt))
    with pytest.raises(InvalidArgument, match=r"ascales has shape \(77, 16\) but the sm_120a GEMM reads the blocked"):
        _gemm(lib, _weight("sm120_weight"), ascales_shape=(M, K // 16))
    assert len(rec.launches) == 2


def test_device_without_enough_smem_is_refused(artifacts, monkeypatch):
    from svdq_loader.errors import DeviceMismatch
    lib = svdq_loader.load(artifacts)
    rec = _driver(monkeypatch, arch="sm_120a", optin_smem=48 * 1024, sms=20)
    with pytest.raises(DeviceMismatch, match=r"needs 94208 bytes of shared memory per block \(93184 dynamic \+ "
                                             r"1024 static\); device 0 allows 49152"):
        _gemm(lib, _weight("sm120_weight"))
    assert rec.launches == []


def test_weight_format_table():
    assert WEIGHT_FORMAT_BY_ARCH["sm_120a"] == WEIGHT_FORMAT_BY_ARCH["sm_121a"] == "sm120_weight"
    from svdq_loader.ops.layouts import WEIGHT_FORMAT_MODULES
    assert WEIGHT_FORMAT_MODULES["sm120_weight"] == "sm120_weight"


@pytest.mark.parametrize("rows, groups", [(256, 16), (77, 16), (130, 24), (1, 4), (128, 6)])
def test_weight_conversion_matches_the_reference(rows, groups):
    g = torch.Generator().manual_seed(rows * 31 + groups)
    raw = torch.randint(1, 127, (rows, groups), generator=g, dtype=torch.uint8)   # positive, non-NaN E4M3 bytes
    lora_up = torch.randn(rows, 32, generator=g).to(BF)
    wgt = torch.randint(0, 256, (rows, 8 * groups), generator=g, dtype=U8)
    w, got, lu = convert(rows, 16 * groups, wgt, raw.view(F8), lora_up, torch.rand(rows, generator=g) + 0.5)
    assert lu is lora_up and w is wgt        # LoRA is added after wcscale: lora_up (and wgt) used as given
    assert got.dtype == F8 and tuple(got.shape) == scale_shape("blocked", rows, 16 * groups)
    want = to_blocked(raw.numpy())
    np.testing.assert_array_equal(got.view(U8).reshape(-1).numpy(), want)
    # every logical byte is somewhere, the padding is zero
    assert int((got.view(U8) != 0).sum()) == rows * groups


def test_selftest_covers_the_sm120_variants(artifacts, monkeypatch, capsys):
    """`svdq-aot selftest` on an sm_120a GPU (stubbed) runs every sm_120a variant of the artifacts."""
    from types import SimpleNamespace

    from svdq_loader import driver
    from svdq_loader.testing import selftest as S
    from svdq_loader.testing.gpu_checks import CaseResult
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake RTX PRO 6000")
    monkeypatch.setattr(driver, "device_arch", lambda i: "sm_120a")
    real_load = svdq_loader.load
    monkeypatch.setattr(svdq_loader, "load", lambda path: SimpleNamespace(variants=real_load(path).variants))
    seen = []

    def fake_run(lib, entry, case, ordinal, base):
        seen.append((entry.op, entry.requirements, case.kwargs))
        return CaseResult(True, "ok", 1e-4, 1e-2, 1e-5, [])
    monkeypatch.setattr(S, "run_case", fake_run)
    assert S.main([artifacts]) == 0
    out = capsys.readouterr().out
    # three GEMM cases and one call without wcscale and bias (identity vectors), three quantize cases
    assert "selftest: Fake RTX PRO 6000 (sm_120a), 2 variant(s), 7 case(s)" in out, out
    assert "M=205 N=256 K=512 no wcscale/bias" in out, out
    assert sorted({op for op, _, _ in seen}) == ["gemm_w4a4", "quantize_act"]
    for op, req, kw in seen:
        assert kw["k"] % req["k_multiple"] == 0 and (op != "gemm_w4a4" or kw["n"] % req["n_multiple"] == 0)
    assert min(kw["k"] for op, _, kw in seen if op == "gemm_w4a4") == 128    # one k-tile: K < 4R
    monkeypatch.setattr(driver, "device_arch", lambda i: "sm_121a")
    assert S.main([artifacts]) == 0
    assert "holds no variants for this GPU's arch sm_121a (built for sm_120a)" in capsys.readouterr().out


def test_selftest_pin_key_matches_an_sm120_call(monkeypatch):
    """selftest pins by (op, device, features, dims); for an sm_120a variant that must be plan_call's key."""
    from svdq_loader.ops import blackwell_weight
    from svdq_loader.testing import selftest as S
    monkeypatch.setattr(gemm_op, "check_devices", lambda named: None)
    g = torch.Generator().manual_seed(3)
    w = gemm_op.prepare_weight(torch.zeros(N, K // 2, dtype=U8), torch.ones(N, K // 16).to(F8),
                               lora_up=torch.randn(N, R, generator=g).to(BF), wcscale=torch.rand(N, generator=g) + 0.5,
                               arch="sm_120a")
    assert w.weight_format == "sm120_weight" and tuple(w.wscales.shape) == scale_shape("blocked", N, K)
    call = gemm_op.plan_call("sm_120a", torch.zeros(M, K // 2, dtype=U8), w,
                             blackwell_weight.to_blocked_scales(torch.ones(M, K // 16).to(F8)),
                             lora_act_in=torch.zeros(M, R, dtype=BF))
    knobs = dict(out_dtype="bf16", rank=R, wcscale=True, bias=False, scale_layout="blocked", tile_m=128,
                 tile_n=128, tile_k=128, stages=5)
    assert S._features("gemm_w4a4", knobs) == call.features
    assert S._dims("gemm_w4a4", dict(m=M, n=N, k=K)) == (("m", call.m), ("n", call.n), ("k", call.k))


def test_every_built_variant_passes_the_static_checks(artifacts):
    """The artifact set of a real build (both ops), checked variant by variant from its own files."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sm120_static
    from kernel_checks import cuobjdump
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump / nvdisasm not available")
    checked, problems = sm120_static.check_artifacts(artifacts, tool)
    assert checked == 2 and problems == []


"""GPU numerics of the FP8-compute mode (op ``gemm_w4a4_fp8`` and its ``act_fp8`` pre-pass) through the loader.

Skipped where no CUDA GPU exists (CI), and where the artifacts hold no ``gemm_w4a4_fp8`` variants (a build of
``configs/sm90_fp8.yaml`` has them).  Every GEMM case: fresh random inputs, the output poisoned with NaN inside a
larger buffer with guard rows, checked against the mode's own float64 reference (`fp8_reference`, in torch on the GPU)
at the exact mode's tolerance; the pre-pass bit for bit against its reference workspace.  Then the mode's distance from the exact
operator on the same inputs, which must be the size of one E4M3 rounding per operand and never zero.
"""
from __future__ import annotations

import pytest

from gpu_env import ART, SEED, torch  # noqa: F401  (skips this module without a GPU or artifacts)
from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.testing import gpu_checks  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402

import svdq_loader  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib():
    lib = svdq_loader.load(ART)
    if not any(v.op == "gemm_w4a4_fp8" for v in lib.variants):
        pytest.skip(f"{ART} holds no gemm_w4a4_fp8 variants (build configs/sm90_fp8.yaml)")
    return lib


def _ranks(lib):
    return sorted({v.knobs["rank"] for v in lib.variants if v.op == "gemm_w4a4_fp8"})


#: Hopper's FP8 tensor cores keep fewer bits than fp32 while they accumulate: without promotion the mode's distance
#: from its float64 reference grows like sqrt(K) (an H100, session 27, fp16 output: 4.3e-4 at K = 768, 9.4e-4 at
#: 3072, 2.2e-3 at 12288, 2.5e-3 at 15360, over the exact mode's fp16 tolerance of 2e-3 from K = 12288 on).  The fp16
#: forms now move their accumulators into fp32 sums in SMEM after every loop step (session 28,
#: `sm90_plan.fp8_promotes`), so K = 12288 is held to that tolerance like every other case.


def _cases():
    for dt in ("bf16", "fp16"):
        for kn in ((3072, 3072), (12288, 3072), (3072, 9216)):
            for m in (1, 77, 256, 1000, 4608):
                yield pytest.param(m, kn, dt, id=f"{dt}-K{kn[0]}N{kn[1]}-{m}")


@pytest.mark.parametrize("m, kn, dt", list(_cases()))
def test_fp8_gemm_against_its_reference(lib, m, kn, dt):
    k, n = kn
    for r in _ranks(lib):
        for wc, b in ((True, True), (False, False)):
            res = gpu_checks.gemm_case(lib, m, n, k, r, dt, wc, b, seed=m + k + n + r + wc, base_seed=SEED,
                                       compute="fp8")
            assert res.ok, res.message


def test_act_fp8_prepass_bit_for_bit(lib):
    entry = next(v for v in lib.variants if v.op == "act_fp8")
    # with SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT=1 these split K over 1, 12, 3, 7 and 1 CTAs per row tile
    for m, k in ((1, 256), (77, 3072), (300, 768), (1024, 12288), (4608, 3072)):
        res = gpu_checks.act_fp8_case(lib, entry, m, k, seed=m + k, base_seed=SEED)
        assert res.ok, res.message


def test_the_mode_is_a_rounding_away_from_the_exact_operator(lib):
    """Same inputs through both modes: the FP8 output differs from the exact one by about one E4M3 rounding per
    operand (0.5-6 % of the main product here), never by nothing."""
    m, n, k = 512, 3072, 3072
    p = ref.random_problem(m, n, k, 0, seed=SEED % 1000, out_dtype="bf16", wcscale=True, bias=False, device="cuda")
    exact = lib.gemm_w4a4(p["act"], p["wgt"], p["ascales"], p["wscales"], wcscale=p["wcscale"])
    w8 = lib.prepare_weight(p["wgt"], p["wscales"], wcscale=p["wcscale"], compute="fp8")
    fp8 = lib.gemm_w4a4(p["act"], w8, p["ascales"])
    d = float(torch.linalg.vector_norm(fp8.double() - exact.double()) / torch.linalg.vector_norm(exact.double()))
    assert 0.005 < d < 0.06, d


def test_compute_mode_errors(lib):
    p = ref.random_problem(16, 256, 256, 0, seed=1, device="cuda")
    w = lib.prepare_weight(p["wgt"], p["wscales"])
    with pytest.raises(InvalidArgument, match="prepared for compute='exact'"):
        lib.gemm_w4a4(p["act"], w, p["ascales"], compute="fp8")
    with pytest.raises(InvalidArgument, match="compute must be one of"):
        lib.prepare_weight(p["wgt"], p["wscales"], compute="fp4")


def _quant_rank(lib):
    ranks = sorted({v.knobs["rank"] for v in lib.variants if v.op == "quantize_act"})
    return 32 if 32 in ranks else ranks[0]


@pytest.mark.parametrize("m, k", [(1, 256), (300, 3072), (4608, 3072)])
def test_quantize_act_fp8_is_the_nvfp4_activation_rounded_once_bit_for_bit(lib, m, k):
    """``quantize_act(x, compute="fp8")`` from fresh bf16 x (groups over many binades, smoothing, LoRA-down): its
    E4m3Act equals, byte for byte, the act_fp8 reference workspace of the *reference* quantizer's codes and scales,
    written into a buffer poisoned with 0xFF; its lora_act_in equals the exact mode's bit for bit; ``act_to_fp8``
    of the exact mode's output gives the same bytes."""
    import numpy as np
    from svdq_loader.ops.act_fp8 import E4m3Act, workspace_bytes
    from svdq_loader.testing.fp8_reference import reference_act_fp8_workspace
    from svdq_loader.testing.quantize_ref import quantize_act_ref_torch
    r = _quant_rank(lib)
    g = torch.Generator(device="cpu").manual_seed(SEED + m + k)
    x = gpu_checks.make_x(m, k, "bf16", g).cuda()
    smooth = (torch.rand(k, generator=g) * 3.75 + 0.25).to(torch.bfloat16).cuda()
    lora_down = (torch.randn(k, r, generator=g) / k**0.5).to(torch.bfloat16).cuda() if r else None
    a_ref, s_ref, _ = quantize_act_ref_torch(x, smooth, lora_down, "logical")
    want = reference_act_fp8_workspace(np.asarray(a_ref), np.asarray(s_ref))
    nb = workspace_bytes(m, k)
    assert want.size == nb
    buf = torch.full((nb + 4096,), 0xFF, dtype=torch.uint8, device="cuda")
    out = E4m3Act(buf[:nb], m, k)
    a8, none, la = lib.quantize_act(x, smooth=smooth, lora_down=lora_down, compute="fp8", out_act=out)
    torch.cuda.synchronize()
    assert a8 is out and none is None
    got = buf.cpu().numpy()
    bad = int((got[:nb] != want).sum())
    assert bad == 0, f"{bad} of {nb} workspace bytes differ from the reference"
    assert (got[nb:] == 0xFF).all(), "written past the E4m3Act's end"
    act, asc, la_exact = lib.quantize_act(x, smooth=smooth, lora_down=lora_down)
    if r:
        assert torch.equal(la, la_exact)
    again = lib.act_to_fp8(act, asc)
    torch.cuda.synchronize()
    assert torch.equal(again.data, out.data)


@pytest.mark.parametrize("m", [1, 77, 1000, 4608])
def test_the_gemm_from_an_e4m3_activation_is_the_call_from_nvfp4(lib, m):
    """The GEMM from ``act_to_fp8``'s E4m3Act (alone) and the call from the NVFP4 activation (act_fp8, then the
    GEMM) give the same output bit for bit, and it matches the mode's float64 reference; outputs poisoned first."""
    from svdq_loader.testing.fp8_reference import reference_torch_f64_fp8
    k, n = 3072, 3072
    r = max(_ranks(lib)) if 32 not in _ranks(lib) else 32
    p = ref.random_problem(m, n, k, r, seed=SEED % 1000 + m, out_dtype="bf16", wcscale=True, bias=True,
                           device="cuda")
    w8 = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"],
                            compute="fp8")
    y1 = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y2 = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    lib.gemm_w4a4(p["act"], w8, p["ascales"], lora_act_in=p["lora_act_in"], out=y1)
    a8 = lib.act_to_fp8(p["act"], p["ascales"])
    assert lib.gemm_w4a4(a8, w8, None, lora_act_in=p["lora_act_in"], out=y2) is y2
    torch.cuda.synchronize()
    assert torch.isfinite(y2).all() and torch.equal(y1, y2)
    want = reference_torch_f64_fp8(p["act"], p["wgt"], p["ascales"], p["wscales"], lora_act_in=p["lora_act_in"],
                                   lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
    e = float(torch.linalg.vector_norm(y2.double() - want) / torch.linalg.vector_norm(want))
    assert e < 1e-2, e


def test_an_fp8_layer_matches_its_float64_reference(lib):
    """W4A4Linear(compute="fp8") eagerly: quantize_act(..., compute="fp8") and the GEMM from its E4M3 activation,
    x -> y against the layer's float64 reference of the mode, with and without smoothing and LoRA."""
    from svdq_loader.torch import W4A4Linear
    k, n = 3072, 3072
    g = torch.Generator(device="cpu").manual_seed(SEED + 11)
    lin = torch.nn.Linear(k, n).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(n, generator=g))
    lin = lin.to("cuda", torch.bfloat16)
    calib = (torch.randn(64, k, generator=g) * (1 + 20 * (torch.rand(k, generator=g) > 0.98))).to("cuda",
                                                                                                  torch.bfloat16)
    for rank, smooth in ((0, False), (_quant_rank(lib), True)):
        if rank not in _ranks(lib):
            continue
        layer = W4A4Linear.from_linear(lin, rank=rank, act_amax=calib.abs().amax(0).float() if smooth else None,
                                       lib=lib, compute="fp8")
        for m in (1, 300, 4608):
            x = (torch.randn(m, k, generator=g) * 2).to("cuda", torch.bfloat16)
            torch.full((256 << 20,), float("nan"), dtype=torch.bfloat16, device="cuda")   # poison the allocator
            y = layer(x)
            assert torch.isfinite(y).all()
            want = layer.reference(x).double()
            e = float(torch.linalg.vector_norm(y.double() - want) / torch.linalg.vector_norm(want))
            assert e < 1e-2, (rank, smooth, m, e)

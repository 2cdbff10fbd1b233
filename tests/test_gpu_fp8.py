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
    for m, k in ((1, 256), (300, 768), (4608, 3072)):
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

"""GPU numerics of `quantize_act` through the DSL-free loader (bit-exact against the reference).

Skipped where no CUDA GPU exists (CI).  On a GPU machine they need built artifacts:
`SVDQ_ARTIFACTS` (default `artifacts/`).  `SVDQ_REQUIRE_GPU=1` turns a missing GPU or missing
artifacts into a failure.

Every case draws fresh random inputs (base seed in each message; `SVDQ_SEED` replays), and
compares codes and scales BIT FOR BIT with `quantize_act_ref_torch`; `lora_act_in` against the
float64 sum within the rounding of the output dtype.  Where the loader accepts caller-provided
outputs they are poisoned first (0xFF bytes / NaN) inside larger buffers whose guard tails must
stay untouched.  The last tests run x -> quantize_act -> gemm_w4a4 against the float64 reference.
"""
from __future__ import annotations

import pytest

from gpu_env import ART, SEED, torch  # noqa: F401  (skips this module without a GPU or artifacts)
from svdq_loader.testing import reference as ref  # noqa: E402
from svdq_loader.testing.quantize_ref import quantize_act_ref_torch  # noqa: E402

import svdq_loader  # noqa: E402

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
LORA_TOL = {"bf16": 4e-3, "fp16": 1e-3}     # relative (norm) error of lora_act_in: output rounding only
GUARD = 64


@pytest.fixture(scope="module")
def lib():
    return svdq_loader.load(ART)


def _layout():
    major, _ = torch.cuda.get_device_capability()
    return "logical" if major == 9 else "blocked"


def _gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1000003 + SEED) % (2**63))
    return g


def _make_x(m, k, dt, g, special=False):
    """Rows with groups over many binades; `special` adds tie / zero / subnormal-scale groups."""
    mag = torch.exp2(torch.empty(m, k // 16, 1).uniform_(-10, 6, generator=g))
    x = (torch.randn(m, k // 16, 16, generator=g) * mag).reshape(m, k)
    if special:
        ties = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
        gcount = k // 16
        for r in range(m):
            gi = (r * 7) % gcount
            kind = r % 5
            scale = {0: 2.0 ** ((r % 9) - 4), 1: 0.0, 2: 2.0**-10, 3: 2.0**-12, 4: 2.0**-9}[kind]
            x[r, 16 * gi:16 * gi + 16] = ties * scale
        if k >= 32:
            x[0, 16:32] = 1e-40 if dt == "bf16" else 2.0**-24          # fp32-subnormal / fp16-subnormal inputs
    return x.to(DT[dt])


def _call(lib, x, smooth, lora_down, outs=None):
    """lib.quantize_act, into caller-provided (poisoned) outputs when `outs` is given."""
    if outs is None:
        return lib.quantize_act(x, smooth=smooth, lora_down=lora_down), False
    return lib.quantize_act(x, smooth=smooth, lora_down=lora_down, out_act=outs[0],
                            out_scales=outs[1].view(torch.float8_e4m3fn), out_lora=outs[2]), True


def _case(lib, m, k, dt, use_smooth, r, seed, special=False):
    g = _gen(seed)
    x = _make_x(m, k, dt, g, special).cuda()
    smooth = (torch.rand(k, generator=g) * 3.75 + 0.25).to(DT[dt]).cuda() if use_smooth else None
    lora_down = (torch.randn(k, r, generator=g) / k**0.5).to(DT[dt]).cuda() if r else None
    layout = _layout()
    a_ref, s_ref, l_ref = quantize_act_ref_torch(x, smooth, lora_down, layout)

    # poisoned outputs inside larger buffers (used when the loader accepts them)
    act_buf = torch.full((m * k // 2 + GUARD,), 0xFF, dtype=torch.uint8, device="cuda")
    asc_buf = torch.full((s_ref.numel() + GUARD,), 0xFF, dtype=torch.uint8, device="cuda")
    lai_buf = torch.full((m * r + GUARD,), float("nan"), dtype=DT[dt], device="cuda") if r else None
    outs = (act_buf[: m * k // 2].view(m, k // 2), asc_buf[: s_ref.numel()].view(s_ref.shape),
            None if not r else lai_buf[: m * r].view(m, r))
    (act, asc, lai), used_bufs = _call(lib, x, smooth, lora_down, outs)
    torch.cuda.synchronize()
    what = f"M={m} K={k} {dt} smooth={use_smooth} R={r} special={special} seed={seed} base={SEED}"

    act_h = act.view(torch.uint8).cpu().reshape(m, k // 2)
    asc_h = asc.view(torch.uint8).cpu().reshape(s_ref.shape)
    bad_a = int((act_h != a_ref).sum())
    bad_s = int((asc_h != s_ref).sum())
    assert bad_s == 0, f"{bad_s} scale bytes differ from the reference ({what})"
    assert bad_a == 0, f"{bad_a} code bytes differ from the reference ({what})"
    if used_bufs:
        assert act.data_ptr() == act_buf.data_ptr() and asc.data_ptr() == asc_buf.data_ptr()
        assert (act_buf[m * k // 2:] == 0xFF).all(), f"act written past its end ({what})"
        assert (asc_buf[s_ref.numel():] == 0xFF).all(), f"ascales written past its end ({what})"
    if r:
        assert lai is not None and lai.shape == (m, r) and lai.dtype == DT[dt]
        ld = lai.double().cpu()
        assert torch.isfinite(ld).all(), f"lora_act_in has non-finite values ({what})"
        rel = float(torch.linalg.vector_norm(ld - l_ref) / torch.linalg.vector_norm(l_ref).clamp_min(1e-30))
        assert rel <= LORA_TOL[dt], f"lora_act_in relative error {rel:.2e} ({what})"
        if used_bufs:
            assert torch.isnan(lai_buf[m * r:]).all(), f"lora_act_in written past its end ({what})"
    else:
        assert lai is None
    return act, asc, lai, (a_ref, s_ref, l_ref), (x, smooth, lora_down)


# 1. many shapes, both dtypes, with / without smooth, R in {0, 32}
@pytest.mark.parametrize("m", [1, 77, 1000])
@pytest.mark.parametrize("k", [64, 3072, 12288, 15360])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("use_smooth", [False, True])
@pytest.mark.parametrize("r", [0, 32])
def test_bit_exact(lib, m, k, dt, use_smooth, r):
    _case(lib, m, k, dt, use_smooth, r, seed=m * 31 + k + 7 * use_smooth + r + (dt == "fp16"))


# 2. the FLUX token count (M = 4608, not a multiple of 128) at every FLUX K
@pytest.mark.parametrize("k", [3072, 12288, 15360])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_flux_m(lib, k, dt):
    _case(lib, 4608, k, dt, True, 32, seed=k + (dt == "fp16"))


# 3. constructed ties, zero groups, subnormal-scale groups, scales rounding to 0, subnormal inputs
@pytest.mark.parametrize("m", [5, 130, 4608])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("use_smooth", [False, True])
def test_constructed_cases(lib, m, dt, use_smooth):
    _case(lib, m, 3072 if m < 4608 else 192, dt, use_smooth, 32, seed=m + 3 * use_smooth, special=True)


def test_other_ranks(lib):
    avail = {v.knobs.get("rank") for v in getattr(lib, "variants", []) if getattr(v, "op", "quantize_act") == "quantize_act"}
    for r in (16, 48, 64, 128):
        if avail and r not in avail:
            continue
        _case(lib, 300, 3072, "bf16", True, r, seed=r)


def test_non_finite_policy(lib):
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x = x.cuda()
    act, asc, _ = lib.quantize_act(x)
    torch.cuda.synchronize()
    a_ref, s_ref, _ = quantize_act_ref_torch(x, None, None, _layout())
    assert torch.equal(act.view(torch.uint8).cpu().reshape(a_ref.shape), a_ref)
    assert torch.equal(asc.view(torch.uint8).cpu().reshape(s_ref.shape), s_ref)


# 4. x -> quantize_act -> gemm_w4a4 against the float64 reference of the whole linear
@pytest.mark.parametrize("use_smooth", [False, True])
@pytest.mark.parametrize("r", [0, 32])
def test_quantize_then_gemm(lib, use_smooth, r):
    if not hasattr(lib, "gemm_w4a4") or _layout() != "logical":
        pytest.skip("no gemm_w4a4 for this device in these artifacts")
    m, n, k, dt = 1000, 3072, 3072, "bf16"
    act, asc, lai, (a_ref, s_ref, l_ref), (x, smooth, _) = _case(lib, m, k, dt, use_smooth, r,
                                                                  seed=97 + r + use_smooth)
    p = ref.random_problem(m, n, k, r, seed=(SEED + 5 + r) % (2**31), out_dtype=dt, device="cuda")
    out = torch.full((m + 3, n), float("nan"), dtype=DT[dt], device="cuda")
    y = lib.gemm_w4a4(act, p["wgt"], asc, p["wscales"], lora_act_in=lai, lora_up=p.get("lora_up"),
                      wcscale=p["wcscale"], bias=p["bias"], out=out[:m])
    torch.cuda.synchronize()
    assert torch.isnan(out[m:]).all(), "gemm wrote past row M"
    # (a) the whole linear in float64 from x alone: the reference quantizer's codes, scales and
    #     float64 LoRA-down, then the float64 GEMM reference -- nothing taken from the kernels
    l64 = torch.as_tensor(l_ref, dtype=torch.float64).cuda() if r else None
    expect = ref.reference_torch_f64(a_ref.cuda(), p["wgt"], s_ref.cuda().view(torch.float8_e4m3fn), p["wscales"],
                                     lora_act_in=l64, lora_up=p.get("lora_up"), wcscale=p["wcscale"],
                                     bias=p["bias"])
    rel = float(torch.linalg.vector_norm(y.double() - expect) / torch.linalg.vector_norm(expect))
    assert rel <= 1e-2, f"quantize -> gemm relative error {rel:.3e} vs the float64 reference"
    # (b) end to end against the unquantized float64 linear of x̂ (NVFP4 error only: loose)
    xh = x.double() / smooth.double() if smooth is not None else x.double()
    e2m1 = torch.tensor(ref.E2M1_VALUES, dtype=torch.float64, device="cuda")
    e4m3 = torch.tensor(ref.decode_e4m3(torch.arange(256, dtype=torch.uint8).numpy()), dtype=torch.float64, device="cuda")
    wb = p["wgt"].view(torch.uint8).long()
    wd = e2m1[torch.stack((wb & 0xF, wb >> 4), -1).reshape(n, k)] * \
        e4m3[p["wscales"].view(torch.uint8).long()].repeat_interleave(16, dim=1)
    full = (xh @ wd.T) * p["wcscale"].double()[None, :] + p["bias"].double()[None, :]
    if r:
        full = full + lai.double() @ p["lora_up"].double().T
    rel2 = float(torch.linalg.vector_norm(y.double() - full) / torch.linalg.vector_norm(full))
    assert rel2 <= 0.25, f"end-to-end error {rel2:.3f} is beyond NVFP4 activation quantization error"

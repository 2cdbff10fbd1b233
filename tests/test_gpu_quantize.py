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
from svdq_loader.testing import gpu_checks  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402
from svdq_loader.testing.quantize_ref import quantize_act_ref_torch  # noqa: E402

import svdq_loader  # noqa: E402

pytestmark = pytest.mark.gpu

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def lib():
    return svdq_loader.load(ART)


def _layout():
    return gpu_checks.device_scale_layout()


def _case(lib, m, k, dt, use_smooth, r, seed, special=False):
    res, (act, asc, lai), refs, inputs = gpu_checks.quantize_case(lib, m, k, dt, use_smooth, r, seed,
                                                                 base_seed=SEED, special=special)
    assert res.ok, res.message
    return act, asc, lai, refs, inputs


# 1. many shapes, both dtypes, without smoothing, with smooth and with smooth_rcp (use_smooth 0 / 1 / 2), R in {0, 32}
@pytest.mark.parametrize("m", [1, 77, 1000])
@pytest.mark.parametrize("k", [64, 3072, 12288, 15360])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("use_smooth", [0, 1, 2])
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
@pytest.mark.parametrize("use_smooth", [0, 1, 2])
def test_constructed_cases(lib, m, dt, use_smooth):
    _case(lib, m, 3072 if m < 4608 else 192, dt, use_smooth, 32, seed=m + 3 * use_smooth, special=True)


def test_other_ranks(lib):
    avail = {v.knobs.get("rank") for v in getattr(lib, "variants", []) if getattr(v, "op", "quantize_act") == "quantize_act"}
    for r in (16, 48, 64, 128):
        if avail and r not in avail:
            continue
        _case(lib, 300, 3072, "bf16", True, r, seed=r)
        _case(lib, 300, 3072, "fp16", 2, r, seed=r + 1)


def _tiles(m, rows=16):
    return -(-m // rows)


def _force_cluster(monkeypatch, ksplit):
    """Every launch takes the cluster form with `ksplit` CTAs per row tile (one CTA per tile at 1)."""
    from svdq_loader.ops import quantize_act as qop
    monkeypatch.setattr(qop, "schedule", lambda m, k, r, sms, res, rows, blocked, clusters=None:
                        (ksplit, _tiles(m, rows) * ksplit, 0))


def _force_range(monkeypatch, grid):
    """Every launch takes the range form with grid(tiles, units) CTAs (clamped to [tiles, units])."""
    from svdq_loader.ops import quantize_act as qop

    def sched(m, k, r, sms, res, rows, blocked, clusters=None):
        tiles = _tiles(m, rows)
        ctas = max(tiles, min(grid(tiles, tiles * (k // 64), sms * res), tiles * (k // 64)))
        return 1, ctas, qop.workspace_bytes(ctas, rows, r) if ctas > tiles else 0
    monkeypatch.setattr(qop, "schedule", sched)


# 5. the K split over a cluster of ksplit CTAs (forced here; the loader sizes it from M, K and the SM count):
#    fewer steps than warps x ksplit, M tails, every rank (96 takes the SMEM-ring form)
@pytest.mark.parametrize("ksplit", [2, 4, 8])
@pytest.mark.parametrize("m,k", [(1, 64), (77, 192), (1000, 3072), (300, 15360)])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("use_smooth", [False, True])
@pytest.mark.parametrize("r", [0, 32])
def test_ksplit(lib, monkeypatch, ksplit, m, k, dt, use_smooth, r):
    _force_cluster(monkeypatch, ksplit)
    _case(lib, m, k, dt, use_smooth, r, seed=m * 31 + k + 7 * use_smooth + r + 5 * ksplit + (dt == "fp16"))


@pytest.mark.parametrize("ksplit", [1, 2, 8])
def test_ksplit_ranks(lib, monkeypatch, ksplit):
    _force_cluster(monkeypatch, ksplit)
    avail = {v.knobs.get("rank") for v in getattr(lib, "variants", []) if getattr(v, "op", "quantize_act") == "quantize_act"}
    for r in (16, 48, 64, 96, 128):
        if avail and r not in avail:
            continue
        _case(lib, 300, 3072, "bf16", True, r, seed=r + ksplit)
        _case(lib, 40, 128, "fp16", False, r, seed=r + ksplit + 1)
        _case(lib, 77, 192, "bf16", 2, r, seed=r + ksplit + 2)


# 6. the range form (ksplit 1): CTA b takes units [b U / G, (b + 1) U / G) of the U (row tile, 64-k step) units,
#    so a CTA may end inside one tile and go on into the next; the LoRA sums of a split tile meet in the workspace
#    (a fresh allocation: whatever bytes it held).  Grids: one more CTA than tiles, 1.5x, 2x - 1, one CTA per
#    unit (every tile split over nsteps CTAs) and whole waves of the resident CTAs.
RANGE_GRIDS = {"tiles+1": lambda t, u, f: t + 1, "1.5x": lambda t, u, f: t * 3 // 2, "2x-1": lambda t, u, f: 2 * t - 1,
               "units": lambda t, u, f: u, "fill": lambda t, u, f: -(-t // f) * f}


@pytest.mark.parametrize("grid", sorted(RANGE_GRIDS))
@pytest.mark.parametrize("m,k", [(77, 192), (1000, 3072), (300, 15360)])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("use_smooth", [False, True])
@pytest.mark.parametrize("r", [0, 32])
def test_range(lib, monkeypatch, grid, m, k, dt, use_smooth, r):
    _force_range(monkeypatch, RANGE_GRIDS[grid])
    _case(lib, m, k, dt, use_smooth, r, seed=m * 37 + k + 7 * use_smooth + r + len(grid) + (dt == "fp16"))


@pytest.mark.parametrize("grid", ["tiles+1", "1.5x", "fill"])
def test_range_ranks(lib, monkeypatch, grid):
    _force_range(monkeypatch, RANGE_GRIDS[grid])
    avail = {v.knobs.get("rank") for v in getattr(lib, "variants", []) if getattr(v, "op", "quantize_act") == "quantize_act"}
    for r in (16, 48, 64, 96, 128):
        if avail and r not in avail:
            continue
        _case(lib, 300, 3072, "bf16", True, r, seed=r + 3 * len(grid))
        _case(lib, 40, 256, "fp16", False, r, seed=r + 3 * len(grid) + 1)
        _case(lib, 300, 3072, "fp16", 2, r, seed=r + 3 * len(grid) + 2)


@pytest.mark.parametrize("fill", ["zeros", "ones", "random"])
def test_range_workspace_reuse(lib, monkeypatch, fill):
    """One workspace for every call (its bytes set once: zeros, 0xFF or random): the counters the last CTA of
    each split tile resets leave it fit for the next call, whatever the grid."""
    from svdq_loader.ops import quantize_act as qop
    ws = torch.empty(60 << 20, dtype=torch.uint8, device="cuda")      # the "units" grid at M = 4608 needs 56.7 MB
    {"zeros": lambda: ws.zero_(), "ones": lambda: ws.fill_(255),
     "random": lambda: ws.copy_(torch.randint(0, 256, ws.shape, dtype=torch.uint8, device="cuda"))}[fill]()
    def alloc(self, n):
        assert n <= ws.numel(), f"the test's workspace holds {ws.numel()} bytes, the launch needs {n}"
        return ws[:n]
    monkeypatch.setattr(qop.QuantizeLauncher, "_alloc", alloc)
    for i, grid in enumerate(["1.5x", "fill", "units", "tiles+1", "1.5x"]):
        _force_range(monkeypatch, RANGE_GRIDS[grid])
        _case(lib, 1000, 3072, "bf16", True, 32, seed=100 + i)
        _case(lib, 4608, 3072, "bf16", True, 32, seed=200 + i)


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
@pytest.mark.parametrize("use_smooth", [0, 1, 2])
@pytest.mark.parametrize("r", [0, 32])
def test_quantize_then_gemm(lib, use_smooth, r):
    from svdq_loader import driver
    arch = driver.device_arch(torch.cuda.current_device())
    if _layout() != "logical" or not any(v.op == "gemm_w4a4" and v.arch == arch and v.knobs.get("rank") == r
                                         for v in lib.variants):
        pytest.skip(f"no gemm_w4a4 variant of rank {r} for {arch} in these artifacts (a quantize-only build)")
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


# 8. two 16-row m-tiles per warp (configs/flux.yaml builds them for ranks 48 and 64; the loader takes them at
#    M >= 2048): the loader's own choice and schedule, then the cluster and range forms forced, M tails included
def _two_m_tiles(lib, dt, rank):
    names = {v.name for v in lib.variants if v.op == "quantize_act" and dict(v.knobs).get("mtiles") == 2
             and dict(v.knobs).get("rank") == rank and dict(v.knobs).get("dtype") == dt}
    if not names:
        pytest.skip(f"these artifacts build no rank-{rank} quantize_act with two m-tiles per warp for {dt}")
    return names


@pytest.mark.parametrize("rank", [48, 64])
@pytest.mark.parametrize("m,k", [(2048, 3072), (2100, 12288), (4608, 15360)])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_two_m_tiles_chosen_and_exact(lib, rank, m, k, dt):
    names = _two_m_tiles(lib, dt, rank)
    ex = lib.explain("quantize_act", m=m, k=k, rank=rank, dtype=dt)
    assert ex.chosen.name in names, ex.text()
    _case(lib, m, k, dt, True, rank, seed=m + k + rank)


@pytest.mark.parametrize("rank", [48, 64])
@pytest.mark.parametrize("form", ["cluster2", "cluster4", "tiles+1", "fill"])
def test_two_m_tiles_forced_forms(lib, monkeypatch, rank, form):
    _two_m_tiles(lib, "bf16", rank)
    if form.startswith("cluster"):
        _force_cluster(monkeypatch, int(form[-1]))
    else:
        _force_range(monkeypatch, RANGE_GRIDS[form])
    _case(lib, 2100, 3072, "bf16", True, rank, seed=7 + len(form) + rank)
    _case(lib, 2063, 256, "bf16", False, rank, seed=8 + len(form) + rank)


# 9. smooth_rcp's reciprocals made on the device: every 16-bit value, bit for bit the reference's rule
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_smooth_reciprocals_on_the_device(lib, dt):
    import numpy as np
    from svdq_loader.testing.quantize_ref import smooth_reciprocals_ref
    s = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(DT[dt])
    got = lib.smooth_reciprocals(s.cuda()).cpu()
    assert got.dtype == DT[dt]
    want = smooth_reciprocals_ref(s.float().numpy(), dt)
    g = got.float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(g), nan)
    assert np.array_equal(g[~nan].view(np.uint32), want[~nan].view(np.uint32))

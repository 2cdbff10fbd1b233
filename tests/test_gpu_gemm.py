"""GPU numerics of `gemm_w4a4` through the DSL-free loader.

Skipped where no CUDA GPU exists (CI).  On a GPU machine they need built
artifacts: `SVDQ_ARTIFACTS` (default `artifacts/`).  Set
`SVDQ_REQUIRE_GPU=1` to turn a missing GPU or missing artifacts into a
failure instead of a skip (that is how they are run on the H200).

Every case: fresh random inputs (all 16 E2M1 codes, scales over several
binades), the output poisoned with NaN beforehand inside a larger buffer
whose guard rows must stay untouched, and a float64 reference computed
independently (decode to float64, float64 matmul).  Magnitudes make each
term (main product, LoRA, wcscale, bias) move the result far beyond the
tolerance; `test_terms_matter` asserts that on the reference itself.
"""
from __future__ import annotations

import pytest

from gpu_env import ART, SEED, torch  # noqa: F401  (skips this module without a GPU or artifacts)
from svdq_loader.testing import gpu_checks  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402

import svdq_loader  # noqa: E402

pytestmark = pytest.mark.gpu

FLUX_KN = [(3072, 9216), (3072, 3072), (3072, 12288), (12288, 3072), (3072, 21504), (15360, 3072)]
MS = [1, 77, 256, 1000, 4608]


@pytest.fixture(scope="module")
def lib():
    return svdq_loader.load(ART)


def _run_case(lib, m, n, k, r, dt, wc, b, seed, prepared=False):
    res = gpu_checks.gemm_case(lib, m, n, k, r, dt, wc, b, seed, prepared=prepared, base_seed=SEED)
    assert res.ok, res.message
    return res.error


# 1. every feature combination (R x dtype x wcscale x bias) at ragged and tile-sized M
@pytest.mark.parametrize("m", [1, 77, 256, 1000])
@pytest.mark.parametrize("r", [0, 32, 64])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("wc", [True, False])
@pytest.mark.parametrize("b", [True, False])
def test_features(lib, m, r, dt, wc, b):
    _run_case(lib, m, 3072, 3072, r, dt, wc, b, seed=m * 131 + r * 7 + (dt == 'bf16') * 3 + wc * 2 + b)


# 2. every FLUX (K, N) at every M, both dtypes, R in {0, 32, 64}, wcscale and bias on
@pytest.mark.parametrize("kn", FLUX_KN, ids=[f"K{k}N{n}" for k, n in FLUX_KN])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("r", [0, 32, 64])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_flux_shapes(lib, kn, m, r, dt):
    k, n = kn
    _run_case(lib, m, n, k, r, dt, True, True, seed=(m * 7 + k + n + r) & 0xFFFF)


# 2b. M = 512 at N = 3072 (the FLUX text stream): the selection's two-way split 256-row images tile where built
#     (ranks 0, 16, 32, 64), another form at the ranks it is refused at (48, 96)
@pytest.mark.parametrize("k", [3072, 12288, 15360])
@pytest.mark.parametrize("r", [32, 48])
def test_m512_n3072(lib, k, r):
    if r not in {v.knobs["rank"] for v in lib.variants if v.op == "gemm_w4a4"}:
        pytest.skip(f"rank {r} not built in these artifacts")
    ex = lib.explain("gemm_w4a4", "sm_90a", m=509, n=3072, k=k, rank=r, dtype="bf16", sm_count=132)
    split2 = [v.name for v in lib.variants if v.op == "gemm_w4a4" and v.arch == "sm_90a" and v.knobs["rank"] == r
              and v.knobs["out_dtype"] == "bf16" and v.knobs.get("schedule") == "ws_splitk2"
              and v.knobs.get("tile_m") == 256]
    assert len(split2) <= 1
    if r == 48:
        assert split2 == []                                  # refused at build time (a stack frame)
    if split2:
        assert ex.chosen.name == split2[0], ex.text()
    _run_case(lib, 509, 3072, k, r, "bf16", True, True, seed=k + r)


# 3. the other ranks the kernel family supports, at one shape
@pytest.mark.parametrize("r", [16, 48, 96, 128, 256])
def test_other_ranks(lib, r):
    avail = {v.knobs["rank"] for v in lib.variants if v.op == "gemm_w4a4"}
    if r not in avail:
        pytest.skip(f"rank {r} not built in these artifacts")
    _run_case(lib, 1000, 3072, 3072, r, "bf16", True, True, seed=r)


def test_prepared_weight_matches_direct(lib):
    _run_case(lib, 300, 3072, 3072, 32, "bf16", True, True, seed=5, prepared=True)


def test_terms_matter():
    """The inputs are sized so that dropping or mis-scaling any term fails the tolerance."""
    p = ref.random_problem(77, 3072, 3072, 32, seed=1, out_dtype="bf16", wcscale=True, bias=True, device="cuda")
    sens = ref.term_sensitivity(p)
    for term, s in sens.items():
        assert s >= 0.1, f"term {term} moves the output by only {s:.3g} (relative)"


def test_current_stream_and_graph_capture(lib):
    """Launches go on the caller's current stream and can be captured in a CUDA graph."""
    p = ref.random_problem(128, 3072, 3072, 32, seed=9, out_dtype="bf16", device="cuda")
    w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
    expect = ref.reference_torch_f64(**p)
    s = torch.cuda.Stream()
    out = torch.full((128, 3072), float("nan"), dtype=torch.bfloat16, device="cuda")
    lib.gemm_w4a4(p["act"], w, p["ascales"], lora_act_in=p["lora_act_in"], out=out)  # warm (loads kernels)
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            lib.gemm_w4a4(p["act"], w, p["ascales"], lora_act_in=p["lora_act_in"], out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "capture must not execute the kernel"
    g.replay()
    torch.cuda.synchronize()
    rel = float(torch.linalg.vector_norm(out.double() - expect) / torch.linalg.vector_norm(expect))
    assert rel <= 1e-2


def test_wrong_arch_is_refused_before_loading(lib):
    """Blackwell variants (datacenter and GeForce/workstation) in the same artifact set are never loaded
    on this sm_90a device: selection picks the sm_90a ones, and loading one directly is refused naming
    both archs, with no CUDA fault."""
    from svdq_loader.errors import DeviceMismatch, UnsupportedProblem
    blackwell = [v for v in lib.variants if v.arch in ("sm_100a", "sm_103a", "sm_120a", "sm_121a")]
    if not blackwell:
        pytest.skip("these artifacts hold no Blackwell variants")
    per_arch = {}
    for v in blackwell:                       # up to two variants of each op on every Blackwell arch
        per_arch.setdefault((v.arch, v.op), []).append(v)
    for v in [v for vs in per_arch.values() for v in vs[:2]]:
        with pytest.raises(DeviceMismatch, match=rf"{v.name} is built for {v.arch} but device 0 is sm_90a"):
            lib._launcher(v.name, 0, False)
    x = torch.randn(16, 3072, dtype=torch.bfloat16, device="cuda")
    act, asc, _ = lib.quantize_act(x)          # the sm_90a variant, logical scales
    assert asc.shape == (16, 3072 // 16)
    torch.cuda.synchronize()
    # a problem only an sm_100a kernel could serve names the device's arch and what was built
    feats = ("bf16", 0, "blocked")
    with pytest.raises(UnsupportedProblem, match=r"no sm_90a quantize_act kernel for dtype=bf16, rank=0, "
                                                 r"scale_layout=blocked"):
        lib.explain("quantize_act", "sm_90a", feats, m=16, k=3072)
    # the context is still healthy
    assert torch.ones(4, device="cuda").sum().item() == 4


def test_bad_arguments_raise_before_gpu_work(lib):
    p = ref.random_problem(64, 3072, 3072, 32, seed=4, out_dtype="bf16", device="cuda")
    from svdq_loader.errors import InvalidArgument, UnsupportedProblem
    with pytest.raises(InvalidArgument, match="contiguous"):
        lib.gemm_w4a4(p["act"].t().contiguous().t(), p["wgt"], p["ascales"], p["wscales"],
                      lora_act_in=p["lora_act_in"], lora_up=p["lora_up"])
    with pytest.raises(InvalidArgument, match="dtype"):
        lib.gemm_w4a4(p["act"], p["wgt"], p["ascales"], p["wscales"],
                      lora_act_in=p["lora_act_in"].half(), lora_up=p["lora_up"])
    with pytest.raises((UnsupportedProblem, InvalidArgument), match="N=3040"):   # the call, or prepare_weight
        w = torch.randint(0, 256, (3040, 1536), dtype=torch.uint8, device="cuda")
        ws = p["wscales"][:1].expand(3040, -1).contiguous()
        lib.gemm_w4a4(p["act"], w, p["ascales"], ws)


def test_launch_from_a_fresh_thread_and_foreign_context(lib):
    """A thread with no current CUDA context, and one with a foreign context current, both launch
    on the device's primary context (torch's), and the caller's current context is left as it was."""
    import threading

    from cuda.bindings import driver as cu
    p = ref.random_problem(96, 3072, 3072, 32, seed=11, out_dtype="fp16", device="cuda")
    expect = ref.reference_torch_f64(**p)
    outs = {tag: torch.full((96, 3072), float("nan"), dtype=torch.float16, device="cuda")
            for tag in ("fresh", "foreign")}
    torch.cuda.synchronize()
    seen = {}

    def work(tag):
        ctx = None
        if tag == "foreign":
            err, dev = cu.cuDeviceGet(0)
            try:                                  # cuda-bindings 13.x: (params, flags, dev); 12.x: (flags, dev)
                err, ctx = cu.cuCtxCreate(None, 0, dev)
            except TypeError:
                err, ctx = cu.cuCtxCreate(0, dev)
            assert err == cu.CUresult.CUDA_SUCCESS, err
        lib.gemm_w4a4(p["act"], p["wgt"], p["ascales"], p["wscales"], lora_act_in=p["lora_act_in"],
                      lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"], out=outs[tag])
        err, cur = cu.cuCtxGetCurrent()
        seen[tag] = int(cur) == int(ctx) if ctx is not None else True
        if ctx is not None:
            cu.cuCtxDestroy(ctx)

    for tag in outs:
        t = threading.Thread(target=work, args=(tag,))
        t.start()
        t.join()
    torch.cuda.synchronize()
    assert seen == {"fresh": True, "foreign": True}, f"caller's context not restored: {seen}"
    for tag, out in outs.items():
        rel = float(torch.linalg.vector_norm(out.double() - expect) / torch.linalg.vector_norm(expect))
        assert rel <= 2e-3, (tag, rel)

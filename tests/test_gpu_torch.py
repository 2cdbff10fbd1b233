"""W4A4Linear and a FLUX transformer on the GPU (run on the H200; skipped without a GPU or artifacts).

Every layer output is compared with `W4A4Linear.reference` (float64 of the
quantized math, exact quantizer rules) on fresh random inputs; outputs land in
memory poisoned with NaN first.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
from gpu_env import ART, SEED, torch

import svdq_loader
from svdq_loader.errors import UnsupportedProblem
from svdq_loader.torch import W4A4Linear, load_quantized, quantize_model

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-2


@pytest.fixture(scope="module")
def lib():
    lib = svdq_loader.load(ART)
    lib.preload()
    return lib


def poison():
    """Fill the caching allocator's free memory with NaN, so an output the kernel never writes shows."""
    t = torch.full((256 << 20,), float("nan"), dtype=torch.bfloat16, device=DEV)
    del t


def served(lib, k, n, rank, dtype, bias=True):
    lin = torch.nn.Linear(k, n, bias=bias, device="meta", dtype=dtype)
    from svdq_loader.torch import eligibility
    why = eligibility(lin, lib.variants, "sm_90a", rank)
    if why is not None:
        pytest.skip(f"not built: {why}")


def make_linear(k, n, dtype, seed, bias=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(DEV, dtype)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rank,smooth", [(0, False), (32, False), (32, True), (64, True)])
def test_layer_matches_the_float64_reference(lib, dtype, rank, smooth):
    k, n = 3072, 1152
    served(lib, k, n, rank, dtype)
    lin = make_linear(k, n, dtype, SEED)
    g = torch.Generator(device="cpu").manual_seed(SEED + 1)
    calib = (torch.randn(64, k, generator=g) * (1 + 20 * (torch.rand(k, generator=g) > 0.98))).to(DEV, dtype)
    layer = W4A4Linear.from_linear(lin, rank=rank, act_amax=calib.abs().amax(0).float() if smooth else None, lib=lib)
    for m in (1, 77, 300, 4608):
        x = (torch.randn(m, k, generator=g) * 2).to(DEV, dtype)
        poison()
        y = layer(x)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.isfinite(y).all(), (m, SEED)
        e = rel(y, layer.reference(x))
        assert e < TOL, (m, e, SEED)
        assert rel(y, lin(x)) < 0.25, (m, SEED)              # and it is still the linear it replaced


def test_layer_smooth_rcp_made_once_and_kept_current(lib):
    """A smoothing layer passes quantize_act its factors' reciprocals (smooth_rcp), made at the first forward and
    again only when smooth changes: its result is the one smooth= gives, bit for bit, before and after an
    in-place change of smooth."""
    from svdq_loader.torch import _ops
    k, n = 3072, 3072
    served(lib, k, n, 32, torch.bfloat16)
    lin = make_linear(k, n, torch.bfloat16, SEED + 7)
    g = torch.Generator(device="cpu").manual_seed(SEED + 8)
    amax = (torch.rand(k, generator=g) * 8 + 0.1).to(DEV)
    layer = W4A4Linear.from_linear(lin, rank=32, act_amax=amax, lib=lib)
    x = (torch.randn(300, k, generator=g) * 2).to(DEV, torch.bfloat16)
    for step in range(2):
        y = layer(x)
        rcp = layer._rcp[1]
        assert torch.equal(rcp, lib.smooth_reciprocals(layer.smooth)), step
        want = _ops.quantize(lib, x, layer.smooth, layer.lora_down)            # smooth= itself
        got = _ops.quantize(lib, x, layer.smooth, layer.lora_down, smooth_rcp=rcp)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
        assert rel(y, layer.reference(x)) < TOL, step
        layer(x)
        assert layer._rcp[1] is rcp, step                                     # kept while smooth is unchanged
        with torch.no_grad():
            layer.smooth.mul_(1.75)                                           # in place: a new version


def test_layer_input_forms(lib):
    k, n = 3072, 3072
    served(lib, k, n, 32, torch.bfloat16)
    layer = W4A4Linear.from_linear(make_linear(k, n, torch.bfloat16, SEED + 2), rank=32, lib=lib)
    g = torch.Generator(device="cpu").manual_seed(SEED + 3)
    x3 = torch.randn(2, 40, k, generator=g).to(DEV, torch.bfloat16)
    y3 = layer(x3)
    assert y3.shape == (2, 40, n) and rel(y3, layer.reference(x3)) < TOL
    xt = torch.randn(k, 33, generator=g).to(DEV, torch.bfloat16).t()          # non-contiguous
    assert rel(layer(xt), layer.reference(xt.contiguous())) < TOL
    flat = torch.randn(33 * k + 1, generator=g).to(DEV, torch.bfloat16)
    xm = flat[1:].view(33, k)                                                 # misaligned data pointer
    assert xm.data_ptr() % 16 and rel(layer(xm), layer.reference(xm)) < TOL


def test_cuda_graph_capture_and_replay(lib):
    k, n = 3072, 3072
    served(lib, k, n, 32, torch.bfloat16)
    layer = W4A4Linear.from_linear(make_linear(k, n, torch.bfloat16, SEED + 4), rank=32, lib=lib)
    g = torch.Generator(device="cpu").manual_seed(SEED + 5)
    x = torch.randn(500, k, generator=g).to(DEV, torch.bfloat16)
    layer(x)                                       # weight prepared, kernels loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for i in range(3):
        x.copy_(torch.randn(500, k, generator=g).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, layer(x)), (i, SEED)
        assert rel(y, layer.reference(x)) < TOL


class Double(torch.nn.Module):
    """An op that is exact in bf16 under any compiler (so compiled and eager inputs to the layer agree)."""

    def forward(self, x):
        return x * 2.0


def test_torch_compile_matches_eager(lib):
    """Today the kernel calls are graph breaks (torch.compiler.disable); the result must not change."""
    k, n = 3072, 3072
    served(lib, k, n, 32, torch.bfloat16)
    layer = W4A4Linear.from_linear(make_linear(k, n, torch.bfloat16, SEED + 6), rank=32, lib=lib)
    model = torch.nn.Sequential(Double(), layer, Double())
    x = torch.randn(256, k, device=DEV, dtype=torch.bfloat16)
    compiled = torch.compile(model)
    assert torch.equal(compiled(x), model(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph_through_custom_ops(lib, mode):
    """Compiled layers go through torch.ops.svdq.* (svdq_loader/torch/_ops.py): no graph break."""
    k, n = 3072, 3072
    served(lib, k, n, 32, torch.bfloat16)
    layer = W4A4Linear.from_linear(make_linear(k, n, torch.bfloat16, SEED + 7), rank=32, lib=lib)
    model = torch.nn.Sequential(Double(), layer, Double())
    x = torch.randn(256, k, device=DEV, dtype=torch.bfloat16)
    want = model(x)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(3):                                 # reduce-overhead records a graph after warm-up calls
        got = compiled(x)
    assert torch.equal(got.clone(), want)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def flux():
    pytest.importorskip("diffusers")
    spec = importlib.util.spec_from_file_location("flux_w4a4", os.path.join(ROOT, "examples", "flux_w4a4.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flux_one_double_one_single_block_at_1024(lib, flux, tmp_path):
    """FLUX.1-dev at full width, 1 + 1 blocks, 4096 + 512 tokens: every swapped layer vs float64, round trip."""
    st = pytest.importorskip("safetensors.torch")
    cfg = dict(flux.FLUX_DEV_CONFIG, num_layers=1, num_single_layers=1)
    model = flux.build_flux(cfg, device=DEV, seed=SEED)
    inputs = flux.make_inputs(cfg, device=DEV, seed=SEED + 1)
    y_bf16 = flux.step(model, inputs)
    try:
        report = quantize_model(model, lib, rank=32, filter=flux.in_blocks, svd="lowrank")
    except UnsupportedProblem as e:                     # pragma: no cover - artifacts without the FLUX shapes
        pytest.skip(str(e))
    assert len(report.swapped) == 14 and report.arch == "sm_90a", str(report)
    check = flux.LayerCheck(model, TOL)
    poison()
    y = flux.step(model, inputs)
    check.remove()
    s = check.summary()
    assert s["layers"] == 14 and s["all_ok"], (s["max_rel_err"], s["worst_layer"], s["failed"], SEED)
    assert {r["m"] for r in s["per_layer"].values()} >= {4096, 512, 4608}
    assert torch.isfinite(y).all()
    e = flux.rel_error(y, y_bf16)
    print(f"flux 1+1 blocks: W4A4 vs bf16 rel err {e:.4f}, worst layer {s['worst_layer']} {s['max_rel_err']:.2e}")
    assert e < 0.5, (e, SEED)
    path = tmp_path / "flux_1_1.safetensors"
    st.save_file(model.state_dict(), str(path))
    fresh = flux.build_flux(cfg, device=DEV, seed=SEED + 99)
    load_quantized(fresh, st.load_file(str(path), device="cuda"), lib=lib)
    assert torch.equal(flux.step(fresh, inputs), y)

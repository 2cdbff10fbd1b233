"""The real client on the CPU: diffusers' FluxTransformer2DModel, swapped by quantize_model.

* A small FLUX (one double and one single block, hidden 128) against a real
  build of configs/tiny.yaml: the swap, the report (swapped and skipped with
  the selector's reasons) and the state-dict round trip through safetensors.
* The full FLUX.1-dev configuration on the meta device against the variants
  configs/flux.yaml enumerates (nothing compiled): which block linears each
  arch serves, and the exact (K, N) set of the model.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from svdq_loader.torch import W4A4Linear, load_quantized, quantize_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("flux_w4a4", os.path.join(ROOT, "examples", "flux_w4a4.py"))
flux = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flux)

#: FLUX.1-dev's structure at hidden 128 (2 heads of 64): every linear still divisible as the GEMM needs.
SMALL = dict(flux.FLUX_DEV_CONFIG, num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=64,
             joint_attention_dim=128, pooled_projection_dim=64, axes_dims_rope=(16, 24, 24))
#: Per block, independently of the model code: (K, N) of every linear after q/k/v fusion, hidden d, mlp 4d.
def block_shapes(d):
    double = [(d, 6 * d)] * 2 + [(d, 3 * d)] * 2 + [(d, d)] * 2 + [(d, 4 * d)] * 2 + [(4 * d, d)] * 2
    single = [(d, 3 * d), (d, 3 * d), (d, 4 * d), (5 * d, d)]
    return double, single


def small_model(seed=0):
    return flux.build_flux(SMALL, device="cpu", seed=seed)


def test_small_flux_swap_report_and_safetensors_round_trip(tiny_artifacts, tmp_path):
    import svdq_loader
    st = pytest.importorskip("safetensors.torch")
    lib = svdq_loader.load(str(tiny_artifacts))
    model = small_model()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    report = quantize_model(model, lib, rank=32, filter=flux.in_blocks, svd="lowrank")
    double, single = block_shapes(128)
    assert report.arch == "sm_90a"
    assert sorted((k, n) for _, k, n, _ in report.swapped) == sorted(double + single)
    assert all(name.startswith(flux.BLOCK_PREFIXES) for name, *_ in report.swapped)
    assert len(report.swapped) + len(report.skipped) == n_linear
    assert {why for *_, why in report.skipped} == {"excluded by the filter"}
    swapped = {n for n, m in model.named_modules() if isinstance(m, W4A4Linear)}
    assert swapped == {name for name, *_ in report.swapped}
    assert not any(isinstance(m, torch.nn.Linear) and n.startswith(flux.BLOCK_PREFIXES)
                   for n, m in model.named_modules())
    assert "14 linear(s) swapped" in str(report)

    path = tmp_path / "flux_small_w4a4.safetensors"
    st.save_file(model.state_dict(), str(path))
    fresh = small_model(seed=123)                                      # other random weights
    names = load_quantized(fresh, st.load_file(str(path)), lib=lib)
    assert set(names) == swapped
    a, b = model.state_dict(), fresh.state_dict()
    assert list(a) == list(b)
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y), key
    layer = fresh.get_submodule("single_transformer_blocks.0.proj_out")
    assert isinstance(layer, W4A4Linear) and layer.lib is lib
    xin = torch.randn(5, 640, dtype=torch.bfloat16)
    assert torch.equal(layer.reference(xin), model.get_submodule("single_transformer_blocks.0.proj_out").reference(xin))


def test_small_flux_skips_what_is_not_built(tiny_artifacts):
    import svdq_loader
    lib = svdq_loader.load(str(tiny_artifacts))
    model = small_model()
    report = quantize_model(model, lib, rank=16, filter=flux.in_blocks, dry_run=True)   # tiny builds R 0 and 32
    assert report.swapped == []
    block = [r for r in report.skipped if r[0].startswith(flux.BLOCK_PREFIXES)]
    assert len(block) == 14 and all("rank=16" in why and "gemm_w4a4" in why for *_, why in block)
    model.to(torch.float16)
    report = quantize_model(model, lib, rank=32, filter=flux.in_blocks, dry_run=True)
    why = {name: w for name, _, _, w in report.skipped}
    assert "fp16" in why["transformer_blocks.0.attn.to_qkv"] and "built: " in why["transformer_blocks.0.attn.to_qkv"]
    assert not any(isinstance(m, W4A4Linear) for m in model.modules())   # dry run swaps nothing
    model.get_submodule("transformer_blocks.0.ff.net.2").float()
    report = quantize_model(model, lib, rank=32, filter=flux.in_blocks, dry_run=True)
    assert "dtype torch.float32" in {n: w for n, _, _, w in report.skipped}["transformer_blocks.0.ff.net.2"]


@dataclass(frozen=True)
class Planned:
    """A variant the config would build, as the selector reads it (no compile, no manifest)."""
    name: str
    op: str
    arch: str
    knobs: dict = field(hash=False)
    requirements: dict = field(hash=False)


def planned_variants(config_path):
    pytest.importorskip("cutlass")
    from svdq_aot.config import load_config
    from svdq_aot.variants import enumerate_variants
    valid, _ = enumerate_variants(load_config(config_path))
    return [Planned(v.name, v.op, v.arch, v.knob_dict, v.requirements()) for v in valid]


def test_flux_dev_shapes_against_the_flux_config():
    lib = type("Planned", (), {"variants": planned_variants(os.path.join(ROOT, "configs", "flux.yaml"))})()
    model = flux.build_flux(device="meta")
    double, single = block_shapes(3072)
    want = sorted(double * 19 + single * 38)
    sm90 = quantize_model(model, lib, rank=32, filter=flux.in_blocks, arch="sm_90a", dry_run=True)
    assert sorted((k, n) for _, k, n, _ in sm90.swapped) == want
    assert {(k, n) for k, n in want} == {(3072, 18432), (3072, 9216), (3072, 3072), (3072, 12288),
                                         (12288, 3072), (15360, 3072)}
    # Blackwell: the tcgen05 family (sm_100a/103a) and the warp-level family (sm_120a/121a) serve every
    # FLUX linear too
    for arch in ("sm_100a", "sm_103a", "sm_120a", "sm_121a"):
        bw = quantize_model(model, lib, rank=32, filter=flux.in_blocks, arch=arch, dry_run=True)
        assert sorted((k, n) for _, k, n, _ in bw.swapped) == want, arch
    # an arch the config does not build: every block linear skipped, with the reason
    sm89 = quantize_model(model, lib, rank=32, filter=flux.in_blocks, arch="sm_89", dry_run=True)
    blocks = [r for r in sm89.skipped if r[0].startswith(flux.BLOCK_PREFIXES)]
    assert sm89.swapped == [] and len(blocks) == len(want)
    assert all("sm_89" in why for *_, why in blocks)
    # every rank the config lists is served on sm_90a, one it does not list is not
    r128 = quantize_model(model, lib, rank=128, filter=flux.in_blocks, arch="sm_90a", dry_run=True)
    assert len(r128.swapped) == len(want) and not [r for r in r128.skipped if r[0].startswith(flux.BLOCK_PREFIXES)]
    r80 = quantize_model(model, lib, rank=80, filter=flux.in_blocks, arch="sm_90a", dry_run=True)
    assert r80.swapped == [] and all("rank=80" in r[3] for r in r80.skipped if r[0].startswith(flux.BLOCK_PREFIXES))


class EmulatedLibrary:
    """The library's three calls in plain torch ops (svdq_loader.testing.torch_quant), for CPU plumbing tests."""

    def __init__(self, variants):
        self.variants, self.prepared = variants, 0

    def quantize_act(self, x, *, smooth=None, lora_down=None, compute="exact"):
        from svdq_loader.testing import torch_quant
        assert x.is_contiguous() and x.data_ptr() % 16 == 0 and compute == "exact"
        return torch_quant.quantize_act(x, smooth, lora_down)

    def prepare_weight(self, wgt, wscales, *, lora_up=None, wcscale=None, bias=None, compute="exact"):
        self.prepared += 1
        return (wgt, wscales, lora_up, wcscale, bias)

    def gemm_w4a4(self, act, w, ascales, *, lora_act_in=None, out_dtype=None):
        from svdq_loader.testing import torch_quant
        wgt, wscales, lora_up, wcscale, bias = w
        return torch_quant.w4a4_unfused(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias,
                                        out_dtype=out_dtype)


def test_small_flux_forward_plumbing_on_an_emulated_library(tiny_artifacts):
    """The model's forward through W4A4Linear (reshapes, smoothing, LoRA, weight cache) with torch-op kernels."""
    import svdq_loader
    from svdq_loader.torch import calibrate
    model = small_model()
    inputs = flux.make_inputs(SMALL, image_tokens=64, text_tokens=16, device="cpu")
    y_bf16 = flux.step(model, inputs)
    amax = calibrate(model, lambda: flux.step(model, inputs), filter=flux.in_blocks)
    assert len(amax) == 14 and all(a.shape == (m.in_features,) for a, m in
                                   ((amax[n], model.get_submodule(n)) for n in amax))
    lib = EmulatedLibrary(svdq_loader.load(str(tiny_artifacts)).variants)
    quantize_model(model, lib, rank=32, filter=flux.in_blocks, act_amax=amax)
    assert all(m.smooth is not None for m in model.modules() if isinstance(m, W4A4Linear))
    check = flux.LayerCheck(model, 1e-2)
    y = flux.step(model, inputs)
    check.remove()
    s = check.summary()
    assert s["layers"] == 14 and s["all_ok"], (s["max_rel_err"], s["worst_layer"])
    assert {r["m"] for r in s["per_layer"].values()} == {1, 16, 64, 80}       # temb, text, image, joint
    assert lib.prepared == 14
    flux.step(model, inputs)
    assert lib.prepared == 14                                                 # the weight side is prepared once
    assert torch.isfinite(y).all() and flux.rel_error(y, y_bf16) < 0.3


def test_example_plan_mode_reports_the_whole_model(tiny_artifacts, tmp_path, capsys):
    """`examples/flux_w4a4.py --plan`: the full FLUX.1-dev model on the meta device, no GPU, no weights."""
    import json
    out = tmp_path / "plan.json"
    assert flux.main(["--plan", "--artifacts", str(tiny_artifacts), "--json", str(out)]) == 0
    plan = json.loads(out.read_text())["plan"]
    assert plan["arch"] == "sm_90a" and len(plan["swapped"]) == 342
    assert {r["reason"] for r in plan["skipped"]} == {"excluded by the filter"} and len(plan["skipped"]) == 10
    assert "342 linear(s) swapped, 10 skipped" in capsys.readouterr().out

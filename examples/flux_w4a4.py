"""FLUX.1-dev's transformer on svdq-aot W4A4 kernels: swap, check, time, profile.

    python examples/flux_w4a4.py --artifacts artifacts --json flux_w4a4.json        # on a GPU
    python examples/flux_w4a4.py --artifacts artifacts --plan                       # no GPU: which linears serve

Builds diffusers' `FluxTransformer2DModel` from the published FLUX.1-dev
configuration (written out below: nothing is downloaded) with random bf16
weights directly on the GPU, fuses the q/k/v projections, and:

1. runs one denoising step at 1024² (4096 image + 512 text tokens) in bf16,
   eager and with `torch.compile` (each transformer block by default,
   `--compile-scope model` for the whole model): step time, peak GPU memory, weight bytes;
2. swaps every linear of the transformer blocks for a `W4A4Linear`
   (SVDQuant's offline recipe: rank-R SVD branch + NVFP4 residual with
   per-channel wcscale; random weights have no outliers, so no smoothing
   unless --calibrate) and prints the swap report;
3. checks every swapped layer's output on one real input against the
   float64 reference of its quantized math (`W4A4Linear.reference`);
4. times the W4A4 step eager and compiled, and reports the relative error of
   its output against the bf16 model's;
5. breaks both eager steps down per GPU kernel with the torch profiler.

Prints a table and writes everything as JSON (--json).  `--plan` builds the
model on the meta device and only prints which linears the artifacts serve.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

#: FLUX.1-dev transformer configuration, as published with the model (diffusers' FluxTransformer2DModel).
FLUX_DEV_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.")
_UNFUSED = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


# ---------------------------------------------------------------------------
# The model and its inputs
# ---------------------------------------------------------------------------

def build_flux(config: dict | None = None, *, device="cuda", dtype=torch.bfloat16, seed: int = 0, fuse_qkv=True):
    """A FluxTransformer2DModel with random weights, built directly on `device` in `dtype`."""
    from diffusers import FluxTransformer2DModel
    cfg = dict(FLUX_DEV_CONFIG if config is None else config)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.eval().requires_grad_(False)
    if fuse_qkv:
        fuse_qkv_projections(model)
    return model


def fuse_qkv_projections(model) -> None:
    """One q/k/v linear per attention (3072 -> 9216 in FLUX), as SVDQuant checkpoints have; unfused ones dropped."""
    model.fuse_qkv_projections()
    for m in model.modules():
        if getattr(m, "fused_projections", False):
            for name in _UNFUSED:
                if isinstance(getattr(m, name, None), torch.nn.Linear):
                    delattr(m, name)


def in_blocks(name: str, linear) -> bool:
    """The swap filter: every linear inside the double and single transformer blocks."""
    return name.startswith(BLOCK_PREFIXES)


def make_inputs(config: dict | None = None, *, image_tokens=4096, text_tokens=512, batch=1, device="cuda",
                dtype=torch.bfloat16, seed: int = 1) -> dict:
    """Keyword arguments of one denoising step (packed latents, T5 and CLIP embeddings, ids, timestep, guidance)."""
    cfg = dict(FLUX_DEV_CONFIG if config is None else config)
    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(f"image_tokens must be a square (a square latent grid), got {image_tokens}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    kw = dict(
        hidden_states=rnd(batch, image_tokens, cfg["in_channels"]),
        encoder_hidden_states=rnd(batch, text_tokens, cfg["joint_attention_dim"]),
        pooled_projections=rnd(batch, cfg["pooled_projection_dim"]),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        img_ids=img_ids.reshape(-1, 3).to(device, dtype),
        txt_ids=torch.zeros(text_tokens, 3, device=device, dtype=dtype),
        return_dict=False,
    )
    if cfg.get("guidance_embeds"):
        kw["guidance"] = torch.full((batch,), 3.5, device=device, dtype=dtype)
    return kw


def step(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------

def time_step(fn, *, warmup: int, iters: int) -> dict:
    """Median and min milliseconds of `fn()` over `iters` runs (CUDA events), after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return {"median_ms": times[len(times) // 2], "min_ms": times[0], "runs": len(times)}


def peak_memory(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def rel_error(y, ref) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm())


def kernel_category(name: str) -> str:
    n = name.lower()
    if "svdq_gemm_w4a4" in n:
        return "w4a4 gemm (ours)"
    if "svdq_quantize_act" in n:
        return "quantize_act (ours)"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_")):
        return "bf16 gemm (cuBLAS)"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    return "elementwise/norm/other"


def profile_step(fn, *, top: int = 15) -> dict:
    """GPU time per kernel of one `fn()` (torch profiler), by kernel and by category."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key, "calls": e.count, "gpu_us": float(us)})
    rows.sort(key=lambda r: -r["gpu_us"])
    cats: dict = {}
    for r in rows:
        c = kernel_category(r["kernel"])
        cats[c] = cats.get(c, 0.0) + r["gpu_us"]
    return {"total_gpu_us": sum(r["gpu_us"] for r in rows), "by_category_us": dict(sorted(cats.items())),
            "top_kernels": rows[:top]}


class LayerCheck:
    """Forward hooks: each W4A4Linear's kernel output vs `reference(input)` on the same input, once."""

    def __init__(self, model, tol: float):
        from svdq_loader.torch import W4A4Linear
        self.tol, self.results, self.hooks = tol, {}, []
        for name, m in model.named_modules():
            if isinstance(m, W4A4Linear):
                self.hooks.append(m.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(mod, args, out):
            if name not in self.results:
                x = args[0]
                err = rel_error(out, mod.reference(x))
                self.results[name] = {"m": int(x.numel() // x.shape[-1]), "k": mod.in_features,
                                      "n": mod.out_features, "rel_err": err, "ok": err <= self.tol}
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()

    def summary(self) -> dict:
        errs = [r["rel_err"] for r in self.results.values()]
        worst = max(self.results, key=lambda k: self.results[k]["rel_err"]) if errs else None
        return {"layers": len(errs), "tolerance": self.tol, "all_ok": all(r["ok"] for r in self.results.values()),
                "max_rel_err": max(errs) if errs else None, "worst_layer": worst,
                "failed": [k for k, r in self.results.items() if not r["ok"]], "per_layer": self.results}


def compile_targets(model, scope: str) -> list:
    """What `--compile-scope` compiles: every transformer block (``blocks``: the repeated blocks share one
    compiled graph per block class, so compilation takes seconds per class) or the whole model (``model``)."""
    if scope == "model":
        return [model]
    return [b for name in ("transformer_blocks", "single_transformer_blocks") for b in getattr(model, name)]


def try_compile(model, inputs, timing: dict, label: str, results: dict, scope: str = "blocks") -> None:
    """Time the step with `torch.compile` applied in place (`nn.Module.compile`) to `compile_targets`;
    a failure is recorded, not raised.  The compilation is undone afterwards."""
    targets = compile_targets(model, scope)
    try:
        t0 = time.perf_counter()
        for t in targets:
            t.compile()
        step(model, inputs)
        torch.cuda.synchronize()
        results[label] = {"scope": scope, "compile_and_first_step_s": time.perf_counter() - t0,
                          **time_step(lambda: step(model, inputs), **timing),
                          "peak_bytes": peak_memory(lambda: step(model, inputs))}
    except Exception as e:  # noqa: BLE001 - report, keep the other numbers
        results[label] = {"scope": scope, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    finally:
        for t in targets:
            t._compiled_call_impl = None      # back to eager (what nn.Module.compile set)
        torch._dynamo.reset()


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def plan(args) -> int:
    """Meta-device model: which linears the artifacts serve (no GPU, no weights)."""
    import svdq_loader
    from svdq_loader.torch import quantize_model
    model = build_flux(device="meta", seed=0)
    lib = svdq_loader.load(args.artifacts)
    report = quantize_model(model, lib, rank=args.rank, filter=in_blocks, arch=args.arch, dry_run=True)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": report.to_dict()}, f, indent=1)
    return 0


def run(args, device="cuda") -> dict:
    import svdq_loader
    from svdq_loader.torch import calibrate, quantize_model, weight_bytes
    dev = torch.device(device)
    lib = svdq_loader.load(args.artifacts)
    timing = {"warmup": args.warmup, "iters": args.iters}
    out: dict = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                 "tokens": {"image": args.image_tokens, "text": args.text_tokens}, "rank": args.rank,
                 "svd": args.svd, "dtype": "bf16"}
    cfg = dict(FLUX_DEV_CONFIG)
    if args.layers is not None:
        cfg["num_layers"] = args.layers
    if args.single_layers is not None:
        cfg["num_single_layers"] = args.single_layers
    out["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}
    t0 = time.perf_counter()
    model = build_flux(cfg, device=dev, seed=args.seed)
    out["build_s"] = time.perf_counter() - t0
    inputs = make_inputs(cfg, image_tokens=args.image_tokens, text_tokens=args.text_tokens, device=dev)
    res: dict = {}
    out["weight_bytes"] = {"bf16": weight_bytes(model)}
    y_bf16 = step(model, inputs).float()
    res["bf16_eager"] = {**time_step(lambda: step(model, inputs), **timing),
                         "peak_bytes": peak_memory(lambda: step(model, inputs))}
    prof_bf16 = profile_step(lambda: step(model, inputs)) if args.profile else None
    if "bf16" in args.compile:
        try_compile(model, inputs, timing, "bf16_compiled", res, args.compile_scope)

    amax = calibrate(model, lambda: step(model, inputs), filter=in_blocks) if args.calibrate else None
    t0 = time.perf_counter()
    report = quantize_model(model, lib, rank=args.rank, filter=in_blocks, act_amax=amax, svd=args.svd)
    torch.cuda.synchronize()
    out["quantize_s"] = time.perf_counter() - t0
    out["swap"] = report.to_dict()
    print(report)
    torch.cuda.empty_cache()
    out["weight_bytes"]["w4a4"] = weight_bytes(model)
    lib.preload()

    check = LayerCheck(model, args.layer_tol)
    y_w4 = step(model, inputs).float()
    check.remove()
    out["layer_check"] = check.summary()
    out["rel_err_vs_bf16"] = rel_error(y_w4, y_bf16)
    out["finite"] = bool(torch.isfinite(y_w4).all())
    res["w4a4_eager"] = {**time_step(lambda: step(model, inputs), **timing),
                         "peak_bytes": peak_memory(lambda: step(model, inputs))}
    if args.profile:
        out["profile"] = {"bf16_eager": prof_bf16, "w4a4_eager": profile_step(lambda: step(model, inputs))}
    if "w4a4" in args.compile:
        try_compile(model, inputs, timing, "w4a4_compiled", res, args.compile_scope)
    if args.fp8:
        # the same swapped model in the FP8-compute mode (sm_90a; docs/design.md section 2): each layer's weight is
        # prepared again for it, and the layer check compares with the mode's own float64 reference
        from svdq_loader.torch import W4A4Linear
        for mod in model.modules():
            if isinstance(mod, W4A4Linear):
                mod.set_compute("fp8")
        torch.cuda.empty_cache()
        check = LayerCheck(model, args.layer_tol)
        y_f8 = step(model, inputs).float()
        check.remove()
        out["fp8"] = {"layer_check": check.summary(), "rel_err_vs_bf16": rel_error(y_f8, y_bf16),
                      "rel_err_vs_w4a4": rel_error(y_f8, y_w4), "finite": bool(torch.isfinite(y_f8).all())}
        res["w4a4_fp8_eager"] = {**time_step(lambda: step(model, inputs), **timing),
                                 "peak_bytes": peak_memory(lambda: step(model, inputs))}
        if "w4a4" in args.compile:
            try_compile(model, inputs, timing, "w4a4_fp8_compiled", res, args.compile_scope)
    out["results"] = res
    return out


def table(out: dict) -> str:
    gib = 2 ** 30
    lines = [f"FLUX.1-dev transformer, {out['config']['num_layers']}+{out['config']['num_single_layers']} blocks, "
             f"{out['tokens']['image']}+{out['tokens']['text']} tokens, rank {out['rank']}, on {out['gpu']}",
             f"{'run':<24} {'step ms (median)':>17} {'min ms':>9} {'peak GiB':>9}"]
    for label, r in out["results"].items():
        if "scope" in r:
            label = f"{label}[{r['scope']}]"
        if "error" in r:
            lines.append(f"{label:<24} {'failed: ' + r['error']}")
        else:
            lines.append(f"{label:<24} {r['median_ms']:>17.2f} {r['min_ms']:>9.2f} {r['peak_bytes'] / gib:>9.2f}")
    wb = out["weight_bytes"]
    lines.append(f"weights: bf16 {wb['bf16'] / gib:.2f} GiB, W4A4 {wb['w4a4'] / gib:.2f} GiB")
    lc = out["layer_check"]
    lines.append(f"layer check: {lc['layers']} W4A4 layers vs float64 reference, max rel err {lc['max_rel_err']:.2e} "
                 f"({lc['worst_layer']}), {'all within' if lc['all_ok'] else 'FAILED'} {lc['tolerance']:g}")
    lines.append(f"output rel err W4A4 vs bf16: {out['rel_err_vs_bf16']:.4f} (finite: {out['finite']})")
    if "fp8" in out:
        f8, lc8 = out["fp8"], out["fp8"]["layer_check"]
        lines.append(f"FP8-compute mode: layer check max rel err {lc8['max_rel_err']:.2e} against the mode's reference "
                     f"({'all within' if lc8['all_ok'] else 'FAILED'} {lc8['tolerance']:g}); output rel err vs bf16 "
                     f"{f8['rel_err_vs_bf16']:.4f}, vs exact W4A4 {f8['rel_err_vs_w4a4']:.4f} (finite: {f8['finite']})")
    for label, p in (out.get("profile") or {}).items():
        cats = ", ".join(f"{c} {us / 1e3:.1f} ms" for c, us in sorted(p["by_category_us"].items(), key=lambda x: -x[1]))
        lines.append(f"profile {label}: total GPU {p['total_gpu_us'] / 1e3:.1f} ms: {cats}")
        for r in p["top_kernels"][:5]:
            lines.append(f"    {r['gpu_us'] / 1e3:8.2f} ms  {r['calls']:5d} calls  {r['kernel'][:90]}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--svd", choices=("exact", "lowrank"), default="lowrank",
                   help="SVD of the offline recipe (lowrank: randomised, seconds for the whole model)")
    p.add_argument("--calibrate", action="store_true", help="smooth with activation maxima of the bf16 step")
    p.add_argument("--image-tokens", type=int, default=4096)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="double blocks (default: FLUX.1-dev's 19)")
    p.add_argument("--single-layers", type=int, default=None, help="single blocks (default: 38)")
    p.add_argument("--compile", default="bf16,w4a4", help="comma list of models to torch.compile ('' for none)")
    p.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                   help="what torch.compile wraps: each transformer block (default; the repeated blocks share "
                        "one graph per class) or the whole model (one large graph: minutes to compile)")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layer-tol", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default=None, help="with --plan: the target arch (default: the artifacts' GEMM arch)")
    p.add_argument("--plan", action="store_true", help="no GPU: report which block linears the artifacts serve")
    p.add_argument("--json", default=None)
    p.add_argument("--fp8", action="store_true",
                   help="also time the W4A4 model in the FP8-compute mode (sm_90a; artifacts with gemm_w4a4_fp8, "
                        "e.g. configs/flux.yaml's, built with compute: [exact, fp8])")
    a = p.parse_args(argv)
    a.compile = [s for s in a.compile.split(",") if s]
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        return plan(args)
    if not torch.cuda.is_available():
        print("no CUDA GPU: run with --plan to see which linears the artifacts serve", file=sys.stderr)
        return 2
    out = run(args)
    print(table(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["layer_check"]["all_ok"] and out["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())

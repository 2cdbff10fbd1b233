"""Swap a model's `nn.Linear` layers for `W4A4Linear` in place, and say what was swapped and why not.

    report = quantize_model(model, lib, rank=32, filter=lambda name, lin: ".blocks." in name)
    print(report)            # one line per layer: swapped, or skipped with the reason

Eligibility is decided from the artifacts' manifest alone (no GPU call): for
each linear, the variant `svdq_loader.select` would choose for
``gemm_w4a4`` (dtype, rank, wcscale, bias; N, K) and for ``quantize_act``
(dtype, rank; K).  A layer no built kernel serves is skipped with the
selector's own reason.  `calibrate` collects per-channel activation maxima
for the smoothing step; `load_quantized` rebuilds swapped layers from a
saved state dict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from svdq_loader import select
from svdq_loader.errors import InvalidArgument, UnsupportedProblem
from svdq_loader.ops.layouts import BLOCK_K, SCALE_LAYOUT_BY_ARCH
from svdq_loader.torch.linear import STATE_NAMES, W4A4Linear

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class SwapReport:
    arch: str
    swapped: list = field(default_factory=list)    # (name, K, N, rank)
    skipped: list = field(default_factory=list)    # (name, K, N, reason)

    def to_dict(self) -> dict:
        return {"arch": self.arch,
                "swapped": [dict(name=n, k=k, n=nn_, rank=r) for n, k, nn_, r in self.swapped],
                "skipped": [dict(name=n, k=k, n=nn_, reason=why) for n, k, nn_, why in self.skipped]}

    def __str__(self) -> str:
        lines = [f"W4A4 swap on {self.arch}: {len(self.swapped)} linear(s) swapped, {len(self.skipped)} skipped"]
        shapes: dict = {}
        for _, k, n, r in self.swapped:
            shapes[(k, n, r)] = shapes.get((k, n, r), 0) + 1
        for (k, n, r), c in sorted(shapes.items()):
            lines.append(f"  swapped  {c:4d} x  K={k:<6d} N={n:<6d} rank={r}")
        for name, k, n, why in self.skipped:
            lines.append(f"  skipped  {name}  (K={k}, N={n}): {why}")
        return "\n".join(lines)


def resolve_arch(lib, arch: str | None = None, device=None) -> str:
    """The arch the swapped model will run on: given, or the GPU's, or the only GEMM arch the artifacts hold."""
    if arch is not None:
        return arch
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        from svdq_loader import driver
        return driver.device_arch(dev.index if dev.index is not None else torch.cuda.current_device())
    archs = sorted({v.arch for v in lib.variants if v.op == "gemm_w4a4"})
    if len(archs) != 1:
        raise InvalidArgument(f"cannot tell which arch the model will run on: the artifacts hold gemm_w4a4 for "
                              f"{archs or 'no arch'}; pass arch= (e.g. arch='sm_90a')")
    return archs[0]


def eligibility(linear: nn.Linear, variants, arch: str, rank: int, dtype: torch.dtype | None = None,
                compute: str = "exact") -> str | None:
    """None if built kernels serve this linear as a W4A4 layer of `rank` (in `compute` mode), else why not."""
    n, k = linear.out_features, linear.in_features
    dt = dtype or linear.weight.dtype
    if dt not in _DTYPE_NAMES:
        return (f"dtype {dt}: W4A4 layers take bf16 or fp16 activations (cast the model, or pass dtype=)")
    if k % BLOCK_K:
        return f"K={k} is not a multiple of {BLOCK_K} (one E4M3 scale per {BLOCK_K} k)"
    if rank > min(n, k):
        return f"rank {rank} exceeds min(N, K) = {min(n, k)}"
    layout = SCALE_LAYOUT_BY_ARCH.get(arch)
    if layout is None:
        return f"arch {arch} has no scale layout defined (known: {', '.join(SCALE_LAYOUT_BY_ARCH)})"
    name = _DTYPE_NAMES[dt]
    probs = (
        ("gemm_w4a4_fp8" if compute == "fp8" else "gemm_w4a4", (name, rank, True, linear.bias is not None, layout),
         (("m", 1), ("n", n), ("k", k))),
        ("quantize_act", (name, rank, layout), (("m", 1), ("k", k))),
    )
    for op, feats, dims in probs:
        try:
            select.choose(variants, select.Problem(op, arch, feats, dims))
        except UnsupportedProblem as e:
            return f"{op}: {e}"
    return None


def _linears(module: nn.Module, filter_fn) -> tuple[list[str], list[tuple[str, str]]]:
    keep, dropped = [], []
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            (keep if filter_fn is None or filter_fn(name, m) else dropped).append(name)
    return keep, dropped


def _set(module: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, new)


def quantize_model(module: nn.Module, lib, *, rank: int = 32, filter: Callable | None = None,
                   act_amax: dict | None = None, alpha: float = 0.5, svd: str = "exact", arch: str | None = None,
                   dtype: torch.dtype | None = None, dry_run: bool = False, compute: str = "exact") -> SwapReport:
    """Swap every eligible `nn.Linear` of `module` for a `W4A4Linear` (in place); returns the report.

    `filter(name, linear) -> bool` picks the candidates (default: all);
    `act_amax` maps a layer name to its calibration maxima (`calibrate`),
    which turns smoothing on for that layer.  `dry_run` only reports (works
    on a model on the ``meta`` device).  `arch` defaults to the GPU the model
    is on, else the only arch with GEMM kernels in `lib`.  `compute="fp8"` makes every swapped layer use the
    FP8-compute mode (sm_90a; not bit-equivalent: docs/design.md section 2).
    """
    if isinstance(module, nn.Linear):
        raise InvalidArgument("quantize_model swaps linears inside a module; for one layer use "
                              "W4A4Linear.from_linear(linear, lib=lib)")
    first = next(iter(module.parameters()), None)
    target = resolve_arch(lib, arch, first.device if first is not None else None)
    report = SwapReport(target)
    names, dropped = _linears(module, filter)
    for name in dropped:
        lin = module.get_submodule(name)
        report.skipped.append((name, lin.in_features, lin.out_features, "excluded by the filter"))
    variants = lib.variants
    for name in names:
        lin = module.get_submodule(name)
        why = eligibility(lin, variants, target, rank, dtype, compute)
        if why is not None:
            report.skipped.append((name, lin.in_features, lin.out_features, why))
            continue
        report.swapped.append((name, lin.in_features, lin.out_features, rank))
        if dry_run:
            continue
        amax = (act_amax or {}).get(name)
        new = W4A4Linear.from_linear(lin, rank=rank, act_amax=amax, alpha=alpha, svd=svd, dtype=dtype, lib=lib,
                                     compute=compute)
        _set(module, name, new)
        del lin
    return report


@torch.no_grad()
def calibrate(module: nn.Module, run: Callable[[], object], *, filter: Callable | None = None) -> dict:
    """Per input channel max |x| of every (filtered) linear's input over what `run()` feeds the model."""
    amax: dict = {}
    hooks = []
    names, _ = _linears(module, filter)

    def hook_for(name):
        def hook(mod, args):
            x = args[0].detach()
            a = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        return hook

    for name in names:
        hooks.append(module.get_submodule(name).register_forward_pre_hook(hook_for(name)))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return amax


def load_quantized(module: nn.Module, state: dict, *, lib=None, strict: bool = True,
                   compute: str = "exact") -> list[str]:
    """Put a `W4A4Linear` wherever `state` holds ``<name>.qweight``, then load `state` into `module`.

    The inverse of saving a swapped model's ``state_dict()`` (e.g. with
    safetensors); `module` is a fresh copy of the original architecture.  `compute`: the layers' GEMM mode.
    """
    names = sorted(k[: -len(".qweight")] for k in state if k.endswith(".qweight"))
    for name in names:
        old = module.get_submodule(name)
        if not isinstance(old, (nn.Linear, W4A4Linear)):
            raise InvalidArgument(f"{name} holds a W4A4 state but the module there is {type(old).__name__}")
        _set(module, name, W4A4Linear.from_state_dict(state, prefix=name + ".", lib=lib, compute=compute)
             .to(_device_of(old)))
    module.load_state_dict(state, strict=strict)
    return names


def _device_of(m: nn.Module):
    t = next(iter(m.buffers()), None) if not list(m.parameters()) else next(iter(m.parameters()))
    return t.device if t is not None else torch.device("cpu")


__all__ = ["SwapReport", "quantize_model", "calibrate", "load_quantized", "eligibility", "resolve_arch",
           "STATE_NAMES"]

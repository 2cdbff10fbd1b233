"""The one place where `svdq_loader.torch` calls the kernels: `quantize` and `gemm`.

Both take plain tensors.  Eagerly they call the library's methods directly
(the weight side checked once per layer and cached); while ``torch.compile``
traces they go through the registered custom ops ``svdq::quantize_act`` /
``svdq::gemm_w4a4`` (`svdq_loader.torch_ops`), so a compiled model has no
graph break around them (``fullgraph=True`` works) and CUDA graphs
(``mode="reduce-overhead"``) capture the launches.  The custom ops launch from
the one Library registered with `torch_ops.use`, which `W4A4Linear.attach`
does; a process uses one Library for its compiled layers.
"""
from __future__ import annotations

import torch

from svdq_loader import torch_ops
from svdq_loader.library import Library
from svdq_loader.errors import InvalidArgument


def _need(lib):
    if lib is None:
        raise InvalidArgument("this W4A4Linear has no kernel library attached; pass lib= to quantize_model / "
                              "from_linear, or call .attach(svdq_loader.load(ARTIFACTS))")
    return lib


def register(lib) -> None:
    """Make `lib` the Library of the custom ops (what compiled layers launch from).  Stand-ins that are
    not a `Library` (test doubles) are used eagerly only."""
    if torch_ops._lib is not lib and isinstance(lib, Library):
        torch_ops.use(lib)


def quantize(lib, x, smooth, lora_down, compute: str = "exact", smooth_rcp=None):
    """x [M, K] -> (act [M, K/2] uint8, ascales, lora_act_in [M, R] or None).  `smooth_rcp`: smooth's
    reciprocals (`ops.quantize_act.smooth_reciprocals`), which an eager call passes instead of smooth (the same
    result, a faster kernel); a compiled graph's custom op takes smooth.

    A non-contiguous x is made contiguous; eagerly, a misaligned one is copied too (the kernel reads
    contiguous, 16-byte-aligned rows; tensors a compiled graph makes are allocator-aligned).  Eagerly with
    ``compute="fp8"``: (an `E4m3Act`, None, lora_act_in), the FP8-compute mode's activation, which `gemm` passes
    to the GEMM as it is.  A compiled graph keeps the NVFP4 form in both modes (the custom ops' schema): its
    FP8-compute GEMM call converts it first, the same arithmetic.
    """
    lib = _need(lib)
    if not x.is_contiguous():
        x = x.contiguous()
    if torch.compiler.is_compiling():
        return torch_ops.quantize_act(x, smooth, lora_down)
    if x.data_ptr() % 16:
        x = x.clone()
    if smooth_rcp is not None:
        return lib.quantize_act(x, smooth_rcp=smooth_rcp, lora_down=lora_down, compute=compute)
    return lib.quantize_act(x, smooth=smooth, lora_down=lora_down, compute=compute)


def prepare(lib, qweight, wscales, lora_up, wcscale, bias, cache: dict, compute: str = "exact"):
    """The layer's PreparedWeight (checked and converted to the device's weight format once, then cached;
    ``cache["last"]`` is the one a compiled forward reads).  `compute`: the GEMM's mode ("exact" or "fp8")."""
    key = (qweight.data_ptr(), wscales.data_ptr(), _ptr(lora_up), _ptr(wcscale), _ptr(bias), id(lib), compute)
    w = cache.get(key)
    if w is None:
        cache.clear()
        w = cache[key] = lib.prepare_weight(qweight, wscales, lora_up=lora_up, wcscale=wcscale, bias=bias,
                                            compute=compute)
        cache["last"] = w
    return w


def gemm(lib, act, ascales, qweight, wscales, lora_act_in, lora_up, wcscale, bias, out_dtype, cache: dict,
         compute: str = "exact"):
    """y = (A·Wᵀ)·wcscale + bias + lora_act_in·lora_upᵀ; `cache` keeps the checked weight side per layer."""
    lib = _need(lib)
    if torch.compiler.is_compiling():
        w = cache.get("last")
        if w is None:
            raise InvalidArgument("a compiled W4A4Linear needs its weight prepared first: run the layer once "
                                  "eagerly on the GPU (or attach the library with the layer on the GPU) before "
                                  "torch.compile")
        return torch_ops.gemm_w4a4(act, ascales, w, lora_act_in, out_dtype)
    w = prepare(lib, qweight, wscales, lora_up, wcscale, bias, cache, compute)
    return lib.gemm_w4a4(act, w, ascales, lora_act_in=lora_act_in, out_dtype=out_dtype)


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0

"""The one place where `svdq_loader.torch` calls the kernels: `quantize` and `gemm`.

Both take plain tensors (the custom-op shape: no Python objects but the
library), so that moving them onto registered ``torch.library`` ops
(``svdq::quantize_act`` / ``svdq::gemm_w4a4``) is an edit of this file only.

Today they call the library's methods directly and are hidden from
``torch.compile`` (`torch.compiler.disable`): a compiled model graph-breaks
around each call and runs the kernels eagerly.  CUDA-graph capture works
already (the library launches on the current stream and refuses to load a
kernel during capture; call ``lib.preload()`` first).
"""
from __future__ import annotations

import torch

from svdq_loader.errors import InvalidArgument


def _need(lib):
    if lib is None:
        raise InvalidArgument("this W4A4Linear has no kernel library attached; pass lib= to quantize_model / "
                              "from_linear, or call .attach(svdq_loader.load(ARTIFACTS))")
    return lib


@torch.compiler.disable
def quantize(lib, x, smooth, lora_down):
    """x [M, K] -> (act [M, K/2] uint8, ascales, lora_act_in [M, R] or None).

    A non-contiguous or misaligned x is copied first (the kernel reads contiguous, 16-byte-aligned rows).
    """
    lib = _need(lib)
    if not x.is_contiguous():
        x = x.contiguous()
    elif x.data_ptr() % 16:
        x = x.clone()
    return lib.quantize_act(x, smooth=smooth, lora_down=lora_down)


@torch.compiler.disable
def gemm(lib, act, ascales, qweight, wscales, lora_act_in, lora_up, wcscale, bias, out_dtype, cache: dict):
    """y = (A·Wᵀ)·wcscale + bias + lora_act_in·lora_upᵀ; `cache` keeps the checked weight side per layer."""
    lib = _need(lib)
    key = (qweight.data_ptr(), wscales.data_ptr(), _ptr(lora_up), _ptr(wcscale), _ptr(bias), id(lib))
    w = cache.get(key)
    if w is None:
        cache.clear()
        w = cache[key] = lib.prepare_weight(qweight, wscales, lora_up=lora_up, wcscale=wcscale, bias=bias)
    return lib.gemm_w4a4(act, w, ascales, lora_act_in=lora_act_in, out_dtype=out_dtype)


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0

"""The operators as torch.library custom ops, ``svdq::gemm_w4a4`` and ``svdq::quantize_act``.

Public API (what a model calls)::

    import svdq_loader
    from svdq_loader import torch_ops

    lib = svdq_loader.load("artifacts")
    torch_ops.use(lib)                      # the Library the ops launch from (per process; call again to replace)
    w = lib.prepare_weight(wgt, wscales, lora_up=lu, wcscale=wc, bias=b)     # once per layer

    y = torch_ops.linear(x, w, smooth=None, lora_down=None, out_dtype=None)
        # x [M, K] bf16/fp16 CUDA -> y [M, N]: quantize_act then gemm_w4a4 (the whole W4A4 linear)
    act, ascales, lora_act_in = torch_ops.quantize_act(x, smooth=None, lora_down=None)
        # act [M, K/2] uint8, ascales in this device's scale layout, lora_act_in [M, R] (None without lora_down)
    y = torch_ops.gemm_w4a4(act, ascales, w, lora_act_in=None, out_dtype=None)
        # w: a PreparedWeight; y [M, N] in lora_up's dtype, else out_dtype, else bf16

These three functions call ``torch.ops.svdq.*``, so a model using them runs
under ``torch.compile(fullgraph=True)`` (the fake implementations give the
output shapes and dtypes without a GPU) and ``mode="reduce-overhead"``.
A `PreparedWeight` is a Python object: its tensors, N, K and weight-format
name cross the op boundary, not the object (`gemm_w4a4` unpacks it; the op
rebuilds it without converting anything again).  Launches go on the current stream.

Op schemas::

    svdq::quantize_act(Tensor x, Tensor? smooth, Tensor? lora_down) -> (Tensor act, Tensor ascales, Tensor lora_act_in)
        (lora_act_in is [M, 0] without lora_down)
    svdq::gemm_w4a4(Tensor act, Tensor ascales, Tensor wgt, Tensor wscales, Tensor? lora_act_in, Tensor? lora_up,
                    Tensor? wcscale, Tensor? bias, ScalarType? out_dtype, int n, int k, str weight_format) -> Tensor
        (the weight tensors as `prepare_weight` left them, in `weight_format`: nothing is converted per call)

CUDA graphs: kernels are loaded on first use, which must not happen while a
graph is captured: call ``lib.preload()`` first (torch.compile's
"reduce-overhead" runs each graph eagerly before capturing it, which loads them).
"""
from __future__ import annotations

from typing import Optional

from .errors import InvalidArgument, TorchMissing
from .ops import gemm_w4a4 as _gemm
from .ops.layouts import COMPUTE_OF_FORMAT, SCALE_LAYOUT_BY_ARCH, scale_shape

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised by the no-torch subprocess test
    raise TorchMissing("svdq_loader.torch_ops registers torch custom ops, but torch is not installed; "
                       "install it (pip install 'svdq-aot[torch]')") from e

_lib = None
_meta_arch = "sm_90a"


def use(lib, *, meta_arch: str | None = None) -> None:
    """Make `lib` the Library the ``svdq::`` ops launch from.

    `meta_arch`: the arch whose scale layout the fake implementation assumes
    for tensors that are not on a CUDA device (meta tensors while tracing);
    default: the one arch `lib` builds ``quantize_act`` for, else sm_90a.
    """
    global _lib, _meta_arch
    _lib = lib
    if meta_arch is None:
        archs = sorted({v.arch for v in lib.variants if v.op == "quantize_act"})
        meta_arch = archs[0] if len(archs) == 1 else "sm_90a"
    if meta_arch not in SCALE_LAYOUT_BY_ARCH:
        raise InvalidArgument(f"meta_arch {meta_arch!r} is not a known arch ({', '.join(SCALE_LAYOUT_BY_ARCH)})")
    _meta_arch = meta_arch


def library():
    if _lib is None:
        raise InvalidArgument("no svdq Library for the svdq:: ops: call svdq_loader.torch_ops.use(lib) first")
    return _lib


def _layout(device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return SCALE_LAYOUT_BY_ARCH.get(f"sm_{major}{minor}a", "logical")
    return SCALE_LAYOUT_BY_ARCH[_meta_arch]


# ---------------------------------------------------------------------------- quantize_act
@torch.library.custom_op("svdq::quantize_act", mutates_args=())
def _quantize_act(x: torch.Tensor, smooth: Optional[torch.Tensor],
                  lora_down: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    act, ascales, la = library().quantize_act(x, smooth=smooth, lora_down=lora_down)
    if la is None:
        la = x.new_empty((x.shape[0], 0))
    return act, ascales, la


@_quantize_act.register_fake
def _quantize_act_fake(x, smooth, lora_down):
    m, k = x.shape
    rank = lora_down.shape[1] if lora_down is not None else 0
    act = x.new_empty((m, k // 2), dtype=torch.uint8)
    ascales = x.new_empty(scale_shape(_layout(x.device), m, k), dtype=torch.float8_e4m3fn)
    return act, ascales, x.new_empty((m, rank))


# ---------------------------------------------------------------------------- gemm_w4a4
@torch.library.custom_op("svdq::gemm_w4a4", mutates_args=())
def _gemm_w4a4(act: torch.Tensor, ascales: torch.Tensor, wgt: torch.Tensor, wscales: torch.Tensor,
               lora_act_in: Optional[torch.Tensor], lora_up: Optional[torch.Tensor], wcscale: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype], n: int, k: int,
               weight_format: str) -> torch.Tensor:
    w = _gemm.PreparedWeight(wgt, wscales, lora_up, wcscale, bias, int(n), int(k),
                             int(lora_up.shape[1]) if lora_up is not None else 0, weight_format,
                             COMPUTE_OF_FORMAT.get(weight_format, "exact"))      # the format names the mode
    return library().gemm_w4a4(act, w, ascales, lora_act_in=lora_act_in, out_dtype=out_dtype)


@_gemm_w4a4.register_fake
def _gemm_w4a4_fake(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out_dtype, n, k, weight_format):
    dt = lora_up.dtype if lora_up is not None else (out_dtype or torch.bfloat16)
    return act.new_empty((act.shape[0], n), dtype=dt)


# ---------------------------------------------------------------------------- the public functions
def quantize_act(x, smooth=None, lora_down=None):
    """x [M, K] -> (act [M, K/2] uint8, ascales, lora_act_in [M, R] or None), through ``svdq::quantize_act``."""
    act, ascales, la = torch.ops.svdq.quantize_act(x, smooth, lora_down)
    return act, ascales, (la if lora_down is not None else None)


def gemm_w4a4(act, ascales, weight, lora_act_in=None, out_dtype=None):
    """y [M, N] = the W4A4 GEMM of `act` with a PreparedWeight `weight`, through ``svdq::gemm_w4a4``."""
    if not isinstance(weight, _gemm.PreparedWeight):
        raise InvalidArgument(f"weight must be a PreparedWeight (lib.prepare_weight(...)), got {type(weight).__name__}")
    return torch.ops.svdq.gemm_w4a4(act, ascales, weight.wgt, weight.wscales, lora_act_in, weight.lora_up,
                                    weight.wcscale, weight.bias, out_dtype, weight.n, weight.k, weight.weight_format)


def linear(x, weight, smooth=None, lora_down=None, out_dtype=None):
    """The W4A4 linear: quantize `x` [M, K] (optional smoothing and LoRA-down), then the GEMM with `weight`."""
    act, ascales, la = quantize_act(x, smooth, lora_down)
    return gemm_w4a4(act, ascales, weight, la, out_dtype)


__all__ = ["use", "library", "quantize_act", "gemm_w4a4", "linear"]

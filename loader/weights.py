"""Offline weight quantization: a bf16/fp16/fp32 weight ``W [N, K]`` -> the GEMM's weight operands.

    qw = quantize_weight(W)                     # per-output-channel wcscale (default)
    w  = lib.prepare_weight(qw.wgt, qw.wscales, wcscale=qw.wcscale, bias=b, lora_up=lu)

Math (fp32, on whatever device W is on):

* ``wcscale[n]`` = ``max_k |W[n, k]| / (6 · 448)`` (1 for an all-zero row),
  so that the largest block of each row gets the largest E4M3 scale, 448;
  ``wcscale="none"`` uses 1 everywhere.  A per-tensor scale of the
  checkpoint (``tensor_scale``, for W = tensor_scale · W_stored) is folded
  in: ``wcscale[n] *= tensor_scale``.  The GEMM multiplies the product by
  ``wcscale[n]`` (the operator: ``y = (A·Wᵀ)·wcscale + ...``).
* ``x = W / wcscale`` (W already divided by any tensor scale); per row and
  16-wide group: ``scale = e4m3(amax(|x|) / 6)`` (round to nearest even,
  saturating at 448), codes = E2M1 nearest of ``x / scale`` (ties to the
  even code, saturating at ±6, sign bit for negative values), scale 0 ->
  codes 0.  These are the rounding rules of ``quantize_act``.

The weight side is converted once; nothing here runs per call.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops.checks import fail, torch_module
from .ops.layouts import BLOCK_K

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
# |v| thresholds between consecutive E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; at a tie the
# even code wins: strict ">" where the lower neighbour is even, ">=" where the upper one is.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class QuantizedWeight:
    wgt: object          # [N, K/2] uint8, low nibble = even k
    wscales: object      # [N, K/16] float8_e4m3fn (logical layout)
    wcscale: object      # [N] float32


def e2m1_codes(v):
    """fp32 tensor (already divided by its block scale) -> E2M1 codes (uint8 0..15)."""
    torch = torch_module()
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t, inclusive in _THRESHOLDS:
        code += (a >= t if inclusive else a > t).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def quantize_blocks(x):
    """fp32 [rows, K] -> (packed uint8 [rows, K/2], E4M3 scales [rows, K/16]) by the rules above."""
    torch = torch_module()
    rows, k = x.shape
    g = x.reshape(rows, k // BLOCK_K, BLOCK_K)
    amax = g.abs().amax(dim=-1)
    scale8 = (amax / _E2M1_MAX).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    s = scale8.to(torch.float32).unsqueeze(-1)
    v = torch.where(s > 0, g / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(g))
    codes = e2m1_codes(v).reshape(rows, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale8.contiguous()


def quantize_weight(w, *, wcscale: str = "per_channel", tensor_scale: float | None = None) -> QuantizedWeight:
    """Quantize a weight ``[N, K]`` (K a multiple of 16) to NVFP4 with a per-output-channel scale."""
    torch = torch_module()
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        fail(f"quantize_weight expects a 2-D floating-point torch tensor [N, K], got "
             f"{type(w).__name__} {getattr(w, 'shape', '')}")
    n, k = w.shape
    if k % BLOCK_K or n < 1:
        fail(f"quantize_weight: K = {k} must be a positive multiple of {BLOCK_K} (N = {n})")
    if wcscale not in ("per_channel", "none"):
        fail(f"quantize_weight: wcscale must be 'per_channel' or 'none', got {wcscale!r}")
    x = w.to(torch.float32)
    if not torch.isfinite(x).all():
        fail("quantize_weight: the weight holds inf or NaN")
    if tensor_scale is not None:
        if not (isinstance(tensor_scale, (int, float)) and tensor_scale > 0):
            fail(f"quantize_weight: tensor_scale must be a positive number, got {tensor_scale!r}")
        x = x / float(tensor_scale)
    if wcscale == "per_channel":
        row = x.abs().amax(dim=1) / (_E2M1_MAX * _E4M3_MAX)
        wc = torch.where(row > 0, row, torch.ones_like(row))
    else:
        wc = torch.ones(n, dtype=torch.float32, device=w.device)
    packed, scales = quantize_blocks(x / wc.unsqueeze(1))
    if tensor_scale is not None:
        wc = wc * float(tensor_scale)
    return QuantizedWeight(packed, scales, wc.contiguous())


def dequantize_weight(qw: QuantizedWeight):
    """float32 [N, K] that the GEMM multiplies with (codes · block scale · wcscale)."""
    torch = torch_module()
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=torch.float32, device=qw.wgt.device)
    n, kh = qw.wgt.shape
    codes = torch.stack([qw.wgt & 0xF, qw.wgt >> 4], dim=-1).reshape(n, 2 * kh).long()
    vals = lut[codes].reshape(n, -1, BLOCK_K) * qw.wscales.to(torch.float32).unsqueeze(-1)
    return vals.reshape(n, 2 * kh) * qw.wcscale.unsqueeze(1)

"""The weight (and scale) formats the sm_100a / sm_103a GEMM reads, made with torch on the tensors' device.

* `wscales`: the logical ``[N, K/16]`` E4M3 scales become the blocked 32x4x4 layout
  (`layouts.scale_shape("blocked", N, K)`), once, in `prepare_weight`.
* `lora_up`: the Blackwell kernel accumulates the LoRA product in the same tensor-memory
  accumulator as the main product and multiplies the sum by ``wcscale`` in its epilogue.  The
  operator puts LoRA *outside* that multiply, so the kernel is given ``lora_up[n, :] / wcscale[n]``
  (fp32 division, rounded once to lora_up's dtype).  A zero, inf or NaN wcscale, or a quotient that
  overflows the dtype, is refused with the channel named.
* `to_blocked_scales`: for a caller whose activation scales are in the logical layout (the output
  of `quantize_act` on this arch is blocked already).  Cost: one pad + permute copy on the GPU,
  reading ``M*K/16`` bytes and writing ``ceil(M/128)*128 * ceil(K/64)*4`` bytes (M = 4608,
  K = 3072: 0.9 MB each way) in three torch kernels (zero fill, copy into the padding, permute);
  an estimate, not measured on a Blackwell GPU.  Prefer `quantize_act`, which writes the blocked
  layout directly.

Imports torch lazily (through `checks.torch_module`).
"""
from __future__ import annotations

from .checks import fail, torch_module
from .layouts import BLOCK_K, ceil_div

#: What `prepare_weight` records for weights in this format.
FORMAT = "sm100"


def to_blocked_scales(scales):
    """Logical E4M3 scales ``[rows, G]`` -> blocked ``[ceil(rows/128), ceil(G/4), 32, 4, 4]`` on the same device.

    Row r and group g land at ``[r // 128, g // 4, r % 32, (r // 32) % 4, g % 4]``; padding is 0.
    """
    torch = torch_module()
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        fail(f"scales must be a 2-D torch.Tensor [rows, K/16], got {type(scales).__name__} "
             f"{tuple(getattr(scales, 'shape', ()))}")
    rows, groups = scales.shape
    rb, gb = ceil_div(rows, 128), ceil_div(groups, 4)
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    padded = torch.zeros((rb * 128, gb * 4), dtype=raw.dtype, device=raw.device)
    padded[:rows, :groups] = raw
    out = padded.reshape(rb, 4, 32, gb, 4).permute(0, 3, 2, 1, 4).contiguous()
    return out.view(scales.dtype) if raw is not scales else out


def lora_up_over_wcscale(lora_up, wcscale):
    """``lora_up[n, :] / wcscale[n]`` in fp32, rounded to lora_up's dtype; refuses what cannot be represented."""
    torch = torch_module()
    wc = wcscale.to(torch.float32)
    bad = ~torch.isfinite(wc) | (wc == 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(f"wcscale[{i}] = {float(wc[i])}: the sm_100 GEMM folds 1/wcscale into lora_up (LoRA stays outside "
             f"the wcscale multiply), so every wcscale must be finite and non-zero")
    q = (lora_up.to(torch.float32) / wc[:, None]).to(lora_up.dtype)
    over = ~torch.isfinite(q) & torch.isfinite(lora_up)
    if bool(over.any()):
        n, r = (int(x) for x in over.nonzero()[0])
        fail(f"lora_up[{n}, {r}] / wcscale[{n}] = {float(lora_up[n, r])} / {float(wc[n])} overflows "
             f"{lora_up.dtype}; the sm_100 GEMM needs lora_up / wcscale representable")
    return q.contiguous()


def convert(n: int, k: int, wgt, wscales, lora_up, wcscale):
    """`prepare_weight`'s hook for sm_100a / sm_103a: (wgt as given, blocked wscales, the lora_up the
    kernel reads)."""
    if wscales.shape != (n, k // BLOCK_K):   # prepare_weight checked it; a guard against misuse
        fail(f"wscales has shape {tuple(wscales.shape)}, expected ({n}, {k // BLOCK_K})")
    lu = lora_up
    if lora_up is not None and wcscale is not None:
        lu = lora_up_over_wcscale(lora_up, wcscale)
    return wgt, to_blocked_scales(wscales), lu

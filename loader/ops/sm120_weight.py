"""Weight format of the sm_120a / sm_121a GEMM: the block scales in the blocked layout (torch, on the weight's device).

The warp-level block-scaled MMA of GeForce/workstation Blackwell reads both
operands' E4M3 scales through TMA in the 32x4x4 atom layout
(`layouts.scale_shape("blocked", ...)`).  `convert` rearranges the logical
``wscales [N, K/16]`` into it once, at `prepare_weight`; ``lora_up`` stays as
given (this GEMM adds the LoRA product after the wcscale multiply, in
registers, so no ``1 / wcscale`` folding is needed).
"""
from __future__ import annotations

from .checks import torch_module
from .layouts import ceil_div


def blocked_scales(scales):
    """Logical ``[rows, G]`` E4M3 scales -> ``[ceil(rows/128), ceil(G/4), 32, 4, 4]`` (padding 0), same device
    (the shape `layouts.scale_shape("blocked", rows, 16 * G)`).

    Row r, group g land at ``[r // 128, g // 4, r % 32, (r // 32) % 4, g % 4]``.
    """
    torch = torch_module()
    rows, groups = scales.shape
    rb, gb = ceil_div(rows, 128), ceil_div(groups, 4)
    raw = scales.contiguous().view(torch.uint8)              # rearrange bytes (fp8 copies are not everywhere)
    padded = torch.zeros((rb * 128, gb * 4), dtype=torch.uint8, device=scales.device)
    padded[:rows, :groups] = raw
    # (rb, r4, r32, gb, g4) -> (rb, gb, r32, r4, g4)
    out = padded.reshape(rb, 4, 32, gb, 4).permute(0, 3, 2, 1, 4).contiguous()
    return out.view(scales.dtype)


def convert(n: int, k: int, wscales, lora_up, wcscale):
    """(wscales, lora_up) as the sm_120a / sm_121a GEMM reads them."""
    return blocked_scales(wscales), lora_up

"""Weight format of the sm_120a / sm_121a GEMM (torch, on the weight's device).

The warp-level block-scaled MMA of GeForce/workstation Blackwell reads both
operands' E4M3 scales through TMA in the blocked 32x4x4 atom layout
(`layouts.scale_shape("blocked", ...)`), so `convert` rearranges the logical
``wscales [N, K/16]`` into it once, at `prepare_weight`.  ``lora_up`` stays as
given: this GEMM adds the LoRA product after the wcscale multiply, in
registers, so nothing is folded into it.
"""
from __future__ import annotations

from .blackwell_weight import to_blocked_scales


def convert(n: int, k: int, wgt, wscales, lora_up, wcscale):
    """(wgt, wscales, lora_up) as the sm_120a / sm_121a GEMM reads them: only wscales changes."""
    return wgt, to_blocked_scales(wscales), lora_up

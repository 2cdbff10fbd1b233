"""Tensor-format facts shared by the operators (one home each).

* NVFP4 block size: one E4M3 scale per 16 consecutive k.
* Which block-scale layout the GEMM family of each arch reads, and so the
  layout `quantize_act` writes on that arch:
  - ``logical``: ``[rows, K/16]`` row-major;
  - ``blocked``: the 32x4x4 scale-factor atom layout of the Blackwell
    tensor cores, stored as ``[ceil(rows/128), K/64, 32, 4, 4]``: row r and
    k-group g live at ``[r // 128, g // 4, r % 32, (r // 32) % 4, g % 4]``;
    rows are padded to 128 and groups to 4 (pad entries hold 0).
"""
from __future__ import annotations

BLOCK_K = 16

SCALE_LAYOUT_BY_ARCH = {
    "sm_90a": "logical",
    "sm_100a": "blocked",
    "sm_103a": "blocked",
    "sm_120a": "blocked",
    "sm_121a": "blocked",
}
SCALE_LAYOUTS = ("logical", "blocked")

#: Weight-format converters by arch: a module under ``svdq_loader.ops`` whose ``convert(n, k, wscales,
#: lora_up, wcscale)`` returns the (wscales, lora_up) the arch's GEMM reads; archs not listed read the
#: logical form as given.
WEIGHT_FORMAT_BY_ARCH = {
    "sm_100a": "blackwell_weight",
    "sm_103a": "blackwell_weight",
    "sm_120a": "sm120_weight",
    "sm_121a": "sm120_weight",
}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(layout: str, rows: int, k: int) -> tuple[int, ...]:
    """Shape of the E4M3 scale tensor of a [rows, K] NVFP4 operand in `layout`."""
    groups = k // BLOCK_K
    if layout == "logical":
        return (rows, groups)
    if layout == "blocked":
        return (ceil_div(rows, 128), ceil_div(groups, 4), 32, 4, 4)
    raise ValueError(f"unknown scale layout {layout!r} (known: {', '.join(SCALE_LAYOUTS)})")

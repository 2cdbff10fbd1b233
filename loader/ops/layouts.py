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

#: The weight format `prepare_weight` writes for the GEMM family of an arch (absent: "logical", the
#: ``[N, K/2]`` / ``[N, K/16]`` tensors as given).  Each format is converted by one module under
#: ``svdq_loader.ops`` (WEIGHT_FORMAT_MODULES) whose ``convert(n, k, wgt, wscales, lora_up, wcscale)``
#: returns the (wgt, wscales, lora_up) that arch's GEMM reads.
WEIGHT_FORMAT_BY_ARCH = {
    "sm_90a": "sm90_frag",             # sm90_weight_format: one 16-byte load per thread fragment
    "sm_100a": "blackwell_weight",     # blackwell_weight: blocked wscales, lora_up / wcscale
    "sm_103a": "blackwell_weight",
    "sm_120a": "sm120_weight",         # sm120_weight: blocked wscales, the rest as given
    "sm_121a": "sm120_weight",
}
#: The weight format of the FP8-compute mode's GEMM per arch (prepare_weight with compute="fp8"; ops.gemm_w4a4_fp8).
FP8_WEIGHT_FORMAT_BY_ARCH = {"sm_90a": "sm90_fp8_frag"}
WEIGHT_FORMAT_MODULES = {"sm90_frag": "sm90_weight_format", "blackwell_weight": "blackwell_weight",
                         "sm120_weight": "sm120_weight",
                         # the FP8-compute mode's (prepare_weight with compute="fp8"; ops.gemm_w4a4_fp8)
                         "sm90_fp8_frag": "sm90_fp8_weight_format"}
#: The arch -> weight format table of each compute mode of the GEMM (docs/design.md section 2): "exact", the operator
#: as stated; "fp8", each NVFP4 operand rounded once to E4M3 on FP8 tensor cores (op gemm_w4a4_fp8), on the archs
#: its table lists only.  One home for both `prepare_weight` and a call's fast path.
WEIGHT_FORMATS_BY_COMPUTE = {"exact": WEIGHT_FORMAT_BY_ARCH, "fp8": FP8_WEIGHT_FORMAT_BY_ARCH}
COMPUTE_MODES = tuple(WEIGHT_FORMATS_BY_COMPUTE)
#: The operator a GEMM call of each compute mode runs (the mode is the operator: docs/design.md section 2).  A build
#: config's ``compute`` key names the modes it builds (svdq_aot.config).
GEMM_OP_BY_COMPUTE = {"exact": "gemm_w4a4", "fp8": "gemm_w4a4_fp8"}
#: The compute mode a weight format belongs to ("logical": exact)
COMPUTE_OF_FORMAT = {fmt: mode for mode, table in WEIGHT_FORMATS_BY_COMPUTE.items() for fmt in table.values()}


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

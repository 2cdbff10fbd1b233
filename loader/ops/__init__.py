"""The operators the loader serves, each declared once (`OPS`: name -> `OpSpec`).

Torch-facing call code of each op lives in its own module and imports torch
lazily, so the builder can read the specs without torch installed.
"""
from __future__ import annotations

from . import act_fp8 as _act_fp8, decode_act as _decode_act
from .act_fp8 import SPEC as ACT_FP8
from .decode_act import SPEC as DECODE_ACT
from .gemm_w4a4 import SPEC as GEMM_W4A4
from .gemm_w4a4_fp8 import SPEC as GEMM_W4A4_FP8
from .quantize_act import SPEC as QUANTIZE_ACT
from .spec import PTR_ALIGN, Feature, OpSpec, variant_name

OPS: dict[str, OpSpec] = {s.name: s for s in (GEMM_W4A4, GEMM_W4A4_FP8, QUANTIZE_ACT, DECODE_ACT, ACT_FP8)}


#: The workspace bytes (m, k) -> int of each pre-pass op: the first part of its GEMM call's per-call workspace
#: (`decode_act.ImagesLauncher`).
WORKSPACE_BYTES_BY_PREPASS = {"decode_act": _decode_act.image_bytes, "act_fp8": _act_fp8.workspace_bytes}


def op_spec(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; known: {', '.join(OPS)}") from None


__all__ = ["OPS", "op_spec", "OpSpec", "Feature", "PTR_ALIGN", "variant_name", "GEMM_W4A4", "QUANTIZE_ACT",
           "DECODE_ACT", "ACT_FP8", "GEMM_W4A4_FP8", "WORKSPACE_BYTES_BY_PREPASS"]

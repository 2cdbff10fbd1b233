"""The gemm_w4a4 operator's feature knobs as every GEMM family's frozen config starts with them."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GemmFeatures:
    out_dtype: str
    rank: int
    wcscale: bool
    bias: bool


def gemm_feature_values(knobs: dict) -> tuple:
    """(out_dtype, rank, wcscale, bias) of a knob dict, typed: a family config's first four fields."""
    return str(knobs["out_dtype"]), int(knobs["rank"]), bool(knobs["wcscale"]), bool(knobs["bias"])

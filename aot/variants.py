"""Kernel variants: one frozen dataclass per compiled kernel.

`Variant.invalid_reason()` is *the* statement of which knob combinations
exist.  Enumeration never drops a combination silently: invalid ones are
returned with their reason.
"""
from __future__ import annotations

from dataclasses import dataclass

# DRAFT (owned by the config/variants work): fields are fixed, the predicate
# and enumeration get filled in.

@dataclass(frozen=True)
class Variant:
    arch: str            # "sm_90a"
    out_dtype: str       # "bf16" | "fp16"
    rank: int            # LoRA rank R (0 = no LoRA)
    wcscale: bool        # per-column scale applied
    bias: bool           # per-column bias added
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 1

    @property
    def name(self) -> str:
        return (
            f"svdq_w4a4_{self.arch}_{self.out_dtype}_r{self.rank}"
            f"_wc{int(self.wcscale)}_b{int(self.bias)}"
            f"_t{self.tile_m}x{self.tile_n}x{self.tile_k}"
            f"_c{self.cluster_m}x{self.cluster_n}_s{self.stages}"
        )

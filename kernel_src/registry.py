"""Kernel families by (operator, arch) -- build time only.

``FAMILIES`` maps ``(op, arch)`` to the module that builds it; one module
may serve several archs (``quantize_act`` is one source for sm_90a,
sm_100a, sm_103a, sm_120a and sm_121a).  `family(op, arch)` imports the module (which imports
the CuTe DSL) and checks it against the family contract
(`svdq_aot.family.check_family`); this module itself imports neither.
"""
from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: dict[tuple[str, str], str] = {
    ("gemm_w4a4", "sm_90a"): "svdq_kernels.sm90_wgmma_w4a4",
    ("quantize_act", "sm_90a"): "svdq_kernels.quantize_act",
    ("quantize_act", "sm_100a"): "svdq_kernels.quantize_act",
    ("quantize_act", "sm_103a"): "svdq_kernels.quantize_act",
    ("gemm_w4a4", "sm_100a"): "svdq_kernels.sm100_gemm_w4a4",
    ("gemm_w4a4", "sm_103a"): "svdq_kernels.sm100_gemm_w4a4",
    ("gemm_w4a4", "sm_120a"): "svdq_kernels.sm120_gemm_w4a4",
    ("gemm_w4a4", "sm_121a"): "svdq_kernels.sm120_gemm_w4a4",
    ("quantize_act", "sm_120a"): "svdq_kernels.quantize_act",
    ("quantize_act", "sm_121a"): "svdq_kernels.quantize_act",
    ("decode_act", "sm_90a"): "svdq_kernels.sm90_decode_act",
    ("gemm_w4a4_fp8", "sm_90a"): "svdq_kernels.sm90_wgmma_w4a4_fp8",
    ("act_fp8", "sm_90a"): "svdq_kernels.sm90_act_fp8",
}


class UnknownFamilyError(KeyError):
    """No kernel family is registered for the requested (op, arch)."""

    def __init__(self, op: str, arch: str):
        self.op, self.arch = op, arch
        super().__init__((op, arch))

    def __str__(self) -> str:  # KeyError would repr() the bare key
        have = ", ".join(f"{o}@{a}" for o, a in FAMILIES) or "(none)"
        return f"no svdq kernel family for op {self.op!r} on arch {self.arch!r}; registered: {have}"


def archs() -> tuple[str, ...]:
    """Every arch some family builds, in registry order."""
    return tuple(dict.fromkeys(a for _, a in FAMILIES))


def ops_for(arch: str) -> tuple[str, ...]:
    return tuple(o for o, a in FAMILIES if a == arch)


def family(op: str, arch: str) -> ModuleType:
    """The family module that builds `op` for `arch` (imports the DSL; contract-checked)."""
    try:
        module_name = FAMILIES[(op, arch)]
    except KeyError:
        raise UnknownFamilyError(op, arch) from None
    mod = importlib.import_module(module_name)
    from svdq_aot.family import check_family
    check_family(mod, where=module_name)
    if mod.OP != op or arch not in mod.ARCHS:
        from svdq_aot.family import FamilyContractError
        raise FamilyContractError(f"kernel family {module_name} is registered for {op}@{arch} but declares "
                                  f"OP={mod.OP!r}, ARCHS={mod.ARCHS!r}")
    return mod

"""Kernel families by target architecture (build time only).

Each family module exposes ``HOST_ARGS``, ``SUPPORTED``,
``resource_problem(variant)`` and ``compile_variant(variant, dump_dir)``.
Importing a family imports the CuTe DSL; this module itself does not.
"""
from __future__ import annotations

import importlib
from types import ModuleType

#: arch string (as in ``Variant.arch``) -> importable module name
FAMILIES: dict[str, str] = {
    "sm_90a": "svdq_kernels.sm90_w4a4",
}


class UnknownArchError(KeyError):
    """No kernel family is registered for the requested architecture."""

    def __init__(self, arch: str):
        self.arch = arch
        self.supported = tuple(sorted(FAMILIES))
        super().__init__(arch)

    def __str__(self) -> str:  # KeyError would repr() the bare key
        return (
            f"no svdq kernel family for arch {self.arch!r}; "
            f"supported archs: {', '.join(self.supported) or '(none)'}"
        )


def family(arch: str) -> ModuleType:
    """The kernel-family module that builds ``arch`` (imports the DSL)."""
    try:
        module_name = FAMILIES[arch]
    except KeyError:
        raise UnknownArchError(arch) from None
    return importlib.import_module(module_name)

"""Which CUDA driver an artifact set needs, and the check against the one installed (one home for these facts).

Versions are the driver API's integers (``cuDriverGetVersion``: 12080 =
CUDA 12.8).  What a cubin needs from the driver is the larger of:

* the first CUDA release whose driver runs that arch (`ARCH_MIN_CUDA`);
* the CUDA major of the compiler that produced it: a driver of an older
  major does not load its cubins (the builder records the DSL's toolkit
  major, `toolkit_floor`);
* what the loader calls while loading (`LOADER_MIN_CUDA`).

The build writes the result per arch into the manifest
(``requires.cuda_driver``); the loader compares it with
``cuDriverGetVersion`` before it loads anything on a device and refuses
with both versions named (`DriverTooOld`).  `LINUX_DRIVER` gives the Linux
driver release that first supports each CUDA version, for messages and
docs.  Pure Python.
"""
from __future__ import annotations

#: arch -> the first CUDA version whose driver supports it.
ARCH_MIN_CUDA = {
    "sm_90a": 12000,
    "sm_100a": 12080,
    "sm_103a": 12090,
    "sm_120a": 12080,
    "sm_121a": 12090,
}
#: What the loader itself calls at load time: cuKernelGetParamInfo (the parameter cross-check) needs CUDA 12.4.
LOADER_MIN_CUDA = 12040
#: CUDA version -> the first Linux driver release that supports it (from NVIDIA's CUDA release notes).
LINUX_DRIVER = {12000: "525.60.13", 12040: "550.54.14", 12080: "570.26", 12090: "575.51.03", 13000: "580.65.06"}


class DriverTooOld(RuntimeError):
    """The installed CUDA driver is older than what the artifacts were built for."""


def text(v: int) -> str:
    """12080 -> '12.8'."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def linux_driver(v: int) -> str:
    """The Linux driver release that brings CUDA `v` (or the nearest older entry we know, with '+')."""
    known = [k for k in sorted(LINUX_DRIVER) if k <= v]
    if not known:
        return "?"
    k = known[-1]
    return LINUX_DRIVER[k] if k == v else f"{LINUX_DRIVER[k]}+"


def toolkit_floor(toolkit_major: int) -> int:
    return int(toolkit_major) * 1000


def required(arch: str, toolkit_major: int) -> int:
    """The CUDA version a driver must support to load `arch` cubins from a toolkit of `toolkit_major`."""
    return max(ARCH_MIN_CUDA.get(arch, toolkit_floor(toolkit_major)), toolkit_floor(toolkit_major), LOADER_MIN_CUDA)


def check(have: int, need: int, arch: str, where: str) -> None:
    """Raise DriverTooOld naming both versions if `have` < `need`."""
    if have < need:
        raise DriverTooOld(
            f"the CUDA driver supports CUDA {text(have)} ({have}) but the {arch} kernels in {where} need "
            f"CUDA {text(need)} ({need}), Linux driver {linux_driver(need)} or newer; upgrade the driver, or "
            f"rebuild the artifacts with a toolkit this driver supports")


__all__ = ["ARCH_MIN_CUDA", "LINUX_DRIVER", "DriverTooOld", "required", "check", "text", "linux_driver"]

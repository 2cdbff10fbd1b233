"""The CUDA driver side of the loader: `cuda.bindings.driver`, plus libcuda through ctypes on the hot path.

- `device_arch(ordinal)`: the device's compute capability as an arch string.
- `DeviceKernels`: one cubin loaded on one device as a context-independent
  `CUlibrary`, its kernels looked up, and the kernel attributes that the
  DSL's own `cuda_load_to_device` would have set, applied per device.
- `raw_launch_config` / `raw_launch_kernel_ex` / `current_context`: a prebuilt
  C `CUlaunchConfig`, libcuda's `cuLaunchKernelEx` and `cuCtxGetCurrent`
  called through ctypes (cheaper per call than cuda.bindings objects).

Nothing here imports the DSL, torch or a compiler.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, Sequence

from cuda.bindings import driver as cu


MAX_SMEM_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (= the runtime's value)
MULTIPROCESSOR_COUNT = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def check(result, what: str):
    """Unwrap a cuda.bindings result tuple, raising `CudaError` on failure."""
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"{what} failed: {name} ({text})")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


_init_lock = threading.Lock()
_initialised = False


def init() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            check(cu.cuInit(0), "cuInit")
            _initialised = True


_driver_version = None


def driver_version() -> int:
    """The CUDA version the installed driver supports (`cuDriverGetVersion`: 12080 = 12.8); cached."""
    global _driver_version
    if _driver_version is None:
        _driver_version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    return _driver_version


def device_count() -> int:
    init()
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def _device(ordinal: int):
    init()
    return check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")


def device_attribute(attr: int, ordinal: int) -> int:
    dev = _device(ordinal)
    return int(check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute(attr), dev),
                     f"cuDeviceGetAttribute({attr}, device {ordinal})"))


def device_name(ordinal: int) -> str:
    """The device's marketing name (`cuDeviceGetName`), e.g. 'NVIDIA H200'."""
    raw = check(cu.cuDeviceGetName(256, _device(ordinal)), f"cuDeviceGetName(device {ordinal})")
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
    return str(raw).strip()


def compute_capability(ordinal: int) -> tuple[int, int]:
    major = device_attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ordinal)
    minor = device_attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ordinal)
    return major, minor


def arch_of_capability(major: int, minor: int) -> str:
    """The arch-specific target ('a' suffix) that runs on exactly this capability."""
    return f"sm_{major}{minor}a"


def device_arch(ordinal: int) -> str:
    return arch_of_capability(*compute_capability(ordinal))


class DeviceKernels:
    """One cubin, loaded on one device (context-independent `cuLibrary*`)."""

    def __init__(self, cubin: bytes, kernel_symbols: Sequence[str], ordinal: int,
                 load_plan: Callable[[Callable, Callable, int], list],
                 expected_params: dict[str, list[tuple[int, int, int]]] | None = None):
        init()
        self.ordinal = ordinal
        self._cubin = cubin  # keep the image alive for the library's lifetime
        self.library = check(cu.cuLibraryLoadData(cubin, None, None, 0, None, None, 0),
                             "cuLibraryLoadData")
        self.kernels: dict[str, object] = {}
        for sym in kernel_symbols:
            self.kernels[sym] = check(cu.cuLibraryGetKernel(self.library, sym.encode()),
                                      f"cuLibraryGetKernel({sym})")
        dev = _device(ordinal)
        # The device's primary context (the one torch and the runtime use);
        # launches go to it whatever context the calling thread has current.
        self.primary_ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._primary_int = int(self.primary_ctx)
        if expected_params:
            # cuKernelGetParamInfo needs a current context (a process that has not touched CUDA yet,
            # e.g. `svdq-aot selftest` before its first tensor, has none): the primary one, for the check
            self.push_primary()
            try:
                self._check_params(expected_params)
            finally:
                self.pop()

        def kernel_attr(sym: str, attr: int, device: int) -> int:
            return int(check(cu.cuKernelGetAttribute(cu.CUfunction_attribute(attr), self.kernels[sym],
                                                     _device(device)),
                             f"cuKernelGetAttribute({attr}, {sym})"))

        # Replay the DSL's own per-device load function against this device.
        for sym, attr, value in load_plan(device_attribute, kernel_attr, ordinal):
            if sym not in self.kernels:
                raise CudaError(f"load plan names kernel {sym!r}, not in cubin symbols {sorted(self.kernels)}")
            check(cu.cuKernelSetAttribute(cu.CUfunction_attribute(attr), value, self.kernels[sym], dev),
                  f"cuKernelSetAttribute({attr}={value}, {sym}, device {ordinal})")

    def _check_params(self, expected: dict[str, list[tuple[int, int, int]]]) -> None:
        """Cross-check the manifest's parameter list against the driver's view of the cubin."""
        for sym, params in expected.items():
            kernel = self.kernels[sym]
            try:  # cuKernelGetParamCount needs a CUDA 13.1+ driver
                count = int(check(cu.cuKernelGetParamCount(kernel), f"cuKernelGetParamCount({sym})"))
            except (AttributeError, RuntimeError) as e:
                if isinstance(e, CudaError):
                    raise
                count = None
            if count is not None and count != len(params):
                raise CudaError(f"kernel {sym}: driver reports {count} parameters, manifest {len(params)}")
            for index, offset, size in params:
                got = check(cu.cuKernelGetParamInfo(kernel, index), f"cuKernelGetParamInfo({sym}, {index})")
                got_off, got_size = int(got[0]), int(got[1])
                if (got_off, got_size) != (offset, size):
                    raise CudaError(f"kernel {sym} parameter {index}: driver says offset {got_off} size "
                                    f"{got_size}, manifest says offset {offset} size {size}")

    def _occupancy(self, sym: str, what: str, query: Callable[[object], int]) -> int:
        """`query(function)` on kernel `sym`'s function in the device's primary context (the context's push and
        pop around the driver's occupancy calls; `what` names the query in errors)."""
        self.push_primary()
        try:
            fn = check(cu.cuKernelGetFunction(self.kernels[sym]), f"cuKernelGetFunction({sym}) for {what}")
            return int(query(fn))
        finally:
            self.pop()

    def resident_blocks(self, sym: str, threads: int, dynamic_smem: int) -> int:
        """CTAs of kernel `sym` one SM holds at once with `threads` threads and `dynamic_smem` bytes of dynamic
        SMEM (the driver's occupancy calculator, in the device's primary context)."""
        what = f"cuOccupancyMaxActiveBlocksPerMultiprocessor({sym})"
        return self._occupancy(sym, what, lambda fn: check(
            cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, dynamic_smem), what))

    def resident_clusters(self, sym: str, threads: int, dynamic_smem: int, cluster: int) -> int:
        """Clusters of `cluster` CTAs of kernel `sym` the whole device holds at once (the driver's
        ``cuOccupancyMaxActiveClusters``: a cluster's CTAs share one GPC, so this can be fewer than the resident
        CTAs per SM times the SMs, divided by `cluster`)."""
        return self._occupancy(sym, "cuOccupancyMaxActiveClusters",
                               lambda fn: max_active_clusters(int(fn), cluster, threads, dynamic_smem))

    def foreign_context(self) -> bool:
        """True if a context other than the device's primary one is current on this thread.

        Launches go to the primary context (the one torch's streams belong to):
        the caller then wraps the launch in `push_primary()` / `pop()`.
        (libcuda's cuCtxGetCurrent through ctypes: this is on every call's path.)
        """
        return current_context() != self._primary_int

    def push_primary(self) -> None:
        check(cu.cuCtxPushCurrent(self.primary_ctx), "cuCtxPushCurrent")

    @staticmethod
    def pop() -> None:
        check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def unload(self) -> None:
        if self.library is not None:
            check(cu.cuLibraryUnload(self.library), "cuLibraryUnload")
            self.library = None


def param_array(params: Sequence[bytes]):
    """(address of a void*[] over copies of `params`, keep-alive object) for one-off launches."""
    bufs = [ctypes.create_string_buffer(bytes(p), max(len(p), 1)) for p in params]
    arr = (ctypes.c_void_p * max(len(bufs), 1))(*[ctypes.addressof(b) for b in bufs])
    return ctypes.addressof(arr), (arr, bufs)


class CUlaunchAttributeRaw(ctypes.Structure):
    """The driver's `CUlaunchAttribute` (x86-64): id, 4 bytes padding, 64-byte value union."""
    _fields_ = [("id", ctypes.c_uint), ("_pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class CUlaunchConfigRaw(ctypes.Structure):
    """The driver's `CUlaunchConfig` (56 bytes on x86-64)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


def raw_launch_config(grid, block, smem: int, attrs) -> CUlaunchConfigRaw:
    """A prebuilt `CUlaunchConfig` in C memory; per launch only `.hStream` is set.

    `attrs`: `[(id, 64 value bytes)]` as the host code wrote them (the
    runtime's `cudaLaunchAttribute` value union has the driver's layout).
    The attribute array is kept alive by the returned object.
    """
    cfg = CUlaunchConfigRaw(*(int(v) for v in grid), *(int(v) for v in block), int(smem), None, None, 0)
    if attrs:
        arr = (CUlaunchAttributeRaw * len(attrs))()
        for a, (attr_id, value) in zip(arr, attrs):
            a.id = int(attr_id)
            value = bytes(value)[:64]
            ctypes.memmove(ctypes.addressof(a) + CUlaunchAttributeRaw.value.offset, value, len(value))
        cfg._attr_array = arr
        cfg.attrs = ctypes.addressof(arr)
        cfg.numAttrs = len(attrs)
    return cfg


_raw_fn = None


def raw_launch_kernel_ex():
    """libcuda's `cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void**, void**) -> CUresult` via ctypes.

    Arguments are plain ints (addresses/handles); a `CUkernel` handle may be
    passed as the `CUfunction` (the driver accepts it since CUDA 12.0).
    """
    global _raw_fn
    if _raw_fn is None:
        fn = _libcuda().cuLaunchKernelEx
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _raw_fn = fn
    return _raw_fn


#: `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION` (the driver's `CUlaunchAttributeID`)
CLUSTER_DIMENSION_ATTR = 4
_clusters_fn = None


def max_active_clusters(function: int, cluster: int, threads: int, dynamic_smem: int) -> int:
    """libcuda's `cuOccupancyMaxActiveClusters` for a (cluster, 1, 1) launch of `threads`-thread CTAs with
    `dynamic_smem` bytes, the function given as a `CUfunction` handle (an int)."""
    global _clusters_fn
    if _clusters_fn is None:
        fn = _libcuda().cuOccupancyMaxActiveClusters
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _clusters_fn = fn
    dims = ctypes.c_uint * 3
    cfg = raw_launch_config((cluster, 1, 1), (threads, 1, 1), dynamic_smem,
                            [(CLUSTER_DIMENSION_ATTR, bytes(dims(cluster, 1, 1)))])
    out = ctypes.c_int(0)
    rc = _clusters_fn(ctypes.byref(out), ctypes.c_void_p(function), ctypes.addressof(cfg))
    if rc:
        raise CudaError(f"cuOccupancyMaxActiveClusters(cluster {cluster}) failed: {error_name(rc)} ({rc})")
    return int(out.value)


_ctx_get = None


def current_context() -> int:
    """The calling thread's current CUcontext handle (0 if none), via libcuda directly."""
    global _ctx_get
    if _ctx_get is None:
        fn = _libcuda().cuCtxGetCurrent
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        fn.restype = ctypes.c_int
        _ctx_get = fn
    out = ctypes.c_void_p()          # per call: threads must not share it
    rc = _ctx_get(ctypes.byref(out))
    if rc:
        raise CudaError(f"cuCtxGetCurrent failed: {error_name(rc)} ({rc})")
    return out.value or 0


def _libcuda():
    import sys
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


def error_name(rc: int) -> str:
    """The driver's name for a `CUresult` value, e.g. 'CUDA_ERROR_INVALID_VALUE'."""
    try:
        err, name = cu.cuGetErrorName(cu.CUresult(int(rc)))
        if err == cu.CUresult.CUDA_SUCCESS:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no driver: fall back to the enum's name
        pass
    try:
        return cu.CUresult(int(rc)).name
    except ValueError:
        return f"CUresult {int(rc)}"

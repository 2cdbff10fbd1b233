"""`load(path)`: verified artifacts -> per-device kernels -> `gemm_w4a4`.

Order of work, so that a bad artifact or a wrong device fails early and
cleanly:
  1. read + validate the manifest, read every cubin and host program and
     check its sha256 (no CUDA call yet; works on a machine with no GPU);
  2. on first use of a device: check its compute capability against the
     chosen variant's arch, then load that cubin on that device
     (`cuLibraryLoadData`, context independent) and replay the DSL's own
     per-device load function (kernel attributes);
  3. per call: check the tensors (ops.plan_call), choose a variant
     (select.choose), get the launch from the cached plan (pointer
     patching; the host program is interpreted once per shape), launch
     with `cuLaunchKernelEx` on the caller's current torch stream.
"""
from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import dataclass, field

from . import driver, select
from .hostvm import HostProgram
from .launch_plan import CachedLaunch, LaunchPlanCache
from ._version import __version__
from .manifest import ManifestError, read_artifacts, read_manifest

KNOWN_HOST_ARGS = frozenset(("act", "ascales", "wgt", "wscales", "lora_act_in", "lora_up", "wcscale", "bias",
                             "out", "m", "n", "k", "stream"))


class DeviceMismatch(RuntimeError):
    """A variant was built for another GPU architecture than the device's."""


class LaunchRefused(RuntimeError):
    """The DSL's own host code flagged this launch as invalid (its printf error path)."""


class CaptureError(RuntimeError):
    """A kernel would have to be loaded while a CUDA graph is being captured."""


@dataclass
class _Variant:
    entry: object                 # manifest variant entry
    cubin: bytes
    program: HostProgram
    plan: LaunchPlanCache
    arg_names: list
    per_device: dict = field(default_factory=dict)   # ordinal -> DeviceKernels
    lock: threading.Lock = field(default_factory=threading.Lock)  # cached launches are patched in place
    configs: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # CachedLaunch -> CUlaunchConfig


class Library:
    """Artifacts loaded from one directory. Thread-safe loading; launches are plain calls."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.manifest = read_manifest(self.path)
        self._lock = threading.Lock()
        self._variants: dict[str, _Variant] = {}
        self._arch: dict[int, str] = {}          # device ordinal -> arch, asked once
        self._choice: dict = {}                  # select.Problem -> _Variant
        files = read_artifacts(self.manifest, self.path)      # every sha256 checked, no CUDA
        for v in self.manifest.variants:
            cubin = files[v.cubin]
            program = HostProgram.from_dict(json.loads(files[v.host_program.file]))
            names = [a[0] for a in v.host_args]
            unknown = [n for n in names if n not in KNOWN_HOST_ARGS]
            if unknown:
                raise ManifestError(
                    f"{os.path.join(self.path, 'manifest.json')}: variant {v.name} has host arguments {unknown} "
                    f"that this loader ({__version__}) does not know; the artifacts need a newer svdq_loader")
            kinds = [a[1] for a in v.host_args]
            ptr_idx = [i for i, kd in enumerate(kinds) if kd in ("ptr", "stream")]
            sizes = {sym: [p.size for p in params] for sym, params in v.params.items()}
            self._variants[v.name] = _Variant(v, cubin, program, LaunchPlanCache(program, ptr_idx, sizes), names)

    # -- introspection -----------------------------------------------------
    @property
    def variants(self):
        return [v.entry for v in self._variants.values()]

    # -- device handling ---------------------------------------------------
    def _device_kernels(self, var: _Variant, ordinal: int, capturing: bool):
        state = var.per_device.get(ordinal)
        if state is not None:
            return state
        arch = driver.device_arch(ordinal)
        if arch != var.entry.arch:
            raise DeviceMismatch(
                f"variant {var.entry.name} is built for {var.entry.arch} but device {ordinal} is {arch}; "
                f"refusing to load it")
        optin = driver.device_attribute(driver.MAX_SMEM_OPTIN, ordinal)
        if var.entry.smem_bytes > optin:
            raise DeviceMismatch(
                f"variant {var.entry.name} needs {var.entry.smem_bytes} bytes of dynamic shared memory per block; "
                f"device {ordinal} allows {optin}")
        if capturing:
            raise CaptureError(
                f"kernel {var.entry.name} is not loaded on device {ordinal} yet and a CUDA graph is being "
                f"captured; call lib.warmup(device={ordinal}) (or run once) before capturing")
        with self._lock:
            state = var.per_device.get(ordinal)
            if state is None:
                dk = driver.DeviceKernels(var.cubin, var.entry.kernel_symbols, ordinal,
                                          var.program.load_plan, var.entry.params)
                state = dk
                var.per_device[ordinal] = state
        return state

    def warmup(self, device=None) -> int:
        """Load every variant whose arch matches `device` (default: current). Returns how many."""
        import torch
        if device is None:
            ordinal = torch.cuda.current_device()
        else:
            ordinal = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
        arch = driver.device_arch(ordinal)
        n = 0
        for var in self._variants.values():
            if var.entry.arch == arch:
                self._device_kernels(var, ordinal, False)
                n += 1
        return n

    # -- the operator --------------------------------------------------------
    def prepare_weight(self, wgt, wscales, *, lora_up=None, wcscale=None, bias=None):
        from .ops import prepare_weight
        return prepare_weight(wgt, wscales, lora_up=lora_up, wcscale=wcscale, bias=bias)

    def gemm_w4a4(self, act, wgt, ascales, wscales=None, *, lora_act_in=None, lora_up=None, wcscale=None,
                  bias=None, out=None, out_dtype=None):
        """y = (A·Wᵀ)·wcscale + bias + lora_act_in·lora_upᵀ (DESIGN.md §2). Returns `out`."""
        import torch
        from .ops import PreparedWeight, InvalidArgument, plan_call, prepare_weight
        if isinstance(wgt, PreparedWeight):
            extra = [n for n, x in (("wscales", wscales), ("lora_up", lora_up), ("wcscale", wcscale),
                                    ("bias", bias)) if x is not None]
            if extra:
                raise InvalidArgument(f"wgt is a PreparedWeight; {', '.join(extra)} belong to prepare_weight(), "
                                      f"not to the call")
            weight = wgt
        else:
            if wscales is None:
                raise InvalidArgument("wscales is required unless wgt is a PreparedWeight")
            weight = prepare_weight(wgt, wscales, lora_up=lora_up, wcscale=wcscale, bias=bias)
        call = plan_call(act, weight, ascales, lora_act_in=lora_act_in, out=out, out_dtype=out_dtype)
        ordinal = act.device.index
        arch = self._arch.get(ordinal)
        if arch is None:
            arch = self._arch[ordinal] = driver.device_arch(ordinal)
        prob = select.Problem(arch, call.out_dtype, call.rank, call.wcscale, call.bias, call.m, call.n, call.k)
        var = self._choice.get(prob)
        if var is None:
            var = self._variants[select.choose(self.variants, prob).name]
            if len(self._choice) > 65536:
                self._choice.clear()
            self._choice[prob] = var
        dk = var.per_device.get(ordinal)
        if dk is None:
            dk = self._device_kernels(var, ordinal, torch.cuda.is_current_stream_capturing())
        values = dict(call.pointers, m=call.m, n=call.n, k=call.k, stream=_current_stream(ordinal))
        args = [values[name] for name in var.arg_names]
        foreign = dk.foreign_context()
        if foreign:                        # launch in torch's (primary) context, restore the caller's after
            dk.push_primary()
        try:
            self._launch(var, dk, args)
        finally:
            if foreign:
                dk.pop()
        return call.out

    @staticmethod
    def _launch(var: _Variant, dk, args) -> None:
        with var.lock:
            rec = var.plan.get(args)
            if rec.printf:   # the DSL's host code reports a launch it knows will fail (e.g. SMEM over the limit)
                raise LaunchRefused(f"host code of {var.entry.name} refused this launch: {rec.printf.strip()}")
            if rec.__class__ is CachedLaunch:          # the usual case: pointer-patched in place
                cfg = var.configs.get(rec)
                if cfg is None:
                    cfg = var.configs[rec] = driver.launch_config(rec)
                kp = rec.kernel_params_address
            else:                                      # a shape the cache could not patch: one-off
                cfg = driver.launch_config(rec)
                kp, _keep = driver.param_array(rec.params)
            driver.launch(cfg, dk.kernels[rec.kernel], kp, rec.stream)


def _current_stream(ordinal: int) -> int:
    """The raw handle of torch's current stream on `ordinal` (the public call costs ~3 µs more)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(ordinal)
    return torch.cuda.current_stream(ordinal).cuda_stream


def load(path: str = "artifacts") -> Library:
    """Read, validate and verify the artifacts in `path`. No CUDA call is made here."""
    return Library(path)

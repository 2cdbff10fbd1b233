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

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field

from . import driver, select
from .hostvm import HostProgram
from .launch_plan import LaunchPlanCache
from .manifest import ArtifactIntegrityError, read_manifest


class DeviceMismatch(RuntimeError):
    """A variant was built for another GPU architecture than the device's."""


class CaptureError(RuntimeError):
    """A kernel would have to be loaded while a CUDA graph is being captured."""


@dataclass
class _Variant:
    entry: object                 # manifest variant entry
    cubin: bytes
    program: HostProgram
    plan: LaunchPlanCache
    arg_names: list
    per_device: dict = field(default_factory=dict)   # ordinal -> (DeviceKernels, {id: PackedLaunch})


def _read_verified(root: str, fname: str, sha256: str) -> bytes:
    if os.path.basename(fname) != fname or fname in ("", ".", ".."):
        raise ArtifactIntegrityError(f"artifact file name {fname!r} is not a plain file name")
    path = os.path.join(root, fname)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ArtifactIntegrityError(f"cannot read artifact {path}: {e.strerror}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ArtifactIntegrityError(
            f"artifact {path} was modified or corrupted: sha256 {got} != manifest {sha256}; "
            f"refusing to load it (rebuild or re-copy the artifacts)")
    return data


def _fields(obj):
    return obj if isinstance(obj, dict) else vars(obj)


class Library:
    """Artifacts loaded from one directory. Thread-safe loading; launches are plain calls."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.manifest = read_manifest(self.path)
        self._lock = threading.Lock()
        self._variants: dict[str, _Variant] = {}
        for v in self.manifest.variants:
            cubin = _read_verified(self.path, v.cubin, v.sha256)
            hp = _fields(v.host_program)
            doc = json.loads(_read_verified(self.path, hp["file"], hp["sha256"]))
            program = HostProgram.from_dict(doc)
            names = [a[0] for a in v.host_args]
            kinds = [a[1] for a in v.host_args]
            ptr_idx = [i for i, kd in enumerate(kinds) if kd in ("ptr", "stream")]
            sizes = {sym: [p[2] if isinstance(p, (list, tuple)) else p["size"] for p in params]
                     for sym, params in v.params.items()}
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
        if capturing:
            raise CaptureError(
                f"kernel {var.entry.name} is not loaded on device {ordinal} yet and a CUDA graph is being "
                f"captured; call lib.warmup(device={ordinal}) (or run once) before capturing")
        with self._lock:
            state = var.per_device.get(ordinal)
            if state is None:
                params = {sym: [tuple(p) if isinstance(p, (list, tuple)) else (p["index"], p["offset"], p["size"])
                                for p in ps] for sym, ps in var.entry.params.items()}
                dk = driver.DeviceKernels(var.cubin, var.entry.kernel_symbols, ordinal,
                                          var.program.load_plan, params)
                state = (dk, {})
                var.per_device[ordinal] = state
        return state

    def warmup(self, device=None) -> int:
        """Load every variant whose arch matches `device` (default: current). Returns how many."""
        import torch
        ordinal = torch.cuda.current_device() if device is None else torch.device("cuda", device).index \
            if not isinstance(device, torch.device) else device.index
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
        arch = driver.device_arch(ordinal) if ordinal not in _ARCH_CACHE else _ARCH_CACHE[ordinal]
        _ARCH_CACHE[ordinal] = arch
        prob = select.Problem(arch, call.out_dtype, call.rank, call.wcscale, call.bias, call.m, call.n, call.k)
        entry = select.choose(self.variants, prob)
        var = self._variants[entry.name]
        stream = torch.cuda.current_stream(act.device)
        capturing = torch.cuda.is_current_stream_capturing()
        dk, packed_cache = self._device_kernels(var, ordinal, capturing)
        scalars = {"m": call.m, "n": call.n, "k": call.k}
        args = []
        for name in var.arg_names:
            if name in call.pointers:
                args.append(call.pointers[name])
            elif name in scalars:
                args.append(scalars[name])
            elif name == "stream":
                args.append(stream.cuda_stream)
            else:
                raise RuntimeError(f"variant {entry.name} has host argument {name!r} this loader does not know")
        rec = var.plan.get(args)
        key = (rec.kernel, rec.grid, rec.block, rec.smem, tuple(rec.attrs), tuple(len(p) for p in rec.params))
        packed = packed_cache.get(key)
        if packed is None:
            packed = driver.PackedLaunch(rec, dk.kernels[rec.kernel])
            packed_cache[key] = packed
        else:
            packed.set_params(rec.params)
        dk.make_current()
        packed.launch(rec.stream)
        return call.out


_ARCH_CACHE: dict[int, str] = {}


def load(path: str = "artifacts") -> Library:
    """Read, validate and verify the artifacts in `path`. No CUDA call is made here."""
    return Library(path)

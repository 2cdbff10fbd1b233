"""One launcher per (variant, device): host arguments in, kernel launched.

``Launcher.launch(args)`` takes the variant's host-function arguments in
order (device pointers and the stream as ints, scalars as ints) and makes
the launch the DSL's host code would have made:

* with a build-time :class:`~.launch_recipe.LaunchRecipe`: one dict lookup
  of the scalar tuple gives a prebuilt launch (grid, block, SMEM, attributes
  in a C ``CUlaunchConfig``, parameters in one arena with a stable
  ``void*[]``); the pointers are written in and libcuda's
  ``cuLaunchKernelEx`` is called through ctypes;
* without one, or where the recipe does not apply (scalars outside its
  domain, a guard, an unaligned or null pointer it was not verified for):
  the general path, :class:`~.launch_plan.LaunchPlanCache` (the host-program
  interpreter, cached per shape with pointer patching).

The DSL's own error path is honoured on the general path: a launch the host
code prints an error for, or traps on, raises :class:`LaunchRefused` naming
the variant (the recipe's guards send such inputs there).  A failing
``cuLaunchKernelEx`` raises :class:`~.driver.CudaError` with the variant and
the driver's error name.

Launches are serialised by a per-launcher lock: the patched buffers are
shared, and the driver copies parameter values during the call.  Making the
right context current is the caller's business.
"""
from __future__ import annotations

import threading
import weakref
from operator import and_, itemgetter
from typing import Callable, Sequence

from . import driver
from .hostvm import HostProgram, HostReturned, HostTrap, HostVMError
from .launch_plan import CachedLaunch, LaunchPlanCache
from .errors import LaunchRefused  # the DSL's own host code flagged the launch as invalid
from .launch_recipe import LaunchRecipe

_GENERAL = object()  # cache value: this scalar tuple takes the general path


def _getter(idx: Sequence[int]):
    idx = tuple(idx)
    if len(idx) == 1:
        i = idx[0]
        return lambda a: (a[i],)
    if not idx:
        return lambda a: ()
    return itemgetter(*idx)


class Launcher:
    """Launches of one variant on one device.

    ``kernels``: ``{symbol: CUkernel handle}`` (cuda.bindings objects or
    ints); ``ptr_arg_indices``: the host arguments that are pointers or the
    stream; ``param_sizes``: ``{symbol: [size per parameter]}`` from the
    cubin.  ``launch_fn`` replaces libcuda's ``cuLaunchKernelEx`` (tests).
    """

    def __init__(self, name: str, kernels: dict, program: HostProgram, recipe: LaunchRecipe | None,
                 ptr_arg_indices: Sequence[int], param_sizes: dict[str, list[int]],
                 *, launch_fn: Callable[[int, int, int, int | None], int] | None = None, max_entries: int = 4096,
                 device=None):
        self.name = name
        self.device = device  # the DeviceKernels it launches from (the library switches contexts with it)
        self.kernels = {sym: int(h) for sym, h in kernels.items()}
        self.program = program
        self.recipe = recipe
        self.ptr_idx = tuple(sorted(set(int(i) for i in ptr_arg_indices)))
        nargs = len(program.arg_kinds)
        if recipe is not None:
            if recipe.nargs != nargs or set(recipe.ptr_args) != set(self.ptr_idx):
                raise ValueError(f"{name}: the launch recipe's arguments do not match the host program's")
            if recipe.kernel not in self.kernels:
                raise ValueError(f"{name}: the launch recipe launches {recipe.kernel!r}, not a loaded kernel")
            self._scalars_of = _getter(recipe.scalar_args)
            self._ptrs_of = _getter(recipe.ptr_args)
        self.plan = LaunchPlanCache(program, self.ptr_idx, param_sizes)
        self._fn = launch_fn if launch_fn is not None else self._first_launch
        self._lock = threading.Lock()
        self._nargs = nargs
        self._entries: dict = {}
        self._max = max_entries
        self._configs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CachedLaunch -> config
        self.recipe_launches = 0  # counts of the slow paths only (the hot path stays uncounted)
        self.general_launches = 0

    @classmethod
    def for_variant(cls, vv, dk) -> "Launcher":
        """The launcher of a verified variant (`verify.VerifiedVariant`) on a loaded device (`DeviceKernels`)."""
        e = vv.entry
        ptr_idx = [i for i, (_, kind) in enumerate(e.host_args) if kind in ("ptr", "stream")]
        sizes = {sym: [p.size for p in params] for sym, params in e.params.items()}
        return cls(e.name, dk.kernels, vv.program, vv.recipe, ptr_idx, sizes, device=dk)

    # -- hot path ------------------------------------------------------------
    def launch(self, args: Sequence[int]) -> None:
        """Launch with the host arguments ``args`` (host-argument order)."""
        if self.recipe is None:
            return self._general(args)
        e = self._entries.get(self._scalars_of(args))
        if e is None:
            e = self._bind(args)
        if e is _GENERAL:
            return self._general(args)
        patch, aligned, amask, nonnull, cfg, cfg_addr, func, kp, spos, bound = e
        p = self._ptrs_of(args)
        if max(p) >> 48 or (amask and any(map(and_, aligned(p), amask))) or (nonnull and not all(nonnull(p))):
            return self._general(args)  # a pointer the recipe was not verified for
        with self._lock:
            patch(p)
            if spos is not None:
                cfg.hStream = p[spos]
            rc = self._fn(cfg_addr, func, kp, None)
        if rc:
            self._failed(rc, bound.kernel)

    # -- slow paths --------------------------------------------------------------
    def _bind(self, args):
        if len(args) != self._nargs:
            raise HostVMError(f"{self.name}: the host function takes {self._nargs} arguments, got {len(args)}")
        key = self._scalars_of(args)
        b = self.recipe.bind(key)
        if b is None:
            e = _GENERAL
        else:
            cfg = driver.raw_launch_config(b.grid, b.block, b.smem, b.attrs)
            nonnull = _getter(b.nonnull) if b.nonnull else None
            align = [i for i, m in enumerate(b.pmask) if m & 0xFFFF]  # pointers with an alignment need
            amask = tuple(b.pmask[i] for i in align)
            e = (b.patch, _getter(align), amask, nonnull, cfg, _addressof(cfg), self.kernels[b.kernel],
                 b.kernel_params_address, b.stream_pos, b)
            self.recipe_launches += 1
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[key] = e
        return e

    def _general(self, args) -> None:
        """The interpreter path (cached per shape): always correct, slower."""
        self.general_launches += 1
        with self._lock:
            try:
                rec = self.plan.get(args)
            except (HostTrap, HostReturned) as ex:
                raise LaunchRefused(f"host code of {self.name} refused this launch: {ex}") from ex
            if rec.printf:  # the DSL's host code reports a launch it knows will fail (e.g. SMEM over the limit)
                raise LaunchRefused(f"host code of {self.name} refused this launch: {rec.printf.strip()}")
            keep = None
            if rec.__class__ is CachedLaunch:
                cfg = self._configs.get(rec)
                if cfg is None:
                    cfg = self._configs[rec] = driver.raw_launch_config(rec.grid, rec.block, rec.smem, rec.attrs)
                kp = rec.kernel_params_address
            else:  # a shape the cache could not patch: one-off buffers
                cfg = driver.raw_launch_config(rec.grid, rec.block, rec.smem, rec.attrs)
                kp, keep = driver.param_array(rec.params)
            cfg.hStream = rec.stream or None
            func = self.kernels.get(rec.kernel)
            if func is None:
                raise driver.CudaError(f"{self.name}: host code launches {rec.kernel!r}, which is not loaded")
            rc = self._fn(_addressof(cfg), func, kp, None)
            del keep
        if rc:
            self._failed(rc, rec.kernel)

    def _first_launch(self, *args) -> int:
        """Bind libcuda's cuLaunchKernelEx on first use (a machine without a driver can still build launchers)."""
        self._fn = driver.raw_launch_kernel_ex()
        return self._fn(*args)

    def _failed(self, rc: int, kernel: str):
        raise driver.CudaError(f"{self.name}: cuLaunchKernelEx({kernel}) failed: {driver.error_name(rc)} ({rc})")


def _addressof(cfg) -> int:
    import ctypes
    return ctypes.addressof(cfg)


__all__ = ["LaunchRefused", "Launcher"]

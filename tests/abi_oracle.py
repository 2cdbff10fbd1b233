"""Oracle for the launch ABI: run the DSL's OWN compiled host code on the CPU.

``cute.compile`` leaves the fully lowered host module in ``compiled.ir_module``
(LLVM dialect).  We JIT a copy of it with the DSL's bundled MLIR
``ExecutionEngine`` (the same engine and opt level the DSL itself uses), but
with every CUDA runtime entry point (``_cudaLaunchKernelEx``,
``_cudaLibraryGetKernel``, ``_cudaDeviceGetAttribute``, ...) bound, by exact
symbol name via ``raw_register_runtime`` before the first lookup, to ctypes
recording stubs.  Then:

* ``cuda_load_to_device`` is called once (stubs answer the attribute
  queries and hand out fake kernel handles; the attribute writes are
  recorded), which also binds the kernel-handle globals;
* the host entry is called through the engine's packed interface
  (``_mlir_<name>(void**)``) with the caller's integer arguments; the
  ``_cudaLaunchKernelEx`` stub copies out grid/block/smem/stream/attributes
  and each kernel parameter's bytes (sizes from the cubin).

Never call it on inputs that make the DSL code trap (``llvm.intr.trap`` is a
SIGILL in this process).

Extend to a new kernel: compile it (``--keep-cubin --dump-dir D``), then
``dsl_oracle_launch(compiled, args, param_sizes=sizes_from_cubin)`` and compare
with ``HostProgram.launch`` (see ``compare_records``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import struct
import sys
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_kernels  # noqa: E402

abi_kernels.ensure_packages()

from svdq_loader.hostvm import LaunchRecord  # noqa: E402

_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_LAUNCH_T = ctypes.CFUNCTYPE(_I32, _P, _P, _P)
_GETK_T = ctypes.CFUNCTYPE(_I32, _P, _P, _P)
_DEVATTR_T = ctypes.CFUNCTYPE(_I32, _P, _I32, _I32)
_GETDEV_T = ctypes.CFUNCTYPE(_I32, _P)
_KATTR_T = ctypes.CFUNCTYPE(_I32, _P, _I32, _P, _I32)
_KSET_T = ctypes.CFUNCTYPE(_I32, _P, _I32, _I32, _I32)
_FSET_T = ctypes.CFUNCTYPE(_I32, _P, _I32, _I32)
_FAIL_T = ctypes.CFUNCTYPE(_I32)

_FAKE_HANDLE_BASE = 0x5A00_0000_0000
_FAKE_LIB = 0x5B00_0000_0010

_STUBBED = {
    "_cudaLaunchKernelEx",
    "_cudaLibraryGetKernel",
    "_cudaDeviceGetAttribute",
    "_cudaGetDevice",
    "_cuKernelGetAttribute",
    "_cudaKernelSetAttributeForDevice",
    "_cudaFuncSetAttribute",
}
_LIBC = {"printf", "malloc", "free", "memcpy", "memset", "puts", "abort"}


class _Oracle:
    def __init__(self, compiled):
        from cutlass._mlir import ir
        from cutlass._mlir.execution_engine import ExecutionEngine
        from svdq_aot.host_ir import parse_type

        self.compiled = compiled
        src = compiled.ir_module
        with src.context:
            self.module = ir.Module.parse(str(src))
            decls = []
            self.arg_types = None
            for op in self.module.body.operations:
                op = op.operation
                if op.name != "llvm.func":
                    continue
                name = op.attributes["sym_name"].value
                if len(list(op.regions[0].blocks)) == 0:
                    decls.append(name)
                if name == compiled.function_name:
                    self.arg_types = parse_type(op.attributes["function_type"].value)[2]
            self.engine = ExecutionEngine(self.module, opt_level=2, shared_libs=[])
        assert self.arg_types is not None
        # recording state
        self.handles: dict[int, str] = {}
        self.launches: list[LaunchRecord] = []
        self.set_attrs: list[tuple[str, int, int]] = []
        self.param_sizes: dict[str, list[int]] | None = None
        self.device_attr: Callable[[int, int], int] = lambda a, d: 0
        self.kernel_attr: Callable[[str, int, int], int] = lambda k, a, d: 0
        self.device = 0
        self.unexpected: list[str] = []
        self._cbs = []
        stubs = {
            "_cudaLaunchKernelEx": _LAUNCH_T(self._launch),
            "_cudaLibraryGetKernel": _GETK_T(self._get_kernel),
            "_cudaDeviceGetAttribute": _DEVATTR_T(self._dev_attr),
            "_cudaGetDevice": _GETDEV_T(self._get_device),
            "_cuKernelGetAttribute": _KATTR_T(self._kernel_attr),
            "_cudaKernelSetAttributeForDevice": _KSET_T(self._kset),
            "_cudaFuncSetAttribute": _FSET_T(self._fset),
        }
        for name in decls:
            if name in _LIBC:
                continue
            cb = stubs.get(name)
            if cb is None:
                cb = _FAIL_T(self._make_fail(name))
            self._cbs.append(cb)
            self.engine.raw_register_runtime(name, ctypes.cast(cb, _P))
        self._entry = ctypes.CFUNCTYPE(None, _P)(self.engine.raw_lookup(compiled.function_name))
        self._load = ctypes.CFUNCTYPE(None, _P)(self.engine.raw_lookup("cuda_load_to_device"))
        # bind the kernel-handle globals once, as the DSL does at module load
        self.load(lambda a, d: 232448, lambda k, a, d: 0, 0)

    # -- stubs -------------------------------------------------------------
    def _make_fail(self, name):
        def fail():
            self.unexpected.append(name)
            return 999
        return fail

    def _launch(self, cfg, kernel, argv):
        raw = ctypes.string_at(cfg, 56)
        gx, gy, gz, bx, by, bz = struct.unpack_from("<6I", raw, 0)
        smem, stream, attrs_ptr = struct.unpack_from("<QQQ", raw, 24)
        nattr = struct.unpack_from("<I", raw, 48)[0]
        attrs = []
        for i in range(nattr):
            a = ctypes.string_at(attrs_ptr + 72 * i, 72)
            attrs.append((struct.unpack_from("<I", a)[0], a[8:72]))
        name = self.handles[kernel]
        sizes = self.param_sizes[name]
        params = []
        for i, n in enumerate(sizes):
            p = ctypes.c_uint64.from_address(argv + 8 * i).value
            params.append(ctypes.string_at(p, n))
        self.launches.append(LaunchRecord(name, (gx, gy, gz), (bx, by, bz), smem, stream or 0, attrs, params))
        return 0

    def _get_kernel(self, out, lib, name):
        assert lib == _FAKE_LIB
        n = ctypes.string_at(name).decode()
        h = None
        for k, v in self.handles.items():
            if v == n:
                h = k
        if h is None:
            h = _FAKE_HANDLE_BASE + 0x100 * (len(self.handles) + 1)
            self.handles[h] = n
        ctypes.c_uint64.from_address(out).value = h
        return 0

    def _dev_attr(self, out, attr, dev):
        ctypes.c_int32.from_address(out).value = int(self.device_attr(attr, dev))
        return 0

    def _get_device(self, out):
        ctypes.c_int32.from_address(out).value = self.device
        return 0

    def _kernel_attr(self, out, attr, kernel, dev):
        ctypes.c_int32.from_address(out).value = int(self.kernel_attr(self.handles[kernel], attr, dev))
        return 0

    def _kset(self, kernel, attr, value, dev):
        self.set_attrs.append((self.handles[kernel], attr, value))
        return 0

    def _fset(self, kernel, attr, value):
        self.set_attrs.append((self.handles[kernel], attr, value))
        return 0

    # -- calls -------------------------------------------------------------
    @staticmethod
    def _packed(fn, values):
        ret = ctypes.c_int32(-12345)
        store = list(values) + [ret]
        arr = (_P * len(store))(*[ctypes.addressof(v) for v in store])
        fn(arr)
        return ret.value

    def _ctype(self, t, v):
        if t[0] == "ptr":
            return ctypes.c_uint64(int(v) & (2**64 - 1))
        if t[0] == "int":
            w = t[1]
            v = int(v) & ((1 << w) - 1)
            return {1: ctypes.c_uint8, 8: ctypes.c_uint8, 16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}[w](v)
        if t[0] == "float":
            if isinstance(v, float):
                return {32: ctypes.c_float, 64: ctypes.c_double}[t[1]](v)
            return {16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}[t[1]](int(v))
        raise TypeError(f"oracle cannot pass an argument of type {t}")

    def load(self, device_attr, kernel_attr, device):
        self.device_attr, self.kernel_attr, self.device = device_attr, kernel_attr, device
        self.set_attrs = []
        lib = ctypes.c_uint64(_FAKE_LIB)
        rc = self._packed(self._load, [ctypes.c_uint64(ctypes.addressof(lib)), ctypes.c_int32(device)])
        if rc != 0:
            raise RuntimeError(f"cuda_load_to_device returned {rc} (unexpected calls: {self.unexpected})")
        return list(self.set_attrs)

    def launch_all(self, args, param_sizes):
        if len(args) != len(self.arg_types):
            raise TypeError(f"entry takes {len(self.arg_types)} args, got {len(args)}")
        self.param_sizes = param_sizes
        self.launches = []
        vals = [self._ctype(t, v) for t, v in zip(self.arg_types, args)]
        rc = self._packed(self._entry, vals)
        if rc != 0:
            raise RuntimeError(f"DSL host function returned {rc} (unexpected calls: {self.unexpected})")
        return list(self.launches)


_ORACLES: dict[int, tuple[object, _Oracle]] = {}


def _oracle(compiled) -> _Oracle:
    hit = _ORACLES.get(id(compiled))
    if hit is not None and hit[0] is compiled:
        return hit[1]
    o = _Oracle(compiled)
    _ORACLES[id(compiled)] = (compiled, o)
    return o


def dsl_oracle_launch(compiled, args: Sequence, param_sizes: dict[str, list[int]]) -> LaunchRecord:
    """Launch as the DSL's own compiled host code makes it (CUDA runtime stubbed).

    ``param_sizes``: ``{kernel symbol: [size of each parameter]}`` (from the
    cubin, e.g. ``svdq_loader.cubin_info.param_sizes``).  Attribute value
    bytes and padding the DSL code never writes are stack garbage here.
    """
    recs = _oracle(compiled).launch_all(args, param_sizes)
    if len(recs) != 1:
        raise RuntimeError(f"expected one launch, DSL host code made {len(recs)}")
    return recs[0]


def dsl_oracle_load_plan(compiled, device_attr, kernel_attr, device: int) -> list[tuple[str, int, int]]:
    """``(kernel, attr, value)`` for each attribute the DSL's ``cuda_load_to_device`` sets."""
    return _oracle(compiled).load(device_attr, kernel_attr, device)


def cubin_from_dump(dump_dir: str) -> bytes:
    files = glob.glob(os.path.join(dump_dir, "*.cubin"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one cubin in {dump_dir}, found {files}")
    with open(files[0], "rb") as fh:
        return fh.read()


def defined_mask(program, args, param_sizes, fills=(0x00, 0xA5, 0x5A)):
    """Which bytes of the VM's launch do not depend on uninitialised memory/poison.

    Returns ``(attr_masks, param_masks)``: lists of bytes-like masks (1 =
    defined).  A byte is undefined when it changes with the VM's
    ``undef_byte``; the DSL's own code has stack garbage there.
    """
    recs = [program.launch(args, param_sizes, undef_byte=f) for f in fills]
    base = recs[0]
    amask = []
    for i, (_, v) in enumerate(base.attrs):
        amask.append(bytes(int(all(r.attrs[i][1][j] == v[j] for r in recs)) for j in range(len(v))))
    pmask = []
    for i, p in enumerate(base.params):
        pmask.append(bytes(int(all(r.params[i][j] == p[j] for r in recs)) for j in range(len(p))))
    for r in recs[1:]:
        assert (r.kernel, r.grid, r.block, r.smem, r.stream) == (base.kernel, base.grid, base.block, base.smem, base.stream)
        assert [a for a, _ in r.attrs] == [a for a, _ in base.attrs]
        assert [len(p) for p in r.params] == [len(p) for p in base.params]
    return amask, pmask


def compare_records(vm: LaunchRecord, dsl: LaunchRecord, amask, pmask) -> list[str]:
    """Differences between the VM's and the DSL's launch on defined bytes (empty = equal)."""
    diffs = []
    for f in ("kernel", "grid", "block", "smem", "stream"):
        if getattr(vm, f) != getattr(dsl, f):
            diffs.append(f"{f}: vm={getattr(vm, f)!r} dsl={getattr(dsl, f)!r}")
    if [a for a, _ in vm.attrs] != [a for a, _ in dsl.attrs]:
        diffs.append(f"attr ids: vm={[a for a, _ in vm.attrs]} dsl={[a for a, _ in dsl.attrs]}")
    else:
        for i, ((aid, va), (_, da), m) in enumerate(zip(vm.attrs, dsl.attrs, amask)):
            bad = [j for j in range(64) if m[j] and va[j] != da[j]]
            if bad:
                diffs.append(f"attr {aid} bytes {bad[:8]}: vm={va.hex()} dsl={da.hex()}")
    if len(vm.params) != len(dsl.params):
        diffs.append(f"param count: vm={len(vm.params)} dsl={len(dsl.params)}")
    else:
        for i, (vp, dp, m) in enumerate(zip(vm.params, dsl.params, pmask)):
            if len(vp) != len(dp):
                diffs.append(f"param {i} size: vm={len(vp)} dsl={len(dp)}")
                continue
            bad = [j for j in range(len(vp)) if m[j] and vp[j] != dp[j]]
            if bad:
                diffs.append(f"param {i} bytes {bad[:8]}...: vm={vp.hex()} dsl={dp.hex()}")
    return diffs


# ---------------------------------------------------------------------------
# Building the test kernels (cached per process)
# ---------------------------------------------------------------------------

_BUILT: dict = {}


class Built:
    """A compiled test kernel with everything the tests need."""

    def __init__(self, name, module, compiled, cubin, doc):
        from svdq_loader.cubin_info import param_sizes
        from svdq_loader.hostvm import HostProgram

        self.name = name
        self.module = module
        self.compiled = compiled
        self.cubin = cubin
        self.doc = doc
        self.program = HostProgram.from_dict(doc)
        self.sizes = param_sizes(cubin)
        self.kinds = [k for _, k in module.HOST_ARGS]
        self.ptr_idx = [i for i, k in enumerate(self.kinds) if k in ("ptr", "stream")]


def build(name: str, arch: str = "sm_90a") -> Built:
    """Compile ``abi_kernels.<name>`` for ``arch``, keep its cubin, serialise its host code."""
    import importlib
    import json
    import tempfile

    key = (name, arch)
    if key in _BUILT:
        return _BUILT[key]
    from svdq_aot.host_ir import serialize_host

    module = importlib.import_module(f"abi_kernels.{name}")
    with tempfile.TemporaryDirectory(prefix="svdq-abi-") as d:
        compiled = module.compile(d, arch)
        cubin = cubin_from_dump(d)
    doc = json.loads(json.dumps(serialize_host(compiled)))  # exactly what an artifact holds
    b = Built(name, module, compiled, cubin, doc)
    _BUILT[key] = b
    return b


def random_launch_args(rng, spec, req, *, ms, m_hi, nk_hi, sm_counts, null_rate=0.1) -> list:
    """A random argument list for `spec`'s host function (the op spec's order), for the launch-byte checks:
    16-byte aligned pointers (null with probability `null_rate`), a null or random stream, M from `ms` or
    below `m_hi`, N and K whole multiples of `req` (below `nk_hi` of them), sm_count from `sm_counts`, and
    0 / 1 for any other integer (feature switches)."""
    out = []
    for a, kind in spec.host_args:
        if kind == "ptr":
            out.append(0 if rng.random() < null_rate else rng.randrange(1 << 32, 1 << 47) & ~15)
        elif kind == "stream":
            out.append(rng.choice([0, rng.randrange(1 << 20, 1 << 47)]))
        elif a == "m":
            out.append(rng.choice(list(ms) + [rng.randrange(1, m_hi)]))
        elif a in ("n", "k"):
            out.append(req[f"{a}_multiple"] * rng.randrange(1, nk_hi))
        elif a == "sm_count":
            out.append(rng.choice(sm_counts))
        elif a == "ksplit":
            out.append(rng.choice([1, 2, 4, 8]))
        elif a == "ctas":
            out.append(rng.choice([1, 396, rng.randrange(1, 1 << 20)]))
        else:
            out.append(rng.randrange(0, 2))
    return out

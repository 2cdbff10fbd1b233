"""What every kernel family reads out of a compiled DSL function (build time only; imports no DSL itself)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from svdq_loader.cubin_info import cubin_info


def placeholder_args(spec: Any, ptr_dtypes: dict[str, Any], default_ptr_dtype: Any) -> tuple:
    """Trace-time arguments of an op's host function, in the op spec's host-argument order: a null global
    pointer of ``ptr_dtypes.get(name, default_ptr_dtype)`` per pointer (16-byte aligned, as the loader
    guarantees), and dynamic values for the integers and the stream (their values are not traced)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr

    make = dict(ptr=lambda a: make_ptr(ptr_dtypes.get(a, default_ptr_dtype), 0, cute.AddressSpace.gmem,
                                       assumed_align=16),
                i32=lambda a: Int32(1), stream=lambda a: cuda.CUstream(0))
    return tuple(make[kind](a) for a, kind in spec.host_args)


def read_cubin(compiled: Any, dump_dir: str, arch: str) -> bytes:
    """The ELF cubin of `compiled` (from the DSL's artifacts, else the file it dumped for `arch`)."""
    art = compiled.artifacts.CUBIN
    data = None
    if isinstance(art, (bytes, bytearray)):
        data = bytes(art)
    elif isinstance(art, str) and os.path.isfile(art):
        with open(art, "rb") as f:
            data = f.read()
    if data is None:
        with open(os.path.join(dump_dir, f"{compiled.function_name}.{arch}.cubin"), "rb") as f:
            data = f.read()
    if not data.startswith(b"\x7fELF"):
        raise RuntimeError("compiled artifact is not an ELF cubin")
    return data


def cubin_resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """Registers and stack-frame bytes per kernel, from the cubin's .nv.info (a frame means spills)."""
    return {n: {"registers": k.regcount, "stack_frame_bytes": k.frame_size or 0}
            for n, k in cubin_info(cubin).kernels.items()}


#: Shared memory per SM (bytes) of each target arch: what the DSL asks the CUDA driver for when a kernel states a
#: minimum of CTAs per SM above one (sm_90 / sm_100 / sm_103: 228 KiB; sm_120 / sm_121: 100 KiB).
SMEM_PER_SM = {"sm_90a": 228 * 1024, "sm_100a": 228 * 1024, "sm_103a": 228 * 1024,
               "sm_120a": 100 * 1024, "sm_121a": 100 * 1024}


@contextlib.contextmanager
def target_device_answers(arch: str) -> Iterator[None]:
    """While tracing for `arch`, the DSL's device-attribute queries are answered from the target's table above, not
    from a GPU: the build machine has none (the query would fail), and where it has one, that GPU is not the
    target.  Any attribute the table does not hold is refused by name."""
    from cutlass.base_dsl.runtime import cuda as cuda_helpers

    smem_attr = cuda_helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    real = cuda_helpers.get_device_attribute

    def answer(attribute, *args, **kwargs):
        if attribute == smem_attr:
            return SMEM_PER_SM[arch]
        raise RuntimeError(f"the DSL asked for device attribute {attribute!r} while cross-compiling for {arch}; "
                           f"the build has no answer for it (only shared memory per SM)")

    cuda_helpers.get_device_attribute = answer
    try:
        yield
    finally:
        cuda_helpers.get_device_attribute = real


def stack_frame_problem(usage: dict[str, dict[str, int]]) -> str | None:
    """None, or which kernel has a stack frame (spilled registers or local arrays): no family ships one."""
    for sym, u in usage.items():
        if u["stack_frame_bytes"]:
            return f"kernel {sym} spills: {u['stack_frame_bytes']}-byte stack frame at {u['registers']} registers"
    return None


def compile_named(kernel_cls: Any, instance: Any, args: tuple, name: str, arch: str, dump_dir: str,
                  *, keep_ptx: bool = False) -> tuple[Any, bytes, list[str]]:
    """Trace and cross-compile `instance` (a `kernel_cls` object with ``kernel`` -- or the kernel methods its
    ``KERNEL_METHODS`` names, of which ``__call__`` launches one -- and ``__call__``) for `arch`.

    The kernel symbol becomes ``<name>_0`` and the host function ``svdq_host_...``; neither may carry
    "cutlass" (ptxas was seen to spill on such symbols).  Returns (compiled function, cubin, symbols).
    """
    import warnings

    import cutlass.cute as cute

    if "cutlass" in name.lower():
        raise ValueError(f"kernel name {name!r} must not contain 'cutlass' (ptxas spills on such symbols)")
    for attr in getattr(kernel_cls, "KERNEL_METHODS", ("kernel",)):     # a class may hold several forms
        getattr(kernel_cls, attr).set_name_prefix(name, remove_cutlass_symbol=True, keep_mangled_name=False)
    host = name.replace("svdq_", "svdq_host_", 1) if name.startswith("svdq_") else "host_" + name
    kernel_cls.__call__.set_name_prefix(host, remove_cutlass_symbol=True, keep_mangled_name=False)
    os.makedirs(dump_dir, exist_ok=True)
    options = f"--gpu-arch {arch} --keep-cubin --dump-dir {dump_dir}" + (" --keep-ptx" if keep_ptx else "")
    with warnings.catch_warnings():
        # epilogues deliberately unroll whole fragments; the DSL warns about slow tracing
        warnings.filterwarnings("ignore", message="This static loop has")
        with target_device_answers(arch):
            compiled = cute.compile(instance, *args, options=options)
    cubin = read_cubin(compiled, dump_dir, arch)
    symbols = list(compiled.kernel_info)
    for sym in symbols:
        if "cutlass" in sym.lower() or not sym.startswith(name):
            raise RuntimeError(f"unexpected kernel symbol {sym!r} (must start {name!r}, no 'cutlass')")
    return compiled, cubin, symbols


def compile_kernel(kernel_cls: Any, instance: Any, spec: Any, ptr_dtypes: dict[str, Any], default_ptr_dtype: Any,
                   name: str, arch: str, dump_dir: str, smem_bytes: Any, *, keep_ptx: bool = False):
    """The body every family's ``compile`` shares: placeholder arguments of `spec`'s host function, trace and
    cross-compile `instance` (`compile_named`), and the `CompiledKernel` with registers and stack frames read
    off the cubin; a kernel with a stack frame (spills) is refused with a RuntimeError naming it.  `smem_bytes`:
    the dynamic SMEM the host function requests, or a function of `instance` for what the DSL only knows after
    tracing."""
    from svdq_aot.family import CompiledKernel

    args = placeholder_args(spec, ptr_dtypes, default_ptr_dtype)
    compiled, cubin, symbols = compile_named(kernel_cls, instance, args, name, arch, dump_dir, keep_ptx=keep_ptx)
    smem = smem_bytes(instance) if callable(smem_bytes) else smem_bytes
    usage = cubin_resource_usage(cubin)
    problem = stack_frame_problem(usage)
    if problem:             # no family ships a kernel that spills: the build fails (or --keep-going lists it)
        raise RuntimeError(f"{name}: {problem}")
    return CompiledKernel(cubin=cubin, compiled=compiled, entry=compiled.function_name, kernel_symbols=symbols,
                          smem_bytes=int(smem), resource_usage=usage)


def refuse_invalid(name: str, reason: str | None) -> None:
    """A family's ``compile`` refuses a variant its validity predicate rejects, before any tracing."""
    if reason:
        raise ValueError(f"cannot compile {name}: {reason}")

"""What the kernel-compile tests (and tools/*_sweep.py) share: finding cuobjdump, reading SASS, the ELF's
SM number, and compiling a list of GEMM cases once per module."""
from __future__ import annotations

import json
import os
import shutil
import subprocess


def cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one the test extra installs (nvidia-cuda-cuobjdump), else None."""
    here = shutil.which("cuobjdump")
    if here:
        return here
    try:
        import nvidia
        base = os.path.dirname(nvidia.__path__[0])
    except Exception:
        return None
    for root, _, files in os.walk(os.path.join(base, "nvidia")):
        if "cuobjdump" in files:
            return os.path.join(root, "cuobjdump")
    return None


def dump_sass(cubin_path: str, tool: str | None = None) -> str | None:
    """The SASS of a cubin file, or None where cuobjdump (or the nvdisasm it calls) is missing."""
    tool = tool or cuobjdump()
    if tool is None:
        return None
    r = subprocess.run([tool, "--dump-sass", cubin_path], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 and "Function" in r.stdout else None


def sass_of_cubin(cubin: bytes, folder) -> str:
    """The SASS of `cubin` (written into `folder`); skips the test under SVDQ_ALLOW_NO_SASS=1 where cuobjdump
    or nvdisasm is missing, else fails it."""
    import pytest
    path = os.path.join(str(folder), "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = dump_sass(path)
    if sass is None:
        if os.environ.get("SVDQ_ALLOW_NO_SASS") == "1":
            pytest.skip("cuobjdump / nvdisasm not available: SASS checks skipped (SVDQ_ALLOW_NO_SASS=1)")
        pytest.fail("cuobjdump / nvdisasm not found: install the test extra or set SVDQ_ALLOW_NO_SASS=1")
    return sass


def elf_sm(info) -> int:
    """SM number from the ELF flags: ABI v7 (sm_90) keeps it in the low byte, v8 (sm_100+) in bits 8-15."""
    return (info.e_flags >> 8) & 0xFF if info.abi_version >= 8 else info.e_flags & 0xFF


def compile_gemm_cases(fam, cases, knobs_of, id_of, tmp_path_factory) -> dict:
    """Compile every GEMM case of a family once: case -> (name, knobs, compiled kernel, cubin path, host
    program, parameter sizes)."""
    from svdq_aot.host_ir import serialize_host
    from svdq_loader.cubin_info import param_sizes
    from svdq_loader.hostvm import HostProgram
    from svdq_loader.ops import GEMM_W4A4

    out = {}
    for c in cases:
        arch = c[0]
        knobs = knobs_of(*c)
        name = GEMM_W4A4.name_for(arch, knobs, fam.requirements(arch, knobs))
        d = tmp_path_factory.mktemp(id_of(c))
        ck = fam.compile(arch, knobs, name, str(d))
        path = d / "k.cubin"
        path.write_bytes(ck.cubin)
        host = json.loads(json.dumps(serialize_host(ck.compiled)))
        out[c] = (name, knobs, ck, str(path), HostProgram.from_dict(host), param_sizes(ck.cubin))
    return out

"""What every kernel family reads out of a compiled DSL function (build time only; imports no DSL itself)."""
from __future__ import annotations

import os
from typing import Any

from svdq_loader.cubin_info import cubin_info


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

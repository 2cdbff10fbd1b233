"""What the kernel-compile tests (and tools/*_sweep.py, tools/sass_loops.py) share: finding cuobjdump, reading
SASS and its loops, the ELF's SM number, and compiling a list of GEMM cases once per module."""
from __future__ import annotations

import json
import os
import re
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


_INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_BRA = re.compile(r"\bBRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)")
_MMA = re.compile(r"\b(HG?MMA|QGMMA)\.")      # fp16 / bf16 MMAs, and Hopper's FP8 wgmma (QGMMA)
#: a branch taken under a predicate: ``@P0 BRA 0x..`` (per thread) or ``BRA.U UP0, 0x..`` (uniform predicate)
_COND_BRA = re.compile(r"^(@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(!?UP\w+\s*,\s*)?(?:`\()?0x([0-9a-f]+)")
_BRA_DIV = re.compile(r"\bBRA\.DIV\s+\w+\s*,\s*(?:`\()?0x([0-9a-f]+)")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction, in order."""
    return [(int(a, 16), txt) for a, txt in _INSN.findall(sass)]


def divergent_paths(ins: list[tuple[int, str]]) -> set[int]:
    """Indices of the instructions ptxas placed for a diverged warp: from each ``BRA.DIV`` target to the first
    unconditional branch after it (the path back).  A converged warp never runs them."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    out: set[int] = set()
    for _, txt in ins:
        m = _BRA_DIV.search(txt)
        j = where.get(int(m.group(1), 16)) if m else None
        while j is not None and j < len(ins):
            out.add(j)
            t = ins[j][1]
            if _BRA.search(t) and not t.startswith("@"):     # (BRA.DIV / BRA.CONV name a register: no match)
                break
            j += 1
    return out


def loops(ins: list[tuple[int, str]]) -> list[dict]:
    """Every backward branch as a loop (except the return branches of `divergent_paths`): its target and
    branch addresses, the instructions from one to the other (divergent paths between them left out), and how
    many of them are HMMA / HGMMA / QGMMA.  Largest first."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    skip = divergent_paths(ins)
    out = []
    for i, (a, txt) in enumerate(ins):
        m = _BRA.search(txt)
        if not m or i in skip:
            continue
        target = int(m.group(1), 16)
        if target > a or target not in where:
            continue
        body = [ins[j] for j in range(where[target], i + 1) if j not in skip]
        out.append(dict(start=target, end=a, instructions=len(body),
                        hmma=sum(bool(_MMA.search(t)) for _, t in body)))
    return sorted(out, key=lambda d: (-d["instructions"], d["start"]))


def skipped_by_branch(ins: list[tuple[int, str]], start: int, end: int, pattern: str) -> bool:
    """Whether, inside the loop from address ``start`` to ``end``, every instruction matching ``pattern`` (a regular
    expression; at least one) lies behind one conditional forward branch that jumps past them all: code a warp
    can skip, where ptxas did not turn the branch into predicated instructions that issue anyway."""
    body = [(a, t) for a, t in ins if start <= a <= end]
    hits = [a for a, t in body if re.search(pattern, t)]
    if not hits:
        return False
    for a, t in body:
        m = _COND_BRA.match(t)
        if m and (m.group(1) or m.group(2)) and a < hits[0] and hits[-1] < int(m.group(3), 16) <= end:
            return True
    return False


def collectives(ins: list[tuple[int, str]]) -> int:
    """How many WARPSYNC.COLLECTIVE blocks (ptxas' guard for a warp barrier it cannot prove converged)."""
    return sum("WARPSYNC.COLLECTIVE" in t for _, t in ins)


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


def check_output_store(sass: str, pairs: int) -> None:
    """The sm_90a GEMM's transposed output store (kernel_src/sm90_epilogue_ptx.py) for `pairs` accumulator pairs
    per thread: one movmatrix transpose per pair, no 16-bit stores, and in the build's store form (``quads``: one
    butterfly shuffle and one 64-bit store per two pairs, also the forms a ``bulk`` build does not stage; ``pairs``:
    one 32-bit store per pair)."""
    from svdq_kernels.sm90_plan import STORE
    assert sass.count("MOVM.16.MT88") == pairs, sass.count("MOVM.16.MT88")
    assert "STG.E.U16" not in sass
    if STORE == "pairs":
        assert len(re.findall(r"STG\.E desc", sass)) == pairs and "STG.E.64 desc" not in sass
    else:
        assert len(re.findall(r"STG\.E\.64 desc", sass)) == pairs // 2 and not re.search(r"STG\.E desc", sass)
        assert sass.count("SHFL.BFLY") == pairs // 2

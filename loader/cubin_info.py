"""Read the launch-relevant facts out of a cubin (NVIDIA ELF), in pure Python.

For every kernel (a ``STT_FUNC`` symbol with a ``.nv.info.<kernel>``
section) this reports:

* its parameters ``(index, offset, size)`` from the ``EIATTR_KPARAM_INFO``
  records of ``.nv.info.<kernel>`` (offsets are relative to the start of the
  parameter space),
* the parameter-space size (``EIATTR_PARAM_CBANK``; else
  ``EIATTR_CBANK_PARAM_SIZE``) and its offset in constant bank 0,
* the static shared memory (size of ``.nv.shared.<kernel>``),
* register count (``EIATTR_REGCOUNT`` in the global ``.nv.info``), frame
  and stack sizes when present, and the required block size
  (``EIATTR_REQNTID``) / max threads when present.

``.nv.info`` sections are sequences of records ``u8 format, u8 attribute``
followed by: nothing (format 1), a 2-byte value (formats 2 and 3), or a
``u16`` length and that many bytes (format 4).  A ``KPARAM_INFO`` payload is
``u32 index, u16 ordinal, u16 offset, u32 flags`` with the parameter size in
``flags >> 18``.

Errors are :class:`CubinFormatError` with a clear message; nothing here
imports anything outside the standard library.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

EM_CUDA = 190

# EIATTR attribute codes used here
EIATTR_MAX_THREADS = 0x05
EIATTR_PARAM_CBANK = 0x0A
EIATTR_REQNTID = 0x10
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19
EIATTR_MAXREG_COUNT = 0x1B
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F

EIFMT_NVAL = 0x01
EIFMT_BVAL = 0x02
EIFMT_HVAL = 0x03
EIFMT_SVAL = 0x04

SHT_SYMTAB = 2
SHT_NOBITS = 8
STT_FUNC = 2


class CubinFormatError(ValueError):
    """The bytes are not a well-formed cubin (or not one this reader understands)."""


@dataclass
class KernelInfo:
    name: str
    params: list[tuple[int, int, int]] = field(default_factory=list)  # (index, offset, size), by index
    param_space_size: int | None = None  # bytes of the parameter space
    param_cbank_offset: int | None = None  # where parameters start in constant bank 0
    static_smem: int = 0
    regcount: int | None = None
    frame_size: int | None = None
    min_stack_size: int | None = None
    max_stack_size: int | None = None
    reqntid: tuple[int, ...] | None = None
    max_threads: tuple[int, ...] | None = None
    maxreg_count: int | None = None

    @property
    def param_sizes(self) -> list[int]:
        return [s for _, _, s in self.params]


@dataclass
class CubinInfo:
    e_flags: int
    abi_version: int
    kernels: dict[str, KernelInfo]

    @property
    def sm(self) -> int | None:
        """SM number encoded in the ELF flags (e.g. 90, 100, 103).

        ELF ABI version 8 (sm_100 and later toolchains) keeps it in bits 8-15
        of e_flags; version 7 in bits 0-7 (and, for older cubins, 16-23).
        """
        if self.abi_version >= 8:
            return (self.e_flags >> 8) & 0xFF or None
        v = self.e_flags & 0xFF
        if self.abi_version >= 7 or v == (self.e_flags >> 16) & 0xFF:
            return v or None
        return (self.e_flags >> 16) & 0xFF or None


class _Elf:
    def __init__(self, data: bytes):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CubinFormatError(f"cubin must be bytes, got {type(data).__name__}")
        data = bytes(data)
        self.data = data
        if len(data) < 64:
            raise CubinFormatError(f"not a cubin: {len(data)} bytes is too short for an ELF header")
        if data[:4] != b"\x7fELF":
            raise CubinFormatError(f"not a cubin: bad ELF magic {data[:4]!r}")
        if data[4] != 2:
            raise CubinFormatError("not a 64-bit ELF (cubins are ELFCLASS64)")
        if data[5] != 1:
            raise CubinFormatError("not a little-endian ELF")
        self.abi_version = data[8]
        (
            e_type,
            e_machine,
            e_version,
            e_entry,
            e_phoff,
            e_shoff,
            e_flags,
            e_ehsize,
            e_phentsize,
            e_phnum,
            e_shentsize,
            e_shnum,
            e_shstrndx,
        ) = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)
        if e_machine != EM_CUDA:
            raise CubinFormatError(f"ELF machine {e_machine} is not EM_CUDA ({EM_CUDA})")
        self.e_flags = e_flags
        if e_phnum:
            if e_phentsize != 56 or e_phoff + e_phnum * e_phentsize > len(data):
                raise CubinFormatError(
                    f"truncated cubin: program headers end at {e_phoff + e_phnum * e_phentsize}, file has {len(data)} bytes"
                )
            for i in range(e_phnum):
                _pt, _pf, p_off, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, e_phoff + i * e_phentsize)
                if p_off + p_filesz > len(data):
                    raise CubinFormatError(f"truncated cubin: segment {i} extends past the end of the file")
        if e_shentsize != 64 or e_shnum == 0:
            raise CubinFormatError("cubin has no usable section header table")
        if e_shoff + e_shnum * e_shentsize > len(data):
            raise CubinFormatError(
                f"truncated cubin: section headers end at {e_shoff + e_shnum * e_shentsize}, file has {len(data)} bytes"
            )
        self.sections = []
        for i in range(e_shnum):
            sh = struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
            name, typ, flags, addr, off, size, link, info, align, entsize = sh
            if typ != SHT_NOBITS and off + size > len(data):
                raise CubinFormatError(f"truncated cubin: section {i} extends past the end of the file")
            self.sections.append(
                {"name_off": name, "type": typ, "offset": off, "size": size, "link": link, "info": info, "entsize": entsize}
            )
        if e_shstrndx >= e_shnum:
            raise CubinFormatError("bad section-name string table index")
        shstr = self.sections[e_shstrndx]
        for s in self.sections:
            s["name"] = self._str(shstr, s["name_off"])

    def _str(self, strsec, off: int) -> str:
        base = strsec["offset"]
        if off >= strsec["size"]:
            raise CubinFormatError("string offset outside its string table")
        end = self.data.find(b"\x00", base + off, base + strsec["size"])
        if end < 0:
            raise CubinFormatError("unterminated string in string table")
        return self.data[base + off : end].decode("utf-8", "replace")

    def body(self, s) -> bytes:
        if s["type"] == SHT_NOBITS:
            return b""
        return self.data[s["offset"] : s["offset"] + s["size"]]

    def symbols(self):
        out = []
        for s in self.sections:
            if s["type"] != SHT_SYMTAB:
                continue
            if s["link"] >= len(self.sections):
                raise CubinFormatError("symbol table links to a missing string table")
            strsec = self.sections[s["link"]]
            ent = s["entsize"] or 24
            body = self.body(s)
            for i in range(len(body) // ent):
                st_name, st_info, st_other, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", body, i * ent)
                out.append(
                    {
                        "index": i,
                        "name": self._str(strsec, st_name) if st_name else "",
                        "type": st_info & 0xF,
                        "bind": st_info >> 4,
                        "other": st_other,
                        "shndx": st_shndx,
                        "value": st_value,
                        "size": st_size,
                    }
                )
        return out


def _records(body: bytes, where: str):
    """Yield (attribute, format, payload bytes) of an .nv.info section."""
    i = 0
    n = len(body)
    while i < n:
        if i + 2 > n:
            raise CubinFormatError(f"truncated record in {where}")
        fmt, attr = body[i], body[i + 1]
        if fmt == EIFMT_NVAL:  # a 4-byte header whose value half is unused (seen on sm_100a cubins)
            yield attr, fmt, b""
            i += 4
        elif fmt in (EIFMT_BVAL, EIFMT_HVAL):
            if i + 4 > n:
                raise CubinFormatError(f"truncated record in {where}")
            yield attr, fmt, body[i + 2 : i + 4]
            i += 4
        elif fmt == EIFMT_SVAL:
            if i + 4 > n:
                raise CubinFormatError(f"truncated record in {where}")
            size = struct.unpack_from("<H", body, i + 2)[0]
            if i + 4 + size > n:
                raise CubinFormatError(f"truncated record in {where}")
            yield attr, fmt, body[i + 4 : i + 4 + size]
            i += 4 + size
        else:
            raise CubinFormatError(f"unknown .nv.info record format {fmt:#x} in {where} at offset {i}")


def cubin_info(cubin: bytes) -> CubinInfo:
    """Parse a cubin; see the module docstring for what is reported."""
    elf = _Elf(cubin)
    syms = elf.symbols()
    funcs = {s["name"]: s for s in syms if s["type"] == STT_FUNC and s["name"]}
    by_index = {s["index"]: s for s in syms}
    kernels: dict[str, KernelInfo] = {}
    sec_by_name = {s["name"]: s for s in elf.sections}
    for s in elf.sections:
        nm = s["name"]
        if not nm.startswith(".nv.info."):
            continue
        kname = nm[len(".nv.info.") :]
        if kname not in funcs:
            continue
        ki = KernelInfo(kname)
        seen = {}
        for attr, fmt, pay in _records(elf.body(s), nm):
            if attr == EIATTR_KPARAM_INFO:
                if len(pay) < 12:
                    raise CubinFormatError(f"short KPARAM_INFO record in {nm}")
                _idx, ordinal, offset, flags = struct.unpack_from("<IHHI", pay, 0)
                size = flags >> 18
                if ordinal in seen:
                    raise CubinFormatError(f"duplicate parameter ordinal {ordinal} in {nm}")
                seen[ordinal] = (ordinal, offset, size)
            elif attr == EIATTR_PARAM_CBANK and len(pay) >= 8:
                _sym, off, size = struct.unpack_from("<IHH", pay, 0)
                ki.param_cbank_offset = off
                ki.param_space_size = size
            elif attr == EIATTR_CBANK_PARAM_SIZE and fmt == EIFMT_HVAL:
                if ki.param_space_size is None:
                    ki.param_space_size = struct.unpack_from("<H", pay)[0]
            elif attr == EIATTR_REQNTID and len(pay) >= 4:
                ki.reqntid = tuple(struct.unpack_from(f"<{len(pay) // 4}I", pay))
            elif attr == EIATTR_MAX_THREADS and len(pay) >= 4:
                ki.max_threads = tuple(struct.unpack_from(f"<{len(pay) // 4}I", pay))
            elif attr == EIATTR_MAXREG_COUNT and fmt == EIFMT_HVAL:
                ki.maxreg_count = struct.unpack_from("<H", pay)[0]
        ki.params = [seen[k] for k in sorted(seen)]
        if ki.params and [p[0] for p in ki.params] != list(range(len(ki.params))):
            raise CubinFormatError(f"parameter ordinals of {kname} are not 0..{len(ki.params) - 1}")
        for _, off, size in ki.params:
            if ki.param_space_size is not None and off + size > ki.param_space_size:
                raise CubinFormatError(f"parameter at {off}+{size} outside the {ki.param_space_size}-byte param space of {kname}")
        sh = sec_by_name.get(".nv.shared." + kname)
        ki.static_smem = sh["size"] if sh is not None else 0
        kernels[kname] = ki
    # per-kernel attributes recorded in the global .nv.info, keyed by symbol index
    g = sec_by_name.get(".nv.info")
    if g is not None:
        for attr, fmt, pay in _records(elf.body(g), ".nv.info"):
            if fmt != EIFMT_SVAL or len(pay) < 8:
                continue
            sym, val = struct.unpack_from("<II", pay)
            s = by_index.get(sym)
            if s is None or s["name"] not in kernels:
                continue
            ki = kernels[s["name"]]
            if attr == EIATTR_REGCOUNT:
                ki.regcount = val
            elif attr == EIATTR_FRAME_SIZE:
                ki.frame_size = val
            elif attr == EIATTR_MIN_STACK_SIZE:
                ki.min_stack_size = val
            elif attr == EIATTR_MAX_STACK_SIZE:
                ki.max_stack_size = val
    return CubinInfo(e_flags=elf.e_flags, abi_version=elf.abi_version, kernels=kernels)


def kernel_params(cubin: bytes) -> dict[str, list[tuple[int, int, int]]]:
    """``{kernel symbol: [(index, offset, size), ...]}`` from ``EIATTR_KPARAM_INFO``."""
    return {k: list(v.params) for k, v in cubin_info(cubin).kernels.items()}


def param_sizes(cubin: bytes) -> dict[str, list[int]]:
    """``{kernel symbol: [size of each parameter]}`` (the form ``HostProgram.launch`` takes)."""
    return {k: v.param_sizes for k, v in cubin_info(cubin).kernels.items()}


def kernel_names(cubin: bytes) -> list[str]:
    return sorted(cubin_info(cubin).kernels)


def pack_params(params: list[tuple[int, int, int]], values: list[bytes], space_size: int | None = None) -> bytearray:
    """Lay parameter bytes out at their cubin offsets (the ``CU_LAUNCH_PARAM_BUFFER_POINTER`` form)."""
    if len(params) != len(values):
        raise ValueError(f"{len(values)} parameter values for {len(params)} parameters")
    end = max((off + size for _, off, size in params), default=0)
    buf = bytearray(max(end, space_size or 0))
    for (_, off, size), v in zip(params, values):
        if len(v) != size:
            raise ValueError(f"parameter at offset {off}: {len(v)} bytes, cubin says {size}")
        buf[off : off + size] = v
    return buf


__all__ = [
    "CubinFormatError",
    "CubinInfo",
    "KernelInfo",
    "cubin_info",
    "kernel_names",
    "kernel_params",
    "pack_params",
    "param_sizes",
]

"""Pure-Python interpreter for serialised CuTe-DSL host programs.

``svdq_aot.host_ir.serialize_host`` turns the lowered (LLVM-dialect) host
function of a compiled CuTe-DSL ``@cute.jit`` into a JSON document.  This
module runs it at inference time, without the DSL, to obtain exactly what the
DSL's own host code would have passed to ``cudaLaunchKernelEx`` (grid, block,
dynamic SMEM, stream, launch attributes and every kernel-parameter byte) and
what its ``cuda_load_to_device`` would have set with
``cudaKernelSetAttributeForDevice``.

Only the standard library is used.  Semantics follow LLVM:

* integers are kept as unsigned Python ints in ``[0, 2**w)``; every op wraps
  at its bit width; signed ops reinterpret two's complement;
* ``sdiv``/``srem`` truncate toward zero; division by zero and
  ``INT_MIN / -1`` raise :class:`HostVMError` (undefined behaviour in LLVM,
  a crash in the compiled host code);
* shifts by ``>= width`` produce poison in LLVM; here they produce 0;
* memory is byte addressed.  Allocas and globals live in a private address
  range (``VM_BASE``); pointers are plain 64-bit ints, so ``ptrtoint`` /
  ``inttoptr`` and integer pointer maths work.  Loads/stores outside an
  allocation raise (kernel pointers passed in by the caller are never
  dereferenced by well-formed host code);
* sizes, alignments and struct offsets follow the x86-64 default data
  layout (the DSL JIT-compiles this code for the host);
* floating-point values are carried as their bit patterns (only moved,
  never computed on: the serialiser rejects float arithmetic);
* uninitialised memory and ``poison``/``undef`` read as ``undef_byte``
  (default 0).  The DSL's compiled code would see stack garbage there
  (struct padding, the unused upper 64 bytes of TMA descriptors, unused
  launch-attribute bytes); tests vary ``undef_byte`` to find those bytes.

External calls are answered by the interpreter itself (recording stubs of
the CUDA runtime); ``printf`` output is collected and attached to
:class:`HostTrap`, which ``llvm.intr.trap``/``llvm.unreachable`` raise.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, Sequence

FORMAT = "svdq-host-ir"
FORMAT_VERSION = 1

VM_BASE = 0x7FF0_0000_0000_0000  # private address range for allocas/globals
HANDLE_BASE = 0x6B00_0000_0000_0000  # fake CUkernel handles
LIB_HANDLE = 0x6C00_0000_0000_0010  # fake CUlibrary handle
M64 = (1 << 64) - 1
STEP_LIMIT = 2_000_000  # executed blocks per run

# cudaLaunchConfig_t / cudaLaunchAttribute C ABI (x86-64)
_CFG_SIZE = 56
_ATTR_SIZE = 72
_U32x6 = struct.Struct("<6I")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")


class HostVMError(RuntimeError):
    """The host program is malformed, unsupported, or failed at run time."""


class HostReturned(HostVMError):
    """The host function returned a non-zero code (the DSL's refusal of these arguments)."""


class HostTrap(HostVMError):
    """The host program hit ``llvm.intr.trap``/``unreachable`` (the DSL's error path).

    ``printf_text`` holds what the program printed before trapping, e.g.
    "launch shared memory exceeds ...".
    """

    def __init__(self, message: str, printf_text: str = ""):
        super().__init__(message + (f": {printf_text.strip()}" if printf_text.strip() else ""))
        self.printf_text = printf_text


@dataclass
class LaunchRecord:
    """One ``cudaLaunchKernelEx`` call as the host program made it."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    stream: int
    attrs: list[tuple[int, bytes]] = field(default_factory=list)  # (id, 64 value bytes)
    params: list[bytes] = field(default_factory=list)
    #: text the host code printed before this launch (e.g. the DSL's
    #: "launch shared memory exceeds ..." warning); not part of equality
    printf: str = field(default="", compare=False)

    def attr(self, attr_id: int) -> bytes | None:
        for i, v in self.attrs:
            if i == attr_id:
                return v
        return None

    @property
    def cluster(self) -> tuple[int, int, int] | None:
        """Cluster dims from launch attribute 4 (cudaLaunchAttributeClusterDimension), if any."""
        v = self.attr(4)
        if v is None:
            return None
        return struct.unpack_from("<3I", v)


# ---------------------------------------------------------------------------
# Types and data layout (x86-64 default LLVM data layout)
# ---------------------------------------------------------------------------

_INT_ALIGN_BITS = ((8, 1), (16, 2), (32, 4), (64, 8), (128, 16))


def _int_align(w: int) -> int:
    for bits, al in _INT_ALIGN_BITS:
        if w <= bits:
            return al
    return 16


class VMType:
    __slots__ = ("enc", "kind", "size", "align", "store", "width", "mask", "fields", "offsets", "n", "elem", "packed", "text")

    def __init__(self, enc):
        self.enc = enc
        self.kind = enc[0]
        self.width = 0
        self.mask = 0
        self.fields = ()
        self.offsets = ()
        self.n = 0
        self.elem = None
        self.packed = False
        k = self.kind
        if k == "int":
            w = int(enc[1])
            if w <= 0:
                raise HostVMError(f"bad integer width {w}")
            self.width = w
            self.mask = (1 << w) - 1
            self.store = (w + 7) // 8
            self.align = _int_align(w)
            self.size = -(-self.store // self.align) * self.align
            self.text = f"i{w}"
        elif k == "float":
            bits = int(enc[1])
            self.width = bits
            self.mask = (1 << bits) - 1
            self.store = bits // 8
            self.align = self.store
            self.size = self.store
            self.text = enc[2] if len(enc) > 2 else f"f{bits}"
        elif k == "ptr":
            self.width = 64
            self.mask = M64
            self.store = self.size = self.align = 8
            self.text = "ptr" if int(enc[1]) == 0 else f"ptr<{int(enc[1])}>"
        elif k == "struct":
            self.packed = bool(enc[1])
            self.fields = tuple(VMType(f) for f in enc[2])
            off = 0
            al = 1
            offs = []
            for f in self.fields:
                fa = 1 if self.packed else f.align
                off = -(-off // fa) * fa
                offs.append(off)
                off += f.size
                al = max(al, fa)
            self.offsets = tuple(offs)
            self.align = al
            self.size = -(-off // al) * al
            self.store = self.size
            self.text = "struct<" + ("packed " if self.packed else "") + "(" + ", ".join(f.text for f in self.fields) + ")>"
        elif k == "array":
            self.n = int(enc[1])
            self.elem = VMType(enc[2])
            self.align = self.elem.align
            self.size = self.n * self.elem.size
            self.store = self.size
            self.text = f"array<{self.n} x {self.elem.text}>"
        elif k == "void":
            self.size = self.store = 0
            self.align = 1
            self.text = "void"
        elif k == "func":
            self.size = self.store = 0
            self.align = 1
            self.text = "func"
        else:
            raise HostVMError(f"unsupported type encoding {enc!r}")

    @property
    def is_scalar(self) -> bool:
        return self.kind in ("int", "ptr", "float")

    def __repr__(self):
        return f"VMType({self.text})"

    # -- values ---------------------------------------------------------
    def filled(self, byte: int):
        """The value whose memory image is all ``byte`` (used for poison/undef)."""
        if self.is_scalar:
            return int.from_bytes(bytes([byte]) * self.store, "little") & self.mask
        if self.kind == "struct":
            return tuple(f.filled(byte) for f in self.fields)
        if self.kind == "array":
            v = self.elem.filled(byte)
            return tuple(v for _ in range(self.n))
        raise HostVMError(f"no value of type {self.text}")

    def read(self, buf, off: int):
        if self.is_scalar:
            return int.from_bytes(buf[off : off + self.store], "little") & self.mask
        if self.kind == "struct":
            return tuple(f.read(buf, off + o) for f, o in zip(self.fields, self.offsets))
        if self.kind == "array":
            e = self.elem
            s = e.size
            return tuple(e.read(buf, off + i * s) for i in range(self.n))
        raise HostVMError(f"cannot load a value of type {self.text}")

    def write(self, buf, off: int, v) -> None:
        if self.is_scalar:
            buf[off : off + self.store] = (v & self.mask).to_bytes(self.store, "little")
            return
        if self.kind == "struct":
            for f, o, x in zip(self.fields, self.offsets, v):
                f.write(buf, off + o, x)
            return
        if self.kind == "array":
            e = self.elem
            s = e.size
            for i, x in enumerate(v):
                e.write(buf, off + i * s, x)
            return
        raise HostVMError(f"cannot store a value of type {self.text}")


def type_size_align_of_encoding(enc) -> tuple[int, int]:
    """(alloc size, ABI alignment) of a JSON type encoding under the x86-64 layout."""
    t = VMType(enc)
    return t.size, t.align


def format_type(enc) -> str:
    return VMType(enc).text


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


class _Memory:
    __slots__ = ("bases", "bufs", "next", "fill")

    def __init__(self, fill: int):
        self.bases: list[int] = []
        self.bufs: list[bytearray] = []
        self.next = VM_BASE
        self.fill = fill

    def alloc(self, size: int, align: int, init: bytes | None = None) -> int:
        align = max(align, 16)
        addr = -(-self.next // align) * align
        size = max(size, 1)
        if init is None:
            buf = bytearray([self.fill]) * size if self.fill else bytearray(size)
        else:
            buf = bytearray(init)
            if len(buf) < size:
                buf += bytearray(size - len(buf))
        self.bases.append(addr)
        self.bufs.append(buf)
        self.next = addr + len(buf) + 64  # guard gap: overruns raise
        return addr

    def find(self, addr: int, n: int):
        i = bisect_right(self.bases, addr) - 1
        if i >= 0:
            off = addr - self.bases[i]
            buf = self.bufs[i]
            if off + n <= len(buf):
                return buf, off
        raise HostVMError(f"invalid host memory access: {n} byte(s) at {addr:#x}")

    def extent(self, addr: int):
        """(buf, off) with the remaining allocation size, for addr inside an allocation."""
        i = bisect_right(self.bases, addr) - 1
        if i >= 0:
            off = addr - self.bases[i]
            buf = self.bufs[i]
            if off < len(buf):
                return buf, off, len(buf) - off
        raise HostVMError(f"pointer {addr:#x} does not point into host memory")

    def cstring(self, addr: int, limit: int = 1 << 16) -> bytes:
        buf, off, rem = self.extent(addr)
        end = buf.find(b"\x00", off, off + min(rem, limit))
        if end < 0:
            raise HostVMError(f"unterminated C string at {addr:#x}")
        return bytes(buf[off:end])


# ---------------------------------------------------------------------------
# printf
# ---------------------------------------------------------------------------


def _c_format(fmt: bytes, args: list[int], arg_types: list[VMType], mem: _Memory) -> str:
    out = []
    i = 0
    ai = 0
    s = fmt.decode("latin-1")
    n = len(s)
    while i < n:
        c = s[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        j = i + 1
        flags = ""
        while j < n and s[j] in "-+ #0":
            flags += s[j]
            j += 1
        width = ""
        while j < n and (s[j].isdigit() or s[j] == "*"):
            width += s[j]
            j += 1
        prec = None
        if j < n and s[j] == ".":
            j += 1
            prec = ""
            while j < n and s[j].isdigit():
                prec += s[j]
                j += 1
        while j < n and s[j] in "hlLqjzt":
            j += 1
        if j >= n:
            out.append(s[i:])
            break
        conv = s[j]
        i = j + 1
        if conv == "%":
            out.append("%")
            continue
        if ai >= len(args):
            out.append("%" + conv)
            continue
        v = args[ai]
        t = arg_types[ai]
        ai += 1
        w = t.width or 64
        spec = flags + width + ("." + prec if prec is not None else "")
        try:
            if conv in "di":
                sv = v - (1 << w) if v >> (w - 1) else v
                out.append(("%" + spec + "d") % sv)
            elif conv in "uxXo":
                out.append(("%" + spec + conv) % v)
            elif conv == "c":
                out.append(chr(v & 0xFF))
            elif conv == "p":
                out.append(hex(v))
            elif conv == "s":
                txt = mem.cstring(v).decode("utf-8", "replace")
                out.append(("%" + spec + "s") % txt)
            elif conv in "eEfFgGaA":
                x = struct.unpack("<d", (v & M64).to_bytes(8, "little"))[0] if w == 64 else float(v)
                out.append(("%" + spec + conv) % x)
            else:
                out.append("%" + spec + conv)
        except (TypeError, ValueError, HostVMError):
            out.append("%" + spec + conv)
    return "".join(out)


# ---------------------------------------------------------------------------
# Compilation of the JSON program into closures
# ---------------------------------------------------------------------------


def _signed(v: int, w: int) -> int:
    return v - (1 << w) if v >> (w - 1) else v


class _Block:
    __slots__ = ("ops", "term", "args")

    def __init__(self):
        self.ops = ()
        self.term = None
        self.args = ()


class _Func:
    __slots__ = ("name", "nargs", "arg_types", "ret_type", "nvalues", "blocks")


_SUPPORTED_OPS = frozenset(
    """const zero poison addressof add sub mul and or xor shl lshr ashr sdiv udiv srem urem
    smin smax umin umax sadd_ovf uadd_ovf ssub_ovf usub_ovf smul_ovf umul_ovf icmp select
    trunc zext sext ptrtoint inttoptr bitcast freeze ctlz cttz ctpop abs bswap insertvalue
    extractvalue alloca load store gep memcpy memset call br cond_br switch return trap
    unreachable""".split()
)

EXTERNALS = frozenset(
    {
        "printf",
        "_cudaLaunchKernelEx",
        "_cudaDeviceGetAttribute",
        "_cudaGetDevice",
        "_cudaLibraryGetKernel",
        "_cuKernelGetAttribute",
        "_cudaKernelSetAttributeForDevice",
        "_cudaFuncSetAttribute",
    }
)


def _binop(kind: str, r: int, a: int, b: int, t: VMType):
    w = t.width
    m = t.mask
    if t.kind not in ("int", "ptr"):
        raise HostVMError(f"'{kind}' on non-integer type {t.text}")
    if kind == "add":
        def f(R, S):
            R[r] = (R[a] + R[b]) & m
    elif kind == "sub":
        def f(R, S):
            R[r] = (R[a] - R[b]) & m
    elif kind == "mul":
        def f(R, S):
            R[r] = (R[a] * R[b]) & m
    elif kind == "and":
        def f(R, S):
            R[r] = R[a] & R[b]
    elif kind == "or":
        def f(R, S):
            R[r] = R[a] | R[b]
    elif kind == "xor":
        def f(R, S):
            R[r] = R[a] ^ R[b]
    elif kind == "shl":
        def f(R, S):
            y = R[b]
            R[r] = (R[a] << y) & m if y < w else 0
    elif kind == "lshr":
        def f(R, S):
            y = R[b]
            R[r] = R[a] >> y if y < w else 0
    elif kind == "ashr":
        def f(R, S):
            y = R[b]
            x = R[a]
            if y >= w:
                R[r] = 0
            else:
                R[r] = ((x - (1 << w) if x >> (w - 1) else x) >> y) & m
    elif kind == "udiv":
        def f(R, S):
            y = R[b]
            if y == 0:
                raise HostVMError("udiv by zero")
            R[r] = R[a] // y
    elif kind == "urem":
        def f(R, S):
            y = R[b]
            if y == 0:
                raise HostVMError("urem by zero")
            R[r] = R[a] % y
    elif kind in ("sdiv", "srem"):
        is_div = kind == "sdiv"
        smin = 1 << (w - 1)

        def f(R, S):
            x = R[a]
            y = R[b]
            if y == 0:
                raise HostVMError(f"{kind} by zero")
            if x == smin and y == m:
                raise HostVMError(f"{kind} overflow (INT_MIN / -1)")
            sx = x - (1 << w) if x >> (w - 1) else x
            sy = y - (1 << w) if y >> (w - 1) else y
            q = abs(sx) // abs(sy)
            if (sx < 0) != (sy < 0):
                q = -q
            R[r] = (q if is_div else sx - sy * q) & m
    elif kind in ("smin", "smax"):
        pick_min = kind == "smin"

        def f(R, S):
            x = R[a]
            y = R[b]
            sx = x - (1 << w) if x >> (w - 1) else x
            sy = y - (1 << w) if y >> (w - 1) else y
            R[r] = (x if sx <= sy else y) if pick_min else (x if sx >= sy else y)
    elif kind == "umin":
        def f(R, S):
            x = R[a]
            y = R[b]
            R[r] = x if x <= y else y
    elif kind == "umax":
        def f(R, S):
            x = R[a]
            y = R[b]
            R[r] = x if x >= y else y
    elif kind.endswith("_ovf"):
        base = kind[:-4]
        signed = base[0] == "s"
        op = base[1:]
        lo = -(1 << (w - 1)) if signed else 0
        hi = ((1 << (w - 1)) - 1) if signed else m

        def f(R, S):
            x = R[a]
            y = R[b]
            if signed:
                x = x - (1 << w) if x >> (w - 1) else x
                y = y - (1 << w) if y >> (w - 1) else y
            if op == "add":
                z = x + y
            elif op == "sub":
                z = x - y
            else:
                z = x * y
            R[r] = (z & m, 0 if lo <= z <= hi else 1)
    else:
        raise HostVMError(f"unknown binary op {kind}")
    return f


_ICMP_PREDICATES = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge")


def _icmp(p: str, r: int, a: int, b: int, t: VMType):
    if t.kind not in ("int", "ptr"):
        raise HostVMError(f"icmp on non-integer type {t.text}")
    if p not in _ICMP_PREDICATES:
        raise HostVMError(f"unknown icmp predicate {p!r}")
    # signed compare == unsigned compare after flipping the sign bit
    bias = 1 << (t.width - 1)
    if p == "eq":
        def f(R, S):
            R[r] = 1 if R[a] == R[b] else 0
    elif p == "ne":
        def f(R, S):
            R[r] = 1 if R[a] != R[b] else 0
    elif p == "ult":
        def f(R, S):
            R[r] = 1 if R[a] < R[b] else 0
    elif p == "ule":
        def f(R, S):
            R[r] = 1 if R[a] <= R[b] else 0
    elif p == "ugt":
        def f(R, S):
            R[r] = 1 if R[a] > R[b] else 0
    elif p == "uge":
        def f(R, S):
            R[r] = 1 if R[a] >= R[b] else 0
    elif p == "slt":
        def f(R, S):
            R[r] = 1 if (R[a] ^ bias) < (R[b] ^ bias) else 0
    elif p == "sle":
        def f(R, S):
            R[r] = 1 if (R[a] ^ bias) <= (R[b] ^ bias) else 0
    elif p == "sgt":
        def f(R, S):
            R[r] = 1 if (R[a] ^ bias) > (R[b] ^ bias) else 0
    else:
        def f(R, S):
            R[r] = 1 if (R[a] ^ bias) >= (R[b] ^ bias) else 0
    return f


def _cast(kind: str, r: int, a: int, t: VMType, ft: VMType):
    m = t.mask
    if kind in ("freeze", "bitcast"):
        if t.is_scalar != ft.is_scalar or (t.is_scalar and t.width != ft.width) or (not t.is_scalar and t.text != ft.text):
            raise HostVMError(f"{kind} from {ft.text} to {t.text} is not supported")

        def f(R, S):
            R[r] = R[a]
        return f
    if not (t.kind in ("int", "ptr") and ft.kind in ("int", "ptr")):
        raise HostVMError(f"{kind} from {ft.text} to {t.text} is not supported")
    if kind in ("trunc", "zext", "ptrtoint", "inttoptr"):
        if kind == "zext" or m >= ft.mask:
            def f(R, S):
                R[r] = R[a]
        else:
            def f(R, S):
                R[r] = R[a] & m
        return f
    if kind == "sext":
        fw = ft.width
        sb = 1 << (fw - 1)
        ext = m ^ ft.mask  # high bits to set

        def f(R, S):
            x = R[a]
            R[r] = x | ext if x & sb else x
        return f
    raise HostVMError(f"unknown cast {kind}")


def _unary_intr(d: dict, r: int, a: int, t: VMType):
    kind = d["o"]
    w = t.width
    m = t.mask
    if t.kind != "int":
        raise HostVMError(f"{kind} on {t.text}")
    if kind == "ctlz":
        def f(R, S):
            R[r] = w - R[a].bit_length()
    elif kind == "cttz":
        def f(R, S):
            x = R[a]
            R[r] = w if x == 0 else (x & -x).bit_length() - 1
    elif kind == "ctpop":
        def f(R, S):
            R[r] = bin(R[a]).count("1")
    elif kind == "abs":
        def f(R, S):
            x = R[a]
            R[r] = (-(x - (1 << w))) & m if x >> (w - 1) else x
    elif kind == "bswap":
        if w % 16:
            raise HostVMError(f"bswap of i{w}")
        nb = w // 8

        def f(R, S):
            R[r] = int.from_bytes(R[a].to_bytes(nb, "little"), "big")
    else:
        raise HostVMError(f"unknown intrinsic {kind}")
    return f


def _insert(agg, path, v):
    lst = list(agg)
    i = path[0]
    lst[i] = v if len(path) == 1 else _insert(agg[i], path[1:], v)
    return tuple(lst)


def _agg_type_at(t: VMType, path) -> VMType:
    for i in path:
        if t.kind == "struct":
            t = t.fields[i]
        elif t.kind == "array":
            if not 0 <= i < t.n:
                raise HostVMError("aggregate index out of range")
            t = t.elem
        else:
            raise HostVMError(f"cannot index into {t.text}")
    return t


class HostProgram:
    """A loaded host program; see the module docstring for semantics."""

    def __init__(self, doc: dict):
        if not isinstance(doc, dict):
            raise HostVMError("host program must be a dict")
        if doc.get("format") != FORMAT:
            raise HostVMError(f"not a host program (format={doc.get('format')!r})")
        if doc.get("format_version") != FORMAT_VERSION:
            raise HostVMError(
                f"host program format_version {doc.get('format_version')!r} is not supported "
                f"(this loader reads version {FORMAT_VERSION})"
            )
        self.doc = doc
        self.types = [VMType(e) for e in doc["types"]]
        self.entry_name: str = doc["entry"]
        self.load_name: str = doc["load"]
        self.externals = dict(doc.get("externals", {}))
        for name in self.externals:
            if name not in EXTERNALS:
                raise HostVMError(f"external function @{name} is not supported by the interpreter")
        # globals
        self.globals: dict[str, dict] = {}
        self.kernels: list[str] = []
        self.handle_of: dict[str, int] = {}
        self.kernel_of_handle: dict[int, str] = {}
        for name, g in doc.get("globals", {}).items():
            kind = g.get("kind")
            t = self.types[g["type"]]
            if kind == "kernel_handle":
                k = g["kernel"]
                if k not in self.handle_of:
                    h = HANDLE_BASE + 0x100 * (len(self.kernels) + 1)
                    self.kernels.append(k)
                    self.handle_of[k] = h
                    self.kernel_of_handle[h] = k
                self.globals[name] = {"kind": kind, "kernel": k, "size": 8, "align": 8}
            elif kind == "data":
                data = bytes.fromhex(g["hex"])
                if len(data) != t.size:
                    raise HostVMError(f"global @{name}: {len(data)} bytes for type {t.text}")
                self.globals[name] = {"kind": kind, "data": data, "align": int(g.get("align", t.align))}
            else:
                raise HostVMError(f"global @{name}: unknown kind {kind!r}")
        # functions (two passes so calls can refer to any function)
        fdocs = doc.get("functions", {})
        self.funcs: dict[str, _Func] = {}
        for name, fd in fdocs.items():
            fn = _Func()
            fn.name = name
            fn.arg_types = [self.types[i] for i in fd["args"]]
            fn.nargs = len(fn.arg_types)
            fn.ret_type = self.types[fd["ret"]] if fd.get("ret") is not None else None
            fn.nvalues = int(fd["nvalues"])
            fn.blocks = [_Block() for _ in fd["blocks"]]
            self.funcs[name] = fn
        for name, fd in fdocs.items():
            self._compile_function(self.funcs[name], fd)
        for need in (self.entry_name, self.load_name):
            if need not in self.funcs:
                raise HostVMError(f"host program lacks function @{need}")
        self.entry = self.funcs[self.entry_name]
        self.arg_types: list[VMType] = list(self.entry.arg_types)

    # -- public ---------------------------------------------------------

    @classmethod
    def from_dict(cls, doc: dict) -> "HostProgram":
        """Load and validate a serialised host program (format_version and op set)."""
        try:
            return cls(doc)
        except HostVMError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise HostVMError(f"malformed host program: {type(e).__name__}: {e}") from e

    @property
    def arg_kinds(self) -> list[str]:
        """LLVM types of the entry function's arguments, in order ('ptr<1>', 'i32', 'ptr', ...)."""
        return [t.text for t in self.arg_types]

    def launch_all(self, args: Sequence, param_sizes: dict[str, list[int]] | None = None, *, undef_byte: int = 0) -> list[LaunchRecord]:
        """Run the entry function; return every launch it made (usually one)."""
        st = _State(self, undef_byte, mode="launch", param_sizes=param_sizes)
        vals = self._convert_args(args)
        rc = st.call(self.entry, vals)
        rc_s = _signed(rc, self.entry.ret_type.width) if (rc is not None and self.entry.ret_type is not None and self.entry.ret_type.kind == "int") else rc
        if rc_s not in (None, 0):
            if st.launches:
                raise HostReturned(f"host function returned {rc_s} after launching")
            raise HostReturned(f"host function returned {rc_s} without launching" + (f"; printf: {st.text()}" if st.printf_out else ""))
        return st.launches

    def launch(self, args: Sequence, param_sizes: dict[str, list[int]] | None = None, *, undef_byte: int = 0) -> LaunchRecord:
        """Run the entry function on integer args; return the single launch it made.

        ``args``: one value per entry argument (see :attr:`arg_kinds`):
        pointers and the stream as ints (0 allowed), integers as Python ints
        (wrapped to their width), floats as Python floats or raw bit patterns.

        Parameter bytes: with ``param_sizes`` (``{kernel: [size per param]}``,
        from the cubin's ``EIATTR_KPARAM_INFO``) each parameter is exactly
        that many bytes and the parameter count is checked; without it, each
        parameter runs to the end of the host allocation its pointer points
        into (i.e. the alloca's size, which may include tail padding) and the
        count is the size of the ``void*[]`` array.
        """
        recs = self.launch_all(args, param_sizes, undef_byte=undef_byte)
        if not recs:
            raise HostVMError("host function returned 0 without launching a kernel")
        if len(recs) != 1:
            raise HostVMError(f"host function made {len(recs)} launches; use launch_all()")
        return recs[0]

    def load_plan(
        self,
        device_attr: Callable[[int, int], int],
        kernel_attr: Callable[[str, int, int], int],
        device: int,
    ) -> list[tuple[str, int, int]]:
        """Run ``cuda_load_to_device`` against callbacks; return the attributes it sets.

        ``_cudaDeviceGetAttribute(out, attr, dev)`` -> ``device_attr(attr, dev)``;
        ``_cuKernelGetAttribute(out, attr, kernel, dev)`` -> ``kernel_attr(name, attr, dev)``;
        each ``_cudaKernelSetAttributeForDevice(kernel, attr, value, dev)`` is
        returned as ``(kernel_name, attr, value)`` (runtime cudaFuncAttribute ids;
        8 = max dynamic shared memory, 14 = non-portable cluster size allowed,
        equal to the driver's CUfunction_attribute ids).
        """
        st = _State(self, 0, mode="load", device_attr=device_attr, kernel_attr=kernel_attr, device=device)
        lib = st.mem.alloc(8, 8, _U64.pack(LIB_HANDLE))
        rc = st.call(self.funcs[self.load_name], [lib, device & 0xFFFFFFFF])
        if rc:
            raise HostVMError(f"{self.load_name} returned {_signed(rc, 32)}" + (f"; printf: {st.text()}" if st.printf_out else ""))
        return st.set_attrs

    def call(self, name: str, args: Sequence, *, undef_byte: int = 0):
        """Run any function of the program on integer args; return its return value.

        For tests and debugging: external calls behave as during :meth:`launch`
        (launches are recorded and dropped).
        """
        fn = self.funcs.get(name)
        if fn is None:
            raise HostVMError(f"no function @{name} in the host program")
        if len(args) != fn.nargs:
            raise HostVMError(f"@{name} takes {fn.nargs} arguments, got {len(args)}")
        st = _State(self, undef_byte, mode="launch")
        vals = [int(v) & t.mask if t.is_scalar else v for v, t in zip(args, fn.arg_types)]
        return st.call(fn, vals)

    # -- internals ------------------------------------------------------

    def _convert_args(self, args: Sequence) -> list:
        ts = self.arg_types
        if len(args) != len(ts):
            raise HostVMError(f"entry function takes {len(ts)} arguments ({', '.join(self.arg_kinds)}), got {len(args)}")
        out = []
        for v, t in zip(args, ts):
            if v is None:
                v = 0
            if t.kind == "float" and isinstance(v, float):
                fmt = {"f16": "<e", "f32": "<f", "f64": "<d"}.get(t.text)
                if fmt is None:
                    raise HostVMError(f"pass {t.text} arguments as raw bit patterns (int)")
                out.append(int.from_bytes(struct.pack(fmt, v), "little"))
            elif t.is_scalar:
                out.append(int(v) & t.mask)
            else:
                raise HostVMError(f"entry argument of type {t.text} is not supported")
        return out

    def _compile_function(self, fn: _Func, fd: dict) -> None:
        T = self.types
        nv = fn.nvalues
        if fn.nargs > nv:
            raise HostVMError(f"@{fn.name}: nvalues {nv} < number of arguments")

        def check_ids(ids, what):
            for v in ids:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < nv:
                    raise HostVMError(f"@{fn.name}: bad value id {v!r} in {what}")

        for bi, bd in enumerate(fd["blocks"]):
            check_ids(bd["args"], f"block {bi} arguments")
            if bi == 0 and list(bd["args"]) != list(range(fn.nargs)):
                raise HostVMError(f"@{fn.name}: entry block arguments must be the function arguments")
            fn.blocks[bi].args = tuple(bd["args"])
            for od in bd["ops"]:
                check_ids(od.get("r", []), f"op {od.get('o')!r} results")
                check_ids(od.get("a", []), f"op {od.get('o')!r} operands")
                check_ids(od.get("ta", []), f"op {od.get('o')!r} operands")
                check_ids(od.get("fa", []), f"op {od.get('o')!r} operands")
                check_ids(od.get("da", []), f"op {od.get('o')!r} operands")
                for case in od.get("cases", []):
                    check_ids(case[2], "switch case operands")
                for k in ("d", "td", "fd", "dd"):
                    if k in od and not (isinstance(od[k], int) and 0 <= od[k] < len(fn.blocks)):
                        raise HostVMError(f"@{fn.name}: bad branch target {od[k]!r}")
                for case in od.get("cases", []):
                    if not (isinstance(case[1], int) and 0 <= case[1] < len(fn.blocks)):
                        raise HostVMError(f"@{fn.name}: bad switch target {case[1]!r}")
        for bi, bd in enumerate(fd["blocks"]):
            blk = fn.blocks[bi]
            ops = []
            term = None
            for od in bd["ops"]:
                kind = od.get("o")
                if kind not in _SUPPORTED_OPS:
                    raise HostVMError(f"unsupported op kind {kind!r} in function @{fn.name}")
                if term is not None:
                    raise HostVMError(f"op after terminator in @{fn.name}")
                try:
                    c = self._compile_op(fn, od, T)
                except HostVMError as e:
                    raise HostVMError(f"@{fn.name}: op {kind!r}: {e}") from None
                if kind in ("br", "cond_br", "switch", "return", "unreachable"):
                    term = c
                else:
                    ops.append(c)
            if term is None:
                raise HostVMError(f"block {bi} of @{fn.name} has no terminator")
            blk.ops = tuple(ops)
            blk.term = term

    def _branch(self, fn: _Func, dest: int, srcs: list[int]):
        blk = fn.blocks[dest]
        dst = blk.args
        if len(dst) != len(srcs):
            raise HostVMError(f"branch to block {dest} passes {len(srcs)} args, block takes {len(dst)}")
        if not dst:
            return blk, None
        pairs = tuple(zip(dst, srcs))
        if len(pairs) == 1:
            (d0, s0), = pairs

            def mv(R):
                R[d0] = R[s0]
        else:
            def mv(R):
                vals = [R[s] for _, s in pairs]
                for (d, _), v in zip(pairs, vals):
                    R[d] = v
        return blk, mv

    def _compile_op(self, fn: _Func, d: dict, T: list[VMType]):
        kind = d["o"]
        r = d.get("r", [])
        a = d.get("a", [])
        r0 = r[0] if r else None

        if kind == "const":
            t = T[d["t"]]
            v = d["v"]
            if isinstance(v, dict) and "bits" in v:
                if not t.is_scalar:
                    raise HostVMError(f"bit-pattern constant of type {t.text}")
                val = int(v["bits"]) & t.mask
            elif isinstance(v, dict):
                data = bytes.fromhex(v["hex"])
                if t.kind != "array" or t.elem.kind != "int" or t.elem.width != 8 or len(data) != t.n:
                    raise HostVMError(f"string constant does not match {t.text}")
                val = tuple(data)
            elif isinstance(v, list):
                if t.kind != "array" or not t.elem.is_scalar or len(v) != t.n:
                    raise HostVMError(f"dense constant does not match {t.text}")
                val = tuple(int(x) & t.elem.mask for x in v)
            else:
                if not t.is_scalar:
                    raise HostVMError(f"integer constant of type {t.text}")
                val = int(v) & t.mask

            def f(R, S):
                R[r0] = val
            return f
        if kind == "zero":
            val = T[d["t"]].filled(0)

            def f(R, S):
                R[r0] = val
            return f
        if kind == "poison":
            t = T[d["t"]]
            val0 = t.filled(0)

            def f(R, S):
                R[r0] = val0 if S.fill == 0 else t.filled(S.fill)
            return f
        if kind == "addressof":
            g = d["g"]
            if g not in self.globals:
                raise HostVMError(f"reference to unknown global @{g}")

            def f(R, S):
                R[r0] = S.gaddr[g]
            return f
        if kind in ("add", "sub", "mul", "and", "or", "xor", "shl", "lshr", "ashr", "sdiv", "udiv", "srem", "urem", "smin", "smax", "umin", "umax") or kind.endswith("_ovf"):
            return _binop(kind, r0, a[0], a[1], T[d["t"]])
        if kind == "icmp":
            return _icmp(d["p"], r0, a[0], a[1], T[d["t"]])
        if kind == "select":
            c, x, y = a

            def f(R, S):
                R[r0] = R[x] if R[c] else R[y]
            return f
        if kind in ("trunc", "zext", "sext", "ptrtoint", "inttoptr", "bitcast", "freeze"):
            return _cast(kind, r0, a[0], T[d["t"]], T[d["ft"]])
        if kind in ("ctlz", "cttz", "ctpop", "abs", "bswap"):
            return _unary_intr(d, r0, a[0], T[d["t"]])
        if kind == "insertvalue":
            path = tuple(d["pos"])
            t = T[d["t"]]
            _agg_type_at(t, path)
            ag, v = a
            if len(path) == 1:
                i0 = path[0]

                def f(R, S):
                    lst = list(R[ag])
                    lst[i0] = R[v]
                    R[r0] = tuple(lst)
            else:
                def f(R, S):
                    R[r0] = _insert(R[ag], path, R[v])
            return f
        if kind == "extractvalue":
            path = tuple(d["pos"])
            _agg_type_at(T[d["t"]], path)
            ag = a[0]
            if len(path) == 1:
                i0 = path[0]

                def f(R, S):
                    R[r0] = R[ag][i0]
            else:
                def f(R, S):
                    x = R[ag]
                    for i in path:
                        x = x[i]
                    R[r0] = x
            return f
        if kind == "alloca":
            et = T[d["et"]]
            align = max(int(d.get("align") or 0), et.align)
            esize = et.size
            cnt = a[0]

            def f(R, S):
                n = R[cnt]
                R[r0] = S.mem.alloc(esize * n, align)
            return f
        if kind == "load":
            t = T[d["t"]]
            p = a[0]
            if t.is_scalar and t.width == 8 * t.store:
                n = t.store

                def f(R, S):
                    buf, off = S.mem.find(R[p], n)
                    R[r0] = int.from_bytes(buf[off : off + n], "little")
            elif t.is_scalar:  # i1 and other odd widths: only the low bits are the value
                n = t.store
                m = t.mask

                def f(R, S):
                    buf, off = S.mem.find(R[p], n)
                    R[r0] = int.from_bytes(buf[off : off + n], "little") & m
            else:
                n = t.size
                rd = t.read

                def f(R, S):
                    buf, off = S.mem.find(R[p], n)
                    R[r0] = rd(buf, off)
            return f
        if kind == "store":
            t = T[d["t"]]
            v, p = a
            if t.is_scalar:
                n = t.store
                m = t.mask

                def f(R, S):
                    buf, off = S.mem.find(R[p], n)
                    buf[off : off + n] = (R[v] & m).to_bytes(n, "little")
            else:
                n = t.size
                wr = t.write

                def f(R, S):
                    buf, off = S.mem.find(R[p], n)
                    wr(buf, off, R[v])
            return f
        if kind == "gep":
            return self._gep(d, T)
        if kind == "memcpy":
            dst, src, ln = a[0], a[1], a[2]

            def f(R, S):
                n = R[ln]
                if n:
                    sb, so = S.mem.find(R[src], n)
                    chunk = bytes(sb[so : so + n])
                    db, do = S.mem.find(R[dst], n)
                    db[do : do + n] = chunk
            return f
        if kind == "memset":
            dst, val, ln = a[0], a[1], a[2]

            def f(R, S):
                n = R[ln]
                if n:
                    db, do = S.mem.find(R[dst], n)
                    db[do : do + n] = bytes([R[val] & 0xFF]) * n
            return f
        if kind == "call":
            return self._call(d, T)
        # terminators -----------------------------------------------------
        if kind == "br":
            blk, mv = self._branch(fn, d["d"], a)
            if mv is None:
                def f(R, S):
                    return blk
            else:
                def f(R, S):
                    mv(R)
                    return blk
            return f
        if kind == "cond_br":
            c = a[0]
            tb, tmv = self._branch(fn, d["td"], d.get("ta", []))
            fb, fmv = self._branch(fn, d["fd"], d.get("fa", []))

            def f(R, S):
                if R[c]:
                    if tmv is not None:
                        tmv(R)
                    return tb
                if fmv is not None:
                    fmv(R)
                return fb
            return f
        if kind == "switch":
            x = a[0]
            t = T[d["t"]]
            default = self._branch(fn, d["dd"], d.get("da", []))
            table = {}
            for v, dest, srcs in d["cases"]:
                table.setdefault(int(v) & t.mask, self._branch(fn, dest, srcs))

            def f(R, S):
                blk, mv = table.get(R[x], default)
                if mv is not None:
                    mv(R)
                return blk
            return f
        if kind == "return":
            slot = fn.nvalues
            if a:
                v = a[0]

                def f(R, S):
                    R[slot] = R[v]
                    return None
            else:
                def f(R, S):
                    R[slot] = None
                    return None
            return f
        if kind in ("trap", "unreachable"):
            what = "llvm.intr.trap" if kind == "trap" else "llvm.unreachable"
            fname = fn.name

            def f(R, S):
                raise HostTrap(f"host code reached {what} in @{fname}", S.text())
            return f
        raise HostVMError(f"unsupported op kind {kind!r}")

    def _gep(self, d: dict, T: list[VMType]):
        r0 = d["r"][0]
        a = d["a"]
        base = a[0]
        dyn = a[1:]
        it = [T[i] for i in d.get("it", [])]
        et = T[d["et"]]
        const = 0
        terms = []  # (operand id, stride, width)
        di = 0
        cur = None
        for k, idx in enumerate(d["idx"]):
            if k == 0:
                stride = et.size
                cur = et
                nxt = et
            else:
                if cur.kind == "struct":
                    if idx is None:
                        raise HostVMError("dynamic index into a struct")
                    if not 0 <= idx < len(cur.fields):
                        raise HostVMError("struct index out of range")
                    const += cur.offsets[idx]
                    cur = cur.fields[idx]
                    continue
                if cur.kind == "array":
                    stride = cur.elem.size
                    nxt = cur.elem
                else:
                    raise HostVMError(f"getelementptr cannot index into {cur.text}")
            if idx is None:
                w = it[di].width if di < len(it) else 64
                terms.append((dyn[di], stride, w))
                di += 1
            else:
                const += idx * stride
            cur = nxt
        const &= M64
        if not terms:
            def f(R, S):
                R[r0] = (R[base] + const) & M64
        elif len(terms) == 1:
            (o1, s1, w1), = terms
            sb = 1 << (w1 - 1)
            full = 1 << w1

            def f(R, S):
                x = R[o1]
                if x & sb:
                    x -= full
                R[r0] = (R[base] + const + x * s1) & M64
        else:
            def f(R, S):
                acc = R[base] + const
                for o, s, w in terms:
                    x = R[o]
                    if x >> (w - 1):
                        x -= 1 << w
                    acc += x * s
                R[r0] = acc & M64
        return f

    def _call(self, d: dict, T: list[VMType]):
        callee = d["callee"]
        r = d.get("r", [])
        r0 = r[0] if r else None
        a = list(d["a"])
        ats = [T[i] for i in d.get("at", [])]
        if callee in self.funcs:
            target = self.funcs[callee]
            if len(a) != target.nargs:
                raise HostVMError(f"call to @{callee} with {len(a)} args, expects {target.nargs}")

            def f(R, S):
                v = S.call(target, [R[x] for x in a])
                if r0 is not None:
                    R[r0] = v
            return f
        if callee not in self.externals or callee not in EXTERNALS:
            raise HostVMError(f"call to unknown/unsupported function @{callee}")
        handler = getattr(_State, "ext" + callee)

        def f(R, S):
            v = handler(S, [R[x] for x in a], ats)
            if r0 is not None:
                R[r0] = v
        return f


class _State:
    """Per-run interpreter state: memory, globals, recorded calls."""

    def __init__(self, prog: HostProgram, fill: int, mode: str, param_sizes=None, device_attr=None, kernel_attr=None, device=0):
        self.prog = prog
        self.fill = fill & 0xFF
        self.mem = _Memory(self.fill)
        self.mode = mode
        self.param_sizes = param_sizes
        self.device_attr = device_attr
        self.kernel_attr = kernel_attr
        self.device = device
        self.printf_out: list[str] = []
        self.launches: list[LaunchRecord] = []
        self.set_attrs: list[tuple[str, int, int]] = []
        self.steps = 0
        self.gaddr: dict[str, int] = {}
        self.handle_global_at: dict[int, str] = {}
        for name, g in prog.globals.items():
            if g["kind"] == "kernel_handle":
                k = g["kernel"]
                # launches run as if the library were loaded: handles bound
                init = _U64.pack(prog.handle_of[k] if mode == "launch" else 0)
                addr = self.mem.alloc(8, 8, init)
                self.handle_global_at[addr] = k
            else:
                addr = self.mem.alloc(len(g["data"]), g["align"], g["data"])
            self.gaddr[name] = addr

    def text(self) -> str:
        return "".join(self.printf_out)

    def call(self, fn: _Func, args: list):
        R = [None] * (fn.nvalues + 1)
        R[: len(args)] = args
        blk = fn.blocks[0]
        steps = self.steps
        while True:
            for op in blk.ops:
                op(R, self)
            nxt = blk.term(R, self)
            if nxt is None:
                self.steps = steps
                return R[fn.nvalues]
            blk = nxt
            steps += 1
            if steps > STEP_LIMIT:
                raise HostVMError(f"step limit exceeded in @{fn.name} (infinite loop?)")

    # -- external functions (name = "ext" + symbol) ------------------------

    def ext_cudaLaunchKernelEx(self, args, ats):  # noqa: N802
        cfg, kernel, argv = args
        if self.mode != "launch":
            raise HostVMError("kernel launch outside the entry function")
        mem = self.mem
        buf, off = mem.find(cfg, _CFG_SIZE)
        gx, gy, gz, bx, by, bz = _U32x6.unpack_from(buf, off)
        smem = _U64.unpack_from(buf, off + 24)[0]
        stream = _U64.unpack_from(buf, off + 32)[0]
        attrs_ptr = _U64.unpack_from(buf, off + 40)[0]
        nattr = _U32.unpack_from(buf, off + 48)[0]
        attrs = []
        for i in range(nattr):
            ab, ao = mem.find(attrs_ptr + _ATTR_SIZE * i, _ATTR_SIZE)
            attrs.append((_U32.unpack_from(ab, ao)[0], bytes(ab[ao + 8 : ao + _ATTR_SIZE])))
        name = self.prog.kernel_of_handle.get(kernel)
        if name is None:
            raise HostVMError(f"launch of unknown kernel handle {kernel:#x}")
        sizes = None
        if self.param_sizes is not None:
            sizes = self.param_sizes.get(name)
            if sizes is None:
                raise HostVMError(f"param_sizes has no entry for kernel {name}")
        if sizes is None:
            _, _, rem = mem.extent(argv)
            nparams = rem // 8
        else:
            nparams = len(sizes)
        params = []
        for i in range(nparams):
            ab, ao = mem.find(argv + 8 * i, 8)
            p = _U64.unpack_from(ab, ao)[0]
            if sizes is None:
                pb, po, n = mem.extent(p)
            else:
                n = sizes[i]
                pb, po = mem.find(p, n)
            params.append(bytes(pb[po : po + n]))
        if sizes is not None:
            # the kernel-parameter array must not have more entries than the kernel takes
            buf2, off2, rem2 = mem.extent(argv)
            if rem2 // 8 != nparams:
                raise HostVMError(
                    f"kernel {name}: host code passes {rem2 // 8} parameters, cubin declares {nparams}"
                )
        self.launches.append(LaunchRecord(name, (gx, gy, gz), (bx, by, bz), smem, stream, attrs, params, self.text()))
        return 0

    def ext_cudaDeviceGetAttribute(self, args, ats):  # noqa: N802
        out, attr, dev = args
        if self.device_attr is None:
            raise HostVMError("cudaDeviceGetAttribute called during a launch")
        v = int(self.device_attr(_signed(attr, 32), _signed(dev, 32)))
        buf, off = self.mem.find(out, 4)
        buf[off : off + 4] = (v & 0xFFFFFFFF).to_bytes(4, "little")
        return 0

    def ext_cudaGetDevice(self, args, ats):  # noqa: N802
        (out,) = args
        buf, off = self.mem.find(out, 4)
        buf[off : off + 4] = (self.device & 0xFFFFFFFF).to_bytes(4, "little")
        return 0

    def ext_cudaLibraryGetKernel(self, args, ats):  # noqa: N802
        out, lib, name_ptr = args
        name = self.mem.cstring(name_ptr).decode("utf-8", "replace")
        k = self.prog.handle_of.get(name)
        if k is None:
            raise HostVMError(f"cudaLibraryGetKernel for unknown kernel {name!r}")
        expect = self.handle_global_at.get(out)
        if expect is not None and expect != name:
            raise HostVMError(f"kernel handle global for {expect!r} bound to kernel {name!r}")
        buf, off = self.mem.find(out, 8)
        buf[off : off + 8] = _U64.pack(k)
        return 0

    def ext_cuKernelGetAttribute(self, args, ats):  # noqa: N802
        out, attr, kernel, dev = args
        name = self.prog.kernel_of_handle.get(kernel)
        if name is None:
            raise HostVMError(f"cuKernelGetAttribute on unbound kernel handle {kernel:#x}")
        if self.kernel_attr is None:
            raise HostVMError("cuKernelGetAttribute called during a launch")
        v = int(self.kernel_attr(name, _signed(attr, 32), _signed(dev, 32)))
        buf, off = self.mem.find(out, 4)
        buf[off : off + 4] = (v & 0xFFFFFFFF).to_bytes(4, "little")
        return 0

    def ext_cudaKernelSetAttributeForDevice(self, args, ats):  # noqa: N802
        kernel, attr, value, dev = args
        name = self.prog.kernel_of_handle.get(kernel)
        if name is None:
            raise HostVMError(f"cudaKernelSetAttributeForDevice on unbound kernel handle {kernel:#x}")
        self.set_attrs.append((name, _signed(attr, 32), _signed(value, 32)))
        return 0

    def ext_cudaFuncSetAttribute(self, args, ats):  # noqa: N802
        kernel, attr, value = args
        name = self.prog.kernel_of_handle.get(kernel)
        if name is None:
            raise HostVMError(f"cudaFuncSetAttribute on unbound kernel handle {kernel:#x}")
        self.set_attrs.append((name, _signed(attr, 32), _signed(value, 32)))
        return 0

    def extprintf(self, args, ats):
        fmt = self.mem.cstring(args[0])
        text = _c_format(fmt, list(args[1:]), list(ats[1:]), self.mem)
        self.printf_out.append(text)
        return len(text) & 0xFFFFFFFF


# map "ext" + symbol names (symbols start with '_' except printf)
for _n in list(EXTERNALS):
    _meth = "ext" + _n
    if not hasattr(_State, _meth):
        raise RuntimeError(f"missing handler for {_n}")  # pragma: no cover


def load_program(doc_or_path) -> HostProgram:
    """Convenience: HostProgram from a dict, a JSON string, or a path to a JSON file."""
    import json
    import os

    if isinstance(doc_or_path, dict):
        return HostProgram.from_dict(doc_or_path)
    if isinstance(doc_or_path, (str, os.PathLike)) and os.path.exists(doc_or_path):
        with open(doc_or_path, "r", encoding="utf-8") as fh:
            return HostProgram.from_dict(json.load(fh))
    return HostProgram.from_dict(json.loads(doc_or_path))


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HostProgram",
    "HostTrap",
    "HostVMError",
    "LaunchRecord",
    "VMType",
    "format_type",
    "load_program",
    "type_size_align_of_encoding",
]

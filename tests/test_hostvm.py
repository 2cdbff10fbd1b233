"""Unit tests of the host-program interpreter (pure Python; no DSL, no GPU).

Programs are written directly in the serialised format with a tiny
assembler; expected values come from independent references (ctypes C
integer types and struct layouts, fractions for truncating division).
"""

from __future__ import annotations

import copy
import ctypes
import os
import random
import sys
from fractions import Fraction
from math import trunc

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_kernels  # noqa: E402

abi_kernels.ensure_packages()

from svdq_aot.host_ir import FORMAT_VERSION, parse_type  # noqa: E402  (no DSL import)
from svdq_loader.hostvm import (  # noqa: E402
    HostProgram,
    HostTrap,
    HostVMError,
    VMType,
    type_size_align_of_encoding,
)

WIDTHS = (8, 16, 32, 64)
CT_S = {8: ctypes.c_int8, 16: ctypes.c_int16, 32: ctypes.c_int32, 64: ctypes.c_int64}
CT_U = {8: ctypes.c_uint8, 16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}


# ---------------------------------------------------------------------------
# a tiny assembler for the serialised format
# ---------------------------------------------------------------------------


class Asm:
    def __init__(self):
        self.types: list = []
        self.functions: dict = {}
        self.globals: dict = {}
        self.externals: dict = {}

    def t(self, text: str) -> int:
        enc = parse_type(text)
        if enc not in self.types:
            self.types.append(enc)
        return self.types.index(enc)

    def func(self, name: str, args: list[str], ret: str | None) -> "Fn":
        return Fn(self, name, args, ret)

    def string(self, name: str, text: bytes):
        self.globals[name] = {"type": self.t(f"!llvm.array<{len(text)} x i8>"), "kind": "data", "constant": True,
                              "align": 1, "hex": text.hex()}

    def doc(self, entry: str, load: str | None = None) -> dict:
        return copy.deepcopy({
            "format": "svdq-host-ir",
            "format_version": FORMAT_VERSION,
            "entry": entry,
            "load": load or entry,
            "types": self.types,
            "functions": self.functions,
            "externals": self.externals,
            "globals": self.globals,
            "kernels": [],
        })

    def program(self, entry: str) -> HostProgram:
        return HostProgram.from_dict(self.doc(entry))


class Fn:
    def __init__(self, asm: Asm, name: str, args: list[str], ret: str | None):
        self.asm = asm
        self.name = name
        self.n = len(args)
        self.args = list(range(self.n))
        self.blocks = [{"args": list(range(self.n)), "ops": []}]
        self.cur = 0
        self.fd = {"args": [asm.t(a) for a in args], "ret": asm.t(ret) if ret else None, "nvalues": self.n,
                   "blocks": self.blocks}
        asm.functions[name] = self.fd

    def new(self) -> int:
        v = self.fd["nvalues"]
        self.fd["nvalues"] += 1
        return v

    def block(self, nargs: int = 0) -> tuple[int, list[int]]:
        args = [self.new() for _ in range(nargs)]
        self.blocks.append({"args": args, "ops": []})
        return len(self.blocks) - 1, args

    def at(self, b: int):
        self.cur = b

    def emit(self, o: str, *a: int, results: int = 1, **kw):
        r = [self.new() for _ in range(results)]
        d = {"o": o, "r": r, "a": list(a)}
        for k, v in kw.items():
            d[k] = self.asm.t(v) if k in ("t", "ft", "et") and isinstance(v, str) else v
        if "it" in d:
            d["it"] = [self.asm.t(x) for x in d["it"]]
        if "at" in d:
            d["at"] = [self.asm.t(x) for x in d["at"]]
        self.blocks[self.cur]["ops"].append(d)
        return r[0] if results == 1 else None

    def const(self, t: str, v) -> int:
        return self.emit("const", t=t, v=v)

    def ret(self, v: int | None = None):
        self.blocks[self.cur]["ops"].append({"o": "return", "a": [] if v is None else [v]})

    def br(self, dest: int, *args: int):
        self.blocks[self.cur]["ops"].append({"o": "br", "d": dest, "a": list(args)})

    def cond_br(self, c: int, td: int, ta: list[int], fd: int, fa: list[int]):
        self.blocks[self.cur]["ops"].append({"o": "cond_br", "a": [c], "td": td, "ta": ta, "fd": fd, "fa": fa})


def _s(v: int, w: int) -> int:
    return CT_S[w](v).value


def _u(v: int, w: int) -> int:
    return CT_U[w](v).value


def _edge_values(w: int, rng: random.Random, n: int = 12) -> list[int]:
    m = (1 << w) - 1
    vals = [0, 1, 2, 3, 7, m, m - 1, 1 << (w - 1), (1 << (w - 1)) - 1, (1 << (w - 1)) + 1]
    vals += [rng.randrange(0, 1 << w) for _ in range(n)]
    vals += [rng.randrange(0, 300) for _ in range(4)] + [m - rng.randrange(0, 300) for _ in range(4)]
    return [v & m for v in vals]


BINOPS = ("add", "sub", "mul", "and", "or", "xor", "shl", "lshr", "ashr", "udiv", "urem", "sdiv", "srem",
          "smin", "smax", "umin", "umax")


def _ref_binop(op: str, x: int, y: int, w: int):
    sx, sy = _s(x, w), _s(y, w)
    if op == "add":
        return _u(x + y, w)
    if op == "sub":
        return _u(x - y, w)
    if op == "mul":
        return _u(x * y, w)
    if op == "and":
        return x & y
    if op == "or":
        return x | y
    if op == "xor":
        return x ^ y
    if op == "shl":
        return _u(x << y, w) if y < w else None
    if op == "lshr":
        return x >> y if y < w else None
    if op == "ashr":
        return _u(sx >> y, w) if y < w else None  # Python >> on negatives floors = arithmetic shift
    if op == "udiv":
        return x // y if y else None
    if op == "urem":
        return x % y if y else None
    if op in ("sdiv", "srem"):
        if sy == 0 or (sx == -(1 << (w - 1)) and sy == -1):
            return None
        q = trunc(Fraction(sx, sy))  # C99: truncation toward zero
        return _u(q, w) if op == "sdiv" else _u(sx - q * sy, w)
    if op == "smin":
        return _u(min(sx, sy), w)
    if op == "smax":
        return _u(max(sx, sy), w)
    if op == "umin":
        return min(x, y)
    if op == "umax":
        return max(x, y)
    raise AssertionError(op)


@pytest.fixture(scope="module")
def binop_program():
    asm = Asm()
    for w in WIDTHS:
        for op in BINOPS:
            f = asm.func(f"{op}_{w}", [f"i{w}", f"i{w}"], f"i{w}")
            f.ret(f.emit(op, 0, 1, t=f"i{w}"))
    return asm.program("add_32")


@pytest.mark.parametrize("w", WIDTHS)
@pytest.mark.parametrize("op", BINOPS)
def test_integer_binops_match_c_semantics(binop_program, op, w):
    rng = random.Random(hash((op, w)) & 0xFFFF)
    xs = _edge_values(w, rng)
    ys = _edge_values(w, rng)
    if op in ("shl", "lshr", "ashr"):
        ys = list(range(w)) + [w, w + 1]
    checked = 0
    for x in xs:
        for y in ys:
            want = _ref_binop(op, x, y, w)
            if want is None:
                if op in ("udiv", "urem", "sdiv", "srem"):
                    with pytest.raises(HostVMError):
                        binop_program.call(f"{op}_{w}", [x, y])
                continue
            got = binop_program.call(f"{op}_{w}", [x, y])
            assert got == want, (op, w, x, y, got, want)
            checked += 1
    assert checked > 100


def test_signed_division_truncates_toward_zero(binop_program):
    m32 = (1 << 32) - 1
    cases = [(-7, 2, -3, -1), (7, -2, -3, 1), (-7, -2, 3, -1), (7, 2, 3, 1), (-1, 5, 0, -1), (-(1 << 31), 1, -(1 << 31), 0)]
    for x, y, q, r in cases:
        assert binop_program.call("sdiv_32", [x & m32, y & m32]) == q & m32
        assert binop_program.call("srem_32", [x & m32, y & m32]) == r & m32
    with pytest.raises(HostVMError, match="overflow"):
        binop_program.call("sdiv_32", [1 << 31, m32])
    with pytest.raises(HostVMError, match="zero"):
        binop_program.call("udiv_64", [5, 0])


def test_wraparound_and_shifts(binop_program):
    assert binop_program.call("add_32", [0xFFFFFFFF, 1]) == 0
    assert binop_program.call("sub_8", [0, 1]) == 0xFF
    assert binop_program.call("mul_16", [0x8000, 2]) == 0
    assert binop_program.call("mul_64", [1 << 63, 3]) == 1 << 63
    assert binop_program.call("lshr_32", [0x80000000, 31]) == 1
    assert binop_program.call("ashr_32", [0x80000000, 31]) == 0xFFFFFFFF
    assert binop_program.call("ashr_8", [0x40, 6]) == 1
    assert binop_program.call("shl_32", [3, 31]) == 0x80000000


ICMP = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge")


def test_icmp_signed_and_unsigned():
    asm = Asm()
    for w in WIDTHS:
        for p in ICMP:
            f = asm.func(f"{p}_{w}", [f"i{w}", f"i{w}"], "i1")
            f.ret(f.emit("icmp", 0, 1, p=p, t=f"i{w}"))
    prog = asm.program("eq_32")
    rng = random.Random(3)
    import operator as o

    ops = {"eq": o.eq, "ne": o.ne, "slt": o.lt, "sle": o.le, "sgt": o.gt, "sge": o.ge, "ult": o.lt, "ule": o.le,
           "ugt": o.gt, "uge": o.ge}
    for w in WIDTHS:
        vals = _edge_values(w, rng, 6)
        for p in ICMP:
            for x in vals:
                for y in vals[::3]:
                    a, b = (_s(x, w), _s(y, w)) if p[0] == "s" else (x, y)
                    assert prog.call(f"{p}_{w}", [x, y]) == int(ops[p](a, b)), (p, w, x, y)
    # the classic: -1 < 1 signed, but not unsigned
    assert prog.call("slt_32", [0xFFFFFFFF, 1]) == 1
    assert prog.call("ult_32", [0xFFFFFFFF, 1]) == 0


def test_casts_trunc_sext_zext_ptr():
    asm = Asm()
    pairs = [(8, 32), (16, 64), (32, 64), (1, 32), (1, 8), (8, 16)]
    for a, b in pairs:
        f = asm.func(f"sext_{a}_{b}", [f"i{a}"], f"i{b}")
        f.ret(f.emit("sext", 0, t=f"i{b}", ft=f"i{a}"))
        f = asm.func(f"zext_{a}_{b}", [f"i{a}"], f"i{b}")
        f.ret(f.emit("zext", 0, t=f"i{b}", ft=f"i{a}"))
        f = asm.func(f"trunc_{b}_{a}", [f"i{b}"], f"i{a}")
        f.ret(f.emit("trunc", 0, t=f"i{a}", ft=f"i{b}"))
    f = asm.func("p2i32", ["!llvm.ptr"], "i32")
    f.ret(f.emit("ptrtoint", 0, t="i32", ft="!llvm.ptr"))
    f = asm.func("i2p", ["i32"], "!llvm.ptr")
    f.ret(f.emit("inttoptr", 0, t="!llvm.ptr", ft="i32"))
    prog = asm.program("p2i32")
    rng = random.Random(5)
    for a, b in pairs:
        for x in [0, 1, (1 << a) - 1, 1 << (a - 1)] + [rng.randrange(0, 1 << a) for _ in range(20)]:
            sx = x - (1 << a) if x >> (a - 1) else x
            assert prog.call(f"sext_{a}_{b}", [x]) == sx & ((1 << b) - 1)
            assert prog.call(f"zext_{a}_{b}", [x]) == x
        for y in [0, (1 << b) - 1] + [rng.randrange(0, 1 << b) for _ in range(20)]:
            assert prog.call(f"trunc_{b}_{a}", [y]) == y & ((1 << a) - 1)
    assert prog.call("p2i32", [0x1234_5678_9ABC_DEF0]) == 0x9ABC_DEF0
    assert prog.call("i2p", [0xFFFFFFFF]) == 0xFFFFFFFF  # inttoptr zero-extends


def test_select_minmax_intrinsics_and_bit_counts():
    asm = Asm()
    f = asm.func("sel", ["i1", "i32", "i32"], "i32")
    f.ret(f.emit("select", 0, 1, 2))
    for op in ("ctlz", "cttz", "ctpop", "abs"):
        f = asm.func(op, ["i32"], "i32")
        f.ret(f.emit(op, 0, t="i32"))
    prog = asm.program("sel")
    assert prog.call("sel", [1, 5, 6]) == 5 and prog.call("sel", [0, 5, 6]) == 6
    assert prog.call("ctlz", [1]) == 31 and prog.call("ctlz", [0]) == 32
    assert prog.call("cttz", [8]) == 3 and prog.call("cttz", [0]) == 32
    assert prog.call("ctpop", [0xF0F0]) == 8
    assert prog.call("abs", [(-5) & 0xFFFFFFFF]) == 5


def test_loop_with_block_arguments():
    # sum = 0; for i in 0..n: sum += i   (blocks with arguments, cond_br, br)
    asm = Asm()
    f = asm.func("sum", ["i32"], "i32")
    zero = f.const("i32", 0)
    one = f.const("i32", 1)
    head, (i, s) = f.block(2)
    body, _ = f.block(0)
    done, (res,) = f.block(1)
    f.br(head, zero, zero)
    f.at(head)
    c = f.emit("icmp", i, 0, p="slt", t="i32")
    f.cond_br(c, body, [], done, [s])
    f.at(body)
    s2 = f.emit("add", s, i, t="i32")
    i2 = f.emit("add", i, one, t="i32")
    f.br(head, i2, s2)
    f.at(done)
    f.ret(res)
    prog = asm.program("sum")
    assert prog.call("sum", [100]) == 4950
    assert prog.call("sum", [0]) == 0


def test_branch_arguments_are_parallel_copies():
    # loop that swaps (a, b) through block arguments n times
    asm = Asm()
    f = asm.func("swap", ["i32", "i32", "i32"], "i32")
    zero = f.const("i32", 0)
    one = f.const("i32", 1)
    head, (k, a, b) = f.block(3)
    done, _ = f.block(0)
    f.br(head, zero, 1, 2)
    f.at(head)
    c = f.emit("icmp", k, 0, p="slt", t="i32")
    k2 = f.emit("add", k, one, t="i32")
    f.cond_br(c, head, [k2, b, a], done, [])
    f.at(done)
    ten = f.const("i32", 10)
    f.ret(f.emit("add", f.emit("mul", a, ten, t="i32"), b, t="i32"))
    prog = asm.program("swap")
    assert prog.call("swap", [3, 1, 2]) == 21
    assert prog.call("swap", [4, 1, 2]) == 12


# ---------------------------------------------------------------------------
# data layout, GEP, memory
# ---------------------------------------------------------------------------


class _S1(ctypes.Structure):
    _fields_ = [("a", ctypes.c_int8), ("b", ctypes.c_int32), ("c", ctypes.c_int64), ("d", ctypes.c_int16)]


class _S2(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int16), ("s", _S1 * 3), ("p", ctypes.c_void_p), ("y", ctypes.c_int8)]


class _Packed(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("a", ctypes.c_int8), ("b", ctypes.c_int32), ("c", ctypes.c_int64)]


class _LaunchConfig(ctypes.Structure):  # cudaLaunchConfig_t
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("smem", ctypes.c_size_t),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint32)]


class _LaunchAttr(ctypes.Structure):  # cudaLaunchAttribute
    _fields_ = [("id", ctypes.c_int32), ("pad", ctypes.c_char * 4), ("val", ctypes.c_char * 64)]


S1 = "!llvm.struct<(i8, i32, i64, i16)>"
S2 = f"!llvm.struct<(i16, array<3 x struct<(i8, i32, i64, i16)>>, ptr, i8)>"
PACKED = "!llvm.struct<packed (i8, i32, i64)>"
CFG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"
ATTR = "!llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>"


@pytest.mark.parametrize("text,ct", [(S1, _S1), (S2, _S2), (PACKED, _Packed), (CFG, _LaunchConfig), (ATTR, _LaunchAttr)])
def test_struct_layout_matches_c_abi(text, ct):
    t = VMType(parse_type(text))
    assert t.size == ctypes.sizeof(ct), text
    assert t.align == ctypes.alignment(ct), text
    assert list(t.offsets) == [getattr(ct, name).offset for name, *_ in ct._fields_], text


def test_scalar_sizes_and_alignments():
    for text, size, align in [("i1", 1, 1), ("i8", 1, 1), ("i16", 2, 2), ("i32", 4, 4), ("i64", 8, 8), ("i128", 16, 16),
                              ("!llvm.ptr", 8, 8), ("!llvm.ptr<1>", 8, 8), ("f16", 2, 2), ("bf16", 2, 2), ("f32", 4, 4),
                              ("f64", 8, 8), ("!llvm.array<17 x struct<(i32, array<4 x i8>, array<64 x i8>)>>", 17 * 72, 4),
                              ("!llvm.struct<()>", 0, 1), ("!llvm.struct<(i32, struct<()>)>", 4, 4)]:
        assert type_size_align_of_encoding(parse_type(text)) == (size, align), text


def test_gep_offsets_match_c_abi():
    # byte offset of &s[0].field_k (constant GEP), &arr[i] with a dynamic (negative) i32 index,
    # and &s2.s[i].c with mixed constant/dynamic indices
    asm = Asm()
    fields = [n for n, *_ in _S1._fields_]
    for k in range(4):
        f = asm.func(f"off{k}", [], "i64")
        one = f.const("i32", 1)
        p = f.emit("alloca", one, et=S1, align=0)
        q = f.emit("gep", p, et=S1, idx=[0, k], it=[])
        f.ret(f.emit("sub", f.emit("ptrtoint", q, t="i64", ft="!llvm.ptr"), f.emit("ptrtoint", p, t="i64", ft="!llvm.ptr"), t="i64"))
    f = asm.func("dyn", ["i32"], "i64")
    one = f.const("i32", 1)
    base = f.const("i64", 1 << 40)
    p = f.emit("inttoptr", base, t="!llvm.ptr", ft="i64")
    q = f.emit("gep", p, 0, et=S1, idx=[None], it=["i32"])
    f.ret(f.emit("sub", f.emit("ptrtoint", q, t="i64", ft="!llvm.ptr"), base, t="i64"))
    f = asm.func("mixed", ["i64"], "i64")
    z = f.const("i64", 0)
    p = f.emit("inttoptr", z, t="!llvm.ptr", ft="i64")
    q = f.emit("gep", p, 0, et=S2, idx=[0, 1, None, 2], it=["i64"])
    f.ret(f.emit("ptrtoint", q, t="i64", ft="!llvm.ptr"))
    prog = asm.program("dyn")
    for k in range(4):
        assert prog.call(f"off{k}", []) == getattr(_S1, fields[k]).offset
    m64 = (1 << 64) - 1
    assert prog.call("dyn", [(-1) & 0xFFFFFFFF]) == (-ctypes.sizeof(_S1)) & m64  # sign-extended index
    assert prog.call("dyn", [3]) == 3 * ctypes.sizeof(_S1)
    for i in range(3):
        assert prog.call("mixed", [i]) == _S2.s.offset + i * ctypes.sizeof(_S1) + _S1.c.offset


def test_aggregate_store_load_roundtrip_and_undef_fill():
    asm = Asm()
    f = asm.func("rt", ["i8", "i32", "i64", "i16"], "i64")
    one = f.const("i32", 1)
    p = f.emit("alloca", one, et=S1, align=0)
    agg = f.emit("poison", t=S1)
    for k in range(4):
        agg = f.emit("insertvalue", agg, k, t=S1, pos=[k])
    f.emit("store", agg, p, t=S1, results=0)
    back = f.emit("load", p, t=S1)
    # return the struct's c field, plus the padding byte after a (never written)
    q = f.emit("gep", p, et="i8", idx=[1], it=[])
    pad = f.emit("zext", f.emit("load", q, t="i8"), t="i64", ft="i8")
    c = f.emit("extractvalue", back, t=S1, pos=[2])
    sh = f.const("i64", 56)
    f.ret(f.emit("or", c, f.emit("shl", pad, sh, t="i64"), t="i64"))
    prog = asm.program("rt")
    assert prog.call("rt", [1, 2, 0x123456, 4]) == 0x123456
    assert prog.call("rt", [1, 2, 0x123456, 4], undef_byte=0xA5) == 0x123456 | (0xA5 << 56)


def test_out_of_bounds_access_raises():
    asm = Asm()
    f = asm.func("oob", [], "i64")
    one = f.const("i32", 1)
    p = f.emit("alloca", one, et="i32", align=0)
    f.ret(f.emit("load", p, t="i64"))  # 8 bytes from a 4-byte alloca
    f = asm.func("wild", ["!llvm.ptr"], "i32")
    f.ret(f.emit("load", 0, t="i32"))  # a device pointer is never host memory
    prog = asm.program("oob")
    with pytest.raises(HostVMError, match="invalid host memory access"):
        prog.call("oob", [])
    with pytest.raises(HostVMError, match="invalid host memory access"):
        prog.call("wild", [0x7F00_0000_1000])


def test_printf_then_trap_raises_hosttrap_with_text():
    asm = Asm()
    asm.string("fmt", b"Error: smem %d bytes exceeds %s (%u, %lld, %x)\n\x00")
    asm.string("what", b"limit\x00")
    asm.externals["printf"] = {"type": asm.t("!llvm.func<i32 (ptr, ...)>")}
    f = asm.func("boom", ["i32"], "i32")
    a = f.emit("addressof", g="fmt")
    b = f.emit("addressof", g="what")
    big = f.const("i64", -2)
    f.emit("call", a, 0, b, 0, big, 0, callee="printf", at=["!llvm.ptr", "i32", "!llvm.ptr", "i32", "i64", "i32"], t="i32")
    f.blocks[f.cur]["ops"].append({"o": "trap"})
    f.blocks[f.cur]["ops"].append({"o": "unreachable"})
    prog = asm.program("boom")
    with pytest.raises(HostTrap) as ei:
        prog.call("boom", [(-300000) & 0xFFFFFFFF])
    assert ei.value.printf_text == "Error: smem -300000 bytes exceeds limit (4294667296, -2, fffb6c20)\n"
    assert "exceeds limit" in str(ei.value)


def test_format_and_op_validation():
    asm = Asm()
    f = asm.func("e", [], "i32")
    f.ret(f.const("i32", 0))
    doc = asm.doc("e")
    HostProgram.from_dict(doc)
    with pytest.raises(HostVMError, match="format_version"):
        HostProgram.from_dict(dict(doc, format_version=FORMAT_VERSION + 1))
    with pytest.raises(HostVMError, match="not a host program"):
        HostProgram.from_dict(dict(doc, format="something-else"))
    bad = asm.doc("e")
    bad["functions"]["e"]["blocks"][0]["ops"].insert(0, {"o": "fadd", "r": [], "a": []})
    with pytest.raises(HostVMError, match="unsupported op kind 'fadd'"):
        HostProgram.from_dict(bad)
    bad2 = asm.doc("e")
    bad2["externals"]["cuTensorMapEncodeTiled"] = {"type": asm.t("!llvm.func<i32 (ptr)>")}
    with pytest.raises(HostVMError, match="cuTensorMapEncodeTiled"):
        HostProgram.from_dict(bad2)
    with pytest.raises(HostVMError, match="lacks function"):
        HostProgram.from_dict(dict(asm.doc("e"), entry="nope"))
    with pytest.raises(HostVMError, match="malformed"):
        HostProgram.from_dict({"format": "svdq-host-ir", "format_version": FORMAT_VERSION})


def test_infinite_loop_is_stopped():
    asm = Asm()
    f = asm.func("spin", [], "i32")
    loop, _ = f.block(0)
    f.br(loop)
    f.at(loop)
    f.br(loop)
    prog = asm.program("spin")
    with pytest.raises(HostVMError, match="step limit"):
        prog.call("spin", [])


# ---------------------------------------------------------------------------
# hand-written launchers: the _cudaLaunchKernelEx stub and the LaunchPlanCache
# ---------------------------------------------------------------------------


def _launcher(variant: str) -> HostProgram:
    """entry(ptr p, ptr q, i32 m, ptr stream): launch kernel "k" with params

    0: i64 p + 64         (a base+offset slot)
    1: i64 q              (a plain pointer)
    2: i32 m
    3: i64 extra          variant "shift": p >> 4 (not base+offset)
                          variant "bit":   (p & 32) ? 1 : 2 (depends on one pointer bit)
                          variant "plain": 7
    grid = (ceil(m / 64), 1, 1), block = (64, 1, 1), smem = m, one attribute (id 4).
    """
    asm = Asm()
    asm.externals["_cudaLaunchKernelEx"] = {"type": asm.t("!llvm.func<i32 (ptr, ptr, ptr)>")}
    asm.globals["kernels_k"] = {"type": asm.t("!llvm.ptr"), "kind": "kernel_handle", "kernel": "k", "cu_attrs": {}}
    f = asm.func("entry", ["!llvm.ptr<1>", "!llvm.ptr<1>", "i32", "!llvm.ptr"], "i32")
    P, Q, M, STREAM = 0, 1, 2, 3
    c = {v: f.const("i32", v) for v in (0, 1, 2, 3, 4, 5, 63, 64)}
    c64 = {v: f.const("i64", v) for v in (1, 2, 4, 7, 32, 64)}
    cfg = f.emit("alloca", c[1], et=CFG, align=0)
    attrs = f.emit("alloca", c[1], et=f"!llvm.array<1 x {ATTR[len('!llvm.'):]}>", align=0)

    def field(ptr, idx, et=CFG):
        return f.emit("gep", ptr, et=et, idx=idx, it=[])

    gx = f.emit("sdiv", f.emit("add", M, c[63], t="i32"), c[64], t="i32")
    f.emit("store", gx, field(cfg, [0, 0, 0]), t="i32", results=0)
    f.emit("store", c[1], field(cfg, [0, 0, 1]), t="i32", results=0)
    f.emit("store", c[1], field(cfg, [0, 0, 2]), t="i32", results=0)
    f.emit("store", c[64], field(cfg, [0, 1, 0]), t="i32", results=0)
    f.emit("store", c[1], field(cfg, [0, 1, 1]), t="i32", results=0)
    f.emit("store", c[1], field(cfg, [0, 1, 2]), t="i32", results=0)
    f.emit("store", f.emit("zext", M, t="i64", ft="i32"), field(cfg, [0, 2]), t="i64", results=0)
    f.emit("store", STREAM, field(cfg, [0, 3]), t="!llvm.ptr", results=0)
    f.emit("store", attrs, field(cfg, [0, 4]), t="!llvm.ptr", results=0)
    f.emit("store", c[1], field(cfg, [0, 5]), t="i32", results=0)
    a0 = f.emit("gep", attrs, et=ATTR, idx=[0, 0], it=[])
    f.emit("store", c[4], a0, t="i32", results=0)
    a2 = f.emit("gep", attrs, et=ATTR, idx=[0, 2], it=[])
    f.emit("store", c[2], a2, t="i32", results=0)
    pint = f.emit("ptrtoint", P, t="i64", ft="!llvm.ptr<1>")
    p0 = f.emit("alloca", c[1], et="i64", align=0)
    f.emit("store", f.emit("gep", P, et="i8", idx=[64], it=[]), p0, t="!llvm.ptr<1>", results=0)
    p1 = f.emit("alloca", c[1], et="!llvm.ptr<1>", align=0)
    f.emit("store", Q, p1, t="!llvm.ptr<1>", results=0)
    p2 = f.emit("alloca", c[1], et="i32", align=0)
    f.emit("store", M, p2, t="i32", results=0)
    p3 = f.emit("alloca", c[1], et="i64", align=0)
    if variant == "shift":
        extra = f.emit("lshr", pint, c64[4], t="i64")
    elif variant == "bit":
        bit = f.emit("icmp", f.emit("and", pint, c64[32], t="i64"), c64[32], p="eq", t="i64")
        extra = f.emit("select", bit, c64[1], c64[2])
    else:
        extra = c64[7]
    f.emit("store", extra, p3, t="i64", results=0)
    params = [p0, p1, p2, p3]
    argv = f.emit("alloca", c[4], et="!llvm.ptr", align=0)
    for i, p in enumerate(params):
        f.emit("store", p, f.emit("gep", argv, c[i], et="!llvm.ptr", idx=[None], it=["i32"]), t="!llvm.ptr", results=0)
    h = f.emit("load", f.emit("addressof", g="kernels_k"), t="!llvm.ptr")
    rc = f.emit("call", cfg, h, argv, callee="_cudaLaunchKernelEx", at=["!llvm.ptr"] * 3, t="i32")
    f.ret(rc)
    load = asm.func("cuda_load_to_device", ["!llvm.ptr", "i32"], "i32")
    load.ret(load.const("i32", 0))
    doc = asm.doc("entry", "cuda_load_to_device")
    return HostProgram.from_dict(doc)


def test_launch_record_from_hand_written_launcher():
    prog = _launcher("plain")
    assert prog.arg_kinds == ["ptr<1>", "ptr<1>", "i32", "ptr"]
    rec = prog.launch([0x1000, 0x2000, 130, 0x77], {"k": [8, 8, 4, 8]})
    assert rec.kernel == "k" and rec.grid == (3, 1, 1) and rec.block == (64, 1, 1)
    assert rec.smem == 130 and rec.stream == 0x77
    assert [a for a, _ in rec.attrs] == [4] and rec.cluster == (2, 0, 0)  # only the first int was written
    assert rec.params == [(0x1040).to_bytes(8, "little"), (0x2000).to_bytes(8, "little"), (130).to_bytes(4, "little"),
                          (7).to_bytes(8, "little")]
    # without sizes each param runs to the end of its allocation (the same here)
    assert prog.launch([0x1000, 0x2000, 130, 0x77]) == rec
    with pytest.raises(HostVMError, match="cubin declares 3"):
        prog.launch([0x1000, 0x2000, 130, 0x77], {"k": [8, 8, 4]})
    with pytest.raises(HostVMError, match="no entry for kernel k"):
        prog.launch([0x1000, 0x2000, 130, 0x77], {"other": [8]})


@pytest.mark.parametrize("variant,patchable", [("plain", True), ("shift", False), ("bit", False)])
def test_launch_plan_cache_is_exact(variant, patchable):
    from svdq_loader.launch_plan import CachedLaunch, LaunchPlanCache

    prog = _launcher(variant)
    sizes = {"k": [8, 8, 4, 8]}
    cache = LaunchPlanCache(prog, [0, 1, 3], sizes)
    rng = random.Random(11)
    kinds = set()
    for i in range(200):
        m = rng.choice([1, 64, 65, 1000])
        p = rng.choice([0, rng.randrange(1, 1 << 43) * 16, rng.randrange(1, 1 << 47)])
        q = rng.choice([0, rng.randrange(1, 1 << 43) * 16, 1 << 50, rng.randrange(1, 1 << 47)])
        s = rng.choice([0, 2, rng.randrange(1, 1 << 47)])
        args = [p, q, m, s]
        got = cache.get(args)
        kinds.add(type(got).__name__)
        rec = got.record() if isinstance(got, CachedLaunch) else got
        assert rec == prog.launch(args, sizes), (variant, args)
    if patchable:
        assert "CachedLaunch" in kinds and cache.stats()["unpatchable"] == 0
        e = cache.entry_for([1 << 40, 2 << 40, 64, 0x99])
        assert sorted((off, i, c) for _, off, i, c in e.slots) == [(0, 0, 64), (0, 1, 0)]
        assert e.stream_pos == 2
        # this launcher only copies pointers: unaligned pointers are fine to patch
        assert cache.get([(1 << 40) + 3, (2 << 40) + 5, 64, 0x99]).__class__ is CachedLaunch
    else:
        assert cache.stats()["unpatchable"] > 0

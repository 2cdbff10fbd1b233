"""Serialise the lowered host side of a compiled CuTe-DSL function.

``cute.compile`` lowers a ``@cute.jit`` host function all the way to the MLIR
LLVM dialect (``compiled.ir_module``).  That host code builds TMA descriptors
inline, computes the grid, packs the kernel parameters and calls
``cudaLaunchKernelEx``; a separate ``cuda_load_to_device`` sets the kernel
attributes when the library is loaded.  :func:`serialize_host` walks that
module with the MLIR Python bindings and emits a JSON-able *host program*
that ``svdq_loader.hostvm`` interprets at inference time without the DSL.

Only the entry function, ``cuda_load_to_device`` and what they reference are
serialised; the fatbin global ``kernels_binary`` never is.  Anything outside
the supported op/type set raises :class:`HostIRError` here, at build time,
naming the op and the function: an unsupported construct must fail the build,
never the launch.

Format (``format_version`` 1), all names are MLIR symbol names::

    {
      "format": "svdq-host-ir", "format_version": 1,
      "producer": {"cutlass_dsl": "4.8.1"},
      "entry": "<compiled.function_name>", "load": "cuda_load_to_device",
      "types": [<type>, ...],           # type table; ops refer to indices
      "functions": {name: {"args": [t...], "ret": t|null,
                           "nvalues": N, "blocks": [block...]}},
      "externals": {name: {"type": t}}, # declarations that are called
      "globals": {name: {"type": t, "kind": "kernel_handle", "kernel": sym,
                         "cu_attrs": {...}}
                      | {"type": t, "kind": "data", "constant": bool,
                         "align": n, "hex": "..."}},
      "kernels": [kernel symbol, ...]
    }

Types are nested lists: ``["int", w]``, ``["ptr", addrspace]``,
``["float", bits, name]``, ``["struct", packed, [t...]]``,
``["array", n, t]``, ``["void"]``, ``["func", ret, [t...], vararg]``.
Sizes/offsets/alignments follow the x86-64 default LLVM data layout (the
module carries no data-layout attribute; the DSL JITs it for the host).

A block is ``{"args": [value ids], "ops": [op...]}``; value ids are dense
integers per function (function arguments first).  An op is a dict with
``"o"`` (kind), ``"r"`` (result ids), ``"a"`` (operand ids) plus per-kind
fields (see ``_FunctionConverter.convert_op``): ``t`` result/operand type,
``ft`` source type of casts, ``p`` icmp predicate name, ``pos`` aggregate
path, ``et``/``idx``/``it`` for alloca and getelementptr (``idx`` entries
are constants or ``null`` for the next dynamic operand), ``callee``/``at``
for calls, ``d``/``td``/``ta``/``fd``/``fa``/``dd``/``da``/``cases`` for
branches.  Constants ``v`` are ints, ``{"hex": bytes}`` (strings),
``{"bits": n}`` (float bit patterns) or lists (dense arrays).

Op kinds: const zero poison addressof add sub mul and or xor shl lshr ashr
sdiv udiv srem urem smin smax umin umax {s,u}{add,sub,mul}_ovf icmp select
trunc zext sext ptrtoint inttoptr bitcast freeze ctlz cttz ctpop abs bswap
insertvalue extractvalue alloca load store gep memcpy memset call br
cond_br switch return trap unreachable.  Float values are only moved
(loads/stores/bitcasts of their bits); float arithmetic is rejected.
"""

from __future__ import annotations

import re
from typing import Any

# The external functions the interpreter knows how to answer: its own list.
from svdq_loader.hostvm import EXTERNALS as SUPPORTED_EXTERNALS

from svdq_loader.hostvm import FORMAT, FORMAT_VERSION  # noqa: E402  (one home: the reader defines the format)

LOAD_FUNCTION = "cuda_load_to_device"
BINARY_GLOBAL = "kernels_binary"
KERNEL_HANDLE_PREFIX = "kernels_"

_ICMP = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge")

_BINARY = {
    "llvm.add": "add",
    "llvm.sub": "sub",
    "llvm.mul": "mul",
    "llvm.and": "and",
    "llvm.or": "or",
    "llvm.xor": "xor",
    "llvm.shl": "shl",
    "llvm.lshr": "lshr",
    "llvm.ashr": "ashr",
    "llvm.sdiv": "sdiv",
    "llvm.udiv": "udiv",
    "llvm.srem": "srem",
    "llvm.urem": "urem",
    "llvm.intr.smin": "smin",
    "llvm.intr.smax": "smax",
    "llvm.intr.umin": "umin",
    "llvm.intr.umax": "umax",
    "llvm.intr.sadd.with.overflow": "sadd_ovf",
    "llvm.intr.uadd.with.overflow": "uadd_ovf",
    "llvm.intr.ssub.with.overflow": "ssub_ovf",
    "llvm.intr.usub.with.overflow": "usub_ovf",
    "llvm.intr.smul.with.overflow": "smul_ovf",
    "llvm.intr.umul.with.overflow": "umul_ovf",
}

_CASTS = {
    "llvm.trunc": "trunc",
    "llvm.zext": "zext",
    "llvm.sext": "sext",
    "llvm.ptrtoint": "ptrtoint",
    "llvm.inttoptr": "inttoptr",
    "llvm.bitcast": "bitcast",
    "llvm.addrspacecast": "bitcast",
    "llvm.freeze": "freeze",
}

_UNARY_INTR = {
    "llvm.intr.ctlz": "ctlz",
    "llvm.intr.cttz": "cttz",
    "llvm.intr.ctpop": "ctpop",
    "llvm.intr.abs": "abs",
    "llvm.intr.bswap": "bswap",
}

# Ops that carry no semantics for the interpreter.
_IGNORED = {"llvm.intr.assume", "llvm.intr.lifetime.start", "llvm.intr.lifetime.end", "llvm.intr.stackrestore"}

_GEP_DYNAMIC = -2147483648  # MLIR's kDynamicIndex marker in rawConstantIndices


class HostIRError(RuntimeError):
    """The lowered host code contains something the interpreter cannot run."""


# ---------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------


class _TypeParser:
    """Parse the textual form of MLIR builtin/LLVM-dialect types."""

    _tok = re.compile(r"\s*(!llvm\.|[A-Za-z_][A-Za-z0-9_.]*|\d+|\.\.\.|\"(?:[^\"\\]|\\.)*\"|[<>(),:])")

    def __init__(self, text: str):
        self.text = text
        self.toks = []
        pos = 0
        while pos < len(text):
            m = self._tok.match(text, pos)
            if not m:
                if text[pos:].strip() == "":
                    break
                raise HostIRError(f"cannot parse type {text!r} at {text[pos:]!r}")
            self.toks.append(m.group(1))
            pos = m.end()
        self.i = 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expect=None):
        t = self.peek()
        if t is None or (expect is not None and t != expect):
            raise HostIRError(f"cannot parse type {self.text!r}: expected {expect!r}, got {t!r}")
        self.i += 1
        return t

    def parse(self):
        t = self.type()
        if self.peek() is not None:
            raise HostIRError(f"trailing text in type {self.text!r}")
        return t

    def type(self):
        t = self.take()
        if t == "!llvm.":
            t = self.take()
        if re.fullmatch(r"i\d+", t):
            return ["int", int(t[1:])]
        if t in ("f16", "bf16", "f32", "f64"):
            return ["float", {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}[t], t]
        if t == "ptr":
            if self.peek() == "<":
                self.take("<")
                a = int(self.take())
                self.take(">")
                return ["ptr", a]
            return ["ptr", 0]
        if t == "void":
            return ["void"]
        if t == "array":
            self.take("<")
            n = int(self.take())
            x = self.take()
            if x != "x":
                raise HostIRError(f"cannot parse array type {self.text!r}")
            e = self.type()
            self.take(">")
            return ["array", n, e]
        if t == "struct":
            self.take("<")
            if self.peek() is not None and self.peek().startswith('"'):
                raise HostIRError(f"identified (named) struct types are not supported: {self.text!r}")
            packed = False
            if self.peek() == "packed":
                self.take()
                packed = True
            self.take("(")
            fields = []
            if self.peek() != ")":
                fields.append(self.type())
                while self.peek() == ",":
                    self.take(",")
                    fields.append(self.type())
            self.take(")")
            self.take(">")
            return ["struct", packed, fields]
        if t == "func":
            self.take("<")
            ret = self.type()
            self.take("(")
            params = []
            vararg = False
            while self.peek() != ")":
                if self.peek() == "...":
                    self.take()
                    vararg = True
                else:
                    params.append(self.type())
                if self.peek() == ",":
                    self.take(",")
            self.take(")")
            self.take(">")
            return ["func", ret, params, vararg]
        raise HostIRError(f"unsupported type {self.text!r} (token {t!r})")


def parse_type(text: str) -> list:
    """Parse an MLIR type string (e.g. ``!llvm.struct<(i32, ptr)>``) into the JSON encoding."""
    return _TypeParser(str(text)).parse()


class _TypeTable:
    def __init__(self):
        self.types: list = []
        self.index: dict[str, int] = {}
        self.by_text: dict[str, int] = {}

    def add_encoded(self, enc) -> int:
        key = repr(enc)
        i = self.index.get(key)
        if i is None:
            i = len(self.types)
            self.types.append(enc)
            self.index[key] = i
        return i

    def add(self, mlir_type) -> int:
        text = str(mlir_type)
        i = self.by_text.get(text)
        if i is not None:
            return i
        i = self.add_encoded(parse_type(text))
        self.by_text[text] = i
        return i


# ---------------------------------------------------------------------------
# Module walking
# ---------------------------------------------------------------------------


def _sym_name(op) -> str | None:
    attrs = op.attributes
    if "sym_name" in attrs:
        return attrs["sym_name"].value
    return None


def _attr(op, name, default=None):
    attrs = op.attributes
    return attrs[name] if name in attrs else default


def _int_list(attr) -> list[int]:
    return [int(x) for x in attr]


def _bool_attr(attr) -> bool:
    if attr is None:
        return False
    v = getattr(attr, "value", None)
    if isinstance(v, bool):
        return v
    return str(attr) in ("true", "unit")


def _attr_to_json(attr) -> Any:
    """Best-effort JSON view of a (small) attribute, for informational fields."""
    from cutlass._mlir import ir  # build time only

    if isinstance(attr, ir.DictAttr):
        out = {}
        for i in range(len(attr)):
            na = attr[i]
            out[na.name] = _attr_to_json(na.attr)
        return out
    if isinstance(attr, ir.IntegerAttr):
        return int(attr.value)
    if isinstance(attr, ir.StringAttr):
        return attr.value
    return str(attr)


class _FunctionConverter:
    def __init__(self, module_conv: "_ModuleConverter", name: str, func_op):
        self.mc = module_conv
        self.name = name
        self.op = func_op
        self.ids: dict[int, int] = {}
        self.next_id = 0
        self.block_index: dict[int, int] = {}

    def err(self, msg, op=None) -> HostIRError:
        where = f" in function @{self.name}"
        if op is not None:
            text = str(op)
            if len(text) > 300:
                text = text[:300] + "..."
            return HostIRError(f"{msg}{where}: {text}")
        return HostIRError(msg + where)

    def new_id(self, value) -> int:
        i = self.next_id
        self.next_id += 1
        self.ids[hash(value)] = i
        return i

    def vid(self, value, op) -> int:
        try:
            return self.ids[hash(value)]
        except KeyError:
            raise self.err("operand defined outside the function (or before use in a non-dominating block)", op) from None

    def t(self, mlir_type, op=None) -> int:
        try:
            return self.mc.types.add(mlir_type)
        except HostIRError as e:
            raise self.err(str(e), op) from None

    def convert(self) -> dict:
        fty = parse_type(self.op.attributes["function_type"].value)
        if fty[0] != "func":
            raise self.err("function_type is not an LLVM function type")
        region = self.op.regions[0]
        blocks = list(region.blocks)
        if not blocks:
            raise self.err("function has no body")
        for i, b in enumerate(blocks):
            self.block_index[hash(b)] = i
        # Number every value first: block arguments (function args are the
        # entry block's arguments), then op results, block by block.
        for b in blocks:
            for a in b.arguments:
                self.new_id(a)
            for op in b.operations:
                for r in op.operation.results:
                    self.new_id(r)
        out_blocks = []
        for b in blocks:
            ops = []
            for op in b.operations:
                c = self.convert_op(op.operation)
                if c is not None:
                    ops.append(c)
            out_blocks.append(
                {
                    "args": [self.ids[hash(a)] for a in b.arguments],
                    "ops": ops,
                }
            )
        ret = fty[1]
        return {
            "args": [self.t(a.type) for a in blocks[0].arguments],
            "ret": None if ret == ["void"] else self.mc.types.add_encoded(ret),
            "nvalues": self.next_id,
            "blocks": out_blocks,
        }

    # -- ops -----------------------------------------------------------------

    def convert_op(self, op) -> dict | None:
        name = op.name
        res = [self.ids[hash(r)] for r in op.results]
        opnds = [self.vid(v, op) for v in op.operands]
        rt = self.t(op.results[0].type, op) if len(op.results) == 1 else None

        if name in _IGNORED:
            return None
        if name == "llvm.mlir.constant":
            return {"o": "const", "r": res, "t": rt, "v": self.const_value(_attr(op, "value"), op)}
        if name in ("llvm.mlir.zero", "llvm.intr.stacksave"):
            # stacksave: the VM never frees allocas, so the token is never used for anything
            return {"o": "zero", "r": res, "t": rt}
        if name in ("llvm.mlir.poison", "llvm.mlir.undef"):
            return {"o": "poison", "r": res, "t": rt}
        if name == "llvm.mlir.addressof":
            g = _attr(op, "global_name").value
            self.mc.require_global(g, self)
            return {"o": "addressof", "r": res, "g": g}
        if name in _BINARY:
            return {"o": _BINARY[name], "r": res, "a": opnds, "t": self.t(op.operands[0].type, op)}
        if name == "llvm.icmp":
            p = int(_attr(op, "predicate").value)
            return {"o": "icmp", "r": res, "a": opnds, "p": _ICMP[p], "t": self.t(op.operands[0].type, op)}
        if name == "llvm.select":
            return {"o": "select", "r": res, "a": opnds, "t": rt}
        if name in _CASTS:
            return {"o": _CASTS[name], "r": res, "a": opnds, "t": rt, "ft": self.t(op.operands[0].type, op)}
        if name in _UNARY_INTR:
            d = {"o": _UNARY_INTR[name], "r": res, "a": opnds, "t": rt}
            if name == "llvm.intr.abs":
                d["poison_min"] = _bool_attr(_attr(op, "is_int_min_poison"))
            if name in ("llvm.intr.ctlz", "llvm.intr.cttz"):
                d["poison_zero"] = _bool_attr(_attr(op, "is_zero_poison"))
            return d
        if name == "llvm.intr.expect":
            return {"o": "freeze", "r": res, "a": opnds[:1], "t": rt, "ft": rt}
        if name == "llvm.insertvalue":
            return {"o": "insertvalue", "r": res, "a": opnds, "t": rt, "pos": _int_list(_attr(op, "position"))}
        if name == "llvm.extractvalue":
            return {
                "o": "extractvalue",
                "r": res,
                "a": opnds,
                "t": self.t(op.operands[0].type, op),
                "pos": _int_list(_attr(op, "position")),
            }
        if name == "llvm.alloca":
            al = _attr(op, "alignment")
            return {
                "o": "alloca",
                "r": res,
                "a": opnds,
                "et": self.t(_attr(op, "elem_type").value, op),
                "align": int(al.value) if al is not None else 0,
            }
        if name == "llvm.load":
            if _attr(op, "ordering") is not None and int(_attr(op, "ordering").value) != 0:
                raise self.err("atomic load is not supported", op)
            return {"o": "load", "r": res, "a": opnds, "t": rt}
        if name == "llvm.store":
            if _attr(op, "ordering") is not None and int(_attr(op, "ordering").value) != 0:
                raise self.err("atomic store is not supported", op)
            return {"o": "store", "r": res, "a": opnds, "t": self.t(op.operands[0].type, op)}
        if name == "llvm.getelementptr":
            raw = _int_list(_attr(op, "rawConstantIndices"))
            idx = [None if x == _GEP_DYNAMIC else x for x in raw]
            ndyn = sum(1 for x in idx if x is None)
            if ndyn != len(opnds) - 1:
                raise self.err("getelementptr dynamic index count mismatch", op)
            return {
                "o": "gep",
                "r": res,
                "a": opnds,
                "et": self.t(_attr(op, "elem_type").value, op),
                "idx": idx,
                "it": [self.t(v.type, op) for v in list(op.operands)[1:]],
            }
        if name in ("llvm.intr.memcpy", "llvm.intr.memmove"):
            return {"o": "memcpy", "r": res, "a": opnds, "t": self.t(op.operands[2].type, op)}
        if name == "llvm.intr.memset":
            return {"o": "memset", "r": res, "a": opnds, "t": self.t(op.operands[2].type, op)}
        if name == "llvm.call":
            return self.convert_call(op, res, opnds)
        if name == "llvm.br":
            (dest,) = list(op.successors)
            return {"o": "br", "d": self.block_index[hash(dest)], "a": opnds}
        if name == "llvm.cond_br":
            seg = _int_list(_attr(op, "operandSegmentSizes"))
            t_dest, f_dest = list(op.successors)
            return {
                "o": "cond_br",
                "a": opnds[:1],
                "td": self.block_index[hash(t_dest)],
                "ta": opnds[1 : 1 + seg[1]],
                "fd": self.block_index[hash(f_dest)],
                "fa": opnds[1 + seg[1] : 1 + seg[1] + seg[2]],
            }
        if name == "llvm.switch":
            seg = _int_list(_attr(op, "operandSegmentSizes"))
            case_seg = _int_list(_attr(op, "case_operand_segments"))
            succ = list(op.successors)
            cv = _attr(op, "case_values")
            values = [int(x) for x in cv] if cv is not None else []
            default_args = opnds[1 : 1 + seg[1]]
            rest = opnds[1 + seg[1] :]
            cases = []
            pos = 0
            for v, d, n in zip(values, succ[1:], case_seg):
                cases.append([v, self.block_index[hash(d)], rest[pos : pos + n]])
                pos += n
            return {
                "o": "switch",
                "a": opnds[:1],
                "t": self.t(op.operands[0].type, op),
                "dd": self.block_index[hash(succ[0])],
                "da": default_args,
                "cases": cases,
            }
        if name == "llvm.return":
            return {"o": "return", "a": opnds}
        if name == "llvm.intr.trap" or name == "llvm.intr.debugtrap" or name == "llvm.intr.ubsantrap":
            return {"o": "trap"}
        if name == "llvm.unreachable":
            return {"o": "unreachable"}
        raise self.err(f"unsupported op '{name}'", op)

    def convert_call(self, op, res, opnds) -> dict:
        callee = _attr(op, "callee")
        if callee is None:
            raise self.err("indirect call is not supported", op)
        callee = callee.value
        seg = _attr(op, "operandSegmentSizes")
        if seg is not None and len(_int_list(seg)) > 1 and _int_list(seg)[1] != 0:
            raise self.err("call with operand bundles is not supported", op)
        self.mc.require_function(callee, self)
        return {
            "o": "call",
            "r": res,
            "a": opnds,
            "callee": callee,
            "at": [self.t(v.type, op) for v in op.operands],
            "t": self.t(op.results[0].type, op) if len(op.results) else None,
        }

    def const_value(self, attr, op):
        from cutlass._mlir import ir

        if isinstance(attr, ir.BoolAttr):
            return 1 if attr.value else 0
        if isinstance(attr, ir.IntegerAttr):
            return int(attr.value)
        if isinstance(attr, ir.FloatAttr):
            # floats are carried as bit patterns (the VM never computes on them)
            import struct

            kind = str(attr.type)
            fmt = {"f16": "<e", "f32": "<f", "f64": "<d"}.get(kind)
            if fmt is not None:
                return {"bits": int.from_bytes(struct.pack(fmt, attr.value), "little")}
            if kind == "bf16":  # exact: a bf16 value is an f32 with 16 zero low bits
                b = int.from_bytes(struct.pack("<f", attr.value), "little")
                if b & 0xFFFF:
                    raise self.err("bf16 constant is not exactly representable", op)
                return {"bits": b >> 16}
            raise self.err(f"unsupported float constant type {kind}", op)
        if isinstance(attr, ir.StringAttr):
            return {"hex": attr.value_bytes.hex()}
        if isinstance(attr, ir.DenseIntElementsAttr):
            if attr.is_splat:
                raise self.err("splat dense constants are not supported", op)
            return [int(x) for x in attr]
        raise self.err(f"unsupported constant attribute {attr}", op)


class _ModuleConverter:
    def __init__(self, module):
        self.module = module
        self.types = _TypeTable()
        self.symbols: dict[str, Any] = {}
        for op in module.body.operations:
            op = op.operation
            n = _sym_name(op)
            if n is not None:
                self.symbols[n] = op
        self.functions: dict[str, dict] = {}
        self.externals: dict[str, dict] = {}
        self.globals: dict[str, dict] = {}
        self.pending: list[str] = []

    def require_function(self, name: str, fc: _FunctionConverter | None):
        if name in self.functions or name in self.externals or name in self.pending:
            return
        op = self.symbols.get(name)
        if op is None or op.name != "llvm.func":
            raise (fc.err if fc else HostIRError)(f"call to unknown function @{name}")
        body = op.regions[0]
        if len(list(body.blocks)) == 0:
            if name not in SUPPORTED_EXTERNALS:
                msg = f"call to unsupported external function @{name}"
                raise fc.err(msg) if fc else HostIRError(msg)
            self.externals[name] = {"type": self.types.add(op.attributes["function_type"].value)}
            return
        self.pending.append(name)

    def require_global(self, name: str, fc: _FunctionConverter):
        if name in self.globals:
            return
        if name == BINARY_GLOBAL:
            raise fc.err(f"host code references @{BINARY_GLOBAL} (the fatbin), which is never serialised")
        op = self.symbols.get(name)
        if op is None:
            raise fc.err(f"reference to unknown symbol @{name}")
        if op.name == "llvm.func":
            raise fc.err(f"taking the address of function @{name} is not supported")
        if op.name != "llvm.mlir.global":
            raise fc.err(f"reference to unsupported symbol @{name} ({op.name})")
        gtype = op.attributes["global_type"].value
        t = self.types.add(gtype)
        enc = self.types.types[t]
        cu_attrs = _attr(op, "cu_attrs")
        if cu_attrs is not None or (name.startswith(KERNEL_HANDLE_PREFIX) and enc == ["ptr", 0]):
            if enc[0] != "ptr":
                raise fc.err(f"kernel handle global @{name} is not a pointer")
            self.globals[name] = {
                "type": t,
                "kind": "kernel_handle",
                "kernel": name[len(KERNEL_HANDLE_PREFIX) :] if name.startswith(KERNEL_HANDLE_PREFIX) else name,
                "cu_attrs": _attr_to_json(cu_attrs) if cu_attrs is not None else {},
            }
            return
        from svdq_loader.hostvm import type_size_align_of_encoding  # pure python, shared layout rules

        size, align = type_size_align_of_encoding(enc)
        value = _attr(op, "value")
        if len(op.regions) and len(list(op.regions[0].blocks)):
            raise fc.err(f"global @{name} has an initializer region, which is not supported")
        data = b""
        if value is not None:
            from cutlass._mlir import ir

            if isinstance(value, ir.StringAttr):
                data = value.value_bytes
            elif isinstance(value, ir.IntegerAttr) and enc[0] == "int":
                data = (int(value.value) & ((1 << enc[1]) - 1)).to_bytes(size, "little")
            else:
                raise fc.err(f"global @{name} has an unsupported initializer {str(value)[:80]}")
        if len(data) > size:
            raise fc.err(f"global @{name} initializer is larger than its type")
        data = data + bytes(size - len(data))
        al = _attr(op, "alignment")
        self.globals[name] = {
            "type": t,
            "kind": "data",
            "constant": "constant" in op.attributes,
            "align": max(int(al.value) if al is not None else 0, align),
            "hex": data.hex(),
        }

    def run(self, entry: str, also=()) -> dict:
        for fname in (entry, LOAD_FUNCTION, *also):
            op = self.symbols.get(fname)
            if op is None or op.name != "llvm.func":
                raise HostIRError(f"function @{fname} not found in the lowered module")
            self.require_function(fname, None)
        while self.pending:
            fname = self.pending.pop()
            if fname in self.functions:
                continue
            self.functions[fname] = None  # type: ignore[assignment]  # mark in progress
            fc = _FunctionConverter(self, fname, self.symbols[fname])
            self.functions[fname] = fc.convert()
        kernels = sorted(g["kernel"] for g in self.globals.values() if g["kind"] == "kernel_handle")
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "producer": _producer(),
            "entry": entry,
            "load": LOAD_FUNCTION,
            "types": self.types.types,
            "functions": self.functions,
            "externals": self.externals,
            "globals": self.globals,
            "kernels": kernels,
        }


def _producer() -> dict:
    try:
        import cutlass

        return {"cutlass_dsl": getattr(cutlass, "__version__", "unknown")}
    except Exception:  # pragma: no cover
        return {}


def serialize_module(module, entry: str, also=()) -> dict:
    """Serialise ``entry`` + ``cuda_load_to_device`` (+ the functions named in
    ``also``) of a lowered LLVM-dialect module, with everything they reference."""
    ctx = module.context
    with ctx:
        doc = _ModuleConverter(module).run(entry, tuple(also))
    # Validate against the interpreter right away: anything it would refuse
    # must fail the build, not the launch.
    from svdq_loader.hostvm import HostProgram, HostVMError

    try:
        HostProgram.from_dict(doc)
    except HostVMError as e:
        raise HostIRError(f"serialised host program rejected by the interpreter: {e}") from e
    return doc


def serialize_host(compiled) -> dict:
    """Serialise the host side of a ``cute.compile`` result into a JSON-able dict.

    ``compiled.ir_module`` must be the fully lowered (LLVM dialect) module and
    ``compiled.function_name`` the host entry.  Raises :class:`HostIRError`
    for any op, type, global or external call the interpreter does not support.
    """
    module = getattr(compiled, "ir_module", None)
    if module is None:
        raise HostIRError("compiled object has no ir_module (was it compiled with a JIT backend that keeps it?)")
    return serialize_module(module, compiled.function_name)

"""Launch recipes: a host program's launch, folded into data at build time.

For most kernels, what the DSL's host code hands to ``cudaLaunchKernelEx``
depends on the inputs only through pointers (copied into parameter bytes,
plus a constant offset) and through simple integer functions of the scalar
arguments (grid = ceil(m / 128), a stride word = k // 8, ...).  A
:class:`LaunchRecipe` writes exactly that down:

* the kernel symbol; grid, block (3 expressions each) and dynamic SMEM;
* launch attributes and kernel parameters as *blocks*: constant template
  bytes plus *slots*, each writing ``expr`` (or ``pointer + expr``) as a
  little-endian integer of 1, 2, 4 or 8 bytes at an offset;
* where it is valid: a box per scalar argument (``lo <= x <= hi``,
  ``x % multiple_of == 0``), optional guards (``expr <= bound`` /
  ``expr >= bound``) and, per pointer, the alignment it needs and whether
  null pointers were verified.  Outside of that the caller takes the general
  path (the host-program interpreter), which is always correct.

Expressions are a tiny AST of JSON lists, evaluated in Python ints (scalar
arguments are read as signed values of their width; a slot keeps the low
``8 * width`` bits of the result, which equals the host code's wrapping
arithmetic for add/sub/mul/shl)::

    int | ["const", v] | ["arg", i] | [op, a, b]  with op in
      add sub mul floordiv ceildiv min max shl shr and
    | ["clog2", a]      ceil(log2 a), 0 for a <= 1
    | ["fdm_mul", a]    the multiplier of CUTLASS FastDivmod(a):
                        (2**32 * (2**clog2(a) - a)) // a + 1, mod 2**32

Division or FastDivmod by a value <= 0 fails the bind (general path).

Hot path: :meth:`LaunchRecipe.bind` (once per tuple of scalar arguments;
callers cache it) returns a :class:`BoundLaunch` holding the evaluated grid,
block, SMEM, attribute bytes and one parameter arena with a stable
``void*[]``; :meth:`BoundLaunch.patch` then only writes the pointers.

Standard library only (``ctypes`` for the stable addresses).
"""
from __future__ import annotations

import ctypes
import struct
from operator import itemgetter
from typing import Sequence

from .hostvm import LaunchRecord

FORMAT = "svdq-launch-recipe"
FORMAT_VERSION = 1
M64 = (1 << 64) - 1
HIGH = M64 ^ ((1 << 48) - 1)  # bits no device/host pointer has: such a value goes the general path
WIDTHS = (1, 2, 4, 8)
_ARENA_ALIGN = 8  # parameters sit 8-aligned in one arena, so 8-byte pointer params are adjacent
_PACK = {1: struct.Struct("<B").pack_into, 2: struct.Struct("<H").pack_into,
         4: struct.Struct("<I").pack_into, 8: struct.Struct("<Q").pack_into}
_pack_u64 = _PACK[8]


class RecipeError(ValueError):
    """A launch recipe is malformed (the message names the field)."""


class RecipeEvalError(ArithmeticError):
    """An expression cannot be evaluated for these arguments (e.g. division by zero)."""


# ---------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------

def _clog2(a: int) -> int:
    return (a - 1).bit_length() if a > 1 else 0


def _fdm_mul(a: int) -> int:
    if a <= 0:
        raise RecipeEvalError(f"FastDivmod of {a}")
    return ((1 << 32) * ((1 << _clog2(a)) - a) // a + 1) & 0xFFFFFFFF


def _div(a: int, b: int) -> int:
    if b <= 0:
        raise RecipeEvalError(f"division by {b}")
    return a // b


def _cdiv(a: int, b: int) -> int:
    if b <= 0:
        raise RecipeEvalError(f"division by {b}")
    return -(-a // b)


def _shift(v: int) -> int:
    if not 0 <= v < 64:
        raise RecipeEvalError(f"shift by {v}")
    return v


BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "floordiv": _div,
    "ceildiv": _cdiv,
    "min": min,
    "max": max,
    "shl": lambda a, b: a << _shift(b),
    "shr": lambda a, b: a >> _shift(b),
    "and": lambda a, b: a & b,
}
UNARY = {"clog2": _clog2, "fdm_mul": _fdm_mul}


def check_expr(e, where: str, scalar_args: frozenset | None = None, depth: int = 0) -> None:
    """Raise :class:`RecipeError` unless ``e`` is a well-formed expression."""
    if depth > 32:
        raise RecipeError(f"{where}: expression nested too deeply")
    if isinstance(e, bool):
        raise RecipeError(f"{where}: booleans are not expressions")
    if isinstance(e, int):
        return
    if not isinstance(e, list) or not e or not isinstance(e[0], str):
        raise RecipeError(f"{where}: expected an int or [op, ...], got {e!r}")
    op, rest = e[0], e[1:]
    if op in ("const", "arg"):
        if len(rest) != 1 or not isinstance(rest[0], int) or isinstance(rest[0], bool):
            raise RecipeError(f"{where}: [{op!r}, int] expected, got {e!r}")
        if op == "arg" and scalar_args is not None and rest[0] not in scalar_args:
            raise RecipeError(f"{where}: argument {rest[0]} is not a scalar argument of the recipe")
        return
    n = 2 if op in BINARY else 1 if op in UNARY else None
    if n is None:
        raise RecipeError(f"{where}: unknown operator {op!r}")
    if len(rest) != n:
        raise RecipeError(f"{where}: {op!r} takes {n} operand(s), got {len(rest)}")
    for i, a in enumerate(rest):
        check_expr(a, f"{where}[{i + 1}]", scalar_args, depth + 1)


def eval_expr(e, x: Sequence[int]) -> int:
    """Value of expression ``e`` with ``x[i]`` the (signed) value of argument ``i``."""
    if e.__class__ is int:
        return e
    op = e[0]
    if op == "arg":
        return x[e[1]]
    if op == "const":
        return e[1]
    f = BINARY.get(op)
    if f is not None:
        return f(eval_expr(e[1], x), eval_expr(e[2], x))
    return UNARY[op](eval_expr(e[1], x))


def expr_args(e) -> set[int]:
    """The argument indices an expression reads."""
    if isinstance(e, int):
        return set()
    if e[0] == "arg":
        return {e[1]}
    if e[0] == "const":
        return set()
    out = set()
    for a in e[1:]:
        out |= expr_args(a)
    return out


def format_expr(e) -> str:
    """Human-readable text of an expression (for messages)."""
    if isinstance(e, int):
        return str(e)
    if e[0] == "arg":
        return f"a{e[1]}"
    if e[0] == "const":
        return str(e[1])
    return f"{e[0]}(" + ", ".join(format_expr(a) for a in e[1:]) + ")"


# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------

class Slot:
    """Write ``expr`` (plus pointer argument ``ptr`` if set) as ``width`` LE bytes at ``offset``."""

    __slots__ = ("offset", "width", "expr", "ptr")

    def __init__(self, offset: int, width: int, expr, ptr: int | None = None):
        self.offset, self.width, self.expr, self.ptr = offset, width, expr, ptr

    def to_dict(self) -> dict:
        d = {"offset": self.offset, "width": self.width, "expr": self.expr}
        if self.ptr is not None:
            d["ptr"] = self.ptr
        return d

    def __eq__(self, other):
        return isinstance(other, Slot) and self.to_dict() == other.to_dict()

    def __repr__(self):
        p = f"a{self.ptr} + " if self.ptr is not None else ""
        return f"Slot(@{self.offset}:u{8 * self.width} = {p}{format_expr(self.expr)})"


class Block:
    """Constant ``template`` bytes with slots (one kernel parameter or one attribute value)."""

    __slots__ = ("template", "slots", "attr_id")

    def __init__(self, template: bytes, slots: Sequence[Slot] = (), attr_id: int | None = None):
        self.template = bytes(template)
        self.slots = list(slots)
        self.attr_id = attr_id

    def to_dict(self) -> dict:
        d = {"size": len(self.template), "template": self.template.hex(), "slots": [s.to_dict() for s in self.slots]}
        if self.attr_id is not None:
            d = {"id": self.attr_id, **d}
        return d

    def __eq__(self, other):
        return isinstance(other, Block) and self.to_dict() == other.to_dict()

    def fill(self, x: Sequence[int]) -> tuple[bytearray, list[tuple[int, int, int]]]:
        """(bytes with every scalar slot written, [(offset, ptr arg, addend)] for pointer slots)."""
        buf = bytearray(self.template)
        ptrs = []
        for s in self.slots:
            v = eval_expr(s.expr, x)
            if s.ptr is None:
                _PACK[s.width](buf, s.offset, v & ((1 << (8 * s.width)) - 1))
            else:
                ptrs.append((s.offset, s.ptr, v & M64))
        return buf, ptrs


_TOP_KEYS = {"format", "format_version", "kernel", "nargs", "scalars", "pointers", "stream", "nulls_ok",
             "grid", "block", "smem", "attrs", "params", "guards"}


class LaunchRecipe:
    """What one variant's host code launches, as data (see the module docstring)."""

    def __init__(self, *, kernel: str, nargs: int, scalars: list[dict], pointers: list[dict],
                 stream: int | None, nulls_ok: bool, grid: list, block: list, smem, attrs: list[Block],
                 params: list[Block], guards: list[dict] = ()):
        self.kernel = kernel
        self.nargs = nargs
        self.scalars = [dict(s) for s in scalars]      # {"arg", "bits", "lo", "hi", "multiple_of"}
        self.pointers = [dict(p) for p in pointers]    # {"arg", "align"}
        self.stream = stream
        self.nulls_ok = nulls_ok
        self.grid, self.block, self.smem = list(grid), list(block), smem
        self.attrs, self.params = list(attrs), list(params)
        self.guards = [dict(g) for g in guards]        # {"expr", "le"} or {"expr", "ge"}
        self.scalar_args = tuple(s["arg"] for s in self.scalars)
        self.ptr_args = tuple(p["arg"] for p in self.pointers)
        self._validate("recipe")

    # -- serialisation ---------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "kernel": self.kernel, "nargs": self.nargs,
            "scalars": [dict(s) for s in self.scalars], "pointers": [dict(p) for p in self.pointers],
            "stream": self.stream, "nulls_ok": self.nulls_ok,
            "grid": list(self.grid), "block": list(self.block), "smem": self.smem,
            "attrs": [a.to_dict() for a in self.attrs], "params": [p.to_dict() for p in self.params],
            "guards": [dict(g) for g in self.guards],
        }

    @classmethod
    def from_dict(cls, d, source: str = "launch recipe") -> "LaunchRecipe":
        """Parse and strictly validate a recipe dict; :class:`RecipeError` names ``source`` and the field."""
        try:
            if not isinstance(d, dict):
                raise RecipeError("not a dict")
            if d.get("format") != FORMAT:
                raise RecipeError(f"format: expected {FORMAT!r}, got {d.get('format')!r}")
            if d.get("format_version") != FORMAT_VERSION:
                raise RecipeError(f"format_version: {d.get('format_version')!r} is not supported "
                                  f"(this loader reads version {FORMAT_VERSION})")
            extra = set(d) - _TOP_KEYS
            missing = _TOP_KEYS - set(d)
            if extra or missing:
                raise RecipeError(f"keys: unknown {sorted(extra)}, missing {sorted(missing)}")

            def blocks(items, what, is_attr):
                if not isinstance(items, list):
                    raise RecipeError(f"{what}: expected a list")
                out = []
                for i, b in enumerate(items):
                    w = f"{what}[{i}]"
                    keys = {"size", "template", "slots"} | ({"id"} if is_attr else set())
                    if not isinstance(b, dict) or set(b) != keys:
                        raise RecipeError(f"{w}: expected keys {sorted(keys)}")
                    try:
                        tpl = bytes.fromhex(b["template"])
                    except (TypeError, ValueError):
                        raise RecipeError(f"{w}.template: not a hex string") from None
                    if not _is_int(b["size"]) or len(tpl) != b["size"]:
                        raise RecipeError(f"{w}.template: {len(tpl)} bytes, size says {b['size']!r}")
                    if not isinstance(b["slots"], list):
                        raise RecipeError(f"{w}.slots: expected a list")
                    slots = []
                    for j, s in enumerate(b["slots"]):
                        if not isinstance(s, dict) or not {"offset", "width", "expr"} <= set(s) <= {"offset", "width", "expr", "ptr"}:
                            raise RecipeError(f"{w}.slots[{j}]: expected keys offset, width, expr[, ptr]")
                        slots.append(Slot(s["offset"], s["width"], s["expr"], s.get("ptr")))
                    if is_attr and not _is_int(b["id"]):
                        raise RecipeError(f"{w}.id: expected an int")
                    out.append(Block(tpl, slots, b["id"] if is_attr else None))
                return out

            return cls(kernel=d["kernel"], nargs=d["nargs"], scalars=_list(d["scalars"], "scalars"),
                       pointers=_list(d["pointers"], "pointers"), stream=d["stream"], nulls_ok=d["nulls_ok"],
                       grid=_list(d["grid"], "grid"), block=_list(d["block"], "block"), smem=d["smem"],
                       attrs=blocks(d["attrs"], "attrs", True), params=blocks(d["params"], "params", False),
                       guards=_list(d["guards"], "guards"))
        except RecipeError as e:
            raise RecipeError(f"{source}: {e}") from None
        except (TypeError, KeyError, AttributeError) as e:
            raise RecipeError(f"{source}: malformed recipe ({type(e).__name__}: {e})") from None

    def _validate(self, where: str) -> None:
        if not isinstance(self.kernel, str) or not self.kernel:
            raise RecipeError("kernel: expected a non-empty string")
        if not _is_int(self.nargs) or self.nargs < 0:
            raise RecipeError("nargs: expected an int >= 0")
        seen = set()
        for i, s in enumerate(self.scalars):
            if not isinstance(s, dict) or set(s) != {"arg", "bits", "lo", "hi", "multiple_of"}:
                raise RecipeError(f"scalars[{i}]: expected keys arg, bits, lo, hi, multiple_of")
            if not all(_is_int(s[k]) for k in s):
                raise RecipeError(f"scalars[{i}]: every field must be an int")
            if s["bits"] not in (8, 16, 32, 64) or s["lo"] > s["hi"] or s["multiple_of"] < 1:
                raise RecipeError(f"scalars[{i}]: bits must be 8/16/32/64, lo <= hi, multiple_of >= 1")
            seen.add(s["arg"])
        for i, p in enumerate(self.pointers):
            if not isinstance(p, dict) or set(p) != {"arg", "align"} or not all(_is_int(v) for v in p.values()):
                raise RecipeError(f"pointers[{i}]: expected int fields arg, align")
            if p["align"] not in (1, 2, 4, 8, 16, 32, 64, 128):
                raise RecipeError(f"pointers[{i}].align: {p['align']} is not a power of two <= 128")
            if p["arg"] in seen:
                raise RecipeError(f"pointers[{i}].arg: argument {p['arg']} listed twice")
            seen.add(p["arg"])
        if seen != set(range(self.nargs)):
            raise RecipeError(f"scalars/pointers: must list each of the {self.nargs} arguments exactly once")
        if self.stream is not None and self.stream not in self.ptr_args:
            raise RecipeError("stream: must be null or a pointer argument")
        if not isinstance(self.nulls_ok, bool):
            raise RecipeError("nulls_ok: expected a bool")
        sargs = frozenset(self.scalar_args)
        for name in ("grid", "block"):
            v = getattr(self, name)
            if len(v) != 3:
                raise RecipeError(f"{name}: expected 3 expressions")
            for i, e in enumerate(v):
                check_expr(e, f"{name}[{i}]", sargs)
        check_expr(self.smem, "smem", sargs)
        for what, blocks in (("attrs", self.attrs), ("params", self.params)):
            for i, b in enumerate(blocks):
                w = f"{what}[{i}]"
                if what == "attrs" and len(b.template) != 64:
                    raise RecipeError(f"{w}.size: an attribute value is 64 bytes")
                used = bytearray(len(b.template))
                for j, s in enumerate(b.slots):
                    ws = f"{w}.slots[{j}]"
                    if not _is_int(s.offset) or s.width not in WIDTHS or not _is_int(s.width):
                        raise RecipeError(f"{ws}: offset must be an int, width one of {WIDTHS}")
                    if s.offset < 0 or s.offset + s.width > len(b.template):
                        raise RecipeError(f"{ws}.offset: {s.offset}+{s.width} outside {len(b.template)} bytes")
                    if any(used[s.offset:s.offset + s.width]):
                        raise RecipeError(f"{ws}: overlaps another slot")
                    used[s.offset:s.offset + s.width] = b"\x01" * s.width
                    if s.ptr is not None:
                        if what == "attrs":
                            raise RecipeError(f"{ws}.ptr: pointers cannot go into launch attributes")
                        if s.ptr not in self.ptr_args or s.width != 8:
                            raise RecipeError(f"{ws}.ptr: must name a pointer argument and have width 8")
                    check_expr(s.expr, f"{ws}.expr", sargs)
        for i, g in enumerate(self.guards):
            if not isinstance(g, dict) or len(g) != 2 or "expr" not in g or not ({"le", "ge"} & set(g)):
                raise RecipeError(f"guards[{i}]: expected {{expr, le}} or {{expr, ge}}")
            b = g.get("le", g.get("ge"))
            if not _is_int(b):
                raise RecipeError(f"guards[{i}]: the bound must be an int")
            check_expr(g["expr"], f"guards[{i}].expr", sargs)

    def __eq__(self, other):
        return isinstance(other, LaunchRecipe) and self.to_dict() == other.to_dict()

    # -- evaluation ------------------------------------------------------------
    def arg_values(self, scalars: Sequence[int]) -> list[int] | None:
        """Signed argument vector for ``scalars`` (in :attr:`scalar_args` order), or None outside the domain."""
        x = [0] * self.nargs
        for s, v in zip(self.scalars, scalars):
            bits = s["bits"]
            v = int(v) & ((1 << bits) - 1)
            if v >> (bits - 1):
                v -= 1 << bits
            if not s["lo"] <= v <= s["hi"] or v % s["multiple_of"]:
                return None
            x[s["arg"]] = v
        return x

    def bind(self, scalars: Sequence[int]) -> "BoundLaunch | None":
        """Evaluate everything but the pointers; None where the recipe does not apply (use the general path)."""
        if len(scalars) != len(self.scalars):
            raise ValueError(f"recipe takes {len(self.scalars)} scalar arguments, got {len(scalars)}")
        x = self.arg_values(scalars)
        if x is None:
            return None
        try:
            for g in self.guards:
                v = eval_expr(g["expr"], x)
                if ("le" in g and v > g["le"]) or ("ge" in g and v < g["ge"]):
                    return None
            grid = tuple(eval_expr(e, x) for e in self.grid)
            block = tuple(eval_expr(e, x) for e in self.block)
            smem = eval_expr(self.smem, x)
            if not all(0 <= v < 1 << 32 for v in (*grid, *block, smem)):
                return None
            attrs = [(a.attr_id, bytes(a.fill(x)[0])) for a in self.attrs]
            params = [p.fill(x) for p in self.params]
        except RecipeEvalError:
            return None
        return BoundLaunch(self, grid, block, smem, attrs, params)


class BoundLaunch:
    """A recipe evaluated for one tuple of scalars: everything but the pointers.

    ``patch(p)`` writes the pointer values ``p`` (a tuple in the recipe's
    :attr:`LaunchRecipe.ptr_args` order) into the parameter arena, whose
    ``void*[]`` lives at :attr:`kernel_params_address` for the object's
    lifetime.  ``usable(p)`` says whether those pointers may be patched in
    (alignment, range, nulls) -- if not, take the general path.
    """

    __slots__ = ("kernel", "grid", "block", "smem", "attrs", "sizes", "offsets", "arena", "stream_pos",
                 "pmask", "nonnull", "_runs", "_adds", "_keep", "kernel_params_address", "__weakref__")

    def __init__(self, recipe: LaunchRecipe, grid, block, smem, attrs, params):
        self.kernel = recipe.kernel
        self.grid, self.block, self.smem, self.attrs = grid, block, smem, attrs
        pos = {a: i for i, a in enumerate(recipe.ptr_args)}
        self.stream_pos = pos.get(recipe.stream) if recipe.stream is not None else None
        self.pmask = tuple(HIGH | (p["align"] - 1) for p in recipe.pointers)
        self.nonnull = () if recipe.nulls_ok else tuple(i for i, a in enumerate(recipe.ptr_args) if a != recipe.stream)
        # one arena for all parameters
        self.sizes = [len(b) for b, _ in params]
        self.offsets, off = [], 0
        for n in self.sizes:
            self.offsets.append(off)
            off += -(-max(n, 1) // _ARENA_ALIGN) * _ARENA_ALIGN
        self.arena = bytearray(max(off, 1))
        slots = []  # (arena offset, pointer position, addend)
        for (buf, ptrs), base in zip(params, self.offsets):
            self.arena[base:base + len(buf)] = buf
            slots += [(base + o, pos[a], c) for o, a, c in ptrs]
        # adjacent pointer slots with addend 0 become one struct.pack_into
        slots.sort()
        plain = [s for s in slots if s[2] == 0]
        self._adds = tuple(s for s in slots if s[2] != 0)
        runs, run = [], []
        for s in plain:
            if run and s[0] != run[-1][0] + 8:
                runs.append(run)
                run = []
            run.append(s)
        if run:
            runs.append(run)
        self._runs = tuple((struct.Struct(f"<{len(r)}Q").pack_into, r[0][0], _getter([i for _, i, _ in r]))
                           for r in runs)
        carr = (ctypes.c_char * len(self.arena)).from_buffer(self.arena)
        base = ctypes.addressof(carr)
        vp = (ctypes.c_void_p * max(len(self.sizes), 1))(*[base + o for o in self.offsets])
        self._keep = (carr, vp)
        self.kernel_params_address = ctypes.addressof(vp)

    def usable(self, p: Sequence[int]) -> bool:
        for v, m in zip(p, self.pmask):
            if v & m:
                return False
        for i in self.nonnull:
            if not p[i]:
                return False
        return True

    def patch(self, p: Sequence[int]) -> None:
        """Write the pointers ``p`` into the arena (the caller has checked :meth:`usable`)."""
        arena = self.arena
        for pack, off, get in self._runs:
            pack(arena, off, *get(p))
        for off, i, c in self._adds:
            _pack_u64(arena, off, (p[i] + c) & M64)

    def params(self) -> list[bytes]:
        return [bytes(self.arena[o:o + n]) for o, n in zip(self.offsets, self.sizes)]

    def record(self, p: Sequence[int]) -> LaunchRecord:
        """Patch ``p`` and return the launch as a :class:`LaunchRecord` (tests, debugging)."""
        self.patch(p)
        stream = p[self.stream_pos] if self.stream_pos is not None else 0
        return LaunchRecord(self.kernel, self.grid, self.block, self.smem, stream, list(self.attrs), self.params())


def _getter(idx: list[int]):
    if len(idx) == 1:
        i = idx[0]
        return lambda p: (p[i],)
    return itemgetter(*idx)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list(v, what: str) -> list:
    if not isinstance(v, list):
        raise RecipeError(f"{what}: expected a list")
    return v


__all__ = ["FORMAT", "FORMAT_VERSION", "BoundLaunch", "Block", "LaunchRecipe", "RecipeError", "RecipeEvalError",
           "Slot", "check_expr", "eval_expr", "expr_args", "format_expr"]

"""Build configuration: YAML -> frozen, validated `Config`.

Schema (every key required but ``compute``, no others allowed)::

    name: flux                     # [A-Za-z0-9][A-Za-z0-9_.-]*
    archs: [sm_90a, sm_100a]       # archs some kernel family builds (svdq_kernels.registry)
    out_dtypes: [bf16, fp16]       # model dtypes: GEMM output / activation dtype
    ranks: [0, 16, 32]             # LoRA ranks: integers >= 0, multiples of 16
    wcscale: [true]                # GEMM: build with the per-column scale (a call without one passes ones);
    bias: [true]                   #   [true, false] adds variants specialised for calls without it
    shapes:                        # named (K, N) linear shapes the build must cover
      qkv: {k: 3072, n: 9216}
    compute: [exact, fp8]          # optional: the GEMM's compute modes (default: as the sections say)
    variants:                      # per arch: the operators to build, each with its family's axes
      sm_90a:
        gemm_w4a4:
          tiles: [[128, 128, 64]]  # family-specific keys (see the family's config_axes)
          stages: [auto]
        quantize_act: {}           # {} = the family's defaults
      sm_100a:
        quantize_act: {}

``compute`` is the one optional key: the GEMM compute modes the build provides (`GEMM_OP_BY_COMPUTE`).
It must list ``exact`` (the operator as stated, every call's default); ``fp8`` adds the FP8-compute GEMM
(``gemm_w4a4_fp8: {}``, the family's measured default forms, and its ``act_fp8`` pre-pass) on every arch that
lists ``gemm_w4a4`` and has a family for it (sm_90a), unless the arch's section names those operators itself.
A config that names ``compute`` without a mode may not hold that mode's operator section.  Without ``compute``
the sections alone decide, and ``Config.compute`` says which modes they build.

Lists must be non-empty and free of duplicates.  Operators are a
first-class axis: each arch lists the ops it builds, and every (op, arch)
must have a registered kernel family.  The feature knobs of each op come
from the top-level keys (the op spec says which); `quantize_act` builds one
variant per (out_dtype, rank) and its scale layout follows the arch.

Validation happens in two steps: `load_config` checks the structure (no
kernel family imported), `svdq_aot.variants.check_sections` asks each family about its own
section (imports the DSL).  Which knob combinations can be built, and which
shapes they cover, is decided later by the families and the op specs.

Every problem raises `ConfigError` naming the file, the key path, the value
and the rule; all problems found are reported together.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from svdq_loader.ops.layouts import GEMM_OP_BY_COMPUTE

KNOWN_DTYPES = ("fp16", "bf16")
#: Archs people may ask for that have no kernel family yet.
_FUTURE_ARCHS: tuple[str, ...] = ()   # archs named in the docs that no family builds yet
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHAPE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOP_KEYS = ("name", "archs", "out_dtypes", "ranks", "wcscale", "bias", "shapes", "variants")
#: top-level keys a config may leave out
_OPTIONAL_KEYS = ("compute",)


class ConfigError(ValueError):
    """An invalid build config.  `problems` lists each one; str() joins them (at most 8 shown)."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        shown = self.problems[:8]
        more = f"; ... and {len(self.problems) - 8} more" if len(self.problems) > 8 else ""
        super().__init__("; ".join(shown) if len(self.problems) == 1
                         else f"{len(self.problems)} problems: " + "; ".join(shown) + more)


@dataclass(frozen=True)
class ShapeSpec:
    name: str
    k: int
    n: int


@dataclass(frozen=True)
class ArchVariants:
    """``variants.<arch>``: the ops to build on `arch`, each with its family's config section."""
    arch: str
    ops: tuple[tuple[str, Any], ...]   # (op, section mapping), in config order


@dataclass(frozen=True)
class Config:
    name: str
    archs: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    ranks: tuple[int, ...]
    wcscale: tuple[bool, ...]
    bias: tuple[bool, ...]
    shapes: tuple[ShapeSpec, ...]
    arch_variants: tuple[ArchVariants, ...]
    #: the GEMM compute modes this build provides (module doc; "exact" first)
    compute: tuple[str, ...] = ("exact",)
    path: str = ""
    sha256: str = ""     # of the YAML file's bytes

    @property
    def variants(self) -> dict[str, ArchVariants]:
        return {a.arch: a for a in self.arch_variants}

    def sections(self, arch: str) -> tuple[tuple[str, Any], ...]:
        """(op, section) pairs configured for `arch`."""
        return self.variants[arch].ops

    @property
    def file_name(self) -> str:
        return Path(self.path).name


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

def load_config(path: str | Path) -> Config:
    p = Path(path)
    src = str(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{src}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{src}: is a directory, expected a YAML config file") from None
    except OSError as e:
        raise ConfigError(f"{src}: cannot read: {e.strerror}") from None
    return parse_config(raw, src, sha256=hashlib.sha256(raw).hexdigest())


def parse_config(text: str | bytes, source: str = "<config>", *, sha256: str | None = None) -> Config:
    if isinstance(text, str):
        text = text.encode()
    if sha256 is None:
        sha256 = hashlib.sha256(text).hexdigest()
    try:
        data = yaml.safe_load(text)
        dupes = _duplicate_keys(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source}: malformed YAML{where}: {what}") from None
    if dupes:
        raise ConfigError([f"{source}: {k}: duplicate key (line {line}); each key may appear once"
                           for k, line in dupes])
    return _Validator(source).config(data, sha256)


def _duplicate_keys(text: bytes) -> list[tuple[str, int]]:
    """Duplicate mapping keys (safe_load silently keeps the last); walks the node tree only."""
    out: list[tuple[str, int]] = []

    def walk(node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                sub = f"{path}.{key}" if path else key
                if key in seen:
                    out.append((sub, k.start_mark.line + 1))
                seen.add(key)
                walk(v, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{path}[{i}]")

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return out


def _show(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 100 else s[:97] + "..."


_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Validator:
    def __init__(self, source: str):
        self.source = source
        self.problems: list[str] = []

    def bad(self, path: str, value: Any, rule: str) -> None:
        shown = "" if value is _MISSING else f" {_show(value)}:"
        self.problems.append(f"{self.source}: {path}:{shown} {rule}")

    def fail_now(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)

    # -- generic helpers ---------------------------------------------------
    def mapping(self, data: Any, path: str, required: tuple[str, ...], what: str,
                optional: tuple[str, ...] = ()) -> dict | None:
        if not isinstance(data, dict):
            self.bad(path, data, f"expected a mapping ({what})")
            return None
        for k in data:
            if k not in required + optional:
                self.bad(f"{path}.{k}" if path else str(k), data[k],
                         f"unknown key (allowed: {', '.join(required + optional)})")
        for k in required:
            if k not in data:
                self.bad(f"{path}.{k}" if path else k, _MISSING, "missing key")
        return data

    def nonempty_list(self, data: Any, path: str, what: str) -> list | None:
        if not isinstance(data, list):
            self.bad(path, data, f"expected a list of {what}")
            return None
        if not data:
            self.bad(path, data, f"empty list: give at least one {what.rstrip('s')}")
            return None
        return data

    def no_dupes(self, items: list, path: str) -> None:
        seen = []
        for i, x in enumerate(items):
            key = tuple(x) if isinstance(x, list) else x
            # True == 1 in Python; compare with types so [1, true] is not a dupe.
            key = (type(x).__name__, key)
            if key in seen:
                self.bad(f"{path}[{i}]", x, "duplicate value")
            seen.append(key)

    # -- the schema --------------------------------------------------------
    def config(self, data: Any, sha256: str) -> Config:
        if data is None:
            raise ConfigError(f"{self.source}: (top level): empty file: expected a mapping with keys "
                              f"{', '.join(_TOP_KEYS)}")
        if not isinstance(data, dict):
            raise ConfigError(f"{self.source}: (top level): {_show(data)}: expected a mapping with keys "
                              f"{', '.join(_TOP_KEYS)}, got {type(data).__name__}")
        self.mapping(data, "", _TOP_KEYS, "the build config", _OPTIONAL_KEYS)

        name = data.get("name")
        if "name" in data and (not isinstance(name, str) or not _NAME_RE.fullmatch(name)):
            self.bad("name", name, "expected a name of letters, digits, '_', '.', '-' (not starting with a "
                                   "punctuation character)")

        archs = self.archs(data.get("archs")) if "archs" in data else []
        dtypes = self.dtypes(data.get("out_dtypes")) if "out_dtypes" in data else []
        ranks = self.ranks(data.get("ranks")) if "ranks" in data else []
        wcscale = self.bools(data.get("wcscale"), "wcscale") if "wcscale" in data else []
        bias = self.bools(data.get("bias"), "bias") if "bias" in data else []
        shapes = self.shapes(data.get("shapes")) if "shapes" in data else []
        compute = self.compute(data["compute"]) if "compute" in data else None
        raw_archs = data.get("archs") if isinstance(data.get("archs"), list) else []
        arch_vars = self.variants(data.get("variants"), archs, raw_archs) if "variants" in data else []
        if compute is not None:
            arch_vars = self.compute_ops(arch_vars, compute)
        built = {op for av in arch_vars for op, _ in av.ops}
        modes = tuple(compute or (m for m, op in GEMM_OP_BY_COMPUTE.items() if m == "exact" or op in built))
        self.fail_now()
        return Config(name=name, archs=tuple(archs), out_dtypes=tuple(dtypes), ranks=tuple(ranks),
                      wcscale=tuple(wcscale), bias=tuple(bias), shapes=tuple(shapes),
                      arch_variants=tuple(arch_vars), compute=modes, path=self.source, sha256=sha256)

    def compute(self, data: Any) -> list[str] | None:
        lst = self.nonempty_list(data, "compute", "compute modes")
        if lst is None:
            return None
        modes = tuple(GEMM_OP_BY_COMPUTE)
        for i, m in enumerate(lst):
            if not isinstance(m, str) or m not in modes:
                self.bad(f"compute[{i}]", m, f"unknown compute mode; expected one of {', '.join(modes)}")
        self.no_dupes(lst, "compute")
        if "exact" not in lst:
            self.bad("compute", lst, "must list exact: the operator as stated, which every call gets unless its "
                                     "weight was prepared for another mode (fp8 is opt-in beside it)")
        return [m for m in modes if m in lst]

    def compute_ops(self, arch_vars: list[ArchVariants], compute: list[str]) -> list[ArchVariants]:
        """Each arch's operators under the config's ``compute`` (module doc): a mode's GEMM (and its pre-pass) added
        where the arch lists the exact GEMM and has a family for it; a section of a mode left out refused."""
        from svdq_loader.ops import op_spec
        out, built = [], set()
        for av in arch_vars:
            ops = list(av.ops)
            names = [op for op, _ in ops]
            for mode, op in GEMM_OP_BY_COMPUTE.items():
                if op in names and mode not in compute:
                    self.bad(f"variants.{av.arch}.{op}", _MISSING,
                             f"the config's compute {compute} leaves out mode {mode!r}, whose GEMM this is; add "
                             f"{mode} to compute or remove this section")
                if mode in compute and mode != "exact" and builds_mode(mode, av.arch, names):
                    built.add(mode)
                    for extra in (op, op_spec(op).prepass({})):
                        if extra is not None and extra not in names:
                            ops.append((extra, _freeze({})))
                            names.append(extra)
            out.append(ArchVariants(arch=av.arch, ops=tuple(ops)))
        for mode in compute:
            op = GEMM_OP_BY_COMPUTE[mode]
            if mode != "exact" and mode not in built:
                where = sorted(a for o, a in _registered() if o == op)
                self.bad("compute", compute, f"mode {mode!r}: no arch of this config lists gemm_w4a4 and has a "
                                             f"family for {op} (archs with one: {', '.join(where) or 'none'})")
        return out

    def archs(self, data: Any) -> list[str]:
        lst = self.nonempty_list(data, "archs", "arch names")
        if lst is None:
            return []
        known = _known_archs()
        out = []
        for i, a in enumerate(lst):
            if not isinstance(a, str):
                self.bad(f"archs[{i}]", a, "expected an arch name string like 'sm_90a'")
            elif a not in known:
                hint = (f"{a} has no kernel family yet" if a in _FUTURE_ARCHS else "unknown arch")
                self.bad(f"archs[{i}]", a, f"{hint}; archs with a kernel family: "
                                            f"{', '.join(known) or 'none (svdq_kernels.registry not importable)'}")
            else:
                out.append(a)
        self.no_dupes(lst, "archs")
        return out

    def dtypes(self, data: Any) -> list[str]:
        lst = self.nonempty_list(data, "out_dtypes", "output dtypes")
        if lst is None:
            return []
        for i, d in enumerate(lst):
            if d not in KNOWN_DTYPES or not isinstance(d, str):
                self.bad(f"out_dtypes[{i}]", d, f"unknown dtype; expected one of {', '.join(KNOWN_DTYPES)}")
        self.no_dupes(lst, "out_dtypes")
        return list(lst)

    def ranks(self, data: Any) -> list[int]:
        lst = self.nonempty_list(data, "ranks", "LoRA ranks")
        if lst is None:
            return []
        for i, r in enumerate(lst):
            if not _is_int(r):
                self.bad(f"ranks[{i}]", r, "expected an integer LoRA rank (0 = no LoRA)")
            elif r < 0:
                self.bad(f"ranks[{i}]", r, "LoRA rank must not be negative")
            elif r % 16:
                self.bad(f"ranks[{i}]", r, "LoRA rank must be a multiple of 16")
        self.no_dupes(lst, "ranks")
        return list(lst)

    def bools(self, data: Any, key: str) -> list[bool]:
        lst = self.nonempty_list(data, key, "true/false values")
        if lst is None:
            return []
        for i, b in enumerate(lst):
            if not isinstance(b, bool):
                self.bad(f"{key}[{i}]", b, "expected true or false")
        self.no_dupes(lst, key)
        return list(lst)

    def shapes(self, data: Any) -> list[ShapeSpec]:
        if not isinstance(data, dict):
            self.bad("shapes", data, "expected a mapping of shape name -> {k: K, n: N}")
            return []
        if not data:
            self.bad("shapes", data, "empty mapping: give at least one shape")
            return []
        out = []
        for name, spec in data.items():
            path = f"shapes.{name}"
            if not isinstance(name, str) or not _SHAPE_NAME_RE.fullmatch(name):
                self.bad(path, name, "shape names must be identifiers (letters, digits, '_')")
                continue
            m = self.mapping(spec, path, ("k", "n"), "{k: K, n: N}")
            if m is None:
                continue
            ok = True
            for dim in ("k", "n"):
                if dim not in m:
                    ok = False
                    continue
                v = m[dim]
                if not _is_int(v):
                    self.bad(f"{path}.{dim}", v, f"expected a positive integer {dim.upper()}")
                    ok = False
                elif v <= 0:
                    self.bad(f"{path}.{dim}", v, f"{dim.upper()} must be positive")
                    ok = False
            if ok and set(m) == {"k", "n"}:
                out.append(ShapeSpec(name=name, k=m["k"], n=m["n"]))
        return out

    def variants(self, data: Any, archs: list[str], listed: list) -> list[ArchVariants]:
        if not isinstance(data, dict):
            self.bad("variants", data, "expected a mapping of arch -> {op: section}")
            return []
        registered = _registered()
        out = []
        for arch in data:
            if arch not in listed:
                self.bad(f"variants.{arch}", data[arch],
                         f"arch is not listed in archs ({', '.join(map(str, listed)) or 'none'}); "
                         f"add it there or remove this entry")
        for arch in archs:
            path = f"variants.{arch}"
            if arch not in data:
                self.bad(path, _MISSING, "missing key: every arch in archs needs the operators to build")
                continue
            m = data[arch]
            ops_here = [o for o, a in registered if a == arch]
            if not isinstance(m, dict) or not m:
                self.bad(path, m, f"expected a non-empty mapping of operator -> section "
                                  f"(operators with a family on {arch}: {', '.join(ops_here)})")
                continue
            ops = []
            for op, section in m.items():
                if (op, arch) not in registered:
                    self.bad(f"{path}.{op}", section,
                             f"no kernel family builds operator {op!r} on {arch} "
                             f"(operators with a family on {arch}: {', '.join(ops_here) or 'none'})")
                    continue
                if section is None:
                    section = {}
                if not isinstance(section, dict):
                    self.bad(f"{path}.{op}", section, "expected a mapping of the family's keys ({} for defaults)")
                    continue
                ops.append((op, _freeze(section)))
            out.append(ArchVariants(arch=arch, ops=tuple(ops)))
        return out


class _FrozenDict(dict):
    """A config section: a plain mapping that is hashable (so `Config` stays frozen)."""

    def __hash__(self):  # type: ignore[override]
        return hash(repr(sorted(self.items(), key=lambda kv: str(kv[0]))))


def _freeze(section: dict) -> _FrozenDict:
    return _FrozenDict(section)


def builds_mode(mode: str, arch: str, ops) -> bool:
    """Whether an arch whose section lists the operators `ops` builds compute `mode`'s GEMM under a config's
    ``compute`` (module doc): it lists that GEMM itself, or the mode is not exact, the arch lists the exact GEMM and a
    family builds the mode's operator there.  False for a name that is no mode (the config check says so)."""
    op, exact = GEMM_OP_BY_COMPUTE.get(mode), GEMM_OP_BY_COMPUTE["exact"]
    return op is not None and (op in ops or (op != exact and exact in ops and (op, arch) in _registered()))


def _registered() -> tuple[tuple[str, str], ...]:
    try:
        from svdq_kernels import registry
    except ImportError:
        return ()
    return tuple(registry.FAMILIES)


def _known_archs() -> tuple[str, ...]:
    return tuple(dict.fromkeys(a for _, a in _registered()))

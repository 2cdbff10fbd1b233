"""Build configuration: YAML -> frozen, fully validated `Config`.

Schema (every key required, no others allowed)::

    name: flux                     # [A-Za-z0-9][A-Za-z0-9_.-]*
    archs: [sm_90a]                # archs with a kernel family (svdq_kernels.registry)
    out_dtypes: [bf16, fp16]       # subset of fp16, bf16
    ranks: [0, 16, 32]             # LoRA ranks: integers >= 0, multiples of 16
    wcscale: [true, false]         # which on/off settings to build
    bias: [true, false]
    shapes:                        # named (K, N) linear shapes the build must cover
      qkv: {k: 3072, n: 9216}
    variants:                      # per-arch variant axes, one entry per arch in `archs`
      sm_90a:
        tiles: [[128, 128, 64]]    # [tile_m, tile_n, tile_k], positive integers
        clusters: [[1, 1]]         # [cluster_m, cluster_n], positive integers
        stages: [auto]             # positive integers or "auto" (the family default)

Lists must be non-empty and free of duplicates.  Every shape must have
N % tile_n == 0 and K % tile_k == 0 for at least one tile of every arch.
Whether a knob combination can actually be built is the kernel family's
call (`Variant.invalid_reason`), not the config's.

Every problem raises `ConfigError` naming the file, the key path, the value
and the rule; all problems found are reported together on one line.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

KNOWN_DTYPES = ("fp16", "bf16")
#: Archs people may ask for that have no kernel family yet.
_FUTURE_ARCHS = ("sm_100a", "sm_103a", "sm_120a")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHAPE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOP_KEYS = ("name", "archs", "out_dtypes", "ranks", "wcscale", "bias", "shapes", "variants")
_ARCH_KEYS = ("tiles", "clusters", "stages")

Stage = Union[int, str]  # int >= 1 or "auto"


class ConfigError(ValueError):
    """An invalid build config.  `problems` lists each one; str() joins them on one line."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems) if len(self.problems) == 1
                         else f"{len(self.problems)} problems: " + "; ".join(self.problems))


@dataclass(frozen=True)
class ShapeSpec:
    name: str
    k: int
    n: int


@dataclass(frozen=True)
class ArchVariants:
    arch: str
    tiles: tuple[tuple[int, int, int], ...]
    clusters: tuple[tuple[int, int], ...]
    stages: tuple[Stage, ...]


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
    path: str = ""
    sha256: str = ""     # of the YAML file's bytes

    @property
    def variants(self) -> dict[str, ArchVariants]:
        return {a.arch: a for a in self.arch_variants}

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
    def mapping(self, data: Any, path: str, required: tuple[str, ...], what: str) -> dict | None:
        if not isinstance(data, dict):
            self.bad(path, data, f"expected a mapping ({what})")
            return None
        for k in data:
            if k not in required:
                self.bad(f"{path}.{k}" if path else str(k), data[k],
                         f"unknown key (allowed: {', '.join(required)})")
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
        self.mapping(data, "", _TOP_KEYS, "the build config")

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
        raw_archs = data.get("archs") if isinstance(data.get("archs"), list) else []
        arch_vars = self.variants(data.get("variants"), archs, raw_archs) if "variants" in data else []
        self.fail_now()
        self.coverage(shapes, arch_vars)
        self.fail_now()
        return Config(name=name, archs=tuple(archs), out_dtypes=tuple(dtypes), ranks=tuple(ranks),
                      wcscale=tuple(wcscale), bias=tuple(bias), shapes=tuple(shapes),
                      arch_variants=tuple(arch_vars), path=self.source, sha256=sha256)

    def archs(self, data: Any) -> list[str]:
        lst = self.nonempty_list(data, "archs", "arch names")
        if lst is None:
            return []
        from .variants import known_archs
        known = known_archs()
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
            self.bad("variants", data, "expected a mapping of arch -> {tiles, clusters, stages}")
            return []
        out = []
        for arch in data:
            if arch not in listed:
                self.bad(f"variants.{arch}", data[arch],
                         f"arch is not listed in archs ({', '.join(map(str, listed)) or 'none'}); "
                         f"add it there or remove this entry")
        for arch in archs:
            path = f"variants.{arch}"
            if arch not in data:
                self.bad(path, _MISSING, "missing key: every arch in archs needs its variant axes")
                continue
            m = self.mapping(data[arch], path, _ARCH_KEYS, "tiles, clusters, stages")
            if m is None:
                continue
            tiles = self.int_tuples(m.get("tiles"), f"{path}.tiles", 3, "[tile_m, tile_n, tile_k]") \
                if "tiles" in m else []
            clusters = self.int_tuples(m.get("clusters"), f"{path}.clusters", 2, "[cluster_m, cluster_n]") \
                if "clusters" in m else []
            stages = self.stages(m.get("stages"), f"{path}.stages") if "stages" in m else []
            out.append(ArchVariants(arch=arch, tiles=tuple(tiles), clusters=tuple(clusters),
                                    stages=tuple(stages)))
        return out

    def int_tuples(self, data: Any, path: str, n: int, what: str) -> list[tuple]:
        lst = self.nonempty_list(data, path, f"{what} lists")
        if lst is None:
            return []
        out = []
        for i, t in enumerate(lst):
            if not (isinstance(t, list) and len(t) == n and all(_is_int(x) and x > 0 for x in t)):
                self.bad(f"{path}[{i}]", t, f"expected {what}: a list of {n} positive integers")
            else:
                out.append(tuple(t))
        self.no_dupes(lst, path)
        return out

    def stages(self, data: Any, path: str) -> list[Stage]:
        lst = self.nonempty_list(data, path, "stage counts")
        if lst is None:
            return []
        for i, s in enumerate(lst):
            if s == "auto" and isinstance(s, str):
                continue
            if not _is_int(s) or s < 1:
                self.bad(f"{path}[{i}]", s, "expected a positive integer stage count or 'auto'")
        self.no_dupes(lst, path)
        return list(lst)

    def coverage(self, shapes: list[ShapeSpec], arch_vars: list[ArchVariants]) -> None:
        for av in arch_vars:
            for s in shapes:
                if not any(s.n % tn == 0 and s.k % tk == 0 for (_, tn, tk) in av.tiles):
                    tiles = [list(t) for t in av.tiles]
                    self.bad(f"shapes.{s.name}", {"k": s.k, "n": s.n},
                             f"shape {s.name} (K={s.k}, N={s.n}) is not served by any tile of "
                             f"variants.{av.arch}.tiles {tiles}: needs N % tile_n == 0 and K % tile_k == 0")

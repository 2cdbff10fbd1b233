"""The artifact manifest: typed records, JSON (de)serialisation, validation, checksum.

Pure Python, standard library only.  The runtime imports this with no DSL,
no torch and no CUDA installed; the builder (`svdq_aot`) imports it to write.

Reading is strict: every key is type-checked, unknown and missing keys are
errors, and every error names the file, the key path and the value found.
The manifest carries a SHA-256 over its own canonical body (``checksum``),
so an edit of ``manifest.json`` itself is refused; `svdq_loader.artifacts`
then checks every file's hash and cross-checks each variant's facts against
the bytes they describe.

Layout of ``manifest.json`` (schema_version 3; 2 is still read, without
``selection`` and ``requires``)::

    {"schema_version": 3,
     "checksum": sha256 of the canonical JSON of everything else,
     "generator": {"package", "package_version", "dsl", "dsl_version", "python", "device_facts" (optional),
                   "kernel_switches" (only in builds made with SVDQ_KERNEL_* switches)},
     "config": {"name", "sha256", "file"},
     "shapes": [{"name", "k", "n"}],
     "variants": [{"name", "op", "arch", "family", "knobs": {knob: bool|int|str, ...},
                   "requirements": {name: int}, "cubin", "sha256", "size",
                   "host_program": {"file", "sha256"}, "entry", "kernel_symbols",
                   "params": {symbol: [{"index", "offset", "size"}]},
                   "host_args": [[name, kind]], "smem_bytes",
                   "resources": {symbol: {"registers", "stack_frame_bytes", "static_smem"}},
                   "launch_recipe": {...} | null}],
     "rejected": [{"name", "reason"}],
     "selection": [{"op", "arch", "family", "buckets": [...]}],   (svdq_loader.select_rules)
     "requires": {"cuda_driver": {arch: CUDA version the driver must support, e.g. 12080 = 12.8}}}
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from ._version import __version__ as LOADER_VERSION
from .select_rules import Rule, RuleError, parse_rule

SCHEMA_VERSION = 3
#: Schema versions this reader understands (2: no selection rules, no driver requirement).
READABLE_SCHEMA_VERSIONS = (2, 3)
MANIFEST_NAME = "manifest.json"
GENERATOR_PACKAGE = "svdq-aot"

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# A plain file name inside the artifact directory: no separators, no leading
# dot (hidden / "." / ".."), no ".." anywhere, printable ASCII subset only.
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


class ArtifactError(Exception):
    """Base class: something is wrong with an artifact directory."""


class ManifestError(ArtifactError, ValueError):
    """The manifest is missing, malformed, of an unknown schema, or from an incompatible builder."""


class ArtifactIntegrityError(ArtifactError):
    """A file named by the manifest is missing, outside the directory, or has the wrong hash/size."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems or [message])


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Generator:
    package: str
    package_version: str
    dsl: str
    dsl_version: str
    python: str
    #: What of a device the kernels depend on, and where it comes from: every build records that no GPU was
    #: queried (the SM count, SMEM limits and clocks are read on the target at load/launch).  Optional in
    #: schema 3 (absent in artifacts written before it existed).
    device_facts: str = ""
    #: The ``SVDQ_KERNEL_*`` build switches an experiment or diagnosis build was made with ("NAME=value, ..."):
    #: its kernels are not the ones a plain build of the config makes.  Present only in such builds.
    kernel_switches: str = ""


_OPTIONAL_GENERATOR_KEYS = ("device_facts", "kernel_switches")


@dataclass(frozen=True)
class ConfigRef:
    name: str
    sha256: str   # of the YAML file's bytes
    file: str     # base name of the YAML file


@dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int


@dataclass(frozen=True)
class HostProgram:
    file: str
    sha256: str


class ParamInfo(NamedTuple):
    """One kernel parameter as the cubin's EIATTR_KPARAM_INFO records it."""
    index: int
    offset: int
    size: int


@dataclass(frozen=True)
class Resources:
    """Per kernel symbol, as read from the cubin at build time (and cross-checked at load)."""
    registers: int
    stack_frame_bytes: int
    static_smem: int


@dataclass(frozen=True)
class VariantEntry:
    name: str
    op: str
    arch: str
    family: str
    knobs: dict[str, Any]          # op features then family tuning knobs, in order
    requirements: dict[str, int]   # what the op's shape rule reads (n_multiple, k_multiple, ...)
    cubin: str
    sha256: str
    size: int
    host_program: HostProgram
    entry: str
    kernel_symbols: tuple[str, ...]
    params: dict[str, tuple[ParamInfo, ...]]
    host_args: tuple[tuple[str, str], ...]
    smem_bytes: int
    resources: dict[str, Resources]
    launch_recipe: dict | None = None

    def __hash__(self) -> int:
        return hash((self.name, self.sha256))


@dataclass(frozen=True)
class RejectedEntry:
    name: str
    reason: str


@dataclass(frozen=True)
class Manifest:
    generator: Generator
    config: ConfigRef
    shapes: tuple[Shape, ...]
    variants: tuple[VariantEntry, ...]
    rejected: tuple[RejectedEntry, ...] = ()
    schema_version: int = SCHEMA_VERSION
    source: str = field(default=MANIFEST_NAME, compare=False, repr=False)
    selection: tuple[Rule, ...] = ()                       # schema 3: one rule per (op, arch, family) built
    cuda_driver: dict[str, int] = field(default_factory=dict)  # schema 3: arch -> CUDA version needed (12080)

    @property
    def rules(self) -> dict[tuple[str, str, str], Rule]:
        return {(r.op, r.arch, r.family): r for r in self.selection}

    # -- lookup -------------------------------------------------------------
    def variant(self, name: str) -> VariantEntry:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant named {name!r} in {self.source}")

    def files(self) -> list[tuple[str, str, int | None]]:
        """Every (file name, sha256, size or None) the manifest references."""
        out: list[tuple[str, str, int | None]] = []
        for v in self.variants:
            out.append((v.cubin, v.sha256, v.size))
            out.append((v.host_program.file, v.host_program.sha256, None))
        return out

    # -- serialisation ----------------------------------------------------
    def body(self) -> dict[str, Any]:
        """Everything but the checksum (what the checksum covers)."""
        return {
            "schema_version": self.schema_version,
            "generator": {k: v for k, v in _plain(self.generator).items() if k not in _OPTIONAL_GENERATOR_KEYS or v},
            "config": _plain(self.config),
            "shapes": [_plain(s) for s in self.shapes],
            "variants": [_variant_to_dict(v) for v in self.variants],
            "rejected": [_plain(r) for r in self.rejected],
            **({} if self.schema_version < 3 else {
                "selection": [r.to_dict() for r in self.selection],
                "requires": {"cuda_driver": dict(self.cuda_driver)}}),
        }

    def to_dict(self) -> dict[str, Any]:
        body = self.body()
        return {"schema_version": body.pop("schema_version"), "checksum": body_checksum(self.body()), **body}

    def to_json(self) -> str:
        """Deterministic JSON text (stable key order, trailing newline)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = MANIFEST_NAME) -> "Manifest":
        return _parse_manifest(data, source)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = MANIFEST_NAME) -> "Manifest":
        return _parse_manifest(_loads(text, source), source)


def _plain(obj) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}


def body_checksum(body: dict) -> str:
    """SHA-256 of the canonical JSON of a manifest body (sorted keys, no spaces, ASCII)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _variant_to_dict(v: VariantEntry) -> dict[str, Any]:
    return {
        "name": v.name,
        "op": v.op,
        "arch": v.arch,
        "family": v.family,
        "knobs": dict(v.knobs),
        "requirements": dict(v.requirements),
        "cubin": v.cubin,
        "sha256": v.sha256,
        "size": v.size,
        "host_program": _plain(v.host_program),
        "entry": v.entry,
        "kernel_symbols": list(v.kernel_symbols),
        "params": {sym: [p._asdict() for p in ps] for sym, ps in v.params.items()},
        "host_args": [list(a) for a in v.host_args],
        "smem_bytes": v.smem_bytes,
        "resources": {sym: _plain(r) for sym, r in v.resources.items()},
        "launch_recipe": v.launch_recipe,
    }


# --------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------

def _loads(text: str | bytes, source: str) -> Any:
    def no_dupes(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise ManifestError(f"{source}: duplicate key {k!r} in a JSON object")
            out[k] = v
        return out

    def no_constants(name):
        raise ManifestError(f"{source}: non-finite number {name} is not allowed")

    try:
        return json.loads(text, object_pairs_hook=no_dupes, parse_constant=no_constants)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{source}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ManifestError(f"{source}: not UTF-8 text ({e.reason})") from None


class _Ctx:
    """Error helper: every message names the file, the key path and the value."""

    schema_text = f"schema_version {SCHEMA_VERSION}"     # named in unknown-key messages

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, value: Any, rule: str) -> ManifestError:
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        return ManifestError(f"{self.source}: {path}: {shown}: {rule}")

    def obj(self, data: Any, path: str, keys: Iterable[str]) -> dict:
        keys = tuple(keys)
        if not isinstance(data, dict):
            raise self.fail(path, data, f"expected an object with keys {list(keys)}")
        missing = [k for k in keys if k not in data]
        if missing:
            raise self.fail(path, sorted(data), f"missing key(s) {missing}")
        unknown = [k for k in data if k not in keys]
        if unknown:
            raise self.fail(f"{path}.{unknown[0]}", data[unknown[0]],
                            f"unknown key ({self.schema_text} allows {list(keys)})")
        return data

    def int_(self, data: dict, key: str, path: str, minimum: int = 0) -> int:
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"{path}.{key}", v, "expected an integer")
        if v < minimum:
            raise self.fail(f"{path}.{key}", v, f"must be >= {minimum}")
        return v

    def bool_(self, data: dict, key: str, path: str) -> bool:
        v = data[key]
        if not isinstance(v, bool):
            raise self.fail(f"{path}.{key}", v, "expected true or false")
        return v

    def str_(self, data: dict, key: str, path: str) -> str:
        v = data[key]
        if not isinstance(v, str) or not v:
            raise self.fail(f"{path}.{key}", v, "expected a non-empty string")
        return v

    def sha_(self, data: dict, key: str, path: str) -> str:
        v = data[key]
        if not isinstance(v, str) or not _SHA256_RE.fullmatch(v):
            raise self.fail(f"{path}.{key}", v, "expected a SHA-256 as 64 lowercase hex digits")
        return v

    def file_(self, data: dict, key: str, path: str) -> str:
        v = data[key]
        if not isinstance(v, str) or not _FILE_RE.fullmatch(v) or ".." in v:
            raise self.fail(f"{path}.{key}", v,
                            "expected a plain file name inside the artifact directory "
                            "(no '/', '\\', '..', leading '.', or unusual characters)")
        return v

    def list_(self, data: dict, key: str, path: str) -> list:
        v = data[key]
        if not isinstance(v, list):
            raise self.fail(f"{path}.{key}", v, "expected a list")
        return v


_VARIANT_KEYS = ("name", "op", "arch", "family", "knobs", "requirements", "cubin", "sha256", "size",
                 "host_program", "entry", "kernel_symbols", "params", "host_args", "smem_bytes", "resources",
                 "launch_recipe")


def _parse_manifest(data: Any, source: str) -> Manifest:
    c = _Ctx(source)
    if not isinstance(data, dict):
        raise c.fail("(top level)", type(data).__name__, "expected a JSON object")
    if "schema_version" not in data:
        raise c.fail("(top level)", sorted(data), "missing key 'schema_version'")
    sv = data["schema_version"]
    if isinstance(sv, bool) or not isinstance(sv, int) or sv not in READABLE_SCHEMA_VERSIONS:
        readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
        raise ManifestError(
            f"{source}: schema_version {sv!r}: these artifacts use manifest schema {sv!r} but this loader "
            f"(svdq_loader {LOADER_VERSION}) reads schema {readable}; rebuild the artifacts with "
            f"svdq-aot {LOADER_VERSION} (or install the loader that matches them)")
    top = ("schema_version", "checksum", "generator", "config", "shapes", "variants", "rejected")
    c.obj(data, "(top level)", top + (("selection", "requires") if sv >= 3 else ()))
    want = c.sha_(data, "checksum", "(top level)")
    got = body_checksum({k: v for k, v in data.items() if k != "checksum"})
    if got != want:
        raise ManifestError(
            f"{source}: checksum mismatch: the manifest says {want} but its content hashes to {got}; "
            f"manifest.json was edited or damaged after the build. Rebuild the artifacts (or re-copy them); "
            f"never edit manifest.json by hand")

    gkeys = [k for k in Generator.__dataclass_fields__ if k not in _OPTIONAL_GENERATOR_KEYS or k in
             (data["generator"] if isinstance(data["generator"], dict) else {})]
    g = c.obj(data["generator"], "generator", gkeys)
    gen = Generator(**{k: c.str_(g, k, "generator") for k in gkeys})
    _check_generator(gen, source)

    cf = c.obj(data["config"], "config", ("name", "sha256", "file"))
    config = ConfigRef(name=c.str_(cf, "name", "config"), sha256=c.sha_(cf, "sha256", "config"),
                       file=c.str_(cf, "file", "config"))

    shapes = []
    for i, s in enumerate(c.list_(data, "shapes", "(top level)")):
        p = f"shapes[{i}]"
        s = c.obj(s, p, ("name", "k", "n"))
        shapes.append(Shape(name=c.str_(s, "name", p), k=c.int_(s, "k", p, 1), n=c.int_(s, "n", p, 1)))

    variants = []
    names: dict[str, str] = {}
    files: dict[str, str] = {}
    for i, v in enumerate(c.list_(data, "variants", "(top level)")):
        entry = _parse_variant(c, v, f"variants[{i}]")
        p = f"variants[{i}]"
        if entry.name in names:
            raise c.fail(f"{p}.name", entry.name, f"duplicate variant name (also {names[entry.name]})")
        names[entry.name] = p
        for key, fname in (("cubin", entry.cubin), ("host_program.file", entry.host_program.file)):
            if fname == MANIFEST_NAME:
                raise c.fail(f"{p}.{key}", fname, "an artifact may not be named like the manifest")
            if fname in files:
                raise c.fail(f"{p}.{key}", fname, f"file already referenced by {files[fname]}")
            files[fname] = f"{p}.{key}"
        variants.append(entry)

    rejected = []
    for i, r in enumerate(c.list_(data, "rejected", "(top level)")):
        p = f"rejected[{i}]"
        r = c.obj(r, p, ("name", "reason"))
        rejected.append(RejectedEntry(name=c.str_(r, "name", p), reason=c.str_(r, "reason", p)))

    selection, cuda_driver = (), {}
    if sv >= 3:
        selection = _parse_selection(c, data["selection"], variants)
        req = c.obj(data["requires"], "requires", ("cuda_driver",))
        drv = req["cuda_driver"]
        if not isinstance(drv, dict):
            raise c.fail("requires.cuda_driver", drv, "expected an object {arch: CUDA version, e.g. 12080}")
        for arch in drv:
            c.int_(drv, arch, "requires.cuda_driver", 1000)
        cuda_driver = dict(drv)
    return Manifest(generator=gen, config=config, shapes=tuple(shapes), variants=tuple(variants),
                    rejected=tuple(rejected), schema_version=sv, source=source, selection=selection,
                    cuda_driver=cuda_driver)


def _parse_selection(c: _Ctx, raw: Any, variants: list) -> tuple[Rule, ...]:
    """The selection rules: well formed, one per (op, arch, family), each naming knobs its variants have."""
    if not isinstance(raw, list):
        raise c.fail("selection", raw, "expected a list of selection rules")
    rules, seen = [], set()
    for i, r in enumerate(raw):
        try:
            rule = parse_rule(r, f"selection[{i}]")
        except RuleError as e:
            raise ManifestError(f"{c.source}: {e}") from None
        key = (rule.op, rule.arch, rule.family)
        if key in seen:
            raise c.fail(f"selection[{i}]", list(key), "a second rule for the same (op, arch, family)")
        seen.add(key)
        mine = [v for v in variants if (v.op, v.arch, v.family) == key]
        for b in rule.buckets:
            for pref in b.prefer:
                for knob in pref.knobs:
                    lacking = [v.name for v in mine if knob not in v.knobs]
                    if lacking:
                        raise c.fail(f"selection[{i}]", knob, f"ranks by a knob variant {lacking[0]} does not have")
        rules.append(rule)
    return tuple(rules)


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def _check_generator(gen: Generator, source: str) -> None:
    if gen.package != GENERATOR_PACKAGE:
        raise ManifestError(f"{source}: generator.package: {gen.package!r}: this loader reads artifacts "
                            f"written by {GENERATOR_PACKAGE!r} only")
    if not re.fullmatch(r"\d+(\.\d+)*([.+-].*)?", gen.package_version):
        raise ManifestError(f"{source}: generator.package_version: {gen.package_version!r}: "
                            f"expected a version like '1.2.3'")
    if _major(gen.package_version) != _major(LOADER_VERSION):
        raise ManifestError(
            f"{source}: generator.package_version: {gen.package_version!r}: artifacts were built by "
            f"svdq-aot {gen.package_version} but this loader is {LOADER_VERSION} (major versions "
            f"{_major(gen.package_version)} vs {_major(LOADER_VERSION)} differ); rebuild the artifacts "
            f"or install a matching loader")


def _parse_variant(c: _Ctx, v: Any, p: str) -> VariantEntry:
    v = c.obj(v, p, _VARIANT_KEYS)
    name = c.str_(v, "name", p)
    p = f"{p} ({name})" if isinstance(name, str) else p

    knobs_raw = v["knobs"]
    if not isinstance(knobs_raw, dict) or not knobs_raw:
        raise c.fail(f"{p}.knobs", knobs_raw, "expected a non-empty object {knob: bool | int | str}")
    for k, x in knobs_raw.items():
        if not isinstance(x, (bool, int, str)):
            raise c.fail(f"{p}.knobs.{k}", x, "knob values must be true/false, integers or strings")
    req_raw = v["requirements"]
    if not isinstance(req_raw, dict):
        raise c.fail(f"{p}.requirements", req_raw, "expected an object {name: positive integer}")
    for k in req_raw:
        c.int_(req_raw, k, f"{p}.requirements", 1)

    hp = c.obj(v["host_program"], f"{p}.host_program", ("file", "sha256"))
    host_program = HostProgram(file=c.file_(hp, "file", f"{p}.host_program"),
                               sha256=c.sha_(hp, "sha256", f"{p}.host_program"))

    symbols = c.list_(v, "kernel_symbols", p)
    if not symbols:
        raise c.fail(f"{p}.kernel_symbols", symbols, "at least one kernel symbol is required")
    for j, s in enumerate(symbols):
        if not isinstance(s, str) or not s:
            raise c.fail(f"{p}.kernel_symbols[{j}]", s, "expected a non-empty string")
    if len(set(symbols)) != len(symbols):
        raise c.fail(f"{p}.kernel_symbols", symbols, "duplicate kernel symbols")

    params_raw = v["params"]
    if not isinstance(params_raw, dict):
        raise c.fail(f"{p}.params", params_raw, "expected an object {kernel symbol: [params]}")
    if set(params_raw) != set(symbols):
        raise c.fail(f"{p}.params", sorted(params_raw),
                     f"must have exactly one entry per kernel symbol {sorted(symbols)}")
    params: dict[str, tuple[ParamInfo, ...]] = {}
    for sym in symbols:
        lst = params_raw[sym]
        sp = f"{p}.params[{sym!r}]"
        if not isinstance(lst, list):
            raise c.fail(sp, lst, "expected a list of {index, offset, size}")
        infos = []
        for j, q in enumerate(lst):
            qp = f"{sp}[{j}]"
            q = c.obj(q, qp, ("index", "offset", "size"))
            infos.append(ParamInfo(c.int_(q, "index", qp), c.int_(q, "offset", qp), c.int_(q, "size", qp, 1)))
        if sorted(i.index for i in infos) != list(range(len(infos))):
            raise c.fail(sp, [i.index for i in infos], "parameter indices must be 0..n-1, each once")
        params[sym] = tuple(infos)

    res_raw = v["resources"]
    if not isinstance(res_raw, dict) or set(res_raw) != set(symbols):
        raise c.fail(f"{p}.resources", res_raw, f"expected one entry per kernel symbol {sorted(symbols)}")
    resources = {}
    for sym in symbols:
        rp = f"{p}.resources[{sym!r}]"
        r = c.obj(res_raw[sym], rp, Resources.__dataclass_fields__)
        resources[sym] = Resources(**{k: c.int_(r, k, rp) for k in Resources.__dataclass_fields__})

    host_args = []
    seen_args = set()
    for j, a in enumerate(c.list_(v, "host_args", p)):
        ap = f"{p}.host_args[{j}]"
        if not (isinstance(a, list) and len(a) == 2 and all(isinstance(x, str) and x for x in a)):
            raise c.fail(ap, a, "expected a [name, kind] pair of non-empty strings")
        if a[0] in seen_args:
            raise c.fail(ap, a, f"duplicate host argument name {a[0]!r}")
        seen_args.add(a[0])
        host_args.append((a[0], a[1]))

    recipe = v["launch_recipe"]
    if recipe is not None and not isinstance(recipe, dict):
        raise c.fail(f"{p}.launch_recipe", recipe, "expected an object or null")

    return VariantEntry(
        name=name, op=c.str_(v, "op", p), arch=c.str_(v, "arch", p), family=c.str_(v, "family", p),
        knobs=dict(knobs_raw), requirements=dict(req_raw),
        cubin=c.file_(v, "cubin", p), sha256=c.sha_(v, "sha256", p), size=c.int_(v, "size", p, 1),
        host_program=host_program, entry=c.str_(v, "entry", p), kernel_symbols=tuple(symbols),
        params=params, host_args=tuple(host_args), smem_bytes=c.int_(v, "smem_bytes", p),
        resources=resources, launch_recipe=recipe)


# --------------------------------------------------------------------------
# Directory-level API
# --------------------------------------------------------------------------

def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate ``<directory>/manifest.json`` (no file hashes checked; see `verify_artifacts`)."""
    d = Path(directory)
    path = d / MANIFEST_NAME
    source = str(path)
    if not d.is_dir():
        raise ManifestError(f"{d}: artifact directory does not exist")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{source}: no manifest in {d} (run `svdq-aot build CONFIG -o {d}`; an "
                            f"interrupted or failed build leaves no manifest)") from None
    except OSError as e:
        raise ManifestError(f"{source}: cannot read: {e.strerror}") from None
    return Manifest.from_json(raw, source)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_artifacts(manifest: Manifest, directory: str | os.PathLike) -> dict[str, bytes]:
    """Read every file the manifest names and check it: inside `directory`, recorded size and SHA-256.

    Pure file I/O, no CUDA.  The hash is taken of the bytes returned, so what
    a caller loads is exactly what was verified.  Raises
    `ArtifactIntegrityError` naming each bad file with expected vs actual.
    """
    d = Path(directory)
    try:
        root = d.resolve(strict=True)
    except (FileNotFoundError, OSError):
        raise ArtifactIntegrityError(f"{d}: artifact directory does not exist") from None
    problems: list[str] = []
    ok: dict[str, bytes] = {}
    for name, expected, size in manifest.files():
        # Defence in depth: the reader already rejects such names.
        if not _FILE_RE.fullmatch(name) or ".." in name:
            problems.append(f"{name!r}: not a plain file name inside {d}")
            continue
        path = d / name
        try:
            real = path.resolve(strict=True)
        except (FileNotFoundError, OSError):
            problems.append(f"{path}: missing (manifest expects sha256 {expected})")
            continue
        if real.parent != root:
            problems.append(f"{path}: resolves to {real}, outside the artifact directory {root}")
            continue
        if not real.is_file():
            problems.append(f"{path}: not a regular file")
            continue
        try:
            data = real.read_bytes()
        except OSError as e:
            problems.append(f"{path}: cannot read: {e.strerror}")
            continue
        if size is not None and len(data) != size:
            problems.append(f"{path}: size mismatch: manifest expects {size} bytes, file has "
                            f"{len(data)} (expected sha256 {expected})")
            continue
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            problems.append(f"{path}: sha256 mismatch: manifest expects {expected}, file has {actual}")
            continue
        ok[name] = data
    if problems:
        head = f"{len(problems)} artifact file(s) in {d} failed verification" if len(problems) > 1 \
            else "artifact file failed verification"
        raise ArtifactIntegrityError(f"{head}: " + "; ".join(problems)
                                     + " (the files were modified or not copied completely; rebuild or re-copy)",
                                     problems)
    return ok

"""Content-addressed cache of compiled variants (build time only).

A variant's **key** is the SHA-256 of everything its compiled bytes can
depend on:

* the variant itself: op, arch, knobs (in order) and its name;
* the kernel sources it depends on: the family's module file and every
  module of the same kernel package it imports, transitively (found by
  reading the ``import`` statements, so a new family or a new shared helper
  needs no list kept here), plus any files a family declares in an optional
  ``SOURCES`` tuple (paths relative to its module);
* the builder code that turns a compiled function into artifact bytes
  (``svdq_aot.host_ir``, ``svdq_aot.derive_recipe``, ``svdq_aot.build``,
  ``svdq_aot.cache``) and the loader modules those read (``svdq_loader``
  without ``testing``);
* the DSL's version, this package's version and the Python version;
* any kernel build switch that is set: an environment variable named
  ``SVDQ_KERNEL_*`` that a family reads at trace time (diagnosis builds such
  as ``SVDQ_KERNEL_QUANT_PROBE``), so such a build never shares a key with a
  plain one.  With none set, the key is what it was before switches existed.

Changing one kernel file therefore re-keys exactly the variants of the
families that import it; a second config that shares variants finds them.

Layout: ``<root>/v1/<key[:2]>/<key>/{cubin,host.json,meta.json}``.  An
entry is written into a temporary folder next to it and renamed into place,
so a reader sees a complete entry or none; a corrupt entry (hash mismatch)
is a miss and is replaced.  The root carries a ``CACHEDIR.TAG`` so that
backup tools skip it and ``svdq-aot clean --cache`` knows it is ours.

The root is, in order: the ``--cache-dir`` flag, ``$SVDQ_AOT_CACHE``,
``$XDG_CACHE_HOME/svdq-aot``, ``~/.cache/svdq-aot``.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import __version__

ENV_VAR = "SVDQ_AOT_CACHE"
LAYOUT = "v1"
TAG_NAME = "CACHEDIR.TAG"
_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
        "# This folder is the svdq-aot compiled-variant cache; `svdq-aot clean --cache` removes it.\n")
#: Builder modules whose code shapes the artifact bytes of every variant.
_BUILDER_MODULES = ("svdq_aot.host_ir", "svdq_aot.derive_recipe", "svdq_aot.build", "svdq_aot.cache")


class CacheError(RuntimeError):
    """The cache folder cannot be used (the message names it and why)."""


def default_root() -> Path:
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "svdq-aot"


def dsl_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------
# What a variant depends on
# --------------------------------------------------------------------------

_SCANNED: dict[tuple[Path, int, int, str], tuple[str, list[Path]]] = {}


def _scan(path: Path, package: str) -> tuple[str, list[Path]]:
    """(sha256 of `path`, the files of `package` it imports); remembered per (path, mtime, size)."""
    st = path.stat()
    key = (path, st.st_mtime_ns, st.st_size, package)
    if key not in _SCANNED:
        data = path.read_bytes()
        _SCANNED[key] = (hashlib.sha256(data).hexdigest(), _local_imports(path, package, data))
    return _SCANNED[key]


def _local_imports(path: Path, package: str, data: bytes) -> list[Path]:
    """Files of modules in `package` (the folder of `path`) that `path` (with bytes `data`) imports."""
    try:
        tree = ast.parse(data, filename=str(path))
    except SyntaxError:
        return []
    folder = path.parent
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1:
                base = mod.split(".")[0] if mod else ""
                names += [base] if base else [a.name.split(".")[0] for a in node.names]
            elif node.level == 0 and mod.split(".")[0] == package:
                parts = mod.split(".")
                names += [parts[1]] if len(parts) > 1 else [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    names.append(parts[1])
    out = []
    for n in dict.fromkeys(names):
        for cand in (folder / f"{n}.py", folder / n / "__init__.py"):
            if cand.is_file():
                out.append(cand)
                break
    return out


def family_sources(family: Any) -> dict[str, str]:
    """{file name: sha256} of the kernel sources `family` depends on ({} for a family without files)."""
    file = getattr(family, "__file__", None)
    if not file:
        return {}
    root = Path(file).resolve()
    package = (getattr(family, "__name__", "") or "").split(".")[0] or root.parent.name
    seen: dict[Path, str] = {}
    todo = [root] + [(root.parent / s).resolve() for s in getattr(family, "SOURCES", ())]
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen[p], imports = _scan(p, package)
        todo += imports
    return {str(p.relative_to(root.parent)) if p.is_relative_to(root.parent) else p.name: d
            for p, d in sorted(seen.items())}


#: Prefix of the environment variables that change compiled kernel bytes (read by families at trace time).
KERNEL_ENV_PREFIX = "SVDQ_KERNEL_"


def kernel_switches() -> dict[str, str]:
    """The kernel build switches set in this process ({name: value}, sorted)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(KERNEL_ENV_PREFIX)}


@lru_cache(maxsize=None)
def builder_digest() -> str:
    """One hash over the builder and loader code that turns a compiled function into artifact bytes."""
    import importlib
    h = hashlib.sha256()
    files: list[Path] = []
    for m in _BUILDER_MODULES:
        files.append(Path(importlib.import_module(m).__file__))
    import svdq_loader
    loader_root = Path(svdq_loader.__file__).parent
    files += [p for p in sorted(loader_root.rglob("*.py")) if "testing" not in p.relative_to(loader_root).parts]
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def variant_key(variant: Any, family: Any) -> str:
    """The cache key of `variant` (built by `family`)."""
    doc = {
        "layout": LAYOUT,
        "op": variant.op, "arch": variant.arch, "name": variant.name,
        "knobs": [[k, v] for k, v in variant.knobs],
        "family": getattr(family, "NAME", "?"),
        "family_module": getattr(family, "__name__", "?"),
        "sources": family_sources(family),
        "builder": builder_digest(),
        "svdq_aot": __version__, "dsl": dsl_version(),
        "python": f"{sys.implementation.name}-{platform.python_version()}",
    }
    switches = kernel_switches()
    if switches:
        doc["kernel_switches"] = switches
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------

class VariantCache:
    """get/put compiled variants by key under `root` (None: the cache is off)."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def _ensure_root(self) -> Path:
        assert self.root is not None
        try:
            (self.root / LAYOUT).mkdir(parents=True, exist_ok=True)
            tag = self.root / TAG_NAME
            if not tag.exists():
                tag.write_text(_TAG)
        except OSError as e:
            raise CacheError(f"cache folder {self.root}: cannot create it: {e.strerror or e} "
                             f"(set --cache-dir or ${ENV_VAR}, or pass --no-cache)") from None
        return self.root

    def entry_dir(self, key: str) -> Path:
        assert self.root is not None
        return self.root / LAYOUT / key[:2] / key

    def get(self, key: str) -> tuple[bytes, bytes, dict] | None:
        """(cubin, host_json, meta) of a complete, intact entry, else None."""
        if self.root is None:
            return None
        d = self.entry_dir(key)
        try:
            meta = json.loads((d / "meta.json").read_bytes())
            cubin = (d / "cubin").read_bytes()
            host = (d / "host.json").read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("key") != key \
                or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest() \
                or meta.get("host_sha256") != hashlib.sha256(host).hexdigest():
            return None
        return cubin, host, meta

    def put(self, key: str, cubin: bytes, host_json: bytes, meta: dict) -> None:
        """Store an entry atomically (a concurrent writer of the same key wins or loses cleanly)."""
        if self.root is None:
            return
        self._ensure_root()
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
        try:
            (tmp / "cubin").write_bytes(cubin)
            (tmp / "host.json").write_bytes(host_json)
            full = dict(meta, key=key, cubin_sha256=hashlib.sha256(cubin).hexdigest(),
                        host_sha256=hashlib.sha256(host_json).hexdigest())
            (tmp / "meta.json").write_text(json.dumps(full))  # key order kept: it is the manifest's
            if final.exists():            # a corrupt old entry (get() said miss): replace it
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:               # another build stored the same key first
                pass
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def size(self) -> tuple[int, int]:
        """(entries, bytes) currently stored."""
        if self.root is None or not (self.root / LAYOUT).is_dir():
            return 0, 0
        n = b = 0
        for meta in (self.root / LAYOUT).glob("*/*/meta.json"):
            n += 1
            b += sum(f.stat().st_size for f in meta.parent.iterdir())
        return n, b

    def clear(self) -> int:
        """Remove the whole cache folder; refuses a folder that is not a svdq-aot cache."""
        if self.root is None or not self.root.exists():
            return 0
        if not (self.root / TAG_NAME).is_file():
            raise CacheError(f"{self.root}: not a svdq-aot cache folder (no {TAG_NAME}); not removing it")
        n, _ = self.size()
        shutil.rmtree(self.root)
        return n


# --------------------------------------------------------------------------
# The whole build: is the output folder already what this build would write?
# --------------------------------------------------------------------------

def build_fingerprint(config_path: str | os.PathLike, shard: tuple[int, int] | None) -> str | None:
    """A hash of every input of a whole build, computed without importing the DSL (None if unknown).

    The config's bytes and file name, the shard, this package's code (enumeration, validity
    rules, the builder), the loader code, the registry and every registered family's kernel
    sources, and the versions.  A build record holding the same fingerprint means the folder
    already holds exactly what the build would write.
    """
    import importlib.util
    try:
        from .variants import _registry
        reg = _registry()
        reg_file = getattr(reg, "__file__", None)
        if not reg_file:
            return None
        sources = {}
        for key, mod in sorted(reg.FAMILIES.items()):
            spec = importlib.util.find_spec(mod)
            if spec is None or not spec.origin:
                return None
            fam = type("FamilyFiles", (), {"__file__": spec.origin, "__name__": mod})
            sources[f"{key[0]}@{key[1]}"] = family_sources(fam)
        cfg = Path(config_path)
        here = Path(__file__).resolve().parent
        doc = {
            "config": [cfg.name, hashlib.sha256(cfg.read_bytes()).hexdigest()],
            "shard": list(shard) if shard else None,
            "svdq_aot_code": hashlib.sha256(b"".join(p.name.encode() + b"\0" + p.read_bytes()
                                                     for p in sorted(here.glob("*.py")))).hexdigest(),
            "builder": builder_digest(), "registry": _scan(Path(reg_file).resolve(), "")[0],
            "families": sources, "svdq_aot": __version__, "dsl": dsl_version(),
            "python": f"{sys.implementation.name}-{platform.python_version()}",
        }
        switches = kernel_switches()
        if switches:
            doc["kernel_switches"] = switches
    except (OSError, ImportError, ValueError, AttributeError):
        return None
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

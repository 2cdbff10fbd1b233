"""`build(config, out_dir)`: config -> variants -> compile -> artifacts -> manifest.

Every valid variant is compiled (and its launch ABI extracted) *before*
anything is written to the output directory, so a failing compile or
host-program serialisation leaves the directory exactly as it was.  Then
`ArtifactDir.commit` writes the files atomically and the manifest last.

Nothing here queries a GPU or the CUDA driver; the kernel family is told
its target arch explicitly.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from svdq_loader.manifest import (
    SCHEMA_VERSION, ConfigRef, Generator, HostProgram, Manifest, ManifestError, ParamInfo,
    RejectedEntry, Resources, Shape, VariantEntry,
)
from svdq_loader import cuda_versions
from svdq_loader.ops import op_spec
from svdq_loader.select_rules import Rule, RuleError, default_rule, parse_buckets

from . import __version__
from .artifacts import ArtifactDir, sha256_bytes
from .config import Config, load_config
from .variants import FamilyUnavailable, Variant, check_sections, enumerate_variants, feature_combinations

ProgressFn = Callable[[str], Any]


class BuildError(RuntimeError):
    """The build cannot produce a complete, valid artifact set; the message says which variant and why."""


@dataclass(frozen=True)
class CompileResult:
    variant: Variant
    cubin: bytes
    host_json: bytes
    entry: str
    kernel_symbols: tuple[str, ...]
    params: dict[str, tuple[tuple[int, int, int], ...]]
    resources: dict[str, tuple[int, int, int]]   # symbol -> (registers, stack frame, static smem)
    smem_bytes: int
    requirements: dict[str, int]
    launch_recipe: dict | None
    seconds: float


# Indirections (tests substitute these; the real ones are imported lazily).
def _kernel_params(cubin: bytes) -> dict:
    from svdq_loader.cubin_info import kernel_params
    return kernel_params(cubin)


def _kernel_resources(cubin: bytes) -> dict[str, tuple[int, int, int]]:
    """symbol -> (registers, stack frame bytes, static smem), from the cubin's .nv.info."""
    from svdq_loader.cubin_info import cubin_info
    return {n: (int(k.regcount or 0), int(k.frame_size or 0), int(k.static_smem))
            for n, k in cubin_info(cubin).kernels.items()}


def _serialize_host(compiled: Any) -> Any:
    from svdq_aot.host_ir import serialize_host
    return serialize_host(compiled)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _one_line(e: BaseException) -> str:
    """The exception as one plain line (the DSL colours its messages: colour codes are dropped)."""
    msg = " ".join(_ANSI.sub("", str(e)).split())
    if len(msg) > 400:
        msg = msg[:397] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _derive_recipe(variant: Variant, host: dict, params: dict, requirements: dict) -> dict | None:
    """The launch recipe of this variant, derived from its host program and checked against it (or None)."""
    try:
        from .derive_recipe import derive_for_op
    except ImportError:  # pragma: no cover - recipe derivation not available
        return None
    return derive_for_op(op_spec(variant.op), host, params, requirements)


def compile_one(variant: Variant) -> CompileResult:
    """Compile one variant and extract its launch ABI; raises BuildError naming the variant."""
    name = variant.name
    t0 = time.perf_counter()
    try:
        fam = variant.family()
    except (KeyError, FamilyUnavailable) as e:
        raise BuildError(f"variant {name}: {_one_line(e)}") from e
    knobs = variant.knob_dict
    with tempfile.TemporaryDirectory(prefix="svdq-aot-dump-") as dump:
        try:
            cv = fam.compile(variant.arch, knobs, name, dump)
        except Exception as e:  # noqa: BLE001
            raise BuildError(f"variant {name}: compile failed: {_one_line(e)}") from e

    cubin = getattr(cv, "cubin", None)
    if not isinstance(cubin, (bytes, bytearray)) or not cubin:
        raise BuildError(f"variant {name}: compile produced no cubin bytes")
    cubin = bytes(cubin)
    if not cubin.startswith(b"\x7fELF"):
        raise BuildError(f"variant {name}: compile output is not an ELF cubin (starts {cubin[:8]!r})")
    symbols = tuple(cv.kernel_symbols)
    if not symbols or not all(isinstance(s, str) and s.startswith(name) for s in symbols):
        raise BuildError(f"variant {name}: kernel symbols {symbols!r} must all start with the variant name")
    entry = cv.entry
    if not isinstance(entry, str) or not entry:
        raise BuildError(f"variant {name}: compile reported no host entry name ({entry!r})")
    smem = cv.smem_bytes
    if isinstance(smem, bool) or not isinstance(smem, int) or smem < 0:
        raise BuildError(f"variant {name}: invalid smem_bytes {smem!r}")

    try:
        all_params = _kernel_params(cubin)
        all_res = _kernel_resources(cubin)
    except Exception as e:  # noqa: BLE001
        raise BuildError(f"variant {name}: reading kernel parameter info from the cubin failed: "
                         f"{_one_line(e)}") from e
    params, resources = {}, {}
    for sym in symbols:
        if sym not in all_params:
            raise BuildError(f"variant {name}: kernel symbol {sym!r} has no parameter info in the cubin "
                             f"(cubin kernels: {sorted(all_params)})")
        params[sym] = tuple(tuple(int(x) for x in p) for p in all_params[sym])
        resources[sym] = all_res.get(sym, (0, 0, 0))

    try:
        host = _serialize_host(cv.compiled)
        host_json = (json.dumps(host, separators=(",", ":"), allow_nan=False) + "\n").encode()
    except Exception as e:  # noqa: BLE001 (HostIRError, or a non-JSON value)
        raise BuildError(f"variant {name}: host program serialisation failed: {_one_line(e)}") from e
    del cv
    requirements = variant.requirements()
    try:
        recipe = _derive_recipe(variant, json.loads(host_json), params, requirements)
    except Exception as e:  # noqa: BLE001 - a recipe is an optimisation: fall back to the interpreter
        recipe = None
        if os.environ.get("SVDQ_STRICT_RECIPES") == "1":
            raise BuildError(f"variant {name}: launch recipe derivation failed: {_one_line(e)}") from e
    return CompileResult(variant=variant, cubin=cubin, host_json=host_json, entry=entry,
                         kernel_symbols=symbols, params=params, resources=resources, smem_bytes=smem,
                         requirements=requirements, launch_recipe=recipe,
                         seconds=time.perf_counter() - t0)


def _feature_keys(spec, feats: dict, config: Config) -> list[str]:
    """``ranks[2]=128``-style config keys of a feature combination."""
    out = []
    for f in spec.features:
        if f.source == "arch":
            continue
        values = list(getattr(config, f.source))
        v = feats[f.name]
        i = next(j for j, x in enumerate(values) if x == v and type(x) is type(v))
        out.append(f"{f.source}[{i}]={str(v).lower() if isinstance(v, bool) else v}")
    return out


def coverage_gaps(config: Config, valid: list[Variant],
                  rejected: list[tuple[Variant, str]]) -> list[tuple[str, str]]:
    """(config key, problem) for every requested problem no valid variant serves."""
    gaps: list[tuple[str, str]] = []
    for arch in config.archs:
        for op, _section in config.sections(arch):
            spec = op_spec(op)
            mine = [v for v in valid if (v.op, v.arch) == (op, arch)]
            reqs = {v: v.requirements() for v in mine}
            for feats in feature_combinations(op, arch, config):
                key = spec.feature_key(feats)
                cands = [v for v in mine if v.feature_key == key]
                fkeys = _feature_keys(spec, feats, config)
                if not cands:
                    why = [r for v, r in rejected if (v.op, v.arch) == (op, arch) and v.feature_key == key]
                    detail = f"every variant was rejected, e.g.: {why[0]}" if why else "no variant was enumerated"
                    culprit = next((k for k in fkeys if k.startswith("ranks[")), fkeys[0] if fkeys else op)
                    gaps.append((culprit.split("=")[0], f"{op} on {arch} has no valid variant for "
                                                        f"{', '.join(fkeys)} ({detail})"))
                    continue
                for label, where, dims in spec.coverage_problems(config):
                    if any(spec.shape_problem(reqs[v], dims) is None for v in cands):
                        continue
                    rule = spec.shape_problem(reqs[cands[0]], dims)
                    gaps.append((where, f"{label} is not served by any {op} variant on {arch} for "
                                        f"{', '.join(fkeys)} ({cands[0].name}: {rule})"))
    return gaps


def check_coverage(config: Config, valid: list[Variant], rejected: list[tuple[Variant, str]]) -> None:
    """BuildError summarising every coverage gap by config key (first gap of each key in full)."""
    gaps = coverage_gaps(config, valid, rejected)
    if not gaps:
        return
    by_key: dict[str, list[str]] = {}
    for k, text in gaps:
        by_key.setdefault(k, []).append(text)
    parts = [f"{k}: {texts[0]}" + (f" (+{len(texts) - 1} similar)" if len(texts) > 1 else "")
             for k, texts in list(by_key.items())[:4]]
    more = f"; and {len(by_key) - 4} more config keys" if len(by_key) > 4 else ""
    raise BuildError(f"{config.path}: {len(gaps)} requested combination(s) cannot be served: "
                     + "; ".join(parts) + more)


def _toolkit_major() -> int:
    """The CUDA major of the DSL's compiler (its libs package is per major: ...-libs-cu12 / -cu13)."""
    for major in (13, 12):
        try:
            importlib.metadata.version(f"nvidia-cutlass-dsl-libs-cu{major}")
            return major
        except importlib.metadata.PackageNotFoundError:
            continue
    return 12


def _selection(entries: list[VariantEntry], results: list[CompileResult]) -> tuple[Rule, ...]:
    """One rule per (op, arch, family) built: the family's SELECTION, or the default (name order)."""
    out: dict[tuple[str, str, str], Rule] = {}
    for e, r in zip(entries, results):
        key = (e.op, e.arch, e.family)
        if key in out:
            continue
        fam = r.variant.family()
        raw = getattr(fam, "SELECTION", None)
        if raw is None:
            out[key] = default_rule(*key)
            continue
        try:
            out[key] = Rule(*key, parse_buckets(raw, f"{fam.__name__}.SELECTION", list(fam.TUNING)))
        except RuleError as ex:
            raise BuildError(str(ex)) from ex
    return tuple(out.values())


def _generator() -> Generator:
    try:
        dsl_version = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        dsl_version = "unknown"
    return Generator(package="svdq-aot", package_version=__version__, dsl="nvidia-cutlass-dsl",
                     dsl_version=dsl_version, python=platform.python_version())


def _entry(r: CompileResult) -> VariantEntry:
    v = r.variant
    return VariantEntry(
        name=v.name, op=v.op, arch=v.arch, family=v.family().NAME, knobs=v.knob_dict,
        requirements=dict(r.requirements),
        cubin=f"{v.name}.cubin", sha256=sha256_bytes(r.cubin), size=len(r.cubin),
        host_program=HostProgram(file=f"{v.name}.host.json", sha256=sha256_bytes(r.host_json)),
        entry=r.entry, kernel_symbols=r.kernel_symbols,
        params={s: tuple(ParamInfo(*p) for p in ps) for s, ps in r.params.items()},
        host_args=op_spec(v.op).host_args,
        smem_bytes=r.smem_bytes,
        resources={s: Resources(*t) for s, t in r.resources.items()},
        launch_recipe=r.launch_recipe)


def _compile_all(valid: list[Variant], jobs: int, progress: ProgressFn | None) -> list[CompileResult]:
    n = len(valid)
    width = len(str(n))

    def report(i: int, r: CompileResult) -> None:
        if progress is not None:
            progress(f"[{i:>{width}}/{n}] {r.variant.name}  {r.seconds:.1f}s")

    if jobs <= 1 or n <= 1:
        out = []
        for i, v in enumerate(valid, 1):
            r = compile_one(v)
            out.append(r)
            report(i, r)
        return out

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a fresh interpreter per worker (the DSL/MLIR state must not be forked).
    results: dict[Variant, CompileResult] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, n),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(compile_one, v): v for v in valid}
        for i, f in enumerate(as_completed(futures), 1):
            exc = f.exception()
            if exc is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                if isinstance(exc, BuildError):
                    raise BuildError(str(exc)) from None
                raise BuildError(f"variant {futures[f].name}: compile worker failed: {_one_line(exc)}") from exc
            r = f.result()
            results[r.variant] = r
            report(i, r)
    return [results[v] for v in valid]


def build(config_path: str | Path, out_dir: str | Path, *, jobs: int = 1,
          progress: ProgressFn | None = None) -> Manifest:
    """Build every valid variant of `config_path` into `out_dir`; returns the manifest written.

    Raises ConfigError (invalid config), BuildError (coverage gap, a variant
    failed to compile/serialise) or BuildLocked (another build owns out_dir).
    On any error no new manifest is written.

    ``jobs > 1`` compiles in a pool of *spawned* processes (fresh interpreters,
    the DSL is not fork-safe); a script calling this needs the usual
    ``if __name__ == "__main__":`` guard.  `progress` receives one line per
    finished variant: ``[i/n] <name>  <seconds>s``.
    """
    config = load_config(config_path)
    try:
        check_sections(config)
        valid, rejected = enumerate_variants(config)
    except FamilyUnavailable as e:
        raise BuildError(str(e)) from e
    if not valid:
        first = f" (e.g. {rejected[0][0].name}: {rejected[0][1]})" if rejected else ""
        raise BuildError(f"{config.path}: no valid variants; all {len(rejected)} were rejected{first}")
    check_coverage(config, valid, rejected)

    results = _compile_all(valid, max(1, int(jobs)), progress)

    entries = [_entry(r) for r in results]
    tk = _toolkit_major()
    manifest = Manifest(
        selection=_selection(entries, results),
        cuda_driver={a: cuda_versions.required(a, tk) for a in dict.fromkeys(e.arch for e in entries)},
        schema_version=SCHEMA_VERSION, generator=_generator(),
        config=ConfigRef(name=config.name, sha256=config.sha256, file=config.file_name),
        shapes=tuple(Shape(name=s.name, k=s.k, n=s.n) for s in config.shapes),
        variants=tuple(entries),
        rejected=tuple(RejectedEntry(name=v.name, reason=r) for v, r in rejected))
    # Never write a manifest the loader would refuse.
    try:
        Manifest.from_json(manifest.to_json(), source="(manifest being built)")
    except ManifestError as e:
        raise BuildError(f"internal: the manifest would not validate: {e}") from e

    files: dict[str, bytes] = {}
    for r, e in zip(results, entries):
        files[e.cubin] = r.cubin
        files[e.host_program.file] = r.host_json
    out = Path(out_dir)
    with ArtifactDir(out) as ad:
        ad.commit(files, manifest)
    return Manifest.from_json(manifest.to_json(), source=str(out / "manifest.json"))

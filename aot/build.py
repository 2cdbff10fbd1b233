"""`build(config, out_dir)`: config -> variants -> (cache | compile) -> artifacts -> manifest.

Order of work:

1. read the config, enumerate the variants, check that every requested
   problem is served (`plan_build`; nothing is locked or written yet);
2. take the output directory's lock and check it is ours (`ArtifactDir`),
   *before* any compile;
3. look every variant up in the content-addressed cache (`svdq_aot.cache`);
   compile the misses, in a pool of spawned processes for ``jobs > 1``
   (`svdq_aot.pool`); each compiled variant goes into the cache as soon as
   it is done, so an interrupted or failed build resumes from there;
4. assemble the manifest (validated as the loader would read it), write the
   files atomically with the manifest last, then ``build-report.md`` and the
   build record (`ArtifactDir.commit`).

The manifest, cubins and host programs depend only on the inputs (config,
kernel sources, versions): two builds of the same inputs are byte-identical,
whatever ``jobs``, the cache state or sharding.  Everything time- or
host-dependent (compile seconds, cache hits, memory, date) goes into the
build record ``.svdq-aot-build.json`` and ``build-report.md`` only.

Nothing here queries a GPU or the CUDA driver; the kernel family is told
its target arch explicitly.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from svdq_loader.manifest import (
    MANIFEST_NAME, SCHEMA_VERSION, ArtifactError, ConfigRef, Generator, HostProgram, Manifest, ManifestError,
    ParamInfo, RejectedEntry, Resources, Shape, VariantEntry, read_artifacts, read_manifest,
)
from svdq_loader import cuda_versions
from svdq_loader.ops import op_spec
from svdq_loader.select_rules import Rule, RuleError, default_rule, parse_buckets

from . import __version__
from .artifacts import ArtifactDir, read_record, sha256_bytes
from .cache import VariantCache, build_fingerprint, default_root, dsl_version, kernel_switches, variant_key
from .errors import BuildError, NeedsConfirmation, PlanError
from .pool import Outcome, peak_rss_mb, run_pool
from .progress import LineProgress, Progress
from .report import REPORT_NAME, render_report
from .plan import check_coverage, plan_build, select_shard
from .variants import FamilyUnavailable, Variant

ProgressFn = Callable[[str], Any]
#: More variants to compile than this needs ``yes=True`` (``--yes``): a guard against a config whose knob lists
#: multiply out by accident.  configs/flux.yaml compiles 630 (about 6.5 min cold at -j 2 on 2 cores).
HUGE_BUILD = 1000
#: Seconds one variant takes to compile on one core of the reference machine (the estimate's fallback).
SECONDS_PER_VARIANT = 1.5


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
    peak_rss_mb: float = 0.0
    cache: str = "off"                           # "hit", "miss" or "off"


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


def _derive_recipe(variant: Variant, host: dict, params: dict, requirements: dict, hints=()) -> dict | None:
    """The launch recipe of this variant, derived from its host program and checked against it (or None)."""
    try:
        from .derive_recipe import derive_for_op
    except ImportError:  # pragma: no cover - recipe derivation not available
        return None
    return derive_for_op(op_spec(variant.op), host, params, requirements, hints=hints)


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
    hints = tuple(cv.recipe_hints)
    del cv
    requirements = variant.requirements()
    try:
        recipe = _derive_recipe(variant, json.loads(host_json), params, requirements, hints)
    except Exception as e:  # noqa: BLE001 - a recipe is an optimisation: fall back to the interpreter
        recipe = None
        if os.environ.get("SVDQ_STRICT_RECIPES") == "1":
            raise BuildError(f"variant {name}: launch recipe derivation failed: {_one_line(e)}") from e
    if recipe is not None:  # exactly what a JSON round trip (the cache, the manifest) gives back
        recipe = json.loads(json.dumps(recipe, allow_nan=False))
    return CompileResult(variant=variant, cubin=cubin, host_json=host_json, entry=entry,
                         kernel_symbols=symbols, params=params, resources=resources, smem_bytes=smem,
                         requirements=requirements, launch_recipe=recipe,
                         seconds=time.perf_counter() - t0, peak_rss_mb=peak_rss_mb())


def _generator() -> Generator:
    return Generator(package="svdq-aot", package_version=__version__, dsl="nvidia-cutlass-dsl",
                     dsl_version=dsl_version(), python=platform.python_version(), device_facts=DEVICE_FACTS,
                     kernel_switches=", ".join(f"{k}={v}" for k, v in kernel_switches().items()))


#: The manifest's record that nothing of the build machine is in the kernels (generator.device_facts).
DEVICE_FACTS = ("none baked in: built without a GPU (cross-compiled per arch); the SM count is the host "
                "argument sm_count, passed by the loader at every launch; SMEM opt-in limits are set on the "
                "target device at load")


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



# --------------------------------------------------------------------------
# Cache <-> CompileResult
# --------------------------------------------------------------------------

def _meta(r: CompileResult) -> dict:
    return {"name": r.variant.name, "entry": r.entry, "kernel_symbols": list(r.kernel_symbols),
            "params": {s: [list(p) for p in ps] for s, ps in r.params.items()},
            "resources": {s: list(t) for s, t in r.resources.items()}, "smem_bytes": r.smem_bytes,
            "requirements": dict(r.requirements), "launch_recipe": r.launch_recipe,
            "seconds": round(r.seconds, 3), "peak_rss_mb": round(r.peak_rss_mb, 1)}


def _from_cache(variant: Variant, cubin: bytes, host_json: bytes, meta: dict) -> CompileResult | None:
    """The cached result of `variant`, or None if the entry does not describe it."""
    try:
        if meta["name"] != variant.name:
            return None
        return CompileResult(
            variant=variant, cubin=cubin, host_json=host_json, entry=str(meta["entry"]),
            kernel_symbols=tuple(meta["kernel_symbols"]),
            params={s: tuple(tuple(int(x) for x in p) for p in ps) for s, ps in meta["params"].items()},
            resources={s: tuple(int(x) for x in t) for s, t in meta["resources"].items()},
            smem_bytes=int(meta["smem_bytes"]), requirements={k: int(x) for k, x in meta["requirements"].items()},
            launch_recipe=meta["launch_recipe"], seconds=float(meta.get("seconds", 0.0)),
            peak_rss_mb=float(meta.get("peak_rss_mb", 0.0)), cache="hit")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def compile_to_cache(variant: Variant, key: str | None, cache_root: str | None) -> CompileResult:
    """Compile `variant` (in a worker, or in-process for -j 1) and store it in the cache at once."""
    r = compile_one(variant)
    if key is not None and cache_root is not None:
        try:
            VariantCache(cache_root).put(key, r.cubin, r.host_json, _meta(r))
        except OSError:  # a full or read-only cache must not fail the build
            pass
    return dataclasses.replace(r, cache="miss" if key else "off")


# --------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------

@dataclass
class BuildResult:
    manifest: Manifest
    results: list[CompileResult]              # this build's variants, in manifest order
    failed: dict[str, str] = field(default_factory=dict)   # variant -> message (keep_going only)
    wall_seconds: float = 0.0
    record: dict = field(default_factory=dict)
    out_dir: Path = Path(".")
    up_to_date: bool = False                   # nothing to do: the folder already held this build

    @property
    def hits(self) -> int:
        if self.up_to_date:
            return len(self.manifest.variants)
        return sum(r.cache == "hit" for r in self.results)

    @property
    def compiled(self) -> int:
        return sum(r.cache != "hit" for r in self.results)


def _as_progress(progress: ProgressFn | Progress | None) -> Progress | None:
    if progress is None or isinstance(progress, Progress):
        return progress
    return LineProgress(progress)


def estimate_seconds(n: int, jobs: int, cache: VariantCache, sample: list[str]) -> float:
    """Expected wall time of compiling `n` variants at `jobs` (from cached compile times when known)."""
    times = []
    for key in sample[:50]:
        got = cache.get(key)
        if got is not None:
            times.append(float(got[2].get("seconds", 0.0)))
    per = sum(times) / len(times) if times else SECONDS_PER_VARIANT
    return n * per / max(1, min(jobs, os.cpu_count() or 1))


def _compile_misses(todo: list[tuple[Variant, str | None]], jobs: int, cache_root: str | None,
                    keep_going: bool, prog: Progress | None) -> tuple[dict[Variant, CompileResult], dict[Variant, str]]:
    done: dict[Variant, CompileResult] = {}
    failed: dict[Variant, str] = {}

    def finish(v: Variant, r: CompileResult | None, err: BaseException | None) -> None:
        if err is None:
            done[v] = r
        else:
            msg = str(err) if isinstance(err, BuildError) else \
                f"variant {v.name}: compile worker failed: {_one_line(err)}"
            failed[v] = msg
        if prog is not None:
            prog.finished(v.name, r, failed.get(v))

    if jobs <= 1 or len(todo) <= 1:
        for v, key in todo:
            if prog is not None:
                prog.running(v.name)
            try:
                r = compile_to_cache(v, key, cache_root)
            except BuildError as e:
                finish(v, None, e)
                if not keep_going:
                    break
                continue
            finish(v, r, None)
        return done, failed

    keys = dict(todo)

    def on_done(oc: Outcome) -> None:
        finish(oc.item, oc.result, oc.error)

    run_pool(compile_to_cache, [v for v, _ in todo], lambda v: (v, keys[v], cache_root), jobs,
             keep_going=keep_going, on_start=(lambda v: prog.running(v.name)) if prog else None, on_done=on_done)
    return done, failed


def build_set(config_path: str | Path, out_dir: str | Path, *, jobs: int = 1,
              progress: ProgressFn | Progress | None = None, keep_going: bool = False,
              shard: tuple[int, int] | None = None, cache_dir: str | Path | None | bool = True,
              force: bool = False, yes: bool = False, report: bool = True) -> BuildResult:
    """Build `config_path` into `out_dir`; see the module docstring for the order of work.

    ``cache_dir``: True = the default cache folder (`svdq_aot.cache.default_root`), a path, or
    False/None = no cache.  ``shard=(i, n)`` builds every n-th variant (merge the shards with
    `svdq_aot.merge`).  Raises ConfigError, PlanError (no variant / coverage gap), BuildError (a
    variant failed; with ``keep_going`` the others are still built and it is listed as rejected),
    NeedsConfirmation (more than HUGE_BUILD to compile and not ``yes``), BuildLocked,
    ForeignDirectory (a non-empty folder no build of ours wrote, unless ``force``).
    """
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    fingerprint = build_fingerprint(config_path, shard)
    if fingerprint is not None:
        same = _already_built(Path(out_dir), fingerprint, force)
        if same is not None:
            return BuildResult(same, [], {}, time.perf_counter() - t0, read_record(out_dir) or {}, Path(out_dir),
                               up_to_date=True)
    plan = plan_build(config_path)
    problem = plan.problem()
    if problem:
        raise PlanError(problem)
    config = plan.config
    mine = select_shard(plan.valid, shard)
    prog = _as_progress(progress)
    jobs = max(1, int(jobs))
    root = default_root() if cache_dir is True else (Path(cache_dir) if cache_dir else None)
    cache = VariantCache(root)

    out = Path(out_dir)
    with ArtifactDir(out, force=force) as ad:       # the lock, before any compile
        have: dict[Variant, CompileResult] = {}
        todo: list[tuple[Variant, str | None]] = []
        for v in mine:
            key = variant_key(v, v.family()) if cache.enabled else None
            got = cache.get(key) if key else None
            r = _from_cache(v, *got) if got else None
            if r is not None:
                have[v] = r
            else:
                todo.append((v, key))
        if len(todo) > HUGE_BUILD and not yes:
            est = estimate_seconds(len(todo), jobs, cache, [k for _, k in todo if k])
            raise NeedsConfirmation(
                f"{config.path}: {len(todo)} variants to compile (more than {HUGE_BUILD}); expected build "
                f"time ~{est / 60:.0f} min at -j {jobs}; pass --yes to build them, or trim the config")
        if prog is not None:
            prog.start(len(mine), len(todo))
            for v in mine:
                if v in have:
                    prog.finished(v.name, have[v], None)
        try:
            done, failed = _compile_misses(todo, jobs, str(root) if root else None, keep_going, prog)
        finally:
            if prog is not None:
                prog.close()
        have.update(done)
        if failed and not keep_going:
            first = next(iter(failed.values()))
            more = f" ({len(failed)} variants failed)" if len(failed) > 1 else ""
            raise BuildError(first + more)
        if len(have) + len(failed) < len(mine):   # stopped early
            raise BuildError("internal: the build stopped before every variant was compiled")

        results = [have[v] for v in mine if v in have]
        rejected = list(plan.rejected) + [(v, f"compile failed: {failed[v]}") for v in mine if v in failed]
        if failed:
            check_coverage(config, [v for v in plan.valid if v not in failed], rejected)
        manifest, text = _manifest(config, results, rejected)
        wall = time.perf_counter() - t0
        record = {
            "config": {"name": config.name, "file": config.file_name, "sha256": config.sha256},
            "shard": list(shard) if shard else None,
            "all_variants": [v.name for v in plan.valid],
            "manifest_sha256": sha256_bytes(text.encode()),
            "fingerprint": fingerprint if not failed else None,
            "build": {"started_utc": started, "wall_seconds": round(wall, 2), "jobs": jobs,
                      "cpus": os.cpu_count(), "load_average": _loadavg(), "host": platform.node(),
                      "cache_dir": str(root) if root else None, "kernel_switches": kernel_switches()},
            "variants": {r.variant.name: {"cache": r.cache, "seconds": round(r.seconds, 3),
                                          "peak_rss_mb": round(r.peak_rss_mb, 1)} for r in results},
            "failed": {v.name: m for v, m in failed.items()},
        }
        files: dict[str, bytes] = {}
        for r, e in zip(results, manifest.variants):
            files[e.cubin] = r.cubin
            files[e.host_program.file] = r.host_json
        extra = {}
        if report:
            extra[REPORT_NAME] = render_report(manifest, record).encode()
        ad.commit(files, manifest, extra=extra, record=record, manifest_text=text)
    return BuildResult(dataclasses.replace(manifest, source=str(out / "manifest.json")), results,
                       {v.name: m for v, m in failed.items()}, wall, record, out)


def _already_built(out: Path, fingerprint: str, force: bool) -> Manifest | None:
    """The manifest in `out` if its build record has `fingerprint` and every file is intact, else None."""
    rec = read_record(out)
    if rec is None or rec.get("fingerprint") != fingerprint or not rec.get("complete") or rec.get("failed"):
        return None
    try:
        with ArtifactDir(out, force=force):
            if not all((out / str(n)).is_file() for n in rec["owned"]):
                return None
            m = read_manifest(out)
            read_artifacts(m, out)               # every file's size and SHA-256
            if sha256_bytes((out / MANIFEST_NAME).read_bytes()) != rec.get("manifest_sha256"):
                return None
            return m
    except ArtifactError:
        return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


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


def _manifest(config, results: list[CompileResult], rejected: list[tuple[Variant, str]]) -> tuple[Manifest, str]:
    """The manifest and its JSON text, read back as the loader would read it."""
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
    text = manifest.to_json()
    try:  # never write a manifest the loader would refuse; return what it reads
        return Manifest.from_json(text, source="(manifest being built)"), text
    except ManifestError as e:
        raise BuildError(f"internal: the manifest would not validate: {e}") from e


def build(config_path: str | Path, out_dir: str | Path, *, jobs: int = 1,
          progress: ProgressFn | Progress | None = None, **options) -> Manifest:
    """Build every valid variant of `config_path` into `out_dir`; returns the manifest written.

    ``jobs > 1`` compiles in a pool of *spawned* processes (fresh interpreters,
    the DSL is not fork-safe); a script calling this needs the usual
    ``if __name__ == "__main__":`` guard.  `progress` is a `Progress` or a
    callable receiving one line per variant.  Other options: see `build_set`.
    """
    return build_set(config_path, out_dir, jobs=jobs, progress=progress, **options).manifest

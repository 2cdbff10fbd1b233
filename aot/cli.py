"""`svdq-aot` command line.  One function per subcommand; add yours the same way.

Subcommands: build, list (alias: variants), inspect, verify, merge, clean,
package, select, tune, bench, selftest.  `bench` and `selftest` forward their
arguments to `svdq_loader.testing.bench` / `.selftest` (torch and a GPU, not
the DSL); `select` needs neither.

Exit codes (also in ``svdq-aot --help``):

====  =========================================================================
0     success
1     the input is wrong or the build failed: invalid config, a variant failed,
      a coverage gap, artifacts that fail verification, a refused merge
2     usage error (unknown option, bad argument)
3     busy: another build holds the output folder's lock (retry later)
4     refused until confirmed: a foreign output folder (``--force``) or a huge
      build (``--yes``)
130   interrupted (SIGINT / Ctrl-C); 143: terminated (SIGTERM)
====  =========================================================================

Errors print one ``Error: ...`` line on stderr, no traceback; with
``--json`` the result (or ``{"ok": false, "error", "exit_code"}``) is one
JSON document on stdout.
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import click

from svdq_loader.manifest import ArtifactError, read_manifest

from . import __version__
from .artifacts import BuildLocked, ForeignDirectory
from .cache import CacheError
from .config import ConfigError
from .errors import BuildError, NeedsConfirmation
from .variants import FamilyUnavailable

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_REFUSED = 0, 1, 2, 3, 4
EXIT_SIGINT, EXIT_SIGTERM = 130, 143

_EXIT_HELP = ("Exit codes: 0 ok; 1 invalid input or failed build/verification; 2 usage; 3 output folder "
              "locked by another build; 4 refused until --force/--yes; 130 interrupted; 143 terminated.")


def _exit_code(e: BaseException) -> int:
    if isinstance(e, BuildLocked):
        return EXIT_BUSY
    if isinstance(e, (ForeignDirectory, NeedsConfirmation)):
        return EXIT_REFUSED
    return EXIT_FAILED


_USER_ERRORS = (ConfigError, BuildError, BuildLocked, ForeignDirectory, FamilyUnavailable, ArtifactError,
                CacheError, OSError, ValueError)


def _fail(e: BaseException) -> click.ClickException:
    """A user error as click's one-line ``Error: ...`` (exit 1), for subcommands that raise it themselves."""
    return click.ClickException(" ".join(str(e).split()))


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the build cleans up like on Ctrl-C."""


def _on_sigterm(signum, frame):  # pragma: no cover - exercised by the subprocess test
    raise _Terminated()


def _emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=1, sort_keys=False))


def _run(as_json: bool, fn: Callable[[], Any]) -> Any:
    """Run a subcommand body: user errors -> one line (or JSON) and their exit code; signals -> 130/143."""
    old = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        return fn()
    except _USER_ERRORS as e:
        code = _exit_code(e)
        msg = " ".join(str(e).split())
        if as_json:
            _emit_json({"ok": False, "error": msg, "error_type": type(e).__name__, "exit_code": code})
        else:
            click.echo(f"Error: {msg}", err=True)
        sys.exit(code)
    except KeyboardInterrupt:
        click.echo("Interrupted: no manifest was written for the unfinished build; variants already "
                   "compiled are in the cache (the next build resumes from there).", err=True)
        sys.exit(EXIT_SIGINT)
    except _Terminated:
        click.echo("Terminated (SIGTERM): no manifest was written for the unfinished build.", err=True)
        sys.exit(EXIT_SIGTERM)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


json_option = click.option("--json", "as_json", is_flag=True, help="print the result as one JSON document")


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EXIT_HELP)
@click.version_option(__version__, prog_name="svdq-aot")
def main() -> None:
    """Ahead-of-time builder for the SVDQuant W4A4 kernels (no GPU needed), and its artifact tools."""


# --------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------

def _default_jobs() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _shard(ctx, param, value):
    if value is None:
        return None
    from .plan import parse_shard
    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command(epilog=_EXIT_HELP)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out", default="artifacts", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="artifact directory to write")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="variants compiled in parallel, one process each  [default: CPU cores]")
@click.option("--keep-going", is_flag=True, help="build every variant that compiles; failed ones are listed "
              "as rejected (the build still fails if that leaves a requested problem unserved)")
@click.option("--shard", callback=_shard, metavar="I/N",
              help="build only shard I of N (1 <= I <= N; deterministic); combine with `svdq-aot merge`")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="compiled-variant cache  [default: $SVDQ_AOT_CACHE, else ~/.cache/svdq-aot]")
@click.option("--no-cache", is_flag=True, help="neither read nor fill the cache")
@click.option("--force", is_flag=True, help="build into a non-empty folder no svdq-aot build wrote "
              "(only the files this build writes are ever touched)")
@click.option("--yes", "-y", is_flag=True, help="confirm a build of more than 1000 variants to compile")
@click.option("--plain", is_flag=True, help="plain progress lines even on a terminal")
@json_option
def build(config: Path, out: Path, jobs: int | None, keep_going: bool, shard, cache_dir: Path | None,
          no_cache: bool, force: bool, yes: bool, plain: bool, as_json: bool) -> None:
    """Compile every valid variant of CONFIG into OUT (cubins, host programs, manifest.json, build-report.md).

    Variants found in the cache are not recompiled.  Progress goes to stderr: a live display on a
    terminal, one line per variant otherwise.
    """
    from .build import build_set
    from .cache import kernel_switches
    from .progress import make_progress

    def body():
        res = build_set(config, out, jobs=jobs or _default_jobs(), progress=make_progress(plain=plain or as_json),
                        keep_going=keep_going, shard=shard, cache_dir=False if no_cache else (cache_dir or True),
                        force=force, yes=yes)
        m = res.manifest
        switches = kernel_switches()
        if as_json:
            _emit_json({"ok": True, "out": str(out), "up_to_date": res.up_to_date, "kernel_switches": switches,
                        "variants": len(m.variants), "rejected": len(m.rejected),
                        "cache_hits": res.hits, "compiled": res.compiled, "failed": res.failed,
                        "shard": list(shard) if shard else None, "wall_seconds": round(res.wall_seconds, 2),
                        "peak_worker_rss_mb": max((r.peak_rss_mb for r in res.results if r.cache != "hit"),
                                                  default=0.0)})
            return
        what = f"shard {shard[0]}/{shard[1]}: " if shard else ""
        if res.up_to_date:
            click.echo(f"{what}up to date: {out}/ already holds this build of {len(m.variants)} variant(s) "
                       f"(inputs unchanged, every file intact; checked in {res.wall_seconds:.1f}s)")
            return
        click.echo(f"{what}built {len(m.variants)} variant(s) ({res.hits} from the cache, {res.compiled} "
                   f"compiled), rejected {len(m.rejected)}, into {out}/ in {res.wall_seconds:.1f}s "
                   f"(report: {out}/build-report.md)")
        if switches:
            click.echo("  kernel build switches set (an experiment or diagnosis build): "
                       + ", ".join(f"{k}={v}" for k, v in switches.items()))
        for name, msg in res.failed.items():
            click.echo(f"  FAILED {name}: {msg}")
        for r in m.rejected:
            if r.name not in res.failed:
                click.echo(f"  rejected {r.name}: {r.reason}")

    _run(as_json, body)


# --------------------------------------------------------------------------
# list (variants)
# --------------------------------------------------------------------------

def _list(config: Path, as_json: bool) -> None:
    from .plan import plan_build

    def body():
        plan = plan_build(config)
        problem = plan.problem()
        cfg = plan.config
        if as_json:
            _emit_json({"ok": problem is None, "config": cfg.name, "valid": [v.name for v in plan.valid],
                        "rejected": [{"name": v.name, "reason": r} for v, r in plan.rejected],
                        "coverage_gaps": plan.gap_summary(), "error": problem})
        else:
            click.echo(f"{cfg.name}: {len(plan.valid)} valid, {len(plan.rejected)} rejected")
            for v in plan.valid:
                click.echo(f"  ok       {v.name}")
            for v, reason in plan.rejected:
                click.echo(f"  rejected {v.name}: {reason}")
            for key, texts in plan.gap_summary().items():
                more = f" (+{len(texts) - 1} similar)" if len(texts) > 1 else ""
                click.echo(f"  GAP {key}: {texts[0]}{more}")
            if problem:
                click.echo(f"Error: `svdq-aot build` would fail: {problem}", err=True)
        if problem:
            sys.exit(EXIT_FAILED)

    _run(as_json, body)


@main.command("list", epilog=_EXIT_HELP)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def list_(config: Path, as_json: bool) -> None:
    """List CONFIG's variants, valid and rejected (with reasons); compiles nothing.

    Exits 1 whenever `build` would fail (no valid variant, or a requested shape or rank no
    variant serves, named by its config key): usable as a CI pre-check.
    """
    _list(config, as_json)


@main.command(hidden=True)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def variants(config: Path, as_json: bool) -> None:
    """Same as `list` (kept for existing scripts)."""
    _list(config, as_json)


# --------------------------------------------------------------------------
# inspect, verify
# --------------------------------------------------------------------------

@main.command(epilog=_EXIT_HELP)
@click.argument("directory", type=click.Path(path_type=Path))
@json_option
def inspect(directory: Path, as_json: bool) -> None:
    """Print the report table of a built artifact set (manifest, plus compile times from its build record)."""
    from .artifacts import read_record
    from .report import render_report, report_rows

    def body():
        m = read_manifest(directory)
        rec = read_record(directory)
        if as_json:
            _emit_json({"ok": True, "config": m.config.name,
                        "kernel_switches": ((rec or {}).get("build") or {}).get("kernel_switches"),
                        "variants": report_rows(m, rec),
                        "rejected": [{"name": r.name, "reason": r.reason} for r in m.rejected]})
        else:
            click.echo(render_report(m, rec), nl=False)

    _run(as_json, body)


@main.command(epilog=_EXIT_HELP)
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--strict", is_flag=True, help="also fail (exit 1) when the folder holds unlisted files")
@json_option
def verify(directory: Path, strict: bool, as_json: bool) -> None:
    """Check DIR with every check load() makes (no GPU), and report files the manifest does not list.

    Schema and manifest checksum, every file's size and SHA-256, every host program parsed, each
    variant's facts cross-checked against its cubin and host program.
    """
    from .verify_dir import verify_dir

    def body():
        rep = verify_dir(directory)
        m = rep.manifest
        g = m.generator
        if as_json:
            t = rep.tuning
            _emit_json({"ok": not (strict and rep.unlisted), "variants": len(m.variants), "files": len(m.files()),
                        "unlisted": rep.unlisted, "config": m.config.name, "generator": g.__dict__,
                        "tuning": None if t is None else {"file": str(t.source), "entries": len(t.entries),
                                                          "measured_on": t.measured_text()}})
        else:
            click.echo(f"OK: {directory}: {len(m.variants)} variant(s), {len(m.files())} file(s) verified and "
                       f"cross-checked (config {m.config.name}, built by {g.package} {g.package_version} "
                       f"with {g.dsl} {g.dsl_version}, python {g.python})")
            if g.kernel_switches:
                click.echo(f"kernel build switches: {g.kernel_switches} (an experiment or diagnosis build: not the "
                           f"kernels a plain build of this config makes)")
            t = rep.tuning
            click.echo(f"tuning table: {t.source}: {len(t.entries)} entr{'y' if len(t.entries) == 1 else 'ies'} "
                       f"verified, measured on {t.measured_text()}" if t is not None else
                       "tuning table: none (selection follows the manifest's rules)")
            for n in rep.unlisted:
                click.echo(f"  unlisted: {n} (not in the manifest; load() ignores it)")
        if strict and rep.unlisted:
            if not as_json:
                click.echo(f"Error: {len(rep.unlisted)} unlisted file(s) in {directory} (--strict)", err=True)
            sys.exit(EXIT_FAILED)

    _run(as_json, body)


# --------------------------------------------------------------------------
# merge, clean, package
# --------------------------------------------------------------------------

@main.command(epilog=_EXIT_HELP)
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="write into a non-empty folder no svdq-aot build wrote")
@json_option
def merge(out: Path, dirs: tuple[Path, ...], force: bool, as_json: bool) -> None:
    """Combine the outputs of `build --shard I/N` (DIRS, every shard once) into one artifact set OUT.

    Refuses duplicates, shards of other configs or versions, and missing shards.  The result is
    byte-identical to a single build of the config.
    """
    from .merge import merge as run_merge

    def body():
        m = run_merge(out, list(dirs), force=force)
        if as_json:
            _emit_json({"ok": True, "out": str(out), "variants": len(m.variants), "shards": len(dirs)})
        else:
            click.echo(f"merged {len(dirs)} shard(s): {len(m.variants)} variant(s) into {out}/")

    _run(as_json, body)


@main.command(epilog=_EXIT_HELP)
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--cache", "cache", is_flag=True, help="also remove the compiled-variant cache")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the cache to remove  [default: $SVDQ_AOT_CACHE, else ~/.cache/svdq-aot]")
@json_option
def clean(directory: Path | None, cache: bool, cache_dir: Path | None, as_json: bool) -> None:
    """Remove the files a build wrote into DIRECTORY (nothing else), and with --cache the cache."""
    from .artifacts import ArtifactDir
    from .cache import VariantCache, default_root

    def body():
        removed: list[str] = []
        if directory is not None:
            if not directory.is_dir():
                raise OSError(f"{directory}: no such directory")
            with ArtifactDir(directory) as ad:
                removed = ad.clean()
            _drop_empty(directory)
        entries = VariantCache(cache_dir or default_root()).clear() if cache else 0
        if as_json:
            _emit_json({"ok": True, "removed": removed, "cache_entries_removed": entries})
        else:
            if directory is not None:
                click.echo(f"removed {len(removed)} file(s) from {directory}/")
            if cache:
                click.echo(f"removed the cache {cache_dir or default_root()} ({entries} entries)")
            if directory is None and not cache:
                click.echo("nothing to do: give a DIRECTORY and/or --cache")

    _run(as_json, body)


def _drop_empty(d: Path) -> None:
    from .artifacts import LOCK_NAME
    try:
        if {p.name for p in d.iterdir()} <= {LOCK_NAME}:
            (d / LOCK_NAME).unlink(missing_ok=True)
            d.rmdir()
    except OSError:
        pass


@main.command(epilog=_EXIT_HELP)
@click.argument("artifacts", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--out", "out", default="dist", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="folder to write the wheel into")
@click.option("--name", default=None, help="distribution name  [default: svdq-kernels-<config name>]")
@click.option("--version", "version", default="1.0.0", show_default=True, help="the wheel's version")
@json_option
def package(artifacts: Path, out: Path, name: str | None, version: str, as_json: bool) -> None:
    """Package a verified artifact set as an installable wheel that `svdq_loader.load()` finds with no path.

    The wheel requires only a compatible svdq-aot runtime (no DSL, no compiler).
    """
    from .package import package as run_package

    def body():
        p = run_package(artifacts, out, name=name, version=version)
        size = p.wheel.stat().st_size
        if as_json:
            _emit_json({"ok": True, "wheel": str(p.wheel), "name": p.name, "version": p.version,
                        "module": p.module, "requires": p.requires, "bytes": size})
        else:
            click.echo(f"wrote {p.wheel} ({size / 1e6:.1f} MB; module {p.module}, requires {p.requires})")

    _run(as_json, body)


# --------------------------------------------------------------------------
# select (no GPU)
# --------------------------------------------------------------------------

@main.command(epilog=_EXIT_HELP)
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--op", required=True, help="operator: gemm_w4a4 or quantize_act")
@click.option("--compute", type=click.Choice(["exact", "fp8"]), default="exact", show_default=True,
              help="gemm_w4a4's compute mode: fp8 explains the FP8-compute operator (gemm_w4a4_fp8, sm_90a), "
                   "which a call gets only with a weight prepared for it")
@click.option("--m", "m", type=int, required=True, help="rows (tokens)")
@click.option("--n", "n", type=int, default=None, help="output columns (gemm_w4a4)")
@click.option("--k", "k", type=int, required=True, help="reduction size")
@click.option("--rank", type=int, default=0, show_default=True, help="LoRA rank R (0: none)")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16"]))
@click.option("--wcscale/--no-wcscale", default=True, show_default=True, help="gemm_w4a4: per-column scale")
@click.option("--bias/--no-bias", default=True, show_default=True, help="gemm_w4a4: bias")
@click.option("--arch", default=None, help="target arch (default: the one the artifacts build the op for)")
@click.option("--gpu", default=None, help="GPU model to explain for (default: the tuning table's, if any)")
@click.option("--sms", type=click.IntRange(1, 4096), default=None,
              help="SM count the grid-fill ranking assumes (default 132: H100 / H200 SXM)")
@click.option("--no-tuning", is_flag=True, help="ignore the tuning table: the rules alone")
@click.option("--json", "as_json", is_flag=True, help="print the explanation as JSON")
def select(directory: Path, op: str, compute: str, m: int, n, k: int, rank: int, dtype: str, wcscale: bool,
           bias: bool, arch, gpu, sms, no_tuning: bool, as_json: bool) -> None:
    """Which variant the loader picks for a problem, why, and why every other candidate is out (no GPU).

    With a tuning table in DIR, the choice on the table's GPU model comes from it (and says so);
    --gpu NAME explains for another model (where the rules decide)."""
    import svdq_loader
    from svdq_loader.errors import UnsupportedProblem
    from svdq_loader.ops import op_spec
    if compute == "fp8":
        if op not in ("gemm_w4a4", "gemm_w4a4_fp8"):
            raise _fail(ValueError(f"--compute fp8 is a mode of gemm_w4a4, not of {op}"))
        op, wcscale = "gemm_w4a4_fp8", True     # the mode's weight always carries wcscale / rw
    try:
        lib = svdq_loader.load(directory, tuning=not no_tuning)
        spec = op_spec(op)
        dims = {d: v for d, v in (("m", m), ("n", n), ("k", k)) if d in spec.dims and v is not None}
        ex = lib.explain(op, arch, gpu=gpu, sm_count=sms, dtype=dtype, rank=rank, wcscale=wcscale, bias=bias,
                         **dims)
    except UnsupportedProblem as e:
        ex = getattr(e, "explanation", None)
        if ex is None:
            raise _fail(e) from None
    except (*_USER_ERRORS, KeyError) as e:
        raise _fail(e) from None
    click.echo(ex.to_json() if as_json else ex.text())
    if ex.chosen is None:
        raise SystemExit(1)


# --------------------------------------------------------------------------
# tune (GPU)
# --------------------------------------------------------------------------

def _csv(kind):
    def parse(ctx, param, text):
        if text is None:
            return None
        try:
            vals = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
        if not vals:
            raise click.BadParameter(f"expected at least one value, got {text!r}")
        return vals
    return parse


@main.command(epilog=_EXIT_HELP)
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="take the (K, N) shapes from this build config (default: the manifest's, else FLUX.1's)")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="table file to write (default: DIR/tuning.json, where the loader reads it)")
@click.option("--json", "as_json", is_flag=True, help="print the table as JSON instead of a summary")
@click.option("--op", type=click.Choice(["gemm_w4a4", "gemm_w4a4_fp8", "quantize_act", "all"]), default="all",
              show_default=True)
@click.option("--m", "ms", callback=_csv(int), default=None,
              help="Ms to measure, each in its M bucket (default: 16,64,256,1024,4608,9728 for the GEMM, "
                   "256,4608 for quantize_act)")
@click.option("--dtype", "dtypes", callback=_csv(str), default=None, help="only these dtypes (default: all built)")
@click.option("--rank", "ranks", callback=_csv(int), default=None, help="only these LoRA ranks (default: all built)")
@click.option("--min-gain", type=click.FloatRange(0, 1), default=0.02, show_default=True,
              help="keep the rules' choice unless the winner is at least this much faster")
@click.option("--quick", is_flag=True, help="fewer, shorter samples (a smoke run)")
def tune(directory: Path, config, out, as_json: bool, op: str, ms, dtypes, ranks, min_gain: float,
         quick: bool) -> None:
    """Time every candidate variant per shape and M bucket on this GPU; write the tuning table (needs a GPU)."""
    import json as _json

    import svdq_loader
    from svdq_loader.testing.bench import FLUX_SHAPES, Settings, load_shapes
    from svdq_loader.tune import tune as run_tune
    from svdq_loader.verify import read_tuning
    from .artifacts import atomic_write_bytes
    try:
        lib = svdq_loader.load(directory, tuning=False)
        shapes = load_shapes(str(config)) if config else \
            [(s.name, s.k, s.n) for s in lib.manifest.shapes] or list(FLUX_SHAPES)
    except (*_USER_ERRORS, ValueError) as e:
        raise _fail(e) from None
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except (ImportError, RuntimeError) as e:
        click.echo(f"Error: svdq-aot tune measures on a GPU: {e}", err=True)
        raise SystemExit(2) from None
    target = out or directory / "tuning.json"
    settings = Settings(reps=5, warmup=2, target_ms=0.5) if quick else Settings(reps=15, warmup=3, target_ms=2.0)
    log = (lambda s: click.echo(s, err=True)) if as_json else click.echo
    table, skipped = run_tune(lib, shapes, ops=None if op == "all" else [op], ms=ms, dtypes=dtypes, ranks=ranks,
                              settings=settings, min_gain=min_gain, source=str(target), progress=log)
    atomic_write_bytes(target, table.to_json().encode())
    try:
        read_tuning(lib.manifest, directory, target)        # what the loader will read: check it now
    except _USER_ERRORS as e:
        raise _fail(e) from None
    if as_json:
        click.echo(_json.dumps(_json.loads(target.read_text()), indent=1))
        return
    changed = sum(e.winner != e.rule_choice for e in table.entries)
    click.echo(f"wrote {target}: {len(table.entries)} entr{'y' if len(table.entries) == 1 else 'ies'} on "
               f"{table.measured_text()}; {changed} differ from the rules' choice; {len(skipped)} problem(s) "
               f"not measured (one candidate or none)")



# --------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------

def _bench_help() -> str:
    try:
        from svdq_loader.testing.bench import build_parser
    except ImportError as e:  # pragma: no cover
        return f"(bench options unavailable: {e})"
    return build_parser().format_help()


class _BenchCommand(click.Command):
    """Arguments go to svdq_loader.testing.bench; --help shows its real options."""

    def get_help(self, ctx: click.Context) -> str:
        return _bench_help()


@main.command(cls=_BenchCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                   "help_option_names": []})
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmark both operators on this machine's GPU against same-run baselines (see `bench --help`)."""
    from svdq_loader.testing.bench import main as bench_main
    ctx.exit(bench_main(ctx.args))


# --------------------------------------------------------------------------
# selftest (GPU)
# --------------------------------------------------------------------------

class _SelftestCommand(click.Command):
    """Arguments go to svdq_loader.testing.selftest; --help shows its real options."""

    def get_help(self, ctx: click.Context) -> str:
        try:
            from svdq_loader.testing.selftest import build_parser
        except ImportError as e:  # pragma: no cover
            return f"(selftest options unavailable: {e})"
        return build_parser().format_help()


@main.command(cls=_SelftestCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                      "help_option_names": []})
@click.pass_context
def selftest(ctx: click.Context) -> None:
    """Check every variant built for this GPU against the float64 reference (`selftest --help`)."""
    from svdq_loader.testing.selftest import main as selftest_main
    ctx.exit(selftest_main(ctx.args))


if __name__ == "__main__":  # pragma: no cover
    main()

"""`svdq-aot` command line: build, variants, verify, select, tune, bench.

`bench` forwards its arguments to `svdq_loader.testing.bench` (which needs
torch and a GPU, not the DSL); `svdq-aot bench --help` lists its options.

Errors the user can act on (bad config, failed variant, locked or tampered
artifact directory) print one ``Error: ...`` line and exit 1; no traceback.
"""
from __future__ import annotations

import time
from pathlib import Path

import click

from svdq_loader.manifest import ArtifactError
from svdq_loader.verify import open_artifacts

from . import __version__
from .artifacts import BuildLocked
from .build import BuildError, build as run_build
from .config import ConfigError, load_config
from .variants import FamilyUnavailable, check_sections, enumerate_variants

_USER_ERRORS = (ConfigError, BuildError, BuildLocked, FamilyUnavailable, ArtifactError, OSError)


def _fail(e: BaseException) -> click.ClickException:
    return click.ClickException(" ".join(str(e).split()))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="svdq-aot")
def main() -> None:
    """Ahead-of-time builder for the SVDQuant W4A4 GEMM kernels (no GPU needed)."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out", default="artifacts", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="artifact directory to write")
@click.option("-j", "--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="variants compiled in parallel (one process each)")
def build(config: Path, out: Path, jobs: int) -> None:
    """Compile every valid variant of CONFIG into OUT (cubins, host programs, manifest.json)."""
    t0 = time.perf_counter()
    try:
        manifest = run_build(config, out, jobs=jobs, progress=click.echo)
    except _USER_ERRORS as e:
        raise _fail(e) from None
    dt = time.perf_counter() - t0
    click.echo(f"built {len(manifest.variants)} variant(s), rejected {len(manifest.rejected)}, "
               f"into {out}/ in {dt:.1f}s")
    for r in manifest.rejected:
        click.echo(f"  rejected {r.name}: {r.reason}")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
def variants(config: Path) -> None:
    """List the variants CONFIG yields, valid and rejected (with reasons); compiles nothing."""
    try:
        cfg = load_config(config)
        check_sections(cfg)
        valid, rejected = enumerate_variants(cfg)
    except _USER_ERRORS as e:
        raise _fail(e) from None
    click.echo(f"{cfg.name}: {len(valid)} valid, {len(rejected)} rejected")
    for v in valid:
        click.echo(f"  ok       {v.name}")
    for v, reason in rejected:
        click.echo(f"  rejected {v.name}: {reason}")


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
def verify(directory: Path) -> None:
    """Check DIR as load() does: schema, checksum, every file's SHA-256, host programs, cross-checks (no GPU)."""
    try:
        arts = open_artifacts(directory)
    except _USER_ERRORS as e:
        raise _fail(e) from None
    m = arts.manifest
    g = m.generator
    click.echo(f"OK: {directory}: {len(m.variants)} variant(s), {len(m.files())} file(s) verified and "
               f"cross-checked "
               f"(config {m.config.name}, built by {g.package} {g.package_version} with {g.dsl} "
               f"{g.dsl_version}, python {g.python})")
    t = arts.tuning
    click.echo(f"tuning table: {t.source}: {len(t.entries)} entr{'y' if len(t.entries) == 1 else 'ies'} verified, "
               f"measured on {t.measured_text()}" if t is not None else
               "tuning table: none (selection follows the manifest's rules)")


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--op", required=True, help="operator: gemm_w4a4 or quantize_act")
@click.option("--m", "m", type=int, required=True, help="rows (tokens)")
@click.option("--n", "n", type=int, default=None, help="output columns (gemm_w4a4)")
@click.option("--k", "k", type=int, required=True, help="reduction size")
@click.option("--rank", type=int, default=0, show_default=True, help="LoRA rank R (0: none)")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16"]))
@click.option("--wcscale/--no-wcscale", default=True, show_default=True, help="gemm_w4a4: per-column scale")
@click.option("--bias/--no-bias", default=True, show_default=True, help="gemm_w4a4: bias")
@click.option("--arch", default=None, help="target arch (default: the one the artifacts build the op for)")
@click.option("--gpu", default=None, help="GPU model to explain for (default: the tuning table's, if any)")
@click.option("--no-tuning", is_flag=True, help="ignore the tuning table: the rules alone")
@click.option("--json", "as_json", is_flag=True, help="print the explanation as JSON")
def select(directory: Path, op: str, m: int, n, k: int, rank: int, dtype: str, wcscale: bool, bias: bool,
           arch, gpu, no_tuning: bool, as_json: bool) -> None:
    """Which variant the loader picks for a problem, why, and why every other candidate is out (no GPU).

    With a tuning table in DIR, the choice on the table's GPU model comes from it (and says so);
    --gpu NAME explains for another model (where the rules decide)."""
    import svdq_loader
    from svdq_loader.errors import UnsupportedProblem
    from svdq_loader.ops import op_spec
    try:
        lib = svdq_loader.load(directory, tuning=not no_tuning)
        spec = op_spec(op)
        dims = {d: v for d, v in (("m", m), ("n", n), ("k", k)) if d in spec.dims and v is not None}
        ex = lib.explain(op, arch, gpu=gpu, dtype=dtype, rank=rank, wcscale=wcscale, bias=bias, **dims)
    except UnsupportedProblem as e:
        ex = getattr(e, "explanation", None)
        if ex is None:
            raise _fail(e) from None
    except (*_USER_ERRORS, KeyError) as e:
        raise _fail(e) from None
    click.echo(ex.to_json() if as_json else ex.text())
    if ex.chosen is None:
        raise SystemExit(1)


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


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="take the (K, N) shapes from this build config (default: the manifest's, else FLUX.1's)")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="table file to write (default: DIR/tuning.json, where the loader reads it)")
@click.option("--json", "as_json", is_flag=True, help="print the table as JSON instead of a summary")
@click.option("--op", type=click.Choice(["gemm_w4a4", "quantize_act", "all"]), default="all", show_default=True)
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


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": []})
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmark both operators on this machine's GPU against same-run baselines (`bench --help`)."""
    from svdq_loader.testing.bench import main as bench_main
    ctx.exit(bench_main(ctx.args))


if __name__ == "__main__":  # pragma: no cover
    main()

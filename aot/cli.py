"""`svdq-aot` command line: build, variants, verify, select, bench, selftest.

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
@click.option("--json", "as_json", is_flag=True, help="print the explanation as JSON")
def select(directory: Path, op: str, m: int, n, k: int, rank: int, dtype: str, wcscale: bool, bias: bool,
           arch, as_json: bool) -> None:
    """Which variant the loader picks for a problem, why, and why every other candidate is out (no GPU)."""
    import svdq_loader
    from svdq_loader.errors import UnsupportedProblem
    from svdq_loader.ops import op_spec
    try:
        lib = svdq_loader.load(directory)
        spec = op_spec(op)
        dims = {d: v for d, v in (("m", m), ("n", n), ("k", k)) if d in spec.dims and v is not None}
        ex = lib.explain(op, arch, dtype=dtype, rank=rank, wcscale=wcscale, bias=bias, **dims)
    except UnsupportedProblem as e:
        ex = getattr(e, "explanation", None)
        if ex is None:
            raise _fail(e) from None
    except (*_USER_ERRORS, KeyError) as e:
        raise _fail(e) from None
    click.echo(ex.to_json() if as_json else ex.text())
    if ex.chosen is None:
        raise SystemExit(1)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": []})
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmark both operators on this machine's GPU against same-run baselines (`bench --help`)."""
    from svdq_loader.testing.bench import main as bench_main
    ctx.exit(bench_main(ctx.args))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": []})
@click.pass_context
def selftest(ctx: click.Context) -> None:
    """Check every variant built for this GPU against the float64 reference (`selftest --help`)."""
    from svdq_loader.testing.selftest import main as selftest_main
    ctx.exit(selftest_main(ctx.args))


if __name__ == "__main__":  # pragma: no cover
    main()

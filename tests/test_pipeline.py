"""Build pipeline with fake families (no DSL): cache keys and hits, ownership, keep-going, list, --yes, clean."""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from svdq_aot import artifacts as A
from svdq_aot import build as B
from svdq_aot import cache as K
from svdq_aot.build import BuildError, build, build_set
from svdq_aot.cli import main
from svdq_loader.manifest import MANIFEST_NAME, read_manifest
from fakes import install_fake, make_gemm_family, make_quant_family
import test_build as TB

CFG, listing = TB.CFG, TB.listing
fake, cfg = TB.fake, TB.cfg            # the fixtures of test_build


# --------------------------------------------------------------------------
# Cache keys: the kernel sources a family depends on, found generically
# --------------------------------------------------------------------------

def _kernel_pkg(tmp_path: Path) -> Path:
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "shared.py").write_text("X = 1\n")
    (pkg / "helper.py").write_text("from .shared import X\n")
    (pkg / "fam_a.py").write_text("import os\nfrom .helper import X\n")
    (pkg / "fam_b.py").write_text("from kpkg import shared\n")
    (pkg / "unrelated.py").write_text("Y = 2\n")
    return pkg


def _mod(pkg: Path, name: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(__file__=str(pkg / f"{name}.py"), __name__=f"kpkg.{name}", NAME=name)


def test_family_sources_follow_imports_transitively(tmp_path):
    pkg = _kernel_pkg(tmp_path)
    a = K.family_sources(_mod(pkg, "fam_a"))
    b = K.family_sources(_mod(pkg, "fam_b"))
    assert sorted(a) == ["fam_a.py", "helper.py", "shared.py"]
    assert sorted(b) == ["fam_b.py", "shared.py"]
    assert K.family_sources(types.SimpleNamespace(__name__="fake")) == {}


def test_family_sources_of_the_real_families_include_their_shared_helper():
    from svdq_kernels import registry
    for mod in set(registry.FAMILIES.values()):
        spec = __import__("importlib.util").util.find_spec(mod)
        src = K.family_sources(types.SimpleNamespace(__file__=spec.origin, __name__=mod))
        assert Path(spec.origin).name in src and "compiled_output.py" in src and "registry.py" not in src


def test_variant_key_changes_only_for_the_family_whose_source_changed(tmp_path):
    pkg = _kernel_pkg(tmp_path)
    fa, fb = _mod(pkg, "fam_a"), _mod(pkg, "fam_b")
    va = B.Variant.make("quantize_act", "sm_90a", {"dtype": "bf16", "rank": 0, "warps": 4, "m_tiles": 1})
    vb = B.Variant.make("quantize_act", "sm_90a", {"dtype": "bf16", "rank": 32, "warps": 4, "m_tiles": 1})
    ka, kb = K.variant_key(va, fa), K.variant_key(vb, fb)
    assert ka != kb and K.variant_key(va, fa) == ka           # deterministic
    (pkg / "helper.py").write_text("from .shared import X\nZ = 3\n")
    assert K.variant_key(va, fa) != ka and K.variant_key(vb, fb) == kb
    (pkg / "shared.py").write_text("X = 2\n")
    assert K.variant_key(vb, fb) != kb
    (pkg / "unrelated.py").write_text("Y = 3\n")
    kb2 = K.variant_key(vb, fb)
    assert K.variant_key(vb, fb) == kb2


def test_build_fingerprint_covers_config_shard_and_kernel_sources(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text((root / "configs" / "tiny.yaml").read_text())
    fp = K.build_fingerprint(cfg, None)
    assert fp is not None and fp == K.build_fingerprint(cfg, None)
    assert K.build_fingerprint(cfg, (1, 2)) not in (fp, K.build_fingerprint(cfg, (2, 2)))
    cfg.write_text(cfg.read_text() + "# edited\n")
    assert K.build_fingerprint(cfg, None) != fp
    fp2 = K.build_fingerprint(cfg, None)
    real_scan = K._scan

    def scan(path, package):        # as if kernel_src/quantize_act.py had changed
        d, imports = real_scan(path, package)
        return (d[::-1] if path.name == "quantize_act.py" else d), imports
    monkeypatch.setattr(K, "_scan", scan)
    assert K.build_fingerprint(cfg, None) != fp2


@pytest.fixture
def file_backed(monkeypatch, tmp_path):
    """The fake families, each given a source file of its own (so the cache keys on it)."""
    src = tmp_path / "fakekern"
    src.mkdir()
    (src / "gemm.py").write_text("# gemm v1\n")
    (src / "quant.py").write_text("# quant v1\n")
    calls: list[str] = []
    gemm, quant = make_gemm_family(), make_quant_family()
    for fam, f in ((gemm, "gemm"), (quant, "quant")):
        fam.__file__ = str(src / f"{f}.py")
        fam.__name__ = f"fakekern.{f}"
        real = fam.compile

        def counted(arch, knobs, name, dump_dir, _real=real):
            calls.append(name)
            return _real(arch, knobs, name, dump_dir)
        fam.compile = counted
    install_fake(monkeypatch, gemm=gemm, quant=quant)
    for n, f in (("_kernel_params", lambda c: {f"{c[10:].decode()}_0": [(0, 0, 8)]}),
                 ("_kernel_resources", lambda c: {f"{c[10:].decode()}_0": (40, 0, 0)}),
                 ("_serialize_host", lambda c: {"entry": f"host_{c}"}), ("_derive_recipe", lambda *a: None)):
        monkeypatch.setattr(B, n, f)
    return src, calls


CFG2 = CFG.replace("      stages: [auto]\n", "      stages: [auto]\n    quantize_act: {}\n").replace(
    "ranks: [0, 32, 128]", "ranks: [0, 32, 64]")


def test_cache_hits_and_one_family_rebuild(file_backed, tmp_path):
    src, calls = file_backed
    cfg = tmp_path / "t.yaml"
    cfg.write_text(CFG2)
    cache = tmp_path / "cache"
    r1 = build_set(cfg, tmp_path / "a", cache_dir=cache)
    n_gemm = sum(v.op == "gemm_w4a4" for v in r1.manifest.variants)
    n_quant = len(r1.manifest.variants) - n_gemm
    assert n_gemm == 12 and n_quant == 3 and r1.hits == 0 and len(calls) == 15
    first = (tmp_path / "a" / MANIFEST_NAME).read_bytes()

    calls.clear()
    r2 = build_set(cfg, tmp_path / "a", cache_dir=cache)          # no-op rebuild
    assert calls == [] and r2.hits == 15 and (tmp_path / "a" / MANIFEST_NAME).read_bytes() == first
    rec = A.read_record(tmp_path / "a")
    assert {v["cache"] for v in rec["variants"].values()} == {"hit"} and rec["complete"]

    r3 = build_set(cfg, tmp_path / "other", cache_dir=cache)      # another folder shares the cache
    assert calls == [] and r3.hits == 15

    cfg_b = tmp_path / "b.yaml"                                   # another config sharing variants
    cfg_b.write_text(CFG2.replace("ranks: [0, 32, 64]", "ranks: [32]").replace("name: t", "name: other"))
    r5 = build_set(cfg_b, tmp_path / "other-config", cache_dir=cache)
    assert calls == [] and r5.hits == len(r5.manifest.variants) == 5

    (src / "quant.py").write_text("# quant v2\n")                 # one kernel file changed
    r4 = build_set(cfg, tmp_path / "a", cache_dir=cache)
    assert len(calls) == n_quant and all("_quantize_act_" in c for c in calls)
    assert r4.hits == n_gemm and (tmp_path / "a" / MANIFEST_NAME).read_bytes() == first  # fake bytes unchanged

    calls.clear()
    build_set(cfg, tmp_path / "b", cache_dir=False)               # --no-cache compiles everything
    assert len(calls) == 15


def test_corrupt_cache_entry_is_a_miss(file_backed, tmp_path):
    src, calls = file_backed
    cfg = tmp_path / "t.yaml"
    cfg.write_text(CFG2)
    cache = tmp_path / "cache"
    build_set(cfg, tmp_path / "a", cache_dir=cache)
    victim = sorted((cache / K.LAYOUT).glob("*/*/cubin"))[0]
    victim.write_bytes(b"\x7fELF-garbage")
    calls.clear()
    r = build_set(cfg, tmp_path / "a", cache_dir=cache)
    assert len(calls) == 1 and r.hits == 14


# --------------------------------------------------------------------------
# A build owns what it writes, and nothing else
# --------------------------------------------------------------------------

def test_foreign_folder_is_refused_and_untouched(fake, cfg, tmp_path):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "model.cubin").write_bytes(b"not ours")
    (out / "notes.host.json").write_text("{}")
    with pytest.raises(A.ForeignDirectory, match=r"not empty and no svdq-aot build wrote it.*model\.cubin.*--force"):
        build(cfg, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.cubin", "notes.host.json"]   # not even a lock file

    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(out), "-j", "1"])
    assert r.exit_code == 4 and "--force" in r.output

    m = build(cfg, out, force=True)
    build(cfg, out)                                      # now ours: no --force needed
    cfg.write_text(CFG.replace("ranks: [0, 32, 128]", "ranks: [32]"))
    m2 = build(cfg, out)                                 # stale files of ours go; theirs stay
    assert (out / "model.cubin").read_bytes() == b"not ours" and (out / "notes.host.json").exists()
    assert len(m2.variants) < len(m.variants)
    assert listing(out) == {"model.cubin", "notes.host.json", MANIFEST_NAME, A.RECORD_NAME, "build-report.md"} | \
        {v.cubin for v in m2.variants} | {v.host_program.file for v in m2.variants}


def test_unowned_cubin_in_an_owned_folder_survives_rebuilds(fake, cfg, tmp_path):
    out = tmp_path / "art"
    build(cfg, out)
    (out / "someone-elses.cubin").write_bytes(b"x")
    (out / "theirs.host.json").write_text("{}")
    build(cfg, out)
    cfg.write_text(CFG.replace("ranks: [0, 32, 128]", "ranks: [0]"))
    build(cfg, out)
    assert (out / "someone-elses.cubin").exists() and (out / "theirs.host.json").exists()


def test_lock_is_taken_before_compiling(fake, monkeypatch, cfg, tmp_path):
    out = tmp_path / "art"
    called = []
    monkeypatch.setattr(B, "compile_one", lambda v: called.append(v))
    with A.ArtifactDir(out):
        with pytest.raises(A.BuildLocked):
            build(cfg, out, cache_dir=False)
        r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(out), "-j", "1", "--no-cache"])
        assert r.exit_code == 3 and "another svdq-aot build" in r.output
    assert called == []


def test_clean_removes_only_what_a_build_owns(fake, cfg, tmp_path):
    out = tmp_path / "art"
    build(cfg, out)
    (out / "README.md").write_text("mine")
    r = CliRunner().invoke(main, ["clean", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert MANIFEST_NAME in doc["removed"] and len(doc["removed"]) == 20 + 3
    assert {p.name for p in out.iterdir()} - {A.LOCK_NAME} == {"README.md"}
    (out / "README.md").unlink()
    build(cfg, out)
    assert CliRunner().invoke(main, ["clean", str(out)]).exit_code == 0 and not out.exists()


def test_clean_cache(fake, cfg, tmp_path):
    cache = tmp_path / "c"
    build(cfg, tmp_path / "art", cache_dir=cache)
    assert (cache / K.TAG_NAME).is_file() and K.VariantCache(cache).size()[0] == 10
    r = CliRunner().invoke(main, ["clean", "--cache", "--cache-dir", str(cache)])
    assert r.exit_code == 0 and "10 entries" in r.output and not cache.exists()
    notours = tmp_path / "precious"
    notours.mkdir()
    (notours / "f").write_text("x")
    r = CliRunner().invoke(main, ["clean", "--cache", "--cache-dir", str(notours)])
    assert r.exit_code == 1 and "not a svdq-aot cache" in r.output and (notours / "f").exists()


# --------------------------------------------------------------------------
# Failures, --keep-going, --yes, list
# --------------------------------------------------------------------------

def _failing(monkeypatch, bad: str):
    fam = make_gemm_family()
    real = fam.compile

    def compile(arch, knobs, name, dump_dir):
        if bad in name:
            raise RuntimeError("ptxas fatal: register allocation failed")
        return real(arch, knobs, name, dump_dir)
    fam.compile = compile
    install_fake(monkeypatch, gemm=fam)


BAD = "_rank0_wcscale0_bias1_tilem128_tilen256_"


def test_failure_fails_the_build_and_keep_going_builds_the_rest(fake, monkeypatch, cfg, tmp_path):
    _failing(monkeypatch, BAD)
    cache = tmp_path / "cache"
    with pytest.raises(BuildError, match=rf"variant \S*{BAD}\S*: compile failed: RuntimeError: ptxas fatal"):
        build(cfg, tmp_path / "a", cache_dir=cache)
    assert not (tmp_path / "a").exists()
    done = K.VariantCache(cache).size()[0]
    assert done >= 1                                     # what compiled before the failure is kept

    res = build_set(cfg, tmp_path / "a", cache_dir=cache, keep_going=True)
    assert len(res.manifest.variants) == 9 and list(res.failed) == [n for n in res.failed if BAD in n]
    assert any(r.name in res.failed and r.reason.startswith("compile failed: ") for r in res.manifest.rejected)
    assert res.hits == done
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "c"), "-j", "1", "--keep-going",
                                  "--cache-dir", str(cache)])
    assert r.exit_code == 0 and "FAILED svdq_gemm" in r.output and "built 9 variant(s)" in r.output
    assert "Failed (1)" in (tmp_path / "c" / "build-report.md").read_text()


def test_huge_build_needs_yes(fake, monkeypatch, cfg, tmp_path):
    monkeypatch.setattr(B, "HUGE_BUILD", 5)
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "a"), "-j", "1", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 4 and doc["exit_code"] == 4 and "10 variants to compile" in doc["error"]
    assert "expected build time" in doc["error"] and "--yes" in doc["error"]
    assert not (tmp_path / "a").exists()
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "a"), "-j", "1", "--yes", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["compiled"] == 10


def test_list_exits_nonzero_when_build_would_fail(fake, cfg, tmp_path):
    r = CliRunner().invoke(main, ["list", str(cfg)])
    assert r.exit_code == 0 and "10 valid, 2 rejected" in r.output
    cfg.write_text(CFG.replace("a: {k: 256, n: 512}", "a: {k: 256, n: 520}")
                   .replace("ranks: [0, 32, 128]", "ranks: [0, 32, 128, 64]"))
    r = CliRunner().invoke(main, ["list", str(cfg)])
    assert r.exit_code == 1
    gaps = [ln for ln in r.output.splitlines() if ln.startswith("  GAP ")]
    assert gaps and all(ln.startswith("  GAP shapes.a: ") for ln in gaps) and "similar" in gaps[0]
    assert "`svdq-aot build` would fail" in r.output
    assert max(len(ln) for ln in r.output.splitlines()) < 600
    r = CliRunner().invoke(main, ["list", str(cfg), "--json"])
    doc = json.loads(r.output)
    assert r.exit_code == 1 and doc["ok"] is False and list(doc["coverage_gaps"]) == ["shapes.a"]
    assert len(doc["coverage_gaps"]["shapes.a"]) == 8       # 4 ranks x 2 wcscale, each named
    with pytest.raises(BuildError, match="shapes.a"):
        build(cfg, tmp_path / "a")


def test_shard_selection_is_a_partition(fake, cfg, tmp_path):
    from svdq_aot.plan import parse_shard, plan_build, select_shard
    plan = plan_build(cfg)
    parts = [select_shard(plan.valid, (i, 3)) for i in (1, 2, 3)]
    assert sorted(v.name for p in parts for v in p) == sorted(v.name for v in plan.valid)
    assert select_shard(plan.valid, (2, 3)) == parts[1]
    for bad in ("0/2", "3/2", "x", "1/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)
    r = CliRunner().invoke(main, ["build", str(cfg), "--shard", "3/2"])
    assert r.exit_code == 2 and "1 <= I <= N" in r.output


def test_every_subcommand_has_real_help():
    for cmd, must in (("build", ["--jobs", "--keep-going", "--shard", "--cache-dir", "--force", "--yes", "--json"]),
                      ("list", ["--json"]), ("verify", ["--strict", "--json"]), ("inspect", ["--json"]),
                      ("merge", ["--force"]), ("clean", ["--cache"]), ("package", ["--name", "--out"]),
                      ("bench", ["--artifacts", "--quick", "--json"])):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0, (cmd, r.output)
        for opt in must:
            assert opt in r.output, (cmd, opt)
    r = CliRunner().invoke(main, ["--help"])
    assert "Exit codes" in r.output and all(c in r.output for c in ("merge", "clean", "package", "inspect"))


def test_inspect_prints_the_report_table(fake, cfg, tmp_path):
    out = tmp_path / "art"
    build(cfg, out)
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0
    rows = [ln for ln in r.output.splitlines() if ln.startswith("| `svdq_gemm")]
    assert len(rows) == 10 and all("| 128x" in ln and "| miss |" in ln for ln in rows)
    assert "## Rejected combinations (2)" in r.output and "SMEM budget exceeded" in r.output
    doc = json.loads(CliRunner().invoke(main, ["inspect", str(out), "--json"]).output)
    assert len(doc["variants"]) == 10 and doc["variants"][0]["stages"] == 2
    assert doc["variants"][0]["cubin_bytes"] == read_manifest(out).variants[0].size


def test_progress_displays(fake, cfg, tmp_path):
    import io
    from svdq_aot.progress import RichProgress, make_progress
    buf = io.StringIO()
    prog = RichProgress(buf)
    r = build_set(cfg, tmp_path / "a", progress=prog)
    text = buf.getvalue()
    assert "10/10" in text and "compiled" in text and r.compiled == 10
    buf = io.StringIO()
    build_set(cfg, tmp_path / "a", progress=RichProgress(buf))
    assert "10 of 10 variant(s) from the cache" in buf.getvalue()
    assert type(make_progress(io.StringIO())).__name__ == "LineProgress"   # not a terminal: plain lines


def test_kernel_build_switches_enter_the_key_and_the_fingerprint(tmp_path, monkeypatch):
    """A diagnosis build (SVDQ_KERNEL_* set) never shares a cache entry or an up-to-date record with a plain one;
    with no switch set, the key does not carry the field at all."""
    pkg = _kernel_pkg(tmp_path)
    fam = _mod(pkg, "fam_a")
    v = B.Variant.make("quantize_act", "sm_90a", {"dtype": "bf16", "rank": 32, "warps": 4, "m_tiles": 1})
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text((Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").read_text())
    for name in [n for n in os.environ if n.startswith(K.KERNEL_ENV_PREFIX)]:
        monkeypatch.delenv(name)
    plain_key, plain_fp = K.variant_key(v, fam), K.build_fingerprint(cfg, None)
    monkeypatch.setenv("SVDQ_KERNEL_QUANT_PROBE", "1")
    probe_key, probe_fp = K.variant_key(v, fam), K.build_fingerprint(cfg, None)
    assert probe_key != plain_key and probe_fp != plain_fp
    monkeypatch.setenv("SVDQ_KERNEL_QUANT_PROBE", "0")
    assert K.variant_key(v, fam) not in (plain_key, probe_key)
    monkeypatch.setenv("SVDQ_QUANT_PROBE", "1")          # not a kernel switch: no effect
    monkeypatch.delenv("SVDQ_KERNEL_QUANT_PROBE")
    assert K.variant_key(v, fam) == plain_key and K.build_fingerprint(cfg, None) == plain_fp

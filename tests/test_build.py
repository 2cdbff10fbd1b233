"""Build pipeline, artifact-directory safety, CLI (fake family; plus one real tiny build)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from svdq_aot import artifacts as A
from svdq_aot import build as B
from svdq_aot.build import BuildError, build
from svdq_aot.cli import main
from svdq_aot.config import ConfigError
from fakes import install_fake, make_gemm_family
from svdq_loader.manifest import (
    MANIFEST_NAME, ArtifactIntegrityError, Manifest, read_artifacts, read_manifest, sha256_file,
)


def verify_artifacts(m, out):
    return [out / n for n in read_artifacts(m, out)]

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

CFG = """
name: t
archs: [sm_90a]
out_dtypes: [bf16]
ranks: [0, 32, 128]
wcscale: [true, false]
bias: [true]
shapes:
  a: {k: 256, n: 512}
  b: {k: 128, n: 128}
variants:
  sm_90a:
    gemm_w4a4:
      tiles: [[128, 128, 64], [128, 256, 64]]
      stages: [auto]
"""


def fake_kernel_params(cubin: bytes) -> dict:
    assert cubin.startswith(b"\x7fELF-fake-")
    name = cubin[len(b"\x7fELF-fake-"):].decode()
    return {f"{name}_0": [(0, 0, 8), (1, 8, 8), (2, 16, 4)], "other_kernel": [(0, 0, 4)]}


def fake_kernel_resources(cubin: bytes) -> dict:
    name = cubin[len(b"\x7fELF-fake-"):].decode()
    return {f"{name}_0": (40, 0, 0)}


def fake_serialize_host(compiled) -> dict:
    return {"entry": f"host_{compiled}", "ops": [["add", 1, 2]]}


@pytest.fixture
def fake(monkeypatch):
    reg = install_fake(monkeypatch)
    monkeypatch.setattr(B, "_kernel_params", fake_kernel_params)
    monkeypatch.setattr(B, "_kernel_resources", fake_kernel_resources)
    monkeypatch.setattr(B, "_serialize_host", fake_serialize_host)
    monkeypatch.setattr(B, "_derive_recipe", lambda *a: None)
    return reg


@pytest.fixture
def cfg(tmp_path) -> Path:
    p = tmp_path / "t.yaml"
    p.write_text(CFG)
    return p


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} - {A.LOCK_NAME}


# --------------------------------------------------------------------------
# fake-family builds
# --------------------------------------------------------------------------

def test_the_report_and_record_name_kernel_build_switches(fake, cfg, tmp_path, monkeypatch):
    """A build made with an SVDQ_KERNEL_* switch set says so in its build record and at the top of its report;
    a plain build says nothing of switches."""
    for name in [n for n in os.environ if n.startswith("SVDQ_KERNEL_")]:
        monkeypatch.delenv(name)
    plain = tmp_path / "plain"
    build(cfg, plain)
    assert json.loads((plain / A.RECORD_NAME).read_text())["build"]["kernel_switches"] == {}
    assert "switch" not in (plain / "build-report.md").read_text()
    monkeypatch.setenv("SVDQ_KERNEL_SM90_WDECODE", "shift")
    monkeypatch.setenv("SVDQ_KERNEL_QUANT_PROBE", "1")
    exp = tmp_path / "exp"
    build(cfg, exp)
    assert json.loads((exp / A.RECORD_NAME).read_text())["build"]["kernel_switches"] == {
        "SVDQ_KERNEL_QUANT_PROBE": "1", "SVDQ_KERNEL_SM90_WDECODE": "shift"}
    head = (exp / "build-report.md").read_text().split("| variant |")[0]
    assert ("**Kernel build switches were set**: `SVDQ_KERNEL_QUANT_PROBE=1`, `SVDQ_KERNEL_SM90_WDECODE=shift`. "
            "This is an experiment or diagnosis build") in head
    # the manifest carries them too (a plain build's has no such key), so a copied or packaged build still says so
    assert read_manifest(exp).generator.kernel_switches == "SVDQ_KERNEL_QUANT_PROBE=1, SVDQ_KERNEL_SM90_WDECODE=shift"
    assert "kernel_switches" not in json.loads((plain / MANIFEST_NAME).read_text())["generator"]
    # `inspect --json` reads them back from the folder, whatever the environment of the reader
    monkeypatch.delenv("SVDQ_KERNEL_SM90_WDECODE")
    monkeypatch.delenv("SVDQ_KERNEL_QUANT_PROBE")
    doc = json.loads(CliRunner().invoke(main, ["inspect", str(exp), "--json"]).stdout)
    assert doc["kernel_switches"] == {"SVDQ_KERNEL_QUANT_PROBE": "1", "SVDQ_KERNEL_SM90_WDECODE": "shift"}
    assert json.loads(CliRunner().invoke(main, ["inspect", str(plain), "--json"]).stdout)["kernel_switches"] == {}


def test_build_writes_everything(fake, cfg, tmp_path):
    out = tmp_path / "art"
    lines = []
    m = build(cfg, out, progress=lines.append)
    # 3 ranks x 2 wcscale x 2 tiles = 12; rank 128 with tile_n 256 rejected (2)
    assert len(m.variants) == 10 and len(m.rejected) == 2
    assert all("SMEM" in r.reason for r in m.rejected)
    assert len(lines) == 10 and lines[0].startswith("[ 1/10] svdq_gemm_w4a4_sm90a_outdtypebf16_rank0_")
    assert " compiled " in lines[0] and "MiB" in lines[0]
    assert listing(out) == {MANIFEST_NAME, A.RECORD_NAME, "build-report.md"} | {v.cubin for v in m.variants} | \
        {v.host_program.file for v in m.variants}
    for v in m.variants:
        assert v.cubin == f"{v.name}.cubin" and v.host_program.file == f"{v.name}.host.json"
        assert sha256_file(out / v.cubin) == v.sha256 and (out / v.cubin).stat().st_size == v.size
        assert sha256_file(out / v.host_program.file) == v.host_program.sha256
        assert json.loads((out / v.host_program.file).read_text())["entry"] == f"host_{v.name}"
        assert v.kernel_symbols == (f"{v.name}_0",)
        assert list(v.params) == [f"{v.name}_0"]  # only this variant's kernels
        assert v.params[f"{v.name}_0"][1] == (1, 8, 8)
        assert v.resources[f"{v.name}_0"].registers == 40
        assert v.requirements == {"n_multiple": v.knobs["tile_n"], "k_multiple": v.knobs["tile_k"]}
        assert v.op == "gemm_w4a4" and v.family == "fake_gemm" and v.knobs["stages"] == 2
        assert v.host_args[0] == ("act", "ptr") and v.host_args[-2] == ("sm_count", "i32")
        assert v.entry == f"host_{v.name}"
    assert m.config.name == "t" and m.config.file == "t.yaml"
    assert m.config.sha256 == sha256_file(cfg)
    assert m.generator.package == "svdq-aot" and m.generator.dsl == "nvidia-cutlass-dsl"
    assert [(s.name, s.k, s.n) for s in m.shapes] == [("a", 256, 512), ("b", 128, 128)]
    # round trip through the reader
    again = read_manifest(out)
    assert again == m
    assert Manifest.from_json(again.to_json()) == m
    assert len(verify_artifacts(again, out)) == 20


def test_build_is_deterministic_and_rebuild_keeps_files(fake, cfg, tmp_path):
    out = tmp_path / "art"
    build(cfg, out)
    first = (out / MANIFEST_NAME).read_bytes()
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    build(cfg, out)
    assert (out / MANIFEST_NAME).read_bytes() == first
    for p in out.glob("*.cubin"):
        assert p.stat().st_mtime_ns == mtimes[p.name]  # identical files are not rewritten


def test_rebuild_removes_stale_files_after_manifest(fake, cfg, tmp_path):
    out = tmp_path / "art"
    build(cfg, out)
    (out / "README.md").write_text("keep me")
    (out / f"{A._TMP_PREFIX}junk.tmp").write_text("left by a killed build")
    cfg.write_text(CFG.replace("ranks: [0, 32, 128]", "ranks: [32]"))
    m = build(cfg, out)
    assert len(m.variants) == 4
    assert listing(out) == {MANIFEST_NAME, "README.md", A.RECORD_NAME, "build-report.md"} | \
        {v.cubin for v in m.variants} | {v.host_program.file for v in m.variants}
    verify_artifacts(read_manifest(out), out)


def test_invalid_config_writes_nothing(fake, cfg, tmp_path):
    cfg.write_text(CFG.replace("ranks: [0, 32, 128]", "ranks: [0, 33]"))
    out = tmp_path / "art"
    with pytest.raises(ConfigError, match=r"ranks\[1\]: 33"):
        build(cfg, out)
    assert not out.exists()


def test_compile_failure_names_variant_and_leaves_no_manifest(fake, monkeypatch, cfg, tmp_path):
    fam = make_gemm_family()
    real = fam.compile
    calls = []

    def flaky(arch, knobs, name, dump_dir):
        calls.append(name)
        if len(calls) == 4:
            raise RuntimeError("ptxas exploded\nsecond line")
        return real(arch, knobs, name, dump_dir)

    fam.compile = flaky
    install_fake(monkeypatch, gemm=fam)
    out = tmp_path / "art"
    with pytest.raises(BuildError) as ei:
        build(cfg, out)
    msg = str(ei.value)
    assert calls[3] in msg and "compile failed" in msg and "ptxas exploded second line" in msg
    assert not (out / MANIFEST_NAME).exists()
    assert not out.exists() or listing(out) == set()


def test_interrupted_rebuild_keeps_old_manifest_consistent(fake, monkeypatch, cfg, tmp_path):
    """Kill the write phase mid-way: whatever manifest is on disk matches its files."""
    out = tmp_path / "art"
    build(cfg, out)
    old = (out / MANIFEST_NAME).read_bytes()

    # Same variants, different bytes -> every host program conflicts with the old manifest.
    monkeypatch.setattr(B, "_serialize_host", lambda c: {"entry": f"host_{c}", "v": 2})
    monkeypatch.setenv("SVDQ_AOT_CACHE", str(tmp_path / "cache2"))   # the fake family has no sources to key on
    writes = []
    real_write = A.atomic_write_bytes

    def dying_write(path, data):
        writes.append(Path(path).name)
        if len(writes) == 5:
            raise KeyboardInterrupt("simulated kill")
        return real_write(path, data)

    monkeypatch.setattr(A, "atomic_write_bytes", dying_write)
    with pytest.raises(KeyboardInterrupt):
        build(cfg, out)
    assert MANIFEST_NAME not in writes
    if (out / MANIFEST_NAME).exists():  # if present it must still verify
        verify_artifacts(read_manifest(out), out)
    else:
        assert old != b""
    assert not list(out.glob(f"{A._TMP_PREFIX}*"))

    # A build that does not conflict leaves the old manifest valid throughout.
    monkeypatch.setattr(A, "atomic_write_bytes", real_write)
    build(cfg, out)
    verify_artifacts(read_manifest(out), out)


def test_interrupted_build_into_fresh_dir_leaves_no_manifest(fake, monkeypatch, cfg, tmp_path):
    out = tmp_path / "art"
    real_write = A.atomic_write_bytes
    n = []

    def dying_write(path, data):
        n.append(path)
        if len(n) == 7:
            raise OSError(28, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(A, "atomic_write_bytes", dying_write)
    with pytest.raises(OSError):
        build(cfg, out)
    assert not (out / MANIFEST_NAME).exists()
    assert not out.exists() or listing(out) == set()  # files written before the failure are discarded


def test_serialization_failure_names_variant(fake, monkeypatch, cfg, tmp_path):
    def bad(compiled):
        if "_rank32_" in compiled:
            raise ValueError("unsupported op llvm.fancy")
        return {"ok": 1}

    monkeypatch.setattr(B, "_serialize_host", bad)
    with pytest.raises(BuildError, match=r"variant svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_\S+: host program "
                                         r"serialisation failed: ValueError: unsupported op llvm.fancy"):
        build(cfg, tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_missing_param_info_fails(fake, monkeypatch, cfg, tmp_path):
    monkeypatch.setattr(B, "_kernel_params", lambda cubin: {"something_else": []})
    with pytest.raises(BuildError, match="has no parameter info in the cubin"):
        build(cfg, tmp_path / "art")


def test_coverage_gap_fails_before_compiling(fake, monkeypatch, cfg, tmp_path):
    # only tile_n=256 divides N=768; rank 128 + tile_n 256 is rejected -> gap
    cfg.write_text(CFG.replace("a: {k: 256, n: 512}", "a: {k: 256, n: 768}").replace("[128, 128, 64], ", "")
                   .replace("b: {k: 128, n: 128}", "b: {k: 128, n: 256}"))
    called = []
    monkeypatch.setattr(B, "compile_one", lambda v: called.append(v))
    with pytest.raises(BuildError) as ei:
        build(cfg, tmp_path / "art")
    msg = str(ei.value)
    assert "ranks[2]: gemm_w4a4 on sm_90a has no valid variant for out_dtypes[0]=bf16, ranks[2]=128" in msg
    assert "every variant was rejected, e.g.: SMEM budget exceeded" in msg and "(+1 similar)" in msg
    assert len(msg) < 1000
    assert called == []


def test_coverage_gap_of_a_shape_names_the_shape(fake, monkeypatch, cfg, tmp_path):
    cfg.write_text(CFG.replace("a: {k: 256, n: 512}", "a: {k: 256, n: 520}"))
    with pytest.raises(BuildError) as ei:
        build(cfg, tmp_path / "art")
    msg = str(ei.value)
    assert "shapes.a: a (K=256, N=520) is not served by any gemm_w4a4 variant on sm_90a" in msg
    assert "N=520 is not a multiple of 128" in msg and "similar" in msg


def test_lock_refuses_concurrent_build(fake, cfg, tmp_path):
    out = tmp_path / "art"
    with A.ArtifactDir(out):
        with pytest.raises(A.BuildLocked, match="another svdq-aot build is writing into this directory"):
            build(cfg, out)
    build(cfg, out)  # released


def test_lock_released_when_holder_dies(tmp_path):
    out = tmp_path / "art"
    code = ("import sys, os; from svdq_aot.artifacts import ArtifactDir; "
            "d = ArtifactDir(sys.argv[1]).__enter__(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True)
    with A.ArtifactDir(out):
        pass


def test_atomic_write(tmp_path):
    p = tmp_path / "x.bin"
    A.atomic_write_bytes(p, b"one")
    A.atomic_write_bytes(p, b"two")
    assert p.read_bytes() == b"two" and os.listdir(tmp_path) == ["x.bin"]


def test_out_dir_is_a_file(fake, cfg, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(NotADirectoryError):
        build(cfg, f)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def test_cli_build_verify_variants(fake, cfg, tmp_path):
    out = tmp_path / "art"
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(out), "-j", "1"])
    assert r.exit_code == 0, r.output
    assert "[ 1/10] " in r.output
    assert "built 10 variant(s) (0 from the cache, 10 compiled), rejected 2" in r.output and str(out) in r.output
    assert ("rejected svdq_gemm_w4a4_sm90a_outdtypebf16_rank128_wcscale1_bias1_tilem128_tilen256_tilek64"
            "_stages2_reqn256k64: SMEM") in r.output

    r = CliRunner().invoke(main, ["verify", str(out)])   # fake bytes: verify cross-checks them and says so
    assert r.exit_code == 1 and "corrupt host program" in r.output and "Traceback" not in r.output

    r = CliRunner().invoke(main, ["variants", str(cfg)])
    assert r.exit_code == 0
    assert "10 valid, 2 rejected" in r.output and "SMEM budget" in r.output


def test_cli_build_names_kernel_build_switches(fake, cfg, tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("SVDQ_KERNEL_")]:
        monkeypatch.delenv(name)
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "plain"), "-j", "1"])
    assert r.exit_code == 0 and "switch" not in r.output
    monkeypatch.setenv("SVDQ_KERNEL_SM90_WDECODE", "shift")
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "exp"), "-j", "1"])
    assert r.exit_code == 0
    assert "kernel build switches set (an experiment or diagnosis build): SVDQ_KERNEL_SM90_WDECODE=shift" in r.output
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "exp2"), "-j", "1", "--json"])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["kernel_switches"] == {"SVDQ_KERNEL_SM90_WDECODE": "shift"}


def test_cli_errors_are_one_line(fake, cfg, tmp_path):
    cfg.write_text(CFG.replace("ranks: [0, 32, 128]", "ranks: [true]"))
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "art"), "-j", "1"])
    assert r.exit_code == 1
    assert r.output.startswith("Error: ") and r.output.count("\n") == 1 and "ranks[0]" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "art").exists()

    r = CliRunner().invoke(main, ["variants", str(cfg)])
    assert r.exit_code == 1 and "ranks[0]" in r.output

    r = CliRunner().invoke(main, ["build", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 1 and "not found" in r.output

    r = CliRunner().invoke(main, ["verify", str(tmp_path / "nowhere")])
    assert r.exit_code == 1 and "does not exist" in r.output


def test_cli_build_failure_and_tamper(fake, monkeypatch, cfg, tmp_path):
    out = tmp_path / "art"
    assert CliRunner().invoke(main, ["build", str(cfg), "-o", str(out), "-j", "1"]).exit_code == 0
    victim = sorted(out.glob("*.cubin"))[0]
    data = bytearray(victim.read_bytes())
    data[5] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and victim.name in r.output and "sha256 mismatch" in r.output

    monkeypatch.setattr(B, "_serialize_host", lambda c: (_ for _ in ()).throw(ValueError("nope")))
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "b"), "--no-cache", "-j", "1"])
    assert r.exit_code == 1 and r.output.splitlines()[-1].startswith("Error: variant svdq_gemm_w4a4_")
    assert "Traceback" not in r.output and not (tmp_path / "b").exists()


def test_console_script_help():
    exe = shutil.which("svdq-aot")
    if exe is None:
        pytest.skip("svdq-aot console script not installed (pip install -e .)")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "build" in r.stdout and "verify" in r.stdout


# --------------------------------------------------------------------------
# Real build (the actual kernel family, cross-compiled on the CPU)
# --------------------------------------------------------------------------

def _have(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except ImportError:
        return False


def _real_pieces_missing() -> str | None:
    for mod in ("svdq_kernels.registry", "svdq_kernels.sm90_wgmma_w4a4", "svdq_kernels.quantize_act", "svdq_aot.host_ir",
                "svdq_loader.cubin_info", "cutlass"):
        if not _have(mod):
            return f"{mod} not importable"
    return None


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    why = _real_pieces_missing()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("tiny") / "artifacts"
    lines = []
    m = build(TINY, out, jobs=2, progress=lines.append)  # jobs=2: exercises the process pool
    return out, m, lines


def test_real_tiny_build(tiny_build):
    out, m, lines = tiny_build
    assert len(m.variants) == 4 and len(lines) == 4
    assert sorted(v.op for v in m.variants) == ["gemm_w4a4"] * 2 + ["quantize_act"] * 2
    for v in m.variants:
        cubin = (out / v.cubin).read_bytes()
        assert cubin.startswith(b"\x7fELF") and sha256_file(out / v.cubin) == v.sha256
        assert v.kernel_symbols and all(s in v.params and v.params[s] for s in v.kernel_symbols)
        assert all("cutlass" not in s for s in v.kernel_symbols)
        assert v.arch == "sm_90a" and v.knobs[{"gemm_w4a4": "out_dtype", "quantize_act": "dtype"}[v.op]] == "bf16"
        assert v.family == {"gemm_w4a4": "sm90_wgmma_w4a4", "quantize_act": "quantize_act"}[v.op]
        json.loads((out / v.host_program.file).read_text())
    assert read_manifest(out) == m
    assert Manifest.from_json(m.to_json()) == m
    verify_artifacts(read_manifest(out), out)


def test_real_tiny_tamper(tiny_build, tmp_path):
    out, m, _ = tiny_build
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    v = m.variants[0]
    p = copy / v.cubin
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError) as ei:
        verify_artifacts(read_manifest(copy), copy)
    assert v.cubin in str(ei.value) and v.sha256 in str(ei.value)


def test_real_invalid_config_no_manifest(tmp_path):
    why = _real_pieces_missing()
    if why:
        pytest.skip(why)
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("ranks: [0, 32]", "ranks: [0, 20]"))
    out = tmp_path / "art"
    with pytest.raises(ConfigError, match=r"bad.yaml: ranks\[1\]: 20"):
        build(bad, out)
    assert not (out / MANIFEST_NAME).exists()

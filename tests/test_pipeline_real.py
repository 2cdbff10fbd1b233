"""The real pipeline on configs/tiny.yaml (the DSL cross-compiles on the CPU): reproducibility, signals.

* two clean builds (cold caches) at -j 1 and -j 2, and shard 1/2 + 2/2 merged, give byte-identical
  manifests, cubins and host programs; a no-op rebuild compiles nothing;
* SIGKILL of a -j 2 build leaves no compile worker running; SIGINT exits 130, writes no manifest,
  leaves no worker, and the next build resumes from the cache.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from svdq_aot import artifacts as A
from svdq_aot.build import build_set
from svdq_aot.cache import VariantCache
from svdq_aot.merge import merge
from svdq_aot.errors import MergeError
from svdq_loader.manifest import MANIFEST_NAME
from svdq_loader.verify import open_artifacts

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

pytestmark = pytest.mark.skipif(__import__("importlib.util").util.find_spec("cutlass") is None,
                                reason="nvidia-cutlass-dsl is not installed")


def _artifact_bytes(d: Path) -> dict[str, bytes]:
    """Everything the reproducibility promise covers (the build record and report are excluded by name)."""
    return {p.name: p.read_bytes() for p in d.iterdir()
            if p.name == MANIFEST_NAME or p.name.endswith((".cubin", ".host.json"))}


def test_reproducible_across_jobs_cache_and_shards(tmp_path):
    a = build_set(TINY, tmp_path / "j1", jobs=1, cache_dir=tmp_path / "c1")
    b = build_set(TINY, tmp_path / "j2", jobs=2, cache_dir=tmp_path / "c2")
    assert a.compiled == b.compiled == 4 and a.hits == b.hits == 0
    ref = _artifact_bytes(tmp_path / "j1")
    assert len(ref) == 9 and _artifact_bytes(tmp_path / "j2") == ref

    s1 = build_set(TINY, tmp_path / "s1", jobs=1, shard=(1, 2), cache_dir=tmp_path / "c3")
    s2 = build_set(TINY, tmp_path / "s2", jobs=1, shard=(2, 2), cache_dir=tmp_path / "c3")
    assert s1.compiled == s2.compiled == 2
    assert {v.name for v in s1.manifest.variants}.isdisjoint(v.name for v in s2.manifest.variants)
    merge(tmp_path / "merged", [tmp_path / "s2", tmp_path / "s1"])
    assert _artifact_bytes(tmp_path / "merged") == ref
    open_artifacts(tmp_path / "merged")
    with pytest.raises(MergeError, match=r"missing shard\(s\) 2/2"):
        merge(tmp_path / "m2", [tmp_path / "s1"])
    with pytest.raises(MergeError, match="not the output of a complete `svdq-aot build --shard"):
        merge(tmp_path / "m3", [tmp_path / "s1", tmp_path / "j1"])

    _merge_refusals(tmp_path)

    t0 = time.perf_counter()
    again = build_set(TINY, tmp_path / "j1", jobs=2, cache_dir=tmp_path / "c1")   # no-op rebuild
    assert again.up_to_date and again.compiled == 0 and again.hits == 4 and time.perf_counter() - t0 < 20
    assert _artifact_bytes(tmp_path / "j1") == ref
    assert A.read_record(tmp_path / "j1")["build"]["jobs"] == 1          # nothing was rewritten

    (tmp_path / "j1" / "build-report.md").unlink()                      # not intact any more: rebuild
    again = build_set(TINY, tmp_path / "j1", jobs=2, cache_dir=tmp_path / "c1")
    assert not again.up_to_date and again.compiled == 0 and again.hits == 4
    assert _artifact_bytes(tmp_path / "j1") == ref and (tmp_path / "j1" / "build-report.md").is_file()
    rec = A.read_record(tmp_path / "j1")
    assert rec["complete"] and rec["build"]["jobs"] == 2 and set(rec["variants"]) == {
        v.name for v in again.manifest.variants}
    victim = sorted((tmp_path / "j1").glob("*.cubin"))[0]                # a tampered file is rebuilt
    victim.write_bytes(victim.read_bytes()[:-4] + b"\0\0\0\1")
    again = build_set(TINY, tmp_path / "j1", jobs=1, cache_dir=tmp_path / "c1")
    assert not again.up_to_date and again.hits == 4 and _artifact_bytes(tmp_path / "j1") == ref


def _reseal(d: Path, **changes) -> None:
    """Edit the manifest's top-level records and give it a valid checksum again (a consistent edit)."""
    import dataclasses
    from svdq_loader.manifest import read_manifest
    m = read_manifest(d)
    new = dataclasses.replace(m, **{k: dataclasses.replace(getattr(m, k), **v) for k, v in changes.items()})
    (d / MANIFEST_NAME).write_text(new.to_json())


def _merge_refusals(tmp_path: Path) -> None:
    import json
    import shutil
    with pytest.raises(MergeError, match=r"shard 1/2 given twice"):
        merge(tmp_path / "m4", [tmp_path / "s1", tmp_path / "s1"])
    for what, edit, msg in (
            ("cfg", dict(config={"name": "other"}), "differ in config"),
            ("ver", dict(generator={"dsl_version": "9.9.9"}), r"differ in versions \(svdq-aot, DSL, Python\)"),
            ("switch", dict(generator={"kernel_switches": "SVDQ_KERNEL_SM90_WDECODE=shift"}),
             r"differ in kernel build switches")):
        bad = tmp_path / f"s2-{what}"
        shutil.copytree(tmp_path / "s2", bad)
        _reseal(bad, **edit)
        open_artifacts(bad)                      # still a valid artifact set on its own
        with pytest.raises(MergeError, match=msg):
            merge(tmp_path / f"m-{what}", [tmp_path / "s1", bad])
        assert not (tmp_path / f"m-{what}").exists()
    bad = tmp_path / "s2-count"
    shutil.copytree(tmp_path / "s2", bad)
    rec = json.loads((bad / A.RECORD_NAME).read_text())
    rec["shard"] = [2, 3]
    (bad / A.RECORD_NAME).write_text(json.dumps(rec))
    with pytest.raises(MergeError, match="differ in shard count"):
        merge(tmp_path / "m-count", [tmp_path / "s1", bad])
    # shard 1's folder relabelled as shard 2: its variants would be in two shards
    shutil.copytree(tmp_path / "s1", tmp_path / "s1-as-2")
    rec1 = json.loads((tmp_path / "s1-as-2" / A.RECORD_NAME).read_text())
    rec1["shard"] = [2, 2]
    (tmp_path / "s1-as-2" / A.RECORD_NAME).write_text(json.dumps(rec1))
    with pytest.raises(MergeError, match="is in two shards"):
        merge(tmp_path / "m-dup", [tmp_path / "s1", tmp_path / "s1-as-2"])


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(st.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _default_sigint() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt handler:
    the build under test gets SIGINT's default disposition, as in a terminal, wherever the tests run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_build(tmp_path: Path, out: Path) -> tuple[subprocess.Popen, list[int]]:
    env = dict(os.environ, SVDQ_AOT_CACHE=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-m", "svdq_aot.cli", "build", str(TINY), "-o", str(out), "-j", "2"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=_default_sigint)
    t0 = time.time()
    kids: list[int] = []
    while time.time() - t0 < 60 and len(kids) < 2:
        kids = _children(p.pid)
        time.sleep(0.1)
    assert len(kids) == 2, "the build did not start two compile workers"
    time.sleep(0.3)                       # the workers are importing the DSL or compiling now
    return p, kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_leaves_no_orphan_workers(tmp_path):
    out = tmp_path / "art"
    p, kids = _start_build(tmp_path, out)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids), "compile workers outlived their killed parent"
    assert not (out / MANIFEST_NAME).exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigint_exits_130_and_the_next_build_resumes(tmp_path):
    out = tmp_path / "art"
    p, kids = _start_build(tmp_path, out)
    os.killpg(p.pid, signal.SIGINT)                   # what Ctrl-C does: the whole process group
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    assert not any(_alive(k) for k in kids)
    assert not (out / MANIFEST_NAME).exists()
    cached = VariantCache(tmp_path / "cache").size()[0]
    res = build_set(TINY, out, jobs=1, cache_dir=tmp_path / "cache")
    assert res.hits == cached and res.compiled == 4 - cached
    open_artifacts(out)


def test_verify_reports_unlisted_files_and_refuses_what_load_refuses(tiny_artifacts, tmp_path):
    import json
    import shutil
    from click.testing import CliRunner
    from svdq_aot.cli import main
    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifacts, copy)
    (copy / "stray.cubin").write_bytes(b"\x7fELF")
    (copy / "notes").mkdir()
    r = CliRunner().invoke(main, ["verify", str(copy)])
    assert r.exit_code == 0 and "unlisted: stray.cubin" in r.output and "unlisted: notes/" in r.output
    assert "build-report.md" not in r.output           # the build's own report is listed by its record
    r = CliRunner().invoke(main, ["verify", str(copy), "--strict", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False and doc["unlisted"] == ["notes/", "stray.cubin"]
    # a host program load() rejects is rejected by verify too (the one shared check)
    host = sorted(copy.glob("*.host.json"))[0]
    host.write_text(host.read_text().replace('"', "'", 1))
    r = CliRunner().invoke(main, ["verify", str(copy), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False and host.name in doc["error"]
    with pytest.raises(Exception, match=host.name):
        __import__("svdq_loader").load(str(copy))

"""Artifact wheels and `load()` with no path.

Unit tests of the search order and the version check, then the container story end to end on a
real tiny build: package it, build this project's own wheel, install both into a fresh venv that
has no DSL (no system site-packages), load the artifacts there with no path argument and verify them.

No package index is needed: the fresh venv gets pip from `ensurepip`, our two wheels are installed
with ``--no-index --no-deps``, and the runtime requirements of svdq-aot (found from its installed
metadata, transitively: cuda-python, numpy, pyyaml, click and what they need) are made importable by
linking exactly those distributions from the test's own environment into a folder named by a
``.pth`` file.  The DSL is not among them, and the test checks that it cannot be imported there.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from svdq_aot.package import PackageError, package
from svdq_loader import discovery as D
from svdq_loader.errors import ArtifactsNotFound, IncompatibleArtifacts

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# The search order and the version range
# --------------------------------------------------------------------------

def _no_packages(monkeypatch):
    monkeypatch.setattr(D.importlib.metadata, "entry_points", lambda group: [])


def test_nothing_found_lists_every_place_searched(monkeypatch, tmp_path):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    _no_packages(monkeypatch)
    with pytest.raises(ArtifactsNotFound) as ei:
        D.find_artifacts()
    msg = str(ei.value)
    assert "$SVDQ_ARTIFACTS: not set" in msg and "'svdq_loader.artifacts': no artifact package installed" in msg
    assert f"{tmp_path}/artifacts/manifest.json does not exist" in msg
    assert msg.index("SVDQ_ARTIFACTS") < msg.index("entry points") < msg.index("./artifacts")


def test_env_var_then_local_folder(monkeypatch, tmp_path):
    _no_packages(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "manifest.json").write_text("{}")
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    assert D.find_artifacts() == D.Found(str(tmp_path / "artifacts"), "./artifacts")
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv(D.ENV_VAR, str(other))
    with pytest.raises(ArtifactsNotFound, match="SVDQ_ARTIFACTS is .*other.* does not exist"):
        D.find_artifacts()
    (other / "manifest.json").write_text("{}")
    assert D.find_artifacts().path == str(other)


class _EP:
    def __init__(self, name, mod, dist=("svdq-kernels-x", "1.0.0")):
        self.name, self.value, self._mod = name, mod.__name__, mod
        self.dist = types.SimpleNamespace(name=dist[0], version=dist[1])

    def load(self):
        return self._mod


def _pkg_module(tmp_path, lo, below):
    d = tmp_path / "pkgart"
    d.mkdir(exist_ok=True)
    return types.SimpleNamespace(__name__="svdq_kernels_x", LOADER_MIN=lo, LOADER_BELOW=below,
                                 artifacts_dir=lambda: str(d))


def test_installed_package_is_found_and_checked(monkeypatch, tmp_path):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    good = _pkg_module(tmp_path, *D.compatible_range(D.__version__))
    monkeypatch.setattr(D.importlib.metadata, "entry_points", lambda group: [_EP("x", good)])
    f = D.find_artifacts()
    assert f.path == str(tmp_path / "pkgart") and f.how == "artifact package svdq-kernels-x 1.0.0"

    bad = _pkg_module(tmp_path, "9.1.0", "9.2")
    monkeypatch.setattr(D.importlib.metadata, "entry_points", lambda group: [_EP("x", bad)])
    with pytest.raises(IncompatibleArtifacts) as ei:
        D.find_artifacts()
    msg = str(ei.value)
    assert "svdq-kernels-x 1.0.0 was built for svdq_loader >=9.1.0,<9.2" in msg
    assert f"the installed svdq_loader is {D.__version__}" in msg

    monkeypatch.setattr(D.importlib.metadata, "entry_points",
                        lambda group: [_EP("x", good), _EP("y", good, ("svdq-kernels-y", "2.0"))])
    with pytest.raises(ArtifactsNotFound, match="2 artifact packages are installed"):
        D.find_artifacts()


def test_compatible_range():
    assert D.compatible_range("0.1.0") == ("0.1.0", "0.2")
    assert D.compatible_range("0.3.2") == ("0.3.2", "0.4")
    assert D.compatible_range("1.4.0") == ("1.4.0", "2")
    D.check_compatible("x", "0.1.0", "0.2", loader="0.1.9")
    for v in ("0.0.9", "0.2.0", "1.0"):
        with pytest.raises(IncompatibleArtifacts, match=rf"installed svdq_loader is {re.escape(v)}"):
            D.check_compatible("x", "0.1.0", "0.2", loader=v)


# --------------------------------------------------------------------------
# The wheel
# --------------------------------------------------------------------------

def test_package_refuses_bad_names_and_tampered_artifacts(tiny_artifacts, tmp_path):
    with pytest.raises(PackageError, match="distribution name"):
        package(tiny_artifacts, tmp_path, name="-bad-")
    with pytest.raises(PackageError, match="release version"):
        package(tiny_artifacts, tmp_path, version="one")
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifacts, copy)
    victim = sorted(copy.glob("*.cubin"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x55
    victim.write_bytes(bytes(data))
    from svdq_loader.manifest import ArtifactError
    with pytest.raises(ArtifactError, match=victim.name):
        package(copy, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_wheel_contents_metadata_and_reproducibility(tiny_artifacts, tmp_path):
    p = package(tiny_artifacts, tmp_path / "a")
    q = package(tiny_artifacts, tmp_path / "b")
    assert p.wheel.name == "svdq_kernels_tiny-1.0.0-py3-none-any.whl"
    assert p.wheel.read_bytes() == q.wheel.read_bytes()          # reproducible
    with zipfile.ZipFile(p.wheel) as z:
        names = z.namelist()
        meta = z.read("svdq_kernels_tiny-1.0.0.dist-info/METADATA").decode()
        eps = z.read("svdq_kernels_tiny-1.0.0.dist-info/entry_points.txt").decode()
        lic = z.read("svdq_kernels_tiny-1.0.0.dist-info/LICENSE").decode()
        record = z.read("svdq_kernels_tiny-1.0.0.dist-info/RECORD").decode()
    art = sorted(n.split("/")[-1] for n in names if n.startswith("svdq_kernels_tiny/artifacts/"))
    want = sorted(["manifest.json"] + [p.name for p in tiny_artifacts.iterdir()
                                       if p.name.endswith((".cubin", ".host.json"))])
    assert art == want                                           # the manifest's files, nothing else
    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist: ")]
    assert requires == ["svdq-aot>=0.1.0,<0.2"] and "License: Apache-2.0" in meta
    assert not any(re.search(r"cutlass|cute|nvcc|ptxas", n, re.I) for n in names)
    assert "[svdq_loader.artifacts]\ntiny = svdq_kernels_tiny\n" == eps
    assert "Apache License" in lic and "Version 2.0" in lic
    assert all(n in record for n in names)


def _setuptools_major() -> int:
    try:
        return int(md.version("setuptools").split(".")[0])
    except (md.PackageNotFoundError, ValueError):
        return 0


def _runtime_distributions() -> list[md.Distribution]:
    """svdq-aot's runtime requirements, transitively, as installed here (extras skipped)."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover
        pytest.skip("packaging is not installed")
    env = dict(default_environment(), extra="")
    seen: dict[str, md.Distribution] = {}
    todo = [r for r in md.requires("svdq-aot") or []]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        seen[key] = dist
        todo += list(dist.requires or [])
    return list(seen.values())


def _link_distributions(dists, target: Path) -> list[str]:
    target.mkdir()
    linked = []
    for dist in dists:
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        base = Path(dist.locate_file(""))
        for top in sorted(tops):
            src = base / top
            if src.exists() and not (target / top).exists():
                os.symlink(src, target / top)
                linked.append(top)
    return linked


@pytest.mark.skipif(sys.platform.startswith("win"), reason="POSIX venv layout")
def test_wheel_installs_into_a_fresh_venv_without_the_dsl(tiny_artifacts, tmp_path):
    p = package(tiny_artifacts, tmp_path / "dist", name="svdq-kernels-ci")
    wheels = tmp_path / "wheels"
    # Offline when this environment has setuptools (it is the build backend); else pip fetches it.
    isolation = ["--no-build-isolation"] if _setuptools_major() >= 68 else []
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                        "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and not isolation and "No matching distribution" in r.stderr:
        pytest.skip("no setuptools here and no package index reachable to build svdq-aot's wheel")
    assert r.returncode == 0, r.stderr[-2000:]
    ours = sorted(wheels.glob("svdq_aot-*.whl"))
    assert ours, list(wheels.iterdir())

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    dists = _runtime_distributions()
    names = {d.metadata["Name"].lower() for d in dists}
    assert {"numpy", "click", "pyyaml"} <= names and not any("cutlass" in n for n in names)
    _link_distributions(dists, tmp_path / "runtime-deps")
    (site / "svdq-runtime-deps.pth").write_text(str(tmp_path / "runtime-deps") + "\n")

    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(ours[0]), str(p.wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]

    code = r"""
import importlib.util, json, sys
import svdq_loader
assert importlib.util.find_spec("cutlass") is None, "the DSL is importable in the runtime venv"
lib = svdq_loader.load()
from svdq_loader.discovery import find_artifacts
found = find_artifacts()
print(json.dumps({"how": found.how, "path": found.path, "variants": sorted(v.name for v in lib.variants),
                  "dsl": "cutlass" in sys.modules, "loader": svdq_loader.__file__}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("SVDQ_ARTIFACTS", "PYTHONPATH", "VIRTUAL_ENV")}
    work = tmp_path / "cwd"          # no ./artifacts here
    work.mkdir()
    r = subprocess.run([str(py), "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["how"] == "artifact package svdq-kernels-ci 1.0.0" and str(venv) in doc["path"]
    assert str(venv) in doc["loader"] and doc["dsl"] is False
    from svdq_loader.manifest import read_manifest
    assert doc["variants"] == sorted(v.name for v in read_manifest(tiny_artifacts).variants)

    r = subprocess.run([str(venv / "bin" / "svdq-aot"), "verify", doc["path"]], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("OK: "), r.stdout + r.stderr

    # packaging again from the installed copy, in the DSL-free venv, gives the same wheel bytes
    r = subprocess.run([str(venv / "bin" / "svdq-aot"), "package", doc["path"], "-o", str(tmp_path / "again"),
                        "--name", "svdq-kernels-ci"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "again" / p.wheel.name).read_bytes() == p.wheel.read_bytes()

    # an artifact package built for another loader is refused, naming both versions
    init = Path(doc["path"]).parent / "__init__.py"
    init.write_text(init.read_text().replace("LOADER_MIN = '0.1.0'", "LOADER_MIN = '7.0.0'")
                    .replace("LOADER_BELOW = '0.2'", "LOADER_BELOW = '8'"))
    r = subprocess.run([str(py), "-c", "import svdq_loader; svdq_loader.load()"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "IncompatibleArtifacts" in r.stderr
    assert ">=7.0.0,<8" in r.stderr and "installed svdq_loader is 0.1.0" in r.stderr

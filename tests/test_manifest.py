"""Manifest schema: round trip, strict validation, versions, integrity, import isolation."""
from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from svdq_loader import manifest as M
from svdq_loader.manifest import (
    ArtifactIntegrityError, Manifest, ManifestError, open_artifacts, read_manifest, verify_artifacts,
)

CUBIN = b"\x7fELF" + bytes(range(256)) * 4
HOST = b'{"entry":"svdq_host_x"}\n'
NAME = "svdq_w4a4_sm_90a_bf16_r32_wc1_b1_t128x128x64_c1x1_s2"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def doc() -> dict:
    return {
        "schema_version": 1,
        "generator": {"package": "svdq-aot", "package_version": "0.1.0", "dsl": "nvidia-cutlass-dsl",
                      "dsl_version": "4.8.1", "python": "3.11.7"},
        "config": {"name": "flux", "sha256": "0" * 64, "file": "flux.yaml"},
        "shapes": [{"name": "qkv", "k": 3072, "n": 9216}],
        "variants": [{
            "name": NAME, "arch": "sm_90a", "family": "sm90_w4a4",
            "knobs": {"out_dtype": "bf16", "rank": 32, "wcscale": True, "bias": True, "tile_m": 128,
                      "tile_n": 128, "tile_k": 64, "cluster_m": 1, "cluster_n": 1, "stages": 2},
            "cubin": f"{NAME}.cubin", "sha256": sha(CUBIN), "size": len(CUBIN),
            "host_program": {"file": f"{NAME}.host.json", "sha256": sha(HOST)},
            "entry": "svdq_host_x", "kernel_symbols": ["svdq_k_0"],
            "params": {"svdq_k_0": [{"index": 0, "offset": 0, "size": 128},
                                    {"index": 1, "offset": 128, "size": 4}]},
            "host_args": [["act", "ptr"], ["m", "i32"], ["stream", "stream"]],
            "smem_bytes": 66048,
            "requirements": {"n_multiple": 128, "k_multiple": 64, "ptr_align": 16}}],
        "rejected": [{"name": "svdq_w4a4_x", "reason": "SMEM budget"}],
    }


def write_dir(tmp_path: Path, d: dict | None = None) -> Path:
    out = tmp_path / "art"
    out.mkdir(exist_ok=True)
    (out / f"{NAME}.cubin").write_bytes(CUBIN)
    (out / f"{NAME}.host.json").write_bytes(HOST)
    (out / "manifest.json").write_text(json.dumps(d if d is not None else doc()))
    return out


def test_round_trip_and_types(tmp_path):
    out = write_dir(tmp_path)
    m = read_manifest(out)
    v = m.variants[0]
    assert m.schema_version == M.SCHEMA_VERSION == 1
    assert v.knobs.rank == 32 and v.knobs.wcscale is True and v.requirements.ptr_align == 16
    assert v.params["svdq_k_0"][1] == (1, 128, 4) and v.params["svdq_k_0"][1].offset == 128
    idx, off, size = v.params["svdq_k_0"][0]
    assert (idx, off, size) == (0, 0, 128)
    assert v.host_args == (("act", "ptr"), ("m", "i32"), ("stream", "stream"))
    assert vars(v.knobs)["tile_n"] == 128  # the selector reads knobs this way
    assert v.serves(3072, 9216) and not v.serves(3072, 9200)
    assert m.variant(NAME) is v
    assert json.loads(m.to_json()) == doc()
    assert Manifest.from_json(m.to_json()) == m
    assert m.to_json() == Manifest.from_dict(doc()).to_json()
    assert [p.name for p in verify_artifacts(m, out)] == [f"{NAME}.cubin", f"{NAME}.host.json"]
    assert open_artifacts(out) == m


def _broken(fn) -> dict:
    d = copy.deepcopy(doc())
    fn(d)
    return d


V0 = "variants[0] (" + NAME + ")"


@pytest.mark.parametrize("fn, words", [
    (lambda d: d.pop("shapes"), ["missing key", "shapes"]),
    (lambda d: d.update(extra=1), ["extra", "unknown key"]),
    (lambda d: d["variants"][0]["knobs"].update(rank=True), [f"{V0}.knobs.rank", "True", "integer"]),
    (lambda d: d["variants"][0]["knobs"].update(rank=24), [f"{V0}.knobs.rank", "24", "multiple of 16"]),
    (lambda d: d["variants"][0]["knobs"].update(wcscale=1), [f"{V0}.knobs.wcscale", "1", "true or false"]),
    (lambda d: d["variants"][0]["knobs"].update(out_dtype="fp8"), ["out_dtype", "'fp8'"]),
    (lambda d: d["variants"][0]["knobs"].pop("stages"), ["knobs", "missing key", "stages"]),
    (lambda d: d["variants"][0].update(sha256="ABC"), [f"{V0}.sha256", "'ABC'", "SHA-256"]),
    (lambda d: d["variants"][0].update(size="12"), [f"{V0}.size", "'12'", "integer"]),
    (lambda d: d["variants"][0].update(cubin="../etc/passwd"), [f"{V0}.cubin", "../etc/passwd", "plain file"]),
    (lambda d: d["variants"][0].update(cubin="sub/x.cubin"), ["sub/x.cubin", "plain file"]),
    (lambda d: d["variants"][0].update(cubin="/abs.cubin"), ["/abs.cubin", "plain file"]),
    (lambda d: d["variants"][0].update(cubin=".."), ["'..'", "plain file"]),
    (lambda d: d["variants"][0].update(cubin="a..b"), ["a..b", "plain file"]),
    (lambda d: d["variants"][0]["host_program"].update(file="..\\x"), ["host_program.file", "plain file"]),
    (lambda d: d["variants"][0].update(cubin="manifest.json"), ["manifest.json", "named like the manifest"]),
    (lambda d: d["variants"][0]["host_program"].update(file=f"{NAME}.cubin"), ["already referenced"]),
    (lambda d: d["variants"].append(copy.deepcopy(d["variants"][0])), ["duplicate variant name"]),
    (lambda d: d["variants"][0].update(kernel_symbols=[]), ["kernel_symbols", "at least one"]),
    (lambda d: d["variants"][0].update(params={}), [f"{V0}.params", "one entry per kernel symbol"]),
    (lambda d: d["variants"][0]["params"]["svdq_k_0"][1].update(index=5), ["indices must be 0..n-1"]),
    (lambda d: d["variants"][0]["params"]["svdq_k_0"][0].update(size=0), ["size", "must be >= 1"]),
    (lambda d: d["variants"][0].update(host_args=[["act"]]), ["host_args[0]", "[name, kind]"]),
    (lambda d: d["variants"][0].update(host_args=[["a", "ptr"], ["a", "i32"]]), ["duplicate host argument"]),
    (lambda d: d["variants"][0]["requirements"].update(n_multiple=0), ["n_multiple", "0", ">= 1"]),
    (lambda d: d["shapes"][0].update(k=0), ["shapes[0].k", "0"]),
    (lambda d: d["generator"].update(package="other"), ["generator.package", "'other'"]),
    (lambda d: d["generator"].update(package_version="1.0.0"),
     ["generator.package_version", "1.0.0", "major versions 1 vs 0 differ"]),
    (lambda d: d["generator"].update(package_version="latest"), ["package_version", "'latest'"]),
    (lambda d: d.update(rejected={}), ["rejected", "expected a list"]),
])
def test_schema_rejections(tmp_path, fn, words):
    out = write_dir(tmp_path, _broken(fn))
    with pytest.raises(ManifestError) as ei:
        read_manifest(out)
    msg = str(ei.value)
    assert str(out / "manifest.json") in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("version", [2, 0, "1", True, None])
def test_unknown_schema_version(tmp_path, version):
    out = write_dir(tmp_path, _broken(lambda d: d.update(schema_version=version)))
    with pytest.raises(ManifestError) as ei:
        read_manifest(out)
    msg = str(ei.value)
    assert f"schema_version {version!r} is not readable" in msg and "reads schema_version [1]" in msg


def test_dsl_and_python_versions_are_informational(tmp_path):
    out = write_dir(tmp_path, _broken(lambda d: d["generator"].update(dsl_version="9.9", python="3.99.0")))
    assert read_manifest(out).generator.dsl_version == "9.9"
    out2 = write_dir(tmp_path, _broken(lambda d: d["generator"].update(package_version="0.7.3")))
    read_manifest(out2)  # same major


def test_not_json_and_missing(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "e").mkdir()
    with pytest.raises(ManifestError, match="no manifest"):
        read_manifest(tmp_path / "e")
    out = write_dir(tmp_path)
    (out / "manifest.json").write_text('{"schema_version": 1,\n "x": }')
    with pytest.raises(ManifestError, match="not valid JSON at line 2"):
        read_manifest(out)
    (out / "manifest.json").write_text('{"schema_version": 1, "schema_version": 1}')
    with pytest.raises(ManifestError, match="duplicate key 'schema_version'"):
        read_manifest(out)
    (out / "manifest.json").write_text("[1]")
    with pytest.raises(ManifestError, match="expected a JSON object"):
        read_manifest(out)


def test_tamper_flip_byte(tmp_path):
    out = write_dir(tmp_path)
    m = read_manifest(out)
    p = out / f"{NAME}.cubin"
    data = bytearray(p.read_bytes())
    data[100] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError) as ei:
        verify_artifacts(m, out)
    msg = str(ei.value)
    assert f"{NAME}.cubin" in msg and "sha256 mismatch" in msg
    assert sha(CUBIN) in msg and sha(bytes(data)) in msg
    with pytest.raises(ArtifactIntegrityError):
        open_artifacts(out)


def test_tamper_size_missing_and_all_reported(tmp_path):
    out = write_dir(tmp_path)
    m = read_manifest(out)
    (out / f"{NAME}.cubin").write_bytes(CUBIN + b"x")
    (out / f"{NAME}.host.json").unlink()
    with pytest.raises(ArtifactIntegrityError) as ei:
        verify_artifacts(m, out)
    assert len(ei.value.problems) == 2
    msg = str(ei.value)
    assert "size mismatch" in msg and f"{NAME}.host.json: missing" in msg and sha(HOST) in msg


def test_symlink_escape_refused(tmp_path):
    out = write_dir(tmp_path)
    m = read_manifest(out)
    outside = tmp_path / "outside.cubin"
    outside.write_bytes(CUBIN)
    (out / f"{NAME}.cubin").unlink()
    (out / f"{NAME}.cubin").symlink_to(outside)
    with pytest.raises(ArtifactIntegrityError, match="outside the artifact directory"):
        verify_artifacts(m, out)


def test_verify_rechecks_names_built_in_code(tmp_path):
    out = write_dir(tmp_path)
    m = read_manifest(out)
    import dataclasses
    bad = dataclasses.replace(m.variants[0], cubin="../art/" + m.variants[0].cubin)
    with pytest.raises(ArtifactIntegrityError, match="not a plain file name"):
        verify_artifacts(dataclasses.replace(m, variants=(bad,)), out)


def test_loader_manifest_imports_no_dsl_torch_or_cuda():
    code = ("import sys, svdq_loader.manifest as m; "
            "bad = [k for k in sys.modules if k.split('.')[0] in "
            "('cutlass', 'torch', 'cuda', 'svdq_aot', 'svdq_kernels', 'numpy', 'yaml')]; "
            "print(bad); assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

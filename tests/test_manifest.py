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
    ArtifactIntegrityError, Manifest, ManifestError, body_checksum, read_artifacts, read_manifest,
)


def verify_artifacts(m, out):
    return [out / n for n in read_artifacts(m, out)]

CUBIN = b"\x7fELF" + bytes(range(256)) * 4
HOST = b'{"entry":"svdq_host_x"}\n'
NAME = "svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_wcscale1_bias1_tilem128_tilen128_tilek64_stages2_reqn128k64"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def seal(d: dict) -> dict:
    """Put the checksum of `d`'s body into `d` (what a build does)."""
    body = {k: v for k, v in d.items() if k != "checksum"}
    return {"schema_version": d["schema_version"], "checksum": body_checksum(body),
            **{k: v for k, v in body.items() if k != "schema_version"}}


RULE = {"op": "gemm_w4a4", "arch": "sm_90a", "family": "sm90_gemm_w4a4",
        "buckets": [{"m_max": 64, "priority": 0, "prefer": [{"knob": "tile_m", "order": "asc"}]},
                    {"m_max": None, "priority": 0, "prefer": [{"knob": "tile_m", "order": "desc"},
                                                              {"knob": "stages", "values": [2, 1]}]}]}


def doc() -> dict:
    return seal({
        "schema_version": 3,
        "generator": {"package": "svdq-aot", "package_version": "0.1.0", "dsl": "nvidia-cutlass-dsl",
                      "dsl_version": "4.8.1", "python": "3.11.7"},
        "config": {"name": "flux", "sha256": "0" * 64, "file": "flux.yaml"},
        "shapes": [{"name": "qkv", "k": 3072, "n": 9216}],
        "variants": [{
            "name": NAME, "op": "gemm_w4a4", "arch": "sm_90a", "family": "sm90_gemm_w4a4",
            "knobs": {"out_dtype": "bf16", "rank": 32, "wcscale": True, "bias": True, "scale_layout": "logical",
                      "tile_m": 128, "tile_n": 128, "tile_k": 64, "stages": 2},
            "requirements": {"n_multiple": 128, "k_multiple": 64},
            "cubin": f"{NAME}.cubin", "sha256": sha(CUBIN), "size": len(CUBIN),
            "host_program": {"file": f"{NAME}.host.json", "sha256": sha(HOST)},
            "entry": "svdq_host_x", "kernel_symbols": [f"{NAME}_0"],
            "params": {f"{NAME}_0": [{"index": 0, "offset": 0, "size": 128},
                                     {"index": 1, "offset": 128, "size": 4}]},
            "host_args": [["act", "ptr"], ["m", "i32"], ["stream", "stream"]],
            "smem_bytes": 66048,
            "resources": {f"{NAME}_0": {"registers": 255, "stack_frame_bytes": 0, "static_smem": 0}},
            "launch_recipe": None}],
        "rejected": [{"name": "svdq_gemm_w4a4_x", "reason": "SMEM budget"}],
        "selection": [RULE],
        "requires": {"cuda_driver": {"sm_90a": 12000}},
    })


def doc_v2() -> dict:
    d = {k: v for k, v in doc().items() if k not in ("selection", "requires", "checksum")}
    return seal(dict(d, schema_version=2))


SYM = f"{NAME}_0"


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
    assert m.schema_version == M.SCHEMA_VERSION == 3
    assert m.cuda_driver == {"sm_90a": 12000}
    rule = m.rules[("gemm_w4a4", "sm_90a", "sm90_gemm_w4a4")]
    assert rule.to_dict() == RULE and rule.bucket(64)[1].prefer[0].order == "asc"
    assert v.op == "gemm_w4a4" and v.knobs["rank"] == 32 and v.knobs["wcscale"] is True
    assert list(v.knobs) == ["out_dtype", "rank", "wcscale", "bias", "scale_layout", "tile_m", "tile_n",
                             "tile_k", "stages"]                    # order kept: it is the naming order
    assert v.requirements == {"n_multiple": 128, "k_multiple": 64}
    assert v.params[SYM][1] == (1, 128, 4) and v.params[SYM][1].offset == 128
    assert v.resources[SYM].registers == 255
    assert v.host_args == (("act", "ptr"), ("m", "i32"), ("stream", "stream"))
    assert m.variant(NAME) is v
    assert json.loads(m.to_json()) == doc()
    assert Manifest.from_json(m.to_json()) == m
    assert m.to_json() == Manifest.from_dict(doc()).to_json()
    assert [p.name for p in verify_artifacts(m, out)] == [f"{NAME}.cubin", f"{NAME}.host.json"]


def test_any_edit_of_the_manifest_fails_its_checksum(tmp_path):
    d = doc()
    d["variants"][0]["knobs"]["rank"] = 16          # a rank-32 kernel claiming rank 16, checksum left as built
    out = write_dir(tmp_path, d)
    with pytest.raises(ManifestError) as ei:
        read_manifest(out)
    msg = str(ei.value)
    assert "checksum mismatch" in msg and "edited" in msg and "Rebuild" in msg and str(out) in msg
    # whitespace / key order are not edits: the checksum is over the canonical body
    (out / "manifest.json").write_text(json.dumps(doc(), indent=4, sort_keys=True))
    assert read_manifest(out).variants[0].knobs["rank"] == 32


def _broken(fn) -> dict:
    """`doc()` edited by `fn` and re-sealed, so the schema checks (not the checksum) must catch it."""
    d = copy.deepcopy(doc())
    fn(d)
    return seal(d) if "schema_version" in d and "checksum" in d else d


V0 = "variants[0] (" + NAME + ")"


@pytest.mark.parametrize("fn, words", [
    (lambda d: d.pop("shapes"), ["missing key", "shapes"]),
    (lambda d: d.update(extra=1), ["extra", "unknown key"]),
    (lambda d: d["variants"][0]["knobs"].update(rank=[32]), [f"{V0}.knobs.rank", "[32]", "integers or strings"]),
    (lambda d: d["variants"][0]["knobs"].update(rank=1.5), [f"{V0}.knobs.rank", "1.5"]),
    (lambda d: d["variants"][0].update(knobs={}), [f"{V0}.knobs", "non-empty object"]),
    (lambda d: d["variants"][0].pop("op"), ["missing key", "op"]),
    (lambda d: d["variants"][0].update(launch_recipe=[1]), ["launch_recipe", "object or null"]),
    (lambda d: d["variants"][0].update(resources={}), ["resources", "one entry per kernel symbol"]),
    (lambda d: d["variants"][0]["resources"][SYM].update(registers=-1), ["registers", ">= 0"]),
    (lambda d: d.pop("checksum"), ["missing key", "checksum"]),
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
    (lambda d: d["variants"][0]["params"][SYM][1].update(index=5), ["indices must be 0..n-1"]),
    (lambda d: d["variants"][0]["params"][SYM][0].update(size=0), ["size", "must be >= 1"]),
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


@pytest.mark.parametrize("version", [1, 4, 0, "2", True, None])
def test_unknown_schema_version(tmp_path, version):
    out = write_dir(tmp_path, _broken(lambda d: d.update(schema_version=version)))
    with pytest.raises(ManifestError) as ei:
        read_manifest(out)
    msg = str(ei.value)
    assert f"manifest schema {version!r}" in msg and "reads schema 2, 3" in msg and "rebuild" in msg


def test_a_v2_manifest_is_still_read_without_rules(tmp_path):
    out = write_dir(tmp_path, doc_v2())
    m = read_manifest(out)
    assert m.schema_version == 2 and m.selection == () and m.cuda_driver == {}
    assert json.loads(m.to_json()) == doc_v2()
    # a v2 manifest may not carry the v3 keys, and a v3 one must
    with pytest.raises(ManifestError, match="unknown key"):
        read_manifest(write_dir(tmp_path, seal(dict(doc(), schema_version=2))))
    with pytest.raises(ManifestError, match=r"missing key\(s\) \['selection', 'requires'\]"):
        read_manifest(write_dir(tmp_path, seal(dict(doc_v2(), schema_version=3))))


@pytest.mark.parametrize("fn, words", [
    (lambda d: d["selection"].append(copy.deepcopy(RULE)), ["a second rule for the same"]),
    (lambda d: d["selection"][0]["buckets"][1].update(m_max=1000), ["the last bucket must be unbounded"]),
    (lambda d: d["selection"][0]["buckets"][0]["prefer"].append({"knob": "splits", "order": "asc"}),
     ["ranks by a knob variant", "does not have"]),
    (lambda d: d["requires"]["cuda_driver"].update(sm_90a="12.0"), ["requires.cuda_driver.sm_90a", "integer"]),
])
def test_selection_and_requires_are_validated(tmp_path, fn, words):
    out = write_dir(tmp_path, _broken(fn))
    with pytest.raises(ManifestError) as ei:
        read_manifest(out)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_a_v1_manifest_is_refused_with_both_versions_and_rebuild(tmp_path):
    v1 = {"schema_version": 1, "generator": doc()["generator"], "config": doc()["config"], "shapes": [],
          "variants": [], "rejected": []}
    out = write_dir(tmp_path, v1)
    with pytest.raises(ManifestError) as ei:
        read_manifest(out)
    msg = str(ei.value)
    assert "schema 1" in msg and "reads schema 2, 3" in msg and "rebuild the artifacts" in msg


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
    (out / "manifest.json").write_text('{"schema_version": 2,\n "x": }')
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


def test_a_build_records_that_nothing_of_the_build_machine_is_baked_in(tiny_artifacts):
    m = read_manifest(tiny_artifacts)
    assert "without a GPU" in m.generator.device_facts and "sm_count" in m.generator.device_facts
    gemms = [v for v in m.variants if v.op == "gemm_w4a4"]
    assert gemms and all(("sm_count", "i32") in [tuple(a) for a in v.host_args] for v in gemms)
    # and an older schema-3 manifest without the field still reads (the field is optional)
    data = json.loads((tiny_artifacts / "manifest.json").read_text())
    del data["generator"]["device_facts"]
    data["checksum"] = M.body_checksum({k: v for k, v in data.items() if k != "checksum"})
    assert M.Manifest.from_json(json.dumps(data), source="old").generator.device_facts == ""


def test_kernel_build_switches_are_recorded_only_when_set(tiny_artifacts):
    """A plain build's generator has no kernel_switches key (its manifest reads as before); an experiment build's
    names its switches, round-trips, and is covered by the checksum like every field."""
    data = json.loads((tiny_artifacts / "manifest.json").read_text())
    assert "kernel_switches" not in data["generator"]
    assert read_manifest(tiny_artifacts).generator.kernel_switches == ""
    data["generator"]["kernel_switches"] = "SVDQ_KERNEL_SM90_WDECODE=shift"
    data["checksum"] = M.body_checksum({k: v for k, v in data.items() if k != "checksum"})
    m = M.Manifest.from_json(json.dumps(data), source="exp")
    assert m.generator.kernel_switches == "SVDQ_KERNEL_SM90_WDECODE=shift"
    again = json.loads(m.to_json())
    assert again["generator"]["kernel_switches"] == "SVDQ_KERNEL_SM90_WDECODE=shift" and again == data
    data["generator"]["kernel_switches"] = "SVDQ_KERNEL_SM90_WDECODE=mul"          # an edit without a reseal
    with pytest.raises(M.ManifestError, match="checksum mismatch"):
        M.Manifest.from_json(json.dumps(data), source="edited")
    data["generator"]["kernel_switches"] = 7
    data["checksum"] = M.body_checksum({k: v for k, v in data.items() if k != "checksum"})
    with pytest.raises(M.ManifestError, match="kernel_switches"):
        M.Manifest.from_json(json.dumps(data), source="typed")

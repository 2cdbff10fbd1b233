"""The manifest is checked, not trusted: every edit of a fact that drives selection or launch is refused.

Each case edits a real build's manifest.json (and re-seals its checksum, as a
determined editor would), then `svdq_loader.load()` and `svdq-aot verify`
must both refuse it, naming the variant and the fact, before any CUDA call.
Without re-sealing, the checksum alone refuses any edit.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from svdq_aot.cli import main
from svdq_loader import driver
from svdq_loader.manifest import ArtifactError, body_checksum
from svdq_loader.verify import open_artifacts


def _seal(d: dict) -> dict:
    body = {k: v for k, v in d.items() if k != "checksum"}
    return {"schema_version": d["schema_version"], "checksum": body_checksum(body),
            **{k: v for k, v in body.items() if k != "schema_version"}}


def _gemm(d, rank=None):
    return next(v for v in d["variants"] if v["op"] == "gemm_w4a4" and (rank is None or v["knobs"]["rank"] == rank))


def _quant(d):
    return next(v for v in d["variants"] if v["op"] == "quantize_act")


def _rename_symbols(v, new):
    old = v["kernel_symbols"][0]
    sym = new + old[len(v["name"]):]
    v["name"] = new
    v["kernel_symbols"] = [sym]
    v["params"] = {sym: v["params"][old]}
    v["resources"] = {sym: v["resources"][old]}


def _other_symbol(v):
    old = v["kernel_symbols"][0]
    new = old + "1"
    v["kernel_symbols"] = [new]
    v["params"] = {new: v["params"][old]}
    v["resources"] = {new: v["resources"][old]}


def _consistent_rank_edit(d):
    v = _gemm(d, 32)
    v["knobs"]["rank"] = 16
    _rename_symbols(v, v["name"].replace("_rank32_", "_rank16_"))


def _swap_cubins(d):
    a, b = _gemm(d, 0), _gemm(d, 32)
    for k in ("cubin", "sha256", "size"):
        a[k], b[k] = b[k], a[k]


EDITS = {
    # what selection reads
    "rank": (lambda d: _gemm(d, 32)["knobs"].update(rank=16), "name does not match its knobs"),
    "out_dtype": (lambda d: _gemm(d)["knobs"].update(out_dtype="fp16"), "name does not match its knobs"),
    "tile_n": (lambda d: _gemm(d)["knobs"].update(tile_n=64), "name does not match its knobs"),
    "n_multiple": (lambda d: _gemm(d)["requirements"].update(n_multiple=64), "name does not match"),
    "quant_dtype": (lambda d: _quant(d)["knobs"].update(dtype="fp16"), "name does not match its knobs"),
    "scale_layout": (lambda d: _quant(d)["knobs"].update(scale_layout="blocked"),
                     "scale_layout 'blocked' is not what sm_90a uses"),
    "rank_and_name": (_consistent_rank_edit, "has no kernel"),
    "arch": (lambda d: _gemm(d).update(arch="sm_100a"), "sm_100a"),
    "op": (lambda d: _gemm(d).update(op="quantize_act"), "host_args"),
    # what the launch reads
    "smem": (lambda d: _gemm(d).update(smem_bytes=_gemm(d)["smem_bytes"] - 1024), "dynamic shared memory"),
    "param_offset": (lambda d: next(iter(_gemm(d)["params"].values()))[1].update(offset=4), "parameters"),
    "param_size": (lambda d: next(iter(_gemm(d)["params"].values()))[-1].update(size=8), "parameters"),
    "static_smem": (lambda d: next(iter(_gemm(d)["resources"].values())).update(static_smem=4096),
                    "static smem"),
    "registers": (lambda d: next(iter(_gemm(d)["resources"].values())).update(registers=32), "registers"),
    "cubin_mapping": (_swap_cubins, "has no kernel"),
    "host_args": (lambda d: _gemm(d)["host_args"].reverse(), "host_args"),
    "kernel_symbol": (lambda d: _other_symbol(_gemm(d)), "has no kernel"),
    "recipe_garbage": (lambda d: _gemm(d).update(launch_recipe={"format": "nope"}), "malformed launch recipe"),
    "recipe_block": (lambda d: _gemm(d)["launch_recipe"].update(block=[64, 1, 1]),
                     "does not reproduce the host program's launch"),
}


@pytest.fixture
def no_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a CUDA call was made while checking artifacts")
    for name in ("init", "device_arch", "device_attribute", "DeviceKernels", "raw_launch_kernel_ex"):
        monkeypatch.setattr(driver, name, boom)


def _edited(tiny_artifacts, tmp_path, fn, seal=True):
    out = tmp_path / "edited"
    shutil.copytree(tiny_artifacts, out)
    d = json.loads((out / "manifest.json").read_text())
    fn(d)
    (out / "manifest.json").write_text(json.dumps(_seal(d) if seal else d, indent=1))
    return out


def test_the_build_itself_passes(tiny_artifacts, no_cuda):
    arts = open_artifacts(tiny_artifacts)
    assert {v.entry.op for v in arts.variants.values()} == {"gemm_w4a4", "quantize_act"}
    r = CliRunner().invoke(main, ["verify", str(tiny_artifacts)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("case", sorted(EDITS))
def test_every_edit_is_refused_by_load_and_verify(tiny_artifacts, tmp_path, no_cuda, case):
    fn, words = EDITS[case]
    out = _edited(tiny_artifacts, tmp_path, fn)
    import svdq_loader
    with pytest.raises(ArtifactError) as ei:
        svdq_loader.load(out)
    msg = str(ei.value)
    assert words in msg, msg
    assert "variant svdq_" in msg, msg
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and words in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("case", ["rank", "smem", "cubin_mapping"])
def test_an_unsealed_edit_fails_the_checksum(tiny_artifacts, tmp_path, no_cuda, case):
    out = _edited(tiny_artifacts, tmp_path, EDITS[case][0], seal=False)
    import svdq_loader
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        svdq_loader.load(out)


@pytest.mark.parametrize("garbage", [b"{not json", b'{"format": "svdq-host-ir", "format_version": 1}', b"[]"])
def test_a_corrupt_host_program_is_refused_by_file_name(tiny_artifacts, tmp_path, no_cuda, garbage):
    import hashlib
    out = tmp_path / "hp"
    shutil.copytree(tiny_artifacts, out)
    d = json.loads((out / "manifest.json").read_text())
    v = _gemm(d)
    (out / v["host_program"]["file"]).write_bytes(garbage)
    v["host_program"]["sha256"] = hashlib.sha256(garbage).hexdigest()
    (out / "manifest.json").write_text(json.dumps(_seal(d)))
    import svdq_loader
    with pytest.raises(ArtifactError) as ei:
        svdq_loader.load(out)
    msg = str(ei.value)
    assert v["host_program"]["file"] in msg and "corrupt host program" in msg
    assert "JSONDecodeError" not in msg.split(":")[0]
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and v["host_program"]["file"] in r.output


def test_import_svdq_loader_loads_neither_testing_nor_the_dsl():
    code = ("import sys, svdq_loader; "
            "bad = sorted(k for k in sys.modules if k.startswith('svdq_loader.testing') "
            "or k.split('.')[0] in ('cutlass', 'svdq_aot', 'svdq_kernels', 'torch', 'numpy')); "
            "print(bad); assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_load_imports_no_testing_code_and_no_dsl(tiny_artifacts):
    code = ("import sys, svdq_loader; lib = svdq_loader.load(sys.argv[1]); "
            "bad = sorted(k for k in sys.modules if k.startswith('svdq_loader.testing') "
            "or k.split('.')[0] in ('cutlass', 'svdq_aot', 'svdq_kernels')); "
            "print(bad); assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_artifacts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

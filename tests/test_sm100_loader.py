"""Artifacts holding both sm_90a and sm_100a GEMMs: built on the CPU, verified, and selected per device arch.

On an sm_90a device the loader refuses to load an sm_100a variant (the message names both archs)
and picks the sm_90a variant; it never loads a cubin of the wrong arch.  The driver is stubbed:
no GPU is needed (the DSL is, to build).
"""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed: cannot build artifacts here")

from svdq_loader.errors import DeviceMismatch, UnsupportedProblem  # noqa: E402

CONFIG = textwrap.dedent("""
    name: mixed
    archs: [sm_90a, sm_100a]
    out_dtypes: [bf16]
    ranks: [0, 32]
    wcscale: [true]
    bias: [true]
    shapes:
      square: {k: 512, n: 256}
    variants:
      sm_90a:
        gemm_w4a4:
          tiles: [[128, 128, 64]]
      sm_100a:
        gemm_w4a4:
          tiles: [[2, 256, 128]]
""")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    from svdq_aot.build import build
    base = tmp_path_factory.mktemp("mixed")
    cfg = base / "mixed.yaml"
    cfg.write_text(CONFIG)
    out = base / "artifacts"
    build(str(cfg), str(out), jobs=1)
    return out


class _FakeDK:
    loads: list = []

    def __init__(self, cubin, symbols, ordinal, load_plan, params):
        self.cubin, self.symbols = cubin, tuple(symbols)
        self.kernels = {s: 0x7000 + i for i, s in enumerate(symbols)}
        _FakeDK.loads.append(self)

    def foreign_context(self):
        return False


def _lib(mixed, monkeypatch, arch):
    import svdq_loader
    from svdq_loader import driver
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: arch)
    monkeypatch.setattr(driver, "driver_version", lambda: 13000)      # a CUDA 13.0 driver
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: 232448 if attr == driver.MAX_SMEM_OPTIN
                        else 132)
    _FakeDK.loads = []
    monkeypatch.setattr(driver, "DeviceKernels", _FakeDK)
    return svdq_loader.load(str(mixed))


def test_mixed_artifacts_verify(mixed):
    from svdq_loader.verify import open_artifacts
    arts = open_artifacts(str(mixed))
    assert sorted({v.arch for v in arts.manifest.variants}) == ["sm_100a", "sm_90a"]


def test_sm90_device_refuses_sm100_variants_and_selects_sm90(mixed, monkeypatch):
    lib = _lib(mixed, monkeypatch, "sm_90a")
    sm100 = [e for e in lib.variants if e.arch == "sm_100a"]
    sm90 = [e for e in lib.variants if e.arch == "sm_90a"]
    assert len(sm100) == 2 and len(sm90) == 2
    for e in sm100:
        with pytest.raises(DeviceMismatch, match=rf"variant {e.name} is built for sm_100a but device 0 is sm_90a; "
                                                 rf"refusing to load it"):
            lib._launcher(e.name, 0, False)
    assert _FakeDK.loads == []                       # refused before any module load
    # selection on this device only ever sees sm_90a variants
    ln = lib._resolve("gemm_w4a4", 0, ("bf16", 32, True, True, "logical"), (("m", 77), ("n", 256), ("k", 512)),
                      False)
    assert ln is not None and len(_FakeDK.loads) == 1
    assert all(s.startswith("svdq_gemm_w4a4_sm90a_") for s in _FakeDK.loads[0].symbols)
    # a problem in the Blackwell scale layout has no kernel here
    with pytest.raises(UnsupportedProblem, match=r"scale_layout=blocked"):
        lib._resolve("gemm_w4a4", 0, ("bf16", 32, True, True, "blocked"), (("m", 77), ("n", 256), ("k", 512)),
                     False)
    for e in sm90:
        lib._launcher(e.name, 0, False)
    assert len(_FakeDK.loads) == 2 and all(dk.symbols[0].startswith("svdq_gemm_w4a4_sm90a_") for dk in _FakeDK.loads)


def test_sm100_device_selects_sm100_variants(mixed, monkeypatch):
    lib = _lib(mixed, monkeypatch, "sm_100a")
    e = lib.choose("gemm_w4a4", "sm_100a", ("bf16", 32, True, True, "blocked"), m=4608, n=256, k=512)
    assert (e.arch, e.knobs["cta_group"], e.knobs["tile_m"], e.knobs["rank"]) == ("sm_100a", 2, 256, 32)
    assert e.knobs["ab_stages"] >= 4
    with pytest.raises(UnsupportedProblem, match=r"K=640 is not a multiple of 256"):
        lib.explain("gemm_w4a4", "sm_100a", ("bf16", 32, True, True, "blocked"), m=7, n=256, k=640)
    sm90 = next(v for v in lib.variants if v.arch == "sm_90a")
    with pytest.raises(DeviceMismatch, match=r"built for sm_90a but device 0 is sm_100a"):
        lib._launcher(sm90.name, 0, False)
    for v in lib.variants:
        if v.arch == "sm_100a":
            lib._launcher(v.name, 0, False)
    assert len(_FakeDK.loads) == 2
    assert all(dk.symbols[0].startswith("svdq_gemm_w4a4_sm100a_") for dk in _FakeDK.loads)

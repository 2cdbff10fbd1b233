"""Variant validity and enumeration (fake kernel family unless noted)."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from svdq_aot import variants as V
from svdq_aot.config import parse_config
from svdq_aot.variants import Variant, enumerate_variants

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# A fake kernel family + registry, shared with the other test modules.
# --------------------------------------------------------------------------

def make_fake_family(**overrides) -> types.SimpleNamespace:
    def resource_problem(v):
        if v.rank == 128 and v.tile_n == 256:
            return f"SMEM budget exceeded: needs 240 KiB > 227 KiB at rank {v.rank} with tile_n 256"
        return None

    def compile_variant(v, dump_dir):
        assert Path(dump_dir).is_dir()
        return types.SimpleNamespace(
            cubin=b"\x7fELF-fake-" + v.name.encode(), compiled=v, entry=f"host_{v.name}",
            kernel_symbols=[f"svdq_k_{v.name}"], smem_bytes=1024 * v.stages)

    fam = types.SimpleNamespace(
        __name__="fake.sm90_w4a4",
        HOST_ARGS=(("act", "ptr"), ("wgt", "ptr"), ("m", "i32"), ("stream", "stream")),
        SUPPORTED=dict(tile_m=(64, 128), tile_n=(64, 128, 256), tile_k=(64, 128), stages=(1, 2, 3, 4),
                       cluster=((1, 1),), ranks=(0, 16, 32, 48, 64, 128), out_dtypes=("fp16", "bf16")),
        DEFAULT_STAGES=2,
        resource_problem=resource_problem,
        compile_variant=compile_variant,
    )
    for k, v in overrides.items():
        setattr(fam, k, v)
    return fam


def make_fake_registry(fam=None) -> types.SimpleNamespace:
    fam = fam or make_fake_family()
    return types.SimpleNamespace(FAMILIES={"sm_90a": "fake.sm90_w4a4"},
                                 family=lambda arch: fam if arch == "sm_90a" else None)


def install_fake(monkeypatch, fam=None):
    reg = make_fake_registry(fam)
    monkeypatch.setattr(V, "_registry", lambda: reg)
    monkeypatch.setattr(V, "_FAMILY_CACHE", {})
    return reg


@pytest.fixture
def fake(monkeypatch):
    return install_fake(monkeypatch)


CFG = """
name: t
archs: [sm_90a]
out_dtypes: [bf16, fp16]
ranks: [0, 128]
wcscale: [true, false]
bias: [false]
shapes:
  a: {k: 256, n: 512}
variants:
  sm_90a:
    tiles: [[128, 128, 64], [128, 256, 64]]
    clusters: [[1, 1]]
    stages: [auto]
"""


def v(**kw) -> Variant:
    base = dict(arch="sm_90a", out_dtype="bf16", rank=32, wcscale=True, bias=True,
                tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=1, stages=2)
    base.update(kw)
    return Variant(**base)


# --------------------------------------------------------------------------

def test_name_encodes_every_knob():
    a = v()
    assert a.name == "svdq_w4a4_sm_90a_bf16_r32_wc1_b1_t128x128x64_c1x1_s2"
    seen = {a.name}
    for kw in [dict(arch="sm_100a"), dict(out_dtype="fp16"), dict(rank=48), dict(wcscale=False),
               dict(bias=False), dict(tile_m=64), dict(tile_n=256), dict(tile_k=128),
               dict(cluster_m=2), dict(cluster_n=2), dict(stages=3)]:
        n = v(**kw).name
        assert n not in seen, kw
        seen.add(n)


def test_valid_variant(fake):
    assert v().invalid_reason() is None
    assert v().requirements == {"n_multiple": 128, "k_multiple": 64, "ptr_align": 16}
    assert v().serves(256, 512) and not v().serves(256, 500) and not v().serves(100, 512)


@pytest.mark.parametrize("kw, words", [
    (dict(arch="sm_100a"), ["sm_100a", "no kernel family", "sm_90a"]),
    (dict(arch="sm_80"), ["sm_80", "no kernel family"]),
    (dict(rank=24), ["rank 24", "multiple of 16"]),
    (dict(rank=-16), ["rank -16"]),
    (dict(rank=256), ["rank 256", "not supported"]),
    (dict(out_dtype="fp32"), ["out_dtype 'fp32'", "not supported", "'bf16'"]),
    (dict(tile_m=256), ["tile_m 256", "not supported"]),
    (dict(tile_n=96), ["tile_n 96"]),
    (dict(tile_k=32), ["tile_k 32"]),
    (dict(cluster_m=2), ["cluster (m, n) (2, 1)", "not supported"]),
    (dict(stages=7), ["stages 7", "not supported"]),
    (dict(rank=128, tile_n=256), ["SMEM budget exceeded"]),
])
def test_invalid_reasons(fake, kw, words):
    reason = v(**kw).invalid_reason()
    assert reason is not None
    for w in words:
        assert w in reason, (w, reason)


def test_resource_check_only_after_support_check(monkeypatch):
    calls = []
    fam = make_fake_family(resource_problem=lambda var: calls.append(var) or None)
    install_fake(monkeypatch, fam)
    assert v(tile_m=256).invalid_reason() is not None
    assert calls == []
    assert v().invalid_reason() is None
    assert calls == [v()]


def test_enumeration_order_rejections_and_auto(fake):
    cfg = parse_config(CFG, "t.yaml")
    valid, rejected = enumerate_variants(cfg)
    # 2 dtypes x 2 ranks x 2 wcscale x 1 bias x 2 tiles = 16, none dropped
    assert len(valid) + len(rejected) == 16
    assert all(x.stages == 2 for x in valid)  # auto -> DEFAULT_STAGES
    assert [x.name for x, _ in rejected] == [
        x.name for x in [v(out_dtype=d, rank=128, wcscale=w, bias=False, tile_n=256)
                         for d in ("bf16", "fp16") for w in (True, False)]]
    assert all("SMEM" in r for _, r in rejected)
    # deterministic
    assert enumerate_variants(cfg) == (valid, rejected)
    assert valid[0].name == "svdq_w4a4_sm_90a_bf16_r0_wc1_b0_t128x128x64_c1x1_s2"
    assert len({x.name for x in valid}) == len(valid)


def test_auto_resolution_prefers_family_function(monkeypatch):
    fam = make_fake_family(default_stages=lambda var: 4 if var.tile_n == 128 else 3)
    install_fake(monkeypatch, fam)
    valid, _ = enumerate_variants(parse_config(CFG, "t.yaml"))
    assert {(x.tile_n, x.stages) for x in valid} == {(128, 4), (256, 3)}


def test_auto_resolution_budget_fallback(monkeypatch):
    fam = make_fake_family(resource_problem=lambda var: "too deep" if var.stages > 3 else None)
    del fam.DEFAULT_STAGES
    install_fake(monkeypatch, fam)
    valid, _ = enumerate_variants(parse_config(CFG, "t.yaml"))
    assert {x.stages for x in valid} == {3}


def test_auto_and_explicit_same_stage_is_one_variant(fake):
    cfg = parse_config(CFG.replace("stages: [auto]", "stages: [auto, 2, 3]"), "t.yaml")
    valid, rejected = enumerate_variants(cfg)
    names = [x.name for x in valid] + [x.name for x, _ in rejected]
    assert len(names) == len(set(names)) == 32


def test_family_import_failure_is_loud(monkeypatch):
    def boom(arch):
        raise ImportError("No module named 'cutlass'")
    reg = types.SimpleNamespace(FAMILIES={"sm_90a": "svdq_kernels.sm90_w4a4"}, family=boom)
    monkeypatch.setattr(V, "_registry", lambda: reg)
    monkeypatch.setattr(V, "_FAMILY_CACHE", {})
    with pytest.raises(V.FamilyUnavailable, match="sm90_w4a4.*sm_90a.*cutlass"):
        v().invalid_reason()


def _real_family_available() -> bool:
    try:
        return importlib.util.find_spec("svdq_kernels.registry") is not None \
            and importlib.util.find_spec("svdq_kernels.sm90_w4a4") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _real_family_available(), reason="svdq_kernels.sm90_w4a4 not present yet")
def test_real_registry_flux_enumerates():
    from svdq_aot.config import load_config
    cfg = load_config(ROOT / "configs" / "flux.yaml")
    valid, rejected = enumerate_variants(cfg)
    assert valid, rejected
    for x in valid:
        assert x.invalid_reason() is None
    for x, r in rejected:
        assert isinstance(r, str) and r
    assert len(valid) + len(rejected) >= 2 * 6 * 2 * 2

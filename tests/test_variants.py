"""Variant names, validity and enumeration; the family contract (fake families unless noted)."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from fakes import install_fake, make_gemm_family, make_quant_family
from svdq_aot import variants as V
from svdq_aot.config import parse_config
from svdq_aot.family import FamilyContractError, check_family
from svdq_aot.variants import Variant, enumerate_variants
from svdq_loader.ops import GEMM_W4A4

ROOT = Path(__file__).resolve().parents[1]


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
    gemm_w4a4:
      tiles: [[128, 128, 64], [128, 256, 64]]
      stages: [auto]
"""


def v(**kw) -> Variant:
    base = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical",
                tile_m=128, tile_n=128, tile_k=64, stages=2)
    arch = kw.pop("arch", "sm_90a")
    base.update(kw)
    return Variant.make("gemm_w4a4", arch, base)


# --------------------------------------------------------------------------

def test_name_encodes_every_knob_but_the_arch_fixed_ones(fake):
    a = v()
    assert a.name == ("svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_wcscale1_bias1_tilem128_tilen128_tilek64_stages2"
                      "_reqn128k64")
    assert a.name == GEMM_W4A4.name_for("sm_90a", a.knob_dict, {"n_multiple": 128, "k_multiple": 64})
    seen = {a.name}
    for kw in [dict(arch="sm_100a"), dict(out_dtype="fp16"), dict(rank=48), dict(wcscale=False),
               dict(bias=False), dict(tile_m=64), dict(tile_n=256), dict(tile_k=128), dict(stages=3)]:
        n = v(**kw).name
        assert n not in seen, kw
        seen.add(n)
    assert "scalelayout" not in a.name


def test_valid_variant(fake):
    assert v().invalid_reason() is None
    assert v().requirements() == {"n_multiple": 128, "k_multiple": 64}
    assert GEMM_W4A4.shape_problem(v().requirements(), dict(m=1, n=512, k=256)) is None
    assert "N=500 is not a multiple of 128" in GEMM_W4A4.shape_problem(v().requirements(), dict(m=1, n=500, k=256))
    assert "K=100" in GEMM_W4A4.shape_problem(v().requirements(), dict(m=1, n=512, k=100))


@pytest.mark.parametrize("kw, words", [
    (dict(arch="sm_80"), ["no gemm_w4a4 kernel family for sm_80"]),
    (dict(rank=24), ["rank 24", "not supported"]),
    (dict(rank=256), ["rank 256", "not supported"]),
    (dict(out_dtype="fp32"), ["out_dtype 'fp32' not allowed", "'bf16'"]),
    (dict(scale_layout="blocked"), ["scale_layout 'blocked'", "sm_90a uses ('logical')"]),
    (dict(tile_m=256), ["tile_m 256", "not supported"]),
    (dict(tile_n=96), ["tile_n 96"]),
    (dict(stages=7), ["stages 7", "not supported"]),
    (dict(rank=128, tile_n=256), ["SMEM budget exceeded", "240 KiB > 227 KiB"]),
])
def test_invalid_reasons(fake, kw, words):
    reason = v(**kw).invalid_reason()
    assert reason is not None
    for w in words:
        assert w in reason, (w, reason)


def test_op_feature_check_runs_before_the_family(monkeypatch):
    gemm = make_gemm_family()
    install_fake(monkeypatch, gemm=gemm)
    assert v(out_dtype="fp32").invalid_reason() is not None
    assert gemm.resource_calls == []
    assert v().invalid_reason() is None
    assert len(gemm.resource_calls) == 1


def test_enumeration_order_rejections_and_auto(fake):
    cfg = parse_config(CFG, "t.yaml")
    valid, rejected = enumerate_variants(cfg)
    # 2 dtypes x 2 ranks x 2 wcscale x 1 bias x 2 tiles = 16, none dropped
    assert len(valid) + len(rejected) == 16
    assert all(x["stages"] == 2 for x in valid)  # auto resolved by the family
    assert [x.name for x, _ in rejected] == [
        x.name for x in [v(out_dtype=d, rank=128, wcscale=w, bias=False, tile_n=256)
                         for d in ("bf16", "fp16") for w in (True, False)]]
    assert all("SMEM" in r for _, r in rejected)
    assert enumerate_variants(cfg) == (valid, rejected)       # deterministic
    assert valid[0].name == v(rank=0, bias=False).name
    assert len({x.name for x in valid}) == len(valid)


def test_auto_and_explicit_same_stage_is_one_variant(fake):
    cfg = parse_config(CFG.replace("stages: [auto]", "stages: [auto, 2, 3]"), "t.yaml")
    valid, rejected = enumerate_variants(cfg)
    names = [x.name for x in valid] + [x.name for x, _ in rejected]
    assert len(names) == len(set(names)) == 32


def test_two_operators_enumerate_with_their_own_features(fake):
    cfg = parse_config(CFG.replace("      stages: [auto]\n", "      stages: [auto]\n    quantize_act: {}\n"), "t.yaml")
    valid, rejected = enumerate_variants(cfg)
    quant = [x for x in valid if x.op == "quantize_act"]
    # one quantize_act variant per (dtype, rank): the GEMM-only features do not multiply it
    assert [(x["dtype"], x["rank"]) for x in quant] == [("bf16", 0), ("fp16", 0)]
    assert [x.name for x, _ in rejected if x.op == "quantize_act"] == [
        "svdq_quantize_act_sm90a_dtypebf16_rank128_rows8_reqk64", "svdq_quantize_act_sm90a_dtypefp16_rank128_rows8_reqk64"]
    assert all(x["scale_layout"] == "logical" for x in quant)


def _family_import_raises(monkeypatch, exc: Exception) -> None:
    """A registry whose sm_90a GEMM family raises `exc` on import."""
    def boom(op, arch):
        raise exc
    reg = types.SimpleNamespace(FAMILIES={("gemm_w4a4", "sm_90a"): "svdq_kernels.sm90_gemm_w4a4"}, family=boom)
    monkeypatch.setattr(V, "_registry", lambda: reg)
    monkeypatch.setattr(V, "_FAMILY_CACHE", {})


def test_family_import_failure_is_loud(monkeypatch):
    _family_import_raises(monkeypatch, ImportError("No module named 'cutlass'"))
    with pytest.raises(V.FamilyUnavailable, match="sm90_gemm_w4a4.*gemm_w4a4 on sm_90a.*cutlass.*build extra"):
        v().invalid_reason()


def test_a_family_that_refuses_its_build_switch_says_why_without_the_install_hint(monkeypatch):
    """Not every import-time failure is a missing DSL: a bad SVDQ_KERNEL_* value is reported as itself."""
    _family_import_raises(monkeypatch, ValueError(
        "SVDQ_KERNEL_SM90_WDECODE='bogus': the sm_90a weight decode form must be one of mul, shift"))
    with pytest.raises(V.FamilyUnavailable) as e:
        v().invalid_reason()
    assert "ValueError: SVDQ_KERNEL_SM90_WDECODE='bogus'" in str(e.value) and "build extra" not in str(e.value)


# --------------------------------------------------------------------------
# the family contract
# --------------------------------------------------------------------------

def test_fake_families_meet_the_contract():
    check_family(make_gemm_family())
    check_family(make_quant_family())


@pytest.mark.parametrize("broken, words", [
    (dict(OP="gemm_w8a8"), ["OP 'gemm_w8a8' is not a known operator"]),
    (dict(ARCHS=()), ["ARCHS must be a non-empty tuple"]),
    (dict(TUNING={"tile_m": ()}), ["TUNING['tile_m'] must be a non-empty tuple"]),
    (dict(TUNING={"rank": (32,)}), ["clash with the op's feature knobs"]),
    (dict(NAME=7), ["NAME must be a str"]),
    (dict(compile=None), ["missing method compile()"]),
    (dict(requirements="n"), ["missing method requirements()"]),
])
def test_a_broken_family_is_refused_at_registration(monkeypatch, broken, words):
    fam = make_gemm_family(**broken)
    with pytest.raises(FamilyContractError) as ei:
        check_family(fam, where="fake.gemm")
    for w in words:
        assert w in str(ei.value)
    # through the registry: the family is refused when it is looked up, before any use
    install_fake(monkeypatch, gemm=fam)
    with pytest.raises(V.FamilyUnavailable, match="breaks the family contract"):
        v().invalid_reason()


def test_missing_attribute_is_named():
    fam = make_gemm_family()
    del fam.TUNING
    with pytest.raises(FamilyContractError, match="missing TUNING"):
        check_family(fam)


def _real_family_available() -> bool:
    try:
        return importlib.util.find_spec("cutlass") is not None \
            and importlib.util.find_spec("svdq_kernels.quantize_act") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _real_family_available(), reason="the DSL or a kernel family is not installed")
def test_real_registry_flux_enumerates():
    from svdq_aot.build import check_coverage
    from svdq_aot.config import load_config
    from svdq_aot.variants import check_sections
    cfg = load_config(ROOT / "configs" / "flux.yaml")
    check_sections(cfg)
    valid, rejected = enumerate_variants(cfg)
    assert valid, rejected
    for x in valid:
        assert x.invalid_reason() is None
    for x, r in rejected:
        assert isinstance(r, str) and r
    ops = {(x.op, x.arch) for x in valid}
    assert {("gemm_w4a4", "sm_90a"), ("quantize_act", "sm_90a"), ("quantize_act", "sm_100a"),
            ("quantize_act", "sm_103a"), ("gemm_w4a4", "sm_100a"), ("gemm_w4a4", "sm_103a"),
            ("gemm_w4a4", "sm_120a"), ("gemm_w4a4", "sm_121a"), ("quantize_act", "sm_120a"),
            ("quantize_act", "sm_121a")} <= ops
    # out_dtypes x ranks (0, 16, 32, 48, 64, 96, 128), wcscale and bias on (run-time inputs): fifteen forms on
    # sm_90a (the six 128-wide images forms have no rank 128, the two-way split 256-row tile no rank 48 or 96: 16
    # fewer; the 128 x 192 images tile, whole and stream-K, has every rank) and the rank-128-only coop form, then one
    # form on each Blackwell arch (sm_100a, sm_103a, sm_120a, sm_121a)
    assert sum(x.op == "gemm_w4a4" for x in valid) == 2 * 7 * (15 + 1 + 1 + 1 + 1) + 2 - 16
    # compute: [exact, fp8]: the FP8-compute GEMM's default forms on sm_90a (tests/test_shipped_configs.py)
    assert {x.arch for x in valid if x.op in ("gemm_w4a4_fp8", "act_fp8")} == {"sm_90a"}
    assert {(dict(x.knobs)["wcscale"], dict(x.knobs)["bias"]) for x in valid if x.op == "gemm_w4a4"} == {(True, True)}
    bw = [x for x in valid if x.op == "gemm_w4a4" and x.arch in ("sm_100a", "sm_103a")]
    assert all(dict(x.knobs)["cta_group"] == 2 and dict(x.knobs)["ab_stages"] >= 4 for x in bw)
    g12 = [x for x in valid if x.op == "gemm_w4a4" and x.arch in ("sm_120a", "sm_121a")]
    assert len(g12) == 2 * 2 * 7 and all(dict(x.knobs)["stages"] == 5 for x in g12)
    check_coverage(cfg, valid, rejected)

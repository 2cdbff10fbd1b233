"""Every config shipped in configs/ is accepted by the real kernel families (CPU; needs the build extra)."""
from __future__ import annotations

from pathlib import Path

import pytest

from svdq_aot.config import load_config
from svdq_aot.variants import check_sections, enumerate_variants

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("cutlass", reason="the families' checks import the DSL (the build extra)")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_accepted_by_its_families(path):
    """The families' own section checks (what `svdq-aot list` runs) pass, and the config asks for at least one
    buildable variant: a config that names a removed knob fails here, not on a user's machine."""
    cfg = load_config(path)
    check_sections(cfg)
    valid, _ = enumerate_variants(cfg)
    assert valid, f"{path.name}: no valid variant"


def test_flux_builds_the_measured_sm90_forms():
    """configs/flux.yaml's sm_90a GEMM forms: exactly the measured winners (ws and its two split-K forms at the
    128-row tile, at the 64-row tile ws reading decode_act's images with eight weight sets and the four-way split
    decoding with four raw activation sets and four weight sets, ws reading decode_act's images at the 256-row one,
    unsplit and split over 4 CTAs, and unsplit at 224-, 216- and 208-row ones (fuller waves at N = 3072 and M = 1024
    or 4608; less padding at M = 1024 and 2048), the 128 x 192 images tile (three MMA warpgroups, four weight sets,
    every rank: M = 1024 and 2048, rank 128 above M = 256, and at M <= 256 where it fills one wave) and its stream-K
    form (M = 129-256, N = 3072, K >= 12288), and coop at 256 rows for rank 128, which the images
    forms do not fit, built for rank 128 only, and the gemv form's 16 x 128 and 16 x 64 tiles for M <= 16), for every
    feature combination; the images forms' pre-pass is built too."""
    cfg = load_config(ROOT / "configs" / "flux.yaml")
    valid, rejected = enumerate_variants(cfg)
    gemm = [v for v in valid if v.op == "gemm_w4a4" and v.arch == "sm_90a"]
    forms = {(v.knob_dict["tile_m"], v.knob_dict["schedule"], v.knob_dict["prefetch"]) for v in gemm}
    assert forms == {(128, "ws", 2), (128, "ws", 1), (256, "ws", 1), (224, "ws", 1), (216, "ws", 1), (208, "ws", 1),
                     (128, "ws_splitk2", 2), (128, "ws_splitk4", 2), (128, "ws_streamk", 1),
                     (64, "ws", 1), (64, "ws_splitk4", 4), (256, "coop", 1), (256, "ws_splitk2", 1), (256, "ws_splitk4", 1),
                     (16, "gemv", 1)}
    assert {v.knob_dict["tile_n"] for v in gemm if v.knob_dict["schedule"] == "gemv"} == {64, 128}
    assert {v.knob_dict["tile_m"] for v in gemm if v.knob_dict["act_source"] == "images"} == {64, 128, 208, 216, 224,
                                                                                              256}
    wide = [v for v in gemm if v.knob_dict["tile_n"] == 192]
    assert {(v.knob_dict["tile_m"], v.knob_dict["schedule"], v.knob_dict["wsets"], v.knob_dict["act_source"])
            for v in wide} == {(128, "ws", 4, "images"), (128, "ws_streamk", 4, "images")}
    assert len(wide) == 2 * 2 * 7             # two schedules, both dtypes, every rank (rank 128 included)
    assert {(v.knob_dict["schedule"], v.knob_dict["act_source"]) for v in gemm if v.knob_dict["tile_m"] == 64} == {
        ("ws", "images"), ("ws_splitk4", "nvfp4")}
    assert {v.knob_dict["schedule"] for v in gemm if v.knob_dict["tile_m"] in (208, 216, 224)} == {"ws"}
    assert [v.name for v in valid if v.op == "decode_act"] == ["svdq_decode_act_sm90a_reqk64"]
    assert {(v.knob_dict["schedule"], v.knob_dict["wsets"]) for v in gemm if v.knob_dict["tile_m"] == 64} == {
        ("ws", 8), ("ws_splitk4", 4)}
    assert {v.knob_dict["wsets"] for v in gemm if v.knob_dict["tile_m"] in (208, 216, 224)} == {4}
    assert {v.knob_dict["wsets"] for v in gemm
            if v.knob_dict["tile_m"] not in (64, 208, 216, 224) and v.knob_dict["tile_n"] != 192} == {2}
    assert {v.knob_dict["rank"] for v in gemm if v.knob_dict["schedule"] == "coop"} == {128}
    assert {(v.knob_dict["wcscale"], v.knob_dict["bias"]) for v in gemm} == {(True, True)}   # run-time inputs
    assert len(gemm) == 15 * 2 * 7 + 2 - 16     # forms x dtypes x ranks, the rank-128 coop form, less ...
    gone = [(v.knob_dict["rank"], v.knob_dict["act_source"], r) for v, r in rejected
            if v.arch == "sm_90a" and v.op == "gemm_w4a4"]
    assert len(gone) == 16     # ... these: rank 128 on the six images forms, and the two-way split 256-row
    assert sum(g[:2] == (128, "images") and "rank 128" in g[2] for g in gone) == 12            # tile at 48 and 96
    assert sorted(g[0] for g in gone if "two-way split-K kernel keeps a stack frame" in g[2]) == [48, 48, 96, 96]


def test_flux_builds_the_fp8_mode_with_its_default_forms():
    """configs/flux.yaml's `compute: [exact, fp8]`: sm_90a alone gains the FP8-compute GEMM (its family's default
    forms) and its pre-pass, and some FP8 variant serves every (dtype, rank) of the config: fp16, whose fp32 sums
    leave the staged tiles no room, on the register tiles, and rank 128 on the 128-row tile."""
    from svdq_kernels import sm90_wgmma_w4a4_fp8 as fam
    cfg = load_config(ROOT / "configs" / "flux.yaml")
    assert cfg.compute == ("exact", "fp8")
    valid, _ = enumerate_variants(cfg)
    fp8 = [v for v in valid if v.op == "gemm_w4a4_fp8"]
    # 41: with the quad output store (the default), the 208-row register form with four weight sets is not built
    # at bf16 rank 48 (it spills); SVDQ_KERNEL_SM90_STORE=pairs builds it (42)
    from svdq_kernels.sm90_plan import STORE
    assert {v.arch for v in fp8} == {"sm_90a"} and len(fp8) == (41 if STORE == "quads" else 42)
    assert [v.arch for v in valid if v.op == "act_fp8"] == ["sm_90a"]
    forms = {(v.knob_dict["tile_m"], v.knob_dict["wsets"], v.knob_dict["weights"]) for v in fp8}
    assert forms == {(t[0], w, f.get("weights", ["regs"])[0])
                     for f in fam.DEFAULT_FORMS for t in f["tiles"] for w in f["wsets"]
                     if set(f.get("ranks", cfg.ranks)) & set(cfg.ranks)}     # (rank 80's forms: not in flux.yaml)
    for dt in cfg.out_dtypes:
        for r in cfg.ranks:
            assert any(v.knob_dict["out_dtype"] == dt and v.knob_dict["rank"] == r for v in fp8), (dt, r)
    assert {v.knob_dict["weights"] for v in fp8 if v.knob_dict["out_dtype"] == "fp16"} == {"regs"}

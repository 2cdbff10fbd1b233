"""Cross-compile the sm_90a W4A4 GEMM family (wgmma) on a CPU-only machine.

Needs the build extra (``nvidia-cutlass-dsl``); skipped without it.  No GPU is
used: the DSL traces and compiles for ``sm_90a`` and we inspect the cubin, its
PTX and (with cuobjdump) its SASS: HGMMA with a register A operand, 128-bit
loads and swizzled 128-bit SMEM stores, no local memory, no stack frame.
"""
from __future__ import annotations

import re

import pytest

from svdq_aot.family import CompiledKernel, Family, check_family
from svdq_aot.variants import Variant
from svdq_loader.ops import GEMM_W4A4

cutlass = pytest.importorskip(
    "cutlass", reason="nvidia-cutlass-dsl (the build extra) is not installed"
)

from svdq_kernels import registry  # noqa: E402
from kernel_checks import check_output_store, sass_of_cubin  # noqa: E402

ARCH = "sm_90a"
sm90 = registry.family("gemm_w4a4", ARCH)

DEFAULT_TM, DEFAULT_TN, DEFAULT_TK = sm90.DEFAULT_TILE


def make_knobs(out_dtype="fp16", rank=32, wcscale=True, bias=True, **kw):
    """A complete knob dict: the op's features (spec order), then the family's tuning knobs."""
    knobs = dict(out_dtype=out_dtype, rank=rank, wcscale=wcscale, bias=bias, scale_layout="logical",
                 tile_m=DEFAULT_TM, tile_n=DEFAULT_TN, tile_k=DEFAULT_TK, stages=sm90.DEFAULT_STAGES,
                 prefetch=1, skip_pad=False, act_decode="shift", schedule="coop", wsets=2, act_source="nvfp4")
    knobs.update(kw)
    return knobs


def name_of(knobs):
    return GEMM_W4A4.name_for(ARCH, knobs, sm90.requirements(ARCH, knobs))


def compile_knobs(knobs, dump_dir, **kw):
    name = name_of(knobs)
    return name, sm90.compile(ARCH, knobs, name, str(dump_dir), **kw)


# --------------------------------------------------------------------------
# registry and static API
# --------------------------------------------------------------------------

def test_registry_maps_gemm_on_sm90a_to_this_family():
    assert registry.FAMILIES[("gemm_w4a4", "sm_90a")] == "svdq_kernels.sm90_wgmma_w4a4"
    # the GEMM of sm_90a is this family; the Blackwell archs (datacenter, GeForce/workstation) have their own
    assert {a: m for (op, a), m in registry.FAMILIES.items() if op == "gemm_w4a4"} == {
        "sm_90a": "svdq_kernels.sm90_wgmma_w4a4", "sm_100a": "svdq_kernels.sm100_gemm_w4a4",
        "sm_103a": "svdq_kernels.sm100_gemm_w4a4", "sm_120a": "svdq_kernels.sm120_gemm_w4a4",
        "sm_121a": "svdq_kernels.sm120_gemm_w4a4"}
    assert sm90.__name__ == "svdq_kernels.sm90_wgmma_w4a4"
    assert "gemm_w4a4" in registry.ops_for("sm_90a")
    assert "sm_90a" in registry.archs()


def test_family_meets_the_contract():
    check_family(sm90)
    assert isinstance(sm90, Family)
    assert sm90.OP == "gemm_w4a4" and sm90.ARCHS == ("sm_90a",) and sm90.NAME == "sm90_wgmma_w4a4"
    assert set(sm90.TUNING) == {"tile_m", "tile_n", "tile_k", "stages", "prefetch", "skip_pad",
                                 "act_decode", "schedule", "wsets", "act_source"}
    assert not set(sm90.TUNING) & set(GEMM_W4A4.feature_names)
    assert tuple(sm90.FEATURE_VALUES) == GEMM_W4A4.feature_names


@pytest.mark.parametrize("op, arch", [("gemm_w4a4", "sm_89"), ("no_such_op", "sm_90a")])
def test_registry_unknown_family_is_a_clear_keyerror(op, arch):
    with pytest.raises(registry.UnknownFamilyError) as info:
        registry.family(op, arch)
    assert isinstance(info.value, KeyError)
    assert (info.value.op, info.value.arch) == (op, arch)
    assert "gemm_w4a4@sm_90a" in str(info.value)


def test_supported_knobs():
    tun, feat = sm90.TUNING, sm90.FEATURE_VALUES
    assert DEFAULT_TM in tun["tile_m"] and DEFAULT_TN in tun["tile_n"] and DEFAULT_TK in tun["tile_k"]
    assert sm90.DEFAULT_STAGES in tun["stages"] and min(tun["stages"]) >= 3   # one barrier per k-tile needs 3
    # every multiple of 16 up to 128, and 256 (LoRA is staged through SMEM in chunks of at most 64 ranks)
    assert feat["rank"] == (0, 16, 32, 48, 64, 80, 96, 112, 128, 256)
    assert feat["scale_layout"] == ("logical",)


def test_deeper_rings_only_where_named():
    """stages 6 / 8 / 12 (the session-24 experiment, configs/sm90_stages.yaml): accepted where a config names them and
    SMEM allows, refused with the numbers where it does not, and never what `auto` resolves to (which keeps the
    shipped depth, so configs/flux.yaml builds what it built before)."""
    ws64 = make_knobs(tile_m=64, schedule="ws", wsets=8, act_source="images", skip_pad=True, act_decode="prmt")
    for st in (6, 8, 12):
        k = dict(ws64, stages=st)
        assert sm90.invalid_reason(ARCH, k) is None, st
        assert f"_stages{st}_" in name_of(k)
        assert sm90.smem_bytes_for(k) > sm90.smem_bytes_for(dict(ws64, stages=4))
    assert sm90.resolve(ARCH, dict(ws64, stages="auto"))["stages"] == 4
    assert max(sm90.AUTO_STAGES) == sm90.DEFAULT_STAGES == 4
    ws256 = dict(ws64, tile_m=256, wsets=2)
    assert sm90.invalid_reason(ARCH, dict(ws256, stages=6)) is None
    why = sm90.invalid_reason(ARCH, dict(ws256, stages=8))
    assert why and "activation stages 262144 B" in why and str(sm90.SMEM_LIMIT_BYTES) in why
    why = sm90.invalid_reason(ARCH, dict(ws64, stages=5))
    assert why and "stages" in why and "5" in why


def test_invalid_reason_accepts_every_rank_and_tile():
    for out_dtype in ("fp16", "bf16"):
        for rank in sm90.FEATURE_VALUES["rank"]:
            for tm, pf in ((128, 1), (128, 2), (256, 1)):
                k = make_knobs(out_dtype=out_dtype, rank=rank, tile_m=tm, prefetch=pf)
                assert sm90.invalid_reason(ARCH, k) is None, k
                assert Variant.make("gemm_w4a4", ARCH, k).invalid_reason() is None, k
                assert sm90.smem_bytes_for(k) <= sm90.SMEM_LIMIT_BYTES
                assert sm90.threads_for(k) == 256
            for sc, w in (("ws", 4), ("ws_splitk2", 4), ("ws_splitk4", 4), ("ws_splitk4", 2)):   # the 64-row tile
                k = make_knobs(out_dtype=out_dtype, rank=rank, tile_m=64, prefetch=2, skip_pad=True, schedule=sc,
                               wsets=w)
                assert sm90.invalid_reason(ARCH, k) is None, k
                split = {"ws": 1}.get(sc) or int(sc[-1])
                assert sm90.requirements(ARCH, k) == {"n_multiple": 128, "k_multiple": 64 * max(2, w) * split}
            for sc, pf in (("ws_splitk2", 1), ("ws_splitk4", 2)):          # split K: not the 256-row tile
                k = make_knobs(out_dtype=out_dtype, rank=rank, prefetch=pf, schedule=sc)
                assert sm90.invalid_reason(ARCH, k) is None, k
                assert sm90.threads_for(k) == 384
                assert sm90.requirements(ARCH, k) == {"n_multiple": 128, "k_multiple": 128 * int(sc[-1])}
            for tm, pf, sp in ((128, 1, False), (128, 2, False), (128, 2, True), (256, 1, False), (256, 2, True)):
                if tm == 256 and rank >= 128:
                    continue                        # ws 256-row tiles stop at rank 96 (below)
                k = make_knobs(out_dtype=out_dtype, rank=rank, tile_m=tm, prefetch=pf, skip_pad=sp, schedule="ws")
                assert sm90.invalid_reason(ARCH, k) is None, k
                assert sm90.smem_bytes_for(k) <= sm90.SMEM_LIMIT_BYTES
                assert sm90.threads_for(k) == 384


def test_ws_register_split_fits_the_launch_allocation():
    """setmaxnreg only moves registers inside the CTA's launch allocation (384 threads x the entry cap):
    a larger split made the MMA warps' setmaxnreg.inc wait forever on the H200."""
    from svdq_kernels import sm90_plan as fam
    assert fam.WS_ENTRY_REGS == 65536 // fam.WS_THREADS // 8 * 8 == 168
    assert 128 * fam.WS_PRODUCER_REGS + 256 * fam.WS_CONSUMER_REGS <= fam.WS_THREADS * fam.WS_ENTRY_REGS
    assert fam.WS_PRODUCER_REGS % 8 == 0 and fam.WS_CONSUMER_REGS % 8 == 0
    assert 24 <= fam.WS_PRODUCER_REGS < fam.WS_ENTRY_REGS < fam.WS_CONSUMER_REGS <= 256
    # three MMA warpgroups (tile_n 192): 512 threads at 128 registers each, producer 24, MMA warps 160
    entry, producer, consumer = fam.WIDE_REGS
    assert entry == 65536 // 512 // 8 * 8 == 128 and (producer, consumer) == (24, 160)
    assert 128 * producer + 384 * consumer <= 512 * entry and producer % 8 == 0 == consumer % 8
    wide = fam._cfg_of(make_knobs(tile_n=192, schedule="ws", act_source="images", prefetch=1, skip_pad=True))
    assert fam.ws_regs(wide) == fam.WIDE_REGS and fam.threads_of(wide) == 512 and fam.mma_warpgroups(wide) == 3
    assert fam.ws_regs(fam._cfg_of(make_knobs(schedule="ws"))) == (168, fam.WS_PRODUCER_REGS, 216)


@pytest.mark.parametrize("knobs, words", [
    (dict(tile_m=512), "tile_m 512 not supported"),
    (dict(tile_n=512), "tile_n 512 not supported"),
    (dict(tile_n=256), "tile_n 256 needs schedule ws"),
    (dict(tile_n=256, schedule="ws"), "ptxas serialises every wgmma"),
    (dict(schedule="pingpong"), "schedule 'pingpong' not supported"),
    (dict(schedule="ws", tile_m=256, rank=128), "rank 128: 128 accumulator registers and the LoRA epilogue"),
    (dict(schedule="ws", tile_m=256, prefetch=2), "prefetch 2 and skip_pad off"),
    (dict(schedule="ws_splitk2", tile_m=256), "act_source nvfp4: at 128 accumulator registers the split-K kernel spills"),
    (dict(schedule="ws_splitk2", tile_m=256, act_source="images", rank=48),
     "rank 48: at 128 accumulator registers the two-way split-K kernel keeps a stack frame at ranks other than "
     "0, 16, 32, 64"),
    (dict(schedule="ws_splitk2", tile_m=256, act_source="images", rank=96), "two-way split-K kernel keeps a stack"),
    (dict(schedule="ws_splitk4", stages=3), "65536 B) are exchanged through the activation stages, which hold only 49152 B"),
    (dict(tile_k=128), "tile_k 128 not supported"),
    (dict(stages=2), "stages 2 not supported"),
    (dict(prefetch=3), "prefetch 3 not supported"),
    (dict(act_decode="lut"), "act_decode 'lut' not supported"),
    (dict(prefetch=2, tile_m=256), "prefetch 2 with tile_m=256"),
    (dict(rank=24), "rank 24 not supported"),
    (dict(out_dtype="fp8"), "out_dtype 'fp8' not supported"),
    (dict(scale_layout="blocked"), "scale_layout 'blocked' not supported"),
    (dict(wcscale=1), "wcscale 1 not supported"),
    (dict(cluster_m=2), "unknown knobs ['cluster_m']"),
    (dict(tile_m=64), "tile_m 64 with schedule coop: its 64 x 2 32-k activation chunks per k-tile do not divide "
                      "over the 256 decoding threads"),
    (dict(wsets=4), "wsets 4 with schedule coop"),
    (dict(wsets=3, schedule="ws"), "wsets 3 not supported"),
    (dict(tile_n=192), "tile_n 192 with schedule coop and act_source nvfp4: three MMA warpgroups leave 24 registers"),
    (dict(tile_n=192, schedule="ws"), "not for a decoding producer"),
    (dict(tile_n=192, schedule="ws_splitk2", act_source="images"),
     "(ws or ws_streamk, act_source images, no cluster split)"),
    (dict(tile_n=192, schedule="ws", act_source="images", tile_m=208),
     "tile 208x192: 104 accumulator registers per MMA thread do not fit the 160 registers"),
    (dict(tile_n=320, schedule="ws"), "tile_n 320 not supported"),
    (dict(schedule="ws_streamk"), "schedule ws_streamk with act_source nvfp4: the stream-K meetings' workspace"),
    (dict(tile_n=192, schedule="ws_streamk"), "tile_n 192 with schedule ws_streamk and act_source nvfp4"),
])
def test_invalid_reason_rejects_with_a_reason(knobs, words):
    reason = sm90.invalid_reason(ARCH, make_knobs(**knobs))
    assert isinstance(reason, str) and words in reason, reason


def test_the_two_way_split_images_tile_takes_the_ranks_it_compiles_at():
    for rank in (0, 16, 32, 64):
        k = make_knobs(schedule="ws_splitk2", tile_m=256, act_source="images", prefetch=1, rank=rank)
        assert sm90.invalid_reason(ARCH, k) is None, (rank, sm90.invalid_reason(ARCH, k))
    for rank in (48, 96):       # the four-way split and the 128-row two-way split keep these ranks
        assert sm90.invalid_reason(ARCH, make_knobs(schedule="ws_splitk4", tile_m=256, act_source="images",
                                                    prefetch=1, rank=rank)) is None
        assert sm90.invalid_reason(ARCH, make_knobs(schedule="ws_splitk2", tile_m=128, prefetch=2, rank=rank)) is None


def test_the_224_row_tile_is_an_images_tile_only():
    """No producer decode, no 64-row blocks: tile_m 224 is valid for act_source images (ws, 112 accumulators) and
    refused, with the reason, for the nvfp4 producer; an images tile height the image does not cover is refused."""
    ok = sm90.invalid_reason(ARCH, make_knobs(tile_m=224, schedule="ws", act_source="images"))
    assert ok is None, ok
    nv = sm90.invalid_reason(ARCH, make_knobs(tile_m=224, schedule="ws", act_source="nvfp4"))
    assert "tile_m 224 with act_source nvfp4" in nv and "64-row blocks" in nv
    from svdq_kernels.sm90_plan import _Cfg, _problem
    odd = _problem(_Cfg("bf16", 32, True, True, 192, 128, 4, schedule="ws", act_source="images"))
    assert "tile_m 192 with act_source images" in odd and "208, 224, 256 rows" in odd and "216 where" in odd
    inner = sm90.invalid_reason(ARCH, make_knobs(tile_m=216, schedule="ws", act_source="images", wsets=4))
    assert inner is None, inner     # served where its row tiles lie inside the image (decode_act.tile_rows_problem)
    big = _problem(_Cfg("bf16", 128, True, True, 224, 128, 4, schedule="ws", act_source="images"))
    assert "112 accumulator registers" in big and "rank 128" in big


def test_resource_rules_give_numbers():
    from svdq_kernels.sm90_plan import _Cfg, _problem
    # 4 stages of a 256 x 64 fp16 activation tile = 128 KiB; a 256-row LoRA chunk of 64 ranks = 64 KiB
    assert _problem(_Cfg("bf16", 256, True, True, 256, 128, 4)) is None
    assert "128 accumulator registers" in _problem(_Cfg("bf16", 32, True, True, 256, 128, 4, 2))
    too_many = _problem(_Cfg("bf16", 32, True, True, 512, 128, 4))
    assert "256 fp32 accumulator registers" in too_many and "128" in too_many
    too_big = _problem(_Cfg("bf16", 32, True, True, 256, 128, 8))
    assert "262144 B of dynamic SMEM" in too_big and str(sm90.SMEM_LIMIT_BYTES) in too_big


def test_variant_name_requirements_and_resolve():
    k = make_knobs(out_dtype="bf16", rank=32)
    v = Variant.make("gemm_w4a4", ARCH, k)
    assert v.name == ("svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_wcscale1_bias1"
                      "_tilem128_tilen128_tilek64_stages4_prefetch1_skippad0_actdecodeshift_schedulecoop_wsets2_actsourcenvfp4"
                      "_reqn128k128")
    assert v.name == name_of(k) and v.knob_dict == k and v.family() is sm90
    # N is tiled by 128 weight rows; K by 64, and the k loop is unrolled by two
    assert v.requirements() == {"n_multiple": 128, "k_multiple": 128}
    assert sm90.resolve(ARCH, dict(k, stages="auto")) == k
    assert sm90.config_axes(ARCH, {}) == ([dict(tile_m=128, tile_n=128, tile_k=64, stages="auto", prefetch=1,
                                                   skip_pad=True, act_decode="prmt", schedule="coop", wsets=2, act_source="nvfp4")], [])
    axes, problems = sm90.config_axes(ARCH, {"tiles": [[256, 128, 64], [256, 128, 64]], "clusters": [[1, 1]]})
    assert axes == [dict(tile_m=256, tile_n=128, tile_k=64, stages="auto", prefetch=1, skip_pad=True,
                         act_decode="prmt", schedule="coop", wsets=2, act_source="nvfp4")]
    assert any(p.startswith("clusters:") for p in problems)
    assert any(p.startswith("tiles[1]:") and "duplicate" in p for p in problems)
    axes, problems = sm90.config_axes(ARCH, {"prefetch": [1, 2, 2]})
    assert [a["prefetch"] for a in axes] == [1, 2] and any("prefetch[2]" in p for p in problems)
    axes, problems = sm90.config_axes(ARCH, {"skip_pad": [False, True, 1]})
    assert [a["skip_pad"] for a in axes] == [False, True] and any("skip_pad[2]: 1: expected true or false" in p
                                                                  for p in problems)
    _, problems = sm90.config_axes(ARCH, {"tiles": [[128, 128]]})
    assert any("tile_k" in p for p in problems)
    _, problems = sm90.config_axes(ARCH, {"schedule": ["ws", 3]})
    assert any(p.startswith("schedule[1]: 3: expected a name") for p in problems)


def test_config_forms_are_a_union_not_a_product():
    """``forms``: each form's own product, then the union (one schedule per tile without the cross terms)."""
    axes, problems = sm90.config_axes(ARCH, {"forms": [
        {"tiles": [[128, 128, 64]], "schedule": ["ws"], "prefetch": [2]},
        {"tiles": [[256, 128, 64]], "schedule": ["coop"]},
        {"tiles": [[256, 128, 64]]}]})                      # the same form again: no duplicate
    assert problems == []
    assert axes == [dict(tile_m=128, tile_n=128, tile_k=64, stages="auto", prefetch=2, skip_pad=True,
                         act_decode="prmt", schedule="ws", wsets=2, act_source="nvfp4"),
                    dict(tile_m=256, tile_n=128, tile_k=64, stages="auto", prefetch=1, skip_pad=True,
                         act_decode="prmt", schedule="coop", wsets=2, act_source="nvfp4")]
    _, problems = sm90.config_axes(ARCH, {"forms": [{"tiles": [[128, 128, 64]], "schedul": ["ws"]}],
                                          "stages": [4]})
    assert any(p.startswith("forms[0].schedul: unknown key") for p in problems)
    assert any(p.startswith("stages: not allowed beside forms") for p in problems)
    assert sm90.config_axes(ARCH, {"forms": []})[1] == ["forms: []: expected a non-empty list of mappings"]


def test_a_form_can_be_limited_to_some_ranks():
    from svdq_aot.variants import ONLY_KEY
    got, problems = sm90.config_axes(ARCH, {"forms": [{"tiles": [[256, 128, 64]], "schedule": ["coop"], "ranks": [128]},
                                                      {"tiles": [[128, 128, 64]], "schedule": ["ws"]}]})
    assert not problems and len(got) == 2
    assert got[0][ONLY_KEY] == {"rank": (128,)} and ONLY_KEY not in got[1]
    for bad in ([], [True], "128", [16.0]):
        _, problems = sm90.config_axes(ARCH, {"forms": [{"schedule": ["coop"], "ranks": bad}]})
        assert problems and "forms[0].ranks" in problems[0] and "non-empty list of integers" in problems[0]


def test_enumeration_builds_a_limited_form_for_its_ranks_only(tmp_path):
    from svdq_aot.config import load_config
    from svdq_aot.variants import enumerate_variants
    p = tmp_path / "c.yaml"
    p.write_text("name: t\narchs: [sm_90a]\nout_dtypes: [bf16]\nranks: [0, 32, 128]\nwcscale: [true]\n"
                 "bias: [true]\nshapes: {a: {k: 256, n: 256}}\nvariants:\n  sm_90a:\n    gemm_w4a4:\n      forms:\n"
                 "        - {tiles: [[256, 128, 64]], schedule: [coop], ranks: [128]}\n"
                 "        - {tiles: [[128, 128, 64]], schedule: [ws], prefetch: [2]}\n")
    valid, rejected = enumerate_variants(load_config(p))
    got = sorted((v.knob_dict["schedule"], v.knob_dict["rank"]) for v in valid)
    assert got == [("coop", 128), ("ws", 0), ("ws", 32), ("ws", 128)] and not rejected
    assert all("_only" not in v.name and "_only" not in v.knob_dict for v in valid)


def test_smem_plan():
    # activation stages: stages x tile_m x 64 fp16
    assert sm90.smem_bytes_for(make_knobs(rank=0, stages=4)) == 4 * 128 * 64 * 2
    assert sm90.smem_bytes_for(make_knobs(rank=0, stages=3, tile_m=256)) == 3 * 256 * 64 * 2
    # a LoRA chunk re-uses those bytes: (128 + 128) rows x 64 ranks x 2 B = 32 KiB < 64 KiB of stages
    assert sm90.smem_bytes_for(make_knobs(rank=256, stages=4)) == 4 * 128 * 64 * 2
    # ws: the producer fills the stages of the next tile during the epilogue, so the LoRA chunk has its own
    # bytes after the stages, then 2 x stages mbarriers (each part rounded up to 1 KiB)
    from svdq_kernels.sm90_plan import _cfg_of, _smem_plan
    plan = _smem_plan(_cfg_of(make_knobs(rank=32, tile_m=256, schedule="ws")))
    assert plan["lu_offset"] == 4 * 256 * 64 * 2 and plan["la_offset"] == plan["lu_offset"] + 128 * 32 * 2
    assert plan["bar_offset"] == plan["lu_offset"] + (128 + 256) * 32 * 2
    assert plan["total_bytes"] == plan["bar_offset"] + 1024
    assert sm90.smem_bytes_for(make_knobs(rank=0, schedule="ws")) == 4 * 128 * 64 * 2 + 1024


def test_compile_refuses_invalid_variants_before_tracing(tmp_path):
    bad = make_knobs(tile_m=512)
    with pytest.raises(ValueError, match=r"cannot compile .*tile_m 512 not supported"):
        sm90.compile(ARCH, bad, name_of(bad), str(tmp_path))
    with pytest.raises(ValueError, match="must not contain 'cutlass'"):
        sm90.compile(ARCH, make_knobs(), "svdq_cutlass_gemm", str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_static_problem_rules():
    from svdq_kernels.sm90_wgmma_w4a4 import static_problem
    ok = {"k_0": {"registers": 200, "stack_frame_bytes": 0}}
    assert static_problem("wgmma.mma_async.sync.aligned.m64n128k16", ok) is None
    assert "no wgmma" in static_problem("mma.sync.aligned.m16n8k16", ok)
    # a form built for the paired store must contain its transpose
    assert "not the paired store" in static_problem("wgmma.mma_async", ok, "wgmma.mma_async", True)
    assert static_problem("wgmma.mma_async movmatrix.sync.aligned.m8n8.trans.b16", ok, "wgmma.mma_async", True) is None
    assert "8-byte stack frame" in static_problem("wgmma.mma_async", {"k_0": {"registers": 255,
                                                                             "stack_frame_bytes": 8}})


# --------------------------------------------------------------------------
# compiles (1-5 s each): every build also runs static_problem (wgmma present, no stack frame)
# --------------------------------------------------------------------------

#: the knobs every images-form case below shares (with wcscale and bias)
_IMAGES = dict(wcscale=True, bias=True, prefetch=1, skip_pad=True, act_decode="prmt", act_source="images")
COMPILE_CASES = [
    dict(out_dtype="fp16", rank=0, wcscale=False, bias=False),
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True),
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, tile_m=256),
    dict(out_dtype="fp16", rank=96, wcscale=True, bias=False, tile_m=256),
    dict(out_dtype="bf16", rank=256, wcscale=False, bias=True, tile_m=256),
    dict(out_dtype="fp16", rank=48, wcscale=False, bias=True, stages=3),
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, prefetch=2),
    dict(out_dtype="fp16", rank=256, wcscale=True, bias=True, prefetch=2),
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, tile_m=256, skip_pad=True),
    dict(out_dtype="fp16", rank=96, wcscale=True, bias=True, prefetch=2, skip_pad=True, act_decode="prmt"),
    dict(out_dtype="bf16", rank=64, wcscale=False, bias=True, tile_m=256, skip_pad=True, act_decode="prmt"),
    # warp-specialised: the configs/flux.yaml form, rank 0, a tail-decoding form, the 256-row tile
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, prefetch=2, skip_pad=True, act_decode="prmt",
         schedule="ws"),
    dict(out_dtype="fp16", rank=0, wcscale=False, bias=False, schedule="ws"),
    dict(out_dtype="fp16", rank=96, wcscale=True, bias=True, tile_m=256, prefetch=2, schedule="ws",
         skip_pad=True, act_decode="prmt"),
    dict(out_dtype="bf16", rank=256, wcscale=True, bias=False, prefetch=2, schedule="ws"),
    # split K over clusters of 2 / 4 CTAs (run and float64-checked on the H200, session 5)
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, prefetch=2, skip_pad=True, act_decode="prmt",
         schedule="ws_splitk4"),
    dict(out_dtype="fp16", rank=96, wcscale=False, bias=True, schedule="ws_splitk2"),
    # the 64-row tile (wgmma N = 64) with four raw weight sets: unsplit at a 16-rank LoRA chunk (two threads
    # per lora_act_in vector), and split over four CTAs (configs/flux.yaml's M <= 64 forms)
    dict(out_dtype="bf16", rank=16, wcscale=True, bias=True, tile_m=64, prefetch=2, skip_pad=True,
         act_decode="prmt", schedule="ws", wsets=4, act_source="nvfp4"),
    dict(out_dtype="fp16", rank=96, wcscale=True, bias=False, tile_m=64, prefetch=2, skip_pad=True,
         act_decode="prmt", schedule="ws_splitk4", wsets=4, act_source="nvfp4"),
    # the 128 x 192 images tile: three MMA warpgroups, 512 threads, 24 / 160 registers
    dict(_IMAGES, out_dtype="bf16", rank=32, tile_n=192, schedule="ws", wsets=4),
    dict(_IMAGES, out_dtype="fp16", rank=128, tile_n=192, schedule="ws", wsets=2),
    # stream-K (an experiment form, configs/sm90_streamk.yaml): the 64-row tile in units of four k-tiles, and the
    # 256-row tile (128 accumulator registers besides the meeting) in units of two
    dict(_IMAGES, out_dtype="bf16", rank=32, tile_m=64, schedule="ws_streamk", wsets=4),
    dict(_IMAGES, out_dtype="fp16", rank=64, tile_m=256, schedule="ws_streamk", wsets=2),
    # and the 64 x 192 tile's three MMA warpgroups under stream-K (session 25); the 128 x 192 one, which
    # configs/flux.yaml builds since session 48 (the owner meeting), at the largest rank
    dict(_IMAGES, out_dtype="bf16", rank=32, tile_m=64, tile_n=192, schedule="ws_streamk", wsets=4),
    dict(_IMAGES, out_dtype="fp16", rank=128, tile_m=128, tile_n=192, schedule="ws_streamk", wsets=4),
]


@pytest.mark.parametrize("knobs", COMPILE_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_compile_produces_a_clean_sm90a_cubin(knobs, tmp_path):
    k = make_knobs(**knobs)
    name, ck = compile_knobs(k, tmp_path, keep_ptx=True)
    assert isinstance(ck, CompiledKernel)
    assert ck.cubin.startswith(b"\x7fELF")
    assert ck.entry == ck.compiled.function_name == name.replace("svdq_", "svdq_host_", 1)
    assert ck.kernel_symbols == [name + "_0"]
    sym = ck.kernel_symbols[0]
    assert sym.encode() in ck.cubin
    assert ck.smem_bytes == sm90.smem_bytes_for(k)
    usage = ck.resource_usage[sym]
    assert 0 < usage["registers"] <= 255 and usage["stack_frame_bytes"] == 0
    ptx = (tmp_path / f"{ck.entry}.{ARCH}.ptx").read_text()
    assert ".target sm_90a" in ptx
    # main loop: wgmma with the weight fragment in registers ({...} A operand), fp16 in, fp32 accumulate
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n%dk16\.f32\.f16\.f16\s+\{" % k["tile_m"], ptx)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mul.rn.f16x2" in ptx       # exact scale decode
    assert "fence.proxy.async.shared::cta" in ptx
    if k["rank"]:   # LoRA: wgmma in the output dtype, both operands from SMEM (descriptors)
        lt = "bf16" if k["out_dtype"] == "bf16" else "f16"
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n%dk16\.f32\.%s\.%s\s+\{[^}]*\},\s*%%rd"
                         % (k["tile_m"], lt, lt), ptx)
    sass = sass_of_cubin(ck.cubin, tmp_path)
    hgmma = re.findall(r"HGMMA\.64x%dx16\.F32(\.BF16)? R\d+, (R\d+|gdesc)" % k["tile_m"], sass)
    main = [h for h in hgmma if h[1].startswith("R")]      # register-sourced A: the weight fragments
    assert len(main) == max(2, k["wsets"]) * 4, hgmma      # two (four) unrolled k-tiles x four k16 steps
    assert len(hgmma) - len(main) == k["rank"] // 16        # one SMEM-sourced HGMMA per 16 ranks
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory traffic in the SASS"
    # 16-byte loads; the LoRA (and a decoding producer's activations) reach SMEM as 16-byte stores, or as 16-byte
    # cp.async copies (the early epilogue's one-chunk LoRA in an images form)
    assert "LDG.E.128" in sass and ("STS.128" in sass or "LDGSTS.E.BYPASS.128" in sass)
    assert "F2FP.F16.E4M3.UNPACK" in sass
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass          # one wgmma group kept in flight
    # (the default early epilogue's LoRA copies with cp.async: test_the_early_epilogue_copies_a_one_chunk_lora_...)
    # the output store: one movmatrix transpose per accumulator pair, then the build's store form
    check_output_store(sass, k["tile_n"] // 128 * k["tile_m"] // 4)    # per 64-row atom: tile_m / 2 accumulators
    assert "movmatrix.sync.aligned.m8n8.trans.b16" in ptx
    # not serialised by ptxas (it falls back to a full wait after every wgmma when registers run short):
    # no full wait between the first and the last register-sourced (main-loop) HGMMA
    ops = re.findall(r"(HGMMA\.\S+ R\d+, R\d+|WARPGROUP\.DEPBAR\.LE gsb0, 0x0)", sass)
    first = next(i for i, o in enumerate(ops) if o.startswith("HGMMA"))
    last = max(i for i, o in enumerate(ops) if o.startswith("HGMMA"))
    assert not [o for o in ops[first:last] if o.startswith("WARPGROUP")], "main-loop wgmmas serialised"
    if k["schedule"].startswith("ws_splitk"):
        # the two cluster barriers around the reduction, joined by the producer and the MMA warps; rank 0 reads
        # each peer's 64 partial sums per thread as 16 128-bit distributed-SMEM loads
        assert sass.count("UCGABAR_ARV") == 4 and sass.count("UCGABAR_WAIT") == 4
        assert len(re.findall(r"\bLD\.E\.128\b", sass)) >= k["tile_m"] // 8
    else:
        assert "UCGABAR" not in sass
    nv4 = k["tile_n"] // 128 * k["tile_m"] // 2 // 4             # 16-byte vectors of accumulators per MMA thread
    if k["schedule"] == "ws_streamk":
        # a split tile's meeting: the partial sums out as 128-bit stores, one GPU-scope fence and one compare-and-swap
        # (the arrival), the other parts read back with relaxed GPU-scope 128-bit loads, and the counter reset
        assert len(re.findall(r"\bSTG\.E\.128\b", sass)) == nv4
        assert len(re.findall(r"\bLDG\.E\.128\.STRONG\.GPU\b", sass)) == nv4
        assert sass.count("ATOMG.E.CAS.64.STRONG.GPU") == 1 and "MEMBAR.ALL.GPU" in sass
        assert sass.count("STG.E.64.STRONG.GPU") == 1
    else:
        assert "ATOMG" not in sass and "STRONG.GPU" not in sass
    if k["schedule"].startswith("ws"):
        from svdq_kernels import sm90_plan as fam
        entry, producer, consumer = fam.ws_regs(fam._cfg_of(k))
        assert f"USETMAXREG.DEALLOC.CTAPOOL {producer:#x}" in sass
        assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {consumer:#x}" in sass
        assert "SYNCS.ARRIVE.TRANS64" in sass and "SYNCS.PHASECHK.TRANS64" in sass      # the mbarrier ring
        assert usage["registers"] == entry
        assert "mbarrier.init.shared" in ptx or "mbarrier.init" in ptx


# the forms configs/flux.yaml builds: at one-chunk ranks (16, 32, 64) under ws the early epilogue copies the LoRA at
# tile start; at a rank of several chunks, under split K and in the coop form it does not (the 256-row tile spills)
EARLY_CASES = [
    dict(out_dtype="bf16", rank=32, tile_m=208, schedule="ws", wsets=4, act_source="images"),
    dict(out_dtype="fp16", rank=32, tile_m=216, schedule="ws", wsets=4, act_source="images"),   # session 31
    dict(out_dtype="fp16", rank=64, tile_m=256, schedule="ws", act_source="images"),
    dict(out_dtype="bf16", rank=16, tile_m=64, schedule="ws", wsets=8, act_source="images"),
    dict(out_dtype="fp16", rank=32, tile_m=128, schedule="ws", prefetch=2),
    dict(out_dtype="bf16", rank=96, tile_m=256, schedule="ws", act_source="images"),
    dict(out_dtype="bf16", rank=64, tile_m=256, schedule="ws_splitk2", act_source="images"),
    dict(out_dtype="fp16", rank=128, tile_m=256, schedule="coop"),
    dict(out_dtype="bf16", rank=32, tile_m=128, tile_n=192, schedule="ws", wsets=4, act_source="images"),
]


@pytest.mark.parametrize("knobs", EARLY_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_the_early_epilogue_copies_a_one_chunk_lora_at_tile_start(knobs, tmp_path, monkeypatch):
    """The early epilogue (the default since session 28): every form compiles without a stack frame, and exactly
    the ws forms without split K at a one-chunk rank issue the chunk's 16-byte cp.async copies (lora_up's and
    lora_act_in's vectors of one thread) and wait for them once."""
    from svdq_kernels import sm90_wgmma_kernel as kern
    from svdq_kernels.sm90_plan import _lora_chunk
    monkeypatch.setattr(kern, "EPILOGUE", "early")
    k = make_knobs(**dict(dict(prefetch=1, skip_pad=True, act_decode="prmt"), **knobs))
    name, ck = compile_knobs(k, tmp_path, keep_ptx=True)
    usage = ck.resource_usage[ck.kernel_symbols[0]]
    assert usage["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    ptx = (tmp_path / f"{ck.entry}.{ARCH}.ptx").read_text()
    assert not re.search(r"\b(STL|LDL)\b", sass)
    copies = len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", sass))
    if k["schedule"] == "ws" and _lora_chunk(k["rank"]) == k["rank"]:
        from svdq_kernels.sm90_plan import _cfg_of, mma_warpgroups
        vpr, nt = k["rank"] // 8, 128 * mma_warpgroups(_cfg_of(k))      # 256 MMA threads, 384 at tile_n 192
        assert copies == k["tile_n"] * vpr // nt + -(-k["tile_m"] * vpr // nt)
        assert len(re.findall(r"cp\.async\.wait_group\s+0;", ptx)) == 1 and "LDGDEPBAR" in sass
    else:
        assert copies == 0


LORA_STAGING_SHAPES = [(128, 192, 32), (128, 192, 96), (64, 128, 16), (64, 128, 48), (208, 128, 32), (216, 128, 16),
                       (224, 128, 32), (256, 128, 64), (128, 128, 128)]


@pytest.mark.parametrize("spare", ["duplicate", "skip"])
@pytest.mark.parametrize("tm,tn,rank", LORA_STAGING_SHAPES)
def test_the_lora_staging_copies_every_vector(tm, tn, rank, spare, monkeypatch):
    """Each 16-byte vector of a LoRA chunk (lora_act_in's and lora_up's) is copied by an MMA thread, also where the
    vectors do not divide over the threads.  ``skip`` (SVDQ_KERNEL_SM90_LORA_SPARE, the default) copies each exactly
    once: the spare threads' copy sits behind a false predicate.  ``duplicate`` (shipped until session 41) has them
    copy a vector another thread copies too: the write-write hazards compute-sanitizer's racecheck reported in the
    128 x 192 and the 208- to 224-row tiles (docs/VERIFICATION.md, sessions 40 and 41), which this counts.  The
    generators run with plain ints for the thread index, as the kernel traces them with its own."""
    from collections import Counter
    from types import SimpleNamespace
    from svdq_kernels import sm90_wgmma_kernel as kern
    from svdq_kernels.sm90_plan import _lora_chunk
    monkeypatch.setattr(kern, "LORA_SPARE", spare)
    rc = _lora_chunk(rank)
    vpr, nt = rc // 8, 128 * (3 if tn == 192 else 2)
    fake = SimpleNamespace(mma_threads=nt, rc=rc, tm=tm, tn=tn)
    la_copies, lu_copies, skipped = Counter(), Counter(), 0
    for tid in range(nt):
        lu, la = kern._Sm90Wgmma._lora_vectors(fake, tid)
        lu_copies.update(lu)
        for r, cv, ok in la:
            assert ok in (True, False) and 0 <= r < tm and 0 <= cv < vpr      # the address is in range either way
            la_copies[(r, cv)] += bool(ok)
            skipped += not ok
    spares = -(-tm * vpr // nt) * nt - tm * vpr
    assert set(la_copies) == {(r, c) for r in range(tm) for c in range(vpr)} and min(la_copies.values()) >= 1
    assert lu_copies == Counter({(r, c): 1 for r in range(tn) for c in range(vpr)})
    if spare == "skip":
        assert max(la_copies.values()) == 1 and skipped == spares
    else:
        assert skipped == 0 and sum(la_copies.values()) - tm * vpr == spares      # each spare copy a duplicate


@pytest.mark.parametrize("knobs", [EARLY_CASES[8], EARLY_CASES[3]], ids=("128x192-r32", "64x128-r16"))
def test_the_skipped_spare_copies_compile_like_the_duplicates(knobs, tmp_path, monkeypatch):
    """SVDQ_KERNEL_SM90_LORA_SPARE=skip on two tiles whose LoRA vectors do not divide over the MMA threads: no
    stack frame, the same registers, the same 16-byte cp.async copies in the SASS (the spare threads branch past
    theirs), and a different cubin from the duplicate form's."""
    from svdq_kernels import sm90_wgmma_kernel as kern
    monkeypatch.setattr(kern, "EPILOGUE", "early")
    k = make_knobs(**dict(dict(prefetch=1, skip_pad=True, act_decode="prmt"), **knobs))
    built = {}
    for spare in ("duplicate", "skip"):
        monkeypatch.setattr(kern, "LORA_SPARE", spare)
        d = tmp_path / spare
        d.mkdir()
        _, ck = compile_knobs(k, d)
        usage = ck.resource_usage[ck.kernel_symbols[0]]
        sass = sass_of_cubin(ck.cubin, d)
        built[spare] = (ck.cubin, usage["stack_frame_bytes"], usage["registers"],
                        len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", sass)))
    assert built["skip"][0] != built["duplicate"][0]
    assert built["skip"][1:] == built["duplicate"][1:] and built["skip"][1] == 0


def test_the_lora_spare_switch_names_its_values():
    """A bad SVDQ_KERNEL_SM90_LORA_SPARE is refused at import with the value and the allowed forms."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import svdq_kernels.sm90_wgmma_kernel"], capture_output=True,
                       text=True, env=dict(os.environ, SVDQ_KERNEL_SM90_LORA_SPARE="twice"))
    assert r.returncode != 0 and "SVDQ_KERNEL_SM90_LORA_SPARE='twice'" in r.stderr and "duplicate, skip" in r.stderr


def test_the_late_epilogue_copies_no_lora_with_cp_async(tmp_path, monkeypatch):
    """SVDQ_KERNEL_SM90_EPILOGUE=late (the form before session 28, kept for side-by-side builds): the one-chunk LoRA
    is loaded when its MMAs come, with no cp.async."""
    from svdq_kernels import sm90_wgmma_kernel as kern
    monkeypatch.setattr(kern, "EPILOGUE", "late")
    k = make_knobs(**dict(dict(prefetch=1, skip_pad=True, act_decode="prmt"), **EARLY_CASES[0]))
    name, ck = compile_knobs(k, tmp_path, keep_ptx=True)
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    assert "LDGSTS" not in sass_of_cubin(ck.cubin, tmp_path)


def test_the_epilogue_switch_names_its_values():
    """A bad SVDQ_KERNEL_SM90_EPILOGUE is refused at import with the value and the allowed forms."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import svdq_kernels.sm90_wgmma_kernel"], capture_output=True,
                       text=True, env=dict(os.environ, SVDQ_KERNEL_SM90_EPILOGUE="soon"))
    assert r.returncode != 0
    assert "SVDQ_KERNEL_SM90_EPILOGUE='soon': the sm_90a epilogue form must be one of early, late" in r.stderr


@pytest.mark.parametrize("tile_m, wsets, rank", [(64, 4, 32), (256, 2, 64)])
def test_the_owner_meeting_waits_instead_of_writing_its_own_slot(tile_m, wsets, rank, tmp_path, monkeypatch):
    """SVDQ_KERNEL_SM90_STREAMK_MEET=owner (the default since session 48): the stream-K kernel compiles without a stack
    frame; its meeting has the other parts' slot stores and arrival (one fence, one compare-and-swap), and the first
    CTA's bounded wait (an acquire-load loop with nanosleep that traps on timeout) before it reads their slots and
    resets the counter."""
    from svdq_kernels import sm90_wgmma_kernel as kern
    monkeypatch.setattr(kern, "STREAMK_MEET", "owner")
    k = make_knobs(**dict(_IMAGES, out_dtype="bf16", rank=rank, tile_m=tile_m, schedule="ws_streamk", wsets=wsets))
    name, ck = compile_knobs(k, tmp_path, keep_ptx=True)
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    ptx = (tmp_path / f"{ck.entry}.{ARCH}.ptx").read_text()
    nv4 = tile_m // 2 // 4
    assert len(re.findall(r"\bSTG\.E\.128\b", sass)) == nv4
    assert len(re.findall(r"\bLDG\.E\.128\.STRONG\.GPU\b", sass)) == nv4
    assert sass.count("ATOMG.E.CAS.64.STRONG.GPU") == 1 and "MEMBAR.ALL.GPU" in sass
    assert "ld.acquire.gpu.global.b64" in ptx and "nanosleep.u32" in ptx and "%globaltimer" in ptx
    assert "BPT.TRAP" in sass and not re.search(r"\b(STL|LDL)\b", sass)


def test_the_last_arrival_meeting_stays_buildable(tmp_path, monkeypatch):
    """SVDQ_KERNEL_SM90_STREAMK_MEET=last (the default until session 48, kept for comparison): every part stores its
    slot and arrives, the last arrival reads them all back; no CTA waits, so there is no bounded wait and no trap."""
    from svdq_kernels import sm90_wgmma_kernel as kern
    monkeypatch.setattr(kern, "STREAMK_MEET", "last")
    k = make_knobs(**dict(_IMAGES, out_dtype="bf16", rank=32, tile_m=128, tile_n=192, schedule="ws_streamk", wsets=4))
    name, ck = compile_knobs(k, tmp_path, keep_ptx=True)
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    ptx = (tmp_path / f"{ck.entry}.{ARCH}.ptx").read_text()
    assert sass.count("ATOMG.E.CAS.64.STRONG.GPU") == 1 and "MEMBAR.ALL.GPU" in sass
    assert "nanosleep.u32" not in ptx and "BPT.TRAP" not in sass and not re.search(r"\b(STL|LDL)\b", sass)


def test_the_streamk_meeting_switch_names_its_values():
    """A bad SVDQ_KERNEL_SM90_STREAMK_MEET is refused at import with the value and the allowed forms."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import svdq_kernels.sm90_wgmma_kernel"], capture_output=True,
                       text=True, env=dict(os.environ, SVDQ_KERNEL_SM90_STREAMK_MEET="first"))
    assert r.returncode != 0
    assert "SVDQ_KERNEL_SM90_STREAMK_MEET='first': the stream-K meeting must be one of last, owner" in r.stderr


@pytest.mark.parametrize("tile_m, wsets, cut", [(64, 8, 0.15), (208, 4, 0.12), (64, 4, 0.12)])
def test_the_step_ring_takes_the_stages_once_per_loop_step(tile_m, wsets, cut, tmp_path, monkeypatch):
    """SVDQ_KERNEL_SM90_RING=step (the default since session 27): the MMA warps' main loop keeps its wgmmas and loses
    the per-k-tile signed modulo and division of `ring_slot` (ptxas: an arithmetic shift right by 31 feeding a
    LEA.HI), at least `cut` of its instructions (session 25 counted 19 % / 15 % / 18 %), with no stack frame."""
    from kernel_checks import instructions, loops
    from svdq_kernels import sm90_wgmma_kernel as kern
    src = "images" if tile_m != 64 or wsets == 8 else "nvfp4"
    k = make_knobs(**dict(_IMAGES, out_dtype="bf16", rank=32, tile_m=tile_m, schedule="ws", wsets=wsets,
                          act_source=src, prefetch=1 if src == "images" else 4))
    main = {}
    for ring in ("modulo", "step"):
        monkeypatch.setattr(kern, "RING", ring)
        _, ck = compile_knobs(k, tmp_path / ring)
        assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
        ins = instructions(sass_of_cubin(ck.cubin, tmp_path / ring))
        lp = min((lp for lp in loops(ins) if lp["hmma"]), key=lambda lp: lp["instructions"])
        body = [t for a, t in ins if lp["start"] <= a <= lp["end"]]
        main[ring] = (lp, sum("SHF.R.S32.HI" in t for t in body))
    (old, old_div), (new, new_div) = main["modulo"], main["step"]
    assert new["hmma"] == old["hmma"] == 4 * k_unroll_of(k)
    assert new["instructions"] <= (1 - cut) * old["instructions"]
    assert old_div >= k_unroll_of(k) and new_div == 0


def k_unroll_of(knobs):
    from svdq_kernels.sm90_plan import _cfg_of, k_unroll
    return k_unroll(_cfg_of(knobs))


def test_the_step_ring_is_the_default():
    """The shipped build takes the ring once per loop step (timed on an H100 in session 27: 0-2 % faster, every
    sm_90a variant exact); ``modulo`` stays selectable for side-by-side builds."""
    from svdq_kernels import sm90_wgmma_kernel as kern
    import os
    assert os.environ.get("SVDQ_KERNEL_SM90_RING") or kern.RING == "step"


def test_the_ring_switch_names_its_values():
    """A bad SVDQ_KERNEL_SM90_RING is refused at import with the value and the allowed forms."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import svdq_kernels.sm90_wgmma_kernel"], capture_output=True,
                       text=True, env=dict(os.environ, SVDQ_KERNEL_SM90_RING="fast"))
    assert r.returncode != 0
    assert "SVDQ_KERNEL_SM90_RING='fast': the sm_90a ring bookkeeping must be one of modulo, step" in r.stderr


def test_build_refuses_a_variant_that_fails_the_static_checks(monkeypatch, tmp_path):
    from svdq_kernels import sm90_wgmma_w4a4 as fam
    monkeypatch.setattr(fam, "static_problem", lambda ptx, usage, *mma: "planted problem")
    with pytest.raises(RuntimeError, match="planted problem"):
        compile_knobs(make_knobs(rank=0), tmp_path)


def test_selection_takes_ws_while_the_tiles_fill_one_wave_and_coop_beyond():
    """The family's SELECTION over every buildable unsplit form of both tiles at N = K = 3072 on 132 SMs: the
    128-row ws form while its tiles fit one wave (M <= 704: 6 x 24 CTAs), the 256-row coop form from two
    waves on (the measured winners; the split forms: tests/test_select_fill.py)."""
    from types import SimpleNamespace

    from svdq_loader import select
    from svdq_loader.select_rules import Rule, parse_buckets

    forms = [(128, "coop", 1), (128, "coop", 2), (128, "ws", 1), (128, "ws", 2),
             (256, "coop", 1), (256, "ws", 1), (256, "ws", 2)]
    vs = []
    for tm, sc, pf in forms:
        k = make_knobs(out_dtype="bf16", rank=32, tile_m=tm, prefetch=pf, schedule=sc, skip_pad=True,
                       act_decode="prmt")
        if sm90.invalid_reason(ARCH, k) is None:
            vs.append(SimpleNamespace(name=name_of(k), op="gemm_w4a4", arch=ARCH, knobs=k, family=sm90.NAME,
                                      requirements=sm90.requirements(ARCH, k)))
    assert len(vs) == len(forms)
    rules = {("gemm_w4a4", ARCH, sm90.NAME): Rule("gemm_w4a4", ARCH, sm90.NAME,
                                                 parse_buckets(sm90.SELECTION, "sm90.SELECTION"))}

    def pick(m):
        p = select.Problem("gemm_w4a4", ARCH, ("bf16", 32, True, True, "logical"), (("m", m), ("n", 3072), ("k", 3072)))
        kn = select.choose(vs, p, rules, sm_count=132).knobs
        return kn["tile_m"], kn["schedule"], kn["prefetch"]

    for m in (1, 16, 64, 256, 257, 640):
        assert pick(m) == (128, "ws", 2), m
    for m in (1024, 4608, 9728):     # the 256-row schedules tie (+-4 %): ws with two register sets first
        assert pick(m) == (256, "ws", 2), m
    vs = [v for v in vs if v.knobs["schedule"] == "coop" or v.knobs["tile_m"] == 128]    # flux.yaml's 256 form
    for m in (1024, 4608, 9728):
        assert pick(m) == (256, "coop", 1), m

"""Cross-compile the sm_90a W4A4 GEMM kernel family on a CPU-only machine.

Needs the build extra (``nvidia-cutlass-dsl``); skipped without it.  No GPU is
used: the DSL traces and compiles for ``sm_90a`` and we inspect the cubin.
"""
from __future__ import annotations

import os

import pytest

from svdq_aot.family import CompiledKernel, Family, check_family
from svdq_aot.variants import Variant
from svdq_loader.ops import GEMM_W4A4

cutlass = pytest.importorskip(
    "cutlass", reason="nvidia-cutlass-dsl (the build extra) is not installed"
)

from svdq_kernels import registry  # noqa: E402

ARCH = "sm_90a"
sm90 = registry.family("gemm_w4a4", ARCH)

DEFAULT_TM, DEFAULT_TN, DEFAULT_TK = sm90.DEFAULT_TILE


def make_knobs(out_dtype="fp16", rank=32, wcscale=True, bias=True, **kw):
    """A complete knob dict: the op's features (spec order), then the family's tuning knobs."""
    knobs = dict(
        out_dtype=out_dtype,
        rank=rank,
        wcscale=wcscale,
        bias=bias,
        scale_layout="logical",
        tile_m=DEFAULT_TM,
        tile_n=DEFAULT_TN,
        tile_k=DEFAULT_TK,
        stages=sm90.DEFAULT_STAGES,
    )
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
    assert registry.FAMILIES[("gemm_w4a4", "sm_90a")] == "svdq_kernels.sm90_gemm_w4a4"
    # the GEMM of sm_90a is this family; Blackwell datacenter archs have their own
    assert {a: m for (op, a), m in registry.FAMILIES.items() if op == "gemm_w4a4"} == {
        "sm_90a": "svdq_kernels.sm90_gemm_w4a4", "sm_100a": "svdq_kernels.sm100_gemm_w4a4",
        "sm_103a": "svdq_kernels.sm100_gemm_w4a4"}
    assert sm90.__name__ == "svdq_kernels.sm90_gemm_w4a4"
    assert "gemm_w4a4" in registry.ops_for("sm_90a")
    assert "sm_90a" in registry.archs()


def test_family_meets_the_contract():
    check_family(sm90)  # raises FamilyContractError with the problems otherwise
    assert isinstance(sm90, Family)
    assert sm90.OP == "gemm_w4a4"
    assert sm90.ARCHS == ("sm_90a",)
    assert sm90.NAME == "sm90_gemm_w4a4"
    # tuning knobs are the family's own: none of them is a feature of the op
    assert set(sm90.TUNING) == {"tile_m", "tile_n", "tile_k", "stages"}
    assert not set(sm90.TUNING) & set(GEMM_W4A4.feature_names)
    # the family states which value it supports for every feature of the op
    assert tuple(sm90.FEATURE_VALUES) == GEMM_W4A4.feature_names


@pytest.mark.parametrize("op, arch", [("gemm_w4a4", "sm_120a"), ("no_such_op", "sm_90a")])
def test_registry_unknown_family_is_a_clear_keyerror(op, arch):
    with pytest.raises(registry.UnknownFamilyError) as info:
        registry.family(op, arch)
    assert isinstance(info.value, KeyError)
    assert (info.value.op, info.value.arch) == (op, arch)
    msg = str(info.value)
    assert repr(op) in msg and repr(arch) in msg
    assert "gemm_w4a4@sm_90a" in msg  # what is registered


def test_host_args_contract():
    assert GEMM_W4A4.host_args == (
        ("act", "ptr"), ("ascales", "ptr"), ("wgt", "ptr"), ("wscales", "ptr"),
        ("lora_act_in", "ptr"), ("lora_up", "ptr"), ("wcscale", "ptr"), ("bias", "ptr"),
        ("out", "ptr"), ("m", "i32"), ("n", "i32"), ("k", "i32"), ("sm_count", "i32"),
        ("stream", "stream"),
    )
    assert GEMM_W4A4.feature_names == ("out_dtype", "rank", "wcscale", "bias", "scale_layout")
    assert GEMM_W4A4.dims == ("m", "n", "k")


def test_supported_knobs_contain_the_default():
    tun, feat = sm90.TUNING, sm90.FEATURE_VALUES
    assert DEFAULT_TM in tun["tile_m"] and DEFAULT_TN in tun["tile_n"]
    assert DEFAULT_TK in tun["tile_k"] and sm90.DEFAULT_STAGES in tun["stages"]
    assert feat["rank"] == (0, 16, 32, 48, 64, 128)
    assert set(feat["out_dtype"]) == {"fp16", "bf16"}
    assert set(feat["wcscale"]) == {False, True} and set(feat["bias"]) == {False, True}
    assert feat["scale_layout"] == ("logical",)  # what sm_90a reads (layouts.SCALE_LAYOUT_BY_ARCH)


def test_invalid_reason_accepts_every_default_tile_variant():
    for out_dtype in ("fp16", "bf16"):
        for rank in sm90.FEATURE_VALUES["rank"]:
            k = make_knobs(out_dtype=out_dtype, rank=rank)
            assert sm90.invalid_reason(ARCH, k) is None, k
            assert Variant.make("gemm_w4a4", ARCH, k).invalid_reason() is None, k
            assert sm90.smem_bytes_for(k) <= sm90.SMEM_LIMIT_BYTES
            assert sm90.threads_for(k) == 128


@pytest.mark.parametrize(
    "knobs, words",
    [
        (dict(tile_m=512), "tile_m 512 not supported"),
        (dict(tile_k=48), "tile_k 48 not supported"),
        (dict(stages=7), "stages 7 not supported"),
        (dict(rank=256), "rank 256 not supported"),
        (dict(out_dtype="fp8"), "out_dtype 'fp8' not supported"),
        (dict(scale_layout="blocked"), "scale_layout 'blocked' not supported"),
        (dict(wcscale=1), "wcscale 1 not supported"),  # a bool knob given as an int
        (dict(cluster_m=2), "unknown knobs ['cluster_m']"),
        (dict(stages=None), "stages None not supported"),
        # a combination of supported values that breaks the thread mapping
        (dict(tile_m=64, tile_k=32), "tile_m*tile_k/32 = 64 is not a multiple of 128 threads"),
    ],
)
def test_invalid_reason_rejects_with_a_reason(knobs, words):
    reason = sm90.invalid_reason(ARCH, make_knobs(**knobs))
    assert isinstance(reason, str) and words in reason, reason


def test_invalid_reason_names_a_missing_knob_and_a_foreign_arch():
    k = make_knobs()
    del k["stages"]
    assert "knob stages missing" in sm90.invalid_reason(ARCH, k)
    reason = sm90.invalid_reason("sm_100a", make_knobs())
    assert "sm_100a" in reason and "sm_90a" in reason


def test_variant_name_requirements_and_resolve():
    k = make_knobs(out_dtype="bf16", rank=32)
    v = Variant.make("gemm_w4a4", ARCH, k)
    # features (less the arch-fixed scale_layout), tuning knobs, then the requirements
    assert v.name == ("svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_wcscale1_bias1"
                      "_tilem128_tilen128_tilek64_stages2_reqn128k64")
    assert v.name == name_of(k)
    assert v.knob_dict == k and v.family() is sm90
    assert v.requirements() == {"n_multiple": 128, "k_multiple": 64}
    assert sm90.requirements(ARCH, make_knobs(tile_n=64, tile_k=32)) == {"n_multiple": 64, "k_multiple": 32}
    # stages: auto -> the deepest supported count that fits
    assert sm90.resolve(ARCH, dict(k, stages="auto")) == k
    assert sm90.resolve(ARCH, k) == k
    # config section -> tuning dicts; problems name their key
    assert sm90.config_axes(ARCH, {}) == ([dict(tile_m=128, tile_n=128, tile_k=64, stages="auto")], [])
    axes, problems = sm90.config_axes(ARCH, {"tiles": [[64, 64, 32], [64, 64, 32]], "clusters": [[1, 1]]})
    assert axes == [dict(tile_m=64, tile_n=64, tile_k=32, stages="auto")]
    assert any(p.startswith("clusters:") for p in problems)
    assert any(p.startswith("tiles[1]:") and "duplicate" in p for p in problems)


def test_smem_plan_matches_layout_arithmetic():
    # 2 stages x (128 + 128) rows x (64 + 8) fp16 = 73728 B; LoRA R=128 fits inside.
    k = make_knobs(rank=128)
    assert sm90.smem_bytes_for(k) == 2 * (128 + 128) * (64 + 8) * 2
    k1 = make_knobs(rank=0, stages=1)
    assert sm90.smem_bytes_for(k1) == (128 + 128) * (64 + 8) * 2
    # one stage of 64x64x32 is smaller than the LoRA R=128 buffers, which set the size:
    # (64 + 64) rows x (128 + 8) x 2 B = 34816 B (already 128-aligned)
    k2 = make_knobs(rank=128, stages=1, tile_m=64, tile_n=64, tile_k=32)
    assert sm90.smem_bytes_for(k2) == (64 + 64) * (128 + 8) * 2


def test_compile_refuses_invalid_variants_before_tracing(tmp_path):
    bad = make_knobs(tile_m=512)
    with pytest.raises(ValueError, match=r"cannot compile .*tile_m 512 not supported"):
        sm90.compile(ARCH, bad, name_of(bad), str(tmp_path))
    with pytest.raises(ValueError, match="must not contain 'cutlass'"):
        sm90.compile(ARCH, make_knobs(), "svdq_cutlass_gemm", str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing was compiled


# --------------------------------------------------------------------------
# compiles (about 1-2 s each)
# --------------------------------------------------------------------------

COMPILE_CASES = [
    dict(out_dtype="fp16", rank=0, wcscale=False, bias=False),
    dict(out_dtype="bf16", rank=32, wcscale=True, bias=True),
    dict(out_dtype="fp16", rank=128, wcscale=True, bias=False),
    dict(out_dtype="bf16", rank=128, wcscale=False, bias=True),
    dict(out_dtype="fp16", rank=48, wcscale=False, bias=True, stages=1),
    dict(out_dtype="bf16", rank=16, wcscale=True, bias=True, tile_m=64, tile_n=64),
]


@pytest.mark.parametrize("knobs", COMPILE_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_compile_produces_a_clean_sm90a_cubin(knobs, tmp_path):
    k = make_knobs(**knobs)
    name, ck = compile_knobs(k, tmp_path)
    assert isinstance(ck, CompiledKernel)
    assert ck.cubin.startswith(b"\x7fELF")
    assert ck.entry == ck.compiled.function_name
    assert ck.entry == name.replace("svdq_", "svdq_host_", 1)
    assert ck.kernel_symbols == [name + "_0"]  # the variant name, DSL suffix, no "cutlass"
    sym = ck.kernel_symbols[0]
    assert "cutlass" not in sym.lower()
    assert sym.encode() in ck.cubin  # the cubin really holds that kernel
    assert ck.smem_bytes == sm90.smem_bytes_for(k)
    # ptxas result read back from the cubin: at most 255 registers, no spills
    assert set(ck.resource_usage) == {sym}
    usage = ck.resource_usage[sym]
    assert 0 < usage["registers"] <= 255
    assert usage["stack_frame_bytes"] == 0
    assert hasattr(ck.compiled, "ir_module")
    # the cubin was dumped where asked
    assert os.path.isfile(tmp_path / f"{ck.entry}.{ARCH}.cubin")


def test_compile_keeps_ptx_on_request(tmp_path):
    name, ck = compile_knobs(make_knobs(rank=16), tmp_path, keep_ptx=True)
    path = tmp_path / f"{ck.entry}.{ARCH}.ptx"
    assert path.is_file()
    ptx = path.read_text()
    assert ".target sm_90a" in ptx
    assert f".entry {ck.kernel_symbols[0]}(" in ptx
    assert ck.kernel_symbols[0] == name + "_0"
    # tensor-core path: ldmatrix + mma.sync m16n8k16 with fp32 accumulation
    assert "ldmatrix.sync.aligned" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx

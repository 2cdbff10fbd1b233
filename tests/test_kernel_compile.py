"""Cross-compile the sm_90a W4A4 kernel family on a CPU-only machine.

Needs the build extra (``nvidia-cutlass-dsl``); skipped without it.  No GPU is
used: the DSL traces and compiles for ``sm_90a`` and we inspect the cubin.
"""
from __future__ import annotations

import pytest

from svdq_aot.variants import Variant

cutlass = pytest.importorskip(
    "cutlass", reason="nvidia-cutlass-dsl (the build extra) is not installed"
)

from svdq_kernels import registry  # noqa: E402

sm90 = registry.family("sm_90a")

DEFAULT_TM, DEFAULT_TN, DEFAULT_TK = sm90.DEFAULT_TILE


def make_variant(out_dtype="fp16", rank=32, wcscale=True, bias=True, **kw):
    knobs = dict(
        arch="sm_90a",
        out_dtype=out_dtype,
        rank=rank,
        wcscale=wcscale,
        bias=bias,
        tile_m=DEFAULT_TM,
        tile_n=DEFAULT_TN,
        tile_k=DEFAULT_TK,
        stages=sm90.DEFAULT_STAGES,
    )
    knobs.update(kw)
    return Variant(**knobs)


# --------------------------------------------------------------------------
# registry and static API
# --------------------------------------------------------------------------

def test_registry_maps_sm90a_to_this_family():
    assert registry.FAMILIES == {"sm_90a": "svdq_kernels.sm90_w4a4"}
    assert sm90.__name__ == "svdq_kernels.sm90_w4a4"


def test_registry_unknown_arch_is_a_clear_keyerror():
    with pytest.raises(KeyError) as info:
        registry.family("sm_100a")
    msg = str(info.value)
    assert "sm_100a" in msg and "sm_90a" in msg


def test_host_args_contract():
    assert sm90.HOST_ARGS == (
        ("act", "ptr"), ("ascales", "ptr"), ("wgt", "ptr"), ("wscales", "ptr"),
        ("lora_act_in", "ptr"), ("lora_up", "ptr"), ("wcscale", "ptr"), ("bias", "ptr"),
        ("out", "ptr"), ("m", "i32"), ("n", "i32"), ("k", "i32"), ("stream", "stream"),
    )


def test_supported_knobs_contain_the_default():
    sup = sm90.SUPPORTED
    assert DEFAULT_TM in sup["tile_m"] and DEFAULT_TN in sup["tile_n"]
    assert DEFAULT_TK in sup["tile_k"] and sm90.DEFAULT_STAGES in sup["stages"]
    assert sup["cluster"] == ((1, 1),)
    assert sup["ranks"] == (0, 16, 32, 48, 64, 128)
    assert set(sup["out_dtypes"]) == {"fp16", "bf16"}


def test_resource_problem_accepts_every_default_tile_variant():
    for out_dtype in ("fp16", "bf16"):
        for rank in sm90.SUPPORTED["ranks"]:
            v = make_variant(out_dtype=out_dtype, rank=rank)
            assert sm90.resource_problem(v) is None, v
            assert sm90.smem_bytes_for(v) <= sm90.SMEM_LIMIT_BYTES


@pytest.mark.parametrize(
    "knobs, words",
    [
        (dict(tile_m=512), "tile_m"),
        (dict(tile_k=48), "tile_k"),
        (dict(stages=7), "stages"),
        (dict(rank=256), "rank"),
        (dict(out_dtype="fp8"), "out_dtype"),
        (dict(cluster_m=2), "cluster"),
        (dict(arch="sm_100a"), "sm_100a"),
        # a combination of supported values that breaks the thread mapping
        (dict(tile_m=64, tile_k=32), "multiple"),
    ],
)
def test_resource_problem_rejects_with_a_reason(knobs, words):
    reason = sm90.resource_problem(make_variant(**knobs))
    assert isinstance(reason, str) and words in reason


def test_smem_plan_matches_layout_arithmetic():
    # 2 stages x (128 + 128) rows x (64 + 8) fp16 = 73728 B; LoRA R=128 fits inside.
    v = make_variant(rank=128)
    assert sm90.smem_bytes_for(v) == 2 * (128 + 128) * (64 + 8) * 2
    v1 = make_variant(rank=0, stages=1)
    assert sm90.smem_bytes_for(v1) == (128 + 128) * (64 + 8) * 2


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
def test_compile_variant_produces_a_clean_sm90a_cubin(knobs, tmp_path):
    v = make_variant(**knobs)
    cv = sm90.compile_variant(v, str(tmp_path))
    assert cv.cubin.startswith(b"\x7fELF")
    assert cv.entry == cv.compiled.function_name
    assert len(cv.kernel_symbols) == 1
    sym = cv.kernel_symbols[0]
    assert sym.startswith("svdq_") and "cutlass" not in sym.lower()
    assert sym.encode() in cv.cubin  # the cubin really holds that kernel
    assert cv.smem_bytes == sm90.smem_bytes_for(v)
    # ptxas result read back from the cubin: at most 255 registers, no spills
    usage = cv.resource_usage[sym]
    assert 0 < usage["registers"] <= 255
    assert usage["stack_frame_bytes"] == 0
    assert hasattr(cv.compiled, "ir_module")


def test_compile_keeps_ptx_on_request(tmp_path):
    cv = sm90.compile_variant(make_variant(rank=16), str(tmp_path), keep_ptx=True)
    assert cv.ptx is not None
    assert ".target sm_90a" in cv.ptx
    assert f".entry {cv.kernel_symbols[0]}(" in cv.ptx
    # tensor-core path: ldmatrix + mma.sync m16n8k16 with fp32 accumulation
    assert "ldmatrix.sync.aligned" in cv.ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in cv.ptx

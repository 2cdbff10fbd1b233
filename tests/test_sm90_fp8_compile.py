"""The FP8-compute mode's build side on the CPU: the ``gemm_w4a4_fp8`` family (sm90_wgmma_w4a4_fp8) and the
``act_fp8`` pre-pass family (sm90_act_fp8) cross-compiled for sm_90a, their SASS read back (FP8 ``QGMMA`` with a
register A operand, the one-rounding conversions, no local memory), their validity predicates and config sections.

Needs the build extra (``nvidia-cutlass-dsl``); skipped without it.  Nothing here ran on a GPU: the numerics of
these kernels are checked on a GPU by ``svdq-aot selftest`` and tests/test_gpu_fp8.py (run on an H100, session 27)."""
from __future__ import annotations

import re

import pytest

from svdq_loader.ops import ACT_FP8, GEMM_W4A4_FP8

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (the build extra) is not installed")

from svdq_kernels import registry  # noqa: E402
from kernel_checks import instructions, loops, sass_of_cubin  # noqa: E402

ARCH = "sm_90a"
fam = registry.family("gemm_w4a4_fp8", ARCH)
pre = registry.family("act_fp8", ARCH)


def knobs(out_dtype="bf16", rank=32, wcscale=True, bias=True, tile_m=128, **kw):
    k = dict(out_dtype=out_dtype, rank=rank, wcscale=wcscale, bias=bias, scale_layout="logical", tile_m=tile_m,
             tile_n=128, tile_k=128, stages=4, **fam.FIXED, **fam.FORM_DEFAULTS)
    k.update(kw)
    return k


def test_families_are_registered_with_their_ops():
    assert fam.OP == "gemm_w4a4_fp8" and pre.OP == "act_fp8"
    assert GEMM_W4A4_FP8.prepass({}) == "act_fp8"
    from svdq_loader.ops import GEMM_W4A4
    assert GEMM_W4A4_FP8.host_args == GEMM_W4A4.host_args         # one launch ABI for both modes
    assert GEMM_W4A4_FP8.feature_names == GEMM_W4A4.feature_names


@pytest.mark.parametrize("kw, words", [
    (dict(tile_m=224), ["tile_m 224", "not verified on a GPU", "208 rows up to rank 48"]),
    (dict(tile_m=256, rank=0), ["tile_m 256", "stack frame", "with weights staged 208-256 rows up to rank 80"]),
    (dict(tile_m=256, rank=96, weights="staged"), ["rank 96 with weights staged", "stack frame"]),
    (dict(tile_m=208, rank=16, out_dtype="fp16", wsets=4), ["wsets 4 with fp16 output at tile_m 208", "spill"]),
    (dict(tile_m=208, rank=64), ["tile_m 208 at rank 64"]),
    (dict(tile_m=216), ["tile_m 216 with weights regs", "staged only"]),
    (dict(tile_m=216, rank=96, weights="staged"), ["rank 96 with weights staged", "stack frame"]),
    (dict(wcscale=False), ["wcscale False"]),
    (dict(tile_k=64), ["tile_k 64"]),
    (dict(schedule="ws_splitk2"), ["schedule 'ws_splitk2'"]),
    (dict(schedule="ws_streamk", out_dtype="fp16"), ["schedule ws_streamk with out_dtype fp16", "bf16 output"]),
    (dict(schedule="ws_streamk", weights="smem"), ["schedule ws_streamk", "weights smem", "regs, staged or lut"]),
])
def test_invalid_forms_are_refused_with_the_reason(kw, words):
    reason = fam.invalid_reason(ARCH, knobs(**kw))
    assert reason is not None
    for w in words:
        assert w in reason, reason


def test_valid_forms_and_requirements():
    for tm, ranks in ((128, (0, 16, 32, 48, 64, 96, 128)), (208, (0, 16, 32, 48))):
        for r in ranks:
            assert fam.invalid_reason(ARCH, knobs(tile_m=tm, rank=r)) is None, (tm, r)
    for tm in (208, 216, 224, 256):
        for r in (0, 16, 32, 48, 64, 80):
            assert fam.invalid_reason(ARCH, knobs(tile_m=tm, rank=r, weights="staged")) is None, (tm, r)
    for tm, weights in ((128, "regs"), (208, "regs"), (216, "staged"), (256, "staged")):
        assert fam.invalid_reason(ARCH, knobs(tile_m=tm, weights=weights, schedule="ws_streamk")) is None
    assert fam.requirements(ARCH, knobs()) == {"n_multiple": 128, "k_multiple": 256}
    assert pre.requirements(ARCH, {"scale_layout": "logical"}) == {"k_multiple": 256}
    assert fam.invalid_reason("sm_100a", knobs()).startswith("arch sm_100a is not built")


def test_config_sections_fix_the_other_knobs():
    got, probs = fam.config_axes(ARCH, {"tiles": [[128, 128, 128], [208, 128, 128]], "stages": ["auto"]})
    assert not probs and [g["tile_m"] for g in got] == [128, 208]
    assert all(g[k] == v for g in got for k, v in fam.FIXED.items())
    assert all(g["schedule"] == "ws" for g in got)          # the default schedule: whole tiles
    _, probs = fam.config_axes(ARCH, {"tiles": [[128, 128, 128]], "prefetch": [1]})
    assert probs and "prefetch: unknown key" in probs[0] and "fixed: prefetch 1" in probs[0]
    got, probs = fam.config_axes(ARCH, {"tiles": [[256, 128, 128]], "schedule": ["ws", "ws_streamk"],
                                        "weights": ["staged"]})
    assert not probs and [g["schedule"] for g in got] == ["ws", "ws_streamk"]
    got, probs = fam.config_axes(ARCH, {"forms": [{"tiles": [[208, 128, 128]], "ranks": [32]}]})
    assert not probs and len(got) == 1
    _, probs = pre.config_axes(ARCH, {"rows": 16})
    assert probs == ["rows: unknown key (act_fp8 has no knobs; write act_fp8: {})"]


@pytest.mark.parametrize("kw", [dict(out_dtype="bf16", rank=32, tile_m=128),
                                dict(out_dtype="fp16", rank=128, tile_m=128),
                                dict(out_dtype="bf16", rank=0, tile_m=208, bias=False),
                                dict(out_dtype="fp16", rank=48, tile_m=208)],
                         ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_compile_gives_fp8_tensor_core_sass_without_local_memory(kw, tmp_path):
    k = knobs(**kw)
    name = GEMM_W4A4_FP8.name_for(ARCH, k, fam.requirements(ARCH, k))
    ck = fam.compile(ARCH, k, name, str(tmp_path), keep_ptx=True)
    assert name.startswith("svdq_gemm_w4a4_fp8_sm90a_") and "tilek128" in name
    usage = ck.resource_usage[ck.kernel_symbols[0]]
    assert usage["stack_frame_bytes"] == 0
    ptx = (tmp_path / f"{ck.entry}.{ARCH}.ptx").read_text()
    tm = k["tile_m"]
    # main loop: E4M3 x E4M3 wgmma, k = 32, the weight fragment from registers
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n%dk32\.f32\.e4m3\.e4m3\s+\{[^}]*\},\s*\{" % tm, ptx)
    sass = sass_of_cubin(ck.cubin, tmp_path)
    q = re.findall(r"QGMMA\.64x%dx32\.F32\.E4M3\.E4M3 R\d+, R\d+" % tm, sass)
    assert len(q) == 2 * 4, q                    # two unrolled 128-k k-tiles x four k32 steps
    assert len(re.findall(r"HGMMA\.64x%dx16" % tm, sass)) == k["rank"] // 16      # the LoRA, in the output dtype
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory traffic in the SASS"
    # the weight decode: byte permutes to E4M3, E4M3 -> fp16 (exact), one rounding back per pair
    assert "PRMT" in sass and "F2FP.F16.E4M3.UNPACK_B" in sass and "F2FP.SATFINITE.E4M3.F16" in sass
    assert "UBLKCP" in sass                        # the producer bulk-copies the E4M3 stage images
    assert "MOVM.16.MT88" in sass                  # the paired output store
    # the main loop: the innermost loop with MMAs holds one unrolled step's eight QGMMA and the decode of the next
    # k-tiles: 475 / 491 instructions at 128 / 208 rows (session 27); the exact 208-row images loop has 248 per eight
    # HGMMA, at half the MMA rate per value
    main = min((lp for lp in loops(instructions(sass)) if lp["hmma"]), key=lambda lp: lp["instructions"])
    nv4 = tm // 8                                  # 16-byte vectors of one thread's accumulators
    if k["out_dtype"] == "fp16":
        # fp16: after the step's last k-tile a full wgmma wait, then the sums go to fp32 in SMEM (one 16-byte load
        # and store per four accumulators): the step's loop grows by about three instructions per accumulator
        assert main["hmma"] == 8 and 400 + 2 * nv4 <= main["instructions"] <= 560 + 4 * tm // 2, main
        body = "\n".join(t for a, t in instructions(sass) if main["start"] <= a <= main["end"])
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in body and "LDS.128" in body and "STS.128" in body
        assert len(re.findall(r"\bLDS\.128\b", sass)) >= 2 * nv4 and len(re.findall(r"\bSTS\.128\b", sass)) >= 2 * nv4
    else:
        assert main["hmma"] == 8 and 400 <= main["instructions"] <= 560, main
        assert "LDS.128" not in sass                # bf16 keeps its sums in the wgmma accumulators


def test_fp16_forms_make_room_for_their_fp32_sums():
    """fp16 output: the sums take 4 B per accumulator of every MMA thread (104 KB at 208 rows).  At rank 32 the
    208-row tile then fits three stages, not four, and at three the promotion keeps a stack frame: both are refused
    with their numbers, and the 128-row tile serves.  Ranks 0, 16 and 48 keep four stages; bf16 has no sums."""
    from svdq_kernels import sm90_plan
    k16 = knobs(out_dtype="fp16", tile_m=208)
    assert sm90_plan.promote_bytes(sm90_plan._cfg_of(k16, "fp8")) == 256 * 104 * 4
    reason = fam.invalid_reason(ARCH, k16)
    assert "fp32 sums 106496 B" in reason and "more than the 232448 B" in reason
    reason = fam.invalid_reason(ARCH, knobs(out_dtype="fp16", tile_m=208, stages=3))
    assert "at three stages the promotion" in reason and "8-byte stack frame" in reason
    for r in (0, 16, 48):
        assert fam.invalid_reason(ARCH, knobs(out_dtype="fp16", tile_m=208, rank=r)) is None, r
    assert fam.invalid_reason(ARCH, knobs(out_dtype="fp16", tile_m=128, wsets=4)) is None
    assert fam.resolve(ARCH, dict(knobs(tile_m=208), stages="auto"))["stages"] == 4
    assert sm90_plan.promote_bytes(sm90_plan._cfg_of(knobs(tile_m=208), "fp8")) == 0


def test_static_check_wants_the_fp8_mma():
    assert "no wgmma.mma_async" in fam.static_problem("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {",
                                                      {"k": {"registers": 100, "stack_frame_bytes": 0}})
    ok = ("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {\nmovmatrix.sync.aligned.m8n8.trans.b16")
    assert fam.static_problem(ok, {"k": {"registers": 100, "stack_frame_bytes": 0}}) is None
    assert "stack frame" in fam.static_problem(ok, {"k": {"registers": 100, "stack_frame_bytes": 8}})


def test_act_fp8_compiles_to_one_pass_without_local_memory(tmp_path):
    name = ACT_FP8.name_for(ARCH, {"scale_layout": "logical"}, pre.requirements(ARCH, {"scale_layout": "logical"}))
    ck = pre.compile(ARCH, {"scale_layout": "logical"}, name, str(tmp_path))
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    assert "REDUX.MAX" in sass                     # the row's largest scale byte over the warp
    assert "F2FP.SATFINITE.E4M3.F16" in sass and "STG.E.128" in sass
    assert not re.search(r"\b(STL|LDL)\b", sass)


def _run_int_ptx(text: str, word: int) -> int:
    """Interpret an integer PTX block (mov / and / or / shl / shr / prmt on .b32) on $1 = `word`; returns $0."""
    body = [ln.strip() for ln in text.strip("{}\n\t ").split("\n") if ln.strip()]
    regs = {"$1": word}

    def val(x):
        return regs[x] if x in regs else int(x, 0)
    for ln in body:
        if ln.startswith(".reg"):
            continue
        m = re.fullmatch(r"(mov|and|or|shl|shr|prmt)\.b32 (\$?\w+), (\$?\w+)(?:, (\$?\w+))?(?:, (\$?\w+))?;", ln)
        assert m, f"unexpected instruction {ln!r}"
        op, d, a, b, c = m.groups()
        if op == "mov":
            regs[d] = val(a)
        elif op == "prmt":                      # default mode: selector nibbles 0-3 pick bytes of {b, a}
            pool = val(a) | (val(b) << 32)
            sel = val(c)
            out = 0
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                assert nib < 8, "sign-replicate mode not expected"
                out |= ((pool >> (8 * nib)) & 0xFF) << (8 * i)
            regs[d] = out
        else:
            x, y = val(a), val(b)
            if op in ("shl", "shr"):
                assert 0 <= y < 32
                regs[d] = (x << y) & 0xFFFFFFFF if op == "shl" else x >> y
            else:
                regs[d] = x & y if op == "and" else x | y
    return regs["$0"]


def test_the_emitted_weight_decode_ptx_is_the_formats_decode():
    """The PTX the kernel is built with (`sm90_fp8_ptx.e2m1_e4m3_ptx`), interpreted instruction by instruction,
    gives the registers `sm90_fp8_weight_format.decode_word` states (which its CPU test proves exact)."""
    import numpy as np
    from svdq_kernels import sm90_fp8_ptx
    from svdq_loader.ops import sm90_fp8_weight_format as fmt
    rng = np.random.default_rng(3)
    words = [0, 0xFFFFFFFF, 0x88888888, 0x77777777] + [int(w) for w in rng.integers(0, 1 << 32, 500)]
    for high in (0, 1):
        text = sm90_fp8_ptx.e2m1_e4m3_ptx(high)
        for w in words:
            assert _run_int_ptx(text, w) == fmt.decode_word(w)[high], (high, hex(w))


@pytest.mark.parametrize("tile_m, weights, wsets, step", [(208, "regs", 2, 6), (216, "lut", 4, 12)])
def test_three_fragment_buffers_move_the_decode_off_the_critical_path(tmp_path, monkeypatch, tile_m, weights, wsets,
                                                                       step):
    """SVDQ_KERNEL_SM90_FP8_BUFFERS=3 (an experiment build): the MMA warps decode k-tile kt + 1 right after issuing
    k-tile kt, into k-tile kt - 2's buffer (from raw registers, or from the stage's words and tables).  It builds
    without a stack frame, the loop step is the lcm of three buffers and the unroll (six k-tiles at two raw sets,
    twelve at four: K a multiple of 768 or 1536), and no full wgmma wait sits among the main loop's QGMMA; the
    128-row tile is refused with its measured stack frame."""
    from svdq_kernels import sm90_plan
    monkeypatch.setattr(sm90_plan, "FP8_BUFFERS", 3)
    assert "8-byte stack frame" in fam.invalid_reason(ARCH, knobs(tile_m=128))
    k = knobs(tile_m=tile_m, rank=32, weights=weights, wsets=wsets)
    assert fam.invalid_reason(ARCH, k) is None
    assert fam.requirements(ARCH, k) == {"n_multiple": 128, "k_multiple": step * 128}
    name = GEMM_W4A4_FP8.name_for(ARCH, k, fam.requirements(ARCH, k))
    ck = fam.compile(ARCH, k, name, str(tmp_path))
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    assert len(re.findall(r"QGMMA\.", sass)) == 4 * step
    ops = re.findall(r"(QGMMA\.\S+ R\d+, R\d+|WARPGROUP\.DEPBAR\.LE gsb0, 0x0)", sass)
    first = next(i for i, o in enumerate(ops) if o.startswith("QGMMA"))
    last = max(i for i, o in enumerate(ops) if o.startswith("QGMMA"))
    assert not [o for o in ops[first:last] if o.startswith("WARPGROUP")], "main-loop wgmmas serialised"


@pytest.mark.parametrize("module, switch, value, message", [
    ("sm90_plan", "SVDQ_KERNEL_SM90_FP8_BUFFERS", "4", "the FP8-compute fragment buffers must be 2 or 3"),
    ("sm90_act_fp8", "SVDQ_KERNEL_SM90_ACT_FP8_UNROLL", "3", "the act_fp8 loop step must be 2, 4 or 8 k-tiles"),
    ("sm90_act_fp8", "SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT", "2", "0 (one CTA per row tile) or 1 (split K)"),
])
def test_the_fp8_build_switches_name_their_values(module, switch, value, message):
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", f"import svdq_kernels.{module}"], capture_output=True, text=True,
                       env=dict(os.environ, **{switch: value}))
    assert r.returncode != 0
    assert f"{switch}={value}: {message}" in r.stderr


def _stage_layout_offsets(coords):
    """The byte offsets the DSL's own sm_90 A-operand SMEM layout (E4M3, K-major, 128 rows x 128 k, 128-byte
    swizzle) gives each (row, k) of `coords`, evaluated at trace time."""
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float8E4M3FN
    from svdq_kernels.sm90_wgmma_kernel import LayoutEnum
    out = []

    def read(lay):
        out.extend(int(str(cute.crd2idx((r, k, 0), lay))) for r, k in coords)

    @cute.jit
    def probe():
        read(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (128, 256, 128), Float8E4M3FN, 4))

    probe()
    return out


def test_smem_weight_stores_land_in_the_wgmma_stage_layout():
    """weights smem: every register of four E4M3 values a decoding thread stores goes where the
    shared-memory wgmma reads that row and k, and the 128 threads fill a 128-row weight stage exactly once."""
    from svdq_kernels.sm90_plan import fp8_weight_store_offset
    stores, coords = [], []
    for t in range(128):
        for b in range(2):
            for kb in range(4):
                for h in range(2):
                    for i in range(2):
                        stores.append(fp8_weight_store_offset(t, b, kb, h, i))
                        coords.append((64 * b + 16 * (t // 32) + (t % 32) // 4 + 8 * i, 32 * kb + 16 * h + 4 * (t % 4)))
    assert _stage_layout_offsets(coords) == stores
    covered = sorted(o + j for o in stores for j in range(4))
    assert covered == list(range(128 * 128))


def test_smem_weights_build_shared_memory_wgmmas_and_a_decoding_warpgroup(tmp_path):
    """weights smem (an experiment form; session 28 ran it on an H100: every variant passed the selftest, no faster
    than the register form): warpgroup 0 decodes the weights into E4M3 stages and the MMA
    warps' main loop is shared-memory QGMMA only.  The 256-row tile the register form refuses builds without a
    stack frame, with 120 / 192 registers for the decoding / MMA warps, and the main loop holds no weight decode."""
    from svdq_kernels import sm90_plan
    k = knobs(tile_m=256, rank=32, weights="smem")
    assert fam.invalid_reason(ARCH, k) is None
    cfg = sm90_plan._cfg_of(k, "fp8")
    assert sm90_plan.ws_regs(cfg) == (168, 120, 192)
    plan = sm90_plan._smem_plan(cfg)
    assert plan["w_offset"] == 4 * 256 * 128 and plan["main_bytes"] == plan["w_offset"] + 4 * 128 * 128
    name = GEMM_W4A4_FP8.name_for(ARCH, k, fam.requirements(ARCH, k))
    ck = fam.compile(ARCH, k, name, str(tmp_path))
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    assert len(re.findall(r"QGMMA\.64x256x32\.F32\.E4M3\.E4M3 R\d+, gdesc", sass)) == 2 * 4
    assert not re.findall(r"QGMMA\.\S+ R\d+, R\d+", sass)           # no register-sourced A left
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x78" in sass                  # the decoding warpgroup: 120 registers
    main = min((lp for lp in loops(instructions(sass)) if lp["hmma"]), key=lambda lp: lp["instructions"])
    assert main["hmma"] == 8 and main["instructions"] <= 160, main
    assert len(re.findall(r"\bSTS\b", sass)) >= 2 * 32                # 32 E4M3 registers per thread and k-tile


def test_the_weights_knob_names_its_values():
    assert "weights 'tmem' not supported" in fam.invalid_reason(ARCH, knobs(weights="tmem"))
    got, probs = fam.config_axes(ARCH, {"forms": [{"tiles": [[128, 128, 128]], "weights": "staged"}]})
    assert got == [] and probs == ["forms[0].weights: 'staged': expected a non-empty list of distinct names "
                                   "(regs, staged, smem, lut)"]
    from svdq_kernels import sm90_plan
    exact_knobs = {k: v for k, v in knobs(schedule="ws").items()}
    exact_knobs.update(weights="staged", tile_k=64)
    assert "the exact mode's MMA warps load and decode their own weights" in \
        sm90_plan._problem(sm90_plan._cfg_of(exact_knobs))


def test_forms_may_set_the_raw_weight_sets():
    got, probs = fam.config_axes(ARCH, {"forms": [{"tiles": [[128, 128, 128]], "wsets": [2, 4]},
                                                  {"tiles": [[208, 128, 128]]}]})
    assert not probs and [(g["tile_m"], g["wsets"], g["weights"]) for g in got] == [
        (128, 2, "regs"), (128, 4, "regs"), (208, 2, "regs")]
    got, probs = fam.config_axes(ARCH, {"forms": [{"tiles": [[224, 128, 128], [256, 128, 128]], "weights": ["staged"],
                                                   "ranks": [32]}]})
    assert not probs and [(g["tile_m"], g["weights"], g["_only"]) for g in got] == [
        (224, "staged", {"rank": (32,)}), (256, "staged", {"rank": (32,)})]
    assert fam.requirements(ARCH, knobs(wsets=4)) == {"n_multiple": 128, "k_multiple": 512}
    assert "wsets 3" in fam.invalid_reason(ARCH, knobs(wsets=3))


@pytest.mark.parametrize("unroll", [4, 8])
def test_act_fp8_deeper_loop_steps_keep_k_a_multiple_of_256(unroll, tmp_path, monkeypatch):
    """SVDQ_KERNEL_SM90_ACT_FP8_UNROLL=4 / 8 (8 is the default since session 29): that many k-tiles' 8-byte code
    loads issued together in the loop, the k-tiles past K skipped in the last step (so K stays a multiple of 256),
    the row-max phase's four rows loaded together; no stack frame."""
    from svdq_kernels import sm90_act_fp8
    monkeypatch.setattr(sm90_act_fp8, "K_UNROLL", unroll)
    assert pre.requirements(ARCH, {"scale_layout": "logical"}) == {"k_multiple": 256}
    name = ACT_FP8.name_for(ARCH, {"scale_layout": "logical"}, pre.requirements(ARCH, {"scale_layout": "logical"}))
    ck = pre.compile(ARCH, {"scale_layout": "logical"}, name, str(tmp_path))
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    main = max((lp for lp in loops(instructions(sass))), key=lambda lp: lp["instructions"])
    body = [t for a, t in instructions(sass) if main["start"] <= a <= main["end"]]
    assert sum(bool(re.search(r"\bLDG\.E\.64\b", t)) for t in body) == unroll       # the codes, all in flight
    assert sum("STG.E.128" in t for t in body) == unroll                            # one chunk per k-tile
    assert sass.count("REDUX.MAX") == 4 and not re.search(r"\b(STL|LDL)\b", sass)


def test_staged_raw_weights_build_the_256_row_register_form(tmp_path):
    """weights staged (ran on the H200 in session 29: exact against the reference): the producer bulk-copies each
    k-tile's raw weight words and scales into the stage beside its activations (one copy for the image rows, two per
    64-row block), the MMA warps read them with 16-byte shared loads instead of holding raw sets in registers, and
    decode into register fragments as before; so the 256-row tile, refused in the register form, builds without a
    stack frame, and no global weight load is left in the MMA warps' main loop."""
    from svdq_kernels import sm90_plan
    k = knobs(tile_m=256, rank=32, weights="staged")
    assert fam.invalid_reason(ARCH, k) is None
    plan = sm90_plan._smem_plan(sm90_plan._cfg_of(k, "fp8"))
    assert plan["main_bytes"] == plan["w_offset"] + 4 * 2 * sm90_plan.FP8_RAW_BLOCK_BYTES
    name = GEMM_W4A4_FP8.name_for(ARCH, k, fam.requirements(ARCH, k))
    ck = fam.compile(ARCH, k, name, str(tmp_path))
    assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    assert len(re.findall(r"QGMMA\.64x256x32\.F32\.E4M3\.E4M3 R\d+, R\d+", sass)) == 2 * 4     # register A, as before
    assert sass.count("UBLKCP") >= 1 + 2 * 2
    main = min((lp for lp in loops(instructions(sass)) if lp["hmma"]), key=lambda lp: lp["instructions"])
    body = [t for a, t in instructions(sass) if main["start"] <= a <= main["end"]]
    assert sum(bool(re.search(r"\bLDS\.128\b", t)) for t in body) == 2 * 3       # words and scales of two k-tiles
    assert not any(re.search(r"\bLDG\b", t) for t in body)


def test_lut_weights_decode_each_word_by_two_byte_permutes(tmp_path):
    """weights lut (session 32; shipped at 216-256 rows): the producer warpgroup turns each k-tile's block scales
    into byte tables in the stage, after the block's words (their SMEM plan), so the MMA warps' main loop converts
    nothing: no F2FP and no HMUL2 there, two byte permutes per word (16 per k-tile), 16-byte shared loads for the
    words and one per word for its tables, and about half the instructions of the staged loop; the producer computes
    the tables with the conversions the staged loop had (F2FP to E4M3) and stores them with 16-byte shared stores."""
    from svdq_kernels import sm90_plan
    k = knobs(tile_m=216, rank=32, weights="lut")
    assert fam.invalid_reason(ARCH, k) is None
    plan = sm90_plan._smem_plan(sm90_plan._cfg_of(k, "fp8"))
    assert sm90_plan.FP8_LUT_BLOCK_BYTES == sm90_plan.FP8_RAW_WORD_BYTES + 8 * 32 * 16
    assert plan["main_bytes"] == plan["w_offset"] + 4 * 2 * sm90_plan.FP8_LUT_BLOCK_BYTES
    assert plan["total_bytes"] <= sm90_plan.SMEM_LIMIT_BYTES
    sizes = {}
    for w in ("lut", "staged"):
        kw = knobs(tile_m=216, rank=32, weights=w)
        ck = fam.compile(ARCH, kw, GEMM_W4A4_FP8.name_for(ARCH, kw, fam.requirements(ARCH, kw)), str(tmp_path))
        assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
        sass = sass_of_cubin(ck.cubin, tmp_path)
        assert not re.search(r"\b(STL|LDL)\b", sass)
        main = min((lp for lp in loops(instructions(sass)) if lp["hmma"]), key=lambda lp: lp["instructions"])
        body = [t for a, t in instructions(sass) if main["start"] <= a <= main["end"]]
        sizes[w] = len(body)
        if w == "staged":
            continue
        steps = main["hmma"] // 4                                   # k-tiles per loop step (four QGMMA each)
        assert not any(re.search(r"\b(F2FP|HMUL2)\b", t) for t in body)
        assert sum(bool(re.search(r"\bPRMT\b", t)) for t in body) == 16 * steps
        assert sum(bool(re.search(r"\bLDS\.128\b", t)) for t in body) == (2 + 8) * steps
        assert re.search(r"F2FP\.SATFINITE\.E4M3\.F16", sass) and re.search(r"\bSTS\.128\b", sass)
    assert sizes["lut"] < 0.55 * sizes["staged"], sizes


def test_every_shipped_fp8_variant_runs_its_main_loop_on_fp8_qgmma_without_spills(tmp_path):
    """Issue 12's static check over every variant `configs/sm90_fp8.yaml` ships for the mode (its gemm_w4a4_fp8 and
    act_fp8 sections, built for real with `-j 2`): each GEMM's SASS has the tile's E4M3 x E4M3 ``QGMMA`` with the
    weight as the register A operand in its main loop, and no local-memory traffic (no spill); the pre-pass has none
    either.  The build itself refuses a stack frame and a PTX without the FP8 wgmma; this reads the SASS."""
    import yaml
    from pathlib import Path

    from svdq_aot.build import build
    src = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "sm90_fp8.yaml").read_text())
    src["variants"]["sm_90a"] = {k: src["variants"]["sm_90a"][k] for k in ("gemm_w4a4_fp8", "act_fp8")}
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(src))
    out = tmp_path / "art"
    m = build(path, out, jobs=2)
    gemms = [v for v in m.variants if v.op == "gemm_w4a4_fp8"]
    assert len(gemms) >= 12 and {v.knobs["weights"] for v in gemms} == {"regs", "lut"}    # ranks 0 and 32: lut
    assert {v.knobs["tile_m"] for v in gemms} == {128, 208, 216, 224, 256}
    for v in m.variants:
        sass = sass_of_cubin((out / v.cubin).read_bytes(), tmp_path)
        assert not re.search(r"\b(STL|LDL)\b", sass), v.name
        if v.op != "gemm_w4a4_fp8":
            continue
        tm = v.knobs["tile_m"]
        main = min((lp for lp in loops(instructions(sass)) if lp["hmma"]), key=lambda lp: lp["instructions"])
        body = [t for a, t in instructions(sass) if main["start"] <= a <= main["end"]]
        qgmma = [t for t in body if re.search(rf"QGMMA\.64x{tm}x32\.F32\.E4M3\.E4M3 R\d+, R\d+", t)]
        assert qgmma and len(qgmma) == main["hmma"], (v.name, main)


def test_the_216_row_staged_tile_builds_its_fp8_mma_at_216_columns(tmp_path):
    """The 216-row tile of configs/sm90_rows216.yaml (an experiment: built and checked on the CPU): wgmma N = 216 is
    27 blocks of 8 activation rows, a multiple of the 128-byte swizzle's 8-row period, so its stages hold whole
    swizzle atoms (216 x 128 B = 27 KiB per k-tile), its E4M3 MMA is ``QGMMA.64x216x32`` with the weight as the
    register operand, its LoRA MMA ``HGMMA.64x216x16``, and it keeps no stack frame at rank 80, the highest staged
    rank."""
    from svdq_kernels import sm90_plan
    for r, dt in ((32, "BF16"), (80, "BF16")):
        k = knobs(tile_m=216, rank=r, weights="staged")
        assert fam.invalid_reason(ARCH, k) is None
        plan = sm90_plan._smem_plan(sm90_plan._cfg_of(k, "fp8"))
        assert plan["total_bytes"] <= sm90_plan.SMEM_LIMIT_BYTES
        name = GEMM_W4A4_FP8.name_for(ARCH, k, fam.requirements(ARCH, k))
        ck = fam.compile(ARCH, k, name, str(tmp_path))
        assert ck.resource_usage[ck.kernel_symbols[0]]["stack_frame_bytes"] == 0
        sass = sass_of_cubin(ck.cubin, tmp_path)
        assert not re.search(r"\b(STL|LDL)\b", sass)
        main = min((lp for lp in loops(instructions(sass)) if lp["hmma"]), key=lambda lp: lp["instructions"])
        body = [t for a, t in instructions(sass) if main["start"] <= a <= main["end"]]
        assert len([t for t in body if re.search(r"QGMMA\.64x216x32\.F32\.E4M3\.E4M3 R\d+, R\d+", t)]) == main["hmma"]
        assert re.search(rf"HGMMA\.64x216x16\.F32\.{dt}", sass)


def test_an_empty_section_builds_the_default_forms():
    """`gemm_w4a4_fp8: {}` (and a config's `compute: [exact, fp8]`) builds DEFAULT_FORMS: the measured tile heights,
    each in the form it was fastest in, not the single 128-row form a bare section's key defaults would give."""
    got, probs = fam.config_axes(ARCH, {})
    want, _ = fam.config_axes(ARCH, {"forms": [dict(f) for f in fam.DEFAULT_FORMS]})
    assert not probs and got == want
    assert {(g["tile_m"], g["wsets"], g["weights"]) for g in got} == {
        (128, 4, "regs"), (128, 2, "regs"), (208, 2, "regs"), (208, 4, "regs"), (216, 4, "lut"), (224, 4, "lut"),
        (256, 4, "lut"), (216, 4, "staged"), (224, 4, "staged"), (256, 4, "staged")}

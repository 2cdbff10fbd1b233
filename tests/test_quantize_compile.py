"""Cross-compile representative quantize_act variants on the CPU (needs the CuTe DSL, no GPU).

Checks per variant: cubin ELF arch, kernel symbol prefix (and no 'cutlass'), registers <= 255, stack
frame 0, PTX without approximate division or flush-to-zero, SASS (when cuobjdump + nvdisasm are
available) without local-memory traffic and with HMMA exactly when R > 0.  Plus the family
contract and the validity predicate.
"""
from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("cutlass")

from kernel_checks import collectives, dump_sass, elf_sm, instructions, loops, skipped_by_branch  # noqa: E402
from svdq_aot.family import check_family  # noqa: E402
from svdq_kernels import quantize_act as fam  # noqa: E402
from svdq_kernels import quantize_plan as plan  # noqa: E402
from svdq_loader.cubin_info import cubin_info  # noqa: E402
from svdq_loader.ops import QUANTIZE_ACT, variant_name  # noqa: E402

LAYOUT = {"sm_90a": "logical", "sm_100a": "blocked", "sm_103a": "blocked", "sm_120a": "blocked",
          "sm_121a": "blocked"}
SM = {"sm_90a": 90, "sm_100a": 100, "sm_103a": 103, "sm_120a": 120, "sm_121a": 121}

# (arch, dtype, rank): both dtypes, R in {0, 32}, every arch (and so both scale layouts); rank 96 and 128
# (the largest register budgets: 96 takes the SMEM ring for x, 128 the register form)
CASES = [
    ("sm_90a", "bf16", 32),
    ("sm_90a", "fp16", 0),
    ("sm_90a", "bf16", 96),
    ("sm_90a", "fp16", 128),
    ("sm_100a", "bf16", 96),
    ("sm_100a", "bf16", 0),
    ("sm_100a", "fp16", 32),
    ("sm_103a", "bf16", 32),
    ("sm_120a", "fp16", 32),
    ("sm_121a", "bf16", 0),
    ("sm_90a", "bf16", 48),          # .minnctapersm 3: the DSL asks for SMEM per SM, answered from the target
    ("sm_103a", "fp16", 48),
    ("sm_100a", "fp16", 128),        # .minnctapersm 1: without it a 24-byte stack frame at 168 registers
]
#: sm_90a ranks held to a step loop without collective warp-sync paths (see test_variant).  Ranks 48, 64 and 96
#: carry such paths (for a diverged warp; their step loops are single blocks too) after the per-row code branch:
#: without that branch they have none, but run up to 31 % slower, as ptxas then sinks the next step's x loads
#: (docs/PERF.md, sessions 5 and 20)
_ONE_BLOCK_LOOP_RANKS = (0, 16, 32, 128)
#: (arch, dtype, rank, warps) cases built with other tuning than the default: the 2-warp variants that
#: configs/flux.yaml builds for sm_120a / sm_121a, at the largest rank (the largest register budget)
TUNED_CASES = [("sm_120a", "bf16", 128, 2), ("sm_121a", "fp16", 128, 2)]


def _knobs(arch, dtype, rank, **tune):
    k = dict(dtype=dtype, rank=rank, scale_layout=LAYOUT[arch])
    k.update(fam.resolve(arch, dict(tune)) if tune else fam.DEFAULT_TUNING)
    return k


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = {}
    for arch, dt, r in CASES:
        knobs = _knobs(arch, dt, r)
        name = variant_name("quantize_act", arch, knobs)
        d = tmp_path_factory.mktemp(f"{arch}_{dt}_{r}")
        ck = fam.compile(arch, knobs, name, str(d), keep_ptx=True)
        path = d / "k.cubin"
        path.write_bytes(ck.cubin)
        out[(arch, dt, r)] = (name, ck, str(path))
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{d}-r{r}" for a, d, r in CASES])
def test_variant(compiled, case):
    arch, dt, r = case
    name, ck, path = compiled[case]
    info = cubin_info(ck.cubin)
    assert elf_sm(info) == SM[arch], f"cubin e_flags {info.e_flags:#x} is not {arch}"
    assert ck.kernel_symbols and all(s.startswith(name) and "cutlass" not in s.lower() for s in ck.kernel_symbols)
    for sym, ru in ck.resource_usage.items():
        assert ru["registers"] <= 255, f"{sym}: {ru['registers']} registers"
        assert ru["stack_frame_bytes"] == 0, f"{sym}: stack frame {ru['stack_frame_bytes']} B (spills / local memory)"
    k = info.kernels[ck.kernel_symbols[0]]
    assert k.param_sizes == [8] * 7 + [4] * 3, k.params          # 7 pointers (workspace last), m, k, use_smooth
    assert ck.smem_bytes == fam.smem_bytes_for(_knobs(arch, dt, r))
    ptx = ck.ptx
    assert ptx and ".entry" in ptx
    # the occupancy the kernel states is the family's table, and its registers fit it
    want = plan.min_ctas_per_sm(plan._cfg_of(_knobs(arch, dt, r)), arch)
    got = re.findall(r"\.minnctapersm\s+(\d+)", ptx)
    assert got == ([str(want)] if want else []), (got, want)
    threads = fam.threads_for(_knobs(arch, dt, r))
    for sym, ru in ck.resource_usage.items():
        assert max(1, want) * threads * ru["registers"] <= 65536, f"{sym}: {ru['registers']} registers x {want} CTAs"
    assert not re.search(r"\bdiv\.(approx|full)", ptx), "approximate division in the PTX"
    assert not re.search(r"\.ftz\.f32|\.ftz\.f16|\.ftz\.bf16", ptx), "fp32/fp16 flush-to-zero in the PTX"
    assert "rcp.approx.f32" not in ptx and "div.full" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "max.NaN" in ptx
    # the K split is read from the launch's cluster; only LoRA needs the cross-CTA reduction
    assert "%cluster_nctarank" in ptx and "%cluster_ctarank" in ptx
    assert ("ld.shared::cluster" in ptx) == (r > 0) and ("barrier.cluster.arrive" in ptx) == (r > 0)
    # the range form (ksplit 1): the grid size is read in the kernel, more than two tiles per CTA traps, and the
    # LoRA sums of a split tile meet through the workspace (one GPU-scope fence and counter CAS per split tile)
    assert "%nctaid.x" in ptx and "trap;" in ptx
    assert ("atom.acq_rel.gpu.global.cas.b64" in ptx) == (r > 0) and ("fence.acq_rel.gpu" in ptx) == (r > 0)
    assert ("ld.relaxed.gpu.global.v2.f32" in ptx) == (r > 0)
    sass = dump_sass(path)
    if sass is None:   # the test extra installs both tools; only an explicit opt-out may skip
        if os.environ.get("SVDQ_ALLOW_NO_SASS") == "1":
            pytest.skip("cuobjdump / nvdisasm not available: SASS checks skipped (SVDQ_ALLOW_NO_SASS=1)")
        pytest.fail("cuobjdump / nvdisasm not found: install the test extra (nvidia-cuda-cuobjdump, "
                    "nvidia-cuda-nvdisasm) or set SVDQ_ALLOW_NO_SASS=1")
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory traffic in the SASS"
    assert ("HMMA" in sass) == (r > 0)
    if r in plan._RING_RANKS:
        # x (and smooth) arrive through cp.async into the per-warp ring: 16-byte copies, no plain loads
        assert re.search(r"LDGSTS\.E\.BYPASS\.128", sass), "x is not copied with cp.async.cg 16-byte chunks"
        # (the range form's workspace reads are GPU-scope STRONG loads, not x)
        plain = [ln for ln in re.findall(r"\bLDG\.E[A-Z0-9.]*", sass) if "STRONG.GPU" not in ln]
        assert not plain, f"a plain global load remains (x should come through SMEM): {plain[:3]}"
    else:
        # x is prefetched one step ahead into registers: 16-byte non-coherent loads
        assert re.search(r"LDG\.E\.[A-Z.]*128", sass), "x is not loaded in 16-byte chunks"
    ins = instructions(sass)
    if arch == "sm_90a" and r in _ONE_BLOCK_LOOP_RANKS:
        # the step loop is one block of SASS holding the step's LoRA MMAs (4 k16 blocks x R/16 x two 8-row
        # halves), and no warp barrier needs ptxas' collective path for a diverged warp (docs/PERF.md, session
        # 20: an edit that brought 18 of them came with a longer step loop, 458 instead of 422 instructions, and
        # a kernel 4-26 % slower even in the forms that never ran the edited code)
        assert collectives(ins) == 0, f"{collectives(ins)} WARPSYNC.COLLECTIVE blocks"
        big = loops(ins)[0]
        assert big["instructions"] <= 600 and big["hmma"] == 8 * (r // 16), big
    # one step loop serves both smoothing forms (use_smooth 1 and 2): its fp64 reciprocals of smooth (MUFU.RCP64H
    # and their Newton steps) sit behind a real branch (per-thread or uniform predicate), which use_smooth 2
    # (reciprocals given) takes to skip them (docs/PERF.md, session 51: 1-3 % faster at M = 4608); predicated
    # instead, they would issue in both forms
    smooth_loops = [lp for lp in loops(ins)[:4] if any(lp["start"] <= a <= lp["end"] and "MUFU.RCP64H" in t
                                                       for a, t in ins)]
    assert smooth_loops, "no step loop holds the reciprocals of smooth"
    for lp in smooth_loops:
        assert skipped_by_branch(ins, lp["start"], lp["end"], r"MUFU\.RCP64H|\bDFMA\b"), lp


@pytest.mark.parametrize("case", TUNED_CASES, ids=[f"{a}-{d}-r{r}-w{w}" for a, d, r, w in TUNED_CASES])
def test_tuned_variant_has_no_stack(case, tmp_path):
    arch, dt, r, warps = case
    knobs = _knobs(arch, dt, r, warps=warps, mtiles=1)
    ck = fam.compile(arch, knobs, variant_name("quantize_act", arch, knobs), str(tmp_path))
    for sym, ru in ck.resource_usage.items():
        assert ru["registers"] <= 255 and ru["stack_frame_bytes"] == 0, f"{sym}: {ru}"


def test_family_contract():
    check_family(fam, where="svdq_kernels.quantize_act")
    assert fam.OP == "quantize_act" and set(fam.ARCHS) == {"sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a"}
    assert not set(fam.TUNING) & set(QUANTIZE_ACT.feature_names)
    assert fam.requirements("sm_90a", _knobs("sm_90a", "bf16", 32)) == {"k_multiple": 64}
    tunings, problems = fam.config_axes("sm_90a", {})
    assert problems == [] and tunings == [dict(warps=4, mtiles=1)]
    tunings, problems = fam.config_axes("sm_100a", {"warps": [4, 8], "mtiles": [1]})
    assert problems == [] and len(tunings) == 2
    _, problems = fam.config_axes("sm_90a", {"warps": [3], "tiles": [1]})
    assert any("warps" in p for p in problems) and any("tiles" in p for p in problems)
    for arch in fam.ARCHS:
        for r in (0, 16, 32, 48, 64, 96, 128):
            for dt in ("bf16", "fp16"):
                # sm_120/121 have 99 KiB per block: 4 warps fit up to R = 64 there (R = 96 takes the x ring,
                # R = 128 two 34 KiB lora_down tiles per warp), 2 warps every R
                assert fam.invalid_reason(arch, dict(_knobs(arch, dt, r), warps=2)) is None, (arch, dt, r)
                assert (fam.invalid_reason(arch, _knobs(arch, dt, r)) is None) == (
                    r <= 64 or not arch.startswith("sm_12")), (arch, dt, r)
    assert not QUANTIZE_ACT.check_feature_values(_knobs("sm_100a", "bf16", 32), "sm_100a")


@pytest.mark.parametrize("arch, knobs, words", [
    ("sm_80", None, "arch"),
    ("sm_90a", dict(scale_layout="blocked"), "scale_layout"),
    ("sm_100a", dict(scale_layout="logical"), "scale_layout"),
    ("sm_90a", dict(rank=24), "rank"),
    ("sm_90a", dict(dtype="fp32"), "dtype"),
    ("sm_90a", dict(warps=16), "warps"),
    ("sm_90a", dict(rank=128, warps=8), "SMEM"),
    ("sm_120a", dict(rank=128, warps=4, scale_layout="blocked"), "100352 B"),
    ("sm_121a", dict(rank=48, warps=8, scale_layout="blocked"), "100352 B"),
    ("sm_90a", dict(extra=1), "unknown"),
])
def test_invalid_knobs_rejected_with_reason(arch, knobs, words):
    base = _knobs("sm_90a", "bf16", 32)
    if knobs:
        base.update(knobs)
    reason = fam.invalid_reason(arch, base)
    assert reason and words in reason, reason
    if words == "SMEM":
        assert re.search(r"\d+ B", reason), "resource reasons give numbers"
    with pytest.raises(ValueError):
        fam.compile(arch, base, "svdq_quantize_act_bad", "/tmp/svdq_qa_bad")


def test_a_lora_epilogue_that_does_not_fit_the_warp_smem_is_refused(monkeypatch):
    """The LoRA epilogue re-uses each warp's SMEM for its partial sums (`_epilogue_bytes`).  Two m-tiles keep two
    lora_down buffers, so every built configuration fits; with one (rank 64's mtiles-1 choice) 32 rows of rank-64
    sums would not, and the predicate says so with the bytes (the kernel's trace-time assertion once failed such a
    build with no reason)."""
    from svdq_kernels import quantize_plan as qp
    knobs = dict(_knobs("sm_90a", "bf16", 64), mtiles=2)
    assert fam.invalid_reason("sm_90a", knobs) is None
    monkeypatch.setattr(qp, "_lora_bufs", lambda cfg: 1)
    reason = fam.invalid_reason("sm_90a", knobs)
    assert reason and "16512 B" in reason and "9344 B" in reason, reason
    with pytest.raises(ValueError):
        fam.compile("sm_90a", knobs, "svdq_quantize_act_bad", "/tmp/svdq_qa_bad")


@pytest.mark.parametrize("rank", [16, 32, 48, 64, 96, 128])
def test_lora_tile_copy_plan(rank):
    """The lora_down tile copy (R / 8 a power of two): every chunk of a step is copied exactly once; the
    per-lane base + per-copy constant addresses equal the direct ones (same SMEM slot, same global
    element); and where a 128-byte line spans two or more rows (R >= 32) each copy's 8 consecutive lanes --
    one line -- hit 8 distinct 16-byte SMEM bank groups."""
    srow = plan._srow
    assert sorted(srow(kk) for kk in range(fam.STEP_K)) == list(range(fam.STEP_K))    # a permutation
    nchunk, pitch = rank // 8, plan._pitch(rank)
    if nchunk & (nchunk - 1):
        pytest.skip(f"R = {rank}: R / 8 is no power of two, the per-chunk form is used")
    seen = set()
    for i in range(fam.STEP_K * nchunk // 32):
        kk_i, _ = plan._lora_copy_slot(0, i, nchunk)
        for lane in range(32):
            kk, c = plan._lora_copy_slot(lane, i, nchunk)
            kk0, c0 = plan._lora_copy_slot(lane, 0, nchunk)
            assert (kk0 & kk_i) == 0 and kk == kk0 + kk_i and c == c0
            assert (srow(kk0) + srow(kk_i)) * pitch + c0 * 16 == srow(kk) * pitch + c * 16
            assert (kk0 * rank + c0 * 8) + kk_i * rank == kk * rank + c * 8
            seen.add((kk, c))
        if rank >= 32:
            for q in range(4):
                slots = [plan._lora_copy_slot(lane, i, nchunk) for lane in range(8 * q, 8 * q + 8)]
                assert len({(srow(kk) * pitch + c * 16) // 16 % 8 for kk, c in slots}) == 8, (i, q, slots)
    assert len(seen) == fam.STEP_K * nchunk


@pytest.mark.parametrize("rank", [16, 32, 48, 64, 96, 128])
def test_ldmatrix_rows_match_the_staging_and_do_not_conflict(rank):
    """Lane mv of ldmatrix matrix (j, h) points at the staged row of the lora_down row whose x̂ value lane
    column t = mv // 2 holds as half e = mv % 2 of word 2j + h (real k 16t + 4j + 2h + e), and a matrix's
    8 rows sit in 8 distinct 16-byte bank groups."""
    pitch = plan._pitch(rank)
    for j in range(4):
        for h in range(2):
            rows = [16 * j + 8 * h + plan._ldsm_row(mv) for mv in range(8)]
            assert rows == [plan._srow(16 * (mv >> 1) + 4 * j + 2 * h + (mv & 1)) for mv in range(8)]
            assert len({r * pitch // 16 % 8 for r in rows}) == 8


def test_reciprocal_buffer_reads_and_writes_are_conflict_free():
    """The smooth reciprocals (16-bit pairs): lane l writes word l, so a warp's writes are one contiguous
    128-byte run; the four lane columns' 16-byte reads of one chunk hit 4 distinct bank groups; lane column
    t's two chunks are its own 16 k (words 8t .. 8t + 7); and the buffer holds them all."""
    for i in range(2):
        assert len({plan._rs_chunk(t, i) // 16 % 8 for t in range(4)}) == 4
    for t in range(4):
        words = [(plan._rs_chunk(t, i) + 4 * j) // 4 for i in range(2) for j in range(4)]
        assert words == list(range(8 * t, 8 * t + 8))          # word w holds k = 2w, 2w + 1
    assert plan._rs_chunk(3, 1) + 16 == plan._RS_BYTES == 4 * 32


def test_cross_compile_answers_device_queries_from_the_target():
    """The DSL's device-attribute query (asked when a kernel wants more than one CTA per SM) is answered from the
    target arch's table while compiling, refused by name for anything else, and restored afterwards."""
    from cutlass.base_dsl.runtime import cuda as helpers
    from svdq_kernels.compiled_output import SMEM_PER_SM, target_device_answers

    smem = helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    other = helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    real = helpers.get_device_attribute
    for arch, want in (("sm_90a", 233472), ("sm_120a", 102400)):
        with target_device_answers(arch):
            assert helpers.get_device_attribute(smem) == want == SMEM_PER_SM[arch]
            with pytest.raises(RuntimeError, match="MULTIPROCESSOR_COUNT.*sm_"):
                helpers.get_device_attribute(other)
        assert helpers.get_device_attribute is real
    with pytest.raises(KeyError):
        with target_device_answers("sm_80"):
            helpers.get_device_attribute(smem)
    assert helpers.get_device_attribute is real


def test_a_kernel_with_a_stack_frame_is_refused(monkeypatch, tmp_path):
    """Every family's compile goes through compile_kernel, which refuses a kernel that spills, naming it."""
    from svdq_kernels import compiled_output as co

    assert co.stack_frame_problem({"k_0": {"registers": 80, "stack_frame_bytes": 0}}) is None
    monkeypatch.setattr(co, "cubin_resource_usage",
                        lambda cubin: {"k_0": {"registers": 168, "stack_frame_bytes": 24}})
    knobs = _knobs("sm_90a", "bf16", 0)
    with pytest.raises(RuntimeError, match="k_0 spills: 24-byte stack frame at 168 registers"):
        fam.compile("sm_90a", knobs, variant_name("quantize_act", "sm_90a", knobs), str(tmp_path))


def test_lora_down_buffers_per_rank():
    """Rank 64 stages one lora_down tile per warp (more L1 for three CTAs per SM: docs/PERF.md, session 19); the
    other register-form ranks two, and the ring form (rank 96) two.  The SMEM a variant asks for follows."""
    def smem(rank):
        return fam.smem_bytes_for(_knobs("sm_90a", "bf16", rank))
    tile = lambda r: 64 * (2 * r + 16)                                       # noqa: E731  one [64, R] tile, padded
    assert smem(64) == 4 * (128 + tile(64))
    for r in (16, 32, 48, 128):
        assert smem(r) == 4 * (128 + 2 * tile(r)), r
    assert smem(96) > 4 * (128 + 2 * tile(96))                               # two tiles and the x ring
    assert smem(0) == 4 * 128


def test_min_ctas_per_sm_table():
    """An occupancy target (> 1) scales with the warps per CTA; the hint 1 (it only lifts ptxas' register target)
    does not; two m-tiles per warp take at most 1; and each arch has its own exceptions."""
    def hint(arch, rank, warps=4, mtiles=1):
        knobs = dict(dtype="bf16", rank=rank, scale_layout=LAYOUT[arch], warps=warps, mtiles=mtiles)
        return plan.min_ctas_per_sm(plan._cfg_of(knobs), arch)
    assert [hint("sm_90a", r) for r in (0, 16, 32, 48, 64, 96, 128)] == [1, 1, 1, 3, 0, 0, 0]
    assert (hint("sm_90a", 48, warps=2), hint("sm_90a", 48, warps=8)) == (6, 1)
    assert hint("sm_90a", 32, warps=2) == 1 and hint("sm_90a", 48, mtiles=2) == 1
    assert hint("sm_100a", 128) == hint("sm_103a", 128) == 1
    assert hint("sm_120a", 128, warps=2) == hint("sm_121a", 48, warps=2) == 1 and hint("sm_120a", 64, warps=2) == 0


def test_sass_loop_reader_on_a_hand_written_listing():
    """The loop / collective reader behind the step-loop check, on a listing in cuobjdump's format: a forward
    branch is no loop, a backward one is, predicated and .reuse HMMAs count, HGMMA too; the copy ptxas keeps for
    a diverged warp (from a BRA.DIV target to its unconditional branch back) is neither a loop nor loop body."""
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                        /* 0x00000a0000017a02 */
        /*0010*/               @P0 BRA 0x60 ;                                     /* 0x0000000000500947 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8.reuse, R12, R4 ;    /* 0x0000000c0804723c */
        /*0030*/               @P1 HMMA.16816.F32.BF16 R4, R8, R14, R4 ;          /* 0x0000000e0804723c */
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ; /* 0x0000000000187df0 */
        /*0050*/               @P2 BRA 0x20 ;                                     /* 0x0000000000c82947 */
        /*0060*/                   BRA.DIV UR4, 0xb0 ;                            /* 0x0000000604007947 */
        /*0070*/                   WARPSYNC 0xffffffff ;                          /* 0x0000000000007948 */
        /*0080*/                   IADD3 R1, R1, 0x1, RZ ;                        /* 0x0000000101017810 */
        /*0090*/               @P3 BRA 0x0 ;                                      /* 0x0000000000007947 */
        /*00a0*/                   EXIT ;                                         /* 0x000000000000794d */
        /*00b0*/                   WARPSYNC.COLLECTIVE R90, 0xe0 ;                /* 0x0000000000007948 */
        /*00c0*/                   NOP ;                                          /* 0x0000000000007918 */
        /*00d0*/                   ENDCOLLECTIVE ;                                /* 0x0000000000007918 */
        /*00e0*/                   BRA 0x20 ;                                     /* 0x0000000000007947 */
    """
    ins = instructions(sass)
    assert [a for a, _ in ins] == list(range(0, 0xf0, 0x10))
    got = loops(ins)
    assert [(d["start"], d["end"], d["instructions"], d["hmma"]) for d in got] == [(0x0, 0x90, 10, 3),
                                                                                 (0x20, 0x50, 4, 3)]
    assert collectives(ins) == 1
    assert collectives(instructions(sass.replace("WARPSYNC.COLLECTIVE", "WARPSYNC"))) == 0


def _listing(lines):
    return "\n".join(f"        /*{16 * i:04x}*/  {t} ;  /* 0x0 */" for i, t in enumerate(lines))


@pytest.mark.parametrize("branch, skips", [
    ("@P0 BRA 0x60", True),             # per-thread predicate, past the block
    ("BRA.U UP0, 0x60", True),          # uniform predicate (sm_100a's form)
    ("BRA.U !UP1, 0x60", True),
    ("@P0 BRA 0x40", False),            # lands inside the block
    ("BRA 0x60", False),                # unconditional: the block never runs, no choice made
    ("NOP", False),                     # no branch: the block issues in both forms
])
def test_skipped_by_branch_reader(branch, skips):
    """The reader behind the smoothing-loop check: a block counts as skippable only behind one conditional forward
    branch whose target lies past its last matching instruction and inside the loop."""
    sass = _listing(["MOV R1, R2", branch, "MUFU.RCP64H R5, R3", "DFMA R6, -R2, R4, 1", "DFMA R6, R4, R6, R4",
                     "F2F.F32.F64 R7, R6", "STS [R8], R7", "@P1 BRA 0x0"])
    ins = instructions(sass)
    assert len(ins) == 8
    assert skipped_by_branch(ins, 0x0, 0x70, r"MUFU\.RCP64H|\bDFMA\b") is skips
    assert skipped_by_branch(ins, 0x0, 0x70, r"\bHMMA\b") is False         # nothing matches: no claim


def test_the_packed_abs_switch_changes_the_fp16_kernels_only(compiled, tmp_path, monkeypatch):
    """`SVDQ_KERNEL_QUANT_ABS=fp16` (an experiment build switch, off in every shipped build): the fp16 variants take
    |x̂| as ``abs.f16x2``, which ptxas folds into the maxima and compares as an operand modifier, so the step loop
    loses the 16 sign masks; the bf16 variants are built as without it (docs/PERF.md, session 55)."""
    from svdq_kernels import quantize_kernel as qk

    def build(arch, dt, r):
        knobs = _knobs(arch, dt, r)
        d = tmp_path / f"{dt}{r}"
        d.mkdir()
        ck = fam.compile(arch, knobs, variant_name("quantize_act", arch, knobs), str(d), keep_ptx=True)
        (d / "k.cubin").write_bytes(ck.cubin)
        return ck, str(d / "k.cubin")

    _, base, base_path = compiled[("sm_90a", "fp16", 0)]
    assert "abs.f16x2" not in base.ptx                       # without the switch: the shipped sign mask
    monkeypatch.setenv(qk.ABS_ENV, "fp16")
    ck, path = build("sm_90a", "fp16", 0)
    assert "abs.f16x2" in ck.ptx
    sass, base_sass = dump_sass(path), dump_sass(base_path)
    if sass is None or base_sass is None:
        pytest.skip("cuobjdump / nvdisasm not available")
    loop, base_loop = loops(instructions(sass))[0], loops(instructions(base_sass))[0]
    assert loop["instructions"] <= base_loop["instructions"] - 12, (loop, base_loop)
    assert "|R" in sass and "|R" not in base_sass            # the abs rides on its readers' operands
    _, bf_base, _ = compiled[("sm_90a", "bf16", 32)]
    bf, _ = build("sm_90a", "bf16", 32)
    assert bf.ptx == bf_base.ptx and bf.cubin == bf_base.cubin

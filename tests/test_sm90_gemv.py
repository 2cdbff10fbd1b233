"""The sm_90a GEMM's small-M form (schedule gemv): its knob rule, its launch-time split, the cp.async schedule of its
weight and activation rings (replayed in Python), and its compiled cubins (CPU cross-compile; the kernel ran
float64-checked on the H200 in session 9, docs/VERIFICATION.md)."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("cutlass")

from svdq_kernels import sm90_gemv_kernel as gv          # noqa: E402
from svdq_kernels import sm90_plan as plan               # noqa: E402
from svdq_kernels import sm90_wgmma_w4a4 as sm90         # noqa: E402
from svdq_loader.ops import GEMM_W4A4                     # noqa: E402

from kernel_checks import sass_of_cubin                  # noqa: E402

ARCH = "sm_90a"


def gemv_knobs(out_dtype="bf16", rank=32, wcscale=True, bias=True, **kw):
    k = dict(out_dtype=out_dtype, rank=rank, wcscale=wcscale, bias=bias, scale_layout="logical", tile_m=64,
             tile_n=128, tile_k=64, stages=4, prefetch=1, skip_pad=True, act_decode="prmt", schedule="gemv",
             wsets=2, act_source="nvfp4")
    k.update(kw)
    return k


# --------------------------------------------------------------------------
# the validity predicate: one tile, no knobs of the wgmma forms
# --------------------------------------------------------------------------

def test_gemv_accepts_its_one_form_at_every_rank():
    for r in sm90.FEATURE_VALUES["rank"]:
        for dt in ("fp16", "bf16"):
            assert sm90.invalid_reason(ARCH, gemv_knobs(dt, r)) is None, (dt, r)
    k = gemv_knobs()
    assert sm90.threads_for(k) == gv.THREADS == 256
    assert sm90.smem_bytes_for(k) == gv.SMEM_BYTES == plan.GEMV_SMEM_BYTES
    # two CTAs per SM (each also pays the driver's 1 KiB)
    assert 2 * (gv.SMEM_BYTES + 1024) <= 228 * 1024
    assert sm90.requirements(ARCH, k) == {"n_multiple": 128, "k_multiple": 128}
    assert sm90.resolve(ARCH, dict(k, stages="auto"))["stages"] == 4


@pytest.mark.parametrize("change, words", [
    (dict(tile_m=128), "tile 128x128: its tile is 64x128"),
    (dict(tile_n=256), "tile 64x256"),
    (dict(stages=3), "stages 3: the gemv form has no stages knob"),
    (dict(prefetch=2), "prefetch 2"),
    (dict(wsets=4), "wsets 4"),
    (dict(act_source="images"), "act_source 'images'"),
    (dict(act_decode="shift"), "act_decode 'shift'"),
    (dict(skip_pad=False), "skip_pad False"),
])
def test_gemv_rejects_knobs_it_does_not_have(change, words):
    reason = sm90.invalid_reason(ARCH, gemv_knobs(**change))
    assert reason is not None and words in reason, reason


def test_static_problem_wants_the_form_s_own_mma():
    ok = {"k_0": {"registers": 90, "stack_frame_bytes": 0}}
    assert sm90.static_problem("mma.sync.aligned.m16n8k16.row.col", ok, "mma.sync.aligned.m16n8k16") is None
    assert "no mma.sync" in sm90.static_problem("wgmma.mma_async", ok, "mma.sync.aligned.m16n8k16")


# --------------------------------------------------------------------------
# the split chosen at launch, and each rank's phases
# --------------------------------------------------------------------------

@pytest.mark.parametrize("m, n, k, want", [
    (16, 3072, 3072, 8),       # 24 tiles: 8 ranks (192 CTAs on 132 SMs, two per SM)
    (64, 3072, 12288, 8),
    (16, 12288, 3072, 2),      # 96 tiles: 2 ranks
    (1, 256, 128, 1),          # one phase: no split
    (1, 256, 640, 4),          # five phases, 2 tiles: four ranks (a power of two; shares of 1 and 2)
    (1, 256, 384, 2),
    (4608, 3072, 3072, 1),     # many tiles: no split
])
def test_split_of(m, n, k, want):
    tiles = -(-m // gv.TILE_M) * (n // gv.TILE_N)
    assert gv.split_of(tiles, 132, k // gv.PHASE_K) == want


def test_phase_shares_cover_every_phase_once():
    for phases in range(1, 40):
        for split in range(1, min(gv.MAX_SPLIT, phases) + 1):
            got = []
            for r in range(split):
                lo, cnt = gv.phase_share(r, phases, split)
                assert cnt >= 1
                got += range(lo, lo + cnt)
            assert got == list(range(phases)), (phases, split)


# --------------------------------------------------------------------------
# the cp.async schedule, replayed: every read finds the bytes it wants, no copy overwrites unread bytes
# --------------------------------------------------------------------------

def _replay(nph: int) -> None:
    R, RA = gv.RING, gv.RAW_SLOTS
    nk = 2 * nph
    groups = []                              # per committed group: its copies [("w", kt) | ("a", q)]
    wslot, aslot = {}, {}                    # slot -> what it holds (pending or landed)
    consumed_w, consumed_a = set(), set()

    def issue(kind, x):
        slots, slot, used = (wslot, x % R, consumed_w) if kind == "w" else (aslot, x % RA, consumed_a)
        old = slots.get(slot)
        assert old is None or old in used, f"{kind}{x} overwrites {kind}{old} before it was read (nph={nph})"
        slots[slot] = x
        groups[-1].append((kind, x))

    def wait(n_pending):
        return len(groups) - n_pending       # groups [0, done) have landed

    def landed(kind, x, done):
        return any((kind, x) in g for g in groups[:done])

    for j in range(R - 1):                   # the prologue
        groups.append([])
        if j < nk:
            issue("w", j)
        if j == 0:
            issue("a", 0)
        if j % 2 == 0 and gv.raw_phase_of_group(j) < nph:
            issue("a", gv.raw_phase_of_group(j))
    done = wait(R - 2)
    assert landed("a", 0, done) and aslot[0] == 0
    consumed_a.add(0)
    for ph in range(nph):
        for h in range(2):
            kt = 2 * ph + h
            done = wait(R - 2)
            assert landed("w", kt, done) and wslot[kt % R] == kt, (nph, kt)
            consumed_w.add(kt)
            j = kt + R - 1
            groups.append([])
            if j < nk:
                issue("w", j)
            if (h + R - 1) % 2 == 0 and gv.raw_phase_of_group(j) < nph:
                issue("a", gv.raw_phase_of_group(j))
        if ph + 1 < nph:
            q = ph + 1
            assert landed("a", q, wait(R - 2)) and aslot[q % RA] == q, (nph, q)
            consumed_a.add(q)
    assert consumed_w == set(range(nk)) and consumed_a == set(range(nph))


@pytest.mark.parametrize("nph", list(range(1, 25)) + [30, 48, 96, 120])
def test_ring_schedule(nph):
    _replay(nph)


def test_swizzle_makes_ldmatrix_and_the_decode_stores_conflict_free():
    # ldmatrix: the 8 row addresses of one matrix (rows r..r+7, one 16-byte chunk) hit 8 distinct 16-byte slots
    for chunk in range(8):
        for r0 in range(0, 64, 8):
            slots = {gv.swizzled_chunk(r, chunk) for r in range(r0, r0 + 8)}
            assert slots == set(range(8))


# --------------------------------------------------------------------------
# compiled cubins
# --------------------------------------------------------------------------

@pytest.mark.parametrize("knobs", [gemv_knobs("bf16", 32, True, True), gemv_knobs("fp16", 0, False, False),
                                   gemv_knobs("bf16", 256, True, False)],
                         ids=["bf16-r32", "fp16-r0-plain", "bf16-r256"])
def test_compile_produces_a_clean_gemv_cubin(knobs, tmp_path):
    from svdq_aot.host_ir import serialize_host
    from svdq_loader.hostvm import HostProgram
    from svdq_loader.cubin_info import param_sizes

    name = GEMM_W4A4.name_for(ARCH, knobs, sm90.requirements(ARCH, knobs))
    assert "schedulegemv" in name
    ck = sm90.compile(ARCH, knobs, name, str(tmp_path), keep_ptx=True)
    sym = ck.kernel_symbols[0]
    usage = ck.resource_usage[sym]
    assert usage["stack_frame_bytes"] == 0
    assert 0 < usage["registers"] <= 65536 // (2 * gv.THREADS)        # two CTAs per SM
    assert ck.smem_bytes == gv.SMEM_BYTES
    sass = sass_of_cubin(ck.cubin, tmp_path)
    assert not re.search(r"\b(STL|LDL)\b", sass)
    main = len(re.findall(r"HMMA\.16816\.F32 ", sass))               # fp16 x fp16: the main loop
    lora = len(re.findall(r"HMMA\.16816\.F32\.BF16 ", sass)) if knobs["out_dtype"] == "bf16" else None
    if knobs["out_dtype"] == "bf16":
        assert main == 2 * 4 * 8                       # one phase: 2 k-tiles x 4 k16 steps x 8 n8 blocks
        assert lora == knobs["rank"] // 16 * 8
    else:
        assert main == 2 * 4 * 8 + knobs["rank"] // 16 * 8
    assert "LDGSTS.E.BYPASS.128" in sass and "LDSM.16.M88.4" in sass and "DEPBAR.LE SB0, 0x6" in sass
    assert "HGMMA" not in sass
    # the split-K reduction: two cluster barriers, 128-bit distributed-SMEM reads
    assert sass.count("UCGABAR_ARV") == 2 and sass.count("UCGABAR_WAIT") == 2
    # the host code: grid = tiles x split, cluster (split, 1, 1), as split_of says
    prog = HostProgram.from_dict(json.loads(json.dumps(serialize_host(ck.compiled))))
    sizes = param_sizes(ck.cubin)
    for m, n, k, sms in ((16, 3072, 3072, 132), (64, 12288, 3072, 132), (1, 256, 640, 132), (300, 512, 1024, 132),
                         (16, 3072, 3072, 78)):
        rec = prog.launch([0x10000 * (i + 1) for i in range(9)] + [m, n, k, sms, 0], sizes)
        tiles = -(-m // 64) * (n // 128)
        s = gv.split_of(tiles, sms, k // 128)
        assert rec.grid == (tiles * s, 1, 1) and rec.block == (256, 1, 1) and rec.cluster[0] == s, (m, n, k, sms)
        assert rec.smem == gv.SMEM_BYTES

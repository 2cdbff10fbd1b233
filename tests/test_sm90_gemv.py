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

from kernel_checks import check_output_store, sass_of_cubin  # noqa: E402

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

@pytest.mark.parametrize("tile", sorted(plan.GEMV_LAYOUTS))
def test_gemv_accepts_its_forms_at_every_rank(tile):
    tile_m, tile_n = tile
    for r in sm90.FEATURE_VALUES["rank"]:
        for dt in ("fp16", "bf16"):
            assert sm90.invalid_reason(ARCH, gemv_knobs(dt, r, tile_m=tile_m, tile_n=tile_n)) is None, (dt, r)
            pf2 = sm90.invalid_reason(ARCH, gemv_knobs(dt, r, tile_m=tile_m, tile_n=tile_n, prefetch=2))
            assert (pf2 is None) == (tile_m == 64 and (tile_n == 64 or r <= 64)), (dt, r, pf2)
    k = gemv_knobs(tile_m=tile_m, tile_n=tile_n)
    lay = plan.GEMV_LAYOUTS[tile]
    assert sm90.threads_for(k) == lay.threads == 2 * tile_n
    assert sm90.smem_bytes_for(k) == lay.smem_bytes
    # ctas_per_sm CTAs per SM (each also pays the driver's 1 KiB); one fewer would not hold the next
    assert lay.ctas_per_sm * (lay.smem_bytes + 1024) <= 228 * 1024
    assert sm90.requirements(ARCH, k) == {"n_multiple": tile_n, "k_multiple": 128}
    assert sm90.resolve(ARCH, dict(k, stages="auto"))["stages"] == 4
    # the layout's regions do not overlap and hold what the kernel puts there
    assert lay.s_ring_at == lay.ring * lay.threads * 16
    assert lay.r_ring_at == lay.s_ring_at + lay.ring * lay.threads * 8
    assert lay.a_buf_at == lay.r_ring_at + lay.raw_slots * lay.raw_tasks * 20
    assert lay.smem_bytes >= lay.a_buf_at + lay.a_buf_bytes
    assert lay.a_buf_bytes == (2 * gv._A_BUF if tile_m == 64 else plan.GEMV_CHUNK * gv._A_PH16)
    assert lay.raw_tasks == 4 * tile_m * (1 if tile_m == 64 else plan.GEMV_CHUNK)   # four 32-k chunks per row
    assert lay.raw_tasks % lay.threads == 0
    nacc = 4 * (tile_m // 8)
    assert lay.warps * 32 * nacc * 4 <= lay.a_buf_bytes                 # the split-K partials fit the tile buffers


def test_wgmma_forms_refuse_the_64_row_weight_tile():
    from test_kernel_compile import make_knobs
    reason = sm90.invalid_reason(ARCH, make_knobs(tile_n=64, schedule="ws", prefetch=2, skip_pad=True,
                                                  act_decode="prmt"))
    assert reason and "tile_n 64 with schedule ws" in reason and "gemv" in reason


@pytest.mark.parametrize("change, words", [
    (dict(tile_m=128), "tile 128x128: its tiles are 64x128, 64x64, 16x128, 16x64"),
    (dict(tile_m=16, prefetch=2), "tile_m 16 and prefetch 2"),
    (dict(tile_n=256), "tile 64x256"),
    (dict(stages=3), "stages 3: the gemv form has no stages knob"),
    (dict(prefetch=2, rank=80), "prefetch 2 and rank 80: two k-tiles of fragments"),
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

@pytest.mark.parametrize("tile_m, tile_n, m, n, k, want", [
    (64, 128, 16, 3072, 3072, 4),       # 24 tiles, 24 phases: 4 ranks of 6 (8 would fit the SMs, at 3 phases)
    (64, 128, 64, 3072, 12288, 8),
    (64, 128, 16, 12288, 3072, 2),      # 96 tiles: 2 ranks
    (64, 128, 1, 256, 128, 1),          # one phase: no split
    (64, 128, 1, 256, 640, 1),          # five phases: one rank (two would get fewer than four each)
    (64, 128, 1, 256, 384, 1),
    (64, 128, 1, 256, 2048, 4),         # 16 phases, 2 tiles: four ranks of four
    (64, 128, 1, 256, 2560, 4),         # 20 phases: x = 5, so four ranks (a power of two; shares of 5)
    (64, 128, 4608, 3072, 3072, 1),     # many tiles: no split
    (64, 64, 16, 3072, 3072, 4),        # 48 tiles: 4 ranks of 6 phases, 192 CTAs (8 would fit, three per SM)
    (64, 64, 16, 3072, 4096, 8),        # 32 phases: 8 ranks, 384 CTAs, three per SM
    (64, 64, 16, 12288, 3072, 2),       # 192 tiles: 2 ranks
    (64, 64, 64, 3072, 15360, 8),
    (16, 128, 16, 3072, 12288, 8),      # the same 24 tiles at M <= 16
    (16, 128, 64, 3072, 12288, 2),      # 4 m-tiles: 96 tiles
    (16, 64, 16, 3072, 15360, 8),
])
def test_split_of(tile_m, tile_n, m, n, k, want):
    tiles = -(-m // tile_m) * (n // tile_n)
    assert gv.split_of(tiles, 132, k // gv.PHASE_K, plan.GEMV_LAYOUTS[(tile_m, tile_n)].ctas_per_sm) == want


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

class _Rings:
    """The copies a thread has committed, group by group, and what each ring slot holds: `issue` fails when a copy
    would overwrite bytes not read yet, `landed` says whether a copy's group is complete under a wait that leaves
    `n_pending` groups in flight."""

    def __init__(self, nph: int, ring: int, raw_slots: int):
        self.nph, self.R, self.RA = nph, ring, raw_slots
        self.groups, self.slots = [], {"w": {}, "a": {}}
        self.used = {"w": set(), "a": set()}

    def commit(self):
        self.groups.append([])

    def issue(self, kind, x, slot=None):
        slot = x % (self.R if kind == "w" else self.RA) if slot is None else slot
        old = self.slots[kind].get(slot)
        assert old is None or old in self.used[kind], \
            f"{kind}{x} overwrites {kind}{old} before it was read (nph={self.nph})"
        self.slots[kind][slot] = x
        self.groups[-1].append((kind, x))

    def read(self, kind, x, n_pending, slot=None):
        slot = x % (self.R if kind == "w" else self.RA) if slot is None else slot
        done = self.groups[:len(self.groups) - n_pending]
        assert any((kind, x) in g for g in done) and self.slots[kind][slot] == x, (self.nph, kind, x)
        self.used[kind].add(x)


def _replay(nph: int, lay, prefetch: int) -> None:
    """tile_m 64, the kernel's copy / wait / read order (prefetch 1: a wait per k-tile; 2: per phase)."""
    R = lay.ring
    nk = 2 * nph
    st = _Rings(nph, R, lay.raw_slots)

    def refill(j):
        st.commit()
        if j < nk:
            st.issue("w", j)
        if j % 2 == 0 and gv.raw_phase_of_group(j) < nph:      # the kernel's parity test, (h + RING - 1) even
            st.issue("a", gv.raw_phase_of_group(j))

    for j in range(R - 1):                   # the prologue
        st.commit()
        if j < nk:
            st.issue("w", j)
        if j == 0:
            st.issue("a", 0)
        if j % 2 == 0 and gv.raw_phase_of_group(j) < nph:
            st.issue("a", gv.raw_phase_of_group(j))
    st.read("a", 0, R - 2)
    for ph in range(nph):
        if prefetch == 1:
            for h in range(2):
                st.read("w", 2 * ph + h, R - 2)
                refill(2 * ph + h + R - 1)
        else:
            for h in range(2):
                st.read("w", 2 * ph + h, R - 3)
            for h in range(2):
                refill(2 * ph + h + R - 1)
        if ph + 1 < nph:
            # the last wait (before the phase's last refill) left groups <= 2ph+1 landed: R - 1 groups since
            st.read("a", ph + 1, R - 1)
    assert st.used["w"] == set(range(nk)) and st.used["a"] == set(range(nph))


def _replay_chunks(nph: int, lay) -> None:
    """tile_m 16: raw chunks of GEMV_CHUNK phases in two slots, decoded a chunk at a time (the kernel's order)."""
    R, CH = lay.ring, plan.GEMV_CHUNK
    nk, nch = 2 * nph, -(-nph // CH)
    st = _Rings(nph, R, lay.raw_slots)
    for j in range(R - 1):
        st.commit()
        if j < nk:
            st.issue("w", j)
        if j == 0:
            for q in range(min(2, nch)):
                st.issue("a", q)
    st.read("a", 0, R - 2)
    # the loop walks the weight ring with the kernel's running offsets (any slot size: 24 bytes here), not kt % R
    B = 24
    ro, wo = plan.gemv_ring_start(R, B)
    for cq in range(nch):
        for pl in range(min(CH, nph - CH * cq)):
            for h in range(2):
                kt = 2 * (CH * cq + pl) + h
                assert ro % B == 0 and 0 <= ro < R * B and wo % B == 0 and 0 <= wo < R * B
                st.read("w", kt, R - 2, slot=ro // B)
                st.commit()
                if kt + R - 1 < nk:
                    st.issue("w", kt + R - 1, slot=wo // B)
                ro, wo = plan.gemv_ring_next(ro, B, R, lambda c, a, b: a if c else b)
                if h == 0 and pl == 0 and cq + 2 < nch:
                    st.issue("a", cq + 2)
        if cq + 1 < nch:
            st.read("a", cq + 1, R - 1)
    assert st.used["w"] == set(range(nk)) and st.used["a"] == set(range(nch))


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("tile", sorted(plan.GEMV_LAYOUTS))
@pytest.mark.parametrize("nph", list(range(1, 25)) + [30, 48, 96, 120])
def test_ring_schedule(nph, tile, prefetch):
    lay = plan.GEMV_LAYOUTS[tile]
    if tile[0] == 64:
        _replay(nph, lay, prefetch)
    elif prefetch == 1:
        _replay_chunks(nph, lay)


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
                                   gemv_knobs("bf16", 256, True, False), gemv_knobs("bf16", 32, True, True, tile_n=64),
                                   gemv_knobs("fp16", 96, False, True, tile_n=64),
                                   gemv_knobs("bf16", 64, True, True, prefetch=2),
                                   gemv_knobs("bf16", 256, True, True, tile_n=64, prefetch=2),
                                   gemv_knobs("bf16", 32, True, True, tile_m=16),
                                   gemv_knobs("fp16", 256, False, True, tile_m=16, tile_n=64)],
                         ids=["bf16-r32", "fp16-r0-plain", "bf16-r256", "tile64-bf16-r32", "tile64-fp16-r96",
                              "pf2-bf16-r64", "tile64-pf2-bf16-r256", "m16-bf16-r32", "m16-tile64-fp16-r256"])
def test_compile_produces_a_clean_gemv_cubin(knobs, tmp_path):
    from svdq_aot.host_ir import serialize_host
    from svdq_loader.hostvm import HostProgram
    from svdq_loader.cubin_info import param_sizes

    name = GEMM_W4A4.name_for(ARCH, knobs, sm90.requirements(ARCH, knobs))
    assert "schedulegemv" in name
    ck = sm90.compile(ARCH, knobs, name, str(tmp_path), keep_ptx=True)
    sym = ck.kernel_symbols[0]
    usage = ck.resource_usage[sym]
    lay = plan.GEMV_LAYOUTS[(knobs["tile_m"], knobs["tile_n"])]
    tm = knobs["tile_m"]
    assert usage["stack_frame_bytes"] == 0
    # ctas_per_sm CTAs' registers fit the SM's 64 K (allocated per warp in units of 256)
    assert lay.fits_registers(usage["registers"]), usage
    assert not lay.fits_registers(65536 // (lay.ctas_per_sm * lay.threads) + 8)
    assert ck.smem_bytes == lay.smem_bytes
    sass = sass_of_cubin(ck.cubin, tmp_path)
    assert not re.search(r"\b(STL|LDL)\b", sass)
    main = len(re.findall(r"HMMA\.16816\.F32 ", sass))               # fp16 x fp16: the main loop
    lora = len(re.findall(r"HMMA\.16816\.F32\.BF16 ", sass)) if knobs["out_dtype"] == "bf16" else None
    if knobs["out_dtype"] == "bf16":
        assert main == 2 * 4 * (tm // 8)               # one phase: 2 k-tiles x 4 k16 steps x tm / 8 n8 blocks
        assert lora == knobs["rank"] // 16 * (tm // 8)
    else:
        assert main == 2 * 4 * (tm // 8) + knobs["rank"] // 16 * (tm // 8)
    assert "LDGSTS.E.BYPASS.128" in sass and "LDSM.16.M88.4" in sass
    assert f"DEPBAR.LE SB0, {lay.ring - 2:#x}" in sass                # ring - 1 k-tiles in flight
    assert "HGMMA" not in sass
    if tm == 16:    # the transposed store: a movmatrix per accumulator pair (two per n8 block), then the store form
        check_output_store(sass, tm // 4)
    else:           # tile_m 64: 16-bit stores, one per accumulator
        assert "MOVM" not in sass and sass.count("STG.E.U16") == 4 * (tm // 8)
    # the split-K reduction: two cluster barriers, 128-bit distributed-SMEM reads
    assert sass.count("UCGABAR_ARV") == 2 and sass.count("UCGABAR_WAIT") == 2
    # the host code: grid = tiles x split, cluster (split, 1, 1), as split_of says
    prog = HostProgram.from_dict(json.loads(json.dumps(serialize_host(ck.compiled))))
    sizes = param_sizes(ck.cubin)
    for m, n, k, sms in ((16, 3072, 3072, 132), (16, 3072, 4096, 132), (64, 12288, 3072, 132), (1, 256, 640, 132),
                         (1, 256, 2560, 132), (300, 512, 1024, 132),
                         (16, 3072, 3072, 78)):
        rec = prog.launch([0x10000 * (i + 1) for i in range(9)] + [m, n, k, sms, 0], sizes)
        tiles = -(-m // tm) * (n // knobs["tile_n"])
        s = gv.split_of(tiles, sms, k // 128, lay.ctas_per_sm)
        assert rec.grid == (tiles * s, 1, 1) and rec.block == (lay.threads, 1, 1) and rec.cluster[0] == s, \
            (m, n, k, sms)
        assert rec.smem == lay.smem_bytes


def test_the_gemv_launch_gets_a_recipe_only_through_the_family_s_hints(tmp_path):
    """The fitter does not find the launch-time split by itself; with the family's hints it derives a recipe that
    reproduces the host program's grid, block and cluster (the derivation verifies it on fresh samples too)."""
    from svdq_aot.build import _kernel_params
    from svdq_aot.derive_recipe import derive_for_op
    from svdq_aot.host_ir import serialize_host
    from svdq_loader.hostvm import HostProgram
    from svdq_loader.launch_recipe import LaunchRecipe

    knobs = gemv_knobs("bf16", 32, True, True, tile_m=16)
    req = sm90.requirements(ARCH, knobs)
    ck = sm90.compile(ARCH, knobs, GEMM_W4A4.name_for(ARCH, knobs, req), str(tmp_path))
    assert len(ck.recipe_hints) == 2
    host = json.loads(json.dumps(serialize_host(ck.compiled)))
    params = {sym: tuple(tuple(int(x) for x in p) for p in ps) for sym, ps in _kernel_params(ck.cubin).items()}
    assert derive_for_op(GEMM_W4A4, host, params, req) is None
    rec = LaunchRecipe.from_dict(derive_for_op(GEMM_W4A4, host, params, req, hints=ck.recipe_hints))
    prog = HostProgram.from_dict(host)
    sizes = {sym: [p[2] for p in ps] for sym, ps in params.items()}
    for m, n, k, sms in ((16, 3072, 3072, 132), (7, 12288, 15360, 132), (300, 512, 1024, 78), (1, 128, 128, 1)):
        want = prog.launch([0x10000 * (i + 1) for i in range(9)] + [m, n, k, sms, 0], sizes)
        got = rec.bind([m, n, k, sms])
        assert got is not None and tuple(got.grid) == want.grid and tuple(got.block) == want.block, (m, n, k, sms)
        assert got.smem == want.smem

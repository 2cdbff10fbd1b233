"""The sm_90a GEMM's stream-K schedule (``ws_streamk``, an experiment timed on an H100 in session 27), on the CPU.

The kernel walks its range with ``gemm_streamk.segment`` and meets with ``ranges.cta_of_unit`` /
``ranges.slot_index`` on its traced integers; here the same functions are replayed on Python ints for every
CTA of many launches: the segments cover every (tile, k-tile) once, in whole loop steps, with a ring index that runs
on from segment to segment; a split tile's parts are exactly the CTAs its counter word names; no two parts share a
slot or two split tiles a counter; the workspace holds them all.  Then the launcher's workspace size, the family's
refusals, and the SASS of one compiled variant.
"""
from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_stubs import WORKSPACE_PTR, StubLauncher, stub_workspaces  # noqa: E402
from svdq_loader.ops import GEMM_W4A4  # noqa: E402
from svdq_loader.ops import decode_act as D  # noqa: E402
from svdq_loader.ops import gemm_streamk as SK  # noqa: E402
from svdq_loader.ops.ranges import cta_of_unit, range_start, slot_index, workspace_counter_bytes  # noqa: E402

PROBLEMS = [  # (m, n, k, tile_m, tile_n, unroll, sm_count)
    (m, n, k, tm, 128, u, sms)
    for m, n, k in ((1, 128, 256), (64, 3072, 3072), (64, 12288, 3072), (64, 9216, 3072), (64, 21504, 3072),
                    (200, 3072, 15360), (256, 12288, 3072), (1024, 3072, 3072), (4608, 3072, 12288))
    for tm, u, sms in ((64, 4, 132), (64, 2, 132), (256, 2, 132), (208, 4, 132), (64, 4, 78), (64, 4, 1),
                       (256, 2, 7))
    if k % (64 * u) == 0
] + [(m, n, k, 64, 192, u, 132) for m, n, k in ((64, 3072, 3072), (64, 12288, 3072), (64, 21504, 3072),
                                                 (64, 3072, 15360)) for u in (2, 4)]


def _replay(m, n, k, tm, tn, unroll, sms):
    """{tile: [(cta, first k-tile, k-tiles, slot or None)]} of one launch, asserting each CTA's walk."""
    upt = SK.units_per_tile(k, unroll)
    total = SK.units(m, n, k, tm, tn, unroll)
    G = SK.grid(total, sms)
    assert 1 <= G <= min(total, sms)
    num_kt = k // 64
    parts: dict[int, list] = {}
    for b in range(G):
        u0, u1 = range_start(b, total, G), range_start(b + 1, total, G)
        assert u1 - u0 in (total // G, -(-total // G))          # equal shares, one unit apart at most
        t0 = u0 // upt
        ring = 0
        for tile in range(t0, (u1 - 1) // upt + 1):
            kabs, nk, g0 = SK.segment(tile, u0, u1, upt, unroll)
            assert g0 == ring, "the stage ring's index must run on from the previous segment"
            assert nk >= unroll and nk % unroll == 0 and kabs % unroll == 0 and kabs + nk <= num_kt
            ring += nk
            whole = kabs == 0 and nk == num_kt
            parts.setdefault(tile, []).append((b, kabs, nk, None if whole else slot_index(b, tile, t0)))
        assert ring == (u1 - u0) * unroll
    return parts, G, upt, total


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: "m{}n{}k{}_t{}x{}u{}s{}".format(*p))
def test_every_k_tile_once_and_every_meeting_consistent(problem):
    m, n, k, tm, tn, unroll, sms = problem
    parts, G, upt, total = _replay(*problem)
    assert sorted(parts) == list(range(SK.tile_count(m, n, tm, tn)))
    slots, counters = set(), set()
    for tile, ps in parts.items():
        covered = sorted(kt for _, kabs, nk, _ in ps for kt in range(kabs, kabs + nk))
        assert covered == list(range(k // 64)), f"tile {tile}: k-tiles covered {covered}"
        if len(ps) == 1:
            assert ps[0][3] is None                   # a whole tile ends in its CTA, no meeting
            continue
        assert all(p[3] is not None for p in ps)
        b_first, b_last = cta_of_unit(tile * upt, total, G), cta_of_unit(tile * upt + upt - 1, total, G)
        assert [p[0] for p in ps] == list(range(b_first, b_last + 1)), "the meeting counts every part, in CTA order"
        for b, _, _, slot in ps:                       # the last arrival reads b's slot where b wrote it
            assert slot == slot_index(b, tile, range_start(b, total, G) // upt)
            assert slot not in slots and slot < 2 * G
            slots.add(slot)
        assert b_first not in counters
        counters.add(b_first)
    assert max(counters, default=0) * 8 + 8 <= workspace_counter_bytes(G)
    need = workspace_counter_bytes(G) + (max(slots, default=-1) + 1) * SK.slot_bytes(tm, tn)
    assert need <= SK.workspace_bytes(G, tm, tn)


def test_the_ranges_use_every_sm_where_tiles_leave_some_idle():
    """M = 64, N = 12288, K = 3072: 96 tiles of 64 x 128 (one tile's 48 k-tiles per busy SM under ws); stream-K over
    132 SMs gives each CTA 32 or 36 k-tiles (units of four)."""
    parts, G, upt, total = _replay(64, 12288, 3072, 64, 128, 4, 132)
    assert (G, total) == (132, 96 * 12)
    per_cta = {}
    for ps in parts.values():
        for b, _, nk, _ in ps:
            per_cta[b] = per_cta.get(b, 0) + nk
    assert sorted(set(per_cta.values())) == [32, 36]


def test_the_launcher_allocates_the_meetings_after_the_images():
    knobs = dict(tile_m=64, tile_n=128, wsets=4, prefetch=1, schedule="ws_streamk", act_source="images")
    extra = GEMM_W4A4.prepass_extra_bytes(knobs)
    assert GEMM_W4A4.prepass_extra_bytes(dict(knobs, schedule="ws")) is None
    gemm, decode = StubLauncher("gemm"), StubLauncher("decode")
    ln = D.ImagesLauncher(decode, gemm, GEMM_W4A4.arg_names, extra)
    sizes = stub_workspaces(ln)
    args = [0x1000 * (i + 1) for i in range(9)] + [64, 12288, 3072, 132, 0x55]
    ln.launch(args)
    names = GEMM_W4A4.arg_names
    assert gemm.calls[0][names.index("act")] == WORKSPACE_PTR      # the images, then the meetings
    # the meetings follow the images in the same block, and reach the GEMM as its (otherwise unread) ascales
    assert gemm.calls[0][names.index("ascales")] == WORKSPACE_PTR + D.image_bytes(64, 3072)
    assert decode.calls[0][:2] == [args[names.index("act")], args[names.index("ascales")]]   # the NVFP4 inputs
    G = SK.grid(SK.units(64, 12288, 3072, 64, 128, 4), 132)
    assert G == 132
    assert sizes == [D.image_bytes(64, 3072) + workspace_counter_bytes(G) + 2 * G * 64 * 128 * 4]
    assert D.image_bytes(64, 3072) % D.MEET_ALIGN == 0


def test_the_fp8_mode_meets_in_a_workspace_of_its_own_k_tiles():
    """The FP8-compute op's stream-K forms count units of 128-k k-tiles; after act_fp8's workspace (1 / ra and the
    E4M3 image, rounded up to MEET_ALIGN), and alone on a ready E4M3 activation in a block of their own."""
    from svdq_loader.ops import GEMM_W4A4_FP8, act_fp8
    knobs = dict(tile_m=256, tile_n=128, tile_k=128, wsets=4, prefetch=1, schedule="ws_streamk",
                 act_source="images")
    extra = GEMM_W4A4_FP8.prepass_extra_bytes(knobs)
    assert GEMM_W4A4_FP8.prepass_extra_bytes(dict(knobs, schedule="ws")) is None
    m, n, k = 4608, 3072, 3072
    U = SK.units(m, n, k, 256, 128, 4, 128)
    assert U == 18 * 24 * (3072 // 512)
    G = SK.grid(U, 132)
    need = workspace_counter_bytes(G) + 2 * G * 256 * 128 * 4
    assert extra(m, n, k, 132) == need
    gemm, pre = StubLauncher("gemm"), StubLauncher("act_fp8")
    names = GEMM_W4A4_FP8.arg_names
    ln = D.ImagesLauncher(pre, gemm, names, extra, act_fp8.workspace_bytes)
    sizes = stub_workspaces(ln)
    args = [0x1000 * (i + 1) for i in range(9)] + [m, n, k, 132, 0x55]
    ln.launch(args)
    at = -(-act_fp8.workspace_bytes(m, k) // D.MEET_ALIGN) * D.MEET_ALIGN
    assert sizes == [at + need]
    assert gemm.calls[0][names.index("ascales")] == WORKSPACE_PTR + at
    alone = ln.workspace_gemm()              # an E4m3Act call: the GEMM alone, its meetings apart
    assert ln.workspace_gemm() is alone      # made once with the launcher, not per call
    assert alone.name == "gemm" and alone.gemm is gemm
    sizes_alone = stub_workspaces(alone)
    a = list(args)
    a[names.index("ascales")] = 0
    alone.launch(a)
    assert sizes_alone == [need]
    assert gemm.calls[1][names.index("act")] == a[names.index("act")]
    assert gemm.calls[1][names.index("ascales")] == WORKSPACE_PTR


def test_loop_unroll_is_the_kernels():
    from svdq_kernels.sm90_plan import _cfg_of, k_unroll
    base = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=64, tile_n=128,
                tile_k=64, stages=4, skip_pad=True, act_decode="prmt", schedule="ws_streamk", act_source="images")
    for wsets, prefetch in itertools.product((2, 4, 8), (1, 2, 4)):
        assert k_unroll(_cfg_of(dict(base, wsets=wsets, prefetch=prefetch))) == SK.loop_unroll(wsets, prefetch)


@pytest.mark.parametrize("tile_m, tile_n, wsets", [(64, 128, 2), (64, 128, 4), (256, 128, 2), (208, 128, 4),
                                                   (64, 192, 2), (64, 192, 4)])
def test_the_selftest_meets_in_every_stream_k_variant(tile_m, tile_n, wsets):
    """The GPU selftest's cases for a stream-K variant (``selftest.gemm_cases``) split tiles over several CTAs, so
    the meeting runs against the float64 reference, not only whole tiles."""
    pytest.importorskip("cutlass")
    from svdq_kernels.sm90_wgmma_w4a4 import requirements
    from svdq_loader.testing.selftest import gemm_cases
    knobs = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=tile_m,
                 tile_n=tile_n, tile_k=64, stages=4, prefetch=1, skip_pad=True, act_decode="prmt",
                 schedule="ws_streamk", wsets=wsets, act_source="images")
    split = 0
    for case in gemm_cases(knobs, requirements("sm_90a", knobs)):
        m, n, k = case.kwargs["m"], case.kwargs["n"], case.kwargs["k"]
        parts, *_ = _replay(m, n, k, tile_m, tile_n, SK.loop_unroll(wsets, 1), 132)
        split += sum(len(ps) > 1 for ps in parts.values())
    assert split >= 8

"""The sm_100a/sm_103a GEMM's trace-time decisions (kernel_src/sm100_plan.py): coverage and budgets.

Pure Python (no DSL, no GPU): the kernel calls these same functions on DSL integers.
"""
from __future__ import annotations

import random

import pytest

from svdq_kernels import sm100_plan as P

RANKS = (16, 32, 48, 64, 96, 128, 256)


# ---------------------------------------------------------------- LoRA interleave schedule
@pytest.mark.parametrize("rank", RANKS)
def test_every_lora_atom_is_issued_exactly_once_for_every_k(rank):
    L = rank // P.LORA_ATOM_K
    for k in list(range(P.MAIN_K_BLOCK, 64 * P.MAIN_K_BLOCK + 1, P.MAIN_K_BLOCK)) + [12288, 15360, 65536]:
        kb_count = k // P.MAIN_K_BLOCK
        sched = P.lora_schedule(kb_count, L)
        issued = [j for lo, hi in sched for j in range(lo, hi)]
        assert issued == list(range(L)), (k, rank, sched)           # each atom once, in order
        assert all(0 <= lo <= hi <= L for lo, hi in sched)
        # the buffer is released after exactly one k-block, the one holding the last atom
        rel = [kb for kb, (lo, hi) in enumerate(sched) if lo < hi and hi == L]
        assert rel == [P.lora_release_kb(kb_count, L)], (k, rank)
        # front-loaded: all LoRA work is done after ceil(L / ceil(L / KB)) k-blocks
        c = -(-L // kb_count)
        assert rel[0] == -(-L // c) - 1


def test_k_smaller_than_4r_issues_several_atoms_per_k_block():
    # K = 256 (one k-block), R = 128 (8 atoms): every atom right after the only k-block
    assert P.lora_schedule(1, 8) == [(0, 8)]
    # K = 512, R = 256 (16 atoms, 2 k-blocks): 8 + 8
    assert P.lora_schedule(2, 16) == [(0, 8), (8, 16)]
    # K = 768, R = 128 (8 atoms, 3 k-blocks): 3 + 3 + 2, nothing dropped
    assert P.lora_schedule(3, 8) == [(0, 3), (3, 6), (6, 8)]


def test_rank_zero_schedule_is_empty_and_k_blocks_must_exist():
    assert P.lora_schedule(5, 0) == [(0, 0)] * 5
    with pytest.raises(ValueError, match="at least one main k-block"):
        P.lora_schedule(0, 2)
    with pytest.raises(ValueError, match="no LoRA buffer to release with 0 LoRA atoms"):
        P.lora_release_kb(4, 0)


def test_lora_slice_with_an_injected_minimum_matches():
    calls = []

    def my_min(a, b):
        calls.append((a, b))
        return a if a < b else b
    assert P.lora_slice(2, 12, 8, my_min) == P.lora_slice(2, 12, 8)
    assert calls, "the kernel's minimum (cutlass.min) must be the one used"


# ---------------------------------------------------------------- persistent tile scheduler
def _walk(m, n, tile_m, tile_n, sm_count, cs):
    tiles_m, tiles_n = -(-m // tile_m), n // tile_n
    num = tiles_m * tiles_n
    clusters = P.persistent_clusters(sm_count, cs, num)
    seen = []
    for c in range(clusters):
        for t in P.tiles_of_cluster(c, clusters, num):
            seen.append(P.tile_coord(t, tiles_m))
    return tiles_m, tiles_n, clusters, seen


@pytest.mark.parametrize("cs,tile_m", [(1, 128), (2, 256)])
def test_every_output_tile_is_visited_exactly_once(cs, tile_m):
    rng = random.Random(6)
    ms = [1, 77, 127, 128, 129, 255, 256, 257, 1280, 4352, 4592, 4608, 16896] + [rng.randrange(1, 20000)
                                                                             for _ in range(12)]
    for m in ms:
        for n in (128, 256, 3072, 9216):
            for tile_n in (128, 256):
                if n % tile_n:
                    continue
                for sm in (1, 2, 3, 8, 78, 114, 132, 148, 160):
                    tiles_m, tiles_n, clusters, seen = _walk(m, n, tile_m, tile_n, sm, cs)
                    assert sorted(seen) == [(a, b) for a in range(tiles_m) for b in range(tiles_n)], (m, n, sm)
                    assert len(seen) == len(set(seen))
                    assert 1 <= clusters <= max(1, sm // cs) and clusters <= tiles_m * tiles_n
                    # at most one CTA per SM whenever the device has room for a cluster at all
                    if sm >= cs:
                        assert clusters * cs <= sm


def test_persistent_grid_follows_the_sm_count_not_a_constant():
    assert P.persistent_clusters(148, 2, 10_000) == 74
    assert P.persistent_clusters(132, 2, 10_000) == 66
    assert P.persistent_clusters(148, 1, 10_000) == 148
    assert P.persistent_clusters(148, 2, 5) == 5       # never more clusters than tiles
    assert P.persistent_clusters(1, 2, 5) == 1         # and at least one


def test_m_runs_fastest_so_concurrent_clusters_share_a_weight_tile():
    assert [P.tile_coord(t, 4) for t in range(6)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]


# ---------------------------------------------------------------- budgets
def test_stage_solver_uses_every_byte_and_rejects_with_numbers():
    b = P.SmemBytes(ab_stage=28672, lora=49152, epilogue=16384)
    best = P.max_ab_stages(b)
    assert b.total(best) <= P.SMEM_LIMIT_BYTES < b.total(best + 1)
    assert P.smem_problem(b, best) is None
    msg = P.smem_problem(b, best + 1)
    assert f"needs {b.total(best + 1)} B of SMEM ({best + 1} A/B stages x 28672 B + LoRA 49152 B" in msg
    assert f"more than the {P.SMEM_LIMIT_BYTES} B" in msg and f"at most {best} A/B stages fit" in msg
    assert "at least 2 stages" in P.smem_problem(b, 1)


def test_stage_solver_counts_alignment_static_smem_and_barriers():
    b = P.SmemBytes(ab_stage=1000, lora=1, epilogue=1, align=1024)
    # lora and epilogue each round up to 1024; 3 stages of 1000 B round to 3072
    assert b.dynamic(3) == 1024 + 1024 + P.BARRIER_BYTES + 3072
    assert b.total(3) == b.dynamic(3) + P.STATIC_SMEM_BYTES
    assert P.max_ab_stages(P.SmemBytes(ab_stage=10, lora=0, epilogue=0)) == P.MAX_AB_STAGES


def test_tmem_budget():
    assert P.acc_stages_for(128, 16, 16) == 2 and P.tmem_columns(128, 2, 16, 16) == 288
    assert P.acc_stages_for(256, 16, 32) == 1        # two 256-column stages + scales exceed 512
    assert P.tmem_problem(256, 2, 16, 32) == ("needs 560 TMEM columns (2 accumulator stage(s) x 256 + SFA 16 + "
                                              "SFB 32), more than the 512 an SM has")
    assert P.tmem_problem(256, 1, 16, 32) is None
    assert [P.tmem_alloc_columns(c) for c in (1, 32, 33, 288, 512)] == [32, 32, 64, 512, 512]

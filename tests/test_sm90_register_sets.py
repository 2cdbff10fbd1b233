"""The warp-specialised sm_90a GEMM's register prefetch: the producer's raw activation sets (knob ``prefetch``, up to
four) and the MMA warps' raw weight sets (knob ``wsets``, up to eight).  A Python replay of the producer's set rotation
(the kernel's own index expressions), the K multiple each choice needs, and the validity rule that keeps more than two
activation sets to the producers that decode NVFP4 (CPU only; the 64-row forms built with four activation sets ran
float64-checked on the H200 in session 17, docs/VERIFICATION.md)."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

from svdq_kernels import sm90_wgmma_w4a4 as sm90         # noqa: E402

ARCH = "sm_90a"


def knobs(**kw):
    k = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=64, tile_n=128,
             tile_k=64, stages=4, prefetch=4, skip_pad=True, act_decode="prmt", schedule="ws", wsets=8,
             act_source="nvfp4")
    k.update(kw)
    return k


def replay_producer(P: int, nk: int, unroll: int | None = None) -> list[int]:
    """The k-tile each producer step finds in the register set it decodes from, with the kernel's expressions: sets
    0 .. P-1 start with k-tiles 0 .. P-1; the loop walks nk in steps of UP = max(2, P) (or `unroll`); step `half` of
    a pass reads set half % P, then reloads it with k-tile min(kt + P, nk - 1)."""
    UP = max(2, P) if unroll is None else unroll
    sets = list(range(P))
    seen = []
    for kt2 in range(0, nk, UP):
        for half in range(UP):
            kt = kt2 + half
            rs = half % P
            seen.append(sets[rs])
            sets[rs] = min(kt + P, nk - 1)
    return seen


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("nk", [4, 8, 12, 48, 192])
def test_each_producer_step_decodes_its_own_k_tile(P, nk):
    """With nk a multiple of the unroll (the variant's K rule), step kt decodes exactly k-tile kt, loaded P steps
    earlier."""
    assert replay_producer(P, nk) == list(range(nk))


def test_the_replay_catches_a_rotation_that_does_not_divide_the_unroll():
    """Three sets in a loop unrolled by two: some step would decode another k-tile (the reason the kernel unrolls by
    max(2, prefetch) and the knob allows 1, 2 and 4 only)."""
    assert replay_producer(3, 12, unroll=2) != list(range(12))
    assert sm90.invalid_reason(ARCH, knobs(prefetch=3)) is not None


@pytest.mark.parametrize("schedule,prefetch,wsets,kmul", [
    ("ws", 4, 8, 512), ("ws", 4, 4, 256), ("ws", 2, 4, 256), ("ws", 2, 8, 512),
    ("ws_splitk4", 4, 4, 1024), ("ws_splitk4", 4, 8, 2048), ("ws_splitk2", 4, 4, 512)])
def test_k_multiple_follows_the_deepest_rotation(schedule, prefetch, wsets, kmul):
    """Both loops walk whole unrolled steps of max(2, prefetch, wsets) k-tiles of 64, per split-K rank."""
    k = knobs(schedule=schedule, prefetch=prefetch, wsets=wsets)
    assert sm90.invalid_reason(ARCH, k) is None
    assert sm90.requirements(ARCH, k)["k_multiple"] == kmul


@pytest.mark.parametrize("kw,words", [
    (dict(schedule="coop", wsets=2, tile_m=128), "producer warpgroup"),
    (dict(act_source="images", tile_m=256, wsets=2), "act_source images"),
    (dict(schedule="gemv", tile_m=16, tile_n=64, wsets=2, stages=4), "gemv"),
])
def test_four_activation_sets_only_where_a_producer_decodes_nvfp4(kw, words):
    why = sm90.invalid_reason(ARCH, knobs(**kw))
    assert why is not None and "prefetch 4" in why and words in why, why


"""The sm_90a ws schedule's trace-time bookkeeping, on the CPU: its mbarrier ring simulated step by step.

The kernel (kernel_src/sm90_wgmma_kernel.py) takes every ring index and parity from `sm90_plan.ring_slot`
and every split-K share from `sm90_plan.split_k_share`; here the same functions drive a model of the
producer warpgroup and the MMA warpgroups over many random interleavings.  An mbarrier is modelled as the
hardware keeps it: a phase counter that advances when the expected arrivals are in, and a parity wait that
passes while the current phase's parity differs from the one asked for (so a fresh barrier passes a wait for
parity 1).  Checked: no deadlock, every k-tile the MMA warps read is the one the producer wrote for them, and
the producer never rewrites a stage a wgmma may still read.
"""
from __future__ import annotations

import random

import pytest

from svdq_kernels.sm90_plan import ring_slot, split_k_share


class _Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.phase, self.pending = self.phase + 1, 0

    def passes(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def _producer(S, tiles, nk, full, empty, stage_of, in_use, producer_parity):
    for g in range(tiles * nk):
        s, par = ring_slot(g, S)
        while not empty[s].passes(producer_parity(par)):
            yield "wait"
        assert s not in in_use, f"producer rewrites stage {s} (k-tile {g}) while a wgmma may read it"
        stage_of[s] = g
        full[s].arrive()
        yield "step"


def _consumer(S, tiles, nk, full, empty, stage_of, in_use, seen):
    """The MMA warps as the kernel orders them: wait full, issue, wait_group(1), release the previous stage."""
    for t in range(tiles):
        g0 = t * nk
        for j in range(nk):
            g = g0 + j
            s, par = ring_slot(g, S)
            while not full[s].passes(par):
                yield "wait"
            assert stage_of[s] == g, f"k-tile {g} read stage {s} holding k-tile {stage_of[s]}"
            in_use.add(s)
            seen.append(g)
            if j > 0:                                   # wait_group(1): k-tile g-1 is done
                prev, _ = ring_slot(g - 1, S)
                in_use.discard(prev)
                empty[prev].arrive()
            yield "step"
        last, _ = ring_slot(g0 + nk - 1, S)             # wait_group(0) at the end of the tile
        in_use.discard(last)
        empty[last].arrive()
        yield "step"


def _run(S, tiles, nk, seed, producer_parity=lambda par: par ^ 1):
    full, empty = [_Barrier(1) for _ in range(S)], [_Barrier(1) for _ in range(S)]
    stage_of, in_use, seen = [None] * S, set(), []
    agents = [_producer(S, tiles, nk, full, empty, stage_of, in_use, producer_parity),
              _consumer(S, tiles, nk, full, empty, stage_of, in_use, seen)]
    rng = random.Random(seed)
    stalled = 0
    while agents:
        a = rng.choice(agents)
        try:
            what = next(a)
        except StopIteration:
            agents.remove(a)
            stalled = 0
            continue
        stalled = stalled + 1 if what == "wait" else 0
        if stalled > 200:
            raise RuntimeError("deadlock")
    return seen


@pytest.mark.parametrize("S", [3, 4])
@pytest.mark.parametrize("tiles, nk", [(1, 2), (3, 2), (2, 6), (4, 48), (2, 12)])
def test_ring_is_correct_under_any_interleaving(S, tiles, nk):
    for seed in range(40):
        assert _run(S, tiles, nk, seed) == list(range(tiles * nk))


def test_the_model_catches_a_wrong_producer_parity():
    """The pitfall the schedule avoids: a producer that waits for parity 0 on a fresh empty barrier hangs."""
    with pytest.raises(RuntimeError, match="deadlock"):
        _run(4, 2, 6, 0, producer_parity=lambda par: par)


def test_the_model_catches_a_producer_that_skips_the_empty_wait():
    """A parity no phase ever has (2) makes every wait pass: the producer overruns the MMA warps."""
    with pytest.raises(AssertionError, match="rewrites stage|read stage"):
        for seed in range(40):
            _run(3, 2, 12, seed, producer_parity=lambda par: 2)


@pytest.mark.parametrize("ks", [2, 4])
@pytest.mark.parametrize("num_kt", [8, 48, 192, 240])
def test_split_k_shares_cover_k_once_in_whole_pairs(ks, num_kt):
    """K % (128 * ks) == 0 (the variant's k_multiple) gives every rank the same even number of k-tiles, and the
    ranks' shares tile [0, num_kt) exactly once."""
    assert num_kt % (2 * ks) == 0
    covered = []
    for rank in range(ks):
        first, nk = split_k_share(rank, num_kt, ks)
        assert nk % 2 == 0 and nk == num_kt // ks
        covered += range(first, first + nk)
    assert covered == list(range(num_kt))

"""The sm_90a ws schedule's trace-time bookkeeping, on the CPU: its mbarrier ring simulated step by step.

The kernel (kernel_src/sm90_wgmma_kernel.py) takes every ring index and parity from `sm90_plan.ring_slot`
(or, in the ``SVDQ_KERNEL_SM90_RING=step`` build, from `ring_step` / `ring_in_step` / `ring_prev_stage`, which must
give the same values) and every split-K share from `sm90_plan.split_k_share`; here the same functions drive a model of the
producer warpgroup and the MMA warpgroups over many random interleavings.  An mbarrier is modelled as the
hardware keeps it: a phase counter that advances when the expected arrivals are in, and a parity wait that
passes while the current phase's parity differs from the one asked for (so a fresh barrier passes a wait for
parity 1).  Checked: no deadlock, every k-tile the MMA warps read is the one the producer wrote for them, and
the producer never rewrites a stage a wgmma may still read.
"""
from __future__ import annotations

import random

import pytest

from svdq_kernels.sm90_plan import (ring_aligned, ring_in_step, ring_prev_stage, ring_slot, ring_step,
                                    split_k_share)


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


def _step_slots(S, U, gs):
    """The `step` build's bookkeeping of one unrolled step starting at k-tile gs: per u, (stage, parity, stage of
    k-tile gs + u - 1), as the kernel derives them (one `ring_step` per step)."""
    base = ring_step(gs, S)
    out = []
    for u in range(U):
        stage, par = ring_in_step(base, u, S, U)
        prev = ring_in_step(base, u - 1, S, U)[0] if u > 0 else ring_prev_stage(base, S, U)
        out.append((stage, par, prev))
    return out


def _consumer(S, tiles, nk, full, empty, stage_of, in_use, seen, unroll=None):
    """The MMA warps as the kernel orders them: wait full, issue, wait_group(1), release the previous stage.
    `unroll`: take the stages as the ``step`` build does, once per unrolled step of that many k-tiles."""
    for t in range(tiles):
        g0 = t * nk
        for j in range(nk):
            g = g0 + j
            if unroll is None:
                s, par = ring_slot(g, S)
                prev = ring_slot(g - 1, S)[0]
            else:
                s, par, prev = _step_slots(S, unroll, g - j % unroll)[j % unroll]
            while not full[s].passes(par):
                yield "wait"
            assert stage_of[s] == g, f"k-tile {g} read stage {s} holding k-tile {stage_of[s]}"
            in_use.add(s)
            seen.append(g)
            if j > 0:                                   # wait_group(1): k-tile g-1 is done
                in_use.discard(prev)
                empty[prev].arrive()
            yield "step"
        last, _ = ring_slot(g0 + nk - 1, S)             # wait_group(0) at the end of the tile
        in_use.discard(last)
        empty[last].arrive()
        yield "step"


def _run(S, tiles, nk, seed, producer_parity=lambda par: par ^ 1, unroll=None):
    full, empty = [_Barrier(1) for _ in range(S)], [_Barrier(1) for _ in range(S)]
    stage_of, in_use, seen = [None] * S, set(), []
    agents = [_producer(S, tiles, nk, full, empty, stage_of, in_use, producer_parity),
              _consumer(S, tiles, nk, full, empty, stage_of, in_use, seen, unroll)]
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


@pytest.mark.parametrize("S, U", [(4, 2), (4, 4), (4, 8), (8, 2), (3, 3), (6, 2), (6, 3), (12, 4), (8, 8)])
@pytest.mark.parametrize("tiles, nk", [(1, 24), (3, 24), (2, 48)])
def test_the_step_bookkeeping_runs_the_ring_under_any_interleaving(S, U, tiles, nk):
    """The ``step`` build's MMA warps (stages taken once per unrolled step) in the same model: every k-tile read
    from the stage the producer wrote it to, no deadlock, no stage rewritten while a wgmma may read it."""
    assert ring_aligned(S, U) and nk % U == 0
    for seed in range(20):
        assert _run(S, tiles, nk, seed, unroll=U) == list(range(tiles * nk))


@pytest.mark.parametrize("S", [3, 4, 6, 8, 12])
@pytest.mark.parametrize("U", [1, 2, 3, 4, 8])
def test_the_step_bookkeeping_equals_ring_slot(S, U):
    """For every step start gs (a multiple of U: whole loop steps per tile, split-K share and stream-K segment)
    over many turns of the ring: `ring_step` is `ring_slot`, each k-tile's (stage, parity) from `ring_in_step` is
    `ring_slot(gs + u)`, and `ring_prev_stage` is the stage of k-tile gs - 1, wherever the ring and the step line
    up (`ring_aligned`); elsewhere both give None and the kernel keeps `ring_slot`."""
    aligned = U % S == 0 or S % U == 0
    assert ring_aligned(S, U) == aligned
    for gs in range(0, 40 * S * U, U):
        base = ring_step(gs, S)
        assert base == ring_slot(gs, S)
        prev = ring_prev_stage(base, S, U)
        for u in range(U):
            got = ring_in_step(base, u, S, U)
            assert got == (ring_slot(gs + u, S) if aligned else None), (S, U, gs, u)
        if aligned:
            assert prev == ring_slot(gs - 1, S)[0] if gs else prev in range(S)
            if U % S == 0:      # the stage is a trace-time constant: the run-time base stage is never read
                assert [ring_in_step((None, base[1]), u, S, U)[0] for u in range(U)] == [u % S for u in range(U)]
        else:
            assert prev is None


def test_the_step_bookkeeping_needs_whole_steps():
    """A step start that is not a multiple of the unroll breaks the constant stages: the tests above hold only
    because every segment is whole steps, which this shows is load-bearing."""
    S, U, gs = 4, 8, 2
    base = ring_step(gs, S)
    assert ring_in_step(base, 0, S, U) != ring_slot(gs, S)


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

"""`quantize_act`'s launch schedule (`ops.quantize_act.schedule`) and the range form's arithmetic, on the CPU.

The range form (ksplit 1) gives CTA b of G the units [range_start(b), range_start(b + 1)) of the U = tiles x
(K / 64) (row tile, step) units; a tile split over several CTAs adds their LoRA sums in the workspace, counted
on its first CTA's word, each CTA writing the slot of its range's first (0) or last (1) tile.  The kernel calls
the same `range_start` / `cta_of_unit` / `workspace_counter_bytes` on its traced integers; here they are
replayed with Python ints, CTA by CTA, the way the kernel walks its tiles.
"""
from __future__ import annotations

import random

import pytest

from svdq_loader.ops import quantize_act as qop
from svdq_loader.ops import ranges as R


def _walk(tiles: int, steps: int, ctas: int):
    """What every CTA of a range launch does, as the kernel computes it: {cta: [(tile, lo, hi), ...]}."""
    units = tiles * steps
    out = {}
    for b in range(ctas):
        u0, u1 = R.range_start(b, units, ctas), R.range_start(b + 1, units, ctas)
        t_a = u0 // steps
        t_b = (u1 - 1) // steps if u1 > u0 else t_a - 1
        out[b] = [(t, max(u0 - t * steps, 0), min(u1 - t * steps, steps)) for t in range(t_a, t_b + 1)]
    return out


CASES = [(1, 1, 1), (1, 48, 7), (16, 48, 396), (16, 240, 396), (288, 48, 396), (288, 192, 396), (289, 48, 396),
         (576, 48, 792), (72, 3, 100), (5, 1, 5), (64, 2, 127), (1152, 240, 1188)]


@pytest.mark.parametrize("tiles,steps,ctas", CASES)
def test_every_unit_once_and_two_tiles_at_most(tiles, steps, ctas):
    ctas = min(ctas, tiles * steps)
    seen = [[0] * steps for _ in range(tiles)]
    for b, segs in _walk(tiles, steps, ctas).items():
        assert segs, f"CTA {b} of {ctas} has no units ({tiles} tiles x {steps} steps)"
        if ctas >= tiles:
            assert len(segs) <= 2, (b, segs)          # the kernel walks at most two tiles (it traps on more)
        for t, lo, hi in segs:
            assert 0 <= lo < hi <= steps
            for s in range(lo, hi):
                seen[t][s] += 1
    assert all(c == 1 for row in seen for c in row)


@pytest.mark.parametrize("tiles,steps,ctas", CASES)
def test_meeting_points(tiles, steps, ctas):
    """A split tile's CTAs are exactly cta_of_unit(first unit) .. cta_of_unit(last unit); their counter words
    (the first CTA's) and slots never collide; the reader finds each CTA's slot the way the writer chose it."""
    ctas = min(ctas, tiles * steps, max(tiles, ctas))
    units = tiles * steps
    walk = _walk(tiles, steps, ctas)
    owners = {}
    for b, segs in walk.items():
        for t, lo, hi in segs:
            owners.setdefault(t, []).append((b, lo, hi))
    counters, slots = set(), set()
    for t, parts in owners.items():
        b_first = R.cta_of_unit(t * steps, units, ctas)
        b_last = R.cta_of_unit(t * steps + steps - 1, units, ctas)
        assert [b for b, _, _ in parts] == list(range(b_first, b_last + 1))
        if len(parts) == 1:
            assert parts[0][1:] == (0, steps)          # whole: stored directly, no counter, no slot
            continue
        assert b_first not in counters
        counters.add(b_first)
        for b, lo, hi in parts:
            first_tile = walk[b][0][0]
            written = (b, int(t != first_tile))                     # the writer: its range's first tile or not
            read = (b, int(R.range_start(b, units, ctas) // steps != t))   # the reader's rule
            assert written == read and written not in slots
            slots.add(written)


def test_workspace_layout():
    for ctas in (1, 31, 32, 33, 396, 1188):
        c = R.workspace_counter_bytes(ctas)
        assert c >= 8 * ctas and c % 256 == 0 and c - 8 * ctas < 256
        assert qop.workspace_bytes(ctas, 16, 32) == c + ctas * 2 * 16 * 32 * 4
        assert qop.workspace_bytes(ctas, 16, 0) == 0


# H200: 132 SMs, 3 resident CTAs per SM at R = 32 (149 registers), 4 without LoRA (115)
@pytest.mark.parametrize("m,k,rank,want", [
    (4608, 3072, 32, (1, 288)), (4608, 12288, 32, (1, 396)), (4608, 15360, 32, (1, 396)),     # range at K >= 8192
    (9216, 12288, 32, (2, 1152)), (9216, 3072, 32, (1, 576)), (18432, 15360, 32, (1, 1152)),   # cluster rule
    (1024, 3072, 32, (4, 256)), (256, 15360, 32, (8, 128)), (16, 3072, 32, (4, 4)),
    (4608, 3072, 0, (1, 528)), (4608, 15360, 0, (1, 528)), (9216, 3072, 0, (1, 1056)),       # range from M = 256
    (18432, 12288, 0, (1, 1584)), (1024, 15360, 0, (1, 528)), (256, 3072, 0, (1, 528)),
    (240, 3072, 0, (8, 120)), (16, 15360, 0, (8, 8)),                                       # cluster below
])
def test_measured_points(m, k, rank, want):
    ks, ctas, ws = qop.schedule(m, k, rank, 132, 3 if rank else 4, 16, False)
    assert (ks, ctas) == want
    assert ws == (qop.workspace_bytes(ctas, 16, rank) if ks == 1 and ctas > -(-m // 16) else 0)


# H100 (session 36, CUDA-graph timing), rank 32 with the driver's cluster counts: at K >= 8192 the range form where
# a 2-CTA split would leave over a quarter of the resident CTAs idle (M = 1792 / 2048: up to 17 % faster), the
# split where it fills them (M = 2560 / 3072: 4-10 % faster than the range form); K = 3072 keeps the split
@pytest.mark.parametrize("m,k,want", [
    (1536, 12288, (2, 192)), (1536, 3072, (2, 192)), (1792, 12288, (1, 396)), (1792, 15360, (1, 396)),
    (2048, 15360, (1, 396)), (2048, 3072, (2, 256)), (1280, 15360, (4, 320)), (768, 3072, (4, 192)),
    (2560, 12288, (2, 320)), (3072, 15360, (2, 384)), (3584, 12288, (1, 396)), (3584, 3072, (1, 224)),
])
def test_measured_points_h100(m, k, want):
    ks, ctas, ws = qop.schedule(m, k, 32, 132, 3, 16, False, ((2, 198), (4, 92), (8, 45)))
    assert (ks, ctas) == want
    assert ws == (qop.workspace_bytes(ctas, 16, 32) if ks == 1 and ctas > -(-m // 16) else 0)


def test_schedule_bounds():
    rng = random.Random(5)
    for _ in range(3000):
        m, k = rng.choice([1, 17, 255, 256, 1000, 4608, rng.randrange(1, 1 << 16)]), 64 * rng.randrange(1, 300)
        rank, sms, res = rng.choice([0, 16, 32, 128]), rng.choice([1, 20, 132, 148]), rng.randrange(0, 9)
        rows, blocked = rng.choice([16, 32]), rng.random() < 0.5
        ks, ctas, ws = qop.schedule(m, k, rank, sms, res, rows, blocked)
        rows_total = -(-m // 128) * 128 if blocked else m        # stated here, not taken from qop.tile_count
        tiles = -(-rows_total // rows)
        if ks > 1:
            assert ctas == tiles * ks and ws == 0
        else:
            assert tiles <= ctas <= max(tiles, tiles * (k // 64)), (m, k, rank, ctas)
            assert ws == (qop.workspace_bytes(ctas, rows, rank) if ctas > tiles else 0)
        assert ctas <= (1 << 20) or ks == 1 and ctas == tiles     # the recipe's box for ctas


def test_host_arguments():
    args = dict(qop.SPEC.host_args)
    assert args["ctas"] == "i32" and args["workspace"] == "ptr"
    names = qop.SPEC.arg_names
    assert names[qop.CTAS_INDEX] == "ctas" and names[qop.WORKSPACE_INDEX] == "workspace"


class _Inner:
    """A kernel launcher stand-in: records the arguments of each launch."""

    def __init__(self):
        self.name, self.kernels, self.launched = "q", {"q_0": 1}, []
        self.device = self

    ordinal = 0

    def resident_blocks(self, sym, threads, smem):
        assert (sym, threads, smem) == ("q_0", 128, 41472)
        return 3

    def resident_clusters(self, sym, threads, smem, cluster):
        assert (sym, threads, smem) == ("q_0", 128, 41472)
        return {2: 198, 4: 92, 8: 45}[cluster]          # an H100's count at rank 32 (session 36)

    def launch(self, args):
        self.launched.append(list(args))


class _Entry:
    def __init__(self, rank):
        self.knobs = dict(dtype="bf16", rank=rank, scale_layout="logical", warps=4, mtiles=1)
        self.smem_bytes = 41472


@pytest.mark.parametrize("m,k,rank", [(4608, 12288, 32), (4608, 3072, 32), (4608, 3072, 0), (64, 3072, 32),
                                     (1536, 3072, 32)])
def test_launcher_fills_the_schedule(monkeypatch, m, k, rank):
    """QuantizeLauncher asks the driver once (SM count, resident CTAs, resident clusters of 2 / 4 / 8), then per
    call writes ksplit, ctas and the workspace pointer the schedule asks for into the arguments, a workspace only
    where tiles are split."""
    from svdq_loader import driver
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: 132 if attr == 16 else 0)
    inner, allocs = _Inner(), []

    class _Buf:
        def __init__(self, n):
            self.n = n

        def data_ptr(self):
            return 0x7000_0000

    monkeypatch.setattr(qop.QuantizeLauncher, "_alloc", lambda self, n: allocs.append(n) or _Buf(n))
    ql = qop.QuantizeLauncher(inner, _Entry(rank))
    assert ql._grid == (132, 3) and ql._clusters == ((2, 198), (4, 92), (8, 45))
    args = [1, 2, 3, 4, 5, 6, 0, m, k, 1, 1, 1, 9]
    ql.launch(args)
    ks, ctas, ws = qop.schedule(m, k, rank, 132, 3, 16, False, ql._clusters)
    if (m, k) == (1536, 3072):
        assert (ks, ctas) == (2, 192)          # 96 clusters of 4 would not all fit
    got = inner.launched[-1]
    assert (got[qop.KSPLIT_INDEX], got[qop.CTAS_INDEX]) == (ks, ctas)
    assert got[qop.WORKSPACE_INDEX] == (0x7000_0000 if ws else 0) and allocs == ([ws] if ws else [])
    assert got[:6] == [1, 2, 3, 4, 5, 6] and got[qop.STREAM_INDEX] == 9


def test_launcher_without_cluster_counts(monkeypatch):
    """Where the driver cannot count resident clusters, the launcher still launches: the split then counts every
    resident CTA (the schedule without `clusters`)."""
    from svdq_loader import driver
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: 132 if attr == 16 else 0)
    inner = _Inner()

    def no_count(sym, threads, smem, cluster):
        raise driver.CudaError("cuOccupancyMaxActiveClusters(cluster 2) failed: CUDA_ERROR_NOT_SUPPORTED (801)")

    inner.resident_clusters = no_count
    ql = qop.QuantizeLauncher(inner, _Entry(32))
    assert ql._clusters is None
    ql.launch([1, 2, 3, 4, 5, 6, 0, 1536, 3072, 1, 1, 1, 9])
    got = inner.launched[-1]
    assert (got[qop.KSPLIT_INDEX], got[qop.CTAS_INDEX]) == (4, 384) == qop.schedule(1536, 3072, 32, 132, 3, 16,
                                                                                     False)[:2]


def test_per_call_workspace(monkeypatch):
    """Both workspace-taking launchers share `PerCallWorkspace._alloc`: uint8 bytes on the launcher's device
    ordinal, from torch.empty (the caching allocator), with the allocating function made once."""
    from svdq_loader.ops import decode_act, workspace
    calls = []

    class _Torch:
        uint8 = "u8"

        @staticmethod
        def device(kind, ordinal):
            calls.append(("device", kind, ordinal))
            return f"{kind}:{ordinal}"

        @staticmethod
        def empty(n, dtype, device):
            calls.append(("empty", n, dtype, device))
            return n

    monkeypatch.setattr(workspace, "torch_module", lambda: _Torch)
    assert issubclass(qop.QuantizeLauncher, workspace.PerCallWorkspace)
    assert issubclass(decode_act.ImagesLauncher, workspace.PerCallWorkspace)

    class _L(workspace.PerCallWorkspace):
        device = type("D", (), {"ordinal": 3})()

    ln = _L()
    assert ln._alloc(100) == 100 and ln._alloc(7) == 7
    assert calls == [("device", "cuda", 3), ("empty", 100, "u8", "cuda:3"), ("empty", 7, "u8", "cuda:3")]

"""The sm_90a GEMM's paired output store, replayed on the CPU (kernel_src/sm90_epilogue_ptx.py).

Both sm_90a forms hold Yᵀ in MMA accumulators; the epilogue packs each accumulator pair into a 16-bit pair, transposes
8 x 8 blocks of those across the warp with ``movmatrix.trans`` and stores 32-bit words.  This test models the two
hardware facts independently of the kernel code -- the accumulator layout of wgmma (m64nNk16) and mma.sync
(m16n8k16) as the PTX ISA states it, and movmatrix's transpose -- and checks that the kernels' block list
(``pair_blocks``) and store target (``pair_target``) put every value of Yᵀ at its place of the row-major output,
each element exactly once, rows >= M never.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("cutlass")
from svdq_kernels.sm90_epilogue_ptx import pair_blocks, pair_target, quad_target   # noqa: E402


def accumulator_coord(warp_rows0: int, lane: int, i: int, tile_m: int) -> tuple[int, int]:
    """(n, m) of accumulator i of `lane`, relative to the tile: the C fragment of wgmma m64nN (per 64-row atom a of
    the warp's warpgroup, register i = a·N/2 + 4j + 2h + e) and of mma.sync m16n8 (one atom, j = the n8 block):
    row = 16·warp + 8h + lane // 4 (+ 128a: the warpgroup's atoms are 128 rows apart in our tiles), column =
    8j + 2·(lane % 4) + e."""
    per_atom = tile_m // 2
    a, r = divmod(i, per_atom)
    j, q = divmod(r, 4)
    h, e = divmod(q, 2)
    return warp_rows0 + 128 * a + 8 * h + lane // 4, 8 * j + 2 * (lane % 4) + e


def movmatrix_trans(words: list[tuple]) -> list[tuple]:
    """movmatrix.sync.aligned.m8n8.trans.b16: lane L holds row L // 4, columns 2·(L % 4) and + 1 of an 8 x 8 matrix
    of 16-bit values; afterwards it holds the same positions of the transpose."""
    mat = {}
    for lane, (lo, hi) in enumerate(words):
        mat[lane // 4, 2 * (lane % 4)] = lo
        mat[lane // 4, 2 * (lane % 4) + 1] = hi
    return [(mat[2 * (lane % 4), lane // 4], mat[2 * (lane % 4) + 1, lane // 4]) for lane in range(32)]


def replay(atoms: int, tile_m: int, warp_rows0: int, n_warp: int, m0: int, m: int) -> dict:
    """Every store one warp makes: {(row, col): value}, value = the (n, m) of Yᵀ it came from."""
    nacc = atoms * tile_m // 2
    acc = [[accumulator_coord(warp_rows0, lane, i, tile_m) for i in range(nacc)] for lane in range(32)]
    out = {}
    for i, mb, nb in pair_blocks(atoms, tile_m):
        assert i % 2 == 0 and i + 1 < nacc
        moved = movmatrix_trans([(acc[lane][i], acc[lane][i + 1]) for lane in range(32)])
        for lane in range(32):
            row, col = pair_target(m0, mb, nb, n_warp, lane)
            if row >= m:
                continue
            for e in range(2):
                assert (row, col + e) not in out, "an output element written twice"
                out[row, col + e] = moved[lane][e]
    return out


def replay_quads(atoms: int, tile_m: int, warp_rows0: int, n_warp: int, m0: int, m: int) -> dict:
    """The quad store (``SVDQ_KERNEL_SM90_STORE=quads``), modelled from its PTX: per block, the h = 0 and h = 1 words
    are transposed; ``shfl.sync.bfly`` by 1 hands lane L what lane L ^ 1 sent (an odd lane sends its h = 0 word, an
    even lane its h = 1 word); lo = odd ? received : own h = 0, hi = odd ? own h = 1 : received; one 64-bit store
    of (lo, hi) -- four 16-bit values -- at ``quad_target``."""
    nacc = atoms * tile_m // 2
    acc = [[accumulator_coord(warp_rows0, lane, i, tile_m) for i in range(nacc)] for lane in range(32)]
    out = {}
    for i, mb, nb in pair_blocks(atoms, tile_m):
        if (i // 2) % 2:
            continue
        w0 = movmatrix_trans([(acc[lane][i], acc[lane][i + 1]) for lane in range(32)])
        w1 = movmatrix_trans([(acc[lane][i + 2], acc[lane][i + 3]) for lane in range(32)])
        sent = [w0[lane] if lane % 2 else w1[lane] for lane in range(32)]
        for lane in range(32):
            got = sent[lane ^ 1]
            lo, hi = (got, w1[lane]) if lane % 2 else (w0[lane], got)
            row, col = quad_target(m0, mb, nb, n_warp, lane)
            if row >= m:
                continue
            for e, v in enumerate(lo + hi):
                assert (row, col + e) not in out, "an output element written twice"
                out[row, col + e] = v
    return out


@pytest.mark.parametrize("atoms,tile_m", [(1, 256), (1, 224), (1, 216), (1, 128), (1, 64), (1, 16), (2, 128)])
@pytest.mark.parametrize("m_rows", ["full", "tail"])
@pytest.mark.parametrize("form", [replay, replay_quads])
def test_every_value_lands_at_its_output_element_once(atoms, tile_m, m_rows, form):
    m0 = 3 * tile_m
    m = m0 + (tile_m if m_rows == "full" else tile_m // 2 - 3)
    for wg, warp in itertools.product(range(2), range(4)):     # the wgmma tiles' 2 warpgroups x 4 warps
        rows0 = 64 * wg + 16 * warp                             # the warp's first weight row within the tile
        n0 = 5 * 128
        out = form(atoms, tile_m, rows0, n0 + rows0, m0, m)
        # the tile-relative (n, m) of Yᵀ stored at output (row, col) is (col - n0, row - m0)
        for (row, col), (yn, ym) in out.items():
            assert (yn, ym) == (col - n0, row - m0), ((row, col), (yn, ym))
        want = {(m0 + j, n0 + rows0 + 128 * a + r) for a in range(atoms) for r in range(16)
                for j in range(min(tile_m, m - m0))}
        assert set(out) == want


def test_a_quad_store_fills_whole_sectors():
    """Each lane's 64-bit store is 8-byte aligned, and one warp's store of a block covers, per output row, 32
    contiguous bytes starting at a multiple of 32 (whole sectors) when the warp's first column is a multiple of 16."""
    for mb, nb in [(0, 0), (8, 0), (0, 128)]:
        rows: dict = {}
        for lane in range(32):
            row, col = quad_target(0, mb, nb, 16 * 5, lane)
            assert col % 4 == 0
            rows.setdefault(row, set()).update(range(col, col + 4))
        assert len(rows) == 8
        for cols in rows.values():
            assert len(cols) == 16 and min(cols) % 16 == 0 and max(cols) == min(cols) + 15


def test_the_block_list_covers_every_accumulator_once():
    for atoms, tile_m in [(1, 256), (1, 224), (1, 16), (2, 64)]:
        firsts = [i for i, _, _ in pair_blocks(atoms, tile_m)]
        covered = sorted(firsts + [i + 1 for i in firsts])
        assert covered == list(range(atoms * tile_m // 2))


def test_a_wrong_layout_model_is_caught():
    """The replay can fail: with the row halves of the layout swapped, values land on the wrong elements."""
    atoms, tile_m, m0 = 1, 16, 0
    blocks = [(i, mb, 8 - nb) for i, mb, nb in pair_blocks(atoms, tile_m)]      # h = 0 <-> h = 1
    acc = [[accumulator_coord(0, lane, i, tile_m) for i in range(8)] for lane in range(32)]
    wrong = 0
    for i, mb, nb in blocks:
        moved = movmatrix_trans([(acc[lane][i], acc[lane][i + 1]) for lane in range(32)])
        for lane in range(32):
            row, col = pair_target(m0, mb, nb, 0, lane)
            wrong += moved[lane][0] != (col, row)
    assert wrong == len(blocks) * 32


@pytest.mark.parametrize("wgs,atoms,tile_m", [(2, 1, 208), (2, 2, 128), (3, 1, 128)])
def test_the_warpgroups_of_a_tile_store_it_whole_and_once(wgs, atoms, tile_m):
    """All MMA warps of one tile together (two warpgroups, or three at tile_n 192): every element of the
    (64 · wgs · atoms) x tile_m tile is stored by exactly one thread, and the kernel's own output rows of each thread
    (``_rows_out``, used for wcscale and bias) are the rows its accumulators hold."""
    from types import SimpleNamespace

    from svdq_kernels.sm90_wgmma_kernel import _Sm90Wgmma
    m0, n0 = 2 * tile_m, 7 * 64 * wgs * atoms
    m = m0 + tile_m
    seen: dict = {}
    fake = SimpleNamespace(atoms=atoms, mwg=wgs)
    for wg, warp in itertools.product(range(wgs), range(4)):
        rows0 = 64 * wg + 16 * warp
        out = replay(atoms, tile_m, rows0, n0 + rows0, m0, m)
        for key in out:
            assert key not in seen, ("stored twice", key)
            seen[key] = (wg, warp)
        for lane in range(32):
            tidx = 128 * wg + 32 * warp + lane
            rows = _Sm90Wgmma._rows_out(fake, n0, tidx, wg)      # (atom a, half h) -> row
            for a, h in itertools.product(range(atoms), range(2)):
                # accumulator 4j + 2h + e of atom a sits in weight row rows0 + 8h + lane // 4 (+ 64 · wgs · a)
                n_rel, _ = accumulator_coord(rows0, lane, a * (tile_m // 2) + 2 * h, tile_m)
                assert rows[2 * a + h] == n0 + n_rel
    assert set(seen) == {(m0 + j, n0 + r) for j in range(tile_m) for r in range(64 * wgs * atoms)}


def test_the_bulk_store_experiment_plans_its_staged_tile(monkeypatch):
    """``SVDQ_KERNEL_SM90_STORE=bulk`` (an experiment): only the unsplit ws tiles of 208 rows and more stage their
    output, in rows of tile_n * 2 + 16 bytes placed after everything else the plan holds, within an sm_90 CTA's
    SMEM; and a warp's quad store into those rows (8 rows x 32 bytes) touches every bank exactly twice, the two
    wavefronts 256 bytes need at least."""
    from svdq_kernels import sm90_plan as plan
    monkeypatch.setattr(plan, "STORE", "bulk")
    cfg = plan._Cfg(rank=32, out_dtype="bf16", wcscale=True, bias=True, tile_m=216, tile_n=128, stages=4,
                    schedule="ws", wsets=4, act_source="images")
    assert plan.bulk_store(cfg)
    assert not plan.bulk_store(dataclasses.replace(cfg, schedule="ws_splitk2"))
    assert not plan.bulk_store(dataclasses.replace(cfg, tile_m=128))
    assert not plan.bulk_store(dataclasses.replace(cfg, tile_m=128, tile_n=plan.WIDE_TILE_N))
    sp = plan._smem_plan(cfg)
    rows = cfg.tile_m * plan.out_row_bytes(cfg)
    assert sp["out_offset"] % 128 == 0 and sp["out_offset"] >= sp["meet_offset"]
    assert sp["out_offset"] + rows <= sp["total_bytes"] <= plan.SMEM_LIMIT_BYTES
    monkeypatch.setattr(plan, "STORE", "quads")
    assert not plan.bulk_store(cfg) and plan._smem_plan(cfg)["total_bytes"] < sp["total_bytes"] - rows + 1024
    rb = plan.out_row_bytes(cfg)
    for mb, nb, nw in [(0, 0, 0), (8, 0, 48), (16, 128, 112)]:
        banks: dict = {}
        for lane in range(32):
            row, col = quad_target(0, mb, nb, nw, lane)
            addr = row * rb + col * 2
            assert addr % 8 == 0
            for word in (addr // 4, addr // 4 + 1):
                banks[word % 32] = banks.get(word % 32, 0) + 1
        assert sorted(banks) == list(range(32)) and set(banks.values()) == {2}

"""The sm_90a GEMM's stream-K schedule (``ws_streamk``): its units, grid and workspace, one home for the kernel
(which applies these to its traced integers), the loader and the tests (Python ints).

Why: at M <= 256 a warp-specialised tile walks all K / 64 k-tiles of its tile on one SM, and N / tile_n tiles
leave SMs idle (M = 64, N = 12288: 96 tiles of 64 x 128 on 132 SMs; N = 9216: 72).  The call then lasts one tile's
walk however many SMs work (docs/PERF.md, session 17).  Stream-K gives every SM an equal share of the whole
problem instead.

* A **unit** is one tile's group of `unroll` consecutive k-tiles (the MMA warps' main loop is unrolled by that
  many, so a CTA's share of a tile is whole loop steps): unit u = tile * units_per_tile + j.
* **Grid**: G = min(units, SMs) CTAs, CTA b takes the units [range_start(b), range_start(b + 1))
  (`svdq_loader.ops.ranges`, which also holds the slot and workspace layout), tile by tile: its *segments*.
  A segment that is a whole tile ends as in ``ws``.
* A **split tile** (its units in several CTAs' ranges) *meets*: each of its CTAs writes its fp32 partial
  accumulators to its own slot, and counts one arrival on the tile's counter (its first CTA's word); the last to
  arrive adds every slot in CTA order (the same sum whoever is last), then runs the epilogue (wcscale, LoRA, bias,
  store) and writes the counter back to 0.  No CTA waits for another, so the grid needs no co-residency.
* **Workspace**: the meetings' counters and slots (`workspace_bytes`) follow the stage images in the call's
  decode_act workspace (``ws_streamk`` is an ``act_source`` images schedule), at byte offset
  ``image_bytes(M, K)``: the kernel finds them from M and K, so the op's arguments do not change.  Slot ``2 b + e``
  of CTA b (e = 0: the first tile of its range, 1: its last) holds ``tile_m * tile_n`` fp32, thread t of the MMA
  warpgroups' 16-byte vector i at ``(i * mma_threads + t) * 16``.
"""
from __future__ import annotations

from . import ranges

#: k per k-tile of the sm_90a GEMM in the exact mode (the FP8-compute mode's k-tiles are 128 k: a variant's
#: ``tile_k`` knob)
K_TILE = 64


def loop_unroll(wsets: int, prefetch: int) -> int:
    """k-tiles per unrolled step of a ws kernel's main loops (the one statement of the rule; ``sm90_plan.k_unroll``
    applies it to a variant): two (the weight fragments' double buffer), or the deepest register rotation, the MMA
    warps' raw weight sets or the producer's raw activation sets."""
    return max(2, wsets, prefetch)


def units_per_tile(k: int, unroll: int, k_tile: int = K_TILE) -> int:
    """A tile's units: its K / k_tile k-tiles in groups of `unroll` (the variant's K rule makes this exact)."""
    return k // (k_tile * unroll)


def tile_count(m: int, n: int, tile_m: int, tile_n: int) -> int:
    return -(-m // tile_m) * (n // tile_n)


def units(m: int, n: int, k: int, tile_m: int, tile_n: int, unroll: int, k_tile: int = K_TILE) -> int:
    return tile_count(m, n, tile_m, tile_n) * units_per_tile(k, unroll, k_tile)


def grid(total_units: int, sm_count: int) -> int:
    """CTAs of a launch: one per SM (the MMA warps' registers hold one CTA per SM), at most one per unit."""
    return max(1, min(total_units, sm_count))


def segment(tile, u0, u1, upt, unroll, maximum=max, minimum=min):
    """CTA [u0, u1)'s segment of `tile`: (first k-tile, k-tiles, ring index of its first k-tile), for a tile its
    range touches.  The ring index counts the CTA's k-tiles from the start of its range (its producer and MMA
    warps share one stage ring).  `maximum` / `minimum`: the kernel passes the DSL's, on its traced integers."""
    lo = maximum(u0 - tile * upt, 0)
    hi = minimum(u1 - tile * upt, upt)
    return lo * unroll, (hi - lo) * unroll, (tile * upt + lo - u0) * unroll


def slot_bytes(tile_m: int, tile_n: int) -> int:
    return tile_m * tile_n * 4


def workspace_bytes(ctas: int, tile_m: int, tile_n: int) -> int:
    """Bytes of the meetings' workspace of a `ctas`-CTA launch (`ranges.workspace_bytes`)."""
    return ranges.workspace_bytes(ctas, slot_bytes(tile_m, tile_n))


def workspace_bytes_for(knobs):
    """The extra workspace bytes of a ``ws_streamk`` variant's call, as a function of (m, n, k, sm_count)."""
    tm, tn, tk = int(knobs["tile_m"]), int(knobs["tile_n"]), int(knobs.get("tile_k", K_TILE))
    unroll = loop_unroll(int(knobs["wsets"]), int(knobs["prefetch"]))

    def extra(m: int, n: int, k: int, sm_count: int) -> int:
        return workspace_bytes(grid(units(m, n, k, tm, tn, unroll, tk), sm_count), tm, tn)
    return extra


__all__ = ["K_TILE", "loop_unroll", "units_per_tile", "tile_count", "units", "grid", "segment", "slot_bytes",
           "workspace_bytes", "workspace_bytes_for"]

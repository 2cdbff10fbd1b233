"""Equal ranges of work units over a grid of CTAs, and the counters with which the CTAs that share a split tile
meet: one home for the kernels that split tiles this way (``quantize_act``'s range form, the sm_90a GEMM's
``ws_streamk`` schedule), which call these on their traced 64-bit integers, and for the loader and the tests, which
call them on Python ints.

Units are numbered tile by tile: unit u = tile * units_per_tile + j.  CTA b of G takes [range_start(b),
range_start(b + 1)), so the ranges differ by at most one unit.  A tile whose units fall in the ranges of several
CTAs is *split*: each of them leaves its partial sums in its own workspace slot and counts one arrival on the
tile's counter (the word of the tile's first CTA, ``cta_of_unit``); the last to arrive adds every slot in CTA order
(the same sum whichever CTA is last) and finishes the tile.
"""
from __future__ import annotations


def range_start(b, units, ctas):
    """First unit of CTA b's range [range_start(b), range_start(b + 1))."""
    return b * units // ctas


def cta_of_unit(u, units, ctas):
    """The CTA whose range holds unit u (the largest b with range_start(b) <= u)."""
    return ((u + 1) * ctas - 1) // units


def workspace_counter_bytes(ctas):
    """Bytes of a workspace's counter words (one 64-bit word per CTA; a split tile counts on its first CTA's
    word), rounded up to 256.  The partial-sum slots follow them: slot ``2 b + e`` of CTA b (e = 0: the first tile
    of its range, 1: the last; a CTA has partial sums of at most those two)."""
    return (ctas * 8 + 255) // 256 * 256


def slot_index(b, tile, first_tile, integer=int):
    """Slot of CTA b's partial sums of `tile` (its range begins in `first_tile`): 2b for the range's first tile,
    2b + 1 for its last (the only two tiles of a range that can be split).  `integer`: the GEMM's stream-K kernel
    passes the DSL's 64-bit integer type (quantize_act's kernel writes the same rule inline)."""
    return integer(b) * 2 + integer(tile != first_tile)


def workspace_bytes(ctas, slot_bytes):
    """Bytes of the workspace of a `ctas`-CTA launch whose slots hold `slot_bytes` each: the counters, then two
    slots per CTA."""
    return workspace_counter_bytes(ctas) + ctas * 2 * slot_bytes


__all__ = ["range_start", "cta_of_unit", "workspace_counter_bytes", "slot_index", "workspace_bytes"]

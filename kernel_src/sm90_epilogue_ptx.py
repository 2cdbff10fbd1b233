"""Inline PTX of the sm_90a GEMM's output store (build time only, CuTe-DSL): the transposed paired store.

**Why the store transposes.**  Both sm_90a forms compute Yᵀ: an MMA thread's accumulators ``c[2h + e]`` of one 8-wide
block are ``Yᵀ[n = g + 8h, m = 2·(lane % 4) + e]`` (``g = lane // 4``; the wgmma and the ``mma.sync m16n8`` C layouts
agree on this).  Its two neighbouring values are two *output rows* apart, so a plain store writes one 16-bit value
per instruction.  Packed to a 16-bit pair, the pair ``(c[2h], c[2h + 1])`` of every lane is one 8 x 8 matrix of
16-bit values in the ``movmatrix`` fragment layout (row = n, column = m).  ``movmatrix.trans`` hands lane L the pair
at row L // 4, columns 2·(L % 4) and + 1 of the transpose: two neighbouring n of output row ``m = g``.  One 32-bit
store then writes both, and a warp's store covers 8 output rows x 16 contiguous bytes, where the 16-bit stores
covered 4 rows x 16 bytes with twice the instructions.  The rounding is the one the 16-bit path had: RNE from fp32,
one value at a time (``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32`` round each half independently).

**Quads (``SVDQ_KERNEL_SM90_STORE``: ``quads``, the default, or ``pairs``; ``sm90_plan.STORE``).**  A warp's
32-bit store fills half of each 32-byte sector it touches.  The two transposed words of one 8-column block (row
halves h = 0 and 1) hold output columns ``2·(lane % 4)`` + {0, 1} and 8 more of row ``g``; one butterfly shuffle
between lanes ``L`` and ``L ^ 1`` leaves each lane four neighbouring columns, ``8·(lane % 2) + 4·((lane % 4) // 2)``
+ {0 .. 3}, and one 64-bit store per lane then fills whole sectors (8 rows x 32 bytes per warp) with half the store
instructions.  It needs the output's rows 8-byte aligned: N is a multiple of 64 and the output pointer of 16 bytes.
"""
from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .sm90_plan import STORE


@dsl_user_op
def _pack2(lo, hi, dtype: str, *, loc=None, ip=None):
    """Two fp32 -> one 32-bit word of two 16-bit values in `dtype` (RNE each): `lo` in the low half."""
    op = "cvt.rn.bf16x2.f32" if dtype == "bf16" else "cvt.rn.f16x2.f32"
    return Int32(llvm.inline_asm(Int32.mlir_type, [Float32(hi).ir_value(), Float32(lo).ir_value()],
                                 op + " $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _movm_t(word, *, loc=None, ip=None):
    """The warp's 8 x 8 matrix of 16-bit pairs (lane L: row L // 4, columns 2·(L % 4), + 1) -> its transpose, in
    the same fragment layout.  Warp-collective: every lane of the warp must execute it."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(word).ir_value()],
                                 "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _st_b32_pred(gaddr, word, pred, *, loc=None, ip=None):
    """st.global.b32 of `word` at `gaddr` where `pred` != 0 (no memory access otherwise)."""
    llvm.inline_asm(None, [Int64(gaddr).ir_value(), Int32(word).ir_value(), Int32(pred).ir_value()],
                    "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p st.global.b32 [$0], $1;\n\t}", "l,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


#: The quad exchange in PTX ($1, $2: the transposed h = 0 and h = 1 words; $3: the lane): lanes L and L ^ 1 swap one
#: word (the odd lane sends its h = 0 word, the even lane its h = 1 word), leaving the lane's four neighbouring
#: columns in `lo`, `hi` (declared by the enclosing block).  The shuffle is unpredicated: every lane of the warp must
#: execute it.
_QUAD_EXCHANGE = ("{\n\t.reg .pred odd;\n\t.reg .b32 t, s, r;\n\t"
                  "and.b32 t, $3, 1;\n\tsetp.ne.u32 odd, t, 0;\n\t"
                  "selp.b32 s, $1, $2, odd;\n\t"
                  "shfl.sync.bfly.b32 r, s, 1, 31, -1;\n\t"
                  "selp.b32 lo, r, $1, odd;\n\tselp.b32 hi, $2, r, odd;\n\t}\n\t")


@dsl_user_op
def _st_quad_pred(gaddr, w0, w1, lane, pred, *, loc=None, ip=None):
    """The quad exchange and store: lanes L and L ^ 1 swap one transposed word (the odd lane sends its h = 0
    word, the even lane its h = 1 word), and each stores its four neighbouring columns as one st.global.v2.b32 at
    `gaddr` where `pred` != 0.  The shuffle is unpredicated: every lane of the warp must execute it."""
    llvm.inline_asm(None, [Int64(gaddr).ir_value(), Int32(w0).ir_value(), Int32(w1).ir_value(),
                           Int32(lane).ir_value(), Int32(pred).ir_value()],
                    "{\n\t.reg .pred p;\n\t.reg .b32 lo, hi;\n\t" + _QUAD_EXCHANGE +
                    "setp.ne.u32 p, $4, 0;\n\t@p st.global.v2.b32 [$0], {lo, hi};\n\t}", "l,r,r,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _sts_quad(saddr, w0, w1, lane, *, loc=None, ip=None):
    """The quad exchange of ``_st_quad_pred``, then one st.shared.v2.b32 at the 32-bit shared address `saddr` (every
    lane: the staged rows past M are never copied out)."""
    llvm.inline_asm(None, [Int32(saddr).ir_value(), Int32(w0).ir_value(), Int32(w1).ir_value(),
                           Int32(lane).ir_value()],
                    "{\n\t.reg .b32 lo, hi;\n\t" + _QUAD_EXCHANGE + "st.shared.v2.b32 [$0], {lo, hi};\n\t}",
                    "r,r,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _bulk_s2g_row(gaddr, saddr, nbytes, pred, *, loc=None, ip=None):
    """Where `pred` != 0: cp.async.bulk of `nbytes` from the shared address `saddr` to global `gaddr` (a bulk group
    of this thread), committed.  Every thread waits for its own groups (``_bulk_wait``)."""
    llvm.inline_asm(None, [Int64(gaddr).ir_value(), Int32(saddr).ir_value(), Int32(nbytes).ir_value(),
                           Int32(pred).ir_value()],
                    "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $3, 0;\n\t"
                    "@p cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;\n\t"
                    "cp.async.bulk.commit_group;\n\t}", "l,r,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _bulk_wait(read_only: bool, *, loc=None, ip=None):
    """cp.async.bulk.wait_group(.read) 0: this thread's bulk copies have read their SMEM (`read_only`), or are
    complete."""
    op = "cp.async.bulk.wait_group.read 0;" if read_only else "cp.async.bulk.wait_group 0;"
    llvm.inline_asm(None, [], op, "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


def _quad_words(acc, blocks, dtype: str):
    """Per 8-column block of ``pair_blocks`` (its h = 0 entry; the h = 1 entry goes with it): (mb, nb, w0, w1), the
    two row halves' accumulator pairs packed to 16 bits and transposed across the warp, ready for the exchange."""
    for i, mb, nb in blocks:
        if (i // 2) % 2:
            continue
        yield mb, nb, _movm_t(_pack2(acc[i], acc[i + 1], dtype)), _movm_t(_pack2(acc[i + 2], acc[i + 3], dtype))


def stage_yt_quads(sout, row_bytes: int, n_warp_t, lane, acc, blocks, dtype: str):
    """The quads of ``store_yt`` written to the SMEM tile at shared address `sout` instead (tile-relative: row
    ``mb + g``, columns from `n_warp_t`, the warp's first column within the tile; `row_bytes` per row)."""
    for mb, nb, w0, w1 in _quad_words(acc, blocks, dtype):
        row, col = quad_target(0, mb, nb, n_warp_t, lane)
        _sts_quad(sout + row * row_bytes + col * 2, w0, w1, lane)


def pair_blocks(atoms: int, tile_m: int) -> list[tuple[int, int, int]]:
    """The accumulator pairs of one MMA thread as (i, mb, nb): acc[i] and acc[i + 1] (i even) hold
    Yᵀ[nb + g, mb + 2·(lane % 4) + {0, 1}] relative to the thread's warp (its first weight row, the tile's first
    activation row), g = lane // 4.  Per 64-row atom a (``tile_m / 2`` accumulators), 8-column block j and row half h:
    i = a·tile_m / 2 + 4j + 2h, mb = 8j, nb = 128a + 8h -- the wgmma C layout, and for one atom the
    ``mma.sync m16n8`` C layout of the gemv form's n8 blocks.  Plain integers (tests/test_sm90_store.py replays the
    store with it)."""
    per_atom = tile_m // 2
    return [(a * per_atom + 4 * j + 2 * h, 8 * j, 128 * a + 8 * h)
            for a in range(atoms) for j in range(tile_m // 8) for h in range(2)]


def pair_target(m0, mb, nb, n_warp, lane):
    """(output row, first output column) the thread stores block (mb, nb)'s transposed pair to: row m0 + mb + g, columns
    n_warp + nb + 2·(lane % 4) and + 1.  Plain operators: the kernels call it on DSL integers, the CPU test on ints."""
    return m0 + mb + lane // 4, n_warp + nb + 2 * (lane % 4)


def quad_target(m0, mb, nb, n_warp, lane):
    """(output row, first of four output columns) a lane stores block (mb, nb)'s two row halves to after the quad
    exchange (`nb` the h = 0 half's): row m0 + mb + g, columns n_warp + nb + 8·(lane % 2) + 4·((lane % 4) // 2) and
    the next three.  Plain operators, like ``pair_target``."""
    return m0 + mb + lane // 4, n_warp + nb + 8 * (lane % 2) + 4 * ((lane % 4) // 2)


def store_yt(out_addr, n, m, m0, n_warp, lane, acc, blocks, dtype: str):
    """Store accumulator pairs of Yᵀ as output rows in the build's store form (``sm90_plan.STORE``).  `blocks`:
    ``pair_blocks`` (quads take its h = 0 and h = 1 entries of each block together)."""
    if STORE == "pairs":                                # ("bulk": the forms that stage use stage_yt_quads)
        store_yt_pairs(out_addr, n, m, m0, n_warp, lane, acc, blocks, dtype)
        return
    for mb, nb, w0, w1 in _quad_words(acc, blocks, dtype):
        row, col = quad_target(m0, mb, nb, n_warp, lane)
        _st_quad_pred(out_addr + (Int64(row) * n + col) * 2, w0, w1, lane, Int32(row < m))


def store_yt_pairs(out_addr, n, m, m0, n_warp, lane, acc, blocks, dtype: str):
    """Store accumulator pairs of Yᵀ as output rows.  `blocks`: ``pair_blocks``; `n_warp`: the absolute output
    column of the warp's first weight row.  Each pair is packed, transposed across the warp, and stored at
    ``pair_target`` where that row is < m: the predicate sits on the store alone, since movmatrix needs the whole
    warp."""
    for i, mb, nb in blocks:
        w = _movm_t(_pack2(acc[i], acc[i + 1], dtype))
        row, col = pair_target(m0, mb, nb, n_warp, lane)
        _st_b32_pred(out_addr + (Int64(row) * n + col) * 2, w, Int32(row < m))

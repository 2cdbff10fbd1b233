"""Inline PTX of the sm_90a GEMM: the exact E2M1 / E4M3 decodes into fp16x2, and the shared / distributed-shared
fp32 moves of its split-K reduction, the bulk copy of pre-decoded stage images (build time only, CuTe-DSL)."""
from __future__ import annotations

import os

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from svdq_loader.ops.sm90_weight_format import PAIR_DECODES

#: The weight decode form the kernels are built with (`sm90_weight_format.PAIR_DECODES`): ``mul``, the default
#: (3 integer instructions fewer per weight word than ``shift``, and 0-8 % faster on the H200: docs/PERF.md,
#: session 22), or ``shift``, the earlier form, chosen for a comparison build with ``SVDQ_KERNEL_SM90_WDECODE=shift``
#: (like every ``SVDQ_KERNEL_*`` switch, it enters the build cache key and the manifest).  The ``mul`` build also
#: converts each k-block's weight scales from their 16-bit half of the scale word without extracting it
#: (`weight_scales_x128`).  Both are exact.
WDECODE = os.environ.get("SVDQ_KERNEL_SM90_WDECODE", "mul")
if WDECODE not in PAIR_DECODES:
    raise ValueError(f"SVDQ_KERNEL_SM90_WDECODE={WDECODE!r}: the sm_90a weight decode form must be one of "
                     f"{', '.join(sorted(PAIR_DECODES))}")

#: 2^7 as fp16x2 (both operands are decoded times 2^-14 and scaled by 2^7: exact, no fp16 overflow)
_F16X2_128 = 0x58005800


def _asm(res, ins, text, cons):
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value() for x in ins], text, cons,
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def _scales_x128_ptx(decl: str, setup: str, src: str) -> str:
    """PTX: two E4M3 bytes in the 16-bit register `src` (declared by `decl`, filled from $1 by `setup`) -> $0 =
    fp16x2 of (scale · 2^7)."""
    return ("{\n\t%s\n\t.reg .b32 c;\n\t%s\n\t"
            "cvt.rn.f16x2.e4m3x2 $0, %s;\n\tmov.b32 c, %d;\n\tmul.rn.f16x2 $0, $0, c;\n\t}"
            % (decl, setup, src, _F16X2_128))


@dsl_user_op
def _scales_x128(two_e4m3, *, loc=None, ip=None):
    """Low 16 bits = two E4M3 bytes -> fp16x2 of (scale · 2^7), exact."""
    return _asm(None, [two_e4m3], _scales_x128_ptx(".reg .b16 t;", "cvt.u16.u32 t, $1;", "t"), "=r,r")


@dsl_user_op
def _scales_x128_half(word, half: int, *, loc=None, ip=None):
    """The two E4M3 bytes in 16-bit half `half` of `word` -> fp16x2 of (scale · 2^7), exact; the half is a
    register operand of the conversion, so no shift or mask extracts it."""
    return _asm(None, [word], _scales_x128_ptx(".reg .b16 l, h;", "mov.b32 {l, h}, $1;", "h" if half else "l"),
                "=r,r")


def weight_scales_x128(word, half: int):
    """The weight scales of one k-block (16-bit half `half` of a word of the sm90 scale format) -> fp16x2 of
    (scale · 2^7).  The ``mul`` build converts the half in place; a ``shift`` build extracts it first."""
    if WDECODE == "shift":
        return _scales_x128((word >> (16 * half)) & 0xFFFF)
    return _scales_x128_half(word, half)


@dsl_user_op
def _bcast(pair, hi: int, *, loc=None, ip=None):
    """fp16x2 {a, b} -> {a, a} (hi=0) or {b, b} (hi=1)."""
    pick = "{l, l}" if hi == 0 else "{h, h}"
    return _asm(None, [pair], "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $1;\n\tmov.b32 $0, %s;\n\t}" % pick,
                "=r,r")


def wdecode_ptx(p: int, form: str) -> str:
    """The PTX of `_wdecode` for pair p: the terms of `PAIR_DECODES[form][p]` in registers a, b, then the scale
    multiply ($1 = word, $2 = broadcast scale, $0 = fp16x2)."""
    lines = [".reg .b32 a, b;"]
    terms = PAIR_DECODES[form][p]
    for reg, (pre, mult, post) in zip("ab", terms):
        src = "$1"
        if pre is not None:
            lines.append(f"and.b32 {reg}, $1, 0x{pre:08X};")
            src = reg
        if mult & (mult - 1) == 0:
            lines.append(f"shl.b32 {reg}, {src}, {mult.bit_length() - 1};")
        else:
            lines.append(f"mul.lo.u32 {reg}, {src}, {mult};")
        lines.append(f"and.b32 {reg}, {reg}, 0x{post:08X};")
    if len(terms) == 2:
        lines.append("or.b32 a, a, b;")
    lines.append("mul.rn.f16x2 $0, a, $2;")
    return "{\n\t" + "\n\t".join(lines) + "\n\t}"


@dsl_user_op
def _wdecode(word, scale2, p: int, *, loc=None, ip=None):
    """Pair p of a fragment word (sm90 weight format) times the broadcast scale -> fp16x2."""
    return _asm(None, [word, scale2], wdecode_ptx(p, WDECODE), "=r,r,r")


@dsl_user_op
def _byte_form(word, high: int, *, loc=None, ip=None):
    """The low (high=0) or high (high=1) nibble of each byte of a logical NVFP4 word, moved to the byte's
    fp16-high-byte position: magnitude at bits 1-3, sign at bit 7."""
    if high == 0:
        text = ("{\n\t.reg .b32 a, b;\n\tshl.b32 a, $1, 1;\n\tand.b32 a, a, 0x0E0E0E0E;\n\t"
                "shl.b32 b, $1, 4;\n\tand.b32 b, b, 0x80808080;\n\tor.b32 $0, a, b;\n\t}")
    else:
        text = ("{\n\t.reg .b32 a, b;\n\tshr.b32 a, $1, 3;\n\tand.b32 a, a, 0x0E0E0E0E;\n\t"
                "and.b32 b, $1, 0x80808080;\n\tor.b32 $0, a, b;\n\t}")
    return _asm(None, [word], text, "=r,r")


@dsl_user_op
def _adecode_prmt(lo_form, hi_form, scale2, byte: int, *, loc=None, ip=None):
    """Pair `byte` from the two byte forms: one byte permute, one mask, one mul.f16x2."""
    sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
    return _asm(None, [lo_form, hi_form, scale2],
                "{\n\t.reg .b32 a;\n\tprmt.b32 a, $1, $2, 0x%04X;\n\tand.b32 a, a, 0x8E008E00;\n\t"
                "mul.rn.f16x2 $0, a, $3;\n\t}" % sel,
                "=r,r,r,r")


@dsl_user_op
def _adecode(word, scale2, byte: int, *, loc=None, ip=None):
    """Byte `byte` of a logical NVFP4 word (low nibble = even k) times the broadcast scale -> fp16x2."""
    return _asm(None, [word, scale2],
                "{\n\t.reg .b32 y, a, b;\n\tshr.b32 y, $1, %d;\n\t"
                "shl.b32 a, y, 9;\n\tand.b32 a, a, 0x00000E00;\n\t"
                "shl.b32 b, y, 12;\n\tand.b32 b, b, 0x00008000;\n\tor.b32 a, a, b;\n\t"
                "shl.b32 b, y, 21;\n\tand.b32 b, b, 0x0E000000;\n\tor.b32 a, a, b;\n\t"
                "shl.b32 b, y, 24;\n\tand.b32 b, b, 0x80000000;\n\tor.b32 a, a, b;\n\t"
                "mul.rn.f16x2 $0, a, $2;\n\t}" % (8 * byte),
                "=r,r,r")


@dsl_user_op
def _sts_v4f(saddr, a, b, c, d, *, loc=None, ip=None):
    """st.shared.v4.f32 at the 32-bit shared address `saddr`."""
    llvm.inline_asm(None, [Int32(saddr).ir_value()] + [Float32(x).ir_value() for x in (a, b, c, d)],
                    "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _lds_v4(saddr, dsl_type, ptx_type: str, mlir_name: str, *, loc=None, ip=None):
    """Four 32-bit values of `ptx_type` at the 32-bit shared address `saddr` (``ld.shared.v4``; volatile, so it is
    neither merged nor moved across the waits and writes that make the bytes visible)."""
    from cutlass._mlir import ir
    st = ir.Type.parse(f"!llvm.struct<({mlir_name},{mlir_name},{mlir_name},{mlir_name})>")
    c = "f" if ptx_type == "f32" else "r"
    r = llvm.inline_asm(st, [Int32(saddr).ir_value()], f"ld.shared.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
                        f"={c},={c},={c},={c},r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [dsl_type(llvm.extractvalue(dsl_type.mlir_type, r, [i])) for i in range(4)]


@dsl_user_op
def _lds_v4f(saddr, *, loc=None, ip=None):
    """Four fp32 at `saddr` (what this thread's own `_sts_v4f` wrote before it, with no fence between)."""
    return _lds_v4(saddr, Float32, "f32", "f32")


@dsl_user_op
def _lds_v4u(saddr, *, loc=None, ip=None):
    """Four 32-bit words at `saddr` (after the mbarrier wait that made them visible)."""
    return _lds_v4(saddr, Int32, "u32", "i32")


@dsl_user_op
def _st_v4f(gaddr, a, b, c, d, *, loc=None, ip=None):
    """st.global.v4.f32 at the 64-bit global address `gaddr` (a stream-K meeting's slot write)."""
    llvm.inline_asm(None, [Int64(gaddr).ir_value()] + [Float32(x).ir_value() for x in (a, b, c, d)],
                    "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _ld_relaxed_v4f(gaddr, *, loc=None, ip=None):
    """Four fp32 at the 64-bit global address `gaddr`, ``ld.relaxed.gpu`` (a stream-K meeting's last arrival reads
    the other CTAs' slots after its acquire: not from a possibly stale L1 line)."""
    from cutlass._mlir import ir
    st = ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>")
    r = llvm.inline_asm(st, [Int64(gaddr).ir_value()], "ld.relaxed.gpu.global.v4.f32 {$0, $1, $2, $3}, [$4];",
                        "=f,=f,=f,=f,l", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(Float32.mlir_type, r, [i])) for i in range(4)]


@dsl_user_op
def _ld_cluster_v4f(saddr, rank, pred=None, *, loc=None, ip=None):
    """Four fp32 at this CTA's shared address `saddr` as it lies in cluster CTA `rank` (mapa + ld.shared::cluster).
    With `pred` (a DSL integer): the load happens where pred != 0, else the result is four zeros and nothing is
    accessed (the gemv reduction issues every peer's load before it adds any)."""
    from cutlass._mlir import ir
    st = ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>")
    if pred is None:
        ins, cons = [Int32(saddr).ir_value(), Int32(rank).ir_value()], "=f,=f,=f,=f,r,r"
        text = ("{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $4, $5;\n\t"
                "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [ra];\n\t}")
    else:
        ins, cons = [Int32(saddr).ir_value(), Int32(rank).ir_value(), Int32(pred).ir_value()], "=f,=f,=f,=f,r,r,r"
        text = ("{\n\t.reg .b32 ra;\n\t.reg .pred p;\n\tsetp.ne.u32 p, $6, 0;\n\t"
                "mov.f32 $0, 0f00000000;\n\tmov.f32 $1, 0f00000000;\n\t"
                "mov.f32 $2, 0f00000000;\n\tmov.f32 $3, 0f00000000;\n\t"
                "@p mapa.shared::cluster.u32 ra, $4, $5;\n\t"
                "@p ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [ra];\n\t}")
    r = llvm.inline_asm(st, ins, text, cons, has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(Float32.mlir_type, r, [i])) for i in range(4)]


@dsl_user_op
def _bulk_g2s(saddr, gaddr, nbytes, mbar, *, loc=None, ip=None):
    """cp.async.bulk of `nbytes` contiguous bytes from global address `gaddr` to this CTA's shared address `saddr`,
    completing as transaction bytes on the mbarrier at shared address `mbar` (async proxy: no proxy fence)."""
    llvm.inline_asm(None, [Int32(saddr).ir_value(), Int64(gaddr).ir_value(), Int32(nbytes).ir_value(),
                           Int32(mbar).ir_value()],
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                    "r,l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)

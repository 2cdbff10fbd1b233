"""Inline PTX of the sm_90a FP8-compute GEMM and its activation pre-pass: E2M1 words to E4M3 bytes by one byte
permute, and the one rounding of a scaled value to E4M3 (build time only, CuTe-DSL).

The steps are the ones `svdq_loader.ops.sm90_fp8_weight_format` states and its CPU test replays bit for bit:
``e2m1_e4m3_regs`` gives the four exact E4M3 values of each of a word's two registers; ``round_scaled`` converts
one register's four values to fp16 (exact), multiplies them by the block's fp16 ``scale · r`` (exact: the products
have at most 6 significant bits and lie between 2⁻¹⁶ and 448) and rounds each once to E4M3
(``cvt.rn.satfinite``).  The ``lut`` weights form does that rounding once per row and 16-k group for the eight E2M1
magnitudes (``lut_pair``, a byte table) and decodes a register by one byte permute of it (``lut_reg``)."""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from svdq_loader.ops.sm90_fp8_weight_format import E2M1_E4M3_LUT, MAG_MASK, SIGN_MASK

from . import quantize_ptx


def _asm(ins, text, cons):
    return Int32(llvm.inline_asm(Int32.mlir_type, [x.ir_value() for x in ins], text, cons,
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def _word_reg_ptx(high: int, lo: str, hi: str, regs: str = "", head: tuple = ()) -> str:
    """PTX: word $1 of the FP8 fragment format -> $0 = its register ``high`` (0: values 0-3, 1: values 4-7) as four
    E4M3 bytes: one mask, one byte permute of the table {lo, hi} (its codes 0-3, 4-7), the signs OR-ed in."""
    lines = [f".reg .b32 m, s{regs};", *head, f"and.b32 m, $1, 0x{MAG_MASK:08X};"]
    if high:
        lines += ["shr.b32 m, m, 16;", "shl.b32 s, $1, 4;", f"and.b32 s, s, 0x{SIGN_MASK:08X};"]
    else:
        lines += [f"and.b32 s, $1, 0x{SIGN_MASK:08X};"]
    lines += [f"prmt.b32 $0, {lo}, {hi}, m;", "or.b32 $0, $0, s;"]
    return "{\n\t" + "\n\t".join(lines) + "\n\t}"


def e2m1_e4m3_ptx(high: int) -> str:
    """PTX: register ``high`` of word $1 through the E2M1 -> E4M3 table (the exact E2M1 values, signed)."""
    return _word_reg_ptx(high, "t0", "t1", ", t0, t1", (f"mov.b32 t0, 0x{E2M1_E4M3_LUT[0]:08X};",
                                                        f"mov.b32 t1, 0x{E2M1_E4M3_LUT[1]:08X};"))


@dsl_user_op
def e2m1_e4m3_reg(word, high: int, *, loc=None, ip=None):
    """Register `high` of a fragment word: four exact E4M3 bytes."""
    return _asm([Int32(word)], e2m1_e4m3_ptx(high), "=r,r")


def lut_reg_ptx(high: int) -> str:
    """PTX: register ``high`` of word $1 through the byte table {$2, $3} of that register's row and group
    (`lut_pair`): e4m3(|e2m1| · scale · rw), the signs OR-ed in."""
    return _word_reg_ptx(high, "$2", "$3")


@dsl_user_op
def lut_reg(word, lo, hi, high: int, *, loc=None, ip=None):
    """Register `high` of a fragment word through its row's byte table (lo: codes 0-3, hi: codes 4-7)."""
    return _asm([Int32(word), Int32(lo), Int32(hi)], lut_reg_ptx(high), "=r,r,r,r")


#: fp16x2 of the E2M1 magnitudes in code order, two per register: {0, 0.5}, {1, 1.5}, {2, 3}, {4, 6}
MAG_F16X2 = (0x38000000, 0x3E003C00, 0x42004000, 0x46004400)

#: PTX: the broadcast fp16x2 multiplier $2 ({scale · rw, scale · rw}) -> the byte table of one row and group:
#: $0 = e4m3 of magnitudes 0, 0.5, 1, 1.5 times it, $1 = of 2, 3, 4, 6 (each product exact in fp16, as in
#: `round_scaled`, then rounded once to E4M3)
LUT_PAIR_PTX = ("{\n\t.reg .b32 c, p;\n\t.reg .b16 q0, q1, q2, q3;\n\t" + "".join(
    f"mov.b32 c, 0x{v:08X};\n\tmul.rn.f16x2 p, c, $2;\n\tcvt.rn.satfinite.e4m3x2.f16x2 q{i}, p;\n\t"
    for i, v in enumerate(MAG_F16X2)) + "mov.b32 $0, {q0, q1};\n\tmov.b32 $1, {q2, q3};\n\t}")


def lut_pair(mult2):
    """(codes 0-3, codes 4-7) of the byte table for the broadcast fp16x2 multiplier `mult2` (`LUT_PAIR_PTX`)."""
    return quantize_ptx._asm(LUT_PAIR_PTX, (Int32, Int32), [Int32(mult2)], "=r,=r,r")


ROUND_SCALED_PTX = ("{\n\t.reg .b16 l, h, ol, oh;\n\t.reg .b32 fl, fh;\n\tmov.b32 {l, h}, $1;\n\t"
                    "cvt.rn.f16x2.e4m3x2 fl, l;\n\tcvt.rn.f16x2.e4m3x2 fh, h;\n\t"
                    "mul.rn.f16x2 fl, fl, $2;\n\tmul.rn.f16x2 fh, fh, $2;\n\t"
                    "cvt.rn.satfinite.e4m3x2.f16x2 ol, fl;\n\tcvt.rn.satfinite.e4m3x2.f16x2 oh, fh;\n\t"
                    "mov.b32 $0, {ol, oh};\n\t}")


@dsl_user_op
def round_scaled(reg, mult2, *, loc=None, ip=None):
    """Four E4M3 bytes times the broadcast fp16x2 multiplier `mult2`, each rounded once to E4M3."""
    return _asm([Int32(reg), Int32(mult2)], ROUND_SCALED_PTX, "=r,r,r")


@dsl_user_op
def block_mults(word, half: int, r2, *, loc=None, ip=None):
    """Half `half` of a scale word (two E4M3 scales: rows r0, r0 + 8) times `r2` (fp16x2 of their powers of two)
    -> fp16x2 of ``scale · r`` for both rows (exact)."""
    pick = "h" if half else "l"
    return _asm([Int32(word), Int32(r2)],
                "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $1;\n\tcvt.rn.f16x2.e4m3x2 $0, %s;\n\t"
                "mul.rn.f16x2 $0, $0, $2;\n\t}" % pick, "=r,r,r")


@dsl_user_op
def f16x2_of(lo, hi, *, loc=None, ip=None):
    """Two fp32 (exact in fp16: powers of two between 2⁻³ and 2¹⁵) -> fp16x2 {lo, hi}."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Float32(lo).ir_value(), Float32(hi).ir_value()],
                                 "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


# -- the activation pre-pass (sm90_act_fp8) ----------------------------------------------------------------------------

#: 2^14 as fp16x2: a byte-form pair (e2m1 · 2^-14, `sm90_decode_ptx._byte_form`) times this is the E2M1 value itself
_F16X2_2P14 = 0x74007400


def act_e4m3_ptx(b0: int) -> str:
    """PTX: pairs b0 and b0 + 1 of a logical NVFP4 word, from its two byte forms ($1 low nibbles, $2 high nibbles),
    times the broadcast fp16x2 multiplier $3 (scale · ra), each value rounded once to E4M3 -> $0 = four E4M3 bytes
    in k order."""
    lines = [".reg .b32 a, c, s;", ".reg .b16 oa, oc;", f"mov.b32 s, 0x{_F16X2_2P14:08X};"]
    for reg, b in (("a", b0), ("c", b0 + 1)):
        sel = b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)
        lines += [f"prmt.b32 {reg}, $1, $2, 0x{sel:04X};", f"and.b32 {reg}, {reg}, 0x8E008E00;",
                  f"mul.rn.f16x2 {reg}, {reg}, s;", f"mul.rn.f16x2 {reg}, {reg}, $3;",
                  f"cvt.rn.satfinite.e4m3x2.f16x2 o{reg}, {reg};"]
    lines.append("mov.b32 $0, {oa, oc};")
    return "{\n\t" + "\n\t".join(lines) + "\n\t}"


@dsl_user_op
def act_e4m3(lo_form, hi_form, mult2, b0: int, *, loc=None, ip=None):
    return _asm([Int32(lo_form), Int32(hi_form), Int32(mult2)], act_e4m3_ptx(b0), "=r,r,r,r")


@dsl_user_op
def act_mult(scale_byte, ra2, *, loc=None, ip=None):
    """One E4M3 scale byte times ra (fp16x2 {ra, ra}) -> fp16x2 {scale · ra, scale · ra} (exact: at most 4
    significant bits, between 2⁻¹² and 74.7)."""
    return _asm([Int32(scale_byte), Int32(ra2)],
                "{\n\t.reg .b16 h, l, u;\n\t.reg .b32 x;\n\tcvt.u16.u32 h, $1;\n\tcvt.rn.f16x2.e4m3x2 x, h;\n\t"
                "mul.rn.f16x2 x, x, $2;\n\tmov.b32 {l, u}, x;\n\tmov.b32 $0, {l, l};\n\t}", "=r,r,r")


#: PTX: the largest E4M3 scale byte of a row ($2; 0 for a row of zero scales) -> $0 = the bits of ra, the largest
#: power of two with 6 · scale · ra <= 448 (1.0 for 0), $1 = the bits of 1 / ra (exact: an exponent).  The quotient
#: 448 / (6 · scale) is rounded, so its power of two is settled on the exact products, as the rule states.
RA_OF_MAX_PTX = ("{\n\t.reg .b16 h, hl, hh;\n\t.reg .b32 x, pb;\n\t.reg .f32 s, b, q, p, prod;\n\t"
                 ".reg .pred big, small, z;\n\t"
                 "cvt.u16.u32 h, $2;\n\tcvt.rn.f16x2.e4m3x2 x, h;\n\tmov.b32 {hl, hh}, x;\n\tcvt.f32.f16 s, hl;\n\t"
                 "mul.rn.f32 b, s, 0f40C00000;\n\tdiv.rn.f32 q, 0f43E00000, b;\n\t"
                 "mov.b32 pb, q;\n\tand.b32 pb, pb, 0x7F800000;\n\tmov.b32 p, pb;\n\t"
                 "mul.rn.f32 prod, b, p;\n\tsetp.gt.f32 big, prod, 0f43E00000;\n\t"
                 "@big sub.s32 pb, pb, 0x00800000;\n\tmov.b32 p, pb;\n\tadd.f32 p, p, p;\n\t"
                 "mul.rn.f32 prod, b, p;\n\tsetp.le.f32 small, prod, 0f43E00000;\n\t"
                 "@small add.s32 pb, pb, 0x00800000;\n\t"
                 "setp.eq.u32 z, $2, 0;\n\t@z mov.b32 pb, 0x3F800000;\n\t"
                 "mov.b32 $0, pb;\n\tsub.s32 $1, 0x7F000000, pb;\n\t}")


def ra_of_max(max_byte):
    """(bits of ra, bits of 1 / ra) for a row whose largest scale byte is `max_byte` (`RA_OF_MAX_PTX`)."""
    return quantize_ptx._asm(RA_OF_MAX_PTX, (Int32, Int32), [Int32(max_byte)], "=r,=r,r")


@dsl_user_op
def ra_half2(ra_bits, *, loc=None, ip=None):
    """The bits of ra (fp32, a power of two between 2⁻³ and 2¹⁵) -> fp16x2 {ra, ra} (exact)."""
    return _asm([Int32(ra_bits)], "{\n\t.reg .f32 f;\n\t.reg .b16 h;\n\tmov.b32 f, $1;\n\tcvt.rn.f16.f32 h, f;\n\t"
                "mov.b32 $0, {h, h};\n\t}", "=r,r")


@dsl_user_op
def byte_max(word, *, loc=None, ip=None):
    """The largest of the four bytes of `word` (unsigned), as a 32-bit integer."""
    return _asm([Int32(word)], "{\n\t.reg .b32 a, b;\n\tand.b32 a, $1, 0x00FF00FF;\n\tshr.b32 b, $1, 8;\n\t"
                "and.b32 b, b, 0x00FF00FF;\n\tmax.u16x2 a, a, b;\n\tshr.b32 b, a, 16;\n\tand.b32 a, a, 0xFFFF;\n\t"
                "max.u32 $0, a, b;\n\t}", "=r,r")


@dsl_user_op
def f32_of_bits(bits, *, loc=None, ip=None):
    """A 32-bit pattern as the fp32 it encodes."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Int32(bits).ir_value()], "mov.b32 $0, $1;", "=f,r",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

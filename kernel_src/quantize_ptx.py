"""Inline PTX for ``quantize_act`` (and the sm_90a gemv GEMM, which shares the copy and load helpers): LLVM inline
asm with ``$N`` operands, one small function per instruction sequence.  Build time only (CuTe-DSL)."""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm

# E2M1 decision thresholds (multiples of the scale) and whether a tie rounds up (>=) or down (>)
_THRESH = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

# ---------------------------------------------------------------------------
# Inline-PTX helper (LLVM inline asm, $N operands)
# ---------------------------------------------------------------------------

# Cache policy of the loads (measured on an H200, M=4608, K=15360, R=32: cp.async.ca 100 us vs .cg 125 us --
# co-resident CTAs work on the same k steps at about the same time, so the lora_down tiles hit in L1;
# an L2::256B prefetch hint on the x stream made no difference).  The x loads allocate in L1 (session 4 of
# docs/PERF.md: 1-5 % faster than L1::no_allocate).  A likely reason: a lane's two 16-byte loads of a row
# are the two halves of the same 32-byte sectors, which no_allocate made L2 send twice.
_CP_CACHE = "ca"
_X_HINT = ""


def _asm(ptx: str, outs: tuple, ins: list, cons: str, side: bool = False):
    """One inline-asm statement.  outs: DSL types of the results; ins: DSL values."""
    vals = [v.ir_value() for v in ins]
    if not outs:
        llvm.inline_asm(None, vals, ptx, cons, has_side_effects=True, asm_dialect=0)
        return None
    if len(outs) == 1:
        r = llvm.inline_asm(outs[0].mlir_type, vals, ptx, cons, has_side_effects=side, asm_dialect=0)
        return outs[0](r)
    st = ir.Type.parse("!llvm.struct<(" + ",".join(str(o.mlir_type) for o in outs) + ")>")
    r = llvm.inline_asm(st, vals, ptx, cons, has_side_effects=side, asm_dialect=0)
    return tuple(o(llvm.extractvalue(o.mlir_type, r, [i])) for i, o in enumerate(outs))


def _ld_v4(addr, side=False):
    return _asm(f"ld.global.nc{_X_HINT}.v4.u32 {{$0, $1, $2, $3}}, [$4];",
                (Int32, Int32, Int32, Int32), [addr], "=r,=r,=r,=r,l", side)


def _ld_v2(addr, side=False):
    return _asm(f"ld.global.nc{_X_HINT}.v2.u32 {{$0, $1}}, [$2];", (Int32, Int32), [addr], "=r,=r,l", side)


def _ld_pred_u32(addr, pred, dflt):
    """ld.global.nc.u32 when pred != 0, else the constant dflt."""
    return _asm("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\nmov.u32 $0, " + str(dflt) + ";\n"
                "@p ld.global.nc.u32 $0, [$1];\n}", (Int32,), [addr, pred], "=r,l,r", True)


def _f32_pair(word, dtype: str):
    """16-bit pair word -> (lo, hi) as Float32 (exact)."""
    if dtype == "bf16":
        lo = (word << 16).bitcast(Float32)
        hi = (word & Int32(-65536)).bitcast(Float32)
        return lo, hi
    return _asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h;\n}",
                (Float32, Float32), [word], "=f,=f,r")


def _pack_pair(lo, hi, dtype: str):
    """(lo, hi) Float32 -> 16-bit pair word, RNE (cvt.rn, no saturation)."""
    op = "cvt.rn.bf16x2.f32" if dtype == "bf16" else "cvt.rn.f16x2.f32"
    return _asm(op + " $0, $1, $2;", (Int32,), [hi, lo], "=r,f,f")


def _mul_pair(a, b, dtype: str):
    """Two 16-bit pairs multiplied per half, one rounding to the 16-bit type (RNE, subnormals kept, overflow ->
    inf): the exact product of two 16-bit values, rounded once (``mul.rn.bf16x2`` / ``mul.rn.f16x2``)."""
    ty = "bf16x2" if dtype == "bf16" else "f16x2"
    return _asm(f"mul.rn.{ty} $0, $1, $2;", (Int32,), [a, b], "=r,r,r")


def _sts_u32(saddr, v):
    _asm("st.shared.u32 [$0], $1;", (), [saddr, v], "r,r")


def _rcp16(a):
    """RN32(1 / a) for every 16-bit a (bf16 / fp16 value held in fp32), with no division call.

    In fp64: y0 = rcp.approx(a), two Newton steps -> |y - 1/a| < 2^-60 |1/a|, then one rounding
    to fp32.  That equals RN32(1/a): 1/a for a = m * 2^e (odd m < 2^11) is either exact (m = 1)
    or at least 2^-36 (relative) away from every fp32 rounding boundary.  a = +-0, +-inf, NaN
    (y0 not a normal fp64) take y0 itself: +-inf, +-0, NaN, as IEEE 1/a.  (fp64 .ftz only
    concerns fp64 subnormals, which 16-bit inputs never produce.)
    """
    return _asm("{\n.reg .f64 d, dn, y0, y1, e;\n.reg .pred p;\n"
                "cvt.f64.f32 d, $1;\nneg.f64 dn, d;\nrcp.approx.ftz.f64 y0, d;\n"
                "fma.rn.f64 e, dn, y0, 0d3FF0000000000000;\nfma.rn.f64 y1, e, y0, y0;\n"
                "fma.rn.f64 e, dn, y1, 0d3FF0000000000000;\nfma.rn.f64 y1, e, y1, y1;\n"
                "testp.normal.f64 p, y0;\nselp.f64 y1, y1, y0, p;\ncvt.rn.f32.f64 $0, y1;\n}",
                (Float32,), [a], "=f,f")


def _div6(a):
    """RN32(a / 6) for every finite 16-bit a >= 0 (checked exhaustively in tests/test_quantize_ref.py):
    q0 = RN(a * RN(1/6)), r = fma(-6, q0, a) (exact), q = fma(r, RN(1/6), q0).  Non-finite a gives NaN
    (those groups are overridden)."""
    return _asm("{\n.reg .f32 q, r;\nmul.rn.f32 q, $1, 0f3E2AAAAB;\nfma.rn.f32 r, q, 0fC0C00000, $1;\n"
                "fma.rn.f32 $0, r, 0f3E2AAAAB, q;\n}", (Float32,), [a], "=f,f")


def _abs(a):
    return _asm("abs.f32 $0, $1;", (Float32,), [a], "=f,f")


def _abs_f16x2(w):
    """|x| of both fp16 halves of pair word w (the sign bits cleared, NaN kept), as ``abs.f16x2``, which ptxas
    folds into the compares and maxima that read it as an operand modifier (it does not fold ``abs.bf16x2``)."""
    return _asm("abs.f16x2 $0, $1;", (Int32,), [w], "=r,r")


def _max_nan(a, b):
    return _asm("max.NaN.f32 $0, $1, $2;", (Float32,), [a, b], "=f,f,f")


def _max_nan_pair(a, b, dt: str):
    ty = "bf16x2" if dt == "bf16" else "f16x2"
    return _asm(f"max.NaN.{ty} $0, $1, $2;", (Int32,), [a, b], "=r,r,r")


def _amax_pairs(aw, dt: str):
    """max.NaN over the 16 |x̂| halves of 8 pair words -> Float32 (exact; NaN anywhere gives NaN)."""
    while len(aw) > 1:
        aw = [_max_nan_pair(aw[2 * i], aw[2 * i + 1], dt) for i in range(len(aw) // 2)]
    lo, hi = _f32_pair(aw[0], dt)
    return _max_nan(lo, hi)


def _thresholds(sc, dt: str):
    """The seven decision thresholds t*s as 16-bit pairs (exact: t has <= 3, s <= 4 significant bits)."""
    s2 = _pack_pair(sc, sc, dt)
    ty = "bf16x2" if dt == "bf16" else "f16x2"
    out = []
    for tv, _ in _THRESH:
        c = _half_bits(tv, dt)
        out.append(_asm(f"{{\n.reg .b32 c;\nmov.b32 c, {(c << 16) | c:#010x};\nmul.rn.{ty} $0, $1, c;\n}}",
                        (Int32,), [s2], "=r,r"))
    return out


def _half_bits(v: float, dt: str) -> int:
    import struct
    if dt == "fp16":
        return struct.unpack("<H", struct.pack("<e", v))[0]
    return struct.unpack("<I", struct.pack("<f", v))[0] >> 16


def _set_pair(a, b, ge: bool, dt: str):
    """Per 16-bit half: 0xFFFF where a >= b (ge) / a > b, else 0 (exact compare, no ftz)."""
    ty = "bf16x2" if dt == "bf16" else "f16x2"
    return _asm(f"set.{'ge' if ge else 'gt'}.u32.{ty} $0, $1, $2;", (Int32,), [a, b], "=r,r,r")


def _sel(k: int, a, b):
    """Bitwise select: bits of a where the constant mask k is 1, else bits of b (one LOP3)."""
    return _asm(f"lop3.b32 $0, $1, $2, {k & 0xFFFFFFFF:#010x}, 0xE4;", (Int32,), [a, b], "=r,r,r")


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _code_pair(w, aw, th, dt: str):
    """x̂ pair word w (|w| = aw) -> its two E2M1 nibbles at bits 12-15 (even k) and 28-31 (odd k).

    Binary search over the seven decision thresholds th (ties: >= at 0.75, 1.75, 3.5 s; > at
    0.25, 1.25, 2.5, 5 s), all per 16-bit half with exact packed compares:
    b2 = |x̂| >= 1.75s; b1 = |x̂| >= (b2 ? 3.5s : 0.75s); b0 = |x̂| > (b2 ? (b1 ? 5s : 2.5s) : (b1 ? 1.25s : 0.25s)).
    The sign bit (bit 3 of the nibble) is x̂'s own sign bit (bits 15 / 31 of w).
    """
    b2 = _set_pair(aw, th[3], True, dt)
    b1 = _set_pair(aw, b2 & th[5] | ~b2 & th[1], True, dt)
    hi = b2 & th[6] | ~b2 & th[2]
    lo = b2 & th[4] | ~b2 & th[0]
    b0 = _set_pair(aw, b1 & hi | ~b1 & lo, False, dt)
    y = _sel(0x80008000, w, b2)
    y = _sel(0xC000C000, y, b1)
    return _sel(0xE000E000, y, b0)


def _bytes4(ys):
    """Four nibble-pair words (from _code_pair) -> one word of 8 nibbles (element e at bits 4e)."""
    lo2 = _prmt(ys[0], ys[1], 0x7351)            # [y0.b1, y1.b1, y0.b3, y1.b3]
    hi2 = _prmt(ys[2], ys[3], 0x7351)
    p = _prmt(lo2, hi2, 0x5410)                  # even-k nibbles, each in the high half of its byte
    q = _prmt(lo2, hi2, 0x7632)                  # odd-k nibbles, likewise
    return _sel(0x0F0F0F0F, _shr(p, 4), q)


def _shr(a, n: int):
    return _asm(f"shr.u32 $0, $1, {n};", (Int32,), [a], "=r,r")


def _prmt(a, b, sel: int):
    return _asm(f"prmt.b32 $0, $1, $2, {sel:#x};", (Int32,), [a, b], "=r,r,r")


def _e4m3_pair(sc_lo, sc_hi):
    """Two fp32 -> (E4M3 byte pair as Int32 [lo | hi << 8], decoded lo, decoded hi), RNE satfinite."""
    return _asm("{\n.reg .b16 e;\n.reg .b32 hh;\n.reg .b16 h0, h1;\n"
                "cvt.rn.satfinite.e4m3x2.f32 e, $4, $3;\n"
                "cvt.u32.u16 $0, e;\n"
                "cvt.rn.f16x2.e4m3x2 hh, e;\n"
                "mov.b32 {h0, h1}, hh;\n"
                "cvt.f32.f16 $1, h0;\ncvt.f32.f16 $2, h1;\n}",
                (Int32, Float32, Float32), [sc_lo, sc_hi], "=r,=f,=f,f,f")



def _st_v2_pred(addr, w0, w1, pred):
    _asm("{\n.reg .pred p;\nsetp.ne.u32 p, $3, 0;\n@p st.global.v2.u32 [$0], {$1, $2};\n}", (),
         [addr, w0, w1, pred], "l,r,r,r")


def _st_u8_pred(addr, v, pred):
    _asm("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.global.u8 [$0], $1;\n}", (), [addr, v, pred], "l,r,r")


def _st_u32_pred(addr, v, pred):
    _asm("{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.global.u32 [$0], $1;\n}", (), [addr, v, pred], "l,r,r")


def _cp_async16(saddr, gaddr):
    _asm(f"cp.async.{_CP_CACHE}.shared.global [$0], [$1], 16;", (), [saddr, gaddr], "r,l")


def _cp_async16_cg(saddr, gaddr):
    """x is read once: the copy bypasses L1."""
    _asm("cp.async.cg.shared.global [$0], [$1], 16;", (), [saddr, gaddr], "r,l")


def _cp_async4(saddr, gaddr):
    _asm("cp.async.ca.shared.global [$0], [$1], 4;", (), [saddr, gaddr], "r,l")


def _lds_v4(saddr):
    return _asm("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", (Int32,) * 4, [saddr], "=r,=r,=r,=r,r", True)


def _lds_u32(saddr):
    return _asm("ld.shared.u32 $0, [$1];", (Int32,), [saddr], "=r,r", True)


def _cp_commit():
    _asm("cp.async.commit_group;", (), [], "")


def _cp_wait(n: int):
    _asm(f"cp.async.wait_group {n};", (), [], "")


def _sts_v2(saddr, a, b):
    _asm("st.shared.v2.f32 [$0], {$1, $2};", (), [saddr, a, b], "r,f,f")


def _sts_v4(saddr, a, b, c, d):
    _asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", (), [saddr, a, b, c, d], "r,r,r,r,r")


def _sts_f(saddr, a):
    _asm("st.shared.f32 [$0], $1;", (), [saddr, a], "r,f")


def _ld_cluster_v2f(saddr, rank):
    """Two fp32 at this CTA's shared address `saddr` as it lies in cluster CTA `rank` (mapa + ld.shared::cluster)."""
    return _asm("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, $2, $3;\nld.shared::cluster.v2.f32 {$0, $1}, [ra];\n}",
                (Float32,) * 2, [saddr, rank], "=f,=f,r,r", True)


#: The workspace's counter words (`workspace_counter_bytes`: a split tile's counter is its first CTA's) hold
#: ``_ARRIVE_KEY | arrivals``.  A word whose top 48 bits are not the key counts as 0: the workspace needs no
#: zeroing (the loader takes it from torch's allocator per call) and the last arrival writes 0 back.
_ARRIVE_KEY = 0x5D0AC7E1B24F << 16


def _arrive(addr):
    """Count one arrival on the counter at `addr` (see _ARRIVE_KEY); returns the arrivals so far, this one
    included.  A compare-and-swap loop, acq_rel at GPU scope: the caller fences (GPU scope) after a CTA barrier
    over its slot writes, and the last arrival's CTA reads the other slots after it."""
    key = f"{_ARRIVE_KEY:#018x}"
    return _asm("{\n.reg .pred p;\n.reg .b64 cur, old, nw, hi;\n"
                "ld.relaxed.gpu.global.b64 cur, [$1];\n"
                "ARRIVE_${:uid}:\n"
                "and.b64 hi, cur, 0xFFFFFFFFFFFF0000;\n"
                f"setp.eq.b64 p, hi, {key};\n"
                f"selp.b64 nw, cur, {key}, p;\n"
                "add.u64 nw, nw, 1;\n"
                "atom.acq_rel.gpu.global.cas.b64 old, [$1], cur, nw;\n"
                "setp.ne.b64 p, old, cur;\n"
                "mov.b64 cur, old;\n"
                "@p bra ARRIVE_${:uid};\n"
                "cvt.u32.u64 $0, nw;\n"
                "and.b32 $0, $0, 0xFFFF;\n}", (Int32,), [addr], "=r,l", True)


def _wait_arrivals(addr, want, timeout_ns: int = 2_000_000_000):
    """Spin until the counter at `addr` (see _ARRIVE_KEY) holds at least `want` arrivals: ``ld.acquire.gpu`` with a
    short ``nanosleep`` between reads, so the caller's later reads (after a barrier) see what the arrivals
    published.  Traps after `timeout_ns` of %globaltimer: a launch whose CTAs are not all resident fails loudly
    instead of hanging (the sm_90a GEMM's stream-K ``owner`` meeting)."""
    key = f"{_ARRIVE_KEY:#018x}"
    _asm("{\n.reg .pred p;\n.reg .b64 v, hi, t0, t1;\n.reg .b32 c;\n"
         "mov.u64 t0, %globaltimer;\n"
         "WAIT_${:uid}:\n"
         "ld.acquire.gpu.global.b64 v, [$0];\n"
         "and.b64 hi, v, 0xFFFFFFFFFFFF0000;\n"
         f"setp.eq.b64 p, hi, {key};\n"
         "cvt.u32.u64 c, v;\n"
         "and.b32 c, c, 0xFFFF;\n"
         "selp.b32 c, c, 0, p;\n"
         "setp.ge.u32 p, c, $1;\n"
         "@p bra DONE_${:uid};\n"
         "nanosleep.u32 32;\n"
         "mov.u64 t1, %globaltimer;\n"
         "sub.u64 t1, t1, t0;\n"
         f"setp.gt.u64 p, t1, {int(timeout_ns)};\n"
         "@p trap;\n"
         "bra.uni WAIT_${:uid};\n"
         "DONE_${:uid}:\n}", (), [addr, want], "l,r")


def _fence_gpu():
    _asm("fence.acq_rel.gpu;", (), [], "")


def _st_v2f_pred(addr, a, b, pred):
    _asm("{\n.reg .pred p;\nsetp.ne.u32 p, $3, 0;\n@p st.global.v2.f32 [$0], {$1, $2};\n}", (),
         [addr, a, b, pred], "l,f,f,r")


def _ld_relaxed_v2f(addr):
    return _asm("ld.relaxed.gpu.global.v2.f32 {$0, $1}, [$2];", (Float32,) * 2, [addr], "=f,=f,l", True)


def _st_u64(addr, v):
    _asm("st.relaxed.gpu.global.u64 [$0], $1;", (), [addr, v], "l,l")


def _lds_v2f(saddr):
    return _asm("ld.shared.v2.f32 {$0, $1}, [$2];", (Float32,) * 2, [saddr], "=f,=f,r", True)


def _ldsm_x4_t(saddr):
    return _asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
                (Int32,) * 4, [saddr], "=r,=r,=r,=r,r", True)


def _mma(dtype: str, c, a, b):
    ab = "bf16" if dtype == "bf16" else "f16"
    return _asm(f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                (Float32,) * 4, list(a) + list(b) + list(c), "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")

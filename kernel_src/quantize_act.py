"""``quantize_act``: bf16/fp16 activations -> NVFP4 codes + E4M3 block scales (+ fused LoRA-down).

CuTe-DSL, build time only.  ONE source for ``sm_90a``, ``sm_100a``,
``sm_103a``, ``sm_120a`` and ``sm_121a`` (warp-level ``mma.sync`` f16/bf16
and ``cvt...e4m3x2`` exist on all of them; sm_120/121 have less SMEM per
block, which the validity predicate reads per arch).  The exact arithmetic is defined (and checked bit for bit) by
``svdq_loader.testing.quantize_ref``; this kernel implements it as follows.

Work decomposition
------------------
* A **step** is 64 consecutive k.  A warp works on ``16 * mtiles`` rows and
  one step at a time; lane ``(g, t) = (lane // 4, lane % 4)`` owns, for every
  16-row m-tile, rows ``g`` and ``g + 8`` and the 16-k group
  ``[16t, 16t + 16)`` of the step: each of its groups is two 16-byte loads of
  x, one 8-byte store of codes, one scale byte (four lanes write four
  consecutive scale bytes, in both layouts).
* A CTA has ``warps`` warps on the same ``16 * mtiles`` rows.  A launch covers U = tiles * (K / 64) units (one
  row tile, one step) in one of two forms, picked per call by the loader
  (``svdq_loader.ops.quantize_act.schedule``; docs/design.md section 4.3):
  - **cluster form** (host argument ``ksplit`` > 1, read in the kernel from ``%cluster_nctarank``; grid =
    ``ctas`` = tiles * ksplit): a cluster of ksplit CTAs works on one row tile.  Warp w of cluster rank r is
    virtual warp v = r * warps + w of warps * ksplit; the virtual warps split the K steps round-robin (v does
    steps v, v + warps * ksplit, ...).  The LoRA partial sums are added inside each CTA (SMEM), then rank 0
    adds the other ranks' sums through distributed SMEM (``mapa`` + ``ld.shared::cluster``, between two
    cluster barriers) and stores them.
  - **range form** (ksplit 1, grid = ``ctas`` = G >= tiles, read from ``%nctaid.x``): CTA b takes the units
    [b U / G, (b + 1) U / G) (``range_start``), at most two tiles (the kernel traps on more), each tile's part
    worked as above by the CTA's warps round robin.  A whole tile is stored directly (G = tiles is the old
    one-CTA-per-tile launch).  The LoRA sums of a tile split over CTAs meet in the ``workspace``: each CTA
    writes its sums to its slot (``2 b`` for its range's first tile, ``2 b + 1`` for its last, after
    ``workspace_counter_bytes(G)`` of counter words), then one thread fences at GPU scope and counts an
    arrival on the tile's counter (its first CTA's word, ``cta_of_unit``) with a compare-and-swap; the last
    arrival adds the slots in CTA order, stores the rows and writes the counter back to 0.  The workspace
    needs no zeroing: a word counts as zero unless its top 48 bits are ``_ARRIVE_KEY``.
  Codes and scales need no reduction in either form.  rows = M (``logical``) or M rounded up to 128
  (``blocked``: the pad rows get scale 0).
* **x in flight.** Each lane loads its own x chunks (and its smooth pair) of
  its warp's next step into registers (``ld.global.nc``, 16 bytes, allocating
  in L1) while it works on the current one.  Each group's code work and
  stores sit in a branch on the row being covered: without a branch in the
  step ptxas sank these loads to the end of the loop, right before their use
  (docs/PERF.md, session 5: 11-28 % slower).  (Two steps ahead in registers
  was measured on the H200 and was not faster: docs/PERF.md, session 4.)  At
  rank 96, where that form keeps a stack frame, the lane instead copies them
  with ``cp.async.cg`` into a per-warp ring in SMEM, ``x_stages - 1`` of the
  warp's steps ahead (3 without LoRA, 2 with it), reading back only what it
  copied itself, so ``cp.async.wait_group`` is the only synchronisation; the
  copies keep the order x_i, L_i, x_i+1, L_i+1, ... (L = the step's
  ``lora_down`` tile), which is what caps that depth at 2 steps with LoRA.
* LoRA-down is computed transposed, ``lora_act_in^T = lora_down^T @ x̂^T``,
  with ``mma.sync m16n8k16`` (fp32 accumulators): the B operand is x̂ itself
  -- a lane's two B registers for mma block j (of 4 per step) are its own
  x̂ pair words 2j and 2j+1 of one row, under a k permutation (virtual k
  ``{2t, 2t+1, 2t+8, 2t+9}`` of lane t = real k ``16t + 4j + {0..3}``), so no
  register shuffling; the A operand is the step's ``lora_down`` tile [64, R],
  staged per warp in SMEM with ``cp.async.ca`` (double buffered, one step
  ahead; at rank 64 one buffer, filled after the step's MMAs, which leaves the
  SM more L1: ``_ONE_LORA_BUFFER_RANKS``; co-resident CTAs hit the same tiles
  in L1), rows stored in the permuted order so that
  ``ldmatrix.trans`` yields the matching fragments (row pitch 2R + 16 bytes:
  conflict free, for the copies too: ``_srow`` puts the two rows of a
  128-byte line 4 rows apart).  The tile's copy addresses are a
  per-lane base plus the step's offset plus constants where R / 8 is a power
  of two (``_srow`` is a bit permutation), so a step spends no index
  arithmetic on them.  At the end
  the warps' partial sums are added in SMEM and rows < M are stored in x's
  dtype.

Arithmetic (per group of 16; quantize_ref has the normative text)
------------------------------------------------------------------
``rs = RN_D(RN32(1 / smooth))`` per k (one per lane per step, shared through SMEM
as 16-bit pairs; RN32(1 / smooth) is fp64 rcp + two Newton steps, then one rounding: equal to
IEEE ``div.rn.f32`` for every 16-bit input -- proof in ``_rcp16``, checked in the tests);
``x̂ = mul.rn.<D>x2(x, rs)``, one packed multiply per pair (the exact product rounded once;
use_smooth == 0: x̂ = x), so x̂ is a 16-bit value and the same words are the LoRA mma operand;
``amax = max.NaN |x̂|`` (packed); ``sc = RN32(amax / 6)`` via
``fma(fma(-6, q0, amax), RN(1/6), q0)``, ``q0 = RN(amax * RN(1/6))`` (equal to
IEEE division for every 16-bit amax: checked exhaustively);
``byte = cvt.rn.satfinite.e4m3x2.f32(sc)``; non-finite amax -> byte 0x7F and
codes 0; ``s = decode(byte)`` (exact); ``s == 0`` -> codes 0.  Codes with no
division: per 16-bit half, exact packed compares of |x̂| with the seven t*s
(binary search: ``b2 = |x̂| >= 1.75s``, ``b1 = |x̂| >= (b2 ? 3.5s : 0.75s)``,
``b0 = |x̂| > (b2 ? (b1 ? 5s : 2.5s) : (b1 ? 1.25s : 0.25s))``), which equals
E2M1-RNE(div.rn.f32(x̂, s)) -- proof in quantize_ref.  Sign bit = x̂'s sign
bit.  No fp32 ``.ftz`` and no approximate fp32 division anywhere (the tests
grep the PTX), no division subroutine calls (they spilled registers).

Launch ABI: host function ``(x, smooth, lora_down, act, ascales, lora_act_in,
workspace, m, k, use_smooth, ksplit, ctas, stream)``; kernel params: the 7 pointers then m, k,
use_smooth (i32).  grid = (ctas, 1, 1), block = (32 * warps, 1, 1), dynamic SMEM ``smem_bytes``,
cluster (ksplit, 1, 1), programmatic dependent launch (PDL: ``griddepcontrol.wait`` before any
global access, then ``launch_dependents``; docs/design.md section 6).  Preconditions (the loader checks them): pointers 16-byte
aligned, contiguous row-major tensors, m >= 1, k % 64 == 0, M*K < 2^31,
1 <= ksplit <= 8 (any value is correct; more CTAs than steps leave warps idle), ctas = tiles * ksplit
where ksplit > 1 and tiles <= ctas otherwise; with LoRA and ctas > tiles, ``workspace`` holds
``workspace_bytes(ctas, 16 * mtiles, R)`` bytes, 8-byte aligned, used by no other launch at the same time.
Pointers of disabled features (smooth when use_smooth == 0, LoRA when
rank == 0, the workspace when no tile is split) may be 0 and are never dereferenced.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint8
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm

from svdq_loader.ops.quantize_act import cta_of_unit, range_start, workspace_counter_bytes

from .compiled_output import compile_kernel, cubin_resource_usage, refuse_invalid

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES", "STEP_K", "SELECTION",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile",
    "smem_bytes_for", "threads_for", "cubin_resource_usage",
]

OP = "quantize_act"
ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
NAME = "quantize_act"

#: This family's tuning knobs: warps per CTA (they split K) and 16-row m-tiles per warp.
TUNING: dict[str, tuple] = dict(
    warps=(2, 4, 8),
    mtiles=(1, 2),
)
DEFAULT_TUNING = dict(warps=4, mtiles=1)
#: Loader ranking (svdq_loader.select_rules): the H200 sweep of docs/PERF.md found warps=4, mtiles=1
#: fastest at every K and R measured (M = 4608), so fewer warps and m-tiles first, one bucket.
SELECTION = [{"m_max": None, "priority": 0, "prefer": [{"knob": "mtiles", "order": "asc"},
                                                       {"knob": "warps", "order": "asc"}]}]
#: Feature-knob values this family builds (the op spec lists the knobs).
FEATURE_VALUES: dict[str, tuple] = dict(
    dtype=("bf16", "fp16"),
    rank=(0, 16, 32, 48, 64, 96, 128),
    scale_layout=("logical", "blocked"),
)
_LAYOUT_BY_ARCH = {"sm_90a": "logical", "sm_100a": "blocked", "sm_103a": "blocked",
                   "sm_120a": "blocked", "sm_121a": "blocked"}

STEP_K = 64                       # k per warp step (= the K multiple required)
SMEM_LIMIT_BYTES = 227 * 1024     # dynamic SMEM per CTA on sm_90 / sm_100 (opt-in limit)
#: sm_120 / sm_121 (GeForce / workstation Blackwell): 99 KiB per block (the DSL's arch table) - 1 KiB static
_SMEM_LIMIT_BY_ARCH = {"sm_120a": 99 * 1024 - 1024, "sm_121a": 99 * 1024 - 1024}
#: Per-warp buffer of the step's 64 reciprocals of smooth, rounded to x's dtype: 32 pair words (lane l
#: writes k = 2l, 2l + 1); lane column t reads its 16 k as two 16-byte chunks at 32t and 32t + 16, so one
#: read's four addresses (one per t, broadcast over g) fall in four distinct 16-byte bank groups.
_RS_BYTES = STEP_K * 2
_SM_STAGE_BYTES = STEP_K * 2      # one step of smooth (32 lanes x one 16-bit pair)
_DT = {"bf16": BFloat16, "fp16": Float16}
_ONE_PAIR = {"bf16": 0x3F803F80, "fp16": 0x3C003C00}   # (1.0, 1.0) in the 16-bit type
# E2M1 decision thresholds (multiples of the scale) and whether a tie rounds up (>=) or down (>)
_THRESH = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# ---------------------------------------------------------------------------
# Configuration and validity
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cfg:
    dtype: str
    rank: int
    scale_layout: str
    warps: int
    mtiles: int


def _cfg_of(knobs: dict) -> _Cfg:
    return _Cfg(dtype=str(knobs["dtype"]), rank=int(knobs["rank"]), scale_layout=str(knobs["scale_layout"]),
                warps=int(knobs["warps"]), mtiles=int(knobs["mtiles"]))


def _pitch(rank: int) -> int:
    """Byte pitch of a staged lora_down row: 2R + 16 (an odd number of 16-byte chunks)."""
    return 2 * rank + 16


#: Ranks whose x arrives through the SMEM ring instead of registers: there the register form keeps
#: a stack frame (rank 96: 8 bytes at 255 registers), the ring form does not (249).  Everywhere else
#: the register form is faster on the H200 (docs/PERF.md: 23.0 vs 31.6 us at M = 4608, K = 3072, R = 32).
_RING_RANKS = (96,)


def _uses_ring(cfg: _Cfg) -> bool:
    return cfg.rank in _RING_RANKS


def _x_stages(cfg: _Cfg) -> int:
    """Steps of x (and of smooth) in flight per warp: each is copied `_x_stages - 1` steps ahead.  With LoRA
    the tile of step i is committed between x of steps i and i + 1, which caps the useful depth at 3."""
    return 3 if cfg.rank else 4


def _x_stage_bytes(cfg: _Cfg) -> int:
    """One step of x for one warp: 32 lanes x (2 * mtiles) rows x two 16-byte chunks."""
    return 32 * 2 * cfg.mtiles * 2 * 16


#: Ranks whose register form stages lora_down in ONE tile buffer per warp: the next step's tile is copied after
#: this step's MMAs and lands during the next step's code work.  Two buffers hide that copy better, but double the
#: warp's SMEM, and the SM's L1 (through which x and the tiles are read) shrinks by as much.  H200, docs/PERF.md
#: session 19: rank 64 (two buffers: 74 KB per CTA, three CTAs leave about 6 KB of L1) 7-11 % faster with one;
#: rank 32 (42 KB per CTA with two) 14-18 % slower with one, rank 16 (at 4 CTAs per SM) 10-31 %.  The ring form
#: (rank 96) keeps two: its copies keep the x / tile order (see `_x_stages`).
_ONE_LORA_BUFFER_RANKS = (64,)


def _lora_bufs(cfg: _Cfg) -> int:
    """lora_down tile buffers per warp (see _ONE_LORA_BUFFER_RANKS)."""
    return 1 if cfg.rank in _ONE_LORA_BUFFER_RANKS and not _uses_ring(cfg) else 2


def _lora_tiles_bytes(cfg: _Cfg) -> int:
    return _lora_bufs(cfg) * STEP_K * _pitch(cfg.rank) if cfg.rank else 0


def _warp_smem(cfg: _Cfg) -> int:
    ring = _x_stages(cfg) * (_x_stage_bytes(cfg) + _SM_STAGE_BYTES) if _uses_ring(cfg) else 0
    return _RS_BYTES + _lora_tiles_bytes(cfg) + ring


def _smem_bytes(cfg: _Cfg) -> int:
    return cfg.warps * _warp_smem(cfg)


def _est_registers(cfg: _Cfg) -> int:
    """Rough per-thread register need (for the validity predicate; ptxas decides the real number)."""
    words = cfg.mtiles * 2 * 8
    acc = cfg.mtiles * (cfg.rank // 8) * 4
    return 3 * words + acc + 16 + 40


def _problem(cfg: _Cfg, arch: str) -> Optional[str]:
    want = _LAYOUT_BY_ARCH[arch]
    if cfg.scale_layout != want:
        return f"scale_layout {cfg.scale_layout!r} is not what {arch} uses ({want!r})"
    if cfg.rank % 16:
        return f"rank {cfg.rank} is not a multiple of 16 (mma k/n tiling)"
    smem = _smem_bytes(cfg)
    limit = _SMEM_LIMIT_BY_ARCH.get(arch, SMEM_LIMIT_BYTES)
    if smem > limit:
        ring = f"{_x_stages(cfg)} x stages of {_x_stage_bytes(cfg)} B, " if _uses_ring(cfg) else ""
        return (f"needs {smem} B of dynamic SMEM ({cfg.warps} warps x {_warp_smem(cfg)} B: {ring}rank {cfg.rank} "
                f"lora_down tiles of {_lora_tiles_bytes(cfg)} B), more than the {limit} B a CTA may use on {arch}")
    regs = _est_registers(cfg)
    if regs > 255:
        return (f"needs about {regs} registers per thread (mtiles {cfg.mtiles} x rank {cfg.rank} fp32 "
                f"accumulators + x buffers), more than 255")
    return None


#: ``.minnctapersm`` per arch and rank for CTAs of 4 warps with one m-tile each (0: no hint).  A value above 1 is
#: an occupancy target and scales with the warps (4 / warps as many CTAs, at least 1); 1 only lifts ptxas' own
#: register target and stays 1.  Two m-tiles per warp take at most 1.  H200, M = 4608 and 1024 (docs/PERF.md,
#: session 19):
#: * ranks 0-32: 1 (115 / 140 / 149 registers, 4 / 3 / 3 CTAs).  4 CTAs took R = 16 / 32 to 128 registers with no
#:   stack frame and the same SASS count, and made them 5-23 % slower (best form against best form): 4 CTAs of
#:   42 KB leave the SM about 60 KB of L1 instead of about 120, and x and the lora_down tiles are read through L1
#:   (forced to a 3-CTA carveout, the 128-register build ran as fast as the 149-register one); R = 0 at 5 CTAs
#:   (96 registers) tied;
#: * rank 48: 3 (168 registers, was 206 and 2 CTAs; 5 % more instructions, 6-19 % faster);
#: * 0: rank 64 (ptxas alone takes 164 registers, 3 CTAs; with two lora_down buffers the hint gave 172, and 4 CTAs
#:   an 8-byte stack frame), rank 96 (near 255 registers, where the hint made ptxas spill more), rank 128 on sm_90a
#:   (168 registers, no stack frame; its SMEM holds one CTA per SM anyway);
#: * rank 128 on sm_100a / sm_103a: 1 (without it ptxas stops at 168 registers with a 24-byte stack frame; with
#:   it 206, none); on sm_120a / sm_121a (2-warp CTAs, 100 KiB per SM): 1 (without it 168 registers and a
#:   16-byte stack frame; with it 214, none), and 1 below rank 64 as on sm_90a.
_MIN_CTAS_SM90 = {0: 1, 16: 1, 32: 1, 48: 3, 64: 0, 96: 0, 128: 0}
_MIN_CTAS_SM100 = {**_MIN_CTAS_SM90, 128: 1}
_MIN_CTAS_SM120 = {0: 1, 16: 1, 32: 1, 48: 1, 64: 0, 96: 0, 128: 1}
_MIN_CTAS = {"sm_90a": _MIN_CTAS_SM90, "sm_100a": _MIN_CTAS_SM100, "sm_103a": _MIN_CTAS_SM100,
             "sm_120a": _MIN_CTAS_SM120, "sm_121a": _MIN_CTAS_SM120}


def min_ctas_per_sm(cfg: _Cfg, arch: str) -> int:
    """The kernel's ``.minnctapersm`` (0: none), from `_MIN_CTAS`."""
    ctas = _MIN_CTAS[arch][cfg.rank]
    if cfg.mtiles != 1:
        return min(ctas, 1)
    return ctas if ctas <= 1 else max(1, ctas * 4 // cfg.warps)


def smem_bytes_for(knobs: dict) -> int:
    return _smem_bytes(_cfg_of(knobs))


def threads_for(knobs: dict) -> int:
    return 32 * int(knobs["warps"])


# ---------------------------------------------------------------------------
# Inline-PTX helper (LLVM inline asm, $N operands)
# ---------------------------------------------------------------------------

# Cache policy of the loads (measured on an H200, M=4608, K=15360, R=32: cp.async.ca 100 us vs .cg 125 us --
# co-resident CTAs work on the same k steps at about the same time, so the lora_down tiles hit in L1;
# an L2::256B prefetch hint on the x stream made no difference).  The x loads allocate in L1 (session 4 of
# docs/PERF.md: 1-5 % faster than L1::no_allocate).  A likely reason: a lane's two 16-byte loads of a row
# are the two halves of the same 32-byte sectors, which no_allocate made L2 send twice.
_CP_CACHE = "ca"
#: Diagnosis builds only: SVDQ_KERNEL_QUANT_PROBE=1 at build time makes every R > 0 variant write, per CTA, its SM
#: id and its first / last %globaltimer reading into lora_act_in (32 bytes per CTA) instead of the LoRA sums
#: (tools/quant_timeline.py reads them).  A kernel build switch: it enters the cache key and the build fingerprint
#: (svdq_aot.cache), so such cubins are never mixed with plain ones.
_PROBE = os.environ.get("SVDQ_KERNEL_QUANT_PROBE") == "1"
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


def _rs_chunk(t, i):
    """Byte offset in the reciprocal buffer of lane column t's i-th 16-byte chunk (k = 16t + 8i .. + 7)."""
    return 32 * t + 16 * i


def _srow(kk):
    """Staged row of lora_down row kk (0 <= kk < 64) of a step.  Real k = 16t + 4j + 2h + e is the mma B
    operand's virtual k 16j + 8h + 2t + e (lane column t's own x̂ words, no shuffling); its row is
    16j + 8h + t + 4e.  The 8 rows an ldmatrix reads for one matrix (t = 0..3, e = 0..1) are then 8 rows in
    a row (distinct bank groups at the odd pitch), and the two lora_down rows of a 128-byte line (e = 0, 1)
    lie 4 rows apart, so a line's 8 chunks land in 8 distinct bank groups too (rows 1 apart, the first
    order, made every copy take 8 wavefronts instead of 4 on the H200).  A bit permutation of kk, for ints
    and DSL integers alike: _srow(a + b) = _srow(a) + _srow(b) where a and b share no bit."""
    return (kk >> 4) + 4 * (kk & 1) + 8 * ((kk >> 1) & 1) + 16 * ((kk >> 2) & 3)


def _ldsm_row(mv):
    """The staged row (within its 8-row matrix block) that lane mv (0..7) of an ldmatrix matrix points at:
    virtual k 2t + e of the block, so t = mv // 2, e = mv % 2 (see `_srow`)."""
    return (mv >> 1) + 4 * (mv & 1)


def _lora_copy_slot(lane, i, nchunk: int):
    """(lora_down row kk of the step, 16-byte chunk c) that `lane` copies with the i-th of a step's 2 * nchunk
    copies, for R / 8 = nchunk a power of two: chunk lane + 32 i of the tile, so a copy's 8 consecutive lanes
    read one 128-byte line.  kk = the lane's row + the copy's row on disjoint bits (so `_srow` splits)."""
    return lane // nchunk + i * (32 // nchunk), lane % nchunk


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


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


class _QuantizeAct:
    def __init__(self, cfg: _Cfg, arch: str = "sm_90a"):
        self.cfg = cfg
        self.dt = cfg.dtype
        self.R = cfg.rank
        self.W = cfg.warps
        self.MT = cfg.mtiles
        self.rows_cta = 16 * cfg.mtiles
        self.blocked = cfg.scale_layout == "blocked"
        self.P = _pitch(cfg.rank)
        self.warp_smem = _warp_smem(cfg)
        self.ring = _uses_ring(cfg)
        self.NS = _x_stages(cfg)
        self.xstage = _x_stage_bytes(cfg)
        self.smem_bytes = _smem_bytes(cfg)
        self.lbufs = _lora_bufs(cfg)
        self.min_ctas = min_ctas_per_sm(cfg, arch)

    @cute.jit
    def __call__(self, x: cute.Pointer, smooth: cute.Pointer, lora_down: cute.Pointer, act: cute.Pointer,
                 ascales: cute.Pointer, lora_act_in: cute.Pointer, workspace: cute.Pointer, m: Int32, k: Int32,
                 use_smooth: Int32, ksplit: Int32, ctas: Int32, stream: cuda.CUstream):
        self.kernel(x, smooth, lora_down, act, ascales, lora_act_in, workspace, m, k, use_smooth).launch(
            grid=[ctas, 1, 1], block=[32 * self.W, 1, 1], cluster=[ksplit, 1, 1], smem=self.smem_bytes,
            stream=stream, min_blocks_per_mp=self.min_ctas, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, smooth: cute.Pointer, lora_down: cute.Pointer, act: cute.Pointer,
               ascales: cute.Pointer, lora_act_in: cute.Pointer, workspace: cute.Pointer, m: Int32, k: Int32,
               use_smooth: Int32):
        W, MT, R, dt, P = self.W, self.MT, self.R, self.dt, self.P
        NG = 2 * MT                     # groups (rows) per lane per step
        cute.arch.griddepcontrol_wait()             # PDL: the previous grid's writes (x) are visible from here on
        if cutlass.const_expr(_PROBE):
            p_t0 = _asm("mov.u64 $0, %globaltimer;", (Int64,), [], "=l", True)
        cute.arch.griddepcontrol_launch_dependents()    # the GEMM may launch once every CTA of this grid runs
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        G, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        S = cute.arch.cluster_size()
        rank = cute.arch.block_idx_in_cluster()
        nsteps = k // STEP_K
        kg = k // 16                    # scale groups per row
        m_cover = m
        if cutlass.const_expr(self.blocked):
            m_cover = (m + 127) // 128 * 128
        tiles = (m_cover + (self.rows_cta - 1)) // self.rows_cta
        # ---- this CTA's work: a range [u0, u1) of the (row tile, step) units u = tile * nsteps + step ----
        # cluster (ksplit > 1): the cluster's tile, every step, its CTAs' warps round robin over the steps;
        # ksplit 1: CTA b of G takes [b U / G, (b + 1) U / G) of the U = tiles * nsteps units (its warps round
        # robin over each tile's part); the LoRA sums of a tile split over CTAs meet in the workspace
        U = tiles * nsteps                             # < 2^21 (M K < 2^31, 16 rows x 64 k per unit)
        cl = S > 1
        u0 = cutlass.select_(cl, (bid // S) * nsteps, Int32(range_start(Int64(bid), Int64(U), Int64(G))))
        u1 = cutlass.select_(cl, u0 + nsteps, Int32(range_start(Int64(bid + 1), Int64(U), Int64(G))))
        t_a = u0 // nsteps
        t_b = cutlass.select_(u1 > u0, (u1 - 1) // nsteps, t_a - 1)
        if t_b > t_a + 1:
            _asm("trap;", (), [], "")                  # fewer CTAs than tiles: a broken launch, never silent
        WS = W * S

        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=128)
        wbase = base.toint() + warp * self.warp_smem          # this warp's SMEM (Int32 shared address)
        rs_s = wbase
        lbuf = wbase + _RS_BYTES
        xring = lbuf + _lora_tiles_bytes(self.cfg)           # x_stages steps of x, then of smooth
        sring = xring + self.NS * self.xstage

        xb = x.toint()
        actb = act.toint()
        scb = ascales.toint()
        if cutlass.const_expr(R > 0):
            acc = cute.make_rmem_tensor((MT * (R // 8) * 4,), Float32)
        if cutlass.const_expr(not self.ring):
            nxt = cute.make_rmem_tensor((NG * 8,), Int32)
            sm_nxt = cute.make_rmem_tensor((1,), Int32)

        for seg in cutlass.range_constexpr(2):       # a CTA's range spans at most two tiles (ctas >= tiles)
            tile = t_a + seg
            if tile <= t_b:
                lo = cutlass.max(u0 - tile * nsteps, 0)
                hi = cutlass.min(u1 - tile * nsteps, nsteps)
                vw = lo + rank * W + warp                 # this warp's first step of the tile
                row0 = tile * self.rows_cta
                # ---- this lane's rows: q = 2*mt + h -> row0 + 16mt + 8h + g ----------
                rowv = []
                valid = []
                xrow = []
                for q in cutlass.range_constexpr(NG):
                    r = row0 + 16 * (q // 2) + 8 * (q % 2) + g
                    rowv.append(r)
                    valid.append(Int32(r < m))
                    rc = cutlass.min(r, m - 1)                         # clamp: never read past row m-1
                    xrow.append(rc * k + 16 * t)                       # element offset (M*K < 2^31)
                c = self._Ctx()
                s_last = hi - 1                                        # the last step of this CTA's part
                vals = dict(vw=vw, WS=WS, warp=warp, lane=lane, g=g, t=t, m=m, k=k, nsteps=nsteps, kg=kg,
                            m_cover=m_cover, use_smooth=use_smooth, rs_s=rs_s, lbuf=lbuf, xrow=xrow, rowv=rowv,
                            valid=valid, actb=actb, scb=scb, smooth=smooth, xb=xb, xring=xring, sring=sring,
                            s_last=s_last)
                for name, v in vals.items():
                    setattr(c, name, v)
                if cutlass.const_expr(R > 0):
                    acc.fill(0.0)
                    c.acc, c.ldb, c.nchunk = acc, lora_down.toint(), R // 8
                    c.lora_fast = (R // 8) & (R // 8 - 1) == 0             # R / 8 a power of two (R = 16, 32, 64, 128)
                    if cutlass.const_expr(c.lora_fast):
                        kk0, cc0 = _lora_copy_slot(lane, 0, R // 8)          # the lane's part (copy 0 adds 0)
                        c.lsb = lbuf + _srow(kk0) * P + cc0 * 16
                        c.lgb = c.ldb + Int64(kk0 * R + cc0 * 8) * 2

                if cutlass.const_expr(self.ring):
                    # ---- ring prologue: copies in the order the steps keep (x_i, L_i, x_i+1, L_i+1, ...) ----
                    # with LoRA: (x0, L0, x1); without: x of steps 0 .. NS-2
                    for j in cutlass.range_constexpr(self.NS - 1):
                        sj = cutlass.min(vw + j * WS, s_last)
                        self._copy_x(c, j, sj)
                        if use_smooth != 0:
                            self._copy_smooth(c, j, sj)
                        _cp_commit()
                        if cutlass.const_expr(R > 0 and j == 0):
                            self._copy_lora(c, 0, sj)
                            _cp_commit()
                else:
                    # ---- register prologue: the first step's x and smooth pair, then its lora_down tile ----
                    s0 = cutlass.min(vw, s_last)
                    for q in cutlass.range_constexpr(NG):
                        for hv in cutlass.range_constexpr(2):
                            v = _ld_v4(xb + Int64(xrow[q] + s0 * STEP_K + 8 * hv) * 2)
                            for i in cutlass.range_constexpr(4):
                                nxt[q * 8 + hv * 4 + i] = v[i]
                    sm_nxt[0] = _ld_pred_u32(smooth.toint() + (Int64(s0) * STEP_K + Int64(2 * lane)) * 2, use_smooth,
                                             _ONE_PAIR[dt])
                    c.nxt, c.sm_nxt = nxt, sm_nxt
                    if cutlass.const_expr(R > 0):
                        self._copy_lora(c, 0, s0)
                        _cp_commit()

                nmine = (hi - vw + WS - 1) // WS                       # this warp's steps (<= 0: none)
                if use_smooth != 0:
                    for it in cutlass.range(0, nmine, 1, unroll=1):
                        self._step(c, it, vw + it * WS, True)
                else:
                    for it in cutlass.range(0, nmine, 1, unroll=1):
                        self._step(c, it, vw + it * WS, False)

                # ---- LoRA epilogue: reduce the warps' partial sums, then store rows < m ----
                if cutlass.const_expr(R > 0):
                    _cp_wait(0)
                    cute.arch.sync_warp()
                    red = lbuf                                        # this warp's [rows_cta][R] fp32, pitch 4R
                    for rt in cutlass.range_constexpr(R // 16):
                        for q in cutlass.range_constexpr(2 * MT):
                            o = (rt * 2 * MT + q) * 4
                            rr0 = 16 * (q // 2) + 8 * (q % 2) + 2 * t          # CTA-local row of c0
                            rc = 16 * rt + g                                   # LoRA column of c0
                            _sts_f(red + (rr0 * R + rc) * 4, acc[o])
                            _sts_f(red + ((rr0 + 1) * R + rc) * 4, acc[o + 1])
                            _sts_f(red + (rr0 * R + rc + 8) * 4, acc[o + 2])
                            _sts_f(red + ((rr0 + 1) * R + rc + 8) * 4, acc[o + 3])
                    cute.arch.sync_threads()
                    npairs = self.rows_cta * R // 2
                    per_thr = (npairs + 32 * W - 1) // (32 * W)
                    assert _RS_BYTES + self.rows_cta * R * 4 + per_thr * 32 * W * 8 <= self.warp_smem   # the sums fit
                    lab = lora_act_in.toint()
                    b0 = base.toint() + _RS_BYTES
                    tot = cute.make_rmem_tensor((2 * per_thr,), Float32)
                    for i in cutlass.range_constexpr(per_thr):
                        idx = tid + 32 * W * i
                        rr = idx // (R // 2)
                        cc = (idx % (R // 2)) * 2
                        s0v = Float32(0.0)
                        s1v = Float32(0.0)
                        for w in cutlass.range_constexpr(W):
                            pv = _lds_v2f(b0 + w * self.warp_smem + (rr * R + cc) * 4)
                            s0v = s0v + pv[0]
                            s1v = s1v + pv[1]
                        tot[2 * i] = s0v
                        tot[2 * i + 1] = s1v
                    store = Int32(rank == 0)
                    if S > 1:
                        # the cluster's other CTAs hold partial sums of the same rows: each leaves its sums in its own
                        # SMEM (warp 0's tile buffers, past its partials: no thread reads there any more), a cluster
                        # barrier publishes them, rank 0 adds them in rank order (mapa + ld.shared::cluster), and a
                        # second barrier keeps every CTA (and its SMEM) alive until rank 0 has read it
                        sums = b0 + self.rows_cta * R * 4
                        if rank != 0:
                            for i in cutlass.range_constexpr(per_thr):
                                _sts_v2(sums + (tid + 32 * W * i) * 8, tot[2 * i], tot[2 * i + 1])
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                        if rank == 0:
                            for r in cutlass.range(1, S, unroll=1):
                                for i in cutlass.range_constexpr(per_thr):
                                    pv = _ld_cluster_v2f(sums + (tid + 32 * W * i) * 8, r)
                                    tot[2 * i] = tot[2 * i] + pv[0]
                                    tot[2 * i + 1] = tot[2 * i + 1] + pv[1]
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                    elif (lo != 0) | (hi != nsteps):
                        # the tile is split over CTAs b_first .. b_last: each writes its sums to its own slot of the
                        # workspace and arrives on the tile's counter (b_first's); the last to arrive adds the slots in
                        # CTA order (the same sum whoever is last), stores the rows and resets the counter
                        # the grid size read again here (volatile), so that it is not kept live through the steps
                        Gv = Int64(_asm("mov.u32 $0, %nctaid.x;", (Int32,), [], "=r", True))
                        tu = Int64(tile) * nsteps
                        b_first = Int32(cta_of_unit(tu, Int64(U), Gv))
                        b_last = Int32(cta_of_unit(tu + nsteps - 1, Int64(U), Gv))
                        wsb = workspace.toint()
                        parts = wsb + workspace_counter_bytes(Gv)
                        slot_bytes = self.rows_cta * R * 4
                        mine = parts + (Int64(bid) * 2 + Int64(tile != t_a)) * slot_bytes
                        for i in cutlass.range_constexpr(per_thr):
                            idx = tid + 32 * W * i
                            _st_v2f_pred(mine + idx * 8, tot[2 * i], tot[2 * i + 1], Int32(idx < npairs))
                        # the CTA's slot writes, then one thread's GPU-scope fence and arrival (acq_rel): the barrier
                        # orders every thread's writes before the fence, and the last arrival's reads after the arrival
                        cute.arch.sync_threads()
                        if tid == 0:
                            _fence_gpu()
                            _sts_u32(rs_s, _arrive(wsb + Int64(b_first) * 8))   # warp 0's smooth buffer: free here
                        cute.arch.sync_threads()
                        store = Int32(_lds_u32(base.toint()) == b_last - b_first + 1)
                        if store != 0:
                            for i in cutlass.range_constexpr(2 * per_thr):
                                tot[i] = Float32(0.0)
                            for b in cutlass.range(b_first, b_last + 1, 1, unroll=1):
                                first_tile = Int32(range_start(Int64(b), Int64(U), Gv)) // nsteps
                                sb = parts + (Int64(b) * 2 + Int64(first_tile != tile)) * slot_bytes
                                for i in cutlass.range_constexpr(per_thr):
                                    idx = cutlass.min(tid + 32 * W * i, npairs - 1)
                                    pv = _ld_relaxed_v2f(sb + idx * 8)
                                    tot[2 * i] = tot[2 * i] + pv[0]
                                    tot[2 * i + 1] = tot[2 * i + 1] + pv[1]
                            if tid == 0:
                                _st_u64(wsb + Int64(b_first) * 8, Int64(0))
                    for i in cutlass.range_constexpr(per_thr):
                        idx = tid + 32 * W * i
                        rr = idx // (R // 2)
                        cc = (idx % (R // 2)) * 2
                        row = row0 + rr
                        ok = Int32((row < m) & (idx < npairs) & (store != 0))
                        if cutlass.const_expr(_PROBE):
                            ok = Int32(0)
                        _st_u32_pred(lab + (Int64(cutlass.min(row, m - 1)) * R + cc) * 2,
                                     _pack_pair(tot[2 * i], tot[2 * i + 1], dt), ok)
                    cute.arch.sync_threads()          # the next tile's copies reuse the SMEM read above

        if cutlass.const_expr(_PROBE and R > 0):
            # diagnosis build only: per CTA (SM id, t_start, t_end) into lora_act_in
            cute.arch.sync_threads()
            if tid == 0:
                p_t1 = _asm("mov.u64 $0, %globaltimer;", (Int64,), [], "=l", True)
                smid = _asm("mov.u32 $0, %smid;", (Int32,), [], "=r", True)
                pa = lora_act_in.toint() + Int64(bid) * 32
                _asm("st.global.v2.u32 [$0], {$1, $1};", (), [pa, smid], "l,r")
                _asm("st.global.u64 [$0], $1;", (), [pa + 8, p_t0], "l,l")
                _asm("st.global.u64 [$0], $1;", (), [pa + 16, p_t1], "l,l")

    class _Ctx:
        """Trace-time bag of the kernel's per-thread values (keeps the loop body out of the AST rewrite)."""

    def _copy_x(self, c, slot, step):
        """cp.async this lane's x of `step` into ring slot `slot`: chunk (row q, half hv) at
        slot + (2q + hv) * 512 + 16 * lane (a warp's 16-byte accesses to one chunk index are contiguous)."""
        base = c.xring + slot * self.xstage + 16 * c.lane
        for q in range(2 * self.MT):
            for hv in range(2):
                _cp_async16_cg(base + (2 * q + hv) * 512, c.xb + Int64(c.xrow[q] + step * STEP_K + 8 * hv) * 2)

    def _copy_smooth(self, c, slot, step):
        """cp.async the lane's smooth pair (k = 2*lane, 2*lane + 1 of `step`) into ring slot `slot`."""
        _cp_async4(c.sring + slot * _SM_STAGE_BYTES + 4 * c.lane,
                   c.smooth.toint() + (Int64(step) * STEP_K + Int64(2 * c.lane)) * 2)

    def _copy_lora(self, c, buf, step):
        """cp.async the [64, R] lora_down tile of `step` into tile buffer `buf` (rows in the ldmatrix order).

        Lane l copies the 16-byte chunks l + 32 i (row kk = chunk // (R / 8)).  Where R / 8 is a power of
        two, kk = kk0 + i * 32 / (R / 8) with the lane's kk0 < 32 / (R / 8) on other bits than the i part
        (`_lora_copy_slot`), and `_srow` moves each bit of kk to a bit of its own, so both addresses are a
        per-lane base (made once per kernel) plus the step's offset plus a constant per i: no per-step
        index arithmetic."""
        R, P = self.R, self.P
        nb = c.lbuf + buf * (STEP_K * P)
        if c.lora_fast:
            sb = c.lsb + buf * (STEP_K * P)
            gb = c.lgb + Int64(step) * (STEP_K * R * 2)
            for i in range((STEP_K * c.nchunk) // 32):
                kk_i, _ = _lora_copy_slot(0, i, c.nchunk)             # the copy's part (lane 0 adds 0)
                _cp_async16(sb + _srow(kk_i) * P, gb + kk_i * R * 2)
            return
        for i in range((STEP_K * c.nchunk) // 32):
            ch = c.lane + 32 * i
            kk = ch // c.nchunk
            cc = ch % c.nchunk
            _cp_async16(nb + _srow(kk) * P + cc * 16, c.ldb + ((Int64(step) * STEP_K + Int64(kk)) * R + cc * 8) * 2)

    def _step(self, c, it, s, smoothing):
        """One K step of one warp (plain Python at trace time); smoothing: trace the x / smooth path.

        Copies in flight keep the order x_i, L_i, x_i+1, L_i+1, ... (L = lora_down tile): step i commits
        L_i+1 and x_i+NS-1, then waits for x_i (and, before its MMAs, for L_i)."""
        W, MT, R, dt, P, NS = self.W, self.MT, self.R, self.dt, self.P, self.NS
        NG = 2 * MT
        warp, lane, t, m, k, nsteps, kg, m_cover = c.warp, c.lane, c.t, c.m, c.k, c.nsteps, c.kg, c.m_cover
        rs_s, lbuf, rowv, valid = c.rs_s, c.lbuf, c.rowv, c.valid
        actb, scb = c.actb, c.scb
        if R > 0:
            acc = c.acc
        if self.ring:
            cute.arch.sync_warp()                         # everyone is done with the last rs / tile reads
            # copies for later steps (clamped to a valid step: the last one is re-read, harmlessly)
            if R > 0:
                self._copy_lora(c, (it + 1) % 2, cutlass.min(s + c.WS, c.s_last))
                _cp_commit()
            sn = cutlass.min(s + (NS - 1) * c.WS, c.s_last)
            slot_n = (it + NS - 1) % NS
            self._copy_x(c, slot_n, sn)
            if smoothing:
                self._copy_smooth(c, slot_n, sn)
            _cp_commit()
            # x (and smooth) of this step: newer than it are x_i+NS-1 and, with LoRA, L_i+1, x_i+1, L_i
            _cp_wait(4 if R > 0 else NS - 1)
            slot = it % NS
            xs = c.xring + slot * self.xstage + 16 * lane
            cur = []
            for q in range(NG):
                for hv in range(2):
                    cur.extend(list(_lds_v4(xs + (2 * q + hv) * 512)))
            if smoothing:
                sm_cur = _lds_u32(c.sring + slot * _SM_STAGE_BYTES + 4 * lane)
        else:
            nxt, sm_nxt = c.nxt, c.sm_nxt
            cur = [nxt[i] for i in range(NG * 8)]
            sm_cur = sm_nxt[0]
            cute.arch.sync_warp()                         # everyone is done with the last rs / tile reads
            # the next step's x and smooth into registers (clamped: the last step is re-read, harmlessly)
            sn = cutlass.min(s + c.WS, c.s_last)
            for q in range(NG):
                for hv in range(2):
                    v = _ld_v4(c.xb + Int64(c.xrow[q] + sn * STEP_K + 8 * hv) * 2)
                    for i in range(4):
                        nxt[q * 8 + hv * 4 + i] = v[i]
            if smoothing:
                sm_nxt[0] = _ld_pred_u32(c.smooth.toint() + (Int64(sn) * STEP_K + Int64(2 * lane)) * 2,
                                         c.use_smooth, _ONE_PAIR[dt])
            if R > 0 and self.lbufs == 2:
                self._copy_lora(c, (it + 1) % 2, sn)
                _cp_commit()

        if smoothing:
            # reciprocals of smooth for the step's 64 k: lane computes k = 2*lane, 2*lane + 1
            s_lo, s_hi = _f32_pair(sm_cur, dt)
            _sts_u32(rs_s + 4 * lane, _pack_pair(_rcp16(s_lo), _rcp16(s_hi), dt))
            cute.arch.sync_warp()
            rs = []
            for i in range(2):
                rs.extend(list(_lds_v4(rs_s + _rs_chunk(t, i))))

        # ---- x̂ as 16-bit pair words; amax per group ------------------------
        xh = []
        aws = []
        amaxes = []
        for q in range(NG):
            if smoothing:
                wq = []
                for i in range(8):
                    wq.append(_mul_pair(cur[q * 8 + i], rs[i], dt))
            else:
                wq = [cur[q * 8 + i] for i in range(8)]
            xh.append(wq)
            aws.append([w & Int32(0x7FFF7FFF) for w in wq])
            amaxes.append(_amax_pairs(aws[-1], dt))

        # ---- scales and codes ------------------------------------------------
        for qp in range(MT):
            qa, qb = 2 * qp, 2 * qp + 1
            sca = _div6(amaxes[qa])
            scb_ = _div6(amaxes[qb])
            bytes2, dec_a, dec_b = _e4m3_pair(sca, scb_)
            for q, byte, dec in ((qa, bytes2 & 0xFF, dec_a), (qb, (bytes2 >> 8) & 0xFF, dec_b)):
                # a group's code work sits in a branch taken by rows the launch covers: the branch keeps ptxas
                # from sinking the next step's x loads (issued above, used by the next step) to the loop's end.
                # At ranks 48-96 ptxas then guards the later warp barriers with collective paths; without the
                # branch it does not, but those ranks ran up to 31 % slower (docs/PERF.md, session 20)
                cutlass.if_generate(rowv[q] < m_cover,
                                    lambda q=q, byte=byte, dec=dec: self._codes(c, s, xh[q], aws[q], amaxes[q], byte,
                                                                                dec, rowv[q], valid[q]))

        # ---- LoRA-down MMAs over the staged tile, after the code work: 2-5 % faster at R = 32, M = 4608 than
        #      issuing them first (H200, docs/PERF.md, session 15) -------------------------------------------
        if R > 0:
            # L_i (newer: ring: x_i+NS-1, L_i+1, x_i+1; registers: L_i+1 with two buffers, none with one)
            _cp_wait(3 if self.ring else self.lbufs - 1)
            cute.arch.sync_warp()
            cb = lbuf + (it % 2) * (STEP_K * P) if self.lbufs == 2 else lbuf
            mq = lane // 8
            mv = lane % 8
            # lora_act_in^T[r, row] += lora_down^T[r, k] . x̂[row, k]: A = lora_down^T (ldmatrix.trans),
            # B = x̂ (the lane's own pair words: for block j, words 2j and 2j + 1 of each row).
            for j in range(4):
                for rt in range(R // 16):
                    sa = cb + (16 * j + 8 * (mq // 2) + _ldsm_row(mv)) * P + (16 * rt + 8 * (mq % 2)) * 2
                    a = _ldsm_x4_t(sa)
                    for q in range(NG):
                        o = (rt * NG + q) * 4
                        c4 = (acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                        d = _mma(dt, c4, a, (xh[q][2 * j], xh[q][2 * j + 1]))
                        for i in range(4):
                            acc[o + i] = d[i]
            if self.lbufs == 1:
                # one tile buffer: every lane is past its reads of L_i, then L_i+1 (the warp's next step, clamped:
                # the last one is re-read, harmlessly) goes in
                cute.arch.sync_warp()
                self._copy_lora(c, 0, cutlass.min(s + c.WS, c.s_last))
                _cp_commit()

    def _codes(self, c, s, xh, aws, amax, byte, dec, r, valid):
        """One group's E2M1 codes and scale byte, stored (row r; valid: r < m)."""
        dt, t, k, kg, m, m_cover = self.dt, c.t, c.k, c.kg, c.m, c.m_cover
        nonfin = amax.bitcast(Int32) >= Int32(0x7F800000)
        byte = cutlass.select_(nonfin, Int32(0x7F), byte)
        zero = nonfin | (dec == Float32(0.0))
        th = _thresholds(dec, dt)
        words = []
        for hw in range(2):
            ys = [_code_pair(xh[4 * hw + i], aws[4 * hw + i], th, dt) for i in range(4)]
            wv = _bytes4(ys)
            words.append(cutlass.select_(zero, Int32(0), wv))
        aoff = Int64(r * (k // 2) + s * (STEP_K // 2) + 8 * t)
        _st_v2_pred(c.actb + aoff, words[0], words[1], valid)
        if self.blocked:
            soff = (((r >> 7) * (kg // 4) + s) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + t)
            _st_u8_pred(c.scb + Int64(soff), cutlass.select_(r < m, byte, Int32(0)), Int32(r < m_cover))
        else:
            _st_u8_pred(c.scb + Int64(r * kg + s * 4 + t), byte, valid)


# ---------------------------------------------------------------------------
# Family contract
# ---------------------------------------------------------------------------


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.<arch>.quantize_act`` -> tuning dicts.  Keys ``warps``, ``mtiles`` (lists);
    defaults: one variant, warps=4, mtiles=1."""
    problems: list[str] = []
    for key in sorted(set(section) - set(TUNING)):
        problems.append(f"{key}: unknown key (allowed: {', '.join(TUNING)})")
    lists = {}
    for key, allowed in TUNING.items():
        vals = section.get(key, [DEFAULT_TUNING[key]])
        if not isinstance(vals, list) or not vals:
            problems.append(f"{key}: {vals!r}: expected a non-empty list")
            vals = []
        good = []
        for i, v in enumerate(vals):
            if isinstance(v, bool) or v not in allowed:
                problems.append(f"{key}[{i}]: {v!r}: not supported (allowed: {', '.join(map(str, allowed))})")
            elif v in good:
                problems.append(f"{key}[{i}]: {v!r}: duplicate value")
            else:
                good.append(v)
        lists[key] = good
    out = [dict(warps=w, mtiles=mt) for w in lists["warps"] for mt in lists["mtiles"]]
    return out, problems


def resolve(arch: str, knobs: dict) -> dict:
    out = dict(knobs)
    for key, v in DEFAULT_TUNING.items():
        if out.get(key, "auto") == "auto":
            out[key] = v
    return out


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    """The one validity predicate of this family: None if buildable, else why (with numbers)."""
    if arch not in ARCHS:
        return f"arch {arch} is not built by {NAME} (builds {', '.join(ARCHS)})"
    from svdq_aot.family import knob_problems
    problems = knob_problems(NAME, knobs, FEATURE_VALUES, TUNING)
    if problems:
        return problems
    return _problem(_cfg_of(knobs), arch)


def requirements(arch: str, knobs: dict) -> dict:
    """K must be a multiple of one warp step (64); any M >= 1."""
    return {"k_multiple": STEP_K}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile one variant for `arch` (no GPU needed); kernel symbol ``<name>_0``."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    cfg = _cfg_of(knobs)
    op = _QuantizeAct(cfg, arch)
    from svdq_loader.ops import QUANTIZE_ACT
    ck = compile_kernel(_QuantizeAct, op, QUANTIZE_ACT, dict(act=Uint8, ascales=Uint8), _DT[cfg.dtype], name, arch,
                        dump_dir, op.smem_bytes, keep_ptx=keep_ptx)
    if keep_ptx:
        ck.ptx = _read_ptx(ck.compiled, dump_dir)
    return ck


def _read_ptx(compiled: Any, dump_dir: str) -> Optional[str]:
    art = getattr(compiled.artifacts, "PTX", None)
    if isinstance(art, bytes):
        art = art.decode()
    if isinstance(art, str) and os.path.isfile(art):
        with open(art) as f:
            art = f.read()
    if isinstance(art, str) and ".entry" in art:
        return art
    for f in os.listdir(dump_dir):
        if f.endswith(".ptx") and compiled.function_name in f:
            with open(os.path.join(dump_dir, f)) as fh:
                return fh.read()
    return None

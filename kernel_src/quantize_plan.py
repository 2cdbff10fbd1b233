"""``quantize_act``'s plan: the configuration, the SMEM and register budgets its validity predicate quotes, the
occupancy hints, and the index arithmetic of the per-warp SMEM buffers (plain Python on ints, which the kernel
also applies to DSL integers; no DSL import).  ``kernel_src/quantize_kernel.py`` describes the kernel."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

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
#: (rank 96) keeps two: its copies keep the x / tile order (see `_x_stages`).  Two m-tiles per warp keep two as
#: well: their LoRA epilogue's 32 rows of sums need the SMEM (`_epilogue_bytes`: 16512 B at rank 64, one buffer
#: gives 9344), and with two CTAs per SM (253 registers) the L1 keeps about 80 KB.
_ONE_LORA_BUFFER_RANKS = (64,)


#: Experiment builds only (docs/PERF.md, session 57): SVDQ_KERNEL_QUANT_LORA at build time.  ``tile``, the default,
#: stages each step's lora_down tile in the warp's SMEM (above).  ``rk`` makes every R > 0 variant read lora_down
#: in the mma fragment order (`svdq_loader.ops.quantize_act.lora_fragments`, made once per layer) straight into
#: the mma A registers: one 16-byte load per fragment, no SMEM tiles, no ldmatrix, so a warp's SMEM is its
#: reciprocals and LoRA epilogue only and the SM keeps the rest as L1.  ``rk3`` is ``rk`` with a ``.minnctapersm`` of 3 CTAs of 4 warps (rank 32: 167 registers
#: instead of 183; ranks 48 and 64 then spill, and 4 CTAs spill at rank 32).  The ring form (rank 96) has no rk
#: form: such variants are refused in rk builds.  Read per call, so a test can set it; like every SVDQ_KERNEL_*
#: switch it enters the build cache key and the manifest.
LORA_ENV = "SVDQ_KERNEL_QUANT_LORA"
LORA_FORMS = ("tile", "rk", "rk3")


def lora_form() -> str:
    """This build's lora_down form (`LORA_ENV`; ``tile`` unless set)."""
    v = os.environ.get(LORA_ENV, "tile")
    if v not in LORA_FORMS:
        raise ValueError(f"{LORA_ENV}={v!r}: the quantize_act lora_down form must be one of {', '.join(LORA_FORMS)}")
    return v


def _lora_rk(cfg: _Cfg) -> bool:
    """Whether this variant reads lora_down in the fragment order into registers (`LORA_ENV`)."""
    return cfg.rank > 0 and not _uses_ring(cfg) and lora_form() != "tile"


def _lora_bufs(cfg: _Cfg) -> int:
    """lora_down tile buffers per warp (see _ONE_LORA_BUFFER_RANKS; two m-tiles keep two)."""
    return 1 if cfg.rank in _ONE_LORA_BUFFER_RANKS and cfg.mtiles == 1 and not _uses_ring(cfg) else 2


def _lora_tiles_bytes(cfg: _Cfg) -> int:
    """Bytes past the reciprocals in a warp's SMEM: its lora_down tile buffers, or in the rk form (no tiles) what the
    LoRA epilogue re-uses there."""
    if _lora_rk(cfg):
        return _epilogue_bytes(cfg) - _RS_BYTES
    return _lora_bufs(cfg) * STEP_K * _pitch(cfg.rank) if cfg.rank else 0


def _warp_smem(cfg: _Cfg) -> int:
    ring = _x_stages(cfg) * (_x_stage_bytes(cfg) + _SM_STAGE_BYTES) if _uses_ring(cfg) else 0
    return _RS_BYTES + _lora_tiles_bytes(cfg) + ring


def _smem_bytes(cfg: _Cfg) -> int:
    return cfg.warps * _warp_smem(cfg)


def _sums_per_thread(cfg: _Cfg) -> int:
    """LoRA sum pairs each thread adds up in the epilogue: the CTA's rows x R / 2 pairs over its threads."""
    threads = 32 * cfg.warps
    return (16 * cfg.mtiles * cfg.rank // 2 + threads - 1) // threads


def _epilogue_bytes(cfg: _Cfg) -> int:
    """Bytes of a warp's SMEM the LoRA epilogue re-uses (after the step loop): the reciprocals' buffer, the warp's
    [rows][R] fp32 partial sums, then the CTA's per-thread pair totals.  The kernel requires it to be at most
    `_warp_smem`, and the validity predicate refuses a configuration where it is not."""
    if not cfg.rank:
        return 0
    return _RS_BYTES + 16 * cfg.mtiles * cfg.rank * 4 + _sums_per_thread(cfg) * 32 * cfg.warps * 8


def _est_registers(cfg: _Cfg) -> int:
    """Rough per-thread register need (for the validity predicate; ptxas decides the real number)."""
    words = cfg.mtiles * 2 * 8
    acc = cfg.mtiles * (cfg.rank // 8) * 4
    return 3 * words + acc + 16 + 40


def _problem(cfg: _Cfg, arch: str) -> Optional[str]:
    want = _LAYOUT_BY_ARCH[arch]
    if cfg.rank and _uses_ring(cfg) and lora_form() != "tile":
        return (f"{LORA_ENV}={lora_form()} (an experiment build) reads lora_down into registers, which the ring form "
                f"of rank {cfg.rank} has no room for")
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
    epi = _epilogue_bytes(cfg)
    if epi > _warp_smem(cfg):
        return (f"the LoRA epilogue needs {epi} B of each warp's SMEM ({16 * cfg.mtiles} rows x rank {cfg.rank} fp32 "
                f"sums and the CTA's pair totals), more than the {_warp_smem(cfg)} B a warp has (its lora_down tiles "
                f"and reciprocals, which the epilogue re-uses): rank {cfg.rank} needs mtiles 1")
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
    if _lora_rk(cfg) and lora_form() == "rk3":
        ctas = 3
    if cfg.mtiles != 1:
        return min(ctas, 1)
    return ctas if ctas <= 1 else max(1, ctas * 4 // cfg.warps)


def smem_bytes_for(knobs: dict) -> int:
    return _smem_bytes(_cfg_of(knobs))


def threads_for(knobs: dict) -> int:
    return 32 * int(knobs["warps"])



# ---------------------------------------------------------------------------
# Index arithmetic of the SMEM buffers
# ---------------------------------------------------------------------------

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

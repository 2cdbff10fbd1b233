"""The sm_90a GEMM's plan: tile, SMEM and register budgets, and the resource part of its validity predicate.

Pure Python (no DSL): the family (``sm90_wgmma_w4a4``) and the kernel (``sm90_wgmma_kernel``) both read it,
and every number a rejection gives comes from here.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from svdq_loader.ops.decode_act import IMAGE_INNER_ROWS, IMAGE_TILE_ROWS
from svdq_loader.ops.gemm_streamk import loop_unroll

from .gemm_features import GemmFeatures, gemm_feature_values

DEFAULT_TILE = (128, 128, 64)
DEFAULT_STAGES = 4
TILE_K = 64
THREADS = 256                    # coop: two warpgroups; ws: the consumer warpgroups
WS_THREADS = 384                 # ws: producer warpgroup 0 + consumer warpgroups 1 and 2
#: setmaxnreg only moves registers inside the CTA's launch allocation: the kernel starts at 168 registers
#: (65536 / 384, rounded down to 8), so 128 x producer + 256 x consumer must stay <= 384 x 168.  More and
#: the consumers' setmaxnreg.inc waits forever (a hang, seen on the H200 with 80 / 216).
WS_ENTRY_REGS = 65536 // WS_THREADS // 8 * 8          # 168
WS_CONSUMER_REGS = 216
WS_PRODUCER_REGS = (WS_THREADS * WS_ENTRY_REGS - 256 * WS_CONSUMER_REGS) // 128 // 8 * 8
assert 128 * WS_PRODUCER_REGS + 256 * WS_CONSUMER_REGS <= WS_THREADS * WS_ENTRY_REGS
#: tile_n 192 (ws, act_source images; run on an H100 in session 29, in configs/flux.yaml): THREE MMA warpgroups of
#: one 64-row atom each, 512 threads, so 128 registers per thread at launch.  The images producer (one thread issues
#: the bulk copies) drops to 24, the MMA warps rise to 160: 128 x 24 + 384 x 160 = 64512 <= 512 x 128.  Measured on
#: the CPU (session 23): the 128-row ws images tile compiles at 160 MMA registers, ranks 32 and 64, two and four weight
#: sets, with no stack frame and no full wgmma wait in its main loop; so does this tile at every rank 0-128.
WIDE_TILE_N = 192
WIDE_REGS = (65536 // 512 // 8 * 8, 24, 160)     # (at launch, producer, MMA warps)
assert 128 * WIDE_REGS[1] + 384 * WIDE_REGS[2] <= 512 * WIDE_REGS[0]
SMEM_LIMIT_BYTES = 227 * 1024
#: ranks the two-way split-K kernel compiles without a stack frame at more than 64 accumulator registers (the
#: 256-row images tile; session 14)
_SPLIT2_WIDE_RANKS = (0, 16, 32, 64)
MAX_ACC_REGS = 128               # fp32 accumulators per thread we allow (the rest: fragments, raws)


@dataclasses.dataclass(frozen=True)
class _Cfg(GemmFeatures):
    tile_m: int
    tile_n: int
    stages: int
    prefetch: int = 1
    skip_pad: bool = False
    act_decode: str = "shift"
    schedule: str = "coop"
    wsets: int = 2
    act_source: str = "nvfp4"
    compute: str = "exact"       # "fp8": the FP8-compute mode (op gemm_w4a4_fp8; family sm90_wgmma_w4a4_fp8)
    weights: str = "regs"        # FP8-compute mode: where the weights are decoded from (`FP8_WEIGHT_PATHS`)


def _cfg_of(knobs: dict, compute: str = "exact") -> _Cfg:
    return _Cfg(*gemm_feature_values(knobs),
                int(knobs["tile_m"]), int(knobs["tile_n"]), int(knobs["stages"]), int(knobs["prefetch"]),
                bool(knobs["skip_pad"]), str(knobs["act_decode"]), str(knobs.get("schedule", "coop")),
                int(knobs.get("wsets", 2)), str(knobs.get("act_source", "nvfp4")), compute,
                str(knobs.get("weights", "regs")))


#: k per k-tile of the FP8-compute mode: one 128-byte stage row of E4M3, four 32-k FP8 wgmma steps (the exact mode's
#: k-tile, TILE_K, is one 128-byte row of fp16: four 16-k steps)
FP8_TILE_K = 128


def k_tile(cfg: _Cfg) -> int:
    """k per pipeline step (stage) of the form: TILE_K, or FP8_TILE_K in the FP8-compute mode."""
    return FP8_TILE_K if cfg.compute == "fp8" else TILE_K


#: The FP8-compute mode's forms: the warp-specialised images schedule (its activations arrive as E4M3 stage images,
#: so the producer only copies) with two MMA warpgroups, whole tiles (``ws``) or equal ranges of (tile, k-tile
#: group) units whose split tiles meet in the workspace past the E4M3 image (``ws_streamk``, bf16 output and weights
#: regs, staged or lut: session 32).  Split K and the 192-row tile are not built for it.
FP8_SCHEDULES = ("ws", "ws_streamk")


#: The FP8-compute MMA warps' weight fragment buffers (an experiment: correct, and slower at 13 of 15 points on an
#: H100, session 33; ``SVDQ_KERNEL_SM90_FP8_BUFFERS``, which like every ``SVDQ_KERNEL_*`` switch enters the build
#: cache key and the manifest): 2, the default, decodes k-tile kt + 1 after k-tile kt - 1's wgmmas are done (its
#: buffer is the one kt + 1 takes), so the decode sits between two k-tiles' MMAs; 3 decodes it right after k-tile kt's
#: wgmmas are issued, into the buffer k-tile kt - 2 used, so it overlaps the MMAs of kt - 1 and kt (session 27: the
#: FP8 main loop holds twice the exact one's decode per MMA cycle, and its GEMM issued on 37 % of cycles on an H100).
FP8_BUFFERS = int(os.environ.get("SVDQ_KERNEL_SM90_FP8_BUFFERS", "2"))
if FP8_BUFFERS not in (2, 3):
    raise ValueError(f"SVDQ_KERNEL_SM90_FP8_BUFFERS={FP8_BUFFERS}: the FP8-compute fragment buffers must be 2 or 3")


#: The output store of every sm_90a GEMM form (``SVDQ_KERNEL_SM90_STORE``, ``sm90_epilogue_ptx``): ``quads``, the
#: default, exchanges one transposed word between neighbouring lanes and stores 64 bits per lane, so a warp's store
#: fills whole 32-byte sectors; ``pairs``, the earlier form kept for side-by-side builds, stores one 32-bit word per
#: lane and fills half of each sector.  On an H100 (session 34), over the rank-32 bf16 forms at M = 1024 and 4608, the
#: quads took 0.91-1.02x the pairs' time in the exact forms (median 0.977) and 0.90-1.03x in the FP8 forms (median
#: 0.943); the gemv and 64-row forms were equal within 2 %.
#: ``bulk`` (an experiment, session 34; correct on an H100 and 0-12 % slower per variant than the quads, session 35,
#: so not the default): the unsplit ws forms stage the quads in SMEM, one padded row
#: per output row (``OUT_ROW_PAD`` bytes after each, so a warp's 8-row store hits every bank twice, the minimum), and
#: one thread per row then copies it to global memory with ``cp.async.bulk`` (the async proxy): the MMA warps go on
#: to the next tile while the copies drain.  The other schedules keep the quads.
STORE = os.environ.get("SVDQ_KERNEL_SM90_STORE", "quads")
if STORE not in ("pairs", "quads", "bulk"):
    raise ValueError(f"SVDQ_KERNEL_SM90_STORE={STORE!r}: the sm_90a output store must be one of pairs, quads, bulk")
OUT_ROW_PAD = 16


#: Where the FP8-compute mode's MMA warps get their weights from (the family's ``weights`` knob):
#: ``regs`` has each MMA warp load its raw weight words from global memory into registers (``wsets`` k-tiles ahead)
#: and decode its own fragments, between two k-tiles' wgmmas; ``staged`` keeps that register decode, but the
#: producer bulk-copies each k-tile's raw weight words and scales into the stage beside its activations, where the
#: MMA warps read them (no raw weight sets in their registers, so the 224- and 256-row tiles build; session 29, at
#: M = 4608, against the 208-row register form: 256 rows 5-7 % faster on the H200, 224 rows 12-13 % at N = 3072 on
#: an H100); ``smem`` has warpgroup 0 (which in an images form
#: only copies the activations) decode each k-tile's 128 weight rows once into an E4M3 stage beside the activation
#: stage, and the MMA warps issue shared-memory wgmmas only (an experiment form: correct on an H100 in session 28,
#: no faster; docs/PERF.md); ``lut`` is ``staged`` where the producer warpgroup (in ``staged`` one thread copies,
#: the other 127 idle) also turns each k-tile's block scales into byte tables in the stage, eight bytes per weight row
#: and 16-k group, e4m3(|e2m1| · scale · rw) for the eight E2M1 magnitudes, so the MMA warps decode a word by two
#: byte permutes and two sign ORs instead of 24 conversions and multiplies (session 32: the FP8 main loop's
#: decode, 780 of its 920 instructions per 16 QGMMA at 216 rows, sits between two k-tiles' wgmmas).
FP8_WEIGHT_PATHS = ("regs", "staged", "smem", "lut")
#: smem weights: the decoding warpgroup holds two k-tiles of raw weight words and scales for 128 rows (48 registers)
#: beside the decode's; at 88 and 104 it kept stack frames (CPU, session 28), so it gets 120 registers and the MMA
#: warps 192: 128 x 120 + 256 x 192 <= 384 x 168.
FP8_SMEM_REGS = (WS_ENTRY_REGS, 120, 192)
assert 128 * FP8_SMEM_REGS[1] + 256 * FP8_SMEM_REGS[2] <= WS_THREADS * WS_ENTRY_REGS


def fp8_smem_weights(cfg: _Cfg) -> bool:
    """The FP8-compute form decodes its weights into SMEM stages (`FP8_WEIGHT_PATHS`: smem)."""
    return cfg.compute == "fp8" and cfg.weights == "smem"


#: staged raw weights: one 64-row block's k-tile in a stage, its eight words per thread, then its 16 scale bytes per
#: quad of threads (the fragment format's bytes as they are)
FP8_RAW_WORD_BYTES = 128 * 32
FP8_RAW_BLOCK_BYTES = FP8_RAW_WORD_BYTES + 32 * 16
#: lut weights: one 64-row block's k-tile of byte tables after its words: for each of the k-tile's eight 16-k
#: groups g and each quad q of MMA threads (rows r0, r0 + 8), 16 bytes: the eight E4M3 bytes e4m3(|e2m1| · scale ·
#: rw) of row r0 (codes 0-7), then those of row r0 + 8, at (32 g + q) · 16
FP8_LUT_BYTES = 8 * 32 * 16
FP8_LUT_BLOCK_BYTES = FP8_RAW_WORD_BYTES + FP8_LUT_BYTES


def fp8_staged_weights(cfg: _Cfg) -> bool:
    """The FP8-compute form's producer bulk-copies the raw weight words into the stages (`FP8_WEIGHT_PATHS`:
    staged, and lut)."""
    return cfg.compute == "fp8" and cfg.weights in ("staged", "lut")


def fp8_lut_weights(cfg: _Cfg) -> bool:
    """The FP8-compute form's producer warpgroup also writes each k-tile's byte tables (`FP8_WEIGHT_PATHS`: lut)."""
    return cfg.compute == "fp8" and cfg.weights == "lut"


def fp8_raw_block_bytes(cfg: _Cfg) -> int:
    """Stage bytes of one 64-row block's k-tile of staged weights: words and scales, or words and tables (lut)."""
    return FP8_LUT_BLOCK_BYTES if fp8_lut_weights(cfg) else FP8_RAW_BLOCK_BYTES


def fp8_weight_store_offset(tidx, b: int, kb: int, h: int, i: int):
    """smem weights (FP8): the byte offset, in its weight stage, of register (kb, h, i) of block `b` that decoding
    thread `tidx` stores: four E4M3 values of weight row 64b + 16 (tidx // 32) + (tidx mod 32) // 4 + 8i at k
    32kb + 16h + 4 (tidx mod 4) (the wgmma A fragment of MMA thread `tidx` of warpgroup b), in the 128-byte-swizzled
    K-major stage: row r at 128 r, its 16-byte chunk c at chunk c ^ (r mod 8).  Works on ints and on the kernel's
    Int32 alike (the CPU test checks it against the DSL's own layout)."""
    g = (tidx % 32) // 4
    row = (tidx // 32) * 16 + g + 64 * b + 8 * i       # row mod 8 = g
    return row * 128 + ((2 * kb + h) ^ g) * 16 + 4 * (tidx % 4)


#: k-tiles (of 128 k) between two promotions of `fp8_promotes` (a multiple of every unrolled loop step, 2 and 4).
#: On an H100 (session 28), promoting after every two k-tiles met fp16's tolerance at K = 12288 but made the fp16
#: forms 1.25-1.46x slower (a full wgmma wait and three instructions per accumulator each time).  The error of an
#: unpromoted sum grows like sqrt(K) (2.2e-3 at K = 12288, over 2e-3); sums of at most 1024 k are expected near
#: sqrt(1024 / 12288) of that, 0.6e-3.
FP8_PROMOTE_KTILES = 8


def fp8_promotes(cfg: _Cfg) -> bool:
    """The FP8-compute form with fp16 output moves its accumulators into an fp32 sum in SMEM every
    `FP8_PROMOTE_KTILES` k-tiles, so no wgmma accumulator sums more than 1024 k (the register form; docs/design.md
    section 2: Hopper's FP8 tensor cores keep fewer bits than fp32 while they accumulate, and fp16's tolerance saw
    it from K = 12288 on)."""
    return cfg.compute == "fp8" and cfg.out_dtype == "fp16" and not fp8_smem_weights(cfg)


def promote_bytes(cfg: _Cfg) -> int:
    """SMEM of the fp32 sums of `fp8_promotes`: every MMA thread's accumulators (tile_m / 2 per 64-row atom)."""
    if not fp8_promotes(cfg):
        return 0
    atoms = cfg.tile_n // (64 * mma_warpgroups(cfg))
    return 128 * mma_warpgroups(cfg) * (cfg.tile_m // 2) * atoms * 4


def frag_buffers(cfg: _Cfg) -> int:
    """Weight fragment buffers of the MMA warps: two, or `FP8_BUFFERS` in the FP8-compute mode."""
    return FP8_BUFFERS if cfg.compute == "fp8" else 2


def k_unroll(cfg: _Cfg) -> int:
    """k-tiles per unrolled step of the main loops: two (the fragment double buffer), or the deepest register
    rotation, the MMA warps' weight sets or the producer's raw activation sets (more than two only in a ws
    producer that decodes NVFP4: `_problem`); with three fragment buffers (`frag_buffers`), a multiple of three."""
    u = loop_unroll(cfg.wsets, cfg.prefetch)
    nbuf = frag_buffers(cfg)
    return u if nbuf == 2 else u * nbuf // math.gcd(u, nbuf)


def _lora_chunk(rank: int) -> int:
    for c in (64, 32, 16):
        if rank % c == 0:
            return c
    return 16


#: schedule "gemv" (sm90_gemv_kernel): the knob values it has (it has no stages, weight sets or act forms: anything
#: else would only duplicate a variant).  gemv's `prefetch`: k-tiles of weight words read and decoded per ring wait
#: (1: per k-tile, the form that ran on the H200; 2: both k-tiles of a 128-k phase after one wait, compiled only)
GEMV_FIXED = dict(stages=4, skip_pad=True, act_decode="prmt", wsets=2, act_source="nvfp4")
#: gemv activation phases decoded at a time at tile_m 16 (a resident chunk: 8 x 4 KB)
GEMV_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class GemvLayout:
    """One gemv tile's threads, rings and SMEM (bytes); `ctas_per_sm` of them fit an SM (registers and SMEM), which
    the launch-time split assumes.

    * a per-thread weight ring of `ring` k-tiles (16 weight and 8 scale bytes per thread each);
    * tile_m 64: `ring / 2 + 1` raw activation slots of one 128-k phase each (256 copy tasks of 16 + 4 bytes) and two
      decoded fp16 phases of 64 rows (a double buffer, one CTA barrier per phase);
    * tile_m 16: two raw chunk buffers of GEMV_CHUNK phases (512 tasks of 16 + 4 bytes) and one decoded chunk of
      GEMV_CHUNK phases of 16 rows (two CTA barriers per chunk)."""
    tile_m: int
    tile_n: int
    ring: int
    ctas_per_sm: int

    @property
    def warps(self) -> int:
        return self.tile_n // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def raw_slots(self) -> int:
        """Raw activation slots: phases (tile_m 64) or chunks (tile_m 16)."""
        return self.ring // 2 + 1 if self.tile_m == 64 else 2

    @property
    def raw_tasks(self) -> int:
        """16-byte copy tasks per raw slot (each also copies 4 scale bytes)."""
        return 256 if self.tile_m == 64 else 4 * 16 * GEMV_CHUNK

    @property
    def w_ring_at(self) -> int:
        return 0

    @property
    def s_ring_at(self) -> int:
        return self.w_ring_at + self.ring * self.threads * 16

    @property
    def r_ring_at(self) -> int:
        return self.s_ring_at + self.ring * self.threads * 8

    @property
    def a_buf_at(self) -> int:
        return self.r_ring_at + self.raw_slots * self.raw_tasks * 20

    @property
    def a_buf_bytes(self) -> int:
        return 2 * 2 * 64 * 128 if self.tile_m == 64 else GEMV_CHUNK * 2 * 16 * 128

    def fits_registers(self, registers: int) -> bool:
        """Whether `ctas_per_sm` CTAs at `registers` per thread fit an SM's 64 K (allocated per warp, in 256s)."""
        return self.ctas_per_sm * self.warps * (-(-registers * 32 // 256) * 256) <= 65536

    @property
    def smem_bytes(self) -> int:
        return (self.a_buf_at + self.a_buf_bytes + 1023) // 1024 * 1024


#: (tile_m, tile_n) -> layout.  (64, 128): the form that ran on the H200 (session 9).  tile_n 64: half the rows per
#: CTA, so N = 3072 gives 48 tiles x 8 ranks = 384 CTAs, three per SM on 132 SMs (a ring of 6 keeps three CTAs
#: within an SM's 228 KB).  tile_m 16 (M <= 16 per tile): the activations of 8 phases resident at a time
GEMV_LAYOUTS = {(64, 128): GemvLayout(64, 128, ring=8, ctas_per_sm=2), (64, 64): GemvLayout(64, 64, ring=6, ctas_per_sm=3),
                (16, 128): GemvLayout(16, 128, ring=8, ctas_per_sm=2), (16, 64): GemvLayout(16, 64, ring=6, ctas_per_sm=3)}


def gemv_layout(cfg: _Cfg) -> GemvLayout:
    return GEMV_LAYOUTS[(cfg.tile_m, cfg.tile_n)]


def is_gemv(cfg: _Cfg) -> bool:
    return cfg.schedule == "gemv"


def _smem_plan(cfg: _Cfg) -> dict[str, int]:
    """Bytes of the activation stages and of one LoRA chunk.  coop: the LoRA chunk re-uses the stages' bytes
    (the epilogue runs after every warp is done with them); ws: the producer is already filling the stages for
    the next tile while the consumers run the epilogue, so the LoRA chunk has its own bytes after the stages,
    and the ring's 2 x stages mbarriers (8 bytes each) come last."""
    if is_gemv(cfg):
        total = gemv_layout(cfg).smem_bytes
        return dict(main_bytes=total, lora_bytes=0, total_bytes=total, lu_offset=0, la_offset=0, bar_offset=-1)
    main = cfg.stages * cfg.tile_m * TILE_K * 2
    w_at = (main + 1023) // 1024 * 1024
    if fp8_smem_weights(cfg):
        main = w_at + cfg.stages * cfg.tile_n * FP8_TILE_K     # the E4M3 weight stages after the activation ones
    elif fp8_staged_weights(cfg):
        main = w_at + cfg.stages * (cfg.tile_n // 64) * fp8_raw_block_bytes(cfg)    # the raw weight bytes
    lora = (cfg.tile_n + cfg.tile_m) * _lora_chunk(cfg.rank) * 2 if cfg.rank else 0
    la_in_chunk = cfg.tile_n * _lora_chunk(cfg.rank) * 2 if cfg.rank else 0
    if is_ws(cfg):
        lora_at = (main + 1023) // 1024 * 1024
        sum_at = lora_at + (lora + 1023) // 1024 * 1024        # the FP8 fp16 form's fp32 sums (fp8_promotes)
        bar_at = sum_at + (promote_bytes(cfg) + 1023) // 1024 * 1024
        meet_at = bar_at + 2 * cfg.stages * 8        # ws_streamk: the word through which a meeting's count is shared
        total = meet_at + (16 if is_streamk(cfg) else 0)
        out_at = (total + 127) // 128 * 128          # bulk_store: the staged output tile (16-byte aligned rows)
        if bulk_store(cfg):
            total = out_at + cfg.tile_m * out_row_bytes(cfg)
        total = (total + 1023) // 1024 * 1024
        return dict(main_bytes=main, lora_bytes=lora, total_bytes=total, lu_offset=lora_at,
                    la_offset=lora_at + la_in_chunk, bar_offset=bar_at, meet_offset=meet_at, w_offset=w_at,
                    sum_offset=sum_at, out_offset=out_at)
    total = (max(main, lora) + 1023) // 1024 * 1024
    return dict(main_bytes=main, lora_bytes=lora, total_bytes=total, lu_offset=0, la_offset=la_in_chunk,
                bar_offset=-1)


def _gemv_problem(cfg: _Cfg) -> Optional[str]:
    if (cfg.tile_m, cfg.tile_n) not in GEMV_LAYOUTS:
        tiles = ", ".join(f"{a}x{b}" for a, b in GEMV_LAYOUTS)
        return (f"schedule gemv with tile {cfg.tile_m}x{cfg.tile_n}: its tiles are {tiles} (warps of 16 weight rows; "
                f"tile_m 64 skips the n8 blocks of rows >= M, tile_m 16 keeps 8 phases of activations resident)")
    lay = gemv_layout(cfg)
    if cfg.prefetch > 2:
        return (f"schedule gemv with prefetch {cfg.prefetch}: the gemv loop reads and decodes one or two k-tiles of "
                f"weight words per ring wait (prefetch 1 or 2)")
    if lay.tile_m == 16 and cfg.prefetch != 1:
        return (f"schedule gemv with tile_m 16 and prefetch {cfg.prefetch}: the resident-chunk loop reads and decodes "
                f"one k-tile per ring wait (prefetch 1)")
    if lay.tile_m == 64 and lay.ctas_per_sm == 2 and cfg.prefetch == 2 and cfg.rank > 64:
        return (f"schedule gemv with tile_n {cfg.tile_n}, prefetch 2 and rank {cfg.rank}: two k-tiles of fragments and "
                f"the LoRA epilogue take 136-142 registers (measured at ranks 80-256), over the "
                f"{65536 // (2 * lay.threads)} that {lay.ctas_per_sm} CTAs of {lay.threads} threads per SM allow")
    for key, want in GEMV_FIXED.items():
        if getattr(cfg, key) != want:
            return (f"schedule gemv with {key} {getattr(cfg, key)!r}: the gemv form has no {key} knob (it runs as "
                    f"{key} {want!r}; another value would only build the same kernel twice)")
    return None


def _fp8_problem(cfg: _Cfg) -> Optional[str]:
    if cfg.schedule not in FP8_SCHEDULES or cfg.act_source != "images" or cfg.tile_n != 128:
        return (f"the FP8-compute mode with schedule {cfg.schedule}, act_source {cfg.act_source} and tile_n "
                f"{cfg.tile_n}: its forms are schedule {' or '.join(FP8_SCHEDULES)}, act_source images (the E4M3 "
                f"stage images of act_fp8), tile_n 128")
    if cfg.weights not in FP8_WEIGHT_PATHS:
        return f"weights {cfg.weights!r}: the FP8-compute weight path is one of {', '.join(FP8_WEIGHT_PATHS)}"
    if is_streamk(cfg) and (fp8_promotes(cfg) or cfg.weights == "smem"):
        return (f"schedule ws_streamk with out_dtype {cfg.out_dtype} and weights {cfg.weights}: the FP8-compute "
                f"stream-K form meets with the fp32 accumulators in registers, so it is built for bf16 output "
                f"(fp16's sums are promoted into SMEM) and weights regs, staged or lut")
    return None


def _problem(cfg: _Cfg) -> Optional[str]:
    if is_gemv(cfg):
        return _gemv_problem(cfg)
    if cfg.compute == "fp8":
        reason = _fp8_problem(cfg)
        if reason:
            return reason
    elif cfg.weights != "regs":
        return f"weights {cfg.weights!r}: the exact mode's MMA warps load and decode their own weights (regs)"
    if cfg.tile_n == WIDE_TILE_N:
        if cfg.schedule not in ("ws", "ws_streamk") or cfg.act_source != "images":
            return (f"tile_n {cfg.tile_n} with schedule {cfg.schedule} and act_source {cfg.act_source}: three MMA "
                    f"warpgroups leave {WIDE_REGS[1]} registers to the producer, enough for the one thread that "
                    f"bulk-copies stage images (ws or ws_streamk, act_source images, no cluster split) and not for a "
                    f"decoding producer")
        if cfg.tile_m > 128:
            return (f"tile {cfg.tile_m}x{cfg.tile_n}: {cfg.tile_m // 2} accumulator registers per MMA thread do not "
                    f"fit the {WIDE_REGS[2]} registers three MMA warpgroups leave each (512 threads, "
                    f"{WIDE_REGS[0]} per thread at launch); 64 or 128 rows do")
    elif cfg.tile_n % 128:
        return (f"tile_n {cfg.tile_n} with schedule {cfg.schedule}: a wgmma tile is whole 128-row weight tiles (two MMA "
                f"warpgroups of 64-row atoms) or 192 rows (three, ws images only); 64 rows is the gemv form's tile "
                f"only")
    atoms = cfg.tile_n // (64 * mma_warpgroups(cfg))
    acc = atoms * cfg.tile_m // 2
    if cfg.wsets != 2 and not is_ws(cfg):
        return (f"wsets {cfg.wsets} with schedule {cfg.schedule}: the weight register sets are the MMA warps' of "
                f"a warp-specialised schedule (coop loads weights one k-tile ahead with its activations)")
    if cfg.prefetch > 2 and (not is_ws(cfg) or cfg.act_source != "nvfp4"):
        return (f"prefetch {cfg.prefetch} with schedule {cfg.schedule} and act_source {cfg.act_source}: more than two "
                f"raw activation register sets belong to the producer warpgroup of a warp-specialised schedule that "
                f"decodes NVFP4 activations (coop holds them in every thread; an images producer loads none)")
    if is_streamk(cfg) and cfg.act_source != "images":
        return (f"schedule ws_streamk with act_source {cfg.act_source}: the stream-K meetings' workspace lies after "
                f"the stage images in the call's decode_act workspace (act_source images only)")
    if cfg.act_source == "images" and not is_ws(cfg):
        return (f"act_source images with schedule {cfg.schedule}: the bulk copies of the stage images are issued "
                f"by the producer warpgroup of a warp-specialised schedule (ws, ws_splitk2, ws_splitk4)")
    if cfg.act_source == "images":
        if cfg.tile_m not in IMAGE_TILE_ROWS + IMAGE_INNER_ROWS:
            return (f"tile_m {cfg.tile_m} with act_source images: the stage image covers whole tiles of "
                    f"{', '.join(map(str, IMAGE_TILE_ROWS))} rows, and {', '.join(map(str, IMAGE_INNER_ROWS))} "
                    f"where its tiles lie inside it (svdq_loader.ops.decode_act)")
    elif cfg.tile_m % 64:
        return (f"tile_m {cfg.tile_m} with act_source nvfp4: the producer decodes whole 64-row blocks (64, 128 or "
                f"256; 224 is an act_source images tile)")
    decoders = 128 if is_ws(cfg) else THREADS
    if cfg.act_source == "nvfp4" and cfg.tile_m * (TILE_K // 32) % decoders:
        return (f"tile_m {cfg.tile_m} with schedule {cfg.schedule}: its {cfg.tile_m} x {TILE_K // 32} 32-k activation "
                f"chunks per k-tile do not divide over the {decoders} decoding threads (the 64-row tile needs a "
                f"warp-specialised schedule: its 128 producer threads take one chunk each)")
    if acc > MAX_ACC_REGS:
        return (f"tile {cfg.tile_m}x{cfg.tile_n} needs {acc} fp32 accumulator registers per thread, "
                f"more than the {MAX_ACC_REGS} this kernel allows (255 registers in all, fragments and "
                f"raw prefetch need the rest)")
    if cfg.tile_n > 128 and cfg.tile_n != WIDE_TILE_N:
        if cfg.schedule == "coop":
            return (f"tile_n {cfg.tile_n} needs schedule ws: with coop every thread also holds the activation "
                    f"bytes, and the tile spilled (8-byte stack frames at 255 registers, ranks 64 and 128)")
        return (f"tile_n {cfg.tile_n}: two weight atoms per MMA warpgroup (128 accumulator + 64 fragment "
                f"registers) do not fit the {WS_CONSUMER_REGS} registers of an MMA thread; ptxas serialises every "
                f"wgmma instead (20 full waits for 20 HGMMA; measured 0.51-0.62x cuBLAS bf16 at M >= 4608 on the "
                f"H200)")
    if is_ws(cfg) and acc > 64 and cfg.rank >= 128:
        return (f"schedule {cfg.schedule} with tile_m={cfg.tile_m} and rank {cfg.rank}: {acc} accumulator registers and the "
                f"LoRA epilogue do not fit the {WS_CONSUMER_REGS} registers of an MMA thread (measured: 8-40 byte "
                f"stack frames at ranks 128 and 256)")
    if is_ws(cfg) and acc > 64 and cfg.prefetch > 1 and not cfg.skip_pad:
        return (f"schedule {cfg.schedule} with tile_m={cfg.tile_m}, prefetch {cfg.prefetch} and skip_pad off: the producer's two "
                f"raw sets and the row predicates do not fit its {WS_PRODUCER_REGS} registers (measured: 56-byte "
                f"stack frames)")
    if ksplit_of(cfg) > 1 and acc > 64 and cfg.act_source == "nvfp4":
        return (f"schedule {cfg.schedule} with tile_m={cfg.tile_m} and act_source nvfp4: at {acc} accumulator "
                f"registers the split-K kernel spills (measured: 8-byte stack frame at 168 registers; the images "
                f"form, whose producer does no decode, compiles without one)")
    if ksplit_of(cfg) == 2 and acc > 64 and cfg.rank not in _SPLIT2_WIDE_RANKS:
        return (f"schedule {cfg.schedule} with tile_m={cfg.tile_m} and rank {cfg.rank}: at {acc} accumulator "
                f"registers the two-way split-K kernel keeps a stack frame at ranks other than "
                f"{', '.join(map(str, _SPLIT2_WIDE_RANKS))} (measured: 8-byte stack frames at 168 registers for ranks "
                f"48, 80, 96 and 112; the four-way split compiles without one)")
    if ksplit_of(cfg) > 1 and cfg.stages * cfg.tile_m * TILE_K * 2 < THREADS * acc * 4:
        return (f"schedule {cfg.schedule}: the split-K partial sums ({THREADS} MMA threads x {acc} fp32 = "
                f"{THREADS * acc * 4} B) are exchanged through the activation stages, which hold only "
                f"{cfg.stages * cfg.tile_m * TILE_K * 2} B at {cfg.stages} stages")
    if cfg.prefetch > 1 and acc > 64 and cfg.schedule == "coop":
        return (f"prefetch {cfg.prefetch} with tile_m={cfg.tile_m}: a second raw-byte register set on top of "
                f"{acc} accumulator registers does not fit (measured: 8-byte stack frames at 255 registers for "
                f"ranks 0, 64, 256)")
    plan = _smem_plan(cfg)
    if plan["total_bytes"] > SMEM_LIMIT_BYTES:
        where = "separate LoRA chunk" if is_ws(cfg) else "LoRA chunk"
        sums = f", fp32 sums {promote_bytes(cfg)} B" if promote_bytes(cfg) else ""
        if bulk_store(cfg):
            sums += f", staged output tile {cfg.tile_m * out_row_bytes(cfg)} B (SVDQ_KERNEL_SM90_STORE=bulk)"
        stages = "weight and activation stages" if fp8_smem_weights(cfg) else "activation stages"
        return (f"needs {plan['total_bytes']} B of dynamic SMEM ({stages} {plan['main_bytes']} B, "
                f"{where} {plan['lora_bytes']} B{sums}), more than the {SMEM_LIMIT_BYTES} B of an sm_90 CTA")
    return None


def ring_slot(g, stages: int):
    """The ws ring's bookkeeping for a CTA's g-th k-tile (g counts across its tiles): (stage, parity).  The MMA
    warps wait on full[stage] for `parity`, the producer on empty[stage] for `parity ^ 1` (a fresh mbarrier
    passes a wait for parity 1, so the first pass over the ring does not block).  Plain operators: the kernel
    calls it on DSL integers, tests/test_sm90_schedule.py on Python integers."""
    return g % stages, (g // stages) & 1


def ring_step(gstep, stages: int):
    """The ws ring at the start of one unrolled step of the MMA warps' main loop: (stage, parity) of its first
    k-tile `gstep` (>= 0), as `ring_slot` gives them, with a shift and masks where `stages` is a power of two (a
    signed modulo and division cost ptxas about ten instructions per k-tile).  Plain operators, like `ring_slot`."""
    if stages & (stages - 1) == 0:
        return gstep & (stages - 1), (gstep >> (stages.bit_length() - 1)) & 1
    return gstep % stages, (gstep // stages) & 1


def ring_aligned(stages: int, unroll: int) -> bool:
    """Whether an unrolled step's k-tiles find their stages without a modulo (`ring_in_step`): the step spans whole
    turns of the ring, or the ring holds whole steps (every form of configs/flux.yaml: 4 stages, unroll 2, 4, 8)."""
    return unroll % stages == 0 or stages % unroll == 0


def ring_in_step(base, u: int, stages: int, unroll: int):
    """(stage, parity) of the u-th k-tile of an unrolled step (0 <= u < unroll), from `ring_step`'s `base` for its
    first k-tile, whose ring index is a multiple of `unroll` (a CTA's k-tiles come in whole steps: every segment,
    split-K share and tile is a multiple of the unroll).  Where the step spans whole turns of the ring
    (unroll % stages == 0) the stage is a trace-time constant; where the ring holds whole steps (stages % unroll
    == 0) it is the base plus u, with no wrap.  Otherwise (not `ring_aligned`) None: the caller takes
    `ring_slot` of the k-tile's index."""
    stage, parity = base
    if unroll % stages == 0:
        return u % stages, parity ^ ((u // stages) & 1)
    if stages % unroll == 0:
        return stage + u, parity
    return None


def ring_prev_stage(base, stages: int, unroll: int):
    """The stage of the k-tile before an unrolled step (the one whose wgmmas its first ``wait_group(1)`` retires),
    from the step's `ring_step` base, under the same conditions as `ring_in_step` (else None)."""
    stage, _ = base
    if unroll % stages == 0:
        return stages - 1
    if stages % unroll == 0:
        if stages & (stages - 1) == 0:
            return (stage + stages - 1) & (stages - 1)
        return (stage + stages - 1) % stages
    return None


def gemv_ring_start(ring: int, slot_bytes: int):
    """The gemv tile_m 16 weight ring's running offsets at k-tile 0: (read, refill) = (slot 0, slot ring - 1), in
    units of `slot_bytes` (the prologue fills slots 0 .. ring - 2)."""
    return 0, (ring - 1) * slot_bytes


def gemv_ring_next(read, slot_bytes: int, ring: int, select):
    """(read, refill) one k-tile on: the slot just read is the next one refilled (k-tile kt + ring - 1 is kt - 1
    modulo ring), and the read slot wraps after `ring` slots.  `select(cond, a, b)`: the kernel passes the DSL's
    select, tests/test_sm90_gemv.py a Python one, so both walk the ring with this one function."""
    nxt = read + slot_bytes
    return select(nxt == ring * slot_bytes, 0, nxt), read


def split_k_share(rank, num_kt, ksplit: int):
    """Split K: (first k-tile, k-tiles) of cluster rank `rank` when `ksplit` CTAs share a tile's `num_kt`."""
    nk = num_kt // ksplit
    return rank * nk, nk


#: schedule -> (warp-specialised, CTAs of a cluster that split one tile's K).  ws_splitk<S>: one tile per cluster
#: of S CTAs, each over K / S; ranks 1.. hand their partial sums to rank 0 through distributed SMEM
#: "gemv": the small-M form (sm90_gemv_kernel: mma.sync, no producer; its K split is chosen at launch)
#: "ws_streamk": ws over equal ranges of (tile, k-tile group) units, one persistent CTA per SM; a tile split over CTAs
#: meets in the workspace after the stage images (`svdq_loader.ops.gemm_streamk`; an experiment, timed in session 27)
SCHEDULES = {"coop": (False, 1), "ws": (True, 1), "ws_splitk2": (True, 2), "ws_splitk4": (True, 4),
             "gemv": (False, 1), "ws_streamk": (True, 1)}


def is_ws(cfg: _Cfg) -> bool:
    return SCHEDULES[cfg.schedule][0]


def ksplit_of(cfg: _Cfg) -> int:
    return SCHEDULES[cfg.schedule][1]


def is_streamk(cfg: _Cfg) -> bool:
    return cfg.schedule == "ws_streamk"


def bulk_store(cfg: _Cfg) -> bool:
    """Whether this form stages its output tile in SMEM and bulk-copies it (``STORE`` ``bulk``): the unsplit ws
    schedule only (split K and stream-K end a tile in their own meetings), at the tall tiles (208 rows and more:
    one CTA per SM with or without the staged tile, where the 64- and 128-row tiles would lose a CTA per SM to its
    SMEM), and not the 192-wide tile, whose 128 registers per thread leave an 8-byte stack frame with it (CPU,
    session 34)."""
    return STORE == "bulk" and cfg.schedule == "ws" and cfg.tile_m >= 208 and cfg.tile_n != WIDE_TILE_N


def out_row_bytes(cfg: _Cfg) -> int:
    """Bytes per staged output row (``bulk_store``): the tile's columns in 16-bit values, then ``OUT_ROW_PAD``."""
    return cfg.tile_n * 2 + OUT_ROW_PAD


def mma_warpgroups(cfg: _Cfg) -> int:
    """MMA warpgroups of a wgmma tile: two, or three at tile_n 192 (one 64-row atom each)."""
    return 3 if cfg.tile_n == WIDE_TILE_N else 2


def ws_regs(cfg: _Cfg) -> tuple[int, int, int]:
    """A ws CTA's registers per thread: (at launch, producer after setmaxnreg, MMA warps after setmaxnreg)."""
    if mma_warpgroups(cfg) == 3:
        return WIDE_REGS
    if fp8_smem_weights(cfg):
        return FP8_SMEM_REGS
    return WS_ENTRY_REGS, WS_PRODUCER_REGS, WS_CONSUMER_REGS


def threads_of(cfg: _Cfg) -> int:
    """Threads per CTA: two warpgroups (coop), a producer warpgroup and two (tile_n 192: three) MMA warpgroups
    (ws*), or one warp per 16 weight rows (gemv)."""
    if is_gemv(cfg):
        return gemv_layout(cfg).threads
    return 128 * (1 + mma_warpgroups(cfg)) if is_ws(cfg) else THREADS

"""SVDQuant W4A4 (NVFP4) GEMM for Hopper, ``sm_90a``, on ``wgmma`` -- CuTe-DSL, build time only.

Operator (fp32 accumulation; docs/design.md has the formula): ``y = (A·Wᵀ)·wcscale + bias + la·luᵀ``.

The kernel computes the transposed product ``Yᵀ[n, m] = Σ_k W[n,k]·A[m,k]`` with
``wgmma.m64nMk16`` (fp16 inputs, fp32 accumulators in registers):

* **Weights in registers.** Each of the two warpgroups owns ``tile_n/2`` rows of W
  (``tile_n/128`` wgmma M atoms).  The weight is stored in the Hopper fragment format
  (``svdq_loader.ops.sm90_weight_format``, written once by ``prepare_weight``): per 64x64
  block one 16-byte load gives a thread its four 16-k fragments and one 8-byte load its eight
  E4M3 scales.  Decode is exact: two shifts and two masks turn a nibble pair into the fp16
  bit patterns ``e2m1·2^-14``, one ``mul.f16x2`` by ``scale·2^7`` finishes it.  The
  fragments are wgmma's register-sourced A operand (double-buffered: k-tile t+1 is decoded
  while the wgmmas of k-tile t run).
* **Activations in swizzled SMEM.** All 256 threads dequantize the ``tile_m x 64`` activation
  k-tile (logical NVFP4, the layout ``quantize_act`` writes on sm_90a) into a 128-byte-swizzled
  K-major fp16 tile, ``stages`` (>= 3) deep: by default (``act_decode: prmt``) two byte forms
  per 32-bit word, then one byte permute and one mask per pair, then one ``mul.f16x2`` by the
  scale; with ``skip_pad`` rows >= m are not decoded (a tile without such rows takes the
  unpredicated path).  Raw bytes of k-tile t+2 are loaded into registers while k-tile t computes.  One barrier per
  k-tile (three stages make it sufficient: a stage is rewritten two k-tiles after it was read,
  and every warpgroup has waited for its previous wgmma group before that barrier).
* **Scale bookkeeping.** Both operands carry a factor ``2^-7``; the epilogue multiplies the
  accumulators by ``2^14·wcscale[n]`` (exact: a power of two), *then* adds LoRA as extra
  wgmmas into the same accumulators (``lora_up`` from SMEM as A, ``lora_act_in`` from SMEM as
  B, output dtype, rank in chunks of up to 64), then ``bias[n]``; predicated store of rows < m.
* **Persistent tiles.** grid = min(sm_count, tiles) CTAs (``sm_count`` is a host argument the
  loader fills from the device), each walking tiles ``blockIdx.x, +gridDim.x, ...``; within
  an M band the N tiles are adjacent, so CTAs running together share activation rows.

Two schedules (knob ``schedule``) run that same arithmetic:

* ``coop`` (above): the two warpgroups do everything, one CTA barrier per k-tile.
* ``ws``, warp-specialised, 384 threads.  Warpgroup 0 is the producer: it loads the raw
  activation bytes (``prefetch`` register sets), decodes them into the stages exactly as above
  and signals an mbarrier ring (``full[s]``: 128 arrivals; ``empty[s]``: one per MMA warp;
  the producer's first pass waits on parity 1, which a fresh barrier satisfies).  Warpgroups 1
  and 2 only load and decode their weight fragments (two raw sets, two k-tiles ahead), wait on
  ``full``, issue the wgmmas, hand a stage back after the next k-tile's ``wait_group(1)``, and
  run the epilogue while the producer already fills the stages of their next tile (so the LoRA
  chunk has SMEM of its own).  ``setmaxnreg`` gives the producer ``WS_PRODUCER_REGS`` and the
  MMA warps ``WS_CONSUMER_REGS`` out of the launch allocation of 384 x 168 registers.

Launch ABI: host args = the op's (9 pointers, m, n, k, sm_count, stream); kernel params =
the 9 pointers and m, n, k.  block = (256, 1, 1) (ws: 384), dynamic SMEM = ``smem_bytes_for(knobs)``.

Preconditions (the loader enforces them): 16-byte aligned contiguous tensors, m >= 1,
n % tile_n == 0, k % 128 == 0, element offsets < 2^31; weights in the sm90 fragment format.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint8, Uint16
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

try:
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # older DSL
    from cutlass.utils import LayoutEnum

from .compiled_output import compile_named, cubin_resource_usage, placeholder_args

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile",
    "threads_for", "smem_bytes_for", "cubin_resource_usage", "SMEM_LIMIT_BYTES", "DEFAULT_TILE",
    "DEFAULT_STAGES", "SELECTION",
]

OP = "gemm_w4a4"
ARCHS = ("sm_90a",)
NAME = "sm90_wgmma_w4a4"

TUNING: dict[str, tuple] = dict(
    tile_m=(128, 256),      # activation rows per tile (the wgmma N extent)
    # weight rows per tile: two MMA warpgroups of tile_n/128 64-row wgmma atoms each.  256 only with
    # schedule ws (coop spilled: 8-byte stack frame at 255 registers, rank 64 and 128)
    tile_n=(128, 256),
    tile_k=(64,),           # k per pipeline step (one 128-byte swizzle row of fp16)
    stages=(3, 4),          # activation SMEM stages
    # k-tiles of raw bytes in flight in registers: 1 = loaded one k-tile ahead (the measured kernel);
    # 2 = two register sets, loaded two k-tiles ahead (more latency cover, 11-16 more registers)
    prefetch=(1, 2),
    # True: activation rows >= m are neither decoded nor stored (they only feed accumulator columns that
    # are never written; the default: 5-10 % faster at M <= 64, the same from M = 256 on, H200);
    # False: decoded with a zero scale
    skip_pad=(False, True),
    # activation E2M1 decode: "prmt" = two byte forms per 32-bit word, then one byte permute + one mask per
    # pair (the default: 10-20 % faster at every measured shape, H200); "shift" = shifts and masks per pair
    act_decode=("shift", "prmt"),
    # "coop": all 8 warps load, decode and issue wgmma, one CTA barrier per k-tile; "ws": warp-specialised,
    # one producer warpgroup decodes the activations into the SMEM stages (mbarrier full/empty ring) while two
    # consumer warpgroups decode their weight fragments and issue wgmma; setmaxnreg moves registers to them
    schedule=("coop", "ws"),
)
FEATURE_VALUES: dict[str, tuple] = dict(
    out_dtype=("fp16", "bf16"),
    rank=(0, 16, 32, 48, 64, 80, 96, 112, 128, 256),
    wcscale=(False, True),
    bias=(False, True),
    scale_layout=("logical",),
)

#: Selection rule (svdq_loader.select_rules): up to M = 256 the 128-row tile (fewer padded rows, more
#: CTAs), above it the 256-row tile; then the faster forms (act_decode prmt, skip_pad on; the H200 sweep
#: of tools/sm90_sweep.py in docs/PERF.md measured both at M = 16 ... 4608).  Up to M = 256 the
#: warp-specialised form with two raw register sets is 12-21 % faster than coop with one set (5-13 % than
#: coop with two; same sweep); above it the two schedules tie (within +-4 %), and the longer-proven coop
#: form is preferred.
_FORMS = [{"knob": "act_decode", "values": ["prmt", "shift"]}, {"knob": "skip_pad", "values": [True, False]}]
SELECTION = [
    {"m_max": 256, "priority": 0, "prefer": [{"knob": "tile_m", "order": "asc"},
                                              {"knob": "schedule", "values": ["ws", "coop"]},
                                              {"knob": "stages", "order": "desc"},
                                              {"knob": "prefetch", "order": "desc"}] + _FORMS},
    {"m_max": None, "priority": 0, "prefer": [{"knob": "tile_m", "order": "desc"},
                                               {"knob": "schedule", "values": ["coop", "ws"]},
                                               {"knob": "stages", "order": "desc"},
                                               {"knob": "prefetch", "order": "asc"}] + _FORMS},
]

DEFAULT_TILE = (128, 128, 64)
DEFAULT_STAGES = 4
TILE_K = 64
K_MULTIPLE = 2 * TILE_K          # the k loop is unrolled by two (register double buffer)
THREADS = 256                    # coop: two warpgroups; ws: the consumer warpgroups
WS_THREADS = 384                 # ws: producer warpgroup 0 + consumer warpgroups 1 and 2
#: ws register split (setmaxnreg): 128 x WS_PRODUCER_REGS + 256 x WS_CONSUMER_REGS <= 65536
#: setmaxnreg only moves registers inside the CTA's launch allocation: the kernel starts at 168 registers
#: (65536 / 384, rounded down to 8), so 128 x producer + 256 x consumer must stay <= 384 x 168.  More and
#: the consumers' setmaxnreg.inc waits forever (a hang, seen on the H200 with 80 / 216).
WS_ENTRY_REGS = 168
WS_CONSUMER_REGS = 216
WS_PRODUCER_REGS = (WS_THREADS * WS_ENTRY_REGS - 256 * WS_CONSUMER_REGS) // 128 // 8 * 8
assert 128 * WS_PRODUCER_REGS + 256 * WS_CONSUMER_REGS <= WS_THREADS * WS_ENTRY_REGS
SMEM_LIMIT_BYTES = 227 * 1024
MAX_ACC_REGS = 128               # fp32 accumulators per thread we allow (the rest: fragments, raws)
_OUT_DTYPES = {"fp16": Float16, "bf16": BFloat16}
#: 2^7 as fp16x2 (both operands are decoded times 2^-14 and scaled by 2^7: exact, no fp16 overflow)
_F16X2_128 = 0x58005800
_ACC_UNSCALE = float(2 ** 14)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    out_dtype: str
    rank: int
    wcscale: bool
    bias: bool
    tile_m: int
    tile_n: int
    stages: int
    prefetch: int = 1
    skip_pad: bool = False
    act_decode: str = "shift"
    schedule: str = "coop"


def _cfg_of(knobs: dict) -> _Cfg:
    return _Cfg(str(knobs["out_dtype"]), int(knobs["rank"]), bool(knobs["wcscale"]), bool(knobs["bias"]),
                int(knobs["tile_m"]), int(knobs["tile_n"]), int(knobs["stages"]), int(knobs["prefetch"]),
                bool(knobs["skip_pad"]), str(knobs["act_decode"]), str(knobs.get("schedule", "coop")))


def _lora_chunk(rank: int) -> int:
    for c in (64, 32, 16):
        if rank % c == 0:
            return c
    return 16


def _smem_plan(cfg: _Cfg) -> dict[str, int]:
    """Bytes of the activation stages and of one LoRA chunk.  coop: the LoRA chunk re-uses the stages' bytes
    (the epilogue runs after every warp is done with them); ws: the producer is already filling the stages for
    the next tile while the consumers run the epilogue, so the LoRA chunk has its own bytes after the stages,
    and the ring's 2 x stages mbarriers (8 bytes each) come last."""
    main = cfg.stages * cfg.tile_m * TILE_K * 2
    lora = (cfg.tile_n + cfg.tile_m) * _lora_chunk(cfg.rank) * 2 if cfg.rank else 0
    la_in_chunk = cfg.tile_n * _lora_chunk(cfg.rank) * 2 if cfg.rank else 0
    if cfg.schedule == "ws":
        lora_at = (main + 1023) // 1024 * 1024
        bar_at = lora_at + (lora + 1023) // 1024 * 1024
        total = bar_at + 2 * cfg.stages * 8
        total = (total + 1023) // 1024 * 1024
        return dict(main_bytes=main, lora_bytes=lora, total_bytes=total, lu_offset=lora_at,
                    la_offset=lora_at + la_in_chunk, bar_offset=bar_at)
    total = (max(main, lora) + 1023) // 1024 * 1024
    return dict(main_bytes=main, lora_bytes=lora, total_bytes=total, lu_offset=0, la_offset=la_in_chunk,
                bar_offset=-1)


def _problem(cfg: _Cfg) -> Optional[str]:
    atoms = cfg.tile_n // 128
    acc = atoms * cfg.tile_m // 2
    if acc > MAX_ACC_REGS:
        return (f"tile {cfg.tile_m}x{cfg.tile_n} needs {acc} fp32 accumulator registers per thread, "
                f"more than the {MAX_ACC_REGS} this kernel allows (255 registers in all, fragments and "
                f"raw prefetch need the rest)")
    if cfg.tile_n > 128:
        if cfg.schedule == "coop":
            return (f"tile_n {cfg.tile_n} needs schedule ws: with coop every thread also holds the activation "
                    f"bytes, and the tile spilled (8-byte stack frames at 255 registers, ranks 64 and 128)")
        return (f"tile_n {cfg.tile_n}: two weight atoms per MMA warpgroup (128 accumulator + 64 fragment "
                f"registers) do not fit the {WS_CONSUMER_REGS} registers of an MMA thread; ptxas serialises every "
                f"wgmma instead (20 full waits for 20 HGMMA; measured 0.51-0.62x cuBLAS bf16 at M >= 4608 on the "
                f"H200)")
    if cfg.schedule == "ws" and acc > 64 and cfg.rank >= 128:
        return (f"schedule ws with tile_m={cfg.tile_m} and rank {cfg.rank}: {acc} accumulator registers and the "
                f"LoRA epilogue do not fit the {WS_CONSUMER_REGS} registers of an MMA thread (measured: 8-40 byte "
                f"stack frames at ranks 128 and 256)")
    if cfg.schedule == "ws" and acc > 64 and cfg.prefetch > 1 and not cfg.skip_pad:
        return (f"schedule ws with tile_m={cfg.tile_m}, prefetch {cfg.prefetch} and skip_pad off: the producer's two "
                f"raw sets and the row predicates do not fit its {WS_PRODUCER_REGS} registers (measured: 56-byte "
                f"stack frames)")
    if cfg.prefetch > 1 and acc > 64 and cfg.schedule == "coop":
        return (f"prefetch {cfg.prefetch} with tile_m={cfg.tile_m}: a second raw-byte register set on top of "
                f"{acc} accumulator registers does not fit (measured: 8-byte stack frames at 255 registers for "
                f"ranks 0, 64, 256)")
    plan = _smem_plan(cfg)
    if plan["total_bytes"] > SMEM_LIMIT_BYTES:
        where = "separate LoRA chunk" if cfg.schedule == "ws" else "LoRA chunk"
        return (f"needs {plan['total_bytes']} B of dynamic SMEM (activation stages {plan['main_bytes']} B, "
                f"{where} {plan['lora_bytes']} B), more than the {SMEM_LIMIT_BYTES} B of an sm_90 CTA")
    return None


def threads_for(knobs: dict) -> int:
    return WS_THREADS if knobs.get("schedule", "coop") == "ws" else THREADS


def smem_bytes_for(knobs: dict) -> int:
    return _smem_plan(_cfg_of(knobs))["total_bytes"]


# ---------------------------------------------------------------------------
# PTX helpers (exact conversions on packed registers)
# ---------------------------------------------------------------------------

def _asm(res, ins, text, cons):
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value() for x in ins], text, cons,
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _scales_x128(two_e4m3, *, loc=None, ip=None):
    """Low 16 bits = two E4M3 bytes -> fp16x2 of (scale · 2^7), exact."""
    return _asm(None, [two_e4m3],
                "{\n\t.reg .b16 t;\n\t.reg .b32 c;\n\tcvt.u16.u32 t, $1;\n\t"
                "cvt.rn.f16x2.e4m3x2 $0, t;\n\tmov.b32 c, %d;\n\tmul.rn.f16x2 $0, $0, c;\n\t}" % _F16X2_128,
                "=r,r")


@dsl_user_op
def _bcast(pair, hi: int, *, loc=None, ip=None):
    """fp16x2 {a, b} -> {a, a} (hi=0) or {b, b} (hi=1)."""
    pick = "{l, l}" if hi == 0 else "{h, h}"
    return _asm(None, [pair], "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $1;\n\tmov.b32 $0, %s;\n\t}" % pick,
                "=r,r")


@dsl_user_op
def _wdecode(word, scale2, p: int, *, loc=None, ip=None):
    """Pair p of a fragment word (sm90 weight format) times the broadcast scale -> fp16x2."""
    return _asm(None, [word, scale2],
                "{\n\t.reg .b32 a, b;\n\tshl.b32 a, $1, %d;\n\tand.b32 a, a, 0x0E000E00;\n\t"
                "shl.b32 b, $1, %d;\n\tand.b32 b, b, 0x80008000;\n\tor.b32 a, a, b;\n\t"
                "mul.rn.f16x2 $0, a, $2;\n\t}" % (9 - 3 * p, 3 - p),
                "=r,r,r")


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


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


class _Sm90Wgmma:
    KERNEL_METHODS = ("kernel", "kernel_ws")      # schedule coop / ws

    def __init__(self, cfg: _Cfg):
        reason = _problem(cfg)
        if reason:
            raise ValueError(f"unsupported {NAME} variant: {reason}")
        self.cfg = cfg
        self.tm, self.tn, self.stages = cfg.tile_m, cfg.tile_n, cfg.stages
        self.atoms = cfg.tile_n // 128
        self.rank = cfg.rank
        self.rc = _lora_chunk(cfg.rank) if cfg.rank else 0
        self.out_dtype = _OUT_DTYPES[cfg.out_dtype]
        self.plan = _smem_plan(cfg)
        self.smem_bytes = self.plan["total_bytes"]
        self.ws = cfg.schedule == "ws"
        self.nthr_a = 128 if self.ws else THREADS                # threads that decode activations
        self.chunks_a = self.tm * (TILE_K // 32) // self.nthr_a  # 32-k activation chunks per such thread
        self.prefetch = cfg.prefetch
        self.skip_pad = cfg.skip_pad
        self.act_decode = cfg.act_decode

    @cute.jit
    def __call__(self, act: cute.Pointer, ascales: cute.Pointer, wgt: cute.Pointer, wscales: cute.Pointer,
                 lora_act_in: cute.Pointer, lora_up: cute.Pointer, wcscale: cute.Pointer, bias: cute.Pointer,
                 out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 sm_count: cutlass.Int32, stream: cuda.CUstream):
        tiles = ((m + (self.tm - 1)) // self.tm) * (n // self.tn)
        grid = cutlass.min(tiles, sm_count)
        if cutlass.const_expr(self.ws):
            # min_blocks_per_mp=1 caps the registers at entry (65536 / 384), which setmaxnreg needs
            self.kernel_ws(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out, m, n, k).launch(
                grid=[grid, 1, 1], block=[WS_THREADS, 1, 1], smem=self.smem_bytes, stream=stream,
                min_blocks_per_mp=1)
        else:
            self.kernel(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out, m, n, k).launch(
                grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream)

    # -- helpers (trace time) -------------------------------------------------
    def _gmem_views(self, p_act, p_asc, p_wgt, p_wsc, p_out, m, n, k):
        """num_kt, kw and the global tensors: activation words and scale pairs, weight fragments and scales, out."""
        num_kt = cute.assume(k // TILE_K, divby=2)
        kw = cute.assume(k // 8, divby=16)          # 32-bit words of packed nibbles per activation row
        kq = cute.assume(k // 32, divby=4)          # 16-bit scale pairs per activation row
        mActW = cute.make_tensor(cute.recast_ptr(p_act, dtype=Int32), cute.make_layout((m, kw), stride=(kw, 1)))
        mAscH = cute.make_tensor(cute.recast_ptr(p_asc, dtype=Uint16), cute.make_layout((m, kq), stride=(kq, 1)))
        nwords = (n // 64) * num_kt * 512
        mWq = cute.make_tensor(cute.recast_ptr(p_wgt, dtype=Int32), cute.make_layout(nwords))
        mWs = cute.make_tensor(cute.recast_ptr(p_wsc, dtype=Int32), cute.make_layout(nwords // 8))
        mOut = cute.make_tensor(p_out, cute.make_layout((m, n), stride=(n, 1)))
        return num_kt, kw, mActW, mAscH, mWq, mWs, mOut

    def _stages(self, base):
        """The activation stages: `stages` 128-byte-swizzled K-major fp16 tiles of tile_m x 64 at `base`."""
        lay_a = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tn, self.tm, TILE_K), Float16, self.stages)
        assert cute.cosize(lay_a) * 2 <= self.plan["main_bytes"]
        return cute.make_tensor(cute.recast_ptr(base, lay_a.inner, dtype=Float16), lay_a.outer)

    def _mma_parts(self, sA, tid):
        """For MMA thread `tid` (0..255): the register-A tiled wgmma, its B view of the stages, the two weight
        fragment buffers (as wgmma A operands and as Int32 words), the accumulators and their coordinates."""
        tm, tn = self.tm, self.tn
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            Float16, Float16, OperandMajorMode.K, OperandMajorMode.K, Float32, (2, 1, 1), (64, tm),
            sm90_utils.OperandSource.RMEM)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        thr_mma = tiled_mma.get_slice(tid)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))
        frag_shape = ((2, 2, 2), self.atoms, TILE_K // 16)
        fragA = (tiled_mma.make_fragment_A(frag_shape), tiled_mma.make_fragment_A(frag_shape))
        fragW = tuple(cute.make_tensor(cute.recast_ptr(f.iterator, dtype=Int32),
                                       cute.make_layout(16 * self.atoms)) for f in fragA)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tn, tm)), Float32)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((tn, tm)))
        return tiled_mma, tCrB, fragA, fragW, acc, tCcC

    def _buffers(self, tidx):
        ca, at = range(self.chunks_a), range(self.atoms)
        return ([cute.make_rmem_tensor((4,), Int32) for _ in ca],
                [cute.make_rmem_tensor((1,), Uint16) for _ in ca],
                [cute.make_rmem_tensor((16,), Int32) for _ in ca],
                [cute.make_rmem_tensor((4,), Int32) for _ in at],
                [cute.make_rmem_tensor((2,), Int32) for _ in at],
                [(tidx + i * self.nthr_a) // 2 for i in ca],
                [(tidx + i * self.nthr_a) % 2 for i in ca])

    def _load_act(self, mActW, mAscH, rows_ld, kcs, kh4, kt, raw, rsc):
        for i in range(self.chunks_a):
            src = cute.local_tile(mActW, (1, 4), (rows_ld[i], kt * 2 + kcs[i]))
            cute.autovec_copy(src, raw[i])
            rsc[i][0] = mAscH[rows_ld[i], kt * 2 + kcs[i]]

    def _load_w(self, mWq, mWs, wblk, num_kt, tidx, kt, wraw, wsc):
        lane_t = tidx % 128
        for a in range(self.atoms):
            blk = wblk[a] * num_kt + kt
            cute.autovec_copy(cute.local_tile(mWq, (4,), (blk * 128 + lane_t,)), wraw[a])
            cute.autovec_copy(cute.local_tile(mWs, (2,), (blk * 32 + lane_t // 4,)), wsc[a])

    def _store_act(self, sA, stage, rows, kcs, valid, raw, rsc, deq, only=None):
        for i in (range(self.chunks_a) if only is None else (only,)):
            sc = Int32(rsc[i][0])
            if valid is not None:
                sc = cutlass.select_(valid[i], sc, Int32(0))
            s2 = _scales_x128(sc)
            b0 = _bcast(s2, 0)
            b1 = _bcast(s2, 1)
            for w in range(4):
                s = b0 if w < 2 else b1
                if self.act_decode == "prmt":
                    lo, hi = _byte_form(raw[i][w], 0), _byte_form(raw[i][w], 1)
                    for b in range(4):
                        deq[i][w * 4 + b] = _adecode_prmt(lo, hi, s, b)
                else:
                    for b in range(4):
                        deq[i][w * 4 + b] = _adecode(raw[i][w], s, b)
            dst = cute.local_tile(sA[None, None, stage], (1, 32), (rows[i], kcs[i]))
            cute.autovec_copy(cute.recast_tensor(deq[i], Float16), dst)

    def _decode_w(self, fragw, wraw, wsc):
        for a in range(self.atoms):
            for j in range(4):
                pair = (wsc[a][j // 2] >> (16 * (j % 2))) & 0xFFFF
                s2 = _scales_x128(pair)
                sb = (_bcast(s2, 0), _bcast(s2, 1))
                for p in range(4):
                    fragw[p + 4 * a + 4 * self.atoms * j] = _wdecode(wraw[a][j], sb[p % 2], p)

    # -- device kernel ----------------------------------------------------------
    @cute.kernel
    def kernel(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_wgt: cute.Pointer, p_wsc: cute.Pointer,
               p_la: cute.Pointer, p_lu: cute.Pointer, p_wc: cute.Pointer, p_bias: cute.Pointer,
               p_out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32):
        tm, tn, S = self.tm, self.tn, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        wg = tidx // 128

        num_kt, kw, mActW, mAscH, mWq, mWs, mOut = self._gmem_views(p_act, p_asc, p_wgt, p_wsc, p_out, m, n, k)

        # ---- SMEM ---------------------------------------------------------------
        smem = cutlass.utils.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        sA = self._stages(base)

        # ---- MMA ----------------------------------------------------------------
        tiled_mma, tCrB, fragA, fragW, acc, tCcC = self._mma_parts(sA, tidx)

        # ---- per-thread register buffers ------------------------------------------
        sets = [self._buffers(tidx) for _ in range(self.prefetch)]      # raw-byte register sets
        raw, rsc, wraw, wsc = ([b[i] for b in sets] for i in (0, 1, 3, 4))
        deq, rows, kcs = sets[0][2], sets[0][5], sets[0][6]

        tiles_n = n // tn
        tiles = ((m + (tm - 1)) // tm) * tiles_n
        for tile in cutlass.range(bid, tiles, gdim, unroll=1):
            tm_i = tile // tiles_n
            tn_i = tile - tm_i * tiles_n
            m0 = tm_i * tm
            n0 = tn_i * tn
            valid = [(m0 + r) < m for r in rows]
            rows_ld = [cutlass.min(m0 + r, m - 1) for r in rows]
            wblk = [n0 // 64 + a * 2 + wg for a in range(self.atoms)]
            acc.fill(0.0)

            # prologue: raw bytes of k-tiles 0 .. P-1 into register sets t % P; k-tile 0 into stage 0 and
            # fragment buffer 0; then k-tile P in flight into set 0
            P = self.prefetch
            for t in cutlass.range_constexpr(P):      # num_kt >= 2: k-tiles 0 and 1 exist
                self._load_act(mActW, mAscH, rows_ld, kcs, kw, t, raw[t], rsc[t])
                self._load_w(mWq, mWs, wblk, num_kt, tidx, t, wraw[t], wsc[t])
            full = (m0 + tm) <= m      # no padded rows in this tile (uniform across the CTA)
            if cutlass.const_expr(self.skip_pad):
                if full:
                    self._store_act(sA, 0, rows, kcs, None, raw[0], rsc[0], deq)
                else:
                    for i in cutlass.range_constexpr(self.chunks_a):
                        if valid[i]:
                            self._store_act(sA, 0, rows, kcs, None, raw[0], rsc[0], deq, only=i)
            else:
                self._store_act(sA, 0, rows, kcs, valid, raw[0], rsc[0], deq)
            self._decode_w(fragW[0], wraw[0], wsc[0])
            ktp = 1 if P == 1 else cutlass.min(P, num_kt - 1)
            self._load_act(mActW, mAscH, rows_ld, kcs, kw, ktp, raw[0], rsc[0])
            self._load_w(mWq, mWs, wblk, num_kt, tidx, ktp, wraw[0], wsc[0])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            for kt2 in cutlass.range(0, num_kt, 2, unroll=1):
                for half in cutlass.range_constexpr(2):
                    kt = kt2 + half
                    stage = kt % S
                    rs = (half + 1) % P          # register set holding k-tile kt+1 (kt2 is even)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(TILE_K // 16):
                        cute.gemm(tiled_mma, acc, fragA[half][None, None, kb], tCrB[None, None, kb, stage], acc)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)     # this warpgroup's k-tile kt-1 is done
                    # k-tile kt+1 (raw bytes already in registers) -> stage (kt+1)%S, other fragment buffer;
                    # past the end this decodes the last k-tile again into a stage nobody reads
                    if cutlass.const_expr(self.skip_pad):
                        # rows >= m only feed accumulator columns that are never stored: not decoded.  A tile
                        # without padded rows takes the unpredicated path (one uniform branch per k-tile)
                        if full:
                            self._store_act(sA, (kt + 1) % S, rows, kcs, None, raw[rs], rsc[rs], deq)
                        else:
                            for i in cutlass.range_constexpr(self.chunks_a):
                                if valid[i]:
                                    self._store_act(sA, (kt + 1) % S, rows, kcs, None, raw[rs], rsc[rs], deq,
                                                    only=i)
                    else:
                        self._store_act(sA, (kt + 1) % S, rows, kcs, valid, raw[rs], rsc[rs], deq)
                    self._decode_w(fragW[1 - half], wraw[rs], wsc[rs])
                    nxt = cutlass.min(kt + 1 + P, num_kt - 1)      # same parity as kt+1 when P = 2
                    self._load_act(mActW, mAscH, rows_ld, kcs, kw, nxt, raw[rs], rsc[rs])
                    self._load_w(mWq, mWs, wblk, num_kt, tidx, nxt, wraw[rs], wsc[rs])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.sync_threads()
            warpgroup.wait_group(0)

            self._epilogue(p_la, p_lu, p_wc, p_bias, base, m, n, m0, n0, tidx, wg, acc)
            for i in cutlass.range_constexpr(cute.size(acc)):
                c = tCcC[i]
                if (m0 + c[1]) < m:
                    mOut[m0 + c[1], n0 + c[0]] = acc[i].to(self.out_dtype)
            # every warpgroup is past its last read of the stages before the next tile rewrites them
            cute.arch.sync_threads()

    @cute.kernel
    def kernel_ws(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_wgt: cute.Pointer, p_wsc: cute.Pointer,
                  p_la: cute.Pointer, p_lu: cute.Pointer, p_wc: cute.Pointer, p_bias: cute.Pointer,
                  p_out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32):
        """schedule "ws": warpgroup 0 decodes activation k-tiles into the SMEM stages (mbarrier ring: full[s]
        gets 128 producer arrivals, empty[s] one arrival per MMA warp); warpgroups 1 and 2 decode their own
        weight fragments, issue the wgmmas and run the epilogue.  Both sides walk the same persistent tile
        sequence, so k-tile j of this CTA's i-th tile is ring slot (i·num_kt + j) mod stages."""
        tm, tn, S = self.tm, self.tn, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        wg = cute.arch.make_warp_uniform(tidx // 128)

        num_kt, kw, mActW, mAscH, mWq, mWs, mOut = self._gmem_views(p_act, p_asc, p_wgt, p_wsc, p_out, m, n, k)
        smem = cutlass.utils.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        sA = self._stages(base)
        bars = cute.recast_ptr(base + self.plan["bar_offset"], dtype=Int64)      # full[0..S), empty[0..S)
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(bars + s, 128)
                cute.arch.mbarrier_init(bars + S + s, 8)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tiles_n = n // tn
        tiles = ((m + (tm - 1)) // tm) * tiles_n
        if wg == 0:
            # ---- producer: raw activation bytes -> registers -> exact fp16 -> stage ------------------
            cute.arch.setmaxregister_decrease(WS_PRODUCER_REGS)
            P = self.prefetch
            sets = [self._buffers(tidx) for _ in range(P)]
            raw, rsc = [b[0] for b in sets], [b[1] for b in sets]
            deq, rows, kcs = sets[0][2], sets[0][5], sets[0][6]
            for tile in cutlass.range(bid, tiles, gdim, unroll=1):
                m0 = (tile // tiles_n) * tm
                valid = [(m0 + r) < m for r in rows]
                rows_ld = [cutlass.min(m0 + r, m - 1) for r in rows]
                full = (m0 + tm) <= m
                g0 = (tile - bid) // gdim * num_kt
                for t in cutlass.range_constexpr(P):
                    self._load_act(mActW, mAscH, rows_ld, kcs, kw, t, raw[t], rsc[t])
                for kt2 in cutlass.range(0, num_kt, 2, unroll=1):
                    for half in cutlass.range_constexpr(2):
                        kt = kt2 + half
                        rs = half % P               # the register set holding k-tile kt
                        g = g0 + kt
                        stage = g % S
                        cute.arch.mbarrier_wait(bars + S + stage, ((g // S) & 1) ^ 1)
                        if cutlass.const_expr(self.skip_pad):
                            if full:
                                self._store_act(sA, stage, rows, kcs, None, raw[rs], rsc[rs], deq)
                            else:
                                for i in cutlass.range_constexpr(self.chunks_a):
                                    if valid[i]:
                                        self._store_act(sA, stage, rows, kcs, None, raw[rs], rsc[rs], deq, only=i)
                        else:
                            self._store_act(sA, stage, rows, kcs, valid, raw[rs], rsc[rs], deq)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.mbarrier_arrive(bars + stage)
                        nxt = cutlass.min(kt + P, num_kt - 1)
                        self._load_act(mActW, mAscH, rows_ld, kcs, kw, nxt, raw[rs], rsc[rs])
        else:
            # ---- MMA warpgroups: weight fragments -> registers; wgmma; epilogue -------------------------
            cute.arch.setmaxregister_increase(WS_CONSUMER_REGS)
            ctid = tidx - 128
            cwg = wg - 1
            lane = tidx % 32
            tiled_mma, tCrB, fragA, fragW, acc, tCcC = self._mma_parts(sA, ctid)
            # two raw weight sets: k-tile j's bytes are loaded two k-tiles before they are decoded
            wraw = [[cute.make_rmem_tensor((4,), Int32) for _ in range(self.atoms)] for _ in range(2)]
            wsc = [[cute.make_rmem_tensor((2,), Int32) for _ in range(self.atoms)] for _ in range(2)]
            for tile in cutlass.range(bid, tiles, gdim, unroll=1):
                tm_i = tile // tiles_n
                tn_i = tile - tm_i * tiles_n
                m0 = tm_i * tm
                n0 = tn_i * tn
                wblk = [n0 // 64 + a * 2 + cwg for a in range(self.atoms)]
                g0 = (tile - bid) // gdim * num_kt
                acc.fill(0.0)
                self._load_w(mWq, mWs, wblk, num_kt, ctid, 0, wraw[0], wsc[0])
                self._load_w(mWq, mWs, wblk, num_kt, ctid, 1, wraw[1], wsc[1])
                self._decode_w(fragW[0], wraw[0], wsc[0])
                self._load_w(mWq, mWs, wblk, num_kt, ctid, cutlass.min(2, num_kt - 1), wraw[0], wsc[0])
                for kt2 in cutlass.range(0, num_kt, 2, unroll=1):
                    for half in cutlass.range_constexpr(2):
                        kt = kt2 + half
                        g = g0 + kt
                        stage = g % S
                        cute.arch.mbarrier_wait(bars + stage, (g // S) & 1)
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(TILE_K // 16):
                            cute.gemm(tiled_mma, acc, fragA[half][None, None, kb], tCrB[None, None, kb, stage], acc)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)     # k-tile kt-1 is done: its stage goes back to the producer
                        if cutlass.const_expr(half == 1):
                            if lane == 0:
                                cute.arch.mbarrier_arrive(bars + S + (g - 1) % S)
                        else:
                            if kt2 > 0:
                                if lane == 0:
                                    cute.arch.mbarrier_arrive(bars + S + (g - 1) % S)
                        # k-tile kt+1 (raw set 1-half) -> fragments 1-half; then k-tile kt+3 into that set
                        self._decode_w(fragW[1 - half], wraw[1 - half], wsc[1 - half])
                        nxt = cutlass.min(kt + 3, num_kt - 1)
                        self._load_w(mWq, mWs, wblk, num_kt, ctid, nxt, wraw[1 - half], wsc[1 - half])
                warpgroup.wait_group(0)
                if lane == 0:
                    cute.arch.mbarrier_arrive(bars + S + (g0 + num_kt - 1) % S)
                self._epilogue(p_la, p_lu, p_wc, p_bias, base, m, n, m0, n0, ctid, cwg, acc)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    c = tCcC[i]
                    if (m0 + c[1]) < m:
                        mOut[m0 + c[1], n0 + c[0]] = acc[i].to(self.out_dtype)

    def _epilogue(self, p_la, p_lu, p_wc, p_bias, base, m, n, m0, n0, tidx, wg, acc):
        """acc *= 2^14·wcscale[n]; LoRA; + bias (the store, with its run-time predicate, stays in the kernel
        body).  tidx: the thread's index among the 256 MMA threads, wg: its MMA warpgroup (0 or 1)."""
        row0 = n0 + wg * 64 + (tidx % 128) // 32 * 16 + (tidx % 32) // 4
        rows_out = [row0 + a * 128 + 8 * h for a in range(self.atoms) for h in range(2)]
        nacc = cute.size(acc)
        per_atom = nacc // self.atoms
        coef = cute.make_rmem_tensor((2 * self.atoms,), Float32)
        for i in range(2 * self.atoms):
            if self.cfg.wcscale:
                mWc = cute.make_tensor(p_wc, cute.make_layout((n,), stride=(1,)))
                coef[i] = mWc[rows_out[i]] * Float32(_ACC_UNSCALE)
            else:
                coef[i] = Float32(_ACC_UNSCALE)
        for i in range(nacc):
            acc[i] = acc[i] * coef[(i // per_atom) * 2 + (i // 2) % 2]

        if self.rank > 0:
            self._lora(p_la, p_lu, base, m, n, m0, n0, tidx, acc)

        if self.cfg.bias:
            mB = cute.make_tensor(p_bias, cute.make_layout((n,), stride=(1,)))
            bv = cute.make_rmem_tensor((2 * self.atoms,), Float32)
            for i in range(2 * self.atoms):
                bv[i] = mB[rows_out[i]]
            for i in range(nacc):
                acc[i] = acc[i] + bv[(i // per_atom) * 2 + (i // 2) % 2]

    def _mma_sync(self):
        """A barrier over the 256 MMA threads: the whole CTA (coop), or named barrier 1 (ws: the producer
        warpgroup is not in it)."""
        if self.ws:
            cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
        else:
            cute.arch.sync_threads()

    def _lora(self, p_la, p_lu, base, m, n, m0, n0, tidx, acc):
        """acc[n, m] += Σ_r lora_up[n, r]·lora_act_in[m, r], in chunks of ``rc`` ranks through SMEM."""
        tm, tn, R, rc = self.tm, self.tn, self.rank, self.rc
        ldt = self.out_dtype
        mLA = cute.make_tensor(p_la, cute.make_layout((m, R), stride=(R, 1)))
        mLU = cute.make_tensor(p_lu, cute.make_layout((n, R), stride=(R, 1)))
        lay_lu = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tn, tm, rc), ldt, 1)
        lay_la = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (tn, tm, rc), ldt, 1)
        assert cute.cosize(lay_lu) * 2 <= self.plan["la_offset"] - self.plan["lu_offset"]
        assert cute.cosize(lay_la) * 2 + self.plan["la_offset"] <= self.smem_bytes
        sLU = cute.make_tensor(cute.recast_ptr(base + self.plan["lu_offset"], lay_lu.inner, dtype=ldt),
                               lay_lu.outer)
        sLA = cute.make_tensor(cute.recast_ptr(base + self.plan["la_offset"], lay_la.inner, dtype=ldt),
                               lay_la.outer)
        lmma = sm90_utils.make_trivial_tiled_mma(ldt, ldt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                 (2, 1, 1), (64, tm))
        lmma.set(warpgroup.Field.ACCUMULATE, True)
        thr = lmma.get_slice(tidx)
        tLrA = lmma.make_fragment_A(thr.partition_A(sLU))
        tLrB = lmma.make_fragment_B(thr.partition_B(sLA))
        vpr = rc // 8                       # 16-byte vectors per row of a chunk
        vbuf = cute.make_rmem_tensor((8,), ldt)
        self._mma_sync()                    # coop: the main loop's stages are free; ws: the last chunk is read
        for ch in range(R // rc):
            for i in range(tn * vpr // THREADS):
                v = tidx + i * THREADS
                r = v // vpr
                cv = v % vpr
                cute.autovec_copy(cute.local_tile(mLU, (1, 8), (n0 + r, ch * vpr + cv)), vbuf)
                cute.autovec_copy(vbuf, cute.local_tile(sLU[None, None, 0], (1, 8), (r, cv)))
            for i in range(tm * vpr // THREADS):
                v = tidx + i * THREADS
                r = v // vpr
                cv = v % vpr
                cute.autovec_copy(cute.local_tile(mLA, (1, 8), (cutlass.min(m0 + r, m - 1), ch * vpr + cv)), vbuf)
                ok = (m0 + r) < m
                for e in range(8):
                    vbuf[e] = cutlass.select_(ok, vbuf[e], ldt(0.0))
                cute.autovec_copy(vbuf, cute.local_tile(sLA[None, None, 0], (1, 8), (r, cv)))
            cute.arch.fence_proxy("async.shared", space="cta")
            self._mma_sync()
            warpgroup.fence()
            for kb in range(rc // 16):
                cute.gemm(lmma, acc, tLrA[None, None, kb, 0], tLrB[None, None, kb, 0], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            self._mma_sync()


# ---------------------------------------------------------------------------
# Build-time API
# ---------------------------------------------------------------------------


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.sm_90a.gemm_w4a4`` -> tuning-knob dicts; keys ``tiles`` ([[tile_m, tile_n, tile_k], ...]),
    ``stages`` ([auto | 3 | 4, ...]; auto = the deepest that fits), ``prefetch`` ([1 | 2, ...]; default [1])
    ``skip_pad`` ([false | true]; default [true]), ``act_decode`` ([shift | prmt]; default [prmt]) and
    ``schedule`` ([coop | ws]; default [coop]): every combination of the listed values.

    Or ``forms``: a list of such sections (a key a form leaves out takes its default), built as the union of
    each form's combinations -- one schedule for the small tile and another for the large one without building
    every cross combination."""
    if "forms" not in section:
        return _form_axes(section, "")
    problems: list[str] = []
    if set(section) - {"forms"}:
        problems.append(f"{', '.join(sorted(set(section) - {'forms'}))}: not allowed beside forms "
                        f"(put them inside each form)")
    forms = section["forms"]
    if not isinstance(forms, list) or not forms or not all(isinstance(f, dict) for f in forms):
        return [], problems + [f"forms: {forms!r}: expected a non-empty list of mappings"]
    out: list[dict] = []
    for i, form in enumerate(forms):
        got, probs = _form_axes(form, f"forms[{i}].")
        problems += probs
        out += [g for g in got if g not in out]
    return out, problems


def _form_axes(section: dict, where: str) -> tuple[list[dict], list[str]]:
    """One section's (or one form's) product of knob values; `where` prefixes its problems."""
    problems: list[str] = []
    allowed = ("tiles", "stages", "prefetch", "skip_pad", "act_decode", "schedule")
    for key in sorted(set(section) - set(allowed)):
        problems.append(f"{where}{key}: unknown key (allowed: {', '.join(allowed)})")
    tiles = section.get("tiles", [list(DEFAULT_TILE)])
    good_tiles = []
    if not isinstance(tiles, list) or not tiles:
        problems.append(f"{where}tiles: {tiles!r}: expected a non-empty list of [tile_m, tile_n, tile_k]")
        tiles = []
    for i, t in enumerate(tiles):
        if not (isinstance(t, list) and len(t) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                            and x > 0 for x in t)):
            problems.append(f"{where}tiles[{i}]: {t!r}: expected [tile_m, tile_n, tile_k], three positive integers")
        elif t in good_tiles:
            problems.append(f"{where}tiles[{i}]: {t!r}: duplicate value")
        else:
            good_tiles.append(t)
    lists = {}
    for key, default, kind in (("stages", ["auto"], "auto"), ("prefetch", [1], "int"), ("skip_pad", [True], "bool"),
                               ("act_decode", ["prmt"], "name"), ("schedule", ["coop"], "name")):
        vals = section.get(key, default)
        good = []
        if not isinstance(vals, list) or not vals:
            problems.append(f"{where}{key}: {vals!r}: expected a non-empty list")
            vals = []
        for i, v in enumerate(vals):
            if kind == "bool":
                ok, want = isinstance(v, bool), "true or false"
            elif kind == "name":
                ok, want = isinstance(v, str), "a name (" + ", ".join(TUNING[key]) + ")"
            else:
                ok = (kind == "auto" and v == "auto") or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
                want = "a positive integer" + (" or 'auto'" if kind == "auto" else "")
            if not ok:
                problems.append(f"{where}{key}[{i}]: {v!r}: expected {want}")
            elif v in good:
                problems.append(f"{where}{key}[{i}]: {v!r}: duplicate value")
            else:
                good.append(v)
        lists[key] = good
    return [dict(tile_m=t[0], tile_n=t[1], tile_k=t[2], stages=s, prefetch=p, skip_pad=sp, act_decode=ad,
                 schedule=sc)
            for t in good_tiles for s in lists["stages"] for p in lists["prefetch"] for sp in lists["skip_pad"]
            for ad in lists["act_decode"] for sc in lists["schedule"]], problems


def resolve(arch: str, knobs: dict) -> dict:
    if knobs.get("stages") != "auto":
        return dict(knobs)
    for st in sorted(TUNING["stages"], reverse=True):
        cand = dict(knobs, stages=st)
        if invalid_reason(arch, cand) is None:
            return cand
    return dict(knobs, stages=max(TUNING["stages"]))


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    if arch not in ARCHS:
        return f"arch {arch} is not built by {NAME} (builds {', '.join(ARCHS)})"
    from svdq_aot.family import knob_problems
    problems = knob_problems(NAME, knobs, FEATURE_VALUES, TUNING)
    if problems:
        return problems
    return _problem(_cfg_of(knobs))


def requirements(arch: str, knobs: dict) -> dict:
    return {"n_multiple": int(knobs["tile_n"]), "k_multiple": K_MULTIPLE}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    from svdq_aot.family import CompiledKernel

    reason = invalid_reason(arch, knobs)
    if reason:
        raise ValueError(f"cannot compile {name}: {reason}")
    cfg = _cfg_of(knobs)
    gemm = _Sm90Wgmma(cfg)
    from svdq_loader.ops import GEMM_W4A4
    args = placeholder_args(GEMM_W4A4, dict(act=Uint8, ascales=Uint8, wgt=Uint8, wscales=Uint8, wcscale=Float32,
                                            bias=Float32), _OUT_DTYPES[cfg.out_dtype])
    compiled, cubin, symbols = compile_named(_Sm90Wgmma, gemm, args, name, arch, dump_dir, keep_ptx=True)
    usage = cubin_resource_usage(cubin)
    problem = static_problem(_read_ptx(dump_dir, compiled.function_name, arch, keep_ptx), usage)
    if problem:
        raise RuntimeError(f"{name}: {problem}")
    return CompiledKernel(cubin=cubin, compiled=compiled, entry=compiled.function_name, kernel_symbols=symbols,
                          smem_bytes=gemm.smem_bytes, resource_usage=usage)


def _read_ptx(dump_dir: str, entry: str, arch: str, keep: bool) -> str:
    import os
    path = os.path.join(dump_dir, f"{entry}.{arch}.ptx")
    with open(path) as f:
        text = f.read()
    if not keep:
        os.remove(path)
    return text


def static_problem(ptx: str, usage: dict) -> Optional[str]:
    """The build-time checks every variant must pass: None, or what is wrong.

    The main loop must be on the Hopper tensor-core path (``wgmma.mma_async`` with a register A operand,
    which ptxas turns into HGMMA), and no kernel may have a stack frame (spilled registers)."""
    if "wgmma.mma_async" not in ptx:
        return "no wgmma.mma_async in the PTX (not on the Hopper tensor-core path)"
    for sym, u in usage.items():
        if u["stack_frame_bytes"]:
            return (f"kernel {sym} spills: {u['stack_frame_bytes']}-byte stack frame at {u['registers']} "
                    f"registers")
    return None

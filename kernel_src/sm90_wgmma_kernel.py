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
  B, output dtype, rank in chunks of up to 64), then ``bias[n]``, each operand loaded when its step comes.  The
  default ``early`` epilogue (``EPILOGUE`` below) takes those global round trips out from between the main loop and
  the store where the registers allow it.  The store
  transposes accumulator pairs across the warp (``sm90_epilogue_ptx``: ``movmatrix``, then one 32-bit store per
  two output columns, rows >= m predicated off); it made the images tiles 5-6 % faster at K = 3072 (docs/PERF.md,
  session 12).
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
  chunk has SMEM of its own).  The MMA warps take a loop step's ring stage and parity once, not per k-tile
  (``RING`` below, ``step``: 13-20 % shorter main loops where the unroll is 4 or 8, 0-2 % faster on an H100).
  ``setmaxnreg`` gives the producer ``WS_PRODUCER_REGS`` and the MMA warps ``WS_CONSUMER_REGS`` out of the launch
  allocation of 384 x 168 registers.
* The FP8-compute mode (``_Cfg.compute == "fp8"``; family ``sm90_wgmma_w4a4_fp8``, docs/design.md sections 2 and 4.0):
  the images ``ws`` schedule with E4M3 operands, ``wgmma.m64nNk32`` E4M3 x E4M3, 128-k k-tiles, the weight rounded
  once to E4M3 in registers with its scale and ``rw`` folded in (``_decode_w_fp8``), and an epilogue that multiplies
  by ``1 / ra`` per activation row (``_fp8_col_scale``) before the coefficient, the LoRA and the bias.
* tile_n 192 (``ws``, ``act_source`` images; run on an H100 in session 29, in configs/flux.yaml for M > 256):
  three MMA warpgroups of one 64-row atom each, 512 threads, registers split 24 / 160 out of 512 x 128
  (``sm90_plan.ws_regs``).  At M = 1024, N = 3072 its 128 x 192 tiles make one wave of 128 CTAs on 132 SMs, each
  with 7.7 % less MMA work than the 208 x 128 tile's 120 (docs/PERF.md, session 23).

* ``ws_splitk2`` / ``ws_splitk4`` (128- and 64-row tiles; the 256-row tile with ``act_source`` images only;
  float64-checked and timed on the H200, sessions 5 and 7):
  the ``ws`` kernel with one tile per cluster of 2 / 4 CTAs (grid = tiles x S, no persistence), CTA rank r
  over k-tiles [r·K/S, (r+1)·K/S).  After the main loop the MMA warps of ranks 1.. store their fp32
  partial sums into their own stages (idle by then), a cluster barrier (joined by every thread, producers
  included) publishes them, rank 0 adds them one peer at a time through ``mapa`` + ``ld.shared::cluster``,
  a second cluster barrier keeps the peers' SMEM alive until read, and rank 0 alone runs the epilogue.
* ``ws_streamk`` (``act_source`` images; an experiment form, timed on an H100 in session 27, not shipped): the ``ws``
  kernel with grid = min(units, sm_count), where a unit is one tile's group of ``k_unroll`` k-tiles.  CTA b walks
  the units [b·U/G, (b+1)·U/G) tile by tile (``svdq_loader.ops.gemm_streamk``: ``segment``), producer and MMA
  warps alike, so every SM works where N / tile_n tiles would leave some idle.  A whole tile ends as in ``ws``.  A
  split one meets: every MMA thread stores its fp32 partial sums to this CTA's slot in the meetings' workspace
  (passed as ``ascales``, which an images form does not read), a named barrier, one thread's GPU-scope fence and
  compare-and-swap arrival on the tile's counter (``quantize_ptx._arrive``), a second barrier; the last arrival
  adds every part's slot in CTA order (the same sum whoever is last), resets the counter and runs the epilogue.
  No CTA waits for another.
  For small M, where N / 128 tiles leave most SMs idle.
* The 64-row activation tile (``tile_m`` 64, ws schedules only): wgmma N = 64, half the MMA and producer work
  of the 128-row tile where most rows are padding (M <= 64).  ``wsets`` 4 gives the MMA warps four raw weight
  register sets (k-tile j loaded four k-tiles before its decode) and unrolls their loop by four.

* ``act_source`` images (ws schedules): ``act`` points to decode_act's stage images (format in
  ``svdq_loader.ops.decode_act``), so the producer does no decode.  One producer thread waits on ``empty``,
  posts the stage's tile_m x 128 bytes as mbarrier transaction bytes (``full[s]`` then expects one arrival)
  and bulk-copies the k-tile's rows, one contiguous block, with ``cp.async.bulk``; the other producer
  threads only join the split-K cluster barriers.  The rest is the ws kernel above.  With no producer decode, the
  tile height is not bound to 64-row blocks: besides 256 rows, a 224-row tile (wgmma N = 224) gives fuller waves
  where 256-row tiles leave a short last one (M = 4608, N = 3072: 504 tiles, 3.8 waves on 132 SMs, against 432,
  3.3); the image covers whole tiles of both heights.

Launch ABI: host args = the op's (9 pointers, m, n, k, sm_count, stream); kernel params =
the 9 pointers and m, n, k.  block = (256, 1, 1) (ws*: 384), cluster (S, 1, 1) for split K, dynamic SMEM =
``smem_bytes_for(knobs)``, programmatic dependent launch (PDL: ``griddepcontrol.wait`` before any global
access; docs/design.md section 6).

Preconditions (the loader enforces them): 16-byte aligned contiguous tensors, m >= 1,
n % tile_n == 0, k % 128 == 0, element offsets < 2^31; weights in the sm90 fragment format.
"""
import os

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Float8E4M3FN, Int32, Int64, Uint16
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

try:
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # older DSL
    from cutlass.utils import LayoutEnum

from .sm90_decode_act import image_rows_dsl
from .sm90_decode_ptx import (_adecode, _adecode_prmt, _bcast, _bulk_g2s, _byte_form, _ld_cluster_v4f, _lds_v4f,
                              _lds_v4u, _scales_x128, _ld_relaxed_v4f, _st_v4f, _sts_v4f, _wdecode, weight_scales_x128)
from .sm90_epilogue_ptx import _bulk_s2g_row, _bulk_wait, pair_blocks, stage_yt_quads, store_yt
from .sm90_fp8_ptx import block_mults, e2m1_e4m3_reg, f16x2_of, lut_pair, lut_reg, round_scaled
from .sm90_plan import (FP8_PROMOTE_KTILES, FP8_RAW_WORD_BYTES, TILE_K, THREADS, _Cfg, bulk_store, out_row_bytes,
                        _lora_chunk, _problem, fp8_lut_weights, fp8_promotes, fp8_raw_block_bytes, fp8_smem_weights,
                        fp8_staged_weights,
                        fp8_weight_store_offset, frag_buffers, k_tile, mma_warpgroups, ws_regs, _smem_plan, is_streamk,
                        is_ws, k_unroll, ksplit_of, ring_aligned, ring_in_step, ring_prev_stage, ring_slot, ring_step,
                        split_k_share, threads_of)
from .quantize_ptx import _arrive, _fence_gpu, _ld_v2, _lds_u32, _st_u64, _sts_u32, _sts_v4, _wait_arrivals
from svdq_loader.ops.gemm_streamk import segment as streamk_segment
from svdq_loader.ops.ranges import cta_of_unit, range_start, slot_index, workspace_counter_bytes

#: Where the epilogue's operands are loaded (chosen at build time with ``SVDQ_KERNEL_SM90_EPILOGUE``, which like every
#: ``SVDQ_KERNEL_*`` switch enters the build cache key and the manifest): ``early``, the default, loads wcscale and
#: bias before the main loop's last wgmma wait and, under ``ws`` without split K, copies a one-chunk LoRA into its
#: SMEM with cp.async when the tile starts; ``late``, the earlier form kept for side-by-side builds, loads wcscale at
#: the start of a tile's epilogue, each LoRA chunk just before its MMAs and the bias after them.  ``early`` was up to
#: 6 % faster on the H200 (the best form of every FLUX shape swept at M = 64, 256 and 1024: 0.945-1.001 of ``late``)
#: and every sm_90a variant of its build passed the selftest (docs/PERF.md, session 28).
EPILOGUE = os.environ.get("SVDQ_KERNEL_SM90_EPILOGUE", "early")
if EPILOGUE not in ("late", "early"):
    raise ValueError(f"SVDQ_KERNEL_SM90_EPILOGUE={EPILOGUE!r}: the sm_90a epilogue form must be one of early, late")

#: What the spare MMA threads do where a LoRA chunk's lora_act_in vectors do not divide over them (the last round of
#: ``_lora_vectors``; ``SVDQ_KERNEL_SM90_LORA_SPARE``): ``skip``, the default, puts the spare threads' copy behind a
#: false predicate, so each vector is copied once; ``duplicate``, the form shipped until session 41, copies a vector
#: another thread copies too (the same bytes to the same address), which compute-sanitizer's racecheck reports as
#: write-write hazards (H100: the 128 x 192 tile, session 40; 17 variants of the 208- to 224-row tiles in both
#: modes, session 41). ``skip`` changes 62 sm_90a cubins of the flux build (registers equal, no stack frame, main
#: loops within 1 %: CPU, session 40); on an H100 (session 41) racecheck found 0 hazards in any of its 121 bf16 GEMM
#: variants, the selftest passed every variant (953/953), and the sweep of the seven ws forms at M = 64-4608 on
#: three FLUX shapes timed each shape's best form at 0.990-1.008x ``duplicate`` (all 84 points 0.981-1.034x,
#: geomean 1.000x; docs/PERF.md, session 41).
LORA_SPARE = os.environ.get("SVDQ_KERNEL_SM90_LORA_SPARE", "skip")
if LORA_SPARE not in ("duplicate", "skip"):
    raise ValueError(f"SVDQ_KERNEL_SM90_LORA_SPARE={LORA_SPARE!r}: the spare LoRA copies must be one of "
                     "duplicate, skip")

#: How a stream-K tile's parts meet (``SVDQ_KERNEL_SM90_STREAMK_MEET``): ``owner``, the default since session 48, has
#: the tile's first CTA, whose part comes last in its range, wait for the others' arrivals and add their slots to
#: its own registers: it never writes or reads back a slot of its own (half the slot traffic of a two-part tile), at
#: the price of a wait (bounded: a trap after 2 s, `quantize_ptx._wait_arrivals`); not applied where the registers
#: do not allow it (``owner_meets``).  ``last`` has every part write its slot and arrive, and the last arrival add
#: all slots (no CTA ever waits).  On an H100 (session 48) ``owner`` took 0.75-1.00x ``last``'s time at 30 points.
STREAMK_MEET = os.environ.get("SVDQ_KERNEL_SM90_STREAMK_MEET", "owner")
if STREAMK_MEET not in ("last", "owner"):
    raise ValueError(f"SVDQ_KERNEL_SM90_STREAMK_MEET={STREAMK_MEET!r}: the stream-K meeting must be one of last, "
                     f"owner")

#: How the MMA warps' main loop finds its ring stage and parity (``SVDQ_KERNEL_SM90_RING``): ``step``, the default,
#: takes them once per unrolled step (``sm90_plan.ring_step``), after which each k-tile's stage is a trace-time
#: constant or the base plus its offset (``ring_in_step``, ``ring_prev_stage``); ``modulo``, the earlier form kept
#: for side-by-side builds, takes ``ring_slot`` of every k-tile (a signed modulo and division, about ten
#: instructions each, and seven more for the stage a ``wait_group(1)`` hands back).  ``step`` was 0-2 % faster on
#: an H100 at every images form and shape swept, and every sm_90a variant of its build passed the selftest
#: (docs/PERF.md, session 27).
RING = os.environ.get("SVDQ_KERNEL_SM90_RING", "step")
if RING not in ("modulo", "step"):
    raise ValueError(f"SVDQ_KERNEL_SM90_RING={RING!r}: the sm_90a ring bookkeeping must be one of modulo, step")

_OUT_DTYPES = {"fp16": Float16, "bf16": BFloat16}
_ACC_UNSCALE = float(2 ** 14)


def _k(first, j):
    """The absolute k-tile of a CTA's j-th: j itself, or first + j under split K (trace time)."""
    return j if first is None else first + j


class _Sm90Wgmma:
    KERNEL_METHODS = ("kernel", "kernel_ws")      # schedule coop / ws and ws_splitk*
    MMA_PTX = "wgmma.mma_async"                   # the main loop's MMA (the family's static check)
    paired_store = True                           # the output leaves as transposed 16-bit pairs (static check too)

    def recipe_hints(self, host_args) -> tuple:
        """The persistent grid as a launch-recipe expression over `host_args` (the op's (name, kind) list):
        min(tiles, sm_count), or under stream-K min(units, sm_count) (``svdq_loader.ops.gemm_streamk.grid``).  The
        fitter's own search does not multiply by a quotient of a tile height such as 208 or 224 (those variants took
        the general path: the host-program interpreter once per new problem size; session 24); split K (tiles x S
        CTAs) needs no hint."""
        if self.ks > 1:
            return ()
        at = {name: ["arg", i] for i, (name, _) in enumerate(host_args)}
        tiles = ["mul", ["ceildiv", at["m"], self.tm], ["floordiv", at["n"], self.tn]]
        fill = ["min", tiles, at["sm_count"]]
        if not self.sk:
            return (fill,)
        return (["min", ["mul", fill, ["floordiv", at["k"], self.ktile * self.unroll]], at["sm_count"]],)

    def resource_problem(self, usage: dict):
        """None: the plan's budgets (sm90_plan) already hold every register limit of these schedules."""
        return None

    def __init__(self, cfg: _Cfg):
        reason = _problem(cfg)
        if reason:
            raise ValueError(f"unsupported sm90_wgmma_w4a4 variant: {reason}")
        self.cfg = cfg
        self.tm, self.tn, self.stages = cfg.tile_m, cfg.tile_n, cfg.stages
        self.mwg = mma_warpgroups(cfg)           # MMA warpgroups: 2, or 3 at tile_n 192
        self.mma_threads = 128 * self.mwg
        self.atoms = cfg.tile_n // (64 * self.mwg)   # 64-row wgmma atoms per MMA warpgroup
        self.rank = cfg.rank
        self.rc = _lora_chunk(cfg.rank) if cfg.rank else 0
        self.out_dtype = _OUT_DTYPES[cfg.out_dtype]
        self.plan = _smem_plan(cfg)
        self.smem_bytes = self.plan["total_bytes"]
        self.ws = is_ws(cfg)
        self.bulk_out = bulk_store(cfg)          # the output staged in SMEM and bulk-copied (an experiment)
        self.threads = threads_of(cfg)
        self.ks = ksplit_of(cfg)                 # ws_splitk<S>: CTAs of a cluster that split one tile's K
        self.nthr_a = 128 if self.ws else THREADS                # threads that decode activations
        self.chunks_a = self.tm * (TILE_K // 32) // self.nthr_a  # 32-k activation chunks per such thread
        self.prefetch = cfg.prefetch
        self.skip_pad = cfg.skip_pad
        self.act_decode = cfg.act_decode
        self.wsets = cfg.wsets                   # ws*: raw weight register sets of the MMA warps
        self.unroll = k_unroll(cfg)              # ws*: k-tiles per unrolled main-loop step
        self.images = cfg.act_source == "images"  # ws*: `act` holds decode_act's stage images
        # EPILOGUE early: ws without split K, a LoRA of one chunk (ranks 16, 32, 64) is copied into its SMEM at the
        # start of a tile.  Not under split K, and not for ranks of several chunks: there the 256-row tile spills
        # (ptxas keeps the later chunks' addresses live through the main loop, or the split's reduction needs them)
        self.early = EPILOGUE == "early"
        self.sk = is_streamk(cfg)                # ws_streamk: equal unit ranges, split tiles meet in the workspace
        # (not where it spilled: the 208-row tile with four weight sets kept 8-24 byte stack frames, session 24, and the
        # FP8-compute mode's 256-row staged tile a 16-byte one, session 48; those meet as ``last`` in an ``owner``
        # build)
        self.owner_meets = (self.sk and STREAMK_MEET == "owner" and not (self.tm * self.atoms > 128 and self.wsets > 2)
                            and cfg.compute != "fp8")
        # (nor in a form that promotes its FP8 sums to fp32: beside the promotion's branch the early copy left the
        # 208-row tile a 16-byte stack frame at rank 16)
        self.lora_prefetch = (self.early and self.ws and self.ks == 1 and not self.sk and cfg.rank > 0
                              and cfg.rank == self.rc and not fp8_promotes(cfg))
        # the FP8-compute mode (sm90_fp8_weight_format; docs/design.md section 2): E4M3 operands, 128-k k-tiles of
        # four 32-k FP8 wgmmas, eight weight words and four scale words per thread, atom and k-tile
        self.fp8 = cfg.compute == "fp8"
        self.ktile = k_tile(cfg)
        self.ab = Float8E4M3FN if self.fp8 else Float16
        self.kstep = 32 if self.fp8 else 16           # k per wgmma
        self.wwords, self.swords = (8, 4) if self.fp8 else (4, 2)
        self.nbuf = frag_buffers(cfg)                 # weight fragment buffers of the MMA warps (2, or 3: FP8)
        self.wsmem = fp8_smem_weights(cfg)            # FP8: warpgroup 0 decodes the weights into SMEM stages
        self.staged = fp8_staged_weights(cfg)         # FP8: the raw weight bytes come through the stages
        self.lut = fp8_lut_weights(cfg)               # FP8: ... with the producer's byte tables beside them
        self.rb = fp8_raw_block_bytes(cfg) if self.staged else 0     # stage bytes per 64-row block
        assert not self.staged or self.atoms == 1
        self.promote = fp8_promotes(cfg)              # FP8, fp16 out: fp32 sums in SMEM every few k-tiles

    @cute.jit
    def __call__(self, act: cute.Pointer, ascales: cute.Pointer, wgt: cute.Pointer, wscales: cute.Pointer,
                 lora_act_in: cute.Pointer, lora_up: cute.Pointer, wcscale: cute.Pointer, bias: cute.Pointer,
                 out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 sm_count: cutlass.Int32, stream: cuda.CUstream):
        tiles = ((m + (self.tm - 1)) // self.tm) * (n // self.tn)
        grid = cutlass.min(tiles, sm_count)
        if cutlass.const_expr(self.ws and self.ks > 1):
            # split K: one tile per cluster of ksplit CTAs (no persistence: the reduction re-uses the stages)
            self.kernel_ws(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out, m, n, k).launch(
                grid=[tiles * self.ks, 1, 1], block=[self.threads, 1, 1], cluster=[self.ks, 1, 1],
                smem=self.smem_bytes, stream=stream, min_blocks_per_mp=1, use_pdl=True)
        elif cutlass.const_expr(self.ws):
            if cutlass.const_expr(self.sk):
                # stream-K: one CTA per SM over equal ranges of the (tile, k-tile group) units (gemm_streamk.grid)
                # (as min(min(tiles, SMs) x units per tile, SMs): the same value, with no 32-bit overflow)
                grid = cutlass.min(grid * (k // (self.ktile * self.unroll)), sm_count)
            # min_blocks_per_mp=1 caps the registers at entry (65536 / 384), which setmaxnreg needs
            self.kernel_ws(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out, m, n, k).launch(
                grid=[grid, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes, stream=stream,
                min_blocks_per_mp=1, use_pdl=True)
        else:
            self.kernel(act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out, m, n, k).launch(
                grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream, use_pdl=True)

    # -- helpers (trace time) -------------------------------------------------
    def _gmem_views(self, p_act, p_asc, p_wgt, p_wsc, m, n, k):
        """num_kt, kw and the global tensors: activation words and scale pairs, weight fragments and scales (the
        output is written through its pointer, ``_store_out``)."""
        num_kt = cute.assume(k // self.ktile, divby=2)
        kw = cute.assume(k // 8, divby=16)          # 32-bit words of packed nibbles per activation row
        kq = cute.assume(k // 32, divby=4)          # 16-bit scale pairs per activation row
        mActW = cute.make_tensor(cute.recast_ptr(p_act, dtype=Int32), cute.make_layout((m, kw), stride=(kw, 1)))
        mAscH = cute.make_tensor(cute.recast_ptr(p_asc, dtype=Uint16), cute.make_layout((m, kq), stride=(kq, 1)))
        nwords = (n // 64) * num_kt * 128 * self.wwords
        mWq = cute.make_tensor(cute.recast_ptr(p_wgt, dtype=Int32), cute.make_layout(nwords))
        # FP8-compute mode: the fragment scales follow rw (float32 [N]) in `wscales`
        p_s = p_wsc + 4 * cute.assume(n, divby=64) if self.fp8 else p_wsc
        mWs = cute.make_tensor(cute.recast_ptr(p_s, dtype=Int32), cute.make_layout(nwords // 8))
        return num_kt, kw, mActW, mAscH, mWq, mWs

    def _stages(self, base):
        """The activation stages: `stages` 128-byte-swizzled K-major tiles of tile_m rows of 128 bytes at `base`
        (fp16: 64 k; E4M3 in the FP8-compute mode: 128 k)."""
        lay_a = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tn, self.tm, self.ktile), self.ab,
                                              self.stages)
        assert cute.cosize(lay_a) * self.ab.width // 8 <= self.plan["main_bytes"]
        return cute.make_tensor(cute.recast_ptr(base, lay_a.inner, dtype=self.ab), lay_a.outer)

    def _wstages(self, base):
        """smem weights (FP8): `stages` 128-byte-swizzled K-major tiles of tile_n weight rows of 128 E4M3 values
        (`_sts_weights` writes them by address; the layout is the same 8-row x 128-byte swizzle atom)."""
        lay_w = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tn, self.tm, self.ktile), self.ab,
                                              self.stages)
        assert cute.cosize(lay_w) == self.stages * self.tn * self.ktile
        return cute.make_tensor(cute.recast_ptr(base + self.plan["w_offset"], lay_w.inner, dtype=self.ab),
                                lay_w.outer)

    def _mma_parts_smem(self, sA, sW, tid):
        """smem weights (FP8): the shared-memory tiled wgmma (warpgroup w takes weight rows 64w..64w+63), its A and
        B views of the stages and the accumulators (the same layout as the register-A form's)."""
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab, self.ab, OperandMajorMode.K, OperandMajorMode.K, Float32, (self.mwg, 1, 1), (64, self.tm),
            sm90_utils.OperandSource.SMEM)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        thr_mma = tiled_mma.get_slice(tid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tn, self.tm)), Float32)
        return tiled_mma, tCrA, tCrB, acc

    def _sts_weights(self, wst, tidx, wraw, wsc, r2):
        """smem weights (FP8): decode thread `tidx`'s words of both 64-row blocks (the register-A form's fragments
        of MMA thread `tidx` of each warpgroup) and store each register of four E4M3 values at its row and k in the
        stage at shared address `wst` (8-row x 128-byte swizzle: 16-byte chunk c of row r at chunk c ^ (r mod 8))."""
        for b in range(self.mwg):
            for kb, h, i, v in self._fp8_regs(wraw[b], wsc[b], r2[b]):
                _sts_u32(wst + fp8_weight_store_offset(tidx, b, kb, h, i), v)

    def _fp8_regs(self, wraw, wsc, r2):
        """FP8-compute mode, one 64-row block's raw words and scales: (kb, h, i, register) for every fragment register
        of the k-tile (k-block kb, group h, row r0 + 8i), four values e4m3(e2m1 · scale · rw) each (word 2kb + h of
        `sm90_fp8_weight_format`; r2: fp16x2 {rw[r0], rw[r0 + 8]})."""
        for kb in range(self.ktile // self.kstep):
            for h in range(2):
                mult = block_mults(wsc[kb], h, r2)
                word = wraw[2 * kb + h]
                for i in range(2):
                    yield kb, h, i, round_scaled(e2m1_e4m3_reg(word, i), _bcast(mult, i))

    def _mma_parts(self, sA, tid):
        """For MMA thread `tid` (0..255): the register-A tiled wgmma, its B view of the stages, the two weight
        fragment buffers (as wgmma A operands and as Int32 words) and the accumulators (layout: ``_store_out``)."""
        tm, tn = self.tm, self.tn
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab, self.ab, OperandMajorMode.K, OperandMajorMode.K, Float32, (self.mwg, 1, 1), (64, tm),
            sm90_utils.OperandSource.RMEM)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        thr_mma = tiled_mma.get_slice(tid)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))
        # a thread's A values per atom and wgmma: eight fp16 (four registers), or sixteen E4M3 (four registers)
        frag_shape = ((4 if self.fp8 else 2, 2, 2), self.atoms, self.ktile // self.kstep)
        fragA = tuple(tiled_mma.make_fragment_A(frag_shape) for _ in range(self.nbuf))
        fragW = tuple(cute.make_tensor(cute.recast_ptr(f.iterator, dtype=Int32),
                                       cute.make_layout(16 * self.atoms)) for f in fragA)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tn, tm)), Float32)
        return tiled_mma, tCrB, fragA, fragW, acc

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
        for a in range(len(wblk)):
            blk = wblk[a] * num_kt + kt
            cute.autovec_copy(cute.local_tile(mWq, (self.wwords,), (blk * 128 + lane_t,)), wraw[a])
            cute.autovec_copy(cute.local_tile(mWs, (self.swords,), (blk * 32 + lane_t // 4,)), wsc[a])

    def _lds_words(self, raddr, lane_t, wraw):
        """staged / lut weights (FP8): thread `lane_t`'s eight words of one 64-row block's k-tile, from the stage
        bytes at shared address `raddr` (the fragment format's order)."""
        for h in range(2):
            v = _lds_v4u(raddr + lane_t * 32 + 16 * h)
            for i in range(4):
                wraw[4 * h + i] = v[i]

    def _lds_w(self, raddr, lane_t, wraw, wsc):
        """staged raw weights (FP8): thread `lane_t`'s eight words and its quad's four scale words of one 64-row
        block's k-tile, from the stage bytes at shared address `raddr` (the fragment format's order)."""
        self._lds_words(raddr, lane_t, wraw)
        v = _lds_v4u(raddr + FP8_RAW_WORD_BYTES + (lane_t // 4) * 16)
        for i in range(4):
            wsc[i] = v[i]

    def _copy_stage(self, bars, stage, sbase, gbase, mp, m0, n0, ka, num_kt, p_wgt, p_wsc, n):
        """Thread 0 of an images producer: k-tile `ka`'s image rows (tile_m rows of 128 bytes from `gbase`, whose
        image has `mp` rows) into `stage`, counted as transaction bytes on its full barrier; with staged or lut
        weights also each 64-row block's raw words (8 per thread of the fragment format) and, staged, its scales."""
        TB, WW = self.tm * TILE_K * 2, FP8_RAW_WORD_BYTES
        SW = self.rb - WW if self.staged and not self.lut else 0
        cute.arch.mbarrier_arrive_and_expect_tx(bars + stage, TB + self.mwg * (WW + SW) if self.staged else TB)
        src = gbase + (Int64(ka) * mp + m0) * (TILE_K * 2)
        _bulk_g2s(sbase + stage * TB, src, TB, (bars + stage).toint())
        if self.staged:
            for b in range(self.mwg):
                blk = Int64((n0 // 64 + b) * num_kt + ka)
                dst = sbase + self.plan["w_offset"] + (stage * self.mwg + b) * self.rb
                _bulk_g2s(dst, p_wgt.toint() + blk * WW, WW, (bars + stage).toint())
                if SW:
                    _bulk_g2s(dst + WW, p_wsc.toint() + Int64(n) * 4 + blk * SW, SW, (bars + stage).toint())

    def _staged_fragments(self, fragw, raddr, lane_t, wraw, wsc, r2):
        """staged / lut weights (FP8): thread `lane_t`'s fragments of one 64-row block's k-tile from its stage bytes
        at shared address `raddr`: its eight words, then (staged) its quad's scales and the register decode, or (lut)
        per word the 16 bytes of its group's tables for rows r0 and r0 + 8 (`FP8_LUT_BYTES`), two byte permutes."""
        if not self.lut:
            self._lds_w(raddr, lane_t, wraw[0], wsc[0])
            self._decode_w(fragw, wraw, wsc, r2)
            return
        self._lds_words(raddr, lane_t, wraw[0])
        tq = raddr + FP8_RAW_WORD_BYTES + (lane_t // 4) * 16
        for kb in range(self.ktile // self.kstep):
            for h in range(2):
                t = _lds_v4u(tq + (2 * kb + h) * 512)
                word = wraw[0][2 * kb + h]
                for i in range(2):
                    fragw[2 * h + i + 4 * kb] = lut_reg(word, t[2 * i], t[2 * i + 1], i)

    def _staged_kt(self, fragw, bars, g, rawb, lane_t, wraw, wsc, r2):
        """staged / lut weights (FP8): wait for the stage of ring index `g` to fill, then `_staged_fragments` of it
        (`rawb`: this warpgroup's block in stage 0)."""
        stage, par = ring_slot(g, self.stages)
        cute.arch.mbarrier_wait(bars + stage, par)
        self._staged_fragments(fragw, rawb + stage * (self.mwg * self.rb), lane_t, wraw, wsc, r2)

    def _store_act(self, sA, stage, rows, kcs, valid, raw, rsc, deq, only=None):
        if self.fp8:
            return      # traced in the decoding producer's branch, which an images form never runs
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

    def _decode_w(self, fragw, wraw, wsc, r2=None):
        if self.fp8:
            return self._decode_w_fp8(fragw, wraw, wsc, r2)
        for a in range(self.atoms):
            for j in range(4):
                s2 = weight_scales_x128(wsc[a][j // 2], j % 2)
                sb = (_bcast(s2, 0), _bcast(s2, 1))
                for p in range(4):
                    fragw[p + 4 * a + 4 * self.atoms * j] = _wdecode(wraw[a][j], sb[p % 2], p)

    def _decode_w_fp8(self, fragw, wraw, wsc, r2):
        """FP8-compute mode: k-block kb's words 2kb + h (group h) -> registers 2h (row r0) and 2h + 1 (row r0 + 8)
        of the atom's fragment, each value e4m3(e2m1 · scale · rw) (`sm90_fp8_weight_format`).  r2[a]: the atom's
        fp16x2 {rw[r0], rw[r0 + 8]}."""
        for a in range(self.atoms):
            for kb, h, i, v in self._fp8_regs(wraw[a], wsc[a], r2[a]):
                fragw[2 * h + i + 4 * a + 4 * self.atoms * kb] = v

    def _fp8_rw_pairs(self, p_wsc, n, n0, tidx, wg):
        """FP8-compute mode: per atom, fp16x2 {rw[r0], rw[r0 + 8]} of the thread's weight rows (rw: float32 [N]
        at the start of `wscales`)."""
        rows = self._rows_out(n0, tidx, wg)
        mRw = cute.make_tensor(cute.recast_ptr(p_wsc, dtype=Float32), cute.make_layout((n,)))
        return [f16x2_of(mRw[rows[2 * a]], mRw[rows[2 * a + 1]]) for a in range(self.atoms)]

    def _fp8_col_scale(self, p_act, m0, tidx, acc):
        """FP8-compute mode: acc[n, m] *= 1 / ra[m] (float32 [image_rows(M)] at the start of the call's workspace,
        before the E4M3 image: its address is the kernel parameter itself, so nothing derived from it lives
        through the main loop)."""
        p_ira = cute.recast_ptr(p_act, dtype=Float32)
        per_atom = cute.size(acc) // self.atoms
        q = tidx % 4
        for j in range(per_atom // 4):
            two = cute.make_tensor(p_ira + (m0 + 8 * j + 2 * q), cute.make_layout((2,)))
            for a in range(self.atoms):
                for hh in range(2):
                    for e in range(2):
                        i = a * per_atom + 4 * j + 2 * hh + e
                        acc[i] = acc[i] * two[e]

    # -- device kernel ----------------------------------------------------------
    @cute.kernel
    def kernel(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_wgt: cute.Pointer, p_wsc: cute.Pointer,
               p_la: cute.Pointer, p_lu: cute.Pointer, p_wc: cute.Pointer, p_bias: cute.Pointer,
               p_out: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32):
        tm, tn, S = self.tm, self.tn, self.stages
        cute.arch.griddepcontrol_wait()             # PDL: the previous grid's writes are visible from here on
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        wg = tidx // 128

        num_kt, kw, mActW, mAscH, mWq, mWs = self._gmem_views(p_act, p_asc, p_wgt, p_wsc, m, n, k)

        # ---- SMEM ---------------------------------------------------------------
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        sA = self._stages(base)

        # ---- MMA ----------------------------------------------------------------
        tiled_mma, tCrB, fragA, fragW, acc = self._mma_parts(sA, tidx)

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
            wblk = [n0 // 64 + a * self.mwg + wg for a in range(self.atoms)]
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
            if cutlass.const_expr(self.early):
                affine = self._load_affine(p_wc, p_bias, n, n0, tidx, wg)
                warpgroup.wait_group(0)
            else:
                warpgroup.wait_group(0)
                affine = self._load_affine(p_wc, p_bias, n, n0, tidx, wg, with_bias=False)
            self._epilogue(p_la, p_lu, p_bias, base, m, n, m0, n0, tidx, wg, affine, acc)
            self._store_out(p_out, m, n, m0, n0, tidx, wg, acc)
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

        num_kt, kw, mActW, mAscH, mWq, mWs = self._gmem_views(p_act, p_asc, p_wgt, p_wsc, m, n, k)
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.smem_bytes, byte_alignment=1024)
        sA = self._stages(base)
        bars = cute.recast_ptr(base + self.plan["bar_offset"], dtype=Int64)      # full[0..S), empty[0..S)
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                # full[s]: the images producer's expect-tx arrival (and, smem weights, every decoding thread's)
                cute.arch.mbarrier_init(bars + s, (129 if self.wsmem or self.lut else 1) if self.images else 128)
                cute.arch.mbarrier_init(bars + S + s, 4 * self.mwg)     # one arrival per MMA warp
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # launched as a programmatic dependent (PDL): the set-up above overlapped the previous grid's tail; no thread
        # touches global memory before that grid's writes are visible
        cute.arch.griddepcontrol_wait()

        tiles_n = n // tn
        tiles = ((m + (tm - 1)) // tm) * tiles_n
        KS = self.ks
        t0, tstep, nk = bid, gdim, num_kt           # the tile walk and the k-tiles per tile of this CTA
        tend = tiles
        kabs = None                                 # this CTA's first k-tile (split K)
        if cutlass.const_expr(KS > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            t0, tstep = bid // KS, gdim // KS
            kabs, nk = split_k_share(rank, num_kt, KS)
            nk = cute.assume(nk, divby=self.unroll)
        sk = None
        if cutlass.const_expr(self.sk):
            # stream-K: this CTA's units [u0, u1) of `units` (a unit: `unroll` k-tiles of one tile), tile by tile
            upt = num_kt // self.unroll
            units = tiles * upt
            u0 = Int32(range_start(Int64(bid), Int64(units), Int64(gdim)))
            u1 = Int32(range_start(Int64(bid + 1), Int64(units), Int64(gdim)))
            t0, tstep, tend = u0 // upt, 1, (u1 - 1) // upt + 1
            sk = (upt, units, u0, u1)
        if wg == 0 and cutlass.const_expr(self.wsmem):
            # ---- producer (FP8, smem weights): thread 0 bulk-copies each k-tile's E4M3 image rows, and all 128
            # threads decode the k-tile's tile_n weight rows into the weight stage beside it ---------------------
            cute.arch.setmaxregister_decrease(ws_regs(self.cfg)[1])
            TB = tm * TILE_K * 2                         # bytes of one activation stage
            WB = tn * self.ktile                         # bytes of one weight stage
            sbase = base.toint()
            wbase = sbase + self.plan["w_offset"]
            mp = Int64(image_rows_dsl(m))
            gbase = p_act.toint() + mp * 4               # past 1 / ra (float32 per image row)
            W, U = self.wsets, self.unroll
            wraw = [[cute.make_rmem_tensor((self.wwords,), Int32) for _ in range(self.mwg)] for _ in range(W)]
            wsc = [[cute.make_rmem_tensor((self.swords,), Int32) for _ in range(self.mwg)] for _ in range(W)]
            for tile in cutlass.range(t0, tend, tstep, unroll=1):
                tm_i = tile // tiles_n
                m0 = tm_i * tm
                n0 = (tile - tm_i * tiles_n) * tn
                wblk = [n0 // 64 + b for b in range(self.mwg)]
                r2 = [self._fp8_rw_pairs(p_wsc, n, n0, tidx, b)[0] for b in range(self.mwg)]
                kabs_t, nk_t, g0 = self._segment(tile, t0, tstep, kabs, nk, sk)
                for j in cutlass.range_constexpr(W):
                    self._load_w(mWq, mWs, wblk, num_kt, tidx, _k(kabs_t, j), wraw[j], wsc[j])
                for ktu in cutlass.range(0, nk_t, U, unroll=1):
                    for u in cutlass.range_constexpr(U):
                        kt = ktu + u
                        ws_ = u % W                 # the raw set of k-tile kt (U is a multiple of W)
                        stage, par = ring_slot(g0 + kt, S)
                        cute.arch.mbarrier_wait(bars + S + stage, par ^ 1)
                        if tidx == 0:
                            cute.arch.mbarrier_arrive_and_expect_tx(bars + stage, TB)
                            src = gbase + (Int64(_k(kabs_t, kt)) * mp + m0) * (TILE_K * 2)
                            _bulk_g2s(sbase + stage * TB, src, TB, (bars + stage).toint())
                        self._sts_weights(wbase + stage * WB, tidx, wraw[ws_], wsc[ws_], r2)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.mbarrier_arrive(bars + stage)
                        nxt = cutlass.min(kt + W, nk_t - 1)
                        self._load_w(mWq, mWs, wblk, num_kt, tidx, _k(kabs_t, nxt), wraw[ws_], wsc[ws_])
        elif wg == 0 and cutlass.const_expr(self.images):
            # ---- producer (act_source images): one thread bulk-copies each k-tile's image rows ----------
            cute.arch.setmaxregister_decrease(ws_regs(self.cfg)[1])
            if cutlass.const_expr(self.lut):
                # lut weights: thread 0 bulk-copies each k-tile's activation image rows and both blocks' raw words
                # into the stage (as staged, without the scales); every thread writes the byte tables of block
                # tidx // 64, quad q = tidx % 32 and groups 4j .. 4j + 3 (j = tidx // 32 % 2): per group, its two
                # rows' fp16 scale · rw (block_mults, from the 8 scale bytes it loads per k-tile) and the eight E4M3
                # bytes of each E2M1 magnitude times it (lut_pair), 16 bytes at (32 g + q) · 16 past the block's
                # words; then every thread arrives on the stage's full barrier (129 with thread 0's expect-tx)
                RB, WW = self.rb, FP8_RAW_WORD_BYTES
                sbase = base.toint()
                mp = Int64(image_rows_dsl(m))
                gbase = p_act.toint() + mp * 4                  # past 1 / ra (float32 per image row)
                b = tidx // 64
                q = tidx % 32
                j = (tidx // 32) % 2
                r0 = 16 * (q // 8) + q % 8                      # the quad's first row in its 64-row block
                mRw = cute.make_tensor(cute.recast_ptr(p_wsc, dtype=Float32), cute.make_layout((n,)))
                sgl = p_wsc.toint() + Int64(n) * 4 + q * 16 + j * 8   # + 512 per (block, k-tile): its 8 scale bytes
                for tile in cutlass.range(t0, tend, tstep, unroll=1):
                    m0 = (tile // tiles_n) * tm
                    n0 = (tile - (tile // tiles_n) * tiles_n) * tn
                    kabs_t, nk_t, g0 = self._segment(tile, t0, tstep, kabs, nk, sk)
                    row = n0 + 64 * b + r0
                    r2 = f16x2_of(mRw[row], mRw[row + 8])
                    for kt in cutlass.range(0, nk_t, unroll=1):
                        ka = _k(kabs_t, kt)
                        sc = _ld_v2(sgl + Int64((n0 // 64 + b) * num_kt + ka) * 512, True)
                        stage, par = ring_slot(g0 + kt, S)
                        cute.arch.mbarrier_wait(bars + S + stage, par ^ 1)
                        if tidx == 0:
                            self._copy_stage(bars, stage, sbase, gbase, mp, m0, n0, ka, num_kt, p_wgt, p_wsc, n)
                        tb = sbase + self.plan["w_offset"] + (stage * self.mwg + b) * RB + WW + q * 16
                        for gi in cutlass.range_constexpr(4):
                            mult = block_mults(sc[gi // 2], gi % 2, r2)
                            l0 = lut_pair(_bcast(mult, 0))
                            l1 = lut_pair(_bcast(mult, 1))
                            _sts_v4(tb + (4 * j + gi) * 512, l0[0], l0[1], l1[0], l1[1])
                        cute.arch.mbarrier_arrive(bars + stage)
            elif tidx == 0:
                sbase = base.toint()
                gbase = p_act.toint()
                mp = Int64(image_rows_dsl(m))
                if cutlass.const_expr(self.fp8):
                    gbase = gbase + mp * 4                  # past 1 / ra (float32 per image row)
                for tile in cutlass.range(t0, tend, tstep, unroll=1):
                    m0 = (tile // tiles_n) * tm
                    n0 = (tile - (tile // tiles_n) * tiles_n) * tn
                    kabs_t, nk_t, g0 = self._segment(tile, t0, tstep, kabs, nk, sk)
                    for kt in cutlass.range(0, nk_t, unroll=1):
                        stage, par = ring_slot(g0 + kt, S)
                        cute.arch.mbarrier_wait(bars + S + stage, par ^ 1)
                        self._copy_stage(bars, stage, sbase, gbase, mp, m0, n0, _k(kabs_t, kt), num_kt, p_wgt,
                                         p_wsc, n)
            if cutlass.const_expr(KS > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
        elif wg == 0:
            # ---- producer: raw activation bytes -> registers -> exact fp16 -> stage ------------------
            cute.arch.setmaxregister_decrease(ws_regs(self.cfg)[1])
            P = self.prefetch
            sets = [self._buffers(tidx) for _ in range(P)]
            raw, rsc = [b[0] for b in sets], [b[1] for b in sets]
            deq, rows, kcs = sets[0][2], sets[0][5], sets[0][6]
            for tile in cutlass.range(t0, tiles, tstep, unroll=1):
                m0 = (tile // tiles_n) * tm
                valid = [(m0 + r) < m for r in rows]
                rows_ld = [cutlass.min(m0 + r, m - 1) for r in rows]
                full = (m0 + tm) <= m
                g0 = (tile - t0) // tstep * nk
                for t in cutlass.range_constexpr(P):
                    self._load_act(mActW, mAscH, rows_ld, kcs, kw, _k(kabs, t), raw[t], rsc[t])
                UP = max(2, P)                      # k-tiles per unrolled producer step (a multiple of P)
                step = RING == "step" and ring_aligned(S, UP)
                for kt2 in cutlass.range(0, nk, UP, unroll=1):
                    gs = g0 + kt2                   # a multiple of UP: every tile's or share's nk is one of U
                    if cutlass.const_expr(step):
                        ring0 = ring_step(gs, S)
                    for half in cutlass.range_constexpr(UP):
                        kt = kt2 + half
                        rs = half % P               # the register set holding k-tile kt
                        if cutlass.const_expr(step):
                            stage, par = ring_in_step(ring0, half, S, UP)
                        else:
                            stage, par = ring_slot(g0 + kt, S)
                        cute.arch.mbarrier_wait(bars + S + stage, par ^ 1)
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
                        nxt = cutlass.min(kt + P, nk - 1)
                        self._load_act(mActW, mAscH, rows_ld, kcs, kw, _k(kabs, nxt), raw[rs], rsc[rs])
            if cutlass.const_expr(KS > 1):
                # the MMA warpgroups' two cluster barriers around the split-K reduction (every thread joins)
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
        else:
            # ---- MMA warpgroups: weight fragments -> registers; wgmma; epilogue -------------------------
            cute.arch.setmaxregister_increase(ws_regs(self.cfg)[2])
            ctid = tidx - 128
            cwg = wg - 1
            lane = tidx % 32
            W, U = self.wsets, self.unroll
            if cutlass.const_expr(self.wsmem):
                tiled_mma, tCrA, tCrB, acc = self._mma_parts_smem(sA, self._wstages(base), ctid)
            else:
                tiled_mma, tCrB, fragA, fragW, acc = self._mma_parts(sA, ctid)
                # W raw weight sets: k-tile j's bytes are loaded W k-tiles before they are decoded (set j mod W)
                wraw = [[cute.make_rmem_tensor((self.wwords,), Int32) for _ in range(self.atoms)] for _ in range(W)]
                wsc = [[cute.make_rmem_tensor((self.swords,), Int32) for _ in range(self.atoms)] for _ in range(W)]
            for tile in cutlass.range(t0, tend, tstep, unroll=1):
                tm_i = tile // tiles_n
                tn_i = tile - tm_i * tiles_n
                m0 = tm_i * tm
                n0 = tn_i * tn
                wblk = [n0 // 64 + a * self.mwg + cwg for a in range(self.atoms)]
                kabs_t, nk_t, g0 = self._segment(tile, t0, tstep, kabs, nk, sk)
                acc.fill(0.0)
                if cutlass.const_expr(self.promote):
                    psum = base.toint() + self.plan["sum_offset"]
                    self._promote(psum, ctid, acc, first=True)
                if cutlass.const_expr(self.staged):
                    # the first k-tile's raw bytes: wait for its stage, read them, decode
                    r2 = None if self.lut else self._fp8_rw_pairs(p_wsc, n, n0, ctid, cwg)
                    rawb = base.toint() + self.plan["w_offset"] + cwg * self.rb
                    self._staged_kt(fragW[0], bars, g0, rawb, ctid % 128, wraw[0], wsc[0], r2)
                elif cutlass.const_expr(not self.wsmem):
                    r2 = self._fp8_rw_pairs(p_wsc, n, n0, ctid, cwg) if self.fp8 else None
                    for j in cutlass.range_constexpr(W):
                        self._load_w(mWq, mWs, wblk, num_kt, ctid, _k(kabs_t, j), wraw[j], wsc[j])
                    self._decode_w(fragW[0], wraw[0], wsc[0], r2)
                    nxt0 = cutlass.min(W, nk_t - 1)
                    self._load_w(mWq, mWs, wblk, num_kt, ctid, _k(kabs_t, nxt0), wraw[0], wsc[0])
                if cutlass.const_expr(self.lora_prefetch):
                    # the LoRA rides in during the main loop (its SMEM is idle until the epilogue)
                    self._lora_prefetch(p_la, p_lu, base, m, n, m0, n0, ctid)
                step = RING == "step" and ring_aligned(S, U)
                for ktu in cutlass.range(0, nk_t, U, unroll=1):
                    gs = g0 + ktu
                    if cutlass.const_expr(step):
                        ring0 = ring_step(gs, S)
                    for u in cutlass.range_constexpr(U):
                        kt = ktu + u
                        half = u % self.nbuf        # the fragment buffer of k-tile kt (U is a multiple of nbuf)
                        g = g0 + kt
                        if cutlass.const_expr(step):
                            stage, par = ring_in_step(ring0, u, S, U)
                        else:
                            stage, par = ring_slot(g, S)
                        cute.arch.mbarrier_wait(bars + stage, par)
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(self.ktile // self.kstep):
                            if cutlass.const_expr(self.wsmem):
                                cute.gemm(tiled_mma, acc, tCrA[None, None, kb, stage], tCrB[None, None, kb, stage],
                                          acc)
                            else:
                                cute.gemm(tiled_mma, acc, fragA[half][None, None, kb], tCrB[None, None, kb, stage],
                                          acc)
                        warpgroup.commit_group()
                        ws_ = (u + 1) % W
                        nbuf = 0 if self.wsmem else self.nbuf
                        if cutlass.const_expr(nbuf == 3 and self.staged):
                            # three buffers: k-tile kt+1's takes k-tile kt-2's buffer, whose wgmmas are done
                            # (the last wait_group(1) retired kt-2), so its decode overlaps the MMAs of kt-1 and kt
                            if kt + 1 < nk_t:
                                self._staged_kt(fragW[(u + 1) % nbuf], bars, g + 1, rawb, ctid % 128, wraw[0],
                                                wsc[0], r2)
                        elif cutlass.const_expr(nbuf == 3):
                            # (the same, from the raw weight set (u+1) mod W in registers)
                            self._decode_w(fragW[(u + 1) % nbuf], wraw[ws_], wsc[ws_], r2)
                            nxt = cutlass.min(kt + 1 + W, nk_t - 1)
                            self._load_w(mWq, mWs, wblk, num_kt, ctid, _k(kabs_t, nxt), wraw[ws_], wsc[ws_])
                        warpgroup.wait_group(1)     # k-tile kt-1 is done: its stage goes back to the producer
                        if cutlass.const_expr(self.promote and u == U - 1):
                            if (ktu + U) % FP8_PROMOTE_KTILES == 0:
                                # every FP8_PROMOTE_KTILES k-tiles: all of this warpgroup's wgmmas done, the
                                # accumulators go into the fp32 sums
                                warpgroup.wait_group(0)
                                self._promote(psum, ctid, acc)
                        if cutlass.const_expr(u > 0):
                            if lane == 0:
                                self._hand_back(bars, g, ring0 if step else None, u)
                        else:
                            if ktu > 0:
                                if lane == 0:
                                    self._hand_back(bars, g, ring0 if step else None, u)
                        if cutlass.const_expr(nbuf == 2 and self.staged):
                            # k-tile kt+1's raw bytes from its stage -> fragments 1-half
                            if kt + 1 < nk_t:
                                self._staged_kt(fragW[1 - half], bars, g + 1, rawb, ctid % 128, wraw[0], wsc[0], r2)
                        elif cutlass.const_expr(nbuf == 2):
                            # k-tile kt+1 (raw set (u+1) mod W) -> fragments 1-half; then k-tile kt+1+W into that set
                            self._decode_w(fragW[1 - half], wraw[ws_], wsc[ws_], r2)
                            nxt = cutlass.min(kt + 1 + W, nk_t - 1)
                            self._load_w(mWq, mWs, wblk, num_kt, ctid, _k(kabs_t, nxt), wraw[ws_], wsc[ws_])
                if cutlass.const_expr(KS == 1 and self.early and not self.sk):
                    # the affine's loads overlap the last wgmmas (under split K they would live through the reduction)
                    affine = self._load_affine(p_wc, p_bias, n, n0, ctid, cwg)
                warpgroup.wait_group(0)
                if lane == 0:
                    cute.arch.mbarrier_arrive(bars + S + (g0 + nk_t - 1) % S)
                if cutlass.const_expr(self.sk):
                    # a whole tile ends as in ws; a split one meets, and its last arrival ends it
                    upt, units = sk[0], sk[1]
                    fin = Int32(1)
                    if (kabs_t != 0) | (nk_t != num_kt):
                        fin = self._streamk_meet(p_asc, base, tile, t0, upt, units, bid, gdim, ctid, acc)
                    if fin != 0:
                        aff = self._load_affine(p_wc, p_bias, n, n0, ctid, cwg, with_bias=False)
                        if cutlass.const_expr(self.fp8):
                            self._fp8_col_scale(p_act, m0, ctid, acc)
                        self._epilogue(p_la, p_lu, p_bias, base, m, n, m0, n0, ctid, cwg, aff, acc)
                        self._store_out(p_out, m, n, m0, n0, ctid, cwg, acc)
                elif cutlass.const_expr(KS > 1):
                    # split K: ranks 1.. leave their partial sums in their own (now idle) stages, rank 0 adds
                    # them through distributed SMEM; a second cluster barrier keeps the partials alive until read
                    red = base.toint()
                    nacc = cute.size(acc)
                    self._mma_sync()                          # both MMA warpgroups are past their last wgmma
                    if rank != 0:
                        for i in cutlass.range_constexpr(nacc // 4):
                            _sts_v4f(red + (i * 256 + ctid) * 16, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                                     acc[4 * i + 3])
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
                    if rank == 0:
                        for r in cutlass.range(1, KS, unroll=1):     # one peer at a time (registers)
                            for i in cutlass.range_constexpr(nacc // 4):
                                v = _ld_cluster_v4f(red + (i * 256 + ctid) * 16, r)
                                for j in cutlass.range_constexpr(4):
                                    acc[4 * i + j] = acc[4 * i + j] + v[j]
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
                    if rank == 0:
                        # (bias after the LoRA: with it loaded first, the 256-row tile spills)
                        aff = self._load_affine(p_wc, p_bias, n, n0, ctid, cwg, with_bias=False)
                        self._epilogue(p_la, p_lu, p_bias, base, m, n, m0, n0, ctid, cwg, aff, acc)
                        self._store_out(p_out, m, n, m0, n0, ctid, cwg, acc)
                else:
                    if cutlass.const_expr(not self.early):
                        affine = self._load_affine(p_wc, p_bias, n, n0, ctid, cwg, with_bias=False)
                    if cutlass.const_expr(self.promote):
                        self._promote(psum, ctid, acc, last=True)
                    if cutlass.const_expr(self.fp8):
                        self._fp8_col_scale(p_act, m0, ctid, acc)
                    self._epilogue(p_la, p_lu, p_bias, base, m, n, m0, n0, ctid, cwg, affine, acc,
                                   lora_ready=self.lora_prefetch)
                    if cutlass.const_expr(self.bulk_out):
                        self._store_out_bulk(p_out, base, m, n, m0, n0, ctid, cwg, acc)
                    else:
                        self._store_out(p_out, m, n, m0, n0, ctid, cwg, acc)
            if cutlass.const_expr(self.bulk_out):
                _bulk_wait(False)       # the last tile's copies are done before the CTA's SMEM goes away

    def _promote(self, psum, tidx, acc, first=False, last=False):
        """FP8, fp16 out (`sm90_plan.fp8_promotes`): MMA thread `tidx`'s fp32 sums at shared address `psum`, four per
        16-byte slot, slot i of thread t at (256 i + t) * 16 (256 MMA threads; a warp's stores are 512 contiguous
        bytes).  first: set
        them to zero (tile start); last: add them into `acc` (tile end, every wgmma done: the k-tiles since the last
        promotion are still in `acc`); else add `acc` into them and clear `acc` for the next wgmmas.  A thread touches
        only its own slots, so its program order is the only order needed."""
        for i in range(cute.size(acc) // 4):
            addr = psum + (i * self.mma_threads + tidx) * 16
            if first:
                _sts_v4f(addr, Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0))
            else:
                v = _lds_v4f(addr)
                if last:
                    for j in range(4):
                        acc[4 * i + j] = acc[4 * i + j] + v[j]
                else:
                    _sts_v4f(addr, v[0] + acc[4 * i], v[1] + acc[4 * i + 1], v[2] + acc[4 * i + 2],
                             v[3] + acc[4 * i + 3])
        if not first and not last:
            acc.fill(0.0)

    def _hand_back(self, bars, g, ring0, u):
        """Arrive on the empty barrier of the k-tile before k-tile g (the u-th of its unrolled loop step),
        which a ``wait_group(1)`` has just retired: its stage from the step's `ring0` (``RING`` step), or
        ``(g - 1) % stages`` where `ring0` is None."""
        S, U = self.stages, self.unroll
        if ring0 is None:
            prev = (g - 1) % S
        else:
            prev = ring_in_step(ring0, u - 1, S, U)[0] if u > 0 else ring_prev_stage(ring0, S, U)
        cute.arch.mbarrier_arrive(bars + S + prev)

    def _segment(self, tile, t0, tstep, kabs, nk, sk):
        """(first k-tile, k-tiles, ring index of its first k-tile) of this CTA's work on `tile`: the whole tile or
        its split-K share; under stream-K (`sk` = (units per tile, units, u0, u1)) the part of its units in the
        CTA's range.  The producer and the MMA warps call it alike, so they walk the same segments."""
        if cutlass.const_expr(sk is None):
            return kabs, nk, (tile - t0) // tstep * nk
        upt, _, u0, u1 = sk
        kabs, nk, g0 = streamk_segment(tile, u0, u1, upt, self.unroll, cutlass.max, cutlass.min)
        return kabs, cute.assume(nk, divby=self.unroll), g0

    @cute.jit
    def _streamk_meet(self, p_ws, base, tile, t0, upt, units, bid, gdim, tidx, acc):
        """A split tile's meeting (`svdq_loader.ops.gemm_streamk`): write the partial sums to this CTA's slot,
        count one arrival on the tile's counter (one thread: GPU-scope fence, then the compare-and-swap of
        `quantize_ptx._arrive`, acq_rel), and if it is the last, add every part's slot in CTA order into `acc`
        and reset the counter.  Returns 1 where this CTA ends the tile.  tidx: the thread among the MMA threads.
        p_ws: the meetings' workspace, which the launcher passes as ``ascales`` (an images form reads no scales)."""
        G = Int64(gdim)
        U = Int64(units)
        ws = p_ws.toint()
        parts = ws + workspace_counter_bytes(G)
        slot = self.tm * self.tn * 4
        P = Int64(upt)
        tu = Int64(tile) * P
        b_first = Int32(cta_of_unit(tu, U, G))
        b_last = Int32(cta_of_unit(tu + P - 1, U, G))
        counter = ws + Int64(b_first) * 8
        if cutlass.const_expr(self.owner_meets):
            return self._streamk_owner_meet(parts, slot, counter, tile, t0, upt, U, G, bid, b_first, b_last, tidx,
                                            acc)
        self._slot_write(parts + slot_index(bid, tile, t0, Int64) * slot, tidx, acc)
        word = base.toint() + self.plan["meet_offset"]
        self._mma_sync()                           # every MMA thread's slot writes are done
        if tidx == 0:
            _fence_gpu()
            _sts_u32(word, _arrive(counter))
        self._mma_sync()
        last = Int32(_lds_u32(word) == b_last - b_first + 1)
        if last != 0:
            acc.fill(0.0)
            for b in cutlass.range(b_first, b_last + 1, 1, unroll=1):
                self._slot_add(self._part_slot(parts, slot, b, tile, U, G, P), tidx, acc)
            if tidx == 0:
                _st_u64(counter, Int64(0))
        return last

    @cute.jit
    def _streamk_owner_meet(self, parts, slot, counter, tile, t0, upt, U, G, bid, b_first, b_last, tidx, acc):
        """The ``owner`` meeting (``STREAMK_MEET``): a CTA other than the tile's first writes its slot and arrives;
        the first CTA (its part is the last one of its range) waits for the others' arrivals (one thread, then a
        barrier of the MMA threads) and adds their slots, in CTA order after its own part, into `acc`.  Returns 1
        where this CTA ends the tile."""
        owner = Int32(bid == b_first)
        if owner == 0:
            self._slot_write(parts + slot_index(bid, tile, t0, Int64) * slot, tidx, acc)
            self._mma_sync()                       # every MMA thread's slot writes are done
            if tidx == 0:
                _fence_gpu()
                _arrive(counter)
        else:
            if tidx == 0:
                _wait_arrivals(counter, b_last - b_first)
            self._mma_sync()
            for b in cutlass.range(b_first + 1, b_last + 1, 1, unroll=1):
                self._slot_add(self._part_slot(parts, slot, b, tile, U, G, Int64(upt)), tidx, acc)
            if tidx == 0:
                _st_u64(counter, Int64(0))
        return owner

    def _slot_write(self, addr, tidx, acc):
        """This MMA thread's accumulators -> the meeting slot at `addr` (its 16-byte vector i at
        (i * mma_threads + tidx) * 16, so a warp's stores cover 512 contiguous bytes)."""
        for i in range(cute.size(acc) // 4):
            _st_v4f(addr + (i * self.mma_threads + tidx) * 16, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                    acc[4 * i + 3])

    def _slot_add(self, addr, tidx, acc):
        """acc += the meeting slot at `addr`, read as `_slot_write` wrote it (relaxed GPU-scope loads)."""
        for i in range(cute.size(acc) // 4):
            v = _ld_relaxed_v4f(addr + (i * self.mma_threads + tidx) * 16)
            for j in range(4):
                acc[4 * i + j] = acc[4 * i + j] + v[j]

    def _part_slot(self, parts, slot, b, tile, U, G, P):
        """The address of CTA b's slot for `tile` (the slot it wrote: `ranges.slot_index` of its range's first
        tile, range_start(b) // P)."""
        first_tile = Int32(range_start(Int64(b), U, G) // P)
        return parts + slot_index(b, tile, first_tile, Int64) * slot

    def _rows_out(self, n0, tidx, wg):
        """The output rows (weight rows) of MMA thread `tidx` of warpgroup `wg`: two per 64-row atom."""
        row0 = n0 + wg * 64 + (tidx % 128) // 32 * 16 + (tidx % 32) // 4
        return [row0 + a * 64 * self.mwg + 8 * h for a in range(self.atoms) for h in range(2)]

    def _load_bias(self, p_bias, n, rows_out):
        mB = cute.make_tensor(p_bias, cute.make_layout((n,), stride=(1,)))
        bv = cute.make_rmem_tensor((2 * self.atoms,), Float32)
        for i in range(2 * self.atoms):
            bv[i] = mB[rows_out[i]]
        return bv

    def _load_affine(self, p_wc, p_bias, n, n0, tidx, wg, with_bias=True):
        """(2^14·wcscale, bias or None) of the thread's output rows, in registers: the early epilogue calls it before
        the main loop's last wgmma wait, so the global round trip overlaps it, the late one when its epilogue
        starts.  Without ``with_bias`` the epilogue loads the bias after the LoRA (fewer live registers there).
        In the FP8-compute mode the `wcscale` input already holds wcscale / rw (`prepare_weight`), and is the
        coefficient."""
        rows_out = self._rows_out(n0, tidx, wg)
        coef = cute.make_rmem_tensor((2 * self.atoms,), Float32)
        for i in range(2 * self.atoms):
            unscale = Float32(1.0 if self.fp8 else _ACC_UNSCALE)
            if self.cfg.wcscale:
                mWc = cute.make_tensor(p_wc, cute.make_layout((n,), stride=(1,)))
                coef[i] = mWc[rows_out[i]] * unscale
            else:
                coef[i] = unscale
        bv = self._load_bias(p_bias, n, rows_out) if self.cfg.bias and with_bias else None
        return coef, bv

    def _epilogue(self, p_la, p_lu, p_bias, base, m, n, m0, n0, tidx, wg, affine, acc, lora_ready=False):
        """acc *= 2^14·wcscale[n]; LoRA; + bias (the store, with its run-time predicate, stays in the kernel
        body).  tidx: the thread's index among the MMA threads (256, or 384 at tile_n 192), wg: its MMA warpgroup
        (0, 1 or 2); affine: ``_load_affine``'s registers; lora_ready: the LoRA's first chunk is already on its way
        to SMEM (``_lora_prefetch``)."""
        coef, bv = affine
        nacc = cute.size(acc)
        per_atom = nacc // self.atoms
        for i in range(nacc):
            acc[i] = acc[i] * coef[(i // per_atom) * 2 + (i // 2) % 2]

        if self.rank > 0:
            self._lora(p_la, p_lu, base, m, n, m0, n0, tidx, acc, lora_ready)

        if self.cfg.bias:
            if bv is None:
                bv = self._load_bias(p_bias, n, self._rows_out(n0, tidx, wg))
            for i in range(nacc):
                acc[i] = acc[i] + bv[(i // per_atom) * 2 + (i // 2) % 2]

    def _store_out(self, p_out, m, n, m0, n0, tidx, wg, acc):
        """acc (Yᵀ of the tile) -> out[m0 + ·, n0 + ·] where the row is < m, as transposed 16-bit pairs
        (``sm90_epilogue_ptx``): acc[a·per_atom + 4j + 2h + e] is Yᵀ[n0 + 128a + 64·wg + 16·warp + 8h + g,
        m0 + 8j + 2·(lane % 4) + e], the wgmma C layout of each 64-row atom."""
        nw = n0 + wg * 64 + (tidx % 128) // 32 * 16
        store_yt(p_out.toint(), n, m, m0, nw, tidx % 32, acc, pair_blocks(self.atoms, self.tm), self.cfg.out_dtype)

    def _store_out_bulk(self, p_out, base, m, n, m0, n0, tidx, wg, acc):
        """``STORE`` ``bulk``: the tile's quads into its SMEM rows, then one thread per row (``tidx`` < tile_m, the
        row < m) bulk-copies it to the output.  The rows are rewritten only after every thread's copies of the
        previous tile have read them (each thread waits for its own bulk groups, then the MMA threads meet)."""
        sout = base.toint() + self.plan["out_offset"]
        rb = out_row_bytes(self.cfg)
        _bulk_wait(True)
        self._mma_sync()
        stage_yt_quads(sout, rb, wg * 64 + (tidx % 128) // 32 * 16, tidx % 32, acc, pair_blocks(self.atoms, self.tm),
                       self.cfg.out_dtype)
        cute.arch.fence_proxy("async.shared", space="cta")     # the generic-proxy writes, before the async reads
        self._mma_sync()
        r = cutlass.min(tidx, self.tm - 1)
        _bulk_s2g_row(p_out.toint() + (Int64(m0 + r) * n + n0) * 2, sout + r * rb, self.tn * 2,
                      Int32((tidx < self.tm) & (m0 + tidx < m)))

    def _stage_la(self, mLA, sLA, vbuf, m, m0, ch, vpr, r, cv):
        """Vector `cv` of row `r` of a lora_act_in chunk -> SMEM (rows >= m as zeros)."""
        cute.autovec_copy(cute.local_tile(mLA, (1, 8), (cutlass.min(m0 + r, m - 1), ch * vpr + cv)), vbuf)
        ok = (m0 + r) < m
        for e in range(8):
            vbuf[e] = cutlass.select_(ok, vbuf[e], self.out_dtype(0.0))
        cute.autovec_copy(vbuf, cute.local_tile(sLA[None, None, 0], (1, 8), (r, cv)))

    def _mma_sync(self):
        """A barrier over the 256 MMA threads: the whole CTA (coop), or named barrier 1 (ws: the producer
        warpgroup is not in it)."""
        if self.ws:
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
        else:
            cute.arch.sync_threads()

    def _lora_views(self, p_la, p_lu, base, m, n):
        """The LoRA operands in global memory (lora_act_in [m, R], lora_up [n, R]) and their SMEM chunk buffers
        (lora_up as the wgmma A operand, lora_act_in as B; ``rc`` ranks each)."""
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
        return mLA, mLU, sLU, sLA

    def _lora_vectors(self, tidx):
        """The 16-byte vectors of one chunk this thread copies: ``(lu, la)``, generators of (row, vector in row) and,
        for ``la``, of a third item ``ok`` (see `_if`), so the index arithmetic is traced next to each copy.  Where
        the lora_act_in vectors do not divide over the MMA threads (the 128 x 192 tile's 384 threads at a 32-rank
        chunk: 512 vectors; the 64-row tile at a 16-rank chunk: 128 vectors for 256 threads; the 208-, 216- and
        224-row tiles), the last round's spare threads either copy nothing, their copy in a branch on ``ok`` = the
        vector exists (``LORA_SPARE`` ``skip``, the default), or copy a vector another thread copies too, the same
        bytes to the same address, with no branch (``duplicate``)."""
        NT = self.mma_threads
        vpr = self.rc // 8                  # 16-byte vectors per row of a chunk
        nla = self.tm * vpr                 # 16-byte vectors of the lora_act_in chunk
        assert (self.tn * vpr) % NT == 0, "lora_up's chunk vectors must divide over the MMA threads"

        def lu():
            for i in range(self.tn * vpr // NT):
                v = tidx + i * NT
                yield v // vpr, v % vpr

        def la():
            for i in range((nla + NT - 1) // NT):
                v = tidx + i * NT
                ok = True
                if cutlass.const_expr((i + 1) * NT > nla):          # the last round, with spare threads
                    if cutlass.const_expr(LORA_SPARE == "skip"):
                        ok = v < nla
                        v = cutlass.min(v, nla - 1)  # in range either way: the address is formed before the branch
                    else:
                        v = v % nla if nla < NT else cutlass.min(v, nla - 1)
                yield v // vpr, v % vpr, ok
        return lu(), la()

    @staticmethod
    def _if(ok, body):
        """body() where ok: traced as is for a Python True, else in a branch on the run-time predicate."""
        if ok is True:
            body()
        else:
            cutlass.if_generate(ok, body)

    def _lora_prefetch(self, p_la, p_lu, base, m, n, m0, n0, tidx):
        """ws schedules: cp.async the LoRA's first chunk into its own SMEM at the start of a tile, so its global
        round trip overlaps the main loop (``_lora`` waits for it).  Rows >= m copy row m - 1: they only feed
        accumulator columns that are never stored."""
        mLA, mLU, sLU, sLA = self._lora_views(p_la, p_lu, base, m, n)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.out_dtype,
                                   num_bits_per_copy=128)
        lu, la = self._lora_vectors(tidx)

        def vec(t):
            # (1, 8) -> one mode of 8 elements: the atom's 128 bits are one copy of the whole vector
            return cute.make_tensor(t.iterator, cute.make_layout((8, 1), stride=(1, 0)))
        for r, cv in lu:
            cute.copy(atom, vec(cute.local_tile(mLU, (1, 8), (n0 + r, cv))),
                      vec(cute.local_tile(sLU[None, None, 0], (1, 8), (r, cv))))
        for r, cv, ok in la:
            self._if(ok, lambda r=r, cv=cv: cute.copy(
                atom, vec(cute.local_tile(mLA, (1, 8), (cutlass.min(m0 + r, m - 1), cv))),
                vec(cute.local_tile(sLA[None, None, 0], (1, 8), (r, cv)))))
        cute.arch.cp_async_commit_group()

    def _lora(self, p_la, p_lu, base, m, n, m0, n0, tidx, acc, chunk0_ready=False):
        """acc[n, m] += Σ_r lora_up[n, r]·lora_act_in[m, r], in chunks of ``rc`` ranks through SMEM.
        chunk0_ready: ``_lora_prefetch`` issued chunk 0's copies; this thread waits for its own, the barrier
        after it for everyone's."""
        tm, R, rc = self.tm, self.rank, self.rc
        ldt = self.out_dtype
        mLA, mLU, sLU, sLA = self._lora_views(p_la, p_lu, base, m, n)
        lmma = sm90_utils.make_trivial_tiled_mma(ldt, ldt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                 (self.mwg, 1, 1), (64, tm))
        lmma.set(warpgroup.Field.ACCUMULATE, True)
        thr = lmma.get_slice(tidx)
        tLrA = lmma.make_fragment_A(thr.partition_A(sLU))
        tLrB = lmma.make_fragment_B(thr.partition_B(sLA))
        vpr = rc // 8                       # 16-byte vectors per row of a chunk
        vbuf = cute.make_rmem_tensor((8,), ldt)
        if not chunk0_ready:
            self._mma_sync()                # coop: the main loop's stages are free; ws: the last chunk is read
        for ch in range(R // rc):
            if chunk0_ready and ch == 0:
                cute.arch.cp_async_wait_group(0)
            else:
                lu, la = self._lora_vectors(tidx)
                for r, cv in lu:
                    cute.autovec_copy(cute.local_tile(mLU, (1, 8), (n0 + r, ch * vpr + cv)), vbuf)
                    cute.autovec_copy(vbuf, cute.local_tile(sLU[None, None, 0], (1, 8), (r, cv)))
                for r, cv, ok in la:
                    self._if(ok, lambda r=r, cv=cv: self._stage_la(mLA, sLA, vbuf, m, m0, ch, vpr, r, cv))
            cute.arch.fence_proxy("async.shared", space="cta")
            self._mma_sync()
            warpgroup.fence()
            for kb in range(rc // 16):
                cute.gemm(lmma, acc, tLrA[None, None, kb, 0], tLrB[None, None, kb, 0], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            self._mma_sync()

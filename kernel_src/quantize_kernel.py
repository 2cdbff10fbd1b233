"""The ``quantize_act`` kernel: bf16/fp16 activations -> NVFP4 codes + E4M3 block scales (+ fused LoRA-down).

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
    needs no zeroing: a word counts as zero unless its top 48 bits are ``quantize_ptx._ARRIVE_KEY``.  (Meeting
    once per CTA, after its last tile, was measured 1-8 % slower: docs/PERF.md, session 46.)
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
  SM more L1: ``quantize_plan._ONE_LORA_BUFFER_RANKS``; co-resident CTAs hit the same tiles
  in L1), rows stored in the permuted order so that
  ``ldmatrix.trans`` yields the matching fragments (row pitch 2R + 16 bytes:
  conflict free, for the copies too: ``quantize_plan._srow`` puts the two rows of a
  128-byte line 4 rows apart).  The tile's copy addresses are a
  per-lane base plus the step's offset plus constants where R / 8 is a power
  of two (``_srow`` is a bit permutation), so a step spends no index
  arithmetic on them.  (Experiment builds with ``SVDQ_KERNEL_QUANT_LORA=rk``
  or ``rk3`` stage nothing: lora_down comes in the mma fragment order, each
  A fragment one 16-byte load into registers at the top of the step;
  ``quantize_plan.LORA_ENV``.)  At the end
  the warps' partial sums are added in SMEM and rows < M are stored in x's
  dtype.

Arithmetic (per group of 16; quantize_ref has the normative text)
------------------------------------------------------------------
``rs = RN_D(RN32(1 / smooth))`` per k (use_smooth == 1: one per lane per step, shared through SMEM
as 16-bit pairs; RN32(1 / smooth) is fp64 rcp + two Newton steps, then one rounding: equal to
IEEE ``div.rn.f32`` for every 16-bit input -- proof in ``quantize_ptx._rcp16``, checked in the tests);
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
use_smooth (i32: 0 none, 1 ``smooth`` holds the factors, 2 it holds their reciprocals rs, which each lane then
shares as loaded: the same x̂; both smoothing forms run one step loop, in which a branch on use_smooth skips
the reciprocal's instructions when use_smooth == 2: 32 of 425 per warp step at rank 32).  grid = (ctas, 1, 1),
block = (32 * warps, 1, 1), dynamic SMEM ``smem_bytes``,
cluster (ksplit, 1, 1), programmatic dependent launch (PDL: ``griddepcontrol.wait`` before any
global access, then ``launch_dependents``; docs/design.md section 6).  Preconditions (the loader checks
them): pointers 16-byte aligned, contiguous row-major tensors, m >= 1, k % 64 == 0, M*K < 2^31,
1 <= ksplit <= 8 (any value is correct; more CTAs than steps leave warps idle), ctas = tiles * ksplit
where ksplit > 1 and tiles <= ctas <= tiles * K / 64 otherwise (a CTA of an empty range would never arrive on its
split tile's counter, so that tile's LoRA sums would never be stored); with LoRA and ctas > tiles, ``workspace`` holds
``workspace_bytes(ctas, 16 * mtiles, R)`` bytes, 8-byte aligned, used by no other launch at the same time.
Pointers of disabled features (smooth when use_smooth == 0, LoRA when
rank == 0, the workspace when no tile is split) may be 0 and are never dereferenced.
"""
from __future__ import annotations

import os

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64

from svdq_loader.ops.ranges import cta_of_unit, range_start, workspace_counter_bytes

from .quantize_plan import (STEP_K, _RS_BYTES, _SM_STAGE_BYTES, _Cfg, _epilogue_bytes, _lora_bufs, _lora_copy_slot,
                            _lora_rk, _lora_tiles_bytes, _ldsm_row, _pitch, _rs_chunk, _smem_bytes, _srow,
                            _sums_per_thread, _uses_ring, _warp_smem, _x_stage_bytes, _x_stages, min_ctas_per_sm)
from .quantize_ptx import (_asm, _ld_v4, _ld_pred_u32, _f32_pair, _pack_pair, _mul_pair, _sts_u32, _rcp16, _div6,
                           _amax_pairs, _thresholds, _code_pair, _bytes4, _e4m3_pair, _st_v2_pred, _st_u8_pred,
                           _st_u32_pred, _cp_async16, _cp_async16_cg, _cp_async4, _lds_v4, _lds_u32, _cp_commit,
                           _cp_wait, _sts_v2, _sts_f, _ld_cluster_v2f, _arrive, _fence_gpu, _st_v2f_pred,
                           _ld_relaxed_v2f, _st_u64, _lds_v2f, _ldsm_x4_t, _mma, _abs_f16x2)

_DT = {"bf16": BFloat16, "fp16": Float16}
_ONE_PAIR = {"bf16": 0x3F803F80, "fp16": 0x3C003C00}   # (1.0, 1.0) in the 16-bit type
#: Diagnosis builds only: SVDQ_KERNEL_QUANT_PROBE=1 at build time makes every R > 0 variant write, per CTA, its SM
#: id and its first / last %globaltimer reading into lora_act_in (32 bytes per CTA) instead of the LoRA sums
#: (tools/quant_timeline.py reads them).  A kernel build switch: it enters the cache key and the build fingerprint
#: (svdq_aot.cache), so such cubins are never mixed with plain ones.
_PROBE = os.environ.get("SVDQ_KERNEL_QUANT_PROBE") == "1"
#: Experiment builds only: SVDQ_KERNEL_QUANT_ABS=fp16 at build time makes the fp16 variants take |x̂| as a packed
#: ``abs.f16x2`` instead of a sign mask (a LOP3), which ptxas folds into the maxima and compares that read it (an
#: operand modifier): 10-31 fewer instructions per step, and fewer registers (docs/PERF.md, session 55; not yet timed).
#: It leaves the bf16 variants as they are: ptxas folds no ``abs.bf16x2``.  Read per kernel object, so a test can
#: set it; like every SVDQ_KERNEL_* switch it enters the build cache key.
ABS_ENV = "SVDQ_KERNEL_QUANT_ABS"


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
        self.abs_pair = os.environ.get(ABS_ENV, "") == "fp16" and cfg.dtype == "fp16"
        self.lora_rk = _lora_rk(cfg)      # experiment builds: lora_down in the fragment order, into registers

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
                    if cutlass.const_expr(self.lora_rk):
                        c.lrk = c.ldb + Int64(16 * lane)                      # the lane's 16 bytes of a fragment
                    elif cutlass.const_expr(c.lora_fast):
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
                    if cutlass.const_expr(R > 0 and not self.lora_rk):
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
                    per_thr = _sums_per_thread(self.cfg)
                    assert _epilogue_bytes(self.cfg) <= self.warp_smem     # the validity predicate's rule
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
                        # (slot 2b + e: `ranges.slot_index`'s rule, kept inline here as the H200-tested build has it)
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

    def _load_lora_rk(self, c, step):
        """The rk form's A operands of `step` (experiment builds, `quantize_plan.LORA_ENV`): lora_down in the mma
        fragment order (`svdq_loader.ops.quantize_act.lora_fragments`), so that a step is R / 16 x 4 blocks of 512 bytes, one per
        (m-tile rt, k block j), in which lane l's 16 bytes are its four A registers.  ``out[rt][j]``: that fragment.
        One per-lane base, the step's offset, constants: no index arithmetic, no register moves."""
        R = self.R
        gb = c.lrk + Int64(step) * (STEP_K * 2 * R)
        return [[_ld_v4(gb + (rt * 4 + j) * 512) for j in range(4)] for rt in range(R // 16)]

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
            if R > 0 and self.lora_rk:
                lfr = self._load_lora_rk(c, s)            # this step's A fragments, used after the code work
            elif R > 0 and self.lbufs == 2:
                self._copy_lora(c, (it + 1) % 2, sn)
                _cp_commit()

        if smoothing:
            # reciprocals of smooth for the step's 64 k: lane l holds k = 2l, 2l + 1.  use_smooth == 1: the lane
            # makes them from the factors; == 2: the caller passed them, and the pair is used as loaded.  One loop
            # serves both: ptxas keeps this a real branch around the reciprocal (tests/test_quantize_compile.py),
            # so the second form runs 32 instructions fewer per step at rank 32.  A third copy of the loop for it
            # was no faster and cost 60 % more quantize_act compile time (docs/PERF.md, session 51)
            def _recip(v):
                s_lo, s_hi = _f32_pair(v, dt)
                return _pack_pair(_rcp16(s_lo), _rcp16(s_hi), dt)
            rs_pair = cutlass.if_generate(c.use_smooth == 1, _recip, None, input_args=[Int32(sm_cur)],
                                          return_types=[Int32])
            _sts_u32(rs_s + 4 * lane, rs_pair)
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
            if cutlass.const_expr(self.abs_pair):
                aws.append([_abs_f16x2(w) for w in wq])
            else:
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
        if R > 0 and self.lora_rk:
            # the same MMAs as below, each A fragment as loaded at the top of the step
            for j in range(4):
                for rt in range(R // 16):
                    self._lora_mmas(acc, lfr[rt][j], xh, rt, j)
        elif R > 0:
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
                    self._lora_mmas(acc, _ldsm_x4_t(sa), xh, rt, j)
            if self.lbufs == 1:
                # one tile buffer: every lane is past its reads of L_i, then L_i+1 (the warp's next step, clamped:
                # the last one is re-read, harmlessly) goes in
                cute.arch.sync_warp()
                self._copy_lora(c, 0, cutlass.min(s + c.WS, c.s_last))
                _cp_commit()

    def _lora_mmas(self, acc, a, xh, rt, j):
        """lora_act_in^T[m-tile rt] += A . x̂ over block j for each of the lane's rows: A = the fragment `a`, B = the
        row's own pair words 2j and 2j + 1."""
        NG = 2 * self.MT
        for q in range(NG):
            o = (rt * NG + q) * 4
            c4 = (acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
            d = _mma(self.dt, c4, a, (xh[q][2 * j], xh[q][2 * j + 1]))
            for i in range(4):
                acc[o + i] = d[i]

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

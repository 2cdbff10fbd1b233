"""SVDQuant W4A4 (NVFP4) GEMM for Hopper, ``sm_90a`` -- CuTe-DSL, build time only.

Operator (fp32 accumulation)::

    y[m, n] = (sum_k A[m,k] * W[n,k]) * wcscale[n] + bias[n]
              + sum_r lora_act_in[m,r] * lora_up[n,r]
    A[m,k]  = e2m1(act nibble)  * e4m3(ascales[m, k//16])
    W[n,k]  = e2m1(wgt nibble)  * e4m3(wscales[n, k//16])

Hopper has no FP4 tensor cores, so both operands are dequantized *exactly* to
fp16 (an E2M1 value times an E4M3 scale has at most 6 significant bits and lies
in [2^-10, 2688]) and multiplied with the warp-level ``mma.sync`` 16x8x16 fp16
instruction, fp32 accumulation.

This is the simplest correct form of the kernel (speed is a later issue):

* one CTA computes one ``tile_m x tile_n`` output tile; 128 threads = 4 warps
  in a 2x2 layout; grid = (ceil(m / tile_m), n / tile_n, 1);
* per k-tile every thread loads whole 16-byte chunks of packed nibbles (32 k
  values) plus their two scale bytes into registers, decodes them with
  integer ops, and stores fp16 into a padded K-major SMEM tile (row pitch
  ``tile_k + 8`` elements, so ``ldmatrix`` reads are bank-conflict free);
  ``stages`` SMEM buffers (1 or 2); the next k-tile's raw bytes are loaded
  into registers before the MMAs of the current one;
* ``ldmatrix`` + ``mma.sync`` over the SMEM tile (as in the Ampere example);
* after the K loop: ``acc *= wcscale[n]`` (optional), then the LoRA MMAs
  (``lora_act_in`` / ``lora_up`` are already 16-bit: copied to SMEM, which
  re-uses the main-loop buffers, then ``mma.sync`` in the output dtype), then
  ``+ bias[n]`` (optional), convert, predicated store of rows < m.

Launch ABI: the host function takes the op's host arguments (9 pointers,
m, n, k, sm_count, stream; sm_count is unused by this one-tile-per-CTA form)
and passes the 9 pointers and m, n, k straight to the kernel (12 kernel parameters:
9 x u64 at offsets 0..64, then 3 x i32 at 72, 76, 80; no descriptors).  All
tensors are built inside the kernel from the pointers and the dynamic m/n/k.
grid = (ceil(m / tile_m), n / tile_n, 1), block = (128, 1, 1), dynamic SMEM =
``smem_bytes_for(knobs)``, no cluster.

Preconditions (the loader enforces them; the kernel does not check):
pointers 16-byte aligned, tensors contiguous row-major, m >= 1,
n % tile_n == 0, k % tile_k == 0, and every element offset fits in int32:
m*n, m*k/2 and n*k/2 < 2^31.  Pointers of disabled features (rank 0: LoRA;
wcscale/bias off) may be 0 -- they are never dereferenced.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Uint8
from cutlass.cute.runtime import make_ptr

from .compiled_output import compile_named, cubin_resource_usage

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile",
    "DEFAULT_TILE", "DEFAULT_STAGES", "SELECTION", "threads_for", "smem_bytes_for", "cubin_resource_usage",
    "SMEM_LIMIT_BYTES",
]

# ---------------------------------------------------------------------------
# Public constants
# ---------------------------------------------------------------------------

OP = "gemm_w4a4"
ARCHS = ("sm_90a",)
NAME = "sm90_gemm_w4a4"

#: This family's own (tuning) knobs and the values it supports.
TUNING: dict[str, tuple] = dict(
    tile_m=(64, 128),
    tile_n=(64, 128),
    tile_k=(32, 64, 128),
    stages=(1, 2),
)
#: Feature-knob values this family can build (the op spec lists the knobs).
FEATURE_VALUES: dict[str, tuple] = dict(
    out_dtype=("fp16", "bf16"),
    rank=(0, 16, 32, 48, 64, 128),
    wcscale=(False, True),
    bias=(False, True),
    scale_layout=("logical",),
)

DEFAULT_TILE = (128, 128, 64)
DEFAULT_STAGES = 2
#: How the loader ranks this family's variants that fit a problem (written into the manifest; format in
#: svdq_loader.select_rules).  Up to 64 rows a 64-row tile pads less; above, the larger tile reuses more.
#: Not tuned: a rule of thumb until a measured table replaces it.
SELECTION = [
    {"m_max": 64, "priority": 0, "prefer": [
        {"knob": "tile_m", "order": "asc"}, {"knob": "tile_n", "order": "desc"},
        {"knob": "tile_k", "values": [64, 128, 32]}, {"knob": "stages", "order": "desc"}]},
    {"m_max": None, "priority": 0, "prefer": [
        {"knob": "tile_m", "order": "desc"}, {"knob": "tile_n", "order": "desc"},
        {"knob": "tile_k", "values": [64, 128, 32]}, {"knob": "stages", "order": "desc"}]},
]

_MMA_SHAPE = (16, 8, 16)  # mma.sync.m16n8k16
_SMEM_PAD = 8  # 16-bit elements of padding per SMEM row (16 bytes)
_SMEM_ALIGN = 128
#: Dynamic SMEM one CTA may use on sm_90 (228 KiB per SM minus 1 KiB reserved).
SMEM_LIMIT_BYTES = 227 * 1024
_CHUNK_K = 32  # k values per 16-byte chunk of packed nibbles
_OUT_DTYPES = {"fp16": Float16, "bf16": BFloat16}


# ---------------------------------------------------------------------------
# Exact decoders (integer ops + selects; plain trace-time helpers)
# ---------------------------------------------------------------------------


def _e2m1_to_f32(nib):
    """E2M1 nibble (Int32 in [0, 15]) -> exact Float32.

    bit 3 = sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.  For index
    i >= 2 the fp32 bit pattern is (i << 22) + bits(0.5): exponent
    126 + (i >> 1), top mantissa bit i & 1.  i = 1 is 0.5, i = 0 is 0.
    """
    i = nib & 7
    half = Int32(0x3F000000)  # 0.5f
    mag = cutlass.select_(i < 2, i * half, (i << 22) + half)
    bits = Int32(mag) | ((nib & 8) << 28)
    return bits.bitcast(Float32)


def _e4m3_to_f32(byte):
    """E4M3FN byte (Int32 in [0, 255]) -> exact Float32 (NaN codes not handled).

    Normal (exp > 0): 2^(exp-7) * (1 + mant/8)  -> fp32 bits
    ((exp + 120) << 23) | (mant << 20) == ((byte & 0x7F) << 20) + (120 << 23).
    Subnormal (exp == 0): mant * 2^-9.
    """
    em = byte & 0x7F
    mant = em & 7
    normal = ((em << 20) + Int32(120 << 23)).bitcast(Float32)
    subnormal = Float32(mant) * Float32(1.0 / 512.0)
    mag = Float32(cutlass.select_((em >> 3) == 0, subnormal, normal))
    return Float32(cutlass.select_((byte & 0x80) != 0, -mag, mag))


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cfg:
    out_dtype: str
    rank: int
    wcscale: bool
    bias: bool
    tile_m: int
    tile_n: int
    tile_k: int
    stages: int


def _cfg_of(knobs: dict) -> _Cfg:
    return _Cfg(
        out_dtype=str(knobs["out_dtype"]),
        rank=int(knobs["rank"]),
        wcscale=bool(knobs["wcscale"]),
        bias=bool(knobs["bias"]),
        tile_m=int(knobs["tile_m"]),
        tile_n=int(knobs["tile_n"]),
        tile_k=int(knobs["tile_k"]),
        stages=int(knobs["stages"]),
    )


def _warp_layout(cfg: _Cfg) -> tuple[int, int, int]:
    """Warps along (M, N, K): 4 warps in a 2x2 layout for every tile.

    Measured on an H200 (128x128x64, 2 stages): 8 warps (4x2, ~151 registers)
    fit only one CTA per SM and ran ~20 % slower than 4 warps (255 registers,
    two CTAs per SM), so 4 warps it is.
    """
    return (2, 2, 1)


def _threads(cfg: _Cfg) -> int:
    wm, wn, wk = _warp_layout(cfg)
    return 32 * wm * wn * wk


def _mma_perm(cfg: _Cfg) -> tuple[int, int, int]:
    """Tiled-MMA permutation: N doubled so that one ldmatrix.x4 feeds 16 columns."""
    wm, wn, _ = _warp_layout(cfg)
    return (wm * _MMA_SHAPE[0], wn * _MMA_SHAPE[1] * 2, _MMA_SHAPE[2])


def _smem_plan(cfg: _Cfg) -> dict[str, int]:
    """Element counts / byte offsets of the SMEM buffers.

    The kernel builds its SMEM layouts from these same numbers and asserts at
    trace time that ``cute.cosize`` of each layout fits in the planned count
    (the planned count also covers the unused padding of the last row).
    Main loop: sA (tile_m, tile_k + pad, stages) and sB (tile_n, ...), fp16.
    LoRA (after the main loop, re-using the same bytes): sLA (tile_m, R + pad)
    and sLU (tile_n, R + pad) in the output dtype.
    """
    pitch = cfg.tile_k + _SMEM_PAD
    a = cfg.tile_m * pitch * cfg.stages
    b = cfg.tile_n * pitch * cfg.stages
    main_bytes = 2 * (a + b)
    if cfg.rank > 0:
        lpitch = cfg.rank + _SMEM_PAD
        la = cfg.tile_m * lpitch
        lu = cfg.tile_n * lpitch
    else:
        lpitch = la = lu = 0
    lora_bytes = 2 * (la + lu)
    total = max(main_bytes, lora_bytes)
    total = (total + _SMEM_ALIGN - 1) // _SMEM_ALIGN * _SMEM_ALIGN
    return dict(
        pitch=pitch, a_elems=a, b_elems=b, b_offset=2 * a,
        lpitch=lpitch, la_elems=la, lu_elems=lu, lu_offset=2 * la,
        main_bytes=main_bytes, lora_bytes=lora_bytes, total_bytes=total,
    )


def _knob_problem(cfg: _Cfg) -> Optional[str]:
    # knob values were checked against TUNING / FEATURE_VALUES by invalid_reason()
    # Every thread handles whole 16-byte chunks (32 k values) of A and W.
    cpr = cfg.tile_k // _CHUNK_K
    threads = _threads(cfg)
    perm = _mma_perm(cfg)
    for name, rows, ext in (("tile_m", cfg.tile_m, perm[0]), ("tile_n", cfg.tile_n, perm[1])):
        if (rows * cpr) % threads:
            return (
                f"{name}*tile_k/32 = {rows * cpr} is not a multiple of "
                f"{threads} threads"
            )
        if rows % ext:
            return f"{name}={rows} is not a multiple of the tiled-MMA extent {ext}"
        if cfg.rank and (rows * cfg.rank // 8) % threads:
            return f"{name}*rank/8 = {rows * cfg.rank // 8} is not a multiple of {threads} threads"
    return None


def _problem(cfg: _Cfg) -> Optional[str]:
    reason = _knob_problem(cfg)
    if reason:
        return reason
    plan = _smem_plan(cfg)
    if plan["total_bytes"] > SMEM_LIMIT_BYTES:
        return (
            f"needs {plan['total_bytes']} B of dynamic SMEM "
            f"(main loop {plan['main_bytes']} B, LoRA {plan['lora_bytes']} B), "
            f"more than the {SMEM_LIMIT_BYTES} B an sm_90 CTA may use"
        )
    return None


def threads_for(knobs: dict) -> int:
    """Threads per CTA (block.x) of this variant."""
    return _threads(_cfg_of(knobs))


def smem_bytes_for(knobs: dict) -> int:
    """Dynamic SMEM bytes the host function requests for this variant."""
    return _smem_plan(_cfg_of(knobs))["total_bytes"]


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


class _Sm90W4A4:
    """One instance per variant; all attributes are trace-time constants."""

    def __init__(self, cfg: _Cfg):
        reason = _problem(cfg)
        if reason:
            raise ValueError(f"unsupported sm90 W4A4 variant: {reason}")
        self.cfg = cfg
        self.tm, self.tn, self.tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
        self.stages = cfg.stages
        self.rank = cfg.rank
        self.has_wcscale = cfg.wcscale
        self.has_bias = cfg.bias
        self.out_dtype = _OUT_DTYPES[cfg.out_dtype]
        self.plan = _smem_plan(cfg)
        self.smem_bytes = self.plan["total_bytes"]
        self.threads = _threads(cfg)
        self.warp_layout = _warp_layout(cfg)
        self.mma_perm = _mma_perm(cfg)
        self.cpr = self.tk // _CHUNK_K  # 16-byte chunks per row per k-tile
        self.chunks_a = self.tm * self.cpr // self.threads  # per thread
        self.chunks_b = self.tn * self.cpr // self.threads
        if self.rank:
            self.lvec = self.rank // 8  # 16-byte vectors per LoRA row
            self.lvec_a = self.tm * self.lvec // self.threads
            self.lvec_b = self.tn * self.lvec // self.threads

    # -- host function ------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        act: cute.Pointer,
        ascales: cute.Pointer,
        wgt: cute.Pointer,
        wscales: cute.Pointer,
        lora_act_in: cute.Pointer,
        lora_up: cute.Pointer,
        wcscale: cute.Pointer,
        bias: cute.Pointer,
        out: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        sm_count: cutlass.Int32,  # unused: one tile per CTA (the op's host args carry it)
        stream: cuda.CUstream,
    ):
        grid_m = (m + (self.tm - 1)) // self.tm
        grid_n = n // self.tn
        self.kernel(
            act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out,
            m, n, k,
        ).launch(
            grid=[grid_m, grid_n, 1],
            block=[self.threads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
        )

    # -- trace-time helpers (plain Python: no dynamic control flow inside) ---
    def _smem_tile_layout(self, rows: int, pitch: int, cols: int, stages: int):
        """(rows, cols, stages) K-major tile with a padded row pitch."""
        return cute.make_layout(
            (rows, cols, stages), stride=(pitch, 1, rows * pitch)
        )

    def _load_raw(self, mQ, mS, rows_ld, kcs, nchunks, kt, raw, scl):
        """Global -> registers: the 16 packed bytes and 2 scale bytes of each
        of this thread's chunks of k-tile ``kt``."""
        for i in range(nchunks):
            src = cute.local_tile(mQ, (1, 16), (rows_ld[i], kt * self.cpr + kcs[i]))
            cute.autovec_copy(src, raw[i])
            g = kt * (self.tk // 16) + kcs[i] * 2  # scale group of the chunk's k0
            scl[i][0] = mS[rows_ld[i], g]
            scl[i][1] = mS[rows_ld[i], g + 1]

    def _dequant_store(self, sX, rows, kcs, valid, nchunks, stage, raw, scl, deq):
        """Registers -> SMEM: decode each chunk to 32 fp16 values (k order)
        and store them at (row, kc*32 .. kc*32+31) of SMEM stage ``stage``."""
        for i in range(nchunks):
            s0 = _e4m3_to_f32(Int32(scl[i][0]) & 0xFF)
            s1 = _e4m3_to_f32(Int32(scl[i][1]) & 0xFF)
            if valid is not None:  # rows >= m read as zero
                s0 = Float32(cutlass.select_(valid[i], s0, Float32(0.0)))
                s1 = Float32(cutlass.select_(valid[i], s1, Float32(0.0)))
            for j in range(16):
                byte = Int32(raw[i][0, j]) & 0xFF
                s = s0 if j < 8 else s1  # bytes 0-7: k 0-15, bytes 8-15: k 16-31
                lo = _e2m1_to_f32(byte & 0xF) * s  # even k
                hi = _e2m1_to_f32(byte >> 4) * s  # odd k
                deq[i][0, 2 * j] = lo.to(Float16)
                deq[i][0, 2 * j + 1] = hi.to(Float16)
            dst = cute.local_tile(sX[None, None, stage], (1, _CHUNK_K), (rows[i], kcs[i]))
            cute.autovec_copy(deq[i], dst)

    def _mma_tile(self, tiled_mma, s2r_a, s2r_b, tXsA, tXrA, tXsB, tXrB,
                  tCrA, tCrB, acc, nkb, stage):
        """acc += A_tile * B_tile^T over ``nkb`` 16-wide k-blocks in SMEM."""
        for kb in range(nkb):
            if stage is None:
                cute.copy(s2r_a, tXsA[None, None, kb], tXrA[None, None, kb])
                cute.copy(s2r_b, tXsB[None, None, kb], tXrB[None, None, kb])
            else:
                cute.copy(s2r_a, tXsA[None, None, kb, stage], tXrA[None, None, kb])
                cute.copy(s2r_b, tXsB[None, None, kb, stage], tXrB[None, None, kb])
            cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)

    # -- device kernel ------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        p_act: cute.Pointer,
        p_asc: cute.Pointer,
        p_wgt: cute.Pointer,
        p_wsc: cute.Pointer,
        p_la: cute.Pointer,
        p_lu: cute.Pointer,
        p_wc: cute.Pointer,
        p_bias: cute.Pointer,
        p_out: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
    ):
        tm, tn, tk = self.tm, self.tn, self.tk
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        bid_m, bid_n, _ = cute.arch.block_idx()
        m0 = bid_m * tm
        n0 = bid_n * tn

        # ---- global tensors (row-major, built from the raw pointers) ------
        kh = cute.assume(k // 2, divby=tk // 2)  # packed bytes per row
        kg = cute.assume(k // 16, divby=tk // 16)  # scale groups per row
        mAct = cute.make_tensor(p_act, cute.make_layout((m, kh), stride=(kh, 1)))
        mAsc = cute.make_tensor(p_asc, cute.make_layout((m, kg), stride=(kg, 1)))
        mWgt = cute.make_tensor(p_wgt, cute.make_layout((n, kh), stride=(kh, 1)))
        mWsc = cute.make_tensor(p_wsc, cute.make_layout((n, kg), stride=(kg, 1)))
        mOut = cute.make_tensor(p_out, cute.make_layout((m, n), stride=(n, 1)))

        # ---- shared memory: one raw buffer, typed views on top ------------
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(plan["total_bytes"], byte_alignment=_SMEM_ALIGN)
        lay_a = self._smem_tile_layout(tm, plan["pitch"], tk, self.stages)
        lay_b = self._smem_tile_layout(tn, plan["pitch"], tk, self.stages)
        assert cute.cosize(lay_a) <= plan["a_elems"]
        assert cute.cosize(lay_b) <= plan["b_elems"]
        sA = cute.make_tensor(cute.recast_ptr(base, dtype=Float16), lay_a)
        sB = cute.make_tensor(
            cute.recast_ptr(base + plan["b_offset"], dtype=Float16), lay_b
        )

        # ---- this thread's chunks: chunk c = tidx + i*T -> (row, kc) ------
        rows_a = []
        rows_a_ld = []
        kcs_a = []
        valid_a = []
        raw_a = []
        scl_a = []
        deq_a = []
        for i in cutlass.range_constexpr(self.chunks_a):
            c = tidx + i * self.threads
            r = c // self.cpr
            rows_a.append(r)
            kcs_a.append(c % self.cpr)
            valid_a.append((m0 + r) < m)
            rows_a_ld.append(cutlass.min(m0 + r, m - 1))  # clamp: never read OOB
            raw_a.append(cute.make_rmem_tensor((1, 16), Uint8))
            scl_a.append(cute.make_rmem_tensor((2,), Uint8))
            deq_a.append(cute.make_rmem_tensor((1, _CHUNK_K), Float16))
        rows_b = []
        rows_b_ld = []
        kcs_b = []
        raw_b = []
        scl_b = []
        deq_b = []
        for i in cutlass.range_constexpr(self.chunks_b):
            c = tidx + i * self.threads
            r = c // self.cpr
            rows_b.append(r)
            rows_b_ld.append(n0 + r)  # n % tile_n == 0: always in range
            kcs_b.append(c % self.cpr)
            raw_b.append(cute.make_rmem_tensor((1, 16), Uint8))
            scl_b.append(cute.make_rmem_tensor((2,), Uint8))
            deq_b.append(cute.make_rmem_tensor((1, _CHUNK_K), Float16))

        # ---- tiled MMA + ldmatrix copies ----------------------------------
        tiled_mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(Float16, Float32, _MMA_SHAPE),
            cute.make_layout(self.warp_layout),
            permutation_mnk=self.mma_perm,
        )
        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)  # (MMA, MMA_M, MMA_K, STAGE)
        tCsB = thr_mma.partition_B(sB)  # (MMA, MMA_N, MMA_K, STAGE)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])

        gC = cute.local_tile(mOut, (tm, tn), (bid_m, bid_n))
        tCgC = thr_mma.partition_C(gC)
        acc = tiled_mma.make_fragment_C(tCgC)
        acc.fill(0.0)

        s2r_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), Float16),
            tiled_mma,
        )
        s2r_b = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), Float16),
            tiled_mma,
        )
        thr_s2r_a = s2r_a.get_slice(tidx)
        thr_s2r_b = s2r_b.get_slice(tidx)
        tXsA = thr_s2r_a.partition_S(sA)
        tXrA = thr_s2r_a.retile(tCrA)
        tXsB = thr_s2r_b.partition_S(sB)
        tXrB = thr_s2r_b.retile(tCrB)

        # ---- main K loop ---------------------------------------------------
        num_kt = k // tk
        nkb = tk // _MMA_SHAPE[2]

        self._load_raw(mAct, mAsc, rows_a_ld, kcs_a, self.chunks_a, 0, raw_a, scl_a)
        self._load_raw(mWgt, mWsc, rows_b_ld, kcs_b, self.chunks_b, 0, raw_b, scl_b)
        self._dequant_store(sA, rows_a, kcs_a, valid_a, self.chunks_a, 0, raw_a, scl_a, deq_a)
        self._dequant_store(sB, rows_b, kcs_b, None, self.chunks_b, 0, raw_b, scl_b, deq_b)
        cute.arch.sync_threads()

        for kt in cutlass.range(num_kt, unroll=1):
            stage = kt % self.stages
            has_next = (kt + 1) < num_kt
            # prefetch the next k-tile's raw bytes into registers
            if has_next:
                self._load_raw(mAct, mAsc, rows_a_ld, kcs_a, self.chunks_a, kt + 1, raw_a, scl_a)
                self._load_raw(mWgt, mWsc, rows_b_ld, kcs_b, self.chunks_b, kt + 1, raw_b, scl_b)
            self._mma_tile(tiled_mma, s2r_a, s2r_b, tXsA, tXrA, tXsB, tXrB,
                           tCrA, tCrB, acc, nkb, stage)
            if cutlass.const_expr(self.stages == 1):
                # single buffer: everyone must be done reading it first
                cute.arch.sync_threads()
            if has_next:
                nstage = (kt + 1) % self.stages
                self._dequant_store(sA, rows_a, kcs_a, valid_a, self.chunks_a, nstage, raw_a, scl_a, deq_a)
                self._dequant_store(sB, rows_b, kcs_b, None, self.chunks_b, nstage, raw_b, scl_b, deq_b)
            cute.arch.sync_threads()

        # ---- epilogue coordinates (tile-local (row, col) of each acc elem) --
        cC = cute.make_identity_tensor((tm, tn))
        tCcC = thr_mma.partition_C(cC)

        # ---- acc *= wcscale[n] (before LoRA) -------------------------------
        if cutlass.const_expr(self.has_wcscale):
            mWc = cute.make_tensor(p_wc, cute.make_layout((n,), stride=(1,)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                col = n0 + tCcC[i][1]
                acc[i] = acc[i] * mWc[col]

        # ---- LoRA: acc += lora_act_in[rows, :] @ lora_up[cols, :]^T --------
        if cutlass.const_expr(self.rank > 0):
            R = self.rank
            ldt = self.out_dtype
            mLA = cute.make_tensor(p_la, cute.make_layout((m, R), stride=(R, 1)))
            mLU = cute.make_tensor(p_lu, cute.make_layout((n, R), stride=(R, 1)))
            lay_la = self._smem_tile_layout(tm, plan["lpitch"], R, 1)
            lay_lu = self._smem_tile_layout(tn, plan["lpitch"], R, 1)
            assert cute.cosize(lay_la) <= plan["la_elems"]
            assert cute.cosize(lay_lu) <= plan["lu_elems"]
            # The main loop ended with a barrier: its SMEM may be overwritten.
            sLA = cute.make_tensor(cute.recast_ptr(base, dtype=ldt), lay_la)
            sLU = cute.make_tensor(
                cute.recast_ptr(base + plan["lu_offset"], dtype=ldt), lay_lu
            )
            sLA2 = sLA[None, None, 0]
            sLU2 = sLU[None, None, 0]

            vbuf = cute.make_rmem_tensor((1, 8), ldt)
            for i in cutlass.range_constexpr(self.lvec_a):
                v = tidx + i * self.threads
                r = v // self.lvec
                cv = v % self.lvec
                src = cute.local_tile(mLA, (1, 8), (cutlass.min(m0 + r, m - 1), cv))
                cute.autovec_copy(src, vbuf)
                if (m0 + r) >= m:
                    vbuf.fill(0.0)  # rows >= m read as zero
                cute.autovec_copy(vbuf, cute.local_tile(sLA2, (1, 8), (r, cv)))
            for i in cutlass.range_constexpr(self.lvec_b):
                v = tidx + i * self.threads
                r = v // self.lvec
                cv = v % self.lvec
                src = cute.local_tile(mLU, (1, 8), (n0 + r, cv))
                cute.autovec_copy(src, vbuf)
                cute.autovec_copy(vbuf, cute.local_tile(sLU2, (1, 8), (r, cv)))
            cute.arch.sync_threads()

            lora_mma = cute.make_tiled_mma(
                cute.nvgpu.warp.MmaF16BF16Op(ldt, Float32, _MMA_SHAPE),
                cute.make_layout(self.warp_layout),
                permutation_mnk=self.mma_perm,
            )
            thr_lmma = lora_mma.get_slice(tidx)
            tLsA = thr_lmma.partition_A(sLA2)
            tLsB = thr_lmma.partition_B(sLU2)
            tLrA = lora_mma.make_fragment_A(tLsA)
            tLrB = lora_mma.make_fragment_B(tLsB)
            ls2r_a = cute.make_tiled_copy_A(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), ldt),
                lora_mma,
            )
            ls2r_b = cute.make_tiled_copy_B(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), ldt),
                lora_mma,
            )
            thr_ls2r_a = ls2r_a.get_slice(tidx)
            thr_ls2r_b = ls2r_b.get_slice(tidx)
            self._mma_tile(
                lora_mma, ls2r_a, ls2r_b,
                thr_ls2r_a.partition_S(sLA2), thr_ls2r_a.retile(tLrA),
                thr_ls2r_b.partition_S(sLU2), thr_ls2r_b.retile(tLrB),
                tLrA, tLrB, acc, R // _MMA_SHAPE[2], None,
            )

        # ---- + bias[n], convert, store rows < m ----------------------------
        if cutlass.const_expr(self.has_bias):
            mBias = cute.make_tensor(p_bias, cute.make_layout((n,), stride=(1,)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                col = n0 + tCcC[i][1]
                acc[i] = acc[i] + mBias[col]
        for i in cutlass.range_constexpr(cute.size(acc)):
            if (m0 + tCcC[i][0]) < m:
                tCgC[i] = acc[i].to(self.out_dtype)


# ---------------------------------------------------------------------------
# Build-time API
# ---------------------------------------------------------------------------


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.<arch>.gemm_w4a4`` -> tuning-knob dicts; keys ``tiles`` and ``stages``.

    ``tiles: [[tile_m, tile_n, tile_k], ...]`` (default ``[DEFAULT_TILE]``),
    ``stages: [auto | 1 | 2, ...]`` (default ``[auto]``: the deepest that fits).
    """
    problems: list[str] = []
    unknown = sorted(set(section) - {"tiles", "stages"})
    for k in unknown:
        problems.append(f"{k}: unknown key (allowed: tiles, stages)")
    tiles = section.get("tiles", [list(DEFAULT_TILE)])
    stages = section.get("stages", ["auto"])
    if not isinstance(tiles, list) or not tiles:
        problems.append(f"tiles: {tiles!r}: expected a non-empty list of [tile_m, tile_n, tile_k]")
        tiles = []
    if not isinstance(stages, list) or not stages:
        problems.append(f"stages: {stages!r}: expected a non-empty list of stage counts or 'auto'")
        stages = []
    good_tiles = []
    for i, t in enumerate(tiles):
        if not (isinstance(t, list) and len(t) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                            and x > 0 for x in t)):
            problems.append(f"tiles[{i}]: {t!r}: expected [tile_m, tile_n, tile_k], three positive integers")
        elif tuple(t) in (tuple(g) for g in good_tiles):
            problems.append(f"tiles[{i}]: {t!r}: duplicate value")
        else:
            good_tiles.append(t)
    good_stages = []
    for i, st in enumerate(stages):
        if not (st == "auto" or (isinstance(st, int) and not isinstance(st, bool) and st >= 1)):
            problems.append(f"stages[{i}]: {st!r}: expected a positive integer or 'auto'")
        elif st in good_stages:
            problems.append(f"stages[{i}]: {st!r}: duplicate value")
        else:
            good_stages.append(st)
    out = [dict(tile_m=t[0], tile_n=t[1], tile_k=t[2], stages=st) for t in good_tiles for st in good_stages]
    return out, problems


def resolve(arch: str, knobs: dict) -> dict:
    """``stages: auto`` -> the deepest supported stage count without a resource problem."""
    if knobs.get("stages") != "auto":
        return dict(knobs)
    for st in sorted(TUNING["stages"], reverse=True):
        cand = dict(knobs, stages=st)
        if invalid_reason(arch, cand) is None:
            return cand
    return dict(knobs, stages=max(TUNING["stages"]))


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    """The one validity predicate of this family: None if buildable, else why (with numbers)."""
    if arch not in ARCHS:
        return f"arch {arch} is not built by {NAME} (builds {', '.join(ARCHS)})"
    from svdq_aot.family import knob_problems
    problems = knob_problems(NAME, knobs, FEATURE_VALUES, TUNING)
    if problems:
        return problems
    return _problem(_cfg_of(knobs))


def requirements(arch: str, knobs: dict) -> dict:
    """What the op's shape rule reads: N and K divisibility (M is arbitrary)."""
    return {"n_multiple": int(knobs["tile_n"]), "k_multiple": int(knobs["tile_k"])}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile one variant for `arch` (no GPU needed); kernel symbol ``<name>_0``."""
    from svdq_aot.family import CompiledKernel

    reason = invalid_reason(arch, knobs)
    if reason:
        raise ValueError(f"cannot compile {name}: {reason}")
    cfg = _cfg_of(knobs)
    gemm = _Sm90W4A4(cfg)
    out_t = _OUT_DTYPES[cfg.out_dtype]

    def gptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    args = (
        gptr(Uint8), gptr(Uint8), gptr(Uint8), gptr(Uint8),  # act, ascales, wgt, wscales
        gptr(out_t), gptr(out_t),  # lora_act_in, lora_up
        gptr(Float32), gptr(Float32),  # wcscale, bias
        gptr(out_t),  # out
        Int32(1), Int32(1), Int32(1), Int32(1),  # m, n, k, sm_count (dynamic)
        cuda.CUstream(0),
    )
    compiled, cubin, symbols = compile_named(_Sm90W4A4, gemm, args, name, arch, dump_dir, keep_ptx=keep_ptx)
    return CompiledKernel(
        cubin=cubin, compiled=compiled, entry=compiled.function_name, kernel_symbols=symbols,
        smem_bytes=gemm.smem_bytes, resource_usage=cubin_resource_usage(cubin),
    )

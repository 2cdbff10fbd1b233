"""``act_fp8`` on sm_90a: NVFP4 activations -> 1 / ra and the E4M3 stage images of the FP8-compute GEMM.

CuTe-DSL, build time only.  The workspace format is stated once, in ``svdq_loader.ops.act_fp8``.

A CTA of 128 threads owns 16 image rows over its share of their K (``K_SPLIT``, the default: where the row tiles are
few, small M, grid.y CTAs split each row tile's k-tile pairs evenly, ``svdq_loader.ops.act_fp8.ksplit_by``; without
it, a comparison build, the whole K).  First each warp takes four rows: its lanes read the row's E4M3 scale bytes a
32-bit word at a time, keep the largest byte (E4M3 encodings of non-negative values order like their values),
reduce it over the warp (``redux.sync``), and turn it into ra and 1 / ra (``sm90_fp8_ptx.ra_of_max``: the largest
power of two with 6 · scale · ra <= 448; every CTA of a row tile reads the whole row's scales).  Lane 0 writes
1 / ra (with ``K_SPLIT``, the row tile's first CTA only) and leaves fp16x2 {ra, ra} in SMEM.  Then, per pair of its
k-tiles (128 k each), thread t writes the 16-byte chunk t % 8 of row t // 8: one 8-byte load of the codes of logical
chunk c = (t % 8) ^ (row % 8) and one scale byte, the two byte forms of each code word, then per
pair of k one byte permute, one mask, two fp16x2 multiplies (by 2^14, which makes the E2M1 value, and by scale · ra)
and one rounding conversion to E4M3 (``sm90_fp8_ptx.act_e4m3``); so every store instruction of a warp writes four
whole 128-byte image rows.  Rows M .. image_rows(M) - 1 are written as +0 with 1 / ra = 1.
grid = (image_rows(M) / 16, ksplit_by(image_rows(M) / 16, K), 1); without ``K_SPLIT``, (image_rows(M) / 16, 1, 1).

Launch ABI: host args = the op's (act, ascales, images, m, k, stream); kernel params: the 3 pointers, m, k.
PDL (docs/design.md section 6): ``griddepcontrol.wait`` before any global access, then ``launch_dependents``.
Preconditions (the loader enforces them): 16-byte aligned contiguous tensors, m >= 1, k % 256 == 0, the workspace
below 2^31 bytes.
"""
from __future__ import annotations

import os

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

from svdq_aot.family import knobless_functions
from svdq_loader.ops.act_fp8 import IMAGE_K, ksplit_by

from .compiled_output import cubin_resource_usage, refuse_invalid
from .quantize_ptx import _lds_u32, _sts_u32
from .sm90_decode_act import compile_prepass, image_rows_dsl, image_rows_grid_hint
from .sm90_decode_ptx import _byte_form
from .sm90_fp8_ptx import act_e4m3, act_mult, byte_max, f32_of_bits, ra_half2, ra_of_max

__all__ = ["OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES", "config_axes", "resolve", "invalid_reason",
           "requirements", "compile", "smem_bytes_for", "threads_for", "cubin_resource_usage", "SELECTION"]

OP = "act_fp8"
ARCHS = ("sm_90a",)
NAME = "sm90_act_fp8"
#: No tuning knobs: one variant per arch (a pass at memory speed).
TUNING: dict[str, tuple] = {}
FEATURE_VALUES: dict[str, tuple] = dict(scale_layout=("logical",))
SELECTION = [{"m_max": None, "priority": 0, "prefer": []}]
THREADS = 128
ROWS_PER_CTA = 16
#: k-tiles per loop step, their loads issued together (``SVDQ_KERNEL_SM90_ACT_FP8_UNROLL``, which like every
#: ``SVDQ_KERNEL_*`` switch enters the build cache key and the manifest).  8, the default since session 29: that many
#: 8-byte loads per thread in flight, a last step that skips the k-tiles past K (K stays a multiple of 256), and the
#: four rows' scale words of the row-max phase loaded together.  On the H200 (session 29) it made the FP8 GEMM call
#: (pre-pass + GEMM) 2-19 % faster than 2 k-tiles per step, which had been latency-bound (sessions 27-28: 15 µs at
#: M = 4608, K = 3072 on an H100, 16 % of DRAM bandwidth, a chain of K / 256 round trips).  2 and 4 stay for
#: comparison builds.
K_UNROLL = int(os.environ.get("SVDQ_KERNEL_SM90_ACT_FP8_UNROLL", "8"))
if K_UNROLL not in (2, 4, 8):
    raise ValueError(f"SVDQ_KERNEL_SM90_ACT_FP8_UNROLL={K_UNROLL}: the act_fp8 loop step must be 2, 4 or 8 k-tiles")
#: Split each row tile's K over grid.y CTAs where the row tiles are few (`svdq_loader.ops.act_fp8.ksplit_by`; the
#: default since session 31).  Why: the unsplit pass took 22 µs of the M = 1024, (12288, 3072) FP8 call on the H200
#: (session 30), where its 72 row tiles leave most of the GPU idle.  Split, on an H100 (session 31, docs/PERF.md): bit
#: for bit the same workspace (selftest), and the FP8 call from NVFP4 3-20 % faster at M = 256 and 1024 (93.3 -> 80.8
#: µs at M = 1024, (12288, 3072)); at M = 4608 it is one CTA per row tile either way.
#: ``SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT=0`` builds the unsplit form for comparison.
K_SPLIT = os.environ.get("SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT", "1")
if K_SPLIT not in ("0", "1"):
    raise ValueError(f"SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT={K_SPLIT}: 0 (one CTA per row tile) or 1 (split K)")
K_SPLIT = K_SPLIT == "1"
K_MULTIPLE = 2 * IMAGE_K           # K per call: whole pairs of 128-k image rows, at every K_UNROLL
SMEM_BYTES = 4 * ROWS_PER_CTA      # fp16x2 {ra, ra} per row


class _ActFp8:
    KERNEL_METHODS = ("kernel",)

    @cute.jit
    def __call__(self, act: cute.Pointer, ascales: cute.Pointer, images: cute.Pointer, m: cutlass.Int32,
                 k: cutlass.Int32, stream: cuda.CUstream):
        mp = image_rows_dsl(m)
        row_ctas = mp // ROWS_PER_CTA
        splits = ksplit_by(row_ctas, k, lambda a, b: a // b, cutlass.max, cutlass.min) if K_SPLIT else 1
        self.kernel(act, ascales, images, m, k).launch(grid=[row_ctas, splits, 1], block=[THREADS, 1, 1],
                                                       smem=SMEM_BYTES, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_img: cute.Pointer, m: cutlass.Int32,
               k: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, bz, _ = cute.arch.block_idx()
        _, nz, _ = cute.arch.grid_dim()
        cute.arch.griddepcontrol_wait()                    # the previous grid's writes (act, ascales) are visible
        cute.arch.griddepcontrol_launch_dependents()       # the GEMM may launch once every CTA of this grid runs
        mp = image_rows_dsl(m)
        kw = cute.assume(k // 8, divby=32)                 # 32-bit code words per activation row
        kq = cute.assume(k // 64, divby=4)                 # 32-bit scale words per row
        kg = cute.assume(k // 16, divby=16)                # scale bytes per row
        mActW = cute.make_tensor(cute.recast_ptr(p_act, dtype=Int32), cute.make_layout((m, kw), stride=(kw, 1)))
        mAscW = cute.make_tensor(cute.recast_ptr(p_asc, dtype=Int32), cute.make_layout((m, kq), stride=(kq, 1)))
        mAsc = cute.make_tensor(cute.recast_ptr(p_asc, dtype=Uint8), cute.make_layout((m, kg), stride=(kg, 1)))
        mIra = cute.make_tensor(cute.recast_ptr(p_img, dtype=Float32), cute.make_layout((mp,)))
        p_im = p_img + cute.assume(mp * 4, divby=256)      # the image, past 1 / ra
        mImg = cute.make_tensor(cute.recast_ptr(p_im, dtype=Int32), cute.make_layout(mp * (k // 4)))
        smem = cutlass.memory.SmemAllocator()
        sra = smem.allocate(SMEM_BYTES, byte_alignment=16).toint()
        warp, lane = tidx // 32, tidx % 32

        # ---- ra of each row: the largest scale byte, over the warp ------------------------------------------
        r0 = bx * ROWS_PER_CTA + warp * 4
        mxs = cute.make_rmem_tensor((4,), Int32)
        mxs.fill(0)
        if cutlass.const_expr(K_UNROLL == 2):
            for i in cutlass.range_constexpr(ROWS_PER_CTA // 4):     # one row at a time (the form before session 29)
                if r0 + i < m:
                    for w in cutlass.range(lane, kq, 32, unroll=1):
                        mxs[i] = cutlass.max(mxs[i], byte_max(mAscW[r0 + i, w]))
        else:
            # the four rows' words loaded together (pad rows read row m - 1; their maximum is not used)
            for w in cutlass.range(lane, kq, 32, unroll=1):
                for i in cutlass.range_constexpr(4):
                    mxs[i] = cutlass.max(mxs[i], byte_max(mAscW[cutlass.min(r0 + i, m - 1), w]))
        for i in cutlass.range_constexpr(4):
            row = r0 + i
            mx = cute.arch.warp_redux_sync(cutlass.select_(row < m, mxs[i], Int32(0)), "max")
            ra_bits, inv_bits = ra_of_max(mx)
            if lane == 0:
                if cutlass.const_expr(K_SPLIT):    # the row tile's first CTA writes 1 / ra
                    if bz == 0:
                        mIra[row] = f32_of_bits(inv_bits)
                else:
                    mIra[row] = f32_of_bits(inv_bits)
                _sts_u32(sra + 4 * (warp * 4 + i), ra_half2(ra_bits))
        cute.arch.sync_threads()

        # ---- the image: thread t writes 16-byte chunk t % 8 of row t // 8, k-tile by k-tile ------------------
        rl = tidx // 8
        p = tidx % 8
        row = bx * ROWS_PER_CTA + rl
        c = p ^ (rl % 8)                                   # the logical chunk (16 k) this thread converts
        ok = row < m
        rr = cutlass.min(row, m - 1)                       # pad rows load row m - 1 and keep zeros
        ra2 = _lds_u32(sra + 4 * rl)
        out = cute.make_rmem_tensor((4,), Int32)
        kt_lo, kt_hi = 0, k // IMAGE_K
        if cutlass.const_expr(K_SPLIT):
            pairs = k // (2 * IMAGE_K)                     # this CTA's k-tile pairs: its share of the row tile's K
            kt_lo = 2 * (pairs * bz // nz)
            kt_hi = 2 * (pairs * (bz + 1) // nz)           # nz <= pairs (ksplit_by): at least one pair each
        for kt2 in cutlass.range(kt_lo, kt_hi, K_UNROLL, unroll=1):
            words, scs = [], []
            for u in cutlass.range_constexpr(K_UNROLL):    # every load first: they overlap
                kt = kt2 + u
                if cutlass.const_expr(K_UNROLL > 2):
                    kt = cutlass.min(kt, kt_hi - 1)        # past the share (the last step): load its last k-tile, skip
                pair = cute.make_rmem_tensor((2,), Int32)
                cute.autovec_copy(cute.local_tile(mActW, (1, 2), (rr, kt * 8 + c)), pair)
                words.append(pair)
                scs.append(Int32(mAsc[rr, kt * 8 + c]))
            for u in cutlass.range_constexpr(K_UNROLL):
                kt = kt2 + u
                if cutlass.const_expr(K_UNROLL > 2 and u >= 2):
                    if kt < kt_hi:                         # whole pairs per CTA: the first two always are
                        self._write(mImg, mp, row, p, kt, ok, scs[u], words[u], ra2, out)
                else:
                    self._write(mImg, mp, row, p, kt, ok, scs[u], words[u], ra2, out)

    def _write(self, mImg, mp, row, p, kt, ok, sc, words, ra2, out):
        """k-tile kt's 16-byte chunk p of image row `row`: its 16 values times scale · ra, rounded once to E4M3."""
        mult = act_mult(cutlass.select_(ok, sc, Int32(0)), ra2)
        for h in range(2):
            wd = cutlass.select_(ok, words[h], Int32(0))
            lo, hi = _byte_form(wd, 0), _byte_form(wd, 1)
            out[2 * h] = act_e4m3(lo, hi, mult, 0)
            out[2 * h + 1] = act_e4m3(lo, hi, mult, 2)
        cute.autovec_copy(out, cute.local_tile(mImg, (4,), ((kt * mp + row) * 8 + p,)))


def threads_for(knobs: dict) -> int:
    return THREADS


def smem_bytes_for(knobs: dict) -> int:
    return SMEM_BYTES


#: the family contract's config section, resolution and validity predicate: no knobs (aot/family.py)
config_axes, resolve, invalid_reason = knobless_functions(OP, NAME, ARCHS, FEATURE_VALUES)


def requirements(arch: str, knobs: dict) -> dict:
    """K whole pairs of 128-k image rows; any M >= 1."""
    return {"k_multiple": K_MULTIPLE}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile the one variant (kernel symbol ``<name>_0``)."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    from svdq_loader.ops import ACT_FP8
    hints = ()
    if K_SPLIT:            # grid.y as a launch-recipe expression
        (rows,) = image_rows_grid_hint(ACT_FP8.host_args, ROWS_PER_CTA)
        k = ["arg", ACT_FP8.arg_names.index("k")]
        hints = (ksplit_by(rows, k, lambda a, b: ["floordiv", a, b], lambda a, b: ["max", a, b],
                           lambda a, b: ["min", a, b]),)
    return compile_prepass(_ActFp8, ACT_FP8, name, arch, dump_dir, SMEM_BYTES, ROWS_PER_CTA, keep_ptx, hints)

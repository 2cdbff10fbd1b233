"""``decode_act`` on sm_90a: NVFP4 activations -> the exact fp16 stage images of the images GEMM.

CuTe-DSL, build time only.  The image format is stated once, in ``svdq_loader.ops.decode_act``.

One thread per (row, k-tile of 64 k): two 16-byte loads of codes and one 4-byte load of the four E4M3
scales, the decode of the GEMM producer (``sm90_decode_ptx``: two byte forms per word, then one byte permute,
one mask and one ``mul.f16x2`` by ``scale·2^7`` per pair; so an image holds bit for bit what the nvfp4
producer writes into a stage), and eight 16-byte stores, one swizzled 128-byte image row.  Rows M ..
image_rows(M) - 1 are written as +0.0 (codes and scale taken as 0).  A CTA is 128 consecutive rows of one
k-tile: the warp's stores are 4 KiB of contiguous image.  grid = (image_rows(M) / 128, K / 64).

Launch ABI: host args = the op's (act, ascales, images, m, k, stream); kernel params: the 3 pointers, m, k.
Preconditions (the loader enforces them): 16-byte aligned contiguous tensors, m >= 1, k % 64 == 0,
K · image_rows(M) · 2 < 2^35 (16-byte block offsets below 2^31).
"""
from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8

from svdq_loader.ops.decode_act import IMAGE_ROW_BLOCK

from .compiled_output import compile_kernel, cubin_resource_usage, refuse_invalid
from .sm90_decode_ptx import _adecode_prmt, _bcast, _byte_form, _scales_x128

__all__ = ["OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES", "config_axes", "resolve", "invalid_reason",
           "requirements", "compile", "smem_bytes_for", "threads_for", "cubin_resource_usage", "SELECTION"]

OP = "decode_act"
ARCHS = ("sm_90a",)
NAME = "sm90_decode_act"
#: No tuning knobs: one variant per arch (the pass is a copy at memory speed; nothing to choose).
TUNING: dict[str, tuple] = {}
FEATURE_VALUES: dict[str, tuple] = dict(scale_layout=("logical",))
SELECTION = [{"m_max": None, "priority": 0, "prefer": []}]
ROWS_PER_CTA = 128
_K_TILE = 64


def image_rows_dsl(m):
    """`svdq_loader.ops.decode_act.image_rows` on DSL integers (the GEMM's images producer uses it too)."""
    return (m + (IMAGE_ROW_BLOCK - 1)) // IMAGE_ROW_BLOCK * IMAGE_ROW_BLOCK


class _DecodeAct:
    KERNEL_METHODS = ("kernel",)

    @cute.jit
    def __call__(self, act: cute.Pointer, ascales: cute.Pointer, images: cute.Pointer, m: cutlass.Int32,
                 k: cutlass.Int32, stream: cuda.CUstream):
        mp = image_rows_dsl(m)
        self.kernel(act, ascales, images, m, k).launch(grid=[mp // ROWS_PER_CTA, k // _K_TILE, 1],
                                                       block=[ROWS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_img: cute.Pointer, m: cutlass.Int32,
               k: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, kt, _ = cute.arch.block_idx()
        row = bx * ROWS_PER_CTA + tidx
        mp = image_rows_dsl(m)
        kw = cute.assume(k // 8, divby=8)                  # 32-bit code words per activation row
        kq = cute.assume(k // _K_TILE, divby=1)            # 32-bit words of 4 scales per row
        mActW = cute.make_tensor(cute.recast_ptr(p_act, dtype=Int32), cute.make_layout((m, kw), stride=(kw, 1)))
        mAscW = cute.make_tensor(cute.recast_ptr(p_asc, dtype=Int32), cute.make_layout((m, kq), stride=(kq, 1)))
        mImg = cute.make_tensor(cute.recast_ptr(p_img, dtype=Int32), cute.make_layout(mp * k // 2))
        raw = cute.make_rmem_tensor((8,), Int32)
        raw.fill(0)
        sc = Int32(0)
        if row < m:
            cute.autovec_copy(cute.local_tile(mActW, (1, 8), (row, kt)), raw)
            sc = mAscW[row, kt]
        out = cute.make_rmem_tensor((4,), Int32)
        base = (kt * mp + row) * 8                         # this image row's first 16-byte block
        sw = row % 8
        for kc in cutlass.range_constexpr(2):              # 32 k per half: two scales
            s2 = _scales_x128((sc >> (16 * kc)) & 0xFFFF)
            b = (_bcast(s2, 0), _bcast(s2, 1))
            for w in cutlass.range_constexpr(4):           # one word = 8 k = one 16-byte chunk
                word = raw[kc * 4 + w]
                lo, hi = _byte_form(word, 0), _byte_form(word, 1)
                for p in cutlass.range_constexpr(4):
                    out[p] = _adecode_prmt(lo, hi, b[w // 2], p)
                c = kc * 4 + w
                cute.autovec_copy(out, cute.local_tile(mImg, (4,), (base + (c ^ sw),)))


def threads_for(knobs: dict) -> int:
    return ROWS_PER_CTA


def smem_bytes_for(knobs: dict) -> int:
    return 0


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.sm_90a.decode_act``: must be ``{}`` (no knobs; one variant)."""
    problems = [f"{key}: unknown key (decode_act has no knobs; write decode_act: {{}})" for key in sorted(section)]
    return [{}], problems


def resolve(arch: str, knobs: dict) -> dict:
    return dict(knobs)


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    """The one validity predicate: the arch, and the feature values (no tuning knobs)."""
    if arch not in ARCHS:
        return f"arch {arch} is not built by {NAME} (builds {', '.join(ARCHS)})"
    from svdq_aot.family import knob_problems
    return knob_problems(NAME, knobs, FEATURE_VALUES, TUNING)


def requirements(arch: str, knobs: dict) -> dict:
    """K a multiple of one image row (64 k); any M >= 1."""
    return {"k_multiple": _K_TILE}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile the one variant (kernel symbol ``<name>_0``)."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    from svdq_loader.ops import DECODE_ACT
    return compile_kernel(_DecodeAct, _DecodeAct(), DECODE_ACT, {}, Uint8, name, arch, dump_dir, 0,
                          keep_ptx=keep_ptx)

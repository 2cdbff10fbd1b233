"""``decode_act`` on sm_90a: NVFP4 activations -> the exact fp16 stage images of the images GEMM.

CuTe-DSL, build time only.  The image format is stated once, in ``svdq_loader.ops.decode_act``.

Each thread writes one 16-byte chunk position p = tid % 8 of four image rows (rows tid // 8 + 16 i of the
CTA's 64): for each, one 4-byte load of the code word of logical chunk c = p ^ (row % 8) (8 k) and one byte
of its E4M3 scale, all eight loads issued first, then the decode of the GEMM producer (``sm90_decode_ptx``: two
byte forms per word, then one byte permute, one mask and one ``mul.f16x2`` by ``scale·2^7`` per pair; so an
image holds bit for bit what the nvfp4 producer writes into a stage) and one 16-byte store.  So every store
instruction of a warp writes 512 contiguous bytes (four whole 128-byte image rows) and every load instruction
reads four whole 32-byte sectors of codes: the first version (one thread per row and k-tile, eight 16-byte
stores at a 128-byte lane stride) ran at 0.8-0.9 TB/s on the H200 (ncu, session 6).  Rows M ..
image_rows(M) - 1 are written as +0.0 (codes and scale taken as 0).  grid = (image_rows(M) / 64, K / 64).

Launch ABI: host args = the op's (act, ascales, images, m, k, stream); kernel params: the 3 pointers, m, k.
PDL (docs/design.md section 6): ``griddepcontrol.wait`` before any global access, then ``launch_dependents``.
Preconditions (the loader enforces them): 16-byte aligned contiguous tensors, m >= 1, k % 64 == 0,
K · image_rows(M) · 2 < 2^31 (the image's size and offsets are 32-bit; the loader's selection keeps larger
calls on the nvfp4 forms).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8

from svdq_aot.family import knobless_functions
from svdq_loader.ops.decode_act import IMAGE_ROW_BLOCK, image_rows_by

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
THREADS = 128
ROWS_PER_THREAD = 4
_ROW_STEP = THREADS // 8                                   # rows between a thread's rows
ROWS_PER_CTA = _ROW_STEP * ROWS_PER_THREAD                 # 64 rows of one k-tile per CTA
assert ROWS_PER_CTA == IMAGE_ROW_BLOCK
_K_TILE = 64


def image_rows_dsl(m):
    """`svdq_loader.ops.decode_act.image_rows` on DSL integers (the GEMM's images producer uses it too)."""
    return image_rows_by(m, lambda x, t: (x + (t - 1)) // t * t, cutlass.max)


class _DecodeAct:
    KERNEL_METHODS = ("kernel",)

    @cute.jit
    def __call__(self, act: cute.Pointer, ascales: cute.Pointer, images: cute.Pointer, m: cutlass.Int32,
                 k: cutlass.Int32, stream: cuda.CUstream):
        mp = image_rows_dsl(m)
        # programmatic dependent launch (PDL): this grid may start while the previous one on the stream drains;
        # every thread waits for it (griddepcontrol.wait) before its first memory access
        self.kernel(act, ascales, images, m, k).launch(grid=[mp // ROWS_PER_CTA, k // _K_TILE, 1],
                                                       block=[THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, p_act: cute.Pointer, p_asc: cute.Pointer, p_img: cute.Pointer, m: cutlass.Int32,
               k: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, kt, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()                    # the previous grid's writes (act, ascales) are visible
        cute.arch.griddepcontrol_launch_dependents()       # the GEMM may launch once every CTA of this grid runs
        mp = image_rows_dsl(m)
        kw = cute.assume(k // 8, divby=8)                  # 32-bit code words per activation row
        kg = cute.assume(k // 16, divby=4)                 # scale bytes per row
        mActW = cute.make_tensor(cute.recast_ptr(p_act, dtype=Int32), cute.make_layout((m, kw), stride=(kw, 1)))
        mAsc = cute.make_tensor(cute.recast_ptr(p_asc, dtype=Uint8), cute.make_layout((m, kg), stride=(kg, 1)))
        mImg = cute.make_tensor(cute.recast_ptr(p_img, dtype=Int32), cute.make_layout(mp * k // 2))
        p = tidx % 8                                       # the physical 16-byte chunk this thread writes
        rows = [bx * ROWS_PER_CTA + tidx // 8 + _ROW_STEP * i for i in range(ROWS_PER_THREAD)]
        words, scs = [], []
        for i in cutlass.range_constexpr(ROWS_PER_THREAD):  # every load first: they overlap
            c = p ^ (rows[i] % 8)                          # the logical chunk = code word of this k-tile
            r = cutlass.min(rows[i], m - 1)                # pad rows load row m - 1 and keep zeros
            words.append(mActW[r, kt * 8 + c])
            scs.append(Int32(mAsc[r, kt * 4 + c // 2]))
        out = cute.make_rmem_tensor((4,), Int32)
        for i in cutlass.range_constexpr(ROWS_PER_THREAD):
            ok = rows[i] < m
            words[i] = cutlass.select_(ok, words[i], Int32(0))
            s = _bcast(_scales_x128(cutlass.select_(ok, scs[i], Int32(0))), 0)
            lo, hi = _byte_form(words[i], 0), _byte_form(words[i], 1)
            for b in cutlass.range_constexpr(4):
                out[b] = _adecode_prmt(lo, hi, s, b)
            cute.autovec_copy(out, cute.local_tile(mImg, (4,), ((kt * mp + rows[i]) * 8 + p,)))


def threads_for(knobs: dict) -> int:
    return THREADS


def smem_bytes_for(knobs: dict) -> int:
    return 0


#: the family contract's config section, resolution and validity predicate: no knobs (aot/family.py)
config_axes, resolve, invalid_reason = knobless_functions(OP, NAME, ARCHS, FEATURE_VALUES)


def requirements(arch: str, knobs: dict) -> dict:
    """K a multiple of one image row (64 k); any M >= 1."""
    return {"k_multiple": _K_TILE}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile the one variant (kernel symbol ``<name>_0``)."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    from svdq_loader.ops import DECODE_ACT
    return compile_prepass(_DecodeAct, DECODE_ACT, name, arch, dump_dir, 0, ROWS_PER_CTA, keep_ptx)


def compile_prepass(cls, spec, name: str, arch: str, dump_dir: str, smem_bytes: int, rows_per_cta: int,
                    keep_ptx: bool, extra_hints=()):
    """Compile the one variant of an sm_90a activation pre-pass (decode_act, act_fp8: kernel class `cls`, op
    `spec`), with its grid, image_rows(M) / `rows_per_cta`, as the launch recipe's hint (the fitter would not find
    it), and `extra_hints` (more candidate expressions, e.g. act_fp8's K split)."""
    ck = compile_kernel(cls, cls(), spec, {}, Uint8, name, arch, dump_dir, smem_bytes, keep_ptx=keep_ptx)
    ck.recipe_hints = image_rows_grid_hint(spec.host_args, rows_per_cta) + tuple(extra_hints)
    return ck


def image_rows_grid_hint(host_args, rows_per_cta: int) -> tuple:
    """image_rows(M) / `rows_per_cta` as a launch-recipe expression over `host_args` (the op's (name, kind) list):
    the grid of a pre-pass whose CTAs own that many image rows (decode_act, act_fp8)."""
    m = ["arg", [name for name, _ in host_args].index("m")]
    rows = image_rows_by(m, lambda x, t: ["mul", ["ceildiv", x, t], t], lambda a, b: ["max", a, b])
    return (["floordiv", rows, rows_per_cta],)

"""SVDQuant W4A4 (NVFP4) GEMM for GeForce/workstation Blackwell, ``sm_120a`` and ``sm_121a`` -- CuTe-DSL, build time only.

Operator (fp32 accumulation)::

    y[m, n] = (sum_k A[m,k] * W[n,k]) * wcscale[n] + bias[n]
              + sum_r lora_act_in[m,r] * lora_up[n,r]
    A[m,k]  = e2m1(act nibble) * e4m3(ascales[m, k//16])
    W[n,k]  = e2m1(wgt nibble) * e4m3(wscales[n, k//16])

These archs have no ``tcgen05`` and no tensor memory.  The main product uses
the warp-level block-scaled MMA (``mma.sync ... kind::mxf4nvf4.block_scale``,
16x8x64, E2M1 operands, one E4M3 scale per 16 k, fp32 register accumulators).

Structure of one CTA (``8 + 1`` warps, 288 threads):

* warp 8 is the producer: it TMA-loads the ``tile_m x tile_k`` slice of
  ``act``, the ``tile_n x tile_k`` slice of ``wgt`` and their block scales
  (blocked 32x4x4 layout, both operands) into a ``stages``-deep SMEM ring
  guarded by full/empty mbarriers (`cutlass.pipeline.PipelineTmaAsync`);
* warps 0-7 are the consumers, a 4x2 warp grid over the output tile: per
  k-tile they wait on the stage, read A/B with ``ldmatrix`` and the scales
  with plain shared loads into registers, release the stage, and issue the
  block-scaled MMAs into fp32 register accumulators;
* persistent: the grid is ``min(sm_count, tiles)`` CTAs, ``sm_count`` being a
  host argument the loader fills from the device at launch (never a traced
  constant); CTA ``b`` takes tiles ``b, b + grid, ...`` (M fastest), and
  producer and consumers walk the same sequence, so the pipeline crosses
  tile boundaries without draining;
* epilogue per tile, in registers, in the order of the formula:
  ``acc *= wcscale[n]``, then the LoRA product as f16/bf16 ``mma.sync``
  16x8x16 into the *same* accumulators (``lora_act_in`` / ``lora_up`` read
  straight from global memory into fragments, one 16-wide k-block at a
  time; rows >= m read as 0), then ``+ bias[n]``, convert, and store rows
  < m.  The LoRA tiled MMA uses the same warp grid and M/N permutation as
  the main one, so both produce the same accumulator layout (checked at
  trace time).

Launch ABI: the op's host arguments (9 pointers, m, n, k, sm_count, stream).
The host function builds 4 TMA descriptors (A, B, SFA, SFB) and passes the
LoRA / wcscale / bias / out pointers and m, n straight to the kernel.
grid = (max(1, min(sm_count, ceil(m / tile_m) * n / tile_n)), 1, 1),
block = (288, 1, 1), dynamic SMEM = the shared-storage struct.

Preconditions the loader enforces: pointers 16-byte aligned, tensors
contiguous, m >= 1, n % tile_n == 0, k % tile_k == 0, ``ascales`` /
``wscales`` in the blocked layout (rows padded to 128, groups to 4, pad 0),
m*n, m*k/2, n*k/2 < 2^31.  Pointers of disabled features may be 0.
"""
from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm120_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from .gemm_features import GemmFeatures, gemm_feature_values
from .compiled_output import compile_kernel, refuse_invalid

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES", "SELECTION",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile",
    "budget", "smem_limit_bytes", "THREADS", "STATIC_SMEM_BYTES",
]

OP = "gemm_w4a4"
ARCHS = ("sm_120a", "sm_121a")
NAME = "sm120_gemm_w4a4"

#: The DSL's SM120 scale-factor layouts and partitioners support the 128 x 128 output tile with this
#: 4 x 2 warp grid (tile_n = 256 fails to partition the SFB fragments); K depth 128 or 256.
TUNING: dict[str, tuple] = dict(
    tile_m=(128,),
    tile_n=(128,),
    tile_k=(128, 256),
    stages=(1, 2, 3, 4, 5, 6, 7, 8),
)
FEATURE_VALUES: dict[str, tuple] = dict(
    out_dtype=("fp16", "bf16"),
    rank=(0, 16, 32, 48, 64, 96, 128),
    wcscale=(False, True),
    bias=(False, True),
    scale_layout=("blocked",),
)
DEFAULT_TILE = (128, 128, 128)
#: One bucket: the deeper pipeline first, then the shorter k-tile (a rule of thumb; never measured on hardware).
SELECTION = [
    {"m_max": None, "priority": 0, "prefer": [
        {"knob": "stages", "order": "desc"}, {"knob": "tile_k", "order": "asc"}]},
]

_AB = cutlass.Float4E2M1FN
_SF = cutlass.Float8E4M3FN
_SF_VEC = 16
_ALIGN = 1024               # SMEM buffer alignment (the 128-byte swizzle wants 1024)
_MMA_WARPS = 8
_WARP_GRID = (4, 2, 1)
THREADS = (_MMA_WARPS + 1) * 32
_LOAD_REGS = 40
_MMA_REGS = 232
_LORA_K = 16                # mma.sync m16n8k16
_OUT_DTYPES = {"fp16": Float16, "bf16": BFloat16}
#: Static SMEM of every kernel of this family (the cubin's .nv.info says 1024 B; a test checks it).  The
#: dynamic part may use the arch's per-block capacity minus this.
STATIC_SMEM_BYTES = 1024
_BARRIER_BYTES = 1024       # the pipeline's mbarriers, rounded up to the buffer alignment


def smem_limit_bytes(arch: str) -> int:
    """Dynamic SMEM one CTA may use on `arch`: the per-block capacity in the DSL's arch table
    (sm_120 and sm_121: 101376 B = 99 KiB) minus the kernel's static SMEM."""
    from cutlass.cutlass_dsl import SMEM_CAPACITY_MAP
    return int(SMEM_CAPACITY_MAP[arch.rstrip("af")]) - STATIC_SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class _Cfg(GemmFeatures):
    tile_m: int
    tile_n: int
    tile_k: int
    stages: int


def _cfg_of(knobs: dict) -> _Cfg:
    return _Cfg(*gemm_feature_values(knobs),
                int(knobs["tile_m"]), int(knobs["tile_n"]), int(knobs["tile_k"]), int(knobs["stages"]))


# ---------------------------------------------------------------------------
# Layouts (the kernel and the SMEM budget read the same ones)
# ---------------------------------------------------------------------------


def _tiled_mmas(cfg: _Cfg):
    """(block-scaled tiled MMA, LoRA tiled MMA or None): same warp grid, same M/N permutation."""
    tile = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
    perm = sm120_utils.get_permutation_mnk(tile, _SF_VEC, False)
    main = cute.make_tiled_mma(cute.nvgpu.warp.MmaMXF4NVF4Op(_AB, Float32, _SF), cute.make_layout(_WARP_GRID),
                               permutation_mnk=perm)
    lora = None
    if cfg.rank:
        lora = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(_OUT_DTYPES[cfg.out_dtype], Float32, (16, 8, _LORA_K)),
            cute.make_layout(_WARP_GRID), permutation_mnk=(perm[0], perm[1], _LORA_K))
    return main, lora


def _layouts(cfg: _Cfg, stages: int) -> SimpleNamespace:
    tile = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
    main, lora = _tiled_mmas(cfg)

    def operand(rows):
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, _AB, cfg.tile_k), _AB)
        return cute.tile_to_shape(atom, (rows, cfg.tile_k, stages), order=(0, 1, 2))

    return SimpleNamespace(
        tiled_mma=main, lora_mma=lora, a=operand(cfg.tile_m), b=operand(cfg.tile_n),
        sfa=blockscaled_utils.sm120_make_smem_layout_sfa(main, tile, _SF_VEC, stages),
        sfb=blockscaled_utils.sm120_make_smem_layout_sfb(main, tile, _SF_VEC, stages),
    )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _stage_bytes(L) -> dict:
    """Bytes per pipeline stage of each buffer, from the real layouts (``cute.cosize``)."""
    def nbytes(dtype, layout):
        lay = layout.outer if hasattr(layout, "outer") else layout
        return cute.cosize(lay) * dtype.width // 8
    return dict(a=nbytes(_AB, L.a), b=nbytes(_AB, L.b), sfa=nbytes(_SF, L.sfa), sfb=nbytes(_SF, L.sfb))


def _in_mlir(arch: str, fn):
    """Run `fn` (which builds layouts) inside a trace, or in a fresh MLIR context targeting `arch`.

    The warp MMA op checks the DSL's target arch when it is constructed; outside ``cute.compile``
    that is the import-time ``CUTE_DSL_ARCH``, so the target is set for the duration of `fn`.
    """
    from cutlass._mlir import ir
    from cutlass.base_dsl.compiler import GPUArch
    from cutlass.base_dsl.dsl import BaseDSL
    if ir.Context.current is not None:
        return fn()
    opt = BaseDSL._get_dsl().compile_options.options[GPUArch]
    saved = opt.value
    opt.value = arch
    try:
        with ir.Context(), ir.Location.unknown():
            module = ir.Module.create()
            with ir.InsertionPoint(module.body):
                return fn()
    finally:
        opt.value = saved


def budget(arch: str, knobs: dict) -> dict:
    """SMEM bytes of a variant measured from its layouts: per stage (one-stage layouts) and in total.

    ``total(stages) = barriers + sum over buffers of align(stages * per_stage)``; the LoRA operands
    and the output do not use SMEM.  Works on the CPU (opens its own MLIR context outside a trace).
    """
    stages = 1 if knobs.get("stages") == "auto" else int(knobs["stages"])
    return dict(_budget(arch, int(knobs["tile_m"]), int(knobs["tile_n"]), int(knobs["tile_k"]), stages))


@functools.lru_cache(maxsize=None)
def _budget(arch: str, tile_m: int, tile_n: int, tile_k: int, stages: int) -> dict:
    cfg = _Cfg("bf16", 0, False, False, tile_m, tile_n, tile_k, stages)

    def measure():
        return _stage_bytes(_layouts(cfg, 1)), _stage_bytes(_layouts(cfg, stages))

    one, staged = _in_mlir(arch, measure)
    total = _BARRIER_BYTES + sum(_aligned(v) for v in staged.values())
    return dict(per_stage=one, per_stage_bytes=sum(one.values()), total_bytes=total)


def _problem(arch: str, cfg: _Cfg) -> Optional[str]:
    b = budget(arch, dataclasses.asdict(cfg))
    limit = smem_limit_bytes(arch)
    if b["total_bytes"] > limit:
        ps = b["per_stage"]
        return (f"needs {b['total_bytes']} B of SMEM ({cfg.stages} stages x {b['per_stage_bytes']} B: A {ps['a']}, "
                f"B {ps['b']}, SFA {ps['sfa']}, SFB {ps['sfb']}; + {_BARRIER_BYTES} B barriers), more than the "
                f"{limit} B of dynamic SMEM an {arch} CTA may use ({limit + STATIC_SMEM_BYTES} B per block "
                f"- {STATIC_SMEM_BYTES} B static)")
    return None


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


class _Sm120W4A4:
    """One instance per variant; all attributes are trace-time constants."""

    def __init__(self, arch: str, cfg: _Cfg):
        reason = _problem(arch, cfg)
        if reason:
            raise ValueError(f"unsupported sm120 W4A4 variant: {reason}")
        self.cfg = cfg
        self.tm, self.tn, self.tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
        self.stages = cfg.stages
        self.rank = cfg.rank
        self.out_dtype = _OUT_DTYPES[cfg.out_dtype]

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
        sm_count: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        L = _layouts(cfg, self.stages)
        kk = cute.assume(k, divby=self.tk)
        nn = cute.assume(n, divby=self.tn)
        a_t = cute.make_tensor(act, cute.make_ordered_layout((m, kk, 1), order=(1, 0, 2)))
        b_t = cute.make_tensor(wgt, cute.make_ordered_layout((nn, kk, 1), order=(1, 0, 2)))
        sfa_t = cute.make_tensor(ascales, blockscaled_utils.tile_atom_to_shape_SF(a_t.shape, _SF_VEC))
        sfb_t = cute.make_tensor(wscales, blockscaled_utils.tile_atom_to_shape_SF(b_t.shape, _SF_VEC))

        def tma(tensor, staged, rows, internal=None):
            return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), tensor,
                                               cute.slice_(staged, (None, None, 0)), (rows, self.tk),
                                               num_multicast=1, internal_type=internal)

        tma_a, g_a = tma(a_t, L.a, self.tm)
        tma_b, g_b = tma(b_t, L.b, self.tn)
        tma_sfa, g_sfa = tma(sfa_t, L.sfa, self.tm, cutlass.Int16)
        tma_sfb, g_sfb = tma(sfb_t, L.sfb, self.tn, cutlass.Int16)
        self.tx_bytes = (cute.size_in_bytes(_AB, cute.slice_(L.a, (None, None, 0)))
                         + cute.size_in_bytes(_AB, cute.slice_(L.b, (None, None, 0)))
                         + cute.size_in_bytes(_SF, cute.slice_(L.sfa, (None, None, 0)))
                         + cute.size_in_bytes(_SF, cute.slice_(L.sfb, (None, None, 0))))

        # persistent grid from the launch-time SM count
        tiles_m = (m + (self.tm - 1)) // self.tm
        num_tiles = tiles_m * (n // self.tn)
        grid = cutlass.max(cutlass.min(sm_count, num_tiles), 1)

        st = self.stages

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, st * 2]
            sA: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(L.a.outer)], _ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(L.b.outer)], _ALIGN]
            sSFA: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(L.sfa)], _ALIGN]
            sSFB: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(L.sfb)], _ALIGN]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_a, g_a, tma_b, g_b, tma_sfa, g_sfa, tma_sfb, g_sfb,
            lora_act_in, lora_up, wcscale, bias, out, m, n, tiles_m, num_tiles,
            L.tiled_mma, L.a, L.b, L.sfa, L.sfb,
        ).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], cluster=[1, 1, 1], stream=stream)

    # -- device kernel ------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        p_la: cute.Pointer,
        p_lu: cute.Pointer,
        p_wc: cute.Pointer,
        p_bias: cute.Pointer,
        p_out: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        tiles_m: cutlass.Int32,
        num_tiles: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        a_lay: cute.ComposedLayout,
        b_lay: cute.ComposedLayout,
        sfa_lay: cute.Layout,
        sfb_lay: cute.Layout,
    ):
        tm, tn, tk = self.tm, self.tn, self.tk
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()

        if warp_idx == 0:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ring = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _MMA_WARPS),
            tx_count=self.tx_bytes,
            barrier_storage=storage.barriers.data_ptr(),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        sA = storage.sA.get_tensor(a_lay.outer, swizzle=a_lay.inner)
        sB = storage.sB.get_tensor(b_lay.outer, swizzle=b_lay.inner)
        sSFA = storage.sSFA.get_tensor(sfa_lay)
        sSFB = storage.sSFB.get_tensor(sfb_lay)

        # (bM, bK, tilesM, tilesK, 1) views of the global operands and scales
        gA = cute.local_tile(mA, (tm, tk), (None, None, None))
        gB = cute.local_tile(mB, (tn, tk), (None, None, None))
        gSFA = cute.local_tile(mSFA, (tm, tk), (None, None, None))
        gSFB = cute.local_tile(mSFB, (tn, tk), (None, None, None))
        one = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        tAsSFA, tAgSFA = cpasync.tma_partition(tma_sfa, 0, one, cute.group_modes(sSFA, 0, 2),
                                               cute.group_modes(gSFA, 0, 2))
        tBsSFB, tBgSFB = cpasync.tma_partition(tma_sfb, 0, one, cute.group_modes(sSFB, 0, 2),
                                               cute.group_modes(gSFB, 0, 2))
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)
        tBsSFB = cute.filter_zeros(tBsSFB)
        tBgSFB = cute.filter_zeros(tBgSFB)
        k_tiles = cute.size(gA, mode=[3])

        cute.arch.sync_threads()  # barrier init visible to all warps

        if warp_idx < _MMA_WARPS:
            cute.arch.setmaxregister_increase(_MMA_REGS)
            self._consumer(tiled_mma, sA, sB, sSFA, sSFB, ring, k_tiles, tidx, bidx, gdim,
                           p_la, p_lu, p_wc, p_bias, p_out, m, n, tiles_m, num_tiles)
        elif warp_idx == _MMA_WARPS:
            cute.arch.setmaxregister_decrease(_LOAD_REGS)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            tile = bidx
            while tile < num_tiles:
                tmi = tile % tiles_m
                tni = tile // tiles_m
                for kt in cutlass.range(k_tiles, unroll=1):
                    ring.producer_acquire(state)
                    bar = ring.producer_get_barrier(state)
                    s = state.index
                    cute.copy(tma_a, tAgA[(None, tmi, kt, 0)], tAsA[(None, s)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tBgB[(None, tni, kt, 0)], tBsB[(None, s)], tma_bar_ptr=bar)
                    cute.copy(tma_sfa, tAgSFA[(None, tmi, kt, 0)], tAsSFA[(None, s)], tma_bar_ptr=bar)
                    cute.copy(tma_sfb, tBgSFB[(None, tni, kt, 0)], tBsSFB[(None, s)], tma_bar_ptr=bar)
                    ring.producer_commit(state)
                    state.advance()
                tile += gdim
            ring.producer_tail(state)

    @cute.jit
    def _consumer(self, tiled_mma, sA, sB, sSFA, sSFB, ring, k_tiles, tidx, bidx, gdim,
                  p_la, p_lu, p_wc, p_bias, p_out, m, n, tiles_m, num_tiles):
        tm, tn = self.tm, self.tn
        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        tCrSFA = sm120_utils.partition_fragment_SFA(sSFA[None, None, 0], thr_mma, tidx)
        tCrSFB = sm120_utils.partition_fragment_SFB(sSFB[None, None, 0], thr_mma, tidx)
        tCrSFA = cute.group_modes(tCrSFA, 2, cute.rank(tCrSFA))
        tCrSFB = cute.group_modes(tCrSFB, 2, cute.rank(tCrSFB))
        num_kb = cute.size(tCrA, mode=[2])

        ld_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), _AB), tiled_mma)
        ld_b = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), _AB), tiled_mma)
        sf_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), _SF)
        perm = tiled_mma.permutation_mnk
        ld_sfa = cute.make_tiled_copy(sf_atom, sm120_utils.get_layoutSFA_TV(tiled_mma),
                                      (cute.size(perm[0]), cute.size(perm[2])))
        ld_sfb = cute.make_tiled_copy(sf_atom, sm120_utils.get_layoutSFB_TV(tiled_mma),
                                      (cute.size(perm[1]), cute.size(perm[2])))
        t_a, t_b = ld_a.get_slice(tidx), ld_b.get_slice(tidx)
        t_sfa, t_sfb = ld_sfa.get_slice(tidx), ld_sfb.get_slice(tidx)
        vsA, vrA = t_a.partition_S(sA), t_a.retile(tCrA)
        vsB, vrB = t_b.partition_S(sB), t_b.retile(tCrB)
        vsSFA, vrSFA = t_sfa.partition_S(sSFA), cute.filter_zeros(t_sfa.retile(tCrSFA))
        vsSFB, vrSFB = t_sfb.partition_S(sSFB), cute.filter_zeros(t_sfb.retile(tCrSFB))

        cC = cute.make_identity_tensor((tm, tn))
        tCcC = thr_mma.partition_C(cC)
        acc = cute.make_rmem_tensor(tCcC.shape, Float32)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile = bidx
        while tile < num_tiles:
            tmi = tile % tiles_m
            tni = tile // tiles_m
            acc.fill(0.0)
            for kt in cutlass.range(k_tiles, unroll=1):
                ring.consumer_wait(state)
                s = state.index
                fsfa = cute.filter_zeros(vsSFA[None, None, None, s])
                fsfb = cute.filter_zeros(vsSFB[None, None, None, s])
                for kb in cutlass.range_constexpr(num_kb):
                    cute.copy(ld_a, vsA[None, None, kb, s], vrA[None, None, kb])
                    cute.copy(ld_b, vsB[None, None, kb, s], vrB[None, None, kb])
                    cute.copy(ld_sfa, fsfa[None, None, kb], vrSFA[None, None, kb])
                    cute.copy(ld_sfb, fsfb[None, None, kb], vrSFB[None, None, kb])
                # the stage is in registers: hand it back to the producer before the MMAs
                ring.consumer_release(state)
                state.advance()
                for kb in cutlass.range_constexpr(num_kb):
                    cute.gemm(tiled_mma, acc, [tCrA[None, None, kb], tCrSFA[None, None, kb]],
                              [tCrB[None, None, kb], tCrSFB[None, None, kb]], acc)
            self._epilogue(acc, thr_mma, tCcC, tidx, tmi, tni, p_la, p_lu, p_wc, p_bias, p_out, m, n)
            tile += gdim

    @cute.jit
    def _epilogue(self, acc, thr_mma, tCcC, tidx, tmi, tni, p_la, p_lu, p_wc, p_bias, p_out, m, n):
        tm, tn = self.tm, self.tn
        m0 = tmi * tm
        n0 = tni * tn
        if cutlass.const_expr(self.cfg.wcscale):
            mWc = cute.make_tensor(p_wc, cute.make_layout((n,), stride=(1,)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * mWc[n0 + tCcC[i][1]]
        if cutlass.const_expr(self.rank > 0):
            self._lora(acc, tidx, m0, n0, p_la, p_lu, m, n)
        if cutlass.const_expr(self.cfg.bias):
            mBias = cute.make_tensor(p_bias, cute.make_layout((n,), stride=(1,)))
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + mBias[n0 + tCcC[i][1]]
        mOut = cute.make_tensor(p_out, cute.make_layout((m, n), stride=(n, 1)))
        gC = cute.local_tile(mOut, (tm, tn), (tmi, tni))
        tCgC = thr_mma.partition_C(gC)
        for i in cutlass.range_constexpr(cute.size(acc)):
            if (m0 + tCcC[i][0]) < m:
                tCgC[i] = acc[i].to(self.out_dtype)

    @cute.jit
    def _lora(self, acc, tidx, m0, n0, p_la, p_lu, m, n):
        """acc += lora_act_in[m0:m0+tm, :] @ lora_up[n0:n0+tn, :]^T, one 16-wide k-block at a time."""
        tm, tn, R = self.tm, self.tn, self.rank
        main, lora = _tiled_mmas(self.cfg)
        # both tiled MMAs must give every thread the same accumulator elements
        assert str(main.tv_layout_C) == str(lora.tv_layout_C), (main.tv_layout_C, lora.tv_layout_C)
        ldt = self.out_dtype
        mLA = cute.make_tensor(p_la, cute.make_layout((m, R), stride=(R, 1)))
        mLU = cute.make_tensor(p_lu, cute.make_layout((n, R), stride=(R, 1)))
        thr = lora.get_slice(tidx)
        gLA = cute.local_tile(mLA, (tm, R), (m0 // tm, 0))
        gLU = cute.local_tile(mLU, (tn, R), (n0 // tn, 0))
        tLgA = thr.partition_A(gLA)
        tLgB = thr.partition_B(gLU)
        tLcA = thr.partition_A(cute.make_identity_tensor((tm, R)))
        rA = lora.make_fragment_A(tLgA)
        rB = lora.make_fragment_B(tLgB)
        for kb in cutlass.range_constexpr(R // _LORA_K):
            ga = tLgA[None, None, kb]
            ca = tLcA[None, None, kb]
            ra = rA[None, None, kb]
            for i in cutlass.range_constexpr(cute.size(ra)):
                ra[i] = ldt(0.0)
                if (m0 + ca[i][0]) < m:  # rows >= m read as 0
                    ra[i] = ga[i]
            cute.autovec_copy(tLgB[None, None, kb], rB[None, None, kb])
            cute.gemm(lora, acc, rA[None, None, kb], rB[None, None, kb], acc)


# ---------------------------------------------------------------------------
# Build-time API
# ---------------------------------------------------------------------------


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.<arch>.gemm_w4a4`` -> tuning-knob dicts.

    Keys (as for sm_90a): ``tiles: [[tile_m, tile_n, tile_k], ...]`` (default ``[DEFAULT_TILE]``) and
    ``stages: [auto | n, ...]`` (default ``[auto]``: the deepest ring that fits).  Values outside
    TUNING are left to `invalid_reason`, so they are listed as rejected with the reason.
    """
    problems = [f"{key}: unknown key (allowed: tiles, stages)" for key in sorted(set(section) - {"tiles", "stages"})]

    def items(key, default, ok, what):
        vals = section.get(key, default)
        if not isinstance(vals, list) or not vals:
            problems.append(f"{key}: {vals!r}: expected a non-empty list of {what}")
            return []
        good = []
        for i, v in enumerate(vals):
            if not ok(v):
                problems.append(f"{key}[{i}]: {v!r}: expected {what}")
            elif v in good:
                problems.append(f"{key}[{i}]: {v!r}: duplicate value")
            else:
                good.append(v)
        return good

    def pos_int(x):
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    tiles = items("tiles", [list(DEFAULT_TILE)], lambda t: isinstance(t, list) and len(t) == 3
                  and all(map(pos_int, t)), "[tile_m, tile_n, tile_k], three positive integers")
    stages = items("stages", ["auto"], lambda s: s == "auto" or pos_int(s), "'auto' or a positive integer")
    return [dict(tile_m=t[0], tile_n=t[1], tile_k=t[2], stages=s) for t in tiles for s in stages], problems


def resolve(arch: str, knobs: dict) -> dict:
    """``stages: auto`` -> the deepest ring that fits: (limit - barriers) // bytes per stage, within TUNING."""
    if knobs.get("stages") != "auto":
        return dict(knobs)
    if arch not in ARCHS or knobs.get("tile_m") not in TUNING["tile_m"] or knobs.get("tile_n") not in TUNING["tile_n"] \
            or knobs.get("tile_k") not in TUNING["tile_k"]:
        return dict(knobs, stages=min(TUNING["stages"]))     # invalid_reason says what is wrong
    per_stage = budget(arch, knobs)["per_stage_bytes"]
    fit = (smem_limit_bytes(arch) - _BARRIER_BYTES) // per_stage
    return dict(knobs, stages=max(min(TUNING["stages"]), min(fit, max(TUNING["stages"]))))


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    """The one validity predicate of this family: None if buildable, else why (with numbers)."""
    from svdq_aot.family import table_reason
    return table_reason(NAME, ARCHS, arch, knobs, FEATURE_VALUES, TUNING) or _problem(arch, _cfg_of(knobs))


def requirements(arch: str, knobs: dict) -> dict:
    """What the op's shape rule reads: N % tile_n and K % tile_k (M is arbitrary)."""
    return {"n_multiple": int(knobs["tile_n"]), "k_multiple": int(knobs["tile_k"])}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile one variant for `arch` (no GPU needed); kernel symbol ``<name>_0``."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    cfg = _cfg_of(knobs)
    gemm = _Sm120W4A4(arch, cfg)
    from svdq_loader.ops import GEMM_W4A4
    return compile_kernel(_Sm120W4A4, gemm, GEMM_W4A4, dict(act=_AB, ascales=_SF, wgt=_AB, wscales=_SF,
                                                            wcscale=Float32, bias=Float32),
                          _OUT_DTYPES[cfg.out_dtype], name, arch, dump_dir,
                          lambda g: g.shared_storage.size_in_bytes(), keep_ptx=keep_ptx)
"""SVDQuant W4A4 (NVFP4) GEMM for Blackwell datacenter GPUs, ``sm_100a`` and ``sm_103a`` -- CuTe-DSL, build time only.

Operator (fp32 accumulation, DESIGN semantics: LoRA outside the wcscale multiply)::

    y[m, n] = (sum_k A[m,k] * W[n,k]) * wcscale[n] + bias[n] + sum_r lora_act_in[m,r] * lora_up[n,r]

How this kernel computes it:

* **Main product.** ``tcgen05.mma.kind::mxf4nvf4.block_scale`` (E2M1 operands, E4M3 scales per
  16 k) from swizzled SMEM, scales copied SMEM -> TMEM (``tcgen05.cp``) per k-block, fp32
  accumulator in TMEM.  One main k-block is 256 k (4 MMA atoms).
* **LoRA.** f16/bf16 ``tcgen05.mma`` into the *same* TMEM accumulator, interleaved into the main
  K loop by `sm100_plan.lora_slice` (every LoRA atom exactly once for every K, also K < 4R).
  Sharing the accumulator means the LoRA term is multiplied by wcscale in the epilogue too, so the
  weight-preparation path (`svdq_loader.ops.blackwell_weight`) hands this kernel
  ``lora_up / wcscale`` instead of ``lora_up`` when wcscale is on.
* **Epilogue.** TMEM -> registers, ``* wcscale[n] + bias[n]`` (each optional), convert to
  fp16/bf16, registers -> SMEM -> TMA store (rows >= M are clipped by the TMA unit).
* **Warp specialisation.** 192 threads: warps 0-3 epilogue, warp 4 MMA, warp 5 TMA loads.  Each
  role keeps its own pipeline states across tiles.
* **Persistent static schedule.** The host function launches
  `sm100_plan.persistent_clusters(sm_count, ...)` clusters, ``sm_count`` being the *launch-time*
  host argument the loader fills from the device; every role walks the same tile sequence
  (`sm100_plan.tiles_of_cluster`, `sm100_plan.tile_coord`).  Nothing of the build machine is baked in.
* **CTA modes.** ``cta_group=1``: tile 128 x tile_n, cluster 1.  ``cta_group=2``: tile 256 x tile_n
  computed by a CTA pair (cluster 2x1, ``tcgen05`` 2-CTA MMA, A split along M, B along N).

Host arguments (the op's): act, ascales, wgt, wscales, lora_act_in, lora_up, wcscale, bias, out,
m, n, k, sm_count, stream.  Preconditions the loader enforces: 16-byte aligned contiguous
tensors, ``ascales``/``wscales`` in the blocked 32x4x4 layout (`svdq_loader.ops.layouts`),
N % tile_n == 0, K % 256 == 0, M >= 1.

This file was compiled and statically checked on a CPU-only machine; it has never run on a
Blackwell GPU (see docs/VERIFICATION.md).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from . import sm100_plan as plan
from .gemm_features import GemmFeatures, gemm_feature_values
from .compiled_output import compile_kernel, refuse_invalid

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile", "budget",
]

OP = "gemm_w4a4"
ARCHS = ("sm_100a", "sm_103a")
NAME = "sm100_gemm_w4a4"

TUNING: dict[str, tuple] = dict(
    cta_group=(1, 2),
    tile_m=(128, 256),
    tile_n=(128, 256),
    ab_stages=tuple(range(2, plan.MAX_AB_STAGES + 1)),
)
FEATURE_VALUES: dict[str, tuple] = dict(
    out_dtype=("fp16", "bf16"),
    rank=(0, 16, 32, 48, 64, 96, 128, 256),
    wcscale=(False, True),
    bias=(False, True),
    scale_layout=("blocked",),
)

_OUT_DTYPES = {"fp16": Float16, "bf16": BFloat16}
_AB = cutlass.Float4E2M1FN
_SF = cutlass.Float8E4M3FN
_SF_VEC = 16
_C_STAGES = 2
_ALIGN = 1024
_EPI_WARPS = (0, 1, 2, 3)
_MMA_WARP = 4
_TMA_WARP = 5
_THREADS = 32 * 6


@dataclasses.dataclass(frozen=True)
class _Cfg(GemmFeatures):
    cta_group: int
    tile_m: int
    tile_n: int
    ab_stages: int


def _cfg_of(knobs: dict) -> _Cfg:
    return _Cfg(*gemm_feature_values(knobs),
                int(knobs["cta_group"]), int(knobs["tile_m"]), int(knobs["tile_n"]), int(knobs["ab_stages"]))


# ---------------------------------------------------------------------------
# Layouts (built by the DSL; used by the kernel and by the budget)
# ---------------------------------------------------------------------------


def _layouts(cfg: _Cfg, ab_stages: int) -> SimpleNamespace:
    """Tiled MMAs and SMEM layouts of a variant; needs an MLIR context (trace time or `budget`)."""
    two = cfg.cta_group == 2
    group = tcgen05.CtaGroup.TWO if two else tcgen05.CtaGroup.ONE
    c_dtype = _OUT_DTYPES[cfg.out_dtype]
    K = OperandMajorMode.K
    mma_mn = (cfg.tile_m, cfg.tile_n)
    tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(_AB, _AB, K, K, _SF, _SF_VEC, group, mma_mn)
    sfb_mn = (cfg.tile_m // cfg.cta_group, -(-cfg.tile_n // 128) * 128)
    tiled_mma_sfb = sm100_utils.make_blockscaled_trivial_tiled_mma(
        _AB, _AB, K, K, _SF, _SF_VEC, tcgen05.CtaGroup.ONE, sfb_mn)
    atom_k = cute.size(tiled_mma.shape_mnk, mode=[2])
    kblk = atom_k * 4
    if kblk != plan.MAIN_K_BLOCK:
        raise RuntimeError(f"block-scaled MMA atom K is {atom_k}; the plan assumes {plan.MAIN_K_BLOCK // 4}")
    tiler = (cfg.tile_m, cfg.tile_n, kblk)
    tiler_sfb = (sfb_mn[0], sfb_mn[1], kblk)
    cta_tile = (cfg.tile_m // cfg.cta_group, cfg.tile_n, kblk)
    epi_tile = sm100_utils.compute_epilogue_tile_shape(cta_tile, two, LayoutEnum.ROW_MAJOR, c_dtype)
    ns = SimpleNamespace(
        two=two, group=group, c_dtype=c_dtype, tiled_mma=tiled_mma, tiled_mma_sfb=tiled_mma_sfb,
        tiler=tiler, tiler_sfb=tiler_sfb, cta_tile=cta_tile, epi_tile=epi_tile,
        a=sm100_utils.make_smem_layout_a(tiled_mma, tiler, _AB, ab_stages),
        b=sm100_utils.make_smem_layout_b(tiled_mma, tiler, _AB, ab_stages),
        sfa=blockscaled_utils.make_smem_layout_sfa(tiled_mma, tiler, _SF_VEC, ab_stages),
        sfb=blockscaled_utils.make_smem_layout_sfb(tiled_mma, tiler, _SF_VEC, ab_stages),
        c=sm100_utils.make_smem_layout_epi(c_dtype, LayoutEnum.ROW_MAJOR, epi_tile, _C_STAGES),
        sfa_cols=(cta_tile[0] // 32) * 4,
        sfb_cols=(sfb_mn[1] // 32) * 4,
    )
    if cfg.rank:
        lora_mma = _lora_tiled_mma(cfg)
        ltiler = (cfg.tile_m, cfg.tile_n, cfg.rank)
        ns.lora_mma, ns.ltiler = lora_mma, ltiler
        ns.la = sm100_utils.make_smem_layout_a(lora_mma, ltiler, c_dtype, 1)
        ns.lb = sm100_utils.make_smem_layout_b(lora_mma, ltiler, c_dtype, 1)
    return ns


def _lora_tiled_mma(cfg: _Cfg):
    """The f16/bf16 tcgen05 MMA of the LoRA term: same (tile_m, tile_n) and CTA group as the main MMA, so
    it accumulates into the same TMEM accumulator layout."""
    group = tcgen05.CtaGroup.TWO if cfg.cta_group == 2 else tcgen05.CtaGroup.ONE
    dt = _OUT_DTYPES[cfg.out_dtype]
    K = OperandMajorMode.K
    return sm100_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, group, (cfg.tile_m, cfg.tile_n))


def _bytes(dtype, layout) -> int:
    outer = layout.outer if hasattr(layout, "outer") else layout
    return (cute.cosize(outer) * dtype.width + 7) // 8


def _measure(cfg: _Cfg) -> tuple[plan.SmemBytes, SimpleNamespace]:
    L = _layouts(cfg, 1)
    ab = _bytes(_AB, L.a) + _bytes(_AB, L.b) + _bytes(_SF, L.sfa) + _bytes(_SF, L.sfb)
    lora = (_bytes(L.c_dtype, L.la) + _bytes(L.c_dtype, L.lb)) if cfg.rank else 0
    return plan.SmemBytes(ab_stage=ab, lora=lora, epilogue=_bytes(L.c_dtype, L.c), align=_ALIGN), L


def budget(knobs: dict) -> dict:
    """SMEM and TMEM numbers of a variant, measured from the real layouts (``cute.cosize``).

    Works at build time with no GPU; opens its own MLIR context when called outside a trace.
    """
    cfg = _cfg_of(dict(knobs, ab_stages=knobs.get("ab_stages") if isinstance(knobs.get("ab_stages"), int) else 2))
    from cutlass._mlir import ir
    if ir.Context.current is not None:
        b, L = _measure(cfg)
    else:
        with ir.Context(), ir.Location.unknown():
            module = ir.Module.create()
            with ir.InsertionPoint(module.body):
                b, L = _measure(cfg)
    acc = plan.acc_stages_for(cfg.tile_n, L.sfa_cols, L.sfb_cols)
    return dict(smem=b, max_ab_stages=plan.max_ab_stages(b), acc_stages=acc, sfa_cols=L.sfa_cols,
                sfb_cols=L.sfb_cols, tmem_used=plan.tmem_columns(cfg.tile_n, acc, L.sfa_cols, L.sfb_cols))


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


class _Sm100W4A4:
    """One instance per variant; all attributes are trace-time constants."""

    def __init__(self, cfg: _Cfg):
        reason = _problem(cfg)
        if reason:
            raise ValueError(f"unsupported sm100 W4A4 variant: {reason}")
        self.cfg = cfg
        self.rank = cfg.rank
        self.lora_atoms = cfg.rank // plan.LORA_ATOM_K
        self.cs = cfg.cta_group  # cluster size (cluster cs x 1)
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.ab_stages = cfg.ab_stages
        self.c_dtype = _OUT_DTYPES[cfg.out_dtype]
        self.epi_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(_EPI_WARPS))
        self.tmem_sync = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (1 + len(_EPI_WARPS)))

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
        sm_count: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        sizes, _ = _measure(cfg)
        L = _layouts(cfg, self.ab_stages)
        self.acc_stages = plan.acc_stages_for(cfg.tile_n, L.sfa_cols, L.sfb_cols)
        self.acc_cols = cfg.tile_n * self.acc_stages
        self.sfa_cols, self.sfb_cols = L.sfa_cols, L.sfb_cols
        self.tmem_cols = plan.tmem_alloc_columns(plan.tmem_columns(cfg.tile_n, self.acc_stages,
                                                                   L.sfa_cols, L.sfb_cols))
        self.smem_plan = sizes
        self.L = L

        kk = cute.assume(k, divby=plan.MAIN_K_BLOCK)
        nn = cute.assume(n, divby=cfg.tile_n)
        a_t = cute.make_tensor(act, cute.make_ordered_layout((m, kk, 1), order=(1, 0, 2)))
        b_t = cute.make_tensor(wgt, cute.make_ordered_layout((nn, kk, 1), order=(1, 0, 2)))
        c_t = cute.make_tensor(out, cute.make_ordered_layout((m, nn, 1), order=(1, 0, 2)))
        sfa_t = cute.make_tensor(ascales, blockscaled_utils.tile_atom_to_shape_SF(a_t.shape, _SF_VEC))
        sfb_t = cute.make_tensor(wscales, blockscaled_utils.tile_atom_to_shape_SF(b_t.shape, _SF_VEC))

        tiled_mma, tiled_mma_sfb = L.tiled_mma, L.tiled_mma_sfb
        cluster_vmnk = cute.tiled_divide(cute.make_layout((self.cs, 1, 1)), (tiled_mma.thr_id.shape,))
        cluster_sfb_vmnk = cute.tiled_divide(cute.make_layout((self.cs, 1, 1)), (tiled_mma_sfb.thr_id.shape,))
        atom_thr = cute.size(tiled_mma.thr_id.shape)

        op_a = sm100_utils.cluster_shape_to_tma_atom_A((self.cs, 1), tiled_mma.thr_id)
        op_b = sm100_utils.cluster_shape_to_tma_atom_B((self.cs, 1), tiled_mma.thr_id)
        op_sfb = sm100_utils.cluster_shape_to_tma_atom_SFB((self.cs, 1), tiled_mma.thr_id)
        a1 = cute.slice_(L.a, (None, None, None, 0))
        b1 = cute.slice_(L.b, (None, None, None, 0))
        sfa1 = cute.slice_(L.sfa, (None, None, None, 0))
        sfb1 = cute.slice_(L.sfb, (None, None, None, 0))
        tma_a, g_a = cute.nvgpu.make_tiled_tma_atom_A(op_a, a_t, a1, L.tiler, tiled_mma, cluster_vmnk.shape)
        tma_b, g_b = cute.nvgpu.make_tiled_tma_atom_B(op_b, b_t, b1, L.tiler, tiled_mma, cluster_vmnk.shape)
        tma_sfa, g_sfa = cute.nvgpu.make_tiled_tma_atom_A(op_a, sfa_t, sfa1, L.tiler, tiled_mma, cluster_vmnk.shape,
                                                          internal_type=cutlass.Int16)
        tma_sfb, g_sfb = cute.nvgpu.make_tiled_tma_atom_B(op_sfb, sfb_t, sfb1, L.tiler_sfb, tiled_mma_sfb,
                                                          cluster_sfb_vmnk.shape, internal_type=cutlass.Int16)
        self.ab_tx = (cute.size_in_bytes(_AB, a1) + cute.size_in_bytes(_AB, b1)
                      + cute.size_in_bytes(_SF, sfa1) + cute.size_in_bytes(_SF, sfb1)) * atom_thr

        tma_la = g_la = tma_lb = g_lb = la_lay = lb_lay = None
        self.lora_tx = 0
        if cutlass.const_expr(self.rank > 0):
            R = self.rank
            la_t = cute.make_tensor(lora_act_in, cute.make_ordered_layout((m, R, 1), order=(1, 0, 2)))
            lb_t = cute.make_tensor(lora_up, cute.make_ordered_layout((nn, R, 1), order=(1, 0, 2)))
            la1 = cute.slice_(L.la, (None, None, None, 0))
            lb1 = cute.slice_(L.lb, (None, None, None, 0))
            tma_la, g_la = cute.nvgpu.make_tiled_tma_atom_A(op_a, la_t, la1, L.ltiler, L.lora_mma, cluster_vmnk.shape)
            tma_lb, g_lb = cute.nvgpu.make_tiled_tma_atom_B(op_b, lb_t, lb1, L.ltiler, L.lora_mma, cluster_vmnk.shape)
            self.lora_tx = (cute.size_in_bytes(self.c_dtype, la1) + cute.size_in_bytes(self.c_dtype, lb1)) * atom_thr
            la_lay, lb_lay = L.la, L.lb

        c1 = cute.slice_(L.c, (None, None, 0))
        tma_c, g_c = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c_t, c1, L.epi_tile)

        # grid from the launch-time SM count (never a traced constant)
        tiles_m = (m + (cfg.tile_m - 1)) // cfg.tile_m
        tiles_n = n // cfg.tile_n
        num_tiles = tiles_m * tiles_n
        clusters = cutlass.max(cutlass.min(sm_count // self.cs, num_tiles), 1)

        c_dt = self.c_dtype
        ab_st, acc_st = self.ab_stages, self.acc_stages

        @cute.struct
        class MainStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, ab_st]
            ab_empty: cute.struct.MemRange[cutlass.Int64, ab_st]
            acc_full: cute.struct.MemRange[cutlass.Int64, acc_st]
            acc_empty: cute.struct.MemRange[cutlass.Int64, acc_st]
            lora_full: cute.struct.MemRange[cutlass.Int64, 1]
            lora_empty: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_dealloc: cutlass.Int64
            tmem_holder: cutlass.Int32
            sC: cute.struct.Align[cute.struct.MemRange[c_dt, cute.cosize(L.c.outer)], _ALIGN]
            sA: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(L.a.outer)], _ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(L.b.outer)], _ALIGN]
            sSFA: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(L.sfa)], _ALIGN]
            sSFB: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(L.sfb)], _ALIGN]

        SharedStorage = MainStorage
        if cutlass.const_expr(self.rank > 0):
            @cute.struct
            class LoraStorage:
                ab_full: cute.struct.MemRange[cutlass.Int64, ab_st]
                ab_empty: cute.struct.MemRange[cutlass.Int64, ab_st]
                acc_full: cute.struct.MemRange[cutlass.Int64, acc_st]
                acc_empty: cute.struct.MemRange[cutlass.Int64, acc_st]
                lora_full: cute.struct.MemRange[cutlass.Int64, 1]
                lora_empty: cute.struct.MemRange[cutlass.Int64, 1]
                tmem_dealloc: cutlass.Int64
                tmem_holder: cutlass.Int32
                sC: cute.struct.Align[cute.struct.MemRange[c_dt, cute.cosize(L.c.outer)], _ALIGN]
                sA: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(L.a.outer)], _ALIGN]
                sB: cute.struct.Align[cute.struct.MemRange[_AB, cute.cosize(L.b.outer)], _ALIGN]
                sSFA: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(L.sfa)], _ALIGN]
                sSFB: cute.struct.Align[cute.struct.MemRange[_SF, cute.cosize(L.sfb)], _ALIGN]
                sLA: cute.struct.Align[cute.struct.MemRange[c_dt, cute.cosize(L.la.outer)], _ALIGN]
                sLB: cute.struct.Align[cute.struct.MemRange[c_dt, cute.cosize(L.lb.outer)], _ALIGN]

            SharedStorage = LoraStorage

        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() > sizes.dynamic(self.ab_stages)):
            raise ValueError(f"SMEM struct {SharedStorage.size_in_bytes()} B is larger than the budget "
                             f"{sizes.dynamic(self.ab_stages)} B: the stage solver under-counts")

        self.kernel(
            tiled_mma, tiled_mma_sfb, tma_a, g_a, tma_b, g_b, tma_sfa, g_sfa, tma_sfb, g_sfb,
            tma_la, g_la, tma_lb, g_lb, tma_c, g_c, wcscale, bias,
            cluster_vmnk, cluster_sfb_vmnk, L.a, L.b, L.sfa, L.sfb, L.c, la_lay, lb_lay, L.epi_tile, m, n, tiles_m, num_tiles,
        ).launch(
            grid=[clusters * self.cs, 1, 1],
            block=[_THREADS, 1, 1],
            cluster=[self.cs, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # -- device kernel ------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_sfb: cute.TiledMma,
        tma_a: cute.CopyAtom, mA: cute.Tensor,
        tma_b: cute.CopyAtom, mB: cute.Tensor,
        tma_sfa: cute.CopyAtom, mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom, mSFB: cute.Tensor,
        tma_la: Optional[cute.CopyAtom], mLA: Optional[cute.Tensor],
        tma_lb: Optional[cute.CopyAtom], mLB: Optional[cute.Tensor],
        tma_c: cute.CopyAtom, mC: cute.Tensor,
        p_wc: cute.Pointer, p_bias: cute.Pointer,
        cluster_vmnk: cute.Layout, cluster_sfb_vmnk: cute.Layout,
        a_lay: cute.ComposedLayout, b_lay: cute.ComposedLayout,
        sfa_lay: cute.Layout, sfb_lay: cute.Layout, c_lay: cute.ComposedLayout,
        la_lay: Optional[cute.ComposedLayout],
        lb_lay: Optional[cute.ComposedLayout],
        epi_tile: cute.Tile,
        m: Int32, n: Int32, tiles_m: Int32, num_tiles: Int32,
    ):
        L = self.L
        has_lora = self.rank > 0
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == _TMA_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_sfa)
            cpasync.prefetch_descriptor(tma_sfb)
            cpasync.prefetch_descriptor(tma_c)
            if cutlass.const_expr(has_lora):
                cpasync.prefetch_descriptor(tma_la)
                cpasync.prefetch_descriptor(tma_lb)

        two = cutlass.const_expr(self.cs == 2)
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        v = bidx % self.cs
        is_leader = v == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        crd_vmnk = cluster_vmnk.get_flat_coord(cta_rank)
        crd_sfb_vmnk = cluster_sfb_vmnk.get_flat_coord(cta_rank)
        tidx, _, _ = cute.arch.thread_idx()
        # the static persistent schedule: cluster c computes tiles c, c + C, c + 2C, ...
        cluster_id = bidx // self.cs
        num_clusters = gdim // self.cs

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)

        consumer_arrivals = 1  # A and B are not multicast (cluster is cs x 1)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.ab_full.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=self.ab_tx, cta_layout_vmnk=cluster_vmnk, defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=st.acc_full.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(_EPI_WARPS) * self.cs),
            cta_layout_vmnk=cluster_vmnk, defer_sync=True,
        )
        lora_pipe = None
        if cutlass.const_expr(has_lora):
            lora_pipe = pipeline.PipelineTmaUmma.create(
                barrier_storage=st.lora_full.data_ptr(), num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
                tx_count=self.lora_tx, cta_layout_vmnk=cluster_vmnk, defer_sync=True,
            )
        tmem = cutlass.memory.TmemAllocator(
            st.tmem_holder.ptr, barrier_for_retrieve=self.tmem_sync, allocator_warp_id=_EPI_WARPS[0],
            is_two_cta=two, two_cta_tmem_dealloc_mbar_ptr=st.tmem_dealloc.ptr,
        )
        pipeline_init_arrive(cluster_shape_mn=(self.cs, 1), is_relaxed=True)

        sC = st.sC.get_tensor(c_lay.outer, swizzle=c_lay.inner)
        sA = st.sA.get_tensor(a_lay.outer, swizzle=a_lay.inner)
        sB = st.sB.get_tensor(b_lay.outer, swizzle=b_lay.inner)
        sSFA = st.sSFA.get_tensor(sfa_lay)
        sSFB = st.sSFB.get_tensor(sfb_lay)

        mc_a = mc_b = mc_sfb = None
        if cutlass.const_expr(two):
            mc_a = cpasync.create_tma_multicast_mask(cluster_vmnk, crd_vmnk, mcast_mode=2)
            mc_b = cpasync.create_tma_multicast_mask(cluster_vmnk, crd_vmnk, mcast_mode=1)
            mc_sfb = cpasync.create_tma_multicast_mask(cluster_sfb_vmnk, crd_sfb_vmnk, mcast_mode=1)

        # global tiles: (bM, bK, RestM, RestK, RestL) etc.
        gA = cute.local_tile(mA, cute.slice_(L.tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(L.tiler, (0, None, None)), (None, None, None))
        gSFA = cute.local_tile(mSFA, cute.slice_(L.tiler, (None, 0, None)), (None, None, None))
        gSFB = cute.local_tile(mSFB, cute.slice_(L.tiler_sfb, (0, None, None)), (None, None, None))
        gC = cute.local_tile(mC, cute.slice_(L.tiler, (None, None, 0)), (None, None, None))
        num_kb = cute.size(gA, mode=[3])

        thr_mma = tiled_mma.get_slice(v)
        thr_mma_sfb = tiled_mma_sfb.get_slice(v)
        tCgA = thr_mma.partition_A(gA)
        tCgB = thr_mma.partition_B(gB)
        tCgSFA = thr_mma.partition_A(gSFA)
        tCgSFB = thr_mma_sfb.partition_B(gSFB)
        tCgC = thr_mma.partition_C(gC)

        a_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
        b_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)
        sfb_cta = cute.make_layout(cute.slice_(cluster_sfb_vmnk, (0, None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(tma_a, crd_vmnk[2], a_cta, cute.group_modes(sA, 0, 3),
                                           cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, crd_vmnk[1], b_cta, cute.group_modes(sB, 0, 3),
                                           cute.group_modes(tCgB, 0, 3))
        tAsSFA, tAgSFA = cpasync.tma_partition(tma_sfa, crd_vmnk[2], a_cta, cute.group_modes(sSFA, 0, 3),
                                               cute.group_modes(tCgSFA, 0, 3))
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cpasync.tma_partition(tma_sfb, crd_sfb_vmnk[1], sfb_cta, cute.group_modes(sSFB, 0, 3),
                                               cute.group_modes(tCgSFB, 0, 3))
        tBsSFB = cute.filter_zeros(tBsSFB)
        tBgSFB = cute.filter_zeros(tBgSFB)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(L.tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))

        # LoRA operands: one buffer per tile
        tLAsA = tLAgA = tLBsB = tLBgB = tCrLA = tCrLB = lora_mma = None
        if cutlass.const_expr(has_lora):
            # built here, not passed in: its atom state is not a kernel parameter the launch ABI carries
            lora_mma = _lora_tiled_mma(self.cfg)
            sLA = st.sLA.get_tensor(la_lay.outer, swizzle=la_lay.inner)
            sLB = st.sLB.get_tensor(lb_lay.outer, swizzle=lb_lay.inner)
            thr_lmma = lora_mma.get_slice(v)
            gLA = cute.local_tile(mLA, cute.slice_(L.ltiler, (None, 0, None)), (None, None, None))
            gLB = cute.local_tile(mLB, cute.slice_(L.ltiler, (0, None, None)), (None, None, None))
            tLAsA, tLAgA = cpasync.tma_partition(tma_la, crd_vmnk[2], a_cta, cute.group_modes(sLA, 0, 3),
                                                 cute.group_modes(thr_lmma.partition_A(gLA), 0, 3))
            tLBsB, tLBgB = cpasync.tma_partition(tma_lb, crd_vmnk[1], b_cta, cute.group_modes(sLB, 0, 3),
                                                 cute.group_modes(thr_lmma.partition_B(gLB), 0, 3))
            tCrLA = lora_mma.make_fragment_A(sLA)
            tCrLB = lora_mma.make_fragment_B(sLB)

        pipeline_init_wait(cluster_shape_mn=(self.cs, 1))

        # ------------------------------------------------------------------ TMA warp
        if warp == _TMA_WARP:
            ab_st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            lora_st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            t = cluster_id
            while t < num_tiles:
                mt, nt = plan.tile_coord(t, tiles_m)
                tAgA_t = tAgA[(None, mt, None, 0)]
                tBgB_t = tBgB[(None, nt, None, 0)]
                tAgSFA_t = tAgSFA[(None, mt, None, 0)]
                tBgSFB_t = tBgSFB[(None, nt, None, 0)]
                for kb in cutlass.range(0, num_kb, 1, unroll=1):
                    ab_pipe.producer_acquire(ab_st)
                    bar = ab_pipe.producer_get_barrier(ab_st)
                    s = ab_st.index
                    cute.copy(tma_a, tAgA_t[(None, kb)], tAsA[(None, s)], tma_bar_ptr=bar, mcast_mask=mc_a)
                    cute.copy(tma_b, tBgB_t[(None, kb)], tBsB[(None, s)], tma_bar_ptr=bar, mcast_mask=mc_b)
                    cute.copy(tma_sfa, tAgSFA_t[(None, kb)], tAsSFA[(None, s)], tma_bar_ptr=bar, mcast_mask=mc_a)
                    cute.copy(tma_sfb, tBgSFB_t[(None, kb)], tBsSFB[(None, s)], tma_bar_ptr=bar, mcast_mask=mc_sfb)
                    ab_st.advance()
                    if cutlass.const_expr(has_lora):
                        if kb == 0:
                            # this tile's LoRA operands (one buffer), right after its first main k-block; the
                            # MMA warp frees the buffer after its last LoRA atom (sm100_plan.lora_release_kb)
                            lora_pipe.producer_acquire(lora_st)
                            lbar = lora_pipe.producer_get_barrier(lora_st)
                            cute.copy(tma_la, tLAgA[(None, mt, 0, 0)], tLAsA[(None, 0)], tma_bar_ptr=lbar,
                                      mcast_mask=mc_a)
                            cute.copy(tma_lb, tLBgB[(None, nt, 0, 0)], tLBsB[(None, 0)], tma_bar_ptr=lbar,
                                      mcast_mask=mc_b)
                if cutlass.const_expr(has_lora):
                    lora_st.advance()   # outside the dynamic `if`: pipeline states only change at loop level
                t += num_clusters
            ab_pipe.producer_tail(ab_st)
            if cutlass.const_expr(has_lora):
                lora_pipe.producer_tail(lora_st)

        # ------------------------------------------------------------------ MMA warp
        if warp == _MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
            sfa_ptr = cute.recast_ptr(acc_ptr + self.acc_cols, dtype=_SF)
            tCtSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, L.tiler, _SF_VEC, cute.slice_(sfa_lay, (None, None, None, 0))))
            sfb_ptr = cute.recast_ptr(acc_ptr + self.acc_cols + self.sfa_cols, dtype=_SF)
            tCtSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, L.tiler, _SF_VEC, cute.slice_(sfb_lay, (None, None, None, 0))))
            s2t_a, tCsSFA_s2t, tCtSFA_s2t = self._s2t(sSFA, tCtSFA)
            s2t_b, tCsSFB_s2t, tCtSFB_s2t = self._s2t(sSFB, tCtSFB)

            ab_st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            acc_st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
            lora_st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            if cutlass.const_expr(has_lora):
                lora_mma.set(tcgen05.Field.ACCUMULATE, True)
            t = cluster_id
            while t < num_tiles:
                tCtAcc = tCtAcc_base[(None, None, None, acc_st.index)]
                if is_leader:
                    acc_pipe.producer_acquire(acc_st)
                for kb in cutlass.range(0, num_kb, 1, unroll=1):
                    if is_leader:
                        ab_pipe.consumer_wait(ab_st)
                        s = ab_st.index
                        cute.copy(s2t_a, tCsSFA_s2t[(None, None, None, None, s)], tCtSFA_s2t)
                        cute.copy(s2t_b, tCsSFB_s2t[(None, None, None, None, s)], tCtSFB_s2t)
                        for ka in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                            # the first MMA of every tile overwrites the accumulator
                            if cutlass.const_expr(ka == 0):
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                            else:
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                            cute.gemm(tiled_mma, tCtAcc,
                                      [tCrA[(None, None, ka, s)], tCtSFA[(None, None, ka)]],
                                      [tCrB[(None, None, ka, s)], tCtSFB[(None, None, ka)]],
                                      tCtAcc)
                        ab_pipe.consumer_release(ab_st)
                        if cutlass.const_expr(has_lora):
                            if kb == 0:
                                lora_pipe.consumer_wait(lora_st)
                            lo, hi = plan.lora_slice(kb, num_kb, self.lora_atoms, cutlass.min)
                            for j in cutlass.range(lo, hi, 1, unroll=1):
                                cute.gemm(lora_mma, tCtAcc, tCrLA[(None, None, j, 0)],
                                          tCrLB[(None, None, j, 0)], tCtAcc)
                            if lo < hi and hi == self.lora_atoms:
                                lora_pipe.consumer_release(lora_st)
                    ab_st.advance()
                if cutlass.const_expr(has_lora):
                    lora_st.advance()
                if is_leader:
                    acc_pipe.producer_commit(acc_st)
                acc_st.advance()
                t += num_clusters
            acc_pipe.producer_tail(acc_st)

        # ------------------------------------------------------------------ epilogue warps
        if warp < _MMA_WARP:
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            tCtAcc_base = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)

            t2r_atom = sm100_utils.get_tmem_load_op(L.cta_tile, LayoutEnum.ROW_MAJOR, self.c_dtype,
                                                     Float32, epi_tile, two)
            tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], epi_tile)
            t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
            thr_t2r = t2r.get_slice(tidx)
            tTR_tAcc_base = thr_t2r.partition_S(tAcc_epi)
            gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
            tTR_gC = thr_t2r.partition_D(gC_epi)
            tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, Float32)
            # the (row, col) coordinates of every accumulator element: for wcscale / bias
            cC = cute.make_identity_tensor(mC.shape)
            tCcC = thr_mma.partition_C(cute.local_tile(cC, cute.slice_(L.tiler, (None, None, 0)), (None, None, None)))
            tTR_cC_all = thr_t2r.partition_D(cute.flat_divide(tCcC[((None, None), 0, 0, None, None, None)], epi_tile))

            tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
            r2s_atom = sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, Float32, t2r)
            r2s = cute.make_tiled_copy_D(r2s_atom, t2r)
            thr_r2s = r2s.get_slice(tidx)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_rC = r2s.retile(tTR_rC)
            bSG_sC, bSG_gC_all = cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2))

            mWc = cute.make_tensor(p_wc, cute.make_layout((n,)))
            mBias = cute.make_tensor(p_bias, cute.make_layout((n,)))
            acc_st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
            c_pipe = pipeline.PipelineTmaStore.create(
                num_stages=_C_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(_EPI_WARPS)))
            done = Int32(0)  # subtiles stored so far by this CTA (picks the SMEM staging buffer)
            t = cluster_id
            while t < num_tiles:
                mt, nt = plan.tile_coord(t, tiles_m)
                bSG_gC = cute.group_modes(bSG_gC_all[(None, None, None, mt, nt, 0)], 1, 3)
                tTR_tAcc = cute.group_modes(tTR_tAcc_base[(None, None, None, None, None, acc_st.index)], 3, 5)
                tTR_cC = cute.group_modes(tTR_cC_all[(None, None, None, None, None, mt, nt, 0)], 3, 5)
                acc_pipe.consumer_wait(acc_st)
                nsub = cute.size(tTR_tAcc.shape, mode=[3])
                for sub in cutlass.range(nsub):
                    cute.copy(t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                    if cutlass.const_expr(self.cfg.wcscale or self.cfg.bias):
                        crd = tTR_cC[(None, None, None, sub)]
                        for i in cutlass.range_constexpr(cute.size(tTR_rAcc)):
                            col = crd[i][1]
                            x = tTR_rAcc[i]
                            if cutlass.const_expr(self.cfg.wcscale):
                                x = x * mWc[col]
                            if cutlass.const_expr(self.cfg.bias):
                                x = x + mBias[col]
                            tTR_rAcc[i] = x
                    tRS_rC.store(r2s.retile(tTR_rAcc).load().to(self.c_dtype))
                    buf = (done + sub) % _C_STAGES
                    cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.epi_sync.arrive_and_wait()
                    if warp == _EPI_WARPS[0]:
                        cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, sub)])
                        c_pipe.producer_commit()
                        c_pipe.producer_acquire()
                    self.epi_sync.arrive_and_wait()
                cute.arch.fence_view_async_tmem_load()
                acc_pipe.consumer_release(acc_st)
                acc_st.advance()
                done += nsub
                t += num_clusters
            tmem.relinquish_alloc_permit()
            self.epi_sync.arrive_and_wait()
            tmem.free(acc_ptr)
            c_pipe.producer_tail()

    def _s2t(self, sSF, tSF):
        """SMEM -> TMEM copy of the scale factors (tcgen05.cp 4x32x128b)."""
        s_compact = cute.filter_zeros(sSF)
        t_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.L.group), _SF)
        tiled = tcgen05.make_s2t_copy(atom, t_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(s_compact))
        return tiled, src, thr.partition_D(t_compact)


# ---------------------------------------------------------------------------
# Validity and budgets
# ---------------------------------------------------------------------------


def _shape_problem(cfg: _Cfg) -> Optional[str]:
    if cfg.tile_m != 128 * cfg.cta_group:
        return f"tile_m={cfg.tile_m} with cta_group={cfg.cta_group}: the MMA tile is {128 * cfg.cta_group} rows"
    return None


_BUDGET_CACHE: dict = {}


def _budget_of(cfg: _Cfg) -> dict:
    key = dataclasses.replace(cfg, ab_stages=2, wcscale=False, bias=False)
    if key not in _BUDGET_CACHE:
        _BUDGET_CACHE[key] = budget(dataclasses.asdict(key))
    return _BUDGET_CACHE[key]


def _problem(cfg: _Cfg) -> Optional[str]:
    reason = _shape_problem(cfg)
    if reason:
        return reason
    bud = _budget_of(cfg)
    reason = plan.tmem_problem(cfg.tile_n, bud["acc_stages"], bud["sfa_cols"], bud["sfb_cols"])
    if reason:
        return reason
    return plan.smem_problem(bud["smem"], cfg.ab_stages)


# ---------------------------------------------------------------------------
# Build-time API
# ---------------------------------------------------------------------------

_SECTION_KEYS = ("tiles", "ab_stages")


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.<arch>.gemm_w4a4`` -> knob dicts.

    ``tiles: [[cta_group, tile_m, tile_n], ...]`` (default ``[[2, 256, 128]]``),
    ``ab_stages: [auto | int, ...]`` (default ``[auto]``: the deepest that fits).
    """
    problems = [f"{k}: unknown key (allowed: {', '.join(_SECTION_KEYS)})" for k in sorted(set(section) - set(_SECTION_KEYS))]
    tiles = section.get("tiles", [[2, 256, 128]])
    stages = section.get("ab_stages", ["auto"])
    good_tiles: list = []
    if not isinstance(tiles, list) or not tiles:
        problems.append(f"tiles: {tiles!r}: expected a non-empty list of [cta_group, tile_m, tile_n]")
        tiles = []
    for i, t in enumerate(tiles):
        if not (isinstance(t, list) and len(t) == 3 and all(type(x) is int and x > 0 for x in t)):
            problems.append(f"tiles[{i}]: {t!r}: expected [cta_group, tile_m, tile_n], three positive integers")
        elif t in good_tiles:
            problems.append(f"tiles[{i}]: {t!r}: duplicate value")
        else:
            good_tiles.append(t)
    good_stages: list = []
    if not isinstance(stages, list) or not stages:
        problems.append(f"ab_stages: {stages!r}: expected a non-empty list of stage counts or 'auto'")
        stages = []
    for i, s in enumerate(stages):
        if not (s == "auto" or (type(s) is int and s >= 1)):
            problems.append(f"ab_stages[{i}]: {s!r}: expected a positive integer or 'auto'")
        elif s in good_stages:
            problems.append(f"ab_stages[{i}]: {s!r}: duplicate value")
        else:
            good_stages.append(s)
    out = [dict(cta_group=t[0], tile_m=t[1], tile_n=t[2], ab_stages=s) for t in good_tiles for s in good_stages]
    return out, problems


def resolve(arch: str, knobs: dict) -> dict:
    """``ab_stages: auto`` -> the deepest stage count the SMEM budget allows."""
    if knobs.get("ab_stages") != "auto":
        return dict(knobs)
    try:
        cfg = _cfg_of(dict(knobs, ab_stages=2))
    except (KeyError, TypeError, ValueError):   # invalid_reason names the bad knob
        return dict(knobs, ab_stages=2)
    if _shape_problem(cfg) or not all(knobs.get(k) in v for k, v in TUNING.items() if k != "ab_stages"):
        return dict(knobs, ab_stages=2)
    best = _budget_of(cfg)["max_ab_stages"]
    return dict(knobs, ab_stages=max(best, 2))   # < 2 fit: invalid_reason then rejects 2 with the numbers


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
    """What the op's shape rule reads: N % tile_n and K % 256 (one main k-block); M is arbitrary."""
    return {"n_multiple": int(knobs["tile_n"]), "k_multiple": plan.MAIN_K_BLOCK}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile one variant for `arch` (no GPU needed); kernel symbol ``<name>_0``."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    cfg = _cfg_of(knobs)
    gemm = _Sm100W4A4(cfg)
    from svdq_loader.ops import GEMM_W4A4
    return compile_kernel(_Sm100W4A4, gemm, GEMM_W4A4, dict(act=_AB, ascales=_SF, wgt=_AB, wscales=_SF,
                                                            wcscale=Float32, bias=Float32),
                          _OUT_DTYPES[cfg.out_dtype], name, arch, dump_dir,
                          lambda g: g.shared_storage.size_in_bytes(), keep_ptx=keep_ptx)
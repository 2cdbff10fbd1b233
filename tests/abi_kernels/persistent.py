"""Persistent tile scheduler: grid from the problem and a *runtime* max number
of active clusters (min, divisions), scheduler parameters passed to the
kernel, a 1x2 cluster and dynamic shared memory computed from k (the DSL
prints a warning when it exceeds the arch limit)."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

TILE_M, TILE_N = 128, 64
CLUSTER = (1, 2, 1)


@cute.kernel
def abi_persistent_kernel(mC: cute.Tensor, sched: utils.PersistentTileSchedulerParams, k: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, bidz = cute.arch.block_idx()
    if tidx == 0:
        if bidz == 0:
            mC[bidx, bidy] = cutlass.Float16(k)


@cute.jit
def host(c: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, max_clusters: cutlass.Int32,
         swizzle_smem: cutlass.Int32, stream: cuda.CUstream):
    mC = cute.make_tensor(c, cute.make_layout((m, n), stride=(n, 1)))
    ntile = ((m + TILE_M - 1) // TILE_M, (n + TILE_N - 1) // TILE_N, 1)
    sched = utils.PersistentTileSchedulerParams(ntile, CLUSTER, 1, True)
    grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_clusters)
    abi_persistent_kernel(mC, sched, k).launch(
        grid=grid, block=[128, 1, 1], cluster=CLUSTER, smem=k * 2 + swizzle_smem, stream=stream
    )


def compile(dump_dir: str, arch: str = "sm_90a"):
    from cutlass.cute.runtime import make_ptr

    c = make_ptr(cutlass.Float16, 16, cute.AddressSpace.gmem, assumed_align=16)
    return cute.compile(
        host, c, cutlass.Int32(256), cutlass.Int32(256), cutlass.Int32(64), cutlass.Int32(132),
        cutlass.Int32(0), cuda.CUstream(0),
        options=f"--gpu-arch {arch} --keep-cubin --dump-dir {dump_dir}",
    )


HOST_ARGS = (("c", "ptr"), ("m", "i32"), ("n", "i32"), ("k", "i32"), ("max_clusters", "i32"),
             ("extra_smem", "i32"), ("stream", "stream"))

"""Pointers + i32 scalars; grid ceil-divides the dynamic m (and n)."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

TILE_M = 128


@cute.kernel
def abi_simple_kernel(mA: cute.Tensor, mC: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, scale: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    i = bidx * TILE_M + tidx
    if i < m:
        if bidy < n:
            mC[i] = (mA[i] * scale).to(cutlass.Float16)


@cute.jit
def host(a: cute.Pointer, c: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32, stream: cuda.CUstream):
    mA = cute.make_tensor(a, cute.make_layout((m,)))
    mC = cute.make_tensor(c, cute.make_layout((m,)))
    abi_simple_kernel(mA, mC, m, n, m * 3 - n).launch(
        grid=[(m + TILE_M - 1) // TILE_M, (n + 7) // 8, 1], block=[TILE_M, 1, 1], stream=stream
    )


def compile(dump_dir: str, arch: str = "sm_90a"):
    from cutlass.cute.runtime import make_ptr

    a = make_ptr(cutlass.Int32, 16, cute.AddressSpace.gmem, assumed_align=16)
    c = make_ptr(cutlass.Float16, 16, cute.AddressSpace.gmem, assumed_align=16)
    return cute.compile(
        host, a, c, cutlass.Int32(5), cutlass.Int32(3), cuda.CUstream(0),
        options=f"--gpu-arch {arch} --keep-cubin --dump-dir {dump_dir}",
    )


# host argument kinds, for the tests: (name, kind)
HOST_ARGS = (("a", "ptr"), ("c", "ptr"), ("m", "i32"), ("n", "i32"), ("stream", "stream"))

"""TMA descriptors (G2S, G2S multicast, S2G), a FastDivmod divisor, a 2x1
cluster and dynamic shared memory: a host function with real work in it."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync

TILE = (128, 128, 64)
SMEM_BYTES = 65536 + 1024


@cute.kernel
def abi_tma_kernel(
    atom_a: cute.CopyAtom,
    tA: cute.Tensor,
    atom_b: cute.CopyAtom,
    tB: cute.Tensor,
    atom_c: cute.CopyAtom,
    tC: cute.Tensor,
    div_m: cute.FastDivmodDivisorV2,
    n: cutlass.Int32,
):
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp == 0:
        cpasync.prefetch_descriptor(atom_a)
        cpasync.prefetch_descriptor(atom_b)
        cpasync.prefetch_descriptor(atom_c)


@cute.jit
def host(
    a: cute.Pointer,
    b: cute.Pointer,
    c: cute.Pointer,
    m: cutlass.Int32,
    n: cutlass.Int32,
    k: cutlass.Int32,
    stream: cuda.CUstream,
):
    mA = cute.make_tensor(a, cute.make_layout((m, k, 1), stride=(k, 1, m * k)))
    mB = cute.make_tensor(b, cute.make_layout((n, k, 1), stride=(k, 1, n * k)))
    mC = cute.make_tensor(c, cute.make_layout((m, n, 1), stride=(n, 1, m * n)))
    sa = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, TILE, cutlass.Float16, 2)
    sb = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, TILE, cutlass.Float16, 2)
    atom_a, tA = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(sa, (None, None, 0)), (TILE[0], TILE[2])
    )
    atom_b, tB = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SMulticastOp(), mB, cute.slice_(sb, (None, None, 0)), (TILE[1], TILE[2]),
        num_multicast=2,
    )
    atom_c, tC = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileS2GOp(), mC, cute.make_layout((64, 32), stride=(32, 1)), (64, 32)
    )
    tiles_m = (m + TILE[0] - 1) // TILE[0]
    div_m = cute.fast_divmod_create_divisor_v2(tiles_m)
    abi_tma_kernel(atom_a, tA, atom_b, tB, atom_c, tC, div_m, n).launch(
        grid=[tiles_m * 2, (n + TILE[1] - 1) // TILE[1], 1],
        block=[256, 1, 1],
        cluster=(2, 1, 1),
        smem=SMEM_BYTES,
        stream=stream,
    )


def compile(dump_dir: str, arch: str = "sm_90a"):
    from cutlass.cute.runtime import make_ptr

    ptrs = [make_ptr(cutlass.Float16, 16, cute.AddressSpace.gmem, assumed_align=16) for _ in range(3)]
    return cute.compile(
        host, *ptrs, cutlass.Int32(256), cutlass.Int32(256), cutlass.Int32(256), cuda.CUstream(0),
        options=f"--gpu-arch {arch} --keep-cubin --dump-dir {dump_dir}",
    )


HOST_ARGS = (("a", "ptr"), ("b", "ptr"), ("c", "ptr"), ("m", "i32"), ("n", "i32"), ("k", "i32"), ("stream", "stream"))

"""cubin parsing: parameter info from real cubins, clean errors on garbage."""

from __future__ import annotations

import os
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_kernels  # noqa: E402

abi_kernels.ensure_packages()

from svdq_loader.cubin_info import (  # noqa: E402
    CubinFormatError,
    cubin_info,
    kernel_names,
    kernel_params,
    pack_params,
    param_sizes,
)


@pytest.fixture(scope="module", params=("simple", "tma", "persistent"))
def built(request):
    pytest.importorskip("cutlass")
    import abi_oracle as O

    return O.build(request.param)


def test_params_match_what_the_interpreter_packs(built):
    params = kernel_params(built.cubin)
    assert set(params) == set(built.program.kernels)
    (kernel,) = params
    ps = params[kernel]
    assert [i for i, _, _ in ps] == list(range(len(ps)))
    # Without param_sizes the interpreter takes each parameter's size from the
    # host allocation it points into: it must agree with the cubin.
    n_ptr = sum(1 for k in built.kinds if k in ("ptr", "stream"))
    args = []
    sc = iter([100, 200, 300, 10, 0])
    for k in built.kinds:
        args.append((1 << 36) if k == "ptr" else 0x77 if k == "stream" else next(sc))
    assert n_ptr >= 2
    free = built.program.launch(args)
    exact = built.program.launch(args, param_sizes(built.cubin))
    assert [len(p) for p in free.params] == [s for _, _, s in ps]
    assert free == exact
    # offsets: increasing, non-overlapping, inside the parameter space
    info = cubin_info(built.cubin).kernels[kernel]
    end = 0
    for _, off, size in ps:
        assert off >= end
        end = off + size
    assert info.param_space_size == end
    assert info.param_cbank_offset is not None and info.param_cbank_offset > 0
    # 128-byte TMA descriptors are 64-byte aligned in constant bank 0
    for _, off, size in ps:
        if size == 128:
            assert (info.param_cbank_offset + off) % 64 == 0
    # the cubin's param buffer layout round-trips
    buf = pack_params(ps, exact.params, info.param_space_size)
    assert len(buf) == info.param_space_size
    for (_, off, size), p in zip(ps, exact.params):
        assert bytes(buf[off:off + size]) == p


def test_kernel_resources(built):
    info = cubin_info(built.cubin)
    assert info.sm == 90
    (k,) = info.kernels.values()
    assert k.static_smem == 0
    assert k.regcount is not None and 0 < k.regcount <= 255
    assert k.reqntid is not None and k.reqntid[0] in (128, 256)
    assert kernel_names(built.cubin) == [k.name]


def _elf_header(**over) -> bytearray:
    h = bytearray(64)
    h[:4] = b"\x7fELF"
    h[4], h[5], h[6], h[7], h[8] = 2, 1, 1, 0x33, 7
    struct.pack_into("<HHIQQQIHHHHHH", h, 16, 2, over.get("machine", 190), 1, 0, 0, over.get("shoff", 64), 0x5A0D5A,
                     64, 56, 0, 64, over.get("shnum", 3), over.get("shstrndx", 1))
    return h


@pytest.mark.parametrize(
    "data,match",
    [
        (b"", "too short"),
        (b"hello world" * 10, "bad ELF magic"),
        (b"\x7fELF" + b"\x01" + bytes(80), "64-bit"),
        (bytes(_elf_header(machine=62)), "EM_CUDA"),
        (bytes(_elf_header()), "truncated"),
    ],
)
def test_garbage_raises_cubin_format_error(data, match):
    with pytest.raises(CubinFormatError, match=match):
        kernel_params(data)


def test_truncated_real_cubin_raises(built):
    cub = built.cubin
    for cut in (10, 63, 64, len(cub) // 2, len(cub) - 1):
        with pytest.raises(CubinFormatError):
            kernel_params(cub[:cut])
    with pytest.raises(CubinFormatError):
        kernel_params("not bytes")  # type: ignore[arg-type]


def test_corrupted_nv_info_raises(built):
    cub = bytearray(built.cubin)
    info = cubin_info(bytes(cub))
    (name,) = info.kernels
    # find the .nv.info.<kernel> section and break its first record's format byte
    shoff = struct.unpack_from("<Q", cub, 0x28)[0]
    shnum, shstrndx = struct.unpack_from("<HH", cub, 0x3C)
    strtab_off = struct.unpack_from("<Q", cub, shoff + shstrndx * 64 + 24)[0]
    for i in range(shnum):
        name_off, _t, _f, _a, off, size = struct.unpack_from("<IIQQQQ", cub, shoff + i * 64)
        end = cub.index(b"\x00", strtab_off + name_off)
        if cub[strtab_off + name_off:end].decode() == ".nv.info." + name:
            cub[off] = 0x7E
            break
    else:
        pytest.fail("no .nv.info section found")
    with pytest.raises(CubinFormatError, match="unknown .nv.info record format"):
        kernel_params(bytes(cub))

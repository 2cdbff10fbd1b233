"""The launch ABI, bit-exact against the DSL's own compiled host code.

For small CuTe-DSL kernels (``tests/abi_kernels``) compiled for sm_90a on
this CPU-only machine, the serialised host program interpreted by
``svdq_loader.hostvm`` must produce exactly the launch that the DSL's own
lowered host code makes when JIT-compiled and run on the CPU against a
recording stub of the CUDA runtime (``abi_oracle``): kernel, grid, block,
dynamic SMEM, stream, launch attributes and every defined kernel-parameter
byte (bytes the DSL code never writes are stack garbage there and are
excluded, see ``abi_oracle.defined_mask``).
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

pytest.importorskip("cutlass")  # build-time tests: need the DSL (no GPU)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_oracle as O  # noqa: E402

from svdq_aot.host_ir import HostIRError, serialize_module  # noqa: E402
from svdq_loader.hostvm import HostProgram, HostVMError  # noqa: E402
from svdq_loader.launch_plan import CachedLaunch, LaunchPlanCache  # noqa: E402

KERNELS = ("simple", "tma", "persistent")
N_RANDOM = 20


def _scalars(name: str, rng: random.Random) -> list[int]:
    if name == "simple":  # m, n
        return [rng.choice([1, 127, 128, 129, rng.randrange(1, 1 << 20)]), rng.randrange(1, 5000)]
    if name == "tma":  # m, n, k
        return [rng.choice([1, 128, rng.randrange(1, 9000)]), rng.randrange(1, 9000), 8 * rng.randrange(1, 1200)]
    if name == "persistent":  # m, n, k, max_clusters, extra smem
        return [rng.randrange(1, 20000), rng.randrange(1, 20000), rng.randrange(1, 100000), rng.randrange(1, 200),
                rng.choice([0, 0, rng.randrange(0, 300000)])]
    raise AssertionError(name)


def _ptr(rng: random.Random) -> int:
    return rng.randrange(1 << 32, 1 << 47) & ~15


def _args(b: O.Built, rng: random.Random, scal=None, *, zeros=False, unaligned=False) -> list:
    sc = iter(scal if scal is not None else _scalars(b.name, rng))
    out = []
    for kind in b.kinds:
        if kind == "ptr":
            p = _ptr(rng)
            if zeros and rng.random() < 0.3:
                p = 0
            elif unaligned and rng.random() < 0.3:
                p |= rng.randrange(1, 16)
            out.append(p)
        elif kind == "stream":
            out.append(rng.choice([0, 2, rng.randrange(1 << 20, 1 << 47)]))
        else:
            out.append(next(sc))
    return out


@pytest.fixture(scope="module", params=KERNELS)
def built(request) -> O.Built:
    return O.build(request.param)


def test_serialised_program_shape(built):
    doc = built.doc
    text = json.dumps(doc)
    assert doc["format"] == "svdq-host-ir" and doc["format_version"] == 1
    assert "kernels_binary" not in text  # the fatbin is never serialised
    assert len(text) < 200_000
    assert doc["entry"] == built.compiled.function_name
    assert set(doc["kernels"]) == set(built.sizes)  # the kernels the host code can launch are in the cubin
    want = {"ptr": "ptr<1>", "stream": "ptr", "i32": "i32"}
    assert built.program.arg_kinds == [want[k] for k in built.kinds]


def test_launch_bytes_match_dsl_host_code(built):
    rng = random.Random(1234 + KERNELS.index(built.name))
    prog = built.program
    for _ in range(N_RANDOM):
        args = _args(built, rng)
        vm = prog.launch(args, built.sizes)
        dsl = O.dsl_oracle_launch(built.compiled, args, built.sizes)
        amask, pmask = O.defined_mask(prog, args, built.sizes)
        diffs = O.compare_records(vm, dsl, amask, pmask)
        assert not diffs, f"{built.name} args={args}: " + "; ".join(diffs)
        assert vm.stream == args[-1]
        # everything that matters is defined: ids, grid etc. are compared outright;
        # at most padding/unused bytes may be undefined
        for (aid, _), m in zip(vm.attrs, amask):
            assert all(m[:4]), (aid, m)  # every attribute value starts with a written int
            if aid == 4:
                assert all(m[:12])  # cluster dims
        for p, m in zip(vm.params, pmask):
            if len(p) == 128:  # TMA descriptor: the DSL writes the first 64 bytes
                assert all(m[:64]), "TMA descriptor bytes left undefined"
            else:
                assert sum(m) >= len(p) - 4


def test_launch_attributes(built):
    rng = random.Random(7)
    rec = built.program.launch(_args(built, rng), built.sizes)
    ids = [a for a, _ in rec.attrs]
    assert 2 in ids and 6 in ids  # cooperative = 0, programmatic stream serialisation = 0
    if built.name == "tma":
        assert rec.cluster == (2, 1, 1)
        assert rec.smem == built.module.SMEM_BYTES
    if built.name == "persistent":
        assert rec.cluster == (1, 2, 1)
    if built.name == "simple":
        assert rec.cluster is None


def test_grid_ceil_divides_dynamic_m():
    b = O.build("simple")
    for m in (1, 127, 128, 129, 1000, 1 << 20):
        rec = b.program.launch([16, 32, m, 9, 0], b.sizes)
        assert rec.grid == (-(-m // 128), 2, 1)
        assert rec.block == (128, 1, 1)
        # params: tensor A {ptr, m}, tensor C {ptr, m}, m, n, m*3-n
        assert rec.params[0][:8] == (16).to_bytes(8, "little") and rec.params[0][8:12] == m.to_bytes(4, "little")
        assert rec.params[4] == ((m * 3 - 9) & 0xFFFFFFFF).to_bytes(4, "little")


def test_smem_warning_is_reported_like_the_dsl():
    b = O.build("persistent")
    args = [1 << 32, 1000, 1000, 64, 132, 240000, 0]
    rec = b.program.launch(args, b.sizes)
    assert "launch shared memory exceeds" in rec.printf
    dsl = O.dsl_oracle_launch(b.compiled, args, b.sizes)  # prints, does not trap
    amask, pmask = O.defined_mask(b.program, args, b.sizes)
    assert not O.compare_records(rec, dsl, amask, pmask)
    assert rec.smem == 240000 + 128


def test_load_plan_matches_dsl(built):
    rng = random.Random(99)
    for dev in (0, 1, 3):
        optin = rng.randrange(100_000, 232_449)
        static = {k: rng.randrange(0, 5000) for k in built.sizes}
        calls = []

        def device_attr(attr, d, _o=optin):
            calls.append(("dev", attr, d))
            return _o if attr == 97 else 0

        def kernel_attr(name, attr, d):
            calls.append(("k", name, attr, d))
            return static[name] if attr == 1 else 0

        vm = built.program.load_plan(device_attr, kernel_attr, dev)
        vm_calls = list(calls)
        calls.clear()
        dsl = O.dsl_oracle_load_plan(built.compiled, device_attr, kernel_attr, dev)
        assert vm == dsl
        assert vm_calls == calls
        (k,) = built.sizes
        assert (k, 8, optin - static[k]) in vm  # max dynamic smem = opt-in limit - static smem
        assert (k, 14, 1) in vm  # non-portable cluster sizes allowed


def test_launch_plan_cache_patches_exactly(built):
    rng = random.Random(55)
    cache = LaunchPlanCache(built.program, built.ptr_idx, built.sizes)
    shapes = [_scalars(built.name, rng) for _ in range(3)]
    for i in range(120):
        args = _args(built, rng, rng.choice(shapes), zeros=i % 3 == 0, unaligned=i % 5 == 0)
        got = cache.get(args)
        rec = got.record() if isinstance(got, CachedLaunch) else got
        want = built.program.launch(args, built.sizes)
        assert rec == want, (built.name, args)
    st = cache.stats()
    assert st["hits"] > 40 and st["unpatchable"] == 0, st


def test_launch_plan_cache_against_dsl(built):
    rng = random.Random(77)
    cache = LaunchPlanCache(built.program, built.ptr_idx, built.sizes)
    scal = _scalars(built.name, rng)
    for i in range(8):
        args = _args(built, rng, scal, zeros=i >= 4)
        got = cache.get(args)
        rec = got.record() if isinstance(got, CachedLaunch) else got
        dsl = O.dsl_oracle_launch(built.compiled, args, built.sizes)
        amask, pmask = O.defined_mask(built.program, args, built.sizes)
        assert not O.compare_records(rec, dsl, amask, pmask), args


def test_tma_pointers_are_alignment_sensitive_in_the_cache():
    b = O.build("tma")
    cache = LaunchPlanCache(b.program, b.ptr_idx, b.sizes)
    args = [1 << 36, 2 << 36, 3 << 36, 1000, 2000, 512, 0x1234]
    e = cache.entry_for(args)
    assert isinstance(e, CachedLaunch)
    assert len(e.slots) == 3 and e.stream_pos == 3
    # descriptors store addr>>4<<4: an unaligned pointer must not be patched in
    odd = list(args)
    odd[1] += 8
    assert cache.get(odd).__class__ is not CachedLaunch
    assert cache.get(odd) == b.program.launch(odd, b.sizes)


# ---------------------------------------------------------------------------
# op coverage: hand-written LLVM dialect vs the MLIR ExecutionEngine
# ---------------------------------------------------------------------------

ZOO = {"arith32": (("i32", "i32"), "i64"), "div": (("i64", "i32"), "i64"), "cmp": (("i16", "i16"), "i32"),
       "mem": (("i64", "i32", "i8"), "i64"), "flow": (("i32", "i32"), "i32"),
       "fbits": (("i32", "i32"), "i64")}


def test_ops_zoo_matches_llvm():
    import ctypes

    from cutlass._mlir import ir
    from cutlass._mlir.execution_engine import ExecutionEngine

    text = open(os.path.join(os.path.dirname(__file__), "abi_kernels", "ops_zoo.mlir")).read()
    with ir.Context():
        doc = serialize_module(ir.Module.parse(text), "flow", also=list(ZOO))
        engine = ExecutionEngine(ir.Module.parse(text), opt_level=2, shared_libs=[])
    prog = HostProgram.from_dict(json.loads(json.dumps(doc)))
    ct = {"i8": ctypes.c_uint8, "i16": ctypes.c_uint16, "i32": ctypes.c_uint32, "i64": ctypes.c_uint64}

    def jit(name, args):
        ats, rt = ZOO[name]
        store = [ct[t](v) for t, v in zip(ats, args)] + [ct[rt](0)]
        arr = (ctypes.c_void_p * len(store))(*[ctypes.addressof(v) for v in store])
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(engine.raw_lookup(name))(arr)
        return store[-1].value

    rng = random.Random(2024)

    def val(t):
        w = int(t[1:])
        return rng.choice([0, 1, (1 << w) - 1, 1 << (w - 1), rng.randrange(1 << w), rng.randrange(100)])

    n = 0
    for name, (ats, _) in ZOO.items():
        for _ in range(200):
            args = [val(t) for t in ats]
            if name == "div" and (args[0] == 0 or args[1] == 0 or (args[0] & 0xFFFFFFFF == 1 << 31 and args[1] == 0xFFFFFFFF)):
                continue
            if name == "flow":
                args = [rng.randrange(0, 40), rng.choice([0, 1, 3, 7])]
            assert prog.call(name, args) == jit(name, args), (name, args)
            n += 1
    assert n > 800


# ---------------------------------------------------------------------------
# unsupported constructs fail the build, naming op and function
# ---------------------------------------------------------------------------

_BAD = """
module {
  llvm.func @cuTensorMapEncodeTiled(!llvm.ptr) -> i32
  llvm.mlir.global internal constant @kernels_binary("\\7FELF") {addr_space = 0 : i32} : !llvm.array<4 x i8>
  llvm.func @cuda_load_to_device(%arg0: !llvm.ptr, %arg1: i32) -> i32 {
    %0 = llvm.mlir.constant(0 : i32) : i32
    llvm.return %0 : i32
  }
  llvm.func @host_float(%a: f32) -> i32 {
    %0 = llvm.fadd %a, %a : f32
    %1 = llvm.mlir.constant(0 : i32) : i32
    llvm.return %1 : i32
  }
  llvm.func @host_ext(%a: !llvm.ptr) -> i32 {
    %0 = llvm.call @cuTensorMapEncodeTiled(%a) : (!llvm.ptr) -> i32
    llvm.return %0 : i32
  }
  llvm.func @host_fatbin() -> i32 {
    %0 = llvm.mlir.addressof @kernels_binary : !llvm.ptr
    %1 = llvm.mlir.constant(0 : i32) : i32
    llvm.return %1 : i32
  }
  llvm.func @host_vec(%a: vector<4xi32>) -> i32 {
    %1 = llvm.mlir.constant(0 : i32) : i32
    llvm.return %1 : i32
  }
}
"""


@pytest.mark.parametrize(
    "entry,match",
    [
        ("host_float", r"unsupported op 'llvm.fadd' in function @host_float"),
        ("host_ext", r"unsupported external function @cuTensorMapEncodeTiled in function @host_ext"),
        ("host_fatbin", r"kernels_binary.*in function @host_fatbin"),
        ("host_vec", r"unsupported type .*vector"),
    ],
)
def test_unsupported_constructs_fail_the_build(entry, match):
    from cutlass._mlir import ir

    with ir.Context():
        module = ir.Module.parse(_BAD)
        with pytest.raises(HostIRError, match=match):
            serialize_module(module, entry)


def test_vm_refuses_wrong_arg_count():
    b = O.build("simple")
    with pytest.raises(HostVMError, match="takes 5 arguments"):
        b.program.launch([1, 2, 3])


# ---------------------------------------------------------------------------
# the project's own sm_90a GEMM kernel (its family, compiled like the builder does)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, tile_m, wsets", [("coop", 128, 2), ("ws", 128, 2), ("ws_splitk4", 128, 2),
                                                     ("ws_splitk4", 64, 4)])
def test_project_sm90_gemm_kernel_matches_dsl(tmp_path, schedule, tile_m, wsets):
    from svdq_aot.host_ir import serialize_host
    from svdq_kernels import registry
    from svdq_loader.cubin_info import param_sizes
    from svdq_loader.ops import GEMM_W4A4

    fam = registry.family("gemm_w4a4", "sm_90a")
    knobs = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical",
                 tile_m=tile_m, tile_n=128, tile_k=64, stages=4, prefetch=1,
                 skip_pad=False, act_decode="shift", schedule=schedule, wsets=wsets, act_source="nvfp4")
    assert fam.invalid_reason("sm_90a", knobs) is None
    name = GEMM_W4A4.name_for("sm_90a", knobs, fam.requirements("sm_90a", knobs))
    ck = fam.compile("sm_90a", knobs, name, str(tmp_path))

    sizes = param_sizes(ck.cubin)
    (sym,) = ck.kernel_symbols
    assert set(sizes) == {sym}
    # 12 kernel parameters: 9 pointers, then m, n, k (sm_count is not passed on)
    assert sizes[sym] == [8] * 9 + [4] * 3
    prog = HostProgram.from_dict(json.loads(json.dumps(serialize_host(ck.compiled))))
    # the host function takes the op's host arguments, in order: 9 pointers, m, n, k, sm_count, stream
    want = {"ptr": "ptr<1>", "stream": "ptr", "i32": "i32"}
    assert prog.arg_kinds == [want[k] for _, k in GEMM_W4A4.host_args]
    assert len(prog.arg_kinds) == 14
    nptr = sum(1 for _, k in GEMM_W4A4.host_args if k == "ptr")
    assert nptr == 9
    rng = random.Random(5)
    for _ in range(10):
        m, n, k = rng.randrange(1, 9000), 128 * rng.randrange(1, 100), 64 * rng.randrange(1, 100)
        sm_count = rng.choice([1, 78, 132, rng.randrange(1, 1 << 16)])
        ptrs = [_ptr(rng) for _ in range(nptr)]
        args = ptrs + [m, n, k, sm_count, rng.randrange(0, 1 << 47)]
        vm = prog.launch(args, sizes)
        dsl = O.dsl_oracle_launch(ck.compiled, args, sizes)
        amask, pmask = O.defined_mask(prog, args, sizes)
        assert not O.compare_records(vm, dsl, amask, pmask)
        # the documented launch: a persistent grid of min(tiles, sm_count) CTAs, 256 threads (ws: 384), the
        # planned SMEM
        assert vm.kernel == sym
        tiles = -(-m // tile_m) * (n // 128)
        if schedule == "ws_splitk4":        # one tile per cluster of 4 CTAs, not persistent
            assert vm.grid == (4 * tiles, 1, 1) and vm.cluster == (4, 1, 1)
        else:
            assert vm.grid == (min(tiles, sm_count), 1, 1)
        assert vm.block == ((256 if schedule == "coop" else 384), 1, 1) == (fam.threads_for(knobs), 1, 1)
        assert vm.smem == ck.smem_bytes == fam.smem_bytes_for(knobs)
        assert vm.stream == args[-1]
        if schedule != "ws_splitk4":
            assert vm.cluster is None
        assert not vm.printf
        # pointers and m, n, k passed straight through (sm_count is not a kernel parameter)
        assert vm.params[:9] == [p.to_bytes(8, "little") for p in ptrs]
        assert vm.params[9:] == [x.to_bytes(4, "little") for x in (m, n, k)]
    dev = lambda a, d: 232448 if a == 97 else 0  # noqa: E731
    kat = lambda k, a, d: 0  # noqa: E731
    assert prog.load_plan(dev, kat, 0) == O.dsl_oracle_load_plan(ck.compiled, dev, kat, 0)
    # sm_count caps the grid and nothing else: 3 x 2 tiles of 128 rows (5 x 2 of 64) -> 6 CTAs on a big GPU,
    # 1 on a one-SM one
    base = [_ptr(rng) for _ in range(nptr)] + [300, 256, 128]
    big, one = prog.launch(base + [132, 0], sizes), prog.launch(base + [1, 0], sizes)
    if schedule == "ws_splitk4":     # not persistent: the grid is 4 CTAs per tile, whatever the SM count
        assert big.grid == one.grid == (4 * 2 * -(-300 // tile_m), 1, 1) and big.params == one.params
    else:
        assert big.grid == (6, 1, 1) and one.grid == (1, 1, 1) and big.params == one.params


@pytest.mark.parametrize("op, k_split, gemm", [("gemm_w4a4_fp8", False, ("fp16", 16, 208, "regs", "ws")),
                                                ("gemm_w4a4_fp8", False, ("bf16", 32, 216, "lut", "ws")),
                                                ("gemm_w4a4_fp8", False, ("bf16", 32, 256, "staged", "ws_streamk")),
                                                ("act_fp8", False, None), ("act_fp8", True, None)])
def test_project_fp8_mode_kernels_match_dsl(tmp_path, monkeypatch, op, k_split, gemm):
    """The FP8-compute mode's GEMM (the 208-row register form, the 216-row lut one of configs/flux.yaml, and the
    256-row staged one under stream-K of configs/sm90_fp8_streamk.yaml) and its pre-pass (also with
    ``SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT=1``'s grid.y): the serialised host program launches exactly what the DSL's
    own host code launches (grid, block, SMEM, cluster, parameter bytes) for random shapes and pointers."""
    from svdq_aot.host_ir import serialize_host
    from svdq_kernels import registry
    from svdq_loader.cubin_info import param_sizes
    from svdq_loader.ops import op_spec
    from svdq_loader.ops.act_fp8 import ksplit
    from svdq_loader.ops.decode_act import image_rows

    fam, spec = registry.family(op, "sm_90a"), op_spec(op)
    if op == "act_fp8":
        import svdq_kernels.sm90_act_fp8 as kernel_module
        monkeypatch.setattr(kernel_module, "K_SPLIT", k_split)     # the switch, read at trace time
    if op == "act_fp8":
        knobs = dict(scale_layout="logical")
    else:
        dt, rank, tile_m, weights, schedule = gemm
        knobs = dict(out_dtype=dt, rank=rank, wcscale=True, bias=True, scale_layout="logical", tile_m=tile_m,
                     tile_n=128, tile_k=128, stages=4, **fam.FIXED,
                     **dict(fam.FORM_DEFAULTS, weights=weights, schedule=schedule))
    assert fam.invalid_reason("sm_90a", knobs) is None
    name = spec.name_for("sm_90a", knobs, fam.requirements("sm_90a", knobs))
    ck = fam.compile("sm_90a", knobs, name, str(tmp_path))
    sizes = param_sizes(ck.cubin)
    (sym,) = ck.kernel_symbols
    prog = HostProgram.from_dict(json.loads(json.dumps(serialize_host(ck.compiled))))
    want = {"ptr": "ptr<1>", "stream": "ptr", "i32": "i32"}
    assert prog.arg_kinds == [want[k] for _, k in spec.host_args]
    nptr = sum(1 for _, k in spec.host_args if k == "ptr")
    rng = random.Random(7)
    for i in range(10):
        m, n, k = rng.randrange(1, 9000), 128 * rng.randrange(1, 100), 256 * rng.randrange(1, 60)
        if i < 3:
            m = (1, 77, 1024)[i]                   # few row tiles: the K split's range
        ptrs = [_ptr(rng) for _ in range(nptr)]
        if op == "act_fp8":
            args = ptrs + [m, k, rng.randrange(0, 1 << 47)]
        else:
            args = ptrs + [m, n, k, rng.choice([1, 78, 132, rng.randrange(1, 1 << 16)]), rng.randrange(0, 1 << 47)]
        vm = prog.launch(args, sizes)
        dsl = O.dsl_oracle_launch(ck.compiled, args, sizes)
        amask, pmask = O.defined_mask(prog, args, sizes)
        assert not O.compare_records(vm, dsl, amask, pmask)
        assert vm.kernel == sym and vm.smem == ck.smem_bytes == fam.smem_bytes_for(knobs)
        if op == "act_fp8":
            splits = ksplit(m, k) if k_split else 1
            assert vm.grid == (image_rows(m) // 16, splits, 1) and vm.block == (128, 1, 1)
        else:
            tiles = -(-m // tile_m) * (n // 128)
            step = fam.requirements("sm_90a", knobs)["k_multiple"]          # k per unit: whole loop steps
            units = tiles * (k // step) if schedule == "ws_streamk" else tiles
            assert vm.grid == (min(units, args[-2]), 1, 1) and vm.block == (384, 1, 1)
        assert vm.params[:nptr] == [p.to_bytes(8, "little") for p in ptrs]

"""The FP8-compute mode's activation on the CPU: `E4m3Act`'s rules, the GEMM's call checks for it, and, on a real
build loaded with the recording driver (tests/fake_cuda.py), what ``quantize_act(..., compute="fp8")``,
``act_to_fp8`` and a GEMM from an E4m3Act launch, and that every misuse is refused before any launch."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from svdq_loader.errors import InvalidArgument, UnsupportedProblem  # noqa: E402
from svdq_loader.ops import act_fp8, decode_act, gemm_w4a4 as gemm_op  # noqa: E402
from svdq_loader.ops.act_fp8 import E4m3Act  # noqa: E402

U8, F8, BF = torch.uint8, torch.float8_e4m3fn, torch.bfloat16


def test_an_e4m3_activation_is_exactly_the_act_fp8_workspace():
    a = E4m3Act.empty(300, 512, "cpu")
    assert a.data.numel() == act_fp8.workspace_bytes(300, 512) == (4 + 512) * decode_act.image_rows(300)
    assert (a.m, a.k, a.device.type) == (300, 512, "cpu")
    with pytest.raises(InvalidArgument, match=r"has 100 bytes but an M=300, K=512 activation takes 264192 \(4 \+ K bytes per image row, 512 rows\)"):
        E4m3Act(torch.empty(100, dtype=U8), 300, 512)
    with pytest.raises(InvalidArgument, match=r"M >= 1 and K a multiple of 256"):
        E4m3Act(torch.empty(100, dtype=U8), 3, 384)
    with pytest.raises(InvalidArgument, match=r"contiguous 1-D uint8 tensor, got torch.float32"):
        E4m3Act(torch.empty(a.data.numel(), dtype=torch.float32), 300, 512)
    buf = torch.empty(a.data.numel() + 16, dtype=U8)
    with pytest.raises(InvalidArgument, match=r"is not 16-byte aligned"):
        E4m3Act(buf[1:1 + a.data.numel()], 300, 512)


@pytest.mark.parametrize("m, k, want", [(1, 256, 1), (77, 3072, 12), (300, 768, 3), (1024, 3072, 7),
                                         (1024, 12288, 7), (4608, 3072, 1), (4608, 15360, 1)])
def test_act_fp8_splits_k_where_its_row_tiles_are_few(m, k, want):
    """Small M: grid.y CTAs share each row tile's k-tile pairs, whole pairs each, every pair once; large M: none."""
    s = act_fp8.ksplit(m, k)
    assert s == want
    rows = decode_act.image_rows(m) // 16
    assert rows * s <= max(act_fp8.KSPLIT_TARGET_CTAS, rows)
    pairs = k // 256
    shares = [(pairs * z // s, pairs * (z + 1) // s) for z in range(s)]      # the kernel's ranges
    assert all(hi - lo >= 1 for lo, hi in shares)
    assert [p for lo, hi in shares for p in range(lo, hi)] == list(range(pairs))


def _fp8_weight(n=128, k=256, rank=0):
    g = torch.Generator().manual_seed(1)
    wgt = torch.randint(0, 256, (n, k // 2), dtype=U8, generator=g)
    sc = torch.randint(1, 0x7F, (n, k // 16), dtype=U8, generator=g).view(F8)
    lu = torch.randn(n, rank).to(BF) if rank else None
    return wgt, sc, lu


def test_the_gemm_takes_an_e4m3_activation_with_no_scales(monkeypatch):
    monkeypatch.setattr(gemm_op, "check_devices", lambda named: None)
    wgt, sc, lu = _fp8_weight(rank=16)
    w8 = gemm_op.prepare_weight(wgt, sc, lora_up=lu, arch="sm_90a", compute="fp8")
    a8 = E4m3Act.empty(5, 256, "cpu")
    la = torch.empty(5, 16, dtype=BF)
    call = gemm_op.plan_call("sm_90a", a8, w8, None, lora_act_in=la)
    assert (call.m, call.n, call.k) == (5, 128, 256)
    assert call.features == ("bf16", 16, True, False, "logical")
    # the GEMM reads the workspace through `act`; the FP8 kernel reads no activation scales
    assert call.pointers["act"] == call.pointers["ascales"] == a8.data_ptr()
    with pytest.raises(InvalidArgument, match=r"block scales are folded into it, so ascales must be None"):
        gemm_op.plan_call("sm_90a", a8, w8, torch.empty(5, 16, dtype=U8).view(F8), lora_act_in=la)
    ex = gemm_op.prepare_weight(wgt, sc, lora_up=lu, arch="sm_90a")
    with pytest.raises(InvalidArgument, match=r"weight was prepared for compute='exact'; prepare it with "
                                              r"compute='fp8'"):
        gemm_op.plan_call("sm_90a", a8, ex, None, lora_act_in=la)
    with pytest.raises(InvalidArgument, match=r"act has K = 512 but the weight has K = 256"):
        gemm_op.plan_call("sm_90a", E4m3Act.empty(5, 512, "cpu"), w8, None, lora_act_in=la)
    with pytest.raises(InvalidArgument, match=r"lora_act_in has shape \(4, 16\)"):
        gemm_op.plan_call("sm_90a", a8, w8, None, lora_act_in=torch.empty(4, 16, dtype=BF))


def test_the_images_launcher_gives_its_gemm_alone_with_its_extra_workspace():
    gemm = type("L", (), {"name": "g", "device": None})()
    names = gemm_op.SPEC.arg_names
    assert decode_act.ImagesLauncher(None, gemm, names).workspace_gemm() is gemm
    alone = decode_act.ImagesLauncher(None, gemm, names, extra=lambda *a: 0).workspace_gemm()
    assert isinstance(alone, decode_act.MeetingsLauncher) and alone.gemm is gemm and alone.name == "g"


#: the smallest build that serves the mode: one FP8 GEMM form, act_fp8 and quantize_act (JSON is YAML)
_CONFIG = dict(name="fp8_act_cpu", archs=["sm_90a"], out_dtypes=["bf16"], ranks=[0], wcscale=[True], bias=[True],
               shapes={"a": {"k": 256, "n": 128}},
               variants={"sm_90a": {"gemm_w4a4_fp8": {"tiles": [[128, 128, 128]]}, "act_fp8": {}, "quantize_act": {}}})


@pytest.fixture(scope="module")
def fp8_artifacts(tmp_path_factory):
    pytest.importorskip("cutlass")
    from svdq_aot.build import build
    d = tmp_path_factory.mktemp("fp8_act")
    (d / "c.yaml").write_text(json.dumps(_CONFIG))
    build(str(d / "c.yaml"), str(d / "art"), jobs=1)
    return d / "art"


@pytest.fixture
def fake(fp8_artifacts, monkeypatch):
    """(lib, recorder, launches): the build loaded on the recording driver; `launches` lists (variant, args) of
    every kernel launch; the allocations the calls make are data-less CUDA tensors."""
    import svdq_loader
    from fake_cuda import FakeCuda, fake_driver
    from svdq_loader import library
    from svdq_loader.ops import quantize_act as quant_op, sm90_fp8_weight_format
    rec = fake_driver(monkeypatch)
    monkeypatch.setattr(sm90_fp8_weight_format, "convert", lambda wgt, wscales, wcscale: (wgt, wscales, wcscale))

    class _Torch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(shape, dtype=None, device=None):
            return FakeCuda(shape if isinstance(shape, tuple) else (shape,), dtype, device or "cuda:0")
    monkeypatch.setattr(quant_op, "torch_module", lambda: _Torch())
    monkeypatch.setattr(E4m3Act, "empty", classmethod(
        lambda cls, m, k, device: cls(FakeCuda((act_fp8.workspace_bytes(m, k),), U8, device), m, k)))
    lib = svdq_loader.load(str(fp8_artifacts))
    launches = []
    real = library._launch_in_primary
    monkeypatch.setattr(library, "_launch_in_primary",
                        lambda ln, a: (launches.append((ln.name, list(a))), real(ln, a))[1])
    return lib, rec, launches


def _names(lib):
    return {v.op: v.name for v in lib.variants}


def test_quantize_act_fp8_runs_the_nvfp4_kernel_then_act_fp8_into_the_e4m3_activation(fake):
    from fake_cuda import FakeCuda
    lib, rec, launches = fake
    names = _names(lib)
    x = FakeCuda((300, 256), BF)
    a8, none, la = lib.quantize_act(x, compute="fp8")
    assert isinstance(a8, E4m3Act) and none is None and la is None and (a8.m, a8.k) == (300, 256)
    (q, qa), (p, pa) = launches
    assert q == names["quantize_act"] and p == names["act_fp8"]
    # act_fp8 reads what quantize_act wrote and writes the E4m3Act's workspace
    assert pa[:2] == [qa[3], qa[4]] and pa[2:5] == [a8.data_ptr(), 300, 256]
    assert len(rec.launches) == 2
    # into a given E4m3Act; the GEMM from it then launches alone, act = ascales = the workspace
    out = E4m3Act.empty(300, 256, "cuda:0")
    assert lib.quantize_act(x, compute="fp8", out_act=out)[0] is out
    assert launches[3][1][2] == out.data_ptr()
    w8 = lib.prepare_weight(FakeCuda((128, 128), U8), FakeCuda((128, 16), F8), wcscale=FakeCuda((128,), torch.float32),
                            bias=FakeCuda((128,), torch.float32), compute="fp8")
    y = FakeCuda((300, 128), BF)
    assert lib.gemm_w4a4(out, w8, None, out=y) is y
    g, ga = launches[4]
    assert g == names["gemm_w4a4_fp8"] and len(launches) == 5 and len(rec.launches) == 5
    i_act, i_asc = gemm_op.SPEC.arg_names.index("act"), gemm_op.SPEC.arg_names.index("ascales")
    assert ga[i_act] == ga[i_asc] == out.data_ptr()
    # act_to_fp8: the second half alone, from NVFP4 tensors
    act, asc = FakeCuda((300, 128), U8), FakeCuda((300, 16), F8)
    a8b = lib.act_to_fp8(act, asc)
    assert launches[5][0] == names["act_fp8"] and launches[5][1][:3] == [act.data_ptr(), asc.data_ptr(),
                                                                           a8b.data_ptr()]


def _refusals():
    from fake_cuda import FakeCuda as T
    return {
        "unknown mode": (lambda lib: lib.quantize_act(T((64, 256), BF), compute="int8"), InvalidArgument,
                         r"compute must be 'exact' or 'fp8', got 'int8'"),
        "scales asked for": (lambda lib: lib.quantize_act(T((64, 256), BF), compute="fp8",
                                                          out_scales=T((64, 16), F8)),
                             InvalidArgument, r"out_scales was given with compute='fp8'"),
        "out of another shape": (lambda lib: lib.quantize_act(T((64, 256), BF), compute="fp8",
                                                              out_act=E4m3Act.empty(65, 256, "cuda:0")),
                                 InvalidArgument, r"must be an E4m3Act of M=64, K=256 on device 0.*M=65, K=256"),
        "out not an E4m3Act": (lambda lib: lib.quantize_act(T((64, 256), BF), compute="fp8",
                                                            out_act=T((64, 128), U8)),
                               InvalidArgument, r"must be an E4m3Act .* got FakeCuda"),
        "K not a multiple of 256": (lambda lib: lib.quantize_act(T((64, 192), BF), compute="fp8"),
                                    UnsupportedProblem, r"K=192"),
        "bad x": (lambda lib: lib.quantize_act(T((64, 256), torch.float32), compute="fp8"), InvalidArgument,
                  r"x must have dtype"),
        "scales of another shape": (lambda lib: lib.act_to_fp8(T((64, 128), U8), T((64, 8), F8)), InvalidArgument,
                                    r"ascales has shape \(64, 8\)"),
        "E4m3Act with scales": (lambda lib: lib.gemm_w4a4(
            E4m3Act.empty(64, 256, "cuda:0"), _w8(lib), T((64, 16), F8)), InvalidArgument,
            r"ascales must be None"),
        "E4m3Act with an exact weight": (lambda lib: lib.gemm_w4a4(
            E4m3Act.empty(64, 256, "cuda:0"), _w8(lib, "exact"), None), InvalidArgument,
            r"prepared for compute='exact'"),
    }


def _w8(lib, compute="fp8"):
    from fake_cuda import FakeCuda as T
    return lib.prepare_weight(T((128, 128), U8), T((128, 16), F8), wcscale=T((128,), torch.float32),
                              bias=T((128,), torch.float32), compute=compute)


@pytest.mark.parametrize("case", sorted(_refusals()))
def test_misuse_is_refused_before_any_launch(fake, case):
    lib, rec, launches = fake
    call, exc, pattern = _refusals()[case]
    with pytest.raises(exc, match=pattern):
        call(lib)
    assert rec.launches == [] and launches == []


def test_artifacts_without_act_fp8_are_refused_with_the_reason(fake):
    from fake_cuda import FakeCuda
    lib, rec, launches = fake
    lib._verified = {k: v for k, v in lib._verified.items() if v.entry.op != "act_fp8"}
    with pytest.raises(UnsupportedProblem, match=r"needs an act_fp8 kernel, and .* has none for sm_90a"):
        lib.quantize_act(FakeCuda((64, 256), BF), compute="fp8")
    assert rec.launches == [] and launches == []

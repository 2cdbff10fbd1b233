"""Every bad input is refused before any launch, with the argument, the value and the rule (CPU, fake driver).

One real build of configs/tiny.yaml (gemm_w4a4 and quantize_act for sm_90a: bf16, R in {0, 32}, N % 128,
K % 64) and tensors with CUDA metadata but no storage (tests/fake_cuda.py).  Each case must raise its
typed error with its message and leave the recording driver with no kernel loaded and nothing launched;
the good calls next to them must launch, so the harness itself can fail.
"""
from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

import svdq_loader  # noqa: E402
from svdq_loader.driver import CudaError  # noqa: E402
from svdq_loader.errors import (DriverTooOld, InvalidArgument, ManifestError, UnsupportedProblem)  # noqa: E402
from svdq_loader.manifest import body_checksum  # noqa: E402
from svdq_loader.ops import GEMM_W4A4  # noqa: E402

from fake_cuda import FakeCuda, fake_driver  # noqa: E402

U8, F8, BF, FP = torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float16
M, N, K, R = 77, 256, 256, 32


def T(shape, dtype, device="cuda:0", **kw):
    return FakeCuda(shape, dtype, device, **kw)


def weight(lib, n=N, k=K, rank=R, lora_dtype=BF, device="cuda:0", **kw):
    return lib.prepare_weight(T((n, k // 2), U8, device), T((n, k // 16), F8, device),
                              lora_up=T((n, rank), lora_dtype, device) if rank else None,
                              wcscale=T((n,), torch.float32, device), bias=T((n,), torch.float32, device), **kw)


def gemm_args(m=M, k=K, rank=R, dtype=BF):
    return dict(act=T((m, k // 2), U8), ascales=T((m, k // 16), F8),
                lora_act_in=T((m, rank), dtype) if rank else None, out=T((m, N), dtype))


def gemm(lib, w=None, **over):
    a = dict(gemm_args(), **over)
    return lib.gemm_w4a4(a.pop("act"), w if w is not None else weight(lib), a.pop("ascales"), **a)


def quant_out(m=M, k=K, rank=R, layout=(None,), dtype=BF):
    sc = (m, k // 16) if layout == (None,) else layout
    return dict(out_act=T((m, k // 2), U8), out_scales=T(sc, F8), out_lora=T((m, rank), dtype) if rank else None)


def quant(lib, x=None, **over):
    kw = dict(quant_out(), lora_down=T((K, R), BF))
    kw.update(over)
    return lib.quantize_act(x if x is not None else T((M, K), BF), **kw)


# (case id) -> (call(lib), exception type, message regex)
GEMM_CASES = {
    "cpu act": (lambda lib: gemm(lib, act=torch.zeros(M, K // 2, dtype=U8)), InvalidArgument,
                r"tensors must be CUDA tensors, got one on cpu"),
    "cpu weight": (lambda lib: weight(lib, device="cpu"), InvalidArgument, r"wgt must be a CUDA tensor, got device cpu"),
    "act on another device": (lambda lib: gemm(lib, act=T((M, K // 2), U8, "cuda:1")), InvalidArgument,
                              r"wgt is on cuda:0 but act is on cuda:1: all tensors must be on one device"),
    "out on another device": (lambda lib: gemm(lib, out=T((M, N), BF, "cuda:1")), InvalidArgument,
                              r"out is on cuda:1 but act is on cuda:0"),
    "act dtype": (lambda lib: gemm(lib, act=T((M, K // 2), torch.int8)), InvalidArgument,
                  r"act must have dtype torch.uint8, got torch.int8"),
    "ascales dtype": (lambda lib: gemm(lib, ascales=T((M, K // 16), FP)), InvalidArgument,
                      r"ascales must have dtype torch.float8_e4m3fn, got torch.float16"),
    "lora_act_in dtype": (lambda lib: gemm(lib, lora_act_in=T((M, R), FP)), InvalidArgument,
                          r"lora_act_in must have dtype torch.bfloat16, got torch.float16"),
    "out dtype": (lambda lib: gemm(lib, out=T((M, N), torch.float32)), InvalidArgument,
                  r"out must have dtype torch.float16 or torch.bfloat16, got torch.float32"),
    "lora_up dtype vs out": (lambda lib: gemm(lib, out=T((M, N), FP)), InvalidArgument,
                             r"lora_up has dtype torch.bfloat16, must equal the output dtype torch.float16"),
    "act K vs weight K": (lambda lib: gemm(lib, act=T((M, 64), U8)), InvalidArgument,
                          r"act has K = 2\*64 = 128 but the weight has K = 256"),
    "ascales shape": (lambda lib: gemm(lib, ascales=T((M, 8), F8)), InvalidArgument,
                      r"ascales has shape \(77, 8\) but the sm_90a GEMM reads the logical scale layout, shape \(77, 16\)"),
    "lora_act_in shape": (lambda lib: gemm(lib, lora_act_in=T((M, 16), BF)), InvalidArgument,
                          r"lora_act_in has shape \(77, 16\), expected \(77, 32\)"),
    "out shape": (lambda lib: gemm(lib, out=T((M, N + 128), BF)), InvalidArgument,
                  r"out has shape \(77, 384\), expected \(77, 256\)"),
    "lora_act_in without lora_up": (lambda lib: gemm(lib, weight(lib, rank=0)), InvalidArgument,
                                    r"lora_act_in and lora_up must be given together \(got only lora_act_in\)"),
    "wscales shape": (lambda lib: lib.prepare_weight(T((N, K // 2), U8), T((N, 8), F8)), InvalidArgument,
                      r"wscales has shape \(256, 8\), expected \(256, 16\)"),
    "wcscale shape": (lambda lib: lib.prepare_weight(T((N, K // 2), U8), T((N, K // 16), F8),
                                                     wcscale=T((N + 1,), torch.float32)), InvalidArgument,
                      r"wcscale must have shape \(256,\), got \(257,\)"),
    "LoRA rank not a multiple of 16": (lambda lib: weight(lib, rank=20), InvalidArgument,
                                       r"LoRA rank R = lora_up.shape\[1\] = 20 must be a positive multiple of 16"),
    "non-contiguous act": (lambda lib: gemm(lib, act=T((M, K // 2), U8, strides=(1, M))), InvalidArgument,
                           r"act must be contiguous \(row-major\), got strides \(1, 77\)"),
    "misaligned act": (lambda lib: gemm(lib, act=T((M, K // 2), U8, ptr=0x7E00_0000_0008)), InvalidArgument,
                       r"act data pointer 0x7e0000000008 is not 16-byte aligned"),
    "not a tensor": (lambda lib: gemm(lib, ascales=[[0.0]]), InvalidArgument,
                     r"ascales must be a torch.Tensor, got list"),
    "K not a multiple of 16": (lambda lib: lib.prepare_weight(T((N, 20), U8), T((N, 2), F8)), InvalidArgument,
                               r"K = 2\*wgt.shape\[1\] = 40 must be a multiple of 16"),
    "M*N over 32 bits": (lambda lib: gemm(lib, act=T((1 << 23, K // 2), U8), ascales=T((1 << 23, K // 16), F8),
                                          lora_act_in=T((1 << 23, R), BF), out=None), InvalidArgument,
                         r"M times N output elements = 2147483648 must be below 2\^31"),
    "N divisibility": (lambda lib: gemm(lib, weight(lib, n=200), out=T((M, 200), BF)), UnsupportedProblem,
                       r"N=200 is not a multiple of 128"),
    "K divisibility": (lambda lib: gemm(lib, weight(lib, k=96), act=T((M, 48), U8), ascales=T((M, 6), F8)),
                       UnsupportedProblem, r"K=96 is not a multiple of 64"),
    "R not built": (lambda lib: gemm(lib, weight(lib, rank=16), lora_act_in=T((M, 16), BF)), UnsupportedProblem,
                    r"no sm_90a gemm_w4a4 kernel for out_dtype=bf16, rank=16, .*built: "),
    "dtype not built": (lambda lib: gemm(lib, weight(lib, lora_dtype=FP), lora_act_in=T((M, R), FP), out=T((M, N), FP)),
                        UnsupportedProblem, r"no sm_90a gemm_w4a4 kernel for out_dtype=fp16, rank=32"),
}

QUANT_CASES = {
    "cpu x": (lambda lib: quant(lib, torch.zeros(M, K, dtype=BF)), InvalidArgument,
              r"tensors must be CUDA tensors, got one on cpu"),
    "lora_down on another device": (lambda lib: quant(lib, lora_down=T((K, R), BF, "cuda:1")), InvalidArgument,
                                    r"lora_down is on cuda:1 but x is on cuda:0"),
    "x dtype": (lambda lib: quant(lib, T((M, K), torch.float32)), InvalidArgument,
                r"x must have dtype torch.float16 or torch.bfloat16, got torch.float32"),
    "smooth dtype": (lambda lib: quant(lib, smooth=T((K,), FP)), InvalidArgument,
                     r"smooth must have dtype torch.bfloat16, got torch.float16"),
    "smooth shape": (lambda lib: quant(lib, smooth=T((K + 16,), BF)), InvalidArgument,
                     r"smooth has shape \(272,\), expected \(256,\)"),
    "smooth and smooth_rcp": (lambda lib: quant(lib, smooth=T((K,), BF), smooth_rcp=T((K,), BF)), InvalidArgument,
                              r"smooth and smooth_rcp were both given: pass the smoothing factors"),
    "smooth_rcp dtype": (lambda lib: quant(lib, smooth_rcp=T((K,), FP)), InvalidArgument,
                         r"smooth_rcp must have dtype torch.bfloat16, got torch.float16"),
    "smooth_rcp shape": (lambda lib: quant(lib, smooth_rcp=T((K - 64,), BF)), InvalidArgument,
                         r"smooth_rcp has shape \(192,\), expected \(256,\)"),
    "lora_down shape": (lambda lib: quant(lib, lora_down=T((K - 64, R), BF)), InvalidArgument,
                        r"lora_down has shape \(192, 32\), expected \(256, \?\)"),
    "out_scales layout": (lambda lib: quant(lib, out_scales=T((1, 4, 32, 4, 4), F8)), InvalidArgument,
                          r"out_scales has shape \(1, 4, 32, 4, 4\) but on sm_90a quantize_act writes the logical"),
    "out_lora without lora_down": (lambda lib: quant(lib, lora_down=None), InvalidArgument,
                                   r"out_lora was given but lora_down was not"),
    "non-contiguous x": (lambda lib: quant(lib, T((M, K), BF, strides=(1, M))), InvalidArgument,
                         r"x must be contiguous"),
    "misaligned out_act": (lambda lib: quant(lib, out_act=T((M, K // 2), U8, ptr=0x7E00_0000_0004)), InvalidArgument,
                           r"out_act data pointer 0x7e0000000004 is not 16-byte aligned"),
    "K not a multiple of 16": (lambda lib: quant(lib, T((M, 100), BF)), InvalidArgument,
                               r"K = x.shape\[1\] = 100 must be a multiple of 16"),
    "K divisibility": (lambda lib: quant(lib, T((M, 96), BF), lora_down=T((96, R), BF), **quant_out(k=96)),
                       UnsupportedProblem, r"K=96 is not a multiple of 64"),
    "R not built": (lambda lib: quant(lib, lora_down=T((K, 16), BF), **quant_out(rank=16)), UnsupportedProblem,
                    r"no sm_90a quantize_act kernel for dtype=bf16, rank=16"),
    "dtype not built": (lambda lib: quant(lib, T((M, K), FP), lora_down=T((K, R), FP), **quant_out(dtype=FP)),
                        UnsupportedProblem, r"no sm_90a quantize_act kernel for dtype=fp16"),
}


@pytest.fixture
def lib(tiny_artifacts):
    return svdq_loader.load(tiny_artifacts)


def test_good_calls_launch(lib, monkeypatch):
    rec = fake_driver(monkeypatch)
    gemm(lib)
    quant(lib)
    assert len(rec.loads) == 2 and len(rec.launches) == 2


def test_a_call_without_wcscale_and_bias_runs_a_variant_built_with_them(lib, monkeypatch):
    """configs/tiny.yaml builds the GEMM with wcscale and bias only: a call without them is served by it, the
    call passing the identity vectors (ones, zeros) that prepare_weight holds, and selection says so."""
    from svdq_loader import library
    rec = fake_driver(monkeypatch)
    assert {(v.knobs["wcscale"], v.knobs["bias"]) for v in lib.variants if v.op == "gemm_w4a4"} == {(True, True)}
    args = []
    real = library._launch_in_primary
    monkeypatch.setattr(library, "_launch_in_primary", lambda ln, a: (args.append(list(a)), real(ln, a)))
    w = lib.prepare_weight(T((N, K // 2), U8), T((N, K // 16), F8), lora_up=T((N, R), BF))
    gemm(lib, w)
    assert len(rec.launches) == 1
    i_wcs, i_bias = GEMM_W4A4.arg_names.index("wcscale"), GEMM_W4A4.arg_names.index("bias")
    ones, zeros = w.fills
    assert ones.shape == zeros.shape == (N,) and ones.data_ptr() != zeros.data_ptr()
    assert (args[0][i_wcs], args[0][i_bias]) == (ones.data_ptr(), zeros.data_ptr())
    ex = lib.explain("gemm_w4a4", "sm_90a", m=M, n=N, k=K, rank=R, wcscale=False, bias=False)
    assert ex.served_features == ("bf16", R, True, True, "logical")
    assert ex.chosen.knobs["wcscale"] is True and ex.chosen.knobs["bias"] is True
    assert any("passing wcscale = 1.0, bias = 0.0 for every column" in w_ for w_ in ex.why), ex.why
    assert ex.to_dict()["served_features"]["wcscale"] is True
    # the call's own features, when built, come first (tested on the selection's CPU tests); with both on,
    # nothing is filled
    ex2 = lib.explain("gemm_w4a4", "sm_90a", m=M, n=N, k=K, rank=R)
    assert ex2.served_features == ex2.problem.features and not any("for every column" in w_ for w_ in ex2.why)


@pytest.mark.parametrize("case", sorted(GEMM_CASES) + sorted(QUANT_CASES))
def test_bad_input_is_refused_before_any_launch(lib, monkeypatch, case):
    call, exc, pattern = {**GEMM_CASES, **QUANT_CASES}[case]
    rec = fake_driver(monkeypatch)
    with pytest.raises(exc, match=pattern):
        call(lib)
    assert rec.launches == [] and rec.loads == []


def test_no_artifact_for_this_arch(lib, monkeypatch):
    rec = fake_driver(monkeypatch, arch="sm_120a")
    with pytest.raises(UnsupportedProblem, match=r"no quantize_act kernel built for this device's arch sm_120a; "
                                                 r"the artifacts hold quantize_act for \['sm_90a'\]"):
        quant(lib, **quant_out(layout=(1, 4, 32, 4, 4)))
    assert rec.launches == [] and rec.loads == []


def test_op_not_built(lib, monkeypatch):
    rec = fake_driver(monkeypatch)
    lib._verified = {k: v for k, v in lib._verified.items() if v.entry.op == "gemm_w4a4"}
    with pytest.raises(UnsupportedProblem, match=r"the artifacts hold no quantize_act kernels; rebuild with "
                                                 r"quantize_act in the config"):
        quant(lib)
    assert rec.launches == [] and rec.loads == []


def test_driver_older_than_the_artifacts_need(lib, monkeypatch):
    rec = fake_driver(monkeypatch, cuda=11080)
    need = lib.manifest.cuda_driver["sm_90a"]
    assert need >= 12000
    with pytest.raises(DriverTooOld, match=rf"the CUDA driver supports CUDA 11.8 \(11080\) but the sm_90a kernels in "
                                           rf".* need CUDA {need // 1000}\.{need % 1000 // 10} \({need}\), Linux driver"):
        gemm(lib)
    assert rec.launches == [] and rec.loads == []


def _resealed(src, dst, fn):
    shutil.copytree(src, dst)
    d = json.loads((dst / "manifest.json").read_text())
    fn(d)
    body = {k: v for k, v in d.items() if k != "checksum"}
    (dst / "manifest.json").write_text(json.dumps(dict(body, checksum=body_checksum(body))))
    return dst


def test_unknown_schema_and_other_loader_version_are_refused_at_load(tiny_artifacts, tmp_path):
    out = _resealed(tiny_artifacts, tmp_path / "v4", lambda d: d.update(schema_version=4))
    with pytest.raises(ManifestError, match=r"schema_version 4: these artifacts use manifest schema 4 but this loader "
                                            r"\(svdq_loader 0\.1\.0\) reads schema 2, 3"):
        svdq_loader.load(out)
    out = _resealed(tiny_artifacts, tmp_path / "other", lambda d: d["generator"].update(package_version="1.0.0"))
    with pytest.raises(ManifestError, match=r"artifacts were built by svdq-aot 1.0.0 but this loader is 0.1.0 "
                                            r"\(major versions 1 vs 0 differ\)"):
        svdq_loader.load(out)


def test_a_failing_launch_names_the_variant_and_the_driver_error(lib, monkeypatch):
    rec = fake_driver(monkeypatch)
    rec.rc = 1
    with pytest.raises(CudaError, match=r"svdq_gemm_w4a4_sm90a_\S+: cuLaunchKernelEx\(\S+\) failed: "
                                        r"CUDA_ERROR_INVALID_VALUE \(1\)"):
        gemm(lib)
    rec.rc = 0                                   # the library is still usable: the next call launches
    gemm(lib)
    assert len(rec.launches) == 2 and len(rec.loads) == 1

"""CPU tests of `svdq-aot bench`: the torch baselines' math, the command line, the rendering, the no-GPU exit."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader.testing import bench  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402
from svdq_loader.testing import torch_quant as tq  # noqa: E402


def _codes(act):
    return ref.unpack_nibbles(act.numpy())


# ---------------------------------------------------------------------------
# torch quantizer
# ---------------------------------------------------------------------------

def test_encode_e2m1_ties_and_saturation():
    v = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 6.0, 7.0, float("inf"),
                      -0.0, -0.1, -0.75, -5.0, -100.0])
    want = [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7, 7,
            8, 8, 8 | 2, 8 | 6, 8 | 7]
    assert tq.encode_e2m1(v).tolist() == want
    # the same as the numpy reference's RNE on a dense grid
    grid = torch.linspace(-7, 7, 2801, dtype=torch.float64)
    assert tq.encode_e2m1(grid).numpy().tolist() == ref.encode_e2m1(grid.numpy()).tolist()


def test_quantize_hand_example():
    g0 = [6, 3, -1.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, 0, 0.3, -0.2, 4, 2]   # amax 6 -> scale 1
    g1 = [6000] + [0] * 15                                                          # 1000 -> saturates to 448
    g2 = [0] * 16                                                                   # all zero -> scale 0
    g3 = [12, 1, -3] + [0] * 13                                                     # scale 2
    x = torch.tensor([g0 + g1 + g2 + g3], dtype=torch.bfloat16)
    act, sc, lora = tq.quantize_act(x)
    assert lora is None
    assert act.dtype == torch.uint8 and act.shape == (1, 32)
    assert sc.dtype == torch.float8_e4m3fn and sc.shape == (1, 4)
    assert sc.float().tolist() == [[1.0, 448.0, 0.0, 2.0]]
    assert sc.view(torch.uint8).tolist() == [[0x38, 0x7E, 0x00, 0x40]]
    want = ([7, 5, 8 | 3, 0, 2, 2, 4, 4, 6, 6, 8 | 7, 0, 1, 8, 6, 4]     # 0.3 (bf16 0.30078) -> 0.5; -0.2 -> -0
            + [7] + [0] * 15 + [0] * 16 + [7, 1, 8 | 3] + [0] * 13)
    assert _codes(act).tolist() == [want]
    assert act[0, :2].tolist() == [7 | 5 << 4, (8 | 3) | 0 << 4]          # low nibble = even k


def test_quantize_smooth_divides_first():
    x = torch.tensor([[6.0, -3.0] + [0.0] * 14], dtype=torch.float16)
    smooth = torch.full((16,), 2.0, dtype=torch.float16)
    act, sc, _ = tq.quantize_act(x, smooth)
    assert sc.float().tolist() == [[0.5]]
    assert _codes(act)[0, :2].tolist() == [7, 8 | 5]


def _smoothed(x, smooth):
    """x̂ of quantize_ref's rule 1: x times the reciprocal of smooth rounded to x's dtype, the exact product
    rounded once (computed in float64 here, so no intermediate rounding)."""
    rs = (1.0 / smooth.float()).to(x.dtype)
    return (x.double() * rs.double()).to(x.dtype)


def test_quantize_matches_numpy_reference_and_lora():
    g = torch.Generator().manual_seed(0)
    m, k, r = 24, 256, 16
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    smooth = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
    ld = (torch.randn(k, r, generator=g) / 16).to(torch.bfloat16)
    act, sc, lora = tq.quantize_act(x, smooth, ld)
    xh = _smoothed(x, smooth)
    pa, ps = ref.quantize_nvfp4(xh.double().numpy())   # no tiny blocks here, so its zero guard never fires
    assert np.array_equal(act.numpy(), pa)
    assert np.array_equal(sc.view(torch.uint8).numpy(), ps)
    want = xh.double() @ ld.double()
    assert lora.dtype == torch.bfloat16 and lora.shape == (m, r)
    assert torch.allclose(lora.double(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_matches_quantize_ref_bit_for_bit(dtype):
    try:
        qr = importlib.import_module("svdq_loader.testing.quantize_ref")
    except ImportError:
        pytest.skip("svdq_loader.testing.quantize_ref is not there yet")
    fn = getattr(qr, "quantize_act_ref_torch", None)
    if fn is None:
        pytest.skip(f"quantize_ref has no quantize_act_ref_torch (has: {getattr(qr, '__all__', None)})")
    g = torch.Generator().manual_seed(1)
    m, k, r = 16, 512, 32
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 8, (m, 1), generator=g).float())
    x[0, :16] = 1e-4                                  # amax / 6 below half the smallest E4M3 subnormal: zero group
    x[1, :16] = 0.0
    x[1, 3] = -0.0
    x[2, 16:32] = 5000.0                              # saturating scale
    x[3, 32] = float("inf")                           # non-finite groups
    x[3, 48] = float("nan")
    x[4, 64:80] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * (1 - 2 * (torch.arange(16) % 2))
    x = x.to(dtype)
    smooth = (torch.rand(k, generator=g) * 3 + 0.25).to(dtype)
    smooth[64:80] = 1.0
    ld = (torch.randn(k, r, generator=g) / 8).to(dtype)
    for sm in (None, smooth):
        act, sc, lora = tq.quantize_act(x, sm, ld)
        r_act, r_sc, r_lora = fn(x, sm, ld)
        assert np.array_equal(act.numpy(), r_act.numpy()), f"codes differ (smooth={sm is not None})"
        assert np.array_equal(sc.view(torch.uint8).numpy(), r_sc.numpy()), f"scales differ (smooth={sm is not None})"
        b = sc.view(torch.uint8)
        assert b[0, 0] == 0 and b[1, 0] == 0 and b[3, 2] == 0x7F and b[3, 3] == 0x7F   # the policies were hit
        assert act[1, :8].tolist() == [0] * 8 and act[3, 16:24].tolist() == [0] * 8
        rows = slice(4, m)                            # rows 0-3 hold non-finite or special groups
        want, got = r_lora[rows].double(), lora[rows].double()
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


# ---------------------------------------------------------------------------
# unfused W4A4 pipeline
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dequantize_is_exact(dtype):
    p = ref.random_problem(8, 16, 64, 0, seed=3, out_dtype=dtype)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    got = tq.dequantize(p["act"], p["ascales"], tdt)
    want = ref.dequantize_nvfp4(p["act"].numpy(), p["ascales"].view(torch.uint8).numpy())
    assert got.dtype == tdt
    assert np.array_equal(got.double().numpy(), want)


@pytest.mark.parametrize("dtype,rank,affine", [("bf16", 16, True), ("fp16", 32, True), ("bf16", 0, False)])
def test_unfused_matches_float64_formula(dtype, rank, affine):
    p = ref.random_problem(12, 48, 128, rank, seed=7, out_dtype=dtype, wcscale=affine, bias=affine)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    y = tq.w4a4_unfused(p["act"], p["ascales"], p["wgt"], p["wscales"], p["lora_act_in"], p["lora_up"],
                        p["wcscale"], p["bias"], tdt)
    want = ref.reference_from_torch(**p)
    assert y.dtype == tdt and y.shape == (12, 48)
    err = (y.double() - want).abs()
    # a few roundings to the 16-bit dtype (matmul, *wcscale, +bias, +LoRA), each <= 2^-8 relative
    assert err.max() <= 4 * 2**-8 * want.abs().max(), float(err.max())
    assert (y.double() - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("dtype,rank", [("bf16", 32), ("fp16", 16), ("bf16", 0)])
def test_torch_linear_matches_float64_reference(dtype, rank):
    """The linear baseline's math: quantize_act's exact rules (codes, scales and lora_act_in of the float64
    reference quantizer), then the float64 GEMM formula; x with a large dynamic range so smoothing, the block
    scales and every epilogue term move the result far beyond the tolerance."""
    from svdq_loader.testing.bench_linear import torch_linear
    from svdq_loader.testing.quantize_ref import quantize_act_ref
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    m, k, n = 9, 128, 40
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (m, k), generator=g).float())).to(tdt)
    smooth = (torch.rand(k, generator=g) * 3 + 0.25).to(tdt)
    ld = (torch.randn(k, rank, generator=g) / k ** 0.5).to(tdt) if rank else None
    p = ref.random_problem(m, n, k, rank, seed=5, out_dtype=dtype)
    y = torch_linear(x, smooth, ld, p["wgt"], p["wscales"], p["lora_up"], p["wcscale"], p["bias"])
    np32 = (lambda t: t.to(torch.float16).numpy()) if dtype == "fp16" else (lambda t: t.float().numpy())
    act, asc, la = quantize_act_ref(np32(x), np32(smooth), None if ld is None else np32(ld), dtype=dtype)
    want = ref.reference_gemm_w4a4(act, p["wgt"].numpy(), asc, p["wscales"].view(torch.uint8).numpy(),
                                   lora_act_in=la, lora_up=None if la is None else p["lora_up"].double().numpy(),
                                   wcscale=p["wcscale"].double().numpy(), bias=p["bias"].double().numpy())
    assert y.dtype == tdt and y.shape == (m, n)
    rel = float(np.linalg.norm(y.double().numpy() - want) / np.linalg.norm(want))
    assert rel < 1e-2, rel
    without_bias = ref.reference_gemm_w4a4(act, p["wgt"].numpy(), asc, p["wscales"].view(torch.uint8).numpy(),
                                           lora_act_in=la,
                                           lora_up=None if la is None else p["lora_up"].double().numpy(),
                                           wcscale=p["wcscale"].double().numpy())
    assert np.linalg.norm(without_bias - want) / np.linalg.norm(want) > 10 * rel     # the bias is seen


def test_linear_set_bytes():
    from svdq_loader.testing.bench_linear import linear_set_bytes
    m, k, n, r = 16, 3072, 9216, 32
    assert linear_set_bytes(m, k, n, r) == (2 * m * k + m * k // 2 + m * k // 16 + n * k // 2 + n * k // 16
                                            + 2 * k + 2 * r * (k + m + n) + 8 * n + 2 * m * n)
    assert linear_set_bytes(m, k, n, 0) < linear_set_bytes(m, k, n, r)


# ---------------------------------------------------------------------------
# command line, rendering, exits
# ---------------------------------------------------------------------------

def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--artifacts", "--config", "--op", "--m", "--quant-m", "--rank", "--dtype", "--json", "--table",
                "--plot", "--quick", "--baselines", "--compute"):
        assert opt in out
    for name in bench.BASELINES:
        assert name in out


def test_argument_parsing():
    a = bench.build_parser().parse_args([])
    assert (a.artifacts, a.op, a.rank, a.dtype, a.m, a.baselines) == ("artifacts", "all", 32, ["bf16", "fp16"],
                                                                      None, list(bench.BASELINES))
    assert a.artifacts_dir is None
    assert bench.build_parser().parse_args(["built/arts", "--config", "c.yaml"]).artifacts_dir == "built/arts"
    a = bench.build_parser().parse_args(["--m", "16,4608", "--dtype", "bf16,fp16", "--baselines", "fp8,compile",
                                         "--op", "quantize_act", "--quick"])
    assert a.m == [16, 4608] and a.dtype == ["bf16", "fp16"] and a.baselines == ["fp8", "compile"] and a.quick
    assert bench.build_parser().parse_args(["--baselines", "none"]).baselines == []
    assert bench.build_parser().parse_args(["--op", "linear"]).op == "linear"
    assert bench.build_parser().parse_args([]).compute == ["exact"]
    assert bench.build_parser().parse_args(["--compute", "exact,fp8"]).compute == ["exact", "fp8"]
    for bad in (["--dtype", "fp32"], ["--m", "16,x"], ["--m", "0"], ["--baselines", "cudnn"], ["--op", "conv"],
                ["--compute", "int8"]):
        with pytest.raises(SystemExit) as e:
            bench.build_parser().parse_args(bad)
        assert e.value.code == 2


def test_shapes_from_config(tmp_path):
    assert bench.load_shapes(None) == bench.FLUX_SHAPES
    assert [(k, n) for _, k, n in bench.FLUX_SHAPES] == [(3072, 9216), (3072, 3072), (3072, 12288), (12288, 3072),
                                                         (3072, 21504), (15360, 3072)]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: t\nshapes:\n  a: {k: 256, n: 512}\n  b: {k: 1024, n: 128}\n")
    assert bench.load_shapes(str(cfg)) == [("a", 256, 512), ("b", 1024, 128)]
    assert bench.quick_shapes(bench.load_shapes(str(cfg))) == [("a", 256, 512), ("b", 1024, 128)]
    assert bench.quick_shapes(bench.FLUX_SHAPES) == [("qkv", 3072, 9216), ("single_out", 15360, 3072)]
    cfg.write_text("name: t\n")
    with pytest.raises(ValueError, match="shapes"):
        bench.load_shapes(str(cfg))


def test_rotation_count_and_byte_model():
    l2 = 60 << 20
    assert bench.n_sets_for(200 << 20, l2) == 1
    n = bench.n_sets_for(5 << 20, l2)
    assert n * (5 << 20) > 2 * l2 and (n - 1) * (5 << 20) <= 2 * l2
    assert bench.n_sets_for(1, l2) == bench.MAX_SETS
    m, k, r = 4608, 3072, 32
    assert bench.quant_bytes(m, k, r) == m * k * 2 + m * k // 2 + m * k // 16 + m * r * 2 + k * 2 + k * r * 2
    assert bench.tflops(1000, 1000, 1000, 1e6) == pytest.approx(2e-3)


def test_unsupported_classification():
    class UnsupportedProblem(ValueError):
        pass

    class InvalidArgument(ValueError):
        pass

    assert bench.is_unsupported(UnsupportedProblem("x"))
    assert bench.is_unsupported(InvalidArgument("x"))
    assert not bench.is_unsupported(RuntimeError("x"))
    try:
        int("not a number")           # a ValueError from outside the loader is a real failure
    except ValueError as exc:
        assert not bench.is_unsupported(exc)


def _synthetic_doc():
    t = lambda us, **kw: dict(us=us, min_us=us * 0.9, max_us=us * 1.1, method="graph", sets=3,  # noqa: E731
                              calls_per_sample=30, samples=20, **kw)
    gemm = dict(op="gemm_w4a4", m=4608, k=3072, n=9216, rank=32, dtype="bf16",
                check=dict(rel_err_vs_eager=2.5e-3, ok=True),
                ours=t(1400.0, tflops=186.4),
                baselines={"dense": t(370.0, tflops=705.3, speedup=370 / 1400),
                           "fp8": t(215.0, tflops=1213.8, speedup=215 / 1400),
                           "eager": t(2100.0, tflops=124.3, speedup=1.5),
                           "compile": dict(error="BackendCompilerFailed: boom")})
    quant = dict(op="quantize_act", m=4608, k=3072, rank=32, dtype="bf16", smooth=True,
                 bytes=bench.quant_bytes(4608, 3072, 32), floor_us=11.9,
                 check=dict(act_bytes_equal=1.0, scales_equal=1.0, lora_rel_err=1e-3),
                 ours=t(20.0, gbps=2800.0, frac_copy=0.7, frac_copy_same=0.6), copy_same=dict(us=12.0, gbps=3050.0),
                 baselines={"eager": t(815.0, gbps=70.0, frac_copy=0.02, speedup=40.75),
                            "compile": t(112.0, gbps=500.0, frac_copy=0.13, speedup=5.6)})
    host = dict(op="gemm_w4a4", size="M=16 K=128 N=128", dtype="bf16", rank=32, us=9.5, min_us=9.1, gpu_us=3.0,
                gpu_bound=False, ref_size="[16,128]x[128,128]",
                refs={"torch.matmul": 5.0, "torch.matmul(out=)": 4.5}, ratio={"torch.matmul": 1.9,
                                                                              "torch.matmul(out=)": 2.11})
    linear = dict(op="linear", m=16, k=3072, n=3072, rank=32, dtype="bf16", smooth=True,
                  check=dict(rel_err_vs_eager=3.9e-3, ok=True), ours=t(12.8, tflops=23.6),
                  baselines={"dense": t(10.1, tflops=29.9, speedup=10.1 / 12.8),
                             "compile": t(60.0, tflops=5.0, speedup=60.0 / 12.8)})
    return dict(schema="svdq-aot-bench/1", env=dict(gpu="NVIDIA H200", torch="2.11.0", loader="0.1.0"),
                copy_bw=dict(gbps=4000.0), gemm=[gemm, dict(op="gemm_w4a4", m=16, k=100, n=9216, rank=32,
                                                            dtype="bf16", skipped="UnsupportedProblem: K=100")],
                linear=[linear, dict(op="linear", m=16, k=3072, n=3072, rank=32, dtype="fp16",
                                     error="RuntimeError: out of memory")],
                quantize_act=[quant], host=[host])


def test_render_tables_from_synthetic_results():
    doc = _synthetic_doc()
    text = bench.render_tables(doc)
    assert "NVIDIA H200" in text
    assert "| 4608 | 3072 | 9216 | 32 | bf16 | 1400.0 | 186.4 | 705.3 (0.26×) | 1213.8 (0.15×) | 124.3 (1.50×) | error |" \
        in text
    assert "cuBLAS bf16 TFLOP/s" in text
    assert "| 4608 | 3072 | 32 | bf16 |" in text and "2800" in text and "70%" in text and "815.0 (40.75×)" in text
    assert "4000 GB/s" in text
    assert "| 2800 | 70% | 12.0 | 60% |" in text              # the 1 GiB copy's fraction, then the same-size copy's
    assert "torch.matmul [16,128]x[128,128] | 5.00 | 1.90×" in text
    assert "### linear: quantize_act + gemm_w4a4" in text
    assert "| 16 | 3072 | 3072 | 32 | bf16 | 12.8 | 23.6 | 29.9 (0.79×) | 5.0 (4.69×) | ok 3.9e-03 |" in text
    assert "linear m=16, k=3072, n=3072, rank=32, dtype=fp16: ERROR: RuntimeError: out of memory" in text
    assert "skipped: UnsupportedProblem: K=100" in text
    assert "compile: BackendCompilerFailed: boom" in text
    assert json.loads(json.dumps(doc)) == doc                 # the document is plain JSON
    assert bench.render_tables(dict(env={}, gemm=[], quantize_act=[], host=[])).startswith("## svdq-aot bench")


def test_plot_from_synthetic_results(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.png"
    assert bench.write_plot(_synthetic_doc(), str(path)) is None
    assert path.stat().st_size > 1000


def test_main_without_gpu_exits_2(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bench.main(["--artifacts", str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_main_without_artifacts_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # reach the artifacts check on a CPU box
    assert bench.main(["--artifacts", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no artifacts" in err and len(err.strip().splitlines()) == 1


def test_the_fastest_baseline_timing_of_a_shape_gives_the_conservative_ratio():
    """An exact and an FP8 row of one shape timed cuBLAS bf16 separately (774.6 and 710.0 TFLOP/s worth of µs):
    each row keeps its own ratio and gains the ratio against the faster timing; a shape timed once, another dtype
    and a failed baseline are left alone; the table shows both ratios where they differ."""
    def row(compute, ours_us, dense_us, dtype="bf16", m=4608, fp8=None):
        base = {"dense": dict(us=dense_us, tflops=1.0, speedup=dense_us / ours_us)}
        base["fp8"] = fp8 if fp8 is not None else dict(us=50.0, tflops=1.0, speedup=50.0 / ours_us)
        return dict(op="gemm_w4a4", m=m, k=3072, n=9216, rank=32, dtype=dtype, compute=compute,
                    ours=dict(us=ours_us, tflops=1.0), baselines=base, check=dict(ok=True, rel_err_vs_eager=1e-3))
    exact, fp8 = row("exact", 348.0, 336.0), row("fp8", 224.0, 366.6, fp8=dict(error="RuntimeError: x"))
    alone, other_dtype = row("exact", 30.0, 33.0, m=1024), row("exact", 350.0, 300.0, dtype="fp16")
    rows = bench.annotate_fastest_baselines([exact, fp8, alone, other_dtype, dict(op="gemm_w4a4", error="boom")])
    assert exact["baselines"]["dense"]["fastest_us"] == fp8["baselines"]["dense"]["fastest_us"] == 336.0
    assert fp8["baselines"]["dense"]["speedup_vs_fastest"] == pytest.approx(336.0 / 224.0)     # 1.50, not 1.64
    assert fp8["baselines"]["dense"]["speedup"] == pytest.approx(366.6 / 224.0)
    assert exact["baselines"]["dense"]["speedup_vs_fastest"] == pytest.approx(336.0 / 348.0)
    assert "fastest_us" not in alone["baselines"]["dense"] and "fastest_us" not in other_dtype["baselines"]["dense"]
    assert "fastest_us" not in exact["baselines"]["fp8"]          # the FP8 row's fp8 baseline failed: one timing
    assert rows[-1] == dict(op="gemm_w4a4", error="boom")
    text = bench.render_tables(dict(env={}, gemm=rows[:4]))
    assert "(1.64×; 1.50× vs the shape's fastest)" in text
    assert "(0.97×)" in text and "(0.97×;" not in text          # the fastest timing was this row's own


def test_warm_gpu_keeps_the_gpu_busy_for_the_time_asked(monkeypatch):
    """warm_gpu runs matmuls, synchronising, until the wall-clock time asked has passed (no GPU: a fake torch)."""
    import sys
    import time
    import types
    calls = {"matmul": 0, "sync": 0}

    def matmul(a, b, out=None):
        calls["matmul"] += 1
        time.sleep(0.001)

    fake = types.SimpleNamespace(
        randn=lambda *s, **kw: object(), empty_like=lambda a: object(), matmul=matmul, bfloat16="bf16",
        cuda=types.SimpleNamespace(synchronize=lambda: calls.__setitem__("sync", calls["sync"] + 1)))
    monkeypatch.setitem(sys.modules, "torch", fake)
    spent = bench.warm_gpu(30.0)
    assert spent >= 30.0
    assert calls["matmul"] >= 4 and calls["sync"] >= 1 and calls["matmul"] == 4 * calls["sync"]
    before = calls["matmul"]
    assert bench.warm_gpu(0.0) >= 0.0 and calls["matmul"] == before      # no time asked: no matmul


def test_host_cost_batches_are_interleaved_and_timed_per_call():
    """host_us_interleaved on a fake clock: each fn advances it by its own cost per call, and the host runs twice
    as slow during the second timed batch (a slow spell). Every fn's batches alternate with the others' (batch b of
    all before b + 1 of any, each batch starting at the next fn in turn), so the spell falls on all of them and
    each median is that fn's own cost."""
    now = [0.0]
    log = []
    cost_us = {"ours": 1.5, "torch.matmul": 2.0, "x.float()": 0.5}
    calls, batches, n = 5, 3, len(cost_us)

    def make(name):
        def fn():
            batch = (len(log) - n * calls) // (n * calls)          # -1 during the warm-up
            log.append(name)
            now[0] += cost_us[name] * 1e-6 * (2.0 if batch == 1 else 1.0)
        return fn

    syncs = []
    st = bench.Settings(host_calls=calls, host_batches=batches)
    out = bench.host_us_interleaved({name: make(name) for name in cost_us}, st, clock=lambda: now[0],
                                    sync=lambda: syncs.append(len(log)))
    assert list(out) == list(cost_us)
    for name, c in cost_us.items():
        assert out[name]["us"] == pytest.approx(c)              # batches 0 and 2 at cost, batch 1 at twice it
        assert out[name]["min_us"] == pytest.approx(c)
        assert (out[name]["calls"], out[name]["batches"]) == (calls, batches)
    warm, timed = log[:n * calls], log[n * calls:]
    assert warm == ["ours"] * calls + ["torch.matmul"] * calls + ["x.float()"] * calls   # min(200, host_calls)
    assert len(timed) == n * calls * batches
    assert all(timed[i:i + calls] == [timed[i]] * calls for i in range(0, len(timed), calls))
    assert timed[::calls] == ["ours", "torch.matmul", "x.float()",            # batch 0
                              "torch.matmul", "x.float()", "ours",            # batch 1 starts at the next fn
                              "x.float()", "ours", "torch.matmul"]
    # a synchronisation after the warm-up, before every timed run and at the end; none inside a run
    assert syncs == [n * calls] + [n * calls + i * calls for i in range(n * batches)] + [len(log)]

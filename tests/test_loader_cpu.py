"""The loader on a machine with no GPU and no DSL: imports, verification,
argument checks and variant selection, all before any CUDA call."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from svdq_loader import select  # noqa: E402
from svdq_loader.ops import InvalidArgument, PreparedWeight, plan_call, prepare_weight  # noqa: E402

BLOCKER = textwrap.dedent("""
    import sys, importlib.abc
    BANNED = ("cutlass", "svdq_aot", "svdq_kernels", "cuda.bindings.nvrtc", "cuda.bindings.nvjitlink", "nvidia_cutlass_dsl")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BANNED):
                raise ImportError(f"{name} is not installed at inference (blocked by the test)")
            return None
    sys.meta_path.insert(0, Block())
""")


def test_loader_runs_without_the_dsl(tiny_artifacts):
    """Import the whole runtime, verify artifacts and interpret a launch with the DSL unimportable."""
    code = BLOCKER + textwrap.dedent(f"""
        try:
            import cutlass
        except ImportError:
            pass
        else:
            raise SystemExit("blocker failed")
        import svdq_loader
        from svdq_loader import driver, hostvm, launch_plan, library, manifest, ops, reference, select
        lib = svdq_loader.load({str(tiny_artifacts)!r})
        assert lib.variants, "no variants"
        for var in lib._variants.values():
            args = []
            for name in var.arg_names:
                args.append({{"m": 77, "n": 3072, "k": 3072}}.get(name, 0x7f0000100000 + 256 * len(args)))
            rec = var.plan.get(args)
            assert rec.kernel in var.entry.kernel_symbols
            assert rec.grid[0] * rec.grid[1] * rec.grid[2] >= 1
        bad = [m for m in sys.modules if m.split(".")[0] in ("cutlass", "svdq_aot", "svdq_kernels")]
        assert not bad, bad
        print("OK", len(lib.variants))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().startswith("OK")


def test_tampered_cubin_is_refused_without_gpu(tiny_artifacts, tmp_path):
    import shutil

    import svdq_loader
    from svdq_loader.manifest import ArtifactIntegrityError
    for f in os.listdir(tiny_artifacts):
        shutil.copy(os.path.join(tiny_artifacts, f), tmp_path / f)
    victim = sorted(p for p in os.listdir(tmp_path) if p.endswith(".cubin"))[0]
    data = bytearray((tmp_path / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / victim).write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match=victim.replace(".", r"\.")):
        svdq_loader.load(str(tmp_path))


# ---------------------------------------------------------------- argument checks
def _args(m=77, n=256, k=128, r=32, dt=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return dict(
        act=torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g),
        ascales=torch.full((m, k // 16), 1.0).to(torch.float8_e4m3fn),
        wgt=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
        wscales=torch.full((n, k // 16), 1.0).to(torch.float8_e4m3fn),
        lora_act_in=torch.randn(m, r, generator=g).to(dt),
        lora_up=torch.randn(n, r, generator=g).to(dt),
        wcscale=torch.rand(n, generator=g) + 0.5,
        bias=torch.randn(n, generator=g),
    )


WEIGHT_KEYS = ("wgt", "wscales", "lora_up", "wcscale", "bias")


def _call(a, **over):
    """Weight-side overrides go through prepare_weight (whose device check comes last);
    call-side ones through plan_call with a weight assembled directly, so that every
    structural rule is reachable on a machine without a GPU."""
    a = {**a, **over}
    if any(key in over for key in WEIGHT_KEYS) or not over:
        w = prepare_weight(a["wgt"], a["wscales"], lora_up=a["lora_up"], wcscale=a["wcscale"], bias=a["bias"])
    else:
        n, kh = a["wgt"].shape
        w = PreparedWeight(a["wgt"], a["wscales"], a["lora_up"], a["wcscale"].float(), a["bias"].float(),
                           n, 2 * kh, a["lora_up"].shape[1])
    return plan_call(a["act"], w, a["ascales"], lora_act_in=a["lora_act_in"], out=a.get("out"),
                     out_dtype=a.get("out_dtype"))


@pytest.mark.parametrize("over, pattern", [
    (dict(act=torch.zeros(77, 64, dtype=torch.int8)), r"act must have dtype torch.uint8, got torch.int8"),
    (dict(act=torch.zeros(77, 32, dtype=torch.uint8)), r"act has K = 2\*32 = 64 but the weight has K = 128"),
    (dict(act=torch.zeros(0, 64, dtype=torch.uint8), ascales=torch.zeros(0, 8).to(torch.float8_e4m3fn)),
     r"M >= 1"),
    (dict(act=torch.zeros(64, 77, dtype=torch.uint8).t()), r"act must be contiguous"),
    (dict(ascales=torch.zeros(77, 8, dtype=torch.uint8)), r"ascales must have dtype torch.float8_e4m3fn"),
    (dict(ascales=torch.zeros(77, 4).to(torch.float8_e4m3fn)), r"ascales has shape \(77, 4\), expected \(77, 8\)"),
    (dict(wscales=torch.zeros(256, 9).to(torch.float8_e4m3fn)), r"wscales has shape \(256, 9\)"),
    (dict(wgt=torch.zeros(256, 60, dtype=torch.uint8)), r"K = 2\*wgt.shape\[1\] = 120 must be a multiple of 16"),
    (dict(lora_up=torch.zeros(256, 24, dtype=torch.bfloat16)),
     r"rank R = lora_up.shape\[1\] = 24 must be a positive multiple of 16"),
    (dict(lora_act_in=None), r"lora_act_in and lora_up must be given together"),
    (dict(lora_act_in=torch.zeros(77, 32, dtype=torch.float16)), r"lora_act_in must have dtype torch.bfloat16"),
    (dict(lora_act_in=torch.zeros(78, 32, dtype=torch.bfloat16)), r"lora_act_in has shape \(78, 32\)"),
    (dict(wcscale=torch.ones(255)), r"wcscale must have shape \(256,\), got \(255,\)"),
    (dict(bias=torch.ones(256, dtype=torch.int32)), r"bias must be a float16/bfloat16/float32 tensor"),
    (dict(out=torch.zeros(77, 256, dtype=torch.float32)), r"out must have dtype"),
    (dict(out=torch.zeros(77, 256, dtype=torch.float16)), r"lora_up has dtype torch.bfloat16, must equal the output"),
    (dict(out_dtype=torch.float32), r"out_dtype must be torch.float16 or torch.bfloat16"),
    (dict(), r"wgt must be a CUDA tensor, got device cpu"),
    (dict(out=torch.zeros(77, 256, dtype=torch.bfloat16)), r"act must be a CUDA tensor, got device cpu"),
])
def test_argument_rules(over, pattern):
    with pytest.raises(InvalidArgument, match=pattern):
        _call(_args(), **over)


def test_misaligned_pointer_is_refused():
    a = _args()
    big = torch.zeros(77 * 64 + 1, dtype=torch.uint8)
    act = big[1:].view(77, 64)
    assert act.is_contiguous() and act.data_ptr() % 16
    with pytest.raises(InvalidArgument, match=r"act data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        _call(a, act=act)


# ---------------------------------------------------------------- selection
def _v(name, arch="sm_90a", dt="bf16", r=32, wc=True, b=True, tm=128, tn=128, tk=64):
    return SimpleNamespace(name=name, arch=arch,
                           knobs=SimpleNamespace(out_dtype=dt, rank=r, wcscale=wc, bias=b, tile_m=tm, tile_n=tn,
                                                 tile_k=tk),
                           requirements=SimpleNamespace(n_multiple=tn, k_multiple=tk))


def _p(**kw):
    d = dict(arch="sm_90a", out_dtype="bf16", rank=32, wcscale=True, bias=True, m=77, n=3072, k=3072)
    d.update(kw)
    return select.Problem(**d)


def test_select_picks_matching_variant():
    vs = [_v("a", r=0), _v("b", r=32), _v("c", r=32, dt="fp16")]
    assert select.choose(vs, _p()).name == "b"
    assert select.choose(vs, _p(rank=0)).name == "a"


def test_select_prefers_small_tile_for_small_m():
    vs = [_v("big", tm=128), _v("small", tm=64)]
    assert select.choose(vs, _p(m=40)).name == "small"
    assert select.choose(vs, _p(m=4096)).name == "big"


@pytest.mark.parametrize("prob, pattern", [
    (dict(arch="sm_100a"), r"no kernel built for this device's arch sm_100a; the artifacts hold \['sm_90a'\]"),
    (dict(rank=48), r"no sm_90a kernel for out_dtype=bf16, lora rank=48, wcscale=on, bias=on"),
    (dict(n=3000), r"N=3000 is not a multiple of 128"),
    (dict(k=3000), r"K=3000 is not a multiple of 64"),
])
def test_select_refusals(prob, pattern):
    with pytest.raises(select.UnsupportedProblem, match=pattern):
        select.choose([_v("a"), _v("z", r=0)], _p(**prob))


# ---------------------------------------------------------------- launch-time refusals (driver stubbed)
def test_host_code_error_path_refuses_the_launch(monkeypatch):
    """When the DSL's host code takes its printf error path, the loader raises instead of launching."""
    import threading
    import weakref

    from svdq_loader import driver, library
    from svdq_loader.hostvm import LaunchRecord
    rec = LaunchRecord("svdq_k", (1, 1, 1), (128, 1, 1), 300000, 0, [], [b"\0" * 8],
                       printf="Error: launch shared memory exceeds current GPU arch sm_90a allowed.\n")
    launched = []
    monkeypatch.setattr(driver, "launch", lambda *a: launched.append(a))
    var = SimpleNamespace(lock=threading.Lock(), plan=SimpleNamespace(get=lambda args: rec),
                          configs=weakref.WeakKeyDictionary(), entry=SimpleNamespace(name="v"))
    dk = SimpleNamespace(kernels={"svdq_k": object()})
    with pytest.raises(library.LaunchRefused, match="launch shared memory exceeds"):
        library.Library._launch(var, dk, [0])
    assert not launched
    rec.printf = ""
    library.Library._launch(var, dk, [0])
    assert len(launched) == 1


def test_variant_needing_more_smem_than_the_device_is_refused(tiny_artifacts, monkeypatch):
    import svdq_loader
    from svdq_loader import driver, library
    lib = svdq_loader.load(str(tiny_artifacts))
    var = next(iter(lib._variants.values()))
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: "sm_90a")
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: 48 * 1024)
    monkeypatch.setattr(driver, "DeviceKernels", lambda *a, **k: pytest.fail("must not load"))
    with pytest.raises(library.DeviceMismatch, match=rf"needs {var.entry.smem_bytes} bytes .* allows 49152"):
        lib._device_kernels(var, 0, False)
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: "sm_100a")
    with pytest.raises(library.DeviceMismatch, match=r"built for sm_90a but device 0 is sm_100a"):
        lib._device_kernels(var, 0, False)

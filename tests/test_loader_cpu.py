"""The loader on a machine with no GPU and no DSL: imports, verification,
argument checks and variant selection, all before any CUDA call."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from svdq_loader import select  # noqa: E402
from svdq_loader.errors import CaptureError, DeviceMismatch, InvalidArgument, LaunchRefused, UnsupportedProblem  # noqa: E402
from svdq_loader.ops import GEMM_W4A4, QUANTIZE_ACT  # noqa: E402
from svdq_loader.ops import quantize_act as quant_op  # noqa: E402
from svdq_loader.ops.gemm_w4a4 import PreparedWeight, plan_call, prepare_weight  # noqa: E402
from svdq_loader.ops.layouts import WEIGHT_FORMAT_BY_ARCH  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
ARCH = "sm_90a"


# ---------------------------------------------------------------- artifacts (GEMM only)
def gemm_only_tiny_config(dest_dir) -> str:
    """configs/tiny.yaml without its ``quantize_act`` section (that family may not exist yet)."""
    with open(TINY) as f:
        lines = f.read().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.strip() != "quantize_act: {}"]
    assert not any("quantize_act" in ln for ln in kept), "tiny.yaml changed shape; update this helper"
    path = os.path.join(str(dest_dir), "tiny.yaml")
    with open(path, "w") as f:
        f.writelines(kept)
    return path


@pytest.fixture(scope="session")
def gemm_artifacts(tmp_path_factory):
    """One real build of the GEMM part of configs/tiny.yaml per session (CPU only; needs the DSL)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed: cannot build artifacts here")
    from svdq_aot.build import build
    base = tmp_path_factory.mktemp("tiny_gemm_session")
    cfg = gemm_only_tiny_config(base)
    out = base / "artifacts"
    build(cfg, str(out), jobs=1)
    return out


def _copy(src, dst):
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), dst / f)
    return dst


BLOCKER = textwrap.dedent("""
    import sys, importlib.abc
    BANNED = {"cutlass", "svdq_aot", "svdq_kernels", "cuda.bindings.nvrtc", "cuda.bindings.nvjitlink",
              "nvidia_cutlass_dsl", "torch"}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BANNED):
                raise ImportError(f"{name} is not installed at inference (blocked by the test)")
            return None
    sys.meta_path.insert(0, Block())
""")


def test_built_tiny_artifacts_are_what_the_config_asks(gemm_artifacts):
    from svdq_loader.manifest import read_manifest
    m = read_manifest(gemm_artifacts)
    assert [(v.op, v.arch, v.knobs["rank"]) for v in m.variants] == [("gemm_w4a4", ARCH, 0), ("gemm_w4a4", ARCH, 32)]
    for v in m.variants:
        assert v.knobs == dict(out_dtype="bf16", rank=v.knobs["rank"], wcscale=True, bias=True, scale_layout="logical",
                               tile_m=128, tile_n=128, tile_k=64, stages=4, prefetch=1,
                 skip_pad=True, act_decode="prmt", schedule="coop", wsets=2, act_source="nvfp4")
        assert v.requirements == {"n_multiple": 128, "k_multiple": 128}
        assert v.name == GEMM_W4A4.name_for(v.arch, v.knobs, v.requirements)
        assert v.host_args == GEMM_W4A4.host_args
        assert v.kernel_symbols == (v.name + "_0",)
        assert v.smem_bytes == 4 * 128 * 64 * 2        # four fp16 activation stages of 128 x 64
        assert v.family == "sm90_wgmma_w4a4"


def test_loader_runs_without_the_dsl_or_torch(gemm_artifacts):
    """Import the whole runtime, verify artifacts and interpret a launch with the DSL (and torch) unimportable;
    then, with torch back, the operators refuse CPU tensors before any CUDA call."""
    code = BLOCKER + textwrap.dedent(f"""
        for banned in ("cutlass", "torch"):
            try:
                __import__(banned)
            except ImportError:
                pass
            else:
                raise SystemExit("blocker failed for " + banned)
        import svdq_loader
        from svdq_loader import (cubin_info, driver, errors, hostvm, launch_plan, library, manifest, ops, select,
                                 verify)
        from svdq_loader.ops import checks, gemm_w4a4, layouts, quantize_act, spec
        from svdq_loader.launch_plan import CachedLaunch, LaunchPlanCache
        path = {str(gemm_artifacts)!r}
        lib = svdq_loader.load(path)
        assert lib.variants, "no variants"
        arts = verify.open_artifacts(path)
        assert sorted(arts.variants) == sorted(e.name for e in lib.variants)
        dims = {{"m": 77, "n": 3072, "k": 3072, "sm_count": 132, "stream": 0}}
        for vv in arts.variants.values():
            e = vv.entry
            assert e.op == "gemm_w4a4" and e.host_args == ops.GEMM_W4A4.host_args
            args = []
            for name, kind in e.host_args:
                args.append(dims[name] if name in dims else 0x7f0000100000 + 256 * len(args))
            sizes = {{s: [p.size for p in ps] for s, ps in e.params.items()}}
            want = vv.program.launch(args, sizes)
            ptr_idx = [i for i, (_, kd) in enumerate(e.host_args) if kd in ("ptr", "stream")]
            cache = LaunchPlanCache(vv.program, ptr_idx, sizes)
            for _ in range(3):   # first call interprets, later ones patch the cached record
                got = cache.get(args)
                got = got.record() if isinstance(got, CachedLaunch) else got
                assert got == want, (got, want)
            assert want.kernel in e.kernel_symbols
            assert want.grid == (min(132, 1 * 3072 // 128), 1, 1), want.grid   # persistent: min(tiles, SMs)
            assert want.block == (256, 1, 1)
            assert want.smem == e.smem_bytes
            assert not want.printf
            assert vv.recipe is not None, "the sm90 GEMM gets a build-time launch recipe"
            b = vv.recipe.bind([args[i] for i in vv.recipe.scalar_args])
            assert b.record([args[i] for i in vv.recipe.ptr_args]) == want
        bad = [m for m in sys.modules if m.split(".")[0] in ("cutlass", "svdq_aot", "svdq_kernels", "torch")]
        assert not bad, bad
        # an operator called without torch says how to get it
        try:
            lib.gemm_w4a4(object(), object(), object(), object())
        except errors.TorchMissing as e:
            assert "pip install" in str(e), e
        else:
            raise SystemExit("no TorchMissing")
        # torch back: reference helpers import, CPU tensors are refused before any CUDA call
        BANNED.discard("torch")
        import torch
        from svdq_loader.testing import reference  # noqa: F401
        def no_cuda(*a, **k):
            raise SystemExit("a CUDA driver call was made")
        driver.device_arch = driver.device_attribute = driver.DeviceKernels = driver.raw_launch_kernel_ex = no_cuda
        try:
            lib.prepare_weight(torch.zeros(256, 64, dtype=torch.uint8), torch.ones(256, 8).to(torch.float8_e4m3fn))
        except errors.InvalidArgument as e:
            assert "wgt must be a CUDA tensor, got device cpu" in str(e), e
        else:
            raise SystemExit("CPU weights were accepted")
        w = gemm_w4a4.PreparedWeight(torch.zeros(256, 64, dtype=torch.uint8), torch.ones(256, 8).to(torch.float8_e4m3fn),
                                     None, None, None, 256, 128, 0)
        try:
            lib.gemm_w4a4(torch.zeros(77, 64, dtype=torch.uint8), w, torch.ones(77, 8).to(torch.float8_e4m3fn))
        except errors.InvalidArgument as e:
            assert "must be CUDA tensors, got one on cpu" in str(e), e
        else:
            raise SystemExit("CPU tensors were accepted")
        print("OK", len(lib.variants))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "OK 2"


def test_tampered_cubin_is_refused_without_gpu(gemm_artifacts, tmp_path):
    import svdq_loader
    from svdq_loader.manifest import ArtifactIntegrityError
    from svdq_loader.verify import open_artifacts
    _copy(gemm_artifacts, tmp_path)
    victim = sorted(p for p in os.listdir(tmp_path) if p.endswith(".cubin"))[0]
    data = bytearray((tmp_path / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / victim).write_bytes(bytes(data))
    pattern = victim.replace(".", r"\.") + ": sha256 mismatch"
    with pytest.raises(ArtifactIntegrityError, match=pattern):
        svdq_loader.load(str(tmp_path))
    with pytest.raises(ArtifactIntegrityError, match=pattern):
        open_artifacts(tmp_path)


def test_tampered_host_program_and_missing_file_are_refused(gemm_artifacts, tmp_path):
    import svdq_loader
    from svdq_loader.manifest import ArtifactIntegrityError
    _copy(gemm_artifacts, tmp_path)
    host = sorted(p for p in os.listdir(tmp_path) if p.endswith(".host.json"))[0]
    data = (tmp_path / host).read_bytes()
    edited = data.replace(b'["int",32]', b'["int",64]', 1)  # still valid JSON, a different program
    assert edited != data
    (tmp_path / host).write_bytes(edited)
    with pytest.raises(ArtifactIntegrityError, match=host.replace(".", r"\.") + ": sha256 mismatch"):
        svdq_loader.load(str(tmp_path))
    _copy(gemm_artifacts, tmp_path)
    cubin = sorted(p for p in os.listdir(tmp_path) if p.endswith(".cubin"))[-1]
    os.remove(tmp_path / cubin)
    with pytest.raises(ArtifactIntegrityError, match=cubin.replace(".", r"\.") + ": missing"):
        svdq_loader.load(str(tmp_path))


def test_edited_manifest_fails_its_checksum(gemm_artifacts, tmp_path):
    import svdq_loader
    from svdq_loader.manifest import ManifestError
    _copy(gemm_artifacts, tmp_path)
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc["variants"][0]["smem_bytes"] += 1024
    (tmp_path / "manifest.json").write_text(json.dumps(doc, indent=1))
    with pytest.raises(ManifestError, match="checksum mismatch"):
        svdq_loader.load(str(tmp_path))


def test_manifest_facts_are_cross_checked_against_the_bytes(gemm_artifacts, tmp_path):
    """A manifest whose checksum is right but whose facts lie is refused by the one verification."""
    import svdq_loader
    from svdq_loader.manifest import body_checksum
    from svdq_loader.verify import ArtifactMismatch

    def rewrite(edit):
        _copy(gemm_artifacts, tmp_path)
        doc = json.loads((tmp_path / "manifest.json").read_text())
        edit(doc["variants"][0])
        doc["checksum"] = body_checksum({k: v for k, v in doc.items() if k != "checksum"})
        (tmp_path / "manifest.json").write_text(json.dumps(doc, indent=1))
        return doc["variants"][0]

    v = rewrite(lambda e: e.update(smem_bytes=e["smem_bytes"] + 1024))
    with pytest.raises(ArtifactMismatch, match=rf"smem_bytes is {v['smem_bytes']} but the host program requests "
                                               rf"{v['smem_bytes'] - 1024} bytes"):
        svdq_loader.load(str(tmp_path))
    # a knob changed without renaming the variant: the name no longer matches its knobs
    rewrite(lambda e: e["knobs"].update(tile_m=64))
    with pytest.raises(ArtifactMismatch, match=r"name does not match its knobs"):
        svdq_loader.load(str(tmp_path))
    # the arch-fixed feature must be the arch's
    rewrite(lambda e: e["knobs"].update(scale_layout="blocked"))
    with pytest.raises(ArtifactMismatch, match=r"scale_layout 'blocked' is not what sm_90a uses \('logical'\)"):
        svdq_loader.load(str(tmp_path))
    # registers read back from the cubin
    v = rewrite(lambda e: [r.update(registers=r["registers"] - 1) for r in e["resources"].values()])
    with pytest.raises(ArtifactMismatch, match=r"uses registers/stack/static smem"):
        svdq_loader.load(str(tmp_path))
    # host arguments are the op's
    rewrite(lambda e: e.update(host_args=e["host_args"][:12] + e["host_args"][13:]))
    with pytest.raises(ArtifactMismatch, match=r"host_args .* differ from op gemm_w4a4's"):
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


def _weight(a, arch=ARCH):
    """A PreparedWeight assembled directly (prepare_weight would refuse CPU tensors last), declared in
    the weight format of `arch` (only metadata is checked here)."""
    n, kh = a["wgt"].shape
    return PreparedWeight(a["wgt"], a["wscales"], a["lora_up"], a["wcscale"].float(), a["bias"].float(),
                          n, 2 * kh, a["lora_up"].shape[1], WEIGHT_FORMAT_BY_ARCH.get(arch, "logical"))


def _call(a, arch=ARCH, **over):
    """Weight-side overrides go through prepare_weight (whose device check comes last);
    call-side ones through plan_call with a weight assembled directly, so that every
    structural rule is reachable on a machine without a GPU."""
    a = {**a, **over}
    if any(key in over for key in WEIGHT_KEYS) or not over:
        w = prepare_weight(a["wgt"], a["wscales"], lora_up=a["lora_up"], wcscale=a["wcscale"], bias=a["bias"])
    else:
        w = _weight(a, arch)
    return plan_call(arch, a["act"], w, a["ascales"], lora_act_in=a["lora_act_in"], out=a.get("out"),
                     out_dtype=a.get("out_dtype"))


@pytest.mark.parametrize("over, pattern", [
    (dict(act=torch.zeros(77, 64, dtype=torch.int8)), r"act must have dtype torch.uint8, got torch.int8"),
    (dict(act=torch.zeros(77, 32, dtype=torch.uint8)), r"act has K = 2\*32 = 64 but the weight has K = 128"),
    (dict(act=torch.zeros(0, 64, dtype=torch.uint8), ascales=torch.zeros(0, 8).to(torch.float8_e4m3fn)),
     r"M >= 1"),
    (dict(act=torch.zeros(64, 77, dtype=torch.uint8).t()), r"act must be contiguous"),
    (dict(ascales=torch.zeros(77, 8, dtype=torch.uint8)), r"ascales must have dtype torch.float8_e4m3fn"),
    (dict(ascales=torch.zeros(77, 4).to(torch.float8_e4m3fn)),
     r"ascales has shape \(77, 4\) but the sm_90a GEMM reads the logical scale layout, shape \(77, 8\) "
     r"for M=77, K=128"),
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
    (dict(out=torch.zeros(77, 255, dtype=torch.bfloat16)), r"out has shape \(77, 255\), expected \(77, 256\)"),
    (dict(out=torch.zeros(77, 256, dtype=torch.float16)), r"lora_up has dtype torch.bfloat16, must equal the output"),
    (dict(out=torch.zeros(77, 256, dtype=torch.bfloat16), out_dtype=torch.float16),
     r"out has dtype torch.bfloat16 but out_dtype=torch.float16"),
    (dict(out_dtype=torch.float32), r"out_dtype must be torch.float16 or torch.bfloat16"),
    (dict(), r"wgt must be a CUDA tensor, got device cpu"),
    (dict(out=torch.zeros(77, 256, dtype=torch.bfloat16)), r"act must be a CUDA tensor, got device cpu"),
])
def test_argument_rules(over, pattern):
    with pytest.raises(InvalidArgument, match=pattern):
        _call(_args(), **over)


def test_ascales_must_be_in_the_layout_the_arch_reads():
    """Blackwell GEMMs read the blocked 32x4x4 scale layout: logical ascales are refused there."""
    a = _args()
    with pytest.raises(InvalidArgument, match=r"ascales has shape \(77, 8\) but the sm_100a GEMM reads the blocked "
                                              r"scale layout, shape \(1, 2, 32, 4, 4\)"):
        _call(a, arch="sm_100a", out=torch.zeros(77, 256, dtype=torch.bfloat16))
    blocked = torch.zeros(1, 2, 32, 4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidArgument, match=r"act must be a CUDA tensor"):  # every structural rule passed
        _call(a, arch="sm_100a", ascales=blocked, out=torch.zeros(77, 256, dtype=torch.bfloat16))


def test_misaligned_pointer_is_refused():
    a = _args()
    big = torch.zeros(77 * 64 + 1, dtype=torch.uint8)
    act = big[1:].view(77, 64)
    assert act.is_contiguous() and act.data_ptr() % 16
    with pytest.raises(InvalidArgument, match=r"act data pointer 0x[0-9a-f]+ is not 16-byte aligned"):
        _call(a, act=act)


def test_plan_call_features_and_pointers(monkeypatch):
    """What a checked call hands to selection and to the host program (device check stubbed out)."""
    from svdq_loader.ops import gemm_w4a4 as gemm_mod
    monkeypatch.setattr(gemm_mod, "check_devices", lambda named: None)
    a = _args()
    w = prepare_weight(a["wgt"], a["wscales"], lora_up=a["lora_up"], wcscale=a["wcscale"], bias=a["bias"], arch=ARCH)
    assert (w.n, w.k, w.rank) == (256, 128, 32)
    assert w.wcscale.dtype == torch.float32 and w.bias.dtype == torch.float32
    # sm_90a reads the weight as pre-shuffled wgmma fragments: [N/64, K/64, 128 threads, 16 B] and 8 scale bytes
    assert w.weight_format == "sm90_frag"
    assert w.wgt.shape == (4, 2, 128, 16) and w.wscales.shape == (4, 2, 32, 8)
    with pytest.raises(InvalidArgument, match=r"weight is in the 'logical' format but the sm_90a GEMM reads "
                                              r"'sm90_frag'"):
        plan_call(ARCH, a["act"], prepare_weight(a["wgt"], a["wscales"], lora_up=a["lora_up"]), a["ascales"],
                  lora_act_in=a["lora_act_in"])
    call = plan_call(ARCH, a["act"], w, a["ascales"], lora_act_in=a["lora_act_in"])
    assert call.features == ("bf16", 32, True, True, "logical")
    assert len(call.features) == len(GEMM_W4A4.feature_names)
    assert (call.m, call.n, call.k) == (77, 256, 128)
    assert call.out.shape == (77, 256) and call.out.dtype == torch.bfloat16
    assert call.pointers == dict(act=a["act"].data_ptr(), ascales=a["ascales"].data_ptr(), wgt=w.wgt.data_ptr(),
                                 wscales=w.wscales.data_ptr(), lora_act_in=a["lora_act_in"].data_ptr(),
                                 lora_up=a["lora_up"].data_ptr(), wcscale=w.wcscale.data_ptr(),
                                 bias=w.bias.data_ptr(), out=call.out.data_ptr())
    # every pointer host argument of the op is filled; no LoRA passes 0, and an absent wcscale / bias points at
    # its identity vector (ones / zeros, shared per device and N), so a variant built with it serves the call
    assert set(call.pointers) == {n for n, kd in GEMM_W4A4.host_args if kd == "ptr"}
    w0 = prepare_weight(a["wgt"], a["wscales"], arch=ARCH)
    call0 = plan_call(ARCH, a["act"], w0, a["ascales"], out_dtype=torch.float16)
    assert call0.features == ("fp16", 0, False, False, "logical")
    assert call0.out.dtype == torch.float16
    assert [call0.pointers[k] for k in ("lora_act_in", "lora_up")] == [0, 0]
    ones, zeros = w0.fills
    assert ones.dtype == zeros.dtype == torch.float32 and ones.shape == zeros.shape == (256,)
    assert bool((ones == 1).all()) and bool((zeros == 0).all()) and not bool(zeros.signbit().any())
    assert (call0.pointers["wcscale"], call0.pointers["bias"]) == (ones.data_ptr(), zeros.data_ptr())
    assert w0.wcscale is None and w0.bias is None
    assert prepare_weight(a["wgt"], a["wscales"], arch=ARCH).fills[0] is ones    # made once per (device, N)


# ---------------------------------------------------------------- quantize_act argument checks
def _qargs(m=77, k=128, r=32, dt=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(m, k, generator=g).to(dt), smooth=torch.rand(k, generator=g).to(dt) + 0.5,
                lora_down=torch.randn(k, r, generator=g).to(dt))


@pytest.mark.parametrize("over, pattern", [
    (dict(x=torch.zeros(77, 128)), r"x must have dtype torch.float16 or torch.bfloat16, got torch.float32"),
    (dict(x=torch.zeros(77, 120, dtype=torch.bfloat16), smooth=None, lora_down=None),
     r"K = x.shape\[1\] = 120 must be a multiple of 16"),
    (dict(x=torch.zeros(0, 128, dtype=torch.bfloat16)), r"x must be non-empty"),
    (dict(smooth=torch.ones(128, dtype=torch.float16)), r"smooth must have dtype torch.bfloat16"),
    (dict(smooth=torch.ones(64, dtype=torch.bfloat16)), r"smooth has shape \(64,\), expected \(128,\)"),
    (dict(lora_down=torch.zeros(128, 24, dtype=torch.bfloat16)),
     r"rank R = lora_down.shape\[1\] = 24 must be a positive multiple of 16"),
    (dict(lora_down=None, out_lora=torch.zeros(77, 32, dtype=torch.bfloat16)), r"out_lora was given but lora_down"),
    (dict(out_act=torch.zeros(77, 128, dtype=torch.uint8)), r"out_act has shape \(77, 128\), expected \(77, 64\)"),
    (dict(out_scales=torch.zeros(1, 2, 32, 4, 4).to(torch.float8_e4m3fn)),
     r"out_scales has shape \(1, 2, 32, 4, 4\) but on sm_90a quantize_act writes the logical scale layout"),
    (dict(out_lora=torch.zeros(77, 16, dtype=torch.bfloat16)), r"out_lora has shape \(77, 16\), expected \(77, 32\)"),
    (dict(), r"x must be a CUDA tensor, got device cpu"),
])
def test_quantize_act_argument_rules(over, pattern):
    a = {**_qargs(), **over}
    with pytest.raises(InvalidArgument, match=pattern):
        quant_op.plan_call(ARCH, a.pop("x"), **a)


def test_quantize_act_refuses_a_non_tensor_out_scales():
    with pytest.raises(InvalidArgument, match=r"out_scales must be a torch.Tensor"):
        quant_op.plan_call(ARCH, _qargs()["x"], out_scales=object())


def test_quantize_act_plan(monkeypatch):
    monkeypatch.setattr(quant_op, "check_devices", lambda named: None)
    a = _qargs()
    call = quant_op.plan_call(ARCH, a["x"], smooth=a["smooth"], lora_down=a["lora_down"])
    assert call.features == ("bf16", 32, "logical")
    assert len(call.features) == len(QUANTIZE_ACT.feature_names)
    assert (call.m, call.k, call.use_smooth) == (77, 128, 1)
    act, scales, lora = call.outputs
    assert act.shape == (77, 64) and act.dtype == torch.uint8
    assert scales.shape == (77, 8) and scales.dtype == torch.float8_e4m3fn
    assert lora.shape == (77, 32) and lora.dtype == torch.bfloat16
    # every pointer but the workspace, which the launcher takes per call (QuantizeLauncher)
    assert set(call.pointers) == {n for n, kd in QUANTIZE_ACT.host_args if kd == "ptr"} - {"workspace"}
    # on Blackwell the scales come out in the blocked layout the GEMM there reads
    call = quant_op.plan_call("sm_100a", a["x"].half())
    assert call.features == ("fp16", 0, "blocked") and call.use_smooth == 0
    assert call.outputs[1].shape == (1, 2, 32, 4, 4) and call.outputs[2] is None
    assert call.pointers["smooth"] == call.pointers["lora_down"] == call.pointers["lora_act_in"] == 0


# ---------------------------------------------------------------- selection
def _v(name, arch="sm_90a", dt="bf16", r=32, wc=True, b=True, tm=128, tn=128, tk=64, op="gemm_w4a4",
       family="sm90_gemm_w4a4"):
    knobs = dict(out_dtype=dt, rank=r, wcscale=wc, bias=b, scale_layout="logical", tile_m=tm, tile_n=tn, tile_k=tk,
                 stages=2)
    return SimpleNamespace(name=name, op=op, arch=arch, knobs=knobs, family=family,
                           requirements=dict(n_multiple=tn, k_multiple=tk))


def _rules(buckets, family="sm90_gemm_w4a4", op="gemm_w4a4", arch="sm_90a"):
    from svdq_loader.select_rules import Rule, parse_buckets
    return {(op, arch, family): Rule(op, arch, family, parse_buckets(buckets, "test"))}


TILE_RULE = [{"m_max": 64, "prefer": [{"knob": "tile_m", "order": "asc"}]},
             {"m_max": None, "prefer": [{"knob": "tile_m", "order": "desc"}]}]


def _p(arch="sm_90a", out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", m=77, n=3072,
       k=3072, op="gemm_w4a4"):
    return select.Problem(op, arch, (out_dtype, rank, wcscale, bias, scale_layout), (("m", m), ("n", n), ("k", k)))


def test_select_picks_matching_variant():
    vs = [_v("a", r=0), _v("b", r=32), _v("c", r=32, dt="fp16")]
    assert select.choose(vs, _p()).name == "b"
    assert select.choose(vs, _p(rank=0)).name == "a"
    assert select.choose(vs, _p(out_dtype="fp16")).name == "c"


def test_select_keeps_to_the_problems_op():
    qa = SimpleNamespace(name="0q", op="quantize_act", arch="sm_90a",
                         knobs=dict(dtype="bf16", rank=32, scale_layout="logical"), requirements=dict(k_multiple=16))
    assert select.choose([qa, _v("b")], _p()).name == "b"
    with pytest.raises(UnsupportedProblem, match=r"the artifacts hold no gemm_w4a4 kernels"):
        select.choose([qa], _p())


def test_select_ranks_by_the_rules_m_buckets():
    vs = [_v("big", tm=128), _v("small", tm=64)]
    rules = _rules(TILE_RULE)
    assert select.choose(vs, _p(m=40), rules).name == "small"
    assert select.choose(vs, _p(m=64), rules).name == "small"     # bucket bounds are inclusive
    assert select.choose(vs, _p(m=65), rules).name == "big"
    assert select.choose(vs, _p(m=4096), rules).name == "big"
    assert select.choose(list(reversed(vs)), _p(m=40), rules).name == "small"
    # without a rule: name order; ties are broken by name, so the choice never depends on the entries' order
    assert select.choose(vs, _p(m=40)).name == "big"
    assert select.choose([_v("y"), _v("x")], _p(), rules).name == "x"
    assert select.choose([_v("x"), _v("y")], _p(), rules).name == "x"


def test_select_rules_are_generic_over_knobs_and_families():
    """A second family with a knob the first lacks: priority per bucket decides between families,
    an explicit value order within one."""
    from svdq_loader.select_rules import Rule, parse_buckets
    a = _v("a64", tm=64)
    b = [SimpleNamespace(**{**vars(_v(f"splitk{s}", family="sm90_splitk")),
                            "knobs": dict(_v("x").knobs, splits=s)}) for s in (2, 4, 8)]
    rules = _rules(TILE_RULE)
    rules[("gemm_w4a4", "sm_90a", "sm90_splitk")] = Rule("gemm_w4a4", "sm_90a", "sm90_splitk", parse_buckets(
        [{"m_max": 32, "priority": -1, "prefer": [{"knob": "splits", "values": [4, 8]}]},
         {"m_max": None, "priority": 1}], "test"))
    assert select.choose([a, *b], _p(m=16), rules).name == "splitk4"
    assert select.choose([a, *b], _p(m=33), rules).name == "a64"
    ex = select.explain([a, *b], rules, _p(m=16))
    why = dict(ex.rejected)
    assert why["splitk8"] == ("outranked by splitk4: splits=8 vs 4 (splits in the order [4, 8] for M in [1, 32])")
    assert why["splitk2"].startswith("outranked by splitk4: splits=2 vs 4")
    assert why["a64"].startswith("outranked by splitk4: family sm90_gemm_w4a4 has priority 0 for M in [1, 64], "
                                 "family sm90_splitk has -1")


def test_explain_names_the_choice_and_every_rejected_candidate():
    vs = [_v("big", tm=128), _v("small", tm=64), _v("r0", r=0), _v("fp16", dt="fp16"), _v("n256", tn=256),
          _v("other_arch", arch="sm_100a")]
    ex = select.explain(vs, _rules(TILE_RULE), _p(m=4608, n=3072 + 128, k=12288))
    assert ex.chosen.name == "big"
    assert dict(ex.rejected) == {
        "other_arch": "built for sm_100a, not sm_90a",
        "r0": "built for rank=0 (the call needs 32)",
        "fp16": "built for out_dtype=fp16 (the call needs bf16)",
        "n256": "N=3200 is not a multiple of 256",
        "small": "outranked by big: tile_m=64 vs 128 (tile_m larger first for M >= 65)",
    }
    assert "M=4608 falls in the bucket M >= 65" in " ".join(ex.why)
    d = ex.to_dict()
    assert d["chosen"] == "big" and d["dims"] == {"m": 4608, "n": 3200, "k": 12288}
    assert d["features"]["rank"] == 32 and len(d["rejected"]) == 5
    text = ex.text()
    assert "chosen: big" in text and "  r0: built for rank=0 (the call needs 32)" in text
    # nothing fits: the explanation still lists every candidate, and choose raises with the reason
    ex = select.explain(vs, {}, _p(rank=48))
    assert ex.chosen is None and "rank=48" in ex.error and len(ex.rejected) == 6


def test_problem_for_fills_features_by_name():
    p = select.problem_for("gemm_w4a4", "sm_90a", m=4608, n=3072, k=12288, rank=32, dtype="bf16")
    assert p.features == ("bf16", 32, True, True, "logical") and p.dim == {"m": 4608, "n": 3072, "k": 12288}
    q = select.problem_for("quantize_act", "sm_100a", m=7, k=3072, rank=16, dtype="fp16")
    assert q.features == ("fp16", 16, "blocked") and q.dims == (("m", 7), ("k", 3072))
    with pytest.raises(UnsupportedProblem, match=r"needs the dims m, n, k; missing n"):
        select.problem_for("gemm_w4a4", "sm_90a", m=1, k=64)
    with pytest.raises(UnsupportedProblem, match=r"no scale_layout for arch 'sm_89'"):
        select.problem_for("gemm_w4a4", "sm_89", m=1, n=128, k=64)


@pytest.mark.parametrize("buckets, words", [
    ([], "expected a non-empty list"),
    ([{"m_max": 64}], "the last bucket must be unbounded"),
    ([{"m_max": None}, {"m_max": None}], "only the last bucket may be unbounded"),
    ([{"m_max": 64}, {"m_max": 32}, {"m_max": None}], "above the previous bucket's bound 64"),
    ([{"m_max": None, "prefer": [{"knob": "tile_q", "order": "asc"}]}], "not a knob of this family"),
    ([{"m_max": None, "prefer": [{"knob": "tile_m", "order": "up"}]}], "order: asc|desc"),
    ([{"m_max": None, "priority": "high"}], "expected an integer"),
    ([{"m_max": None, "bogus": 1}], "expected an object with keys m_max"),
])
def test_malformed_selection_rules_are_refused(buckets, words):
    from svdq_loader.select_rules import RuleError, parse_buckets
    with pytest.raises(RuleError, match=words):
        parse_buckets(buckets, "fam.SELECTION", ["tile_m", "tile_n"])


@pytest.mark.parametrize("prob, pattern", [
    (dict(arch="sm_100a"), r"no gemm_w4a4 kernel built for this device's arch sm_100a; the artifacts hold "
                           r"gemm_w4a4 for \['sm_90a'\]"),
    (dict(rank=48), r"no sm_90a gemm_w4a4 kernel for out_dtype=bf16, rank=48, wcscale=True, bias=True, "
                    r"scale_layout=logical; built: "),
    (dict(n=3000), r"N=3000 is not a multiple of 128"),
    (dict(k=3000), r"K=3000 is not a multiple of 64"),
    (dict(m=0), r"M=0 must be at least 1"),
])
def test_select_refusals(prob, pattern):
    with pytest.raises(UnsupportedProblem, match=pattern):
        select.choose([_v("a"), _v("z", r=0)], _p(**prob))


def test_select_on_the_built_artifacts(gemm_artifacts):
    import svdq_loader
    lib = svdq_loader.load(str(gemm_artifacts))
    feats = ("bf16", 32, True, True, "logical")
    e = lib.choose("gemm_w4a4", ARCH, feats, m=77, n=256, k=256)
    assert (e.knobs["rank"], e.op, e.arch) == (32, "gemm_w4a4", ARCH)
    assert lib.choose("gemm_w4a4", ARCH, ("bf16", 0, True, True, "logical"), m=1, n=512, k=128).knobs["rank"] == 0
    assert lib.choose("gemm_w4a4", m=1, n=512, k=128, rank=32) == e        # arch: the one built; features by name
    ex = lib.explain("gemm_w4a4", m=1, n=512, k=128, rank=32)
    assert ex.chosen == e and [r for _, r in ex.rejected] == ["built for rank=0 (the call needs 32)"]
    rule = lib.rules[("gemm_w4a4", ARCH, "sm90_wgmma_w4a4")]            # the family's rule, from the manifest
    assert [b.m_max for b in rule.buckets] == [16, 128, 256, None]
    with pytest.raises(UnsupportedProblem, match=r"N=200 is not a multiple of 128"):
        lib.choose("gemm_w4a4", ARCH, feats, m=77, n=200, k=256)
    with pytest.raises(UnsupportedProblem, match=r"rank=16"):
        lib.choose("gemm_w4a4", ARCH, ("bf16", 16, True, True, "logical"), m=77, n=256, k=256)
    with pytest.raises(UnsupportedProblem, match=r"the artifacts hold no quantize_act kernels"):
        lib.choose("quantize_act", ARCH, ("bf16", 32, "logical"), m=77, k=256)
    with pytest.raises(UnsupportedProblem, match=r"N=200 is not a multiple of 128") as ei:
        lib.explain("gemm_w4a4", m=77, n=200, k=256, rank=32)
    assert ei.value.explanation.chosen is None and len(ei.value.explanation.rejected) == 2


# ---------------------------------------------------------------- launch-time refusals (driver stubbed)
@pytest.fixture(autouse=True)
def _driver_supports_cuda_13(monkeypatch):
    """The stubbed driver of these tests reports CUDA 13.0 (the version check has its own tests)."""
    from svdq_loader import driver
    monkeypatch.setattr(driver, "driver_version", lambda: 13000)


class _FakeDK:
    """Stands in for driver.DeviceKernels: records the load, hands out one handle per kernel symbol."""
    loads: list = []

    def __init__(self, cubin, symbols, ordinal, load_plan, params, foreign=False):
        self.args = (cubin, tuple(symbols), ordinal, load_plan, params)
        self.kernels = {s: 0x5000 + i for i, s in enumerate(symbols)}
        self.foreign = foreign
        self.ctx = []
        _FakeDK.loads.append(self)

    def foreign_context(self):
        return self.foreign

    def push_primary(self):
        self.ctx.append("push")

    def pop(self):
        self.ctx.append("pop")


def test_host_code_error_path_refuses_the_launch(monkeypatch):
    """When the DSL's host code takes its printf error path, the loader raises instead of launching."""
    from svdq_loader import launcher as L
    from svdq_loader.hostvm import LaunchRecord
    rec = LaunchRecord("svdq_k", (1, 1, 1), (128, 1, 1), 300000, 0, [], [b"\0" * 8],
                       printf="Error: launch shared memory exceeds current GPU arch sm_90a allowed.\n")
    launched = []
    prog = SimpleNamespace(arg_kinds=["i64"])
    ln = L.Launcher("v", {"svdq_k": 77}, prog, None, [], {"svdq_k": [8]},
                    launch_fn=lambda cfg, func, kp, extra: launched.append((cfg, func)) or 0)
    ln.plan = SimpleNamespace(get=lambda args: rec)
    with pytest.raises(LaunchRefused, match="host code of v refused this launch: .*launch shared memory exceeds"):
        ln.launch([0])
    assert not launched
    rec.printf = ""
    ln.launch([0])
    assert len(launched) == 1 and launched[0][1] == 77


def test_a_launch_in_a_foreign_context_restores_it(monkeypatch):
    from svdq_loader import library
    calls = []
    dk = _FakeDK(b"", ["svdq_k"], 0, None, None, foreign=True)
    ln = SimpleNamespace(device=dk, launch=lambda args: calls.append(list(dk.ctx)))
    library._launch_in_primary(ln, [1])
    assert calls == [["push"]] and dk.ctx == ["push", "pop"]
    dk.foreign = False
    library._launch_in_primary(ln, [1])
    assert dk.ctx == ["push", "pop"]
    ln.launch = lambda args: (_ for _ in ()).throw(LaunchRefused("no"))
    dk.foreign = True
    with pytest.raises(LaunchRefused):
        library._launch_in_primary(ln, [1])
    assert dk.ctx == ["push", "pop", "push", "pop"]      # restored on the refusal too


def _static_smem(entry):
    return max(r.static_smem for r in entry.resources.values())


def test_variant_needing_more_smem_than_the_device_is_refused(gemm_artifacts, monkeypatch):
    import svdq_loader
    from svdq_loader import driver
    lib = svdq_loader.load(str(gemm_artifacts))
    e = lib.variants[0]
    need = e.smem_bytes + _static_smem(e)
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: "sm_90a")
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: 48 * 1024)
    monkeypatch.setattr(driver, "DeviceKernels", lambda *a, **k: pytest.fail("must not load"))
    with pytest.raises(DeviceMismatch, match=rf"{e.name} needs {need} bytes of shared memory per block "
                                             rf"\({e.smem_bytes} dynamic \+ {_static_smem(e)} static\); "
                                             rf"device 0 allows 49152"):
        lib._launcher(e.name, 0, False)
    # one byte short is refused (the static part counts); exactly enough loads
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: need - 1)
    with pytest.raises(DeviceMismatch, match=rf"allows {need - 1}"):
        lib._launcher(e.name, 0, False)
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: need)
    _FakeDK.loads = []
    monkeypatch.setattr(driver, "DeviceKernels", _FakeDK)
    assert lib._launcher(e.name, 0, False) is not None
    assert len(_FakeDK.loads) == 1
    lib = svdq_loader.load(str(gemm_artifacts))  # the arch of a device is cached per library
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: "sm_100a")
    with pytest.raises(DeviceMismatch, match=r"built for sm_90a but device 0 is sm_100a"):
        lib._launcher(e.name, 0, False)


def test_loading_during_capture_is_refused_then_cached(gemm_artifacts, monkeypatch):
    import svdq_loader
    from svdq_loader import driver
    lib = svdq_loader.load(str(gemm_artifacts))
    e = lib.variants[-1]
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: "sm_90a")
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: 232448 if attr == 97 else 132)
    _FakeDK.loads = []
    monkeypatch.setattr(driver, "DeviceKernels", _FakeDK)
    with pytest.raises(CaptureError, match=rf"kernel {e.name} is not loaded on device 0 yet .* lib.preload\(\)"):
        lib._launcher(e.name, 0, True)
    assert not _FakeDK.loads
    ln = lib._launcher(e.name, 0, False)
    (dk,) = _FakeDK.loads
    cubin, symbols, ordinal, _plan, params = dk.args
    assert symbols == e.kernel_symbols and ordinal == 0
    assert cubin == (gemm_artifacts / e.cubin).read_bytes()
    assert params == {s: [tuple(p) for p in ps] for s, ps in e.params.items()}
    # once loaded, capturing is fine and nothing is loaded again
    assert lib._launcher(e.name, 0, True) is ln
    assert lib._launcher(e.name, 0, False) is ln
    assert len(_FakeDK.loads) == 1
    # a launch through it (recipe path): the variant's kernel, the documented grid, the caller's stream
    import ctypes
    from svdq_loader.driver import CUlaunchConfigRaw
    launched = []

    def fake_launch(cfg_addr, func, kp, extra):
        cfg = CUlaunchConfigRaw.from_address(cfg_addr)
        launched.append(((cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                         cfg.sharedMemBytes, int(cfg.hStream or 0), func,
                         ctypes.c_uint64.from_address(ctypes.c_void_p.from_address(kp).value).value))
        return 0

    ln._fn = fake_launch
    vals = dict(act=1 << 36, ascales=2 << 36, wgt=3 << 36, wscales=4 << 36, lora_act_in=5 << 36, lora_up=6 << 36,
                wcscale=7 << 36, bias=8 << 36, out=9 << 36, m=300, n=512, k=256, sm_count=132, stream=0x1234)
    args = [vals[n] for n in GEMM_W4A4.arg_names]
    for _ in range(2):
        ln.launch(args)
    assert len(launched) == 2 and ln.recipe is not None and ln.general_launches == 0
    for grid, block, smem, stream, func, first_param in launched:
        assert func == 0x5000 and stream == 0x1234
        assert grid == (3 * 4, 1, 1) and block == (256, 1, 1) and smem == e.smem_bytes   # min(tiles, 132 SMs)
        assert first_param == 1 << 36           # parameter 0 is the act pointer


def test_preload_needs_a_cuda_device(gemm_artifacts, monkeypatch):
    import svdq_loader
    from svdq_loader import driver
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: pytest.fail("no driver call expected"))
    lib = svdq_loader.load(str(gemm_artifacts))
    assert lib.warmup == lib.preload
    with pytest.raises(DeviceMismatch, match=r"torch sees no CUDA device"):
        lib.preload()


def test_library_call_rules_before_any_device_call(gemm_artifacts, monkeypatch):
    import svdq_loader
    from svdq_loader import driver
    for f in ("device_arch", "device_attribute", "DeviceKernels", "raw_launch_kernel_ex"):
        monkeypatch.setattr(driver, f, lambda *a, **k: pytest.fail("no driver call expected"))
    lib = svdq_loader.load(str(gemm_artifacts))
    a = _args()
    w = _weight(a)
    with pytest.raises(InvalidArgument, match=r"wgt must be a CUDA tensor, got device cpu"):
        lib.prepare_weight(a["wgt"], a["wscales"])
    with pytest.raises(InvalidArgument, match=r"wgt is a PreparedWeight; wscales, bias belong to prepare_weight\(\)"):
        lib.gemm_w4a4(a["act"], w, a["ascales"], a["wscales"], bias=a["bias"])
    with pytest.raises(InvalidArgument, match=r"wscales is required unless wgt is a PreparedWeight"):
        lib.gemm_w4a4(a["act"], a["wgt"], a["ascales"])
    with pytest.raises(InvalidArgument, match=r"tensors must be CUDA tensors, got one on cpu"):
        lib.gemm_w4a4(a["act"], w, a["ascales"], lora_act_in=a["lora_act_in"])
    with pytest.raises(InvalidArgument, match=r"tensors must be CUDA tensors, got one on cpu"):
        lib.quantize_act(torch.zeros(77, 128, dtype=torch.bfloat16))


def test_max_active_clusters_passes_the_cluster_launch_config(monkeypatch):
    """driver.max_active_clusters hands libcuda's cuOccupancyMaxActiveClusters a CUlaunchConfig of one cluster
    of `cluster` CTAs (grid and the CLUSTER_DIMENSION attribute), the block and the dynamic SMEM asked for, and
    returns the count it writes; a failing call raises CudaError naming the cluster size (no GPU: a fake libcuda)."""
    import ctypes
    from svdq_loader import driver
    from svdq_loader.driver import CUlaunchAttributeRaw, CUlaunchConfigRaw, CudaError
    seen = []

    def occupancy(out, func, cfg_addr):
        cfg = CUlaunchConfigRaw.from_address(cfg_addr)
        attrs = (CUlaunchAttributeRaw * cfg.numAttrs).from_address(cfg.attrs)
        raw = ctypes.string_at(ctypes.addressof(attrs[0]) + CUlaunchAttributeRaw.value.offset, 12)
        dims = tuple((ctypes.c_uint * 3).from_buffer_copy(raw))
        seen.append((func.value, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY,
                     cfg.blockDimZ), cfg.sharedMemBytes, cfg.numAttrs, attrs[0].id, dims))
        out._obj.value = 92 if dims[0] == 4 else 7
        return rc[0]

    class _Lib:
        cuOccupancyMaxActiveClusters = staticmethod(occupancy)

    rc = [0]
    monkeypatch.setattr(driver, "_clusters_fn", None)
    monkeypatch.setattr(driver, "_libcuda", lambda: _Lib())
    assert driver.max_active_clusters(0x5000, 4, 128, 41472) == 92
    assert seen[-1] == (0x5000, (4, 1, 1), (128, 1, 1), 41472, 1, driver.CLUSTER_DIMENSION_ATTR, (4, 1, 1))
    assert driver.max_active_clusters(0x5000, 8, 256, 0) == 7 and seen[-1][6] == (8, 1, 1)
    rc[0] = 1
    with pytest.raises(CudaError, match=r"cuOccupancyMaxActiveClusters\(cluster 2\) failed"):
        driver.max_active_clusters(0x5000, 2, 128, 0)

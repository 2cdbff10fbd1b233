"""The svdq:: torch custom ops on a machine without a GPU: schemas, fake (meta) implementations, opcheck,
torch.compile(fullgraph=True) tracing, and the errors a caller can make."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from svdq_loader import torch_ops  # noqa: E402
from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader.ops.gemm_w4a4 import PreparedWeight  # noqa: E402

META = torch.device("meta")


def _lib(*archs):
    return SimpleNamespace(variants=[SimpleNamespace(op="quantize_act", arch=a) for a in archs])


def _weight(n=3072, k=12288, rank=32, dtype=torch.bfloat16, dev=META, wcscale=True, bias=True):
    lu = torch.empty(n, rank, dtype=dtype, device=dev) if rank else None
    return PreparedWeight(torch.empty(n, k // 2, dtype=torch.uint8, device=dev),
                          torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device=dev), lu,
                          torch.empty(n, device=dev) if wcscale else None, torch.empty(n, device=dev) if bias else None,
                          n, k, rank)


@pytest.fixture(autouse=True)
def _sm90():
    torch_ops.use(_lib("sm_90a"))
    yield
    torch_ops._lib = None


def test_schemas():
    assert str(torch.ops.svdq.quantize_act.default._schema) == (
        "svdq::quantize_act(Tensor x, Tensor? smooth, Tensor? lora_down) -> (Tensor, Tensor, Tensor)")
    assert str(torch.ops.svdq.gemm_w4a4.default._schema) == (
        "svdq::gemm_w4a4(Tensor act, Tensor ascales, Tensor wgt, Tensor wscales, Tensor? lora_act_in, "
        "Tensor? lora_up, Tensor? wcscale, Tensor? bias, ScalarType? out_dtype, SymInt n, SymInt k, "
        "str weight_format) -> Tensor")


@pytest.mark.parametrize("arch, scales", [("sm_90a", (77, 192)), ("sm_100a", (1, 48, 32, 4, 4))])
@pytest.mark.parametrize("rank", [0, 32])
def test_fake_quantize_act_shapes(arch, scales, rank):
    torch_ops.use(_lib(arch))
    x = torch.empty(77, 3072, dtype=torch.float16, device=META)
    ld = torch.empty(3072, rank, dtype=torch.float16, device=META) if rank else None
    act, sc, la = torch_ops.quantize_act(x, torch.empty(3072, dtype=torch.float16, device=META), ld)
    assert (act.shape, act.dtype, act.device) == ((77, 1536), torch.uint8, META)
    assert (tuple(sc.shape), sc.dtype) == (scales, torch.float8_e4m3fn)
    if rank:
        assert (la.shape, la.dtype) == ((77, rank), torch.float16)
    else:
        assert la is None


@pytest.mark.parametrize("rank, out_dtype, want", [(32, None, torch.bfloat16), (32, torch.bfloat16, torch.bfloat16),
                                                   (0, None, torch.bfloat16), (0, torch.float16, torch.float16)])
def test_fake_gemm_shapes(rank, out_dtype, want):
    w = _weight(rank=rank)
    act = torch.empty(4608, 6144, dtype=torch.uint8, device=META)
    sc = torch.empty(4608, 768, dtype=torch.float8_e4m3fn, device=META)
    la = torch.empty(4608, rank, dtype=torch.bfloat16, device=META) if rank else None
    y = torch_ops.gemm_w4a4(act, sc, w, la, out_dtype)
    assert (y.shape, y.dtype, y.device) == ((4608, 3072), want, META)


def test_opcheck_on_meta_tensors():
    x = torch.randn(64, 256, dtype=torch.bfloat16).to(META)
    ld = torch.randn(256, 16, dtype=torch.bfloat16).to(META)
    torch.library.opcheck(torch.ops.svdq.quantize_act.default, (x, None, ld))
    w = _weight(n=128, k=256, rank=16)
    act = torch.empty(64, 128, dtype=torch.uint8, device=META)
    sc = torch.empty(64, 16, dtype=torch.float8_e4m3fn, device=META)
    la = torch.empty(64, 16, dtype=torch.bfloat16, device=META)
    torch.library.opcheck(torch.ops.svdq.gemm_w4a4.default,
                          (act, sc, w.wgt, w.wscales, la, w.lora_up, w.wcscale, w.bias, None))


def test_compile_fullgraph_traces_both_ops_without_a_break():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    w = _weight(n=3072, k=3072, rank=32)

    def block(x, smooth, lora_down):
        return torch_ops.linear(x, w, smooth, lora_down) * 2

    f = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for m in (77, 4608):
        y = f(torch.empty(m, 3072, dtype=torch.bfloat16, device=META), torch.empty(3072, dtype=torch.bfloat16,
              device=META), torch.empty(3072, 32, dtype=torch.bfloat16, device=META))
        assert (y.shape, y.dtype) == ((m, 3072), torch.bfloat16)
    assert len(graphs) == 1                      # one graph, dynamic in M: no break, no recompile
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("svdq.")] == ["svdq.quantize_act", "svdq.gemm_w4a4"], targets


def test_caller_errors():
    x = torch.empty(77, 3072, dtype=torch.bfloat16, device=META)
    with pytest.raises(InvalidArgument, match=r"weight must be a PreparedWeight"):
        torch_ops.gemm_w4a4(x, x, object())
    torch_ops._lib = None
    with pytest.raises(InvalidArgument, match=r"call svdq_loader.torch_ops.use\(lib\) first"):
        torch_ops.quantize_act(torch.zeros(77, 3072, dtype=torch.bfloat16))      # a CPU tensor runs the real impl
    with pytest.raises(InvalidArgument, match=r"meta_arch 'sm_89' is not a known arch"):
        torch_ops.use(_lib("sm_90a"), meta_arch="sm_89")


def test_real_impl_refuses_cpu_tensors_through_the_library(monkeypatch):
    """A CPU tensor reaches the real implementation, whose Library refuses it with its own message."""
    calls = []
    lib = SimpleNamespace(variants=[], quantize_act=lambda x, **kw: calls.append(x) or (_ for _ in ()).throw(
        InvalidArgument("tensors must be CUDA tensors, got one on cpu")))
    torch_ops.use(lib)
    with pytest.raises(InvalidArgument, match="must be CUDA tensors, got one on cpu"):
        torch_ops.quantize_act(torch.zeros(4, 64, dtype=torch.bfloat16))
    assert len(calls) == 1


def test_import_without_torch_says_so():
    code = textwrap.dedent("""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("no torch here (blocked by the test)")
        sys.meta_path.insert(0, Block())
        from svdq_loader.errors import TorchMissing
        try:
            import svdq_loader.torch_ops
        except TorchMissing as e:
            assert "pip install 'svdq-aot[torch]'" in str(e), e
            print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "OK", r.stdout + r.stderr

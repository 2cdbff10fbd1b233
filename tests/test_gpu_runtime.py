"""The loader as a serving runtime, on the GPU: torch custom ops under torch.compile and CUDA graphs,
streams, capture, preload, launch errors, threads, and no per-call allocation.

Skipped without a GPU or artifacts (tests/gpu_env.py); `SVDQ_REQUIRE_GPU=1` turns that into a failure.
Results of the compiled, graphed, threaded and multi-stream paths must be *bit-identical* to the eager
`lib.quantize_act` -> `lib.gemm_w4a4` pipeline on the same inputs (same kernels, same inputs); that pipeline
itself is checked once against the float64 reference.  Inputs are fresh random (SEED in gpu_env).
"""
from __future__ import annotations

import ctypes
import threading
import time

import pytest

from gpu_env import ART, SEED, torch  # noqa: F401  (skips this module without a GPU or artifacts)

import svdq_loader  # noqa: E402
from svdq_loader import driver, torch_ops  # noqa: E402
from svdq_loader.errors import CaptureError  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402
from svdq_loader.weights import quantize_weight  # noqa: E402

pytestmark = pytest.mark.gpu
K, N, R = 3072, 3072, 32
BF = torch.bfloat16


@pytest.fixture(scope="module")
def lib():
    lib = svdq_loader.load(ART)
    torch_ops.use(lib)
    return lib


def _gen(seed):
    g = torch.Generator(device="cuda")
    g.manual_seed((seed * 1000003 + SEED) % 2**31)
    return g


_LOGICAL: dict = {}


@pytest.fixture(scope="module")
def layer(lib):
    """A FLUX-sized W4A4 linear (K = N = 3072, R = 32, bf16): prepared weight, smooth, lora_down."""
    g = _gen(1)
    qw = quantize_weight(torch.randn(N, K, device="cuda", generator=g))
    lora_up = (torch.randn(N, R, device="cuda", generator=g) * 0.5).to(BF)
    bias = torch.randn(N, device="cuda", generator=g)
    w = lib.prepare_weight(qw.wgt, qw.wscales, lora_up=lora_up, wcscale=qw.wcscale, bias=bias)
    _LOGICAL[id(w)] = qw             # the tensors as given (the prepared ones are in this GPU's weight format)
    smooth = (torch.rand(K, device="cuda", generator=g) + 0.5).to(BF)
    lora_down = (torch.randn(K, R, device="cuda", generator=g) / K ** 0.5).to(BF)
    return w, smooth, lora_down


def _x(m, seed):
    return (torch.randn(m, K, device="cuda", generator=_gen(seed)) * 3).to(BF)


def eager(lib, x, layer):
    w, smooth, lora_down = layer
    act, ascales, la = lib.quantize_act(x, smooth=smooth, lora_down=lora_down)
    return lib.gemm_w4a4(act, w, ascales, lora_act_in=la)


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    bad = int((a.view(torch.int16) != b.view(torch.int16)).sum())
    assert bad == 0, f"{what}: {bad} of {a.numel()} outputs differ from eager (SEED={SEED})"


def test_eager_pipeline_matches_float64(lib, layer):
    w, smooth, lora_down = layer
    x = _x(77, 2)
    act, ascales, la = lib.quantize_act(x, smooth=smooth, lora_down=lora_down)
    y = lib.gemm_w4a4(act, w, ascales, lora_act_in=la)
    qw = _LOGICAL[id(w)]
    expect = ref.reference_torch_f64(act, qw.wgt, ascales, qw.wscales, lora_act_in=la, lora_up=w.lora_up,
                                     wcscale=qw.wcscale, bias=w.bias)
    rel = float(torch.linalg.vector_norm(y.double() - expect) / torch.linalg.vector_norm(expect))
    assert rel <= 1e-2, f"relative error {rel:.3e} (SEED={SEED})"


def test_torch_ops_eager_is_the_library_call(lib, layer):
    w, smooth, lora_down = layer
    for m in (1, 77, 1000):
        x = _x(m, 3 + m)
        _same(torch_ops.linear(x, w, smooth, lora_down), eager(lib, x, layer), f"torch_ops.linear M={m}")


def test_compile_fullgraph_identical_to_eager(lib, layer):
    w, smooth, lora_down = layer

    def block(x):
        return torch_ops.linear(x, w, smooth, lora_down)

    f = torch.compile(block, fullgraph=True)
    for seed in (4, 5):
        x = _x(300, seed)
        _same(f(x), eager(lib, x, layer), "torch.compile(fullgraph=True)")


# torch's CUDA-graph tree manager captures an empty graph when it starts, and torch warns about it (the H100,
# session 40, under -W error::UserWarning)
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_reduce_overhead_identical_to_eager(lib, layer):
    w, smooth, lora_down = layer

    def block(x):
        return torch_ops.linear(x, w, smooth, lora_down)

    from torch._dynamo.utils import counters
    counters.clear()
    f = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(6, 11):        # the first runs warm up, later ones replay the CUDA graph
        x = _x(256, seed)
        _same(f(x).clone(), eager(lib, x, layer), f"mode=reduce-overhead, call {seed - 5}")
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    assert skips == 0, f"inductor did not use CUDA graphs ({skips} skips)"


def test_two_streams_respect_their_ordering(lib, layer):
    """Each stream first sleeps, then writes its input, then runs the operators: a launch that ignored the
    current stream would read the input before it is written."""
    xs = [_x(512, 20), _x(512, 21)]
    want = [eager(lib, x, layer) for x in xs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bufs = [torch.zeros_like(x) for x in xs]
    ys = [None, None]
    torch.cuda.synchronize()
    for i, s in enumerate(streams):
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            bufs[i].copy_(xs[i])
            ys[i] = eager(lib, bufs[i], layer)
    torch.cuda.synchronize()
    for i in range(2):
        _same(ys[i], want[i], f"stream {i}")


def test_cuda_graph_capture_and_replay(lib, layer):
    xbuf = _x(200, 30)
    eager(lib, xbuf, layer)                      # loads the kernels before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = eager(lib, xbuf, layer)
    for seed in (31, 32, 33):
        x = _x(200, seed)
        xbuf.copy_(x)
        g.replay()
        torch.cuda.synchronize()
        _same(y.clone(), eager(lib, x, layer), f"graph replay {seed}")


# The first capture is aborted by design before anything is recorded, which torch reports as an empty graph.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_a_kernel_load_during_capture_raises_then_preload_fixes_it(layer):
    fresh = svdq_loader.load(ART)                 # nothing loaded yet
    x = _x(64, 40)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match=r"is not loaded on device 0 yet and a CUDA graph is being captured; "
                                           r"call lib.preload\(\)"):
        with torch.cuda.graph(g):
            eager(fresh, x, layer)
    torch.cuda.synchronize()                      # the context survived the aborted capture
    assert torch.ones(8, device="cuda").sum().item() == 8
    fresh.preload()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = eager(fresh, x, layer)
    y.fill_(float("nan"))                         # poisoned: only the replay can make it right
    g.replay()
    torch.cuda.synchronize()
    _same(y, eager(fresh, x, layer), "capture after preload")


def test_preload_loads_every_variant_of_this_device(layer):
    fresh = svdq_loader.load(ART)
    arch = driver.device_arch(torch.cuda.current_device())
    mine = sorted(v.name for v in fresh.variants if v.arch == arch)
    assert mine, f"no {arch} variants in {ART}"
    assert fresh.preload() == len(mine)
    assert sorted(name for name, _ in fresh._launchers) == mine
    assert fresh.warmup(torch.device("cuda", torch.cuda.current_device())) == len(mine)
    assert len(fresh._launchers) == len(mine)     # nothing loaded twice


def test_a_failing_launch_names_variant_and_driver_error_and_the_context_survives(lib, layer):
    from svdq_loader.driver import CUlaunchConfigRaw, CudaError
    x = _x(128, 50)
    want = eager(lib, x, layer)
    torch.cuda.synchronize()
    arch = lib._device_arch(torch.cuda.current_device())       # the artifacts hold several archs
    name = lib.choose("gemm_w4a4", arch, m=128, n=N, k=K, rank=R, dtype="bf16").name
    ln = lib._launchers[(name, torch.cuda.current_device())]
    real = ln._fn

    def bad_block(cfg_addr, func, kp, extra):    # the same launch with 4096 threads per block: the driver refuses
        cfg = CUlaunchConfigRaw.from_buffer_copy(CUlaunchConfigRaw.from_address(cfg_addr))
        cfg.blockDimX = 4096
        return real(ctypes.addressof(cfg), func, kp, extra)

    ln._fn = bad_block
    try:
        with pytest.raises(CudaError, match=rf"{name}: cuLaunchKernelEx\(\S+\) failed: CUDA_ERROR_[A-Z_]+ \(\d+\)"):
            eager(lib, x, layer)
    finally:
        ln._fn = real
    torch.cuda.synchronize()
    _same(eager(lib, x, layer), want, "after a failed launch")


@pytest.mark.parametrize("m", [200, 333])
def test_no_device_allocation_per_call_besides_outputs(lib, layer, m):
    """With every output given, a call allocates nothing, except the decode pre-pass's workspace of a GEMM form
    fed by it (act_source images: one allocation per call from torch's allocator, docs/design.md section 4).
    M = 200 runs a one-launch form, M = 333 (where configs/flux.yaml builds it) the two-way split images tile."""
    w, smooth, lora_down = layer
    x = _x(m, 60)
    act, ascales, la = lib.quantize_act(x, smooth=smooth, lora_down=lora_down)
    out = lib.gemm_w4a4(act, w, ascales, lora_act_in=la)
    torch.cuda.synchronize()
    chosen = lib.explain("gemm_w4a4", "sm_90a", m=m, n=N, k=K, rank=R, dtype="bf16",
                         sm_count=torch.cuda.get_device_properties(0).multi_processor_count).chosen
    work = 1 if chosen.knobs.get("act_source") == "images" else 0

    def allocs():
        return torch.cuda.memory_stats()["allocation.all.allocated"]

    a0 = allocs()
    for _ in range(200):
        lib.quantize_act(x, smooth=smooth, lora_down=lora_down, out_act=act, out_scales=ascales, out_lora=la)
        lib.gemm_w4a4(act, w, ascales, lora_act_in=la, out=out)
    torch.cuda.synchronize()
    assert allocs() - a0 == 200 * work, (f"a call with every output given allocated device memory beyond the "
                                         f"{work} workspace(s) of {chosen.name}")
    a0 = allocs()
    for _ in range(50):
        a, s, l_ = lib.quantize_act(x, smooth=smooth, lora_down=lora_down)
        lib.gemm_w4a4(a, w, s, lora_act_in=l_)
    torch.cuda.synchronize()
    assert allocs() - a0 == 50 * (4 + work), "expected exactly the 4 outputs per pair of calls (and the workspace)"


@pytest.mark.parametrize("streams", ["shared", "separate"])
def test_threads_with_simultaneous_cache_misses(layer, streams):
    """8 threads on a fresh library start together (a barrier) on Ms no one has run: every first call of
    every thread is a selection and load miss at once.  Bounded to about 6 s per mode."""
    fresh = svdq_loader.load(ART)
    base = svdq_loader.load(ART)
    nthreads, deadline = 8, time.monotonic() + 6
    ms = {t: [1 + t, 77 + 13 * t, 1000 + 7 * t, 64 * (t + 1)] for t in range(nthreads)}
    xs = {m: _x(m, 70 + m) for t in ms for m in ms[t]}
    want = {m: eager(base, x, layer) for m, x in xs.items()}
    torch.cuda.synchronize()
    barrier = threading.Barrier(nthreads)
    errors, counts = [], [0] * nthreads

    def work(t):
        try:
            s = torch.cuda.Stream() if streams == "separate" else torch.cuda.current_stream()
            with torch.cuda.stream(s):
                barrier.wait()
                while True:
                    for m in ms[t]:
                        y = eager(fresh, xs[m], layer)
                        s.synchronize()
                        if not torch.equal(y.view(torch.int16), want[m].view(torch.int16)):
                            errors.append(f"thread {t} M={m}: output differs")
                        counts[t] += 1
                    if time.monotonic() > deadline or errors:
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors[:5]
    assert min(counts) >= len(ms[0]), counts
    names = [n for n, _ in fresh._launchers]
    assert len(names) == len(set(names))

"""`svdq-aot bench`: time the loader's operators on this GPU against same-run baselines.

    svdq-aot bench artifacts --config configs/flux.yaml --json bench.json --table bench.md --plot bench.png
    python -m svdq_loader.testing.bench --quick              (smoke run: a few shapes, few reps)

gemm_w4a4, for every (M, K, N): our kernel, cuBLAS in the 16-bit dtype
(torch.matmul [M,K]x[K,N]), cuBLAS FP8 per-tensor (torch._scaled_mm, scales
1.0), the unfused eager torch W4A4 pipeline (dequantize both operands,
matmul, epilogue) and torch.compile of it, all on the same M, K, N in the same
process.  TFLOP/s = 2·M·N·K / time (LoRA flops not counted).

linear (``--op linear``), for every (M, K, N): a whole W4A4 linear as a model
runs it -- quantize_act on 16-bit activations, then gemm_w4a4 -- against
cuBLAS on the 16-bit operands (the layer it replaces) and the same linear in
eager torch and torch.compile (``svdq_loader.testing.bench_linear``).

quantize_act, for every (M, K): our kernel against the same math in plain torch
(eager and torch.compile), as GB/s of the bytes it must move, and as a
fraction of two copy rates measured in this run: a 1 GiB device-to-device
copy (the device's sustained rate), and a streaming kernel that moves the
op's own bytes over as many rotating buffers, timed as the op is (what a
kernel of that size can reach).

Method: medians of CUDA-event timings after warm-up; each timed sample is a
CUDA graph of several calls (plain launches in a loop where capture fails)
cycling over enough copies of the per-call inputs and outputs (weights
included: a linear's weights are not L2-resident in a model) that one pass
over them moves more than twice the L2 size.  A baseline is timed once per
row; where one shape's rows (its exact and FP8 rows) timed it more than once,
each row also gives ours against the fastest of those timings (JSON:
speedup_vs_fastest), the conservative ratio.  Host cost: back-to-back calls
on a tiny problem without synchronising, in µs per call, next to
torch.matmul of the same size.

Exit codes: 0 done, 1 some case failed (see the errors), 2 no GPU or no artifacts.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

FLUX_SHAPES = [("qkv", 3072, 9216), ("attn_out", 3072, 3072), ("mlp_fc1", 3072, 12288),
               ("mlp_fc2", 12288, 3072), ("single_fused", 3072, 21504), ("single_out", 15360, 3072)]
GEMM_M = [16, 64, 256, 1024, 4608, 9728]
QUANT_M = [4608]
QUICK_M = [256, 4608]
BASELINES = {
    "dense": "cuBLAS in the 16-bit dtype: torch.matmul [M,K]x[K,N] (gemm_w4a4, linear)",
    "fp8": "cuBLAS FP8 per-tensor: torch._scaled_mm, e4m3 operands, scales 1.0 (gemm_w4a4)",
    "eager": "the same math in plain eager torch (every op; for the GEMM: dequantize + matmul + epilogue)",
    "compile": "torch.compile of the eager version (every op)",
}
GEMM_BASELINES = ("dense", "fp8", "eager", "compile")
QUANT_BASELINES = ("eager", "compile")
LABELS = {"dense": "cuBLAS {dtype}", "fp8": "cuBLAS fp8", "eager": "eager torch", "compile": "torch.compile"}
MAX_SETS = 64          # input copies per case, at most
MAX_CALLS = 512        # calls per timed sample (graph), at most
CHECK_TOL = 2e-2       # relative error vs the eager pipeline above which a GEMM result is flagged
#: the same for the FP8-compute mode, whose distance from the exact operator is one E4M3 rounding per operand
#: (about 3.5 % of the main product on these inputs: docs/design.md section 2); the check then records that distance
FP8_CHECK_TOL = 6e-2


@dataclass
class Settings:
    reps: int = 20              # timed samples per measurement (median taken)
    warmup: int = 3             # untimed passes over the input sets first
    target_ms: float = 2.0      # wanted length of one timed sample
    host_calls: int = 2000      # calls per host-cost batch
    host_batches: int = 7
    copy_mib: int = 1024        # size of the copy-bandwidth buffer (read + write = 2x this)
    graphs: bool = True


QUICK = Settings(reps=5, warmup=2, target_ms=1.0, host_calls=300, host_batches=3, copy_mib=256)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _choice_list(allowed):
    def parse(text: str) -> list[str]:
        vals = [v.strip() for v in text.split(",") if v.strip()]
        if vals == ["all"]:
            return list(allowed)
        if vals == ["none"]:
            return []
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(allowed)}")
        return vals
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="svdq-aot bench", description=__doc__,
        epilog="baselines (--baselines):\n" + "\n".join(f"  {k:8s} {v}" for k, v in BASELINES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts_dir", nargs="?", metavar="ARTIFACTS",
                    help="directory holding manifest.json and the cubins (default: --artifacts, else artifacts)")
    ap.add_argument("--artifacts", default="artifacts", metavar="DIR",
                    help="the same directory as an option (default: %(default)s)")
    ap.add_argument("--config", metavar="YAML",
                    help="take the (K, N) shapes from this build config (keys shapes.NAME.{k,n}); "
                         "default: the six FLUX.1 linears")
    ap.add_argument("--op", choices=["gemm_w4a4", "quantize_act", "linear", "all"], default="all",
                    help="what to time: one operator, the whole linear (quantize_act then gemm_w4a4, from 16-bit "
                         "activations), or all three (default: %(default)s)")
    ap.add_argument("--m", type=_int_list, metavar="LIST",
                    help="token counts M for gemm_w4a4 and linear (default: " + ",".join(map(str, GEMM_M))
                         + "; with --quick: " + ",".join(map(str, QUICK_M)) + ")")
    ap.add_argument("--quant-m", type=_int_list, metavar="LIST",
                    help="token counts M for quantize_act (default: " + ",".join(map(str, QUANT_M)) + ")")
    ap.add_argument("--smoothing", type=_choice_list(SMOOTHINGS), default=list(SMOOTHINGS), metavar="LIST",
                    help="quantize_act's smoothing forms, comma-separated from " + ",".join(SMOOTHINGS) + ": the "
                         "factors (smooth=), or their reciprocals made once (smooth_rcp=, what a model's layer "
                         "passes); each gets its own row (default: both)")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank R, 0 for none (default: %(default)s)")
    ap.add_argument("--compute", type=_choice_list(("exact", "fp8")), default=["exact"], metavar="LIST",
                    help="compute modes of the gemm_w4a4 and linear cases and of the host cost, comma-separated "
                         "from exact,fp8 (default: exact; fp8 is the FP8-compute mode, op gemm_w4a4_fp8, sm_90a: "
                         "docs/design.md section 2; its GEMM is timed from quantize_act's E4M3 activation, and from "
                         "an NVFP4 one beside it)")
    ap.add_argument("--dtype", type=_choice_list(("bf16", "fp16")), default=["bf16", "fp16"], metavar="LIST",
                    help="activation/output dtypes, comma-separated from bf16,fp16 (default: both)")
    ap.add_argument("--baselines", type=_choice_list(tuple(BASELINES)), default=list(BASELINES), metavar="LIST",
                    help="comma-separated from " + ",".join(BASELINES) + ", or all / none (default: all)")
    ap.add_argument("--json", metavar="FILE", help="write every number (and the environment) as JSON here")
    ap.add_argument("--table", metavar="FILE.md", help="also write the markdown tables here (always printed)")
    ap.add_argument("--plot", metavar="FILE.png", help="bar chart of ours against each baseline (needs matplotlib)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: two shapes, M in " + ",".join(map(str, QUICK_M)) + ", fewer repetitions")
    ap.add_argument("--no-graphs", action="store_true",
                    help="time plain launches in a loop instead of CUDA graphs (for debugging)")
    return ap


def load_shapes(path: str | None) -> list[tuple[str, int, int]]:
    """(name, K, N) of every shape in a build config, or the FLUX.1 set."""
    if not path:
        return list(FLUX_SHAPES)
    import yaml
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    shapes = doc.get("shapes") if isinstance(doc, dict) else None
    if not isinstance(shapes, dict) or not shapes:
        raise ValueError(f"{path}: no 'shapes' mapping (expected shapes.NAME: {{k: K, n: N}})")
    out = []
    for name, s in shapes.items():
        try:
            out.append((str(name), int(s["k"]), int(s["n"])))
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: shapes.{name} must be a mapping with integer k and n, got {s!r}") from None
    return out


def quick_shapes(shapes):
    """The first shape and the one with the largest K (both aspect ratios of a FLUX block)."""
    first, deep = shapes[0], max(shapes, key=lambda s: (s[1], -s[2]))
    return [first] if deep == first else [first, deep]


# ---------------------------------------------------------------------------
# Timing (torch imported lazily: the module loads on a CPU-only box)
# ---------------------------------------------------------------------------

#: Milliseconds of dense matmuls run before the first timing of a process, so that no timing includes the GPU's
#: way up from idle (its clock, the first launches); each case's own warm-up passes then only warm its inputs
WARMUP_MS = 300.0


def warm_gpu(ms: float = WARMUP_MS) -> float:
    """Keep the current GPU busy with bf16 matmuls for about `ms` milliseconds (wall clock) so that later
    timings run at the clock the GPU holds under load; returns the milliseconds spent."""
    import torch
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(4):
            torch.matmul(a, a, out=c)
        torch.cuda.synchronize()
    del a, c
    return (time.perf_counter() - t0) * 1e3


def n_sets_for(bytes_per_set: int, l2_bytes: int) -> int:
    """Fewest input copies whose one pass moves more than 2x the L2."""
    return max(1, min(MAX_SETS, 2 * l2_bytes // max(1, bytes_per_set) + 1))


def time_calls(fn, n_sets: int, st: Settings) -> dict:
    """Median device time per call of fn(i), i cycling over range(n_sets)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                    # warm-up off the default stream, as torch's graph docs do
        for _ in range(st.warmup):
            for i in range(n_sets):
                fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for i in range(n_sets):
        fn(i)
    e1.record()
    e1.synchronize()
    est_ms = max(e0.elapsed_time(e1) / n_sets, 1e-3)
    passes = max(1, min(math.ceil(st.target_ms / (est_ms * n_sets)), MAX_CALLS // n_sets))
    calls = passes * n_sets

    def loop():
        for j in range(calls):
            fn(j % n_sets)

    run, method, note, graph = loop, "loop", None, None
    if st.graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loop()
            graph.replay()
            torch.cuda.synchronize()
            run, method = graph.replay, "graph"
        except Exception as exc:  # noqa: BLE001 - any capture failure means: time plain launches
            note = f"graph capture failed ({type(exc).__name__}: {_first_line(exc)}); timed plain launches"
            graph = None
            torch.cuda.synchronize()
    if method == "loop":
        loop()
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(st.reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(st.reps)]
    for a, b in zip(starts, ends):
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    per_call = sorted(a.elapsed_time(b) * 1e3 / calls for a, b in zip(starts, ends))
    del graph
    out = dict(us=statistics.median(per_call), min_us=per_call[0], max_us=per_call[-1], method=method,
               sets=n_sets, calls_per_sample=calls, samples=st.reps)
    if note:
        out["note"] = note
    return out


def host_us_per_call(fn, st: Settings) -> dict:
    """CPU time per call of fn() over back-to-back calls with no synchronisation in the loop."""
    return host_us_interleaved({"fn": fn}, st)["fn"]


def host_us_interleaved(fns: dict, st: Settings, *, clock=time.perf_counter, sync=None) -> dict:
    """CPU time per call of each of `fns` ({name: fn}) over back-to-back calls with no synchronisation in the loop,
    their batches interleaved: batch b of every fn runs before batch b + 1 of any, each batch starting at the next
    fn in turn, so that a slow spell of the host (another process, the clock) falls on all of them alike and their
    ratio stays meaningful.  Returns {name: dict(us=median over batches, min_us, calls, batches)}."""
    if sync is None:
        import torch
        sync = torch.cuda.synchronize
    items = list(fns.items())
    for _, fn in items:
        for _ in range(min(200, st.host_calls)):
            fn()
    sync()
    samples = {name: [] for name, _ in items}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for b in range(st.host_batches):
            for j in range(len(items)):
                name, fn = items[(b + j) % len(items)]
                sync()
                t0 = clock()
                for _ in range(st.host_calls):
                    fn()
                samples[name].append((clock() - t0) / st.host_calls * 1e6)
    finally:
        if gc_was:
            gc.enable()
    sync()
    out = {}
    for name, v in samples.items():
        v.sort()
        out[name] = dict(us=statistics.median(v), min_us=v[0], calls=st.host_calls, batches=st.host_batches)
    return out


def _first_line(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


_SKIP_NAMES = {"UnsupportedProblem", "InvalidArgument"}


def is_unsupported(exc: BaseException) -> bool:
    """True for the loader's refusal of a problem (skip the case), False for a real failure.

    A refusal is an exception class named UnsupportedProblem / InvalidArgument
    (from svdq_loader.errors or anywhere in the loader), or, where there is
    no svdq_loader.errors module, a ValueError raised by svdq_loader's own
    code (not by its testing helpers).
    """
    try:
        from svdq_loader import errors
        known = tuple(getattr(errors, n) for n in _SKIP_NAMES if hasattr(errors, n))
    except ImportError:
        known = ()
    if isinstance(exc, known) or any(c.__name__ in _SKIP_NAMES for c in type(exc).__mro__):
        return True
    if not known and isinstance(exc, ValueError) and exc.__traceback__ is not None:
        import svdq_loader
        root = os.path.dirname(os.path.abspath(svdq_loader.__file__))
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        where = os.path.abspath(tb.tb_frame.f_code.co_filename)
        return where.startswith(root + os.sep) and not where.startswith(os.path.join(root, "testing") + os.sep)
    return False


def _clone(t):
    return None if t is None else t.clone()


def gemm_input_sets(p: dict, m: int, k: int, n: int, rank: int, l2: int) -> list[dict]:
    """`p` (a `reference.random_problem`) and enough copies of it that one pass over them moves more than
    twice the L2: act, scales, weights, LoRA, affine and the output counted."""
    per_set = m * k // 2 + m * k // 16 + n * k // 2 + n * k // 16 + 2 * rank * (m + n) + 8 * n + 2 * m * n
    return [p] + [{key: _clone(v) for key, v in p.items()} for _ in range(n_sets_for(per_set, l2) - 1)]


def _free():
    import torch
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

def _dtype(name):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def tflops(m, n, k, us):
    return 2.0 * m * n * k / (us * 1e-6) / 1e12


def gemm_case(lib, m, k, n, rank, dtype, baselines, st, l2, compute="exact") -> dict:
    import torch
    from . import reference as ref
    from . import torch_quant as tq
    tdt = _dtype(dtype)
    res = dict(op="gemm_w4a4_fp8" if compute == "fp8" else "gemm_w4a4", m=m, k=k, n=n, rank=rank, dtype=dtype,
               compute=compute)
    p = ref.random_problem(m, n, k, rank, seed=(m * 7919 + k * 31 + n) % 2**31, out_dtype=dtype, device="cuda")
    sets = gemm_input_sets(p, m, k, n, rank, l2)
    outs = [torch.empty(m, n, dtype=tdt, device="cuda") for _ in sets]
    side = {}                               # the FP8 mode's call from NVFP4, timed beside its GEMM

    def setup():
        kw = {} if compute == "exact" else dict(compute=compute)
        ws = [lib.prepare_weight(q["wgt"], q["wscales"], lora_up=q["lora_up"], wcscale=q["wcscale"], bias=q["bias"],
                                 **kw) for q in sets]

        def from_nvfp4(i):
            q = sets[i]
            lib.gemm_w4a4(q["act"], ws[i], q["ascales"], lora_act_in=q["lora_act_in"], out=outs[i])
        if compute == "exact":
            return from_nvfp4
        # the FP8-compute mode's GEMM takes quantize_act(..., compute="fp8")'s E4M3 activation (an E4m3Act);
        # the call from NVFP4 (act_fp8 first, then the GEMM) is timed beside it (`res["ours_from_nvfp4"]`)
        a8 = [lib.act_to_fp8(q["act"], q["ascales"]) for q in sets]
        side["from_nvfp4"] = from_nvfp4

        def ours(i):
            lib.gemm_w4a4(a8[i], ws[i], None, lora_act_in=sets[i]["lora_act_in"], out=outs[i])
        return ours

    ours, skipped = first_call_or_skip(res, setup)
    if skipped:
        return skipped
    lut = tq.e2m1_lut(tdt, "cuda")

    def unfused(f):
        def call(i):
            q = sets[i]
            return f(q["act"], q["ascales"], q["wgt"], q["wscales"], q["lora_act_in"], q["lora_up"], q["wcscale"],
                     q["bias"], tdt, lut=lut)
        return call

    want = unfused(tq.w4a4_unfused)(0).float()      # result check against the eager pipeline
    got = outs[0].float()
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    tol = FP8_CHECK_TOL if compute == "fp8" else CHECK_TOL
    res["check"] = dict(rel_err_vs_eager=rel, ok=bool(rel < tol and torch.isfinite(got).all()))
    del want, got
    timers = {"dense": lambda: _dense_case(m, k, n, tdt, st, l2), "fp8": lambda: _fp8_case(m, k, n, tdt, st, l2),
              "eager": lambda: time_calls(unfused(tq.w4a4_unfused), len(sets), st),
              "compile": lambda: time_calls(unfused(tq.compiled(tq.w4a4_unfused)), len(sets), st)}
    from_nvfp4 = side.get("from_nvfp4")
    if from_nvfp4 is not None:
        from_nvfp4(0)                    # the same kernels on the same values: the same output, bit for bit
        torch.cuda.synchronize()
        got = outs[0].clone()
        outs[0].fill_(float("nan"))
        ours(0)
        torch.cuda.synchronize()
        same = bool(torch.equal(got, outs[0]))
        res["check"]["e4m3_equals_nvfp4_call"] = same
        res["check"]["ok"] = res["check"]["ok"] and same
        res["ours_from_nvfp4"] = time_calls(from_nvfp4, len(sets), st)
        res["ours_from_nvfp4"]["tflops"] = tflops(m, n, k, res["ours_from_nvfp4"]["us"])
    return time_against(res, ours, len(sets), st, (m, n, k), {b: timers[b] for b in baselines if b in timers})


def first_call_or_skip(res: dict, setup):
    """(ours, None) after one synchronised call of the case's `ours = setup()`, or (None, the case skipped) where
    the loader refuses the problem as unsupported; any other failure propagates."""
    import torch
    try:
        ours = setup()
        ours(0)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        if is_unsupported(exc):
            return None, dict(res, skipped=f"{type(exc).__name__}: {_first_line(exc)}")
        raise
    return ours, None


def time_against(res: dict, ours, n_sets: int, st: Settings, mnk: tuple, timers: dict) -> dict:
    """`res` with our time and TFLOP/s, and each baseline's (timers: name -> () -> time_calls dict), ours× =
    our throughput over the baseline's; a failing baseline is recorded, not raised."""
    res["ours"] = time_calls(ours, n_sets, st)
    res["ours"]["tflops"] = tflops(*mnk, res["ours"]["us"])
    base = {}
    for name, timer in timers.items():
        try:
            b = timer()
            b["tflops"] = tflops(*mnk, b["us"])
            b["speedup"] = b["us"] / res["ours"]["us"]       # ours / baseline in throughput
        except Exception as exc:  # noqa: BLE001 - one baseline failing must not lose the case
            b = dict(error=f"{type(exc).__name__}: {_first_line(exc)}")
        base[name] = b
        _free()
    res["baselines"] = base
    return res


def _dense_case(m, k, n, tdt, st, l2):
    import torch
    a = torch.randn(m, k, device="cuda").to(tdt)
    b = (torch.randn(k, n, device="cuda") / math.sqrt(k)).to(tdt)
    ns = n_sets_for(2 * (m * k + k * n + m * n), l2)
    A, B = [a] + [a.clone() for _ in range(ns - 1)], [b] + [b.clone() for _ in range(ns - 1)]
    Y = [torch.empty(m, n, dtype=tdt, device="cuda") for _ in range(ns)]
    return time_calls(lambda i: torch.matmul(A[i], B[i], out=Y[i]), ns, st)


def _fp8_case(m, k, n, tdt, st, l2):
    import torch
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)     # row-major [N, K]; .t() is column-major
    one = torch.ones((), dtype=torch.float32, device="cuda")
    ns = n_sets_for(m * k + n * k + 2 * m * n, l2)
    A, B = [a] + [a.clone() for _ in range(ns - 1)], [b] + [b.clone() for _ in range(ns - 1)]
    return time_calls(lambda i: torch._scaled_mm(A[i], B[i].t(), scale_a=one, scale_b=one, out_dtype=tdt), ns, st)


def quant_bytes(m, k, rank) -> int:
    """Bytes quantize_act must move: x, act, scales, lora_act_in, smooth, lora_down (16-bit dtypes)."""
    return m * k * 2 + m * k // 2 + m * k // 16 + m * rank * 2 + k * 2 + k * rank * 2


def _quant_inputs(m, k, rank, tdt, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(tdt)
    smooth = (torch.rand(k, device="cuda", generator=g) * 1.5 + 0.5).to(tdt)
    lora_down = (torch.randn(k, rank, device="cuda", generator=g) / math.sqrt(k)).to(tdt) if rank else None
    return x, smooth, lora_down


#: quantize_act's two ways to smooth (`--smoothing`): the factors (the kernel makes their reciprocals each step), or
#: the reciprocals made once (``smooth_rcp``, what a model's layer holds); the same result bit for bit
SMOOTHINGS = ("smooth", "smooth_rcp")


def quant_case(lib, m, k, rank, dtype, baselines, st, l2, copy_gbps, smoothing="smooth") -> dict:
    """One quantize_act row: `smoothing` "smooth" passes the factors, "smooth_rcp" their reciprocals (made before
    the timing, as a layer makes them once), to ours and to the torch baselines alike (x * rs instead of x times
    1 / smooth rounded); both are checked against the torch version from the factors."""
    import torch
    from . import torch_quant as tq
    tdt = _dtype(dtype)
    nbytes = quant_bytes(m, k, rank)
    res = dict(op="quantize_act", m=m, k=k, rank=rank, dtype=dtype, smooth=True, smoothing=smoothing, bytes=nbytes)
    if not hasattr(lib, "quantize_act"):
        return dict(res, skipped="this svdq_loader has no quantize_act")
    x, smooth, ld = _quant_inputs(m, k, rank, tdt, seed=m + k)
    rcp = smoothing == "smooth_rcp"
    if rcp and not hasattr(lib, "smooth_reciprocals"):
        return dict(res, skipped="this svdq_loader has no smooth_rcp")
    s0 = lib.smooth_reciprocals(smooth) if rcp else smooth
    ns = n_sets_for(nbytes, l2)
    X = [x] + [x.clone() for _ in range(ns - 1)]
    S = [s0] + [s0.clone() for _ in range(ns - 1)]
    L = [ld] + [_clone(ld) for _ in range(ns - 1)]
    key = "smooth_rcp" if rcp else "smooth"
    try:
        act, sc, la = lib.quantize_act(x, lora_down=ld, **{key: s0})
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        if is_unsupported(exc):
            return dict(res, skipped=f"{type(exc).__name__}: {_first_line(exc)}")
        raise
    OA = [torch.empty_like(act) for _ in range(ns)]
    OS = [torch.empty_like(sc) for _ in range(ns)]
    OL = [None if la is None else torch.empty_like(la) for _ in range(ns)]

    def ours(i):
        lib.quantize_act(X[i], lora_down=L[i], out_act=OA[i], out_scales=OS[i], out_lora=OL[i], **{key: S[i]})

    # result check against the torch version from the factors (the scale layout must be the logical one to compare)
    r_act, r_sc, r_la = tq.quantize_act(x, smooth, ld)
    chk = dict(act_bytes_equal=float((act == r_act).float().mean()) if act.shape == r_act.shape else None,
               scales_equal=float((sc.view(torch.uint8) == r_sc.view(torch.uint8)).float().mean())
               if sc.shape == r_sc.shape else None)
    if la is not None:
        chk["lora_rel_err"] = float((la.float() - r_la.float()).norm() / r_la.float().norm().clamp_min(1e-30))
    res["check"] = chk
    del act, sc, la, r_act, r_sc, r_la
    res["ours"] = _bw(time_calls(ours, ns, st), nbytes, copy_gbps)
    res["floor_us"] = nbytes / (copy_gbps * 1e3) if copy_gbps else None
    res["copy_same"] = same_size_copy(nbytes, ns, st)
    res["ours"]["frac_copy_same"] = res["copy_same"]["us"] / res["ours"]["us"]
    base = {}
    for name in baselines:
        if name not in QUANT_BASELINES:
            continue
        f = tq.quantize_act if name == "eager" else tq.compiled(tq.quantize_act)
        try:
            fi = (lambda i: f(X[i], None, L[i], S[i])) if rcp else (lambda i: f(X[i], S[i], L[i]))
            b = _bw(time_calls(fi, ns, st), nbytes, copy_gbps)
            b["speedup"] = b["us"] / res["ours"]["us"]
        except Exception as exc:  # noqa: BLE001
            b = dict(error=f"{type(exc).__name__}: {_first_line(exc)}")
        base[name] = b
        _free()
    res["baselines"] = base
    return res


def _bw(t: dict, nbytes: int, copy_gbps) -> dict:
    t["gbps"] = nbytes / (t["us"] * 1e3)
    t["frac_copy"] = t["gbps"] / copy_gbps if copy_gbps else None
    return t


def copy_bandwidth(st: Settings) -> dict:
    """Device-to-device copy rate, counting the bytes read plus the bytes written.

    Timed as plain launches: captured in a CUDA graph, a copy of 1 GiB or
    more ran at about 2.8 TB/s on an H200 against 4.25 TB/s launched
    directly (probably a copy-engine memcpy node instead of the copy kernel).
    """
    import torch
    nbytes = st.copy_mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    t = time_calls(lambda i: dst.copy_(src), 1, Settings(reps=max(5, st.reps // 2), warmup=2, target_ms=10.0,
                                                          graphs=False))
    del src, dst
    _free()
    return dict(gbps=2 * nbytes / (t["us"] * 1e3), bytes_moved=2 * nbytes, us=t["us"])


def same_size_copy(nbytes: int, n_sets: int, st: Settings) -> dict:
    """What a streaming kernel that moves `nbytes` (nbytes / 2 read, nbytes / 2 written) takes on this device,
    cycling over `n_sets` buffer pairs as the op's case cycles over its inputs (so neither is L2-resident).  The
    kernel is torch's elementwise ``bitwise_not`` on int32 words, timed like the op (CUDA graphs): a plain
    ``copy_`` would be a memcpy, which a graph turns into a copy-engine node (slower), and which launched
    directly is bound by the host's dispatch below about 40 MB.  {us, gbps}."""
    import torch
    words = max(4, nbytes // 2 // 4)
    src = [torch.randint(0, 2 ** 31 - 1, (words,), dtype=torch.int32, device="cuda") for _ in range(n_sets)]
    dst = [torch.empty_like(b) for b in src]
    t = time_calls(lambda i: torch.bitwise_not(src[i], out=dst[i]), n_sets, st)
    del src, dst
    _free()
    return dict(us=t["us"], gbps=2 * 4 * words / (t["us"] * 1e3), method=t.get("method"))


# ---------------------------------------------------------------------------
# Host cost
# ---------------------------------------------------------------------------

def _tiny_gemm(lib, rank, dtype, shapes, compute="exact"):
    """A tiny GEMM the artifacts serve: M=16, K=N=128 first, then the manifest's and the config's shapes.  In the
    FP8-compute mode, from an E4m3Act (what a model's calls take)."""
    import torch
    from . import reference as ref
    cands = [(128, 128)]
    cands += sorted({(s.k, s.n) for s in getattr(lib.manifest, "shapes", ())}, key=lambda s: s[0] * s[1])
    cands += sorted({(k, n) for _, k, n in shapes}, key=lambda s: s[0] * s[1])
    reasons = []
    for k, n in dict.fromkeys(cands):
        p = ref.random_problem(16, n, k, rank, seed=1, out_dtype=dtype, device="cuda")
        out = torch.empty(16, n, dtype=_dtype(dtype), device="cuda")
        try:
            kw = {} if compute == "exact" else dict(compute=compute)
            w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"],
                                   **kw)
            act, sc = (p["act"], p["ascales"]) if compute == "exact" else (lib.act_to_fp8(p["act"], p["ascales"]),
                                                                             None)

            def call(act=act, sc=sc, p=p, w=w, out=out):
                lib.gemm_w4a4(act, w, sc, lora_act_in=p["lora_act_in"], out=out)
            call()
            torch.cuda.synchronize()
            return k, n, call, None
        except Exception as exc:  # noqa: BLE001
            if not is_unsupported(exc):
                raise
            reasons.append(f"K={k} N={n}: {_first_line(exc)}")
    return None, None, None, "; ".join(reasons[:3]) or "no candidate shape"


def _tiny_quant(lib, rank, dtype, shapes, compute="exact"):
    import torch
    if not hasattr(lib, "quantize_act"):
        return None, None, "this svdq_loader has no quantize_act"
    ks = [128] + sorted({s.k for s in getattr(lib.manifest, "shapes", ())}) + sorted({k for _, k, _ in shapes})
    reasons = []
    for k in dict.fromkeys(ks):
        x, smooth, ld = _quant_inputs(16, k, rank, _dtype(dtype))
        try:
            kw = {} if compute == "exact" else dict(compute=compute)
            act, sc, la = lib.quantize_act(x, smooth=smooth, lora_down=ld, **kw)

            def call(x=x, smooth=smooth, ld=ld, act=act, sc=sc, la=la):
                lib.quantize_act(x, smooth=smooth, lora_down=ld, out_act=act, out_scales=sc, out_lora=la, **kw)
            call()
            torch.cuda.synchronize()
            return k, call, None
        except Exception as exc:  # noqa: BLE001
            if not is_unsupported(exc):
                raise
            reasons.append(f"K={k}: {_first_line(exc)}")
    return None, None, "; ".join(reasons[:3]) or "no candidate shape"


def host_costs(lib, ops, rank, dtype, shapes, st, computes=("exact",)) -> list[dict]:
    """µs per call of our ops and of torch.matmul / x.float() of the same size (tiny, cached problems), in each
    compute mode of `computes` (the FP8-compute mode: its GEMM from an E4m3Act, its two-kernel quantize_act)."""
    import torch
    tdt = _dtype(dtype)
    rows = []

    def measure(op, call, size, ref_k, ref_n, extra=()):
        gpu = time_calls(lambda i: call(), 1, Settings(reps=5, warmup=2, target_ms=1.0))
        a = torch.randn(16, ref_k, device="cuda").to(tdt)
        b = torch.randn(ref_k, ref_n, device="cuda").to(tdt)
        y = torch.empty(16, ref_n, dtype=tdt, device="cuda")
        fns = {op: call, "torch.matmul": lambda: torch.matmul(a, b),
               "torch.matmul(out=)": lambda: torch.matmul(a, b, out=y)}
        for label, fn in extra:
            fns[label] = lambda fn=fn, a=a: fn(a)
        timed = host_us_interleaved(fns, st)          # ours and the references in alternating batches
        own = timed.pop(op)
        refs = timed
        rows.append(dict(op=op, size=size, dtype=dtype, rank=rank, us=own["us"], min_us=own["min_us"],
                         gpu_us=gpu["us"], gpu_bound=bool(own["us"] < 1.15 * gpu["us"]),
                         ref_size=f"[16,{ref_k}]x[{ref_k},{ref_n}]",
                         refs={k: v["us"] for k, v in refs.items()},
                         ratio={k: own["us"] / v["us"] for k, v in refs.items()}))

    for compute in computes:
        tag = "" if compute == "exact" else f" {compute}"
        if "gemm_w4a4" in ops:
            k, n, call, why = _tiny_gemm(lib, rank, dtype, shapes, compute)
            if call is None:
                rows.append(dict(op="gemm_w4a4" + tag, skipped=why))
            else:
                measure("gemm_w4a4" + tag, call, f"M=16 K={k} N={n}", k, n)
        if "quantize_act" in ops:
            k, call, why = _tiny_quant(lib, rank, dtype, shapes, compute)
            if call is None:
                rows.append(dict(op="quantize_act" + tag, skipped=why))
            else:
                measure("quantize_act" + tag, call, f"M=16 K={k}", k, k,
                        extra=(("x.float()", lambda t: t.float()),))
    return rows


def annotate_fastest_baselines(rows: list) -> list:
    """Each baseline is timed once per row, so the rows of one shape (its exact and FP8 rows) carry separate
    timings of the same baseline, which can differ by several percent on one GPU in one run (clock and thermal
    drift).  For each (M, K, N, R, dtype) and baseline timed in more than one row, every row's entry gains
    ``fastest_us`` (the shortest of those timings) and ``speedup_vs_fastest`` (our throughput over that one): the
    conservative ratio.  Rows without that baseline, or with an error, are left as they are.  Returns `rows`."""
    groups: dict = {}                  # (shape, baseline) -> [(our row, its timing of that baseline)]
    for r in rows:
        if "ours" not in r:
            continue
        for name, b in r.get("baselines", {}).items():
            if "us" in b:
                groups.setdefault((r["m"], r["k"], r["n"], r.get("rank"), r["dtype"], name), []).append((r, b))
    for timed in groups.values():
        if len(timed) > 1:
            fastest = min(b["us"] for _, b in timed)
            for r, b in timed:
                b["fastest_us"] = fastest
                b["speedup_vs_fastest"] = fastest / r["ours"]["us"]
    return rows


# ---------------------------------------------------------------------------
# Rendering (pure Python: testable without a GPU)
# ---------------------------------------------------------------------------

def _f(v, spec=".1f", none="–"):
    return none if v is None else format(v, spec)


def _base_cell(b: dict | None, key: str, spec: str) -> str:
    if b is None:
        return "–"
    if "error" in b:
        return "error"
    vs = b.get("speedup_vs_fastest")
    if vs is not None and abs(vs - b["speedup"]) >= 0.005:
        return f"{format(b[key], spec)} ({b['speedup']:.2f}×; {vs:.2f}× vs the shape's fastest)"
    return f"{format(b[key], spec)} ({b['speedup']:.2f}×)"


def _matmul_table(rows: list, baselines: tuple, title: str) -> list:
    """Markdown lines of a GEMM-shaped table (gemm_w4a4, linear): none without measured rows."""
    if not rows:
        return []
    names = [b for b in baselines if any(b in r.get("baselines", {}) for r in rows)]
    dts = "/".join(dict.fromkeys(r["dtype"] for r in rows))
    head = ["M", "K", "N", "R", "dtype", "ours µs", "ours TFLOP/s"]
    head += [LABELS[b].format(dtype=dts) + " TFLOP/s (ours×)" for b in names] + ["check"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        chk = r.get("check", {})
        dt = r["dtype"] + (" fp8" if r.get("compute") == "fp8" else "")
        ours = _f(r["ours"]["us"]) + (f" ({_f(r['ours_from_nvfp4']['us'])} from NVFP4)" if "ours_from_nvfp4" in r
                                      else "")
        cells = [r["m"], r["k"], r["n"], r["rank"], dt, ours, _f(r["ours"]["tflops"])]
        cells += [_base_cell(r["baselines"].get(b), "tflops", ".1f") for b in names]
        cells.append(("ok" if chk.get("ok") else "**MISMATCH**") + f" {chk.get('rel_err_vs_eager', 0):.1e}"
                     if chk else "–")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines + [""]


def render_tables(doc: dict) -> str:
    """The markdown tables of a bench document (ours; each baseline with ours/baseline in parentheses)."""
    env = doc.get("env", {})
    lines = [f"## svdq-aot bench — {env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
             f"svdq_loader {env.get('loader', '?')}", ""]
    lines += _matmul_table([r for r in doc.get("gemm", []) if "ours" in r], GEMM_BASELINES,
                           "### gemm_w4a4 (TFLOP/s = 2·M·N·K / time; ours× = our throughput / baseline's, and "
                           "where a shape's rows timed a baseline more than once, also against its fastest timing; "
                           "fp8 rows: the GEMM from quantize_act's E4M3 activation, in parentheses the call from an "
                           "NVFP4 activation, which runs act_fp8 first)")
    from .bench_linear import LINEAR_BASELINES
    lines += _matmul_table([r for r in doc.get("linear", []) if "ours" in r], LINEAR_BASELINES,
                           "### linear: quantize_act + gemm_w4a4 from 16-bit activations (TFLOP/s = 2·M·N·K / "
                           "time; ours× = our throughput / baseline's)")
    quant = [r for r in doc.get("quantize_act", []) if "ours" in r]
    if quant:
        cbw = doc.get("copy_bw", {}).get("gbps")
        names = [b for b in QUANT_BASELINES if any(b in r.get("baselines", {}) for r in quant)]
        head = ["M", "K", "R", "dtype", "smoothing", "MB moved", "floor µs", "ours µs", "ours GB/s", "of copy BW",
                "same-size copy µs", "of same-size copy"]
        head += [LABELS[b] + " µs (ours×)" for b in names] + ["check act/scales"]
        lines += [f"### quantize_act (device copy bandwidth this run: {_f(cbw, '.0f')} GB/s, read + write)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in quant:
            o, chk = r["ours"], r.get("check", {})
            cells = [r["m"], r["k"], r["rank"], r["dtype"], r.get("smoothing", "smooth"), _f(r["bytes"] / 1e6),
                     _f(r.get("floor_us")),
                     _f(o["us"]), _f(o["gbps"], ".0f"), _f(None if o.get("frac_copy") is None
                                                          else 100 * o["frac_copy"], ".0f") + "%",
                     _f(r.get("copy_same", {}).get("us")),
                     _f(None if o.get("frac_copy_same") is None else 100 * o["frac_copy_same"], ".0f") + "%"]
            cells += [_base_cell(r["baselines"].get(b), "us", ".1f") for b in names]
            cells.append(f"{_f(chk.get('act_bytes_equal'), '.4f')}/{_f(chk.get('scales_equal'), '.4f')}")
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    host = [r for r in doc.get("host", []) if "us" in r]
    if host:
        lines += ["### host cost per call (back-to-back, no sync; tiny cached problem; ours and the references "
                  "timed in alternating batches)", "",
                  "| op | problem | ours µs/call | reference | ref µs/call | ours / ref |", "|---|---|---|---|---|---|"]
        for r in host:
            flag = " (GPU-bound: an upper bound)" if r.get("gpu_bound") else ""
            for i, (name, us) in enumerate(r["refs"].items()):
                first = [r["op"], r["size"], _f(r["us"], ".2f") + flag] if i == 0 else ["", "", ""]
                lines.append("| " + " | ".join(first + [f"{name} {r['ref_size'] if 'matmul' in name else ''}".strip(),
                                                        _f(us, ".2f"), f"{r['ratio'][name]:.2f}×"]) + " |")
        lines.append("")
    skipped = [r for key in ("gemm", "linear", "quantize_act", "host") for r in doc.get(key, [])
               if "skipped" in r or "error" in r]
    if skipped:
        lines += ["### skipped / failed", ""]
        for r in skipped:
            what = ", ".join(f"{k}={r[k]}" for k in ("m", "k", "n", "rank", "dtype") if k in r)
            lines.append(f"- {r['op']} {what}: " + (f"skipped: {r['skipped']}" if "skipped" in r
                                                     else f"ERROR: {r['error']}"))
        lines.append("")
    errs = [(r, b, v["error"]) for key in ("gemm", "linear", "quantize_act") for r in doc.get(key, [])
            for b, v in r.get("baselines", {}).items() if "error" in v]
    if errs:
        lines += ["### baseline errors", ""]
        lines += [f"- {r['op']} M={r['m']} K={r['k']} {('N=' + str(r['n'])) if 'n' in r else ''} {b}: {e}"
                  for r, b, e in errs]
        lines.append("")
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> str | None:
    """Bar charts (log scale) of ours vs each baseline; returns None or why no plot was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    panels = []          # (title, x labels, [(series name, values)], horizontal line or None)
    from .bench_linear import LINEAR_BASELINES
    for op, key_doc, bases in (("gemm_w4a4", "gemm", GEMM_BASELINES), ("linear", "linear", LINEAR_BASELINES)):
        measured = [r for r in doc.get(key_doc, []) if "ours" in r]
        for key in dict.fromkeys((r["k"], r["n"], r["dtype"]) for r in measured):   # a panel per (K, N, dtype)
            rows = [r for r in measured if (r["k"], r["n"], r["dtype"]) == key]
            names = [b for b in bases if any("tflops" in r["baselines"].get(b, {}) for r in rows)]
            panels.append((f"{op} K={key[0]} N={key[1]} {key[2]}: TFLOP/s", [f"M={r['m']}" for r in rows],
                           [("ours", [r["ours"]["tflops"] for r in rows])]
                           + [(LABELS[b].format(dtype=key[2]), [r["baselines"].get(b, {}).get("tflops")
                                                               for r in rows]) for b in names], None))
    quant = [r for r in doc.get("quantize_act", []) if "ours" in r]
    if quant:
        names = [b for b in QUANT_BASELINES if any("gbps" in r["baselines"].get(b, {}) for r in quant)]
        labels = [f"{r['m']}×{r['k']} {r['dtype']}" + (" rcp" if r.get("smoothing") == "smooth_rcp" else "")
                  for r in quant]
        panels.append(("quantize_act: GB/s of the bytes moved", labels,
                       [("ours", [r["ours"]["gbps"] for r in quant])]
                       + [(LABELS[b], [r["baselines"].get(b, {}).get("gbps") for r in quant]) for b in names],
                       doc.get("copy_bw", {}).get("gbps")))
    if not panels:
        return "no measured case to plot"
    cols = 1 if len(panels) == 1 else 2
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, labels, series, line) in zip(axes.flat, panels):
        w = 0.8 / len(series)
        for j, (name, vals) in enumerate(series):
            ax.bar([i + (j - (len(series) - 1) / 2) * w for i in range(len(labels))],
                   [float("nan") if v is None else v for v in vals], w, label=name)
        if line:
            ax.axhline(line, color="k", ls="--", lw=1, label=f"copy bandwidth {line:.0f} GB/s")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    env = doc.get("env", {})
    fig.suptitle(f"svdq-aot bench on {env.get('gpu', '?')} (torch {env.get('torch', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def environment(args, lib) -> dict:
    import torch
    import svdq_loader
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
               l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0), memory_bytes=props.total_memory,
               torch=torch.__version__, torch_cuda=torch.version.cuda, python=platform.python_version(),
               loader=svdq_loader.__version__, artifacts=os.path.abspath(args.artifacts),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        from cuda.bindings import driver as cu
        err, ver = cu.cuDriverGetVersion()
        env["cuda_driver_api"] = f"{ver // 1000}.{ver % 1000 // 10}"
    except Exception:  # noqa: BLE001 - informative only
        pass
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            env["driver"] = out.stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    cfg = getattr(lib.manifest, "config", None)
    if cfg is not None:
        env["artifacts_config"] = getattr(cfg, "name", None)
    return env


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.artifacts_dir:
        args.artifacts = args.artifacts_dir
    try:
        shapes = load_shapes(args.config)
    except (OSError, ValueError) as exc:
        print(f"svdq-aot bench: {exc}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("svdq-aot bench: torch is not installed; the benchmark needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("svdq-aot bench: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing to time",
              file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.artifacts, "manifest.json")):
        print(f"svdq-aot bench: no artifacts in {args.artifacts!r} (no manifest.json); "
              f"build them with 'svdq-aot build CONFIG -o {args.artifacts}' or pass --artifacts DIR", file=sys.stderr)
        return 2
    import svdq_loader
    try:
        lib = svdq_loader.load(args.artifacts)
    except Exception as exc:  # noqa: BLE001 - manifest / integrity errors: one clear line
        print(f"svdq-aot bench: cannot load artifacts from {args.artifacts!r}: {type(exc).__name__}: "
              f"{_first_line(exc)}", file=sys.stderr)
        return 2

    st = QUICK if args.quick else Settings()
    st = Settings(**{**st.__dict__, "graphs": not args.no_graphs})
    if args.quick:
        shapes = quick_shapes(shapes)
    ops = ["gemm_w4a4", "linear", "quantize_act"] if args.op == "all" else [args.op]
    gemm_m = args.m or (QUICK_M if args.quick else GEMM_M)
    quant_m = args.quant_m or QUANT_M
    torch.manual_seed(0)
    env = environment(args, lib)
    l2 = env["l2_bytes"] or 64 << 20
    doc = dict(schema="svdq-aot-bench/1", env=env, argv=list(argv) if argv is not None else sys.argv[1:],
               method=dict(timer="CUDA events, median of samples", samples=st.reps, warmup_passes=st.warmup,
                           rotation="input+output copies so one pass moves > 2x L2", graphs=st.graphs,
                           tflops="2*M*N*K/time (LoRA not counted)", fp8="torch._scaled_mm, use_fast_accum=False",
                           compile="torch.compile(dynamic=False), default mode: one static compilation per shape"),
               gemm=[], linear=[], quantize_act=[], host=[])
    print(f"svdq-aot bench: {env['gpu']} (L2 {l2 >> 20} MiB), torch {env['torch']}, "
          f"svdq_loader {env['loader']}, artifacts {args.artifacts}", flush=True)
    doc["method"]["gpu_warmup_ms"] = round(warm_gpu(), 1)
    failed = 0

    def run_case(key, fn, desc):
        nonlocal failed
        try:
            r = fn()
        except Exception as exc:  # noqa: BLE001 - report, go on with the next case
            failed += 1
            r = dict(op=key, error=f"{type(exc).__name__}: {_first_line(exc)}", case=desc)
            print(f"  {desc}: ERROR {r['error']}", flush=True)
        else:
            if "skipped" in r:
                print(f"  {desc}: skipped: {r['skipped']}", flush=True)
            elif key in ("gemm", "linear"):
                o, b = r["ours"], r["baselines"]
                print(f"  {desc}: {o['us']:9.1f} us {o['tflops']:7.1f} TFLOP/s  " + "  ".join(
                    f"{n} {v['tflops']:.0f}" if "tflops" in v else f"{n} error" for n, v in b.items()), flush=True)
            else:
                o = r["ours"]
                print(f"  {desc}: {o['us']:9.1f} us {o['gbps']:7.0f} GB/s  " + "  ".join(
                    f"{n} {v['us']:.1f} us" if "us" in v else f"{n} error" for n, v in r["baselines"].items()),
                    flush=True)
        doc[key].append(r)
        _free()

    from .bench_linear import linear_case
    for op, key, case, title in (("gemm_w4a4", "gemm", gemm_case, "gemm_w4a4:"),
                                 ("linear", "linear", linear_case, "linear (quantize_act + gemm_w4a4):")):
        if op not in ops:
            continue
        print(title, flush=True)
        for dtype in args.dtype:
            for _, k, n in shapes:
                for m in gemm_m:
                    for compute in args.compute:
                        kw = {} if compute == "exact" else dict(compute=compute)
                        run_case(key, lambda m=m, k=k, n=n, dtype=dtype, case=case, kw=kw: case(
                            lib, m, k, n, args.rank, dtype, args.baselines, st, l2, **kw),
                            f"M={m} K={k} N={n} {dtype}" + (f" {compute}" if kw else ""))
    if "quantize_act" in ops:
        doc["copy_bw"] = copy_bandwidth(st)
        print(f"quantize_act (copy bandwidth {doc['copy_bw']['gbps']:.0f} GB/s):", flush=True)
        for dtype in args.dtype:
            for k in dict.fromkeys(k for _, k, _ in shapes):
                for m in quant_m:
                    for sm in args.smoothing:
                        run_case("quantize_act", lambda m=m, k=k, dtype=dtype, sm=sm: quant_case(
                            lib, m, k, args.rank, dtype, args.baselines, st, l2, doc["copy_bw"]["gbps"], sm),
                            f"M={m} K={k} {dtype} {sm}")
    print("host cost:", flush=True)
    try:
        doc["host"] = host_costs(lib, ops, args.rank, args.dtype[0], shapes, st, args.compute)
    except Exception as exc:  # noqa: BLE001
        failed += 1
        doc["host"] = [dict(op="host cost", error=f"{type(exc).__name__}: {_first_line(exc)}")]

    for key in ("gemm", "linear"):
        annotate_fastest_baselines(doc.get(key, []))
    text = render_tables(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.table}")
    if args.plot:
        why = write_plot(doc, args.plot)
        print(f"no plot: {why}" if why else f"wrote {args.plot}")
    measured = sum("ours" in r for key in ("gemm", "linear", "quantize_act") for r in doc[key])
    print()
    print(text, flush=True)
    if failed:
        return 1
    return 0 if measured or doc["host"] else 1


if __name__ == "__main__":
    sys.exit(main())

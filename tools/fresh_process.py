"""`import svdq_loader` + `load()` + first launch, each in a fresh process (no JIT anywhere), and graph replay cost.

    python3 tools/fresh_process.py artifacts [--runs 3] [--json out.json]

Per fresh process (torch imported and its CUDA context created first, untimed: every serving process has
those): the import, `load()` (manifest, hashes, cross-checks), the first `gemm_w4a4` call (selection, kernel
load on the device, launch, synchronise) and a second call.  The child also checks that no compiler or JIT
library (nvrtc, nvJitLink, the CuTe DSL) was imported, and which such libraries are mapped into the process
after each phase: torch's CUDA start, the loader's import and `load()`, the test problem's torch ops, and the
loader's weight preparation and calls.  The verdict (`no_jit`) counts the loader's phases only.  (Sessions 2 and
40 found nvrtc and nvJitLink mapped by the end of the child, and the loader calls neither; torch's CUDA start is
the likely source, which no serving process avoids, and these records say which phase it is.)  Then, in this
process: the cost of a CUDA graph of 100 captured `gemm_w4a4` launches per replay, next to 100 eager calls.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time

def jit_libs():
    maps = open("/proc/self/maps").read()
    return {ln.split("/")[-1] for ln in maps.splitlines() if "nvrtc" in ln or "nvJitLink" in ln}

seen, phases = set(), {}
def phase(name):
    new = jit_libs() - seen
    phases[name] = sorted(new)
    seen.update(new)

import torch
torch.empty(1, device="cuda"); torch.cuda.synchronize()
phase("torch_cuda_start")
art = sys.argv[1]
t0 = time.perf_counter()
import svdq_loader
t1 = time.perf_counter()
lib = svdq_loader.load(art)
t2 = time.perf_counter()
phase("loader_import_and_load")
from svdq_loader.testing import reference as ref
p = ref.random_problem(256, 3072, 3072, 32, seed=1, out_dtype="bf16", device="cuda")
torch.cuda.synchronize()
phase("test_problem_torch_ops")
w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p["lora_up"], wcscale=p["wcscale"], bias=p["bias"])
torch.cuda.synchronize()
t3 = time.perf_counter()
lib.gemm_w4a4(p["act"], w, p["ascales"], lora_act_in=p["lora_act_in"])
torch.cuda.synchronize()
t4 = time.perf_counter()
lib.gemm_w4a4(p["act"], w, p["ascales"], lora_act_in=p["lora_act_in"])
torch.cuda.synchronize()
t5 = time.perf_counter()
phase("loader_prepare_and_calls")
jit_mods = sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "svdq_aot", "svdq_kernels")
                  or m in ("cuda.bindings.nvrtc", "cuda.bindings.nvjitlink"))
print(json.dumps(dict(import_ms=(t1 - t0) * 1e3, load_ms=(t2 - t1) * 1e3, first_call_ms=(t4 - t3) * 1e3,
                      second_call_ms=(t5 - t4) * 1e3, jit_modules=jit_mods, jit_libraries=sorted(seen),
                      jit_libraries_mapped_by=phases, variants=len(lib.variants))))
"""
#: The child's phases that are the loader's own work: a JIT library first mapped in one of them fails the check
LOADER_PHASES = ("loader_import_and_load", "loader_prepare_and_calls")


def graph_replay_cost(art: str) -> dict:
    import torch

    import svdq_loader
    from svdq_loader.testing.bench import _tiny_gemm
    lib = svdq_loader.load(art)
    k, n, call, why = _tiny_gemm(lib, 32, "bf16", [])
    if call is None:
        return dict(error=why)
    reps, copies = 20, 100
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for _ in range(copies):
                call()
    torch.cuda.synchronize()
    host_eager, host_replay, gpu_eager, gpu_replay = [], [], [], []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0.record()
        for _ in range(copies):
            call()
        e1.record()
        host_eager.append((time.perf_counter() - t0) * 1e6 / copies)
        e1.synchronize()
        gpu_eager.append(e0.elapsed_time(e1) * 1e3 / copies)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0.record()
        g.replay()
        e1.record()
        host_replay.append((time.perf_counter() - t0) * 1e6)
        e1.synchronize()
        gpu_replay.append(e0.elapsed_time(e1) * 1e3 / copies)
    med = statistics.median
    return dict(problem=f"M=16 K={k} N={n} R=32 bf16", launches_per_graph=copies,
                eager_host_us_per_call=med(host_eager), eager_gpu_us_per_call=med(gpu_eager),
                replay_host_us_per_graph=med(host_replay), replay_gpu_us_per_launch=med(gpu_replay))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = []
    for _ in range(a.runs):
        r = subprocess.run([sys.executable, "-c", CHILD, a.artifacts], capture_output=True, text=True, timeout=120)
        if r.returncode:
            print(r.stdout + r.stderr)
            return 1
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    keys = ("import_ms", "load_ms", "first_call_ms", "second_call_ms")
    summary = {k: statistics.median(r[k] for r in runs) for k in keys}
    summary["no_jit"] = all(not r["jit_modules"] and not any(r["jit_libraries_mapped_by"][p] for p in LOADER_PHASES)
                            for r in runs)
    summary["jit_libraries_mapped_by"] = runs[-1]["jit_libraries_mapped_by"]
    print("fresh process (median of runs):", json.dumps(summary))
    graph = graph_replay_cost(a.artifacts)
    print("graph replay:", json.dumps(graph))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(runs=runs, summary=summary, graph=graph), f, indent=1)
    return 0 if summary["no_jit"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

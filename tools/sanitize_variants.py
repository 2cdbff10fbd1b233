"""Every built variant of this GPU's arch, every launched operator, over M tails: the cases for compute-sanitizer.

    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_variants.py artifacts
    compute-sanitizer --tool racecheck python3 tools/sanitize_variants.py artifacts --default-only --m 77,1000
    compute-sanitizer --tool racecheck python3 tools/sanitize_variants.py artifacts --match splitk4 --m 77
    compute-sanitizer --tool memcheck python3 tools/sanitize_variants.py artifacts --match quantize --quant-grid range

Each variant's launcher is driven directly (selection bypassed, so every variant runs, not only the ones
selection prefers).  Outputs sit NaN-poisoned in a buffer with guard rows; gemm_w4a4 is checked against
the float64 reference, quantize_act bit-exactly against the exact reference.  The FP8-compute GEMM
(gemm_w4a4_fp8) runs as a user calls it, its act_fp8 pre-pass included, with selection pinned to the variant
(the selftest's case runner) and checked against its own float64 reference.  Exit status 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import sys

import torch

import svdq_loader
from svdq_loader import driver
from svdq_loader.ops import gemm_w4a4 as gop
from svdq_loader.ops import quantize_act as qop
from svdq_loader.testing import reference as ref
from svdq_loader.testing import selftest
from svdq_loader.testing.quantize_ref import quantize_act_ref_torch

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"bf16": 1e-2, "fp16": 2e-3}


def _launch(lib, ln, args, stream_index):
    args[stream_index] = torch.cuda.current_stream().cuda_stream
    ln.launch(args)


def gemm_case(lib, arch, e, m, seed) -> bool:
    kn = e.knobs
    n, k, r, dt = 2 * e.requirements["n_multiple"], max(256, e.requirements["k_multiple"]), kn["rank"], kn["out_dtype"]
    p = ref.random_problem(m, n, k, r, seed=seed, out_dtype=dt, wcscale=kn["wcscale"], bias=kn["bias"], device="cuda")
    w = lib.prepare_weight(p["wgt"], p["wscales"], lora_up=p.get("lora_up"), wcscale=p.get("wcscale"),
                           bias=p.get("bias"))
    buf = torch.full((m + 3, n), float("nan"), dtype=DT[dt], device="cuda")
    _, _, out, args, _ = gop.fast_args(arch, p["act"], w, p["ascales"], p.get("lora_act_in"), buf[:m], None)
    args[gop.SM_COUNT_INDEX] = lib._sms[0]
    _launch(lib, lib._launcher(e.name, 0, False), args, gop.STREAM_INDEX)
    torch.cuda.synchronize()
    expect = ref.reference_torch_f64(**p)
    rel = float(torch.linalg.vector_norm(out.double() - expect) / torch.linalg.vector_norm(expect))
    return rel <= TOL[dt] and bool(torch.isnan(buf[m:]).all())


def quant_case(lib, arch, e, m, seed, smooth_on) -> bool:
    kn = e.knobs
    k, r, dt = max(256, e.requirements["k_multiple"]), kn["rank"], DT[kn["dtype"]]
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).mul_(3).to(dt)
    sm = torch.rand(k, device="cuda", generator=g).add_(0.5).to(dt) if smooth_on else None
    ld = (torch.randn(k, r, device="cuda", generator=g) / k ** 0.5).to(dt) if r else None
    _, _, (act, sc, la), args = qop.fast_args(arch, x, sm, ld)
    _launch(lib, lib._launcher(e.name, 0, False), args, qop.STREAM_INDEX)
    torch.cuda.synchronize()
    ra, rs, _ = quantize_act_ref_torch(x, sm, ld, "logical")
    return torch.equal(act.cpu(), ra) and torch.equal(sc.view(torch.uint8).cpu(), rs)


def fp8_case(lib, e, m, seed) -> bool:
    """One FP8-compute call pinned to `e` (the act_fp8 pre-pass runs too, as in a user's call)."""
    kn = e.knobs
    n, k = 2 * e.requirements["n_multiple"], max(256, e.requirements["k_multiple"])
    case = selftest.Case("gemm_w4a4_fp8", dict(m=m, n=n, k=k, r=kn["rank"], dt=kn["out_dtype"], wc=kn["wcscale"],
                                               b=kn["bias"], seed=seed))
    return selftest.run_case(lib, e, case, 0, base_seed=0).ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts")
    ap.add_argument("--m", default="1,77,1000,4592", help="comma-separated M values")
    ap.add_argument("--default-only", action="store_true",
                    help="only the variants selection picks for bf16, R=32, wcscale and bias (racecheck/synccheck)")
    ap.add_argument("--match", action="append", default=[], metavar="TEXT",
                    help="only variants whose name contains TEXT (repeatable: all must match)")
    ap.add_argument("--quant-grid", choices=("auto", "range"), default="auto",
                    help="quantize_act launch form: the loader's choice (auto), or the range form with 1.5x the "
                         "tiles in CTAs, so that most tiles are split and their LoRA sums meet in the workspace")
    a = ap.parse_args()
    if a.quant_grid == "range":
        def sched(m, k, r, sms, res, rows, blocked, clusters=None):
            tiles = qop.tile_count(m, rows, blocked)
            ctas = max(tiles, min(tiles * 3 // 2 + 1, tiles * (k // 64)))
            return 1, ctas, qop.workspace_bytes(ctas, rows, r) if ctas > tiles else 0
        qop.schedule = sched
    lib = svdq_loader.load(a.artifacts)
    arch = driver.device_arch(0)
    lib._device_arch(0)
    ms = [int(v) for v in a.m.split(",")]
    # decode_act runs inside the images GEMM variants' launcher (its own numerics: svdq-aot selftest)
    todo = [e for e in lib.variants if e.arch == arch and e.op in ("gemm_w4a4", "gemm_w4a4_fp8", "quantize_act")
            and all(t in e.name for t in a.match)]
    if a.default_only:
        keep = {lib.choose("gemm_w4a4", arch, m=1000, n=3072, k=3072, rank=32).name,
                lib.choose("quantize_act", arch, m=1000, k=3072, rank=32).name}
        if any(e.op == "gemm_w4a4_fp8" for e in todo):
            keep.add(lib.choose("gemm_w4a4_fp8", arch, m=1000, n=3072, k=3072, rank=32).name)
        todo = [e for e in todo if e.name in keep]
    bad = 0
    for i, e in enumerate(todo):
        for m in ms:
            seed = i * 131 + m
            if e.op == "gemm_w4a4":
                oks = [gemm_case(lib, arch, e, m, seed)]
            elif e.op == "gemm_w4a4_fp8":
                oks = [fp8_case(lib, e, m, seed)]
            else:
                oks = [quant_case(lib, arch, e, m, seed, s) for s in (False, True)]
            bad += not all(oks)
            print(f"{e.name} M={m}: {'ok' if all(oks) else 'MISMATCH'}", flush=True)
    print(f"sanitize variants: {len(todo)} variant(s) x {len(ms)} M:", "all ok" if not bad else f"{bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Time every built sm_90a gemm_w4a4 variant of an artifact set on this GPU, beside cuBLAS bf16 in the
same run (tuning data for docs/PERF.md and the selection rules).

    python3 tools/sm90_sweep.py ARTIFACTS [ARTIFACTS ...] [--m 256,1024,4608] [--kn 3072x3072,3072x12288,12288x3072]
        [--rank 32] [--json F] [--quick] [--match TEXT ...] [--compute fp8] [--sm-counts 132,66,33]
        [--oversubscribe]

Bypasses selection: each variant's launcher is driven directly with the arguments the loader would build.
Every variant's output is checked once per shape against the eager torch W4A4 pipeline (relative error
below 1e-2, finite; with --compute fp8 the gemm_w4a4_fp8 variants, below the mode's 6e-2); a variant that fails the
check is reported and not timed.  Inputs rotate over enough
copies that one pass moves more than twice the L2 (weights included), as in `svdq-aot bench`.
With several artifact folders (e.g. a build with a kernel switch such as SVDQ_KERNEL_SM90_WDECODE=shift beside a
plain one), every variant of each is timed on the same inputs in the same run; rows name their folder, and two
closing tables give each folder's fastest form per shape (and its time over the first folder's best), then each
variant's time per folder and its ratio to the first folder's.  ``--json`` is rewritten
after every shape, so a sweep stopped by a time limit keeps the rows it timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import svdq_loader
from svdq_loader.ops import gemm_w4a4 as gop
from svdq_loader.testing import bench, reference as ref, torch_quant as tq

_SHORT = ("tile_m", "tile_n", "stages", "prefetch", "skip_pad", "act_decode", "schedule", "wsets", "act_source")


def short(knobs: dict) -> str:
    return " ".join(f"{k}={knobs[k]}" for k in _SHORT if k in knobs)


def compare(rows: list[dict], folders: list[str]) -> list[str]:
    """Markdown lines: per variant and shape timed in the first folder and another, the times and their ratio
    (other / first: below 1 means the other build is faster); a failed check shows as FAILED."""
    if len(folders) < 2:
        return []
    by = {(r["artifacts"], r["variant"], r["m"], r["k"], r["n"]): r for r in rows}
    head = ["variant (knobs)", "M", "K", "N", f"{folders[0]} µs"]
    for f in folders[1:]:
        head += [f"{f} µs", f"{f} / {folders[0]}"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["artifacts"] != folders[0]:
            continue
        base = r.get("us") if r["ok"] else None
        cells = [r["knobs"], str(r["m"]), str(r["k"]), str(r["n"]), f"{base:.1f}" if base else "FAILED"]
        for f in folders[1:]:
            o = by.get((f, r["variant"], r["m"], r["k"], r["n"]))
            if o is None:
                cells += ["–", "–"]
            elif not o["ok"]:
                cells += ["FAILED", "–"]
            else:
                cells += [f"{o['us']:.1f}", f"{o['us'] / base:.3f}" if base else "–"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def brief(knobs: str) -> str:
    """A row's knob summary (`short`) in a few characters: tile, schedule, weight sets, stages, activation source."""
    k = dict(kv.split("=", 1) for kv in knobs.split())
    out = f"{k.get('tile_m')}x{k.get('tile_n')} {k.get('schedule')}"
    if "wsets" in k:
        out += f" w{k['wsets']}"
    if "stages" in k:
        out += f" s{k['stages']}"
    return out + (" img" if k.get("act_source") == "images" else "")


def best_table(rows: list[dict], folders: list[str]) -> list[str]:
    """Markdown lines: per shape (M, K, N), each folder's fastest checked variant (µs, its form) and that time over
    the first folder's best, beside cuBLAS bf16; the table to read first when several builds are swept."""
    if len(folders) < 2:
        return []
    shapes = list(dict.fromkeys((r["m"], r["k"], r["n"]) for r in rows))
    head = ["M", "K", "N", "cuBLAS µs"] + [f"{f}: best µs (form)" for f in folders] + \
        [f"{f} / {folders[0]}" for f in folders[1:]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in shapes:
        mine = [r for r in rows if (r["m"], r["k"], r["n"]) == shape]
        best = {}
        for f in folders:
            ok = [r for r in mine if r["artifacts"] == f and r["ok"]]
            best[f] = min(ok, key=lambda r: r["us"]) if ok else None
        cublas = mine[0].get("cublas_us")
        cells = [str(x) for x in shape] + [f"{cublas:.1f}" if cublas else "–"]
        cells += [f"{b['us']:.1f} ({brief(b['knobs'])})" if b else "–" for b in best.values()]
        b0 = best[folders[0]]
        cells += [f"{best[f]['us'] / b0['us']:.3f}" if best[f] and b0 else "–" for f in folders[1:]]
        out.append("| " + " | ".join(cells) + " |")
    return out


def sm_count_list(text: str | None, sms: int, oversubscribe: bool = False) -> list[int] | str:
    """The --sm-counts values (the device's own count when none are given), or the message that refuses them: each
    must be an integer from 1 to the device's SM count, or to 8 times it with --oversubscribe."""
    if not text:
        return [sms]
    top = 8 * sms if oversubscribe else sms
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = [0]
    if any(c < 1 or c > top for c in counts):
        return (f"--sm-counts {text}: a comma list of integers, each 1 .. {top} (this device's SMs"
                f"{', times 8 with --oversubscribe' if oversubscribe else '; more with --oversubscribe'})")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", help="artifact folders; their variants are timed side by side")
    ap.add_argument("--m", default="256,1024,4608")
    ap.add_argument("--kn", default="3072x3072,3072x12288,12288x3072", help="comma list of KxN")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--affine", choices=("on", "off"), default="on",
                    help="on: variants built with wcscale and bias, called with both; off: variants built without "
                         "either, called without them")
    ap.add_argument("--compute", choices=("exact", "fp8"), default="exact",
                    help="the GEMM's compute mode: fp8 times the gemm_w4a4_fp8 variants (their outputs checked against "
                         "the exact eager pipeline within the mode's distance, the bench's 6e-2)")
    ap.add_argument("--sm-counts", default=None,
                    help="comma list of the sm_count host argument each variant is launched with (default: the "
                         "device's); a smaller one shrinks a persistent grid and the gemv form's split-K, so the "
                         "split rules can be timed without a rebuild. With several, each row names its count")
    ap.add_argument("--oversubscribe", action="store_true",
                    help="let --sm-counts exceed the device's SMs: a larger count gives the gemv form a larger "
                         "split-K (more CTAs than fit at once), to time a split its rule does not take here")
    ap.add_argument("--match", action="append", default=[],
                    help="time only variants whose knob summary (as printed) contains this text; repeatable, all "
                         "must match")
    a = ap.parse_args(argv)
    st = bench.QUICK if a.quick else bench.Settings(reps=9, warmup=2, target_ms=2.0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm_counts = sm_count_list(a.sm_counts, sms, a.oversubscribe)
    if isinstance(sm_counts, str):
        print(sm_counts)
        return 2
    gpu = torch.cuda.get_device_name(0)
    libs = {folder: svdq_loader.load(folder) for folder in a.artifacts}
    lib = libs[a.artifacts[0]]               # prepares the weights (one format for every sm_90a build)
    bench.warm_gpu()
    tdt = bench._dtype(a.dtype)
    affine = a.affine == "on"
    op = "gemm_w4a4_fp8" if a.compute == "fp8" else "gemm_w4a4"
    tol = bench.FP8_CHECK_TOL if a.compute == "fp8" else 1e-2
    from svdq_loader.ops import op_spec
    spec = op_spec(op)
    cands = [(folder, e) for folder, lb in libs.items() for e in lb.variants
             if e.op == op and e.arch == "sm_90a" and e.knobs["rank"] == a.rank
             and e.knobs["out_dtype"] == a.dtype and e.knobs["wcscale"] == affine and e.knobs["bias"] == affine
             and all(t in short(e.knobs) for t in a.match)]
    if not cands:
        print(f"no sm_90a {op} variant with rank {a.rank}, {a.dtype}, wcscale and bias {a.affine} in "
              f"{', '.join(a.artifacts)}")
        return 2
    label = len(a.artifacts) > 1
    rows = []
    for kn in a.kn.split(","):
        k, n = (int(x) for x in kn.lower().split("x"))
        ms = [int(x) for x in a.m.split(",")]
        big = ref.random_problem(max(ms), n, k, a.rank, seed=k * 31 + n, out_dtype=a.dtype, device="cuda")
        lut = tq.e2m1_lut(tdt, "cuda")
        for m in ms:
            p = dict(big, act=big["act"][:m].contiguous(), ascales=big["ascales"][:m].contiguous(),
                     lora_act_in=big["lora_act_in"][:m].contiguous() if a.rank else None)
            if not affine:
                p.update(wcscale=None, bias=None)
            sets = bench.gemm_input_sets(p, m, k, n, a.rank, l2)
            nsets = len(sets)
            mode = {} if a.compute == "exact" else dict(compute=a.compute)
            ws = [lib.prepare_weight(q["wgt"], q["wscales"], lora_up=q["lora_up"], wcscale=q["wcscale"],
                                     bias=q["bias"], **mode) for q in sets]
            outs = [torch.empty(m, n, dtype=tdt, device="cuda") for _ in sets]
            want = tq.w4a4_unfused(p["act"], p["ascales"], p["wgt"], p["wscales"], p["lora_act_in"], p["lora_up"],
                                   p["wcscale"], p["bias"], tdt, lut=lut).float()
            dense = bench._dense_case(m, k, n, tdt, st, l2)
            stream = torch.cuda.current_stream().cuda_stream
            argv_ = []
            for i, q in enumerate(sets):
                f = gop.fast_args("sm_90a", q["act"], ws[i], q["ascales"], q["lora_act_in"], outs[i], None)
                args = f[3]
                args[gop.STREAM_INDEX] = stream         # (sm_count: set per launch below)
                argv_.append(args)
            for (folder, e), smc in ((c, smc) for c in cands for smc in sm_counts):
                if spec.shape_problem(e.requirements, dict(m=m, n=n, k=k), e.knobs):
                    continue                # the op's shape rule excludes this (K, N) for the variant
                for args in argv_:
                    args[gop.SM_COUNT_INDEX] = smc
                ln = libs[folder]._launcher(e.name, 0, False)
                outs[0].fill_(float("nan"))
                ln.launch(argv_[0])
                torch.cuda.synchronize()
                got = outs[0].float()
                rel = float((got - want).norm() / want.norm())
                ok = bool(rel < tol and torch.isfinite(got).all())
                tag = f" sms={smc}" if len(sm_counts) > 1 else ""
                row = dict(artifacts=folder, variant=e.name + tag, knobs=short(e.knobs) + tag, m=m, k=k, n=n,
                           rel_err=rel, ok=ok, cublas_us=dense["us"], sm_count=smc)
                if ok:
                    def call(i, ln=ln):
                        args = argv_[i]
                        args[gop.STREAM_INDEX] = torch.cuda.current_stream().cuda_stream   # the capture stream
                        ln.launch(args)
                    t = bench.time_calls(call, nsets, st)
                    row.update(us=t["us"], tflops=bench.tflops(m, n, k, t["us"]), x_cublas=dense["us"] / t["us"])
                rows.append(row)
                print(f"M={m:5d} K={k:5d} N={n:5d}  {(folder + ': ') if label else ''}{row['knobs']:<70} "
                      + (f"{row['us']:8.1f} us {row['tflops']:6.1f} TF/s {row['x_cublas']:.3f}x cuBLAS"
                         if ok else f"CHECK FAILED rel {rel:.3g}"), flush=True)
            del sets, ws, outs, want
            bench._free()
            if a.json:              # after every shape, so a sweep stopped by a time limit keeps what it timed
                write_json(a.json, rows, gpu)
    table = best_table(rows, a.artifacts) + [""] + compare(rows, a.artifacts)
    if len(a.artifacts) > 1:
        print("\n" + "\n".join(table))
    if a.json:
        write_json(a.json, rows, gpu)
    return 0 if all(r["ok"] for r in rows) else 1


def write_json(path: str, rows: list[dict], gpu: str) -> None:
    """The rows so far as JSON, replacing `path` whole (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(gpu=gpu, rows=rows), f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())

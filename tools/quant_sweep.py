"""Time every built quantize_act variant of an artifact set on this GPU (tuning data for docs/PERF.md).

    python3 tools/quant_sweep.py ARTIFACTS [--m 4608,1024] [--k 3072,15360] [--ksplit 1,2,4] [--smooth 0,1,2]
        [--ranks 0,32] [--ctas tiles,fill,2fill,auto] [--carveout -1,100] [--dtype bf16|fp16] [--full-check]
        [--timer graph|loop]

Bypasses selection (each variant's launcher is driven directly); checks every
variant's codes and scales of the first 64 rows against the exact reference
once per row of the table, and with --full-check every row's codes and scales
and lora_act_in against the torch version as well.  Times CUDA graphs of the
calls, as `svdq-aot bench` does (--timer loop: plain launches from Python, whose
own cost per call, several µs, then bounds what a short kernel can show).
After the table of every timing, a second one: each folder's fastest schedule (grid,
split, carveout) per problem (rank, M, K, smoothing form), and its time x the first
folder's fastest on the same problem -- the A/B of two builds in one table.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import svdq_loader
from svdq_loader.ops import quantize_act as qop
from svdq_loader.testing import bench
from svdq_loader.testing import torch_quant as tq
from svdq_loader.testing.quantize_ref import quantize_act_ref_torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", help="artifact folders (each one's variants are timed in turn)")
    ap.add_argument("--m", default="4608", help="token counts (comma-separated)")
    ap.add_argument("--k", default="3072,15360")
    ap.add_argument("--ksplit", default="1", help="cluster K splits to time (the launch's ksplit argument)")
    ap.add_argument("--ctas", default="tiles",
                    help="grid sizes to time: tiles (tiles x ksplit: one CTA per tile and split), fill / 2fill ... "
                         "(ksplit 1 only: whole waves of the CTAs the SMs hold, at least the tiles; N x that), an "
                         "integer (the range form on that many CTAs, within [tiles, units]), or auto (the loader's "
                         "own schedule: ksplit and grid)")
    ap.add_argument("--smooth", default="0,1",
                    help="smoothing forms to time: 0 none, 1 smooth (the kernel computes the reciprocals), 2 "
                         "smooth_rcp (the reciprocals passed); comma-separated")
    ap.add_argument("--ranks", default="", help="only these ranks (default: every built rank)")
    ap.add_argument("--carveout", default="-1",
                    help="the kernel's preferred shared-memory carveout to time at, in percent of the unified "
                         "L1 / SMEM (-1: the driver's choice, as the loader leaves it; 100: the most SMEM and so the "
                         "least L1); comma-separated")
    ap.add_argument("--timer", choices=("graph", "loop"), default="graph",
                    help="graph: median of CUDA-graph replays of the calls (the GPU's time, as the bench); loop: "
                         "median of back-to-back plain launches from Python (bounded below by their host cost)")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16",
                    help="the activations' dtype: only the variants built for it are timed (default bf16)")
    ap.add_argument("--full-check", action="store_true",
                    help="check every row's codes and scales, and lora_act_in, against the torch version")
    a = ap.parse_args()
    copies = 8
    print("| variant | M | K | R | smooth | ksplit | ctas | carveout % | µs (median) | GB/s | exact |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    ranks = {int(r) for r in a.ranks.split(",") if r}
    bench.warm_gpu()
    timed: list[dict] = []
    for art in a.artifacts:
        lib = svdq_loader.load(art)
        for e in lib.variants:
            _time_variant(a, art, lib, e, ranks, copies, timed)
    print()
    print(best_table(timed))


def best_rows(timed: list[dict]) -> list[dict]:
    """The fastest row of each folder per problem (rank, m, k, smooth) among `timed` (dicts with those keys and
    folder, us, ksplit, ctas, carveout, exact), the problems in the order first timed and the folders in the order
    given; each with ``ratio``: its µs over the first folder's best on the same problem (None where that folder
    has none).  A row whose output was not exact never counts as the fastest: it is left out."""
    folders: list[str] = []
    best: dict = {}
    for row in timed:
        if row["folder"] not in folders:
            folders.append(row["folder"])
        if not row["exact"]:
            continue
        key = (row["rank"], row["m"], row["k"], row["smooth"])
        cur = best.setdefault(key, {}).get(row["folder"])
        if cur is None or row["us"] < cur["us"]:
            best[key][row["folder"]] = row
    out = []
    for key, by_folder in best.items():
        base = by_folder.get(folders[0])
        for f in folders:
            if f in by_folder:
                r = dict(by_folder[f])
                r["ratio"] = r["us"] / base["us"] if base else None
                out.append(r)
    return out


def best_table(timed: list[dict]) -> str:
    """`best_rows` as a markdown table."""
    lines = ["| folder | R | M | K | smooth | µs (fastest) | ksplit | ctas | carveout % | × first folder |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in best_rows(timed):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['folder']} | {r['rank']} | {r['m']} | {r['k']} | {r['smooth']} | {r['us']:.1f} | "
                     f"{r['ksplit']} | {r['ctas']} | {r['carveout']} | {ratio} |")
    return "\n".join(lines)


def grid_for(ln, form: str, m: int, k: int, r: int, ks: int) -> tuple[int, int]:
    """(ksplit, ctas) of grid form `form` (see --ctas) for launcher ln (a QuantizeLauncher)."""
    tiles = qop.tile_count(m, ln.tile_rows, ln.blocked)
    if form == "auto":
        s, ctas, _ = ln.plan(m, k)
        return s, ctas
    if form == "tiles":
        return ks, tiles * ks
    if form.endswith("fill"):
        sms, resident = ln.grid_facts()
        return 1, qop.range_ctas(tiles, k, resident * sms * int(form[:-4] or 1))
    # at most one CTA per (tile, 64-k step) unit, as `range_ctas` keeps the loader's launches: with more, CTAs of
    # empty ranges sit between a split tile's first and last CTA and never arrive, so its LoRA sums are never
    # stored (session 40 timed such grids by mistake: their rows failed the check)
    return 1, min(max(tiles, int(form)), tiles * (k // 64))


def direct_calls(lib, e, m, k, r, ks, copies, smooth_on=True, form="tiles"):
    """Variant e's kernel launcher and `copies` argument lists of fresh random inputs in its dtype (x [m, k], smooth,
    lora_down [k, r]) on the current stream, with the grid forced to form `form` (see --ctas; the range forms
    get a workspace of random bytes each): (launcher, xs, smooth, lora_down, calls, (ksplit, ctas))."""
    dt = _DTYPES[e.knobs["dtype"]]
    xs = [torch.randn(m, k, device="cuda").to(dt) for _ in range(copies)]
    sm = torch.rand(k, device="cuda").add_(0.5).to(dt) if smooth_on else None
    ld = (torch.randn(k, r, device="cuda") / k ** 0.5).to(dt) if r else None
    ql = lib._launcher(e.name, 0, False)
    ks, ctas = grid_for(ql, form, m, k, r, ks)
    frags = None
    if r and qop.LORA_FRAGMENTS_SWITCH in lib.manifest.generator.kernel_switches:
        frags = qop.lora_fragments(ld)                            # the experiment's layout (docs/PERF.md, s57)
    # smooth_on 2: the kernel gets the reciprocals RN(1 / smooth) (smooth_rcp) instead of smooth
    rs = qop.smooth_reciprocals(sm) if smooth_on == 2 else None
    calls = [qop.fast_args("sm_90a", x, sm, ld) if rs is None else
             qop.fast_args("sm_90a", x, None, ld, smooth_rcp=rs) for x in xs]
    stream = torch.cuda.current_stream().cuda_stream
    nbytes = qop.workspace_bytes(ctas, ql.tile_rows, r) if ks == 1 else 0
    keep = []
    for c in calls:
        if frags is not None:
            c[3][qop.LORA_INDEX] = frags.data_ptr()
        c[3][qop.STREAM_INDEX] = stream
        c[3][qop.KSPLIT_INDEX] = ks
        c[3][qop.CTAS_INDEX] = ctas
        if nbytes:
            ws = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
            c[3][qop.WORKSPACE_INDEX] = ws.data_ptr()
            keep.append(ws)
    if rs is not None:
        keep.append(rs)
    if frags is not None:
        keep.append(frags)
    calls = [c + (keep,) for c in calls]                      # each call holds the workspaces
    return ql.inner, xs, sm, ld, calls, (ks, ctas)


def set_carveout(ln, percent: int) -> None:
    """Set the preferred shared-memory carveout (percent; -1 = no preference, the default) of launcher ln's kernels
    on its device."""
    from cuda.bindings import driver as cu
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    dev = cu.CUdevice(ln.device.ordinal)
    for sym, handle in ln.device.kernels.items():
        if sym in ln.kernels:
            err, = cu.cuKernelSetAttribute(attr, percent, handle, dev)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelSetAttribute(carveout {percent}, {sym}): {err}")


def timed_pass(ln, calls) -> float:
    """µs per launch of one back-to-back pass over `calls` (CUDA events around the pass)."""
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for c in calls:
        ln.launch(c[3])
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3 / len(calls)


def graph_time(ln, calls) -> float:
    """µs per launch of `calls` (each launch on the capturing stream), timed as `svdq-aot bench` times an op:
    the median of CUDA-graph replays of passes over the calls."""
    def fn(i):
        args = calls[i][3]
        args[qop.STREAM_INDEX] = torch.cuda.current_stream().cuda_stream     # the warm-up or capture stream
        ln.launch(args)
    res = bench.time_calls(fn, len(calls), bench.Settings(reps=20, warmup=2, target_ms=1.0))
    if res["method"] != "graph":
        raise RuntimeError(f"quant_sweep: {res.get('note') or 'no CUDA graph'}; rerun with --timer loop")
    return res["us"]


def _time_variant(a, art, lib, e, ranks, copies, timed):
    if e.op != "quantize_act" or e.arch != "sm_90a":
        return
    r = e.knobs["rank"]
    if ranks and r not in ranks or e.knobs["dtype"] != a.dtype:
        return
    for mm, k, ks, form, cv in ((int(y), int(x), int(s), f, int(c)) for y in a.m.split(",") for x in a.k.split(",")
                                for s in a.ksplit.split(",") for f in a.ctas.split(",")
                                for c in a.carveout.split(",")):
        if form != "tiles" and ks != 1:
            continue                                          # the range forms have no cluster split
        for smooth_on in (int(x) for x in a.smooth.split(",")):
            set_carveout(lib._launcher(e.name, 0, False).inner, cv)
            ln, xs, sm, ld, calls, (ks_used, ctas) = direct_calls(lib, e, mm, k, r, ks, copies, smooth_on, form)
            ln.launch(calls[0][3])
            torch.cuda.synchronize()
            act, sc, la = calls[0][2]
            ra, rs, _ = quantize_act_ref_torch(xs[0][:64], sm, ld, "logical")     # rows are independent
            exact = torch.equal(act[:64].cpu(), ra) and torch.equal(sc[:64].view(torch.uint8).cpu(), rs)
            if a.full_check:
                # every row against the torch version (equal to the reference: tests/test_gpu_quantize.py), and
                # lora_act_in within 16-bit rounding of it
                ta, ts, tl = tq.quantize_act(xs[0], sm, ld)
                exact = exact and torch.equal(act, ta) and torch.equal(sc.view(torch.uint8), ts.view(torch.uint8))
                if la is not None:
                    err = float((la.float() - tl.float()).norm() / tl.float().norm())
                    exact = exact and err < 1e-2
            if a.timer == "graph":
                us = graph_time(ln, calls)
            else:
                us = statistics.median(timed_pass(ln, calls) for _ in range(20))
            nbytes = mm * k * 2 + mm * k // 2 + mm * k // 16 + mm * r * 2 + k * r * 2 + (k * 2 if smooth_on else 0)
            folder = art.rstrip("/").split("/")[-1]
            short = (folder + ":" if len(a.artifacts) > 1 else "") + e.name.split("_sm90a_")[1]
            print(f"| {short} | {mm} | {k} | {r} | {int(smooth_on)} | {ks_used} | {ctas} | {cv} | {us:.1f} | "
                  f"{nbytes / us / 1e3:.0f} | {'yes' if exact else 'NO'} |", flush=True)
            timed.append(dict(folder=folder, rank=r, m=mm, k=k, smooth=int(smooth_on),
                              ksplit=ks_used, ctas=ctas, carveout=cv, us=us, exact=bool(exact)))


if __name__ == "__main__":
    main()

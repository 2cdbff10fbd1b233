"""``svdq-aot selftest [ARTIFACTS]``: every operator variant built for this GPU against the float64 reference.

For each variant of the current device's arch, a few fresh random problems (M tails, K of one
main k-block so that K < 4R, larger K) go through the loader with selection pinned to that
variant, and are checked by the same code as the GPU tests (`gpu_checks`).  Prints a pass/fail
table with errors and GPU times (``--json`` for a machine-readable report).  Without torch, a
CUDA GPU, or variants for this GPU's arch it says so and exits 0 (``--require-gpu``: exit 1).
Exit status 1 when any case fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    op: str
    kwargs: dict      # arguments of gpu_checks.gemm_case / quantize_case besides lib


def gemm_cases(knobs: dict, req: dict, op: str = "gemm_w4a4") -> list[Case]:
    """M = 1, an M tail past one tile, and a multi-tile M; K = one k-block (K < 4R when R > 0) and more.  The
    selftest pins the variant (no selection), so an M whose row tiles would lie past an images form's stage image
    (`decode_act.tile_rows_problem`, the 216-row tile) is moved up to the next M the form serves."""
    from svdq_loader.ops.decode_act import tile_rows_problem
    n = 2 * req["n_multiple"]
    kmin = req["k_multiple"]
    tm = knobs.get("tile_m", 128)

    def served(m: int) -> int:
        while knobs.get("act_source") == "images" and tile_rows_problem(tm, m):
            m += 1
        return m
    shapes = [(1, n, kmin), (served(tm + 77), n, 4 * kmin),
              (served(3 * tm + 5), 2 * n, max(12 * kmin, 3072 // kmin * kmin))]
    feats = dict(r=knobs["rank"], dt=knobs["out_dtype"], wc=knobs["wcscale"], b=knobs["bias"])
    cases = [Case(op, dict(m=m, n=nn, k=k, seed=1 + i, **feats)) for i, (m, nn, k) in enumerate(shapes)]
    if knobs["wcscale"] or knobs["bias"]:
        # a call without wcscale and bias runs this variant too, passing the identity vectors
        m, nn, k = shapes[1]
        cases.append(Case(op, dict(m=m, n=nn, k=k, seed=4, **dict(feats, wc=False, b=False))))
    return cases


def fp8_gemm_cases(knobs: dict, req: dict) -> list[Case]:
    """The FP8-compute GEMM: the same shapes and calls as `gemm_cases`."""
    return gemm_cases(knobs, req, "gemm_w4a4_fp8")


def quantize_cases(knobs: dict, req: dict) -> list[Case]:
    kmin = req["k_multiple"]
    # smoothing: none, smooth, smooth_rcp (its reciprocals passed)
    shapes = [(1, kmin, 0), (77, max(3072 // kmin, 1) * kmin, 1), (130, 3 * kmin, 2)]
    return [Case("quantize_act", dict(m=m, k=k, dt=knobs["dtype"], use_smooth=sm, r=knobs["rank"], seed=11 + i))
            for i, (m, k, sm) in enumerate(shapes)]


def decode_cases(knobs: dict, req: dict) -> list[Case]:
    """M = 1, a tail past one image block of 256 rows, K of one and of many k-tiles."""
    kmin = req["k_multiple"]
    shapes = [(1, kmin), (300, 3 * kmin), (77, max(3072 // kmin, 1) * kmin)]
    return [Case("decode_act", dict(m=m, k=k, seed=21 + i)) for i, (m, k) in enumerate(shapes)]


def act_fp8_cases(knobs: dict, req: dict) -> list[Case]:
    """M = 1, a tail past one image block, K of one and of many k-tile pairs (decode_act's cases), and M = 1024,
    K = 12288.  In a build with the K split (``SVDQ_KERNEL_SM90_ACT_FP8_KSPLIT=1``, `act_fp8.ksplit`) these split
    each row tile's K over 1, 3, 12 and 7 CTAs (the last unevenly: 48 pairs)."""
    kmin = req["k_multiple"]
    return [Case("act_fp8", c.kwargs) for c in decode_cases(knobs, req)] + \
        [Case("act_fp8", dict(m=1024, k=max(12288 // kmin, 1) * kmin, seed=24))]


CASES_FOR = {"gemm_w4a4": gemm_cases, "quantize_act": quantize_cases, "decode_act": decode_cases,
             "gemm_w4a4_fp8": fp8_gemm_cases, "act_fp8": act_fp8_cases}
_GEMM_OPS = ("gemm_w4a4", "gemm_w4a4_fp8")


def _features(op: str, knobs: dict) -> tuple:
    from svdq_loader.ops import op_spec
    return tuple(knobs[f] for f in op_spec(op).feature_names)


def _call_features(op: str, variant_features: tuple, kw: dict) -> tuple:
    from svdq_loader.ops import GEMM_W4A4
    names = GEMM_W4A4.feature_names
    out = list(variant_features)
    # an FP8-compute weight always has a wcscale (wcscale / rw: prepare_weight)
    out[names.index("wcscale")], out[names.index("bias")] = kw["wc"] or op == "gemm_w4a4_fp8", kw["b"]
    return tuple(out)


def _dims(op: str, kw: dict) -> tuple:
    if op in _GEMM_OPS:
        return (("m", kw["m"]), ("n", kw["n"]), ("k", kw["k"]))
    return (("m", kw["m"]), ("k", kw["k"]))


def run_case(lib, entry, case: Case, ordinal: int, base_seed: int):
    """One case with selection pinned to `entry` (the library's per-problem choice cache is seeded)."""
    from . import gpu_checks
    if case.op in ("decode_act", "act_fp8"):
        kw = dict(case.kwargs)
        check = gpu_checks.decode_case if case.op == "decode_act" else gpu_checks.act_fp8_case
        return check(lib, entry, kw.pop("m"), kw.pop("k"), kw.pop("seed"), base_seed=base_seed, time_it=True)
    ln = lib._launcher(entry.name, ordinal, False)
    feats = _features(case.op, entry.knobs)
    if case.op in _GEMM_OPS:      # the call's own features (a call without wcscale / bias may run this variant)
        feats = _call_features(case.op, feats, case.kwargs)
    lib._choice[(case.op, ordinal, feats, _dims(case.op, case.kwargs))] = ln
    kw = dict(case.kwargs)
    if case.op in _GEMM_OPS:
        return gpu_checks.gemm_case(lib, kw.pop("m"), kw.pop("n"), kw.pop("k"), kw.pop("r"), kw.pop("dt"),
                                    kw.pop("wc"), kw.pop("b"), kw.pop("seed"), base_seed=base_seed, time_it=True,
                                    compute="fp8" if case.op == "gemm_w4a4_fp8" else "exact")
    res, *_ = gpu_checks.quantize_case(lib, kw.pop("m"), kw.pop("k"), kw.pop("dt"), kw.pop("use_smooth"),
                                       kw.pop("r"), kw.pop("seed"), base_seed=base_seed, time_it=True)
    return res


def _num(x):
    """A float for the report, None where there is no number (JSON has no NaN)."""
    return None if x is None or math.isnan(x) else float(x)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    """Fixed-width table: status, variant, case, error / tolerance, GPU time."""
    head = ("status", "variant", "case", "error", "tol", "time")
    body = [(r["status"], r["variant"], r["case"], _fmt(r["error"], ".2e"), _fmt(r["tol"], ".0e"),
             "-" if r["seconds"] is None else f"{r['seconds'] * 1e6:.1f} us") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))] + [line(b) for b in body]
    return "\n".join(out)


def _short_case(case: Case) -> str:
    kw = case.kwargs
    if case.op in _GEMM_OPS:
        return f"M={kw['m']} N={kw['n']} K={kw['k']}" + ("" if kw.get("wc", True) or kw.get("b", True) else
                                                         " no wcscale/bias")
    if case.op in ("decode_act", "act_fp8"):
        return f"M={kw['m']} K={kw['k']}"
    return f"M={kw['m']} K={kw['k']} smooth={int(kw['use_smooth'])}"


def _skip(msg: str, as_json: bool, require: bool) -> int:
    if as_json:
        print(json.dumps({"status": "skipped", "reason": msg, "cases": []}))
    else:
        print(f"selftest skipped: {msg}")
    return 1 if require else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="svdq-aot selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="?", default="artifacts",
                    help="directory holding manifest.json and the cubins (default: artifacts)")
    ap.add_argument("--json", action="store_true", help="print one JSON report instead of the table")
    ap.add_argument("--require-gpu", action="store_true", help="exit 1 instead of 0 when nothing can be checked")
    ap.add_argument("--op", choices=sorted(CASES_FOR), help="only this operator")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: random; printed)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        return _skip("torch is not installed", a.json, a.require_gpu)
    if not torch.cuda.is_available():
        return _skip("torch sees no CUDA GPU on this machine", a.json, a.require_gpu)
    import svdq_loader
    from svdq_loader import driver
    lib = svdq_loader.load(a.artifacts)
    ordinal = torch.cuda.current_device()
    arch = driver.device_arch(ordinal)
    entries = [e for e in lib.variants if e.arch == arch and (a.op is None or e.op == a.op)]
    if not entries:
        built = sorted({e.arch for e in lib.variants})
        return _skip(f"{a.artifacts} holds no variants for this GPU's arch {arch} (built for {', '.join(built)})",
                     a.json, a.require_gpu)
    base = a.seed if a.seed is not None else int.from_bytes(os.urandom(3), "little")
    rows = []
    for e in entries:
        for case in CASES_FOR[e.op](e.knobs, e.requirements):
            try:
                res = run_case(lib, e, case, ordinal, base)
                ok, err, tol, secs, msg = res.ok, res.error, res.tol, res.seconds, res.message
            except Exception as ex:  # noqa: BLE001 - a refused or failing launch is a failed case
                ok, err, tol, secs, msg = False, float("nan"), float("nan"), float("nan"), \
                    f"{type(ex).__name__}: {ex}"
            rows.append(dict(status="PASS" if ok else "FAIL", variant=e.name, op=e.op, case=_short_case(case),
                             error=_num(err), tol=_num(tol), seconds=_num(secs), detail=msg))
    failed = sum(r["status"] == "FAIL" for r in rows)
    dev = torch.cuda.get_device_name(ordinal)
    if a.json:
        print(json.dumps({"status": "failed" if failed else "passed", "device": dev, "arch": arch,
                          "artifacts": str(a.artifacts), "base_seed": base, "cases": rows}, indent=1,
                         allow_nan=False))
    else:
        print(f"selftest: {dev} ({arch}), {len(entries)} variant(s), {len(rows)} case(s), base seed {base}")
        print(format_table(rows))
        for r in rows:
            if r["status"] == "FAIL":
                print(f"FAIL {r['variant']}: {r['detail']}")
        print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

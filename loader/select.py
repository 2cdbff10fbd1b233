"""Which compiled variant serves a problem: one interface, per-arch heuristics.

Pure Python: no CUDA.  `choose()` filters the manifest's variants by what
the call needs (arch, output dtype, LoRA rank, wcscale/bias on/off), then
by the shape rules each variant records (N and K divisibility), then picks
one with the arch's heuristic.  Every refusal names the value and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


class UnsupportedProblem(ValueError):
    """No built variant can serve this call; the message says why."""


@dataclass(frozen=True)
class Problem:
    arch: str
    out_dtype: str   # "bf16" | "fp16"
    rank: int
    wcscale: bool
    bias: bool
    m: int
    n: int
    k: int


def _waste_then_big_tile(p: Problem, v) -> tuple:
    """sm_90a: fewest padded rows in the last M tile, then the larger tile."""
    tm, tn = v.knobs.tile_m, v.knobs.tile_n
    tiles_m = -(-p.m // tm)
    return (tiles_m * tm - p.m > tm // 2, tiles_m * (p.n // tn), -tm * tn)


HEURISTICS: dict[str, Callable[[Problem, object], tuple]] = {
    "sm_90a": _waste_then_big_tile,
}


def shape_problem(v, p: Problem) -> str | None:
    req = v.requirements
    if p.n % req.n_multiple:
        return f"N={p.n} is not a multiple of {req.n_multiple}"
    if p.k % req.k_multiple:
        return f"K={p.k} is not a multiple of {req.k_multiple}"
    return None


def choose(variants: Sequence, p: Problem):
    on_arch = [v for v in variants if v.arch == p.arch]
    if not on_arch:
        built = sorted({v.arch for v in variants})
        raise UnsupportedProblem(
            f"no kernel built for this device's arch {p.arch}; the artifacts hold {built}. "
            f"Rebuild with '{p.arch}' in the config's archs.")
    feats = [v for v in on_arch
             if (v.knobs.out_dtype, v.knobs.rank, bool(v.knobs.wcscale), bool(v.knobs.bias))
             == (p.out_dtype, p.rank, p.wcscale, p.bias)]
    if not feats:
        have = sorted({(v.knobs.out_dtype, v.knobs.rank, bool(v.knobs.wcscale), bool(v.knobs.bias))
                       for v in on_arch})
        raise UnsupportedProblem(
            f"no {p.arch} kernel for out_dtype={p.out_dtype}, lora rank={p.rank}, "
            f"wcscale={'on' if p.wcscale else 'off'}, bias={'on' if p.bias else 'off'}; "
            f"built (out_dtype, rank, wcscale, bias): {have}")
    fits, reasons = [], []
    for v in feats:
        why = shape_problem(v, p)
        (reasons.append(f"{v.name}: {why}") if why else fits.append(v))
    if not fits:
        raise UnsupportedProblem(
            f"shape M={p.m} N={p.n} K={p.k} is not supported by any built kernel: " + "; ".join(reasons))
    key = HEURISTICS.get(p.arch, _waste_then_big_tile)
    return min(fits, key=lambda v: (key(p, v), v.name))

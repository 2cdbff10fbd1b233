"""Which built variant serves a problem: one interface, per-(op, arch) heuristics.

Pure Python, no CUDA.  `choose()` keeps the variants of the problem's op and
arch, then those whose feature knobs equal the call's (the op spec's
features), then those whose requirements pass the op's shape rule, and
picks one with the (op, arch) heuristic.  Every refusal names the value and
the rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import UnsupportedProblem
from .ops import op_spec


@dataclass(frozen=True)
class Problem:
    op: str
    arch: str
    features: tuple                 # in the op spec's feature order
    dims: tuple[tuple[str, int], ...]

    @property
    def dim(self) -> dict[str, int]:
        return dict(self.dims)


def _gemm_sm90(p: Problem, v) -> tuple:
    """Fewest padded activation rows (each is dequantized and multiplied), then the larger tile, then the
    measured forms (prefetch 1, skip_pad off, act_decode shift: run on the H200; the others are compiled only)."""
    d = p.dim
    tm, tn = v.knobs["tile_m"], v.knobs["tile_n"]
    return (-(-d["m"] // tm) * tm, -tm * tn, v.knobs.get("prefetch", 1), v.knobs.get("skip_pad", False),
            v.knobs.get("act_decode", "shift") != "shift")


def _by_name(p: Problem, v) -> tuple:
    return ()


HEURISTICS: dict[tuple[str, str], Callable[[Problem, object], tuple]] = {
    ("gemm_w4a4", "sm_90a"): _gemm_sm90,
}


def _features_text(spec, feats) -> str:
    return ", ".join(f"{n}={v}" for n, v in zip(spec.feature_names, feats))


def choose(variants: Sequence, p: Problem):
    spec = op_spec(p.op)
    mine = [v for v in variants if v.op == p.op]
    if not mine:
        raise UnsupportedProblem(f"the artifacts hold no {p.op} kernels; rebuild with {p.op} in the config")
    on_arch = [v for v in mine if v.arch == p.arch]
    if not on_arch:
        built = sorted({v.arch for v in mine})
        raise UnsupportedProblem(
            f"no {p.op} kernel built for this device's arch {p.arch}; the artifacts hold {p.op} for {built}. "
            f"Rebuild with '{p.arch}' in the config's archs.")
    feats = [v for v in on_arch if spec.feature_key(v.knobs) == p.features]
    if not feats:
        have = sorted({_features_text(spec, spec.feature_key(v.knobs)) for v in on_arch})
        raise UnsupportedProblem(
            f"no {p.arch} {p.op} kernel for {_features_text(spec, p.features)}; built: {'; '.join(have)}")
    fits, reasons = [], []
    dims = p.dim
    for v in feats:
        why = spec.shape_problem(v.requirements, dims)
        (reasons.append(f"{v.name}: {why}") if why else fits.append(v))
    if not fits:
        shown = " ".join(f"{k.upper()}={val}" for k, val in p.dims)
        raise UnsupportedProblem(f"{p.op} shape {shown} is not supported by any built kernel: " + "; ".join(reasons))
    key = HEURISTICS.get((p.op, p.arch), _by_name)
    return min(fits, key=lambda v: (key(p, v), v.name))

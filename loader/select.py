"""Which built variant serves a problem, and why: deterministic, explainable, by the manifest's rules.

Pure Python, no CUDA.  `explain(variants, rules, problem)` walks every
variant of the problem's op and says, for each one, why it is out (another
arch; a feature knob differs; the op's shape rule fails; outranked), and
which one is chosen under the selection rule of its (op, arch, family) and
the M bucket the problem falls in (`select_rules`).  `choose` is the same
walk returning the chosen entry, or raising `UnsupportedProblem` with the
reasons.  The builder writes the rules into the manifest.  The one thing
that can override them is a tuning-table entry measured on the same GPU
model (`tuning_table.TableHit`): its winner is chosen if it fits, and the
explanation says so, naming the table and the GPU; an entry measured on
another GPU model is reported and ignored.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .errors import UnsupportedProblem
from .ops import op_spec
from .select_rules import Fill, Rule, rule_for


@dataclass(frozen=True)
class Problem:
    op: str
    arch: str
    features: tuple                 # in the op spec's feature order
    dims: tuple[tuple[str, int], ...]

    @property
    def dim(self) -> dict[str, int]:
        return dict(self.dims)


@dataclass
class Explanation:
    """The outcome of selection for one problem, with every reason."""
    problem: Problem
    chosen: object | None                       # the VariantEntry, or None
    why: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)   # (variant name, reason)
    error: str | None = None                    # the UnsupportedProblem message when nothing fits
    candidates: list[str] = field(default_factory=list)   # names of every variant that fits (rule order)
    source: str = "rules"                       # "rules" or "tuning_table": what made the choice
    served_features: tuple | None = None        # the variants' features (the call's, or with identity fills)
    tuning: dict | None = None                  # the table entry consulted (file, GPU, times), if any

    def to_dict(self) -> dict:
        spec = op_spec(self.problem.op)
        return {"op": self.problem.op, "arch": self.problem.arch,
                "features": dict(zip(spec.feature_names, self.problem.features)), "dims": self.problem.dim,
                "chosen": getattr(self.chosen, "name", None), "why": list(self.why),
                "rejected": [{"name": n, "reason": r} for n, r in self.rejected], "error": self.error,
                "source": self.source, "tuning": self.tuning,
                "served_features": (dict(zip(spec.feature_names, self.served_features))
                                    if self.served_features is not None else None)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def text(self) -> str:
        p = self.problem
        spec = op_spec(p.op)
        head = (f"{p.op} on {p.arch}, " + " ".join(f"{k.upper()}={v}" for k, v in p.dims) + ", "
                + _features_text(spec, p.features))
        lines = [head]
        if self.chosen is not None and self.source == "tuning_table":
            lines.append(f"chosen: {self.chosen.name} (from the tuning table {self.tuning['file']}, measured on "
                         f"{self.tuning['measured_on']['gpu']})")
        elif self.chosen is not None:
            lines.append(f"chosen: {self.chosen.name}")
        else:
            lines.append(f"no variant: {self.error}")
        lines += [f"  why: {w}" for w in self.why]
        lines.append(f"rejected ({len(self.rejected)}):")
        lines += [f"  {n}: {r}" for n, r in self.rejected]
        return "\n".join(lines)


def _features_text(spec, feats) -> str:
    return ", ".join(f"{n}={v}" for n, v in zip(spec.feature_names, feats))


#: SM count assumed where no device is named (explaining without a GPU): an H100 / H200 SXM.
DEFAULT_SM_COUNT = 132


def rank_key(rule: Rule, dims: Mapping[str, int], v, sm_count: int = DEFAULT_SM_COUNT) -> tuple:
    """The sort key of variant `v` under `rule` for a problem of `dims` on `sm_count` SMs (smaller first)."""
    _, b = rule.bucket(dims.get("m", 1))
    return (b.priority, rule.family, tuple(p.rank(v.knobs, dims, sm_count) for p in b.prefer), v.name)


def _outranked(rules, p: Problem, v, best, sm_count: int) -> str:
    m = p.dim.get("m", 1)
    rv = rule_for(rules, p.op, p.arch, getattr(v, "family", ""))
    rb = rule_for(rules, p.op, p.arch, getattr(best, "family", ""))
    lo, bv = rv.bucket(m)
    _, bb = rb.bucket(m)
    if (bv.priority, rv.family) != (bb.priority, rb.family):
        return (f"outranked by {best.name}: family {rv.family} has priority {bv.priority} for {bv.text(lo)}, "
                f"family {rb.family} has {bb.priority} (lower wins; then the family name)")
    for pref in bv.prefer:
        why = pref.differs(v.knobs, best.knobs, p.dim, sm_count)
        if why:
            return f"outranked by {best.name}: {why} ({pref.text()} for {bv.text(lo)})"
    return f"ranks equal to {best.name} under the rule for {bv.text(lo)}; the name breaks the tie"


def explain(variants: Sequence, rules: Mapping[tuple[str, str, str], Rule], p: Problem, hit=None,
            sm_count: int | None = None) -> Explanation:
    """Every variant of `p`'s op with why it is chosen or out; `hit` (a `tuning_table.TableHit` or None) is
    the tuning-table entry found for `p`; `sm_count`: the device's SMs (grid-fill preferences read it; None
    assumes `DEFAULT_SM_COUNT` and says so where it matters)."""
    sms = DEFAULT_SM_COUNT if sm_count is None else int(sm_count)
    spec = op_spec(p.op)
    ex = Explanation(p, None)
    mine = [v for v in variants if v.op == p.op]
    if not mine:
        ex.error = f"the artifacts hold no {p.op} kernels; rebuild with {p.op} in the config"
        return ex
    on_arch = []
    for v in mine:
        if v.arch != p.arch:
            ex.rejected.append((v.name, f"built for {v.arch}, not {p.arch}"))
        else:
            on_arch.append(v)
    if not on_arch:
        built = sorted({v.arch for v in mine})
        ex.error = (f"no {p.op} kernel built for this device's arch {p.arch}; the artifacts hold {p.op} for "
                    f"{built}. Rebuild with '{p.arch}' in the config's archs.")
        return ex
    keys = spec.serving_keys(p.features)
    groups: dict[tuple, list] = {}
    for v in on_arch:
        have = spec.feature_key(v.knobs)
        if have in keys:
            groups.setdefault(have, []).append(v)
            continue
        diff = [f"{n}={h} (the call needs {w})" for n, h, w in zip(spec.feature_names, have, p.features) if h != w]
        ex.rejected.append((v.name, "built for " + ", ".join(diff)))
    if not groups:
        have = sorted({_features_text(spec, spec.feature_key(v.knobs)) for v in on_arch})
        ex.error = f"no {p.arch} {p.op} kernel for {_features_text(spec, p.features)}; built: {'; '.join(have)}"
        return ex
    # the first serving key (the call's own, then fills) with a variant that passes the shape rule serves
    fits, reasons, served, dims = [], [], None, p.dim
    for key in keys:
        for v in groups.get(key, ()):
            if served is not None:
                ex.rejected.append((v.name, f"serves the call with {spec.filled_text(p.features, key)}, but the "
                                            f"variants built for {spec.filled_text(p.features, served) or 'its own features'} "
                                            f"come first"))
                continue
            why = spec.shape_problem(v.requirements, dims, v.knobs)
            if why:
                reasons.append(f"{v.name}: {why}")
                ex.rejected.append((v.name, why))
            else:
                fits.append(v)
        if fits and served is None:
            served = key
    if not fits:
        shown = " ".join(f"{k.upper()}={val}" for k, val in p.dims)
        ex.error = f"{p.op} shape {shown} is not supported by any built kernel: " + "; ".join(reasons)
        return ex
    ex.served_features = served
    m = dims.get("m", 1)
    keyed = sorted(fits, key=lambda v: rank_key(rule_for(rules, p.op, p.arch, getattr(v, "family", "")), dims, v, sms))
    ex.candidates = [v.name for v in keyed]
    if hit is not None and _tuned(ex, keyed, hit, len(mine)):
        return ex
    best = keyed[0]
    ex.chosen = best
    rule = rule_for(rules, p.op, p.arch, getattr(best, "family", ""))
    lo, b = rule.bucket(m)
    ex.why.append(f"{len(fits)} of {len(mine)} {p.op} variant(s) fit the arch, the features and the shape rule")
    if served != p.features:
        ex.why.append(_filled_why(spec, p.features, served))
    prefs = "; ".join(x.text() for x in b.prefer) or "no preference (name order)"
    ex.why.append(f"family {rule.family}: M={m} falls in the bucket {b.text(lo)}, priority {b.priority}, "
                  f"prefer: {prefs}")
    if b.prefer:
        ex.why.append("chosen knobs: " + ", ".join(t for x in b.prefer if (t := x.chosen_text(best.knobs, dims, sms))))
    if sm_count is None and any(isinstance(x, Fill) for x in b.prefer):
        ex.why.append(f"the grid fill assumes {sms} SMs (no device given)")
    if p.op in COMPUTE_MODE_OF:
        ex.why.append(COMPUTE_MODE_OF[p.op])
    pre = op_spec(p.op).prepass(best.knobs)
    if pre:
        ex.why.append(f"each call runs {pre} first, into a workspace it allocates on the call's stream")
    for v in keyed[1:]:
        ex.rejected.append((v.name, _outranked(rules, p, v, best, sms)))
    return ex


def _filled_why(spec, call: tuple, served: tuple) -> str:
    return (f"no variant built for the call's own features fits; variants built with the inputs it lacks serve "
            f"it, the call passing {spec.filled_text(call, served)} for every column (x·1 + 0 = x: the same "
            f"result, up to the sign of a zero)")


def _tuned(ex: Explanation, keyed: list, hit, n_op: int) -> bool:
    """Apply a tuning-table entry: choose its winner (True), or note why the rules decide instead (False)."""
    e, table = hit.entry, hit.table
    on = table.gpu.text() if hit.gpu is None else hit.gpu.text()
    ex.tuning = {"file": table.source, "measured_on": dict(table.measured_on), "bucket": e.bucket_text(),
                 "ms": list(e.ms), "winner": e.winner, "rule_choice": e.rule_choice,
                 "times_us": {n: list(t) for n, t in e.times_us.items()}, "applies": hit.applies,
                 "gpu": on}
    if not hit.applies:
        ex.why.append(f"the tuning table {table.source} has an entry for this problem ({e.bucket_text()}), measured "
                      f"on {table.measured_text()}; this device is {on}, so it is ignored and the rules decide")
        return False
    by_name = {v.name: v for v in keyed}
    best = by_name.get(e.winner)
    if best is None:  # parse_table checks the winner serves the shape; kept for tables of a subset
        ex.why.append(f"the tuning table {table.source} picks {e.winner}, which does not fit; the rules decide")
        return False
    ex.chosen, ex.source = best, "tuning_table"
    assumed = " (assumed: the device this runs on is that model)" if hit.gpu is None else ""
    gain = table.method.get("min_gain", 0)
    ex.why.append(f"{len(keyed)} of {n_op} {ex.problem.op} variant(s) fit the arch, the features and the shape rule")
    if ex.served_features != ex.problem.features:
        ex.why.append(_filled_why(op_spec(ex.problem.op), ex.problem.features, ex.served_features))
    what = "fastest" if e.rule_choice != e.winner else \
        f"the rules' choice, not beaten by more than {gain:.0%} by any other"
    ex.why.append(f"chosen by the tuning table {table.source}, measured on {table.measured_text()}{assumed}: "
                  f"{what} for {e.bucket_text()} ({e.times_text(e.winner)})")
    if e.rule_choice != e.winner:
        ex.why.append(f"the rules would pick {e.rule_choice} ({e.times_text(e.rule_choice)})")
    for v in keyed:
        if v is best:
            continue
        if v.name not in e.times_us:
            ex.rejected.append((v.name, f"not measured by the tuning table; its winner {best.name} is preferred"))
            continue
        r = math.exp(sum(math.log(a / b) for a, b in zip(e.times_us[v.name], e.times_us[best.name])) / len(e.ms))
        if r < 1:
            ex.rejected.append((v.name, f"{1 - r:.1%} faster in the tuning table ({e.times_text(v.name)}), within "
                                        f"its {gain:.0%} margin: the rules' choice {best.name} is kept"))
        else:
            ex.rejected.append((v.name, f"{r - 1:.1%} slower in the tuning table ({e.times_text(v.name)}) than "
                                        f"{best.name}"))
    return True


#: What `explain` says of the compute mode of a GEMM call (docs/design.md section 2): the mode is the operator, which
#: the call's prepared weight decides (`prepare_weight(compute=...)`), never the selection.
COMPUTE_MODE_OF = {
    "gemm_w4a4": "compute mode exact: the W4A4 operator as stated (the default)",
    "gemm_w4a4_fp8": ("compute mode fp8: each NVFP4 operand rounded once to E4M3 on FP8 tensor cores, not "
                      "bit-equivalent to the exact operator (the call's weight was prepared with compute='fp8')"),
}


def choose(variants: Sequence, p: Problem, rules: Mapping[tuple[str, str, str], Rule] | None = None, hit=None,
           sm_count: int | None = None):
    """The variant for `p` (raises UnsupportedProblem naming every refusal); `hit`, `sm_count`: see `explain`."""
    ex = explain(variants, rules or {}, p, hit, sm_count)
    if ex.chosen is None:
        raise UnsupportedProblem(ex.error)
    return ex.chosen


def problem_for(op: str, arch: str, *, dtype: str = "bf16", rank: int = 0, wcscale: bool = True,
                bias: bool = True, **dims: int) -> Problem:
    """A `Problem` from plain values: the op's features by name (``dtype`` fills ``out_dtype``/``dtype``;
    features fixed by the arch, such as the scale layout, are taken from it) and its dims."""
    spec = op_spec(op)
    given = {"out_dtype": dtype, "dtype": dtype, "rank": int(rank), "wcscale": bool(wcscale), "bias": bool(bias)}
    feats = []
    for f in spec.features:
        if f.by_arch is not None:
            if arch not in f.by_arch:
                raise UnsupportedProblem(f"op {op} has no {f.name} for arch {arch!r} (known archs: "
                                         f"{', '.join(sorted(f.by_arch))})")
            feats.append(f.by_arch[arch])
        elif f.name in given:
            feats.append(given[f.name])
        else:  # pragma: no cover - a new feature needs a value here
            raise UnsupportedProblem(f"op {op}: no value given for feature {f.name}")
    missing = [d for d in spec.dims if d not in dims]
    if missing:
        raise UnsupportedProblem(f"op {op} needs the dims {', '.join(spec.dims)}; missing {', '.join(missing)}")
    extra = sorted(set(dims) - set(spec.dims))
    if extra:
        raise UnsupportedProblem(f"op {op} has no dims {extra} (its dims: {', '.join(spec.dims)})")
    return Problem(op, arch, tuple(feats), tuple((d, int(dims[d])) for d in spec.dims))

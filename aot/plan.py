"""What a build of a config will do, before anything is compiled or written.

`plan_build(config_path)` reads the config, enumerates the variants (valid
and rejected, with reasons) and finds every requested problem no valid
variant serves (a *coverage gap*, named by its config key: ``ranks[i]``,
``shapes.NAME``).  `svdq-aot list` prints it; `build` refuses to start
unless it has no problem.  `select_shard` picks the deterministic subset of
``--shard I/N``.
"""
from __future__ import annotations

from dataclasses import dataclass

from svdq_loader.ops import op_spec

from .config import Config, load_config
from .errors import PlanError
from .variants import FamilyUnavailable, Variant, check_sections, enumerate_variants, feature_combinations


@dataclass
class Plan:
    config: Config
    valid: list[Variant]
    rejected: list[tuple[Variant, str]]
    gaps: list[tuple[str, str]]          # (config key, problem)

    def problem(self) -> str | None:
        """Why `build` would fail (one summarised message), or None."""
        if not self.valid:
            first = f" (e.g. {self.rejected[0][0].name}: {self.rejected[0][1]})" if self.rejected else ""
            return f"{self.config.path}: no valid variants; all {len(self.rejected)} were rejected{first}"
        if self.gaps:
            return summarise_gaps(self.config, self.gaps)
        return None

    def gap_summary(self) -> dict[str, list[str]]:
        """{config key: [problem, ...]} in config order."""
        out: dict[str, list[str]] = {}
        for k, text in self.gaps:
            out.setdefault(k, []).append(text)
        return out


def plan_build(config_path) -> Plan:
    """Config -> Plan.  Raises ConfigError (invalid config) or PlanError (a family will not import)."""
    config = load_config(config_path)
    try:
        check_sections(config)
        valid, rejected = enumerate_variants(config)
    except FamilyUnavailable as e:
        raise PlanError(str(e)) from e
    gaps = coverage_gaps(config, valid, rejected) if valid else []
    return Plan(config, valid, rejected, gaps)


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` (1 <= I <= N) -> (I, N); ValueError naming the rule otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected I/N with integers, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {text!r}: need 1 <= I <= N")
    return i, n


def select_shard(valid: list[Variant], shard: tuple[int, int] | None) -> list[Variant]:
    """The variants shard (I, N) builds: every N-th one of the enumeration order, starting at I-1."""
    if shard is None:
        return list(valid)
    i, n = shard
    if n > len(valid):
        raise PlanError(f"--shard {i}/{n}: the config has only {len(valid)} valid variant(s); "
                        f"use at most {len(valid)} shards")
    return [v for idx, v in enumerate(valid) if idx % n == i - 1]


def _feature_keys(spec, feats: dict, config: Config) -> list[str]:
    """``ranks[2]=128``-style config keys of a feature combination."""
    out = []
    for f in spec.features:
        if f.source == "arch":
            continue
        values = list(getattr(config, f.source))
        v = feats[f.name]
        i = next(j for j, x in enumerate(values) if x == v and type(x) is type(v))
        out.append(f"{f.source}[{i}]={str(v).lower() if isinstance(v, bool) else v}")
    return out


def coverage_gaps(config: Config, valid: list[Variant],
                  rejected: list[tuple[Variant, str]]) -> list[tuple[str, str]]:
    """(config key, problem) for every requested problem no valid variant serves."""
    gaps: list[tuple[str, str]] = []
    for arch in config.archs:
        for op, _section in config.sections(arch):
            spec = op_spec(op)
            mine = [v for v in valid if (v.op, v.arch) == (op, arch)]
            reqs = {v: v.requirements() for v in mine}
            for feats in feature_combinations(op, arch, config):
                key = spec.feature_key(feats)
                cands = [v for v in mine if v.feature_key == key]
                fkeys = _feature_keys(spec, feats, config)
                if not cands:
                    why = [r for v, r in rejected if (v.op, v.arch) == (op, arch) and v.feature_key == key]
                    detail = f"every variant was rejected, e.g.: {why[0]}" if why else "no variant was enumerated"
                    culprit = next((k for k in fkeys if k.startswith("ranks[")), fkeys[0] if fkeys else op)
                    gaps.append((culprit.split("=")[0], f"{op} on {arch} has no valid variant for "
                                                        f"{', '.join(fkeys)} ({detail})"))
                    continue
                for label, where, dims in spec.coverage_problems(config):
                    if any(spec.shape_problem(reqs[v], dims) is None for v in cands):
                        continue
                    rule = spec.shape_problem(reqs[cands[0]], dims)
                    gaps.append((where, f"{label} is not served by any {op} variant on {arch} for "
                                        f"{', '.join(fkeys)} ({cands[0].name}: {rule})"))
    gaps += prepass_gaps(valid)
    return gaps


def prepass_gaps(valid: list[Variant]) -> list[tuple[str, str]]:
    """(config key, problem) for every variant whose call runs another op first (the op spec's
    ``prepass``) where the build has no variant of that op on the same arch."""
    have = {(v.op, v.arch) for v in valid}
    gaps: list[tuple[str, str]] = []
    for v in valid:
        pre = op_spec(v.op).prepass(v.knob_dict)
        if pre and (pre, v.arch) not in have:
            gaps.append((f"variants.{v.arch}.{pre}",
                         f"{v.name} runs {pre} before each call, and the config builds no {pre} variant on "
                         f"{v.arch} (add `{pre}: {{}}` under variants.{v.arch})"))
    return gaps


def check_coverage(config: Config, valid: list[Variant], rejected: list[tuple[Variant, str]]) -> None:
    """PlanError summarising every coverage gap by config key (first gap of each key in full)."""
    gaps = coverage_gaps(config, valid, rejected)
    if gaps:
        raise PlanError(summarise_gaps(config, gaps))


def summarise_gaps(config: Config, gaps: list[tuple[str, str]]) -> str:
    """One message: how many gaps, then per config key (first 4 keys) its first problem in full."""
    by_key: dict[str, list[str]] = {}
    for k, text in gaps:
        by_key.setdefault(k, []).append(text)
    parts = [f"{k}: {texts[0]}" + (f" (+{len(texts) - 1} similar)" if len(texts) > 1 else "")
             for k, texts in list(by_key.items())[:4]]
    more = f"; and {len(by_key) - 4} more config keys" if len(by_key) > 4 else ""
    return (f"{config.path}: {len(gaps)} requested combination(s) cannot be served: "
            + "; ".join(parts) + more)



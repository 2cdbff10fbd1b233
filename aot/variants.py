"""Kernel variants: one frozen record per kernel to compile.

A `Variant` is ``(op, arch, knobs)``: the op's feature knobs (from the op
spec, e.g. out_dtype, rank) followed by the family's tuning knobs (e.g.
tile_m).  Its name is the one naming rule of `svdq_loader.ops.variant_name`,
which is also the kernel symbol prefix.

Validity has one statement per family (``family.invalid_reason``).
Enumeration never drops a combination silently: invalid ones come back
with their reason.  Families are found through `svdq_kernels.registry`;
importing one imports the DSL, which only happens at build time.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any

from svdq_loader.ops import op_spec

if TYPE_CHECKING:  # pragma: no cover
    from .config import Config


class FamilyUnavailable(RuntimeError):
    """A kernel family exists for (op, arch) but cannot be imported (environment problem)."""


def _registry() -> Any:
    from svdq_kernels import registry
    return registry


_FAMILY_CACHE: dict[tuple[int, str, str], Any] = {}


def family_module(op: str, arch: str) -> Any:
    """The family for (op, arch); KeyError if none, FamilyUnavailable if it will not import."""
    reg = _registry()
    if (op, arch) not in reg.FAMILIES:
        raise KeyError((op, arch))
    key = (id(reg), op, arch)
    if key not in _FAMILY_CACHE:
        try:
            _FAMILY_CACHE[key] = reg.family(op, arch)
        except Exception as e:  # noqa: BLE001 - report any import-time failure clearly
            hint = " (is the build extra `nvidia-cutlass-dsl` installed?)" if isinstance(e, ImportError) else ""
            raise FamilyUnavailable(
                f"kernel family {reg.FAMILIES[(op, arch)]} for {op} on {arch} failed to load: "
                f"{type(e).__name__}: {e}{hint}") from e
    return _FAMILY_CACHE[key]


@dataclass(frozen=True)
class Variant:
    op: str
    arch: str
    knobs: tuple[tuple[str, Any], ...]   # (name, value) in order: op features, then family tuning knobs

    @classmethod
    def make(cls, op: str, arch: str, knobs: dict) -> "Variant":
        return cls(op, arch, tuple(knobs.items()))

    @property
    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)

    def __getitem__(self, key: str) -> Any:
        return self.knob_dict[key]

    @property
    def name(self) -> str:
        return op_spec(self.op).name_for(self.arch, self.knob_dict, self.requirements())

    @property
    def feature_key(self) -> tuple:
        return op_spec(self.op).feature_key(self.knob_dict)

    def family(self) -> Any:
        return family_module(self.op, self.arch)

    def requirements(self) -> dict[str, int]:
        """What the op's shape rule reads, from the family (a variant no family builds has none)."""
        try:
            return dict(self.family().requirements(self.arch, self.knob_dict))
        except (KeyError, TypeError, ValueError):
            return {k: 0 for k in op_spec(self.op).requirement_keys}

    def invalid_reason(self) -> str | None:
        """None if this variant can be built, else why (one line, from the op spec or the family)."""
        try:
            fam = self.family()
        except KeyError:
            return f"no {self.op} kernel family for {self.arch}"
        problems = op_spec(self.op).check_feature_values(self.knob_dict, self.arch)
        if problems:
            return "; ".join(problems)
        return fam.invalid_reason(self.arch, self.knob_dict)


def feature_combinations(op: str, arch: str, config: "Config") -> list[dict[str, Any]]:
    """Every combination of the op's feature knobs the config asks for on `arch`, in config order."""
    spec = op_spec(op)
    axes = []
    for f in spec.features:
        if f.source == "arch":
            axes.append([f.by_arch[arch]] if f.by_arch and arch in f.by_arch else [None])
        else:
            axes.append(list(getattr(config, f.source)))
    return [dict(zip(spec.feature_names, combo)) for combo in product(*axes)]


#: the key of a tuning dict (a family's config_axes output) that limits it to some feature values:
#: ``{"_only": {"rank": (128,)}}`` builds that tuning for rank 128 only
ONLY_KEY = "_only"


def enumerate_variants(config: "Config") -> tuple[list[Variant], list[tuple[Variant, str]]]:
    """Every combination the config asks for, split into (valid, [(rejected, reason)]).

    Order is deterministic: archs, then ops, in config order; within, feature
    combinations then tuning combinations in config order.  Tuning values
    "auto" are resolved by the family; a combination that resolves to one
    already produced is the same variant and appears once.
    """
    valid: list[Variant] = []
    rejected: list[tuple[Variant, str]] = []
    seen: set[Variant] = set()
    for arch in config.archs:
        for op, section in config.sections(arch):
            fam = family_module(op, arch)
            tunings, problems = fam.config_axes(arch, section)
            if problems:  # the config validator reports these first; defensive
                raise ValueError(f"variants.{arch}.{op}: " + "; ".join(problems))
            for feats in feature_combinations(op, arch, config):
                for tune in tunings:
                    # a tuning dict may restrict the features it is built for: "_only" = {feature: values}
                    only = tune.get(ONLY_KEY, {})
                    if any(feats[f] not in vals for f, vals in only.items()):
                        continue
                    tune = {k: v for k, v in tune.items() if k != ONLY_KEY}
                    knobs = fam.resolve(arch, {**feats, **tune})
                    v = Variant.make(op, arch, {**feats, **{k: knobs[k] for k in tune}})
                    if v in seen:
                        continue
                    seen.add(v)
                    reason = v.invalid_reason()
                    if reason is None:
                        valid.append(v)
                    else:
                        rejected.append((v, reason))
    return valid, rejected


def check_sections(config: "Config") -> None:
    """Ask each (op, arch) family about its config section; ConfigError with key paths on problems.

    Imports the kernel families (and so the DSL).
    """
    from .config import ConfigError
    problems = []
    for av in config.arch_variants:
        for op, section in av.ops:
            fam = family_module(op, av.arch)
            _, probs = fam.config_axes(av.arch, dict(section))
            problems += [f"{config.path}: variants.{av.arch}.{op}.{p}" for p in probs]
    if problems:
        raise ConfigError(problems)

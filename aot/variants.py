"""Kernel variants: one frozen dataclass per compiled kernel.

`Variant.invalid_reason()` is *the* statement of which knob combinations
exist.  Enumeration never drops a combination silently: invalid ones are
returned with their reason.

Kernel families are found through `svdq_kernels.registry` (``FAMILIES``:
arch -> module name, ``family(arch)`` -> module).  A family module declares
``SUPPORTED`` (allowed knob values), ``HOST_ARGS``, ``resource_problem(v)``
and ``compile_variant(v, dump_dir)``.  Importing a family imports the DSL;
that only happens here, at build time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .config import Config

#: Alignment (bytes) every pointer handed to a kernel must have.
PTR_ALIGN = 16


class FamilyUnavailable(RuntimeError):
    """A kernel family exists for the arch but cannot be imported (environment problem)."""


# --------------------------------------------------------------------------
# Registry access (single indirection so tests can substitute a fake family)
# --------------------------------------------------------------------------

def _registry() -> Any:
    from svdq_kernels import registry
    return registry


def known_archs() -> tuple[str, ...]:
    """Archs that have a kernel family, in registry order (empty if the registry is absent)."""
    try:
        reg = _registry()
    except ImportError:
        return ()
    return tuple(reg.FAMILIES)


def family_name(arch: str) -> str:
    """Short family name recorded in the manifest, e.g. ``sm90_w4a4``."""
    return str(_registry().FAMILIES[arch]).rsplit(".", 1)[-1]


_FAMILY_CACHE: dict[tuple[int, str], Any] = {}


def family_module(arch: str) -> Any:
    """The family module for `arch`; raises KeyError if none, FamilyUnavailable if it will not import."""
    reg = _registry()
    if arch not in reg.FAMILIES:
        raise KeyError(arch)
    key = (id(reg), arch)
    if key not in _FAMILY_CACHE:
        try:
            _FAMILY_CACHE[key] = reg.family(arch)
        except Exception as e:  # noqa: BLE001 - report any import-time failure clearly
            raise FamilyUnavailable(
                f"kernel family {reg.FAMILIES[arch]} for {arch} failed to import: "
                f"{type(e).__name__}: {e} (is the build extra `nvidia-cutlass-dsl` installed?)") from e
    return _FAMILY_CACHE[key]


def _no_family_reason(arch: str) -> str:
    have = ", ".join(known_archs()) or "none"
    extra = " (sm_100a/sm_103a have no kernel family yet)" if arch.startswith("sm_10") else ""
    return f"arch {arch} has no kernel family{extra}; families exist for: {have}"


# --------------------------------------------------------------------------
# Variant
# --------------------------------------------------------------------------

_SUPPORT_AXES = (
    # (SUPPORTED key, description, getter)
    ("out_dtypes", "out_dtype", lambda v: v.out_dtype),
    ("ranks", "rank", lambda v: v.rank),
    ("tile_m", "tile_m", lambda v: v.tile_m),
    ("tile_n", "tile_n", lambda v: v.tile_n),
    ("tile_k", "tile_k", lambda v: v.tile_k),
    ("cluster", "cluster (m, n)", lambda v: (v.cluster_m, v.cluster_n)),
    ("stages", "stages", lambda v: v.stages),
    ("wcscale", "wcscale", lambda v: v.wcscale),
    ("bias", "bias", lambda v: v.bias),
)


def _as_set(values) -> set:
    return {tuple(x) if isinstance(x, list) else x for x in values}


@dataclass(frozen=True)
class Variant:
    arch: str            # "sm_90a"
    out_dtype: str       # "bf16" | "fp16"
    rank: int            # LoRA rank R (0 = no LoRA)
    wcscale: bool        # per-column scale applied
    bias: bool           # per-column bias added
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 1

    @property
    def name(self) -> str:
        return (
            f"svdq_w4a4_{self.arch}_{self.out_dtype}_r{self.rank}"
            f"_wc{int(self.wcscale)}_b{int(self.bias)}"
            f"_t{self.tile_m}x{self.tile_n}x{self.tile_k}"
            f"_c{self.cluster_m}x{self.cluster_n}_s{self.stages}"
        )

    # -- what the loader must enforce ------------------------------------
    @property
    def requirements(self) -> dict[str, int]:
        return {"n_multiple": self.tile_n, "k_multiple": self.tile_k, "ptr_align": PTR_ALIGN}

    def serves(self, k: int, n: int) -> bool:
        return n % self.tile_n == 0 and k % self.tile_k == 0

    def knobs(self) -> dict[str, Any]:
        return {"out_dtype": self.out_dtype, "rank": self.rank, "wcscale": self.wcscale,
                "bias": self.bias, "tile_m": self.tile_m, "tile_n": self.tile_n,
                "tile_k": self.tile_k, "cluster_m": self.cluster_m,
                "cluster_n": self.cluster_n, "stages": self.stages}

    # -- validity ----------------------------------------------------------
    def invalid_reason(self) -> str | None:
        """None if this variant can be built, else why not (one line).

        Order: arch has a family; rank is a non-negative multiple of 16; every
        knob is among the family's SUPPORTED values (all violations listed);
        then the family's own resource check (SMEM/register budget...).
        """
        try:
            fam = family_module(self.arch)
        except KeyError:
            return _no_family_reason(self.arch)
        problems = []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0 or self.rank % 16:
            problems.append(f"rank {self.rank!r} is not a non-negative multiple of 16")
        supported = getattr(fam, "SUPPORTED", {})
        for key, what, get in _SUPPORT_AXES:
            if key not in supported:
                continue
            allowed = supported[key]
            value = get(self)
            if value not in _as_set(allowed):
                shown = sorted(_as_set(allowed), key=repr)
                problems.append(f"{what} {value!r} not supported by {family_name(self.arch)} "
                                f"(supported: {', '.join(map(repr, shown))})")
        if problems:
            return "; ".join(problems)
        problem = fam.resource_problem(self)
        return str(problem) if problem else None


# --------------------------------------------------------------------------
# Enumeration
# --------------------------------------------------------------------------

def resolve_stages(variant: Variant, fam: Any) -> int:
    """The family's default stage count for `variant` (its `stages` value is ignored).

    Uses, in order: ``fam.default_stages(variant)``; ``fam.DEFAULT_STAGES``;
    otherwise the deepest SUPPORTED stage count without a resource problem
    (the deepest overall if none fits, so the variant is rejected with the
    family's reason rather than dropped).
    """
    fn = getattr(fam, "default_stages", None)
    if callable(fn):
        return int(fn(variant))
    default = getattr(fam, "DEFAULT_STAGES", None)
    if default is not None:
        return int(default)
    choices = sorted(getattr(fam, "SUPPORTED", {}).get("stages", ()) or (1,), reverse=True)
    for s in choices:
        if fam.resource_problem(replace(variant, stages=s)) is None:
            return s
    return choices[0]


def enumerate_variants(config: "Config") -> tuple[list[Variant], list[tuple[Variant, str]]]:
    """Every combination of the config's axes, split into (valid, [(rejected, reason)]).

    Order is deterministic: archs, out_dtypes, ranks, wcscale, bias, tiles,
    clusters, stages, each in config order.  ``"auto"`` stages resolve to the
    family default; a combination that resolves to one already produced is
    the same variant and appears once.
    """
    valid: list[Variant] = []
    rejected: list[tuple[Variant, str]] = []
    seen: set[Variant] = set()
    for arch in config.archs:
        axes = config.variants[arch]
        try:
            fam = family_module(arch)
        except KeyError:
            fam = None
        for dtype in config.out_dtypes:
            for rank in config.ranks:
                for wc in config.wcscale:
                    for b in config.bias:
                        for (tm, tn, tk) in axes.tiles:
                            for (cm, cn) in axes.clusters:
                                for st in axes.stages:
                                    v = Variant(arch=arch, out_dtype=dtype, rank=rank, wcscale=wc, bias=b,
                                                tile_m=tm, tile_n=tn, tile_k=tk, cluster_m=cm, cluster_n=cn,
                                                stages=1 if st == "auto" else st)
                                    if st == "auto" and fam is not None:
                                        v = replace(v, stages=resolve_stages(v, fam))
                                    if v in seen:
                                        continue
                                    seen.add(v)
                                    reason = v.invalid_reason()
                                    if reason is None:
                                        valid.append(v)
                                    else:
                                        rejected.append((v, reason))
    return valid, rejected

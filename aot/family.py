"""The contract a kernel family must meet, and the registry that enforces it.

A *family* builds the kernels of one operator for one or more archs (the
registry keys it by ``(op, arch)``).  It is a module (or any object) with:

``OP: str``
    the operator it implements (a key of ``svdq_loader.ops.OPS``).
``ARCHS: tuple[str, ...]``
    the archs it builds.
``NAME: str``
    short family name recorded in the manifest (``sm90_gemm_w4a4``).
``TUNING: dict[str, tuple]``
    its own knobs and the values it supports, in name order (e.g.
    ``{"tile_m": (64, 128), ...}``).  Feature knobs come from the op spec.
``config_axes(arch, section) -> (list[dict], list[str])``
    the config section ``variants.<arch>.<op>`` (a mapping, possibly
    empty) -> the tuning-knob dicts to enumerate, and problems with the
    section (each names its key).  ``"auto"`` values are resolved here or
    in ``resolve``.  A dict may carry ``"_only": {feature: values}`` (``svdq_aot.variants.ONLY_KEY``): it is
    then built for those feature values only.
``resolve(arch, knobs) -> dict``
    fill any ``"auto"`` tuning value (e.g. the deepest stage count that
    fits); return the complete knob dict.
``invalid_reason(arch, knobs) -> str | None``
    *the* validity predicate: None if the variant can be built, else one
    line; resource problems give their numbers ("needs 240 KiB of SMEM,
    sm_90 allows 227 KiB").
``requirements(arch, knobs) -> dict[str, int]``
    the integers the op's shape rule reads (``n_multiple`` ...).
``compile(arch, knobs, name, dump_dir) -> CompiledKernel``
    trace and cross-compile; the kernel symbols must start with ``name``
    and the host function must take the op's ``host_args`` in order.

Optional:

``SELECTION: list[dict]``
    how the loader ranks this family's variants that fit a problem, per M
    bucket (``[{"m_max": 64, "priority": 0, "prefer": [{"knob": "tile_m",
    "order": "asc"}]}, {"m_max": None, ...}]``; format in
    ``svdq_loader.select_rules``).  Preferences name TUNING knobs.  The build
    writes it into the manifest; without it the loader takes name order.

`check_family` verifies all of it when a family is registered, and fails
with a message naming what is missing.  Importing a family module imports
the DSL: that only happens at build time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from svdq_loader.ops import OPS
from svdq_loader.select_rules import RuleError, parse_buckets


@dataclass
class CompiledKernel:
    """What a family's ``compile`` returns."""
    cubin: bytes              # ELF cubin for the arch
    compiled: Any             # the DSL's compiled function (its .ir_module holds the host code)
    entry: str                # host function name
    kernel_symbols: list[str]
    smem_bytes: int           # dynamic SMEM the host function requests
    resource_usage: dict = field(default_factory=dict)   # symbol -> {"registers", "stack_frame_bytes"}
    #: launch-recipe expressions (svdq_loader.launch_recipe's AST over the host arguments) that the recipe fitter
    #: tries besides its own search, for a host launch it would not find (each is checked like any other fit)
    recipe_hints: tuple = ()


@runtime_checkable
class Family(Protocol):
    OP: str
    ARCHS: tuple
    NAME: str
    TUNING: dict

    def config_axes(self, arch: str, section: dict) -> tuple[list[dict], list[str]]: ...
    def resolve(self, arch: str, knobs: dict) -> dict: ...
    def invalid_reason(self, arch: str, knobs: dict) -> str | None: ...
    def requirements(self, arch: str, knobs: dict) -> dict: ...
    def compile(self, arch: str, knobs: dict, name: str, dump_dir: str) -> CompiledKernel: ...


def knob_problems(family_name: str, knobs: dict, *tables: dict) -> str | None:
    """The table part of a family's validity predicate: every knob present, of an allowed value and
    type, and no unknown knob.  None if all hold, else every violation on one line."""
    problems = []
    for table in tables:
        for key, allowed in table.items():
            if key not in knobs:
                problems.append(f"knob {key} missing")
            elif knobs[key] not in allowed or type(knobs[key]) is not type(allowed[0]):
                problems.append(f"{key} {knobs[key]!r} not supported by {family_name} "
                                f"(supported: {', '.join(map(repr, allowed))})")
    known = set().union(*(set(t) for t in tables))
    extra = sorted(set(knobs) - known)
    if extra:
        problems.append(f"unknown knobs {extra}")
    return "; ".join(problems) if problems else None


def table_reason(family_name: str, archs: tuple, arch: str, knobs: dict, *tables: dict) -> str | None:
    """`knob_problems` preceded by the arch check: the part of a validity predicate every family shares."""
    if arch not in archs:
        return f"arch {arch} is not built by {family_name} (builds {', '.join(archs)})"
    return knob_problems(family_name, knobs, *tables)


def forms_axes(section: dict, form_axes) -> tuple[list[dict], list[str]]:
    """A config section written as ``forms`` (a list of sections, each with an optional ``ranks``) -> the union of
    each form's tuning dicts, ``form_axes(form, where)`` giving one form's dicts and problems (`where` prefixes
    them).  A form that lists ``ranks`` is built for those LoRA ranks only (``"_only"``; of the config's ranks)."""
    from .variants import ONLY_KEY
    problems: list[str] = []
    if set(section) - {"forms"}:
        problems.append(f"{', '.join(sorted(set(section) - {'forms'}))}: not allowed beside forms "
                        f"(put them inside each form)")
    forms = section["forms"]
    if not isinstance(forms, list) or not forms or not all(isinstance(f, dict) for f in forms):
        return [], problems + [f"forms: {forms!r}: expected a non-empty list of mappings"]
    out: list[dict] = []
    for i, form in enumerate(forms):
        form = dict(form)
        ranks = form.pop("ranks", None)
        got, probs = form_axes(form, f"forms[{i}].")
        problems += probs
        if ranks is not None:
            if (not isinstance(ranks, list) or not ranks
                    or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
                problems.append(f"forms[{i}].ranks: {ranks!r}: expected a non-empty list of integers")
                continue
            got = [dict(g, **{ONLY_KEY: {"rank": tuple(ranks)}}) for g in got]
        out += [g for g in got if g not in out]
    return out, problems


def knobless_functions(op: str, family_name: str, archs: tuple, feature_values: dict):
    """``(config_axes, resolve, invalid_reason)`` of a family without tuning knobs (one variant per arch, e.g. the
    sm_90a pre-passes decode_act and act_fp8): its config section must be ``{}``, and its validity predicate is
    the arch and the feature values."""
    def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
        problems = [f"{key}: unknown key ({op} has no knobs; write {op}: {{}})" for key in sorted(section)]
        return [{}], problems

    def resolve(arch: str, knobs: dict) -> dict:
        return dict(knobs)

    def invalid_reason(arch: str, knobs: dict) -> str | None:
        return table_reason(family_name, archs, arch, knobs, feature_values, {})
    return config_axes, resolve, invalid_reason


class FamilyContractError(TypeError):
    """A kernel family does not meet the contract; the message says what is wrong."""


_ATTRS = (("OP", str), ("ARCHS", tuple), ("NAME", str), ("TUNING", dict))
_METHODS = ("config_axes", "resolve", "invalid_reason", "requirements", "compile")


def check_family(fam: Any, *, where: str = "") -> None:
    """Raise FamilyContractError unless `fam` meets the contract above."""
    who = where or getattr(fam, "__name__", type(fam).__name__)
    problems = []
    for attr, typ in _ATTRS:
        if not hasattr(fam, attr):
            problems.append(f"missing {attr}")
        elif not isinstance(getattr(fam, attr), typ):
            problems.append(f"{attr} must be a {typ.__name__}, got {type(getattr(fam, attr)).__name__}")
    for m in _METHODS:
        if not callable(getattr(fam, m, None)):
            problems.append(f"missing method {m}()")
    if not problems:
        if fam.OP not in OPS:
            problems.append(f"OP {fam.OP!r} is not a known operator ({', '.join(OPS)})")
        else:
            feats = set(OPS[fam.OP].feature_names)
            clash = sorted(feats & set(fam.TUNING))
            if clash:
                problems.append(f"TUNING knobs {clash} clash with the op's feature knobs")
        if not fam.ARCHS or not all(isinstance(a, str) and a.startswith("sm_") for a in fam.ARCHS):
            problems.append(f"ARCHS must be a non-empty tuple of arch names, got {fam.ARCHS!r}")
        for k, vals in fam.TUNING.items():
            if not isinstance(k, str) or not isinstance(vals, tuple) or not vals:
                problems.append(f"TUNING[{k!r}] must be a non-empty tuple of allowed values")
        if getattr(fam, "SELECTION", None) is not None:
            try:
                parse_buckets(fam.SELECTION, "SELECTION", list(fam.TUNING))
            except RuleError as e:
                problems.append(str(e))
    if problems:
        raise FamilyContractError(f"kernel family {who} breaks the family contract: " + "; ".join(problems))

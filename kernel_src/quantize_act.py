"""``quantize_act``: bf16/fp16 activations -> NVFP4 codes + E4M3 block scales (+ fused LoRA-down): the family.

Its knobs, the one validity predicate, the selection ranking, and compile (CuTe-DSL, build time only).  Four
modules, one job each: this one; ``quantize_plan`` (the budgets the predicate quotes, the SMEM index arithmetic;
no DSL); ``quantize_ptx`` (the inline PTX); ``quantize_kernel`` (the kernel, whose docstring describes the work
decomposition, the exact arithmetic and the launch ABI).  One source serves ``sm_90a``, ``sm_100a``,
``sm_103a``, ``sm_120a`` and ``sm_121a``.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from cutlass import Uint8

from .compiled_output import compile_kernel, cubin_resource_usage, refuse_invalid
from .quantize_kernel import _DT, _QuantizeAct
from .quantize_plan import STEP_K, _cfg_of, _problem, smem_bytes_for, threads_for

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES", "STEP_K", "SELECTION",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile",
    "smem_bytes_for", "threads_for", "cubin_resource_usage",
]

OP = "quantize_act"
ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
NAME = "quantize_act"

#: This family's tuning knobs: warps per CTA (they split K) and 16-row m-tiles per warp.
TUNING: dict[str, tuple] = dict(
    warps=(2, 4, 8),
    mtiles=(1, 2),
)
DEFAULT_TUNING = dict(warps=4, mtiles=1)
#: Loader ranking (svdq_loader.select_rules): fewer warps and m-tiles first (the H200 sweep of docs/PERF.md found
#: warps=4, mtiles=1 fastest at every K and R it measured, M = 4608), except ranks 48 and 64 at M >= 2048, where two
#: m-tiles per warp come first: on an H100 (docs/PERF.md, session 37; the loader's schedule for each) they took 11-28 %
#: less time at M = 2048 and 4096, 15-18 % less at M = 4608, 4-6 % at M = 3072 and 8-11 % at M = 9216 where K >= 12288,
#: and 1-9 % more at M = 3072 and 4608 where K = 3072; ranks 16 and 32 were at most 1 % faster and up to 20 % slower
#: with two (M = 4608), so the rule prefers them at ranks 48-64 only, and `configs/flux.yaml` builds them only there.
MTILES2_MIN_RANK, MTILES2_MAX_RANK = 48, 64      # the ranks (a range of the rule's `when`) ...
MTILES2_M_MIN = 2048                             # ... and the M from which two m-tiles come first
SELECTION = [
    {"m_max": MTILES2_M_MIN - 1, "priority": 0, "prefer": [{"knob": "mtiles", "order": "asc"},
                                                           {"knob": "warps", "order": "asc"}]},
    {"m_max": None, "priority": 0, "prefer": [
        {"knob": "mtiles", "order": "desc", "when": {"dim": "rank", "min": MTILES2_MIN_RANK, "max": MTILES2_MAX_RANK}},
        {"knob": "mtiles", "order": "asc"}, {"knob": "warps", "order": "asc"}]},
]
#: Feature-knob values this family builds (the op spec lists the knobs).
FEATURE_VALUES: dict[str, tuple] = dict(
    dtype=("bf16", "fp16"),
    rank=(0, 16, 32, 48, 64, 96, 128),
    scale_layout=("logical", "blocked"),
)


# ---------------------------------------------------------------------------
# Family contract
# ---------------------------------------------------------------------------


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.<arch>.quantize_act`` -> tuning dicts.  Keys ``warps``, ``mtiles`` (lists; every combination);
    defaults: one variant, warps=4, mtiles=1.  Or ``forms``: a list of such sections, built as their union, each
    with an optional ``ranks`` (that form is built for those LoRA ranks only)."""
    if "forms" in section:
        from svdq_aot.family import forms_axes
        return forms_axes(section, _form_axes)
    return _form_axes(section, "")


def _form_axes(section: dict, where: str) -> tuple[list[dict], list[str]]:
    problems: list[str] = []
    for key in sorted(set(section) - set(TUNING)):
        problems.append(f"{where}{key}: unknown key (allowed: {', '.join(TUNING)})")
    lists = {}
    for key, allowed in TUNING.items():
        vals = section.get(key, [DEFAULT_TUNING[key]])
        if not isinstance(vals, list) or not vals:
            problems.append(f"{where}{key}: {vals!r}: expected a non-empty list")
            vals = []
        good = []
        for i, v in enumerate(vals):
            if isinstance(v, bool) or v not in allowed:
                problems.append(f"{where}{key}[{i}]: {v!r}: not supported (allowed: {', '.join(map(str, allowed))})")
            elif v in good:
                problems.append(f"{where}{key}[{i}]: {v!r}: duplicate value")
            else:
                good.append(v)
        lists[key] = good
    out = [dict(warps=w, mtiles=mt) for w in lists["warps"] for mt in lists["mtiles"]]
    return out, problems


def resolve(arch: str, knobs: dict) -> dict:
    out = dict(knobs)
    for key, v in DEFAULT_TUNING.items():
        if out.get(key, "auto") == "auto":
            out[key] = v
    return out


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    """The one validity predicate of this family: None if buildable, else why (with numbers)."""
    if arch not in ARCHS:
        return f"arch {arch} is not built by {NAME} (builds {', '.join(ARCHS)})"
    from svdq_aot.family import knob_problems
    problems = knob_problems(NAME, knobs, FEATURE_VALUES, TUNING)
    if problems:
        return problems
    return _problem(_cfg_of(knobs), arch)


def requirements(arch: str, knobs: dict) -> dict:
    """K must be a multiple of one warp step (64); any M >= 1."""
    return {"k_multiple": STEP_K}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    """Trace and cross-compile one variant for `arch` (no GPU needed); kernel symbol ``<name>_0``."""
    refuse_invalid(name, invalid_reason(arch, knobs))
    cfg = _cfg_of(knobs)
    op = _QuantizeAct(cfg, arch)
    from svdq_loader.ops import QUANTIZE_ACT
    ck = compile_kernel(_QuantizeAct, op, QUANTIZE_ACT, dict(act=Uint8, ascales=Uint8), _DT[cfg.dtype], name, arch,
                        dump_dir, op.smem_bytes, keep_ptx=keep_ptx)
    if keep_ptx:
        ck.ptx = _read_ptx(ck.compiled, dump_dir)
    return ck


def _read_ptx(compiled: Any, dump_dir: str) -> Optional[str]:
    art = getattr(compiled.artifacts, "PTX", None)
    if isinstance(art, bytes):
        art = art.decode()
    if isinstance(art, str) and os.path.isfile(art):
        with open(art) as f:
            art = f.read()
    if isinstance(art, str) and ".entry" in art:
        return art
    for f in os.listdir(dump_dir):
        if f.endswith(".ptx") and compiled.function_name in f:
            with open(os.path.join(dump_dir, f)) as fh:
                return fh.read()
    return None

"""What an operator is, declared once: the `OpSpec` record and the facts every op shares.

An operator (``gemm_w4a4``, ``quantize_act``) is a public function of the
loader.  Its spec says, in one place:

* ``host_args``: the host function every kernel family of the op must take,
  in order, with its ABI kind (``ptr``: a device pointer or 0, ``i32``: a
  32-bit integer, ``stream``: the CUDA stream);
* ``features``: the knobs a call must match (the selection key's
  exact part), with the config key they are enumerated from and the values
  allowed;
* ``dims``: the problem's integer sizes (``m``, ``n``, ``k`` ...), and
  ``shape_problem``: *the* divisibility rule, fed by the requirements a
  family records per variant; build-time coverage and run-time selection
  both call it; ``knob_size_rule`` adds what a knob's value asks of the sizes;
* ``coverage``: which problems a config asks the build to serve;
* ``prepass``: which variants' calls run another op's kernel first.

This module is pure Python (no torch, no CUDA, no DSL): the builder and the
loader both import it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

#: Byte alignment every pointer handed to any kernel must have (the one home of this rule).
PTR_ALIGN = 16
#: ABI kinds a host argument may have.
ARG_KINDS = ("ptr", "i32", "stream")
#: Scalar knob value types a manifest may hold.
KNOB_TYPES = (bool, int, str)


@dataclass(frozen=True)
class Feature:
    """A knob a call must match: exactly, or for an on/off input with an ``identity``, by a variant built with it.

    ``source`` names where enumeration takes its values: a top-level config
    key (``"out_dtypes"``, ``"ranks"``, ``"wcscale"``, ``"bias"``), or
    ``"arch"`` for a value fixed by the target arch (see ``by_arch``).

    ``identity``: for an on/off input (``wcscale``, ``bias``), the value that
    makes it a no-op (1.0, 0.0).  A call without the input may then run a
    variant built with it, passing a vector of that value: the input is a
    run-time parameter of such a variant, and a variant built without it is
    only a specialisation (preferred when built, never required).
    """
    name: str
    source: str
    values: tuple = ()                          # allowed values (empty: any the validator accepts)
    by_arch: Mapping[str, Any] | None = None    # source == "arch": arch -> value
    identity: float | None = None               # on/off inputs: the value a call without the input passes


@dataclass(frozen=True)
class OpSpec:
    name: str
    summary: str
    host_args: tuple[tuple[str, str], ...]
    features: tuple[Feature, ...]
    dims: tuple[str, ...]
    #: (requirements, dims) -> None or the rule the problem breaks ("N=96 is not a multiple of 128")
    shape_rule: Callable[[Mapping[str, int], Mapping[str, int]], str | None]
    #: names of the requirement integers a variant of this op must record
    requirement_keys: tuple[str, ...]
    #: (config) -> [(problem label, config key path, dims dict)] the build must serve
    coverage_problems: Callable[[Any], list[tuple[str, str, dict]]]
    #: values for the i32 host args that are not problem dims, used for sample launches (build-time
    #: recipe checks, load-time cross-checks), e.g. {"sm_count": 132}
    sample_scalars: dict = field(default_factory=dict)
    #: (variant knobs) -> the op whose variant must run first on the call's inputs, or None.  Such a call
    #: is two launches on one stream (e.g. ``gemm_w4a4`` with ``act_source`` images runs ``decode_act``
    #: into a per-call workspace first); the build refuses a config that lacks the pre-pass op's variants.
    prepass: Callable[[Mapping[str, Any]], "str | None"] = lambda knobs: None
    #: (variant knobs) -> None, or a function (m, n, k, sm_count) -> the bytes such a variant's kernel uses past
    #: the pre-pass's output in the same per-call workspace (the sm_90a GEMM's stream-K meetings)
    prepass_extra_bytes: Callable[[Mapping[str, Any]], Any] = lambda knobs: None
    #: (variant knobs, dims) -> None or the size rule a knob adds to the shape rule (e.g. the images GEMM's
    #: workspace, which its pre-pass indexes with 32-bit offsets).  Selection and the tuning table apply it.
    knob_size_rule: Callable[[Mapping[str, Any], Mapping[str, int]], "str | None"] = lambda knobs, dims: None
    #: (kernel launcher, manifest entry) -> the launcher the library calls, or None for the kernel launcher
    #: itself: an op whose launch needs more than its arguments (e.g. ``quantize_act``'s grid from the
    #: device's resident CTAs, and a per-call workspace) wraps it here.
    wrap_launcher: "Callable[[Any, Mapping[str, Any]], Any] | None" = None
    #: (the build's kernel switches, as ``generator.kernel_switches`` records them; a call's feature key) -> None, or
    #: why such a build cannot serve such calls through the library (an experiment build whose kernels read an input
    #: in another layout than the op's); the library raises it as UnsupportedProblem before selecting a variant
    build_refusal: Callable[[str, tuple], "str | None"] = lambda switches, features: None

    def __post_init__(self):
        names = [a for a, _ in self.host_args]
        if len(set(names)) != len(names):
            raise ValueError(f"op {self.name}: duplicate host argument names {names}")
        for a, kind in self.host_args:
            if kind not in ARG_KINDS:
                raise ValueError(f"op {self.name}: host argument {a!r} has kind {kind!r}; allowed {ARG_KINDS}")

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.host_args)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    def feature(self, name: str) -> Feature:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)

    def feature_key(self, knobs: Mapping[str, Any]) -> tuple:
        """The exact-match part of a variant's selection key, in feature order."""
        return tuple(knobs[f] for f in self.feature_names)

    def serving_keys(self, features: tuple) -> list[tuple]:
        """The feature keys whose variants can serve a call with `features`, best first: the call's own key,
        then keys that turn on inputs the call lacks and that have an ``identity`` value (fewest first, in
        feature order).  E.g. a call without wcscale and bias: (.., False, False), (.., True, False),
        (.., False, True), (.., True, True)."""
        off = [i for i, f in enumerate(self.features) if f.identity is not None and features[i] is False]
        out = []
        for r in range(len(off) + 1):
            for on in itertools.combinations(off, r):
                key = list(features)
                for i in on:
                    key[i] = True
                out.append(tuple(key))
        return out

    def filled_text(self, call: tuple, key: tuple) -> str:
        """What a call with features `call` passes to a variant keyed `key` (a `serving_keys` entry) for the
        inputs it lacks, e.g. "wcscale = 1.0, bias = 0.0 for every column"; "" for the call's own key."""
        return ", ".join(f"{f.name} = {f.identity}" for f, c, k in zip(self.features, call, key) if c != k)

    def name_for(self, arch: str, knobs: Mapping[str, Any], requirements: Mapping[str, int]) -> str:
        """The variant name (= kernel symbol prefix) of `knobs` and `requirements` on `arch`.

        Features fixed by the arch (``source == "arch"``) are not spelled out;
        the requirements (what selection reads) are, after ``req``:
        ``..._stages2_reqn128k64``.  So the cubin's symbol table binds every
        fact selection uses to the bytes.
        """
        fixed = {f.name for f in self.features if f.source == "arch"}
        base = variant_name(self.name, arch, {k: v for k, v in knobs.items() if k not in fixed})
        req = "".join(f"{k.split('_')[0]}{int(requirements[k])}" for k in self.requirement_keys)
        return f"{base}_req{req}"

    def sample_args(self, requirements: Mapping[str, int], *, m: int = 77) -> list[int]:
        """A valid argument list for a sample launch: distinct aligned non-null pointers, stream 0.

        Dims come from the requirements (``<dim>_multiple``, M defaults to `m`).
        """
        out = []
        for i, (a, kind) in enumerate(self.host_args):
            if kind == "ptr":
                out.append(0x7A00_0000_0000 + 0x100_0000 * (i + 1))
            elif kind == "stream":
                out.append(0)
            elif a in self.dims:
                out.append(m if a == "m" else int(requirements.get(f"{a}_multiple", 1)))
            else:
                out.append(int(self.sample_scalars.get(a, 1)))
        return out

    def shape_problem(self, requirements: Mapping[str, int], dims: Mapping[str, int],
                      knobs: Mapping[str, Any] | None = None) -> str | None:
        """The rule `dims` break for a variant with these requirements (and, given its knobs, the knobs' size
        rule), or None."""
        why = self.shape_rule(requirements, dims)
        if why is None and knobs is not None:
            why = self.knob_size_rule(knobs, dims)
        return why

    def check_feature_values(self, knobs: Mapping[str, Any], arch: str) -> list[str]:
        """Problems with the feature knobs of a variant (type, allowed value, arch-fixed value)."""
        out = []
        for f in self.features:
            if f.name not in knobs:
                out.append(f"knob {f.name!r} missing (op {self.name} features: {list(self.feature_names)})")
                continue
            v = knobs[f.name]
            if f.by_arch is not None:
                want = f.by_arch.get(arch)
                if want is None:
                    out.append(f"op {self.name} has no {f.name} defined for arch {arch}")
                elif v != want:
                    out.append(f"{f.name} {v!r} is not what {arch} uses ({want!r})")
            elif f.values and (v not in f.values or type(v) is not type(f.values[0])):
                out.append(f"{f.name} {v!r} not allowed (allowed: {', '.join(map(repr, f.values))})")
        return out


def knob_token(value: Any) -> str:
    """How a knob value is spelled in a variant name (bool -> 0/1)."""
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def variant_name(op: str, arch: str, knobs: Mapping[str, Any]) -> str:
    """The one naming rule: ``svdq_<op>_<arch>_<knob><value>_...`` in knob order.

    The name is also the kernel symbol prefix, so the cubin's own symbol
    table binds every knob to the bytes (the loader checks it).  Knob names
    lose their underscores (``tile_m=128`` -> ``tilem128``).
    """
    parts = [f"{k.replace('_', '')}{knob_token(v)}" for k, v in knobs.items()]
    return "_".join([f"svdq_{op}_{arch.replace('_', '')}"] + parts)


def plain_knobs(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in items:
        if not isinstance(v, KNOB_TYPES):
            raise TypeError(f"knob {k}={v!r}: knob values must be bool, int or str")
        out[k] = v
    return out


def m_k_shape_rule(req, dims) -> str | None:
    """The shape rule of an op on an [M, K] activation: M >= 1, K a multiple of ``k_multiple``."""
    if dims["m"] < 1:
        return f"M={dims['m']} must be at least 1"
    if dims["k"] % req["k_multiple"]:
        return f"K={dims['k']} is not a multiple of {req['k_multiple']}"
    return None


def distinct_k_coverage(config) -> list[tuple[str, str, dict]]:
    """The problems an activation-side op must serve: every distinct K of the config's shapes (M = 1)."""
    out, seen = [], set()
    for s in config.shapes:
        if s.k not in seen:
            seen.add(s.k)
            out.append((f"K={s.k}", f"shapes.{s.name}", {"m": 1, "k": s.k}))
    return out

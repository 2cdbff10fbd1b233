"""Selection rules: how the candidates that fit a problem are ranked, written into the manifest at build time.

A kernel family declares its rule (``SELECTION``, optional; see
`svdq_aot.family`); the build copies it into the manifest, one rule per
(op, arch, family) built, and the loader ranks by it.  A rule is data, generic
over knobs: per M bucket an ordered list of preferences, each over one knob::

    {"op": "gemm_w4a4", "arch": "sm_90a", "family": "sm90_gemm_w4a4",
     "buckets": [
       {"m_max": 64,   "priority": 0, "prefer": [{"knob": "tile_m", "order": "asc"},
                                                 {"knob": "tile_n", "order": "desc"}]},
       {"m_max": null, "priority": 0, "prefer": [{"knob": "tile_m", "order": "desc"}]}]}

* ``buckets``: ``m_max`` strictly increasing, the last one ``null`` (no
  bound); a problem falls in the first bucket with ``M <= m_max``.
* a preference may instead be a **grid fill** estimate (`Fill`), which ranks
  by the problem's dims and the device's SM count, not by one knob::

    {"fill": {"tile": ["tile_m", "tile_n", "tile_k"], "ctas_per_sm": 1,
              "factor": {"knob": "tile_m", "values": [[256, 0.86]]},
              "split": {"knob": "schedule", "values": [["ws_splitk2", 2, 7], ["ws_splitk4", 4, 11]]}}}

  estimated cost = waves x (k-steps per CTA x tile area / 128^2 x factor + overhead), where ``factor`` may
  also be a list of such tables (the variant's factor is then the product of its value in each; a table over
  several knobs, ``{"knob": ["tile_m", "act_source"], "values": [[[64, "images"], 1.18]]}``, matches a variant
  whose knobs equal all of a row's values: an interaction of two knobs that no product of one-knob tables
  states), a variant
  whose split knob has value v splits K over S CTAs (S = 1 when v is not listed) at an extra ``overhead``
  (in 128 x 128 k-steps), CTAs = ceil(M / tile_m) x ceil(N / tile_n) x S and waves = ceil(CTAs / (SMs x
  ctas_per_sm)).  S = 0 means stream-K: one wave of min(units, SMs x ctas_per_sm) CTAs, each with an equal share
  of the units = tiles x k-steps, so the cost is ceil(units / CTAs) k-steps x area x factor + overhead.  Smaller
  is preferred; the family documents the measurements behind its constants.
* a knob preference may carry ``"when": {"dim": "n", "min": 9216}`` (``min``
  and/or ``max``, over ``m``, ``n`` or ``k``, or ``rank``: the variant's LoRA
  rank, which every candidate of a call shares with the call): it then ranks
  only problems inside that range, and every variant equal elsewhere;
* ``priority``: between families of one (op, arch), the lower wins (ties: the
  family name).  Within a family the preferences rank lexicographically:
  ``order`` ``asc`` (smaller first), ``desc`` (larger first), or ``values``
  (an explicit order; values not listed come after, in ``asc`` order).
  The variant name breaks the last tie, so the choice never depends on the
  order of the manifest's entries.

A family without a rule gets `default_rule` (one bucket, no preference:
name order).  Pure Python; the builder and the loader both import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

ORDERS = ("asc", "desc")


class RuleError(ValueError):
    """A selection rule is malformed; the message names the field and the value."""


@dataclass(frozen=True)
class Preference:
    knob: str
    order: str = "asc"                 # "asc" | "desc" | "values"
    values: tuple = ()
    #: () or (dim, lo, hi): the preference applies only to problems with lo <= dims[dim] <= hi (None: unbounded);
    #: elsewhere it ranks every variant equal.  A dim of `WHEN_FEATURES` is read from the variant's knobs instead
    #: (a feature: every candidate of one call has the call's value)
    when: tuple = ()

    @property
    def knobs(self) -> tuple[str, ...]:
        return (self.knob,)

    def applies(self, dims: Mapping[str, int], knobs: Mapping[str, Any] | None = None) -> bool:
        if not self.when:
            return True
        dim, lo, hi = self.when
        v = int((knobs or {}).get(dim, 0)) if dim in WHEN_FEATURES else int(dims.get(dim, 1))
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    def rank(self, knobs: Mapping[str, Any], dims: Mapping[str, int], sm_count: int) -> tuple:
        """Sort key of a variant's knobs under this preference (smaller = preferred)."""
        return self.key(knobs.get(self.knob)) if self.applies(dims, knobs) else ()

    def differs(self, a: Mapping[str, Any], b: Mapping[str, Any], dims, sm_count) -> str:
        """What makes knobs `a` rank below `b` under this preference ('' when they rank equal)."""
        if not self.applies(dims, a) or self.key(a.get(self.knob)) == self.key(b.get(self.knob)):
            return ""
        return f"{self.knob}={a.get(self.knob)} vs {b.get(self.knob)}{self._when_text()}"

    def chosen_text(self, knobs: Mapping[str, Any], dims, sm_count) -> str:
        return f"{self.knob}={knobs.get(self.knob)}{self._when_text()}" if self.applies(dims, knobs) else ""

    def _when_text(self) -> str:
        if not self.when:
            return ""
        dim, lo, hi = self.when
        if lo is not None and lo == hi:
            return f" (as {dim} = {lo})"
        if hi is None:
            return f" (as {dim} >= {lo})"
        if lo is None:
            return f" (as {dim} <= {hi})"
        return f" (as {lo} <= {dim} <= {hi})"

    def key(self, value: Any) -> tuple:
        """Sort key of a knob value under this preference (smaller = preferred)."""
        if self.order == "values":
            return (self.values.index(value), 0) if value in self.values else (len(self.values), _num(value))
        return (_num(value) if self.order == "asc" else -_num(value),)

    def text(self) -> str:
        if self.order == "values":
            t = f"{self.knob} in the order {list(self.values)}"
        else:
            t = f"{self.knob} {'smaller' if self.order == 'asc' else 'larger'} first"
        return t + self._when_text().replace(" (as ", " (where ")

    def to_dict(self) -> dict:
        d = {"knob": self.knob, "values": list(self.values)} if self.order == "values" else \
            {"knob": self.knob, "order": self.order}
        if self.when:
            dim, lo, hi = self.when
            d["when"] = {"dim": dim, **({"min": lo} if lo is not None else {}), **({"max": hi} if hi is not None else {})}
        return d


#: Work of one CTA is counted in k-steps of a tile of this area (rows x columns).
_UNIT_AREA = 128 * 128
#: A split table's CTA count that means stream-K: one wave of CTAs over an equal share of every (tile, k-step) unit.
STREAM_K = 0


@dataclass(frozen=True)
class Fill:
    """Grid-fill preference: rank by an estimate of waves x per-CTA work on the device's SMs (module doc)."""
    tile: tuple[str, str, str]                       # knob names of the tile's M, N and K extents
    ctas_per_sm: int = 1
    #: ((knob, ((knob value, work factor), ...)), ...): a variant's factor is the product over the tables of
    #: its knob value's factor (unlisted values: 1.0).  `knob` may be a tuple of knob names, its values then
    #: tuples of as many values (a row matches when every knob equals its value)
    factor_tables: tuple[tuple[Any, tuple[tuple[Any, float], ...]], ...] = ()
    split_knob: str | None = None
    splits: tuple[tuple[Any, int, float], ...] = ()  # (knob value, CTAs per tile along K, overhead)

    @property
    def knobs(self) -> tuple[str, ...]:
        names = tuple(self.tile) + tuple(n for k, _ in self.factor_tables for n in _names(k)) + \
            ((self.split_knob,) if self.split_knob is not None else ())
        return tuple(dict.fromkeys(names))

    def _split(self, knobs: Mapping[str, Any]) -> tuple[int, float]:
        if self.split_knob is not None:
            for value, s, over in self.splits:
                if knobs.get(self.split_knob) == value:
                    return s, over
        return 1, 0.0

    def estimate(self, knobs: Mapping[str, Any], dims: Mapping[str, int], sm_count: int) -> dict:
        tm, tn, tk = (int(knobs[k]) for k in self.tile)
        m, n, k = (int(dims.get(d, 1)) for d in ("m", "n", "k"))
        s, over = self._split(knobs)
        f = 1.0
        for knob, rows in self.factor_tables:
            f *= next((w for value, w in rows if _matches(knobs, knob, value)), 1.0)
        tiles = -(-m // tm) * -(-n // tn)
        if s == STREAM_K:
            # one wave of CTAs, each an equal share of every (tile, k-step) unit
            units = tiles * -(-k // tk)
            ctas = min(units, max(1, sm_count) * self.ctas_per_sm)
            per_cta = -(-units // ctas) * tm * tn / _UNIT_AREA * f + over
            return {"ctas": ctas, "waves": 1, "split": "stream-K", "cost": round(per_cta, 6)}
        ctas = tiles * s
        waves = -(-ctas // (max(1, sm_count) * self.ctas_per_sm))
        per_cta = -(-k // (s * tk)) * tm * tn / _UNIT_AREA * f + over
        return {"ctas": ctas, "waves": waves, "split": s, "cost": round(waves * per_cta, 6)}

    def rank(self, knobs, dims, sm_count) -> tuple:
        return (self.estimate(knobs, dims, sm_count)["cost"],)

    def differs(self, a, b, dims, sm_count) -> str:
        ea, eb = self.estimate(a, dims, sm_count), self.estimate(b, dims, sm_count)
        if ea["cost"] == eb["cost"]:
            return ""
        return (f"grid fill cost {ea['cost']:g} vs {eb['cost']:g}: {ea['ctas']} vs {eb['ctas']} CTAs, "
                f"{ea['waves']} vs {eb['waves']} wave(s) on {sm_count} SMs")

    def chosen_text(self, knobs, dims, sm_count) -> str:
        e = self.estimate(knobs, dims, sm_count)
        split = "stream-K" if e["split"] == "stream-K" else f"K split {e['split']}"
        return f"grid fill cost {e['cost']:g} ({e['ctas']} CTAs, {split}, {e['waves']} wave(s))"

    def text(self) -> str:
        return "the smallest estimated waves x per-CTA k-steps first"

    def to_dict(self) -> dict:
        d: dict = {"tile": list(self.tile), "ctas_per_sm": self.ctas_per_sm}
        tables = [{"knob": list(k) if isinstance(k, tuple) else k,
                   "values": [[list(v) if isinstance(v, tuple) else v, w] for v, w in rows]}
                  for k, rows in self.factor_tables]
        if tables:
            d["factor"] = tables[0] if len(tables) == 1 else tables
        if self.split_knob is not None:
            d["split"] = {"knob": self.split_knob, "values": [list(x) for x in self.splits]}
        return {"fill": d}


def _names(knob) -> tuple[str, ...]:
    """The knob names of a factor table's key: one name, or a tuple of them."""
    return knob if isinstance(knob, tuple) else (knob,)


def _matches(knobs: Mapping[str, Any], knob, value) -> bool:
    """Whether a variant's knobs equal a factor row's value (over every knob of a multi-knob table)."""
    if isinstance(knob, tuple):
        return all(knobs.get(k) == v for k, v in zip(knob, value))
    return knobs.get(knob) == value


def _parse_fill(raw: Any, path: str, knobs: Sequence[str] | None, fail) -> Fill:
    want = "expected {tile: [m knob, n knob, k knob], ctas_per_sm: int >= 1, factor?: {knob, values: " \
           "[[value, number > 0], ...]} (or knob: [names], values: [[[one value per name], number > 0], ...]) or a " \
           "list of them, split?: {knob, values: [[value, int >= 2 or 0 (stream-K), number >= 0], ...]}}"
    if not isinstance(raw, Mapping) or "tile" not in raw or set(raw) - {"tile", "ctas_per_sm", "factor", "split"}:
        fail(path, raw, want)
    tile, cps = raw["tile"], raw.get("ctas_per_sm", 1)
    if not isinstance(tile, (list, tuple)) or len(tile) != 3 or not all(isinstance(t, str) for t in tile):
        fail(f"{path}.tile", tile, "expected three knob names (the tile's M, N and K extents)")
    if isinstance(cps, bool) or not isinstance(cps, int) or cps < 1:
        fail(f"{path}.ctas_per_sm", cps, "expected an integer >= 1")

    scalar = (bool, int, str)

    def table(key, width, check, spec=None, where=None, multi=False):
        spec = raw.get(key) if spec is None else spec
        key = where or key
        if spec is None:
            return None, ()
        kn = spec.get("knob") if isinstance(spec, Mapping) else None
        several = multi and isinstance(kn, (list, tuple))
        if several and (len(kn) < 2 or not all(isinstance(x, str) for x in kn) or len(set(kn)) != len(kn)):
            fail(f"{path}.{key}.knob", kn, "expected one knob name, or a list of two or more distinct knob names")
        if not isinstance(spec, Mapping) or set(spec) != {"knob", "values"} or not (several or isinstance(kn, str)) \
                or not isinstance(spec["values"], (list, tuple)) or not spec["values"]:
            fail(f"{path}.{key}", spec, want)
        def key_ok(value) -> bool:
            """A row's key: one scalar, or (a multi-knob table) a list of one scalar per knob."""
            if several:
                return isinstance(value, (list, tuple)) and len(value) == len(kn) and \
                    all(isinstance(x, scalar) for x in value)
            return isinstance(value, scalar)

        rows = []
        for j, row in enumerate(spec["values"]):
            if not isinstance(row, (list, tuple)) or len(row) != width or not key_ok(row[0]) or not check(row[1:]):
                fail(f"{path}.{key}.values[{j}]", row, want)
            rows.append((tuple(row[0]),) + tuple(row[1:]) if several else tuple(row))
        return (tuple(kn) if several else kn), tuple(rows)

    num = (int, float)
    ftabs = raw.get("factor")
    ftabs = [] if ftabs is None else ftabs if isinstance(ftabs, (list, tuple)) else [ftabs]
    if raw.get("factor") is not None and not ftabs:
        fail(f"{path}.factor", raw.get("factor"), want)
    factor_tables = []
    for i, spec in enumerate(ftabs):
        fk, fv = table("factor", 2, lambda r: isinstance(r[0], num) and not isinstance(r[0], bool) and r[0] > 0,
                       spec, "factor" if len(ftabs) == 1 and isinstance(raw["factor"], Mapping) else f"factor[{i}]",
                       multi=True)
        factor_tables.append((fk, tuple((v, float(w)) for v, w in fv)))
    sk, sv = table("split", 3, lambda r: isinstance(r[0], int) and not isinstance(r[0], bool)
                   and (r[0] >= 2 or r[0] == STREAM_K) and isinstance(r[1], num) and not isinstance(r[1], bool)
                   and r[1] >= 0)
    f = Fill(tuple(tile), cps, tuple(factor_tables), sk,
             tuple((v, int(s), float(o)) for v, s, o in sv))
    if knobs is not None:
        for kn in f.knobs:
            if kn not in knobs:
                fail(f"{path}", kn, f"not a knob of this family (knobs: {', '.join(knobs)})")
    return f


@dataclass(frozen=True)
class Bucket:
    m_max: int | None
    priority: int
    prefer: tuple  # of Preference | Fill

    def text(self, lo: int) -> str:
        return f"M in [{lo}, {self.m_max}]" if self.m_max is not None else f"M >= {lo}"


@dataclass(frozen=True)
class Rule:
    op: str
    arch: str
    family: str
    buckets: tuple[Bucket, ...]

    def bucket(self, m: int) -> tuple[int, Bucket]:
        """(lowest M of the bucket, the bucket) that `m` falls in."""
        lo = 1
        for b in self.buckets:
            if b.m_max is None or m <= b.m_max:
                return lo, b
            lo = b.m_max + 1
        raise AssertionError("the last bucket is unbounded")  # parse_rule guarantees it

    def to_dict(self) -> dict:
        return {"op": self.op, "arch": self.arch, "family": self.family,
                "buckets": [{"m_max": b.m_max, "priority": b.priority, "prefer": [p.to_dict() for p in b.prefer]}
                            for b in self.buckets]}


def _num(v: Any):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    return 0  # strings rank equal under asc/desc; the name breaks the tie


def default_rule(op: str, arch: str, family: str) -> Rule:
    return Rule(op, arch, family, (Bucket(None, 0, ()),))


def parse_buckets(raw: Any, where: str, knobs: Sequence[str] | None = None) -> tuple[Bucket, ...]:
    """A family's ``SELECTION`` (list of buckets) or a manifest rule's ``buckets``, validated.

    `knobs`: the knob names the family has; a preference on any other knob is refused.
    """
    def fail(path, value, rule):
        raise RuleError(f"{where}: {path}: {value!r}: {rule}")

    if not isinstance(raw, (list, tuple)) or not raw:
        fail("buckets", raw, "expected a non-empty list of {m_max, priority, prefer}")
    out, last = [], 0
    for i, b in enumerate(raw):
        p = f"buckets[{i}]"
        if not isinstance(b, Mapping) or set(b) - {"m_max", "priority", "prefer"} or "m_max" not in b:
            fail(p, b, "expected an object with keys m_max, priority (optional), prefer (optional)")
        m_max, prio, prefer = b["m_max"], b.get("priority", 0), b.get("prefer", [])
        if m_max is not None and (isinstance(m_max, bool) or not isinstance(m_max, int) or m_max <= last):
            fail(f"{p}.m_max", m_max, f"expected an integer above the previous bucket's bound {last}, or null")
        if m_max is None and i != len(raw) - 1:
            fail(f"{p}.m_max", m_max, "only the last bucket may be unbounded (null)")
        if isinstance(prio, bool) or not isinstance(prio, int):
            fail(f"{p}.priority", prio, "expected an integer")
        if not isinstance(prefer, (list, tuple)):
            fail(f"{p}.prefer", prefer, "expected a list of {knob, order} or {knob, values}")
        prefs = []
        for j, q in enumerate(prefer):
            qp = f"{p}.prefer[{j}]"
            if isinstance(q, Mapping) and set(q) == {"fill"}:
                prefs.append(_parse_fill(q["fill"], f"{qp}.fill", knobs, fail))
                continue
            if not isinstance(q, Mapping) or "knob" not in q or not isinstance(q["knob"], str):
                fail(qp, q, "expected {knob: name, order: asc|desc}, {knob: name, values: [...]} or {fill: {...}}")
            if knobs is not None and q["knob"] not in knobs:
                fail(f"{qp}.knob", q["knob"], f"not a knob of this family (knobs: {', '.join(knobs)})")
            when = _parse_when(q["when"], f"{qp}.when", fail) if "when" in q else ()
            keys = set(q) - {"when"}
            if keys == {"knob", "order"} and q["order"] in ORDERS:
                prefs.append(Preference(q["knob"], q["order"], when=when))
            elif keys == {"knob", "values"} and isinstance(q["values"], (list, tuple)) and q["values"] \
                    and all(isinstance(v, (bool, int, str)) for v in q["values"]):
                prefs.append(Preference(q["knob"], "values", tuple(q["values"]), when=when))
            else:
                fail(qp, q, "expected {knob, order: asc|desc} or {knob, values: [non-empty list of knob values]}, "
                            "each with an optional when: {dim, min, max}")
        out.append(Bucket(m_max, prio, tuple(prefs)))
        last = m_max if m_max is not None else last
    if out[-1].m_max is not None:
        fail(f"buckets[{len(out) - 1}].m_max", out[-1].m_max, "the last bucket must be unbounded (m_max null)")
    return tuple(out)


#: The problem dims a `when` condition may read, and the features it may read from the variant's knobs.
WHEN_FEATURES = ("rank",)
WHEN_DIMS = ("m", "n", "k") + WHEN_FEATURES


def _parse_when(raw: Any, path: str, fail) -> tuple:
    """``{dim, min, max}`` (min and/or max, integers, min <= max) -> (dim, lo, hi)."""
    if not isinstance(raw, Mapping) or set(raw) - {"dim", "min", "max"} or "dim" not in raw \
            or not ({"min", "max"} & set(raw)):
        fail(path, raw, "expected {dim: m|n|k|rank, min: integer and/or max: integer}")
    if raw["dim"] not in WHEN_DIMS:
        fail(f"{path}.dim", raw["dim"], f"expected one of {', '.join(WHEN_DIMS)}")
    lo, hi = raw.get("min"), raw.get("max")
    for key, v in (("min", lo), ("max", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            fail(f"{path}.{key}", v, "expected an integer")
    if lo is not None and hi is not None and lo > hi:
        fail(path, raw, "expected min <= max")
    return (raw["dim"], lo, hi)


def parse_rule(raw: Any, where: str) -> Rule:
    if not isinstance(raw, Mapping) or set(raw) != {"op", "arch", "family", "buckets"}:
        raise RuleError(f"{where}: {raw!r}: expected an object with keys op, arch, family, buckets")
    for k in ("op", "arch", "family"):
        if not isinstance(raw[k], str) or not raw[k]:
            raise RuleError(f"{where}.{k}: {raw[k]!r}: expected a non-empty string")
    return Rule(raw["op"], raw["arch"], raw["family"], parse_buckets(raw["buckets"], where))


def rule_for(rules: Mapping[tuple[str, str, str], Rule], op: str, arch: str, family: str) -> Rule:
    return rules.get((op, arch, family)) or default_rule(op, arch, family)


__all__ = ["Rule", "Bucket", "Preference", "Fill", "RuleError", "parse_rule", "parse_buckets", "default_rule", "rule_for"]

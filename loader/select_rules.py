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

    def key(self, value: Any) -> tuple:
        """Sort key of a knob value under this preference (smaller = preferred)."""
        if self.order == "values":
            return (self.values.index(value), 0) if value in self.values else (len(self.values), _num(value))
        return (_num(value) if self.order == "asc" else -_num(value),)

    def text(self) -> str:
        if self.order == "values":
            return f"{self.knob} in the order {list(self.values)}"
        return f"{self.knob} {'smaller' if self.order == 'asc' else 'larger'} first"

    def to_dict(self) -> dict:
        return {"knob": self.knob, "values": list(self.values)} if self.order == "values" else \
            {"knob": self.knob, "order": self.order}


@dataclass(frozen=True)
class Bucket:
    m_max: int | None
    priority: int
    prefer: tuple[Preference, ...]

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
            if not isinstance(q, Mapping) or "knob" not in q or not isinstance(q["knob"], str):
                fail(qp, q, "expected {knob: name, order: asc|desc} or {knob: name, values: [...]}")
            if knobs is not None and q["knob"] not in knobs:
                fail(f"{qp}.knob", q["knob"], f"not a knob of this family (knobs: {', '.join(knobs)})")
            if set(q) == {"knob", "order"} and q["order"] in ORDERS:
                prefs.append(Preference(q["knob"], q["order"]))
            elif set(q) == {"knob", "values"} and isinstance(q["values"], (list, tuple)) and q["values"] \
                    and all(isinstance(v, (bool, int, str)) for v in q["values"]):
                prefs.append(Preference(q["knob"], "values", tuple(q["values"])))
            else:
                fail(qp, q, "expected {knob, order: asc|desc} or {knob, values: [non-empty list of knob values]}")
        out.append(Bucket(m_max, prio, tuple(prefs)))
        last = m_max if m_max is not None else last
    if out[-1].m_max is not None:
        fail(f"buckets[{len(out) - 1}].m_max", out[-1].m_max, "the last bucket must be unbounded (m_max null)")
    return tuple(out)


def parse_rule(raw: Any, where: str) -> Rule:
    if not isinstance(raw, Mapping) or set(raw) != {"op", "arch", "family", "buckets"}:
        raise RuleError(f"{where}: {raw!r}: expected an object with keys op, arch, family, buckets")
    for k in ("op", "arch", "family"):
        if not isinstance(raw[k], str) or not raw[k]:
            raise RuleError(f"{where}.{k}: {raw[k]!r}: expected a non-empty string")
    return Rule(raw["op"], raw["arch"], raw["family"], parse_buckets(raw["buckets"], where))


def rule_for(rules: Mapping[tuple[str, str, str], Rule], op: str, arch: str, family: str) -> Rule:
    return rules.get((op, arch, family)) or default_rule(op, arch, family)


__all__ = ["Rule", "Bucket", "Preference", "RuleError", "parse_rule", "parse_buckets", "default_rule", "rule_for"]

"""The tuning table: measured winners per problem, written by `svdq-aot tune`, read by the loader.

Pure Python, standard library only (no torch, no CUDA).  The file lives in
the artifact directory as ``tuning.json`` and travels with the artifacts::

    {"schema": "svdq-aot-tuning/1",
     "checksum": sha256 of the canonical JSON of everything else (as the manifest's),
     "manifest_checksum": the checksum of the manifest it was measured against,
     "measured_on": {"gpu": "NVIDIA H200", "sm_count": 132, "arch": "sm_90a",
                     "cuda_driver": 12080, "driver": "570.124.06" | null,
                     "loader_version": "0.1.0", "torch": "2.9.0", "date": "2026-12-01T11:00:00Z"},
     "method": {"timer": ..., "samples": 20, "warmup": 3, "rotation": ..., "min_gain": 0.02},
     "entries": [{"op": "gemm_w4a4", "arch": "sm_90a",
                  "features": {"out_dtype": "bf16", "rank": 32, ...},   (the op's feature knobs, all)
                  "dims": {"n": 3072, "k": 3072},                       (the op's dims but m)
                  "m_min": 65, "m_max": null, "ms": [256, 4608],        (the M bucket, the Ms measured)
                  "winner": variant name, "rule_choice": variant name,
                  "times_us": {variant name: [µs at each of ms]}}]}

An entry serves a problem of its op, arch and exact features and non-M dims
whose M lies in ``[m_min, m_max]`` (``null``: no bound).

Reading is strict and checked against the manifest (`parse_table`): the
schema, the checksum, the manifest it belongs to, every key's type, and
that every variant it names exists, is of the entry's op, arch and features
and serves the entry's shape.  Any failure raises `TuningTableError` naming
the file: a damaged or edited table is refused, never half used (the
manifest is treated the same way).  Whether an entry *applies* is decided
at selection time: only on the GPU model it was measured on (same name,
same SM count); on any other the rules decide, with one logged notice per
process (`notice_other_gpu`).
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from .manifest import ArtifactError, _Ctx, _loads, body_checksum
from .ops import OPS

TABLE_NAME = "tuning.json"
SCHEMA = "svdq-aot-tuning/1"
_TOP = ("schema", "checksum", "manifest_checksum", "measured_on", "method", "entries")
_MEASURED = ("gpu", "sm_count", "arch", "cuda_driver", "driver", "loader_version", "torch", "date")
_ENTRY = ("op", "arch", "features", "dims", "m_min", "m_max", "ms", "winner", "rule_choice", "times_us")

log = logging.getLogger("svdq_loader.tuning")


class TuningTableError(ArtifactError):
    """The tuning table is malformed, edited, for other artifacts, or names variants they do not hold."""


@dataclass(frozen=True)
class GpuId:
    """A GPU model as the tuning table compares it: the device name and its SM count (None: not compared)."""
    name: str
    sm_count: int | None = None

    def text(self) -> str:
        return self.name + (f" ({self.sm_count} SMs)" if self.sm_count is not None else "")


@dataclass(frozen=True)
class Entry:
    op: str
    arch: str
    features: tuple                     # in the op spec's feature order
    dims: tuple[tuple[str, int], ...]   # the op's dims but m, in spec order
    m_min: int
    m_max: int | None
    ms: tuple[int, ...]
    winner: str
    rule_choice: str
    times_us: dict[str, tuple[float, ...]]

    def covers(self, m: int) -> bool:
        return self.m_min <= m and (self.m_max is None or m <= self.m_max)

    def bucket_text(self) -> str:
        return f"M in [{self.m_min}, {self.m_max}]" if self.m_max is not None else f"M >= {self.m_min}"

    def times_text(self, name: str) -> str:
        return ", ".join(f"{t:.1f} µs at M={m}" for m, t in zip(self.ms, self.times_us[name]))

    def to_dict(self) -> dict:
        spec = OPS[self.op]
        return {"op": self.op, "arch": self.arch, "features": dict(zip(spec.feature_names, self.features)),
                "dims": dict(self.dims), "m_min": self.m_min, "m_max": self.m_max, "ms": list(self.ms),
                "winner": self.winner, "rule_choice": self.rule_choice,
                "times_us": {n: list(t) for n, t in self.times_us.items()}}


@dataclass
class TuningTable:
    source: str
    manifest_checksum: str
    measured_on: dict
    method: dict
    entries: tuple[Entry, ...]
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        idx: dict = {}
        for e in self.entries:
            idx.setdefault((e.op, e.arch, e.features, e.dims), []).append(e)
        self._index = idx

    @property
    def gpu(self) -> GpuId:
        return GpuId(self.measured_on["gpu"], self.measured_on["sm_count"])

    def measured_text(self) -> str:
        m = self.measured_on
        drv = f"driver {m['driver']}, " if m.get("driver") else ""
        return (f"{self.gpu.text()}, {drv}CUDA driver API {_cuda_text(m['cuda_driver'])}, "
                f"svdq_loader {m['loader_version']}")

    def lookup(self, problem) -> Entry | None:
        """The entry for a `select.Problem` (op, arch, features, dims with m), or None."""
        d = dict(problem.dims)
        m = d.pop("m", 1)
        spec = OPS[problem.op]
        key = (problem.op, problem.arch, tuple(problem.features),
               tuple((n, d[n]) for n in spec.dims if n != "m" and n in d))
        for e in self._index.get(key, ()):
            if e.covers(m):
                return e
        return None

    def matches(self, gpu: GpuId | None) -> bool:
        """Whether entries apply on `gpu` (None: the caller assumes the table's own GPU)."""
        if gpu is None:
            return True
        mine = self.gpu
        return gpu.name.strip() == mine.name.strip() and (gpu.sm_count is None or gpu.sm_count == mine.sm_count)

    def body(self) -> dict:
        return {"schema": SCHEMA, "manifest_checksum": self.manifest_checksum, "measured_on": dict(self.measured_on),
                "method": dict(self.method), "entries": [e.to_dict() for e in self.entries]}

    def to_json(self) -> str:
        import json
        body = self.body()
        doc = {"schema": body.pop("schema"), "checksum": body_checksum(self.body()), **body}
        return json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=False) + "\n"


@dataclass(frozen=True)
class TableHit:
    """A tuning-table entry found for a problem, and whether it applies on the GPU at hand."""
    entry: Entry
    table: TuningTable
    applies: bool
    gpu: GpuId | None        # the GPU the choice is for (None: assumed to be the table's)


def _cuda_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


class _TCtx(_Ctx):
    schema_text = SCHEMA

    def fail(self, path: str, value: Any, rule: str) -> TuningTableError:
        e = super().fail(path, value, rule)
        return TuningTableError(f"{e} (re-run `svdq-aot tune`, or delete the file to select by the rules)")


def parse_table(text: str | bytes, manifest, source: str = TABLE_NAME) -> TuningTable:
    """Read and check a tuning table against `manifest` (its checksum and variants). Raises TuningTableError."""
    c = _TCtx(source)
    try:
        data = _loads(text, source)
    except ArtifactError as e:
        raise TuningTableError(f"{e} (re-run `svdq-aot tune`, or delete the file to select by the rules)") from None
    if not isinstance(data, dict):
        raise c.fail("(top level)", type(data).__name__, "expected a JSON object")
    if data.get("schema") != SCHEMA:
        raise c.fail("schema", data.get("schema"), f"this loader reads tuning tables of schema {SCHEMA!r}")
    c.obj(data, "(top level)", _TOP)
    want = c.sha_(data, "checksum", "(top level)")
    got = body_checksum({k: v for k, v in data.items() if k != "checksum"})
    if got != want:
        raise c.fail("checksum", want, f"checksum mismatch: the content hashes to {got}; the table was edited "
                                       f"or damaged after `svdq-aot tune` wrote it")
    mine = body_checksum(manifest.body())
    if c.sha_(data, "manifest_checksum", "(top level)") != mine:
        raise c.fail("manifest_checksum", data["manifest_checksum"],
                     f"the table was measured for other artifacts (this manifest's checksum is {mine})")
    mo = c.obj(data["measured_on"], "measured_on", _MEASURED)
    for k in ("gpu", "arch", "loader_version", "torch", "date"):
        c.str_(mo, k, "measured_on")
    c.int_(mo, "sm_count", "measured_on", 1)
    c.int_(mo, "cuda_driver", "measured_on", 1000)
    if mo["driver"] is not None:
        c.str_(mo, "driver", "measured_on")
    if not isinstance(data["method"], dict):
        raise c.fail("method", data["method"], "expected an object")
    variants = {v.name: v for v in manifest.variants}
    entries = [_parse_entry(c, e, f"entries[{i}]", variants)
               for i, e in enumerate(c.list_(data, "entries", "(top level)"))]
    seen: dict = {}
    for i, e in enumerate(entries):
        for j, other in seen.get((e.op, e.arch, e.features, e.dims), []):
            if other.covers(e.m_min) or e.covers(other.m_min):
                raise c.fail(f"entries[{i}]", e.bucket_text(), f"overlaps the M bucket of entries[{j}] "
                                                               f"({other.bucket_text()}) for the same problem")
        seen.setdefault((e.op, e.arch, e.features, e.dims), []).append((i, e))
    return TuningTable(source, mine, dict(mo), dict(data["method"]), tuple(entries))


def _parse_entry(c: _TCtx, raw: Any, p: str, variants: Mapping[str, Any]) -> Entry:
    e = c.obj(raw, p, _ENTRY)
    op = c.str_(e, "op", p)
    spec = OPS.get(op)
    if spec is None:
        raise c.fail(f"{p}.op", op, f"not an operator of this loader ({', '.join(OPS)})")
    arch = c.str_(e, "arch", p)
    feats = c.obj(e["features"], f"{p}.features", spec.feature_names)
    for k, v in feats.items():
        if not isinstance(v, (bool, int, str)):
            raise c.fail(f"{p}.features.{k}", v, "expected true/false, an integer or a string")
    dim_names = tuple(d for d in spec.dims if d != "m")
    dims = c.obj(e["dims"], f"{p}.dims", dim_names)
    for d in dim_names:
        c.int_(dims, d, f"{p}.dims", 1)
    m_min = c.int_(e, "m_min", p, 1)
    m_max = e["m_max"]
    if m_max is not None:
        m_max = c.int_(e, "m_max", p, m_min)
    ms = c.list_(e, "ms", p)
    if not ms or any(isinstance(m, bool) or not isinstance(m, int) or m < m_min or (m_max is not None and m > m_max)
                     for m in ms) or len(set(ms)) != len(ms):
        raise c.fail(f"{p}.ms", ms, "expected distinct integers M inside the entry's bucket")
    times = e["times_us"]
    if not isinstance(times, dict) or not times:
        raise c.fail(f"{p}.times_us", times, "expected an object {variant name: [µs per M of ms]}")
    key = tuple(feats[f] for f in spec.feature_names)
    for name, ts in times.items():
        v = variants.get(name)
        if v is None:
            raise c.fail(f"{p}.times_us", name, "names a variant the manifest does not hold")
        if (v.op, v.arch) != (op, arch) or spec.feature_key(v.knobs) != key:
            raise c.fail(f"{p}.times_us", name, f"is not a {arch} {op} variant with the entry's features")
        for m in ms:
            why = spec.shape_problem(v.requirements, {**dims, "m": m}, v.knobs)
            if why:
                raise c.fail(f"{p}.times_us", name, f"does not serve the entry's shape: {why}")
        if not isinstance(ts, list) or len(ts) != len(ms) or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in ts):
            raise c.fail(f"{p}.times_us.{name}", ts, f"expected {len(ms)} positive times in µs (one per M of ms)")
    for k in ("winner", "rule_choice"):
        if c.str_(e, k, p) not in times:
            raise c.fail(f"{p}.{k}", e[k], "must be one of the measured variants (times_us)")
    return Entry(op, arch, key, tuple((d, dims[d]) for d in dim_names), m_min, m_max, tuple(ms), e["winner"],
                 e["rule_choice"], {n: tuple(float(t) for t in ts) for n, ts in times.items()})


# -- the once-per-process notice -----------------------------------------------------------
_noticed: set = set()
_notice_lock = threading.Lock()


def notice_other_gpu(table: TuningTable, gpu: GpuId) -> bool:
    """Log (once per process per table and GPU) that the table's entries are ignored on `gpu`. True if logged."""
    key = (table.source, gpu)
    with _notice_lock:
        if key in _noticed:
            return False
        _noticed.add(key)
    log.warning("svdq_loader: the tuning table %s was measured on %s, but this device is %s: its entries are "
                "ignored and selection follows the manifest's rules (run `svdq-aot tune` on this GPU model)",
                table.source, table.measured_text(), gpu.text())
    return True


__all__ = ["TABLE_NAME", "SCHEMA", "TuningTable", "TuningTableError", "Entry", "GpuId", "TableHit", "parse_table",
           "notice_other_gpu"]

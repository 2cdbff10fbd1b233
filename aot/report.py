"""``build-report.md``: one table row per variant and the rejected combinations, rendered with jinja2.

`report_rows(manifest, record)` is the data (also `svdq-aot inspect --json`);
`render_report` renders it.  The facts come from the manifest (knobs,
registers, shared memory, cubin size); compile time and cache hit/miss come
from the build record, when there is one.
"""
from __future__ import annotations

from typing import Any

from svdq_loader.manifest import Manifest

from .errors import BuildError

REPORT_NAME = "build-report.md"

_TEMPLATE = """\
# Build report: {{ m.config.name }}

{% if rec.build -%}
Built {{ rows | length }} variant(s) of `{{ m.config.file }}` with svdq-aot {{ m.generator.package_version }} \
({{ m.generator.dsl }} {{ m.generator.dsl_version }}, Python {{ m.generator.python }}) \
on {{ rec.build.started_utc }} in {{ "%.1f" | format(rec.build.wall_seconds) }} s at -j {{ rec.build.jobs }} \
({{ rec.build.cpus }} CPUs{% if rec.build.load_average %}, load average {{ rec.build.load_average | join(" ") }}{% endif %}).
{{ hits }} from the cache, {{ rows | length - hits }} compiled{% if compiled_seconds %} \
({{ "%.1f" | format(compiled_seconds) }} s of compile time, \
peak worker memory {{ "%.0f" | format(peak_mb) }} MiB){% endif %}.
{%- if rec.shard %} This is shard {{ rec.shard[0] }}/{{ rec.shard[1] }} of {{ rec.all_variants | length }} variants.{% endif %}
{%- if rec.build.kernel_switches %}

**Kernel build switches were set**: \
{% for k, v in rec.build.kernel_switches.items() %}`{{ k }}={{ v }}`{% if not loop.last %}, {% endif %}{% endfor %}. \
This is an experiment or diagnosis build: its kernels differ from those a plain build of this config makes.
{%- endif %}
{%- elif rec.merged_from -%}
{{ rows | length }} variant(s) of `{{ m.config.file }}`, svdq-aot {{ m.generator.package_version }} \
({{ m.generator.dsl }} {{ m.generator.dsl_version }}), merged from {{ rec.merged_from | length }} shard folder(s) \
({{ hits }} of the variants came from the cache in their shard's build).
{%- else -%}
{{ rows | length }} variant(s) of `{{ m.config.file }}`, svdq-aot {{ m.generator.package_version }} \
({{ m.generator.dsl }} {{ m.generator.dsl_version }}); no build record (compile times unknown).
{%- endif %}

| variant | op | arch | tile | cta_group | stages | registers | smem (B) | cubin (B) | compile (s) | cache |
|---|---|---|---|---|---:|---:|---:|---:|---:|---|
{% for r in rows -%}
| `{{ r.name }}` | {{ r.op }} | {{ r.arch }} | {{ r.tile }} | {{ r.cta_group }} | {{ r.stages }} | {{ r.registers }} \
| {{ r.smem_bytes }} | {{ r.cubin_bytes }} | {{ r.compile_seconds }} | {{ r.cache }} |
{% endfor %}
{%- if failed %}

## Failed ({{ failed | length }})

{% for name, msg in failed.items() -%}
- `{{ name }}`: {{ msg }}
{% endfor %}
{%- endif %}

## Rejected combinations ({{ m.rejected | length }})

{% for r in m.rejected -%}
- `{{ r.name }}`: {{ r.reason }}
{% else -%}
None.
{% endfor %}
"""


def _dash(x: Any) -> Any:
    return "-" if x is None else x


def report_rows(manifest: Manifest, record: dict | None) -> list[dict[str, Any]]:
    per = (record or {}).get("variants", {})
    rows = []
    for v in manifest.variants:
        tiles = [str(x) for k, x in v.knobs.items() if k.startswith("tile_")]
        info = per.get(v.name, {})
        static = max((r.static_smem for r in v.resources.values()), default=0)
        secs = info.get("seconds")
        rows.append({
            "name": v.name, "op": v.op, "arch": v.arch, "family": v.family,
            "tile": "x".join(tiles) if tiles else "-",
            "cta_group": _dash(v.knobs.get("cta_group")), "stages": _dash(v.knobs.get("stages")),
            "registers": max((r.registers for r in v.resources.values()), default=0),
            "smem_bytes": v.smem_bytes + static, "cubin_bytes": v.size,
            "compile_seconds": f"{secs:.1f}" if isinstance(secs, (int, float)) else "-",
            "cache": info.get("cache", "-"),
        })
    return rows


def render_report(manifest: Manifest, record: dict | None) -> str:
    try:
        import jinja2
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency of the build extra
        raise BuildError("the build report needs jinja2 (pip install 'svdq-aot[build]')") from e
    rec = record or {}
    rows = report_rows(manifest, rec)
    per = rec.get("variants", {})
    compiled = [x for x in per.values() if x.get("cache") != "hit"]
    env = jinja2.Environment(autoescape=False, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(
        m=manifest, rec=_Attr(rec), rows=rows, failed=rec.get("failed", {}),
        hits=sum(1 for x in per.values() if x.get("cache") == "hit"),
        compiled_seconds=sum(x.get("seconds", 0.0) for x in compiled),
        peak_mb=max((x.get("peak_rss_mb", 0.0) for x in compiled), default=0.0))


class _Attr(dict):
    """A dict whose keys read as attributes in the template (missing keys read as None)."""

    def __getattr__(self, k):
        v = self.get(k)
        return _Attr(v) if isinstance(v, dict) else v

"""`merge(out, dirs)`: the outputs of ``build --shard I/N`` -> one artifact set.

Every shard folder is verified as `load()` would (`open_artifacts`) and its
build record read.  The merge refuses, naming the folders: a folder with no
shard record, shards of different configs (name or SHA-256), built by
different versions (svdq-aot, DSL, Python), different shard counts, a shard
given twice, a missing shard, a variant in two shards, shards that disagree
on the rejected list or the shapes, and a union that is not exactly the
config's variant list.  The merged manifest lists the variants in the
config's enumeration order, so it is byte-identical to a single build's.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from svdq_loader.manifest import Manifest
from svdq_loader.verify import open_artifacts

from .artifacts import ArtifactDir, read_record
from .errors import MergeError
from .report import REPORT_NAME, render_report


def merge(out_dir: str | os.PathLike, dirs: list[str | os.PathLike], *, force: bool = False) -> Manifest:
    if not dirs:
        raise MergeError("merge needs at least one shard folder")
    shards = []
    for d in dirs:
        d = Path(d)
        rec = read_record(d)
        if rec is None or not rec.get("complete") or not isinstance(rec.get("shard"), list):
            raise MergeError(f"{d}: not the output of a complete `svdq-aot build --shard I/N` (no shard record)")
        arts = open_artifacts(d)
        shards.append((d, rec, arts))

    d0, r0, a0 = shards[0]
    m0 = a0.manifest

    def differ(what: str, get) -> None:
        for d, rec, arts in shards[1:]:
            if get(rec, arts.manifest) != get(r0, m0):
                raise MergeError(f"{d} and {d0} differ in {what}: {get(rec, arts.manifest)!r} vs "
                                 f"{get(r0, m0)!r}; merge only shards of one build")

    differ("config (name, file, sha256)", lambda r, m: (m.config.name, m.config.file, m.config.sha256))
    differ("versions (svdq-aot, DSL, Python)",
           lambda r, m: (m.generator.package_version, m.generator.dsl_version, m.generator.python))
    differ("kernel build switches (SVDQ_KERNEL_*)", lambda r, m: m.generator.kernel_switches)
    differ("shard count", lambda r, m: r["shard"][1])
    differ("the shapes", lambda r, m: m.shapes)
    differ("the rejected combinations", lambda r, m: m.rejected)
    differ("the config's variant list", lambda r, m: r.get("all_variants"))

    n = r0["shard"][1]
    seen: dict[int, Path] = {}
    for d, rec, _ in shards:
        i = rec["shard"][0]
        if i in seen:
            raise MergeError(f"shard {i}/{n} given twice: {seen[i]} and {d}")
        seen[i] = d
    missing = [f"{i}/{n}" for i in range(1, n + 1) if i not in seen]
    if missing:
        raise MergeError(f"missing shard(s) {', '.join(missing)} of {n} (given: "
                         f"{', '.join(f'{i}/{n}={d}' for i, d in sorted(seen.items()))})")

    owner: dict[str, Path] = {}
    entries = {}
    files: dict[str, bytes] = {}
    for d, rec, arts in shards:
        for name, vv in arts.variants.items():
            if name in owner:
                raise MergeError(f"variant {name} is in two shards: {owner[name]} and {d}")
            owner[name] = d
            entries[name] = vv.entry
            files[vv.entry.cubin] = vv.cubin
            files[vv.entry.host_program.file] = (d / vv.entry.host_program.file).read_bytes()
    order = list(r0["all_variants"])
    if sorted(order) != sorted(entries):
        lost = sorted(set(order) - set(entries))
        extra = sorted(set(entries) - set(order))
        raise MergeError(f"the shards do not add up to the config's {len(order)} variants: "
                         f"missing {lost[:3]}{'...' if len(lost) > 3 else ''}, "
                         f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    variants = tuple(entries[n_] for n_ in order)
    # selection rules and driver needs, in the order one single build writes them (first appearance)
    rules, driver = {}, {}
    for _, _, arts in shards:
        rules.update(arts.manifest.rules)
        driver.update(arts.manifest.cuda_driver)
    selection = tuple(dict.fromkeys(rules[(e.op, e.arch, e.family)] for e in variants
                                    if (e.op, e.arch, e.family) in rules))
    cuda_driver = {a: driver[a] for a in dict.fromkeys(e.arch for e in variants) if a in driver}
    manifest = Manifest(schema_version=m0.schema_version, generator=m0.generator, config=m0.config,
                        shapes=m0.shapes, variants=variants, rejected=m0.rejected, selection=selection,
                        cuda_driver=cuda_driver)
    record = {"config": r0["config"], "shard": None, "all_variants": order, "merged_from": [str(d) for d in dirs],
              "variants": {k: v for _, rec, _ in shards for k, v in rec.get("variants", {}).items()},
              "failed": {}}
    record["manifest_sha256"] = hashlib.sha256(manifest.to_json().encode()).hexdigest()
    with ArtifactDir(out_dir, force=force) as ad:
        ad.commit(files, manifest, extra={REPORT_NAME: render_report(manifest, record).encode()}, record=record)
    return Manifest.from_json(manifest.to_json(), source=str(Path(out_dir) / "manifest.json"))

"""`svdq-aot verify`: `open_artifacts` (exactly the checks `load()` makes), plus the unlisted files.

A file in the folder that the manifest does not list is reported (load()
ignores it, so it may be a leftover or something copied by mistake).  The
build's own bookkeeping is not "unlisted": the lock file, the build record
and ``build-report.md`` (when the record lists it); nor is the tuning table
(``tuning.json``), which `open_artifacts` verifies.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from svdq_loader.manifest import MANIFEST_NAME, Manifest
from svdq_loader.tuning_table import TABLE_NAME
from svdq_loader.verify import open_artifacts

from .artifacts import LOCK_NAME, RECORD_NAME, read_record


@dataclass
class VerifyReport:
    manifest: Manifest
    unlisted: list[str]
    tuning: object = None          # the verified tuning table (svdq_loader.tuning_table), if any


def verify_dir(directory: str | os.PathLike) -> VerifyReport:
    d = Path(directory)
    arts = open_artifacts(d)                  # raises ArtifactError on any problem
    listed = {n for n, _, _ in arts.manifest.files()} | {MANIFEST_NAME, LOCK_NAME, RECORD_NAME, TABLE_NAME}
    rec = read_record(d)
    if rec is not None:
        listed |= {str(n) for n in rec["owned"] if not str(n).endswith((".cubin", ".host.json"))}
    unlisted = sorted(p.name + ("/" if p.is_dir() else "") for p in d.iterdir() if p.name not in listed)
    return VerifyReport(arts.manifest, unlisted, arts.tuning)

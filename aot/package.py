"""`package(artifacts, out_dir)`: a verified artifact set -> an installable wheel (no DSL inside).

The wheel ``<name>-<version>-py3-none-any.whl`` holds one small Python
package (``svdq_kernels_flux`` for ``--name svdq-kernels-flux``) with the
artifacts under ``<package>/artifacts/``: the manifest and exactly the files
it lists, verified first with the checks `load()` makes.  Its module states
the loader versions the artifacts work with (``LOADER_MIN``,
``LOADER_BELOW``), and an entry point in the group
``svdq_loader.artifacts`` lets ``svdq_loader.load()`` find it with no path.

Metadata: Apache-2.0 license (the LICENSE file is in ``.dist-info``), the
project's metadata, and one runtime requirement: ``svdq-aot`` in the
compatible range.  Nothing of the DSL or of any compiler goes in.

The wheel is reproducible: entries are sorted and carry a fixed timestamp
(``$SOURCE_DATE_EPOCH`` when set, else 1980-01-01), so packaging the same
artifacts twice gives the same bytes.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from svdq_loader.discovery import ENTRY_POINT_GROUP, compatible_range
from svdq_loader.manifest import MANIFEST_NAME
from svdq_loader.tuning_table import TABLE_NAME
from svdq_loader.verify import open_artifacts

from . import __version__
from .errors import BuildError

_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION_RE = re.compile(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")


class PackageError(BuildError):
    """The artifacts cannot be packaged (the message names the value and the rule)."""


@dataclass(frozen=True)
class Packaged:
    wheel: Path
    name: str
    version: str
    module: str
    requires: str
    files: int


def _license_text() -> str:
    """The project's LICENSE: from the source tree (editable install) or svdq-aot's installed metadata."""
    tree = Path(__file__).resolve().parents[1]
    if (tree / "pyproject.toml").is_file() and (tree / "LICENSE").is_file():   # a source checkout
        return (tree / "LICENSE").read_text()
    import importlib.metadata
    try:
        dist = importlib.metadata.distribution("svdq-aot")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for rel in ("licenses/LICENSE", "LICENSE"):
        text = dist.read_text(rel) if dist is not None else None
        if text:
            return text
    raise PackageError("the Apache-2.0 LICENSE text is not installed with svdq-aot (reinstall the package)")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _date() -> tuple[int, int, int, int, int, int]:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch and epoch.isdigit():
        t = time.gmtime(max(int(epoch), 315532800))
        return (t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)
    return (1980, 1, 1, 0, 0, 0)


def package(artifacts: str | os.PathLike, out_dir: str | os.PathLike = "dist", *, name: str | None = None,
            version: str = "1.0.0") -> Packaged:
    arts = open_artifacts(artifacts)            # the checks load() makes, before anything is packaged
    m = arts.manifest
    name = name or f"svdq-kernels-{m.config.name}"
    if not _NAME_RE.fullmatch(name):
        raise PackageError(f"--name {name!r}: a distribution name is letters, digits and . _ - "
                           f"(starting and ending with a letter or digit)")
    if not _VERSION_RE.fullmatch(version):
        raise PackageError(f"--version {version!r}: expected a release version like 1.0.0")
    dist = re.sub(r"[-_.]+", "_", name).lower()
    module = dist
    lo, below = compatible_range(m.generator.package_version)
    requires = f"svdq-aot>={lo},<{below}"

    init = (f'"""svdq kernel artifacts of config {m.config.name!r} ({len(m.variants)} variants), built by '
            f'svdq-aot {m.generator.package_version}.\n\n    import svdq_loader\n    lib = svdq_loader.load()'
            f'   # finds this package through its entry point\n"""\n'
            f"import os\n\n"
            f"CONFIG = {m.config.name!r}\n"
            f"CONFIG_SHA256 = {m.config.sha256!r}\n"
            f"BUILT_WITH = {m.generator.package_version!r}\n"
            f"LOADER_MIN = {lo!r}\n"
            f"LOADER_BELOW = {below!r}\n\n\n"
            f"def artifacts_dir() -> str:\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), \"artifacts\")\n")
    files: dict[str, bytes] = {f"{module}/__init__.py": init.encode()}
    files[f"{module}/artifacts/{MANIFEST_NAME}"] = (Path(artifacts) / MANIFEST_NAME).read_bytes()
    for vv in arts.variants.values():
        e = vv.entry
        files[f"{module}/artifacts/{e.cubin}"] = vv.cubin
        files[f"{module}/artifacts/{e.host_program.file}"] = (Path(artifacts) / e.host_program.file).read_bytes()
    if arts.tuning is not None:          # the verified tuning table travels with the kernels it was measured on
        files[f"{module}/artifacts/{TABLE_NAME}"] = (Path(artifacts) / TABLE_NAME).read_bytes()

    di = f"{dist}-{version}.dist-info"
    summary = (f"svdq W4A4 kernels for config {m.config.name} ({len(m.variants)} variants, "
               f"{', '.join(sorted({v.arch for v in m.variants}))}), loaded by svdq_loader")
    meta = "\n".join([
        "Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", f"Summary: {summary}",
        "License: Apache-2.0",
        "Classifier: License :: OSI Approved :: Apache Software License",
        "Classifier: Programming Language :: Python :: 3", "Classifier: Environment :: GPU :: NVIDIA CUDA",
        "Requires-Python: >=3.10", f"Requires-Dist: {requires}", "", 
        f"Compiled kernels (cubins), their host programs and manifest for config `{m.config.name}` "
        f"(sha256 {m.config.sha256}), built by svdq-aot {m.generator.package_version} with "
        f"{m.generator.dsl} {m.generator.dsl_version}.  The DSL was a build-time tool only: nothing of it is in "
        f"this wheel.  `svdq_loader.load()` finds the artifacts through the `{ENTRY_POINT_GROUP}` entry point.",
        ""])
    files[f"{di}/METADATA"] = meta.encode()
    files[f"{di}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: svdq-aot {__version__}\nRoot-Is-Purelib: true\n"
                            f"Tag: py3-none-any\n").encode()
    files[f"{di}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{m.config.name} = {module}\n".encode()
    files[f"{di}/top_level.txt"] = f"{module}\n".encode()
    files[f"{di}/LICENSE"] = _license_text().encode()
    record_name = f"{di}/RECORD"
    record = "".join(f"{n},{_record_hash(b)},{len(b)}\n" for n, b in sorted(files.items())) + f"{record_name},,\n"
    files[record_name] = record.encode()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"{dist}-{version}-py3-none-any.whl"
    tmp = wheel.with_name(f".{wheel.name}.tmp")
    date = _date()
    order = sorted(n for n in files if not n.startswith(di)) + sorted(n for n in files if n.startswith(di)
                                                                      and n != record_name) + [record_name]
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n in order:
            zi = zipfile.ZipInfo(n, date_time=date)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, files[n], compresslevel=9)
    os.replace(tmp, wheel)
    return Packaged(wheel, name, version, module, requires, len(files))

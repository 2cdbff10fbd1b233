"""Where `load()` with no path finds its artifacts (standard library only).

In order:

1. ``$SVDQ_ARTIFACTS``: a folder holding ``manifest.json``;
2. an installed *artifact package* (a wheel made by ``svdq-aot package``),
   found through the ``svdq_loader.artifacts`` entry point group; its module
   says which loader versions it was built for (``LOADER_MIN`` <= version <
   ``LOADER_BELOW``) and is refused outside that range, naming both
   versions; several installed packages are refused as ambiguous;
3. ``./artifacts``.

When nothing is found, `ArtifactsNotFound` lists every place searched.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass

from ._version import __version__
from .errors import ArtifactsNotFound, IncompatibleArtifacts

ENV_VAR = "SVDQ_ARTIFACTS"
ENTRY_POINT_GROUP = "svdq_loader.artifacts"
DEFAULT_DIR = "artifacts"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Found:
    path: str
    how: str          # what found it, for messages ("$SVDQ_ARTIFACTS", "package svdq-kernels-flux 1.0.0", ...)


def version_tuple(v: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: '0.1.0rc1' -> (0, 1, 0)."""
    m = re.match(r"\d+(\.\d+)*", v.strip())
    if not m:
        raise ValueError(f"not a version: {v!r}")
    return tuple(int(x) for x in m.group(0).split("."))


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def compatible_range(builder_version: str) -> tuple[str, str]:
    """(min, below) of the loader versions artifacts built by `builder_version` work with.

    At least the builder's own version; below the next minor release for 0.x (where a minor
    release may change the format), below the next major release from 1.0 on.
    """
    t = version_tuple(builder_version) + (0, 0)
    below = f"0.{t[1] + 1}" if t[0] == 0 else f"{t[0] + 1}"
    return ".".join(map(str, version_tuple(builder_version))), below


def check_compatible(what: str, lo: str, below: str, loader: str = __version__) -> None:
    v = version_tuple(loader)
    if _cmp(v, version_tuple(lo)) < 0 or _cmp(v, version_tuple(below)) >= 0:
        raise IncompatibleArtifacts(
            f"{what} was built for svdq_loader >={lo},<{below} but the installed svdq_loader is {loader}; "
            f"install svdq-aot>={lo},<{below} (or rebuild and repackage the artifacts with svdq-aot {loader})")


def _from_packages(searched: list[str]) -> Found | None:
    eps = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    if not eps:
        searched.append(f"entry points {ENTRY_POINT_GROUP!r}: no artifact package installed")
        return None
    if len(eps) > 1:
        names = ", ".join(f"{e.name} ({e.value})" for e in eps)
        raise ArtifactsNotFound(f"{len(eps)} artifact packages are installed ({names}); load(path) one of "
                                f"them or set ${ENV_VAR} to its folder")
    ep = eps[0]
    dist = getattr(ep, "dist", None)
    what = f"artifact package {dist.name} {dist.version}" if dist is not None else f"artifact package {ep.value}"
    try:
        mod = ep.load()
        lo, below = str(mod.LOADER_MIN), str(mod.LOADER_BELOW)
        path = str(mod.artifacts_dir())
    except (ImportError, AttributeError, TypeError) as e:
        raise ArtifactsNotFound(f"{what} (entry point {ep.name} = {ep.value}) is broken: "
                                f"{type(e).__name__}: {e}") from None
    check_compatible(what, lo, below)
    return Found(path, what)


def find_artifacts() -> Found:
    """The artifact folder `load()` with no path uses (raises ArtifactsNotFound / IncompatibleArtifacts)."""
    searched: list[str] = []
    env = os.environ.get(ENV_VAR)
    if env:
        if os.path.isfile(os.path.join(env, MANIFEST)):
            return Found(env, f"${ENV_VAR}")
        raise ArtifactsNotFound(f"${ENV_VAR} is {env!r} but {os.path.join(env, MANIFEST)} does not exist")
    searched.append(f"${ENV_VAR}: not set")
    found = _from_packages(searched)
    if found is not None:
        return found
    local = os.path.abspath(DEFAULT_DIR)
    if os.path.isfile(os.path.join(local, MANIFEST)):
        return Found(local, f"./{DEFAULT_DIR}")
    searched.append(f"./{DEFAULT_DIR}: {os.path.join(local, MANIFEST)} does not exist")
    raise ArtifactsNotFound("no svdq artifacts found; searched, in order: " + "; ".join(searched)
                            + " (pass load(path), set $SVDQ_ARTIFACTS, or pip install an artifact wheel "
                              "made by `svdq-aot package`)")

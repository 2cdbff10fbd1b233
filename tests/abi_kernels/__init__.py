"""Small CuTe-DSL kernels used by the launch-ABI tests (build time only).

``ensure_packages()`` makes ``svdq_loader`` / ``svdq_aot`` importable from the
source tree when the project is not pip-installed (pyproject maps them from
``loader/`` and ``aot/``).  It imports nothing from the DSL.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ensure_packages() -> None:
    for pkg, sub in (("svdq_loader", "loader"), ("svdq_aot", "aot")):
        if pkg in sys.modules:
            continue
        try:
            importlib.import_module(pkg)
            continue
        except ImportError:
            pass
        init = ROOT / sub / "__init__.py"
        spec = importlib.util.spec_from_file_location(pkg, init, submodule_search_locations=[str(ROOT / sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[pkg] = mod
        spec.loader.exec_module(mod)

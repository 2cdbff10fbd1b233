"""The loader's use of cuda-bindings, checked on the CPU against the installed binding (and, with
SVDQ_BINDINGS_VENVS, against other majors' venvs made by tools/check_bindings.sh)."""
from __future__ import annotations

import os
import subprocess

import pytest

from svdq_loader import bindings_check


def test_used_names_are_found_in_source():
    chains = bindings_check.used_names("cu.cuInit(0)\nx = cu.CUresult.CUDA_SUCCESS\ny = other.cuFoo\n")
    assert chains == [("CUresult", "CUDA_SUCCESS"), ("cuInit",)]


def test_installed_binding_has_every_name_the_driver_module_uses():
    from svdq_loader import driver
    with open(driver.__file__) as f:
        chains = bindings_check.used_names(f.read())
    assert ("cuLibraryLoadData",) in chains and ("cuDriverGetVersion",) in chains
    assert bindings_check.missing_names() == []


@pytest.mark.skipif(not os.environ.get("SVDQ_BINDINGS_VENVS"), reason="set SVDQ_BINDINGS_VENVS=venv1:venv2 "
                    "(python venvs with another cuda-bindings major and this package installed --no-deps)")
def test_other_binding_majors(tiny_artifacts):
    for venv in os.environ["SVDQ_BINDINGS_VENVS"].split(":"):
        r = subprocess.run([os.path.join(venv, "bin", "python"), "-m", "svdq_loader.bindings_check",
                            str(tiny_artifacts)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "OK" in r.stdout, (venv, r.stdout + r.stderr)

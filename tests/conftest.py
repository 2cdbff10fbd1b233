"""Shared fixtures: one real build of configs/tiny.yaml per test session (CPU only)."""
from __future__ import annotations

import os

import atexit
import shutil
import tempfile

import pytest

# Builds in tests never read or fill the user's compiled-variant cache: one private cache for the
# session (the session fixtures below), and a fresh one per test (autouse fixture).
os.environ["SVDQ_AOT_CACHE"] = tempfile.mkdtemp(prefix="svdq-aot-test-cache-")
atexit.register(shutil.rmtree, os.environ["SVDQ_AOT_CACHE"], True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """Artifacts of a real build of configs/tiny.yaml (skips where the DSL is not installed)."""
    try:
        import cutlass  # noqa: F401
    except ImportError:
        pytest.skip("nvidia-cutlass-dsl is not installed: cannot build artifacts here")
    from svdq_aot.build import build
    out = tmp_path_factory.mktemp("tiny_session") / "artifacts"
    build(TINY, str(out), jobs=1)
    return out


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SVDQ_AOT_CACHE", str(tmp_path / "_svdq_cache"))

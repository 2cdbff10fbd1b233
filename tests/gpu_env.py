"""The GPU test modules' shared gate: skip cleanly without a GPU or artifacts, fail with SVDQ_REQUIRE_GPU=1.

    from gpu_env import ART, SEED, torch     # at the top of a GPU test module

`SVDQ_ARTIFACTS` (default `artifacts/`) names the artifact folder; fresh random
inputs come from `SEED` (`SVDQ_SEED` replays a run; every failure message prints it).
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

REQUIRE = os.environ.get("SVDQ_REQUIRE_GPU") == "1"
ART = os.environ.get("SVDQ_ARTIFACTS", os.path.join(os.path.dirname(__file__), "..", "artifacts"))
SEED = int(os.environ.get("SVDQ_SEED", int.from_bytes(os.urandom(3), "little")))

if not torch.cuda.is_available():
    if REQUIRE:
        raise RuntimeError("SVDQ_REQUIRE_GPU=1 but torch sees no CUDA device")
    pytest.skip("no CUDA GPU here (GPU tests run on the H200 through the device tool)", allow_module_level=True)
if not os.path.exists(os.path.join(ART, "manifest.json")):
    if REQUIRE:
        raise RuntimeError(f"SVDQ_REQUIRE_GPU=1 but no artifacts at {ART} (run svdq-aot build first)")
    pytest.skip(f"no built artifacts at {ART}", allow_module_level=True)

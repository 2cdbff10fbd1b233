"""The device-call scripts under tools/ parse (``bash -n``) and say how they are run, so a scarce H200 call is not
lost to a typo."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "tools").glob("*.sh"))


def test_there_are_scripts():
    assert any(p.name == "h200_ab.sh" for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_documents_its_use(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = script.read_text().splitlines()
    assert lines[0].startswith("#!"), "no interpreter line"
    assert any(f"tools/{script.name}" in line for line in lines[:12] if line.startswith("#")), \
        "the header comment does not show how to run it"


def test_the_ab_script_refuses_missing_folders(tmp_path):
    script = str(SCRIPTS[0].parent / "h200_ab.sh")
    r = subprocess.run(["bash", script], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: h200_ab.sh BASE [EXP ...]" in r.stderr
    base = tmp_path / "base"
    base.mkdir()
    (base / "manifest.json").write_text("{}")
    r = subprocess.run(["bash", script, str(base), str(tmp_path / "nope")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and "nope has no manifest.json" in r.stderr
    assert not (tmp_path / "out").exists()           # refused before anything ran

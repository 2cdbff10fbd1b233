"""tools/arch_config.py: the part of a config that serves some of its archs (no GPU, no DSL)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from svdq_aot.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("arch_config", ROOT / "tools" / "arch_config.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)
FLUX = ROOT / "configs" / "flux.yaml"


@pytest.mark.parametrize("archs", [["sm_90a"], ["sm_100a", "sm_120a"], ["sm_121a", "sm_90a"]])
def test_the_narrowed_config_keeps_the_listed_archs_sections_as_they_were(archs):
    full = load_config(FLUX)
    part = parse_config(tool.narrow(FLUX.read_text(), archs, str(FLUX)), "narrowed")
    assert part.archs == tuple(a for a in full.archs if a in archs)          # the config's own order
    assert part.variants == {a: v for a, v in full.variants.items() if a in archs}
    # the FP8-compute mode (configs/flux.yaml's compute) is sm_90a's: kept with it, dropped without it
    assert part.compute == (("exact", "fp8") if "sm_90a" in archs else ("exact",))
    assert (part.name, part.shapes, part.ranks, part.out_dtypes) == (full.name, full.shapes, full.ranks,
                                                                       full.out_dtypes)


def test_narrowing_archs_alone_is_what_the_config_check_refuses():
    """Why the tool exists: the arch list cut by hand leaves variants sections the check refuses."""
    text = FLUX.read_text().replace("archs: [sm_90a, sm_100a, sm_103a, sm_120a, sm_121a]", "archs: [sm_90a]")
    with pytest.raises(ConfigError, match="arch is not listed in archs"):
        parse_config(text, "by hand")


def test_an_arch_the_config_does_not_list_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"sm_89 not in its archs \(sm_90a, sm_100a"):
        tool.narrow(FLUX.read_text(), ["sm_89"], str(FLUX))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "arch_config.py"), str(FLUX), "sm_89"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "" and "sm_89 not in its archs" in r.stderr

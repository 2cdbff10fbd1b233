"""Write the part of a build config that serves some of its archs, for a build of those archs only.

    python3 tools/arch_config.py configs/flux.yaml sm_90a > build/flux90.yaml

A config may not hold a ``variants`` section for an arch it does not list, so narrowing ``archs`` alone is refused;
this keeps the listed archs' sections and drops the others' (everything else as written, comments aside), and drops
from ``compute`` a mode that none of the kept archs builds (``fp8`` when sm_90a is not kept), which the config check
would refuse.  The
sm_90a experiments of docs/PERF.md build against ``build/flux90.yaml`` made this way: the sm_90a half of
``configs/flux.yaml`` in about 90 s instead of the whole config.  The result is checked as a config before it is
written (exit 1 with the reason otherwise).
"""
from __future__ import annotations

import argparse
import sys

import yaml

from svdq_aot.config import ConfigError, builds_mode, parse_config


def narrow(text: str, archs: list[str], source: str = "<config>") -> str:
    """The YAML of `text`'s config with only `archs` (each one it lists); ConfigError naming the rule otherwise."""
    data = yaml.safe_load(text)
    listed = list(data.get("archs") or []) if isinstance(data, dict) else []
    missing = [a for a in archs if a not in listed]
    if missing:
        raise ConfigError(f"{source}: {', '.join(missing)} not in its archs ({', '.join(map(str, listed))})")
    data["archs"] = [a for a in listed if a in archs]
    if isinstance(data.get("variants"), dict):
        data["variants"] = {a: v for a, v in data["variants"].items() if a in archs}
    if isinstance(data.get("compute"), list) and isinstance(data.get("variants"), dict):
        data["compute"] = [m for m in data["compute"] if m == "exact" or any(
            builds_mode(m, a, v if isinstance(v, dict) else {}) for a, v in data["variants"].items())]
    out = yaml.safe_dump(data, sort_keys=False)
    parse_config(out, f"{source} narrowed to {', '.join(archs)}")       # the same checks as a build's
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("archs", nargs="+", help="archs to keep, each listed in the config")
    a = ap.parse_args(argv)
    try:
        with open(a.config) as f:
            text = f.read()
        sys.stdout.write(narrow(text, a.archs, a.config))
    except (OSError, ConfigError) as e:
        print(f"arch_config: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

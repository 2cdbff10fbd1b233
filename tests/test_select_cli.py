"""`svdq-aot select`: the choice, why, and every rejected candidate, as text and JSON (CPU, no GPU)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from svdq_aot.cli import main


def _run(*args):
    return CliRunner().invoke(main, ["select", *map(str, args)])


def test_select_text_and_json(tiny_artifacts):
    r = _run(tiny_artifacts, "--op", "gemm_w4a4", "--m", 4608, "--n", 256, "--k", 256, "--rank", 32,
             "--dtype", "bf16", "--arch", "sm_90a")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == ("gemm_w4a4 on sm_90a, M=4608 N=256 K=256, out_dtype=bf16, rank=32, wcscale=True, bias=True, "
                        "scale_layout=logical")
    assert lines[1].startswith("chosen: svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_")
    assert ("M=4608 falls in the bucket M >= 257, priority 0, prefer: the smallest estimated waves x per-CTA "
            "k-steps first; tile_m larger first") in r.output
    assert "the grid fill assumes 132 SMs (no device given)" in r.output
    r2 = _run(tiny_artifacts, "--op", "gemm_w4a4", "--m", 4608, "--n", 256, "--k", 256, "--rank", 32, "--sms", 8)
    assert r2.exit_code == 0 and "(no device given)" not in r2.output, r2.output
    fill = [ln for ln in r.output.splitlines() if "chosen knobs: grid fill cost" in ln]
    fill2 = [ln for ln in r2.output.splitlines() if "chosen knobs: grid fill cost" in ln]
    assert fill and fill2 and " 1 wave(s))" in fill[0] and " 1 wave(s))" not in fill2[0], (fill, fill2)
    assert "rejected (1):" in r.output and "built for rank=0 (the call needs 32)" in r.output
    j = _run(tiny_artifacts, "--op", "gemm_w4a4", "--m", 16, "--n", 256, "--k", 256, "--rank", 32, "--json")
    assert j.exit_code == 0, j.output
    d = json.loads(j.output)
    assert d["chosen"] == lines[1].split(": ")[1] and d["dims"] == {"m": 16, "n": 256, "k": 256}
    assert any("bucket M in [1, 16]" in w for w in d["why"])
    assert [x["reason"] for x in d["rejected"]] == ["built for rank=0 (the call needs 32)"]


def test_select_quantize_act_and_refusals(tiny_artifacts):
    r = _run(tiny_artifacts, "--op", "quantize_act", "--m", 77, "--k", 256)
    assert r.exit_code == 0 and "chosen: svdq_quantize_act_sm90a_dtypebf16_rank0_" in r.output, r.output
    r = _run(tiny_artifacts, "--op", "gemm_w4a4", "--m", 77, "--n", 200, "--k", 256, "--rank", 32)
    assert r.exit_code == 1 and "no variant: gemm_w4a4 shape M=77 N=200 K=256 is not supported" in r.output
    assert "N=200 is not a multiple of 128" in r.output
    r = _run(tiny_artifacts, "--op", "gemm_w4a4", "--m", 77, "--k", 256)
    assert r.exit_code == 1 and "missing n" in r.output and "Traceback" not in r.output
    r = _run(tiny_artifacts, "--op", "gemm_w4a4", "--m", 77, "--n", 256, "--k", 256, "--arch", "sm_100a")
    assert r.exit_code == 1 and "no gemm_w4a4 kernel built for this device's arch sm_100a" in r.output


def test_select_runs_without_the_dsl(tiny_artifacts):
    """A serving image has no DSL: the select command must not need it."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("cutlass", "svdq_kernels", "torch"):
                    raise ImportError(name + " blocked by the test")
        sys.meta_path.insert(0, Block())
        sys.argv = ["svdq-aot", "select", {str(tiny_artifacts)!r}, "--op", "gemm_w4a4", "--m", "7", "--n", "512",
                    "--k", "128", "--rank", "32", "--json"]
        from svdq_aot.cli import main
        main()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["chosen"].startswith("svdq_gemm_w4a4_sm90a_outdtypebf16_rank32_")

"""tools/sass_loops.py --compare: the side-by-side rows of two builds (pure Python on report dicts; the reports
themselves come from cuobjdump, whose loop reader has its own test in test_quantize_compile.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "tools" / "sass_loops.py"
_spec = importlib.util.spec_from_file_location("sass_loops", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _rep(folder, cubin, regs, loops):
    return dict(folder=folder, cubin=cubin, registers=regs, stack=0, sass=1000, collectives=0,
                loops=[dict(start=0, end=1, instructions=n, hmma=h) for n, h in loops])


def test_the_main_loop_is_the_innermost_loop_holding_mmas():
    assert tool.main_loop(_rep("a", "k", 80, [(535, 16), (283, 16), (1, 0)]))["instructions"] == 283
    assert tool.main_loop(_rep("a", "k", 80, [(40, 0)])) is None


def test_compare_pairs_each_cubin_of_the_first_folder_with_the_others():
    rows = [_rep("a", "x.cubin", 120, [(698, 16), (278, 16)]), _rep("b", "x.cubin", 118, [(672, 16), (254, 16)]),
            _rep("a", "y.cubin", 168, [(1041, 32)]), _rep("b", "z.cubin", 168, [(945, 32)]),
            _rep("a", "q.cubin", 115, [(368, 0)]), _rep("b", "q.cubin", 115, [(360, 0)])]
    pairs = tool.compare(rows, ["a", "b"])
    assert [p["cubin"] for p in pairs] == ["x.cubin", "q.cubin"]          # y has no partner in b
    x, q = pairs
    assert x["registers"] == (120, 118) and x["loop"] == (278, 254) and x["mma"] == (16, 16)
    assert abs(x["change"] - (254 - 278) / 278) < 1e-12
    assert q["loop"] == (None, None) and q["change"] is None
    table = tool.compare_table(pairs, "a").splitlines()
    assert table[2] == "| x.cubin | b | 120 → 118 | 0 → 0 | 278 / 16 → 254 / 16 | -8.6 % |"
    assert table[3] == "| q.cubin | b | 115 → 115 | 0 → 0 | none → none | – |"

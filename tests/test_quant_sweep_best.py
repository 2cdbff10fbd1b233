"""`tools/quant_sweep.py`'s closing table: each folder's fastest exact schedule per problem, against the first
folder's (hand-built timings; the timing itself needs a GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "quant_sweep.py"
_spec = importlib.util.spec_from_file_location("quant_sweep", TOOL)
quant_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quant_sweep)


def _row(folder, m, k, us, ctas, exact=True, rank=32, smooth=2, ksplit=1):
    return dict(folder=folder, rank=rank, m=m, k=k, smooth=smooth, ksplit=ksplit, ctas=ctas, carveout=-1, us=us,
                exact=exact)


def test_each_folder_keeps_its_fastest_exact_row_per_problem_with_its_ratio_to_the_first():
    timed = [_row("base", 4608, 3072, 19.0, 288), _row("base", 4608, 3072, 18.7, 396),
             _row("base", 4608, 12288, 63.8, 396),
             _row("exp", 4608, 3072, 12.0, 528, exact=False),      # fast but wrong: never the fastest
             _row("exp", 4608, 3072, 29.0, 528), _row("exp", 4608, 12288, 68.9, 528),
             _row("exp", 9216, 12288, 134.5, 528)]                 # a problem the first folder did not time
    got = [(r["folder"], r["m"], r["k"], r["us"], r["ctas"], r["ratio"]) for r in quant_sweep.best_rows(timed)]
    assert got == [("base", 4608, 3072, 18.7, 396, 1.0), ("exp", 4608, 3072, 29.0, 528, pytest.approx(29.0 / 18.7)),
                   ("base", 4608, 12288, 63.8, 396, 1.0),
                   ("exp", 4608, 12288, 68.9, 528, pytest.approx(68.9 / 63.8)),
                   ("exp", 9216, 12288, 134.5, 528, None)]


def test_problems_differ_by_rank_and_smoothing_form_too():
    timed = [_row("a", 64, 192, 5.0, 4, rank=0), _row("a", 64, 192, 6.0, 4, rank=32),
             _row("a", 64, 192, 7.0, 4, smooth=1), _row("b", 64, 192, 2.5, 4, rank=0)]
    got = [(r["folder"], r["rank"], r["smooth"], r["us"], r["ratio"]) for r in quant_sweep.best_rows(timed)]
    assert got == [("a", 0, 2, 5.0, 1.0), ("b", 0, 2, 2.5, 0.5), ("a", 32, 2, 6.0, 1.0), ("a", 32, 1, 7.0, 1.0)]


def test_the_table_prints_every_best_row_and_a_dash_without_a_baseline():
    text = quant_sweep.best_table([_row("base", 4608, 3072, 18.7, 396), _row("exp", 4608, 3072, 29.0, 528),
                                   _row("exp", 1024, 3072, 33.4, 16)])
    lines = text.splitlines()
    assert lines[0].startswith("| folder | R | M | K |") and len(lines) == 5
    assert lines[2] == "| base | 32 | 4608 | 3072 | 2 | 18.7 | 1 | 396 | -1 | 1.00 |"
    assert lines[3] == "| exp | 32 | 4608 | 3072 | 2 | 29.0 | 1 | 528 | -1 | 1.55 |"
    assert lines[4].endswith("| 16 | -1 | - |")

"""tools/sm90_sweep.py's side-by-side table of two or more builds (pure Python; the sweep itself needs a GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[1] / "tools" / "sm90_sweep.py"
_spec = importlib.util.spec_from_file_location("sm90_sweep", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def _row(folder, variant, m, us, ok=True):
    r = dict(artifacts=folder, variant=variant, knobs=f"knobs of {variant}", m=m, k=3072, n=3072, ok=ok)
    if ok:
        r["us"] = us
    return r


def test_one_folder_has_no_comparison():
    assert sweep.compare([_row("a", "v1", 16, 10.0)], ["a"]) == []


def test_each_variant_and_shape_gets_its_times_and_ratio_to_the_first_folder():
    rows = [_row("a", "v1", 16, 10.0), _row("b", "v1", 16, 9.0), _row("a", "v1", 64, 20.0),
            _row("b", "v1", 64, 25.0), _row("a", "v2", 16, 8.0), _row("b", "v2", 16, 0.0, ok=False),
            _row("a", "v3", 16, 7.0)]
    lines = sweep.compare(rows, ["a", "b"])
    assert lines[0] == "| variant (knobs) | M | K | N | a µs | b µs | b / a |"
    assert lines[2:] == ["| knobs of v1 | 16 | 3072 | 3072 | 10.0 | 9.0 | 0.900 |",
                         "| knobs of v1 | 64 | 3072 | 3072 | 20.0 | 25.0 | 1.250 |",
                         "| knobs of v2 | 16 | 3072 | 3072 | 8.0 | FAILED | – |",
                         "| knobs of v3 | 16 | 3072 | 3072 | 7.0 | – | – |"]


def test_a_failed_first_folder_row_has_no_ratio():
    rows = [_row("a", "v1", 16, 0.0, ok=False), _row("b", "v1", 16, 9.0), _row("c", "v1", 16, 8.0)]
    want = "| knobs of v1 | 16 | 3072 | 3072 | FAILED | 9.0 | – | 8.0 | – |"
    assert sweep.compare(rows, ["a", "b", "c"])[2] == want


def test_the_json_is_replaced_whole_after_each_shape(tmp_path):
    """write_json (called after every shape, so a sweep stopped by its time limit keeps its rows): each call leaves
    the file holding all rows so far and no temporary beside it."""
    import json
    path = tmp_path / "sweep.json"
    rows = [_row("a", "v1", 16, 10.0)]
    sweep.write_json(str(path), rows, "GPU X")
    rows.append(_row("a", "v1", 64, 20.0))
    sweep.write_json(str(path), rows, "GPU X")
    got = json.loads(path.read_text())
    assert got["gpu"] == "GPU X" and [r["m"] for r in got["rows"]] == [16, 64]
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]


def test_the_best_table_gives_each_folders_fastest_form_per_shape():
    def row(folder, variant, m, us, ok=True, knobs="tile_m=64 tile_n=128 stages=4 schedule=ws wsets=8 "
                                                      "act_source=images"):
        r = dict(_row(folder, variant, m, us, ok), knobs=knobs, cublas_us=20.0)
        return r
    sk = "tile_m=64 tile_n=192 stages=4 schedule=ws_streamk wsets=4 act_source=images"
    rows = [row("a", "v1", 64, 22.0), row("a", "v2", 64, 25.0), row("b", "v1", 64, 21.0),
            row("b", "v3", 64, 11.0, knobs=sk), row("c", "v1", 64, 0.0, ok=False),
            row("a", "v1", 256, 40.0), row("b", "v1", 256, 44.0)]
    lines = sweep.best_table(rows, ["a", "b", "c"])
    assert lines[0] == ("| M | K | N | cuBLAS µs | a: best µs (form) | b: best µs (form) | c: best µs (form) "
                        "| b / a | c / a |")
    assert lines[2] == ("| 64 | 3072 | 3072 | 20.0 | 22.0 (64x128 ws w8 s4 img) | 11.0 (64x192 ws_streamk w4 s4 img) "
                        "| – | 0.500 | – |")
    assert lines[3] == ("| 256 | 3072 | 3072 | 20.0 | 40.0 (64x128 ws w8 s4 img) | 44.0 (64x128 ws w8 s4 img) | – "
                        "| 1.100 | – |")
    assert sweep.best_table(rows, ["a"]) == []


def test_sm_counts_default_to_the_device_and_stay_within_it_unless_oversubscribed():
    assert sweep.sm_count_list(None, 132) == [132]
    assert sweep.sm_count_list("132,66,33", 132) == [132, 66, 33]
    refused = sweep.sm_count_list("132,264", 132)
    assert isinstance(refused, str) and "1 .. 132" in refused and "--oversubscribe" in refused
    assert sweep.sm_count_list("132,264,396", 132, oversubscribe=True) == [132, 264, 396]
    assert "1 .. 1056" in sweep.sm_count_list("2000", 132, oversubscribe=True)
    assert isinstance(sweep.sm_count_list("0", 132), str) and isinstance(sweep.sm_count_list("a,b", 132), str)

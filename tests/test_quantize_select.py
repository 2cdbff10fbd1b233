"""quantize_act's selection rule (the family's SELECTION) against the H100 sweeps of docs/PERF.md, session 37, and
its config forms (two m-tiles per warp built for the listed ranks only)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from svdq_loader import select
from svdq_loader.select_rules import Rule, parse_buckets

fam = pytest.importorskip("svdq_kernels.quantize_act", reason="the quantize_act family needs the DSL to import")

#: (rank, M, K) -> (mtiles 1, mtiles 2) µs, 4 warps, bf16, smoothing on, the loader's own launch schedule for each
#: (`tools/quant_sweep.py ... --ctas auto`, CUDA-graph timing, every output checked against the torch version).
#: Rank 48: call 2; ranks 16 and 32: call 1; rank 64: call 9.
MEASURED_S37 = {
    (48, 256, 3072): (6.2, 7.8), (48, 256, 12288): (13.3, 13.0), (48, 256, 15360): (15.4, 15.4),
    (48, 512, 3072): (8.4, 8.0), (48, 512, 12288): (17.7, 19.4), (48, 512, 15360): (21.1, 23.0),
    (48, 1024, 3072): (11.1, 11.8), (48, 1024, 12288): (28.7, 32.9), (48, 1024, 15360): (33.7, 40.0),
    (48, 2048, 3072): (16.2, 12.6), (48, 2048, 12288): (42.1, 36.0), (48, 2048, 15360): (48.9, 43.5),
    (48, 3072, 3072): (16.4, 17.8), (48, 3072, 12288): (51.7, 49.4), (48, 3072, 15360): (61.6, 58.6),
    (48, 4096, 3072): (26.0, 19.1), (48, 4096, 12288): (71.8, 53.9), (48, 4096, 15360): (86.8, 65.7),
    (48, 4608, 3072): (26.2, 26.5), (48, 4608, 12288): (79.6, 67.2), (48, 4608, 15360): (95.9, 81.1),
    (16, 1024, 3072): (8.2, 9.8), (16, 1024, 12288): (19.6, 27.7), (16, 1024, 15360): (23.1, 33.6),
    (16, 4608, 3072): (18.3, 21.7), (16, 4608, 12288): (62.2, 61.9), (16, 4608, 15360): (76.3, 76.4),
    (16, 9216, 3072): (36.1, 41.1), (16, 9216, 12288): (115.1, 133.6), (16, 9216, 15360): (141.9, 167.9),
    (32, 1024, 3072): (8.7, 10.2), (32, 1024, 12288): (21.0, 29.1), (32, 1024, 15360): (24.5, 35.4),
    (32, 4608, 3072): (19.1, 23.0), (32, 4608, 12288): (64.2, 63.5), (32, 4608, 15360): (78.2, 77.8),
    (32, 9216, 3072): (37.9, 43.5), (32, 9216, 12288): (118.4, 138.3), (32, 9216, 15360): (145.0, 172.0),
    (64, 1024, 3072): (11.1, 11.8), (64, 1024, 12288): (28.4, 32.8), (64, 1024, 15360): (33.6, 40.5),
    (64, 2048, 3072): (16.2, 12.6), (64, 2048, 12288): (43.9, 35.9), (64, 2048, 15360): (51.7, 43.6),
    (64, 3072, 3072): (17.1, 17.8), (64, 3072, 12288): (52.7, 50.0), (64, 3072, 15360): (64.3, 60.4),
    (64, 4096, 3072): (25.7, 19.0), (64, 4096, 12288): (75.6, 54.5), (64, 4096, 15360): (92.1, 66.7),
    (64, 4608, 3072): (26.1, 26.5), (64, 4608, 12288): (83.5, 68.4), (64, 4608, 15360): (101.3, 83.1),
    (64, 9216, 3072): (44.7, 43.6), (64, 9216, 12288): (153.7, 136.6), (64, 9216, 15360): (187.6, 166.8),
}


@pytest.fixture(scope="module")
def rules():
    return {("quantize_act", "sm_90a", fam.NAME): Rule("quantize_act", "sm_90a", fam.NAME,
                                                       parse_buckets(fam.SELECTION, "SELECTION", list(fam.TUNING)))}


def _variant(rank, mtiles):
    knobs = dict(dtype="bf16", rank=rank, scale_layout="logical", warps=4, mtiles=mtiles)
    return SimpleNamespace(name=f"r{rank}_mt{mtiles}", op="quantize_act", arch="sm_90a", knobs=knobs,
                           family=fam.NAME, requirements=dict(k_multiple=64))


def _problem(rank, m, k):
    return select.Problem("quantize_act", "sm_90a", ("bf16", rank, "logical"), (("m", m), ("k", k)))


@pytest.mark.parametrize("point", sorted(MEASURED_S37))
def test_rule_picks_a_form_within_9_percent_of_the_faster(rules, point):
    rank, m, k = point
    t = dict(zip((1, 2), MEASURED_S37[point]))
    ex = select.explain([_variant(rank, 1), _variant(rank, 2)], rules, _problem(rank, m, k), sm_count=132)
    picked = ex.chosen.knobs["mtiles"]
    assert t[picked] <= 1.09 * min(t.values()), (point, t, ex.text())
    if max(t.values()) > 1.1 * min(t.values()):        # a clear difference: the faster one
        assert t[picked] == min(t.values()), (point, t, ex.text())


def test_two_m_tiles_only_at_ranks_48_and_64_from_m_2048(rules):
    for rank in (0, 16, 32, 48, 64, 96, 128):
        for m in (1, 2047, 2048, 9216):
            ex = select.explain([_variant(rank, 1), _variant(rank, 2)], rules, _problem(rank, m, 3072))
            two = rank in (48, 64) and m >= 2048
            assert ex.chosen.knobs["mtiles"] == (2 if two else 1), (rank, m)
            if two:
                assert "mtiles=2 (as 48 <= rank <= 64)" in " ".join(ex.why), ex.why


def test_config_forms_build_two_m_tiles_for_the_listed_ranks_only():
    from svdq_aot.variants import ONLY_KEY
    dicts, problems = fam.config_axes("sm_90a", {"forms": [{}, {"mtiles": [2], "ranks": [48, 64]}]})
    assert problems == []
    assert dicts == [dict(warps=4, mtiles=1), {"warps": 4, "mtiles": 2, ONLY_KEY: {"rank": (48, 64)}}]
    assert fam.config_axes("sm_90a", {}) == ([dict(warps=4, mtiles=1)], [])
    for section, words in (({"forms": [{"mtiles": [3]}]}, "forms[0].mtiles[0]: 3: not supported"),
                           ({"forms": [{"tiles": [1]}]}, "forms[0].tiles: unknown key"),
                           ({"forms": [{}], "warps": [2]}, "warps: not allowed beside forms"),
                           ({"forms": [{"ranks": 48}]}, "forms[0].ranks: 48: expected a non-empty list"),
                           ({"forms": []}, "forms: []: expected a non-empty list")):
        _, problems = fam.config_axes("sm_90a", section)
        assert any(words in p for p in problems), (section, problems)


def test_flux_config_builds_ranks_48_and_64_with_two_m_tiles_on_sm90a_only():
    import os
    from svdq_aot.config import load_config
    from svdq_aot.variants import enumerate_variants
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                   "flux.yaml"))
    two = [(v.arch, dict(v.knobs)) for v in enumerate_variants(cfg)[0] if v.op == "quantize_act"
           and dict(v.knobs).get("mtiles") == 2]
    assert sorted((a, kn["rank"], kn["dtype"]) for a, kn in two) == [
        ("sm_90a", 48, "bf16"), ("sm_90a", 48, "fp16"), ("sm_90a", 64, "bf16"), ("sm_90a", 64, "fp16")]

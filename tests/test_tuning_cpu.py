"""The tuning table on the CPU: planning, the winner rule, the file (checksum, manifest binding, tamper cases),
precedence over the rules on the same GPU model, the once-per-process notice on another, explain and select
output, verify, and a rebuild dropping a stale table.  Times are made up here (no GPU); tests/test_gpu_tune.py
measures real ones."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

torch = pytest.importorskip("torch")

import svdq_loader  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from svdq_aot.cli import main  # noqa: E402
from svdq_loader import select, tune, tuning_table  # noqa: E402
from svdq_loader.manifest import body_checksum  # noqa: E402
from svdq_loader.tuning_table import TABLE_NAME, GpuId, TuningTableError  # noqa: E402

from fake_cuda import fake_driver  # noqa: E402
from test_safety_cpu import BF, T, gemm_args  # noqa: E402

TWO = """
name: two
archs: [sm_90a]
out_dtypes: [bf16]
ranks: [0]
wcscale: [true]
bias: [true]
shapes:
  sq: {k: 256, n: 256}
variants:
  sm_90a:
    gemm_w4a4:
      tiles: [[128, 128, 64], [256, 128, 64]]
      stages: [auto]
    quantize_act:
      warps: [4, 8]
"""
H200 = dict(gpu="NVIDIA H200", sm_count=132, arch="sm_90a", cuda_driver=12080, driver="570.124.06",
            loader_version=svdq_loader.__version__, torch="2.9.0", date="2026-12-01T11:00:00Z")
SHAPES = [("sq", 256, 256)]
# the two sm_90a tiles: G64 the one the rules prefer for M <= 64, G128 the one they prefer above (the family's
# rule is replaced by one with its bucket edge at 64 for this build: `two_artifacts`)
G64 = ("svdq_gemm_w4a4_sm90a_outdtypebf16_rank0_wcscale1_bias1_tilem128_tilen128_tilek64_stages4_prefetch1_skippad1_"
       "actdecodeprmt_schedulecoop_wsets2_actsourcenvfp4_reqn128k128")
G128 = ("svdq_gemm_w4a4_sm90a_outdtypebf16_rank0_wcscale1_bias1_tilem256_tilen128_tilek64_stages4_prefetch1_skippad1_"
        "actdecodeprmt_schedulecoop_wsets2_actsourcenvfp4_reqn128k128")
EDGE64 = [{"m_max": 64, "priority": 0, "prefer": [{"knob": "tile_m", "order": "asc"}]},
          {"m_max": None, "priority": 0, "prefer": [{"knob": "tile_m", "order": "desc"}]}]
Q4 = "svdq_quantize_act_sm90a_dtypebf16_rank0_warps4_mtiles1_reqk64"
Q8 = "svdq_quantize_act_sm90a_dtypebf16_rank0_warps8_mtiles1_reqk64"
#: quantize_act's rule for these builds: one bucket, fewer warps first (the family's own rule has a second bucket
#: from M = 2048 for rank 48, which would split the tuning jobs of every rank in two)
ONE_BUCKET_Q = [{"m_max": None, "priority": 0, "prefer": [{"knob": "mtiles", "order": "asc"},
                                                          {"knob": "warps", "order": "asc"}]}]


def _build_two(cfg: str, out: str) -> None:
    """build() with the two test rules above in place of the families' own (read when the manifest is written)."""
    from svdq_aot.build import build
    from svdq_kernels import quantize_act as qfam
    from svdq_kernels import sm90_wgmma_w4a4 as fam
    saved = fam.SELECTION, qfam.SELECTION
    fam.SELECTION, qfam.SELECTION = EDGE64, ONE_BUCKET_Q
    try:
        build(cfg, out, jobs=1)
    finally:
        fam.SELECTION, qfam.SELECTION = saved


@pytest.fixture(scope="session")
def two_artifacts(tmp_path_factory):
    """A real build with two candidates per problem (two GEMM tiles, two quantize_act warp counts)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed: cannot build artifacts here")
    base = tmp_path_factory.mktemp("two_candidates")
    (base / "two.yaml").write_text(TWO)
    _build_two(str(base / "two.yaml"), str(base / "artifacts"))
    return base / "artifacts"


def _times(job, fast: str, slow_factor: float = 1.3) -> dict:
    """Made-up times: `fast` takes 10 µs per 1000 rows, every other candidate `slow_factor` times that."""
    return {n: [m / 100 * (1.0 if n == fast else slow_factor) + 1.0 for m in job.ms] for n in job.candidates}


def _table(art, winners: dict, measured=H200) -> tuning_table.TuningTable:
    """A table for `art` whose entries make winners[(op, m_min)] the fastest."""
    lib = svdq_loader.load(art, tuning=False)
    jobs, _ = tune.plan(lib.variants, lib.rules, "sm_90a", SHAPES, ms=[16, 64, 256, 4608])
    entries = [tune.entry_for(j, _times(j, winners[(j.op, j.m_min)])) for j in jobs]
    return tune.make_table(lib.manifest, entries, measured, {"min_gain": 0.02}, str(art / TABLE_NAME))


@pytest.fixture
def tuned(two_artifacts, tmp_path):
    """A copy of the two-candidate artifacts with a table that overrules the rules in every bucket."""
    art = tmp_path / "art"
    shutil.copytree(two_artifacts, art)
    t = _table(art, {("gemm_w4a4", 1): G128, ("gemm_w4a4", 65): G64, ("quantize_act", 1): Q8})
    (art / TABLE_NAME).write_text(t.to_json())
    return art


# ---------------------------------------------------------------- planning and the winner rule
def test_plan_covers_every_bucket_and_skips_single_candidates(two_artifacts, tiny_artifacts):
    lib = svdq_loader.load(two_artifacts)
    jobs, skipped = tune.plan(lib.variants, lib.rules, "sm_90a", SHAPES + [("again", 256, 256)], ms=[16, 64, 256, 4608])
    got = [(j.op, j.dims, j.m_min, j.m_max, j.ms, j.rule_choice) for j in jobs]
    assert got == [("gemm_w4a4", (("n", 256), ("k", 256)), 1, 64, (16, 64), G64),
                   ("gemm_w4a4", (("n", 256), ("k", 256)), 65, None, (256, 4608), G128),
                   ("quantize_act", (("k", 256),), 1, None, (16, 64, 256, 4608), Q4)] and skipped == []
    assert all(set(j.candidates) == ({G64, G128} if j.op == "gemm_w4a4" else {Q4, Q8}) for j in jobs)
    jobs, _ = tune.plan(lib.variants, lib.rules, "sm_90a", SHAPES, ranks=[32])
    assert jobs == []                                       # nothing built at rank 32
    jobs, _ = tune.plan(lib.variants, lib.rules, "sm_90a", SHAPES, ops=["quantize_act"], ms=[100])
    assert [(j.op, j.ms) for j in jobs] == [("quantize_act", (100,))]
    tiny = svdq_loader.load(tiny_artifacts)                 # one tile: every problem has one candidate
    jobs, skipped = tune.plan(tiny.variants, tiny.rules, "sm_90a", [("square", 256, 256)])
    assert jobs == [] and skipped and all(why == "one variant serves it: nothing to choose" for _, why in skipped)


def test_m_buckets_refine_the_rules_of_every_family():
    from svdq_loader.select_rules import Rule, parse_buckets
    rules = {("gemm_w4a4", "sm_90a", f): Rule("gemm_w4a4", "sm_90a", f, parse_buckets(b, "t")) for f, b in (
        ("a", [{"m_max": 64}, {"m_max": None}]),
        ("b", [{"m_max": 16}, {"m_max": 64}, {"m_max": 1024}, {"m_max": None}]))}
    assert tune.m_buckets(rules, "gemm_w4a4", "sm_90a", ["a", "b"]) == [(1, 16), (17, 64), (65, 1024), (1025, None)]
    assert tune.m_buckets(rules, "gemm_w4a4", "sm_90a", ["a"]) == [(1, 64), (65, None)]
    assert tune.m_buckets({}, "gemm_w4a4", "sm_90a", ["zzz"]) == [(1, None)]     # no rule: one bucket


def test_pick_winner_geometric_mean_and_margin():
    ms = [16, 4096]
    # b wins by 50 % at the large M and loses 10 % at the small one: geometric mean ratio 0.74 vs 1
    times = {"a": [10.0, 300.0], "b": [11.0, 200.0]}
    assert tune.pick_winner(ms, times, "a") == "b"
    # a 1 % gain is within the 2 % margin: the rules' choice stays; with no margin the faster one wins
    times = {"a": [10.0, 100.0], "b": [9.9, 99.0]}
    assert tune.pick_winner(ms, times, "a") == "a" and tune.pick_winner(ms, times, "a", 0.0) == "b"
    assert tune.pick_winner(ms, {"x": [5.0, 5.0], "y": [5.0, 5.0]}, "nope") == "x"    # ties: the name


# ---------------------------------------------------------------- the file
def test_table_round_trip_lookup_and_verify(tuned):
    lib = svdq_loader.load(tuned)
    t = lib.tuning
    assert t is not None and len(t.entries) == 3 and t.gpu == GpuId("NVIDIA H200", 132)
    doc = json.loads((tuned / TABLE_NAME).read_text())
    assert doc["schema"] == "svdq-aot-tuning/1" and doc["manifest_checksum"] == body_checksum(lib.manifest.body())
    assert doc["manifest_checksum"] == json.loads((tuned / "manifest.json").read_text())["checksum"]
    assert doc["checksum"] == body_checksum({k: v for k, v in doc.items() if k != "checksum"})
    e = doc["entries"][1]
    assert (e["m_min"], e["m_max"], e["ms"], e["winner"], e["rule_choice"]) == (65, None, [256, 4608], G64, G128)
    assert e["times_us"][G64] == pytest.approx([3.56, 47.08]) and e["times_us"][G128] == pytest.approx(
        [1.3 * 2.56 + 1, 1.3 * 46.08 + 1])
    for m, want in ((1, G128), (64, G128), (65, G64), (100000, G64)):
        assert t.lookup(select.problem_for("gemm_w4a4", "sm_90a", m=m, n=256, k=256)).winner == want
    assert t.lookup(select.problem_for("gemm_w4a4", "sm_90a", m=7, n=512, k=256)) is None       # shape not tuned
    assert t.lookup(select.problem_for("gemm_w4a4", "sm_90a", m=7, n=256, k=256, rank=32)) is None
    r = CliRunner().invoke(main, ["verify", str(tuned)])
    assert r.exit_code == 0 and f"tuning table: {tuned / TABLE_NAME}: 3 entries verified, measured on NVIDIA H200 " \
                                f"(132 SMs), driver 570.124.06, CUDA driver API 12.8" in r.output, r.output
    from svdq_loader.verify import open_artifacts
    assert TABLE_NAME in open_artifacts(tuned).files()                  # listed with what ships
    assert TABLE_NAME not in open_artifacts(tuned, tuning=False).files()


def _reseal(art, edit):
    """Apply edit(doc) to the table and recompute its checksum (a table that is well sealed but wrong)."""
    doc = json.loads((art / TABLE_NAME).read_text())
    edit(doc)
    doc["checksum"] = body_checksum({k: v for k, v in doc.items() if k != "checksum"})
    (art / TABLE_NAME).write_text(json.dumps(doc))


def _set(path, value):
    def edit(doc):
        d = doc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


TAMPER = {
    "edited time": (None, r"checksum mismatch: the content hashes to [0-9a-f]{64}; the table was edited"),
    "not json": ("text", r"not valid JSON at line 1"),
    "unknown variant": (_set(["entries", 0, "winner"], "svdq_gemm_w4a4_made_up"),
                        r"entries\[0\]\.winner: 'svdq_gemm_w4a4_made_up': must be one of the measured variants"),
    "unknown measured variant": (lambda d: d["entries"][0]["times_us"].update(svdq_nope=[1.0, 2.0]),
                                 r"entries\[0\]\.times_us: 'svdq_nope': names a variant the manifest does not hold"),
    "variant of another op": (lambda d: d["entries"][0]["times_us"].update({Q4: [1.0, 2.0]}),
                              r"is not a sm_90a gemm_w4a4 variant with the entry's features"),
    "other artifacts": (_set(["manifest_checksum"], "0" * 64),
                        r"the table was measured for other artifacts \(this manifest's checksum is"),
    "unknown schema": (_set(["schema"], "svdq-aot-tuning/9"), r"this loader reads tuning tables of schema"),
    "missing key": (lambda d: d.pop("measured_on"), r"missing key\(s\) \['measured_on'\]"),
    "negative time": (lambda d: d["entries"][0]["times_us"][G64].__setitem__(0, -1.0),
                      r"expected 2 positive times in µs"),
    "M outside the bucket": (_set(["entries", 0, "ms"], [16, 65]), r"expected distinct integers M inside"),
    "overlapping buckets": (_set(["entries", 1, "m_min"], 60), r"entries\[1\]: 'M >= 60': overlaps the M bucket"),
    "shape the variant cannot serve": (_set(["entries", 0, "dims", "n"], 200), r"N=200 is not a multiple of 128"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_a_bad_table_is_refused_naming_the_file(tuned, case):
    edit, pattern = TAMPER[case]
    path = tuned / TABLE_NAME
    if edit is None:                                  # one time edited by hand, the checksum left as it was
        doc = json.loads(path.read_text())
        doc["entries"][0]["times_us"][G64][0] *= 0.5
        path.write_text(json.dumps(doc))
    elif edit == "text":
        path.write_text("{oops")
    else:
        _reseal(tuned, edit)
    with pytest.raises(TuningTableError, match=pattern) as ei:
        svdq_loader.load(tuned)
    assert str(path) in str(ei.value) and "re-run `svdq-aot tune`, or delete the file" in str(ei.value)
    r = CliRunner().invoke(main, ["verify", str(tuned)])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and str(path) in r.output, r.output
    assert svdq_loader.load(tuned, tuning=False).tuning is None          # opting out still loads
    path.unlink()
    assert svdq_loader.load(tuned).tuning is None                        # no table: the rules, silently


# ---------------------------------------------------------------- precedence and the notice
def _gemm_call(lib, m):
    w = lib.prepare_weight(T((256, 128), torch.uint8), T((256, 16), torch.float8_e4m3fn),
                           wcscale=T((256,), torch.float32), bias=T((256,), torch.float32))
    a = gemm_args(m=m, rank=0)
    lib.gemm_w4a4(a["act"], w, a["ascales"], out=a["out"])


def _quant_call(lib, m):
    lib.quantize_act(T((m, 256), BF), out_act=T((m, 128), torch.uint8), out_scales=T((m, 16), torch.float8_e4m3fn))


def test_same_gpu_model_uses_the_tables_winner(tuned, monkeypatch, caplog):
    rec = fake_driver(monkeypatch, gpu="NVIDIA H200", sms=132)
    lib = svdq_loader.load(tuned)
    rules = svdq_loader.load(tuned, tuning=False)
    with caplog.at_level(logging.WARNING, logger="svdq_loader.tuning"):
        for m, want, by_rule in ((16, G128, G64), (4608, G64, G128)):
            _gemm_call(lib, m)
            assert rec.loads[-1] == (f"{want}_0",)
            assert lib._choice[("gemm_w4a4", 0, ("bf16", 0, True, True, "logical"),
                                (("m", m), ("n", 256), ("k", 256)))].name == want
            _gemm_call(rules, m)
            assert rec.loads[-1] == (f"{by_rule}_0",)                # the rules alone pick the other tile
        _quant_call(lib, 77)
        assert rec.loads[-1] == (f"{Q8}_0",)
        _gemm_call(lib, 7)                                           # any M of the bucket, not only those timed
        assert lib._choice[("gemm_w4a4", 0, ("bf16", 0, True, True, "logical"),
                            (("m", 7), ("n", 256), ("k", 256)))].name == G128
    assert caplog.records == []
    assert lib.explain("gemm_w4a4", gpu=lib.device_gpu(0), m=7, n=256, k=256).source == "tuning_table"


def test_another_gpu_model_falls_back_to_the_rules_with_one_notice(tuned, monkeypatch, caplog):
    tuning_table._noticed.clear()
    rec = fake_driver(monkeypatch, gpu="NVIDIA H100 80GB HBM3", sms=132)
    lib = svdq_loader.load(tuned)
    with caplog.at_level(logging.WARNING, logger="svdq_loader.tuning"):
        _gemm_call(lib, 16)
        assert rec.loads[-1] == (f"{G64}_0",)
        _gemm_call(lib, 4608)
        assert rec.loads[-1] == (f"{G128}_0",)
        _quant_call(lib, 77)
        assert rec.loads[-1] == (f"{Q4}_0",)
        svdq_loader.load(tuned)._resolve("gemm_w4a4", 0, ("bf16", 0, True, True, "logical"),
                                         (("m", 9), ("n", 256), ("k", 256)), False)
    notes = [r for r in caplog.records if r.name == "svdq_loader.tuning"]
    assert len(notes) == 1, [r.getMessage() for r in notes]                 # once per process
    msg = notes[0].getMessage()
    assert str(tuned / TABLE_NAME) in msg and "measured on NVIDIA H200 (132 SMs)" in msg
    assert "this device is NVIDIA H100 80GB HBM3 (132 SMs): its entries are ignored" in msg


def test_same_name_other_sm_count_is_another_model(tuned, monkeypatch):
    tuning_table._noticed.clear()
    rec = fake_driver(monkeypatch, gpu="NVIDIA H200", sms=114)
    _gemm_call(svdq_loader.load(tuned), 16)
    assert rec.loads[-1] == (f"{G64}_0",)


def test_pinned_runs_the_named_variant_then_selection_decides_again(two_artifacts, monkeypatch):
    from svdq_loader import library
    rec = fake_driver(monkeypatch)
    monkeypatch.setattr(library, "_ordinal", lambda device: 0)
    lib = svdq_loader.load(two_artifacts)
    p = select.problem_for("quantize_act", "sm_90a", m=77, k=256)
    with lib.pinned(Q8, p):
        _quant_call(lib, 77)
        assert rec.launches[-1] == 0x5000 and rec.loads[-1] == (f"{Q8}_0",)
    _quant_call(lib, 77)
    assert rec.loads[-1] == (f"{Q4}_0",)                         # the rules again
    with pytest.raises(select.UnsupportedProblem, match=r"does not serve quantize_act"):
        with lib.pinned(G64, p):
            pass
    with pytest.raises(RuntimeError, match=r"selected for other problems .*did not run the pinned variant"):
        with lib.pinned(Q8, p):
            _quant_call(lib, 78)                                 # another M: not the pinned problem


# ---------------------------------------------------------------- explain and select
def test_explain_says_where_the_choice_came_from(tuned):
    lib = svdq_loader.load(tuned)
    ex = lib.explain("gemm_w4a4", m=4608, n=256, k=256)
    assert ex.chosen.name == G64 and ex.source == "tuning_table"
    text = ex.text()
    assert text.splitlines()[1] == \
        f"chosen: {G64} (from the tuning table {tuned / TABLE_NAME}, measured on NVIDIA H200)"
    assert "measured on NVIDIA H200 (132 SMs), driver 570.124.06, CUDA driver API 12.8, svdq_loader " in text
    assert "(assumed: the device this runs on is that model): fastest for M >= 65 " \
           "(3.6 µs at M=256, 47.1 µs at M=4608)" in text
    assert f"the rules would pick {G128}" in text
    # geometric mean of 4.328/3.56 and 60.90/47.08
    assert dict(ex.rejected)[G128].startswith("25.4% slower in the tuning table (4.3 µs at M=256, 60.9 µs at M=4608)")
    d = ex.to_dict()
    assert d["source"] == "tuning_table" and d["tuning"]["measured_on"]["gpu"] == "NVIDIA H200"
    assert d["tuning"]["winner"] == G64 and d["tuning"]["rule_choice"] == G128 and d["tuning"]["applies"] is True
    other = lib.explain("gemm_w4a4", gpu="NVIDIA A100-SXM4-80GB", m=4608, n=256, k=256)
    assert other.chosen.name == G128 and other.source == "rules" and other.to_dict()["tuning"]["applies"] is False
    assert "this device is NVIDIA A100-SXM4-80GB, so it is ignored and the rules decide" in other.why[0]
    kept = lib.explain("gemm_w4a4", gpu=GpuId("NVIDIA H200", 132), m=4608, n=256, k=256)
    assert kept.chosen.name == G64 and "(assumed" not in kept.text()
    plain = lib.explain("gemm_w4a4", m=4608, n=512, k=256)   # untuned shape: the rules, no mention of a table
    assert plain.source == "rules" and plain.tuning is None and "tuning" not in plain.text()


def test_a_call_without_the_affine_uses_the_entry_of_the_variants_that_serve_it(tuned):
    """The build has wcscale and bias on only, and the table's entries are keyed by those features: a call
    without them is served by those variants (identity vectors), so it takes the same entry."""
    lib = svdq_loader.load(tuned)
    for m, want in ((4608, G64), (16, G128)):
        ex = lib.explain("gemm_w4a4", m=m, n=256, k=256, wcscale=False, bias=False)
        assert ex.source == "tuning_table" and ex.chosen.name == want, ex.text()
        assert ex.problem.features == ("bf16", 0, False, False, "logical")
        assert ex.served_features == ("bf16", 0, True, True, "logical")
        assert any("passing wcscale = 1.0, bias = 0.0 for every column" in w for w in ex.why), ex.why
        assert ex.tuning["winner"] == want


def test_a_margin_kept_rule_choice_says_so(two_artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(two_artifacts, art)
    lib = svdq_loader.load(art, tuning=False)
    jobs, _ = tune.plan(lib.variants, lib.rules, "sm_90a", SHAPES, ops=["quantize_act"], ms=[4608])
    e = tune.entry_for(jobs[0], _times(jobs[0], Q8, slow_factor=1.01))       # Q8 1 % faster: under the margin
    assert e.winner == Q4 == e.rule_choice
    t = tune.make_table(lib.manifest, [e], H200, {"min_gain": 0.02}, "x")
    (art / TABLE_NAME).write_text(t.to_json())
    ex = svdq_loader.load(art).explain("quantize_act", m=4608, k=256)
    assert ex.chosen.name == Q4 and ex.source == "tuning_table"
    assert "the rules' choice, not beaten by more than 2% by any other" in ex.text()
    assert dict(ex.rejected)[Q8].startswith("1.0% faster in the tuning table") and "within its 2% margin" in \
        dict(ex.rejected)[Q8]


def test_select_cli_reports_the_table(tuned):
    args = ["select", str(tuned), "--op", "quantize_act", "--m", "77", "--k", "256"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and f"chosen: {Q8} (from the tuning table" in r.output, r.output
    j = json.loads(CliRunner().invoke(main, args + ["--json"]).output)
    assert j["chosen"] == Q8 and j["source"] == "tuning_table" and j["tuning"]["gpu"] == "NVIDIA H200 (132 SMs)"
    r = CliRunner().invoke(main, args + ["--gpu", "NVIDIA L40S"])
    assert r.exit_code == 0 and f"chosen: {Q4}\n" in r.output
    assert "this device is NVIDIA L40S, so it is ignored" in r.output
    r = CliRunner().invoke(main, args + ["--no-tuning", "--json"])
    assert json.loads(r.output)["source"] == "rules" and json.loads(r.output)["tuning"] is None


def test_tune_cli_needs_a_gpu(tuned):
    r = CliRunner().invoke(main, ["tune", str(tuned)])
    assert r.exit_code == 2 and "svdq-aot tune measures on a GPU: torch sees no CUDA device" in r.output, r.output
    r = CliRunner().invoke(main, ["tune", str(tuned), "--m", "1,x"])
    assert r.exit_code == 2 and "expected comma-separated int values" in r.output


class _Recording:
    """Stands in for a Library in `tune._inputs`: records what the measured calls would receive."""

    def __init__(self):
        self.calls = []

    def prepare_weight(self, wgt, wscales, **kw):
        return dict(wgt=wgt, wscales=wscales, **kw)

    def gemm_w4a4(self, act, w, ascales, **kw):
        self.calls.append(dict(act=act, ascales=ascales, **w, **kw))

    def quantize_act(self, x, **kw):
        self.calls.append(dict(x=x, **kw))


def _shapes(call):
    return {k: (tuple(v.shape), v.dtype) if v is not None else None for k, v in call.items()}


def test_tune_inputs_have_the_ops_shapes_dtypes_and_rotate_past_twice_the_l2():
    lib = _Recording()
    feats = dict(out_dtype="bf16", rank=32, wcscale=True, bias=False, scale_layout="logical")
    n_sets, call = tune._inputs(lib, "gemm_w4a4", feats, dict(m=64, n=256, k=512), l2=1 << 20, seed=1, dev="cpu")
    per_set = 64 * 256 + 64 * 32 + 256 * 256 + 256 * 32 + 2 * 32 * (64 + 256) + 8 * 256 + 2 * 64 * 256
    assert n_sets == 2 * (1 << 20) // per_set + 1 and n_sets * per_set > 2 << 20
    for i in range(n_sets):
        call(i)
    u8, f8, bf = torch.uint8, torch.float8_e4m3fn, torch.bfloat16
    assert _shapes(lib.calls[0]) == {"act": ((64, 256), u8), "ascales": ((64, 32), f8), "wgt": ((256, 256), u8),
                                     "wscales": ((256, 32), f8), "lora_up": ((256, 32), bf),
                                     "wcscale": ((256,), torch.float32), "bias": None,
                                     "lora_act_in": ((64, 32), bf), "out": ((64, 256), bf)}
    assert len({c["act"].data_ptr() for c in lib.calls}) == n_sets            # distinct copies, rotated
    assert lib.calls[0]["ascales"].float().min() >= 0.25 and lib.calls[0]["act"].float().std() > 50
    q = _Recording()
    feats = dict(dtype="fp16", rank=0, scale_layout="blocked")
    n_sets, call = tune._inputs(q, "quantize_act", feats, dict(m=200, k=256), l2=1 << 16, seed=2, dev="cpu")
    call(n_sets - 1)
    assert _shapes(q.calls[0]) == {"x": ((200, 256), torch.float16), "smooth": ((256,), torch.float16),
                                   "lora_down": None, "out_act": ((200, 128), u8),
                                   "out_scales": ((2, 4, 32, 4, 4), f8), "out_lora": None}
    # a small problem needs more copies than the bench's 64 for one pass to move twice the L2
    from svdq_loader.testing.bench import quant_bytes
    n_small, _ = tune._inputs(_Recording(), "quantize_act", feats, dict(m=16, k=64), l2=1 << 20, seed=3, dev="cpu")
    assert n_small > 64 and n_small * quant_bytes(16, 64, 0) > 2 << 20 >= (n_small - 1) * quant_bytes(16, 64, 0)


def test_tune_cli_writes_the_table_it_measured(two_artifacts, tmp_path, monkeypatch):
    """The CLI around the measurement (no GPU here: the timer and the GPU record are stubbed)."""
    art = tmp_path / "art"
    shutil.copytree(two_artifacts, art)
    fake_driver(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tune, "measured_on", lambda lib, ordinal: dict(H200))
    fast = {G128, Q8}
    monkeypatch.setattr(tune, "measure", lambda lib, p, names, st, ordinal, seed: {
        n: (1.0 if n in fast else 1.5) * p.dim["m"] for n in names})
    r = CliRunner().invoke(main, ["tune", str(art), "--m", "16,4608", "--quick"])
    assert r.exit_code == 0, r.output
    assert f"wrote {art / TABLE_NAME}: 3 entries on NVIDIA H200 (132 SMs)" in r.output
    assert "2 differ from the rules' choice" in r.output
    lib = svdq_loader.load(art)
    got = {(e.op, e.m_min): (e.winner, e.ms) for e in lib.tuning.entries}
    assert got == {("gemm_w4a4", 1): (G128, (16,)), ("gemm_w4a4", 65): (G128, (4608,)),
                   ("quantize_act", 1): (Q8, (16, 4608))}
    assert lib.tuning.method["samples"] == 5 and lib.tuning.method["min_gain"] == 0.02
    out = tmp_path / "elsewhere.json"
    r = CliRunner().invoke(main, ["tune", str(art), "--op", "quantize_act", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["entries"][0]["winner"] == Q8
    assert len(json.loads((art / TABLE_NAME).read_text())["entries"]) == 3        # the folder's table untouched


@pytest.mark.parametrize("text, want", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 05:55:41 UTC 2025\n", "570.124.06"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n",
     "580.65.06"),
    ("something else\n", None),
])
def test_kernel_driver_version_from_proc(tmp_path, text, want):
    (tmp_path / "version").write_text(text)
    assert tune.kernel_driver_version(str(tmp_path / "version")) == want
    assert tune.kernel_driver_version(str(tmp_path / "absent")) is None


def test_device_name_strips_the_nul_padding(monkeypatch):
    from svdq_loader import driver
    monkeypatch.setattr(driver, "_device", lambda ordinal: ordinal)
    monkeypatch.setattr(driver.cu, "cuDeviceGetName", lambda n, dev: (
        driver.cu.CUresult.CUDA_SUCCESS, b"NVIDIA H200" + b"\0" * (n - 11)))
    assert driver.device_name(0) == "NVIDIA H200"


# ---------------------------------------------------------------- a rebuild drops a stale table
def test_rebuild_drops_a_table_measured_for_other_kernels(two_artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(two_artifacts, art)
    cfg = tmp_path / "two.yaml"
    cfg.write_text(TWO)
    t = _table(art, {("gemm_w4a4", 1): G128, ("gemm_w4a4", 65): G64, ("quantize_act", 1): Q8})
    (art / TABLE_NAME).write_text(t.to_json())
    _build_two(str(cfg), str(art))                     # the same kernels: the manifest and the table stay valid
    assert svdq_loader.load(art).tuning is not None
    cfg.write_text(TWO.replace("warps: [4, 8]", "warps: [4]"))
    _build_two(str(cfg), str(art))                     # other kernels: the table is removed with the old files
    assert not (art / TABLE_NAME).exists() and svdq_loader.load(art).tuning is None

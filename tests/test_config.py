"""Config loading: every rule rejects with a message naming file, key path, value and rule."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fakes import install_fake
from svdq_aot.config import ConfigError, load_config
from svdq_aot.variants import check_sections

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "name": "t",
    "archs": ["sm_90a"],
    "out_dtypes": ["bf16"],
    "ranks": [0, 32],
    "wcscale": [True, False],
    "bias": [True],
    "shapes": {"qkv": {"k": 3072, "n": 9216}, "out": {"k": 3072, "n": 3072}},
    "variants": {"sm_90a": {"gemm_w4a4": {"tiles": [[128, 128, 64]], "stages": ["auto"]}, "quantize_act": {}}},
}


@pytest.fixture(autouse=True)
def _fake(monkeypatch):
    install_fake(monkeypatch)


def write(tmp_path: Path, data=None, text: str | None = None, name="cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text if text is not None else yaml.safe_dump(data, sort_keys=False))
    return p


def mutate(fn) -> dict:
    d = copy.deepcopy(BASE)
    fn(d)
    return d


def err(tmp_path, data=None, text=None) -> str:
    p = write(tmp_path, data, text)
    with pytest.raises(ConfigError) as ei:
        check_sections(load_config(p))
    msg = str(ei.value)
    assert str(p) in msg, msg            # names the file
    assert "\n" not in msg, msg          # one line
    return msg


def test_base_loads(tmp_path):
    p = write(tmp_path, BASE)
    c = load_config(p)
    assert c.name == "t" and c.archs == ("sm_90a",) and c.ranks == (0, 32)
    assert c.wcscale == (True, False) and c.bias == (True,)
    assert [(s.name, s.k, s.n) for s in c.shapes] == [("qkv", 3072, 9216), ("out", 3072, 3072)]
    assert [op for op, _ in c.sections("sm_90a")] == ["gemm_w4a4", "quantize_act"]
    assert dict(c.sections("sm_90a"))["gemm_w4a4"] == {"tiles": [[128, 128, 64]], "stages": ["auto"]}
    check_sections(c)
    assert len(c.sha256) == 64 and c.file_name == "cfg.yaml"
    with pytest.raises(Exception):
        c.name = "x"  # frozen


def _with_fp8_families(monkeypatch):
    """The fake registry plus the FP8-compute mode's two operators on sm_90a (the config reads only which (op, arch)
    pairs have a family)."""
    from svdq_aot import config as C
    have = C._registered() + (("gemm_w4a4_fp8", "sm_90a"), ("act_fp8", "sm_90a"))
    monkeypatch.setattr(C, "_registered", lambda: have)


def test_repo_configs_load(monkeypatch):
    _with_fp8_families(monkeypatch)
    flux = load_config(ROOT / "configs" / "flux.yaml")
    assert flux.name == "flux"
    assert flux.ranks == (0, 16, 32, 48, 64, 96, 128)        # 96 = FLUX's 32 + a user LoRA of 64
    assert set(flux.out_dtypes) == {"bf16", "fp16"}
    assert {(s.name, s.k, s.n) for s in flux.shapes} == {
        ("qkv", 3072, 9216), ("attn_out", 3072, 3072), ("mlp_fc1", 3072, 12288),
        ("mlp_fc2", 12288, 3072), ("single_fused", 3072, 21504), ("single_out", 15360, 3072)}
    assert flux.wcscale == flux.bias == (True,)     # run-time inputs: a call without them passes ones / zeros
    assert flux.archs == ("sm_90a", "sm_100a", "sm_103a", "sm_120a", "sm_121a")
    # compute: [exact, fp8] adds the FP8-compute GEMM's default forms and its pre-pass where a family builds them
    assert flux.compute == ("exact", "fp8")
    assert [op for op, _ in flux.sections("sm_90a")] == ["gemm_w4a4", "quantize_act", "decode_act", "gemm_w4a4_fp8",
                                                         "act_fp8"]
    assert dict(flux.sections("sm_90a"))["gemm_w4a4_fp8"] == {} == dict(flux.sections("sm_90a"))["act_fp8"]
    assert [op for op, _ in flux.sections("sm_100a")] == ["gemm_w4a4", "quantize_act"]
    assert [op for op, _ in flux.sections("sm_103a")] == ["gemm_w4a4", "quantize_act"]
    for arch in ("sm_120a", "sm_121a"):
        assert [op for op, _ in flux.sections(arch)] == ["gemm_w4a4", "quantize_act"]
    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    assert len(tiny.out_dtypes) == 1 and tiny.ranks == (0, 32) and tiny.compute == ("exact",)


def test_compute_fp8_adds_the_mode_where_a_family_builds_it(tmp_path, monkeypatch):
    """`compute: [exact, fp8]`: sm_90a (which lists gemm_w4a4 and has the FP8 family) gains `gemm_w4a4_fp8: {}` and
    its pre-pass `act_fp8: {}`; sm_100a, without that family, is left as written; a section of its own is kept.
    Without `compute` the sections decide, and the config says which modes they build."""
    _with_fp8_families(monkeypatch)
    two = lambda d: (d.update(archs=["sm_90a", "sm_100a"]),  # noqa: E731
                     d["variants"].update(sm_100a={"gemm_w4a4": {}, "quantize_act": {}}))
    c = load_config(write(tmp_path, mutate(lambda d: (two(d), d.update(compute=["fp8", "exact"])))))
    assert c.compute == ("exact", "fp8")                       # the modes in their own order
    assert c.sections("sm_90a") == (("gemm_w4a4", {"tiles": [[128, 128, 64]], "stages": ["auto"]}),
                                    ("quantize_act", {}), ("gemm_w4a4_fp8", {}), ("act_fp8", {}))
    assert [op for op, _ in c.sections("sm_100a")] == ["gemm_w4a4", "quantize_act"]
    own = {"tiles": [[208, 128, 128]], "wsets": [4]}
    c = load_config(write(tmp_path, mutate(lambda d: (d.update(compute=["exact", "fp8"]),
                                                      d["variants"]["sm_90a"].update(gemm_w4a4_fp8=own)))))
    assert dict(c.sections("sm_90a"))["gemm_w4a4_fp8"] == own and "act_fp8" in dict(c.sections("sm_90a"))
    assert load_config(write(tmp_path, BASE)).compute == ("exact",)
    c = load_config(write(tmp_path, mutate(lambda d: d["variants"]["sm_90a"].update(gemm_w4a4_fp8={}, act_fp8={}))))
    assert c.compute == ("exact", "fp8") and [op for op, _ in c.sections("sm_90a")][-2:] == ["gemm_w4a4_fp8",
                                                                                          "act_fp8"]


@pytest.mark.parametrize("fn, path, value, rule", [
    (lambda d: d.update(compute=["fp8"]), "compute", "['fp8']", "must list exact"),
    (lambda d: d.update(compute=["exact", "int8"]), "compute[1]", "'int8'", "unknown compute mode; expected one of "
                                                                            "exact, fp8"),
    (lambda d: d.update(compute=["exact", "exact"]), "compute[1]", "'exact'", "duplicate"),
    (lambda d: d.update(compute="fp8"), "compute", "'fp8'", "expected a list"),
    (lambda d: d.update(compute=[]), "compute", "[]", "empty list"),
    (lambda d: (d.update(compute=["exact"]), d["variants"]["sm_90a"].update(gemm_w4a4_fp8={})),
     "variants.sm_90a.gemm_w4a4_fp8", None, "compute ['exact'] leaves out mode 'fp8'"),
    (lambda d: (d.update(archs=["sm_100a"], compute=["exact", "fp8"]),
                d.update(variants={"sm_100a": {"gemm_w4a4": {}, "quantize_act": {}}})),
     "compute", "['exact', 'fp8']", "no arch of this config lists gemm_w4a4 and has a family for gemm_w4a4_fp8 "
                                    "(archs with one: sm_90a)"),
])
def test_compute_rules(tmp_path, monkeypatch, fn, path, value, rule):
    _with_fp8_families(monkeypatch)
    msg = err(tmp_path, mutate(fn))
    assert f": {path}:" in msg, msg
    if value is not None:
        assert value in msg, msg
    assert rule in msg, msg


@pytest.mark.parametrize("fn, path, value, rule", [
    # unknown / missing keys
    (lambda d: d.update(colour="red"), "colour", "'red'", "unknown key"),
    (lambda d: d.pop("ranks"), "ranks", None, "missing key"),
    (lambda d: d["variants"]["sm_90a"]["gemm_w4a4"].update(warps=4), "variants.sm_90a.gemm_w4a4.warps", None, "unknown key"),
    (lambda d: d["variants"]["sm_90a"].update(gemm_w8a8={}), "variants.sm_90a.gemm_w8a8", "{}",
     "no kernel family builds operator 'gemm_w8a8' on sm_90a"),
    (lambda d: d["variants"].update(sm_90a={}), "variants.sm_90a", "{}", "non-empty mapping of operator"),
    (lambda d: d["variants"]["sm_90a"].update(quantize_act=[1]), "variants.sm_90a.quantize_act", "[1]",
     "expected a mapping"),
    (lambda d: d["shapes"]["qkv"].update(m=5), "shapes.qkv.m", "5", "unknown key"),
    (lambda d: d["shapes"]["qkv"].pop("n"), "shapes.qkv.n", None, "missing key"),
    (lambda d: d["variants"].pop("sm_90a"), "variants.sm_90a", None, "missing key"),
    # wrong types (bools are not ints)
    (lambda d: d.update(ranks=[True]), "ranks[0]", "True", "expected an integer"),
    (lambda d: d.update(ranks="32"), "ranks", "'32'", "expected a list"),
    (lambda d: d.update(wcscale=[1]), "wcscale[0]", "1", "expected true or false"),
    (lambda d: d["shapes"]["qkv"].update(k=3072.0), "shapes.qkv.k", "3072.0", "positive integer"),
    (lambda d: d["shapes"]["qkv"].update(k=True), "shapes.qkv.k", "True", "positive integer"),
    (lambda d: d.update(name=5), "name", "5", "expected a name"),
    (lambda d: d.update(shapes=[1]), "shapes", "[1]", "mapping"),
    # archs
    (lambda d: d.update(archs=["sm_80"]), "archs[0]", "'sm_80'", "unknown arch"),
    (lambda d: d["variants"].update(sm_100a={"quantize_act": {}}), "variants.sm_100a", None,
     "not listed in archs"),
    # ranks
    (lambda d: d.update(ranks=[0, 24]), "ranks[1]", "24", "multiple of 16"),
    (lambda d: d.update(ranks=[-16]), "ranks[0]", "-16", "negative"),
    # dtypes
    (lambda d: d.update(out_dtypes=["fp32"]), "out_dtypes[0]", "'fp32'", "unknown dtype"),
    # duplicates
    (lambda d: d.update(ranks=[32, 32]), "ranks[1]", "32", "duplicate"),
    (lambda d: d.update(out_dtypes=["bf16", "bf16"]), "out_dtypes[1]", "'bf16'", "duplicate"),
    (lambda d: d.update(wcscale=[True, True]), "wcscale[1]", "True", "duplicate"),
    (lambda d: d.update(archs=["sm_90a", "sm_90a"]), "archs[1]", "'sm_90a'", "duplicate"),
    # empty lists
    (lambda d: d.update(ranks=[]), "ranks", "[]", "empty list"),
    (lambda d: d.update(bias=[]), "bias", "[]", "empty list"),
    (lambda d: d.update(shapes={}), "shapes", "{}", "empty"),
    # shapes
    (lambda d: d["shapes"]["qkv"].update(k=0), "shapes.qkv.k", "0", "must be positive"),
    (lambda d: d["shapes"]["qkv"].update(n=-128), "shapes.qkv.n", "-128", "must be positive"),
])
def test_rules(tmp_path, fn, path, value, rule):
    msg = err(tmp_path, mutate(fn))
    assert f": {path}:" in msg, msg
    if value is not None:
        assert value in msg, msg
    assert rule in msg, msg


def test_section_for_an_op_without_a_family_on_the_arch(tmp_path, monkeypatch):
    from svdq_aot import config as C
    have = tuple(k for k in C._registered() if k != ("gemm_w4a4", "sm_100a"))
    monkeypatch.setattr(C, "_registered", lambda: have)
    msg = err(tmp_path, mutate(lambda d: (d.update(archs=["sm_90a", "sm_100a"]),
                                          d["variants"].update(sm_100a={"gemm_w4a4": {}}))))
    assert ": variants.sm_100a.gemm_w4a4: {}: no kernel family builds operator 'gemm_w4a4' on sm_100a" in msg, msg


def test_config_alone_does_not_judge_coverage(tmp_path):
    # divisibility is the op spec's rule applied at build time (test_build covers the message)
    d = mutate(lambda d: d["shapes"]["qkv"].update(n=9200))
    assert load_config(write(tmp_path, d)).shapes[0].n == 9200


def test_many_problems_are_summarised(tmp_path):
    msg = err(tmp_path, mutate(lambda d: d.update(ranks=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])))
    assert "10 problems" in msg and "and 2 more" in msg and len(msg) < 1200


def test_all_problems_reported_together(tmp_path):
    msg = err(tmp_path, mutate(lambda d: d.update(ranks=[24], out_dtypes=["fp8"])))
    assert "2 problems" in msg and "ranks[0]" in msg and "out_dtypes[0]" in msg


def test_malformed_yaml_names_line(tmp_path):
    msg = err(tmp_path, text="name: t\narchs: [sm_90a\nout_dtypes: [bf16]\n")
    assert "malformed YAML" in msg and "line" in msg


def test_tab_indentation_is_malformed(tmp_path):
    msg = err(tmp_path, text="name: t\nshapes:\n\tqkv: {k: 1, n: 1}\n")
    assert "malformed YAML at line 3" in msg


def test_duplicate_yaml_key(tmp_path):
    text = yaml.safe_dump(BASE, sort_keys=False) + "ranks: [16]\n"
    msg = err(tmp_path, text=text)
    assert "ranks" in msg and "duplicate key" in msg and "line" in msg


@pytest.mark.parametrize("text, what", [("- a\n- b\n", "list"), ("42\n", "int"), ("", "empty")])
def test_top_level_not_mapping(tmp_path, text, what):
    msg = err(tmp_path, text=text)
    assert "(top level)" in msg and what in msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_no_python_objects(tmp_path):
    # safe_load only: python tags are a YAML error, never executed
    msg = err(tmp_path, text="name: !!python/object/apply:os.system ['true']\n")
    assert "malformed YAML" in msg


def test_yaml_on_off_are_bools(tmp_path):
    text = yaml.safe_dump(BASE, sort_keys=False).replace("wcscale:\n- true\n- false", "wcscale: [on, off]")
    assert load_config(write(tmp_path, text=text)).wcscale == (True, False)

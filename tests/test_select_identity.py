"""wcscale and bias as run-time inputs: a call without one may run a variant built with it (CPU only).

The op spec gives both an identity value (1.0, 0.0).  Selection tries the call's own features first, then
the keys that turn on inputs the call lacks; the call passes identity vectors for those
(`PreparedWeight.fills`, tested in test_loader_cpu.py and test_safety_cpu.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from svdq_loader import select
from svdq_loader.errors import UnsupportedProblem
from svdq_loader.ops import GEMM_W4A4, QUANTIZE_ACT


def _v(name, wcscale, bias, k_multiple=64):
    knobs = dict(out_dtype="bf16", rank=32, wcscale=wcscale, bias=bias, scale_layout="logical", tile_m=128)
    return SimpleNamespace(name=name, op="gemm_w4a4", arch="sm_90a", knobs=knobs, family="fam",
                           requirements=dict(n_multiple=128, k_multiple=k_multiple))


def _p(wcscale, bias, k=128):
    return select.Problem("gemm_w4a4", "sm_90a", ("bf16", 32, wcscale, bias, "logical"),
                          (("m", 77), ("n", 256), ("k", k)))


def test_serving_keys_put_the_calls_own_features_first_then_the_fewest_fills():
    f = ("bf16", 32, False, False, "logical")
    assert GEMM_W4A4.serving_keys(f) == [f, ("bf16", 32, True, False, "logical"), ("bf16", 32, False, True, "logical"),
                                         ("bf16", 32, True, True, "logical")]
    on = ("fp16", 0, True, True, "logical")
    assert GEMM_W4A4.serving_keys(on) == [on]                 # an input the call has is never dropped
    assert GEMM_W4A4.serving_keys(("bf16", 32, True, False, "logical"))[1] == ("bf16", 32, True, True, "logical")
    assert GEMM_W4A4.filled_text(f, ("bf16", 32, True, True, "logical")) == "wcscale = 1.0, bias = 0.0"
    # no other feature has an identity: a rank or a dtype is never stood in for
    assert [x.name for x in GEMM_W4A4.features if x.identity is not None] == ["wcscale", "bias"]
    assert all(x.identity is None for x in QUANTIZE_ACT.features)
    q = ("bf16", 32, "logical")
    assert QUANTIZE_ACT.serving_keys(q) == [q]


def test_a_variant_built_for_the_calls_own_features_wins_when_it_fits():
    both, none = _v("both", True, True), _v("none", False, False, k_multiple=128)
    ex = select.explain([both, none], {}, _p(False, False, k=256))
    assert ex.chosen is none and ex.served_features == _p(False, False).features
    assert dict(ex.rejected)["both"] == ("serves the call with wcscale = 1.0, bias = 0.0, but the variants built for "
                                         "its own features come first")
    assert not any("for every column" in w for w in ex.why)


def test_the_filled_variant_serves_when_none_built_for_the_calls_features_fits():
    both, none = _v("both", True, True), _v("none", False, False, k_multiple=128)
    ex = select.explain([both, none], {}, _p(False, False, k=64))     # K = 64 breaks `none`'s rule
    assert ex.chosen is both and ex.served_features == ("bf16", 32, True, True, "logical")
    assert dict(ex.rejected)["none"] == "K=64 is not a multiple of 128"
    assert any("passing wcscale = 1.0, bias = 0.0 for every column" in w for w in ex.why), ex.why
    # a call lacking only the bias prefers the variant that fills the bias alone
    wcs_only = _v("wcs_only", True, False)
    ex = select.explain([both, wcs_only], {}, _p(True, False))
    assert ex.chosen is wcs_only
    ex = select.explain([both], {}, _p(True, False))
    assert ex.chosen is both and ex.served_features == ("bf16", 32, True, True, "logical")
    assert any("passing bias = 0.0 for every column" in w for w in ex.why), ex.why


def test_an_input_the_call_has_is_never_served_by_a_variant_without_it():
    none = _v("none", False, False)
    with pytest.raises(UnsupportedProblem, match=r"no sm_90a gemm_w4a4 kernel for out_dtype=bf16, rank=32, "
                                                  r"wcscale=True, bias=False, scale_layout=logical; built: "
                                                  r"out_dtype=bf16, rank=32, wcscale=False, bias=False"):
        select.choose([none], _p(True, False))
    ex = select.explain([none], {}, _p(True, False))
    assert dict(ex.rejected)["none"] == "built for wcscale=False (the call needs True)"

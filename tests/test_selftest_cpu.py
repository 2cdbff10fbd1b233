"""`svdq-aot selftest` on a machine without a GPU: clean skip, case plans, table and report (GPU stubbed)."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from svdq_loader.testing import selftest as S  # noqa: E402
from svdq_loader.testing.gpu_checks import CaseResult  # noqa: E402


def test_skips_cleanly_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert S.main(["nonexistent-dir"]) == 0
    assert capsys.readouterr().out.strip() == "selftest skipped: torch sees no CUDA GPU on this machine"
    assert S.main(["--json", "--require-gpu"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep == {"status": "skipped", "reason": "torch sees no CUDA GPU on this machine", "cases": []}


def test_cli_forwards_to_selftest():
    from click.testing import CliRunner

    from svdq_aot.cli import main
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = CliRunner().invoke(main, ["selftest", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "skipped"


@pytest.mark.parametrize("knobs, req", [
    (dict(out_dtype="bf16", rank=128, wcscale=True, bias=False, tile_m=256), dict(n_multiple=128, k_multiple=256)),
    (dict(out_dtype="fp16", rank=0, wcscale=False, bias=True, tile_m=128), dict(n_multiple=128, k_multiple=64)),
])
def test_gemm_cases_cover_tails_and_small_k(knobs, req):
    cases = S.gemm_cases(knobs, req)
    ms = [c.kwargs["m"] for c in cases]
    assert 1 in ms and any(m % knobs["tile_m"] for m in ms if m > knobs["tile_m"])      # M = 1 and an M tail
    for c in cases[:3]:
        kw = c.kwargs
        assert kw["n"] % req["n_multiple"] == 0 and kw["k"] % req["k_multiple"] == 0
        assert (kw["r"], kw["dt"], kw["wc"], kw["b"]) == (knobs["rank"], knobs["out_dtype"], knobs["wcscale"],
                                                         knobs["bias"])
    # a variant built with wcscale or bias also serves a call without them (identity vectors): one more case
    assert len(cases) == 4
    kw = cases[3].kwargs
    assert (kw["r"], kw["dt"], kw["wc"], kw["b"]) == (knobs["rank"], knobs["out_dtype"], False, False)
    assert kw["m"] > knobs["tile_m"] and kw["m"] % knobs["tile_m"]
    assert len(S.gemm_cases(dict(knobs, wcscale=False, bias=False), req)) == 3
    assert min(c.kwargs["k"] for c in cases) == req["k_multiple"]     # one k-block: K < 4R for R >= 128
    assert len({c.kwargs["seed"] for c in cases}) == len(cases)


def test_quantize_cases_are_valid():
    cases = S.quantize_cases(dict(dtype="bf16", rank=32), dict(k_multiple=64))
    assert all(c.kwargs["k"] % 64 == 0 for c in cases) and {c.kwargs["use_smooth"] for c in cases} == {0, 1, 2}


def test_decode_cases_are_valid_and_every_op_has_cases():
    from svdq_loader.ops import OPS
    assert set(S.CASES_FOR) == set(OPS)
    cases = S.decode_cases({"scale_layout": "logical"}, dict(k_multiple=64))
    assert all(c.op == "decode_act" and c.kwargs["k"] % 64 == 0 for c in cases)
    assert {c.kwargs["m"] for c in cases} >= {1, 300}                 # one row, and a tail past a 256-row block
    assert [S._short_case(c) for c in cases][:2] == ["M=1 K=64", "M=300 K=192"]


def test_table_and_report_with_a_stubbed_gpu(monkeypatch, capsys):
    import svdq_loader
    from svdq_loader import driver
    entries = [SimpleNamespace(name="svdq_gemm_a", op="gemm_w4a4", arch="sm_90a",
                               knobs=dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, tile_m=128,
                                          scale_layout="logical"),
                               requirements=dict(n_multiple=128, k_multiple=64)),
               SimpleNamespace(name="svdq_gemm_b", op="gemm_w4a4", arch="sm_100a", knobs={}, requirements={})]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake H200")
    monkeypatch.setattr(svdq_loader, "load", lambda path: SimpleNamespace(variants=entries))
    monkeypatch.setattr(driver, "device_arch", lambda i: "sm_90a")
    seen = []

    def fake_run(lib, entry, case, ordinal, base):
        seen.append((entry.name, case.kwargs["m"], base))
        if case.kwargs["k"] == 256:
            raise RuntimeError("launch refused")
        bad = case.kwargs["m"] == 1
        return CaseResult(not bad, f"case m={case.kwargs['m']}", 0.5 if bad else 1e-3, 1e-2, 12e-6,
                          ["relative error 5.000e-01 > 1e-02"] if bad else [])
    monkeypatch.setattr(S, "run_case", fake_run)
    assert S.main(["arts", "--seed", "7"]) == 1
    out = capsys.readouterr().out
    # only this arch; the fourth case calls without wcscale and bias (the variant has both: identity vectors)
    assert [s[0] for s in seen] == ["svdq_gemm_a"] * 4 and all(s[2] == 7 for s in seen)
    assert "selftest: Fake H200 (sm_90a), 1 variant(s), 4 case(s), base seed 7" in out
    assert re.search(r"^FAIL +svdq_gemm_a +M=1 N=256 K=64 +5.00e-01 +1e-02 +12.0 us$", out, re.M), out
    assert len(re.findall(r"^PASS +svdq_gemm_a ", out, re.M)) == 1
    assert "FAIL svdq_gemm_a: case m=1: relative error 5.000e-01 > 1e-02" in out
    assert out.strip().endswith("1 passed, 3 failed")
    assert re.search(r"^FAIL +svdq_gemm_a +M=205 N=256 K=256 +- +- +-$", out, re.M), out
    assert "FAIL svdq_gemm_a: RuntimeError: launch refused" in out
    assert S.main(["arts", "--json", "--seed", "7"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "failed" and rep["arch"] == "sm_90a" and len(rep["cases"]) == 4
    assert [c["status"] for c in rep["cases"]].count("PASS") == 1
    assert rep["cases"][1]["error"] is None and rep["cases"][1]["detail"] == "RuntimeError: launch refused"
    # a GPU whose arch the artifacts do not cover: explained, not failed
    monkeypatch.setattr(driver, "device_arch", lambda i: "sm_120a")
    assert S.main(["arts"]) == 0
    assert "holds no variants for this GPU's arch sm_120a (built for sm_100a, sm_90a)" in capsys.readouterr().out


def test_pinning_key_is_the_one_a_call_looks_up(monkeypatch):
    """selftest pins a variant by seeding the library's (op, device, features, dims) cache; the key must be
    the one plan_call's features and dims give, or the pin would silently not apply."""
    from svdq_loader.ops import gemm_w4a4 as gemm_op
    from svdq_loader.ops import quantize_act as quant_op
    monkeypatch.setattr(gemm_op, "check_devices", lambda named: None)
    monkeypatch.setattr(quant_op, "check_devices", lambda named: None)
    m, n, k, r = 77, 256, 512, 32
    g = torch.Generator().manual_seed(2)
    w = gemm_op.prepare_weight(torch.zeros(n, k // 2, dtype=torch.uint8),
                               torch.ones(n, k // 16).to(torch.float8_e4m3fn),
                               lora_up=torch.randn(n, r, generator=g).to(torch.float16),
                               wcscale=torch.rand(n, generator=g) + 0.5, arch="sm_100a")
    from svdq_loader.ops.blackwell_weight import to_blocked_scales
    call = gemm_op.plan_call("sm_100a", torch.zeros(m, k // 2, dtype=torch.uint8), w,
                             to_blocked_scales(torch.ones(m, k // 16).to(torch.float8_e4m3fn)),
                             lora_act_in=torch.zeros(m, r, dtype=torch.float16))
    knobs = dict(out_dtype="fp16", rank=r, wcscale=True, bias=False, scale_layout="blocked", cta_group=2,
                 tile_m=256, tile_n=128, ab_stages=5)
    case = S.Case("gemm_w4a4", dict(m=m, n=n, k=k))
    assert S._features("gemm_w4a4", knobs) == call.features
    feats = S._features("gemm_w4a4", knobs)
    assert S._call_features("gemm_w4a4", feats, dict(wc=True, b=False)) == call.features
    w0 = gemm_op.prepare_weight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 16).to(torch.float8_e4m3fn),
                                lora_up=w.lora_up, arch="sm_100a")
    call0 = gemm_op.plan_call("sm_100a", torch.zeros(m, k // 2, dtype=torch.uint8), w0,
                              to_blocked_scales(torch.ones(m, k // 16).to(torch.float8_e4m3fn)),
                              lora_act_in=torch.zeros(m, r, dtype=torch.float16))
    assert S._call_features("gemm_w4a4", S._features("gemm_w4a4", knobs), dict(wc=False, b=False)) == call0.features
    assert S._dims("gemm_w4a4", case.kwargs) == (("m", call.m), ("n", call.n), ("k", call.k))
    qcall = quant_op.plan_call("sm_90a", torch.zeros(m, k, dtype=torch.bfloat16))
    assert S._features("quantize_act", dict(dtype="bf16", rank=0, scale_layout="logical", warps=4)) == qcall.features
    assert S._dims("quantize_act", dict(m=m, k=k)) == (("m", qcall.m), ("k", qcall.k))

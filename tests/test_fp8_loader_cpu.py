"""The FP8-compute mode's loader side on the CPU: prepare_weight(compute="fp8"), the call checks, the pre-pass
workspace the images launcher allocates, selection (never an FP8 variant for an exact call), and the torch module's
compute argument."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svdq_loader import select  # noqa: E402
from svdq_loader.errors import InvalidArgument  # noqa: E402
from svdq_loader import ops  # noqa: E402
from svdq_loader.ops import act_fp8, decode_act, gemm_w4a4 as gemm_op  # noqa: E402
from svdq_loader.ops import sm90_fp8_weight_format as fmt  # noqa: E402
from svdq_loader.testing import fp8_reference as f8  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_tensors(monkeypatch):
    """The device check stubbed out: these tests hand CPU tensors to the checks and conversions."""
    monkeypatch.setattr(gemm_op, "check_devices", lambda named: None)


def _weight(n=128, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    wgt = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    sc = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    return wgt, sc


def test_prepare_weight_for_fp8_records_the_mode_and_folds_rw_into_wcscale():
    wgt, sc = _weight()
    wc = torch.rand(128) + 0.5
    w = gemm_op.prepare_weight(wgt, sc, wcscale=wc, arch="sm_90a", compute="fp8")
    assert (w.compute, w.op, w.weight_format) == ("fp8", "gemm_w4a4_fp8", "sm90_fp8_frag")
    rw = f8.scale_pow2(sc.view(torch.uint8).numpy())
    np.testing.assert_array_equal(fmt.rw_of(w.wscales, 128).double().numpy(), rw)
    np.testing.assert_array_equal(w.wcscale.numpy(), (wc / torch.from_numpy(rw).float()).numpy())   # exact
    w0 = gemm_op.prepare_weight(wgt, sc, arch="sm_90a", compute="fp8")        # no wcscale: 1 / rw
    np.testing.assert_array_equal(w0.wcscale.double().numpy(), 1.0 / rw)
    ex = gemm_op.prepare_weight(wgt, sc, wcscale=wc, arch="sm_90a")
    assert (ex.compute, ex.op, ex.weight_format) == ("exact", "gemm_w4a4", "sm90_frag")


@pytest.mark.parametrize("arch, compute, k, words", [
    ("sm_100a", "fp8", 256, "runs on sm_90a only"),
    ("sm_90a", "fp4", 256, "compute must be one of 'exact', 'fp8'"),
    ("sm_90a", "fp8", 192, "K % 128 == 0"),
])
def test_prepare_weight_refuses_what_the_mode_cannot_serve(arch, compute, k, words):
    wgt, sc = _weight(k=k)
    with pytest.raises(InvalidArgument, match=words):
        gemm_op.prepare_weight(wgt, sc, arch=arch, compute=compute)


def test_plan_call_takes_an_fp8_weight_with_the_exact_features():
    wgt, sc = _weight()
    w = gemm_op.prepare_weight(wgt, sc, bias=torch.zeros(128), arch="sm_90a", compute="fp8")
    act = torch.zeros(5, 128, dtype=torch.uint8)
    asc = torch.ones(5, 16).to(torch.float8_e4m3fn)
    call = gemm_op.plan_call("sm_90a", act, w, asc)
    assert call.features == ("bf16", 0, True, True, "logical")      # wcscale always on: it holds wcscale / rw
    assert call.pointers["wscales"] == w.wscales.data_ptr()


def test_the_images_launcher_allocates_the_prepass_workspace():
    assert ops.WORKSPACE_BYTES_BY_PREPASS["act_fp8"](1000, 3072) == act_fp8.workspace_bytes(1000, 3072)
    assert act_fp8.workspace_bytes(1000, 3072) == 4 * decode_act.image_rows(1000) + 3072 * decode_act.image_rows(1000)
    assert ops.WORKSPACE_BYTES_BY_PREPASS["decode_act"] is decode_act.image_bytes
    assert act_fp8.image_size_problem(4608, 15360) is None
    assert "split the call along M" in act_fp8.image_size_problem(1 << 17, 1 << 15)


def _fp8_config_entries(path=None):
    """The variants of configs/sm90_fp8.yaml (or the config at `path`) as the fields selection and tune read of
    manifest entries."""
    from pathlib import Path

    from svdq_aot.config import load_config
    from svdq_aot.variants import enumerate_variants
    from svdq_kernels import registry
    cfg = load_config(path or Path(__file__).resolve().parents[1] / "configs" / "sm90_fp8.yaml")
    valid, _ = enumerate_variants(cfg)

    class E:
        def __init__(self, v):
            self.name, self.op, self.arch, self.knobs = v.name, v.op, v.arch, v.knob_dict
            fam = registry.family(v.op, v.arch)
            self.requirements = fam.requirements(v.arch, v.knob_dict)
            self.family = fam.NAME
    return [E(v) for v in valid]


def test_tune_plans_the_public_operators_of_both_modes():
    """`svdq-aot tune` measures gemm_w4a4, gemm_w4a4_fp8 and quantize_act; a pre-pass op (decode_act, act_fp8)
    is never a job of its own (it runs inside its GEMM's calls)."""
    pytest.importorskip("cutlass")
    from svdq_loader import tune
    assert set(tune.TUNED_OPS) == {"gemm_w4a4", "gemm_w4a4_fp8", "quantize_act"}
    jobs, _ = tune.plan(_fp8_config_entries(), {}, "sm_90a", [("attn_out", 3072, 3072)])
    assert {j.op for j in jobs} == {"gemm_w4a4", "gemm_w4a4_fp8"}
    assert all(set(j.candidates) <= {e.name for e in _fp8_config_entries() if e.op == j.op} for j in jobs)


def test_selection_keeps_the_modes_apart():
    """An exact call never gets an FP8 variant and the other way round: the mode is the operator."""
    pytest.importorskip("cutlass")
    entries = _fp8_config_entries()
    feats = ("bf16", 32, True, True, "logical")
    for op in ("gemm_w4a4", "gemm_w4a4_fp8"):
        for m in (1, 64, 1024, 4608):
            p = select.Problem(op, "sm_90a", feats, (("m", m), ("n", 3072), ("k", 3072)))
            ex = select.explain(entries, {}, p)
            assert ex.chosen is not None and ex.chosen.op == op, ex.text()
            assert any(w.startswith(f"compute mode {'fp8' if op.endswith('fp8') else 'exact'}") for w in ex.why)


def test_torch_module_takes_the_compute_mode():
    from svdq_loader.torch.linear import W4A4Linear
    layer = W4A4Linear(256, 128, rank=16, compute="fp8")
    assert layer.compute == "fp8" and "compute='fp8'" in repr(layer)
    assert W4A4Linear(256, 128).compute == "exact"
    with pytest.raises(InvalidArgument, match="compute must be one of"):
        W4A4Linear(256, 128, compute="int8")
    assert layer.set_compute("exact").compute == "exact"


def test_selection_takes_the_fp8_forms_the_promotion_leaves(tmp_path):
    """The FP8 forms of configs/sm90_fp8.yaml at ranks 32 and 128, both dtypes, ranked by the grid-fill estimate.
    bf16 at rank 32 gets the tile height that was fastest in the sweeps of sessions 29 and 31: 216 rows at M = 4608,
    N = 3072 (four waves of 528 tiles; 224 rows before it was built), 256 rows at N = 12288, 208 rows at M = 1024,
    N = 3072 (one wave of 120), the 128-row tile at M <= 256, N = 3072.  fp16 at rank 32 takes the 128-row tile (the
    fp32 sums leave no room for the taller ones); at rank 128 the four-set 128-row tile, except fp16, which keeps a
    stack frame there and takes the two-set form the default forms add for it."""
    pytest.importorskip("cutlass")
    import yaml
    from pathlib import Path

    from svdq_kernels import registry
    from svdq_loader.select_rules import Rule, parse_buckets
    src = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "sm90_fp8.yaml").read_text())
    src["ranks"] = [32, 128]
    src["variants"]["sm_90a"] = {k: src["variants"]["sm_90a"][k] for k in ("gemm_w4a4_fp8", "act_fp8")}
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(src))
    entries = _fp8_config_entries(path)
    fam = registry.family("gemm_w4a4_fp8", "sm_90a")
    key = ("gemm_w4a4_fp8", "sm_90a", fam.NAME)
    rules = {key: Rule(*key, parse_buckets(fam.SELECTION, "SELECTION", list(fam.TUNING)))}
    want = {("bf16", 32, 4608, 3072, 3072): (216, 4, "lut"), ("bf16", 32, 4608, 12288, 3072): (216, 4, "lut"),
            ("bf16", 32, 4608, 3072, 12288): (256, 4, "lut"), ("bf16", 32, 1024, 3072, 3072): (208, 4, "regs"),
            ("bf16", 32, 1024, 12288, 3072): (208, 4, "regs"), ("bf16", 32, 1024, 3072, 12288): (256, 4, "lut"),
            ("bf16", 32, 256, 3072, 3072): (128, 4, "regs"), ("bf16", 32, 256, 3072, 12288): (256, 4, "lut"),
            ("fp16", 32, 4608, 3072, 3072): (128, 4, "regs"), ("bf16", 32, 64, 3072, 3072): (128, 4, "regs"),
            ("bf16", 128, 64, 3072, 3072): (128, 4, "regs"), ("fp16", 128, 64, 3072, 3072): (128, 2, "regs"),
            ("fp16", 128, 4608, 3072, 3072): (128, 2, "regs"), ("bf16", 128, 4608, 3072, 3072): (128, 4, "regs"),
            ("bf16", 32, 4608, 3328, 3072): (208, 2, "regs")}       # K = 13 x 256: only the two-set forms
    for (dt, r, m, k, n), (tm, ws, wp) in want.items():
        p = select.Problem("gemm_w4a4_fp8", "sm_90a", (dt, r, True, True, "logical"),
                           (("m", m), ("n", n), ("k", k)))
        ex = select.explain(entries, rules, p)
        assert ex.chosen is not None, ex.text()
        got = (ex.chosen.knobs["tile_m"], ex.chosen.knobs["wsets"], ex.chosen.knobs["weights"])
        assert got == (tm, ws, wp), (dt, r, m, k, n, ex.text())


def test_the_216_row_tiles_serve_where_their_rows_lie_inside_the_image():
    """configs/sm90_rows216.yaml (both modes, bf16, rank 32): at M = 4608, N = 3072 the grid-fill estimate takes the
    216-row tile in either mode (22 row tiles by 24: four whole waves on 132 SMs, against the 224-row tile's 21 in as
    many); at M = 653 its row tiles would end at row 864, past the 832 rows of the stage image, so the shape rule
    leaves it out, with that reason, and a covered height serves; at M = 1024 the 208-row tile keeps its one wave."""
    pytest.importorskip("cutlass")
    from pathlib import Path

    from svdq_kernels import registry
    from svdq_loader.ops.decode_act import image_rows
    from svdq_loader.select_rules import Rule, parse_buckets
    entries = _fp8_config_entries(Path(__file__).resolve().parents[1] / "configs" / "sm90_rows216.yaml")
    assert image_rows(653) == 832
    for op in ("gemm_w4a4_fp8", "gemm_w4a4"):
        fam = registry.family(op, "sm_90a")
        key = (op, "sm_90a", fam.NAME)
        rules = {key: Rule(*key, parse_buckets(fam.SELECTION, "SELECTION", list(fam.TUNING)))}
        mine = [e for e in entries if e.op == op]
        assert 216 in {e.knobs["tile_m"] for e in mine}
        for m, n, want in ((4608, 3072, 216), (653, 3072, 208), (1024, 3072, 208), (4608, 21504, 256)):
            p = select.Problem(op, "sm_90a", ("bf16", 32, True, True, "logical"), (("m", m), ("n", n), ("k", 3072)))
            ex = select.explain(mine, rules, p)
            assert ex.chosen is not None and ex.chosen.knobs["tile_m"] == want, (op, m, n, ex.text())
            why = [w for name, w in ex.rejected if "tilem216" in name and "rank32" in name]
            if m == 653:
                assert why and "tile_m 216" in why[0] and "row 864" in why[0] and "832 rows" in why[0], why
            elif want != 216:
                assert why and "outranked" in why[0], why

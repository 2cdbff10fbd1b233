"""The decode pass of the sm_90a images GEMM (op ``decode_act``) and the GEMM form that reads it.

CPU only: the image format's two statements agree (the reference's vectorised layout and the element formula
`image_offset`); the decode kernel and the images GEMM compile to the instruction mix their design says; a
config with images forms but no decode_act section is refused naming the key; `ImagesLauncher` hands the
decode pass and the GEMM the arguments the format needs.  The numbers (bit-exact images, the GEMM through
the float64 reference) run on the H200: tests/test_gpu_gemm.py and ``svdq-aot selftest``.
"""
from __future__ import annotations

import os
import re
import sys
import textwrap

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from svdq_loader.ops import decode_act as D  # noqa: E402
from svdq_loader.testing import reference as ref  # noqa: E402


def _random_nvfp4(rng, m, k):
    act = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    asc = rng.integers(0, 0x7F, (m, k // 16), dtype=np.uint8) | (rng.integers(0, 2, (m, k // 16), dtype=np.uint8) << 7)
    return act, asc


@pytest.mark.parametrize("m, k", [(1, 64), (37, 192), (256, 128), (300, 64)])
def test_reference_images_follow_the_element_formula(m, k):
    rng = np.random.default_rng(m * 131 + k)
    act, asc = _random_nvfp4(rng, m, k)
    img = ref.reference_images(act, asc)
    assert img.size == D.image_bytes(m, k) == k * D.image_rows(m) * 2
    assert D.image_rows(m) % D.IMAGE_ROW_BLOCK == 0
    h = img.view(np.float16)
    vals = ref.decode_e2m1(ref.unpack_nibbles(act)) * np.repeat(ref.decode_e4m3(asc), 16, axis=1) * 2.0 ** -7
    rows, ks = np.meshgrid(np.arange(m), np.arange(k), indexing="ij")
    offs = np.vectorize(lambda r, kk: D.image_offset(m, int(r), int(kk)))(rows, ks)
    assert np.array_equal(h[offs // 2].astype(np.float64), vals)
    assert np.array_equal(np.signbit(h[offs // 2]), np.signbit(vals))        # -0.0 stays -0.0
    covered = np.zeros(h.size, dtype=bool)
    covered[offs // 2] = True
    assert np.all(h[~covered].view(np.uint16) == 0)                          # pad rows: +0.0


@pytest.mark.parametrize("m, rows", [(1, 256), (64, 256), (224, 448), (256, 448), (1000, 1152), (4608, 4800),
                                     (9728, 9856)])
def test_image_rows_cover_whole_tiles_of_every_images_tile_height(m, rows):
    """Worked by hand: 4608 rows are 18 tiles of 256, 20.6 of 224 (21 x 224 = 4704 rows) and 22.2 of 208, so the
    image needs 23 x 208 = 4784 rows, rounded to 64: 4800.  224 rows are one tile of 224 or 256 but two of 208.  The
    64- and 128-row tiles divide 256, so they never add rows: the same heights as with 208, 224 and 256 alone."""
    assert D.IMAGE_TILE_ROWS == (64, 128, 208, 224, 256) and D.IMAGE_COVER_ROWS == (208, 224, 256)
    assert D.image_rows(m) == rows
    for t in D.IMAGE_TILE_ROWS:
        assert -(-m // t) * t <= rows
    assert rows == -(-max(-(-m // t) * t for t in (208, 224, 256)) // 64) * 64


def test_tile_rows_rule_serves_the_inner_heights_where_their_tiles_lie_inside_the_image():
    """A height of IMAGE_TILE_ROWS always fits the image; 216 (IMAGE_INNER_ROWS) fits exactly where ceil(M / 216)
    row tiles end inside image_rows(M), and adds no row to any image.  Worked by hand: M = 4608 makes 22 tiles of 216
    (4752 rows) in a 4800-row image; M = 433 makes 3 (648 rows) in 640 (433 is two tiles of 224 or 256 and three of
    208: 624, rounded to 64)."""
    assert D.IMAGE_INNER_ROWS == (216,) and not set(D.IMAGE_INNER_ROWS) & set(D.IMAGE_TILE_ROWS)
    served = 0
    for m in range(1, 12001):
        rows = D.image_rows(m)
        for t in D.IMAGE_TILE_ROWS:
            assert D.tile_rows_problem(t, m) is None
        fits = -(-m // 216) * 216 <= rows
        served += fits
        assert (D.tile_rows_problem(216, m) is None) == fits, m
    assert 0.8 < served / 12000 < 0.9
    assert D.tile_rows_problem(216, 4608) is None and D.tile_rows_problem(216, 1024) is None
    why = D.tile_rows_problem(216, 433)
    assert D.image_rows(433) == 640 and "M=433" in why and "row 648" in why and "640 rows" in why


def test_image_rows_of_one_tile_are_one_contiguous_block():
    """The bulk copy of a stage: rows [m0, m0 + tile_m) of k-tile t are tile_m x 128 bytes from (t * rows + m0) * 128."""
    m = 1000
    for t in (0, 3):
        for m0, tm in ((0, 256), (256, 128), (512, 256), (896, 224), (832, 208), (960, 64)):
            offs = sorted(D.image_offset(m, r, t * 64 + kk) for r in range(m0, m0 + tm) for kk in range(64))
            start = (t * D.image_rows(m) + m0) * 128
            assert offs == list(range(start, start + tm * 128, 2))


def test_images_launcher_runs_the_decode_then_the_gemm_on_the_workspace():
    from launch_stubs import StubLauncher, stub_workspaces
    from svdq_loader.ops import GEMM_W4A4

    dec, gemm = StubLauncher("decode"), StubLauncher("gemm")
    ln = D.ImagesLauncher(dec, gemm, GEMM_W4A4.arg_names)
    sizes = stub_workspaces(ln)
    names = GEMM_W4A4.arg_names
    args = [0x1000 * (i + 1) for i in range(9)] + [300, 256, 3072, 132, 0x55]
    ln.launch(args)
    assert sizes == [D.image_bytes(300, 3072)] == [3072 * 512 * 2]
    assert dec.calls == [[args[names.index("act")], args[names.index("ascales")], 0x7000_0000, 300, 3072, 0x55]]
    want = list(args)
    want[names.index("act")] = 0x7000_0000
    assert gemm.calls == [want] and args[0] == 0x1000                       # the caller's list is untouched
    assert ln.name == "gemm"


def test_gemm_spec_names_decode_act_as_the_images_prepass():
    from svdq_loader.ops import GEMM_W4A4, QUANTIZE_ACT
    assert GEMM_W4A4.prepass({"act_source": "images"}) == "decode_act"
    assert GEMM_W4A4.prepass({"act_source": "nvfp4"}) is None
    assert QUANTIZE_ACT.prepass({"dtype": "bf16"}) is None and D.SPEC.prepass({}) is None


def _gemm_variant(name, **knobs):
    from types import SimpleNamespace
    k = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=256, tile_n=128,
             tile_k=64, stages=4, prefetch=1, skip_pad=True, act_decode="prmt", schedule="ws", wsets=2,
             act_source="images")
    k.update(knobs)
    return SimpleNamespace(name=name, op="gemm_w4a4", arch="sm_90a", knobs=k, family="sm90_wgmma_w4a4",
                           requirements=dict(n_multiple=128, k_multiple=128))


def test_images_forms_leave_the_selection_where_the_image_would_not_fit_32_bit_offsets():
    """decode_act indexes its image with 32-bit integers: a call whose image takes 2^31 bytes or more is served
    by a producer-decode form, and `explain` names the size and the rule.  K = 12288: M = 87296 (341 blocks of
    256 rows, 2^31 - 2^22 bytes) still takes the images form, M = 87297 (342 blocks) does not."""
    from svdq_loader import select
    from svdq_loader.ops import GEMM_W4A4
    from svdq_loader.select_rules import default_rule
    k = 12288
    assert D.image_bytes(87296, k) < D.IMAGE_BYTES_LIMIT <= D.image_bytes(87297, k)
    assert GEMM_W4A4.knob_size_rule({"act_source": "images"}, dict(m=87296, n=3072, k=k)) is None
    assert GEMM_W4A4.knob_size_rule({"act_source": "nvfp4"}, dict(m=10 ** 6, n=3072, k=k)) is None
    variants = [_gemm_variant("images_256"), _gemm_variant("coop_256", schedule="coop", act_source="nvfp4")]
    rules = {("gemm_w4a4", "sm_90a", "sm90_wgmma_w4a4"): default_rule("gemm_w4a4", "sm_90a", "sm90_wgmma_w4a4")}
    feats = ("bf16", 32, True, True, "logical")
    fits = select.explain(variants, rules, select.Problem("gemm_w4a4", "sm_90a", feats,
                                                          (("m", 87296), ("n", 3072), ("k", k))))
    assert sorted(fits.candidates) == ["coop_256", "images_256"]
    big = select.explain(variants, rules, select.Problem("gemm_w4a4", "sm_90a", feats,
                                                         (("m", 87297), ("n", 3072), ("k", k))))
    assert big.chosen.name == "coop_256" and big.candidates == ["coop_256"]
    why = dict(big.rejected)["images_256"]
    assert why == (f"act_source images: the decode_act image of M=87297, K=12288 takes {D.image_bytes(87297, k)} "
                   "bytes, not below 2^31 (decode_act indexes it with 32-bit offsets); the forms that decode in "
                   "their producer (act_source nvfp4) serve this call")
    # only images forms built: the call is refused before any launch, naming the rule
    only = select.explain(variants[:1], rules, select.Problem("gemm_w4a4", "sm_90a", feats,
                                                              (("m", 87297), ("n", 3072), ("k", k))))
    assert only.chosen is None and "not below 2^31" in only.error


# -- needs the DSL --------------------------------------------------------------------------------------------

def _config(tmp_path, with_decode: bool, forms=("{tiles: [[256, 128, 64]], schedule: [ws, coop], act_source: [images]}",
                                                 "{tiles: [[128, 128, 64]], schedule: [ws]}"),
            rank=32, k=3072, n=3072):
    """A one-shape sm_90a config with these GEMM forms, and a decode_act section if `with_decode`."""
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(f"""\
        name: img
        archs: [sm_90a]
        out_dtypes: [bf16]
        ranks: [{rank}]
        wcscale: [true]
        bias: [true]
        shapes:
          a: {{k: {k}, n: {n}}}
        variants:
          sm_90a:
            gemm_w4a4:
              forms:
        """) + "".join(f"        - {f}\n" for f in forms) + ("    decode_act: {}\n" if with_decode else ""))
    return p


@pytest.mark.parametrize("with_decode", [False, True])
def test_images_forms_need_a_decode_act_section(tmp_path, with_decode):
    pytest.importorskip("cutlass")
    from svdq_aot.config import load_config
    from svdq_aot.plan import PlanError, check_coverage
    from svdq_aot.variants import check_sections, enumerate_variants
    cfg = load_config(str(_config(tmp_path, with_decode)))
    check_sections(cfg)
    valid, rejected = enumerate_variants(cfg)
    assert [r for v, r in rejected if v.knob_dict.get("schedule") == "coop"] == [
        "act_source images with schedule coop: the bulk copies of the stage images are issued by the producer "
        "warpgroup of a warp-specialised schedule (ws, ws_splitk2, ws_splitk4)"]
    if with_decode:
        check_coverage(cfg, valid, rejected)
        assert [v.name for v in valid if v.op == "decode_act"] == ["svdq_decode_act_sm90a_reqk64"]
    else:
        with pytest.raises(PlanError, match=r"variants\.sm_90a\.decode_act: .*actsourceimages.* runs decode_act "
                                            r"before each call, and the config builds no decode_act variant on "
                                            r"sm_90a \(add `decode_act: \{\}` under variants\.sm_90a\)"):
            check_coverage(cfg, valid, rejected)


def test_decode_act_section_takes_no_knobs():
    pytest.importorskip("cutlass")
    from svdq_kernels import registry
    fam = registry.family("decode_act", "sm_90a")
    assert fam.config_axes("sm_90a", {}) == ([{}], [])
    assert fam.config_axes("sm_90a", {"warps": [4]})[1] == [
        "warps: unknown key (decode_act has no knobs; write decode_act: {})"]
    assert fam.invalid_reason("sm_100a", {"scale_layout": "blocked"}).startswith("arch sm_100a is not built")


def _sass_of(ck, tmp_path):
    from kernel_checks import sass_of_cubin
    return sass_of_cubin(ck.cubin, tmp_path)


def test_decode_kernel_loads_four_code_words_and_stores_four_whole_chunks_per_thread(tmp_path):
    pytest.importorskip("cutlass")
    from svdq_kernels import registry
    fam = registry.family("decode_act", "sm_90a")
    knobs = {"scale_layout": "logical"}
    ck = fam.compile("sm_90a", knobs, "svdq_decode_act_sm90a_reqk64", str(tmp_path))
    (sym,) = ck.kernel_symbols
    assert ck.resource_usage[sym]["stack_frame_bytes"] == 0 and ck.resource_usage[sym]["registers"] <= 64
    assert ck.smem_bytes == 0
    sass = _sass_of(ck, tmp_path)
    assert len(re.findall(r"\bLDG\.E ", sass)) == 4                    # a code word of each of four rows
    assert len(re.findall(r"\bLDG\.E\.[SU]8 ", sass)) == 4             # and its scale byte
    assert len(re.findall(r"\bSTG\.E\.128\b", sass)) == 4              # one 16-byte chunk of four rows
    assert len(re.findall(r"\bHMUL2\b", sass)) == 16 + 4               # one per pair, one per scale (x 2^7)
    assert "F2FP.F16.E4M3.UNPACK" in sass and not re.search(r"\b(STL|LDL)\b", sass)


def test_images_gemm_bulk_copies_its_stages_and_decodes_no_activation(tmp_path):
    """Against the nvfp4 form of the same tile: one bulk copy (UBLKCP) instead of the producer's decode."""
    pytest.importorskip("cutlass")
    from svdq_kernels import registry
    from svdq_loader.ops import op_spec
    fam = registry.family("gemm_w4a4", "sm_90a")
    base = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=256, tile_n=128,
                tile_k=64, stages=4, prefetch=1, skip_pad=True, act_decode="prmt", schedule="ws", wsets=2)
    counts = {}
    for src in ("nvfp4", "images"):
        knobs = dict(base, act_source=src)
        name = op_spec("gemm_w4a4").name_for("sm_90a", knobs, fam.requirements("sm_90a", knobs))
        ck = fam.compile("sm_90a", knobs, name, str(tmp_path / src))
        sass = _sass_of(ck, tmp_path)
        counts[src] = {op: len(re.findall(r"\b%s\b" % op, sass)) for op in ("UBLKCP", "HMUL2", "STS", "HGMMA")}
        assert not re.search(r"\b(STL|LDL)\b", sass)
    assert counts["images"]["UBLKCP"] == 1 and counts["nvfp4"]["UBLKCP"] == 0
    assert counts["images"]["HGMMA"] == counts["nvfp4"]["HGMMA"]
    # the weight decode (and LoRA staging) stays; the activation decode and its stage stores go
    assert counts["images"]["HMUL2"] < counts["nvfp4"]["HMUL2"] / 4
    assert counts["images"]["STS"] < counts["nvfp4"]["STS"] / 4


def test_images_gemm_splits_k_at_the_256_row_tile_without_a_stack_frame(tmp_path):
    """The 256-row images tile with K over 4 CTAs (configs/flux.yaml's form for M = 256, K = 12288): 168 launch
    registers and no stack frame, where the nvfp4 form of the same tile is refused (its producer decode spills);
    rank 0 reads each peer's 128 partial sums per thread as 32 distributed-SMEM loads between two cluster
    barriers."""
    pytest.importorskip("cutlass")
    from svdq_kernels import registry
    from svdq_loader.ops import op_spec
    fam = registry.family("gemm_w4a4", "sm_90a")
    knobs = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=256,
                 tile_n=128, tile_k=64, stages=4, prefetch=1, skip_pad=True, act_decode="prmt",
                 schedule="ws_splitk4", wsets=2, act_source="images")
    assert fam.invalid_reason("sm_90a", knobs) is None
    assert "act_source nvfp4" in fam.invalid_reason("sm_90a", dict(knobs, act_source="nvfp4"))
    assert fam.requirements("sm_90a", knobs)["k_multiple"] == 2 * 64 * 4
    name = op_spec("gemm_w4a4").name_for("sm_90a", knobs, fam.requirements("sm_90a", knobs))
    ck = fam.compile("sm_90a", knobs, name, str(tmp_path))
    usage = ck.resource_usage[ck.kernel_symbols[0]]
    assert usage["stack_frame_bytes"] == 0 and usage["registers"] == 168
    sass = _sass_of(ck, tmp_path)
    assert not re.search(r"\b(STL|LDL)\b", sass)
    # the two barriers in the MMA warps' path and in the producer's (its bulk-copy thread and the idle ones)
    assert sass.count("UCGABAR_ARV") == sass.count("UCGABAR_WAIT") >= 4
    assert len(re.findall(r"\bLD\.E\.128\b", sass)) >= 32
    assert len(re.findall(r"\bUBLKCP\b", sass)) == 1


def test_library_runs_the_decode_then_the_gemm_through_one_cached_launcher(tmp_path, monkeypatch):
    """A real build of one images form and decode_act, loaded with the recording driver (tests/fake_cuda.py):
    the call launches the decode kernel, then the GEMM with `act` replaced by the workspace, and the
    (variant, device) launcher is built once."""
    pytest.importorskip("cutlass")
    torch = pytest.importorskip("torch")
    import svdq_loader
    from svdq_aot.build import build
    from fake_cuda import FakeCuda, fake_driver
    cfg = _config(tmp_path, True, forms=("{tiles: [[256, 128, 64]], schedule: [ws], prefetch: [1], act_source: [images]}",),
                  rank=0, k=256, n=256)
    build(str(cfg), str(tmp_path / "art"), jobs=1)
    lib = svdq_loader.load(str(tmp_path / "art"))
    rec = fake_driver(monkeypatch)
    sizes = []

    def alloc(self, n):
        sizes.append(n)
        return FakeCuda((n,), torch.uint8, ptr=0x7E00_0000_0000)
    monkeypatch.setattr(D.ImagesLauncher, "_alloc", alloc)
    m, n, k = 300, 256, 256
    T = FakeCuda
    w = lib.prepare_weight(T((n, k // 2), torch.uint8), T((n, k // 16), torch.float8_e4m3fn),
                           wcscale=T((n,), torch.float32), bias=T((n,), torch.float32))
    act, asc = T((m, k // 2), torch.uint8), T((m, k // 16), torch.float8_e4m3fn)
    (gemm_name,) = [v.name for v in lib.variants if v.op == "gemm_w4a4"]
    ln = lib._launcher(gemm_name, 0, False)
    seen = []
    for part in ("decode", "gemm"):
        inner = getattr(ln, part)
        monkeypatch.setattr(inner, "launch", lambda a, f=inner.launch, part=part: (seen.append((part, a[0], a[2])),
                                                                                   f(a))[1])
    for _ in range(2):
        lib.gemm_w4a4(act, w, asc, out=T((m, n), torch.bfloat16))
    assert lib._launchers[(gemm_name, 0)] is ln
    # decode: (act, ascales, images = the workspace); GEMM: act = the workspace, wgt as prepared
    assert seen == [("decode", act.data_ptr(), 0x7E00_0000_0000), ("gemm", 0x7E00_0000_0000, w.wgt.data_ptr())] * 2
    assert isinstance(ln, D.ImagesLauncher) and ln.gemm is lib._kernel_lns[(gemm_name, 0)]
    assert ln.decode is lib._kernel_lns[("svdq_decode_act_sm90a_reqk64", 0)]
    dec, gem = ln.decode.kernels["svdq_decode_act_sm90a_reqk64_0"], ln.gemm.kernels[gemm_name + "_0"]
    assert rec.launches == [dec, gem, dec, gem]                  # decode first, on every call
    assert len(rec.loads) == 2 and sizes == [D.image_bytes(m, k)] * 2

"""Cross-compile sm_100a / sm_103a W4A4 GEMM variants on the CPU and check them statically (needs the DSL).

Per variant: ELF arch, kernel symbol, registers <= 255 and no stack frame, static + dynamic SMEM
within the per-CTA limit and equal to the stage solver's numbers, SASS with the block-scaled FP4
tensor-core MMA (``UTCOMMA.4X`` on sm_100a, ``UTCOMMA.BLOCK16`` on sm_103a), the f16 one
(``UTCHMMA``) exactly when R > 0, the ``.2CTA`` forms exactly in 2-CTA variants, TMA loads and
stores, no local memory (``STL``/``LDL``).  Launch bytes (interpreter and the loader's
pointer-patching cache) bit-exact against the DSL's own host code for random shapes, pointers and
SM counts, with the grid following the SM count.  Nothing here runs on a GPU.
"""
from __future__ import annotations

import os
import random
import re
import sys

import pytest

pytest.importorskip("cutlass")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_oracle as O  # noqa: E402
from kernel_checks import compile_gemm_cases, dump_sass, elf_sm  # noqa: E402

from svdq_aot.family import check_family  # noqa: E402
from svdq_kernels import registry  # noqa: E402
from svdq_kernels import sm100_gemm_w4a4 as fam  # noqa: E402
from svdq_kernels import sm100_plan as plan  # noqa: E402
from svdq_loader.cubin_info import cubin_info  # noqa: E402
from svdq_loader.launch_plan import CachedLaunch, LaunchPlanCache  # noqa: E402
from svdq_loader.ops import GEMM_W4A4  # noqa: E402

SM = {"sm_100a": 100, "sm_103a": 103}
BLOCK_SCALED = re.compile(r"\bUTC[OQ]MMA(\.2CTA)?\.(4X|BLOCK16)\b")

# (arch, cta_group, tile_m, tile_n, out_dtype, rank, wcscale, bias)
CASES = [
    ("sm_100a", 1, 128, 128, "fp16", 0, True, True),
    ("sm_100a", 1, 128, 256, "bf16", 64, True, False),
    ("sm_100a", 2, 256, 128, "bf16", 128, True, True),
    ("sm_100a", 2, 256, 256, "fp16", 32, False, True),
    ("sm_103a", 2, 256, 128, "fp16", 48, False, False),
    ("sm_103a", 1, 128, 128, "bf16", 96, True, True),
]


def _id(c):
    return f"{c[0]}-cta{c[1]}-{c[2]}x{c[3]}-{c[4]}-r{c[5]}"


def _knobs(arch, cg, tm, tn, dt, r, wc, b, stages="auto"):
    k = dict(out_dtype=dt, rank=r, wcscale=wc, bias=b, scale_layout="blocked", cta_group=cg, tile_m=tm,
             tile_n=tn, ab_stages=stages)
    return fam.resolve(arch, k)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_gemm_cases(fam, CASES, _knobs, _id, tmp_path_factory)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_variant_statically(compiled, case):
    arch, cg, tm, tn, dt, r = case[:6]
    name, knobs, ck, path, program, sizes = compiled[case]
    info = cubin_info(ck.cubin)
    assert elf_sm(info) == SM[arch]
    assert ck.kernel_symbols == [f"{name}_0"]
    (sym,) = ck.kernel_symbols
    ru = ck.resource_usage[sym]
    assert ru["registers"] <= 255 and ru["stack_frame_bytes"] == 0, ru
    static = info.kernels[sym].static_smem
    bud = fam.budget(knobs)
    # the struct the kernel allocates is exactly the solver's number; static SMEM as the solver assumes
    assert ck.smem_bytes == bud["smem"].dynamic(knobs["ab_stages"])
    assert static <= plan.STATIC_SMEM_BYTES, f"static SMEM {static} B, the solver assumes {plan.STATIC_SMEM_BYTES}"
    assert ck.smem_bytes + plan.STATIC_SMEM_BYTES <= plan.SMEM_LIMIT_BYTES
    assert bud["tmem_used"] <= plan.TMEM_COLUMNS
    sass = dump_sass(path)
    if sass is None:
        if os.environ.get("SVDQ_ALLOW_NO_SASS") == "1":
            pytest.skip("cuobjdump / nvdisasm not available (SVDQ_ALLOW_NO_SASS=1)")
        pytest.fail("cuobjdump / nvdisasm not found: install the test extra or set SVDQ_ALLOW_NO_SASS=1")
    mmas = BLOCK_SCALED.findall(sass)
    assert len(mmas) == 4, f"expected 4 block-scaled MMAs (one k-block = 4 atoms), got {mmas}"
    want_form = "BLOCK16" if arch == "sm_103a" else "4X"
    assert all(form == want_form for _, form in mmas), mmas
    assert all((two == ".2CTA") == (cg == 2) for two, _ in mmas), mmas
    hmma = re.findall(r"\bUTCHMMA(\.2CTA)?\b", sass)
    assert bool(hmma) == (r > 0), hmma
    assert all((two == ".2CTA") == (cg == 2) for two in hmma)
    assert "UTCCP" in sass, "scale factors are not copied SMEM -> TMEM"
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bUTMASTG\b", sass)
    assert not re.search(r"\b(STL|LDL)\b", sass), "local-memory traffic in the SASS"


def test_256x128_two_cta_rank128_gets_at_least_4_stages():
    for arch in fam.ARCHS:
        knobs = _knobs(arch, 2, 256, 128, "bf16", 128, True, True)
        assert knobs["ab_stages"] >= 4, knobs
        assert fam.invalid_reason(arch, knobs) is None
        b = fam.budget(knobs)["smem"]
        # the 2-CTA LoRA-up tile is halved per CTA (64 of 128 rows): lora = (128 + 64) rows x 128 x 2 B
        assert b.lora == (128 + 64) * 128 * 2, b


def test_variants_that_do_not_fit_are_rejected_with_numbers():
    k = _knobs("sm_100a", 1, 128, 256, "bf16", 256, True, True)
    msg = fam.invalid_reason("sm_100a", k)
    assert msg and re.search(r"needs \d+ B of SMEM \(2 A/B stages x \d+ B \+ LoRA \d+ B", msg), msg
    assert "at most 0 A/B stages fit" in msg and "LoRA 196608 B" in msg
    k = _knobs("sm_100a", 1, 128, 128, "bf16", 32, True, True, stages=8)
    assert "more than the 232448 B" in fam.invalid_reason("sm_100a", k)
    assert "the MMA tile is 256 rows" in fam.invalid_reason("sm_100a", _knobs("sm_100a", 2, 128, 128, "bf16", 0,
                                                                                True, True))
    assert "not built by sm100_gemm_w4a4" in fam.invalid_reason("sm_90a", _knobs("sm_100a", 1, 128, 128,
                                                                                   "bf16", 0, True, True))
    # R = 256 fits where the budget allows it (2-CTA 256x128: the LoRA tile is split across the pair)
    assert fam.invalid_reason("sm_100a", _knobs("sm_100a", 2, 256, 128, "bf16", 256, True, True)) is None


def test_family_contract_and_registry():
    check_family(fam, where="svdq_kernels.sm100_gemm_w4a4")
    for arch in ("sm_100a", "sm_103a"):
        assert registry.family("gemm_w4a4", arch) is fam
    assert not set(fam.TUNING) & set(GEMM_W4A4.feature_names)
    assert fam.requirements("sm_100a", _knobs("sm_100a", 2, 256, 128, "bf16", 0, True, True)) == \
        {"n_multiple": 128, "k_multiple": 256}


def _random_args(rng, req):
    return O.random_launch_args(rng, GEMM_W4A4, req, ms=[1, 77, 128, 129, 255, 257, 4592, 4608], m_hi=1 << 15,
                                nk_hi=120, sm_counts=[1, 2, 7, 78, 114, 132, 148, 160])


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[_id(c) for c in (CASES[0], CASES[2], CASES[4])])
def test_launch_bytes_are_bit_exact_with_the_dsl(compiled, case):
    name, knobs, ck, path, program, sizes = compiled[case]
    req = fam.requirements(case[0], knobs)
    cs = knobs["cta_group"]
    rng = random.Random(0x5100 + cs)
    ptr_idx = [i for i, (_, kind) in enumerate(GEMM_W4A4.host_args) if kind in ("ptr", "stream")]
    cache = LaunchPlanCache(program, ptr_idx, sizes)
    names = GEMM_W4A4.arg_names
    for _ in range(10):
        args = _random_args(rng, req)
        a = dict(zip(names, args))
        vm = program.launch(args, sizes)
        dsl = O.dsl_oracle_launch(ck.compiled, args, sizes)
        amask, pmask = O.defined_mask(program, args, sizes)
        diffs = O.compare_records(vm, dsl, amask, pmask)
        assert not diffs, f"interpreter differs from the DSL's host code for {a}: {diffs[:3]}"
        got = cache.get(args)
        rec = got.record() if isinstance(got, CachedLaunch) else got
        assert rec == vm, a
        # the persistent grid comes from the launch-time SM count
        tiles = -(-a["m"] // knobs["tile_m"]) * (a["n"] // knobs["tile_n"])
        assert vm.grid == (plan.persistent_clusters(a["sm_count"], cs, tiles) * cs, 1, 1), (a, vm.grid)
        assert vm.block == (192, 1, 1)
        assert vm.smem == ck.smem_bytes

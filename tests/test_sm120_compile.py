"""Cross-compile sm_120a / sm_121a W4A4 GEMM variants on the CPU and check them statically (needs the DSL).

Per variant: ELF arch, kernel symbol, registers <= 255 and no stack frame, static + dynamic SMEM within
sm_120's per-block limit (from the DSL's arch table) and equal to the family's budget, SASS with
exactly the expected number of block-scaled FP4 MMAs (``OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X``) and
of f16/bf16 ``HMMA`` (only when R > 0), TMA loads, ``ldmatrix``, no local memory.  The LoRA tiled MMA
gives every thread the same accumulator coordinates as the block-scaled one.  Launch bytes (interpreter
and pointer-patching cache) bit-exact against the DSL's own host code, with the persistent grid
following the launch-time SM count.  Nothing here runs on a GPU; no such GPU was available.
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
import sm120_static as S  # noqa: E402
from kernel_checks import compile_gemm_cases, dump_sass, elf_sm  # noqa: E402

from svdq_aot.family import check_family  # noqa: E402
from svdq_kernels import registry  # noqa: E402
from svdq_kernels import sm120_gemm_w4a4 as fam  # noqa: E402
from svdq_loader.cubin_info import cubin_info  # noqa: E402
from svdq_loader.launch_plan import CachedLaunch, LaunchPlanCache  # noqa: E402
from svdq_loader.ops import GEMM_W4A4  # noqa: E402

SM = {"sm_120a": 120, "sm_121a": 121}

# (arch, tile_k, out_dtype, rank, wcscale, bias): both archs, both k depths, both dtypes, R in {0,16,48,128}
CASES = [
    ("sm_120a", 128, "bf16", 32, True, True),
    ("sm_120a", 256, "fp16", 0, False, True),
    ("sm_120a", 128, "fp16", 128, True, False),
    ("sm_121a", 128, "bf16", 0, True, True),
    ("sm_121a", 256, "bf16", 48, False, False),
    ("sm_121a", 128, "fp16", 16, True, True),
]


def _id(c):
    return f"{c[0]}-k{c[1]}-{c[2]}-r{c[3]}-wc{int(c[4])}-b{int(c[5])}"


def _knobs(arch, tk, dt, r, wc, b, stages="auto"):
    return fam.resolve(arch, dict(out_dtype=dt, rank=r, wcscale=wc, bias=b, scale_layout="blocked",
                                  tile_m=128, tile_n=128, tile_k=tk, stages=stages))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_gemm_cases(fam, CASES, _knobs, _id, tmp_path_factory)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_variant_statically(compiled, case):
    arch, tk, dt, r = case[:4]
    name, knobs, ck, path, program, sizes = compiled[case]
    info = cubin_info(ck.cubin)
    assert elf_sm(info) == SM[arch], f"cubin e_flags {info.e_flags:#x} is not {arch}"
    assert ck.kernel_symbols == [f"{name}_0"] and "cutlass" not in name
    (sym,) = ck.kernel_symbols
    ru = ck.resource_usage[sym]
    assert ru["registers"] <= 255 and ru["stack_frame_bytes"] == 0, ru
    # SMEM: the struct the kernel allocates is the budget; static SMEM is what the limit assumes
    static = info.kernels[sym].static_smem
    assert static == fam.STATIC_SMEM_BYTES, f"static SMEM {static} B, the budget assumes {fam.STATIC_SMEM_BYTES}"
    assert ck.smem_bytes == fam.budget(arch, knobs)["total_bytes"]
    assert ck.smem_bytes + static <= 101376, "more than sm_120's 99 KiB per block"
    assert knobs["stages"] == {128: 5, 256: 2}[tk], knobs       # the deepest ring that fits 99 KiB
    sass = dump_sass(path)
    if sass is None:
        if os.environ.get("SVDQ_ALLOW_NO_SASS") == "1":
            pytest.skip("cuobjdump / nvdisasm not available (SVDQ_ALLOW_NO_SASS=1)")
        pytest.fail("cuobjdump / nvdisasm not found: install the test extra or set SVDQ_ALLOW_NO_SASS=1")
    res = {s: dict(r_, static_smem=info.kernels[s].static_smem) for s, r_ in ck.resource_usage.items()}
    assert S.variant_problems("gemm_w4a4", knobs, sass, res, ck.smem_bytes) == []
    # the counts the checker wants, spelled out: 2 m-atoms x 8 n-atoms per 64-k block, 16 HMMA per 16 of R
    assert len(S.OMMA.findall(sass)) == 2 * 8 * (tk // 64) and len(S.HMMA.findall(sass)) == r
    assert all((form == ".BF16") == (dt == "bf16") for form in S.HMMA.findall(sass))


def test_the_static_checker_can_fail(compiled):
    name, knobs, ck, path, program, sizes = compiled[CASES[0]]
    sass = dump_sass(path)
    if sass is None:
        pytest.skip("cuobjdump / nvdisasm not available")
    res = {s: dict(r_, static_smem=1024) for s, r_ in ck.resource_usage.items()}
    one_omma = S.OMMA.search(sass).group(0)
    cases = {
        "block-scaled OMMA": sass.replace(one_omma, "NOP", 1),
        "HMMA": re.sub(r"\bHMMA\.16816\.F32\.BF16\b", "NOP", sass, count=1),
        "local-memory": sass + "\n        STL [R1], R2 ;",
        "no TMA loads": re.sub(r"\bUTMALDG\.[23]D\b", "NOP", sass),
    }
    for words, bad in cases.items():
        got = S.variant_problems("gemm_w4a4", knobs, bad, res, ck.smem_bytes)
        assert got and any(words in p for p in got), (words, got)
    assert any("registers" in p for p in S.variant_problems(
        "gemm_w4a4", knobs, sass, {"k": dict(registers=256, stack_frame_bytes=0)}, ck.smem_bytes))
    assert any("per block" in p for p in S.variant_problems("gemm_w4a4", knobs, sass, res, 100353))
    assert any("HMMA" in p for p in S.variant_problems("gemm_w4a4", dict(knobs, rank=0), sass, res, ck.smem_bytes))


def test_lora_mma_shares_the_accumulator_layout():
    """Every thread's accumulator element i is the same (row, col) in both tiled MMAs."""
    import cutlass.cute as cute
    for arch in fam.ARCHS:
        cfg = fam._cfg_of(_knobs(arch, 128, "bf16", 32, True, True))

        def coords():
            main, lora = fam._tiled_mmas(cfg)
            c = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
            out = []
            for t in range(0, 256, 5):
                a, b = main.get_slice(t).partition_C(c), lora.get_slice(t).partition_C(c)
                out.append(([a[i] for i in range(cute.size(a))], [b[i] for i in range(cute.size(b))]))
            return out

        pairs = fam._in_mlir(arch, coords)
        seen = set()
        for a, b in pairs:
            assert a == b and len(a) == 64
            seen.update(a)
        assert len(seen) == 52 * 64                   # distinct elements: the threads cover disjoint parts


def test_variants_that_do_not_fit_are_rejected_with_numbers():
    for arch in fam.ARCHS:
        k = _knobs(arch, 128, "bf16", 32, True, True, stages=6)
        msg = fam.invalid_reason(arch, k)
        assert msg == (f"needs 111616 B of SMEM (6 stages x 18432 B: A 8192, B 8192, SFA 1024, SFB 1024; "
                       f"+ 1024 B barriers), more than the 100352 B of dynamic SMEM an {arch} CTA may use "
                       f"(101376 B per block - 1024 B static)"), msg
        assert fam.invalid_reason(arch, dict(k, stages=5)) is None
        assert "3 stages x 36864 B" in fam.invalid_reason(arch, _knobs(arch, 256, "bf16", 0, True, True, stages=3))
        assert fam.invalid_reason(arch, _knobs(arch, 256, "bf16", 0, True, True, stages=2)) is None
    base = _knobs("sm_120a", 128, "bf16", 32, True, True)
    assert "tile_n 256 not supported" in fam.invalid_reason("sm_120a", dict(base, tile_n=256))
    assert "scale_layout 'logical' not supported" in fam.invalid_reason("sm_120a", dict(base, scale_layout="logical"))
    assert "rank 24 not supported" in fam.invalid_reason("sm_120a", dict(base, rank=24))
    assert "not built by sm120_gemm_w4a4" in fam.invalid_reason("sm_90a", base)
    with pytest.raises(ValueError, match="111616 B"):
        fam.compile("sm_120a", dict(base, stages=6), "svdq_gemm_bad", "/tmp/svdq_sm120_bad")


def test_smem_limit_comes_from_the_dsl_arch_table():
    from cutlass.cutlass_dsl import SMEM_CAPACITY_MAP
    for arch in fam.ARCHS:
        assert fam.smem_limit_bytes(arch) == SMEM_CAPACITY_MAP[arch[:-1]] - fam.STATIC_SMEM_BYTES == 100352


def test_family_contract_registry_and_config_axes():
    check_family(fam, where="svdq_kernels.sm120_gemm_w4a4")
    for arch in ("sm_120a", "sm_121a"):
        assert registry.family("gemm_w4a4", arch) is fam
        assert registry.family("quantize_act", arch).NAME == "quantize_act"
    assert not set(fam.TUNING) & set(GEMM_W4A4.feature_names)
    assert fam.requirements("sm_120a", _knobs("sm_120a", 256, "bf16", 0, True, True)) == \
        {"n_multiple": 128, "k_multiple": 256}
    tunings, problems = fam.config_axes("sm_120a", {})
    assert problems == [] and tunings == [dict(tile_m=128, tile_n=128, tile_k=128, stages="auto")]
    tunings, problems = fam.config_axes("sm_121a", {"tiles": [[128, 128, 128], [128, 128, 256]], "stages": [2, 3]})
    assert problems == [] and len(tunings) == 4
    _, problems = fam.config_axes("sm_120a", {"tiles": [[128, 128]], "stages": [0, "auto", "auto"], "x": 1})
    assert any(p.startswith("tiles[0]") for p in problems) and any(p.startswith("stages[0]") for p in problems)
    assert any("duplicate" in p for p in problems) and any(p.startswith("x: unknown key") for p in problems)


def _random_args(rng, req):
    # sm_counts: DGX Spark .. RTX PRO 6000 and others
    return O.random_launch_args(rng, GEMM_W4A4, req, ms=[1, 77, 128, 129, 255, 257, 4592, 4608], m_hi=1 << 15,
                                nk_hi=120, sm_counts=[1, 2, 20, 48, 84, 170, 188])


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[_id(CASES[0]), _id(CASES[4])])
def test_launch_bytes_are_bit_exact_with_the_dsl(compiled, case):
    name, knobs, ck, path, program, sizes = compiled[case]
    req = fam.requirements(case[0], knobs)
    rng = random.Random(0x120 + case[1])
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
        assert (got.record() if isinstance(got, CachedLaunch) else got) == vm, a
        tiles = -(-a["m"] // 128) * (a["n"] // 128)
        assert vm.grid == (max(1, min(a["sm_count"], tiles)), 1, 1), (a, vm.grid)
        assert vm.block == (fam.THREADS, 1, 1) == (288, 1, 1)
        assert vm.smem == ck.smem_bytes

"""Build-time launch recipes of both operators' real kernels, bit-exact against the DSL's own host code.

For each op, a variant is compiled through the registry, its recipe is
derived by the build's own entry point (`derive_for_op`), and for random
valid problems and pointers the recipe's launch must equal the DSL's compiled
host code run on the CPU (CUDA runtime stubbed; defined bytes only) and the
host-program interpreter byte for byte.  CPU only; needs the DSL.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile

import pytest

pytest.importorskip("cutlass")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_oracle as O  # noqa: E402

from svdq_aot.derive_recipe import derive_for_op  # noqa: E402
from svdq_aot.host_ir import serialize_host  # noqa: E402
from svdq_kernels import registry  # noqa: E402
from svdq_loader.cubin_info import kernel_params, param_sizes  # noqa: E402
from svdq_loader.hostvm import HostProgram  # noqa: E402
from svdq_loader.launch_recipe import LaunchRecipe  # noqa: E402
from svdq_loader.ops import op_spec  # noqa: E402

#: the sm_90a GEMM knobs every case shares (features, then tuning); each case names what it changes
_SM90 = dict(out_dtype="bf16", rank=32, wcscale=True, bias=True, scale_layout="logical", tile_m=128, tile_n=128,
             tile_k=64, stages=4, prefetch=2, skip_pad=True, act_decode="prmt", schedule="ws", wsets=2, act_source="nvfp4")
CASES = {
    "gemm_w4a4": ("sm_90a", dict(_SM90, prefetch=1, skip_pad=False, act_decode="shift", schedule="coop")),
    # the warp-specialised form configs/flux.yaml builds for M <= 256 (384 threads, min_blocks_per_mp 1)
    "gemm_w4a4@ws": ("sm_90a", dict(_SM90, out_dtype="fp16")),
    # the 64-row tile with four weight sets, unrolled by four (configs/flux.yaml's M <= 64 form)
    "gemm_w4a4@ws64": ("sm_90a", dict(_SM90, rank=16, tile_m=64, wsets=4)),
    # split K: one tile per cluster of four CTAs (float64-checked on the H200, session 5)
    "gemm_w4a4@splitk": ("sm_90a", dict(_SM90, schedule="ws_splitk4")),
    # the images form: one producer thread bulk-copies decode_act's stage images (configs/flux.yaml, M > 256)
    "gemm_w4a4@images": ("sm_90a", dict(_SM90, tile_m=256, prefetch=1, act_source="images")),
    # the 208-row images tile (configs/flux.yaml, M = 1024 and 2048): its grid min(ceil(M/208) x N/128, SMs) comes
    # from the family's recipe hint (without it the loader interpreted the host program once per new shape)
    "gemm_w4a4@images208": ("sm_90a", dict(_SM90, tile_m=208, prefetch=1, act_source="images", wsets=4)),
    # the 216-row images tile (an experiment, configs/sm90_rows216.yaml): the same hint at 216 rows
    "gemm_w4a4@images216": ("sm_90a", dict(_SM90, tile_m=216, prefetch=1, act_source="images", wsets=4)),
    # the stream-K schedule (an experiment, configs/sm90_streamk.yaml): grid min(units, SMs), also from a hint
    "gemm_w4a4@streamk": ("sm_90a", dict(_SM90, tile_m=64, prefetch=1, act_source="images", wsets=4,
                                         schedule="ws_streamk")),
    # the gemv form (M <= 16): its launch-time split comes from the family's recipe hint
    "gemm_w4a4@gemv": ("sm_90a", dict(_SM90, tile_m=16, prefetch=1, schedule="gemv")),
    "decode_act": ("sm_90a", dict(scale_layout="logical")),
    "quantize_act": ("sm_90a", dict(dtype="bf16", rank=32, scale_layout="logical", warps=4, mtiles=1)),
    # GeForce/workstation Blackwell: blocked scale layout, the 2-warp variant configs/flux.yaml builds
    "quantize_act@sm_121a": ("sm_121a", dict(dtype="fp16", rank=32, scale_layout="blocked", warps=2, mtiles=1)),
}
_BUILT: dict = {}


def _built(case):
    op = case.split("@")[0]
    if case not in _BUILT:
        arch, knobs = CASES[case]
        fam = registry.family(op, arch)
        req = fam.requirements(arch, knobs)
        name = op_spec(op).name_for(arch, knobs, req)
        with tempfile.TemporaryDirectory() as d:
            ck = fam.compile(arch, knobs, name, d)
        host = json.loads(json.dumps(serialize_host(ck.compiled)))
        params = {s: tuple(tuple(p) for p in ps) for s, ps in kernel_params(ck.cubin).items()}
        recipe = derive_for_op(op_spec(op), host, params, req, tuple(ck.recipe_hints))   # as the build does
        _BUILT[case] = (ck, HostProgram.from_dict(host), param_sizes(ck.cubin), req, recipe)
    return _BUILT[case]


def _random_args(op, req, rng):
    return O.random_launch_args(rng, op_spec(op), req, ms=[1, 77, 128, 129, 4592, 4608], m_hi=1 << 16, nk_hi=400,
                                sm_counts=[78, 114, 132, 148], null_rate=0.15)


#: cases whose launch a recipe cannot express over a wider box than the build's (m < 2^24, n < 2^20: the four-way
#: split's grid, 4 x ceil(m/128) x (n/128), wraps 32 bits at its corner), so the loader would interpret the host
#: program there (per-shape cached)
NO_RECIPE = {"gemm_w4a4@splitk": "grid[0]"}
_WIDE_BOX = {"m": (1, 1 << 24), "n": (1, 1 << 20), "k": (1, 1 << 20)}


@pytest.mark.parametrize("case", sorted(NO_RECIPE))
def test_cases_without_a_recipe_fall_back_to_the_interpreter(case, monkeypatch):
    """Over the wide box the build's recipe derivation refuses, naming the field; the interpreter's launch is
    what the DSL's host code does (``test_launch_abi.py`` checks that for the split-K form).  Over the build's
    own box (DIM_LIMITS) the same variant gets a recipe (the bit-exact test below)."""
    import svdq_aot.derive_recipe as D
    ck, _, _, req, recipe_doc = _built(case)
    assert recipe_doc is not None
    reasons = []
    real = D.derive_recipe
    monkeypatch.setattr(D, "derive_recipe", lambda *a, **kw: (lambda r: reasons.append(r[1]) or r)(real(*a, **kw)))
    monkeypatch.setattr(D, "DIM_LIMITS", _WIDE_BOX)
    host = json.loads(json.dumps(serialize_host(ck.compiled)))
    params = {s: tuple(tuple(p) for p in ps) for s, ps in kernel_params(ck.cubin).items()}
    assert derive_for_op(op_spec(case.split("@")[0]), host, params, req) is None
    assert len(reasons) == 1 and reasons[0].startswith(NO_RECIPE[case]), reasons


@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_exists_and_is_bit_exact_with_the_dsl(case):
    op = case.split("@")[0]
    ck, program, sizes, req, recipe_doc = _built(case)
    assert recipe_doc is not None, f"{op}: no recipe derived (the loader would interpret every new shape)"
    recipe = LaunchRecipe.from_dict(recipe_doc)
    rng = random.Random(0xA11 + len(op))
    checked = 0
    for _ in range(12):
        args = _random_args(op, req, rng)
        b = recipe.bind([args[i] for i in recipe.scalar_args])
        assert b is not None, f"{op}: the recipe does not cover {args}"
        ptrs = [args[i] for i in recipe.ptr_args]
        if not b.usable(ptrs):            # a null the recipe was not verified for: the interpreter's job
            continue
        got = b.record(ptrs)
        assert got == program.launch(args, sizes), f"{op}: recipe differs from the interpreter for {args}"
        dsl = O.dsl_oracle_launch(ck.compiled, args, sizes)
        amask, pmask = O.defined_mask(program, args, sizes)
        diffs = O.compare_records(got, dsl, amask, pmask)
        assert not diffs, f"{op}: recipe differs from the DSL's host code for {args}: {diffs[:3]}"
        checked += 1
    assert checked >= 6


#: the ops whose kernels let their dependents launch early (griddepcontrol.launch_dependents at the top): each feeds
#: the next kernel of a W4A4 linear (quantize_act -> decode_act or the GEMM, decode_act -> the images GEMM)
_TRIGGERS = {"quantize_act", "decode_act"}
_GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LDGSTS|UBLKCP|UTMALDG|ATOMG|RED)\b")


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_kernel_is_a_programmatic_dependent_that_waits_before_touching_memory(case, tmp_path):
    """PDL (docs/design.md, section 6): each kernel here is launched with the programmatic-serialization attribute
    (id 6) set to 1, so it may start while the previous grid on the stream drains; its one griddepcontrol.wait
    (SASS ACQBULK) comes before its first global-memory instruction, so any predecessor's writes are visible to
    it, whatever kernel that predecessor is."""
    from kernel_checks import sass_of_cubin
    op = case.split("@")[0]
    ck, program, sizes, req, _ = _built(case)
    args = _random_args(op, req, random.Random(7))
    attrs = dict(program.launch(args, sizes).attrs)
    assert 6 in attrs, f"{case}: the host code sets no programmatic-serialization attribute"
    assert int.from_bytes(attrs[6][:4], "little") == 1, case
    sass = sass_of_cubin(ck.cubin, tmp_path)
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    waits = [i for i, ln in enumerate(lines) if re.search(r"\bACQBULK\b", ln)]
    first_global = next(i for i, ln in enumerate(lines) if _GLOBAL_ACCESS.search(ln))
    assert len(waits) == 1 and waits[0] < first_global, (case, waits, first_global, lines[first_global])
    assert ("PREEXIT" in sass) == (op in _TRIGGERS), case

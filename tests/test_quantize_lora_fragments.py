"""The quantize_act experiment build ``SVDQ_KERNEL_QUANT_LORA=rk`` / ``rk3`` (docs/PERF.md, session 57): lora_down in
the mma fragment order, loaded straight into the A registers.  Its layout checked against the PTX definition of the
``mma.m16n8k16`` fragments (a simulated MMA), its plan (SMEM, occupancy hint, the ring form refused), its kernel (no
ldmatrix, no lora_down copies, a shorter step loop), and the library's refusal to call such a build with lora_down.
No GPU needed; whether the form is faster is measured on the device only."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from svdq_kernels import quantize_plan as plan  # noqa: E402
from svdq_loader.ops import quantize_act  # noqa: E402


def _mma_product(frags, xh, rank):
    """lora_act_in^T [R, 16] of one 64-k step, as the kernel's MMAs compute it from `frags` (one step of
    `lora_fragments`, [R / 16][4][32 lanes][8] values) and the 16 rows of x̂ [16, 64], simulating each
    ``mma.m16n8k16`` from its fragments as the PTX ISA places them: lane (g, t)'s A registers a0..a3 hold
    A[g][2t + e], A[g + 8][2t + e], A[g][2t + 8 + e], A[g + 8][2t + 8 + e] (e = 0, 1: low half, high half), its B
    registers b0, b1 hold B[2t + e][g], B[2t + 8 + e][g].  B is the kernel's own x̂ words: for block j, word 2j
    (k = 16t + 4j + e) and word 2j + 1 (k = 16t + 4j + 2 + e) of the lane's row."""
    out = torch.zeros(rank, 16, dtype=torch.float64)
    for rt in range(rank // 16):
        for j in range(4):
            a = torch.empty(16, 16, dtype=torch.float64)
            for lane in range(32):
                g, t = divmod(lane, 4)
                v = frags[rt, j, lane]
                for e in range(2):
                    a[g, 2 * t + e] = v[e]
                    a[g + 8, 2 * t + e] = v[2 + e]
                    a[g, 2 * t + 8 + e] = v[4 + e]
                    a[g + 8, 2 * t + 8 + e] = v[6 + e]
            for q in range(2):                               # n8 block q: rows 8q .. 8q + 7
                b = torch.empty(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for e in range(2):
                        b[2 * t + e, g] = xh[8 * q + g, 16 * t + 4 * j + e]
                        b[2 * t + 8 + e, g] = xh[8 * q + g, 16 * t + 4 * j + 2 + e]
                out[16 * rt:16 * rt + 16, 8 * q:8 * q + 8] += a @ b
    return out


@pytest.mark.parametrize("rank", [16, 32])
def test_lora_fragments_feed_the_mma_the_lora_down_product(rank):
    """Fresh random integers (exact in float64): the simulated MMAs over each step's fragments add up to
    x̂ @ lora_down, step by step and over K; and each lane's 16 bytes are its rows and k as the layout states."""
    g = torch.Generator().manual_seed(rank)
    k = 192
    lora = torch.randint(-50, 51, (k, rank), generator=g).to(torch.float64)
    xh = torch.randint(-50, 51, (16, k), generator=g).to(torch.float64)
    frags = quantize_act.lora_fragments(lora)
    assert frags.is_contiguous() and frags.numel() == k * rank
    frags = frags.reshape(k // 64, rank // 16, 4, 32, 8)
    total = torch.zeros(rank, 16, dtype=torch.float64)
    for s in range(k // 64):
        part = _mma_product(frags[s], xh[:, 64 * s:64 * s + 64], rank)
        assert torch.equal(part, (xh[:, 64 * s:64 * s + 64] @ lora[64 * s:64 * s + 64]).T), s
        total += part
    assert torch.equal(total, (xh @ lora).T)
    # the docstring's statement, element by element, for one block
    s, rt, j = 2, rank // 16 - 1, 3
    for lane in (0, 5, 31):
        gg, t = divmod(lane, 4)
        r, kk = 16 * rt + gg, 64 * s + 16 * t + 4 * j
        want = [lora[kk, r], lora[kk + 1, r], lora[kk, r + 8], lora[kk + 1, r + 8],
                lora[kk + 2, r], lora[kk + 3, r], lora[kk + 2, r + 8], lora[kk + 3, r + 8]]
        assert frags[s, rt, j, lane].tolist() == [float(w) for w in want]


def _knobs(rank, dtype="bf16"):
    return dict(dtype=dtype, rank=rank, scale_layout="logical", warps=4, mtiles=1)


def test_the_switch_plans_no_lora_tiles(monkeypatch):
    """Unset (or ``tile``): the shipped plan.  ``rk`` / ``rk3``: a LoRA warp's SMEM is its reciprocals and the LoRA
    epilogue's sums only; ``rk3`` sets the 3-CTA hint; the ring form (rank 96) is refused with the switch named;
    rank 0 is untouched; an unknown value is an error naming the allowed ones."""
    cfg = plan._cfg_of(_knobs(32))
    monkeypatch.delenv(plan.LORA_ENV, raising=False)
    shipped = (plan._smem_bytes(cfg), plan.min_ctas_per_sm(cfg, "sm_90a"))
    assert shipped == (4 * (128 + 2 * 64 * (2 * 32 + 16)), 1)
    monkeypatch.setenv(plan.LORA_ENV, "tile")
    assert (plan._smem_bytes(cfg), plan.min_ctas_per_sm(cfg, "sm_90a")) == shipped
    epi = 128 + 16 * 32 * 4 + 2 * 128 * 8                    # reciprocals, [16][32] fp32 sums, pair totals
    for form, hint in (("rk", 1), ("rk3", 3)):
        monkeypatch.setenv(plan.LORA_ENV, form)
        assert plan._smem_bytes(cfg) == 4 * epi == plan.smem_bytes_for(_knobs(32))
        assert plan.min_ctas_per_sm(cfg, "sm_90a") == hint
        assert plan._problem(cfg, "sm_90a") is None
        assert plan._smem_bytes(plan._cfg_of(_knobs(0))) == 4 * 128
        reason = plan._problem(plan._cfg_of(_knobs(96)), "sm_90a")
        assert reason and f"SVDQ_KERNEL_QUANT_LORA={form}" in reason and "ring form" in reason, reason
    monkeypatch.setenv(plan.LORA_ENV, "rk9")
    with pytest.raises(ValueError, match="tile, rk, rk3"):
        plan._smem_bytes(cfg)


def test_the_rk_kernel_reads_lora_down_into_registers(monkeypatch, tmp_path):
    """The rank-32 bf16 kernel under ``rk3``: no ldmatrix and no cp.async of lora_down tiles (the rank-0 kernel's x
    path has none either), one 16-byte load per A fragment, at most 168 registers (three 4-warp CTAs per SM) and no
    stack frame, a step loop shorter than the shipped kernel's (session 57: 425 -> 396-400 instructions), and the
    fragment loads in its first tenth, its MMAs in its last quarter."""
    pytest.importorskip("cutlass")
    from kernel_checks import dump_sass, instructions, loops
    from svdq_kernels import quantize_act as fam
    from svdq_loader.cubin_info import cubin_info
    from svdq_loader.ops import variant_name

    def build(d):
        knobs = _knobs(32)
        ck = fam.compile("sm_90a", knobs, variant_name("quantize_act", "sm_90a", knobs), str(d), keep_ptx=True)
        (d / "k.cubin").write_bytes(ck.cubin)
        return ck, str(d / "k.cubin")

    monkeypatch.delenv(plan.LORA_ENV, raising=False)
    (tmp_path / "tile").mkdir()
    base, base_path = build(tmp_path / "tile")
    monkeypatch.setenv(plan.LORA_ENV, "rk3")
    (tmp_path / "rk3").mkdir()
    ck, path = build(tmp_path / "rk3")
    assert "ldmatrix" in base.ptx and "ldmatrix" not in ck.ptx
    assert "cp.async.ca" in base.ptx and "cp.async.ca" not in ck.ptx and "cp.async.cg" not in ck.ptx
    info = next(iter(cubin_info(ck.cubin).kernels.values()))
    assert info.regcount <= 168 and not info.frame_size, info
    sass, base_sass = dump_sass(path), dump_sass(base_path)
    if sass is None or base_sass is None:
        pytest.skip("cuobjdump / nvdisasm not available")
    loop, base_loop = loops(instructions(sass))[0], loops(instructions(base_sass))[0]
    assert loop["hmma"] == base_loop["hmma"] == 16
    assert loop["instructions"] <= base_loop["instructions"] - 20, (loop, base_loop)
    body = [t for a, t in instructions(sass) if loop["start"] <= a <= loop["end"]]
    assert not any(t.split()[0].startswith(("LDSM", "LDGSTS")) for t in body)
    wide = [t for t in body if t.split()[0].startswith("LDG.E.128")]
    base_wide = [t for a, t in instructions(base_sass) if base_loop["start"] <= a <= base_loop["end"]
                 and t.split()[0].startswith("LDG.E.128")]
    assert len(wide) == len(base_wide) + 8, (len(wide), len(base_wide))     # + the 2 x 4 A fragments of a step
    # the loads stay at the top of the step and the MMAs at its end, so the step's code work hides their latency
    at = [i for i, t in enumerate(body) if t.split()[0].startswith("LDG.E.128")]
    mma = [i for i, t in enumerate(body) if t.split()[0].startswith("HMMA")]
    assert max(at) < len(body) // 10 and min(mma) > 3 * len(body) // 4, (at, mma, len(body))


def test_the_library_refuses_lora_calls_on_an_rk_build(monkeypatch, tmp_path):
    """A real ``rk3`` build (one rank-16 variant, on the CPU): `load()` accepts it, the manifest names the switch,
    and resolving a quantize_act problem with LoRA raises UnsupportedProblem naming the build and the switch before
    anything is loaded onto a GPU (the device facts are set by hand: this machine has none)."""
    pytest.importorskip("cutlass")
    import svdq_loader
    from svdq_aot.build import build
    from svdq_loader import select

    for name in [n for n in os.environ if n.startswith("SVDQ_KERNEL_")]:
        monkeypatch.delenv(name)
    cfg = tmp_path / "q.yaml"
    cfg.write_text("name: q\narchs: [sm_90a]\nout_dtypes: [bf16]\nranks: [16]\nwcscale: [true]\nbias: [true]\n"
                   "shapes:\n  s: {k: 128, n: 128}\nvariants:\n  sm_90a:\n    quantize_act: {}\n")
    monkeypatch.setenv(plan.LORA_ENV, "rk3")
    out = tmp_path / "rk3"
    build(cfg, out)
    lib = svdq_loader.load(str(out))
    assert lib.manifest.generator.kernel_switches == "SVDQ_KERNEL_QUANT_LORA=rk3"
    lib._arch[0], lib._sms[0] = "sm_90a", 132
    with pytest.raises(select.UnsupportedProblem, match="SVDQ_KERNEL_QUANT_LORA=rk3.*lora_down"):
        lib._resolve("quantize_act", 0, ("bf16", 16, "logical"), (("m", 16), ("k", 128)), False)
    assert not lib._launchers

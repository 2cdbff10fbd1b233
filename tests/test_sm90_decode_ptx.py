"""The sm_90a weight decode as the kernels run it: the PTX that `sm90_decode_ptx.wdecode_ptx` writes for each
form is interpreted here instruction by instruction and must give the bits the format module's terms give (which
tests/test_sm90_weight_format.py proves exact against float64), and each form compiles to the SASS it promises.
CPU only (cross-compile); the GPU side of the default ``mul`` form is the float64 GEMM tests on the H200
(docs/PERF.md, session 22)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

import numpy as np                                       # noqa: E402

from svdq_kernels import sm90_decode_ptx as ptx          # noqa: E402
from svdq_kernels import sm90_plan as plan               # noqa: E402
from svdq_kernels import sm90_wgmma_w4a4 as sm90         # noqa: E402
from svdq_loader.ops import GEMM_W4A4                     # noqa: E402
from svdq_loader.ops import sm90_weight_format as fmt    # noqa: E402

from kernel_checks import instructions, loops, sass_of_cubin   # noqa: E402
from test_kernel_compile import make_knobs                     # noqa: E402

ARCH = "sm_90a"
MASK32 = 0xFFFFFFFF


def _run_ptx(text: str, word: int) -> int:
    """Interpret the integer part of a `_wdecode` PTX block on one word: the 32-bit operand of its final
    ``mul.rn.f16x2`` (the fp16x2 bits before the scale)."""
    body = [ln.strip() for ln in text.strip("{}\n\t ").split("\n") if ln.strip()]
    assert body[0] == ".reg .b32 a, b;"
    regs = {"$1": word}

    def val(x):
        return regs[x] if x in regs else int(x, 0)
    for ln in body[1:]:
        m = re.fullmatch(r"(and\.b32|or\.b32|shl\.b32|mul\.lo\.u32|mul\.rn\.f16x2) (\$?\w+), (\$?\w+), (\$?\w+);", ln)
        assert m, f"unexpected instruction {ln!r}"
        op, d, a, b = m.groups()
        if op == "mul.rn.f16x2":
            assert (d, b) == ("$0", "$2")
            return regs[a]
        x, y = val(a), val(b)
        if op == "shl.b32":
            assert 0 <= y < 32
            regs[d] = (x << y) & MASK32
        else:
            regs[d] = {"and.b32": x & y, "or.b32": x | y, "mul.lo.u32": (x * y) & MASK32}[op]
    raise AssertionError("no mul.rn.f16x2")


@pytest.mark.parametrize("form", sorted(fmt.PAIR_DECODES))
def test_the_emitted_ptx_computes_the_format_s_terms(form):
    rng = np.random.default_rng(5)
    words = [0, MASK32, 0x8E008E00, 0x71FF71FF] + [int(w) for w in rng.integers(0, 1 << 32, 400)]
    for p in range(4):
        text = ptx.wdecode_ptx(p, form)
        for w in words:
            assert _run_ptx(text, w) == fmt.decode_pair_bits(w, p, form), (form, p, hex(w))


def test_the_shipped_form_is_the_default_and_its_ptx_is_unchanged():
    """The default build is the mul form, whose text is the one timed on the H200 (session 22); the shift form,
    still selectable with the switch, keeps the text of the builds before it."""
    assert ptx.WDECODE == "mul"
    mul = {0: "and.b32 a, $1, 0x10071007;\n\tmul.lo.u32 a, a, 520;\n\tand.b32 a, a, 0x8E008E00;",
           1: "and.b32 a, $1, 0x20382038;\n\tmul.lo.u32 a, a, 68;\n\tand.b32 a, a, 0x8E008E00;",
           2: "shl.b32 a, $1, 3;\n\tand.b32 a, a, 0x0E000E00;\n\tshl.b32 b, $1, 1;\n\tand.b32 b, b, 0x80008000;"
              "\n\tor.b32 a, a, b;",
           3: "shl.b32 a, $1, 0;\n\tand.b32 a, a, 0x8E008E00;"}
    for p in range(4):
        assert ptx.wdecode_ptx(p, "mul") == (
            "{\n\t.reg .b32 a, b;\n\t%s\n\tmul.rn.f16x2 $0, a, $2;\n\t}" % mul[p])
        assert ptx.wdecode_ptx(p, "shift") == (
            "{\n\t.reg .b32 a, b;\n\tshl.b32 a, $1, %d;\n\tand.b32 a, a, 0x0E000E00;\n\tshl.b32 b, $1, %d;\n\t"
            "and.b32 b, b, 0x80008000;\n\tor.b32 a, a, b;\n\tmul.rn.f16x2 $0, a, $2;\n\t}" % (9 - 3 * p, 3 - p))


def _knobs(**kw):
    return make_knobs("bf16", 32, stages=4, skip_pad=True, act_decode="prmt", **kw)


def _step_loop(knobs, form, tmp_path, monkeypatch):
    """Registers, the innermost loop holding MMAs, and its instructions, of `knobs` built with decode `form`."""
    monkeypatch.setattr(ptx, "WDECODE", form)
    name = GEMM_W4A4.name_for(ARCH, knobs, sm90.requirements(ARCH, knobs))
    ck = sm90.compile(ARCH, knobs, name, str(tmp_path / form))
    sym = ck.kernel_symbols[0]
    assert ck.resource_usage[sym]["stack_frame_bytes"] == 0
    sass = sass_of_cubin(ck.cubin, tmp_path)
    ins = instructions(sass)
    inner = min((lp for lp in loops(ins) if lp["hmma"]), key=lambda lp: lp["instructions"])
    body = [t for off, t in ins if inner["start"] <= off <= inner["end"]]
    return ck.resource_usage[sym]["registers"], inner, body


@pytest.mark.parametrize("knobs, words", [
    (_knobs(tile_m=16, tile_n=64, schedule="gemv"), 8),
    (_knobs(tile_m=64, tile_n=128, schedule="ws", wsets=8, act_source="images"), 32),
], ids=["gemv-16x64", "ws-64-images-wsets8"])
def test_the_multiply_form_compiles_to_three_fewer_instructions_per_weight_word(knobs, words, tmp_path, monkeypatch):
    """The loop decodes `words` weight words (8 per gemv phase; 4 per k-tile and warpgroup, 8 k-tiles deep, in
    the ws form).  With ``mul`` ptxas keeps one IMAD per multiplied pair (constants 2^9 + 2^3 and 2^6 + 2^2), and
    each k-block's scale pair converts without a shift or mask: three instructions fewer per word, with the same
    MMAs, the same conversions, no stack frame and (gemv) the same CTAs per SM."""
    regs_s, loop_s, body_s = _step_loop(knobs, "shift", tmp_path, monkeypatch)
    regs_m, loop_m, body_m = _step_loop(knobs, "mul", tmp_path, monkeypatch)
    assert loop_m["hmma"] == loop_s["hmma"] > 0
    assert regs_m <= regs_s + 4                      # ptxas' allocation moves by a few either way
    if knobs["schedule"] == "gemv":                  # and the gemv tile keeps its CTAs per SM
        assert plan.GEMV_LAYOUTS[(knobs["tile_m"], knobs["tile_n"])].fits_registers(regs_m)
    assert loop_s["instructions"] - loop_m["instructions"] == 3 * words, (loop_s, loop_m)

    def count(body, pattern):
        return sum(1 for t in body if re.search(pattern, t))
    assert count(body_s, r"\bIMAD R\d+, R\d+, (0x208|0x44), RZ") == 0
    assert count(body_m, r"\bIMAD R\d+, R\d+, (0x208|0x44), RZ") == 2 * words
    assert count(body_m, r"F2FP\.F16\.E4M3") == count(body_s, r"F2FP\.F16\.E4M3") > 0


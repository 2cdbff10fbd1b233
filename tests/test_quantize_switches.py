"""quantize_act's L1 experiment switches (``SVDQ_KERNEL_QUANT_XLOAD`` / ``_XCACHE`` / ``_LORACACHE`` / ``_MINCTAS``,
kernel_src/quantize_kernel.py; docs/PERF.md, sessions 53-54): the whole-sector x loads hand every lane its own
group (a replay of the plan's index functions over a warp), a build with every switch on shows each in its SASS,
the shipped build shows none, and a bad value is refused by name.  CPU only (the switched builds have not run yet)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from svdq_kernels import quantize_plan as plan

STEP_K = plan.STEP_K


def _lane_loads(g: int, t: int, sectors: bool, row_k: int = STEP_K) -> list[list[int]]:
    """Element indices (row * row_k + k) of the 8 words x 2 values each of lane (g, t)'s two loads of row g."""
    out = []
    for start in plan._x_loads(t, sectors):
        out.append([g * row_k + start + e for e in range(8)])
    return out


@pytest.mark.parametrize("sectors", [False, True])
def test_every_lane_ends_with_its_own_group(sectors):
    """After the loads (and, for sectors, the swap with lane t ^ 1), lane (g, t) holds k = [16t, 16t + 8) then
    [16t + 8, 16t + 16) of its row, in order: what the code work, the stores and the LoRA operand read."""
    held = {(g, t): _lane_loads(g, t, sectors) for g in range(8) for t in range(4)}
    select = lambda p, x, y: x if p else y              # noqa: E731
    # what each lane sends: _x_swap's argument to exchange, recorded lane by lane (a shuffle's inputs all exist
    # before any lane reads one)
    sent = {}
    for (g, t), (a, b) in held.items():
        plan._x_swap(bool(t & 1), a, b, lambda v, lane=(g, t): sent.setdefault(lane, v), select)
    for (g, t), (a, b) in held.items():
        if sectors:
            own0, own1 = plan._x_swap(bool(t & 1), a, b, lambda v, p=(g, t ^ 1): sent[p], select)
        else:
            own0, own1 = a, b
        assert own0 == [g * STEP_K + 16 * t + e for e in range(8)]
        assert own1 == [g * STEP_K + 16 * t + 8 + e for e in range(8)]


def test_a_wrong_swap_is_caught():
    """The replay above can fail: swapping the partner's words the other way round leaves odd lanes wrong."""
    a, b = _lane_loads(0, 1, True)
    pa, pb = _lane_loads(0, 0, True)
    own0, _ = plan._x_swap(True, a, b, lambda v: pa, lambda p, x, y: x if p else y)    # the partner's first load
    assert own0 != [16 + e for e in range(8)]


@pytest.mark.parametrize("sectors", [False, True])
def test_each_load_instruction_reads_whole_sectors_only_with_sectors(sectors):
    """One load instruction of the warp (32 lanes, 16 bytes each, rows g of 2-byte elements): with sectors every
    32-byte sector it touches is read whole; with halves every sector is read half, by the two instructions."""
    for which in range(2):
        touched: dict[int, int] = {}
        for g in range(8):
            for t in range(4):
                first = _lane_loads(g, t, sectors)[which][0] * 2       # byte address
                touched[first // 32] = touched.get(first // 32, 0) + 16
        assert set(touched.values()) == ({32} if sectors else {16})


def test_the_halves_form_is_the_shipped_index_arithmetic():
    assert [plan._x_loads(t, False) for t in range(4)] == [(16 * t, 16 * t + 8) for t in range(4)]


def _build(tmp_path, env_extra: dict, warps: int = 5) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        name: switches
        archs: [sm_90a]
        out_dtypes: [bf16]
        ranks: [32]
        wcscale: [true]
        bias: [true]
        shapes:
          k3072: {{k: 3072, n: 3072}}
        variants:
          sm_90a:
            quantize_act: {{warps: [{warps}]}}
        """))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SVDQ_KERNEL_")}
    env.update(env_extra, SVDQ_AOT_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "svdq_aot.cli", "build", str(cfg), "-o", str(out), "-j", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (cubin,) = [p for p in out.iterdir() if p.suffix == ".cubin"]
    return str(cubin)


def test_every_switch_shows_in_the_sass_and_the_defaults_show_none(tmp_path):
    pytest.importorskip("cutlass")
    from kernel_checks import dump_sass
    from svdq_kernels.compiled_output import cubin_resource_usage
    on = _build(tmp_path / "on", {"SVDQ_KERNEL_QUANT_XLOAD": "sectors", "SVDQ_KERNEL_QUANT_XCACHE": "no_allocate",
                                  "SVDQ_KERNEL_QUANT_LORACACHE": "cg", "SVDQ_KERNEL_QUANT_MINCTAS": "3"})
    off = _build(tmp_path / "off", {})
    regs = {}
    for tag, path in (("on", on), ("off", off)):
        (use,) = cubin_resource_usage(open(path, "rb").read()).values()
        regs[tag] = use["registers"]
        assert use["stack_frame_bytes"] == 0
    # five warps at three CTAs per SM: at most 65536 / (3 x 160) registers (128 as allocated)
    assert regs["on"] <= 65536 // (3 * 160) and regs["off"] > 65536 // (3 * 160)
    sass_on, sass_off = dump_sass(on), dump_sass(off)
    if sass_on is None:
        pytest.skip("cuobjdump / nvdisasm not available")
    count = lambda pat, s: len(re.findall(pat, s))            # noqa: E731
    # x: 24 loads of 16 bytes (the prologue's and the step loops'), all L1::no_allocate with the switch
    assert count(r"LDG\.E\.NA\.128\.CONSTANT", sass_on) == count(r"LDG\.E\.128\.CONSTANT", sass_off) == 24
    assert count(r"LDG\.E\.NA", sass_off) == 0 and count(r"LDG\.E\.128\.CONSTANT", sass_on) == 0
    # lora_down: every 16-byte tile copy bypasses L1 with the switch, none without
    assert count(r"LDGSTS\.E\.BYPASS\.128", sass_on) == count(r"LDGSTS\.E\.128", sass_off) > 0
    assert count(r"LDGSTS\.E\.BYPASS", sass_off) == 0
    # sectors: one shuffle per word of a lane's two rows (8) in each of the four step-loop copies
    assert count(r"SHFL\.BFLY", sass_on) == 32 and count(r"SHFL", sass_off) == 0


@pytest.mark.parametrize("name, value", [("SVDQ_KERNEL_QUANT_XLOAD", "pairs"),
                                         ("SVDQ_KERNEL_QUANT_XCACHE", "evict_first"),
                                         ("SVDQ_KERNEL_QUANT_LORACACHE", "cs"),
                                         ("SVDQ_KERNEL_QUANT_MINCTAS", "9")])
def test_a_bad_switch_value_is_refused_by_name(name, value):
    pytest.importorskip("cutlass")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SVDQ_KERNEL_")}
    env[name] = value
    r = subprocess.run([sys.executable, "-c", "import svdq_kernels.quantize_kernel"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode != 0 and f"{name}={value!r}: must be one of" in r.stderr

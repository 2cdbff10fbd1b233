"""The sm_90a FP8-compute GEMM family (``sm90_wgmma_w4a4_fp8``, op ``gemm_w4a4_fp8``): knobs, the validity predicate,
selection, build.  CuTe-DSL at build time only.

The kernel is ``sm90_wgmma_kernel`` in its FP8-compute mode (``_Cfg.compute == "fp8"``): the warp-specialised images
schedule with E4M3 operands, ``wgmma.m64nNk32`` (E4M3 x E4M3 -> fp32), 128-k k-tiles.  The weight stays 4-bit
(``svdq_loader.ops.sm90_fp8_weight_format``: each value is rounded once to E4M3 in registers, its block scale and
the column's power of two ``rw`` folded in); the activations arrive as E4M3 stage images with ``1 / ra`` from the
``act_fp8`` pre-pass (``svdq_loader.ops.act_fp8``); the epilogue multiplies by ``wcscale / rw`` (the ``wcscale``
input in this mode, `prepare_weight`) and ``1 / ra``, then adds the LoRA (fp16 / bf16 wgmma, as in the exact mode)
and the bias.  The mode's numerics: docs/design.md section 2, ``svdq_loader.testing.fp8_reference``.

Ran on an H100 (session 27) and the H200 (session 28; docs/PERF.md): the selftest of every variant passed.  The fp16
forms add their accumulators into fp32 sums in SMEM every 1024 k (``sm90_plan.fp8_promotes``): unbroken, the FP8
tensor cores' accumulation missed fp16's tolerance from K = 12288 on (docs/design.md section 2).

Forms: the images ``ws`` tile of 128 to 256 activation rows by 128 weight rows, four stages, two or four (``wsets``)
raw weight sets, and where the MMA warps' raw weights come from (``weights``, `sm90_plan.FP8_WEIGHT_PATHS`): loaded
from global memory into registers (``regs``), or bulk-copied by the producer into the stages (``staged``).  The
register form above 128 rows is offered where it has run (208 rows up to rank 48, `_MAX_TILE_M`: session 27 measured
stack frames beyond, from the FP8 decode's eight weight words and four scale words per raw set); staged, 208-256 rows
build up to rank 80 (216 rows staged only).  `invalid_reason` says so.
"""
from __future__ import annotations

from typing import Optional

from svdq_loader.ops.decode_act import IMAGE_INNER_ROWS

from . import sm90_wgmma_w4a4 as exact
from .compiled_output import cubin_resource_usage, refuse_invalid
from . import sm90_plan
from .sm90_plan import FP8_TILE_K, SMEM_LIMIT_BYTES, _cfg_of, _problem, _smem_plan, k_unroll, threads_of
from .sm90_wgmma_kernel import _Sm90Wgmma

__all__ = ["OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES", "DEFAULT_FORMS", "config_axes", "resolve",
           "invalid_reason", "requirements", "compile", "threads_for", "smem_bytes_for", "cubin_resource_usage",
           "SMEM_LIMIT_BYTES", "SELECTION"]

OP = "gemm_w4a4_fp8"
ARCHS = ("sm_90a",)
NAME = "sm90_wgmma_w4a4_fp8"

#: The knobs a form may set (`config_axes`: tiles, stages); the others are the exact family's knobs, fixed here to
#: the one value the FP8-compute kernel has (`FIXED`).
TUNING: dict[str, tuple] = dict(
    # 216, 224 and 256: weights staged only (invalid_reason); 216 serves an M where its row tiles lie inside the
    # stage image (svdq_loader.ops.decode_act.IMAGE_INNER_ROWS)
    tile_m=(128, 208, 216, 224, 256),
    tile_n=(128,),
    tile_k=(FP8_TILE_K,),          # 128 k per stage: one 128-byte row of E4M3
    stages=(3, 4, 6),
    wsets=(2, 4),                  # raw weight sets in flight (k-tiles loaded ahead of their decode)
    weights=sm90_plan.FP8_WEIGHT_PATHS,   # where the MMA warps' raw weights come from (regs | staged | smem | lut)
    # whole tiles, or stream-K (equal ranges of (tile, 4-k-tile group) units; bf16 only: sm90_plan.FP8_SCHEDULES)
    schedule=sm90_plan.FP8_SCHEDULES,
    prefetch=(1,), skip_pad=(True,), act_decode=("prmt",), act_source=("images",),
)
FIXED = dict(prefetch=1, skip_pad=True, act_decode="prmt", act_source="images")
#: the knobs a form may set, beside tiles: their defaults
FORM_DEFAULTS = dict(wsets=2, weights="regs", schedule="ws")
FEATURE_VALUES: dict[str, tuple] = dict(
    out_dtype=("fp16", "bf16"),
    rank=(0, 16, 32, 48, 64, 80, 96, 112, 128),
    # the epilogue always multiplies by the wcscale input, which holds wcscale / rw in this mode (prepare_weight)
    wcscale=(True,),
    bias=(False, True),
    scale_layout=("logical",),
)
#: The register form's tile heights above 128 rows that have run on a GPU, per rank: 208 rows at ranks 0-48 (H100 and
#: H200, sessions 27-29).  Session 27 found stack frames beyond them; today's kernel (CPU, session 31, bf16) compiles
#: 208 and 216 rows without one at ranks 0-96, 224 at ranks 0-80 with two raw sets, and 256 rows spills at ranks 48,
#: 80 and 96 (and with four sets everywhere).  Those have not run, so the family keeps to this table.
_MAX_TILE_M = {0: 208, 16: 208, 32: 208, 48: 208}
#: with weights staged the 208-, 224- and 256-row tiles compile without a stack frame up to this rank (CPU,
#: session 29: ranks 0-80 at 224 and 256 rows; rank 96 keeps a frame at 208, 224 and 256)
_MAX_STAGED_RANK = 80
#: with weights lut (the tables beside the words) the 256-row tile does not build well at ranks 48-80 (CPU, session 32):
#: rank -> why; the staged 256-row form serves those ranks (DEFAULT_FORMS)
_LUT_256_REFUSED = {48: "a 32-byte stack frame", 80: "a 32-byte stack frame",
                    64: "four stages need more SMEM than an SM has (three would fit; staged builds four)"}

#: A grid-fill estimate (`svdq_loader.select_rules.Fill`: waves x per-CTA k-steps x tile area x factor), then the
#: deeper ring, the more raw weight sets, and the register form before the staged one.  The factors are the time per
#: 128 x 128 tile area of each tile height, relative to the 256-row one, fitted in session 29 (`tools/sm90_sweep.py
#: ... --compute fp8` at M = 256, 1024, 4608 on three FLUX shapes, on the H200 and again on an H100): 128 rows
#: 1.36-1.42 (1.29 at M = 1024, where the pre-pass weighs more), 208 rows 1.04-1.09, 224 rows 1.03-1.06.  With them
#: the rule picks the fastest measured tile height at all nine points of both runs (e.g. M = 4608, N = 3072: 224
#: rows, four waves of 504 tiles on 132 SMs; M = 1024: 208 rows at N = 3072, one wave of 120 tiles, and 256 rows at
#: N = 12288).  The 216-row tile costs 1.8 % more per row than the 224-row one (H100, session 31: 100.2 against 102.1
#: µs for four waves of each at M = 4608, K = N = 3072), so 1.07: the rule takes it at M = 4608 and N = 3072 (528
#: tiles, four whole waves), where it was the fastest height at all three K, and 256 rows at N >= 9216, as measured.
SELECTION = [
    {"m_max": None, "priority": 0, "prefer": [
        {"fill": {"tile": ["tile_m", "tile_n", "tile_k"], "ctas_per_sm": 1,
                  "factor": {"knob": "tile_m", "values": [[128, 1.4], [208, 1.06], [216, 1.07], [224, 1.05]]}}},
        {"knob": "stages", "order": "desc"}, {"knob": "wsets", "order": "desc"},
        # at one tile: regs (the 208-row form, faster than lut there at K >= 12288), then lut before staged (measured
        # faster at every tile it shares with staged, session 32)
        {"knob": "weights", "values": ["regs", "lut", "staged", "smem"]}]},
]


def _cfg(knobs: dict):
    return _cfg_of(knobs, "fp8")


def threads_for(knobs: dict) -> int:
    return threads_of(_cfg(knobs))


def smem_bytes_for(knobs: dict) -> int:
    return _smem_plan(_cfg(knobs))["total_bytes"]


#: What an empty section (``gemm_w4a4_fp8: {}``, or a config's ``compute: [exact, fp8]``) builds: the forms measured
#: fastest, each where it was (docs/PERF.md, sessions 28-29), which together serve every rank and dtype the family has.
DEFAULT_FORMS = (
    # four raw weight sets in flight: 2-5 % faster than two at the 128-row tile (H100, session 28)
    {"tiles": [[128, 128, 128]], "wsets": [4]},
    # fp16 at rank 128 keeps a stack frame with four sets (the promotion's fp32 sums): two serve it
    {"tiles": [[128, 128, 128]], "wsets": [2], "ranks": [128]},
    # four sets 1-4 % faster at 208 rows (H200 and H100, session 29); two for K a multiple of 256 only
    {"tiles": [[208, 128, 128]], "wsets": [2, 4]},
    # the producer bulk-copies the raw weights into the stages, so the taller tiles fit the MMA warps' registers: 5-12 %
    # faster than the 208-row tile at M = 4608 (H200, session 29); bf16 only (fp16's fp32 sums do not fit their SMEM).
    # 216 rows: whole waves at M = 4608, 1.3-2.0 % faster than 224 at all six FLUX shapes there (H100, session 31).
    # lut: the producer also writes the weights' byte tables, so the MMA warps decode a word by two byte permutes;
    # 1.1-3.0 % faster than staged at 216 rows and 2.6-7.6 % at 256 at all six M = 4608 shapes, no slower beyond
    # 0.4 % at M = 1024 (H100, session 32), and 1.6-3.9 % at 224 rows (H100, session 33).  lut wherever it has run
    # (`configs/sm90_fp8_lut.yaml`'s selftest, session 33: 216 and 224 rows at ranks 0-64, 256 rows at 0-32);
    # staged where lut is refused (256 rows at ranks 48-80) or has not run (rank 80).
    {"tiles": [[216, 128, 128], [224, 128, 128]], "wsets": [4], "weights": ["lut"], "ranks": [0, 16, 32, 48, 64]},
    {"tiles": [[256, 128, 128]], "wsets": [4], "weights": ["lut"], "ranks": [0, 16, 32]},
    {"tiles": [[216, 128, 128], [224, 128, 128]], "wsets": [4], "weights": ["staged"], "ranks": [80]},
    {"tiles": [[256, 128, 128]], "wsets": [4], "weights": ["staged"], "ranks": [48, 64, 80]},
)


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.sm_90a.gemm_w4a4_fp8`` -> knob dicts: ``tiles`` ([[tile_m, 128, 128], ...]), ``stages``
    ([auto | 3 | 4 | 6]), ``wsets`` ([2 | 4], default 2), ``weights`` ([regs | staged | smem | lut], default regs) and
    ``schedule`` ([ws | ws_streamk], default ws), or
    ``forms`` (a list of such sections, each may list ``ranks``), read as the exact family reads them: every
    combination of a form's values; every other knob is fixed (`FIXED`).  An empty section builds
    `DEFAULT_FORMS`."""
    problems: list[str] = []
    if not section:
        section = {"forms": [dict(f) for f in DEFAULT_FORMS]}
    if "forms" in section:
        forms = section["forms"]
        if set(section) - {"forms"}:
            problems.append(f"{', '.join(sorted(set(section) - {'forms'}))}: not allowed beside forms "
                            f"(put them inside each form)")
        if not isinstance(forms, list) or not forms or not all(isinstance(f, dict) for f in forms):
            return [], problems + [f"forms: {forms!r}: expected a non-empty list of mappings"]
    else:
        forms = [section]
        if "ranks" in section:
            problems.append("ranks: allowed inside forms only (a form built for some of the config's ranks)")
    for i, form in enumerate(forms):
        where = f"forms[{i}]." if "forms" in section else ""
        for key in sorted(set(form) - {"tiles", "stages", "ranks", *FORM_DEFAULTS}):
            problems.append(f"{where}{key}: unknown key (an FP8-compute form sets tiles, stages, "
                            f"{', '.join(FORM_DEFAULTS)} and ranks; "
                            f"fixed: {', '.join(f'{k} {v}' for k, v in FIXED.items())})")
    if problems:
        return [], problems

    def axes(form: dict, where: str) -> list[dict]:
        """One form's knob dicts: the exact family's product of its shared keys, times its ``weights``."""
        form = dict(form)
        paths = form.pop("weights", [FORM_DEFAULTS["weights"]])
        if (not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths)
                or len(set(paths)) != len(paths)):
            problems.append(f"{where}weights: {paths!r}: expected a non-empty list of distinct names "
                            f"({', '.join(sm90_plan.FP8_WEIGHT_PATHS)})")
            return []
        form = dict({k: [v] for k, v in FORM_DEFAULTS.items() if k != "weights"}, **form,
                    **{k: [v] for k, v in FIXED.items()})
        got, probs = exact.config_axes(arch, {"forms": [form]})
        problems.extend(p.replace("forms[0].", where) for p in probs)
        return [dict(g, weights=w) for g in got for w in paths]

    out: list[dict] = []
    for i, form in enumerate(forms):
        out += [g for g in axes(form, f"forms[{i}]." if "forms" in section else "") if g not in out]
    return out, problems


def resolve(arch: str, knobs: dict) -> dict:
    return exact.resolve(arch, knobs, invalid_reason)


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    from svdq_aot.family import table_reason
    problems = table_reason(NAME, ARCHS, arch, knobs, FEATURE_VALUES, TUNING)
    if problems:
        return problems
    rank, tm = int(knobs["rank"]), int(knobs["tile_m"])
    if tm == 128 and sm90_plan.FP8_BUFFERS == 3:
        return (f"tile_m 128 with SVDQ_KERNEL_SM90_FP8_BUFFERS=3 (an experiment build): a third weight fragment "
                f"buffer leaves the 128-row tile an 8-byte stack frame (measured on the CPU, session 27: ranks 32 and "
                f"128); the 208-row tile takes it at ranks 0-48")
    cfg = _cfg(knobs)
    if sm90_plan.fp8_promotes(cfg) and tm > 128 and cfg.stages < 4:
        return (f"tile_m {tm} with fp16 output at {cfg.stages} stages: at three stages the promotion to fp32 sums "
                f"keeps an 8-byte stack frame (measured on the CPU, session 28, at rank 32, where the sums' "
                f"{sm90_plan.promote_bytes(cfg)} B leave room for no more); four stages build at ranks 0, 16 and 48, "
                f"and the 128-row tile at every rank")
    if sm90_plan.fp8_promotes(cfg) and cfg.wsets > 2 and tm > 128 and rank > 0 and cfg.weights == "regs":
        return (f"wsets {cfg.wsets} with fp16 output at tile_m {tm} and rank {rank}: four raw weight sets beside the "
                f"promotion's and a LoRA chunk's registers spill (measured on the CPU, session 29: 56 bytes at rank "
                f"16, also rank 48; rank 0 builds); two sets build, and the 128-row tile takes four")
    if sm90_plan.STORE == "quads" and cfg.wsets > 2 and tm > 128 and rank >= 48 and cfg.weights == "regs":
        return (f"wsets {cfg.wsets} at tile_m {tm} and rank {rank} with weights regs: beside four raw weight sets "
                f"and a LoRA chunk, the quad output store's exchanged words spill (measured on the CPU, session 34: "
                f"56 bytes with bf16 output at tile_m 208, rank 48; SVDQ_KERNEL_SM90_STORE=pairs builds it); two sets "
                f"build, and the 128-row tile takes four")
    if sm90_plan.fp8_promotes(cfg) and cfg.wsets > 2 and rank >= 128:
        return (f"wsets {cfg.wsets} with fp16 output at rank {rank}: four raw weight sets beside the promotion and a "
                f"LoRA of two chunks keep an 8-byte stack frame (measured on the CPU, session 28: rank 128); two sets "
                f"build")
    if tm in IMAGE_INNER_ROWS and cfg.weights not in ("staged", "lut"):
        return (f"tile_m {tm} with weights {cfg.weights}: the {tm}-row tile is built with weights staged only (the "
                f"form it ran in, session 31; staged, the 224- and 256-row tiles ran 5-12 % faster than the 208-row "
                f"register form at M = 4608, session 29)")
    if tm > 128 and tm > _MAX_TILE_M.get(rank, 128) and cfg.weights == "regs":
        return (f"tile_m {tm} at rank {rank} with weights regs: not verified on a GPU (the register form above 128 "
                f"rows has run at 208 rows up to rank 48; session 27 measured a stack frame beyond, and where today's "
                f"kernel compiles without one, CPU session 31, it has not run); 128 rows build at every rank, and "
                f"with weights staged 208-256 rows up to rank {_MAX_STAGED_RANK}")
    if tm == 256 and rank in _LUT_256_REFUSED and cfg.weights == "lut":
        return (f"tile_m 256 at rank {rank} with weights lut: {_LUT_256_REFUSED[rank]} (measured on the CPU, session "
                f"32); weights staged build it, and lut builds 216 and 224 rows up to rank {_MAX_STAGED_RANK}")
    if tm > 128 and rank > _MAX_STAGED_RANK and cfg.weights in ("staged", "lut"):
        return (f"tile_m {tm} at rank {rank} with weights {cfg.weights}: {tm // 2} accumulators beside a LoRA of "
                f"more than {_MAX_STAGED_RANK} keep a stack frame (measured on the CPU, session 29: rank 96 at 208, "
                f"224 and 256 rows, session 31: 216 rows); the 128-row tile builds at every rank")
    return _problem(cfg)


def requirements(arch: str, knobs: dict) -> dict:
    """N: whole 128-row weight tiles; K: whole unrolled steps of two 128-k k-tiles."""
    return {"n_multiple": int(knobs["tile_n"]), "k_multiple": k_unroll(_cfg(knobs)) * FP8_TILE_K}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    refuse_invalid(name, invalid_reason(arch, knobs))
    cfg = _cfg(knobs)
    from svdq_loader.ops import GEMM_W4A4_FP8
    return exact.compile_gemm(_Sm90Wgmma, _Sm90Wgmma(cfg), GEMM_W4A4_FP8, cfg.out_dtype, arch, name, dump_dir,
                              keep_ptx, lambda ptx, usage, gemm: static_problem(ptx, usage))


#: the main loop's MMA: E4M3 x E4M3 into fp32 (SASS ``QGMMA…E4M3.E4M3``)
FP8_MMA_PTX = ".f32.e4m3.e4m3"


def static_problem(ptx: str, usage: dict) -> Optional[str]:
    """The exact family's checks (wgmma, the paired store, no stack frame) and the FP8 MMA in the main loop."""
    if not any("wgmma.mma_async" in line and FP8_MMA_PTX in line for line in ptx.splitlines()):
        return f"no wgmma.mma_async…{FP8_MMA_PTX} in the PTX (the main loop is not on the FP8 tensor cores)"
    return exact.static_problem(ptx, usage, "wgmma.mma_async", True)

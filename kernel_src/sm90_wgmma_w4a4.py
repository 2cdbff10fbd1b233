"""The sm_90a W4A4 GEMM family (``sm90_wgmma_w4a4``): knobs, the validity predicate, selection, build.

The kernel itself is ``sm90_wgmma_kernel`` (its docstring has the design: Yᵀ = W·Aᵀ on wgmma, the weight as
the register-sourced operand, exact activation decode into swizzled SMEM, the coop and ws schedules); the
budgets every rejection quotes are in ``sm90_plan``; the inline PTX decodes in ``sm90_decode_ptx``; the small-M form
(schedule ``gemv``, mma.sync) is its own kernel, ``sm90_gemv_kernel``.
CuTe-DSL at build time only.
"""
from __future__ import annotations

from typing import Optional

from cutlass import Float32, Uint8

from .compiled_output import compile_kernel, cubin_resource_usage, refuse_invalid, stack_frame_problem
from .sm90_plan import (DEFAULT_STAGES, DEFAULT_TILE, SMEM_LIMIT_BYTES, TILE_K, _cfg_of, _problem, _smem_plan,
                        is_gemv, k_unroll, ksplit_of, threads_of)
from .sm90_wgmma_kernel import _OUT_DTYPES, _Sm90Wgmma

__all__ = [
    "OP", "ARCHS", "NAME", "TUNING", "FEATURE_VALUES",
    "config_axes", "resolve", "invalid_reason", "requirements", "compile",
    "threads_for", "smem_bytes_for", "cubin_resource_usage", "SMEM_LIMIT_BYTES", "DEFAULT_TILE",
    "DEFAULT_STAGES", "SELECTION",
]

OP = "gemm_w4a4"
ARCHS = ("sm_90a",)
NAME = "sm90_wgmma_w4a4"

TUNING: dict[str, tuple] = dict(
    # activation rows per tile (the wgmma N extent); 64 only with a warp-specialised schedule or gemv (for M <= 64:
    # half the MMA work of the 128-row tile where most rows are padding)
    # 16: the gemv form only; 208, 216, 224: act_source images only (216 serves an M where its row tiles lie inside
    # the stage image, svdq_loader.ops.decode_act.tile_rows_problem)
    tile_m=(16, 64, 128, 208, 216, 224, 256),
    # weight rows per tile: two MMA warpgroups of tile_n/128 64-row wgmma atoms each.  256 only with
    # schedule ws (coop spilled: 8-byte stack frame at 255 registers, rank 64 and 128); 192: three MMA warpgroups of
    # one atom (ws, act_source images; run on an H100 in session 29, in configs/flux.yaml for M > 256)
    tile_n=(64, 128, 192, 256),   # 64: the gemv form only (one 64-row fragment block, 4 warps)
    tile_k=(64,),           # k per pipeline step (one 128-byte swizzle row of fp16)
    # activation SMEM stages.  `auto` takes the deepest of AUTO_STAGES that fits (3 and 4: the depths every shipped
    # form ran with); 6, 8 and 12 only where a config names them (an experiment, session 24; on an H100 in session 27
    # within +-3 % of four stages, not shipped: an images
    # producer can copy at most stages - 2 k-tiles ahead of the MMA warps, which at tile_m 64 is 16 KB in flight)
    stages=(3, 4, 6, 8, 12),
    # k-tiles of raw bytes in flight in registers: 1 = loaded one k-tile ahead (the measured kernel);
    # 2 = two register sets, loaded two k-tiles ahead (more latency cover, 11-16 more registers); 4 = four sets
    # (the ws producer that decodes NVFP4 only, its loop unrolled by four; 1-4 % faster at the 64-row tile's
    # 4-way split, session 17)
    prefetch=(1, 2, 4),
    # True: activation rows >= m are neither decoded nor stored (they only feed accumulator columns that
    # are never written; the default: 5-10 % faster at M <= 64, the same from M = 256 on, H200);
    # False: decoded with a zero scale
    skip_pad=(False, True),
    # activation E2M1 decode: "prmt" = two byte forms per 32-bit word, then one byte permute + one mask per
    # pair (the default: 10-20 % faster at every measured shape, H200); "shift" = shifts and masks per pair
    act_decode=("shift", "prmt"),
    # "coop": all 8 warps load, decode and issue wgmma, one CTA barrier per k-tile; "ws": warp-specialised,
    # one producer warpgroup decodes the activations into the SMEM stages (mbarrier full/empty ring) while two
    # consumer warpgroups decode their weight fragments and issue wgmma; setmaxnreg moves registers to them
    # "ws_splitk2" / "ws_splitk4": ws with one tile per cluster of 2 / 4 CTAs that split K, the partial sums
    # added through distributed SMEM (for small M, where N / 128 tiles leave most SMs idle; up to 2.9x faster
    # there on the H200, docs/PERF.md session 5)
    # "gemv": the small-M form (its own kernel, sm90_gemv_kernel): mma.sync warps that stream their weight through
    # a per-thread cp.async ring, with no producer / consumer handshake; K split over a cluster sized at launch
    # "ws_streamk" (an experiment, session 24; timed on an H100 in session 27, not shipped): ws, act_source images,
    # one CTA per SM over an equal range
    # of (tile, group of k-tiles) units, so every SM works where N / tile_n tiles leave some idle (M <= 256); a tile
    # split over CTAs meets in a workspace after the stage images (svdq_loader.ops.gemm_streamk)
    schedule=("coop", "ws", "ws_splitk2", "ws_splitk4", "gemv", "ws_streamk"),
    # ws*: raw weight register sets of the MMA warps, each loaded that many k-tiles before it is decoded (2:
    # the measured default; 4: 12 more registers, for small M, where a CTA's k-tile is shorter than the
    # weight load's latency over two k-tiles; 8: the 64-row tile, 1-4 % faster than 4 at M = 64, session 17)
    wsets=(2, 4, 8),
    # ws*: what the op's `act` pointer holds.  "nvfp4": the NVFP4 activations (act / ascales), decoded by the
    # producer warpgroup into the stages.  "images": the exact fp16 stage images the decode_act pass wrote
    # (its format: svdq_loader.ops.decode_act); one producer thread bulk-copies each k-tile's rows into its
    # stage, and the call runs decode_act first (the op spec's prepass), so the decode happens once per call
    # rather than once per weight tile.  Run on the H200 with every ws schedule at tile 128 and 256 (session 7;
    # the 256-row tile can split K only in this form: its producer does no decode, so it keeps no stack frame)
    act_source=("nvfp4", "images"),
)
#: the depths `stages: auto` chooses among (the deepest that fits)
AUTO_STAGES = (3, 4)
FEATURE_VALUES: dict[str, tuple] = dict(
    out_dtype=("fp16", "bf16"),
    rank=(0, 16, 32, 48, 64, 80, 96, 112, 128, 256),
    wcscale=(False, True),
    bias=(False, True),
    scale_layout=("logical",),
)

#: Selection rule (svdq_loader.select_rules).  First a grid-fill estimate on the device's SMs (one CTA per SM
#: for every form: 256-384 threads at up to 255 / 216 registers), fitted to the H200 sweep of session 5 in
#: docs/PERF.md (tools/sm90_sweep.py, M = 16 ... 1024, the three FLUX (K, N) of configs/sm90_ws.yaml): per
#: 64-k step a 256-row tile costs 0.86 x twice a 128-row one (0.85-0.87 measured at M = 256 and 1024), a
#: 64-row tile 0.83 x one 128-row tile (0.82-0.83 at M = 16 and 64, where both have the same CTAs), and
#: splitting K over 2 / 4 CTAs of a cluster costs 12 / 22 extra k-steps (the reduction and a second pipeline
#: fill, no persistence).  Session 5 fitted 7 / 11 to the 128-row forms alone; 12 / 22 keeps all 15 of its
#: shapes right and also picks the fastest form at all 12 shapes of session 7's sweep, whose 256-row split
#: forms pay a reduction twice as large (7 / 11 took the 4-way 256-row split at M = 1024, K = 12288: 0.54 x
#: cuBLAS against 0.72 unsplit).  The 224-row tile (images only) costs what the 256-row one does per row (session 11:
#: equal times at 8 against 7 waves, M = 9728, N = 3072, and at 16 against 14, M = 4608, N = 12288), so the
#: estimate takes it where its waves are fuller (M = 4608, N = 3072: 504 tiles are 3.8 waves, where 432 are 3.3;
#: M = 1024: 120 CTAs against 96), up to 13 % faster there.  The 208-row tile too (session 13: 5-7 % faster than 224
#: at M = 1024 and 2048, where both make the same row tiles; the estimate picks it there except at N = 12288).  The images form
#: (act_source images) costs 0.76 x that per k-step (session 6: a 256-row images tile ran at 0.646-0.66 x the
#: time of two 128-row nvfp4 ones at M = 1024 and 4608, N = 12288; 0.65 / 0.86).  Ties (equal
#: estimates: many waves, or the same tile) go to the M bucket's order: the 128-row tile up to M = 256, the
#: 256-row one above; then, above M = 256, the images form (act_source images: 15-33 % faster than the
#: producer's decode at M = 1024 ... 9728, session 6; up to M = 256 the one-launch nvfp4 form first); then the
#: warp-specialised form with two raw register sets (12-21 % faster than coop with one set at the 128-row
#: tile; at the 256-row tile the two schedules tie within +-4 %); then the faster decode forms (act_decode
#: prmt, skip_pad on).  The 216-row tile costs 1.6 % more per row than the 224-row one (H100, session 31: 134.8
#: against 137.6 µs for four waves of each at M = 4608, K = N = 3072), so 0.875: the rule takes it at M = 4608 and
#: N = 3072 (22 row tiles by 24, four whole waves on 132 SMs; 1.9-2.2 % faster than 224 at all three K) and
#: N = 12288 (within 0.6 % of the 256-row tile there), the 256-row one at N = 9216 and 21504.
_FILL = {"fill": {"tile": ["tile_m", "tile_n", "tile_k"], "ctas_per_sm": 1,
                  "factor": [{"knob": "tile_m", "values": [[64, 1.66], [208, 0.86], [216, 0.875], [224, 0.86],
                                                                 [256, 0.86]]},
                             {"knob": "act_source", "values": [["images", 0.76]]},
                             # the images form saves less on a low tile, where the producer's decode is a smaller
                             # share of a k-step: measured images / nvfp4 time at the same tile 0.90-0.93 at 64 rows
                             # (M = 64, unsplit, session 17) and 0.81-1.00, median 0.88, at 128 rows (M = 256,
                             # session 7), so 0.76 x these.  Without it the estimate took the unsplit 64-row images
                             # tile over the 4-way split at N = 3072, where it is 1.8x slower
                             {"knob": ["tile_m", "act_source"], "values": [[[64, "images"], 1.18],
                                                                         [[128, "images"], 1.16]]},
                             # the estimate has no model of gemv's launch-time split: a factor that keeps the
                             # estimate from ever preferring it over a wgmma form (above M = 16 it lost, session 9)
                             {"knob": "schedule", "values": [["gemv", 100.0]]}],
                  "split": {"knob": "schedule", "values": [["ws_splitk2", 2, 12], ["ws_splitk4", 4, 22]]}}}
#: Above M = 256 the 128 x 192 images tile (three MMA warpgroups) costs 0.79 x what the table above gives a
#: 128-row images tile per unit of area (session 29, H100: 33.9 against 34.6 µs for the 208-row tile at M = 1024,
#: K = N = 3072, one wave each of 1.5 and 1.625 units; 2-4 % faster than the 208-row tile at M = 1024 and 2048 on
#: three FLUX shapes).
def _fill_n192(factor: float) -> dict:
    """`_FILL` with the 128 x 192 tile costing `factor` x a 128-row images tile per unit of area."""
    return {"fill": dict(_FILL["fill"], factor=_FILL["fill"]["factor"] + [
        {"knob": ["tile_m", "tile_n"], "values": [[[128, 192], factor]]}])}


_FILL_N192 = _fill_n192(0.79)
#: From M = 17 to 256 it costs 0.71 x (session 48, H100, every form of the shipped build timed at M = 64, 128, 256
#: and 512 on the six FLUX shapes: at M = 128, N = 9216 and 12288 its one wave of 48 / 64 tiles took 29.9 / 30.5 µs
#: against 32.1 / 32.2 for the 128-row nvfp4 tile's 72 / 96, 0.62-0.63 x per unit of area; and where the other
#: tiles need a second wave it is the fastest form by 17-49 %: M = 256, N >= 9216, 30.2-60.5 µs against the 256-row
#: tile's 35.8-70.9; M = 64 and 128, N = 21504, 31.2 / 31.7 against 39.2 / 57.1 µs).  So that bucket prices it here
#: and takes it at N >= 9216 from M = 65 to 256 and at N = 21504 from M = 17 (64-row tiles: 168, two waves).
_FILL_N192_SMALL = _fill_n192(0.71)
#: From M = 129 to 256 the 128 x 192 tile's stream-K form (`ws_streamk`, the owner meeting) too: one wave of one CTA
#: per SM over equal shares of the (tile, k-step) units, priced as that share plus 30 k-steps for the meetings
#: (session 48, H100: at M = 256, N = 3072 and K = 12288 / 15360 it took 44.8 / 51.8 µs against the 4-way split
#: 256-row tile's 50.4 / 58.2; where the whole 128 x 192 tiles make one wave it lost 10-25 % (N = 9216, 12288), and
#: at K = N = 3072 it took 23.3 against the 64-row tile's 20.0 µs).  At M <= 128 it won 8-13 % at N = 9216 and
#: 12288 but lost 3 % at N = 3072, K = 12288 and 59 % at K = N = 3072, where one overhead cannot price both, so that
#: bucket leaves it out (without a split entry it ranks as its whole tile, and ties go to `ws`).
_FILL_N192_STREAMK = {"fill": dict(_FILL_N192_SMALL["fill"], split={
    "knob": "schedule", "values": _FILL["fill"]["split"]["values"] + [["ws_streamk", 0, 30]]})}
#: M <= 16 (after the gemv form): the 128 x 192 tile priced out (not timed there)
_FILL_SMALL = _fill_n192(100.0)
_FORMS = [{"knob": "act_decode", "values": ["prmt", "shift"]}, {"knob": "skip_pad", "values": [True, False]}]
#: M <= 16: the gemv form first, where it is built, and of its tiles the 16-row one (session 9, docs/PERF.md: the
#: 16 x 128 gemv tile is 1.30-1.55x faster than the best wgmma form at all four (K, N) measured at M = 1 and 16,
#: 0.96-1.42x cuBLAS bf16).  Above M = 16 it reads the weight once per 16 rows, so the wgmma forms and the fill
#: estimate decide again there (the gemv form ranks after every listed schedule)
_SMALL = [{"knob": "schedule", "values": ["gemv"]}, {"knob": "tile_m", "values": [16]},
          # session 11: at N >= 9216 the 16 x 64 gemv tile is 14-24 % faster than 16 x 128 (M = 1 and 16; N = 9216,
          # 12288, 21504, K = 3072): 16 x 128 makes N / 128 >= 72 tiles, whose launch-time split of 2 fills 144 of
          # the 264 two-per-SM CTA slots, while 16 x 64 fills 288 of 396.  Session 35 (H100, at least four phases
          # per split rank): at N = 3072 the 64-wide tile takes 4-6 % less time at K = 3072 (48 tiles x 4 ranks)
          # and the 128-wide one 13-15 % less at K = 12288 and 15360 (24 tiles x 8 ranks).  Between N = 3072 and 9216
          # and at K between 3072 and 12288: not measured
          {"knob": "tile_n", "values": [64], "when": {"dim": "n", "min": 9216}},
          {"knob": "tile_n", "values": [64], "when": {"dim": "k", "max": 4095}},
          {"knob": "tile_n", "values": [128], "when": {"dim": "n", "max": 9215}}]
#: After the grid fill, up to M = 256: the lower tile, the one-launch form, then the schedules in this order
_SMALL_M_ORDER = [{"knob": "tile_m", "order": "asc"}, {"knob": "act_source", "values": ["nvfp4", "images"]},
                  {"knob": "schedule", "values": ["ws", "coop", "ws_splitk2", "ws_splitk4", "ws_streamk"]},
                  {"knob": "stages", "order": "desc"}, {"knob": "prefetch", "order": "desc"}] + _FORMS
SELECTION = [
    {"m_max": 16, "priority": 0, "prefer": _SMALL + [_FILL_SMALL] + _SMALL_M_ORDER},
    {"m_max": 128, "priority": 0, "prefer": [_FILL_N192_SMALL] + _SMALL_M_ORDER},
    {"m_max": 256, "priority": 0, "prefer": [_FILL_N192_STREAMK] + _SMALL_M_ORDER},
    {"m_max": None, "priority": 0, "prefer": [_FILL_N192, {"knob": "tile_m", "order": "desc"},
                                               {"knob": "act_source", "values": ["images", "nvfp4"]},
                                               {"knob": "schedule", "values": ["ws", "coop", "ws_splitk2", "ws_splitk4",
                                                                               "ws_streamk"]},
                                               {"knob": "stages", "order": "desc"},
                                               {"knob": "prefetch", "order": "desc"}] + _FORMS},
]


def threads_for(knobs: dict) -> int:
    return threads_of(_cfg_of(knobs))


def smem_bytes_for(knobs: dict) -> int:
    return _smem_plan(_cfg_of(knobs))["total_bytes"]


# ---------------------------------------------------------------------------
# Build-time API
# ---------------------------------------------------------------------------


def config_axes(arch: str, section: dict) -> tuple[list[dict], list[str]]:
    """``variants.sm_90a.gemm_w4a4`` -> tuning-knob dicts; keys ``tiles`` ([[tile_m, tile_n, tile_k], ...]),
    ``stages`` ([auto | 3 | 4, ...]; auto = the deepest that fits), ``prefetch`` ([1 | 2, ...]; default [1])
    ``skip_pad`` ([false | true]; default [true]), ``act_decode`` ([shift | prmt]; default [prmt]) and
    ``schedule`` ([coop | ws | ws_splitk2 | ws_splitk4 | gemv]; default [coop]) and ``wsets`` ([2 | 4]; default [2]):
    every combination of the listed values.

    Or ``forms``: a list of such sections (a key a form leaves out takes its default), built as the union of
    each form's combinations -- one schedule for the small tile and another for the large one without building
    every cross combination.  A form may also list ``ranks``: it is then built for those LoRA ranks only (of the
    config's ``ranks``), e.g. a fallback form that only one rank needs."""
    if "forms" not in section:
        return _form_axes(section, "")
    from svdq_aot.family import forms_axes
    return forms_axes(section, _form_axes)


def _form_axes(section: dict, where: str) -> tuple[list[dict], list[str]]:
    """One section's (or one form's) product of knob values; `where` prefixes its problems."""
    problems: list[str] = []
    allowed = ("tiles", "stages", "prefetch", "skip_pad", "act_decode", "schedule", "wsets", "act_source")
    for key in sorted(set(section) - set(allowed)):
        problems.append(f"{where}{key}: unknown key (allowed: {', '.join(allowed)})")
    tiles = section.get("tiles", [list(DEFAULT_TILE)])
    good_tiles = []
    if not isinstance(tiles, list) or not tiles:
        problems.append(f"{where}tiles: {tiles!r}: expected a non-empty list of [tile_m, tile_n, tile_k]")
        tiles = []
    for i, t in enumerate(tiles):
        if not (isinstance(t, list) and len(t) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                            and x > 0 for x in t)):
            problems.append(f"{where}tiles[{i}]: {t!r}: expected [tile_m, tile_n, tile_k], three positive integers")
        elif t in good_tiles:
            problems.append(f"{where}tiles[{i}]: {t!r}: duplicate value")
        else:
            good_tiles.append(t)
    lists = {}
    for key, default, kind in (("stages", ["auto"], "auto"), ("prefetch", [1], "int"), ("skip_pad", [True], "bool"),
                               ("act_decode", ["prmt"], "name"), ("schedule", ["coop"], "name"),
                               ("wsets", [2], "int"), ("act_source", ["nvfp4"], "name")):
        vals = section.get(key, default)
        good = []
        if not isinstance(vals, list) or not vals:
            problems.append(f"{where}{key}: {vals!r}: expected a non-empty list")
            vals = []
        for i, v in enumerate(vals):
            if kind == "bool":
                ok, want = isinstance(v, bool), "true or false"
            elif kind == "name":
                ok, want = isinstance(v, str), "a name (" + ", ".join(TUNING[key]) + ")"
            else:
                ok = (kind == "auto" and v == "auto") or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
                want = "a positive integer" + (" or 'auto'" if kind == "auto" else "")
            if not ok:
                problems.append(f"{where}{key}[{i}]: {v!r}: expected {want}")
            elif v in good:
                problems.append(f"{where}{key}[{i}]: {v!r}: duplicate value")
            else:
                good.append(v)
        lists[key] = good
    return [dict(tile_m=t[0], tile_n=t[1], tile_k=t[2], stages=s, prefetch=p, skip_pad=sp, act_decode=ad,
                 schedule=sc, wsets=w, act_source=src)
            for t in good_tiles for s in lists["stages"] for p in lists["prefetch"] for sp in lists["skip_pad"]
            for ad in lists["act_decode"] for sc in lists["schedule"] for w in lists["wsets"]
            for src in lists["act_source"]], problems


def resolve(arch: str, knobs: dict, valid=None) -> dict:
    """``stages: auto`` -> the deepest of AUTO_STAGES that `valid` (default: this family's `invalid_reason`; the
    FP8 family passes its own) accepts."""
    if knobs.get("stages") != "auto":
        return dict(knobs)
    for st in sorted(AUTO_STAGES, reverse=True):
        cand = dict(knobs, stages=st)
        if (valid or invalid_reason)(arch, cand) is None:
            return cand
    return dict(knobs, stages=max(AUTO_STAGES))


def invalid_reason(arch: str, knobs: dict) -> Optional[str]:
    if arch not in ARCHS:
        return f"arch {arch} is not built by {NAME} (builds {', '.join(ARCHS)})"
    from svdq_aot.family import knob_problems
    problems = knob_problems(NAME, knobs, FEATURE_VALUES, TUNING)
    if problems:
        return problems
    return _problem(_cfg_of(knobs))


def requirements(arch: str, knobs: dict) -> dict:
    """N: whole weight tiles; K: the k loop is unrolled by two (ws with 4 weight sets: by four), and split K
    gives each CTA whole unrolled steps."""
    cfg = _cfg_of(knobs)
    if is_gemv(cfg):
        return {"n_multiple": int(knobs["tile_n"]), "k_multiple": 2 * TILE_K}     # whole 128-k phases
    return {"n_multiple": int(knobs["tile_n"]), "k_multiple": k_unroll(cfg) * TILE_K * ksplit_of(cfg)}


def compile(arch: str, knobs: dict, name: str, dump_dir: str, *, keep_ptx: bool = False):
    refuse_invalid(name, invalid_reason(arch, knobs))
    cfg = _cfg_of(knobs)
    if is_gemv(cfg):
        from .sm90_gemv_kernel import _Sm90Gemv as cls
    else:
        cls = _Sm90Wgmma
    from svdq_loader.ops import GEMM_W4A4
    return compile_gemm(cls, cls(cfg), GEMM_W4A4, cfg.out_dtype, arch, name, dump_dir, keep_ptx,
                        lambda ptx, usage, gemm: static_problem(ptx, usage, cls.MMA_PTX, gemm.paired_store))


def compile_gemm(cls, gemm, spec, out_dtype: str, arch: str, name: str, dump_dir: str, keep_ptx: bool, check):
    """Trace and cross-compile one sm_90a GEMM kernel instance for op `spec`, then the kernel class's part of the
    build: `check(ptx, resource usage, gemm)` (the MMA its PTX must contain, no stack frame), a check of its
    registers against the CTAs per SM it was planned for, and expressions for the launch-recipe fitter.  The exact
    family and the FP8 one (sm90_wgmma_w4a4_fp8) build through it."""
    ck = compile_kernel(cls, gemm, spec, dict(act=Uint8, ascales=Uint8, wgt=Uint8, wscales=Uint8, wcscale=Float32,
                                              bias=Float32),
                        _OUT_DTYPES[out_dtype], name, arch, dump_dir, gemm.smem_bytes, keep_ptx=True)
    ck.recipe_hints = gemm.recipe_hints(spec.host_args)
    problem = (check(_read_ptx(dump_dir, ck.entry, arch, keep_ptx), ck.resource_usage, gemm)
               or gemm.resource_problem(ck.resource_usage))
    if problem:
        raise RuntimeError(f"{name}: {problem}")
    return ck


def _read_ptx(dump_dir: str, entry: str, arch: str, keep: bool) -> str:
    import os
    path = os.path.join(dump_dir, f"{entry}.{arch}.ptx")
    with open(path) as f:
        text = f.read()
    if not keep:
        os.remove(path)
    return text


def static_problem(ptx: str, usage: dict, mma: str = "wgmma.mma_async", paired_store: bool = False) -> Optional[str]:
    """The build-time checks every variant must pass: None, or what is wrong.

    The main loop must be on the tensor cores: ``wgmma.mma_async`` with a register A operand (HGMMA) for the
    wgmma forms, ``mma.sync`` (HMMA) for the gemv form, whose bound is the weight stream, not the MMA rate; a form
    built to store transposed 16-bit pairs (``paired_store``: every wgmma form, the 16-row gemv tile) must contain
    the ``movmatrix`` transpose of that store; and no kernel may have a stack frame (spilled registers)."""
    if mma not in ptx:
        return f"no {mma} in the PTX (not on the tensor-core path this form is built for)"
    if paired_store and "movmatrix.sync.aligned.m8n8.trans.b16" not in ptx:
        return "no movmatrix.sync.aligned.m8n8.trans.b16 in the PTX (the output store is not the paired store)"
    return stack_frame_problem(usage)

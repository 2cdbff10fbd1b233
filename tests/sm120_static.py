"""Static checks of sm_120a / sm_121a cubins (both operators), shared by the tests and tools/sm120_sweep.py.

`variant_problems(op, knobs, sass, resources, smem_bytes)` lists what is wrong with one variant (empty:
it passes); `check_artifacts(folder)` applies it to every sm_120a / sm_121a variant of a built artifact
set.  The expected instruction counts follow from the kernels' structure:

* GEMM, per warp and k-tile: 2 m-atoms x 8 n-atoms x tile_k/64 k-blocks of the block-scaled
  ``OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X``; the LoRA epilogue: 2 x 8 atoms per 16-wide k-block of
  ``HMMA.16816.F32`` (``.BF16`` for bf16 output), none at R = 0; TMA loads, ``ldmatrix``, mbarrier waits.
* quantize_act: ``HMMA`` exactly when R > 0 (the LoRA-down product).
* both: no local memory (``STL``/``LDL``), no stack frame, <= 255 registers, static + dynamic SMEM
  within the 101376 B per block of sm_120 / sm_121 (the DSL's arch table).
"""
from __future__ import annotations

import json
import os
import re

from kernel_checks import dump_sass

OMMA = re.compile(r"\bOMMA\.SF\.16864\.F32\.E2M1\.E2M1\.UE4M3\.4X\b")
HMMA = re.compile(r"\bHMMA\.16816\.F32(\.BF16)?\b")
SMEM_PER_BLOCK = 101376
ARCHS = ("sm_120a", "sm_121a")


def variant_problems(op: str, knobs: dict, sass: str, resources: dict, smem_bytes: int) -> list[str]:
    """Everything that is wrong with one compiled variant (`resources`: symbol -> registers,
    stack_frame_bytes, static_smem)."""
    bad = []
    for sym, ru in resources.items():
        if ru["registers"] > 255:
            bad.append(f"{sym}: {ru['registers']} registers")
        if ru["stack_frame_bytes"]:
            bad.append(f"{sym}: stack frame {ru['stack_frame_bytes']} B")
        if smem_bytes + ru.get("static_smem", 0) > SMEM_PER_BLOCK:
            bad.append(f"{sym}: {smem_bytes} + {ru.get('static_smem', 0)} B of SMEM > {SMEM_PER_BLOCK} B per block")
    if re.search(r"\b(STL|LDL)\b", sass):
        bad.append("local-memory traffic (STL/LDL)")
    r = int(knobs["rank"])
    hmma = HMMA.findall(sass)
    if len(re.findall(r"\bHMMA\b", sass)) != len(hmma):
        bad.append("an HMMA of another shape")
    if op == "gemm_w4a4":
        want = 2 * 8 * (int(knobs["tile_k"]) // 64)
        got = len(OMMA.findall(sass))
        if got != want or "OMMA" in OMMA.sub("", sass):
            bad.append(f"{got} block-scaled OMMA.SF...E2M1...UE4M3 (want {want}, and no other OMMA form)")
        if len(hmma) != 16 * (r // 16):
            bad.append(f"R={r}: {len(hmma)} HMMA (want {16 * (r // 16)})")
        if any((form == ".BF16") != (knobs["out_dtype"] == "bf16") for form in hmma):
            bad.append("LoRA HMMA in the wrong dtype")
        for what, pat in (("TMA loads", r"\bUTMALDG\.[23]D\b"), ("ldmatrix", r"\bLDSM\b"),
                          ("mbarrier waits", r"\bSYNCS\.PHASECHK")):
            if not re.search(pat, sass):
                bad.append(f"no {what}")
    elif bool(hmma) != (r > 0):
        bad.append(f"R={r}: {len(hmma)} HMMA")
    return bad


def check_artifacts(folder: str, tool: str) -> tuple[int, list[str]]:
    """(variants checked, problems) over every sm_120a / sm_121a variant of the artifact set in `folder`."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    checked, problems = 0, []
    for v in manifest["variants"]:
        if v["arch"] not in ARCHS:
            continue
        sass = dump_sass(os.path.join(folder, v["cubin"]), tool)
        if sass is None:
            problems.append(f"{v['name']}: no SASS from {tool}")
            continue
        problems += [f"{v['name']}: {p}" for p in variant_problems(v["op"], v["knobs"], sass, v["resources"],
                                                                     v["smem_bytes"])]
        checked += 1
    return checked, problems

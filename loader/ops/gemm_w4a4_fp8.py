"""Operator ``gemm_w4a4_fp8``: ``gemm_w4a4`` in the FP8-compute mode (sm_90a; docs/design.md section 2).

    y[m, n] = (Σ_k a8[m,k]·w8[n,k]) / (ra[m]·rw[n]) · wcscale[n] + bias[n] + Σ_r lora_act_in[m,r]·lora_up[n,r]

with ``a8 = e4m3(A · ra)`` and ``w8 = e4m3(W · rw)``: each NVFP4 operand rounded once to E4M3 after a power of two
per row / column (``svdq_loader.testing.fp8_reference`` is the float64 statement).  It is a separate operator, so
the mode is never chosen silently: a call reaches it only with a weight prepared with ``compute="fp8"``
(`gemm_w4a4.prepare_weight`), and ``select`` names the operator a call got.

The same host arguments and features as ``gemm_w4a4``; the tensors differ only inside the prepared weight (the
``sm90_fp8_frag`` format, whose ``wscales`` carries rw, and a ``wcscale`` of wcscale / rw).  A call given the
mode's own activation (an ``act_fp8.E4m3Act``, from ``quantize_act(..., compute="fp8")``, with ``ascales`` None)
runs the GEMM alone on it; a call given an NVFP4 activation runs ``act_fp8`` first (its ``prepass``), into a
per-call workspace the GEMM reads through ``act``; a ``ws_streamk`` variant's meetings take the bytes after it
(the exact op's ``prepass_extra_bytes``, with the variant's 128-k k-tiles).
"""
from __future__ import annotations

import dataclasses

from . import act_fp8
from .decode_act import tile_rows_problem
from .gemm_w4a4 import SPEC as _EXACT

SPEC = dataclasses.replace(
    _EXACT,
    name="gemm_w4a4_fp8",
    summary="NVFP4 W4A4 GEMM in the FP8-compute mode (E4M3 tensor cores; not bit-equivalent) + LoRA + affine",
    prepass=lambda knobs: "act_fp8",
    knob_size_rule=lambda knobs, dims: (act_fp8.image_size_problem(dims["m"], dims["k"])
                                        or tile_rows_problem(int(knobs.get("tile_m", 1)), dims["m"])),
)

__all__ = ["SPEC"]

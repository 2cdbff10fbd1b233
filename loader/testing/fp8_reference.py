"""Numerical reference of ``gemm_w4a4``'s FP8-compute mode (``compute: fp8``, sm_90a; docs/design.md section 2).

The exact operator multiplies A[m,k] = e2m1 · e4m3 scale by W[n,k] likewise, each product needing up to 6
significant bits.  FP8 E4M3 holds 4, so this mode rounds each operand once to E4M3 after moving it, by a power of
two per row (activations) or per column (weights), to the top of E4M3's range:

    ra[m]   = pow2_floor(448 / (6 · max_g ascales[m,g]))     rw[n] = pow2_floor(448 / (6 · max_g wscales[n,g]))
              (1 where every scale of the row is 0)
    a8[m,k] = e4m3(A[m,k] · ra[m]),                     w8[n,k] = e4m3(W[n,k] · rw[n])
    y[m,n]  = (Σ_k a8[m,k] · w8[n,k]) / (ra[m] · rw[n]) · wcscale[n] + bias[n] + Σ_r lora_act_in[m,r] · lora_up[n,r]

* ``pow2_floor(x)`` is the largest power of two ≤ x.  6 · (the row's largest block scale) bounds every |A[m,k]| of
  the row (an E2M1 value is at most 6), so nothing saturates, and the bound · r lies in (224, 448]: E4M3's top
  binade.  The bound is the row's largest |A| itself whenever the block with the largest scale holds a ±6, which
  NVFP4 quantization (scale = e4m3(amax / 6)) gives every block whose scale is E4M3-normal.  The bound needs only
  the scales (K/16 bytes per row), so a kernel knows r before it reads a code.  Scales are ≤ 448, so r ≥ 2⁻³,
  and ≥ 2⁻⁹ where nonzero, so r ≤ 2¹⁵; multiplying by r is exact.
* ``e4m3`` rounds to nearest, ties to even, on the E4M3FN grid (subnormals 2⁻⁹ apart; 2⁻¹⁰ rounds to 0), and
  saturates at ±448 (never reached, by the choice of r).  This is PTX ``cvt.rn.satfinite.e4m3x2``.
* Each operand is rounded exactly once, from its exact value: the NVFP4 activation (the checkpoint's numerics, as
  ``quantize_act`` produces it) and the NVFP4 weight with its block scale.  The K-sum, the division by ra · rw and
  the affine are exact here (float64; every a8 · w8 product has ≤ 8 significant bits); a kernel accumulates in
  fp32 and is held to the exact path's tolerance against this.
* LoRA, wcscale and bias enter exactly as in the exact operator (`reference.reference_gemm_w4a4`).

The mode is an approximation of the exact operator, never a silent replacement: `fp8_distance` measures how far.
Only numpy is imported (the E4M3 / E2M1 codecs are `reference`'s, written with explicit bit arithmetic).
"""
from __future__ import annotations

import numpy as np

from .reference import (BLOCK, E2M1_MAX, E4M3_MAX, _logical_scales, apply_terms, decode_e4m3, dequantize_nvfp4,
                        encode_e4m3)

__all__ = ["pow2_floor", "row_pow2", "scale_pow2", "fp8_operand", "fp8_operands", "reference_gemm_w4a4_fp8",
           "fp8_distance", "reference_act_fp8_workspace", "reference_torch_f64_fp8"]


def pow2_floor(x) -> np.ndarray:
    """The largest power of two ≤ x, elementwise, for finite x > 0 (exact: from the float's exponent)."""
    x = np.asarray(x, dtype=np.float64)
    if np.any(~np.isfinite(x)) or np.any(x <= 0):
        raise ValueError("pow2_floor needs finite positive values")
    _, e = np.frexp(x)                   # x = f · 2^e, f in [0.5, 1)
    return np.ldexp(1.0, e - 1)


def row_pow2(bound) -> np.ndarray:
    """[rows] bounds b >= 0 on each row's |values| -> [rows] the power of two r with b · r in (224, 448] (1 where
    b = 0).  Computed without trusting a rounded quotient: b · r is exact, so the bound is checked as stated."""
    b = np.asarray(bound, dtype=np.float64)
    if b.ndim != 1:
        raise ValueError(f"row_pow2 expects [rows] bounds, got shape {b.shape}")
    if not np.isfinite(b).all() or np.any(b < 0):
        raise ValueError("row_pow2: a bound is negative, inf or NaN")
    safe = np.where(b > 0, b, E4M3_MAX)
    r = pow2_floor(E4M3_MAX / safe)
    r = np.where(safe * r > E4M3_MAX, r / 2, r)
    r = np.where(safe * (2 * r) <= E4M3_MAX, 2 * r, r)
    return np.where(b > 0, r, 1.0)


def scale_pow2(scales) -> np.ndarray:
    """Logical E4M3 scale bytes uint8 [rows, K/16] -> [rows] r = pow2_floor(448 / (6 · the row's largest scale))
    (1 for a row of zero scales)."""
    s = decode_e4m3(np.asarray(scales))
    if s.ndim != 2:
        raise ValueError(f"scale_pow2 expects [rows, K/16] scale bytes, got shape {s.shape}")
    if np.isnan(s).any():
        raise ValueError("scale_pow2: a block scale is NaN (0x7F / 0xFF: the quantized input was not finite)")
    return row_pow2(E2M1_MAX * np.abs(s).max(axis=1) if s.shape[1] else np.zeros(s.shape[0]))


def fp8_operand(packed, scales) -> tuple[np.ndarray, np.ndarray]:
    """One NVFP4 operand (packed uint8 [rows, K/2], logical E4M3 scale bytes [rows, K/16]) ->
    (E4M3 bytes uint8 [rows, K] of value · r, r float64 [rows])."""
    vals = dequantize_nvfp4(packed, scales)
    r = scale_pow2(scales)
    return encode_e4m3(vals * r[:, None]), r


def fp8_operands(act, ascales, wgt, wscales):
    """(a8, ra, w8, rw) of the mode, from the exact operator's operands (``reference_gemm_w4a4``'s conventions:
    scale bytes in the logical layout, or 1-D in the blocked one)."""
    act, wgt = np.asarray(act), np.asarray(wgt)
    if act.dtype != np.uint8 or wgt.dtype != np.uint8 or act.ndim != 2 or wgt.ndim != 2:
        raise TypeError("act and wgt must be 2-D uint8 (packed E2M1)")
    if act.shape[1] != wgt.shape[1]:
        raise ValueError(f"K mismatch: act has K={2 * act.shape[1]}, wgt has K={2 * wgt.shape[1]}")
    g = 2 * act.shape[1] // BLOCK
    a8, ra = fp8_operand(act, _logical_scales(ascales, act.shape[0], g, "ascales"))
    w8, rw = fp8_operand(wgt, _logical_scales(wscales, wgt.shape[0], g, "wscales"))
    return a8, ra, w8, rw


def reference_gemm_w4a4_fp8(act, wgt, ascales, wscales, *, lora_act_in=None, lora_up=None, wcscale=None,
                            bias=None) -> np.ndarray:
    """float64 [M, N]: the FP8-compute mode's output (module docstring), same arguments as
    ``reference.reference_gemm_w4a4``."""
    a8, ra, w8, rw = fp8_operands(act, ascales, wgt, wscales)
    y = np.matmul(decode_e4m3(a8), decode_e4m3(w8).T) / (ra[:, None] * rw[None, :])
    return apply_terms(y, wcscale=wcscale, bias=bias, lora_act_in=lora_act_in, lora_up=lora_up)


def fp8_distance(act, wgt, ascales, wscales) -> float:
    """‖y_fp8 − y_exact‖ / ‖y_exact‖ (Frobenius) of the main products Σ_k (no LoRA, no affine: those are the
    same in both modes and would only dilute the distance)."""
    from .reference import reference_gemm_w4a4
    exact = reference_gemm_w4a4(act, wgt, ascales, wscales)
    fp8 = reference_gemm_w4a4_fp8(act, wgt, ascales, wscales)
    den = float(np.linalg.norm(exact))
    if den == 0:
        raise ValueError("fp8_distance: the exact product is all zeros")
    return float(np.linalg.norm(fp8 - exact)) / den


def reference_act_fp8_workspace(act, ascales) -> np.ndarray:
    """uint8 bytes of the ``act_fp8`` pre-pass's workspace for logical NVFP4 activations (``act`` uint8 [M, K/2],
    ``ascales`` E4M3 bytes [M, K/16]): 1 / ra as float32 per image row (1 past row M), then the swizzled E4M3 image
    (+0 past row M), laid out by `svdq_loader.ops.act_fp8.image_offset`."""
    from svdq_loader.ops import act_fp8
    from svdq_loader.ops.decode_act import image_rows
    act, ascales = np.asarray(act), np.asarray(ascales)
    m, kh = act.shape
    k = 2 * kh
    a8, ra = fp8_operand(act, ascales)
    mp = image_rows(m)
    out = np.zeros(act_fp8.workspace_bytes(m, k), dtype=np.uint8)
    ira = np.ones(mp, dtype=np.float32)
    ira[:m] = (1.0 / ra).astype(np.float32)
    out[: act_fp8.ira_bytes(m)] = ira.view(np.uint8)
    rows = np.arange(m)[:, None]
    ks = np.arange(k)[None, :]
    t, kk = ks // act_fp8.IMAGE_K, ks % act_fp8.IMAGE_K
    off = act_fp8.ira_bytes(m) + ((t * mp + rows) * 8 + ((kk // 16) ^ (rows % 8))) * 16 + kk % 16
    out[off] = a8
    return out


def reference_torch_f64_fp8(act, wgt, ascales, wscales, *, lora_act_in=None, lora_up=None, wcscale=None,
                            bias=None):
    """The mode's output computed with torch on the tensors' own device (float64; for large problems, e.g. a
    model's layer check on the GPU): the same rules, with torch's own E4M3 cast (round to nearest even; every
    value is within ±448 by the choice of r, so no saturation is involved).  The numpy
    `reference_gemm_w4a4_fp8` is the statement; tests/test_fp8_reference.py checks the two agree."""
    import torch
    from .reference import E2M1_MAX as _E2M1_MAX, decode_e4m3 as _dec, torch_operand, torch_terms
    e4m3 = torch.tensor(_dec(np.arange(256, dtype=np.uint8)), dtype=torch.float64, device=act.device)

    def side(packed, scales):
        v = torch_operand(packed, scales)
        bound = _E2M1_MAX * e4m3[scales.view(torch.uint8).long()].amax(dim=1)
        safe = torch.where(bound > 0, bound, torch.full_like(bound, E4M3_MAX))
        r = torch.exp2(torch.floor(torch.log2(E4M3_MAX / safe)))
        r = torch.where(safe * r > E4M3_MAX, r / 2, r)
        r = torch.where(safe * (2 * r) <= E4M3_MAX, 2 * r, r)
        r = torch.where(bound > 0, r, torch.ones_like(r))
        return (v * r[:, None]).to(torch.float8_e4m3fn).to(torch.float64), r
    a8, ra = side(act, ascales)
    w8, rw = side(wgt, wscales)
    y = (a8 @ w8.T) / (ra[:, None] * rw[None, :])
    return torch_terms(y, wcscale=wcscale, bias=bias, lora_act_in=lora_act_in, lora_up=lora_up)

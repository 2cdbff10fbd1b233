"""Exact reference of ``quantize_act`` (NVFP4 activation quantization + fused LoRA-down).

This module *defines* the arithmetic; the kernel (kernel_src/quantize_kernel.py)
must reproduce ``act`` and ``ascales`` bit for bit.  numpy float32 arithmetic
is IEEE binary32 with round-to-nearest-even and no flush-to-zero, so every
step below is computed here exactly as written.

Inputs
------
``x`` [M, K], dtype D = bf16 or fp16 (K a multiple of 16; the kernel needs 64),
``smooth`` [K] in D (optional), ``lora_down`` [K, R] in D (optional).

Rules, per row m and group g of 16 consecutive k (k = 16g .. 16g + 15)
----------------------------------------------------------------------
1. Smoothing (only with ``smooth``): the reciprocal rounded to D, then one
   exact product rounded once to D::

       rs[k]   = RN_D( RN32(1 / float32(smooth[k])) )  IEEE division (div.rn.f32),
                                                        then RN_D
       x̂[m,k]  = RN_D( x[m,k] * rs[k] )                 the exact product of two D
                                                        values, rounded once
   RN_D = round-to-nearest-even to D, overflow -> inf, subnormals kept (the
   kernel: one packed ``mul.rn.bf16x2`` / ``mul.rn.f16x2`` per pair of k).
   Without ``smooth``: x̂ = x.  So x̂ is always a D value: the same x̂ feeds the
   codes, the scales and the LoRA product.  (Note: x̂ is x times the
   reciprocal rounded to D, not the rounded quotient x / smooth: rs carries
   a relative error of at most 2^-9 (bf16) or 2^-12 (fp16), as much as the
   rounding of x̂ itself and far below the 4-bit quantization step.  That
   makes the reciprocal a once-per-k cost and the smoothing one instruction
   per pair.  For fp16, 1 / smooth must lie in fp16's range: smooth below
   2^-16 gives rs = inf, above 2^14 a subnormal rs.)  ``smooth_rcp`` [K] in
   D, the operator's other way to smooth, *is* rs (``smooth_reciprocals``
   makes it from smooth by the first line's rule): x̂ = RN_D(x * smooth_rcp).
2. ``amax = max |x̂|`` over the group, as fp32 (exact).  A NaN anywhere in the
   group makes amax NaN (NaN-propagating max); an inf makes it inf.
3. ``sc = RN32(amax / 6)`` (IEEE division), then the scale byte
   ``b = E4M3FN(sc)``: round-to-nearest-even on the E4M3 grid (subnormals
   mant * 2^-9; 2^-10 rounds to 0, 3 * 2^-10 to 0x02), saturating at 448
   (0x7E) -- exactly PTX ``cvt.rn.satfinite.e4m3x2.f32``.  sc >= 0 always.
4. **Non-finite policy**: if amax is inf or NaN (the group holds an inf or a
   NaN -- with smoothing also when x * rs overflowed D), the scale byte is
   0x7F (E4M3 NaN) and all 16 codes are 0.  The GEMM then yields NaN in that
   row, which propagates the bad input instead of hiding it.
5. ``s = decode(b)`` (exact fp32).  **Zero policy**: if s == 0 (an all-zero
   group, or amax / 6 below 2^-10, i.e. under half the smallest E4M3
   subnormal) the scale byte is 0x00 and all codes are 0 (sign bits too).
6. Otherwise each code is ``E2M1(RN32(float32(x̂) / s))`` (IEEE division):
   magnitude = nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even code
   (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
   5 -> 4), saturating at 6 (|q| > 5 -> code 7); the sign bit (bit 3) is
   the sign bit of x̂ (so -0.0 and small negatives give code 8, "-0").
7. Packing: ``act[m, k // 2]``: low nibble = even k, high nibble = odd k.
   Scales: ``logical`` = [M, K/16] row-major; ``blocked`` =
   [ceil(M/128), ceil(K/64), 32, 4, 4] with row r, group g at
   [r // 128, g // 4, r % 32, (r // 32) % 4, g % 4]; pad rows hold 0.
8. LoRA: ``lora_act_in[m, r] = sum_k x̂[m,k] * lora_down[k,r]``, products and
   sums in fp32 (the kernel: ``mma.sync`` with D operands, fp32
   accumulators, an unspecified summation order), rounded to D at the end.
   This reference returns the exact float64 sum of the same products
   (before the final rounding); compare with a tolerance.  A row with a
   non-finite x̂ has an unspecified LoRA output.

Why the kernel needs no division for the codes
----------------------------------------------
Let t be a decision threshold {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5} (<= 3
significant bits) and s a nonzero E4M3 value (<= 4 bits, >= 2^-9): T = t*s
is exact in fp32, bf16 and fp16, and >= 2^-11 (normal).  Write
t = tau * 2^a, s = sigma * 2^b (tau, sigma in [1, 2)), Q = x̂ / s exactly,
q = RN32(Q).  If x̂ == T then q = Q = t.  Otherwise x̂ and T are distinct
fp32 numbers, so |x̂ - T| is at least the fp32 spacing next to T (2^(e_T-23),
or 2^(e_T-24) just below a power of two), e_T = a + b or a + b + 1; dividing
by s < 2^(b+1) gives |Q - t| > 2^(a-24) in every case, which is at least half
the fp32 spacing on that side of t.  So q lies strictly on the same side of t
as Q: "q > t" is "x̂ > T" and "q == t" is "x̂ == T".  The kernel therefore
compares |x̂| with the seven T exactly (packed 16-bit compares) and uses >=
where the tie rounds up (0.75, 1.75, 3.5) and > where it rounds down.
``tests/test_quantize_ref.py`` also checks this equivalence numerically.

Only numpy is imported at module level; torch is imported inside
``quantize_act_ref_torch``.
"""
from __future__ import annotations

import numpy as np

from .reference import decode_e4m3, to_blocked

__all__ = [
    "quantize_act_ref",
    "quantize_act_ref_torch",
    "round_to_bf16",
    "e4m3_rne_satfinite",
    "e2m1_code",
    "smooth_input",
    "round_once",
    "THRESHOLDS",
]

#: E2M1 decision thresholds (in units of the scale) and whether a tie rounds up.
THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
# Non-negative finite E4M3 values 0x00..0x7E (ascending).
_E4M3_POS = decode_e4m3(np.arange(0x7F, dtype=np.uint8))


def round_to_bf16(v) -> np.ndarray:
    """float32 -> float32 holding the bf16 RNE rounding (overflow -> inf, NaN kept quiet)."""
    shape = np.shape(v)
    f = np.ascontiguousarray(np.asarray(v, dtype=np.float32)).reshape(-1)
    u = f.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32).copy()
    nan = np.isnan(f)
    out[nan] = np.float32(np.nan)
    return out.reshape(shape)


def _round_to(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float32)
    return round_to_bf16(v)


def _is_bf16(v: np.ndarray) -> bool:
    f = np.ascontiguousarray(v, dtype=np.float32)
    return bool(np.array_equal(round_to_bf16(f), f, equal_nan=True))


def e4m3_rne_satfinite(sc) -> np.ndarray:
    """float32 >= 0 (or NaN) -> E4M3FN byte: RNE on the E4M3 grid, saturating at 448 (0x7E); NaN -> 0x7F."""
    a = np.asarray(sc, dtype=np.float64)
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    grid = _E4M3_POS
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, grid.size - 1)
    lo = hi - 1
    d_lo = a - grid[lo]
    d_hi = grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    idx = np.where(pick_hi, hi, lo)
    idx = np.where(a >= grid[-1], grid.size - 1, idx)
    return np.where(nan, 0x7F, idx).astype(np.uint8)


def e2m1_code(q) -> np.ndarray:
    """float32 quotient -> E2M1 magnitude index 0..7 (RNE, ties to even, saturating at 6)."""
    a = np.abs(np.asarray(q, dtype=np.float64))
    mag = np.zeros(a.shape, dtype=np.uint8)
    for t, up in THRESHOLDS:
        mag += (a >= t) if up else (a > t)
    return mag


def smooth_reciprocals_ref(smooth, dtype: str) -> np.ndarray:
    """Rule 1's ``rs = RN_D(RN32(1 / smooth))`` as float32 holding D values (IEEE float32 division)."""
    sf = np.asarray(smooth, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return _round_to(np.float32(1.0) / sf, dtype)


def smooth_input(x, smooth, dtype: str, smooth_rcp=None) -> np.ndarray:
    """Rule 1: x̂ as float32 holding D values (from smooth, or from its reciprocals rs = smooth_rcp)."""
    xf = np.asarray(x, dtype=np.float32)
    if smooth is None and smooth_rcp is None:
        return xf.copy()
    rs = smooth_reciprocals_ref(smooth, dtype) if smooth is not None else np.asarray(smooth_rcp, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = xf.astype(np.float64) * rs.astype(np.float64)[None, :]     # exact: two D values
    return round_once(prod, dtype)


#: (significant bits, exponent of the smallest subnormal, exponent of the first power of two past the range)
_FORMAT = {"bf16": (8, -133, 128), "fp16": (11, -24, 16)}


def round_once(v, dtype: str) -> np.ndarray:
    """float64 -> float32 holding RN_D(v): one round-to-nearest-even to D, subnormals kept, overflow -> inf,
    NaN kept (computed in float64, so no intermediate float32 rounding)."""
    bits, qmin, top = _FORMAT[dtype]
    a = np.abs(np.asarray(v, dtype=np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = np.frexp(np.where(np.isfinite(a), a, 0.0))
        q = np.ldexp(1.0, np.maximum(e - bits, qmin))
        r = np.rint(a / q) * q
        r = np.where(r >= 2.0 ** top, np.inf, r)
    return np.copysign(r, v).astype(np.float32)


def _dtype_of(x, dtype):
    if dtype is not None:
        if dtype not in ("bf16", "fp16"):
            raise ValueError(f"dtype must be 'bf16' or 'fp16', got {dtype!r}")
        return dtype
    return "fp16" if np.asarray(x).dtype == np.float16 else "bf16"


def quantize_act_ref(x, smooth=None, lora_down=None, scale_layout: str = "logical", *, dtype: str | None = None,
                     smooth_rcp=None):
    """The exact reference (rules above) on numpy arrays.

    ``x`` [M, K]: float16 (fp16), or float32 holding bf16 values (bf16; pass
    ``dtype`` to override).  ``smooth`` [K] (or its reciprocals ``smooth_rcp``,
    not both) and ``lora_down`` [K, R] hold values of the same 16-bit type.  Returns ``(act uint8 [M, K/2], ascales
    uint8 (logical [M, K/16] or blocked [ceil(M/128), ceil(K/64), 32, 4, 4]),
    lora_act_in float64 [M, R] or None)``.
    """
    dt = _dtype_of(x, dtype)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    m, k = x.shape
    if k % 16:
        raise ValueError(f"K = {k} is not a multiple of 16")
    if dt == "bf16" and x.dtype != np.float16 and not _is_bf16(x):
        raise ValueError("x (bf16) holds values that are not bf16 numbers")
    if scale_layout not in ("logical", "blocked"):
        raise ValueError(f"unknown scale_layout {scale_layout!r}")
    if smooth is not None and smooth_rcp is not None:
        raise ValueError("smooth and smooth_rcp: give one")
    for name, v in (("smooth", smooth), ("smooth_rcp", smooth_rcp)):
        if v is not None and np.asarray(v).shape != (k,):
            raise ValueError(f"{name} shape {np.asarray(v).shape} != ({k},)")
    xh = smooth_input(x, smooth, dt, smooth_rcp)           # float32 holding D values
    g = xh.reshape(m, k // 16, 16)
    ag = np.abs(g)
    with np.errstate(invalid="ignore"):
        amax = ag.max(axis=-1)                             # NaN-propagating
        nonfin = ~np.isfinite(amax)
        sc = (amax / np.float32(6.0)).astype(np.float32)
    b = e4m3_rne_satfinite(np.where(nonfin, np.float32(0.0), sc))
    s = decode_e4m3(b).astype(np.float32)
    zero = nonfin | (s == 0)
    b = np.where(nonfin, np.uint8(0x7F), b).astype(np.uint8)
    safe = np.where(zero, np.float32(1.0), s)[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        q = (np.where(zero[..., None], np.float32(0.0), g) / safe).astype(np.float32)
    mag = e2m1_code(q)
    sign = (np.signbit(g).astype(np.uint8) << 3)
    codes = np.where(zero[..., None], np.uint8(0), mag | sign).astype(np.uint8).reshape(m, k)
    act = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    if scale_layout == "logical":
        asc = b
    else:
        asc = to_blocked(b).reshape(-(-m // 128), -(-(k // 16) // 4), 32, 4, 4)
    lora = None
    if lora_down is not None:
        ld = np.asarray(lora_down, dtype=np.float64)
        if ld.ndim != 2 or ld.shape[0] != k:
            raise ValueError(f"lora_down shape {ld.shape} is not [K={k}, R]")
        lora = xh.astype(np.float64) @ ld
    return act, asc, lora


def quantize_act_ref_torch(x, smooth=None, lora_down=None, scale_layout: str = "logical"):
    """``quantize_act_ref`` on torch tensors (any device; bf16 or fp16) -> CPU torch tensors.

    Returns ``(act uint8, ascales uint8 (same layout rule), lora_act_in float64 or None)``.
    """
    import torch

    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}")
    dt = "bf16" if x.dtype == torch.bfloat16 else "fp16"

    def np32(t):
        if t is None:
            return None
        t = t.detach().cpu()
        return t.to(torch.float16).numpy() if dt == "fp16" else t.to(torch.float32).numpy()

    act, asc, lora = quantize_act_ref(np32(x), np32(smooth), np32(lora_down), scale_layout, dtype=dt)
    return (torch.from_numpy(np.ascontiguousarray(act)), torch.from_numpy(np.ascontiguousarray(asc)),
            None if lora is None else torch.from_numpy(lora))

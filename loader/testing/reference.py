"""Numerical reference for the SVDQuant W4A4 NVFP4 GEMM (docs/design.md, section 2).

    y[m, n] = (Σ_k A[m,k]·W[n,k])·wcscale[n] + bias[n] + Σ_r lora_act_in[m,r]·lora_up[n,r]
    A[m,k]  = e2m1(act[m, k//2] nibble) · e4m3(ascales[m, k//16])
    W[n,k]  = e2m1(wgt[n, k//2] nibble) · e4m3(wscales[n, k//16])

Conventions
-----------
* E2M1 nibble: bit 3 = sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
  In a packed byte the **low nibble is the even k**, the high nibble the odd k.
* Block scales are FP8 E4M3FN bytes (bias 7, exponent field 0 = subnormal
  mant·2^-9, 0x7F / 0xFF = NaN, max finite ±448), one per 16 consecutive k,
  logical layout ``[rows, K/16]``.  ``to_blocked`` / ``from_blocked`` convert
  to / from the CUTLASS/cuBLAS 32×4×4 scale-factor atom layout.

Independence
------------
The numpy core decodes every operand to float64 with explicit bit arithmetic
(no torch, no fp8 dtype support needed) and multiplies with ``np.matmul`` in
float64.  Each E2M1·E4M3 product has ≤ 6 significant bits, so every product
A[m,k]·W[n,k] is exact in float64 and the K-sum is exact unless it needs more
than 53 bits (in practice: exact; the worst case is ~1 ulp of float64).

Only numpy is imported at module level; torch is imported lazily inside the
torch-facing helpers (``reference_from_torch``, ``random_problem``,
``term_sensitivity``) so the module works on a GPU box with torch but without
the DSL, and on a box with numpy only.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "decode_e2m1",
    "encode_e2m1",
    "decode_e4m3",
    "encode_e4m3",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "to_blocked",
    "from_blocked",
    "blocked_size",
    "reference_gemm_w4a4",
    "apply_terms",
    "reference_from_torch",
    "random_problem",
    "term_sensitivity",
    "reference_images",
]

# ---------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: float64[16]; index = nibble code.  Code 8 is -0.0.
E2M1_VALUES = np.array(
    list(_E2M1_MAGNITUDES) + [-v for v in _E2M1_MAGNITUDES], dtype=np.float64
)
E2M1_VALUES.setflags(write=False)

E2M1_MAX = 6.0


def decode_e2m1(nibbles) -> np.ndarray:
    """E2M1 codes (any integer array, values 0..15) -> float64 of same shape."""
    codes = np.asarray(nibbles)
    if codes.dtype.kind not in "ui":
        raise TypeError(f"decode_e2m1 expects integer codes, got {codes.dtype}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("E2M1 codes must lie in 0..15")
    return E2M1_VALUES[codes.astype(np.intp)]


def encode_e2m1(x) -> np.ndarray:
    """float -> E2M1 code (uint8, 0..15), round-to-nearest-even, saturating to ±6.

    Ties go to the code with an even mantissa bit (= even code), as IEEE RNE:
    0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2, 2.5→2, 3.5→4, 5→4.  |x| > 6 (incl.
    ±inf) saturates to ±6.  The sign bit follows the sign of x (so -0.1 → code 8,
    i.e. -0.0).  NaN has no E2M1 encoding: it raises ValueError.
    """
    x = np.asarray(x, dtype=np.float64)
    if np.isnan(x).any():
        raise ValueError("encode_e2m1: NaN has no E2M1 encoding")
    grid = np.asarray(_E2M1_MAGNITUDES, dtype=np.float64)
    mag = _round_to_grid_rne(np.abs(x), grid)
    sign = np.signbit(x).astype(np.uint8) << 3
    return (mag.astype(np.uint8) | sign).astype(np.uint8)


def _round_to_grid_rne(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value to a (a >= 0, grid ascending, grid[0]=0).

    Ties go to the even index; values beyond grid[-1] saturate to the last
    index.  Index parity equals mantissa-LSB parity for both E2M1 and E4M3,
    so this is IEEE round-to-nearest-even with saturation.
    """
    last = grid.size - 1
    hi = np.searchsorted(grid, a, side="left")  # grid[hi-1] < a <= grid[hi]
    hi = np.clip(hi, 1, last)
    lo = hi - 1
    d_lo = a - grid[lo]
    d_hi = grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    idx = np.where(pick_hi, hi, lo)
    idx = np.where(a >= grid[last], last, idx)  # saturate (and exact max)
    return idx


# ---------------------------------------------------------------------------
# E4M3 (FN: no infinities, 0x7F/0xFF NaN, max 448)
# ---------------------------------------------------------------------------

E4M3_MAX = 448.0


def _e4m3_byte_value(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    e = (b >> 3) & 0xF
    m = b & 0x7
    if e == 0xF and m == 0x7:
        return math.copysign(math.nan, sign)  # 0xFF -> NaN with the sign bit set, as torch
    if e == 0:
        return sign * math.ldexp(m, -9)
    return sign * math.ldexp(8 + m, e - 7 - 3)


_E4M3_LUT = np.array([_e4m3_byte_value(b) for b in range(256)], dtype=np.float64)
_E4M3_LUT.setflags(write=False)
# Non-negative finite values, indexed by code 0x00..0x7E (monotone increasing).
_E4M3_POS_GRID = _E4M3_LUT[:0x7F].copy()


def decode_e4m3(b) -> np.ndarray:
    """E4M3FN bytes (uint8 array) -> float64 (exact; 0x7F/0xFF -> NaN; 0x80 -> -0.0)."""
    arr = np.asarray(b)
    if arr.dtype != np.uint8:
        if arr.dtype.kind not in "ui" or (arr.size and (arr.min() < 0 or arr.max() > 255)):
            raise TypeError(f"decode_e4m3 expects uint8 bytes, got {arr.dtype}")
        arr = arr.astype(np.uint8)
    return _E4M3_LUT[arr]


def encode_e4m3(x) -> np.ndarray:
    """float -> E4M3FN byte (uint8), round-to-nearest-even, saturating (satfinite).

    |x| > 448 (incl. ±inf) saturates to ±448 (0x7E / 0xFE); NaN -> 0x7F
    (0xFF if the NaN's sign bit is set).  Subnormals are rounded RNE on the
    2^-9 grid (2^-10 → 0x00, 3·2^-10 → 0x02).  Sign is kept, so -0.0 and
    negative values rounding to zero encode to 0x80.  This matches PTX
    ``cvt.rn.satfinite.e4m3x2.f32`` and agrees with torch's float8_e4m3fn cast
    for every |x| ≤ 448.
    """
    x = np.asarray(x, dtype=np.float64)
    nan = np.isnan(x)
    a = np.where(nan, 0.0, np.abs(x))
    code = _round_to_grid_rne(a, _E4M3_POS_GRID).astype(np.uint8)
    code = np.where(nan, np.uint8(0x7F), code).astype(np.uint8)
    sign = (np.signbit(x).astype(np.uint8) << 7).astype(np.uint8)
    return (code | sign).astype(np.uint8)


# ---------------------------------------------------------------------------
# Nibble packing
# ---------------------------------------------------------------------------


def pack_nibbles(codes) -> np.ndarray:
    """uint8 codes [..., K] (0..15) -> packed uint8 [..., K/2]; low nibble = even k."""
    c = np.asarray(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got {c.shape[-1]}")
    if c.size and (c.min() < 0 or c.max() > 15):
        raise ValueError("pack_nibbles: codes must lie in 0..15")
    c = c.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed) -> np.ndarray:
    """packed uint8 [..., K/2] -> codes uint8 [..., K]; element 2j = low nibble of byte j."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise TypeError(f"unpack_nibbles expects uint8, got {p.dtype}")
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


# ---------------------------------------------------------------------------
# NVFP4 quantize / dequantize (block 16, single-level)
# ---------------------------------------------------------------------------

BLOCK = 16


def quantize_nvfp4(x):
    """float [rows, K] -> (packed uint8 [rows, K/2], scales uint8 E4M3 [rows, K/16]).

    Per 16-block: scale = encode_e4m3(amax / 6); values = encode_e2m1(x / scale)
    (RNE, saturating at ±6, so a scale that rounded down costs at most a
    saturation of |x/scale| ≤ 6.4 → 6).
    Zero guard: an all-zero block gets scale byte 0x00 (decodes to 0) and
    codes 0.  A nonzero block whose amax/6 rounds to 0 in E4M3
    (amax < 6·2^-10) gets the smallest subnormal 0x01 (2^-9) instead.
    amax/6 > 448 saturates the scale to 448 (values then saturate at ±6).
    Non-finite input raises ValueError.

    Error bound (per element; scale = the decoded block scale):
    |x - dequant| ≤ max(|x|/4, scale/4, |x| - 6·scale), and the last term is
    ≤ |x|/4 whenever amax/6 lies in E4M3's normal range [2^-6, 448], so there
    |x - dequant| ≤ max(|x|/4, scale/4).  (Subnormal-range scales can round
    far below amax/6 and saturate the block.)
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"quantize_nvfp4 expects [rows, K], got shape {x.shape}")
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"K must be a multiple of {BLOCK}, got {k}")
    if not np.isfinite(x).all():
        raise ValueError("quantize_nvfp4: input must be finite")
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    sbytes = encode_e4m3(amax / E2M1_MAX)
    sbytes = np.where((sbytes == 0) & (amax > 0), np.uint8(0x01), sbytes).astype(np.uint8)
    s = decode_e4m3(sbytes)
    safe = np.where(s > 0, s, 1.0)[..., None]
    v = np.where(s[..., None] > 0, blocks / safe, 0.0)
    codes = encode_e2m1(v).reshape(rows, k)
    return pack_nibbles(codes), sbytes


def dequantize_nvfp4(packed, scales) -> np.ndarray:
    """(packed uint8 [rows, K/2], scales uint8 E4M3 [rows, K/16]) -> float64 [rows, K]."""
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    if packed.ndim != 2 or scales.ndim != 2:
        raise ValueError("dequantize_nvfp4 expects 2-D packed and scales")
    rows, half = packed.shape
    k = 2 * half
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    if scales.shape != (rows, k // BLOCK):
        raise ValueError(
            f"scales shape {scales.shape} does not match [rows, K/16] = {(rows, k // BLOCK)}"
        )
    vals = decode_e2m1(unpack_nibbles(packed)).reshape(rows, k // BLOCK, BLOCK)
    s = decode_e4m3(scales)[..., None]
    return (vals * s).reshape(rows, k)


# ---------------------------------------------------------------------------
# Blocked (32x4x4 atom) scale layout
# ---------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocked_size(rows: int, groups: int) -> int:
    """Number of elements of the blocked layout: rows padded to 128, groups to 4."""
    return _ceil_div(rows, 128) * 128 * _ceil_div(groups, 4) * 4


def to_blocked(scales) -> np.ndarray:
    """Logical scales [rows, G] -> 1-D blocked layout (dtype preserved, uint8 for bytes).

    Element (r, g) lands at flat index of [r//128, g//4, r%32, (r//32)%4, g%4]
    in an array of shape (ceil(rows/128), ceil(G/4), 32, 4, 4), i.e.
    ((((r//128)·Gb + g//4)·32 + r%32)·4 + (r//32)%4)·4 + g%4.  Padding is zero.
    Same as torchao's / cuBLAS's ``to_blocked``.
    """
    s = np.asarray(scales)
    if s.ndim != 2:
        raise ValueError(f"to_blocked expects [rows, groups], got shape {s.shape}")
    rows, groups = s.shape
    rb, gb = _ceil_div(rows, 128), _ceil_div(groups, 4)
    padded = np.zeros((rb * 128, gb * 4), dtype=s.dtype)
    padded[:rows, :groups] = s
    # (rb, r4, r32, gb, g4) -> (rb, gb, r32, r4, g4)
    return np.ascontiguousarray(
        padded.reshape(rb, 4, 32, gb, 4).transpose(0, 3, 2, 1, 4)
    ).reshape(-1)


def from_blocked(blocked, rows: int, groups: int) -> np.ndarray:
    """Inverse of ``to_blocked``: 1-D blocked -> logical [rows, groups] (padding dropped)."""
    b = np.asarray(blocked).reshape(-1)
    rb, gb = _ceil_div(rows, 128), _ceil_div(groups, 4)
    if b.size != rb * gb * 512:
        raise ValueError(
            f"blocked scales have {b.size} elements, expected {rb * gb * 512} "
            f"for rows={rows}, groups={groups}"
        )
    logical = b.reshape(rb, gb, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(rb * 128, gb * 4)
    return np.ascontiguousarray(logical[:rows, :groups])


# ---------------------------------------------------------------------------
# The reference GEMM
# ---------------------------------------------------------------------------


def _logical_scales(scales, rows: int, groups: int, name: str) -> np.ndarray:
    s = np.asarray(scales)
    if s.ndim == 1:  # blocked layout
        s = from_blocked(s, rows, groups)
    if s.shape != (rows, groups):
        raise ValueError(f"{name} shape {s.shape} != expected {(rows, groups)}")
    if s.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8 E4M3 bytes, got {s.dtype}")
    return s


def reference_gemm_w4a4(
    act,
    wgt,
    ascales,
    wscales,
    *,
    lora_act_in=None,
    lora_up=None,
    wcscale=None,
    bias=None,
) -> np.ndarray:
    """float64 [M, N] reference of the W4A4 GEMM (docs/design.md section 2; LoRA outside wcscale).

    act uint8 [M, K/2], wgt uint8 [N, K/2] (packed E2M1, low nibble = even k);
    ascales uint8 [M, K/16], wscales uint8 [N, K/16] (E4M3 bytes, logical
    layout; a 1-D array is taken to be the ``to_blocked`` layout);
    lora_act_in [M, R] and lora_up [N, R] (both or neither), wcscale [N],
    bias [N]: any float arrays, taken at their exact values.  None = term absent
    (wcscale None ≡ 1, bias None ≡ 0, LoRA None ≡ 0).
    """
    act = np.asarray(act)
    wgt = np.asarray(wgt)
    if act.dtype != np.uint8 or wgt.dtype != np.uint8:
        raise TypeError("act and wgt must be uint8 (packed E2M1)")
    if act.ndim != 2 or wgt.ndim != 2:
        raise ValueError("act and wgt must be 2-D")
    m, half = act.shape
    n, half_w = wgt.shape
    if half != half_w:
        raise ValueError(f"K mismatch: act has K={2 * half}, wgt has K={2 * half_w}")
    k = 2 * half
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    g = k // BLOCK
    a = dequantize_nvfp4(act, _logical_scales(ascales, m, g, "ascales"))
    w = dequantize_nvfp4(wgt, _logical_scales(wscales, n, g, "wscales"))
    return apply_terms(np.matmul(a, w.T), wcscale=wcscale, bias=bias, lora_act_in=lora_act_in, lora_up=lora_up)


def apply_terms(y, *, wcscale=None, bias=None, lora_act_in=None, lora_up=None) -> np.ndarray:
    """The operator's terms after the main product ``y`` [M, N] (float64): ``y · wcscale + bias + la·luᵀ``
    (LoRA outside wcscale; None = term absent), with their shapes checked."""
    m, n = y.shape
    if wcscale is not None:
        wc = np.asarray(wcscale, dtype=np.float64)
        if wc.shape != (n,):
            raise ValueError(f"wcscale shape {wc.shape} != ({n},)")
        y = y * wc[None, :]
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        if b.shape != (n,):
            raise ValueError(f"bias shape {b.shape} != ({n},)")
        y = y + b[None, :]
    if (lora_act_in is None) != (lora_up is None):
        raise ValueError("lora_act_in and lora_up must be given together")
    if lora_act_in is not None:
        la = np.asarray(lora_act_in, dtype=np.float64)
        lu = np.asarray(lora_up, dtype=np.float64)
        if la.ndim != 2 or lu.ndim != 2 or la.shape[0] != m or lu.shape[0] != n or la.shape[1] != lu.shape[1]:
            raise ValueError(
                f"LoRA shapes lora_act_in {la.shape}, lora_up {lu.shape} do not match [M,R], [N,R] "
                f"with M={m}, N={n}"
            )
        y = y + np.matmul(la, lu.T)
    return y


# ---------------------------------------------------------------------------
# torch-facing helpers (torch imported lazily)
# ---------------------------------------------------------------------------


def _to_numpy(t, kind: str):
    """torch tensor / numpy / None -> numpy.  kind: 'bytes' (raw uint8 view) or 'float'."""
    if t is None:
        return None
    try:
        import torch
    except ImportError:  # pragma: no cover - numpy-only environment
        torch = None
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.detach()
        if kind == "bytes":
            if t.element_size() != 1:
                raise TypeError(f"expected a 1-byte dtype (uint8 / float8 / fp4x2), got {t.dtype}")
            if t.dtype != torch.uint8:
                t = t.view(torch.uint8)
            return t.cpu().contiguous().numpy()
        return t.cpu().to(torch.float64).contiguous().numpy()
    arr = np.asarray(t)
    return arr if kind == "bytes" else arr.astype(np.float64)


def reference_from_torch(
    act,
    wgt,
    ascales,
    wscales,
    *,
    lora_act_in=None,
    lora_up=None,
    wcscale=None,
    bias=None,
):
    """``reference_gemm_w4a4`` on torch tensors (CPU or CUDA) -> float64 CPU torch tensor.

    act/wgt: uint8 (or any 1-byte dtype, viewed as uint8).  ascales/wscales:
    torch.float8_e4m3fn or uint8, [rows, K/16] logical or 1-D blocked.
    LoRA / wcscale / bias: any float dtype, converted exactly to float64.
    """
    import torch

    y = reference_gemm_w4a4(
        _to_numpy(act, "bytes"),
        _to_numpy(wgt, "bytes"),
        _to_numpy(ascales, "bytes"),
        _to_numpy(wscales, "bytes"),
        lora_act_in=_to_numpy(lora_act_in, "float"),
        lora_up=_to_numpy(lora_up, "float"),
        wcscale=_to_numpy(wcscale, "float"),
        bias=_to_numpy(bias, "float"),
    )
    return torch.from_numpy(np.ascontiguousarray(y))



def reference_torch_f64(
    act,
    wgt,
    ascales,
    wscales,
    *,
    lora_act_in=None,
    lora_up=None,
    wcscale=None,
    bias=None,
):
    """The same float64 reference computed with torch on the tensors' own device.

    For large GPU test problems (a float64 GEMM on the GPU instead of the
    host).  Decodes through the module's exact lookup tables (E2M1_VALUES and
    decode_e4m3 over all 256 bytes), expands the per-16 block scales, and
    multiplies in float64; logical scale layout only.  Returns float64 on the
    input device.
    """
    y = torch_operand(act, ascales) @ torch_operand(wgt, wscales).T
    return torch_terms(y, wcscale=wcscale, bias=bias, lora_act_in=lora_act_in, lora_up=lora_up)


def torch_operand(packed, scales):
    """float64 [rows, K] of a packed NVFP4 operand and its logical E4M3 scales, on their device (exact)."""
    import torch
    dev = packed.device
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=dev)
    e4m3 = torch.tensor(decode_e4m3(np.arange(256, dtype=np.uint8)), dtype=torch.float64, device=dev)
    b = packed.view(torch.uint8).long()
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1)   # low nibble = even k
    sc = e4m3[scales.view(torch.uint8).long()].repeat_interleave(BLOCK, dim=1)
    return e2m1[codes] * sc


def torch_terms(y, *, wcscale=None, bias=None, lora_act_in=None, lora_up=None):
    """`apply_terms` in torch float64 on y's device."""
    import torch
    if wcscale is not None:
        y = y * wcscale.to(torch.float64)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float64)[None, :]
    if lora_act_in is not None:
        y = y + lora_act_in.to(torch.float64) @ lora_up.to(torch.float64).T
    return y


def _torch_out_dtype(out_dtype):
    import torch

    if isinstance(out_dtype, torch.dtype):
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"out_dtype must be bf16 or fp16, got {out_dtype}")
        return out_dtype
    names = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "f16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    try:
        return names[str(out_dtype).lower()]
    except KeyError:
        raise ValueError(f"out_dtype must be bf16 or fp16, got {out_dtype!r}") from None


# Mean square of an E2M1 value over all 16 codes (uniform): 68.5 / 8.
_E2M1_MEAN_SQ = float(np.mean(E2M1_VALUES**2))
# Target RMS of the raw main product Σ_k A·W in random_problem.  Slightly above
# the bias / LoRA RMS (1.0) so the wcscale term, whose size is ∝ main·(wcscale−1),
# is as visible as the others.
_MAIN_RMS = 1.5


def random_problem(
    M: int,
    N: int,
    K: int,
    R: int,
    *,
    seed: int,
    out_dtype="bf16",
    wcscale: bool = True,
    bias: bool = True,
    device="cpu",
):
    """A random W4A4 problem as a dict of torch tensors ready for the kernel.

    Keys: ``act`` uint8 [M, K/2], ``wgt`` uint8 [N, K/2], ``ascales``
    float8_e4m3fn [M, K/16], ``wscales`` float8_e4m3fn [N, K/16] (logical
    layout; use ``to_blocked`` for the kernel layout), ``lora_act_in`` [M, R]
    and ``lora_up`` [N, R] in ``out_dtype``, ``wcscale`` and ``bias`` float32
    [N] (None when disabled; LoRA None when R == 0).  The dict can be splatted
    into ``reference_from_torch(**p)``; the output dtype is
    ``p["lora_act_in"].dtype`` when R > 0.  Deterministic in ``seed``
    (generated with numpy on the CPU, then moved to ``device``).

    Magnitudes (measured: raw main RMS ≈ 1.7, output RMS ≈ 2.6, max |y| ≈ 20;
    removing any one term changes y by ≥ 0.1·‖y‖ — typically 0.3–0.8 — far
    above a 1e-2 tolerance; over 200 seeds the smallest sensitivity seen was
    0.22 at M=1, N=64 and 0.13 even at M=1, N=16):
      * nibbles: uniform over all 16 codes (E[e2m1²] = 8.5625); code 0 of each
        row is forced nonzero, so no row is all zeros.
      * block scales: 2^u, u ~ U(-2, 1) (3 binades within a row), each row then
        rescaled so its RMS scale is 2^U(-0.5, 0.5)·√target, target =
        1.5/(E[e2m1²]·√K), and rounded to E4M3 (0 bumped to 0x01).  So the raw
        main product Σ_k A·W has RMS ≈ 1.5–1.7 for any K and every row (per-row
        normalisation keeps tiny K, e.g. M=1, K=16, from rolling a tiny row).
        Observed scale ranges: 2^-2.8..2^-1.8 at K=16, 2^-5.4..2^-1.4 at K=64,
        2^-7..2^-3 at K=12288 (17 % E4M3 subnormals there, 4 % at K=3072).
      * wcscale: 2^(±U(0.5, 1)) per column, random sign: in [0.5, 0.71] ∪
        [1.41, 2], never ≈ 1 (|wcscale−1| ≥ 0.29), so ‖main·(wcscale−1)‖ ≈
        0.6·‖main‖.
      * bias: N(0, 1) float32, rescaled to RMS exactly 1.
      * LoRA: lora_act_in, lora_up ~ N(0, 1), each row rescaled to RMS exactly
        R^(-1/4), rounded to out_dtype, so Σ_r has RMS ≈ 1.
    Output magnitudes are O(1)–O(10): no fp16/bf16 overflow; bf16 output rounding is ≤ 2^-9 relative per element.
    """
    import torch

    if K % BLOCK or K <= 0:
        raise ValueError(f"K must be a positive multiple of {BLOCK}, got {K}")
    if M <= 0 or N <= 0 or R < 0:
        raise ValueError(f"bad shape M={M}, N={N}, R={R}")
    tdt = _torch_out_dtype(out_dtype)
    rng = np.random.default_rng(seed)
    g = K // BLOCK

    def nibbles(rows):
        codes = rng.integers(0, 16, size=(rows, K), dtype=np.uint8)
        codes[:, 0] = rng.integers(1, 8, size=rows) | (rng.integers(0, 2, size=rows) << 3)  # never an all-zero row
        return pack_nibbles(codes)

    # target E[s^2] per side so the raw main product has RMS ~ _MAIN_RMS
    target = _MAIN_RMS / (_E2M1_MEAN_SQ * math.sqrt(K))

    def scales(rows):
        # 3 binades of spread within each row, then each row renormalised so its
        # RMS scale is within half a binade of the target (keeps the main term
        # O(1) for every row even when K/16 is tiny, e.g. M = 1, K = 16).
        raw = np.exp2(rng.uniform(-2.0, 1.0, size=(rows, g)))
        row_rms = np.sqrt(np.mean(raw**2, axis=1, keepdims=True))
        shift = rng.uniform(-0.5, 0.5, size=(rows, 1))
        b = encode_e4m3(raw * (math.sqrt(target) / row_rms) * np.exp2(shift))
        return np.where(b == 0, np.uint8(0x01), b).astype(np.uint8)

    act = nibbles(M)
    wgt = nibbles(N)
    asc = scales(M)
    wsc = scales(N)

    out = {
        "act": torch.from_numpy(act),
        "wgt": torch.from_numpy(wgt),
        "ascales": torch.from_numpy(asc).view(torch.float8_e4m3fn),
        "wscales": torch.from_numpy(wsc).view(torch.float8_e4m3fn),
        "lora_act_in": None,
        "lora_up": None,
        "wcscale": None,
        "bias": None,
    }
    if R > 0:
        def lora(rows):
            # Gaussian rows rescaled to RMS exactly R^(-1/4) (removes row-norm luck at small M).
            x = rng.standard_normal((rows, R))
            x *= R**-0.25 / np.sqrt(np.mean(x**2, axis=1, keepdims=True))
            return torch.from_numpy(x).to(tdt)

        out["lora_act_in"] = lora(M)
        out["lora_up"] = lora(N)
    # Draw wcscale / bias unconditionally so the other tensors do not depend on the flags.
    wc = np.exp2(rng.choice([-1.0, 1.0], size=N) * rng.uniform(0.5, 1.0, size=N))
    bs = rng.standard_normal(N)
    bs /= np.sqrt(np.mean(bs**2))  # RMS exactly 1
    if wcscale:
        out["wcscale"] = torch.from_numpy(wc.astype(np.float32))
    if bias:
        out["bias"] = torch.from_numpy(bs.astype(np.float32))
    return {k: (v.to(device) if v is not None else None) for k, v in out.items()}


def term_sensitivity(problem) -> dict:
    """Relative effect of each present term on the reference output.

    Returns {term: ‖y − y_without_term‖ / ‖y‖} (Frobenius norms, float64
    reference) for "main" (act set to all-zero codes), "lora", "bias", and for
    "wcscale" ‖y − y_with_wcscale=1‖ / ‖y‖.  Absent terms are omitted.
    A kernel that drops or mis-applies a term with sensitivity ≥ 0.1 fails a
    1e-2 relative-error check.
    """
    p = dict(problem)
    y = reference_from_torch(**p).numpy()
    ny = np.linalg.norm(y)
    if ny == 0:
        raise ValueError("reference output is identically zero")

    def rel(**override):
        q = dict(p)
        q.update(override)
        return float(np.linalg.norm(y - reference_from_torch(**q).numpy()) / ny)

    act_np = _to_numpy(p["act"], "bytes")
    res = {"main": rel(act=np.zeros_like(act_np))}
    if p.get("lora_act_in") is not None:
        res["lora"] = rel(lora_act_in=None, lora_up=None)
    if p.get("wcscale") is not None:
        res["wcscale"] = rel(wcscale=None)
    if p.get("bias") is not None:
        res["bias"] = rel(bias=None)
    return res


# ---------------------------------------------------------------------------
# decode_act: the stage images of the sm_90a images GEMM (format: svdq_loader.ops.decode_act)
# ---------------------------------------------------------------------------

def reference_images(packed, scales) -> np.ndarray:
    """act [M, K/2] uint8 + logical ascales [M, K/16] (E4M3 bytes) -> the image bytes (uint8, 1-D).

    Independent of the kernel: float64 e2m1 x e4m3 x 2^-7 per element, rounded once to fp16 (exact: the
    function checks it), rows padded with +0.0 to ``image_rows(M)``, then laid out element by element with
    ``decode_act.image_offset``'s formula (k-tile major, 128-byte rows, chunk c at c ^ (row % 8))."""
    from svdq_loader.ops.decode_act import IMAGE_K, IMAGE_SCALE_LOG2, image_rows
    p = np.asarray(packed, dtype=np.uint8)
    s = np.asarray(scales)
    s = s if s.dtype == np.uint8 else s.view(np.uint8)
    m, kh = p.shape
    k = 2 * kh
    vals = decode_e2m1(unpack_nibbles(p)) * np.repeat(decode_e4m3(s), 16, axis=1) * 2.0 ** IMAGE_SCALE_LOG2
    h = vals.astype(np.float16)
    fin = np.isfinite(vals)
    if not np.array_equal(h[fin].astype(np.float64), vals[fin]):
        raise AssertionError("reference_images: a value is not exact in fp16")
    mp = image_rows(m)
    full = np.zeros((mp, k), dtype=np.float16)
    full[:m] = h
    t = full.reshape(mp, k // IMAGE_K, 8, 8).transpose(1, 0, 2, 3)     # [k-tile, row, chunk, 8]
    rows = np.arange(mp)[:, None]
    phys = np.arange(8)[None, :] ^ (rows % 8)                            # physical chunk p holds chunk p ^ (r % 8)
    out = np.take_along_axis(t, np.broadcast_to(phys[None, :, :, None], t.shape), axis=2)
    return np.ascontiguousarray(out).view(np.uint8).reshape(-1)

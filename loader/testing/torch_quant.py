"""The two operators written in plain torch ops: the eager and `torch.compile` baselines of the bench.

    quantize_act(x, smooth, lora_down) -> (act, ascales, lora_act_in)
    w4a4_unfused(act, ascales, wgt, wscales, ...) -> y      (docs/design.md section 2: dequantize + matmul + epilogue)

Both run on any device (the CPU tests use them too) and only use ops that
`torch.compile` lowers and CUDA graphs can capture (no host syncs).

quantize_act follows the rules of `quantize_ref` (the kernel's exact spec):
    x̂      = x * (1 / smooth.float()).to(x.dtype)           (x̂ = x without smooth; a 16-bit multiply
                                                          rounds the exact product once)
    per row and group of 16 consecutive k:
    scale  = e4m3(min(amax|x̂| / 6, 448))              (RNE cast; clamped first so it saturates)
    v      = x̂ / float(scale)                           (0 where scale == 0)
    code   = E2M1(v): RNE, saturating at ±6; bit 3 = sign bit of x̂
    a group holding inf / NaN: scale byte 0x7F (NaN), codes 0
    act    = code[2j] | code[2j+1] << 4                 (low nibble = even k)
    lora_act_in = x̂ @ lora_down                         (fp32 accumulation in the matmul, result in x.dtype)
On the CPU and in eager CUDA every step is IEEE, so codes and scales match
`quantize_ref` bit for bit (seen on an H200 too).  Under torch.compile about
2 % of the bf16 code bytes and 3 % of the scales differ (inductor keeps
intermediates in fp32 unless emulate_precision_casts is set); that version
is only a timing baseline.
"""
from __future__ import annotations

import torch

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# |v| thresholds between consecutive E2M1 magnitudes.  A tie goes to the even
# code: 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0 (code 4),
# 2.5 -> 2.0, 3.5 -> 4.0 (code 6), 5 -> 4.0.  So a threshold whose tie rounds
# down is compared with `>`, one whose tie rounds up with `>=`.
_THRESHOLDS = ((0.25, ">"), (0.75, ">="), (1.25, ">"), (1.75, ">="), (2.5, ">"), (3.5, ">="), (5.0, ">"))

_LUTS: dict = {}


def e2m1_lut(dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """The 16 E2M1 values (index = nibble code; code 8 is -0.0) as a tensor (cached per dtype/device)."""
    key = (dtype, str(torch.device(device)))
    lut = _LUTS.get(key)
    if lut is None:
        vals = list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES]
        lut = _LUTS[key] = torch.tensor(vals, dtype=dtype, device=device)
    return lut


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float tensor -> uint8 E2M1 codes (0..15), round-to-nearest-even, saturating at ±6."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t, op in _THRESHOLDS:
        mag = mag + (a > t if op == ">" else a >= t).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def smooth_input(x: torch.Tensor, smooth: torch.Tensor | None, smooth_rcp: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x̂ of quantize_ref's rule 1: x times 1 / smooth rounded to x's dtype (or times `smooth_rcp`, those
    reciprocals given), a 16-bit multiply (the exact product rounded once); x itself without either."""
    if smooth_rcp is not None:
        return x * smooth_rcp
    return x if smooth is None else x * (1.0 / smooth.float()).to(x.dtype)


def quantize_act(x: torch.Tensor, smooth: torch.Tensor | None = None, lora_down: torch.Tensor | None = None,
                 smooth_rcp: torch.Tensor | None = None):
    """x [M, K] bf16/fp16 -> (act uint8 [M, K/2], ascales float8_e4m3fn [M, K/16], lora_act_in [M, R] or None)."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    xh = smooth_input(x, smooth, smooth_rcp)
    g = xh.float().view(m, k // BLOCK, BLOCK)
    amax = g.abs().amax(dim=-1)
    sc = torch.where(torch.isfinite(amax), amax / 6.0, torch.full_like(amax, float("nan")))
    scale = sc.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)      # NaN stays NaN: byte 0x7F
    s = scale.float().unsqueeze(-1)
    v = torch.where(s > 0, g / s, torch.zeros_like(g))         # False for s == 0 and for NaN
    codes = encode_e2m1(v).view(m, k)
    act = codes[:, 0::2] | (codes[:, 1::2] << 4)
    lora = None
    if lora_down is not None:
        lora = torch.matmul(xh, lora_down.to(x.dtype))
    return act, scale, lora


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16, lut: torch.Tensor | None = None):
    """NVFP4 (packed uint8 [rows, K/2], E4M3 scales [rows, K/16], logical layout) -> dtype [rows, K].

    Exact in bf16 and fp16: an E2M1 value times an E4M3 scale has at most 6
    significant bits and lies in [2^-10, 2688].
    """
    if lut is None:
        lut = e2m1_lut(dtype, packed.device)
    b = packed.view(torch.uint8)
    rows = b.shape[0]
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(rows, -1)
    k = codes.shape[1]
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    vals = lut[codes.long()].view(rows, k // BLOCK, BLOCK)
    return (vals * scales.to(dtype).unsqueeze(-1)).view(rows, k)


def w4a4_unfused(act, ascales, wgt, wscales, lora_act_in=None, lora_up=None, wcscale=None, bias=None,
                 out_dtype=torch.bfloat16, *, lut: torch.Tensor | None = None) -> torch.Tensor:
    """y = (A·Wᵀ)·wcscale + bias + lora_act_in·lora_upᵀ with A, W dequantized to `out_dtype` (unfused)."""
    a = dequantize(act, ascales, out_dtype, lut)
    w = dequantize(wgt, wscales, out_dtype, lut)
    y = torch.matmul(a, w.t())
    if wcscale is not None:
        y = y * wcscale.to(out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    if lora_act_in is not None:
        y = torch.addmm(y, lora_act_in.to(out_dtype), lora_up.to(out_dtype).t())
    return y


_COMPILED: dict = {}


def compiled(fn):
    """`torch.compile(fn, dynamic=False)` (default mode, cached): one static compilation per shape.

    Static shapes give torch its best kernels (on an H200, automatic dynamic
    shapes made the compiled quantizer 5x slower at K=15360); each shape
    compiles in a few seconds, so the recompile limits are raised.
    """
    c = _COMPILED.get(fn)
    if c is None:
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        c = _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return c

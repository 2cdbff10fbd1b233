"""SVDQuant's offline recipe for one linear: smoothing, rank-R SVD branch, NVFP4 residual.

For ``y = x·Wᵀ + b`` with ``W [N, K]``:

1. **Smoothing** (optional, needs the activations' per-channel ``amax [K]``
   from a calibration batch): ``smooth[k] = amax_x[k]^α / amax_w[k]^(1-α)``
   (α = 0.5 by default; a channel with no signal on either side gets 1),
   rounded to the activation dtype, because ``quantize_act`` reads it in that
   dtype.  Then ``x̂ = x / smooth`` and ``W' = W · diag(smooth)``, so
   ``x̂·W'ᵀ = x·Wᵀ``.
2. **Low-rank branch**: the best rank-R approximation ``W' ≈ U_R Σ_R V_Rᵀ``.
   ``lora_up = U_R·√Σ_R  [N, R]`` and ``lora_down = V_R·√Σ_R  [K, R]``, both
   rounded to the activation dtype (√Σ on each side keeps their magnitudes
   alike).  ``svd="exact"`` uses a full SVD, ``svd="lowrank"`` a randomised
   one (``torch.svd_lowrank``, for large models where time matters).
3. **Residual** ``W' - lora_up·lora_downᵀ`` (with the *rounded* factors, so
   the residual absorbs their rounding) is quantized to NVFP4 by
   `svdq_loader.weights.quantize_weight`: per-output-channel ``wcscale`` so
   that every block scale fits E4M3 and each row's largest block uses 448.

The layer then computes
``y = (Q(x̂)·Q(res)ᵀ)·wcscale + bias + (x̂·lora_down)·lora_upᵀ``: the
operator of docs/design.md section 2.  Everything here runs once, offline, on
whatever device the weight is on (CPU works).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from svdq_loader.errors import InvalidArgument
from svdq_loader.weights import quantize_weight

SVD_METHODS = ("exact", "lowrank")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class QuantizedLinear:
    """The tensors of one W4A4 linear, in the layouts `W4A4Linear` stores (docs/torch.md)."""
    qweight: torch.Tensor            # [N, K/2] uint8
    wscales: torch.Tensor            # [N, K/16] float8_e4m3fn, logical layout
    wcscale: torch.Tensor            # [N] float32
    bias: torch.Tensor | None        # [N] float32
    smooth: torch.Tensor | None      # [K] activation dtype
    lora_down: torch.Tensor | None   # [K, R] activation dtype
    lora_up: torch.Tensor | None     # [N, R] activation dtype


def smooth_factor(weight: torch.Tensor, act_amax: torch.Tensor, *, alpha: float = 0.5,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``amax_x^α / amax_w^(1-α)`` per input channel, rounded to `dtype` (1 where either side is 0)."""
    k = weight.shape[1]
    if not isinstance(act_amax, torch.Tensor) or tuple(act_amax.shape) != (k,):
        raise InvalidArgument(f"act_amax must be a tensor of shape ({k},) (one max |x| per input channel), "
                              f"got {type(act_amax).__name__} {tuple(getattr(act_amax, 'shape', ()))}")
    if not 0.0 <= alpha <= 1.0:
        raise InvalidArgument(f"smoothing alpha must lie in [0, 1], got {alpha}")
    ax = act_amax.detach().to(weight.device, torch.float32).abs()
    if not torch.isfinite(ax).all():
        raise InvalidArgument("act_amax holds inf or NaN: the calibration batch is not finite")
    aw = weight.detach().to(torch.float32).abs().amax(dim=0)
    s = ax.pow(alpha) / aw.pow(1.0 - alpha)
    ok = (ax > 0) & (aw > 0) & torch.isfinite(s) & (s > 0)
    s = torch.where(ok, s, torch.ones_like(s)).to(dtype)
    # a factor that rounds to 0 or inf in the 16-bit dtype would break x / smooth
    bad = ~torch.isfinite(s.float()) | (s.float() == 0)
    return torch.where(bad, torch.ones_like(s), s).contiguous()


def low_rank(w: torch.Tensor, rank: int, *, svd: str = "exact", seed: int = 0):
    """(up [N, R], down [K, R]) float32 with ``up·downᵀ`` the rank-R SVD approximation of `w` [N, K]."""
    if svd not in SVD_METHODS:
        raise InvalidArgument(f"svd must be one of {SVD_METHODS}, got {svd!r}")
    w = w.to(torch.float32)
    if svd == "exact":
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        u, s, v = u[:, :rank], s[:rank], vh[:rank].T
    else:
        devices = [w.device] if w.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):      # deterministic, and the caller's RNG is untouched
            torch.manual_seed(seed)
            u, s, v = torch.svd_lowrank(w, q=min(rank + 16, min(w.shape)), niter=4)
        u, s, v = u[:, :rank], s[:rank], v[:, :rank]
    r = s.clamp(min=0).sqrt()
    return (u * r).contiguous(), (v * r).contiguous()


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, rank: int = 32,
                    act_amax: torch.Tensor | None = None, alpha: float = 0.5, svd: str = "exact",
                    dtype: torch.dtype | None = None) -> QuantizedLinear:
    """Run the recipe on ``weight [N, K]`` (+ ``bias [N]``); `dtype` is the activation dtype (default: W's)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise InvalidArgument(f"weight must be a 2-D floating-point tensor [N, K], got "
                              f"{type(weight).__name__} {tuple(getattr(weight, 'shape', ()))}")
    n, k = weight.shape
    dtype = dtype or weight.dtype
    if dtype not in _HALF:
        raise InvalidArgument(f"the activation dtype must be torch.bfloat16 or torch.float16, got {dtype} "
                              f"(pass dtype= for a float32 weight)")
    if not isinstance(rank, int) or rank < 0 or rank % 16:
        raise InvalidArgument(f"rank must be 0 or a positive multiple of 16, got {rank!r}")
    if rank > min(n, k):
        raise InvalidArgument(f"rank {rank} exceeds min(N, K) = {min(n, k)} of the weight [{n}, {k}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise InvalidArgument(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    with torch.no_grad():
        w = weight.detach().to(torch.float32)
        smooth = None
        if act_amax is not None:
            smooth = smooth_factor(weight, act_amax, alpha=alpha, dtype=dtype)
            w = w * smooth.to(torch.float32)[None, :]
        down = up = None
        res = w
        if rank:
            up32, down32 = low_rank(w, rank, svd=svd)
            up, down = up32.to(dtype).contiguous(), down32.to(dtype).contiguous()
            res = w - up.to(torch.float32) @ down.to(torch.float32).T
        qw = quantize_weight(res)
        b = bias.detach().to(torch.float32).contiguous() if bias is not None else None
    return QuantizedLinear(qw.wgt, qw.wscales, qw.wcscale, b, smooth, down, up)

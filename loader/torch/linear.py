"""`W4A4Linear`: an SVDQuant W4A4 linear layer as an `nn.Module` (state dict: docs/torch.md).

    layer = W4A4Linear.from_linear(linear, lib=lib, rank=32, act_amax=amax)   # offline recipe
    layer = W4A4Linear.from_tensors(qweight=..., wscales=..., wcscale=..., lib=lib)
    y = layer(x)          # x [..., K] bf16/fp16 on the GPU -> y [..., N] in x's dtype
    W4A4Linear(..., compute="fp8")   # the FP8-compute mode (sm_90a; not bit-equivalent: docs/design.md section 2)

forward = ``quantize_act`` (smooth, NVFP4 codes and scales, LoRA-down) ->
``gemm_w4a4`` with the layer's weights, both through `svdq_loader.torch._ops` (in the FP8-compute mode,
eagerly, ``quantize_act(..., compute="fp8")`` and the GEMM from its E4M3 activation).
`reference(x)` computes the same quantized math in float64 with torch ops
(any device), for checking a layer's output.
"""
from __future__ import annotations

import torch
from torch import nn

from svdq_loader.errors import InvalidArgument
from svdq_loader.ops.layouts import BLOCK_K, COMPUTE_MODES
from svdq_loader.ops.quantize_act import smooth_reciprocals
from svdq_loader.torch import _ops
from svdq_loader.torch.recipe import quantize_linear

#: Buffers whose dtype is part of the format: `module.to(dtype)` moves them but keeps their dtype.
FIXED_DTYPE = ("qweight", "wscales", "wcscale", "bias")
#: Every state-dict name, in order (optional ones may be absent).
STATE_NAMES = ("qweight", "wscales", "wcscale", "bias", "smooth", "lora_down", "lora_up")
_HALF = (torch.float16, torch.bfloat16)


def _check_compute(compute) -> str:
    if compute not in COMPUTE_MODES:
        raise InvalidArgument(f"compute must be one of {', '.join(map(repr, COMPUTE_MODES))}, got {compute!r}")
    return compute


class W4A4Linear(nn.Module):
    """y = (Q(x̂)·Q(W)ᵀ)·wcscale + bias + (x̂·lora_down)·lora_upᵀ, x̂ = x / smooth (docs/design.md section 2)."""

    def __init__(self, in_features: int, out_features: int, *, rank: int = 32, bias: bool = True,
                 smooth: bool = False, dtype: torch.dtype = torch.bfloat16, device=None, lib=None,
                 compute: str = "exact"):
        super().__init__()
        #: "exact" (the default) or "fp8": the GEMM's compute mode (`prepare_weight`; never chosen silently)
        self.compute = _check_compute(compute)
        if in_features < BLOCK_K or in_features % BLOCK_K or out_features < 1:
            raise InvalidArgument(f"W4A4Linear needs in_features a positive multiple of {BLOCK_K} and "
                                  f"out_features >= 1, got in_features={in_features}, out_features={out_features}")
        if not isinstance(rank, int) or rank < 0 or rank % 16:
            raise InvalidArgument(f"rank must be 0 or a positive multiple of 16, got {rank!r}")
        if dtype not in _HALF:
            raise InvalidArgument(f"dtype (activations, LoRA, output) must be torch.bfloat16 or torch.float16, "
                                  f"got {dtype}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        k, n = in_features, out_features
        e = lambda *s, dt: torch.empty(*s, dtype=dt, device=device)  # noqa: E731
        self.register_buffer("qweight", e(n, k // 2, dt=torch.uint8))
        self.register_buffer("wscales", e(n, k // BLOCK_K, dt=torch.float8_e4m3fn))
        self.register_buffer("wcscale", e(n, dt=torch.float32))
        self.register_buffer("bias", e(n, dt=torch.float32) if bias else None)
        self.register_buffer("smooth", e(k, dt=dtype) if smooth else None)
        self.register_buffer("lora_down", e(k, rank, dt=dtype) if rank else None)
        self.register_buffer("lora_up", e(n, rank, dt=dtype) if rank else None)
        self._prepared: dict = {}
        self._rcp: tuple | None = None    # ((smooth's pointer, version), its reciprocals): `_smooth_rcp`
        self._lib = None
        if lib is not None:          # the weight is prepared once the buffers hold values (load_tensors, attach)
            _ops.register(lib)
            self._lib = lib

    # -- construction ------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rank: int = 32, act_amax: torch.Tensor | None = None,
                    alpha: float = 0.5, svd: str = "exact", dtype: torch.dtype | None = None,
                    lib=None, compute: str = "exact") -> "W4A4Linear":
        """SVDQuant's offline recipe (`recipe.quantize_linear`) on a bf16/fp16 `nn.Linear`.

        `act_amax [K]`: max |x| per input channel over a calibration batch
        (`calibrate`); without it there is no smoothing.
        """
        if not isinstance(linear, nn.Linear):
            raise InvalidArgument(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        q = quantize_linear(linear.weight, linear.bias, rank=rank, act_amax=act_amax, alpha=alpha, svd=svd,
                            dtype=dtype)
        return cls.from_tensors(**q.__dict__, lib=lib, compute=compute)

    @classmethod
    def from_tensors(cls, *, qweight, wscales, wcscale, bias=None, smooth=None, lora_down=None, lora_up=None,
                     lib=None, compute: str = "exact") -> "W4A4Linear":
        """A layer holding already-quantized tensors (layouts: docs/torch.md); they are checked, then copied."""
        if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise InvalidArgument(f"qweight must be a 2-D uint8 tensor [N, K/2], got "
                                  f"{getattr(qweight, 'dtype', type(qweight).__name__)} "
                                  f"{tuple(getattr(qweight, 'shape', ()))}")
        n, k = qweight.shape[0], 2 * qweight.shape[1]
        if (lora_down is None) != (lora_up is None):
            raise InvalidArgument("lora_down and lora_up must be given together")
        rank = int(lora_up.shape[1]) if lora_up is not None else 0
        halves = [t for t in (smooth, lora_down, lora_up) if t is not None]
        dtype = halves[0].dtype if halves else torch.bfloat16
        layer = cls(k, n, rank=rank, bias=bias is not None, smooth=smooth is not None, dtype=dtype,
                    device=qweight.device, lib=lib, compute=compute)
        given = dict(qweight=qweight, wscales=wscales, wcscale=wcscale, bias=bias, smooth=smooth,
                     lora_down=lora_down, lora_up=lora_up)
        layer.load_tensors(given)
        return layer

    @classmethod
    def from_state_dict(cls, state: dict, *, prefix: str = "", lib=None, compute: str = "exact") -> "W4A4Linear":
        """A layer shaped and filled from a state dict (e.g. one read with safetensors)."""
        t = {n: state.get(prefix + n) for n in STATE_NAMES}
        if t["qweight"] is None:
            raise InvalidArgument(f"state dict has no {prefix}qweight: not a W4A4Linear state")
        return cls.from_tensors(**t, lib=lib, compute=compute)

    def load_tensors(self, given: dict) -> None:
        """Copy tensors into the buffers after checking names, shapes and dtypes (raises InvalidArgument)."""
        for name in STATE_NAMES:
            buf, t = getattr(self, name), given.get(name)
            if (buf is None) != (t is None):
                raise InvalidArgument(f"{name}: the layer {'has' if buf is not None else 'has no'} it but the "
                                      f"tensors {'lack' if t is None else 'hold'} it")
            if buf is None:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(buf.shape):
                raise InvalidArgument(f"{name} must have shape {tuple(buf.shape)}, got "
                                      f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
            if name in ("qweight", "wscales") and t.dtype != buf.dtype:
                raise InvalidArgument(f"{name} must have dtype {buf.dtype}, got {t.dtype}")
            if name not in ("qweight", "wscales") and not t.is_floating_point():
                raise InvalidArgument(f"{name} must be a floating-point tensor, got {t.dtype}")
            if name in ("smooth", "lora_down", "lora_up") and t.dtype != buf.dtype:
                raise InvalidArgument(f"{name} has dtype {t.dtype} but the layer's activation dtype is {buf.dtype} "
                                      f"(smooth, lora_down and lora_up share one dtype)")
            with torch.no_grad():
                buf.copy_(t)
        self.attach(self._lib)          # prepared again from the new values (on a GPU, with a library)

    # -- runtime -----------------------------------------------------------
    def attach(self, lib) -> "W4A4Linear":
        """Use the kernels of `lib` (an `svdq_loader.Library`) in forward (and register it with the
        custom ops that compiled forwards launch through)."""
        if lib is not None:
            _ops.register(lib)
        self._lib = lib
        self._prepared.clear()
        if lib is not None and self.qweight.is_cuda and hasattr(lib, "prepare_weight"):
            # prepared now, so that a compiled forward finds it (prepare once per weight and device)
            _ops.prepare(lib, self.qweight, self.wscales, self.lora_up, self.wcscale, self.bias, self._prepared,
                         self.compute)
        return self

    def set_compute(self, compute: str) -> "W4A4Linear":
        """Switch the GEMM's compute mode ("exact" or "fp8"); the weight is prepared again for it."""
        self.compute = _check_compute(compute)
        return self.attach(self._lib)

    @property
    def lib(self):
        return self._lib

    @property
    def dtype(self) -> torch.dtype:
        """The activation / output dtype (of the LoRA and smoothing tensors; bf16 when there are none)."""
        for t in (self.lora_up, self.smooth):
            if t is not None:
                return t.dtype
        return torch.bfloat16

    def _apply(self, fn, recurse=True):
        keep = {n: self._buffers[n] for n in FIXED_DTYPE if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for n, old in keep.items():
            new = self._buffers[n]
            if new.dtype != old.dtype:          # a dtype cast: follow the device, keep the format's dtype
                self._buffers[n] = old.to(new.device)
        self.attach(self._lib)               # re-prepares the weight on its (new) device, if it is a GPU
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self._prepared.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def _flat_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise InvalidArgument(f"input must be a tensor [..., {self.in_features}], got "
                                  f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        return x.reshape(-1, self.in_features)

    def _smooth_rcp(self):
        """The reciprocals of `smooth` that quantize_act takes as ``smooth_rcp`` (the same x̂, a faster kernel),
        made once and again only when smooth changes (another tensor, or written in place); None without
        smoothing and while torch.compile traces (the compiled graph passes smooth itself)."""
        s = self.smooth
        if s is None or torch.compiler.is_compiling() or not s.is_cuda:
            return None
        key = (s.data_ptr(), s._version, s.dtype)
        if self._rcp is None or self._rcp[0] != key:
            self._rcp = (key, smooth_reciprocals(s))
        return self._rcp[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = self._flat_input(x)
        act, ascales, lora_act_in = _ops.quantize(self._lib, x2, self.smooth, self.lora_down, self.compute,
                                                  self._smooth_rcp())
        y = _ops.gemm(self._lib, act, ascales, self.qweight, self.wscales, lora_act_in, self.lora_up, self.wcscale,
                      self.bias, x2.dtype, self._prepared, self.compute)
        return y.reshape(*x.shape[:-1], self.out_features)

    # -- checking ----------------------------------------------------------
    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64 [..., N] of the layer's quantized math on x's device (exact quantizer rules, LoRA unrounded).

        x̂ = x · (1/smooth rounded to x's dtype), rounded once; codes and scales by the
        rules of `svdq_loader.testing.quantize_ref` (bit-exact with the
        kernel); the GEMM, ``wcscale``, ``bias`` and ``x̂·lora_down·lora_upᵀ``
        in float64.  In the FP8-compute mode, the mode's math instead (`fp8_reference.reference_torch_f64_fp8`).
        """
        from svdq_loader.testing import torch_quant
        from svdq_loader.testing.reference import reference_torch_f64
        x2 = self._flat_input(x).contiguous()
        act, ascales, _ = torch_quant.quantize_act(x2, self.smooth, None)
        xh = torch_quant.smooth_input(x2, self.smooth)
        la = lu = None
        if self.rank:
            la = xh.to(torch.float64) @ self.lora_down.to(torch.float64)
            lu = self.lora_up
        if self.compute == "fp8":
            from svdq_loader.testing.fp8_reference import reference_torch_f64_fp8
            y = reference_torch_f64_fp8(act, self.qweight, ascales, self.wscales, lora_act_in=la, lora_up=lu,
                                        wcscale=self.wcscale, bias=self.bias)
        else:
            y = reference_torch_f64(act, self.qweight, ascales, self.wscales, lora_act_in=la, lora_up=lu,
                                    wcscale=self.wcscale, bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"bias={self.bias is not None}, smooth={self.smooth is not None}, dtype={self.dtype}"
                + (f", compute={self.compute!r}" if self.compute != "exact" else ""))


@torch.no_grad()
def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` (what the model keeps resident)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

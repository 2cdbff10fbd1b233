"""The torch-facing operator: argument checks, weight preparation, dispatch.

Every check a caller can fail runs here, on tensor metadata only, before
anything touches the GPU.  Layouts are the logical ones of DESIGN.md §2:

    act      [M, K/2]  uint8 (two E2M1 nibbles, low = even k)
    ascales  [M, K/16] float8_e4m3fn
    wgt      [N, K/2]  uint8
    wscales  [N, K/16] float8_e4m3fn
    lora_act_in [M, R], lora_up [N, R]   fp16 or bf16 (= output dtype)
    wcscale, bias [N]  any float dtype (used as float32)
    out      [M, N]    fp16 or bf16, row-major
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PTR_ALIGN = 16
OUT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class InvalidArgument(ValueError):
    """A tensor argument breaks a rule of the operator; the message names it."""


def _fail(msg: str):
    raise InvalidArgument(msg)


def _check_tensor(name: str, t, *, dtype, ndim: int, shape=None):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dts = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dts:
        _fail(f"{name} must have dtype {' or '.join(str(d) for d in dts)}, got {t.dtype}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                _fail(f"{name} has shape {tuple(t.shape)}, expected "
                      f"{tuple('?' if w is None else w for w in shape)} (dim {i}: {got} != {want})")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape {tuple(t.shape)}")
    if t.data_ptr() % PTR_ALIGN:
        _fail(f"{name} data pointer 0x{t.data_ptr():x} is not {PTR_ALIGN}-byte aligned "
              f"(a slice or view at an odd offset?); pass a fresh contiguous tensor")


def _check_devices(named: dict) -> None:
    """Last check of a call: all tensors are CUDA tensors on one device."""
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            _fail(f"{name} must be a CUDA tensor, got device {t.device}")
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            _fail(f"{name} is on {t.device} but {first[0]} is on {first[1]}: all tensors must be on one device")


def _check_vector(name: str, t, n: int):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        _fail(f"{name} must be a float16/bfloat16/float32 tensor, got {t.dtype}")
    if tuple(t.shape) != (n,):
        _fail(f"{name} must have shape ({n},), got {tuple(t.shape)}")


def _as_f32(t):
    t = t.to(torch.float32).contiguous()
    if t.data_ptr() % PTR_ALIGN:
        t = t.clone()
    return t


@dataclass(frozen=True)
class PreparedWeight:
    """The weight side of the operator, checked and converted once.

    Pass it as `wgt` to `gemm_w4a4`; nothing on the weight side is then
    checked or converted per call.
    """
    wgt: torch.Tensor           # [N, K/2] uint8
    wscales: torch.Tensor       # [N, K/16] float8_e4m3fn
    lora_up: torch.Tensor | None
    wcscale: torch.Tensor | None  # [N] float32
    bias: torch.Tensor | None     # [N] float32
    n: int
    k: int
    rank: int

    @property
    def device(self):
        return self.wgt.device


def prepare_weight(wgt, wscales, *, lora_up=None, wcscale=None, bias=None) -> PreparedWeight:
    _check_tensor("wgt", wgt, dtype=torch.uint8, ndim=2)
    n, kh = wgt.shape
    k = 2 * kh
    if n < 1 or kh < 1:
        _fail(f"wgt must be non-empty, got shape {tuple(wgt.shape)}")
    if k % 16:
        _fail(f"K = 2*wgt.shape[1] = {k} must be a multiple of 16 (one E4M3 scale per 16 k)")
    _check_tensor("wscales", wscales, dtype=torch.float8_e4m3fn, ndim=2, shape=(n, k // 16))
    rank = 0
    if lora_up is not None:
        _check_tensor("lora_up", lora_up, dtype=tuple(OUT_DTYPES), ndim=2, shape=(n, None))
        rank = int(lora_up.shape[1])
        if rank < 1 or rank % 16:
            _fail(f"LoRA rank R = lora_up.shape[1] = {rank} must be a positive multiple of 16")
    if wcscale is not None:
        _check_vector("wcscale", wcscale, n)
    if bias is not None:
        _check_vector("bias", bias, n)
    _check_devices(dict(wgt=wgt, wscales=wscales, lora_up=lora_up, wcscale=wcscale, bias=bias))
    if wcscale is not None:
        wcscale = _as_f32(wcscale)
    if bias is not None:
        bias = _as_f32(bias)
    return PreparedWeight(wgt, wscales, lora_up, wcscale, bias, n, k, rank)


@dataclass(frozen=True)
class CallPlan:
    """What one call resolved to: sizes, dtype and the kernel pointers in HOST_ARGS order."""
    m: int
    n: int
    k: int
    rank: int
    out_dtype: str
    wcscale: bool
    bias: bool
    out: torch.Tensor
    pointers: dict


def plan_call(act, weight: PreparedWeight, ascales, *, lora_act_in=None, out=None, out_dtype=None) -> CallPlan:
    _check_tensor("act", act, dtype=torch.uint8, ndim=2)
    m, kh = act.shape
    if m < 1:
        _fail(f"act must have at least one row (M >= 1), got shape {tuple(act.shape)}")
    if 2 * kh != weight.k:
        _fail(f"act has K = 2*{kh} = {2 * kh} but the weight has K = {weight.k}")
    k, n = weight.k, weight.n
    for what, val in (("M*N (output elements)", m * n), ("M*K/2 (act bytes)", m * kh), ("N*K/2 (weight bytes)", n * kh)):
        if val >= 2**31:
            _fail(f"{what} = {val} must be below 2^31 (the kernels index with 32-bit integers); split the call along M")
    _check_tensor("ascales", ascales, dtype=torch.float8_e4m3fn, ndim=2, shape=(m, k // 16))

    if (lora_act_in is None) != (weight.lora_up is None):
        _fail("lora_act_in and lora_up must be given together (got only "
              f"{'lora_act_in' if lora_act_in is not None else 'lora_up'})")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        _fail(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    want = out_dtype
    if out is not None:
        _check_tensor("out", out, dtype=tuple(OUT_DTYPES), ndim=2, shape=(m, n))
        if want is not None and out.dtype != want:
            _fail(f"out has dtype {out.dtype} but out_dtype={want}")
        want = out.dtype
    if weight.lora_up is not None:
        if want is None:
            want = weight.lora_up.dtype
        if weight.lora_up.dtype != want:
            _fail(f"lora_up has dtype {weight.lora_up.dtype}, must equal the output dtype {want}")
        _check_tensor("lora_act_in", lora_act_in, dtype=want, ndim=2, shape=(m, weight.rank))
    if want is None:
        want = torch.bfloat16
    _check_devices(dict(act=act, wgt=weight.wgt, ascales=ascales, lora_act_in=lora_act_in, out=out))
    if out is None:
        out = torch.empty((m, n), dtype=want, device=act.device)

    ptrs = dict(
        act=act.data_ptr(), ascales=ascales.data_ptr(), wgt=weight.wgt.data_ptr(),
        wscales=weight.wscales.data_ptr(),
        lora_act_in=lora_act_in.data_ptr() if lora_act_in is not None else 0,
        lora_up=weight.lora_up.data_ptr() if weight.lora_up is not None else 0,
        wcscale=weight.wcscale.data_ptr() if weight.wcscale is not None else 0,
        bias=weight.bias.data_ptr() if weight.bias is not None else 0,
        out=out.data_ptr(),
    )
    return CallPlan(m, n, k, weight.rank, OUT_DTYPES[want], weight.wcscale is not None,
                    weight.bias is not None, out, ptrs)

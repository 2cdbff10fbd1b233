"""Argument checks shared by the operators: tensor metadata only, never a GPU call.

torch is imported on first use (`torch_module`), so the op specs stay
importable without it.
"""
from __future__ import annotations

from ..errors import InvalidArgument, TorchMissing
from .spec import PTR_ALIGN

_torch = None


def torch_module():
    global _torch
    if _torch is None:
        try:
            import torch
        except ImportError as e:
            raise TorchMissing("svdq_loader's operators take torch tensors, but torch is not installed; "
                               "install it (pip install 'svdq-aot[torch]')") from e
        _torch = torch
    return _torch


def fail(msg: str):
    raise InvalidArgument(msg)


def half_dtypes():
    t = torch_module()
    return {t.float16: "fp16", t.bfloat16: "bf16"}


def check_tensor(name: str, t, *, dtype, ndim: int, shape=None):
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dts = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dts:
        fail(f"{name} must have dtype {' or '.join(str(d) for d in dts)}, got {t.dtype}")
    if t.dim() != ndim:
        fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                shown = ", ".join("?" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "")
                fail(f"{name} has shape {tuple(t.shape)}, expected ({shown}) (dim {i}: {got} != {want})")
    if not t.is_contiguous():
        fail(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape {tuple(t.shape)}")
    if t.data_ptr() % PTR_ALIGN:
        fail(f"{name} data pointer 0x{t.data_ptr():x} is not {PTR_ALIGN}-byte aligned "
             f"(a slice or view at an odd offset?); pass a fresh contiguous tensor")


def check_devices(named: dict):
    """All tensors are CUDA tensors on one device; returns that device."""
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            fail(f"{name} must be a CUDA tensor, got device {t.device}")
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            fail(f"{name} is on {t.device} but {first[0]} is on {first[1]}: all tensors must be on one device")
    return None if first is None else first[1]


def check_vector(name: str, t, n: int):
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fail(f"{name} must be a float16/bfloat16/float32 tensor, got {t.dtype}")
    if tuple(t.shape) != (n,):
        fail(f"{name} must have shape ({n},), got {tuple(t.shape)}")


def check_i32_sizes(**sizes: int):
    for what, val in sizes.items():
        if val >= 2**31:
            fail(f"{what.replace('_', ' ')} = {val} must be below 2^31 (the kernels index with 32-bit "
                 f"integers); split the call along M")

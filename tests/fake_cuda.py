"""CPU stand-ins for a CUDA device: tensors with CUDA metadata and no storage, and a recording driver.

`FakeCuda(shape, dtype, device="cuda:0", ptr=..., strides=None)` is a tensor
subclass with the metadata the loader's checks read (device, dtype, shape,
strides, data_ptr) and no data (any compute raises).  `fake_driver(monkeypatch)`
replaces every driver entry point the library uses with stubs that record
kernel loads and launches.
"""
from __future__ import annotations

import itertools

import torch

_ptrs = itertools.count(0x7F00_0000_0000, 1 << 24)


class FakeCuda(torch.Tensor):
    @staticmethod
    def __new__(cls, shape, dtype, device="cuda:0", ptr=None, strides=None):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=torch.device(device),
                                                strides=strides)
        t._ptr = next(_ptrs) if ptr is None else ptr
        return t

    def data_ptr(self):
        return self._ptr

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"FakeCuda tensors hold no data ({func} was called)")


class FakeDeviceKernels:
    """Stands in for driver.DeviceKernels: one handle per kernel symbol, primary context always current."""

    def __init__(self, recorder, cubin, symbols, ordinal, load_plan, params):
        self.kernels = {s: 0x5000 + i for i, s in enumerate(symbols)}
        self.ordinal = ordinal
        recorder.loads.append(tuple(symbols))

    def foreign_context(self):
        return False

    def resident_blocks(self, sym, threads, dynamic_smem):
        return 3

    def resident_clusters(self, sym, threads, dynamic_smem, cluster):
        return {2: 198, 4: 92, 8: 45}.get(cluster, 396 // cluster)      # an H100's count at 3 CTAs per SM


class Recorder:
    def __init__(self):
        self.loads, self.launches, self.rc = [], [], 0

    def launch(self, cfg_addr, func, kp, extra):
        self.launches.append(func)
        return self.rc


def fake_driver(monkeypatch, *, arch="sm_90a", cuda=13000, optin_smem=232448, sms=132,
                gpu="NVIDIA H200") -> Recorder:
    from svdq_loader import driver, library
    rec = Recorder()
    monkeypatch.setattr(driver, "device_arch", lambda ordinal: arch)
    monkeypatch.setattr(driver, "device_attribute", lambda attr, ordinal: optin_smem if attr == 97 else sms)
    monkeypatch.setattr(driver, "driver_version", lambda: cuda)
    monkeypatch.setattr(driver, "device_name", lambda ordinal: gpu)
    monkeypatch.setattr(driver, "DeviceKernels", lambda *a, **k: FakeDeviceKernels(rec, *a, **k))
    monkeypatch.setattr(driver, "raw_launch_kernel_ex", lambda: rec.launch)
    monkeypatch.setattr(library, "_current_stream", lambda ordinal: 0x1234)
    monkeypatch.setattr(library, "_capturing", lambda: False)
    # FakeCuda tensors hold no data, so no weight-format conversion can run on them: every arch reads
    # the logical weight tensors here (the formats have their own tests on real data)
    from svdq_loader.ops import gemm_w4a4, layouts
    monkeypatch.setitem(layouts.WEIGHT_FORMATS_BY_COMPUTE, "exact", {})    # the formats' one table
    # nor can torch fill a vector there: a weight without wcscale / bias gets data-less identity vectors
    monkeypatch.setattr(gemm_w4a4, "identity_vector", lambda like, n, value: FakeCuda((n,), torch.float32, like.device))
    return rec

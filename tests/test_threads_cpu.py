"""Concurrent calls from many threads on a fresh library (CPU, recording fake driver): every thread misses the
selection and load caches at once; each variant is loaded exactly once and every call launches."""
from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

import svdq_loader  # noqa: E402

from fake_cuda import FakeDeviceKernels, fake_driver  # noqa: E402
from test_safety_cpu import BF, K, T, gemm, gemm_args, quant, quant_out  # noqa: E402


def test_simultaneous_cache_misses_load_each_variant_once(tiny_artifacts, monkeypatch):
    from svdq_loader import driver
    rec = fake_driver(monkeypatch)

    def slow_load(*a, **k):                       # widen the window in which two threads could both load
        time.sleep(0.02)
        return FakeDeviceKernels(rec, *a, **k)

    monkeypatch.setattr(driver, "DeviceKernels", slow_load)
    lib = svdq_loader.load(tiny_artifacts)
    nthreads, calls = 8, 30
    barrier = threading.Barrier(nthreads)
    errors = []

    def work(t):
        try:
            barrier.wait()
            for i in range(calls):
                m = 1 + t * calls + i                 # every call a new M: a selection-cache miss
                gemm(lib, **gemm_args(m=m))
                quant(lib, T((m, K), BF), **quant_out(m=m))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors[:3]
    assert sorted(len(s) for s in rec.loads) == [1, 1] and len(rec.loads) == 2, rec.loads
    assert len(rec.launches) == 2 * nthreads * calls
    assert len(lib._launchers) == 2

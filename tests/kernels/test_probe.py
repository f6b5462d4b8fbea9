"""The capability probe names the first thing a user can change: no GPU (no driver, or no device),
then CuPy missing, then a GPU without FP8 instructions."""
import builtins
import ctypes

import pytest

from fusedfp8 import _cuda


class _Driver:
    def __init__(self, init_err=0, count=1):
        self.init_err, self.count = init_err, count

    def cuInit(self, flags):
        return self.init_err

    def cuDeviceGetCount(self, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return 0


@pytest.fixture
def fresh_probe(monkeypatch):
    _cuda.probe.cache_clear()
    _cuda._gpu_count.cache_clear()
    yield monkeypatch
    _cuda.probe.cache_clear()
    _cuda._gpu_count.cache_clear()


def _no_cupy(monkeypatch):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


@pytest.mark.parametrize("driver, want", [
    (None, r"^no CUDA GPU \(no NVIDIA driver"),
    (_Driver(init_err=100), r"^no CUDA GPU \(the NVIDIA driver does not initialise: CUDA error 100\)"),
    (_Driver(count=0), r"^no CUDA GPU \(the driver sees no device\)"),
], ids=["no-driver", "driver-fails", "no-device"])
def test_without_a_gpu_the_reason_is_the_missing_gpu_even_without_cupy(fresh_probe, driver, want):
    fresh_probe.setattr(_cuda, "driver", lambda: driver)
    _no_cupy(fresh_probe)
    ok, reason = _cuda.probe()
    assert not ok and __import__("re").match(want, reason), reason


def test_with_a_gpu_but_no_cupy_the_reason_is_cupy(fresh_probe):
    fresh_probe.setattr(_cuda, "driver", lambda: _Driver(count=2))
    _no_cupy(fresh_probe)
    assert _cuda.probe() == (False, "CuPy is not installed (pip install 'fusedfp8[cuda]')")
    assert _cuda.probe(3) == (False, "no CUDA device 3 (found 2)")

"""The capability probe names the first thing a user can change: no GPU (no driver, or no device),
then CuPy missing, then a GPU without FP8 instructions."""
import builtins
import ctypes

import pytest

from fusedfp8 import launch
from fusedfp8.launch import executor as E, kernels as K


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
    launch.probe.cache_clear()
    K._gpu_count.cache_clear()
    yield monkeypatch
    launch.probe.cache_clear()
    K._gpu_count.cache_clear()


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
    fresh_probe.setattr(E, "driver", lambda: driver)
    _no_cupy(fresh_probe)
    ok, reason = launch.probe()
    assert not ok and __import__("re").match(want, reason), reason


def test_with_a_gpu_but_no_cupy_the_reason_is_cupy(fresh_probe):
    fresh_probe.setattr(E, "driver", lambda: _Driver(count=2))
    _no_cupy(fresh_probe)
    assert launch.probe() == (False, "CuPy is not installed (pip install 'fusedfp8[cuda]')")
    assert launch.probe(3) == (False, "no CUDA device 3 (found 2)")


NOT_HOPPER = "has no block-scaled FP8 GEMMs (cuBLASLt runs BlockScaling's 1x128 / 128x128 GEMMs on Hopper, 9.0)"


@pytest.mark.parametrize("cc, kernels, fp8_gemm, block_gemm", [
    (80, "no FP8 conversion instructions", "no FP8 GEMMs", "no FP8 GEMMs"),
    (89, None, None, NOT_HOPPER),
    (90, None, None, None),
    (100, None, None, NOT_HOPPER),
], ids=["ampere", "ada", "hopper", "blackwell"])
def test_each_capability_gets_the_verdict_of_what_it_runs(fresh_probe, cc, kernels, fp8_gemm, block_gemm):
    """FP8 kernels and GEMMs from 8.9 on; cuBLASLt's block-scaled FP8 GEMMs (BlockScaling) on
    Hopper (9.0) only, and the reason says so."""
    import types

    fresh_probe.setattr(E, "driver", lambda: _Driver(count=1))
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: types.SimpleNamespace(
        compute_capability=str(cc))))
    fresh_probe.setitem(__import__("sys").modules, "cupy", cupy)
    major, minor = divmod(cc, 10)
    for kwargs, want in (({}, kernels), ({"need_fp8_gemm": True}, fp8_gemm), ({"need_block_gemm": True}, block_gemm)):
        ok, reason = launch.probe(**kwargs)
        if want is None:
            assert ok and reason == f"GPU 0: compute capability {major}.{minor}", (kwargs, reason)
        else:
            assert not ok and want in reason and f"compute capability {major}.{minor}" in reason, (kwargs, reason)

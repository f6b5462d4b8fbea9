"""Helpers shared by the torch tests (CPU and GPU): inputs, the scaled_mm spy, SQNR, state
comparisons, one train step; the plain-torch twin of Fp8MLP is the library's own
(fusedfp8.demo.task.TorchMLP, shared with the demo and the scripts)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import fusedfp8.pytorch as fp8
from fusedfp8.demo.task import TorchMLP  # noqa: F401  (re-exported for the torch tests)
from fusedfp8.pytorch import autograd as A8
from fusedfp8.state import STATE_FIELDS, ScalingState

from .frameworks import same_bytes


def inputs(rows: int, cols: int, dtype=torch.float32, seed: int = 0, device="cpu") -> torch.Tensor:
    """Normal values whose rows span 2**-4 .. 2**4 (so a scale from the amax matters)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g).float())
    return (torch.randn(rows, cols, generator=g) * mag).to(device=device, dtype=dtype)


def sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantization-noise ratio in dB (float64)."""
    w, g = want.detach().double(), got.detach().double()
    return 10 * math.log10(float((w * w).sum()) / max(float(((w - g) ** 2).sum()), 1e-300))


def same_state(module, twin: ScalingState) -> bool:
    """An Fp8Linear's state buffers equal a twin state's arrays, byte for byte."""
    return all(same_bytes(getattr(module, f), getattr(twin, f)) for f in STATE_FIELDS)


def train_step(model, x, target, opt, update=True):
    """MSE loss, backward, optimizer step, and (by default) the once-per-step scale update."""
    loss = (model(x).float() - target.float()).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if update:
        fp8.update_model_scales(model)
    return loss.detach()


class Spy:
    """Records every scaled_mm call of the autograd functions: (a, b, scale_a, scale_b, result)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = A8.scaled_mm

        self.gemms = []  # the backend each call asked for

        def spy(a, b, sa, sb, bias, out_dtype, fast_accum=False, gemm="scaled_mm"):
            out = real(a, b, sa, sb, bias, out_dtype, fast_accum, gemm)
            self.calls.append((a, b, sa.clone(), sb.clone(), out))
            self.gemms.append(gemm)
            return out

        monkeypatch.setattr(A8, "scaled_mm", spy)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op torch thread for the test (small tensors: more threads only contend, 20x slower
    on a loaded 2-core machine). Autouse where a module binds it to a name."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextlib.contextmanager
def launch_path(cpp: bool):
    """The custom ops' CUDA launch path for the block: the compiled shim's C++ kernels (``cpp``; a
    skip without a C++ compiler) or the Python executor; as it was after."""
    from fusedfp8.pytorch import cpp_path

    from .shim import built

    was, decided = cpp_path._cpp, list(cpp_path._cpp_state)
    if cpp:
        built("torch")
    cpp_path.use_cpp(cpp)
    try:
        yield
    finally:
        cpp_path.use_cpp(was is not None)
        cpp_path._cpp_state[:] = decided

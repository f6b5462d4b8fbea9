"""The C++ implementation of the custom ops (:mod:`fusedfp8.csrc`, ``torch_ops.cc``): loading it,
switching it on and off (:func:`use_cpp`) and saying which path runs (:func:`launch_path`).

Where the compiled shim is available (compiled on the first CUDA call when it was not built at
install time) the CUDA (and AutogradCUDA) kernels of the ops are C++: eager calls, torch.compile
graphs and CUDA graphs then run no Python per call, and only a new signature calls back into
Python (:func:`fusedfp8.pytorch.op_plans._cpp_plan`). Without it the Python implementations of
:mod:`fusedfp8.pytorch.custom_ops` launch the same plans.
"""
from __future__ import annotations

import threading

import torch

from .. import csrc as _shim
from .op_plans import _cpp_plan

__all__ = ["use_cpp", "launch_path"]

# the ops in the order of torch_ops.cc's Op enum
_CPP_OPS = ("quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "dequantize")
_cpp = None  # the registered extension module, else None
_cpp_state: list = []  # [(on, why)] once decided: loading happens on the first CUDA call
_cpp_lock = threading.Lock()


def _cpp_ops():
    """The C++ ops module, loaded (compiled on first use) and registered for the CUDA keys; None
    where the shim cannot be had or was switched off."""
    if not _cpp_state:
        with _cpp_lock:
            if not _cpp_state:
                on, why = _shim.default_on()
                lib, why = _shim.library("torch") if on else (None, why)
                if lib is not None:
                    use_cpp(True, _lib=lib)
                _cpp_state.append((lib is not None, why))
    return _cpp


def use_cpp(on: bool, _lib=None) -> None:
    """Switch the CUDA implementation of the ops between C++ (``on``; the default where the shim
    is available and opted into, see :func:`fusedfp8.csrc.default_on`) and the Python executor
    (``on=False``, e.g. to compare the two). Raises RuntimeError when the shim is wanted but
    cannot be had."""
    global _cpp
    if on:
        lib = _lib
        if lib is None:
            lib, why = _shim.library("torch")
            if lib is None:
                raise RuntimeError(f"fusedfp8: the torch launch shim is not available: {why}")
        lib.register(_cpp_plan, _cpp_grad_path)
        _cpp = lib
    else:
        if _cpp is not None:
            _cpp.unregister()
        _cpp = None
        _cpp_state[:] = [(False, "switched off with use_cpp(False)")]


def launch_path() -> tuple[str, str]:
    """('C++' | 'Python', why) of the ops' CUDA implementation (without building the shim: before
    the first CUDA call this reports what that call will do)."""
    if _cpp is not None:
        return "C++", _shim.library("torch")[1]
    if _cpp_state:
        return "Python", _cpp_state[0][1]
    on, why = _shim.default_on()
    if not on:
        return "Python", why
    ready, why = _shim.status("torch")
    return ("C++" if ready is not False else "Python"), (why if ready is not None else
                                                         f"from the first CUDA call on ({why})")


class _NoDerivative(torch.autograd.Function):
    """What the custom op's own autograd kernel does when a gradient is wanted: the op runs (grad
    mode is off inside, so the C++ kernel runs), and a backward through its outputs raises."""

    @staticmethod
    def forward(ctx, name, *args):
        ctx.name = name
        return getattr(torch.ops.fusedfp8, name).default(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"Trying to backward through fusedfp8::{ctx.name} but no autograd formula was "
                           "registered (use fusedfp8.pytorch's autograd functions)")


def _cpp_grad_path(name: str, args: tuple):
    return _NoDerivative.apply(name, *args)

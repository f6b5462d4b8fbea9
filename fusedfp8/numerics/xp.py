"""Array namespaces: the few array operations the scaling rule needs, for numpy, cupy and
torch (jax.numpy's, whose division is its own, is :class:`fusedfp8.numerics.jnp.JnpNamespace`).

:mod:`fusedfp8.numerics.scaling` is written once against this interface; which namespace serves
an array is decided by :func:`fusedfp8._interop.namespace` (the one place that looks at
frameworks). Every namespace has ``float32``, ``int32`` and: ``asarray(value, dtype, like)`` (on
``like``'s device), ``where``, ``isfinite``, ``isinf``, ``abs``, ``amax(a, axis)``,
``concatenate(arrays, axis)``, ``zeros_like``, ``astype(a, dtype)``, ``bits(a)`` (the int32 bit
pattern of a float32 array) and ``divide(a, b)`` (IEEE float32 division, round to nearest even).
Frameworks are imported when a namespace is made, never at import.
"""
from __future__ import annotations

import numpy as np


class NumpyNamespace:
    """numpy (also the base of the cupy namespace, which speaks the same API)."""

    def __init__(self, module=np):
        self.m = module
        self.float32, self.int32 = module.float32, module.int32

    def asarray(self, value, dtype, like):
        return self.m.asarray(value, dtype=dtype)

    def where(self, cond, a, b):
        return self.m.where(cond, a, b)

    def isfinite(self, a):
        return self.m.isfinite(a)

    def isinf(self, a):
        return self.m.isinf(a)

    def abs(self, a):
        return self.m.abs(a)

    def amax(self, a, axis):
        return self.m.max(a, axis=axis)

    def concatenate(self, arrays, axis):
        return self.m.concatenate(arrays, axis=axis)

    def zeros_like(self, a):
        return self.m.zeros_like(a)

    def astype(self, a, dtype):
        return a.astype(dtype)

    def bits(self, a):
        return a.view(self.m.int32)

    def divide(self, a, b):
        with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
            return a / b


class CupyNamespace(NumpyNamespace):
    def __init__(self):
        import cupy

        super().__init__(cupy)

    def asarray(self, value, dtype, like):
        with self.m.cuda.Device(like.device):
            return self.m.asarray(value, dtype=dtype)


class TorchNamespace:
    def __init__(self):
        import torch

        self.torch = torch
        self.float32, self.int32 = torch.float32, torch.int32

    def asarray(self, value, dtype, like):
        return self.torch.as_tensor(value, dtype=dtype, device=like.device)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def isfinite(self, a):
        return self.torch.isfinite(a)

    def isinf(self, a):
        return self.torch.isinf(a)

    def abs(self, a):
        return self.torch.abs(a)

    def amax(self, a, axis):
        return self.torch.amax(a, dim=axis)

    def concatenate(self, arrays, axis):
        return self.torch.cat(arrays, dim=axis)

    def zeros_like(self, a):
        return self.torch.zeros_like(a)

    def astype(self, a, dtype):
        return a.to(dtype)

    def bits(self, a):
        return a.view(self.torch.int32)

    def divide(self, a, b):
        return a / b

"""A stand-in for the CUDA driver's context calls that :mod:`fusedfp8.csrc.plan` and
:class:`fusedfp8._cuda.Kernel` make through ctypes, for testing on a machine without a GPU
(or with one GPU) which context a launch or an occupancy query runs in.

Device ``d``'s primary context is the handle ``PRIMARY + d``; each thread has its own context
stack, empty (no current context) or holding ``start``'s primary context when it first looks.
Subclasses add the launch calls they record (the current context comes with each record)."""
from __future__ import annotations

import threading

PRIMARY = 0xC0_0000


def primary(device: int) -> int:
    return PRIMARY + device


class FakeContexts:
    """cuCtxGetCurrent / cuCtxPushCurrent_v2 / cuCtxPopCurrent_v2 / cuDeviceGet /
    cuDevicePrimaryCtxRetain / cuGetErrorString over a per-thread context stack. ``calls`` lists
    ("push", ctx) and ("pop", ctx) in order; ``retained`` the devices whose primary context was
    retained."""

    def __init__(self, start: int | None = 0):
        self.start = start
        self._tls = threading.local()
        self.calls: list = []
        self.retained: list = []

    def stack(self) -> list:
        s = getattr(self._tls, "stack", None)
        if s is None:
            s = self._tls.stack = [] if self.start is None else [primary(self.start)]
        return s

    def current(self) -> int | None:
        s = self.stack()
        return s[-1] if s else None

    def cuCtxGetCurrent(self, p):
        p._obj.value = self.current()
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.stack().append(ctx.value)
        self.calls.append(("push", ctx.value))
        return 0

    def cuCtxPopCurrent_v2(self, p):
        p._obj.value = self.stack().pop()
        self.calls.append(("pop", p._obj.value))
        return 0

    def cuDeviceGet(self, p, ordinal):
        p._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, p, dev):
        p._obj.value = primary(dev.value)
        self.retained.append(dev.value)
        return 0

    def cuGetErrorString(self, err, p):
        p._obj.value = f"fake CUDA error {err}".encode()
        return 0

"""A stand-in for the CUDA driver's context calls that :mod:`fusedfp8.launch.executor` and
:class:`fusedfp8.launch.kernels.Kernel` make through ctypes, for testing on a machine without a GPU
(or with one GPU) which context a launch or an occupancy query runs in.

Device ``d``'s primary context is the handle ``PRIMARY + d``; each thread has its own context
stack, empty (no current context) or holding ``start``'s primary context when it first looks.
:class:`FakeDriver` adds the launches, occupancy queries and function attributes, each recorded with
the context it ran in, and the capture status of streams."""
from __future__ import annotations

import threading
import types

PRIMARY = 0xC0_0000
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906


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


class FakeDriver(FakeContexts):
    """The context calls, and launches / occupancy queries that record the context they ran in.
    A kernel handle belongs to the device ``handle // DEVICE_STRIDE``: a query in another context
    fails as the driver's does (CUDA_ERROR_INVALID_CONTEXT)."""

    DEVICE_STRIDE = 0x1_0000

    def __init__(self, start, fail_launch: int = 0, per_sm: dict | None = None):
        super().__init__(start)
        self.fail_launch = fail_launch
        self.per_sm = per_sm or {}  # device -> the occupancy its kernels report
        self.records: list = []
        self.capturing: set = set()

    def _own(self, func) -> bool:
        return self.current() == primary(int(func) // self.DEVICE_STRIDE)

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.records.append(("launch", func, self.current(), stream))
        return self.fail_launch or (0 if self._own(func) else CUDA_ERROR_INVALID_CONTEXT)

    def cuLaunchCooperativeKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, params):
        self.records.append(("coop", func, self.current(), stream))
        return self.fail_launch or (0 if self._own(func) else CUDA_ERROR_INVALID_CONTEXT)

    def cuMemsetD32Async(self, ptr, value, words, stream):
        self.records.append(("memset", ptr, self.current(), stream))
        return 0

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, n, func, block, shared):
        self.records.append(("occupancy", func.value, self.current(), block))
        if not self._own(func.value):
            return CUDA_ERROR_INVALID_CONTEXT
        n._obj.value = self.per_sm.get(func.value // self.DEVICE_STRIDE, 3)
        return 0

    def cuFuncGetAttribute(self, n, attribute, func):
        self.records.append(("get_attribute", func.value, self.current(), attribute))
        n._obj.value = 1216
        return 0 if self._own(func.value) else CUDA_ERROR_INVALID_CONTEXT

    def cuFuncSetAttribute(self, func, attribute, value):
        self.records.append(("set_attribute", func.value, self.current(), value.value))
        return 0 if self._own(func.value) else CUDA_ERROR_INVALID_CONTEXT

    def cuStreamIsCapturing(self, stream, status):
        """``capturing``: the streams capturing a graph; the legacy stream (0) while any does."""
        if stream.value is None and self.capturing:
            return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        status._obj.value = 1 if stream.value in self.capturing else 0
        return 0


def install(setattr_, start: int | None = 0) -> FakeDriver:
    """A FakeDriver (``start``'s context current) as the driver of the executor and the kernels,
    patched with ``setattr_(obj, name, value)`` (pytest's ``monkeypatch.setattr``)."""
    from fusedfp8.launch import executor

    drv = FakeDriver(start)
    setattr_(executor, "driver", lambda: drv)  # (the kernels call it through the executor too)
    setattr_(executor, "_primary", {})
    return drv


def fake_id(name: str) -> int:
    """The kernel id (fusedfp8.launch.kernels.kernel_id) of a made-up kernel named ``name``: made of no
    real source, so it never names a compiled kernel's handle in the shims' registries."""
    from fusedfp8.launch import kernels as K

    return K.kernel_id(name, "made up", (), "no target")


def fake_kernels(key, device: int) -> dict:
    """What fusedfp8.launch.kernels.load (or its _build) returns, made up: real Kernel objects (the
    occupancy and attribute calls go to the driver installed) whose handles belong to ``device``
    by :class:`FakeDriver`'s rule."""
    from fusedfp8.launch import kernels as K

    return {role: K.Kernel(types.SimpleNamespace(kernel=types.SimpleNamespace(
        ptr=device * FakeDriver.DEVICE_STRIDE + 0x100 + i)), role, expr, device, fake_id(expr))
        for i, (role, expr) in enumerate(K.name_expressions(key).items())}


# No real architecture and compiler: the ids of kernels "compiled" by fake_cupy never name a real
# kernel in the shims' registries of a process that also runs real ones (a GPU test run).
FAKE_TARGET = "sm_00 nvrtc 0.0"


def fake_cupy(handle_of) -> types.ModuleType:
    """A stand-in for what fusedfp8.launch.kernels._build uses of CuPy: RawModule (which "compiles" a module
    into kernels whose handles are ``handle_of(name expression)``), Device (a context manager; its
    compute capability and NVRTC's version give :data:`FAKE_TARGET`) and CompileException."""

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.code, self.options, self.name_expressions = code, tuple(options), tuple(name_expressions)

        def get_function(self, expr):
            return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=handle_of(expr)))

    class Device:
        compute_capability = "00"

        def __init__(self, device_id=0):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cupy = types.ModuleType("cupy")
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(Device=Device, compiler=types.SimpleNamespace(CompileException=Exception),
                                      nvrtc=types.SimpleNamespace(getVersion=lambda: (0, 0)))
    return cupy


class AnyHandleDriver(FakeDriver):
    """A FakeDriver that takes any handle for its device's (handles that are not ``device *
    DEVICE_STRIDE + k``: random ones, as a real process's)."""

    def _own(self, func) -> bool:
        return True


def pretend_gpu(setattr_, setitem_, handle_of) -> FakeDriver:
    """Make this process see one FP8 GPU (device 0; the H200's multiprocessors and shared memory)
    where fusedfp8.launch looks: the probe passes (for the kernels' build and for the callers of
    ``launch.probe``), CuPy is :func:`fake_cupy` (so the real ``kernels._build`` runs: kernel ids,
    registration in the shims) and the driver an :class:`AnyHandleDriver`; no module loaded yet.
    Patched with ``setattr_`` / ``setitem_`` (pytest's monkeypatch.setattr / setitem, or plain ones
    in a process of its own). The cached plans of fusedfp8.launch (quantize_plan, ...) are not
    patched: in a process that goes on with real kernels, build plans with the build_*_plan
    functions, or clear those caches after."""
    import sys

    from fusedfp8 import launch
    from fusedfp8.launch import executor, kernels

    drv = AnyHandleDriver(0)
    setitem_(sys.modules, "cupy", fake_cupy(handle_of))
    for module in (kernels, launch):
        setattr_(module, "probe", lambda device_id=0, need_fp8_gemm=False, need_block_gemm=False: (True, "a pretended GPU"))
    setattr_(executor, "driver", lambda: drv)
    setattr_(executor, "_primary", {})
    setattr_(kernels, "_loaded", {})
    setattr_(kernels, "sm_count", lambda device_id: 132)
    setattr_(kernels, "shared_optin", lambda device_id: 227 << 10)
    return drv

"""The Python executor of a launch plan: the driver through ctypes, the device contexts, the
capture guard, and :func:`execute` (one cuLaunchKernel, or cuLaunchCooperativeKernel, per step).

It is the launch path wherever the compiled shim (``fusedfp8/csrc/plan.h``) is not loaded, and
hands the driver the same bytes as the shim: :func:`dry_run` and the shim's ``ff8_dry_run`` are
compared in tests/kernels/test_launch_shim.py. It launches a kernel by its CUfunction handle, in
the context of the plan's device whatever the calling thread's current one is.

Nothing here imports a framework or CuPy.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import struct
import threading

from .format import COOP_LAUNCH, MEMSET, Plan


@functools.lru_cache(maxsize=None)
def driver():
    """libcuda through ctypes (None where it cannot be loaded)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    vp, u, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
    lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, u, sz, vp]
    lib.cuMemsetD32Async.restype = ctypes.c_int
    lib.cuLaunchCooperativeKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp]
    lib.cuLaunchCooperativeKernel.restype = ctypes.c_int
    pp = ctypes.POINTER(ctypes.c_void_p)
    lib.cuCtxGetCurrent.argtypes = [pp]
    lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuCtxPushCurrent_v2.argtypes = [vp]
    lib.cuCtxPopCurrent_v2.argtypes = [pp]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [pp, ctypes.c_int]
    lib.cuStreamIsCapturing.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
    return lib


def check_cuda(err: int, what: str) -> None:
    """Raise RuntimeError naming ``what`` and the driver's message when ``err`` is not 0."""
    if err:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"fusedfp8: {what} failed: CUDA error {err} ({(msg.value or b'?').decode()})")


def current_device() -> int:
    """The CUDA ordinal of the calling thread's current context (XLA's device inside its callbacks)."""
    dev = ctypes.c_int(0)
    check_cuda(driver().cuCtxGetDevice(ctypes.byref(dev)), "reading the current context's device")
    return dev.value


# ---- device contexts -------------------------------------------------------------------------
_primary: dict = {}  # CUDA ordinal -> its primary context (retained once, kept)
_primary_lock = threading.Lock()


def primary_context(device: int) -> int:
    """The primary context of CUDA device ``device``: the one the CUDA runtime (torch, CuPy, XLA)
    uses, into which CuPy loaded the kernels. Retained once per device and kept."""
    ctx = _primary.get(device)
    if ctx is None:
        with _primary_lock:
            ctx = _primary.get(device)
            if ctx is None:
                drv = driver()
                if drv is None:
                    raise RuntimeError("fusedfp8: libcuda.so.1 cannot be loaded, so no kernel can be launched")
                dev, c = ctypes.c_int(0), ctypes.c_void_p(0)
                check_cuda(drv.cuDeviceGet(ctypes.byref(dev), device), f"finding CUDA device {device}")
                check_cuda(drv.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev),
                           f"retaining CUDA device {device}'s context")
                ctx = _primary[device] = c.value
    return ctx


def push_context(device: int) -> bool:
    """Make ``device``'s primary context current on this thread unless it is already; True when it
    was pushed (then :func:`pop_context` restores the caller's). A kernel handle is valid in its
    own context only, and the thread's current one may be another GPU's (the caller's current
    device), none at all (a thread that made no CUDA runtime call: torch's autograd workers), or a
    context of the same GPU that is not the primary one."""
    drv = driver()
    cur = ctypes.c_void_p(0)
    err = drv.cuCtxGetCurrent(ctypes.byref(cur))
    if err:
        check_cuda(err, "reading the thread's current CUDA context")
    ctx = primary_context(device)
    if cur.value == ctx:
        return False
    check_cuda(drv.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), f"making CUDA device {device}'s context current")
    return True


def pop_context() -> None:
    """Undo a :func:`push_context` that returned True."""
    check_cuda(driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p(0))), "restoring the caller's CUDA context")


@contextlib.contextmanager
def on_device(device: int):
    """Run the block with ``device``'s primary context current (a no-op for -1 and when it already
    is), restoring the caller's after it: every driver call on a kernel handle goes under it."""
    pushed = device >= 0 and push_context(device)
    try:
        yield
    finally:
        if pushed:
            pop_context()


# ---- CUDA-graph capture ----------------------------------------------------------------------
_STREAM_CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: the legacy stream while another captures


def capturing(stream: int) -> bool:
    """Whether a CUDA-graph capture is in progress on ``stream`` (active, or already invalidated);
    for the legacy stream (0), on any blocking stream of the current context."""
    status = ctypes.c_int(0)
    err = driver().cuStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(status))
    if err == _STREAM_CAPTURE_IMPLICIT:
        return True
    check_cuda(err, "asking whether the stream is capturing a CUDA graph")
    return status.value != 0


_launch_stream = threading.local()  # .handle: the stream that the plan being built (plan_on) launches on


def plan_on(stream: int, make, *args) -> Plan:
    """``make(*args)``, a function that builds (or finds cached) a plan for launches on ``stream``
    (the plan functions of :mod:`fusedfp8.launch`). While a CUDA-graph capture is in progress on
    ``stream``, :func:`refuse_in_capture` refuses to load a kernel module: loading one is not an
    operation a capture may contain (in the default global mode it invalidates the capture). The
    rest of building a plan is host work and capture-safe driver queries (occupancy, function
    attributes), which libraries run inside captures on every call (CUB's dispatch,
    FlashAttention's launches), so a new shape of a loaded module may still be planned in a capture."""
    _launch_stream.handle = stream
    try:
        return make(*args)
    finally:
        _launch_stream.handle = None


def refuse_in_capture(what: str, device: int) -> None:
    """Raise if the stream of the plan being built (:func:`plan_on`) is capturing a CUDA graph:
    ``what`` (e.g. "the quantize kernels (bfloat16, e4m3, identity)") would have to be loaded on
    ``device`` first."""
    stream = getattr(_launch_stream, "handle", None)
    if stream is None:
        return
    with on_device(device):
        if not capturing(stream):
            return
    raise RuntimeError(
        f"fusedfp8: {what} are not loaded on cuda:{device} yet, and the stream is capturing a CUDA graph: loading "
        "a module during a capture would invalidate it. Warm up first: run the same call (the same shapes, dtypes, "
        "formats and recipe) once outside the capture, e.g. one eager step before torch.cuda.graph (torch.compile's "
        "mode='reduce-overhead' warms up by itself)")


# ---- running a plan --------------------------------------------------------------------------
_tls = threading.local()


def _param_buffer(size: int, offsets: tuple = ()):
    """This thread's parameter buffer of ``size`` bytes and the cuLaunchKernel 'extra' array pointing
    at it (the driver copies the parameters at launch, so a buffer is reused call after call); with
    ``offsets`` (a cooperative launch) instead the array of pointers to each parameter in it."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    found = bufs.get((size, offsets))
    if found is None:
        buf = ctypes.create_string_buffer(max(size, 1))
        nbytes = ctypes.c_size_t(size)
        if offsets:
            extra = (ctypes.c_void_p * len(offsets))(*(ctypes.addressof(buf) + o for o in offsets))
        else:
            extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(nbytes), 0)
        found = bufs[(size, offsets)] = (buf, nbytes, extra)
    return found


def _walk(plan: Plan, ptrs, on_memset, on_launch) -> None:
    if len(ptrs) != len(plan.slots):
        raise ValueError(f"fusedfp8: this plan takes {len(plan.slots)} pointers ({', '.join(plan.slots)}); "
                         f"got {len(ptrs)}")
    for step in plan.program:
        if step[0] == MEMSET:
            p = ptrs[step[1]]
            if p and step[2]:
                on_memset(p, step[2])
            continue
        kind, variants, block, fmt, size, pack, shared, _ = step
        choice, values = pack(ptrs)
        on_launch(kind, variants[choice], block, shared, fmt, size, values)


def execute(plan: Plan, ptrs, stream: int) -> None:
    """Run ``plan`` on the device pointers ``ptrs`` (one per slot, in ``plan.slots`` order, 0 =
    absent) on ``stream`` (a stream of ``plan.device``), in that device's context whatever the
    thread's current one is. The walk of :func:`_walk`, written out: this is the hot path of the
    Python launch path."""
    if len(ptrs) != len(plan.slots):
        _walk(plan, ptrs, None, None)  # raises the message
    pushed = plan.device >= 0 and push_context(plan.device)
    try:
        _launch_all(plan, ptrs, stream)
    finally:
        if pushed:
            pop_context()


def run(plan: Plan, buffers, stream: int) -> None:
    """:func:`execute` with the buffers by name: ``buffers`` maps slot names to device pointers (a
    slot not named is null)."""
    execute(plan, plan.slots.arrange(buffers), stream)


def _launch_all(plan: Plan, ptrs, stream: int) -> None:
    drv = driver()
    for step in plan.program:
        if step[0] == MEMSET:
            p = ptrs[step[1]]
            if p and step[2]:
                err = drv.cuMemsetD32Async(p, 0, step[2] // 4, stream)
                if err:
                    check_cuda(err, f"zeroing {step[2]} bytes at {p:#x}")
            continue
        kind, variants, block, fmt, size, pack, shared, offsets = step
        choice, values = pack(ptrs)
        v = variants[choice]
        buf, _, extra = _param_buffer(size, offsets)
        struct.pack_into(fmt, buf, 0, *values)
        if kind == COOP_LAUNCH:
            err = drv.cuLaunchCooperativeKernel(v.func, v.grid, 1, 1, block, 1, 1, shared, stream, extra)
        else:
            err = drv.cuLaunchKernel(v.func, v.grid, 1, 1, block, 1, 1, shared, stream, None, extra)
        if err:
            check_cuda(err, f"launching {v.name}" + (" (cooperative)" if kind == COOP_LAUNCH else ""))


def dry_run(plan: Plan, ptrs) -> bytes:
    """What :func:`execute` would hand the driver, as bytes (the compiled shim's ``ff8_dry_run``
    writes the same): per memset ``<q 0><Q ptr><q nbytes>``; per launch ``<q 1><Q func><q grid>
    <q block><q shared><q size>`` (``<q 2>...`` for a cooperative one) then the packed parameters,
    zero-padded to 8 bytes."""
    out = bytearray()

    def memset(p, nbytes):
        out.extend(struct.pack("<qQq", MEMSET, p, nbytes))

    def launch(kind, v, block, shared, fmt, size, values):
        out.extend(struct.pack("<qQqqqq", kind, v.func, v.grid, block, shared, size))
        out.extend(struct.pack(fmt, *values))
        out.extend(bytes(-size % 8))

    _walk(plan, ptrs, memset, launch)
    return bytes(out)

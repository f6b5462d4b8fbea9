"""The launch-plan format and its Python executor.

A plan is the pure-data description of one call's launches (see :mod:`fusedfp8._cuda`, which
builds them once per signature and caches them). Two executors read it: :func:`execute` here
(struct + ctypes, one cuLaunchKernel, or cuLaunchCooperativeKernel, per step) and the compiled host shim beside this file
(``plan.h``: the XLA FFI handler and the torch C++ ops), which gets it as int64s
(:meth:`Plan.encode`). Both hand the driver the same bytes (:func:`dry_run` and the shim's
``ff8_dry_run`` are compared in tests/kernels/test_launch_shim.py).

The Python executor launches a kernel by its CUfunction handle; the encoded plan names it by a
stable id instead (:func:`kernel_id`), which the shim resolves in a registry of the handles of
the modules loaded in the process (``fusedfp8.csrc.register_kernels``): a handle is a pointer that
means nothing in another process, and an XLA program holds its encoded plans as attributes.

A plan names buffers by slot: a parameter is "the pointer of slot i plus a byte offset", and
the caller hands one device pointer per slot, 0 for an absent buffer (whose pointer parameters
are then null, whatever their offset).

Nothing here imports a framework or CuPy.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import struct
import threading
from typing import NamedTuple

import numpy as np

PLAN_VERSION = 3  # 2: the cooperative launch step (COOP_LAUNCH); 3: kernels named by id (kernel_id)
MEMSET, LAUNCH, COOP_LAUNCH = 0, 1, 2  # step kinds (COOP_LAUNCH: a LAUNCH through cuLaunchCooperativeKernel)
I64, I32, F32, PTR, NULL, FLAG = 1, 2, 3, 4, 5, 6  # parameter (token) kinds
_LAYOUT_CHAR = {I64: "q", I32: "i", F32: "f", PTR: "P", NULL: "P", FLAG: "i"}
_PACK_CHAR = {I64: "q", I32: "i", F32: "I", PTR: "Q", NULL: "Q", FLAG: "i"}  # F32 goes in as its bits

QUANTIZE_SLOTS = ("x", "b", "q", "q_t", "dbias", "partial", "counters", "scale", "amax", "scale_out",
                  "scale_inv_out", "scale_inv_used", "updates")
LAYERNORM_SLOTS = ("x", "weight", "bias", "q", "q_t", "mean", "rstd", "scale", "amax", "scale_out", "scale_inv_out",
                   "scale_inv_used", "updates")
DEQUANTIZE_SLOTS = ("q", "out", "scale_inv")
UPDATE_SLOTS = ("amax_history", "scale", "scale_inv", "overflows", "updates", "fmt_max")
# update_meta (JAX, out of place): the meta's arrays in, the state's (int32 counters) and the output meta's counters out
META_UPDATE_SLOTS = ("amax_history", "scale", "overflows_f", "updates_f", "writes", "fmt_max", "amax_history_out",
                     "scale_out", "scale_inv_out", "overflows", "updates", "overflows_f_out", "updates_f_out")


class Token(NamedTuple):
    """One kernel parameter. I64 / I32: the immediate ``a``; F32: ``a`` = the float's bits; PTR: the
    pointer of slot ``a`` plus ``b`` bytes (null when the slot's pointer is 0); NULL: a null
    pointer; FLAG: int32 1 iff ``c`` (a static condition) is 1 and the pointer of every slot in
    the bit mask ``a`` is a multiple of ``b``, else 0."""

    kind: int
    a: int = 0
    b: int = 0
    c: int = 0


def _mask(slots) -> int:
    return sum(1 << s for s in set(slots))


def imm64(v: int) -> Token:
    return Token(I64, int(v))


def imm32(v: int) -> Token:
    return Token(I32, int(v))


def immf32(v: float) -> Token:
    return Token(F32, struct.unpack("<I", struct.pack("<f", v))[0])


def ptr(slot: int, offset: int = 0) -> Token:
    return Token(PTR, slot, offset)


NULLPTR = Token(NULL)


def flag(slots, align: int, cond: bool = True) -> Token:
    return Token(FLAG, _mask(slots), align, int(bool(cond)))


def kernel_id(name: str, source: str, options, target: str) -> int:
    """The stable id of a compiled kernel, by which an encoded plan names it: a 63-bit hash
    (blake2b) of its name expression, its module's source text, the compile options and the
    target (the architecture and compiler it was built for). The same in every process that
    compiles the same kernel alike, another wherever any of the four differs; never 0."""
    h = hashlib.blake2b(digest_size=8, person=b"fusedfp8 kernel")
    for part in (name, source, *options, target):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return (int.from_bytes(h.digest(), "little") >> 1) or 1


class Variant(NamedTuple):
    """One kernel a launch step may run: its CUfunction handle (the Python executor's), grid
    (blocks), name and :func:`kernel_id` (the encoded plan's)."""

    func: int
    grid: int
    name: str
    kid: int


class Launch(NamedTuple):
    """A kernel launch: ``variants[0]`` when the pointers of every slot in the bit mask ``select``
    are 16-byte aligned (always, for a mask of 0), else ``variants[1]``; ``block`` threads; the
    parameters laid out as the kernel declares them (natural alignment, no trailing padding);
    ``shared`` bytes of dynamic shared memory; ``coop``: a cooperative launch (all blocks resident
    at once, the grid-wide barrier's workspace; the driver refuses a grid larger than resident)."""

    variants: tuple
    select: int
    block: int
    params: tuple
    shared: int = 0
    coop: bool = False

    @property
    def layout(self) -> str:
        return "@" + "".join(_LAYOUT_CHAR[t.kind] for t in self.params)


class Memset(NamedTuple):
    """Zero ``nbytes`` (a multiple of 4) of slot ``slot``'s buffer on the stream (none for a null slot)."""

    slot: int
    nbytes: int


class Plan(NamedTuple):
    slots: tuple  # slot names, in the order the caller's pointers come in
    steps: tuple  # Memset | Launch, in launch order
    program: tuple  # the steps, pre-digested for the Python executor
    # the CUDA ordinal whose context holds the kernels (their handles are valid there only); -1 for a
    # plan of made-up kernels, which runs in whatever context is current
    device: int = -1

    def encode(self) -> tuple[np.ndarray, str]:
        """(int64 array, names) for the compiled shim: ``[PLAN_VERSION, n_slots, n_steps]``, then per
        step ``[MEMSET, slot, nbytes]`` or ``[LAUNCH | COOP_LAUNCH, n_variants, select, block,
        shared_bytes, n_params, (kernel id, grid) * n_variants, (kind, a, b, c) * n_params]``;
        names: the variants' kernel names in the same order, joined by ';'. No handle: the same
        bytes in every process that builds the plan on the same device."""
        out = [PLAN_VERSION, len(self.slots), len(self.steps)]
        names = []
        for st in self.steps:
            if isinstance(st, Memset):
                out += [MEMSET, st.slot, st.nbytes]
                continue
            out += [COOP_LAUNCH if st.coop else LAUNCH, len(st.variants), st.select, st.block, st.shared,
                    len(st.params)]
            for v in st.variants:
                out += [v.kid, v.grid]
                names.append(v.name)
            for t in st.params:
                out += list(t)
        return np.array(out, dtype=np.int64), ";".join(names)


def _packer(st: Launch, n_slots: int):
    """``pack(ptrs) -> (variant index, parameter values)`` of one launch, generated once per plan
    (as namedtuple does) so that a call costs one Python function call, not a walk over tokens."""

    def aligned(mask: int, align: int) -> str:
        tests = [f"p[{i}] % {align} == 0" for i in range(n_slots) if mask >> i & 1]
        return " and ".join(tests) or "True"

    values = []
    for t in st.params:
        if t.kind == PTR:
            if not 0 <= t.a < n_slots:
                raise ValueError(f"fusedfp8: a plan parameter points at slot {t.a} of {n_slots}")
            values.append(f"p[{t.a}]" if t.b == 0 else f"(p[{t.a}] + {t.b} if p[{t.a}] else 0)")
        elif t.kind == FLAG:
            values.append(f"int({aligned(t.a, t.b)})" if t.c else "0")
        elif t.kind == NULL:
            values.append("0")
        else:
            values.append(str(int(t.a)))
    choice = f"0 if {aligned(st.select, 16)} else 1" if st.select else "0"
    scope: dict = {}
    exec(f"def pack(p):\n    return ({choice}), ({', '.join(values)},)\n", scope)  # noqa: S102 - generated from ints
    return scope["pack"]


def _plan(slots: tuple, steps) -> Plan:
    program = []
    for st in steps:
        if isinstance(st, Memset):
            if st.nbytes % 4 or st.nbytes < 0 or not 0 <= st.slot < len(slots):
                raise ValueError(f"fusedfp8: a memset of {st.nbytes} bytes of slot {st.slot} cannot be planned")
            program.append((MEMSET, st.slot, st.nbytes))
            continue
        if not 1 <= len(st.variants) <= 2 or (st.select and len(st.variants) != 2):
            raise ValueError("fusedfp8: a launch has one variant, or two chosen by a select mask")
        if st.shared < 0:
            raise ValueError(f"fusedfp8: a launch cannot ask for {st.shared} bytes of shared memory")
        fmt = "@" + "".join(_PACK_CHAR[t.kind] for t in st.params)
        program.append((COOP_LAUNCH if st.coop else LAUNCH, st.variants, st.block, fmt, struct.calcsize(fmt),
                        _packer(st, len(slots)), st.shared, _offsets(fmt) if st.coop else ()))
    return Plan(tuple(slots), tuple(steps), tuple(program))


def _offsets(fmt: str) -> tuple:
    """Byte offset of each parameter of the packed layout ``fmt`` ('@' + one character a parameter):
    cuLaunchCooperativeKernel takes a pointer per parameter, not the packed buffer."""
    return tuple(struct.calcsize(fmt[:i + 1]) - struct.calcsize(fmt[i]) for i in range(1, len(fmt)))


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


def _check(err: int, what: str) -> None:
    if err:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"fusedfp8: {what} failed: CUDA error {err} ({(msg.value or b'?').decode()})")


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
                _check(drv.cuDeviceGet(ctypes.byref(dev), device), f"finding CUDA device {device}")
                _check(drv.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), f"retaining CUDA device {device}'s context")
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
        _check(err, "reading the thread's current CUDA context")
    ctx = primary_context(device)
    if cur.value == ctx:
        return False
    _check(drv.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), f"making CUDA device {device}'s context current")
    return True


def pop_context() -> None:
    """Undo a :func:`push_context` that returned True."""
    _check(driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p(0))), "restoring the caller's CUDA context")


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


_STREAM_CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: the legacy stream while another captures


def capturing(stream: int) -> bool:
    """Whether a CUDA-graph capture is in progress on ``stream`` (active, or already invalidated);
    for the legacy stream (0), on any blocking stream of the current context."""
    status = ctypes.c_int(0)
    err = driver().cuStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(status))
    if err == _STREAM_CAPTURE_IMPLICIT:
        return True
    _check(err, "asking whether the stream is capturing a CUDA graph")
    return status.value != 0


_launch_stream = threading.local()  # .handle: the stream that the plan being built (plan_on) launches on


def plan_on(stream: int, make, *args) -> Plan:
    """``make(*args)``, a function that builds (or finds cached) a plan for launches on ``stream``
    (fusedfp8._cuda's plan functions). While a CUDA-graph capture is in progress on ``stream``,
    :func:`refuse_in_capture` refuses to load a kernel module: loading one is not an operation a
    capture may contain (in the default global mode it invalidates the capture). The rest of
    building a plan is host work and capture-safe driver queries (occupancy, function attributes),
    which libraries run inside captures on every call (CUB's dispatch, FlashAttention's launches),
    so a new shape of a loaded module may still be planned in a capture."""
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


def execute(plan: Plan, ptrs, stream: int) -> None:
    """Run ``plan`` on the device pointers ``ptrs`` (one per slot, 0 = absent) on ``stream`` (a stream
    of ``plan.device``), in that device's context whatever the thread's current one is: the Python
    executor (the compiled shim runs the same plans, see fusedfp8/csrc/plan.h). The walk of
    :func:`_walk`, written out: this is the hot path of the Python launch path."""
    if len(ptrs) != len(plan.slots):
        _walk(plan, ptrs, None, None)  # raises the message
    pushed = plan.device >= 0 and push_context(plan.device)
    try:
        _launch_all(plan, ptrs, stream)
    finally:
        if pushed:
            pop_context()


def _launch_all(plan: Plan, ptrs, stream: int) -> None:
    drv = driver()
    for step in plan.program:
        if step[0] == MEMSET:
            p = ptrs[step[1]]
            if p and step[2]:
                err = drv.cuMemsetD32Async(p, 0, step[2] // 4, stream)
                if err:
                    _check(err, f"zeroing {step[2]} bytes at {p:#x}")
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
            _check(err, f"launching {v.name}" + (" (cooperative)" if kind == COOP_LAUNCH else ""))


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
    lib.cuCtxPushCurrent_v2.argtypes = [vp]
    lib.cuCtxPopCurrent_v2.argtypes = [pp]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [pp, ctypes.c_int]
    lib.cuStreamIsCapturing.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
    return lib

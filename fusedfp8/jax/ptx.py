"""impl 'ptx': the launch plans as XLA's own PTX custom calls (``__gpu$xla.gpu.ptx``), issue 18.

Without buffer donation XLA updates its command buffer before every execution, and an FFI custom
call is captured again each time (a few microseconds of host each); a kernel that XLA launches
itself is a kernel node whose pointers are re-packed, about what a fusion costs
(scripts/xla_custom_call_probe.py). XLA's built-in PTX custom call launches a PTX kernel given in
its backend_config (``name``, ``kernel_type="ptx"``, ``kernel_data``, ``grid_x..z``,
``block_x..z``, ``shared_mem_bytes``) with the call's buffers as the kernel's parameters, operands
then results. What that call cannot do, and how a plan (:mod:`fusedfp8._cuda`) is made to fit:

- parameters are buffers only, launch dimensions fixed when XLA compiles: every launch step of the
  plan becomes one call of a small wrapper kernel (:func:`wrapper_source`) with pointer-only
  parameters that calls the kernel's body (``<kernel>_body``, the ``__device__`` function each
  ``__global__`` kernel of cuda_src/ calls) with the plan's immediates, flags and byte offsets
  baked in, compiled to PTX with NVRTC for the device's compute capability (cached by source);
- no cooperative launch: the first step of the delayed recipe takes the plan's two-pass form (the
  amax pre-pass, which reads ``updates`` on the device and exits past the first step, then the
  cast), never the cooperative one; the same bytes by construction;
- no memset: a zeroed buffer (the dbias counters, the column sums of an empty tensor, the amax of
  :func:`fusedfp8.jax.primitives.amax`) comes in as a zeros array aliased to the call's result;
- buffers a kernel updates in place (the amax history, scale, scale_inv, counters, ...) are results
  aliased to their operands (``input_output_aliases``); each call passes on the current value of
  every buffer it touches, so the steps of a plan chain through XLA's dataflow;
- the launch picks no variant at run time: XLA's buffers are aligned. Its GPU executable checks
  every buffer of a run (``CheckAlignment`` in xla/service/gpu/gpu_executable.cc: an entry
  parameter to ``kEntryParameterAlignBytes`` = 16 bytes, a constant or an XLA allocation to
  ``kXlaAllocatedBufferAlignBytes`` = 64, gpu_constants.h) and its own kernels are compiled on that
  alignment (the ``align`` attribute of their parameters; the PTX call's arguments come from the
  same ``KernelArguments``). So a plan's launch takes the variant its ``select`` mask gives for
  16-byte aligned pointers (``variants[0]``) and every alignment flag (16 or 8 bytes) its static
  condition; a byte offset into a state array (4 * index) is baked into the pointer, as the plan
  does at run time (the kernels never vector-load a state entry).

Every local GPU gets one launch configuration: the plans of all of them must agree (grids, blocks,
parameters), which they do for GPUs of one kind. Which jaxlib runs the call: :func:`supported`
(a probe: one tiny PTX kernel compiled and run on the first GPU, once per process).
"""
from __future__ import annotations

import functools
import hashlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cuda
from ..csrc.plan import FLAG, F32, I32, I64, NULL, PTR, Launch, Memset

TARGET = "__gpu$xla.gpu.ptx"
# the kernels a wrapper can call: kernel name -> its cuda_src family (its body is <name>_body)
FAMILIES = {"quantize_flat": "quantize", "quantize_tiled": "quantize", "update_scales": "update_scales",
            "update_meta": "update_scales", "dequantize_flat": "dequantize"}
XLA_ALIGN = 16  # the least alignment of an XLA buffer (kEntryParameterAlignBytes)

_HELPER = r'''
namespace ff8_ptx {
// a buffer of the custom call, converting to whatever pointer type the body's parameter has
struct Buf {
    char* p;
    template <class U> __device__ __forceinline__ operator U*() const { return reinterpret_cast<U*>(p); }
};
}  // namespace ff8_ptx
'''


def body_call(name: str) -> tuple[str, str]:
    """(family, the body's name expression) of the kernel name expression ``name``
    (``quantize_flat<float, 0, 0, true, true>`` -> ``quantize_flat_body<float, 0, 0, true, true>``)."""
    m = re.fullmatch(r"(\w+)(<.*>)?", name.strip())
    if m is None or m.group(1) not in FAMILIES:
        raise ValueError(f"fusedfp8: impl='ptx' has no wrapper for kernel {name!r} (it wraps {sorted(FAMILIES)})")
    return FAMILIES[m.group(1)], f"{m.group(1)}_body{m.group(2) or ''}"


def _literal(tok) -> str:
    if tok.kind == I64:
        return f"(long long){int(tok.a)}LL"
    if tok.kind == I32:
        return f"(int){int(tok.a)}"
    if tok.kind == F32:
        return f"__int_as_float({int(tok.a):#010x})"
    raise ValueError(f"fusedfp8: no literal for a parameter of kind {tok.kind}")


def wrapper_source(name: str, block: int, args: list[str], n_params: int) -> tuple[str, str, str]:
    """(family, kernel name, source) of the wrapper of kernel ``name``: an ``extern "C"`` kernel of
    ``n_params`` pointers (the call's buffers, ``p0``..) with ``__launch_bounds__(block)`` that calls
    the kernel's body with ``args`` (C++ expressions over ``p<i>``, one per parameter of the body).
    The kernel's name is a hash of the rest, so equal wrappers share one PTX."""
    family, body = body_call(name)
    params = ", ".join(f"char* p{i}" for i in range(n_params)) or "void"
    text = (f"{body}(\n        " + ",\n        ".join(args) + ");")
    tag = hashlib.sha1(f"{family}|{block}|{params}|{text}".encode()).hexdigest()[:20]
    kname = f"ff8_ptx_{tag}"
    src = (f'{_HELPER}\nextern "C" __global__ void __launch_bounds__({block}) {kname}({params}) {{\n'
           f"    {text}\n}}\n")
    return family, kname, src


def _compile_options(cc: int) -> list[str]:
    # -default-device: the bodies' lambdas (quantize_tiled_body's) are device code; without it the
    # GPU machine's NVRTC (CuPy's binding, H200 2026-12-04) refused them as host functions "in JIT
    # mode" in a __device__ function, where the kernels' own compile (RawModule) takes them
    return [f"-arch=compute_{cc}", "-default-device", *_cuda.COMPILE_OPTIONS,
            *(f"-I{d}" for d in _cuda.cuda_include_dirs())]


@functools.lru_cache(maxsize=256)  # (a PTX is up to ~200 KB)
def compile_ptx(family: str, wrapper: str, cc: int) -> str:
    """The PTX of cuda_src/<family>.cu followed by ``wrapper``, for compute capability ``cc`` (90 for
    sm_90; ``family`` '' for ``wrapper`` alone): NVRTC through CuPy's binding where CuPy is there (the
    GPU machine), else cuda-bindings' (no GPU needed). Cached by source. CompileError with NVRTC's log
    if it fails."""
    source = (_cuda.family_source(family) + "\n" if family else "") + wrapper
    opts = _compile_options(cc)
    try:
        from cupy_backends.cuda.libs import nvrtc as cnv
    except ImportError:
        cnv = None
    if cnv is not None:
        prog = cnv.createProgram(source, f"{family}_ptx.cu", [], [])
        try:
            try:
                cnv.compileProgram(prog, opts)
            except cnv.NVRTCError as e:
                raise _cuda.CompileError(f"fusedfp8: NVRTC failed to compile a PTX wrapper of {family}.cu with options "
                                         f"{opts}: {e}\nCompiler log:\n{cnv.getProgramLog(prog)}") from None
            ptx = cnv.getPTX(prog)
        finally:
            cnv.destroyProgram(prog)
    else:
        ptx = _compile_cuda_bindings(source, f"{family}_ptx.cu", opts)
    return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")


def _compile_cuda_bindings(source: str, name: str, opts: list[str]) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise _cuda.CompileError(f"fusedfp8: nvrtcCreateProgram failed: {err}")
    try:
        raw = [o.encode() for o in opts]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(raw), raw)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise _cuda.CompileError(f"fusedfp8: NVRTC failed to compile {name} with options {opts}\nCompiler log:\n"
                                     f"{log.decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@functools.lru_cache(maxsize=None)
def compute_capability(device: int) -> int:
    """The compute capability of CUDA device ``device`` as an int (90 for sm_90)."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


# ---- which jaxlib runs the call ---------------------------------------------------------------
_PROBE_SRC = r'''
extern "C" __global__ void ff8_ptx_probe(const float* x, const float* y, float* out) {
  if (threadIdx.x < 4) out[threadIdx.x] = x[threadIdx.x] + y[threadIdx.x];
}'''


@functools.lru_cache(maxsize=None)
def supported() -> tuple[bool, str]:
    """(ok, why): this jaxlib runs XLA's PTX custom call on the first local GPU, an aliased result
    included. A probe rather than a version check (the call is XLA's, not a documented jax API, and
    no release note pins it): one 4-thread kernel compiled to PTX, jitted as one call whose result
    is aliased to its second operand (XLA passes operands then results, an aliased pair as two
    pointers to one buffer), run and checked (once per process, about a second). Measured to run in
    jaxlib 0.11.2 (scripts/xla_custom_call_probe.py)."""
    import jaxlib

    try:  # (run now even when the first call comes while a program is traced: FUSEDFP8_JAX_IMPL=ptx)
        with jax.ensure_compile_time_eval():
            return _probe(dev=jax.local_devices(backend="gpu")[0])
    except Exception as e:  # noqa: BLE001 - the reason goes into the error of impl='ptx'
        return False, f"jaxlib {jaxlib.__version__} could not run it: {type(e).__name__}: {str(e)[:400]}"


def _probe(dev) -> tuple[bool, str]:
    """:func:`supported`'s run on ``dev``."""
    import jaxlib

    ptx = compile_ptx("", _PROBE_SRC, compute_capability(int(getattr(dev, "local_hardware_id", dev.id))))

    def f(x, y):
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.float32), input_output_aliases={1: 0})(
            x, y, **launch_attrs("ff8_ptx_probe", ptx, 1, 32, 0))

    x = jax.device_put(jnp.arange(4, dtype=jnp.float32), dev)
    y = jax.device_put(jnp.asarray([10.0, 20.0, 30.0, 40.0], jnp.float32), dev)
    got = np.asarray(jax.jit(f)(x, y))
    if got.tolist() != [10.0, 21.0, 32.0, 43.0]:
        return False, f"jaxlib {jaxlib.__version__} ran it with wrong results ({got.tolist()}, not x + y)"
    return True, f"jaxlib {jaxlib.__version__} runs it"


def launch_attrs(name: str, ptx: str, grid: int, block: int, shared: int) -> dict:
    """The backend_config of one call (int32 attributes, as XLA reads them)."""
    i32 = np.int32
    return {"name": name, "kernel_type": "ptx", "kernel_data": ptx, "grid_x": i32(grid), "grid_y": i32(1),
            "grid_z": i32(1), "block_x": i32(block), "block_y": i32(1), "block_z": i32(1),
            "shared_mem_bytes": i32(shared)}


# ---- a plan as calls ----------------------------------------------------------------------------
def _structure(plan) -> tuple:
    """What of a plan the calls bake in (everything but the CUfunction handles)."""
    out = []
    for st in plan.steps:
        if isinstance(st, Memset):
            out.append(("memset", st.slot, st.nbytes))
        else:
            out.append(("launch", tuple((v.name, v.grid) for v in st.variants), st.select, st.block, st.params,
                        st.shared, st.coop))
    return tuple(out)


def one_plan(plans: dict):
    """The plan every local GPU runs (``plans``: CUDA ordinal -> Plan) and its devices' compute
    capability; ValueError where the GPUs would need different launches (the call bakes one)."""
    if not plans:
        raise ValueError("fusedfp8: impl='ptx' needs the launch plans of a local GPU at trace time; jax has none")
    devs = sorted(plans)
    first = _structure(plans[devs[0]])
    ccs = {compute_capability(d) for d in devs}
    for d in devs[1:]:
        if _structure(plans[d]) != first:
            raise ValueError(f"fusedfp8: impl='ptx' bakes one launch configuration for every local GPU, but the plans "
                             f"of CUDA devices {devs[0]} and {d} differ (GPUs of different kinds?); use impl='ffi'")
    if len(ccs) != 1:
        raise ValueError(f"fusedfp8: impl='ptx' compiles one PTX for every local GPU; their compute capabilities "
                         f"differ ({sorted(ccs)}); use impl='ffi'")
    return plans[devs[0]], ccs.pop()


def _nbytes(shape) -> int:
    return math.prod(shape.shape) * np.dtype(shape.dtype).itemsize


def run(plans: dict, shapes, args, sources, aliases: dict):
    """The results of ``plans`` on ``args`` as PTX custom calls (the contract of
    :func:`fusedfp8.jax.callbacks.run`): ``shapes`` the results, ``sources`` one per plan slot
    (``("in", k)``, ``("out", k)`` or None), ``aliases`` operand -> result of the state buffers."""
    plan, cc = one_plan(plans)
    current = [None] * len(shapes)  # each result's value so far (an array), None before it is written
    for i, o in aliases.items():
        current[o] = args[i]

    def size_of(src) -> int:
        return _nbytes(shapes[src[1]] if src[0] == "out" else args[src[1]])

    for st in plan.steps:
        if isinstance(st, Memset):
            src = sources[st.slot]
            if src is None:
                continue
            if src[0] != "out" or st.nbytes != _nbytes(shapes[src[1]]):
                raise ValueError(f"fusedfp8: impl='ptx' turns a memset into a zeros buffer, so it zeroes whole results "
                                 f"only; the plan zeroes {st.nbytes} bytes of slot {plan.slots[st.slot]} ({src})")
            current[src[1]] = jnp.zeros(shapes[src[1]].shape, shapes[src[1]].dtype)
            continue
        current = _launch(st, cc, shapes, args, sources, current, size_of)
    # a result no launch touches is one the plan leaves undefined (an empty tensor's dbias workspaces,
    # which the callers drop): zeros
    return [jnp.zeros(shapes[k].shape, shapes[k].dtype) if v is None else v for k, v in enumerate(current)]


def _launch(st: Launch, cc: int, shapes, args, sources, current, size_of) -> list:
    """One launch step as one call: its operands, its results (aliased where the buffer has a value)."""
    if st.coop:
        raise ValueError("fusedfp8: impl='ptx' cannot launch a cooperative kernel (XLA's PTX call has no such launch)")
    variant = st.variants[0]  # the 16-byte aligned variant (the select mask's slots are XLA buffers)
    operands, results, aliases = [], [], {}
    where: dict = {}  # buffer (source) -> (is a result, index)

    def buffer(src):
        if src in where:
            return where[src]
        if src[0] == "in":
            where[src] = (False, len(operands))
            operands.append(args[src[1]])
        else:
            k = src[1]
            if current[k] is not None:  # in place: the value so far in, the result aliased to it
                aliases[len(operands)] = len(results)
                operands.append(current[k])
            where[src] = (True, len(results))
            results.append(k)
        return where[src]

    exprs = []
    for tok in st.params:
        if tok.kind == PTR:
            src = sources[tok.a] if 0 <= tok.a < len(sources) else None
            if src is None or size_of(src) == 0:
                exprs.append("nullptr")  # an absent or empty buffer: a null pointer, as the executors pass
                continue
            exprs.append((buffer(src), tok.b))  # (a buffer of the call, a byte offset)
        elif tok.kind == NULL:
            exprs.append("nullptr")
        elif tok.kind == FLAG:  # every XLA buffer is XLA_ALIGN-aligned: the flag is its static condition
            if tok.b > XLA_ALIGN:
                raise ValueError(f"fusedfp8: impl='ptx' cannot bake an alignment flag of {tok.b} bytes")
            exprs.append(f"(int){int(tok.c)}")
        else:
            exprs.append(_literal(tok))
    n_ops = len(operands)

    def render(e):
        if isinstance(e, str):
            return e
        (is_result, idx), offset = e
        p = f"p{n_ops + idx if is_result else idx}"
        return f"ff8_ptx::Buf{{{p} + {offset}}}" if offset else f"ff8_ptx::Buf{{{p}}}"

    family, kname, wrapper = wrapper_source(variant.name, st.block, [render(e) for e in exprs],
                                            n_ops + len(results))
    ptx = compile_ptx(family, wrapper, cc)
    call = jax.ffi.ffi_call(TARGET, [shapes[k] for k in results], vmap_method="sequential",
                            input_output_aliases=aliases)
    outs = call(*operands, **launch_attrs(kname, ptx, variant.grid, st.block, st.shared))
    current = list(current)
    for k, v in zip(results, outs):
        current[k] = v
    return current

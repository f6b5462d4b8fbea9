"""CUDA kernels: source assembly from ``cuda_src/``, compile cache, and the whole launch
interface (parameter layouts, launch plans, grids, workspaces, ``launch_*``). The plans themselves
are built in :mod:`fusedfp8._plans` (pure data, no device: re-exported here); this module compiles
the kernels, reads the device, and caches a plan per signature.

Every kernel family is a ``cuda_src/<family>.cu`` file of C++ templates. A module is built once
per (family, template arguments) with ``cupy.RawModule(code=..., name_expressions=...)`` and kept
in an lru_cache; CuPy's disk cache keys on the source text, so the shared ``common.cuh`` is
folded into that text here (an edited header can never leave a stale kernel behind).

Launches go through *plans* (:func:`quantize_plan`, :func:`layernorm_plan`, :func:`dequantize_plan`,
:func:`update_plan`):
for one signature, the memsets and kernel launches of a call as pure data (kernels, by handle and
by stable id, grids, blocks, and each parameter as an immediate or "pointer of buffer slot i plus an offset"),
built once and cached, tagged with the device whose context holds its kernels. The Python
executor (:func:`fusedfp8.csrc.plan.execute`, which runs a plan in its device's context whatever
the caller's current device) and the compiled shim (fusedfp8/csrc: the XLA FFI handler, the torch
C++ ops) run the same plans. The ``launch_*``
functions at the end are thin wrappers that take raw device pointers and a stream, as
:mod:`fusedfp8.ops` and the JAX callbacks call them. They check nothing: their callers own
shapes, dtypes and lifetimes.

Nothing here imports CuPy at module import time: the CPU path works without it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from pathlib import Path
from typing import NamedTuple

# the plan format and the Python executor (re-exported: the launch interface is this module)
from . import csrc as _shim
from .csrc.plan import (DEQUANTIZE_SLOTS, LAYERNORM_SLOTS, META_UPDATE_SLOTS, NULLPTR, QUANTIZE_SLOTS, UPDATE_SLOTS, Launch,  # noqa: F401
                        Memset, Plan, Variant, _check, _mask, _plan, driver, dry_run, execute, flag, imm32, imm64, immf32,
                        kernel_id, on_device, plan_on, ptr, refuse_in_capture)
from .numerics import layernorm as _ln
# the plans' sizes, layouts and builders (re-exported, as the plan format above). Not re-exported: the
# grid rules (_flat_grid, _tiled_grid, _resident) that the builders read as module globals, so that
# code which replaces them (tests) must do it in _plans, where they act.
from ._plans import (LN_BLOCK, LN_SPLIT_COLS, LN_STATIC_SHARED, LN_THREADS, LN_TILES, SIGNATURES,  # noqa: F401
                     THREADS, TILE_C, TILE_R, TILED_BLOCK, KernelRef, _launch, aligned, build_amax_plan,
                     build_dequantize_plan, build_layernorm_amax_plan, build_layernorm_plan, build_quantize_plan,
                     build_update_plan, dbias_workspace, layernorm_block, layernorm_tile, padded, signature,
                     split_transpose)

CPP_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
CPP_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
FMT_IDS = {"e4m3": 0, "e5m2": 1}
OPS = {"identity": 0, "gelu_tanh": 1, "gelu_erf": 2, "dgelu_tanh": 3, "dgelu_erf": 4}  # types.kernel_op names
COMPILE_OPTIONS = ("-std=c++17", f"-DFF8_THREADS={THREADS}")


def source_dir() -> Path:
    """``cuda_src/`` beside the package (editable install, checkout) or inside it (wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "cuda_src", here / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"fusedfp8: cannot find the CUDA sources (cuda_src/common.cuh) beside or inside {here}")


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def family_source(family: str) -> str:
    """The text of ``cuda_src/<family>.cu`` with every local ``#include "x.cuh"`` inlined."""
    root = source_dir()
    seen: set[str] = set()

    def expand(text: str) -> str:
        def repl(m):
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand((root / name).read_text())

        return _INCLUDE.sub(repl, text)

    return expand((root / f"{family}.cu").read_text())


def compile_options() -> tuple:
    """NVRTC's options for every module: the tunables, then the folders holding cuda_fp8.h."""
    return COMPILE_OPTIONS + tuple(f"-I{d}" for d in cuda_include_dirs())


def families() -> list[str]:
    return sorted(p.stem for p in source_dir().glob("*.cu"))


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp8.h: the nvidia-cuda-runtime wheel, then the toolkit."""
    dirs = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for base in nvidia.__path__:
            for sub in ("cu13/include", "cuda_runtime/include"):
                p = Path(base) / sub
                if (p / "cuda_fp8.h").is_file():
                    dirs.append(str(p))
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(dirs) if os.path.isfile(os.path.join(d, "cuda_fp8.h"))]


# ---- name expressions: one module per (family, types) -------------------------------------
class ModuleKey(NamedTuple):
    family: str
    dtype: str = ""  # input dtype of quantize / layernorm_quantize, output dtype of dequantize
    fmt: str = ""
    op: str = ""
    param: str = ""  # layernorm_quantize: the dtype of weight and bias


def name_expressions(key: ModuleKey) -> dict[str, str]:
    """Kernel role -> C++ name expression, for the module ``key``. The role's prefix names its
    parameter layout in SIGNATURES."""
    if key.family == "quantize":
        t, f, o = CPP_TYPES[key.dtype], FMT_IDS[key.fmt], OPS[key.op]
        names = {f"flat_vec{int(v)}_store{int(s)}": f"quantize_flat<{t}, {f}, {o}, {str(v).lower()}, {str(s).lower()}>"
                 for v in (True, False) for s in (True, False)}
        names["tiled"] = f"quantize_tiled<{t}, {f}, {o}>"
        if key.op == "identity":  # a plain gradient's column sums (the bias gradient) with its cast
            names["tiled_dbias"] = f"quantize_tiled<{t}, {f}, {o}, StagedAmax, true>"
        return names
    if key.family == "current_quantize":  # the same kernels with the first step's amax in the launch
        t, f, o = CPP_TYPES[key.dtype], FMT_IDS[key.fmt], OPS[key.op]
        names = {f"coop_flat_vec{int(v)}": f"quantize_flat<{t}, {f}, {o}, {str(v).lower()}, true, GridAmax>"
                 for v in (True, False)}
        names["coop_tiled"] = f"quantize_tiled<{t}, {f}, {o}, GridAmax>"
        if key.op == "identity":
            names["coop_tiled_dbias"] = f"quantize_tiled<{t}, {f}, {o}, GridAmax, true>"
        return names
    if key.family == "layernorm_quantize":
        t, p, f = CPP_TYPES[key.dtype], CPP_TYPES[key.param], FMT_IDS[key.fmt]
        return {"layernorm_store1": f"layernorm_quantize<{t}, {p}, {f}, true, false>",
                "layernorm_store1_t": f"layernorm_quantize<{t}, {p}, {f}, true, true>",
                "layernorm_store0": f"layernorm_quantize<{t}, {p}, {f}, false, false>",
                "padded_layernorm_store1": f"layernorm_quantize_padded<{t}, {p}, {f}, false>",
                "padded_layernorm_store1_t": f"layernorm_quantize_padded<{t}, {p}, {f}, true>",
                "transpose_tiled": "transpose_fp8"}
    if key.family == "dequantize":
        return {"dequant": f"dequantize_flat<{CPP_TYPES[key.dtype]}, {FMT_IDS[key.fmt]}>"}
    if key.family == "update_scales":
        return {"update": "update_scales", "meta_update": "update_meta"}
    raise ValueError(f"unknown kernel family {key.family!r}")


def all_module_keys() -> list[ModuleKey]:
    keys = [ModuleKey(fam, d, f, o) for fam in ("quantize", "current_quantize") for d in CPP_TYPES for f in FMT_IDS
            for o in OPS]
    keys += [ModuleKey("layernorm_quantize", d, f, param=p) for d in CPP_TYPES for f in FMT_IDS for p in CPP_TYPES]
    keys += [ModuleKey("dequantize", d, f) for d in CPP_TYPES for f in FMT_IDS]
    keys.append(ModuleKey("update_scales"))
    return keys


class CompileError(RuntimeError):
    """NVRTC rejected a kernel: carries the kernel names, the options and the compiler log."""


_lock = threading.Lock()
_loaded: dict = {}  # (ModuleKey, device) -> {role: Kernel}; read without the lock once filled
compile_count = 0  # modules compiled (or loaded from CuPy's disk cache) in this process

class Kernel:
    """A compiled kernel: its CUfunction handle (``func``), its name, the device whose context
    holds it, its stable id (``kid``, :func:`kernel_id`) and its occupancy. CuPy compiles and loads
    the module and keeps it alive (``raw``); launches go through plans. Every driver call on the
    handle runs in the device's context: the handle means nothing in another GPU's, and the
    caller's current device may be any."""

    def __init__(self, raw, role: str, name: str, device: int, kid: int):
        if driver() is None:
            raise RuntimeError("fusedfp8: libcuda.so.1 cannot be loaded, so no kernel can be launched")
        self.raw, self.role, self.name, self.device, self.kid = raw, role, name, device, kid
        self.func = raw.kernel.ptr

    @functools.lru_cache(maxsize=None)
    def blocks_per_sm(self, block: int, shared: int = 0) -> int:
        """Resident blocks of ``block`` threads with ``shared`` bytes of dynamic shared memory per
        multiprocessor (the occupancy calculator; 0 where one block does not fit, which the launch
        then refuses). A driver error raises: a guessed occupancy would size every grid of the
        plan wrong without a word."""
        n = ctypes.c_int(0)
        with on_device(self.device):
            err = driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(self.func),
                                                                         block, ctypes.c_size_t(shared))
        _check(err, f"the occupancy query of {self.name} ({block} threads, {shared} bytes of shared memory) on "
                    f"cuda:{self.device}")
        return n.value

    @functools.cached_property
    def static_shared(self) -> int:
        """Bytes of static shared memory the kernel declares (its dynamic shared memory comes after)."""
        n = ctypes.c_int(0)
        with on_device(self.device):
            err = driver().cuFuncGetAttribute(ctypes.byref(n), 1, ctypes.c_void_p(self.func))  # SHARED_SIZE_BYTES
        _check(err, f"reading the static shared memory of {self.name} on cuda:{self.device}")
        return n.value

    def allow_shared(self, nbytes: int) -> None:
        """Let launches ask for ``nbytes`` of dynamic shared memory: static and dynamic together
        beyond 48 KiB need the attribute (set once per size, before any launch that uses it). Without
        it the occupancy calculator answers 0 blocks and the launch fails."""
        if nbytes > getattr(self, "_shared_cap", (48 << 10) - self.static_shared):
            with on_device(self.device):
                err = driver().cuFuncSetAttribute(ctypes.c_void_p(self.func), 8, ctypes.c_int(nbytes))  # MAX_DYNAMIC_SHARED
            _check(err, f"allowing {nbytes} bytes of shared memory for {self.name} on cuda:{self.device}")
            self._shared_cap = nbytes


def _build(key: ModuleKey, device_id: int) -> dict:
    ok, reason = probe(device_id)
    if not ok:  # a GPU array but no CuPy, or a GPU without FP8: say what to do, once per module
        raise RuntimeError(f"fusedfp8: the FP8 kernels cannot run on cuda:{device_id}: {reason}. (CPU arrays run the "
                           "bit-exact NumPy reference instead.)")
    import cupy

    global compile_count
    names = name_expressions(key)
    source, options = family_source(key.family), compile_options()
    with cupy.cuda.Device(device_id):
        try:  # CuPy may compile when the module is built or at the first get_function
            mod = cupy.RawModule(code=source, options=options, name_expressions=list(names.values()))
            # what besides the source and the options decides the code (CuPy compiles for the device's architecture)
            target = "sm_{} nvrtc {}.{}".format(cupy.cuda.Device().compute_capability, *cupy.cuda.nvrtc.getVersion())
            out = {role: Kernel(mod.get_function(expr), role, expr, device_id, kernel_id(expr, source, options, target))
                   for role, expr in names.items()}
        except cupy.cuda.compiler.CompileException as e:
            raise CompileError(
                f"fusedfp8: NVRTC failed to compile {key.family}.cu (kernels {sorted(names.values())}) with options "
                f"{list(options)}. If cuda_fp8.h is missing, pip install nvidia-cuda-runtime or set CUDA_PATH.\n"
                f"Compiler log:\n{e}") from None
    _shim.register_kernels(device_id, [(k.kid, k.func) for k in out.values()])  # encoded plans name them by id
    compile_count += 1
    return out


def kernels(key: ModuleKey, device_id: int) -> dict:
    """The compiled kernels of module ``key`` on device ``device_id`` (built once, even when
    first calls race from several threads; refused while the stream of :func:`plan_on` captures)."""
    found = _loaded.get((key, device_id))
    if found is None:
        refuse_in_capture(f"the {key.family} kernels ({', '.join(v for v in key[1:] if v)})", device_id)
        with _lock:
            found = _loaded.get((key, device_id))
            if found is None:
                found = _loaded[(key, device_id)] = _build(key, device_id)
    return found


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def shared_optin(device_id: int) -> int:
    """The most dynamic shared memory one block may opt in to on ``device_id`` (bytes)."""
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


@functools.lru_cache(maxsize=None)
def _gpu_count() -> tuple[int, str]:
    """(number of CUDA devices, why none) from the driver itself (no CuPy needed)."""
    lib = driver()
    if lib is None:
        return 0, "no CUDA GPU (no NVIDIA driver: libcuda.so.1 cannot be loaded)"
    err = lib.cuInit(0)
    if err:
        return 0, f"no CUDA GPU (the NVIDIA driver does not initialise: CUDA error {err})"
    n = ctypes.c_int(0)
    err = lib.cuDeviceGetCount(ctypes.byref(n))
    return (n.value, "") if not err and n.value else (0, "no CUDA GPU (the driver sees no device)")


@functools.lru_cache(maxsize=None)
def probe(device_id: int = 0, need_fp8_gemm: bool = False) -> tuple[bool, str]:
    """(ok, reason): can the kernels run here? One probe feeds every GPU skip marker.

    The reason names the first thing a user could change: no CUDA GPU (no driver, or no device),
    then CuPy not installed, then a device below sm_89 (no FP8 conversion instructions; with
    ``need_fp8_gemm``, no FP8 GEMMs).
    """
    count, why = _gpu_count()
    if count == 0:
        return False, why
    if count <= device_id:
        return False, f"no CUDA device {device_id} (found {count})"
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'fusedfp8[cuda]')"
    try:
        cc = str(cupy.cuda.Device(device_id).compute_capability)  # e.g. '90'
    except Exception as e:  # noqa: BLE001 - a driver CuPy cannot use (too old for its runtime, ...)
        return False, f"CuPy cannot use CUDA device {device_id} ({type(e).__name__}: {e})"
    major, minor = int(cc[:-1]), int(cc[-1])
    if (major, minor) < (8, 9):
        what = "FP8 GEMMs" if need_fp8_gemm else "FP8 conversion instructions"
        return False, f"GPU of compute capability {major}.{minor} has no {what} (needs 8.9 or newer)"
    return True, f"GPU {device_id}: compute capability {major}.{minor}"


def kernel_refs(key: ModuleKey, device_id: int) -> dict:
    """Role -> :class:`KernelRef` of module ``key`` on ``device_id`` (compiles it on first use)."""
    return {role: KernelRef(k.func, k.name, role, k.blocks_per_sm(TILED_BLOCK if "tiled" in role else THREADS),
                            k.kid) for role, k in kernels(key, device_id).items()}


# Cached per signature. Pass the arguments positionally: the cache keys on them as given.
@functools.lru_cache(maxsize=4096)
def quantize_plan(device: int, dtype: str, fmt: str, op: str, rows: int, cols: int, transpose: bool = False,
                  dbias: bool = False, first: bool = False, margin_factor: float = 1.0, offset: int = 0,
                  pad_to: int = 1, coop: bool = True) -> Plan:
    """:func:`build_quantize_plan` for module (dtype, fmt, op) on ``device`` (and, for a first step
    in one launch, its current_quantize twin). ``dbias`` goes with a gradient's ops only, the
    identity and the dgelu ops (the bias gradient: the column sums of what is cast); ValueError
    with a gelu op."""
    if dbias and op not in ("identity", "dgelu_tanh", "dgelu_erf"):
        raise ValueError(f"dbias: the column sums come with op 'identity', 'dgelu_tanh' or 'dgelu_erf' (a gradient); "
                         f"got op {op!r}")
    refs = kernel_refs(ModuleKey("quantize", dtype, fmt, op), device)
    if first and coop:
        refs = {**refs, **kernel_refs(ModuleKey("current_quantize", dtype, fmt, op), device)}
    return build_quantize_plan(refs, sm_count(device), rows, cols, transpose, dbias, first, margin_factor, offset,
                               pad_to, coop)._replace(device=device)


@functools.lru_cache(maxsize=4096)
def layernorm_plan(device: int, dtype: str, param: str, fmt: str, rows: int, cols: int, transpose: bool = False,
                   first: bool = False, eps: float = 1e-5, margin_factor: float = 1.0, offset: int = 0,
                   pad_to: int = 1) -> Plan:
    """:func:`build_layernorm_plan` for module (dtype, fmt, param) on ``device`` (compiles it on first
    use; with ``transpose``, allows the kernel the tile's shared memory: the tile of the padded columns)."""
    ks = kernels(ModuleKey("layernorm_quantize", dtype, fmt, param=param), device)
    fused_t = transpose and rows and not split_transpose(padded(rows, cols, pad_to)[1])
    tile = layernorm_tile(padded(rows, cols, pad_to)[1], shared_optin(device)) if fused_t else (0, 0)
    tpr = _ln.threads_per_row(max(cols, 1))
    for role in ("layernorm_store1_t", "padded_layernorm_store1_t"):
        ks[role].allow_shared(tile[1])

    def per_sm(role, k):
        if role == "transpose_tiled":
            return k.blocks_per_sm(TILED_BLOCK)
        return k.blocks_per_sm(layernorm_block(tpr, tile[0]), tile[1]) if role.endswith("_t") else \
            k.blocks_per_sm(layernorm_block(tpr))

    refs = {role: KernelRef(k.func, k.name, role, per_sm(role, k), k.kid) for role, k in ks.items()}
    return build_layernorm_plan(refs, sm_count(device), rows, cols, transpose, first, eps, margin_factor, offset, tile,
                                pad_to)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def amax_plan(device: int, dtype: str, op: str, n: int) -> Plan:
    """:func:`build_amax_plan` for an input of ``dtype`` and kernel ``op`` on ``device``."""
    return build_amax_plan(kernel_refs(ModuleKey("quantize", dtype, "e4m3", op), device), sm_count(device),
                           n)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def layernorm_amax_plan(device: int, dtype: str, param: str, rows: int, cols: int, eps: float = 1e-5) -> Plan:
    """:func:`build_layernorm_amax_plan` for (dtype, param) on ``device``."""
    refs = kernel_refs(ModuleKey("layernorm_quantize", dtype, "e4m3", param=param), device)
    return build_layernorm_amax_plan(refs, sm_count(device), rows, cols, eps)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def dequantize_plan(device: int, dtype: str, fmt: str, n: int) -> Plan:
    return build_dequantize_plan(kernel_refs(ModuleKey("dequantize", dtype, fmt), device), sm_count(device),
                                 n)._replace(device=device)


@functools.lru_cache(maxsize=256)
def update_plan(device: int, n: int, L: int, margin_factor: float, algo_max: bool, meta: bool = False) -> Plan:
    return build_update_plan(kernel_refs(ModuleKey("update_scales"), device), n, L, margin_factor, algo_max,
                             meta)._replace(device=device)


# ---- the launch interface on raw pointers (thin wrappers over the plans) ---------------------
def launch_quantize(device: int, stream: int, *, dtype: str, fmt: str, op: str, x: int, b: int, q: int,
                    scale: int, amax: int, rows: int, cols: int, q_t: int = 0, dbias: int = 0, partial: int = 0,
                    counters: int = 0, scale_inv_used: int = 0, first: bool = False, updates: int = 0,
                    scale_out: int = 0, scale_inv_out: int = 0, margin_factor: float = 1.0, pad_to: int = 1,
                    coop: bool = True) -> None:
    """Launch the quantize kernels on raw device pointers (:func:`quantize_plan`, then :func:`execute`).

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle (0 = legacy default stream).
    dtype : 'float32' | 'float16' | 'bfloat16', the input's dtype.
    fmt : 'e4m3' | 'e5m2', the format of ``q`` / ``q_t``.
    op : one of :data:`OPS`; for 'dgelu_*' ``x`` is dy and ``b`` is the forward input.
    x, b, q : input(s) (rows x cols, row-major) and the FP8 output (same shape, bytes).
    scale : (1,) float32, read.  amax : (1,) float32, max-accumulated (NaN-propagating).
    q_t : (cols, rows) FP8 transpose, or 0.  dbias : (cols,) float32 column sums (dgelu ops only), or 0; needs
        ``partial`` and ``counters`` (:func:`dbias_workspace`; the plan zeroes the counters first,
        and zeroes dbias itself when rows * cols is 0).
    scale_inv_used : (1,) float32 receiving ``1 / scale`` as used (written even when rows*cols
        is 0), or 0.
    first : a first step is possible (current scaling, or delayed scaling's ``first_step='current'``);
        then ``updates`` (int32 flag, 0 = first step), ``scale_out`` and ``scale_inv_out`` (the
        state's entries, written on a first step) are set.
    coop : with ``first``, the amax and the cast in one cooperative launch (default); False: the
        two-pass path (an amax pre-pass launch, then the cast). The same bytes either way.
    margin_factor : 2**margin, for the first-step scale.
    pad_to : q is (rows, cols) rounded up to multiples of it, q_t its transpose, zeros in the pad
        (:func:`padded`; the dbias workspace too).
    """
    if rows * cols == 0 and not scale_inv_used:
        return
    plan = plan_on(stream, quantize_plan, device, dtype, fmt, op, rows, cols, bool(q_t),
                   bool(dbias or partial or counters), bool(first), float(margin_factor), 0, int(pad_to), bool(coop))
    execute(plan, (x, b, q, q_t, dbias, partial, counters, scale, amax, scale_out, scale_inv_out, scale_inv_used,
                   updates), stream)


def launch_layernorm_quantize(device: int, stream: int, *, dtype: str, param: str, fmt: str, x: int, weight: int,
                              bias: int, q: int, mean: int, rstd: int, scale: int, amax: int, rows: int, cols: int,
                              eps: float, q_t: int = 0, scale_inv_used: int = 0, first: bool = False,
                              updates: int = 0, scale_out: int = 0, scale_inv_out: int = 0,
                              margin_factor: float = 1.0, pad_to: int = 1) -> None:
    """Launch the layernorm_quantize kernels on raw device pointers (:func:`layernorm_plan`, then
    :func:`execute`).

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle.
    dtype : the dtype of x; param : the dtype of weight and bias ('float32' | 'float16' | 'bfloat16').
    fmt : 'e4m3' | 'e5m2', the format of ``q`` / ``q_t``.
    x : (rows, cols) row-major input, cols >= 1. weight, bias : (cols,), or 0 (1 and -0).
    q : (rows, cols) FP8 output (bytes; padded with pad_to); q_t : (cols, rows) transpose (likewise), or 0.
    mean, rstd : (rows,) float32 outputs.
    scale : (1,) float32, read. amax : (1,) float32, max-accumulated (NaN-propagating).
    eps : added to the variance (rounded to float32).
    scale_inv_used, first, updates, scale_out, scale_inv_out, margin_factor : as :func:`launch_quantize`.
    pad_to : q is (rows, cols) rounded up to multiples of it, q_t its transpose, zeros in the pad
        (:func:`padded`); mean and rstd stay (rows,).
    """
    if rows == 0 and not scale_inv_used:
        return
    plan = plan_on(stream, layernorm_plan, device, dtype, param, fmt, rows, cols, bool(q_t), bool(first), float(eps),
                   float(margin_factor), 0, int(pad_to))
    execute(plan, (x, weight, bias, q, q_t, mean, rstd, scale, amax, scale_out, scale_inv_out, scale_inv_used,
                   updates), stream)


def launch_dequantize(device: int, stream: int, *, dtype: str, fmt: str, q: int, out: int, scale_inv: int,
                      n: int) -> None:
    """``out[i] = dtype(float32(q[i]) * scale_inv[0])`` for n elements (nothing for n == 0)."""
    if n:
        execute(plan_on(stream, dequantize_plan, device, dtype, fmt, n), (q, out, scale_inv), stream)


def launch_update_scales(device: int, stream: int, *, amax_history: int, scale: int, scale_inv: int,
                         overflows: int, updates: int, fmt_max: int, n: int, L: int, margin_factor: float,
                         algo_max: bool) -> None:
    """Launch the fused update (:func:`fusedfp8.numerics.scaling.update_rule`) on raw pointers, in
    place: ``amax_history`` (L, n) float32, ``scale``/``scale_inv`` (n,) float32,
    ``overflows``/``updates`` (n,) int32, ``fmt_max`` (n,) float32 (each tensor's format max)."""
    execute(plan_on(stream, update_plan, device, n, L, float(margin_factor), bool(algo_max)),
            (amax_history, scale, scale_inv, overflows, updates, fmt_max), stream)

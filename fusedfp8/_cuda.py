"""CUDA kernels: source assembly from ``cuda_src/``, compile cache, and the whole launch
interface (parameter layouts, grids, workspaces, ``launch_*``).

Every kernel family is a ``cuda_src/<family>.cu`` file of C++ templates. A module is built once
per (family, template arguments) with ``cupy.RawModule(code=..., name_expressions=...)`` and kept
in an lru_cache; CuPy's disk cache keys on the source text, so the shared ``common.cuh`` is
folded into that text here (an edited header can never leave a stale kernel behind).

The ``launch_*`` functions at the end take raw device pointers and a stream and are the one
layer under every GPU entry point: :mod:`fusedfp8.ops`, the torch custom ops and the JAX
callbacks. They check nothing: their callers own shapes, dtypes and lifetimes.

Nothing here imports CuPy at module import time: the CPU path works without it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import struct
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np


THREADS = 256  # -DFF8_THREADS for the element-wise kernels
TILE_R, TILE_C = 128, 64  # the tiled kernel's tile (rows, columns), fixed in quantize.cu
CPP_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
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
    dtype: str = ""  # input dtype of quantize, output dtype of dequantize
    fmt: str = ""
    op: str = ""


def name_expressions(key: ModuleKey) -> dict[str, str]:
    """Kernel role -> C++ name expression, for the module ``key``. The role's prefix names its
    parameter layout in SIGNATURES."""
    if key.family == "quantize":
        t, f, o = CPP_TYPES[key.dtype], FMT_IDS[key.fmt], OPS[key.op]
        names = {f"flat_vec{int(v)}_store{int(s)}": f"quantize_flat<{t}, {f}, {o}, {str(v).lower()}, {str(s).lower()}>"
                 for v in (True, False) for s in (True, False)}
        names["tiled"] = f"quantize_tiled<{t}, {f}, {o}>"
        return names
    if key.family == "dequantize":
        return {"dequant": f"dequantize_flat<{CPP_TYPES[key.dtype]}, {FMT_IDS[key.fmt]}>"}
    if key.family == "update_scales":
        return {"update": "update_scales"}
    raise ValueError(f"unknown kernel family {key.family!r}")


def all_module_keys() -> list[ModuleKey]:
    keys = [ModuleKey("quantize", d, f, o) for d in CPP_TYPES for f in FMT_IDS for o in OPS]
    keys += [ModuleKey("dequantize", d, f) for d in CPP_TYPES for f in FMT_IDS]
    keys.append(ModuleKey("update_scales"))
    return keys


class CompileError(RuntimeError):
    """NVRTC rejected a kernel: carries the kernel names, the options and the compiler log."""


_lock = threading.Lock()
_loaded: dict = {}  # (ModuleKey, device) -> {role: Kernel}; read without the lock once filled
compile_count = 0  # modules compiled (or loaded from CuPy's disk cache) in this process

# Parameter layouts (struct format, native alignment) of every kernel, by role prefix. The packed
# size must equal the kernel's parameter size exactly (no trailing padding), or the driver
# refuses the launch (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); tests/test_compile.py checks each
# against the parameter bank size NVRTC records in the cubin.
SIGNATURES = {
    "flat": "@9Pqf",         # quantize_flat: x, b, q, scale, amax, scale_out, scale_inv_out, scale_inv_used,
                             #                updates, n, margin
    "tiled": "@13Pqqiif",    # quantize_tiled: 13 pointers, rows, cols, vec, vec_t, margin
    "dequant": "@3Pqi",      # dequantize_flat: q, out, scale_inv, n, vec
    "update": "@6Piifi",     # update_scales: 6 pointers, n, L, margin, algo_max
}


class Kernel:
    """A compiled kernel and its launcher: ``kernel(grid, block, stream_ptr, *args)``.

    Launches go straight to the driver (cuLaunchKernel with one packed parameter buffer), which
    costs a few microseconds instead of CuPy's per-argument conversion; CuPy compiles and loads
    the module and keeps it alive (``raw``).
    """

    def __init__(self, raw, role: str, name: str):
        if _driver() is None:
            raise RuntimeError("fusedfp8: libcuda.so.1 cannot be loaded, so no kernel can be launched")
        self.raw, self.name = raw, name
        self.fmt = SIGNATURES[next(k for k in SIGNATURES if role.startswith(k))]
        self.size = struct.calcsize(self.fmt)
        self.func = raw.kernel.ptr

    @functools.lru_cache(maxsize=None)
    def blocks_per_sm(self, block: int) -> int:
        """Resident blocks of ``block`` threads per multiprocessor (the occupancy calculator)."""
        n = ctypes.c_int(0)
        err = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(self.func),
                                                                     block, ctypes.c_size_t(0))
        return n.value if err == 0 and n.value > 0 else 1

    def _buffers(self):
        """This thread's parameter buffer and the cuLaunchKernel 'extra' array pointing at it
        (the driver copies the parameters at launch, so a buffer is reused call after call)."""
        bufs = getattr(_tls, "bufs", None)
        if bufs is None:
            bufs = _tls.bufs = {}
        found = bufs.get(self.size)
        if found is None:
            buf = ctypes.create_string_buffer(self.size)
            size = ctypes.c_size_t(self.size)
            extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
            found = bufs[self.size] = (buf, size, extra)
        return found

    def __call__(self, grid: int, block: int, stream_ptr: int, *args):
        buf, _, extra = self._buffers()
        struct.pack_into(self.fmt, buf, 0, *args)
        err = _driver().cuLaunchKernel(self.func, grid, 1, 1, block, 1, 1, 0, stream_ptr, None, extra)
        if err:
            msg = ctypes.c_char_p()
            _driver().cuGetErrorString(err, ctypes.byref(msg))
            raise RuntimeError(f"fusedfp8: launching {self.name} failed: CUDA error {err} "
                               f"({(msg.value or b'?').decode()})")


_tls = threading.local()


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                   ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p]
    lib.cuLaunchKernel.restype = ctypes.c_int
    return lib


def _build(key: ModuleKey, device_id: int) -> dict:
    ok, reason = probe(device_id)
    if not ok:  # a GPU array but no CuPy, or a GPU without FP8: say what to do, once per module
        raise RuntimeError(f"fusedfp8: the FP8 kernels cannot run on cuda:{device_id}: {reason}. (CPU arrays run the "
                           "bit-exact NumPy reference instead.)")
    import cupy

    global compile_count
    names = name_expressions(key)
    options = COMPILE_OPTIONS + tuple(f"-I{d}" for d in cuda_include_dirs())
    with cupy.cuda.Device(device_id):
        try:  # CuPy may compile when the module is built or at the first get_function
            mod = cupy.RawModule(code=family_source(key.family), options=options,
                                 name_expressions=list(names.values()))
            out = {role: Kernel(mod.get_function(expr), role, expr) for role, expr in names.items()}
        except cupy.cuda.compiler.CompileException as e:
            raise CompileError(
                f"fusedfp8: NVRTC failed to compile {key.family}.cu (kernels {sorted(names.values())}) with options "
                f"{list(options)}. If cuda_fp8.h is missing, pip install nvidia-cuda-runtime or set CUDA_PATH.\n"
                f"Compiler log:\n{e}") from None
    compile_count += 1
    return out


def kernels(key: ModuleKey, device_id: int) -> dict:
    """The compiled kernels of module ``key`` on device ``device_id`` (built once, even when
    first calls race from several threads)."""
    found = _loaded.get((key, device_id))
    if found is None:
        with _lock:
            found = _loaded.get((key, device_id))
            if found is None:
                found = _loaded[(key, device_id)] = _build(key, device_id)
    return found


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def flat_grid(kernel: "Kernel", n: int, device_id: int, per_thread: int = 16) -> int:
    """One resident wave: min(work items, resident blocks per SM x SMs); grid-stride beyond."""
    return max(1, min(-(-n // (per_thread * THREADS)), kernel.blocks_per_sm(THREADS) * sm_count(device_id)))


def tiled_grid(kernel: "Kernel", rows: int, cols: int, device_id: int) -> int:
    tiles = -(-rows // TILE_R) * -(-cols // TILE_C)
    return max(1, min(tiles, kernel.blocks_per_sm(256) * sm_count(device_id)))


@functools.lru_cache(maxsize=None)
def probe(device_id: int = 0, need_fp8_gemm: bool = False) -> tuple[bool, str]:
    """(ok, reason): can the kernels run here? One probe feeds every GPU skip marker.

    Reasons are distinct: CuPy missing, no CUDA device, a device below sm_89 (no FP8
    conversion instructions), and with ``need_fp8_gemm`` a device below sm_89 for FP8 GEMMs.
    """
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'fusedfp8[cuda]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        return False, f"no CUDA GPU ({type(e).__name__}: {e})"
    if count <= device_id:
        return False, "no CUDA GPU" if count == 0 else f"no CUDA device {device_id} (found {count})"
    cc = str(cupy.cuda.Device(device_id).compute_capability)  # e.g. '90'
    major, minor = int(cc[:-1]), int(cc[-1])
    if (major, minor) < (8, 9):
        what = "FP8 GEMMs" if need_fp8_gemm else "FP8 conversion instructions"
        return False, f"GPU of compute capability {major}.{minor} has no {what} (needs 8.9 or newer)"
    return True, f"GPU {device_id}: compute capability {major}.{minor}"


# ---- the launch interface ------------------------------------------------------------------
def aligned(*ptrs: int) -> bool:
    """All pointers 16-byte aligned (the vector paths' requirement)."""
    return all(q % 16 == 0 for q in ptrs)


def dbias_workspace(rows: int, cols: int) -> tuple[tuple[int, int], int]:
    """Shapes of the dbias workspaces of the tiled kernel: ``partial`` (float32, (row tiles,
    cols)) and the int32 ``counters`` (one per column strip, zero before the launch)."""
    return (max(1, -(-rows // TILE_R)), cols), max(1, -(-cols // TILE_C))


def launch_quantize(device: int, stream: int, *, dtype: str, fmt: str, op: str, x: int, b: int, q: int,
                    scale: int, amax: int, rows: int, cols: int, q_t: int = 0, dbias: int = 0, partial: int = 0,
                    counters: int = 0, scale_inv_used: int = 0, first: bool = False, updates: int = 0,
                    scale_out: int = 0, scale_inv_out: int = 0, margin_factor: float = 1.0) -> None:
    """Launch the quantize kernels on raw device pointers.

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle (0 = legacy default stream).
    dtype : 'float32' | 'float16' | 'bfloat16', the input's dtype.
    fmt : 'e4m3' | 'e5m2', the format of ``q`` / ``q_t``.
    op : one of :data:`OPS`; for 'dgelu_*' ``x`` is dy and ``b`` is the forward input.
    x, b, q : input(s) (rows x cols, row-major) and the FP8 output (same shape, bytes).
    scale : (1,) float32, read.  amax : (1,) float32, max-accumulated (NaN-propagating).
    q_t : (cols, rows) FP8 transpose, or 0.  dbias : (cols,) float32 column sums, or 0; needs
        ``partial`` and ``counters`` (:func:`dbias_workspace`; the counters zero before the launch,
        the kernel leaves them zero).
    scale_inv_used : (1,) float32 receiving ``1 / scale`` as used (written even when rows*cols
        is 0), or 0.
    first : launch the first-step pre-pass; then ``updates`` (int32 flag, 0 = first step),
        ``scale_out`` and ``scale_inv_out`` (the state's entries, written on a first step) are set.
    margin_factor : 2**margin, for the first-step scale.
    """
    kern = kernels(ModuleKey("quantize", dtype, fmt, op), device)
    n = rows * cols
    if not first:
        updates = scale_out = scale_inv_out = 0
    if n == 0:
        if scale_inv_used:  # nothing to quantize, still hand out 1 / scale (amax max-accumulates 0)
            kern["flat_vec0_store1"](1, THREADS, stream, x, b, q, scale, amax, 0, 0, scale_inv_used, 0, 0,
                                     margin_factor)
        return
    vec = aligned(x, b, q)
    if first:  # first-step pre-pass: amax of the whole tensor, only if *updates == 0
        pre = kern[f"flat_vec{int(vec)}_store0"]
        pre(flat_grid(pre, n, device), THREADS, stream, x, b, q, scale, amax, 0, 0, 0, updates, n, margin_factor)
    if q_t or dbias:
        tiled = kern["tiled"]
        tiled(tiled_grid(tiled, rows, cols, device), 256, stream, x, b, q, q_t, dbias, partial, counters,
              scale, amax, scale_out, scale_inv_out, scale_inv_used, updates, rows, cols,
              int(vec and cols % 8 == 0), int(bool(q_t) and q_t % 8 == 0 and rows % 8 == 0), margin_factor)
    else:
        flat = kern[f"flat_vec{int(vec)}_store1"]
        flat(flat_grid(flat, n, device), THREADS, stream, x, b, q, scale, amax, scale_out, scale_inv_out,
             scale_inv_used, updates, n, margin_factor)


def launch_dequantize(device: int, stream: int, *, dtype: str, fmt: str, q: int, out: int, scale_inv: int,
                      n: int) -> None:
    """``out[i] = dtype(float32(q[i]) * scale_inv[0])`` for n elements (nothing for n == 0)."""
    if n:
        kern = kernels(ModuleKey("dequantize", dtype, fmt), device)["dequant"]
        kern(flat_grid(kern, n, device), THREADS, stream, q, out, scale_inv, n, int(aligned(q, out)))


def launch_update_scales(device: int, stream: int, *, amax_history: int, scale: int, scale_inv: int,
                         overflows: int, updates: int, fmt_max: int, n: int, L: int, margin_factor: float,
                         algo_max: bool) -> None:
    """Launch the fused update (:func:`fusedfp8.numerics.scaling.update_rule`) on raw pointers, in
    place: ``amax_history`` (L, n) float32, ``scale``/``scale_inv`` (n,) float32,
    ``overflows``/``updates`` (n,) int32, ``fmt_max`` (n,) float32 (each tensor's format max)."""
    kern = kernels(ModuleKey("update_scales"), device)["update"]
    kern(max(n, 1), THREADS, stream, amax_history, scale, scale_inv, overflows, updates, fmt_max, n, L,
         margin_factor, int(algo_max))  # one block per tensor

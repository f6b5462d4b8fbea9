"""CUDA kernels: source assembly from ``cuda_src/``, compile cache, and the whole launch
interface (parameter layouts, launch plans, grids, workspaces, ``launch_*``).

Every kernel family is a ``cuda_src/<family>.cu`` file of C++ templates. A module is built once
per (family, template arguments) with ``cupy.RawModule(code=..., name_expressions=...)`` and kept
in an lru_cache; CuPy's disk cache keys on the source text, so the shared ``common.cuh`` is
folded into that text here (an edited header can never leave a stale kernel behind).

Launches go through *plans* (:func:`quantize_plan`, :func:`layernorm_plan`, :func:`dequantize_plan`,
:func:`update_plan`):
for one signature, the memsets and kernel launches of a call as pure data (CUfunction handles,
grids, blocks, and each parameter as an immediate or "pointer of buffer slot i plus an offset"),
built once and cached. The Python executor (:func:`fusedfp8.csrc.plan.execute`) and the compiled
shim (fusedfp8/csrc: the XLA FFI handler, the torch C++ ops) run the same plans. The ``launch_*``
functions at the end are thin wrappers that take raw device pointers and a stream, as
:mod:`fusedfp8.ops` and the JAX callbacks call them. They check nothing: their callers own
shapes, dtypes and lifetimes.

Nothing here imports CuPy at module import time: the CPU path works without it.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import threading
from pathlib import Path
from typing import NamedTuple

# the plan format and the Python executor (re-exported: the launch interface is this module)
from .csrc.plan import (DEQUANTIZE_SLOTS, LAYERNORM_SLOTS, META_UPDATE_SLOTS, NULLPTR, QUANTIZE_SLOTS, UPDATE_SLOTS, Launch,  # noqa: F401
                        Memset, Plan, Variant, _check, _mask, _plan, driver, dry_run, execute, flag, imm32, imm64, immf32,
                        ptr)
from .numerics import layernorm as _ln

THREADS = 256  # -DFF8_THREADS for the element-wise kernels
TILE_R, TILE_C = 128, 64  # the tiled kernel's tile (rows, columns), fixed in quantize.cu
TILED_BLOCK = 256  # the tiled kernel's block (its __launch_bounds__)
LN_THREADS = _ln.MAX_THREADS_PER_ROW  # the layernorm kernel's largest block (LN_THREADS in layernorm_quantize.cu)
LN_BLOCK = 256  # its block when a row takes fewer threads (blockDim / threads-per-row rows per pass)
# the layernorm kernel's transposed tile: (rows per tile, most shared bytes), first that fits wins
LN_TILES = ((16, 64 << 10), (8, 128 << 10), (4, 1 << 30))
LN_STATIC_SHARED = 2048  # room left for the kernel's static shared memory (1216 bytes on sm_90)
CPP_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
CPP_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
FMT_IDS = {"e4m3": 0, "e5m2": 1}
OPS = {"identity": 0, "gelu_tanh": 1, "gelu_erf": 2, "dgelu_tanh": 3, "dgelu_erf": 4}  # types.kernel_op names
LAUNCH_CONFIGS = ("old", "new", "split")


def _launch_config() -> str:
    """The launch configuration of the small- and medium-tensor changes of issue 18, from the
    environment variable FUSEDFP8_LAUNCH at import ('new', the default, or 'old': the launches as
    they were, for an A/B in one benchmark run; the same bytes either way, by construction). 'new':
    layernorm_quantize with q_t one pass per tile (:func:`layernorm_block`); measured faster on the
    H200 (2026-12-04: layernorm_t 2048x1024 7.9 vs 8.8 us, 2048x4096 25.0 vs 29.6 us), bytes equal
    to the reference there (bench_kernels' check) and to 'old' (tests/kernels/test_launch_configs.py,
    passed on the H200 2026-12-04). (A lean dgelu tiled
    kernel, three blocks per multiprocessor at 80 registers, was measured on the H200 and left
    out: 2048x4096 dgelu_dbias_t 26.3 vs 24.7 us, slower at the seed's size; faster only at
    8192x16384, 289 vs 315 us.) 'split': 'new', but layernorm_quantize with q_t as two launches, the
    kernel without q_t and then transpose_fp8 over its q (:func:`build_layernorm_plan`), for an A/B
    against the fused tile (not yet measured on a GPU); any width then takes q_t (no shared tile)."""
    value = os.environ.get("FUSEDFP8_LAUNCH", "new")
    if value not in LAUNCH_CONFIGS:
        raise ValueError(f"fusedfp8: FUSEDFP8_LAUNCH must be one of {LAUNCH_CONFIGS}, got {value!r}")
    return value


LAUNCH = _launch_config()
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
        return names
    if key.family == "current_quantize":  # the same kernels with the first step's amax in the launch
        t, f, o = CPP_TYPES[key.dtype], FMT_IDS[key.fmt], OPS[key.op]
        names = {}
        for prefix, policy in (("coop", "GridAmax"), ("chip", "ChipAmax")):  # (chip: the share kept on chip)
            names.update({f"{prefix}_flat_vec{int(v)}": f"quantize_flat<{t}, {f}, {o}, {str(v).lower()}, true, "
                          f"{policy}>" for v in (True, False)})
            names[f"{prefix}_tiled"] = f"quantize_tiled<{t}, {f}, {o}, {policy}>"
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

# Parameter layouts (struct format, native alignment) of every kernel, by role prefix. The packed
# size must equal the kernel's parameter size exactly (no trailing padding), or the driver
# refuses the launch (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); tests/kernels/test_compile.py checks each
# against the parameter bank size NVRTC records in the cubin, and every plan below is checked
# against these when it is built.
SIGNATURES = {
    "flat": "@9Pqqf",        # quantize_flat: x, b, q, scale, amax, scale_out, scale_inv_out, scale_inv_used,
                             #                updates, n, npad, margin
    "tiled": "@13Pqqqqiif",  # quantize_tiled: 13 pointers, rows, cols, prows, pcols, vec, vec_t, margin
    "coop_flat": "@9Pqqf",   # the same two kernels of current_quantize.cu (GridAmax), cooperative launches
    "coop_tiled": "@13Pqqqqiif",
    "chip_flat": "@9Pqqf",   # the same with ChipAmax (dynamic shared memory, sized by the plan)
    "chip_tiled": "@13Pqqqqiif",
    "layernorm": "@13Pqq4i2f",  # layernorm_quantize: 13 pointers, rows, cols, tpr, tile_rows, vec, vec_t, eps,
                                #                     margin
    "padded_layernorm": "@13Pqqqq4i2f",  # layernorm_quantize_padded: 13 pointers, rows, cols, prows, pcols, tpr,
                                         #                            tile_rows, vec, vec_t, eps, margin
    "transpose": "@2Pqqii",  # transpose_fp8: q, q_t, prows, pcols, vec, vec_t
    "dequant": "@3Pqi",      # dequantize_flat: q, out, scale_inv, n, vec
    "update": "@6Piifi",     # update_scales: 6 pointers, n, L, margin, algo_max
    "meta_update": "@13Piifi",  # update_meta: 13 pointers (the meta in, the state and counters out), n, L, margin,
                                #              algo_max
}


def signature(role: str) -> str:
    """The parameter layout of a kernel role, one struct character per parameter ('@PPPqf')."""
    fmt = SIGNATURES[next(k for k in SIGNATURES if role.startswith(k))]
    return "@" + "".join(c * int(n or 1) for n, c in re.findall(r"(\d*)([a-zA-Z])", fmt))


class Kernel:
    """A compiled kernel: its CUfunction handle (``func``), its name and its occupancy. CuPy
    compiles and loads the module and keeps it alive (``raw``); launches go through plans."""

    def __init__(self, raw, role: str, name: str):
        if driver() is None:
            raise RuntimeError("fusedfp8: libcuda.so.1 cannot be loaded, so no kernel can be launched")
        self.raw, self.role, self.name = raw, role, name
        self.func = raw.kernel.ptr

    @functools.lru_cache(maxsize=None)
    def blocks_per_sm(self, block: int, shared: int = 0) -> int:
        """Resident blocks of ``block`` threads with ``shared`` bytes of dynamic shared memory per
        multiprocessor (the occupancy calculator)."""
        n = ctypes.c_int(0)
        err = driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(self.func),
                                                                     block, ctypes.c_size_t(shared))
        return n.value if err == 0 and n.value > 0 else 1

    @functools.cached_property
    def static_shared(self) -> int:
        """Bytes of static shared memory the kernel declares (its dynamic shared memory comes after)."""
        n = ctypes.c_int(0)
        _check(driver().cuFuncGetAttribute(ctypes.byref(n), 1, ctypes.c_void_p(self.func)),  # SHARED_SIZE_BYTES
               f"reading the static shared memory of {self.name}")
        return n.value

    def prefer_shared(self) -> None:
        """Ask for the largest shared memory carveout of the multiprocessor (L1 gets the rest): the
        ChipAmax kernels' plans count on all of it, and the occupancy calculator then answers for it."""
        if not getattr(self, "_prefers_shared", False):
            _check(driver().cuFuncSetAttribute(ctypes.c_void_p(self.func), 9, ctypes.c_int(100)),  # PREFERRED_CARVEOUT
                   f"preferring shared memory for {self.name}")
            self._prefers_shared = True

    def allow_shared(self, nbytes: int) -> None:
        """Let launches ask for ``nbytes`` of dynamic shared memory: static and dynamic together
        beyond 48 KiB need the attribute (set once per size, before any launch that uses it). Without
        it the occupancy calculator answers 0 blocks (a ChipAmax tiled plan at 2048x4096, 34864 bytes
        static + 16384 dynamic, fell back to GridAmax on the H200 for that reason)."""
        if nbytes > getattr(self, "_shared_cap", (48 << 10) - self.static_shared):
            _check(driver().cuFuncSetAttribute(ctypes.c_void_p(self.func), 8, ctypes.c_int(nbytes)),  # MAX_DYNAMIC_SHARED
                   f"allowing {nbytes} bytes of shared memory for {self.name}")
            self._shared_cap = nbytes


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


@functools.lru_cache(maxsize=None)
def chip_room(device_id: int) -> tuple[int, int, int]:
    """(shared memory per multiprocessor, the most one block may opt in to, the driver's reserve per
    resident block) of ``device_id``, bytes: what the ChipAmax kernels' dynamic shared memory is cut from."""
    drv, dev, out = driver(), ctypes.c_int(0), []
    _check(drv.cuDeviceGet(ctypes.byref(dev), device_id), f"getting CUDA device {device_id}")
    for attr in (81, 97, 111):  # MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, ..._PER_BLOCK_OPTIN, RESERVED_..._PER_BLOCK
        v = ctypes.c_int(0)
        _check(drv.cuDeviceGetAttribute(ctypes.byref(v), attr, dev), f"reading attribute {attr} of device {device_id}")
        out.append(v.value)
    return tuple(out)


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


# ---- plan builders ---------------------------------------------------------------------------
class KernelRef(NamedTuple):
    """What a plan needs of a compiled kernel."""

    func: int  # CUfunction
    name: str  # name expression (for errors)
    role: str  # its role (SIGNATURES key prefix)
    per_sm: int  # resident blocks per multiprocessor at the block size it is launched with
    static_shared: int = 0  # bytes of static shared memory (the ChipAmax kernels' plans count it)


class Chip(NamedTuple):
    """What the plan of a ChipAmax launch (current_quantize.cu: the block's share kept in shared memory
    through the grid barrier) sizes its dynamic shared memory from: the device (:func:`chip_room`) and
    the bytes of input an element takes (the dtype's size, twice for dgelu's two inputs)."""

    per_sm: int  # shared memory per multiprocessor
    per_block: int  # the most one block may opt in to
    reserved: int  # the driver's reserve per resident block
    elem_bytes: int


H200_ROOM = (233472, 232448, 1024)  # chip_room on an H200 (sm_90): 228 KiB, 227 KiB, 1 KiB
CHIP_MIN_FRACTION = 0.5  # a ChipAmax launch when at least this fraction of the tensor stays on chip, else GridAmax's
# the fewest resident blocks a ChipAmax launch may take, as a fraction of the kernel's occupancy without shared
# memory (fewer hold more shared memory each, but fewer threads: less in registers, less latency hidden; the
# delayed recipe's later steps, which run the first-step plan, run with them too)
CHIP_MIN_OCCUPANCY = 0.5
CHIP_ENV = "FUSEDFP8_CURRENT_ONCHIP"  # "1": the ChipAmax kernels where the tensor fits (an A/B switch; default off)


def chip_default() -> bool:
    """Whether a one-launch first step takes the ChipAmax kernels where the tensor fits: no by default
    (the GridAmax kernels), yes with ``FUSEDFP8_CURRENT_ONCHIP=1`` in the environment. Measured on the
    H200 (2026-12-04, ``bench_kernels.py --recipe current``): ChipAmax is SLOWER than GridAmax where
    it takes the tensor on chip (bf16 quantize 2048x4096 15.6 vs 12.8 us, 4096x4096 26.7 vs 22.8,
    quantize_t 4096x4096 35.7 vs 28.4, gelu_t 4096x4096 58.3 vs 48.2), and its grid slows the
    delayed recipe's later steps, which run the same plan (4096x4096 quantize 16.4 vs 14.9 us); kept
    byte-exact and tested as an opt-in for the next attempt."""
    return os.environ.get(CHIP_ENV, "0").strip() in ("1", "true", "yes", "on")


class ChipStage(NamedTuple):
    grid: int
    shared: int  # dynamic shared memory per block (bytes)
    fraction: float  # of the tensor's units kept on chip (registers and shared memory)


def chip_stage(ref: KernelRef, sms: int, units: int, first_round: int, slot_bytes: int, chip: Chip) -> ChipStage:
    """Grid and dynamic shared memory of a ChipAmax launch over ``units`` (16-element vectors of the
    flat kernel, tiles of the tiled one) that a grid of B blocks takes grid-stride, ``first_round`` a
    block (its first, held in registers: a vector a thread, a tile a block), the next ones in slots of
    ``slot_bytes`` of the block's dynamic shared memory, as many as a block needs (its rounds - 1) and
    fits. Blocks per multiprocessor from the kernel's occupancy down to half of it (fewer resident
    threads hold less in registers and hide less latency; :data:`CHIP_MIN_OCCUPANCY`): the one that keeps
    the most of the tensor on chip (ties: the most blocks). Every block resident: the cooperative launch's
    condition."""
    best = None
    top = max(ref.per_sm, 1)
    for bps in range(top, max(1, math.ceil(top * CHIP_MIN_OCCUPANCY)) - 1, -1):
        grid = max(1, min(bps * sms, -(-units // first_round)))
        rounds = -(-units // (grid * first_round))
        room = min(chip.per_block, chip.per_sm // bps - chip.reserved) - ref.static_shared
        slots = max(0, min(rounds - 1, room // slot_bytes))
        fraction = min(1.0, grid * first_round * (1 + slots) / units) if units else 1.0
        if best is None or fraction > best.fraction:
            best = ChipStage(grid, slots * slot_bytes, fraction)
    return best


def kernel_refs(key: ModuleKey, device_id: int) -> dict:
    """Role -> :class:`KernelRef` of module ``key`` on ``device_id`` (compiles it on first use)."""
    return {role: KernelRef(k.func, k.name, role, k.blocks_per_sm(TILED_BLOCK if role.endswith("tiled") else THREADS),
                            k.static_shared if role.startswith("chip") else 0)
            for role, k in kernels(key, device_id).items()}


def _flat_grid(ref: KernelRef, sms: int, n: int) -> int:
    """One resident wave: min(work items of 16 elements per thread, resident blocks); grid-stride beyond."""
    return max(1, min(-(-n // (16 * THREADS)), ref.per_sm * sms))


def _tiled_grid(ref: KernelRef, sms: int, rows: int, cols: int) -> int:
    """One resident wave of tiles (grid-stride beyond): the tiled kernel pipelines a block's tiles."""
    return max(1, min(-(-rows // TILE_R) * -(-cols // TILE_C), ref.per_sm * sms))


def _resident(ref: KernelRef, sms: int, grid: int) -> int:
    """A cooperative launch's grid: every block resident at once (the driver refuses more), whatever
    the grid rule asked for (the kernels' grid-stride loops cover the rest)."""
    return max(1, min(grid, ref.per_sm * sms))


def _launch(variants, select: int, block: int, params: tuple, shared: int = 0, coop: bool = False) -> Launch:
    """A Launch whose parameter layout is checked against SIGNATURES for every variant's kernel
    (``coop``: a cooperative launch, whose grid must not exceed the resident blocks)."""
    step = Launch(tuple(Variant(r.func, grid, r.name) for r, grid in variants), select, block, tuple(params), shared,
                  coop)
    for r, _ in variants:
        if step.layout != signature(r.role):
            raise RuntimeError(f"fusedfp8: the plan lays out {r.name}'s parameters as {step.layout}, but its "
                               f"signature is {signature(r.role)}")
    return step


def aligned(*ptrs: int) -> bool:
    """All pointers 16-byte aligned (the vector paths' requirement)."""
    return all(q % 16 == 0 for q in ptrs)


def padded(rows: int, cols: int, pad_to: int = 1) -> tuple[int, int]:
    """(rows, cols) rounded up to multiples of ``pad_to`` (the shape of a padded FP8 output)."""
    return -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to


def dbias_workspace(rows: int, cols: int, pad_to: int = 1) -> tuple[tuple[int, int], int]:
    """Shapes of the dbias workspaces of the tiled kernel: ``partial`` (float32, (row tiles,
    cols)) and the int32 ``counters`` (one per column strip; the plan zeroes them first), tiles
    of the padded shape."""
    prows, pcols = padded(rows, cols, pad_to)
    return (max(1, -(-prows // TILE_R)), cols), max(1, -(-pcols // TILE_C))


def build_quantize_plan(refs: dict, sms: int, rows: int, cols: int, transpose: bool = False, dbias: bool = False,
                        first: bool = False, margin_factor: float = 1.0, offset: int = 0, pad_to: int = 1,
                        coop: bool = True, chip: Chip | None = None) -> Plan:
    """The plan of one quantize call over :data:`QUANTIZE_SLOTS` (``refs``: role -> KernelRef of the
    module, and with ``first`` and ``coop`` of its current_quantize twin; ``sms``: the device's
    multiprocessors). ``offset``: the byte offset of the tensor's entry in the scale / amax /
    scale_out / scale_inv_out / updates slots (4 * index for a state).
    ``first``: the first step (the tensor's ``updates`` is 0; every step under CurrentScaling)
    quantizes with the scale of its own amax, and the kernel writes the scale it used. With ``coop``
    (default) that is ONE cooperative launch of the current_quantize kernels (the amax, a grid-wide
    barrier, the cast); without, the two-pass path: an amax pre-pass launch, then the cast.
    ``chip`` (with ``first`` and ``coop``): that launch is of the ChipAmax kernels (the block's share
    also kept in dynamic shared memory through the barrier, sized by :func:`chip_stage`) when at least
    :data:`CHIP_MIN_FRACTION` of the tensor stays on chip, else of the GridAmax ones; None: GridAmax.
    ``pad_to``: q is (rows, cols) rounded up to multiples of it (q_t its transpose), zeros in the
    pad. A shape padded in rows only, without q_t or dbias, takes the flat kernel (q's first
    rows * cols bytes are x's, row-major, in either shape) with the (prows - rows) * cols zeros
    after them written by the same launch (npad); any other padded shape the tiled kernel."""
    X, B, Q, QT, DB, PART, CNT, S, A, SO, SIO, SIU, U = range(len(QUANTIZE_SLOTS))
    n = rows * cols
    prows, pcols = padded(rows, cols, pad_to)
    mf = immf32(margin_factor)

    def st(slot):
        return ptr(slot, offset)

    steps = []
    if dbias and n == 0 and cols:
        steps.append(Memset(DB, 4 * cols))  # no kernel runs: the column sums of nothing are 0
    if n == 0:  # nothing to quantize: still hand out 1 / scale (amax max-accumulates 0)
        r = refs["flat_vec0_store1"]
        steps.append(_launch([(r, 1)], 0, THREADS, (ptr(X), ptr(B), ptr(Q), st(S), st(A), NULLPTR, NULLPTR,
                                                    ptr(SIU), NULLPTR, imm64(0), imm64(0), mf)))
        return _plan(QUANTIZE_SLOTS, steps)
    if dbias:
        steps.append(Memset(CNT, 4 * dbias_workspace(rows, cols, pad_to)[1]))
    vec = (X, B, Q)

    def flat(store):
        # the pre-pass (store 0) runs at most one block per multiprocessor: on a first step it
        # reads the tensor grid-stride (once in a training run), on every other step each block
        # reads the flag and exits, so a small grid keeps that launch cheap
        return [(refs[f"flat_vec{v}_store{store}"], min(_flat_grid(refs[f"flat_vec{v}_store{store}"], sms, n),
                                                        sms if store == 0 else n)) for v in (1, 0)]

    coop = coop and first
    if first and not coop:  # first-step pre-pass: amax of the whole tensor, only if *updates == 0
        steps.append(_launch(flat(0), _mask(vec), THREADS, (ptr(X), ptr(B), ptr(Q), st(S), st(A), NULLPTR, NULLPTR,
                                                            NULLPTR, st(U), imm64(n), imm64(0), mf)))
    so, sio, u = (st(SO), st(SIO), st(U)) if first else (NULLPTR, NULLPTR, NULLPTR)
    if transpose or dbias or pcols != cols:
        r = refs["coop_tiled" if coop else "tiled"]
        opt = {slot: ptr(slot) if on else NULLPTR for slot, on in ((QT, transpose), (DB, dbias), (PART, dbias),
                                                                    (CNT, dbias))}
        grid = _tiled_grid(r, sms, prows, pcols)
        grid, shared = (_resident(r, sms, grid) if coop else grid), 0
        stage = chip_stage(refs["chip_tiled"], sms, -(-prows // TILE_R) * -(-pcols // TILE_C), 1,
                           TILE_R * TILE_C * chip.elem_bytes, chip) if coop and chip else None
        if stage and stage.fraction >= CHIP_MIN_FRACTION:
            r, grid, shared = refs["chip_tiled"], stage.grid, stage.shared
        steps.append(_launch([(r, grid)], 0, TILED_BLOCK, (
            ptr(X), ptr(B), ptr(Q), opt[QT], opt[DB], opt[PART], opt[CNT], st(S), st(A), so, sio, ptr(SIU), u,
            imm64(rows), imm64(cols), imm64(prows), imm64(pcols), flag((X, B), 16, cols % 8 == 0),
            flag((QT,), 8, transpose and prows % 8 == 0), mf), shared, coop=coop))
    else:
        shared = 0
        if coop:
            coop_refs = [refs[f"coop_flat_vec{v}"] for v in (1, 0)]
            main = [(r, _resident(r, sms, _flat_grid(r, sms, n))) for r in coop_refs]
            stage = chip_stage(refs["chip_flat_vec1"], sms, n // 16, THREADS, THREADS * 16 * chip.elem_bytes,
                               chip) if chip else None
            if stage and stage.fraction >= CHIP_MIN_FRACTION:  # (the unaligned twin: the same grid where it fits)
                shared = stage.shared
                main = [(refs[f"chip_flat_vec{v}"], min(stage.grid, refs[f"chip_flat_vec{v}"].per_sm * sms))
                        for v in (1, 0)]
        else:
            main = flat(1)
        steps.append(_launch(main, _mask(vec), THREADS, (ptr(X), ptr(B), ptr(Q), st(S), st(A), so, sio, ptr(SIU), u,
                                                         imm64(n), imm64((prows - rows) * cols), mf), shared,
                          coop=coop))
    return _plan(QUANTIZE_SLOTS, steps)


def build_amax_plan(refs: dict, sms: int, n: int) -> Plan:
    """The amax-only plan over :data:`QUANTIZE_SLOTS`: ``amax`` (a (2,) float32 buffer) gets
    ``max |op(x, b)|`` of the ``n`` elements in its word 0, nothing is cast. It is the first-step
    pre-pass of :func:`build_quantize_plan` (the same kernel, so the same amax bits as the
    quantization stages) with its first-step flag read from word 1 of the buffer, which the plan
    zeroes with the amax: a memset of 8 bytes, then one grid-stride launch (none for n == 0). The
    current-scaling path of several ranks takes it (the local amax, reduced across the ranks
    before the cast with the given scale)."""
    X, B, A = (QUANTIZE_SLOTS.index(s) for s in ("x", "b", "amax"))
    steps = [Memset(A, 8)]
    if n:
        variants = [(refs[f"flat_vec{v}_store0"], _flat_grid(refs[f"flat_vec{v}_store0"], sms, n)) for v in (1, 0)]
        steps.append(_launch(variants, _mask((X, B)), THREADS, (ptr(X), ptr(B), NULLPTR, NULLPTR, ptr(A), NULLPTR,
                                                                NULLPTR, NULLPTR, ptr(A, 4), imm64(n), imm64(0),
                                                                immf32(1.0))))
    return _plan(QUANTIZE_SLOTS, steps)


def layernorm_tile(cols: int, optin: int) -> tuple[int, int]:
    """(rows per transposed tile, dynamic shared bytes) of the layernorm kernel with q_t: the first
    of :data:`LN_TILES` whose tile of FP8 bytes (rows x cols rounded up to 16) fits both its cap and
    ``optin`` (the device's most shared memory per block) less the kernel's static shared memory."""
    pitch = -(-cols // 16) * 16
    room = optin - LN_STATIC_SHARED
    for tile_rows, cap in LN_TILES:
        if tile_rows * pitch <= min(cap, room):
            return tile_rows, tile_rows * pitch
    most = room // LN_TILES[-1][0] // 16 * 16
    raise ValueError(f"layernorm_quantize: transpose=True needs {LN_TILES[-1][0]} rows of FP8 bytes per block in "
                     f"shared memory ({optin} bytes on this GPU), so at most {most} columns; got {cols}")


def layernorm_block(tpr: int, tile_rows: int = 0, launch: str | None = None) -> int:
    """Threads per block of the layernorm kernel for ``tpr`` threads per row: at least
    :data:`LN_BLOCK`, one row wide. With q_t (``tile_rows`` > 0) and the 'new' launch
    configuration (``launch``, default :data:`LAUNCH`), enough rows for one pass per tile, up to
    :data:`LN_THREADS`: the rows of a tile are normalised side by side, not in tile_rows / 8
    passes one after another (at hidden 1024 a tile of 16 rows is 16 warps in one pass; the grid
    of a 2048-row tensor is only 128 tiles, so the warps a block holds are all an SM gets). The
    rows per tile stay a multiple of the rows per pass: both are powers of two."""
    block = max(LN_BLOCK, tpr)
    if tile_rows and (launch or LAUNCH) == "new":
        block = max(block, min(LN_THREADS, tile_rows * tpr))
    return block


def build_layernorm_plan(refs: dict, sms: int, rows: int, cols: int, transpose: bool = False, first: bool = False,
                         eps: float = 1e-5, margin_factor: float = 1.0, offset: int = 0,
                         tile: tuple[int, int] = (0, 0), pad_to: int = 1, split: bool = False) -> Plan:
    """The plan of one layernorm_quantize call over :data:`LAYERNORM_SLOTS` (``refs``: role ->
    KernelRef, the main kernel's ``per_sm`` counted with the tile's shared memory; ``tile``: (rows
    per tile, shared bytes) from :func:`layernorm_tile`, used with ``transpose``). ``offset``: the
    byte offset of the tensor's entry in the state slots. ``first``: launch the first-step
    pre-pass (amax of y only, when the tensor's ``updates`` is 0), and let the main kernel write
    the scale it used. The row layout (threads per row) comes from
    :func:`fusedfp8.numerics.layernorm.threads_per_row`, the one the reference sums in.
    ``pad_to``: q is (rows, cols) rounded up to multiples of it (q_t its transpose), zeros in the
    pad, written by the padded main kernel (its groups run to the padded rows; ``tile`` must then
    be the one of the padded columns); a shape that needs no pad (or 0 rows) launches exactly what
    ``pad_to=1`` launches. ``split`` (with ``transpose``; FUSEDFP8_LAUNCH=split): q_t not from the
    kernel's shared tile (``tile`` unused) but from a second launch, transpose_fp8 over the q the
    kernel without q_t wrote (padded: with its zeros), in 128 x 64-byte tiles."""
    X, W, B, Q, QT, MEAN, RSTD, S, A, SO, SIO, SIU, U = range(len(LAYERNORM_SLOTS))
    prows, pcols = padded(rows, cols, pad_to)
    pad = rows > 0 and (prows, pcols) != (rows, cols)
    tpr = _ln.threads_per_row(max(cols, 1))
    fused_t = transpose and not split  # q_t from the kernel's shared tile
    tile_rows, shared = tile if fused_t else (0, 0)
    block = layernorm_block(tpr)  # the pre-pass's (and without q_t the main kernel's)
    per_pass = block // tpr
    vec_in = flag((X, W, B, Q), 16, cols % 8 == 0)  # the pre-pass (and a launch for no rows) writes no q
    vec = flag((X, W, B, Q), 16, cols % 8 == 0 and pcols % 8 == 0)  # q's rows start 8-byte aligned
    main = refs[("padded_" if pad else "") + ("layernorm_store1_t" if fused_t else "layernorm_store1")]
    pre = refs["layernorm_store0"]

    def st(slot):
        return ptr(slot, offset)

    def params(q, q_t, mean, rstd, so, sio, siu, u, n_rows, t_rows, vec_t, padded_shape=(), vec=vec):
        return (ptr(X), ptr(W), ptr(B), q, q_t, mean, rstd, st(S), st(A), so, sio, siu, u, imm64(n_rows), imm64(cols),
                *map(imm64, padded_shape), imm32(tpr), imm32(t_rows), vec, vec_t, immf32(eps), immf32(margin_factor))

    if rows == 0:  # nothing to normalise: still hand out 1 / scale (one block, no row)
        return _plan(LAYERNORM_SLOTS, [_launch([(main, 1)], 0, block, params(
            NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, ptr(SIU), NULLPTR, 0, 0, flag((), 16, False),
            vec=vec_in))])
    steps = []
    if first:  # at most one block per multiprocessor: past the first step each block reads the flag and exits
        steps.append(_launch([(pre, min(-(-rows // per_pass), sms))], 0, block, params(
            NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, st(U), rows, 0, flag((), 16, False),
            vec=vec_in)))
    so, sio, u = (st(SO), st(SIO), st(U)) if first else (NULLPTR, NULLPTR, NULLPTR)
    groups = -(-prows // (tile_rows if fused_t else per_pass))
    steps.append(_launch([(main, max(1, min(groups, main.per_sm * sms)))], 0, layernorm_block(tpr, tile_rows), params(
        ptr(Q), ptr(QT) if fused_t else NULLPTR, ptr(MEAN), ptr(RSTD), so, sio, ptr(SIU), u, rows, tile_rows,
        flag((QT,), 16, fused_t and prows % max(tile_rows, 1) == 0), (prows, pcols) if pad else ()), shared))
    if transpose and split:
        tr = refs["transpose_tiled"]
        steps.append(_launch([(tr, _tiled_grid(tr, sms, prows, pcols))], 0, TILED_BLOCK, (
            ptr(Q), ptr(QT), imm64(prows), imm64(pcols), flag((Q,), 16, pcols % 16 == 0), flag((QT,), 16, prows % 16 == 0))))
    return _plan(LAYERNORM_SLOTS, steps)


def build_layernorm_amax_plan(refs: dict, sms: int, rows: int, cols: int, eps: float = 1e-5) -> Plan:
    """The amax-only plan of LayerNorm over :data:`LAYERNORM_SLOTS`: ``amax`` (a (2,) float32
    buffer) gets ``max |LayerNorm(x) * weight + bias|`` in word 0; nothing else is written. The
    first-step pre-pass of :func:`build_layernorm_plan` (the same amax bits) with its flag read
    from word 1, zeroed with the amax by the plan's memset."""
    X, A = LAYERNORM_SLOTS.index("x"), LAYERNORM_SLOTS.index("amax")
    steps = [Memset(A, 8)]
    if rows:
        tpr = _ln.threads_per_row(max(cols, 1))
        block = max(LN_BLOCK, tpr)
        pre = refs["layernorm_store0"]
        steps.append(_launch([(pre, min(-(-rows // (block // tpr)), sms))], 0, block, (
            ptr(X), ptr(X + 1), ptr(X + 2), NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, ptr(A), NULLPTR, NULLPTR,
            NULLPTR, ptr(A, 4), imm64(rows), imm64(cols), imm32(tpr), imm32(0), flag((X, X + 1, X + 2), 16, cols % 8 == 0),
            flag((), 16, False), immf32(eps), immf32(1.0))))
    return _plan(LAYERNORM_SLOTS, steps)


def build_dequantize_plan(refs: dict, sms: int, n: int) -> Plan:
    """``out[i] = dtype(float32(q[i]) * scale_inv[0])`` over :data:`DEQUANTIZE_SLOTS` (nothing for n == 0)."""
    if n == 0:
        return _plan(DEQUANTIZE_SLOTS, ())
    r = refs["dequant"]
    return _plan(DEQUANTIZE_SLOTS, [_launch([(r, _flat_grid(r, sms, n))], 0, THREADS,
                                            (ptr(0), ptr(1), ptr(2), imm64(n), flag((0, 1), 16)))])


def build_update_plan(refs: dict, n: int, L: int, margin_factor: float, algo_max: bool, meta: bool = False) -> Plan:
    """The fused update over :data:`UPDATE_SLOTS`: one block per tensor. ``meta``: update_meta over
    :data:`META_UPDATE_SLOTS` (a flax meta decoded, updated and its counters converted, in one launch)."""
    slots, role = (META_UPDATE_SLOTS, "meta_update") if meta else (UPDATE_SLOTS, "update")
    return _plan(slots, [_launch([(refs[role], max(n, 1))], 0, THREADS, (
        *map(ptr, range(len(slots))), imm32(n), imm32(L), immf32(margin_factor), imm32(int(algo_max))))])


# Cached per signature. Pass the arguments positionally: the cache keys on them as given.
@functools.lru_cache(maxsize=4096)
def quantize_plan(device: int, dtype: str, fmt: str, op: str, rows: int, cols: int, transpose: bool = False,
                  dbias: bool = False, first: bool = False, margin_factor: float = 1.0, offset: int = 0,
                  pad_to: int = 1, coop: bool = True, onchip: bool | None = None) -> Plan:
    """:func:`build_quantize_plan` for module (dtype, fmt, op) on ``device`` (and, for a first step
    in one launch, its current_quantize twin). ``dbias`` goes with the dgelu ops only (the column
    sums of a gradient: the tiled kernel sums nothing for another op); ValueError otherwise.
    ``onchip``: a one-launch first step may take the ChipAmax kernels (None: :func:`chip_default`);
    their dynamic shared memory is allowed here, and a launch the occupancy calculator says would
    not be resident falls back to the GridAmax kernels."""
    if dbias and OPS[op] < OPS["dgelu_tanh"]:
        raise ValueError(f"dbias: the column sums come with op 'dgelu_tanh' or 'dgelu_erf' (a gradient); got op {op!r}")
    refs = kernel_refs(ModuleKey("quantize", dtype, fmt, op), device)
    if not (first and coop):
        return build_quantize_plan(refs, sm_count(device), rows, cols, transpose, dbias, first, margin_factor,
                                   offset, pad_to, coop)
    refs = {**refs, **kernel_refs(ModuleKey("current_quantize", dtype, fmt, op), device)}
    chip = None
    if (chip_default() if onchip is None else onchip):
        chip = Chip(*chip_room(device), CPP_SIZES[dtype] * (2 if OPS[op] >= 3 else 1))
    while True:
        plan = build_quantize_plan(refs, sm_count(device), rows, cols, transpose, dbias, first, margin_factor,
                                   offset, pad_to, coop, chip)
        main = plan.steps[-1]
        if chip is None or not main.shared:
            return plan
        by_func = {k.func: k for k in kernels(ModuleKey("current_quantize", dtype, fmt, op), device).values()}
        for v in main.variants:
            by_func[v.func].prefer_shared()
            by_func[v.func].allow_shared(main.shared)
        if all(by_func[v.func].blocks_per_sm(main.block, main.shared) * sm_count(device) >= v.grid
               for v in main.variants):
            return plan
        chip = None  # (not resident as planned: GridAmax's launch)


@functools.lru_cache(maxsize=4096)
def layernorm_plan(device: int, dtype: str, param: str, fmt: str, rows: int, cols: int, transpose: bool = False,
                   first: bool = False, eps: float = 1e-5, margin_factor: float = 1.0, offset: int = 0,
                   pad_to: int = 1) -> Plan:
    """:func:`build_layernorm_plan` for module (dtype, fmt, param) on ``device`` (compiles it on first
    use; with ``transpose``, allows the kernel the tile's shared memory: the tile of the padded columns)."""
    ks = kernels(ModuleKey("layernorm_quantize", dtype, fmt, param=param), device)
    split = LAUNCH == "split"
    fused_t = transpose and rows and not split
    tile = layernorm_tile(padded(rows, cols, pad_to)[1], shared_optin(device)) if fused_t else (0, 0)
    tpr = _ln.threads_per_row(max(cols, 1))
    for role in ("layernorm_store1_t", "padded_layernorm_store1_t"):
        ks[role].allow_shared(tile[1])

    def per_sm(role, k):
        if role == "transpose_tiled":
            return k.blocks_per_sm(TILED_BLOCK)
        return k.blocks_per_sm(layernorm_block(tpr, tile[0]), tile[1]) if role.endswith("_t") else \
            k.blocks_per_sm(layernorm_block(tpr))

    refs = {role: KernelRef(k.func, k.name, role, per_sm(role, k)) for role, k in ks.items()}
    return build_layernorm_plan(refs, sm_count(device), rows, cols, transpose, first, eps, margin_factor, offset, tile,
                                pad_to, split)


@functools.lru_cache(maxsize=1024)
def amax_plan(device: int, dtype: str, op: str, n: int) -> Plan:
    """:func:`build_amax_plan` for an input of ``dtype`` and kernel ``op`` on ``device``."""
    return build_amax_plan(kernel_refs(ModuleKey("quantize", dtype, "e4m3", op), device), sm_count(device), n)


@functools.lru_cache(maxsize=1024)
def layernorm_amax_plan(device: int, dtype: str, param: str, rows: int, cols: int, eps: float = 1e-5) -> Plan:
    """:func:`build_layernorm_amax_plan` for (dtype, param) on ``device``."""
    refs = kernel_refs(ModuleKey("layernorm_quantize", dtype, "e4m3", param=param), device)
    return build_layernorm_amax_plan(refs, sm_count(device), rows, cols, eps)


@functools.lru_cache(maxsize=1024)
def dequantize_plan(device: int, dtype: str, fmt: str, n: int) -> Plan:
    return build_dequantize_plan(kernel_refs(ModuleKey("dequantize", dtype, fmt), device), sm_count(device), n)


@functools.lru_cache(maxsize=256)
def update_plan(device: int, n: int, L: int, margin_factor: float, algo_max: bool, meta: bool = False) -> Plan:
    return build_update_plan(kernel_refs(ModuleKey("update_scales"), device), n, L, margin_factor, algo_max, meta)


# ---- the launch interface on raw pointers (thin wrappers over the plans) ---------------------
def launch_quantize(device: int, stream: int, *, dtype: str, fmt: str, op: str, x: int, b: int, q: int,
                    scale: int, amax: int, rows: int, cols: int, q_t: int = 0, dbias: int = 0, partial: int = 0,
                    counters: int = 0, scale_inv_used: int = 0, first: bool = False, updates: int = 0,
                    scale_out: int = 0, scale_inv_out: int = 0, margin_factor: float = 1.0, pad_to: int = 1,
                    coop: bool = True, onchip: bool | None = None) -> None:
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
    onchip : with ``first`` and ``coop``, that launch keeps the tensor on chip through the barrier where
        it fits (the ChipAmax kernels); False: the GridAmax kernels (the rest read again); None: the
        default (:func:`chip_default`, the environment's ``FUSEDFP8_CURRENT_ONCHIP``). The same bytes.
    margin_factor : 2**margin, for the first-step scale.
    pad_to : q is (rows, cols) rounded up to multiples of it, q_t its transpose, zeros in the pad
        (:func:`padded`; the dbias workspace too).
    """
    if rows * cols == 0 and not scale_inv_used:
        return
    plan = quantize_plan(device, dtype, fmt, op, rows, cols, bool(q_t), bool(dbias or partial or counters),
                         bool(first), float(margin_factor), 0, int(pad_to), bool(coop),
                         None if onchip is None else bool(onchip))
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
    plan = layernorm_plan(device, dtype, param, fmt, rows, cols, bool(q_t), bool(first), float(eps),
                          float(margin_factor), 0, int(pad_to))
    execute(plan, (x, weight, bias, q, q_t, mean, rstd, scale, amax, scale_out, scale_inv_out, scale_inv_used,
                   updates), stream)


def launch_dequantize(device: int, stream: int, *, dtype: str, fmt: str, q: int, out: int, scale_inv: int,
                      n: int) -> None:
    """``out[i] = dtype(float32(q[i]) * scale_inv[0])`` for n elements (nothing for n == 0)."""
    if n:
        execute(dequantize_plan(device, dtype, fmt, n), (q, out, scale_inv), stream)


def launch_update_scales(device: int, stream: int, *, amax_history: int, scale: int, scale_inv: int,
                         overflows: int, updates: int, fmt_max: int, n: int, L: int, margin_factor: float,
                         algo_max: bool) -> None:
    """Launch the fused update (:func:`fusedfp8.numerics.scaling.update_rule`) on raw pointers, in
    place: ``amax_history`` (L, n) float32, ``scale``/``scale_inv`` (n,) float32,
    ``overflows``/``updates`` (n,) int32, ``fmt_max`` (n,) float32 (each tensor's format max)."""
    execute(update_plan(device, n, L, float(margin_factor), bool(algo_max)),
            (amax_history, scale, scale_inv, overflows, updates, fmt_max), stream)

"""The kernels: source assembly from ``cuda_src/``, the NVRTC build and its cache, the capability
probe, and each kernel's stable id.

Every kernel family is a ``cuda_src/<family>.cu`` file of C++ templates. A module is built once
per (family, template arguments) with ``cupy.RawModule(code=..., name_expressions=...)`` and kept
(:func:`load`); CuPy's disk cache keys on the source text, so the shared ``common.cuh`` is folded
into that text here (an edited header can never leave a stale kernel behind). Each kernel gets a
stable id (:func:`kernel_id`: its name, its module's source, the options and the target), by which
the encoded plans name it, and is registered under it with the compiled shim
(:func:`fusedfp8.csrc.register_kernels`).

Nothing here imports CuPy at module import time: the CPU path works without it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import threading
from pathlib import Path
from typing import NamedTuple

from .. import csrc
from . import executor
from .plans import THREADS

CPP_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
FMT_IDS = {"e4m3": 0, "e5m2": 1}
OPS = {"identity": 0, "gelu_tanh": 1, "gelu_erf": 2, "dgelu_tanh": 3, "dgelu_erf": 4}  # types.kernel_op names
COMPILE_OPTIONS = ("-std=c++17", f"-DFF8_THREADS={THREADS}")


def source_dir() -> Path:
    """``cuda_src/`` beside the package (editable install, checkout) or inside it (wheel)."""
    package = Path(__file__).resolve().parent.parent  # fusedfp8/
    for candidate in (package.parent / "cuda_src", package / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"fusedfp8: cannot find the CUDA sources (cuda_src/common.cuh) beside or inside {package}")


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
                "layernorm_stats": f"layernorm_quantize<{t}, {p}, {f}, false, false, true>",  # block scaling's
                "transpose_tiled": "transpose_fp8"}
    if key.family == "block_quantize":  # plans.block_role: 1x128 rows (every op), 128x128 tiles (the identity)
        t, f, o = CPP_TYPES[key.dtype], FMT_IDS[key.fmt], OPS[key.op]
        if key.op != "identity":  # an activation (gelu) or a gradient (dgelu, with its column sums compiled in)
            return {"block_1x128": f"block_quantize<{t}, {f}, false, {o}>"}
        return {"block_1x128": f"block_quantize<{t}, {f}, false>", "block_128x128": f"block_quantize<{t}, {f}, true>",
                "block_1x128_dbias": f"block_quantize<{t}, {f}, false, 0, true>",  # a plain gradient's dbias
                # the LayerNorm's y, by the dtype of its weight and bias
                **{f"block_1x128_ln_{d}": f"block_quantize<{t}, {f}, false, 0, false, {p}, true>"
                   for d, p in CPP_TYPES.items()}}
    if key.family == "dequantize":
        return {"dequant": f"dequantize_flat<{CPP_TYPES[key.dtype]}, {FMT_IDS[key.fmt]}>"}
    if key.family == "update_scales":
        return {"update": "update_scales", "meta_update": "update_meta"}
    raise ValueError(f"unknown kernel family {key.family!r}")


def all_module_keys() -> list[ModuleKey]:
    keys = [ModuleKey(fam, d, f, o) for fam in ("quantize", "current_quantize") for d in CPP_TYPES for f in FMT_IDS
            for o in OPS]
    keys += [ModuleKey("layernorm_quantize", d, f, param=p) for d in CPP_TYPES for f in FMT_IDS for p in CPP_TYPES]
    keys += [ModuleKey("block_quantize", d, f, o) for d in CPP_TYPES for f in FMT_IDS for o in OPS]
    keys += [ModuleKey("dequantize", d, f) for d in CPP_TYPES for f in FMT_IDS]
    keys.append(ModuleKey("update_scales"))
    return keys


class CompileError(RuntimeError):
    """NVRTC rejected a kernel: carries the kernel names, the options and the compiler log."""


_lock = threading.Lock()
_loaded: dict = {}  # (ModuleKey, device) -> {role: Kernel}; read without the lock once filled
compile_count = 0  # modules compiled (or loaded from CuPy's disk cache) in this process


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


class Kernel:
    """A compiled kernel: its CUfunction handle (``func``), its name, the device whose context
    holds it, its stable id (``kid``, :func:`kernel_id`) and its occupancy. CuPy compiles and loads
    the module and keeps it alive (``raw``); launches go through plans. Every driver call on the
    handle runs in the device's context: the handle means nothing in another GPU's, and the
    caller's current device may be any."""

    def __init__(self, raw, role: str, name: str, device: int, kid: int):
        if executor.driver() is None:
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
        with executor.on_device(self.device):
            err = executor.driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), ctypes.c_void_p(self.func), block, ctypes.c_size_t(shared))
        executor.check_cuda(err, f"the occupancy query of {self.name} ({block} threads, {shared} bytes of shared "
                                 f"memory) on cuda:{self.device}")
        return n.value

    @functools.cached_property
    def static_shared(self) -> int:
        """Bytes of static shared memory the kernel declares (its dynamic shared memory comes after)."""
        n = ctypes.c_int(0)
        with executor.on_device(self.device):
            err = executor.driver().cuFuncGetAttribute(ctypes.byref(n), 1,  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
                                                       ctypes.c_void_p(self.func))
        executor.check_cuda(err, f"reading the static shared memory of {self.name} on cuda:{self.device}")
        return n.value

    def allow_shared(self, nbytes: int) -> None:
        """Let launches ask for ``nbytes`` of dynamic shared memory: static and dynamic together
        beyond 48 KiB need the attribute (set once per size, before any launch that uses it). Without
        it the occupancy calculator answers 0 blocks and the launch fails."""
        if nbytes > getattr(self, "_shared_cap", (48 << 10) - self.static_shared):
            with executor.on_device(self.device):
                err = executor.driver().cuFuncSetAttribute(ctypes.c_void_p(self.func), 8,  # MAX_DYNAMIC_SHARED
                                                           ctypes.c_int(nbytes))
            executor.check_cuda(err, f"allowing {nbytes} bytes of shared memory for {self.name} on cuda:{self.device}")
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
            out = {role: Kernel(mod.get_function(expr), role, expr, device_id,
                                kernel_id(expr, source, options, target)) for role, expr in names.items()}
        except cupy.cuda.compiler.CompileException as e:
            raise CompileError(
                f"fusedfp8: NVRTC failed to compile {key.family}.cu (kernels {sorted(names.values())}) with options "
                f"{list(options)}. If cuda_fp8.h is missing, pip install nvidia-cuda-runtime or set CUDA_PATH.\n"
                f"Compiler log:\n{e}") from None
    csrc.register_kernels(device_id, [(k.kid, k.func) for k in out.values()])  # encoded plans name them by id
    compile_count += 1
    return out


def load(key: ModuleKey, device_id: int) -> dict:
    """Role -> :class:`Kernel`: the compiled kernels of module ``key`` on device ``device_id`` (built
    once, even when first calls race from several threads; refused while the stream of
    :func:`fusedfp8.launch.executor.plan_on` captures)."""
    found = _loaded.get((key, device_id))
    if found is None:
        executor.refuse_in_capture(f"the {key.family} kernels ({', '.join(v for v in key[1:] if v)})", device_id)
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
    lib = executor.driver()
    if lib is None:
        return 0, "no CUDA GPU (no NVIDIA driver: libcuda.so.1 cannot be loaded)"
    err = lib.cuInit(0)
    if err:
        return 0, f"no CUDA GPU (the NVIDIA driver does not initialise: CUDA error {err})"
    n = ctypes.c_int(0)
    err = lib.cuDeviceGetCount(ctypes.byref(n))
    return (n.value, "") if not err and n.value else (0, "no CUDA GPU (the driver sees no device)")


@functools.lru_cache(maxsize=None)
def probe(device_id: int = 0, need_fp8_gemm: bool = False, need_block_gemm: bool = False) -> tuple[bool, str]:
    """(ok, reason): can the kernels run here? One probe feeds every GPU skip marker.

    The reason names the first thing a user could change: no CUDA GPU (no driver, or no device),
    then CuPy not installed, then a device below sm_89 (no FP8 conversion instructions; with
    ``need_fp8_gemm``, no FP8 GEMMs); with ``need_block_gemm``, a device other than Hopper (9.0):
    cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMMs (BlockScaling's, also behind
    ``torch._scaled_mm``'s blockwise recipes) run there only. The block quantize kernels need no
    more than the FP8 conversions.
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
        what = "FP8 GEMMs" if need_fp8_gemm or need_block_gemm else "FP8 conversion instructions"
        return False, f"GPU of compute capability {major}.{minor} has no {what} (needs 8.9 or newer)"
    if need_block_gemm and (major, minor) != (9, 0):
        return False, (f"GPU of compute capability {major}.{minor} has no block-scaled FP8 GEMMs (cuBLASLt runs "
                       "BlockScaling's 1x128 / 128x128 GEMMs on Hopper, 9.0)")
    return True, f"GPU {device_id}: compute capability {major}.{minor}"



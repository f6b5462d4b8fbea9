"""Zero-copy interop with torch, jax, cupy and numpy, and the caller's current stream.

The framework of an array is found from ``type(x).__module__`` without importing anything;
each framework's adapter is imported lazily. GPU data reaches the kernels as raw device
pointers (torch ``data_ptr``, cupy ``data.ptr``, jax through DLPack into cupy), outputs are
allocated with the caller's framework allocator, and FP8 outputs are created directly in the
caller's float8 dtype (torch) or as uint8 (cupy; CuPy has no float8 dtype).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .formats import Format

FLOAT_INPUTS = ("float32", "float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def framework_of(a) -> str:
    """'numpy', 'torch', 'jax' or 'cupy', from the type's module (no import)."""
    mod = type(a).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith(("jax", "jaxlib")):
        return "jax"
    if mod.startswith("cupy"):
        return "cupy"
    if isinstance(a, (np.ndarray, np.generic)):
        return "numpy"
    raise TypeError(f"expected a numpy, torch, jax or cupy array; got {type(a).__module__}.{type(a).__name__}")


@dataclass
class ArrayInfo:
    """What the ops need to know about one array argument."""

    array: Any
    framework: str
    device: int  # CUDA device index, or -1 for host memory
    dtype: str  # 'float32', 'bfloat16', 'float8_e4m3fn', 'uint8', ...
    shape: tuple
    contiguous: bool
    ptr: int = 0  # device pointer (GPU arrays only)

    @property
    def is_gpu(self) -> bool:
        return self.device >= 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def where(self) -> str:
        return f"cuda:{self.device}" if self.is_gpu else "cpu"


def _torch_info(x, argname) -> ArrayInfo:
    if x.is_cuda:
        device = x.get_device()
    elif x.is_cpu:
        device = -1
    else:
        raise ValueError(f"{argname}: fusedfp8 runs on CUDA or CPU tensors; got a tensor on {x.device}")
    return ArrayInfo(x, "torch", device, _torch_dtype_name(x.dtype), tuple(x.shape), x.is_contiguous(),
                     x.data_ptr() if device >= 0 else 0)


@functools.lru_cache(maxsize=None)
def _torch_dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cupy_info(x, argname) -> ArrayInfo:
    return ArrayInfo(x, "cupy", int(x.device.id), x.dtype.name, tuple(x.shape), bool(x.flags.c_contiguous),
                     int(x.data.ptr))


def _jax_info(x, argname) -> ArrayInfo:
    import jax

    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{argname}: fusedfp8.ops works on concrete arrays; inside jax.jit / grad / vmap use "
                        "fusedfp8.jax, whose primitives trace")
    devices = x.devices()
    if len(devices) != 1:
        raise ValueError(f"{argname}: expected a jax array on one device; got one sharded over {len(devices)}")
    dev = next(iter(devices))
    device = dev.id if dev.platform == "gpu" else -1
    return ArrayInfo(x, "jax", device, x.dtype.name, tuple(x.shape), True)


def _numpy_info(x, argname) -> ArrayInfo:
    x = np.asarray(x)
    return ArrayInfo(x, "numpy", -1, x.dtype.name, tuple(x.shape), bool(x.flags.c_contiguous))


_INFO = {"torch": _torch_info, "cupy": _cupy_info, "jax": _jax_info, "numpy": _numpy_info}


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "uint8": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


def _byte_range(info: ArrayInfo) -> tuple[int, int]:
    """[start, end) of the bytes of a contiguous array (an element count x itemsize from its start)."""
    a = info.array
    if info.ptr:
        start = info.ptr
    elif info.framework == "torch":
        start = a.data_ptr()
    else:
        start = a.__array_interface__["data"][0]
    return start, start + info.size * _ITEMSIZE.get(info.dtype, 8)


def overlaps(out: ArrayInfo, x: ArrayInfo) -> bool:
    """Whether the contiguous output ``out`` shares bytes with the contiguous input ``x`` (same
    framework and device; jax arrays are immutable and never alias an output)."""
    if out.framework == "jax" or out.size == 0 or x.size == 0:
        return False
    o0, o1 = _byte_range(out)
    x0, x1 = _byte_range(x)
    return o0 < x1 and x0 < o1


def describe(x, argname: str) -> ArrayInfo:
    """An :class:`ArrayInfo` for ``x``; TypeError naming ``argname`` for a non-array."""
    try:
        fw = framework_of(x)
    except TypeError:
        raise TypeError(f"{argname}: expected a numpy, torch, jax or cupy array; got "
                        f"{type(x).__module__}.{type(x).__name__}") from None
    return _INFO[fw](x, argname)


# ---- host (reference) path: numpy views of CPU arrays, and back ------------------------------
def to_numpy(info: ArrayInfo) -> np.ndarray:
    """A numpy view (torch, numpy) or copy (jax) of a host array, bfloat16/float8 as ml_dtypes."""
    import ml_dtypes

    x = info.array
    if info.framework == "torch":
        import torch

        # through DLPack, not Tensor.numpy(): .numpy() pins the storage, which FSDP2 must free
        # after the forward (it refuses to resize a storage that a numpy array still views)
        if info.dtype in ("bfloat16",) + FP8_DTYPES:
            raw = np.from_dlpack(x.detach().view(torch.int16 if info.dtype == "bfloat16" else torch.uint8))
            return raw.view(getattr(ml_dtypes, info.dtype))
        return np.from_dlpack(x.detach())
    return np.asarray(x)


def from_numpy(a: np.ndarray, like: ArrayInfo):
    """Wrap a host result for the caller's framework (torch: zero-copy; jax: a jax array)."""
    if like.framework == "torch":
        import torch

        a = a if a.flags.c_contiguous else a.copy()  # (np.ascontiguousarray would make 0-d 1-d)
        if a.dtype.name in FP8_DTYPES + ("bfloat16",):
            raw = torch.from_numpy(a.view(np.uint8 if a.dtype.itemsize == 1 else np.int16))
            return raw.view(getattr(torch, a.dtype.name))
        return torch.from_numpy(a)
    if like.framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a)
    return a


# ---- device path -----------------------------------------------------------------------------
def stream_ptr(info: ArrayInfo) -> int:
    """The caller's current CUDA stream, as a raw handle: torch's current stream for torch
    tensors, CuPy's current stream otherwise (jax arrays reach the kernels as cupy views whose
    DLPack import already ordered them after jax's work)."""
    if info.framework == "torch":
        return _torch_stream_ptr(info.device)
    import cupy

    return int(cupy.cuda.get_current_stream(info.device).ptr)


def _torch_stream_ptr(device: int) -> int:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # fast path, no Stream object
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def device_view(info: ArrayInfo):
    """For jax GPU arrays: a cupy view through DLPack (the DLPack stream handshake orders it
    after jax's pending work). Other frameworks: the array itself (pointers are read directly)."""
    if info.framework != "jax":
        return info
    try:
        import cupy
    except ImportError:
        raise ImportError(f"{info.framework} array on cuda:{info.device}: fusedfp8 needs CuPy to run its kernels on "
                          "the GPU: pip install 'fusedfp8[cuda]' (cupy-cuda13x)") from None

    arr = cupy.from_dlpack(info.array)
    return ArrayInfo(arr, "cupy", info.device, info.dtype, info.shape, True, int(arr.data.ptr))


def empty(like: ArrayInfo, shape, dtype: str):
    """An uninitialised device array from the caller's allocator (cupy for jax callers)."""
    if like.framework == "torch":
        return like.array.new_empty(shape, dtype=_torch_dtype(dtype))
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype="uint8" if dtype in FP8_DTYPES else dtype)


@functools.lru_cache(maxsize=None)
def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def zeros(like: ArrayInfo, shape, dtype: str):
    if like.framework == "torch":
        return like.array.new_zeros(shape, dtype=_torch_dtype(dtype))
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.zeros(shape, dtype=dtype)


def data_ptr(a) -> int:
    return a.data_ptr() if framework_of(a) == "torch" else int(a.data.ptr)


def fp8_out(a, fmt: Format, caller: ArrayInfo):
    """A device FP8 result for the caller: torch float8 tensor as allocated; cupy uint8; jax
    float8 array (imported through DLPack as uint8, then bitcast by XLA)."""
    if caller.framework == "jax":
        import jax
        import jax.numpy as jnp

        u8 = jax.dlpack.from_dlpack(a)
        return jax.lax.bitcast_convert_type(u8, getattr(jnp, fmt.dtype_name))
    return a


def out_for_caller(a, caller: ArrayInfo):
    """A non-FP8 device result (amax, dbias, dequantized) in the caller's framework."""
    if caller.framework == "jax":
        import jax

        return jax.dlpack.from_dlpack(a)
    return a

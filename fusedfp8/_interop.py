"""Zero-copy interop with torch, jax, cupy and numpy: the ONLY module that branches on a framework.

The framework of an array is found from ``type(x).__module__`` without importing anything;
each framework has one adapter class below, imported lazily. GPU data reaches the kernels as raw
device pointers (torch ``data_ptr``, cupy ``data.ptr``, jax through DLPack into cupy), outputs
are allocated with the caller's framework allocator, and FP8 outputs are created directly in
the caller's float8 dtype (torch) or as uint8 (cupy; CuPy has no float8 dtype). Everything the
rest of the package needs from a framework goes through the module-level functions at the end,
which pick the adapter.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .formats import Format
from .numerics import xp as _xp
from .types import FP8_DTYPES

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "uint8": 1, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


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
    writable: bool = True  # can be written in place (numpy scalars, read-only views, jax arrays cannot)
    why_not_writable: str = ""

    size: int = 0  # element count (set from the shape)
    mutable: bool = True  # arrays of this framework can be written in place (jax arrays cannot)
    _range: tuple | None = None

    def __post_init__(self):
        self.size = math.prod(self.shape)
        self.mutable = _ADAPTERS[self.framework].mutable

    @property
    def is_gpu(self) -> bool:
        return self.device >= 0

    @property
    def adapter(self) -> "_Adapter":
        return _adapter(self.framework)

    def where(self) -> str:
        return f"cuda:{self.device}" if self.is_gpu else "cpu"

    def byte_range(self) -> tuple[int, int]:
        """[start, end) of the bytes of a contiguous array."""
        if self._range is None:
            start = self.ptr or self.adapter.host_address(self.array)
            self._range = (start, start + self.size * _ITEMSIZE.get(self.dtype, 8))
        return self._range


class _Adapter:
    """One framework. Subclasses override what differs; the defaults are numpy's."""

    mutable = True  # arrays can be written in place

    def info(self, x, argname: str) -> ArrayInfo:
        raise NotImplementedError

    def namespace(self):
        return _xp.NumpyNamespace()

    def host_address(self, a) -> int:
        return a.__array_interface__["data"][0]

    def to_numpy(self, info: ArrayInfo) -> np.ndarray:
        return np.asarray(info.array)

    def from_numpy(self, a: np.ndarray, like: ArrayInfo):
        return a

    def host_copy(self, a) -> np.ndarray:
        return np.array(a)

    def copy(self, a):
        return a.copy()

    def device_view(self, info: ArrayInfo) -> ArrayInfo:
        return info

    def mark_written(self, arrays: list) -> None:
        """``arrays`` were written in place through their memory; frameworks that keep a record of
        in-place writes are told (the default: nothing is kept)."""

    def stream_ptr(self, device: int) -> int:
        import cupy

        return int(cupy.cuda.get_current_stream(device).ptr)

    def empty(self, like: ArrayInfo, shape, dtype: str):
        import cupy

        with cupy.cuda.Device(like.device):
            return cupy.empty(shape, dtype="uint8" if dtype in FP8_DTYPES else dtype)

    def zeros(self, like: ArrayInfo, shape, dtype: str):
        import cupy

        with cupy.cuda.Device(like.device):
            return cupy.zeros(shape, dtype="uint8" if dtype in FP8_DTYPES else dtype)

    def upload(self, host: np.ndarray, like: ArrayInfo):
        """A device copy of ``host`` with the caller's allocator (outside any hot path)."""
        import cupy

        with cupy.cuda.Device(like.device):
            return cupy.asarray(host)

    def data_ptr(self, a) -> int:
        return int(a.data.ptr)

    def fp8_out(self, a, fmt: Format, caller: ArrayInfo):
        return a

    def out_for_caller(self, a, caller: ArrayInfo):
        return a


class _Numpy(_Adapter):
    def info(self, x, argname):
        if isinstance(x, np.generic):
            return ArrayInfo(np.asarray(x), "numpy", -1, x.dtype.name, (), True, writable=False,
                             why_not_writable="a numpy scalar (a value, not memory: pass a 1-element array)")
        why = "" if x.flags.writeable else "a read-only numpy array"
        return ArrayInfo(x, "numpy", -1, x.dtype.name, tuple(x.shape), bool(x.flags.c_contiguous), writable=not why,
                         why_not_writable=why)


class _Cupy(_Adapter):
    def namespace(self):
        return _xp.CupyNamespace()

    def info(self, x, argname):
        return ArrayInfo(x, "cupy", int(x.device.id), x.dtype.name, tuple(x.shape), bool(x.flags.c_contiguous),
                         int(x.data.ptr))

    def host_copy(self, a):
        return a.get()

    def copy(self, a):
        import cupy

        with cupy.cuda.Device(a.device.id):  # (cupy copies onto the current device otherwise)
            return a.copy()


class _Jax(_Adapter):
    mutable = False

    def namespace(self):
        from .numerics.jnp import JnpNamespace

        return JnpNamespace()

    def info(self, x, argname):
        import jax

        if isinstance(x, jax.core.Tracer):
            raise TypeError(f"{argname}: fusedfp8's eager functions work on concrete arrays; inside jax.jit / grad / "
                            "vmap use fusedfp8.jax, whose primitives trace")
        devices = x.devices()
        if len(devices) != 1:
            raise ValueError(f"{argname}: expected a jax array on one device; got one sharded over {len(devices)}")
        dev = next(iter(devices))
        device = dev.id if dev.platform == "gpu" else -1
        return ArrayInfo(x, "jax", device, x.dtype.name, tuple(x.shape), True, writable=False,
                         why_not_writable="a jax array (immutable)")

    def copy(self, a):
        return a  # immutable: sharing is copying

    def from_numpy(self, a, like):
        import jax.numpy as jnp

        return jnp.asarray(a)

    def device_view(self, info):
        """A cupy view through DLPack (the DLPack stream handshake orders it after jax's work)."""
        try:
            import cupy
        except ImportError:
            raise ImportError(f"jax array on cuda:{info.device}: fusedfp8 needs CuPy to run its kernels on the GPU: "
                              "pip install 'fusedfp8[cuda]' (cupy-cuda13x)") from None
        arr = cupy.from_dlpack(info.array)
        return ArrayInfo(arr, "cupy", info.device, info.dtype, info.shape, True, int(arr.data.ptr))

    def fp8_out(self, a, fmt, caller):
        """Imported through DLPack as uint8, then bitcast by XLA."""
        import jax
        import jax.numpy as jnp

        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(a), getattr(jnp, fmt.dtype_name))

    def out_for_caller(self, a, caller):
        import jax

        return jax.dlpack.from_dlpack(a)


class _Torch(_Adapter):
    def namespace(self):
        return _xp.TorchNamespace()

    def info(self, x, argname):
        import torch

        if x.is_cuda:
            device = x.get_device()
        elif x.is_cpu:
            device = -1
        else:
            raise ValueError(f"{argname}: fusedfp8 runs on CUDA or CPU tensors; got a tensor on {x.device}")
        why = ""
        if x.requires_grad:
            why = "a tensor that requires grad (autograd forbids writing it in place)"
        elif x.is_inference() and not torch.is_inference_mode_enabled():
            why = "an inference tensor (made under torch.inference_mode), written outside inference mode"
        return ArrayInfo(x, "torch", device, dtype_name(x), tuple(x.shape), x.is_contiguous(),
                         x.data_ptr() if device >= 0 else 0, writable=not why, why_not_writable=why)

    def host_address(self, a):
        return a.data_ptr()

    def to_numpy(self, info):
        """Through DLPack, not Tensor.numpy(): .numpy() pins the storage, which FSDP2 must free
        after the forward (it refuses to resize a storage that a numpy array still views)."""
        import ml_dtypes
        import torch

        x = info.array.detach()
        if info.dtype in ("bfloat16",) + FP8_DTYPES:
            raw = np.from_dlpack(x.view(torch.int16 if info.dtype == "bfloat16" else torch.uint8))
            return raw.view(getattr(ml_dtypes, info.dtype))
        return np.from_dlpack(x)

    def from_numpy(self, a, like):
        import torch

        a = a if a.flags.c_contiguous else a.copy()  # (np.ascontiguousarray would make 0-d 1-d)
        if a.dtype.name in FP8_DTYPES + ("bfloat16",):
            raw = torch.from_numpy(a.view(np.uint8 if a.dtype.itemsize == 1 else np.int16))
            return raw.view(getattr(torch, a.dtype.name))
        return torch.from_numpy(a)

    def host_copy(self, a):
        return a.detach().cpu().numpy().copy()

    def copy(self, a):
        return a.clone()

    def mark_written(self, arrays):
        """Their version counters advance, as an in-place op's would: autograd's check of saved
        tensors (and anything keyed on the version) sees the write."""
        import torch

        torch.autograd.graph.increment_version(arrays)

    def stream_ptr(self, device):
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # fast path, no Stream object
        return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream

    def empty(self, like, shape, dtype):
        return like.array.new_empty(shape, dtype=_torch_dtype(dtype))

    def zeros(self, like, shape, dtype):
        return like.array.new_zeros(shape, dtype=_torch_dtype(dtype))

    def upload(self, host, like):
        import torch

        return torch.from_numpy(host).to(like.array.device)

    def data_ptr(self, a):
        return a.data_ptr()


_ADAPTERS = {"numpy": _Numpy(), "cupy": _Cupy(), "jax": _Jax(), "torch": _Torch()}


def _adapter(framework: str) -> _Adapter:
    return _ADAPTERS[framework]


@functools.lru_cache(maxsize=None)
def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def dtype_name(a) -> str:
    """The dtype of any supported array as a plain name: 'float32', 'bfloat16', 'float8_e4m3fn'."""
    return str(a.dtype).replace("torch.", "")


# ---- the interface the rest of the package uses -----------------------------------------------
def describe(x, argname: str) -> ArrayInfo:
    """An :class:`ArrayInfo` for ``x``; TypeError naming ``argname`` for a non-array."""
    try:
        fw = framework_of(x)
    except TypeError:
        raise TypeError(f"{argname}: expected a numpy, torch, jax or cupy array; got "
                        f"{type(x).__module__}.{type(x).__name__}") from None
    return _adapter(fw).info(x, argname)


def namespace(a):
    """The array namespace (:mod:`fusedfp8.numerics.xp`) that operates on ``a``."""
    return _adapter(framework_of(a)).namespace()


def is_mutable(a) -> bool:
    """Whether arrays of ``a``'s framework are updated in place (jax: never)."""
    return _adapter(framework_of(a)).mutable


def copy(a):
    return _adapter(framework_of(a)).copy(a)


def as_jax(a, argname: str):
    """A jax array (or tracer) as is, a numpy array converted; TypeError naming ``argname`` for
    the arrays of other frameworks."""
    fw = framework_of(a)
    if fw == "jax":
        return a
    if fw == "numpy":
        import jax.numpy as jnp

        return jnp.asarray(a)
    raise TypeError(f"{argname}: fusedfp8.jax needs jax (or numpy) arrays; got a {fw} array (fusedfp8.quantize / "
                    "fusedfp8.update_scales take those)")


def host_copy(a) -> np.ndarray:
    """A numpy copy of a numpy / torch / cupy / jax array (reads the device: synchronises)."""
    return _adapter(framework_of(a)).host_copy(a)


def overlaps(a: ArrayInfo, b: ArrayInfo) -> bool:
    """Whether two contiguous arrays share bytes (jax arrays are immutable and alias nothing
    that is written)."""
    if a.device != b.device or a.framework != b.framework or not a.mutable or not a.size or not b.size:
        return False
    a0, a1 = a.byte_range()
    b0, b1 = b.byte_range()
    return a0 < b1 and b0 < a1


# host (reference) path: numpy views of CPU arrays, and back
def to_numpy(info: ArrayInfo) -> np.ndarray:
    """A numpy view (torch, numpy) or copy (jax) of a host array, bfloat16/float8 as ml_dtypes."""
    return info.adapter.to_numpy(info)


def from_numpy(a: np.ndarray, like: ArrayInfo):
    """Wrap a host result for the caller's framework (torch: zero-copy; jax: a jax array)."""
    return like.adapter.from_numpy(a, like)


# device path
def stream_ptr(info: ArrayInfo) -> int:
    """The caller's current CUDA stream as a raw handle: torch's current stream for torch
    tensors, CuPy's current stream otherwise (jax arrays reach the kernels as cupy views whose
    DLPack import already ordered them after jax's work)."""
    return info.adapter.stream_ptr(info.device)


def device_view(info: ArrayInfo) -> ArrayInfo:
    """jax GPU arrays: a cupy view through DLPack; other frameworks: ``info`` itself."""
    return info.adapter.device_view(info)


def empty(like: ArrayInfo, shape, dtype: str):
    """An uninitialised device array from the caller's allocator (cupy for jax callers)."""
    return like.adapter.empty(like, shape, dtype)


def zeros(like: ArrayInfo, shape, dtype: str):
    return like.adapter.zeros(like, shape, dtype)


def upload(host: np.ndarray, like: ArrayInfo):
    return like.adapter.upload(host, like)


def mark_written(infos) -> None:
    """Record that the arrays of ``infos`` (ArrayInfo of one framework) were written in place
    behind their framework's back (a kernel, a numpy view): torch tensors' version counters advance."""
    infos = list(infos)
    if infos:
        infos[0].adapter.mark_written([i.array for i in infos])


def data_ptr(a) -> int:
    return _adapter(framework_of(a)).data_ptr(a)


def fp8_out(a, fmt: Format, caller: ArrayInfo):
    """A device FP8 result for the caller: torch float8 tensor as allocated; cupy uint8; jax
    float8 array."""
    return caller.adapter.fp8_out(a, fmt, caller)


def out_for_caller(a, caller: ArrayInfo):
    """A non-FP8 device result (amax, dbias, dequantized) in the caller's framework."""
    return caller.adapter.out_for_caller(a, caller)

"""The GPU backend of the JAX primitives: ``jax.experimental.buffer_callback`` callbacks that hand
XLA's device buffers to :func:`fusedfp8._cuda.launch_quantize` /
:func:`~fusedfp8._cuda.launch_update_scales` on XLA's stream (``ctx.stream``).

Nothing here runs on the host per element: a callback reads raw pointers off the buffers, works
out the column offsets of the state, and launches. With ``command_buffer_compatible=True`` XLA
records the launches into its command buffer (a CUDA graph) once and replays them without
calling Python again, so a callback must not depend on anything but the buffers it is given
(it does not: the first-step decision is made on the device from ``updates``). Kernels are
compiled and their launch configuration cached at trace time (:func:`prepare`), never inside a
stream capture.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from .. import _cuda
from ..formats import Format

_F32 = 4  # bytes of a float32 / int32 state entry


def _ptr(buf) -> int:
    return int(buf.__cuda_array_interface__["data"][0]) if _size(buf) else 0


def _size(buf) -> int:
    return int(np.prod(buf.shape)) if buf.shape else 1


def _current_device() -> int:
    """The CUDA ordinal of the calling thread's current context (XLA's device for this call)."""
    dev = ctypes.c_int(0)
    err = _cuda._driver().cuCtxGetDevice(ctypes.byref(dev))
    if err:
        raise RuntimeError(f"fusedfp8.jax: cuCtxGetDevice failed with CUDA error {err} inside an XLA callback")
    return dev.value


def gpu_devices() -> list[int]:
    """CUDA ordinals of jax's local GPUs (empty without a GPU backend)."""
    import jax

    try:
        devs = jax.local_devices(backend="gpu")
    except RuntimeError:
        return []
    return [int(getattr(d, "local_hardware_id", d.id)) for d in devs]


@functools.lru_cache(maxsize=None)
def prepare(key: _cuda.ModuleKey) -> None:
    """Compile module ``key`` on every local GPU and cache its launch configuration, so that the
    first launch inside an XLA command-buffer capture only records kernels."""
    for dev in gpu_devices():
        for kern in _cuda.kernels(key, dev).values():
            kern.blocks_per_sm(_cuda.THREADS)
            kern.blocks_per_sm(256)
        _cuda.sm_count(dev)


def _memset(ptr: int, nbytes: int, stream: int) -> None:
    if nbytes:
        import cupy

        cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream)


def _same_or_copy(dst, src, stream: int) -> int:
    """The aliased output's pointer; XLA gives the input's buffer, but copy if it did not."""
    d, s = _ptr(dst), _ptr(src)
    if d != s and d:
        import cupy

        cupy.cuda.runtime.memcpyAsync(d, s, _size(src) * _F32, cupy.cuda.runtime.memcpyDeviceToDevice, stream)
    return d


def quantize_callback(*, dtype: str, fmt: Format, op: str, index: int, rows: int, cols: int, transpose: bool,
                      dbias: bool, has_b: bool, current_first: bool, margin_factor: float):
    """The buffer_callback body of one quantize primitive (static configuration bound here).

    Inputs: x, [b], amax_history (L, n), scale (n,), scale_inv (n,), updates (n,) int32.
    Outputs (in this order): q (uint8, x's shape), [q_t (cols, rows) uint8], [dbias (cols,)
    float32, partial, counters], scale_inv_used (1,), amax_history, scale, scale_inv (the last
    three aliased to their inputs).
    """
    off = index * _F32

    def callback(ctx, outs, *ins):
        stream = int(ctx.stream)
        x, rest = ins[0], ins[1:]
        b = rest[0] if has_b else None
        hist, scale, scale_inv, updates = rest[1:] if has_b else rest
        outs = list(outs)
        q = outs.pop(0)
        q_t = outs.pop(0) if transpose else None
        db = partial = counters = None
        if dbias:
            db, partial, counters = outs.pop(0), outs.pop(0), outs.pop(0)
        si_used, hist_o, scale_o, scale_inv_o = outs
        h = _same_or_copy(hist_o, hist, stream)
        s = _same_or_copy(scale_o, scale, stream)
        si = _same_or_copy(scale_inv_o, scale_inv, stream)
        if dbias:
            _memset(_ptr(counters), _size(counters) * _F32, stream)
            if rows * cols == 0:
                _memset(_ptr(db), _size(db) * _F32, stream)
        _cuda.launch_quantize(
            _current_device(), stream, dtype=dtype, fmt=fmt.name, op=op, x=_ptr(x), b=_ptr(b) if has_b else 0, q=_ptr(q),
            scale=s + off, amax=h + off, rows=rows, cols=cols, q_t=_ptr(q_t) if transpose else 0,
            dbias=_ptr(db) if dbias and rows * cols else 0, partial=_ptr(partial) if dbias else 0,
            counters=_ptr(counters) if dbias else 0, scale_inv_used=_ptr(si_used), first=current_first,
            updates=_ptr(updates) + off if current_first else 0, scale_out=s + off if current_first else 0,
            scale_inv_out=si + off if current_first else 0, margin_factor=margin_factor)

    return callback


def update_callback(*, n: int, L: int, margin_factor: float, algo_max: bool):
    """The buffer_callback body of update_scales. Inputs: amax_history, scale, scale_inv,
    overflows, updates, fmt_max (n,) float32; outputs: the first five, aliased."""

    def callback(ctx, outs, hist, scale, scale_inv, overflows, updates, fmt_max):
        stream = int(ctx.stream)
        ptrs = [_same_or_copy(o, i, stream) for o, i in zip(outs, (hist, scale, scale_inv, overflows, updates))]
        _cuda.launch_update_scales(_current_device(), stream, amax_history=ptrs[0], scale=ptrs[1], scale_inv=ptrs[2],
                                 overflows=ptrs[3], updates=ptrs[4], fmt_max=_ptr(fmt_max), n=n, L=L,
                                 margin_factor=margin_factor, algo_max=algo_max)

    return callback

"""How a checked call of :mod:`fusedfp8.ops` runs: host arrays through the NumPy reference
(:mod:`fusedfp8.numerics.reference`, bit-identical to the kernels), device arrays through the
launch interface (:mod:`fusedfp8.launch`) on the caller's current stream, results handed back in
the caller's framework. The calls come checked (:class:`fusedfp8.checks._Plan`, or
:class:`fusedfp8.checks._LayerNormPlan` for the LayerNorm runs).
"""
from __future__ import annotations

import threading

import numpy as np

from . import _interop as io
from . import launch
from .checks import _Plan
from .numerics import layernorm as ln
from .numerics import reference as ref
from .types import LayerNormQuantized, Quantized, kernel_op

_host_lock = threading.Lock()  # host-path read-modify-writes of amax / scale slots are atomic


# ---- host path (reference) -------------------------------------------------------------------
def _nan_max(a: np.float32, b: np.float32) -> np.float32:
    """max of two amaxes, NaN-propagating; -0 counts as 0 (a slot holding -0 takes b)."""
    if np.isnan(a) or np.isnan(b):
        return np.float32(np.nan)
    return max(np.float32(abs(a)), np.float32(b))


def _host_run(p: _Plan, approximate: str) -> Quantized:
    y = ref.activation(p.op, io.to_numpy(p.xi), io.to_numpy(p.bi) if p.bi is not None else None, approximate)
    return _host_quantize(p, y)


def _host_quantize(p: _Plan, y: np.ndarray) -> Quantized:
    """Quantize the float32 values ``y`` (of x's shape) as the call ``p`` asks: scale or slot,
    amax accumulation, first step, transpose, dbias."""
    amax_y = ref.amax(y)
    with _host_lock:
        if p.slot is not None:
            sv, av = io.to_numpy(p.scale), io.to_numpy(p.amax)
            fresh = p.slot.current_first and int(io.to_numpy(p.updates)[0]) == 0
            acc = _nan_max(av[0], amax_y)
            s = ref.current_scale(acc, p.fmt, p.slot.margin_factor, sv[0]) if fresh else sv[0]
            if fresh:
                sv[0] = s
                with np.errstate(all="ignore"):
                    io.to_numpy(p.scale_inv)[0] = np.float32(1.0) / s
            av[0] = acc
            amax_out = p.amax.array
        else:
            s = io.to_numpy(p.scale).reshape(())
            if p.amax is not None:
                av = io.to_numpy(p.amax).reshape(-1)
                av[0] = _nan_max(av[0], amax_y)
                amax_out = p.amax.array
            else:
                amax_out = io.from_numpy(np.array([amax_y], np.float32), p.xi)
    with np.errstate(all="ignore"):
        res = ref.finish(y, amax_y, np.float32(s), p.fmt, p.transpose)
        scale_inv = np.array([np.float32(1.0) / np.float32(s)], np.float32)
    data, data_t = res.data, res.data_t
    if p.pad_to > 1:
        data = ref.pad2d(data.reshape(p.rows, p.cols), p.prows, p.pcols)
        data_t = ref.pad2d(data_t, p.pcols, p.prows) if data_t is not None else None
    dbias = io.from_numpy(ref.column_sums(y), p.xi) if p.dbias else None
    data_t = io.from_numpy(data_t, p.xi) if data_t is not None else None
    return Quantized(io.from_numpy(data, p.xi), amax_out, data_t, dbias, io.from_numpy(scale_inv, p.xi))


# ---- device path -----------------------------------------------------------------------------
def _device_run(p: _Plan, approximate: str) -> Quantized:
    xi = io.device_view(p.xi)
    bi = io.device_view(p.bi) if p.bi is not None else None
    q = io.empty(p.xi, p.q_shape, p.fmt.dtype_name)
    q_t = io.empty(p.xi, (p.pcols, p.prows), p.fmt.dtype_name) if p.transpose else None
    amax = io.device_view(p.amax) if p.amax is not None else None
    amax_arr = amax.array if amax is not None else io.zeros(p.xi, (1,), "float32")
    scale_inv = io.empty(p.xi, (1,), "float32")
    dbias = partial = counters = None
    if p.dbias:
        part_shape, n_counters = launch.dbias_workspace(p.rows, p.cols, p.pad_to)
        dbias = io.empty(p.xi, (p.cols,), "float32")  # the plan zeroes it when there is nothing to sum
        partial = io.empty(p.xi, part_shape, "float32")
        counters = io.empty(p.xi, (n_counters,), "int32")  # and zeroes the counters before the kernel
    first = p.slot is not None and p.slot.current_first
    ptr = io.data_ptr
    buffers = {"x": xi.ptr, "q": ptr(q), "scale": io.device_view(p.scale).ptr, "amax": ptr(amax_arr),
               "scale_inv_used": ptr(scale_inv), **_first_step_buffers(p, first)}
    if bi is not None:
        buffers["b"] = bi.ptr
    if q_t is not None:
        buffers["q_t"] = ptr(q_t)
    if p.dbias:
        buffers.update(dbias=ptr(dbias), partial=ptr(partial), counters=ptr(counters))
    launch.quantize(xi.device, io.stream_ptr(p.xi), buffers, dtype=xi.dtype, fmt=p.fmt.name,
                    op=kernel_op(p.op, approximate), rows=p.rows, cols=p.cols, first=first,
                    margin_factor=p.slot.margin_factor if p.slot is not None else 1.0, pad_to=p.pad_to)
    c = p.xi
    return Quantized(io.fp8_out(q, p.fmt, c), io.out_for_caller(amax_arr, c) if amax is None else p.amax.array,
                     io.fp8_out(q_t, p.fmt, c) if q_t is not None else None,
                     io.out_for_caller(dbias, c) if dbias is not None else None, io.out_for_caller(scale_inv, c))


def _first_step_buffers(p: _Plan, first: bool) -> dict:
    """The state's entries a first step writes (scale_out, scale_inv_out) and its flag (updates)."""
    return {"updates": p.updates.ptr, "scale_out": p.scale.ptr, "scale_inv_out": p.scale_inv.ptr} if first else {}


def _run(p: _Plan, approximate: str = "tanh") -> Quantized:
    out = _device_run(p, approximate) if p.xi.is_gpu else _host_run(p, approximate)
    io.mark_written(p.written().values())
    return out


def _host_layernorm(p: _Plan) -> LayerNormQuantized:
    y, mean, rstd = ln.layernorm_f32(io.to_numpy(p.xi), io.to_numpy(p.wi) if p.wi is not None else None,
                                     io.to_numpy(p.biasi) if p.biasi is not None else None, np.float32(p.eps))
    return LayerNormQuantized(_host_quantize(p, y), io.from_numpy(mean, p.xi), io.from_numpy(rstd, p.xi))


def _device_layernorm(p: _Plan) -> LayerNormQuantized:
    xi = io.device_view(p.xi)
    wi = io.device_view(p.wi) if p.wi is not None else None
    bi = io.device_view(p.biasi) if p.biasi is not None else None
    q = io.empty(p.xi, p.q_shape, p.fmt.dtype_name)
    q_t = io.empty(p.xi, (p.pcols, p.prows), p.fmt.dtype_name) if p.transpose else None
    mean = io.empty(p.xi, (p.rows,), "float32")
    rstd = io.empty(p.xi, (p.rows,), "float32")
    amax = io.device_view(p.amax) if p.amax is not None else None
    amax_arr = amax.array if amax is not None else io.zeros(p.xi, (1,), "float32")
    scale_inv = io.empty(p.xi, (1,), "float32")
    first = p.slot is not None and p.slot.current_first
    ptr = io.data_ptr
    buffers = {"x": xi.ptr, "q": ptr(q), "mean": ptr(mean), "rstd": ptr(rstd), "scale": io.device_view(p.scale).ptr,
               "amax": ptr(amax_arr), "scale_inv_used": ptr(scale_inv), **_first_step_buffers(p, first)}
    for name, view in (("weight", wi), ("bias", bi)):
        if view is not None:
            buffers[name] = view.ptr
    if q_t is not None:
        buffers["q_t"] = ptr(q_t)
    launch.layernorm_quantize(xi.device, io.stream_ptr(p.xi), buffers, dtype=xi.dtype, param=p.param_dtype,
                              fmt=p.fmt.name, rows=p.rows, cols=p.cols, eps=p.eps, first=first,
                              margin_factor=p.slot.margin_factor if p.slot is not None else 1.0, pad_to=p.pad_to)
    c = p.xi
    quantized = Quantized(io.fp8_out(q, p.fmt, c), io.out_for_caller(amax_arr, c) if amax is None else p.amax.array,
                          io.fp8_out(q_t, p.fmt, c) if q_t is not None else None, None,
                          io.out_for_caller(scale_inv, c))
    return LayerNormQuantized(quantized, io.out_for_caller(mean, c), io.out_for_caller(rstd, c))

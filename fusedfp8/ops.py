"""The framework-agnostic functions: quantize, gelu_quantize, dgelu_quantize, layernorm_quantize,
dequantize, update_scales.

Every function accepts torch tensors, jax arrays, cupy arrays and numpy arrays. Device arrays
run the fused CUDA kernels on the caller's current stream (through the launch interface,
:mod:`fusedfp8.launch`); host arrays run the NumPy reference (:mod:`fusedfp8.numerics.reference`), which is
bit-identical. Results come back in the caller's framework: FP8 data as ``torch.float8_*``
tensors, ``jnp.float8_*`` arrays, ml_dtypes arrays (numpy), or uint8 arrays (cupy, which has no
float8 dtype).

All arguments are checked before anything is launched or written: a rejected call changes no
state.

Scales. ``scale`` is a Python float, a 1-element float32 array on the input's device (stateless
use), or a :class:`fusedfp8.state.Slot` from ``ScalingState.slot(i, recipe)`` (delayed or current
scaling): then the format comes from the recipe, the amax is max-accumulated into the state's
staging row, and a tensor's first step uses current scaling when the recipe says so (decided on
the device from the state's ``updates``, never by the host). Under ``CurrentScaling`` every step
is a first step (its ``updates`` stay 0).

Inputs must be contiguous (row-major); a non-contiguous view is refused rather than silently
copied (call ``.contiguous()`` / ``np.ascontiguousarray`` first).
"""
from __future__ import annotations

import math
import threading

import numpy as np

from . import _interop as io
from . import launch
from .formats import Format, get_format
from .numerics import layernorm as ln
from .numerics import reference as ref
from .recipe import CurrentScaling, DelayedScaling
from .state import STATE_FIELDS, ScalingState, Slot, apply_update
from .types import (FLOAT_INPUTS, FP8_DTYPES, LayerNormQuantized, Quantized, check_approximate, check_pad_to,
                    check_recipe, kernel_op)

__all__ = ["quantize", "gelu_quantize", "dgelu_quantize", "layernorm_quantize", "dequantize", "update_scales"]

_host_lock = threading.Lock()  # host-path read-modify-writes of amax / scale slots are atomic


# ---- argument checks -------------------------------------------------------------------------
def _check_input(x, argname: str, need_dims: bool, what: str = "transpose=True") -> io.ArrayInfo:
    info = io.describe(x, argname)
    if info.dtype not in FLOAT_INPUTS:
        raise TypeError(f"{argname} must be float32, float16 or bfloat16; got {info.dtype}")
    if not info.contiguous:
        raise ValueError(f"{argname} must be contiguous (row-major); got a non-contiguous view of shape "
                         f"{info.shape}: call .contiguous() / np.ascontiguousarray first")
    if need_dims and len(info.shape) < 1:
        verb = "needs" if what == "transpose=True" else "need"
        raise ValueError(f"{argname}: {what} {verb} an input of at least 1 dimension; got a scalar")
    return info


def _check_beside(info: io.ArrayInfo, argname: str, x: io.ArrayInfo) -> None:
    """``argname`` is an array of x's framework on x's device."""
    if info.framework != x.framework:
        raise TypeError(f"{argname} is a {info.framework} array but the input is a {x.framework} array")
    if info.device != x.device:
        raise ValueError(f"{argname} is on {info.where()} but the input is on {x.where()}; "
                         "they must be on the same device")


def _check_scalar(a, argname: str, dtype: str, x: io.ArrayInfo, writable: bool) -> io.ArrayInfo:
    info = io.describe(a, argname)
    if info.dtype != dtype:
        raise TypeError(f"{argname} must be a {dtype} array; got {info.dtype}")
    if info.size != 1:
        raise ValueError(f"{argname} must hold exactly one element; got shape {info.shape}")
    _check_beside(info, argname, x)
    if writable and not info.writable:
        if not info.mutable:
            raise TypeError(f"{argname}: jax arrays are immutable and cannot be accumulated into; leave "
                            f"{argname}=None and take the returned amax, or use fusedfp8.jax")
        raise ValueError(f"{argname} is {info.why_not_writable}; it is written in place")
    return info


def _scale_arg(scale, x: io.ArrayInfo) -> io.ArrayInfo:
    """A Python number becomes a 1-element float32 array on x's device (a stateless convenience:
    in a CUDA graph or a hot loop pass an array)."""
    if isinstance(scale, (int, float, np.floating, np.integer)) and not isinstance(scale, (bool, np.bool_)):
        scale = io.from_numpy(np.array([scale], np.float32), x) if not x.is_gpu else io.upload(
            np.array([scale], np.float32), x)
    elif not hasattr(scale, "shape"):
        raise TypeError(f"scale: expected a Python float, a 1-element float32 array on the input's device, or a "
                        f"Slot (ScalingState.slot(i, recipe)); got {type(scale).__module__}.{type(scale).__name__}")
    return _check_scalar(scale, "scale", "float32", x, writable=False)


def _refuse_overlaps(written: dict, read: dict) -> None:
    """Every written array must share no byte with any input or with another written array."""
    names = list(written)
    for i, w in enumerate(names):
        for r, ri in read.items():
            if io.overlaps(written[w], ri):
                what = "the input" if r == "x" else r
                raise ValueError(f"{w} overlaps {what}'s memory; it is written in place, so it must not alias {what}")
        for other in names[i + 1:]:
            if io.overlaps(written[w], written[other]):
                raise ValueError(f"{w} and {other} share memory; both are written, so they must be separate arrays")


class _Plan:
    """Everything a launch needs, all checked."""

    def __init__(self, x, b, scale, fmt, amax, op, transpose, dbias, argname="x", pad_to=1):
        check_pad_to(pad_to)
        need = transpose or dbias
        what = "transpose=True" if transpose and not dbias else "transpose / dbias"
        self.xi = _check_input(x, argname, need, what)
        self.bi = None
        if b is not None:
            self.bi = _check_input(b, "x", need, what)
            if self.bi.shape != self.xi.shape:
                raise ValueError(f"dy and x must have the same shape; got {self.xi.shape} and {self.bi.shape}")
            if self.bi.dtype != self.xi.dtype:
                raise TypeError(f"dy and x must have the same dtype; got {self.xi.dtype} and {self.bi.dtype}")
            if (self.bi.framework, self.bi.device) != (self.xi.framework, self.xi.device):
                raise ValueError(f"dy is on {self.xi.where()} ({self.xi.framework}) but x is on {self.bi.where()} "
                                 f"({self.bi.framework}); they must be on the same device")
        inputs = {"x": self.xi} if b is None else {"dy": self.xi, "x": self.bi}
        self.slot = scale if isinstance(scale, Slot) else None
        if self.slot is not None:
            if fmt is not None and get_format(fmt) != self.slot.fmt:
                raise ValueError(f"fmt: {get_format(fmt).name!r} disagrees with the slot's recipe format "
                                 f"{self.slot.fmt.name!r}; leave fmt=None with a slot")
            if amax is not None:
                raise ValueError("amax: a slot accumulates into its state; pass amax=None with a slot")
            self.fmt = self.slot.fmt
            self.scale = _check_scalar(self.slot.scale, "state.scale", "float32", self.xi, writable=True)
            self.amax = _check_scalar(self.slot.amax, "state.amax_history", "float32", self.xi, writable=True)
            self.scale_inv = _check_scalar(self.slot.scale_inv, "state.scale_inv", "float32", self.xi, writable=True)
            self.updates = _check_scalar(self.slot.updates, "state.updates", "int32", self.xi, writable=False)
            _refuse_overlaps({"state.amax_history": self.amax, "state.scale": self.scale,
                              "state.scale_inv": self.scale_inv}, {**inputs, "state.updates": self.updates})
        else:
            self.fmt = get_format("e4m3" if fmt is None else fmt)
            self.scale = _scale_arg(scale, self.xi)
            self.amax = None if amax is None else _check_scalar(amax, "amax", "float32", self.xi, writable=True)
            self.scale_inv = self.updates = None
            if self.amax is not None:
                _refuse_overlaps({"amax": self.amax}, {**inputs, "scale": self.scale})
        self.op, self.transpose, self.dbias = op, transpose, dbias
        shape = self.xi.shape
        self.rows = math.prod(shape[:-1])
        self.cols = int(shape[-1]) if shape else 1
        self.pad_to = int(pad_to)
        self.prows, self.pcols = launch.padded(self.rows, self.cols, self.pad_to)
        # the shape of q: x's own, or its (rows, cols) view rounded up to multiples of pad_to
        self.q_shape = shape if pad_to == 1 else (self.prows, self.pcols)

    def written(self) -> dict:
        """The arrays this call writes in place, by argument name."""
        if self.slot is not None:
            return {"state.amax_history": self.amax, "state.scale": self.scale, "state.scale_inv": self.scale_inv}
        return {"amax": self.amax} if self.amax is not None else {}


def _check_eps(eps) -> float:
    """``eps`` as the float32 the kernels add (returned as a Python float)."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps must be a real number (a Python or NumPy float); got {type(eps).__module__}."
                        f"{type(eps).__name__}")
    with np.errstate(over="ignore"):
        e32 = np.float32(eps)
    if not (math.isfinite(float(eps)) and float(eps) >= 0 and np.isfinite(e32)):
        raise ValueError(f"eps must be a finite number >= 0 (and finite as float32); got {eps!r}")
    return float(e32)


def _check_param(a, argname: str, x: io.ArrayInfo, cols: int) -> io.ArrayInfo | None:
    """weight / bias of layernorm_quantize: None, or a (cols,) float array beside x."""
    if a is None:
        return None
    info = io.describe(a, argname)
    if info.dtype not in FLOAT_INPUTS:
        raise TypeError(f"{argname} must be float32, float16 or bfloat16; got {info.dtype}")
    _check_beside(info, argname, x)
    if tuple(info.shape) != (cols,):
        raise ValueError(f"{argname} must have shape ({cols},) (the last dimension of x); got {tuple(info.shape)}")
    if not info.contiguous:
        raise ValueError(f"{argname} must be contiguous; got a non-contiguous view of shape {tuple(info.shape)}")
    return info


class _LayerNormPlan(_Plan):
    """A checked layernorm_quantize call: the checks of a quantization of x, then weight, bias and
    eps, and no written array (amax, the state) sharing memory with weight or bias."""

    def __init__(self, x, weight, bias, eps, scale, fmt, amax, transpose, pad_to=1):
        super().__init__(x, None, scale, fmt, amax, "layernorm", transpose, False, pad_to=pad_to)
        if not self.xi.shape:
            raise ValueError("x: layernorm_quantize needs an input of at least 1 dimension; got a scalar")
        if self.cols == 0:
            raise ValueError(f"x: layernorm_quantize normalises over the last dimension, which must not be empty; "
                             f"got shape {tuple(self.xi.shape)}")
        self.eps = _check_eps(eps)
        self.wi = _check_param(weight, "weight", self.xi, self.cols)
        self.biasi = _check_param(bias, "bias", self.xi, self.cols)
        if self.wi is not None and self.biasi is not None and self.wi.dtype != self.biasi.dtype:
            raise TypeError(f"weight and bias must have the same dtype; got {self.wi.dtype} and {self.biasi.dtype}")
        self.param_dtype = next((i.dtype for i in (self.wi, self.biasi) if i is not None), "float32")
        params = {name: i for name, i in (("weight", self.wi), ("bias", self.biasi)) if i is not None}
        _refuse_overlaps(self.written(), params)


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


def _host_layernorm(p: _LayerNormPlan) -> LayerNormQuantized:
    y, mean, rstd = ln.layernorm_f32(io.to_numpy(p.xi), io.to_numpy(p.wi) if p.wi is not None else None,
                                     io.to_numpy(p.biasi) if p.biasi is not None else None, np.float32(p.eps))
    return LayerNormQuantized(_host_quantize(p, y), io.from_numpy(mean, p.xi), io.from_numpy(rstd, p.xi))


def _device_layernorm(p: _LayerNormPlan) -> LayerNormQuantized:
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


# ---- public API ------------------------------------------------------------------------------
def quantize(x, scale, fmt: str | Format | None = None, *, amax=None, transpose: bool = False,
             dbias: bool = False, pad_to: int = 1) -> Quantized:
    """Quantize ``x`` to FP8 and compute its amax in one pass.

    Parameters
    ----------
    x : array, float32 / float16 / bfloat16, any shape, contiguous
    scale : a Python float, a 1-element float32 array on x's device, or a
        :class:`~fusedfp8.state.Slot` (``state.slot(i, recipe)``). ``q = fp8(float32(x) * scale)``.
    fmt : 'e4m3' (default) or 'e5m2', in any spelling :func:`fusedfp8.formats.get_format` takes
        ('float8_e4m3fn', 'e4m3fn', ``torch.float8_e4m3fn``, ``jnp.float8_e5m2``, ...); taken from
        the recipe when ``scale`` is a Slot.
    amax : 1-element float32 array, optional
        Max-accumulated in place (NaN-propagating); a new one is returned when omitted.
    transpose : bool
        Also return the quantized transpose of x viewed as (prod(shape[:-1]), shape[-1]).
    dbias : bool
        Also return that view's (N,) float32 column sums (a gradient's bias gradient), from the
        same read.
    pad_to : int
        1 (default): ``data`` has x's shape. Else ``data`` is x's (M, N) view with M and N
        rounded up to multiples of ``pad_to``, and ``data_t`` the (N', M') transpose, zeros in
        the pad (written by the same kernel): operands for FP8 GEMMs, which need every dimension
        a multiple of 16. The pad takes no part in the amax.

    Returns
    -------
    Quantized
        ``data`` (shape of x, FP8), ``amax`` (1-element float32), ``data_t`` ((N, M) or None),
        ``dbias`` ((N,) float32 or None), ``scale_inv`` ((1,) float32 in a buffer of its own: 1 /
        the scale used, the GEMM operand scale).

    Raises
    ------
    TypeError, ValueError
        On a bad dtype, device, shape, format, an output aliasing an input, or a non-contiguous
        input; nothing is written.
    """
    return _run(_Plan(x, None, scale, fmt, amax, "identity", transpose, dbias, pad_to=pad_to))


def gelu_quantize(x, scale, fmt: str | Format | None = None, *, approximate: str = "tanh", amax=None,
                  transpose: bool = False, pad_to: int = 1) -> Quantized:
    """``y = gelu(x)`` (float32; ``approximate`` 'tanh' or 'none' as in torch / jax.nn.gelu),
    quantized as :func:`quantize` does; ``amax = max |y|``. Same arguments and errors."""
    approximate = check_approximate(approximate)
    return _run(_Plan(x, None, scale, fmt, amax, "gelu", transpose, False, pad_to=pad_to), approximate)


def dgelu_quantize(dy, x, scale, fmt: str | Format | None = None, *, approximate: str = "tanh", amax=None,
                   transpose: bool = False, dbias: bool = False, pad_to: int = 1) -> Quantized:
    """The gelu backward: ``dx = dy * gelu'(x)`` in float32, quantized (E5M2 is the usual format
    for gradients); ``amax = max |dx|``; with ``dbias=True`` also the (N,) float32 column sums of
    the unquantized dx over its (M, N) view (deterministic; equal to the reference within float32
    summation order). ``dy`` and ``x``: same shape, dtype and device."""
    approximate = check_approximate(approximate)
    return _run(_Plan(dy, x, scale, fmt, amax, "dgelu", transpose, dbias, argname="dy", pad_to=pad_to), approximate)


def layernorm_quantize(x, weight, bias, eps: float, scale, fmt: str | Format | None = None, *, amax=None,
                       transpose: bool = False, pad_to: int = 1) -> LayerNormQuantized:
    """LayerNorm over the last dimension of ``x``, quantized to FP8 in the same pass.

    In float32, per row of x viewed as (rows, cols): ``mean``, the variance of the centred values,
    ``rstd = 1 / sqrt(var + eps)`` (correctly rounded), ``y = (x - mean) * rstd * weight + bias``
    (the op order of :mod:`fusedfp8.numerics.layernorm`, which the kernel follows bit for bit);
    ``y`` is quantized as :func:`quantize` quantizes x, and ``amax = max |y|``. The normalised
    output is never written in 16 or 32 bits.

    Parameters
    ----------
    x : array, float32 / float16 / bfloat16, at least 1-D (last dimension >= 1), contiguous
    weight, bias : (cols,) arrays of one float dtype on x's device, or None (1 and 0)
    eps : number >= 0, added to the variance (as float32)
    scale, fmt, amax, transpose : as :func:`quantize` (a Slot stages amax(y) in its state; the
        first step quantizes with the scale of y's own amax when the recipe says so)
    pad_to : int
        As :func:`quantize`: 1 (default), ``data`` has x's shape; else ``data`` is y's (rows, cols)
        view rounded up to multiples of ``pad_to`` and ``data_t`` its transpose, zeros in the pad
        (written by the same kernel); the pad takes no part in the amax; ``mean`` / ``rstd`` stay
        (rows,).

    Returns
    -------
    LayerNormQuantized
        ``quantized`` (a :class:`Quantized`: data, amax, data_t, scale_inv) and ``mean`` / ``rstd``,
        (rows,) float32 for the backward (``xhat = (x - mean) * rstd``); a NaN among them is the
        canonical NaN.

    Raises
    ------
    TypeError, ValueError
        As :func:`quantize`, and on a weight / bias of the wrong shape, dtype or device, weight and
        bias of different dtypes, a written array sharing memory with them, or a bad eps; nothing
        is written.
    """
    p = _LayerNormPlan(x, weight, bias, eps, scale, fmt, amax, transpose, pad_to)
    out = _device_layernorm(p) if p.xi.is_gpu else _host_layernorm(p)
    io.mark_written(p.written().values())
    return out


def dequantize(q, scale_inv, dtype: str = "float32", fmt: str | Format | None = None):
    """``dtype(float32(q) * scale_inv)``.

    Parameters
    ----------
    q : FP8 array (torch / jax float8, ml_dtypes float8), or uint8 (cupy) with ``fmt`` given.
    scale_inv : 1-element float32 array on q's device.
    dtype : 'float32', 'float16' or 'bfloat16'.
    fmt : 'e4m3' or 'e5m2' (any spelling, as :func:`quantize`); required for uint8 data, checked
        against q's dtype otherwise.
    """
    qi, si, f = check_dequantize(q, scale_inv, dtype, fmt)
    if not qi.is_gpu:
        import ml_dtypes

        qn = io.to_numpy(qi)
        if qn.dtype == np.uint8:
            qn = qn.view(f.numpy_dtype)
        out_dtype = getattr(ml_dtypes, "bfloat16") if dtype == "bfloat16" else np.dtype(dtype)
        return io.from_numpy(ref.dequantize(qn, io.to_numpy(si), out_dtype), qi)
    qd, sd = io.device_view(qi), io.device_view(si)
    out = io.empty(qi, qi.shape, dtype)
    launch.dequantize(qi.device, io.stream_ptr(qi), {"q": qd.ptr, "out": io.data_ptr(out), "scale_inv": sd.ptr},
                      dtype=dtype, fmt=f.name, n=qi.size)
    return io.out_for_caller(out, qi)


def check_dequantize(q, scale_inv, dtype: str, fmt) -> tuple[io.ArrayInfo, io.ArrayInfo, Format]:
    """The argument check of :func:`dequantize`: (q, scale_inv, q's format)."""
    qi = io.describe(q, "q")
    if qi.dtype in FP8_DTYPES:
        f = get_format(qi.dtype)
        if fmt is not None and get_format(fmt) != f:
            raise ValueError(f"fmt: {get_format(fmt).name!r} disagrees with q's dtype {qi.dtype}")
    elif qi.dtype == "uint8":
        if fmt is None:
            raise ValueError("q is uint8: pass fmt='e4m3' or 'e5m2'")
        f = get_format(fmt)
    else:
        raise TypeError(f"q must be a float8_e4m3fn / float8_e5m2 array (or uint8 with a format); got {qi.dtype}")
    if dtype not in FLOAT_INPUTS:
        raise ValueError(f"dtype must be one of {FLOAT_INPUTS}; got {dtype!r}")
    if not qi.contiguous:
        raise ValueError(f"q must be contiguous; got a non-contiguous view of shape {qi.shape}")
    return qi, _check_scalar(scale_inv, "scale_inv", "float32", qi, writable=False), f


def _check_state_arrays(state: ScalingState) -> list[io.ArrayInfo]:
    """Every check of an update before its first write: contiguity, one device, writability,
    no two state arrays sharing memory."""
    infos = [io.describe(getattr(state, f), f"state.{f}") for f in STATE_FIELDS]
    devices = {i.device for i in infos}
    if len(devices) != 1:
        raise ValueError(f"state arrays are on several devices ({sorted(devices)}); they must share one")
    for f, i in zip(STATE_FIELDS, infos):
        if not i.contiguous:
            raise ValueError(f"state.{f} must be contiguous; got a non-contiguous view of shape {i.shape}")
        if i.mutable and not i.writable:
            raise ValueError(f"ScalingState.{f} is {i.why_not_writable}; the update writes the state in place")
    _refuse_overlaps({f"state.{f}": i for f, i in zip(STATE_FIELDS, infos)}, {})
    return infos


_fmt_max_cache: dict = {}


def _fmt_max_device(state: ScalingState, recipe: DelayedScaling, like: io.ArrayInfo):
    """(n,) float32 device array of each tensor's format max (a constant, uploaded once per
    (formats, device, framework) with the caller's allocator)."""
    key = (state.grad, recipe.fp8_format, like.device, like.framework)
    found = _fmt_max_cache.get(key)
    if found is None:
        found = _fmt_max_cache[key] = io.upload(state.fmt_max(recipe), like)
    return found


def update_scales(state: ScalingState, recipe: DelayedScaling | CurrentScaling) -> ScalingState:
    """Turn this step's staged amaxes into the next step's scales, for every tensor at once.

    The rule is :func:`fusedfp8.numerics.scaling.update_rule`. On a GPU it is one kernel launch
    (numpy, torch CPU and jax on the CPU run the rule through their own array namespace). Under
    :class:`~fusedfp8.CurrentScaling` it closes the step instead
    (:func:`fusedfp8.numerics.scaling.close_step`: overflows counted, the last amax kept, the
    staging row cleared, no scale changed), through the arrays' own namespace on every device.
    numpy / torch / cupy states are updated in place and returned (and their ``on_update`` is called);
    jax states are immutable and a new state is returned. Always use the return value.
    """
    if not isinstance(state, ScalingState):
        raise TypeError(f"state must be a fusedfp8.ScalingState; got {type(state).__name__}")
    check_recipe(recipe)
    state.validate(recipe)
    infos = _check_state_arrays(state)
    hi = infos[0]
    if not hi.is_gpu or recipe.current:  # current scaling closes the step with a few elementwise ops
        new = apply_update(state, recipe)
        if new is state and state.on_update is not None:
            state.on_update()
        return new
    views = [io.device_view(i) for i in infos]
    immutable = not io.is_mutable(state.amax_history)
    if immutable:  # jax buffers: update copies, return a new state
        views = [io.describe(io.copy(v.array), "state") for v in views]
    fmt_max = _fmt_max_device(state, recipe, hi)
    buffers = {**{f: v.ptr for f, v in zip(STATE_FIELDS, views)}, "fmt_max": io.data_ptr(fmt_max)}
    launch.update_scales(hi.device, io.stream_ptr(hi), buffers, n=state.num_tensors, L=state.history_len,
                         margin_factor=recipe.margin_factor, algo_max=recipe.amax_compute_algo == "max")
    if immutable:
        return state.replace(**{f: io.out_for_caller(v.array, hi) for f, v in zip(STATE_FIELDS, views)})
    io.mark_written(infos)
    if state.on_update is not None:
        state.on_update()
    return state

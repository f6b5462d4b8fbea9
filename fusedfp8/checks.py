"""The argument contract of the framework-agnostic functions (:mod:`fusedfp8.ops`): a quantizing
call checked whole (:class:`_Plan`: input dtype and contiguity, the scale or the state's slot on
the input's device, the arrays written in place sharing no memory with what is read), the
dequantize arguments, the state arrays an update writes, and layernorm_quantize's weight, bias and
eps (:class:`_LayerNormPlan`). Every check runs before anything is launched or written, so a
rejected call changes no state.
"""
from __future__ import annotations

import math

import numpy as np

from . import _interop as io
from . import launch
from .formats import Format, get_format
from .state import STATE_FIELDS, ScalingState, Slot
from .types import FLOAT_INPUTS, FP8_DTYPES, check_pad_to

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


# ---- layernorm_quantize's checks: weight, bias and eps over those of a quantization -------------
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


def check_layernorm_args(weight, bias, eps, x: io.ArrayInfo, cols: int):
    """(weight info, bias info, the parameters' dtype, eps as float32) of a fused LayerNorm over ``cols``
    columns of ``x`` (layernorm_quantize, block_layernorm_quantize): each parameter None or a (cols,)
    float array beside x, both of one dtype ('float32' where neither is given)."""
    eps = _check_eps(eps)
    wi, bi = _check_param(weight, "weight", x, cols), _check_param(bias, "bias", x, cols)
    if wi is not None and bi is not None and wi.dtype != bi.dtype:
        raise TypeError(f"weight and bias must have the same dtype; got {wi.dtype} and {bi.dtype}")
    return wi, bi, next((i.dtype for i in (wi, bi) if i is not None), "float32"), eps


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
        self.wi, self.biasi, self.param_dtype, self.eps = check_layernorm_args(weight, bias, eps, self.xi, self.cols)
        params = {name: i for name, i in (("weight", self.wi), ("bias", self.biasi)) if i is not None}
        _refuse_overlaps(self.written(), params)

"""Framework-agnostic entry points.

Every function accepts torch tensors, jax arrays, cupy arrays and numpy arrays. Device arrays
run the fused CUDA kernels on the caller's current stream; host arrays run the NumPy reference
(:mod:`fusedfp8.reference`), which is bit-identical. Results come back in the caller's framework:
FP8 data as ``torch.float8_*`` tensors, ``jnp.float8_*`` arrays, ml_dtypes arrays (numpy), or
uint8 arrays (cupy, which has no float8 dtype).

All arguments are checked before anything is launched or written: a rejected call changes no
state.

Scales. ``scale`` is either a 1-element float32 array on the input's device (stateless use) or a
:class:`fusedfp8.state.Slot` from ``ScalingState.slot(i, recipe)`` / :func:`fusedfp8.state.slot`
(delayed scaling): then the format comes from the recipe, the amax is max-accumulated into the
state's staging row, and a tensor's first step uses current scaling when the recipe says so.

Inputs must be contiguous (row-major); a non-contiguous view is refused rather than silently
copied (call ``.contiguous()`` / ``np.ascontiguousarray`` first).
"""
from __future__ import annotations

import math

import numpy as np

from . import _cuda
from . import _interop as io
from . import reference as ref
from .formats import Format, get_format
from .recipe import DelayedScaling
from .reference import Quantized
from .state import STATE_FIELDS, ScalingState, Slot, apply_update, slot

__all__ = ["quantize", "gelu_quantize", "dgelu_quantize", "dequantize", "update_scales", "slot", "Quantized"]

_APPROX = {"tanh": "tanh", "none": "erf"}


# ---- argument checks -------------------------------------------------------------------------
def _check_input(x, argname: str, transpose: bool) -> io.ArrayInfo:
    info = io.describe(x, argname)
    if info.dtype not in io.FLOAT_INPUTS:
        raise TypeError(f"{argname} must be float32, float16 or bfloat16; got {info.dtype}")
    if not info.contiguous:
        raise ValueError(f"{argname} must be contiguous (row-major); got a non-contiguous view of shape "
                         f"{info.shape}: call .contiguous() / np.ascontiguousarray first")
    if transpose and len(info.shape) < 1:
        raise ValueError(f"{argname}: transpose=True needs an input of at least 1 dimension; got a scalar")
    return info


def _check_scalar(a, argname: str, dtype: str, x: io.ArrayInfo, writable: bool) -> io.ArrayInfo:
    info = io.describe(a, argname)
    if info.dtype != dtype:
        raise TypeError(f"{argname} must be a {dtype} array; got {info.dtype}")
    if info.size != 1:
        raise ValueError(f"{argname} must hold exactly one element; got shape {info.shape}")
    if info.framework != x.framework:
        raise TypeError(f"{argname} is a {info.framework} array but the input is a {x.framework} array")
    if info.device != x.device:
        raise ValueError(f"{argname} is on {info.where()} but the input is on {x.where()}; "
                         "they must be on the same device")
    if writable:
        if info.framework == "jax":
            raise TypeError(f"{argname}: jax arrays are immutable and cannot be accumulated into; leave "
                            f"{argname}=None and take the returned amax, or use fusedfp8.jax")
        if info.framework == "numpy" and not info.array.flags.writeable:
            raise ValueError(f"{argname} is a read-only numpy array; it is written in place")
        if io.overlaps(info, x):
            raise ValueError(f"{argname} overlaps the input's memory; it is written in place, so it must not "
                             "alias the input")
    return info


class _Plan:
    """Everything a launch needs, all checked."""

    def __init__(self, x, b, scale, fmt, amax, op, transpose, dbias, argname="x"):
        self.xi = _check_input(x, argname, transpose)
        self.bi = None
        if b is not None:
            self.bi = _check_input(b, "x", transpose)
            if self.bi.shape != self.xi.shape:
                raise ValueError(f"dy and x must have the same shape; got {self.xi.shape} and {self.bi.shape}")
            if self.bi.dtype != self.xi.dtype:
                raise TypeError(f"dy and x must have the same dtype; got {self.xi.dtype} and {self.bi.dtype}")
            if (self.bi.framework, self.bi.device) != (self.xi.framework, self.xi.device):
                raise ValueError(f"dy is on {self.xi.where()} ({self.xi.framework}) but x is on {self.bi.where()} "
                                 f"({self.bi.framework}); they must be on the same device")
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
        else:
            self.fmt = get_format("e4m3" if fmt is None else fmt)
            self.scale = _check_scalar(scale, "scale", "float32", self.xi, writable=False)
            self.amax = None if amax is None else _check_scalar(amax, "amax", "float32", self.xi, writable=True)
            if self.amax is not None and io.overlaps(self.amax, self.scale):
                raise ValueError("amax overlaps scale's memory; amax is written in place while scale is read")
            self.scale_inv = self.updates = None
        self.op, self.transpose, self.dbias = op, transpose, dbias
        shape = self.xi.shape
        self.rows = math.prod(shape[:-1])
        self.cols = int(shape[-1]) if shape else 1
        if (transpose or dbias) and not shape:
            raise ValueError(f"{argname}: transpose / dbias need an input of at least 1 dimension; got a scalar")


# ---- host path (reference) -------------------------------------------------------------------
def _nan_max(a: np.float32, b: np.float32) -> np.float32:
    return np.float32(np.nan) if (np.isnan(a) or np.isnan(b)) else max(np.float32(a), np.float32(b))


def _host_run(p: _Plan, approximate: str) -> Quantized:
    x = io.to_numpy(p.xi)
    b = io.to_numpy(p.bi) if p.bi is not None else None
    if p.op == "identity":
        y = ref._float32(x)
    elif p.op == "gelu":
        y = ref.gelu_f32(ref._float32(x), approximate)
    else:
        with np.errstate(all="ignore"):
            y = (ref._float32(x) * ref.dgelu_f32(ref._float32(b), approximate)).astype(np.float32)
    amax_y = ref.amax(y)
    if p.slot is not None:
        sv, av = io.to_numpy(p.scale), io.to_numpy(p.amax)
        fresh = p.slot.current_first and int(io.to_numpy(p.updates)[0]) == 0
        acc = _nan_max(av[0], amax_y)
        if fresh:
            s = ref.current_scale(acc, p.fmt, p.slot.margin_factor, sv[0])
            sv[0] = s
            io.to_numpy(p.scale_inv)[0] = np.float32(1.0) / s
        else:
            s = sv[0]
        av[0] = acc
        amax_out = p.amax.array
    else:
        s = io.to_numpy(p.scale).reshape(())
        if p.amax is not None:
            av = io.to_numpy(p.amax)
            av.reshape(-1)[0] = _nan_max(av.reshape(-1)[0], amax_y)
            amax_out = p.amax.array
        else:
            amax_out = io.from_numpy(np.array([amax_y], np.float32), p.xi)
    with np.errstate(all="ignore"):
        res = ref._finish(y, amax_y, np.float32(s), p.fmt, p.transpose)
    dbias = None
    if p.dbias:
        dbias = io.from_numpy(ref.column_sums(y), p.xi)
    data_t = io.from_numpy(res.data_t, p.xi) if res.data_t is not None else None
    scale_inv = io.from_numpy(np.array([np.float32(1.0) / np.float32(s)], np.float32), p.xi)
    return Quantized(io.from_numpy(res.data, p.xi), amax_out, data_t, dbias, scale_inv)


# ---- device path -----------------------------------------------------------------------------
def _aligned(*ptrs: int) -> bool:
    return all(q % 16 == 0 for q in ptrs)


QUANTIZE_OPS = ("identity", "gelu_tanh", "gelu_erf", "dgelu_tanh", "dgelu_erf")


def launch_quantize(device: int, stream: int, *, dtype: str, fmt: Format, op: str, x: int, b: int, q: int,
                    scale: int, amax: int, rows: int, cols: int, q_t: int = 0, dbias: int = 0, partial: int = 0,
                    counters: int = 0, scale_inv_used: int = 0, first: bool = False, updates: int = 0,
                    scale_out: int = 0, scale_inv_out: int = 0, margin_factor: float = 1.0) -> None:
    """Launch the quantize kernels on raw device pointers (the layer under every GPU entry point:
    :func:`quantize` and friends, the torch custom ops, the JAX buffer callbacks).

    Nothing is checked here beyond the names: the caller owns shapes, dtypes and lifetimes.

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle (0 = legacy default stream).
    dtype : 'float32' | 'float16' | 'bfloat16', the input's dtype.
    fmt : the FP8 format of ``q`` / ``q_t``.
    op : one of :data:`QUANTIZE_OPS`; for 'dgelu_*' ``x`` is dy and ``b`` is the forward input.
    x, b, q : input(s) (rows x cols, row-major) and the FP8 output (same shape, bytes).
    scale : (1,) float32, read.  amax : (1,) float32, max-accumulated (NaN-propagating).
    q_t : (cols, rows) FP8 transpose, or 0.  dbias : (cols,) float32 column sums, or 0; needs
        ``partial`` (ceil(rows/128) * cols float32 workspace) and ``counters`` (ceil(cols/64) int32,
        zero before the first launch; the kernel leaves them zero).
    scale_inv_used : (1,) float32 receiving ``1 / scale`` as used (written even when rows*cols
        is 0), or 0.
    first : launch the first-step pre-pass; then ``updates`` (int32 flag, 0 = first step),
        ``scale_out`` and ``scale_inv_out`` (the state's entries, written on a first step) are set.
    margin_factor : 2**margin, for the first-step scale.
    """
    kern = _cuda.kernels(_cuda.ModuleKey("quantize", dtype, fmt.name, op), device)
    n = rows * cols
    if not first:
        updates = scale_out = scale_inv_out = 0
    if n == 0:
        if scale_inv_used:  # nothing to quantize, still hand out 1 / scale (amax max-accumulates 0)
            kern["flat_vec0_store1"](1, _cuda.THREADS, stream, x, b, q, scale, amax, 0, 0, scale_inv_used, 0, 0,
                                     margin_factor)
        return
    vec = _aligned(x, b, q)
    if first:  # first-step pre-pass: amax of the whole tensor, only if *updates == 0
        pre = kern[f"flat_vec{int(vec)}_store0"]
        pre(_cuda.flat_grid(pre, n, device), _cuda.THREADS, stream, x, b, q, scale, amax, 0, 0, 0, updates, n,
            margin_factor)
    if q_t or dbias:
        tiled = kern["tiled"]
        tiled(_cuda.tiled_grid(tiled, rows, cols, device), 256, stream, x, b, q, q_t, dbias, partial, counters,
              scale, amax, scale_out, scale_inv_out, scale_inv_used, updates, rows, cols,
              int(vec and cols % 8 == 0), int(bool(q_t) and q_t % 8 == 0 and rows % 8 == 0), margin_factor)
    else:
        flat = kern[f"flat_vec{int(vec)}_store1"]
        flat(_cuda.flat_grid(flat, n, device), _cuda.THREADS, stream, x, b, q, scale, amax, scale_out,
             scale_inv_out, scale_inv_used, updates, n, margin_factor)


def launch_update_scales(device: int, stream: int, *, amax_history: int, scale: int, scale_inv: int,
                         overflows: int, updates: int, fmt_max: int, n: int, L: int, margin_factor: float,
                         algo_max: bool) -> None:
    """Launch the fused update (:func:`fusedfp8.state.update_rule`) on raw pointers, in place:
    ``amax_history`` (L, n) float32, ``scale``/``scale_inv`` (n,) float32, ``overflows``/``updates``
    (n,) int32, ``fmt_max`` (n,) float32 (each tensor's format max)."""
    kern = _cuda.kernels(_cuda.ModuleKey("update_scales"), device)["update"]
    kern(max(n, 1), _cuda.THREADS, stream, amax_history, scale, scale_inv, overflows, updates, fmt_max, n, L,
         margin_factor, int(algo_max))  # one block per tensor


def _device_run(p: _Plan, approximate: str) -> Quantized:
    xi = io.device_view(p.xi)
    bi = io.device_view(p.bi) if p.bi is not None else None
    op = {"identity": "identity", "gelu": f"gelu_{_APPROX[approximate]}",
          "dgelu": f"dgelu_{_APPROX[approximate]}"}[p.op]
    q = io.empty(p.xi, p.xi.shape, p.fmt.dtype_name)
    q_t = io.empty(p.xi, (p.cols, p.rows), p.fmt.dtype_name) if p.transpose else None
    amax = io.device_view(p.amax) if p.amax is not None else None
    amax_arr = amax.array if amax is not None else io.zeros(p.xi, (1,), "float32")
    scale_inv = io.empty(p.xi, (1,), "float32")
    dbias = partial = counters = None
    if p.dbias:
        dbias = io.empty(p.xi, (p.cols,), "float32") if p.xi.size else io.zeros(p.xi, (p.cols,), "float32")
        partial = io.empty(p.xi, (-(-p.rows // _cuda.TILE_R), p.cols), "float32")
        counters = io.zeros(p.xi, (-(-p.cols // _cuda.TILE_C),), "int32")
    first = p.slot is not None and p.slot.current_first and bool(p.slot.host_fresh[0])
    if p.slot is not None:
        p.slot.host_pending[0] = True
    ptr = io.data_ptr
    launch_quantize(
        xi.device, io.stream_ptr(p.xi), dtype=xi.dtype, fmt=p.fmt, op=op, x=xi.ptr, b=bi.ptr if bi is not None else 0,
        q=ptr(q), scale=io.device_view(p.scale).ptr, amax=ptr(amax_arr), rows=p.rows, cols=p.cols,
        q_t=ptr(q_t) if q_t is not None else 0, dbias=ptr(dbias) if p.dbias and p.xi.size else 0,
        partial=ptr(partial) if p.dbias else 0, counters=ptr(counters) if p.dbias else 0,
        scale_inv_used=ptr(scale_inv), first=first, updates=p.updates.ptr if first else 0,
        scale_out=p.scale.ptr if first else 0, scale_inv_out=p.scale_inv.ptr if first else 0,
        margin_factor=p.slot.margin_factor if p.slot is not None else 1.0)
    c = p.xi
    return Quantized(io.fp8_out(q, p.fmt, c), io.out_for_caller(amax_arr, c) if amax is None else p.amax.array,
                     io.fp8_out(q_t, p.fmt, c) if q_t is not None else None,
                     io.out_for_caller(dbias, c) if dbias is not None else None, io.out_for_caller(scale_inv, c))


def _run(p: _Plan, approximate: str = "tanh") -> Quantized:
    if p.xi.is_gpu:
        return _device_run(p, approximate)
    return _host_run(p, approximate)


# ---- public API ------------------------------------------------------------------------------
def quantize(x, scale, fmt: str | Format | None = None, *, amax=None, transpose: bool = False) -> Quantized:
    """Quantize ``x`` to FP8 and compute its amax in one pass.

    Parameters
    ----------
    x : array, float32 / float16 / bfloat16, any shape, contiguous
    scale : 1-element float32 array on x's device, or a :class:`~fusedfp8.state.Slot`
        ``q = fp8(float32(x) * scale)``.
    fmt : 'e4m3' (default) or 'e5m2'; taken from the recipe when ``scale`` is a Slot.
    amax : 1-element float32 array, optional
        Max-accumulated in place (NaN-propagating); a new one is returned when omitted.
    transpose : bool
        Also return the quantized transpose of x viewed as (prod(shape[:-1]), shape[-1]).

    Returns
    -------
    Quantized
        ``data`` (shape of x, FP8), ``amax`` (1-element float32), ``data_t`` ((N, M) or None),
        ``scale_inv`` ((1,) float32 in a buffer of its own: 1 / the scale used, the GEMM operand scale).

    Raises
    ------
    TypeError, ValueError
        On a bad dtype, device, shape, format or a non-contiguous input; nothing is written.
    """
    return _run(_Plan(x, None, scale, fmt, amax, "identity", transpose, False))


def gelu_quantize(x, scale, fmt: str | Format | None = None, *, approximate: str = "tanh", amax=None,
                  transpose: bool = False) -> Quantized:
    """``y = gelu(x)`` (float32; ``approximate`` 'tanh' or 'none' as in torch / jax.nn.gelu),
    quantized as :func:`quantize` does; ``amax = max |y|``. Same arguments and errors."""
    return _run(_Plan(x, None, scale, fmt, amax, "gelu", transpose, False), ref._check_approximate(approximate))


def dgelu_quantize(dy, x, scale, fmt: str | Format | None = None, *, approximate: str = "tanh", amax=None,
                   transpose: bool = False, dbias: bool = False) -> Quantized:
    """The gelu backward: ``dx = dy * gelu'(x)`` in float32, quantized (E5M2 is the usual format
    for gradients); ``amax = max |dx|``; with ``dbias=True`` also the (N,) float32 column sums of
    the unquantized dx over its (M, N) view (deterministic; equal to the reference within float32
    summation order). ``dy`` and ``x``: same shape, dtype and device."""
    return _run(_Plan(dy, x, scale, fmt, amax, "dgelu", transpose, dbias, argname="dy"),
                ref._check_approximate(approximate))


def dequantize(q, scale_inv, dtype: str = "float32", fmt: str | Format | None = None):
    """``dtype(float32(q) * scale_inv)``.

    Parameters
    ----------
    q : FP8 array (torch / jax float8, ml_dtypes float8), or uint8 (cupy) with ``fmt`` given.
    scale_inv : 1-element float32 array on q's device.
    dtype : 'float32', 'float16' or 'bfloat16'.
    fmt : 'e4m3' or 'e5m2'; required for uint8 data, checked against q's dtype otherwise.
    """
    qi = io.describe(q, "q")
    if qi.dtype in io.FP8_DTYPES:
        f = get_format(qi.dtype)
        if fmt is not None and get_format(fmt) != f:
            raise ValueError(f"fmt: {get_format(fmt).name!r} disagrees with q's dtype {qi.dtype}")
    elif qi.dtype == "uint8":
        if fmt is None:
            raise ValueError("q is uint8: pass fmt='e4m3' or 'e5m2'")
        f = get_format(fmt)
    else:
        raise TypeError(f"q must be a float8_e4m3fn / float8_e5m2 array (or uint8 with a format); got {qi.dtype}")
    if dtype not in io.FLOAT_INPUTS:
        raise ValueError(f"dtype must be one of {io.FLOAT_INPUTS}; got {dtype!r}")
    if not qi.contiguous:
        raise ValueError(f"q must be contiguous; got a non-contiguous view of shape {qi.shape}")
    si = _check_scalar(scale_inv, "scale_inv", "float32", qi, writable=False)
    if not qi.is_gpu:
        import ml_dtypes

        qn = io.to_numpy(qi)
        if qn.dtype == np.uint8:
            qn = qn.view(f.numpy_dtype)
        out_dtype = getattr(ml_dtypes, "bfloat16") if dtype == "bfloat16" else np.dtype(dtype)
        return io.from_numpy(ref.dequantize(qn, io.to_numpy(si), out_dtype), qi)
    qd, sd = io.device_view(qi), io.device_view(si)
    out = io.empty(qi, qi.shape, dtype)
    if qi.size:
        kern = _cuda.kernels(_cuda.ModuleKey("dequantize", dtype, f.name), qi.device)["dequant"]
        out_ptr = io.data_ptr(out)
        kern(_cuda.flat_grid(kern, qi.size, qi.device), _cuda.THREADS, io.stream_ptr(qi), qd.ptr, out_ptr, sd.ptr, qi.size,
             int(_aligned(qd.ptr, out_ptr)))
    return io.out_for_caller(out, qi)


def update_scales(state: ScalingState, recipe: DelayedScaling) -> ScalingState:
    """Turn this step's staged amaxes into the next step's scales, for every tensor at once.

    The rule is :func:`fusedfp8.state.update_rule`. On a GPU it is one kernel launch (numpy,
    torch CPU and jax run the rule through their own array namespace). numpy / torch / cupy
    states are updated in place and returned; jax states are immutable and a new state is
    returned. Always use the return value.
    """
    if not isinstance(state, ScalingState):
        raise TypeError(f"state must be a fusedfp8.ScalingState; got {type(state).__name__}")
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"recipe must be a fusedfp8.DelayedScaling; got {type(recipe).__name__}")
    state.validate(recipe)
    infos = [io.describe(getattr(state, f), f"state.{f}") for f in STATE_FIELDS]
    devices = {i.device for i in infos}
    if len(devices) != 1:
        raise ValueError(f"state arrays are on several devices ({sorted(devices)}); they must share one")
    for f, i in zip(STATE_FIELDS, infos):
        if not i.contiguous:
            raise ValueError(f"state.{f} must be contiguous; got a non-contiguous view of shape {i.shape}")
    hi = infos[0]
    if not hi.is_gpu:
        new = apply_update(state, recipe)
    else:
        views = [io.device_view(i) for i in infos]
        if hi.framework == "jax":  # jax buffers are immutable: update copies, return a new state
            views = [io.ArrayInfo(c, "cupy", v.device, v.dtype, v.shape, True, int(c.data.ptr))
                     for v in views for c in (v.array.copy(),)]
        fmt_max = _fmt_max_device(state, recipe, hi)
        launch_update_scales(hi.device, io.stream_ptr(hi), **{f: v.ptr for f, v in zip(STATE_FIELDS, views)},
                             fmt_max=io.data_ptr(fmt_max), n=state.num_tensors, L=state.history_len,
                             margin_factor=recipe.margin_factor, algo_max=recipe.amax_compute_algo == "max")
        if hi.framework == "jax":
            new = state.replace(**{f: io.out_for_caller(v.array, hi) for f, v in zip(STATE_FIELDS, views)})
        else:
            new = state
    state.mark_updated()
    return new


def _fmt_max_device(state: ScalingState, recipe: DelayedScaling, like: io.ArrayInfo):
    """(n,) float32 device array of each tensor's format max, cached on the state object."""
    cache = state.__dict__.setdefault("_fmt_max_cache", {})
    key = (recipe.fp8_format, like.device, like.framework)
    if key not in cache:
        arr = io.empty(like, (state.num_tensors,), "float32")
        host = state.fmt_max(recipe)
        if like.framework == "torch":
            import torch

            arr.copy_(torch.from_numpy(host))
        else:
            arr.set(host)
        cache[key] = arr
    return cache[key]

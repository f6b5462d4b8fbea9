"""The framework-agnostic functions: quantize, gelu_quantize, dgelu_quantize, layernorm_quantize,
dequantize, update_scales.

Every function accepts torch tensors, jax arrays, cupy arrays and numpy arrays. Device arrays
run the fused CUDA kernels on the caller's current stream (through the launch interface,
:mod:`fusedfp8.launch`); host arrays run the NumPy reference (:mod:`fusedfp8.numerics.reference`), which is
bit-identical. Results come back in the caller's framework: FP8 data as ``torch.float8_*``
tensors, ``jnp.float8_*`` arrays, ml_dtypes arrays (numpy), or uint8 arrays (cupy, which has no
float8 dtype).

All arguments are checked before anything is launched or written: a rejected call changes no
state (the checks: :mod:`fusedfp8.checks`; the host and device runs of a checked call:
:mod:`fusedfp8.runs`).

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

import numpy as np

from . import _interop as io
from . import launch
from .checks import _check_state_arrays, _LayerNormPlan, _Plan, check_dequantize
from .formats import Format
from .numerics import reference as ref
from .recipe import CurrentScaling, DelayedScaling
from .runs import _device_layernorm, _host_layernorm, _run
from .state import STATE_FIELDS, ScalingState, apply_update
from .types import LayerNormQuantized, Quantized, check_approximate, check_recipe

__all__ = ["quantize", "gelu_quantize", "dgelu_quantize", "layernorm_quantize", "dequantize", "update_scales"]


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
